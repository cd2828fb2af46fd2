// Request checks shared by every entry point, and the kernel status mapping.
#include "server/validation.h"

#include <cmath>

#include "absl/strings/str_format.h"

namespace karakv::server {

absl::Status to_status(const kernels::KernelStatus& s) {
  switch (s.code) {
    case kernels::KernelStatus::Code::kOk:
      return absl::OkStatus();
    case kernels::KernelStatus::Code::kInvalidArgument:
      return absl::InvalidArgumentError(s.message);
    case kernels::KernelStatus::Code::kUnsupported:
      return absl::UnimplementedError(s.message);
    default:
      return absl::InternalError(s.message);
  }
}

std::string geometry_string(const kernels::Geometry& g) {
  return absl::StrFormat("layers=%d q_heads=%d kv_heads=%d head_dim=%d dtype=%s block_size=%d", g.num_layers,
                         g.num_q_heads, g.num_kv_heads, g.head_dim, kernels::dtype_name(g.dtype), g.block_size);
}

absl::Status validate_geometry(const kernels::Geometry& g) {
  auto bad = [](const char* field, int v, const char* want) {
    return absl::InvalidArgumentError(absl::StrCat("geometry ", field, "=", v, " invalid: ", want));
  };
  if (g.num_layers < 1 || g.num_layers > 1024) return bad("num_layers", g.num_layers, "expected 1..1024");
  if (g.num_kv_heads < 1 || g.num_kv_heads > 1024) return bad("num_kv_heads", g.num_kv_heads, "expected 1..1024");
  if (g.num_q_heads < g.num_kv_heads || g.num_q_heads % g.num_kv_heads != 0) {
    return bad("num_q_heads", g.num_q_heads, "expected a multiple of num_kv_heads");
  }
  if (g.head_dim < 1 || g.head_dim > 1024) return bad("head_dim", g.head_dim, "expected 1..1024");
  if (g.block_size < 1 || g.block_size > 4096) return bad("block_size", g.block_size, "expected 1..4096");
  return absl::OkStatus();
}

absl::Status check_worker_geometry(const kernels::Geometry& wg, const kernels::Geometry& g) {
  const bool none_sent = wg.num_layers == 0 && wg.num_q_heads == 0 && wg.num_kv_heads == 0 && wg.head_dim == 0;
  if (none_sent) return absl::OkStatus();
  if (wg.num_layers != g.num_layers || wg.num_q_heads != g.num_q_heads || wg.num_kv_heads != g.num_kv_heads ||
      wg.head_dim != g.head_dim || wg.dtype != g.dtype || (wg.block_size != 0 && wg.block_size != g.block_size)) {
    return absl::InvalidArgumentError(absl::StrCat("worker geometry (", geometry_string(wg),
                                                   ") differs from the daemon's (", geometry_string(g),
                                                   "); send the daemon's geometry, or none to be served it"));
  }
  return absl::OkStatus();
}

absl::Status check_layer(int64_t layer, const kernels::Geometry& g) {
  if (layer >= 0 && layer < g.num_layers) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range, expected 0..", g.num_layers - 1));
}

absl::Status check_scale(float scale) {
  if (scale == 0.0f || (std::isfinite(scale) && scale > 0.0f)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "scale is ", std::isnan(scale) ? std::string("NaN") : absl::StrCat(scale),
      ", expected a finite number > 0 (or 0 for 1/sqrt(head_dim))"));
}

float effective_scale(float scale, int head_dim) {
  return scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

absl::Status check_output_range(const char* what, uint64_t length, size_t want, bool exact) {
  if (exact ? length == want : length >= want) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " staging range has ", length, " bytes, expected ", exact ? "" : "at least ", want));
}

absl::Status check_batch(size_t num_sequences) {
  if (num_sequences > 0) return absl::OkStatus();
  return absl::InvalidArgumentError("sequence_ids is empty, expected >= 1 sequence");
}

absl::Status check_append_batch(size_t num_entries) {
  if (num_entries > 0) return absl::OkStatus();
  return absl::InvalidArgumentError("entries is empty, expected >= 1 Append");
}

absl::Status append_entry_status(const absl::Status& s, size_t index, size_t num_entries, uint64_t sequence_id) {
  if (s.ok() || num_entries <= 1) return s;
  const std::string applied = index == 0   ? std::string("no entry was applied")
                              : index == 1 ? std::string("entry 0 was applied")
                                           : absl::StrCat("entries 0 to ", index - 1, " were applied");
  return absl::Status(s.code(), absl::StrCat("entry ", index, " of ", num_entries, " (sequence ", sequence_id,
                                             "): ", s.message(), "; ", applied, ", none after it"));
}

}  // namespace karakv::server
