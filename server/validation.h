// The request checks every entry point shares (gRPC handlers, the fast-path ring, the core) and the
// one mapping from a kernel's status to absl::Status. Each check lives here once; a refusal names
// the field, the value received and what was expected.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "karakv/kernels/backend.h"

namespace karakv::server {

// KernelStatus -> absl::Status: invalid argument stays INVALID_ARGUMENT, unsupported becomes
// UNIMPLEMENTED, anything else INTERNAL (a kernel fault is never the caller's).
absl::Status to_status(const kernels::KernelStatus& s);

// A geometry the pool and the kernels can serve; names the bad field.
absl::Status validate_geometry(const kernels::Geometry& g);

// "layers=.. q_heads=.. kv_heads=.. head_dim=.. dtype=.. block_size=..", for messages.
std::string geometry_string(const kernels::Geometry& g);

// The geometry a worker sent at Attach against the daemon's. A worker that sends none (layers,
// heads and head_dim all zero) is served the daemon's geometry and learns it from the reply; a
// worker that sends any of them has every field compared (block_size 0: any; the dtype already
// defaulted to the daemon's by the caller when unspecified).
absl::Status check_worker_geometry(const kernels::Geometry& worker, const kernels::Geometry& daemon);

// INVALID_ARGUMENT "<what> has N bytes, expected M (<layout>)". `layout` is only called when the
// size is wrong: this runs on every Step.
template <typename Layout>
absl::Status check_size(const char* what, size_t got, size_t want, Layout&& layout) {
  if (got == want) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, " has ", got, " bytes, expected ", want, " (", layout(), ")"));
}

// layer in [0, num_layers).
absl::Status check_layer(int64_t layer, const kernels::Geometry& g);

// The softmax scale of Step and Attend: 0 means 1/sqrt(head_dim); otherwise a finite positive
// number. NaN, negative and infinite scales are refused.
absl::Status check_scale(float scale);
// The scale the kernels get (after check_scale).
float effective_scale(float scale, int head_dim);

// An output's staging range: `length` bytes where the call writes `want` (exactly, or at least).
absl::Status check_output_range(const char* what, uint64_t length, size_t want, bool exact);

// A Step's batch: at least one sequence id.
absl::Status check_batch(size_t num_sequences);

// A multi-sequence Append (gRPC AppendBatch, the ring's Append command): at least one entry.
absl::Status check_append_batch(size_t num_entries);
// A refused entry of a multi-sequence Append: the entry's own status, its message prefixed with
// which entry it was and that the ones before it were applied. A batch of one is a plain Append:
// its status is returned as is.
absl::Status append_entry_status(const absl::Status& s, size_t index, size_t num_entries, uint64_t sequence_id);

}  // namespace karakv::server
