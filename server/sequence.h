// One sequence as the sequence store keeps it: block tables, resident positions, cached queries,
// quantized storage and prompt ids. The record knows no policy: the compactor's binding (policy,
// prefill policy and the policy's own state) hangs off it as an opaque pointer.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "karakv/kernels/backend.h"
#include "server/prefix_cache.h"

namespace karakv::server {

// Read-only input bytes and writable output bytes, already resolved by the transport.
using ConstBytes = absl::Span<const uint8_t>;
using MutableBytes = absl::Span<uint8_t>;

// Defined by the compactor (server/compaction.h); the store only carries it.
struct PolicyBinding;

// The TurboQuant rotation seed every quantized sequence gets (Sequence::qseed).
inline constexpr uint64_t kQuantSeed = 0x6b617261ull;

struct Sequence {
  uint64_t id = 0;
  std::string session_id;
  std::string tenant;
  // "kara" or "kara+kivi4": what stats and metrics group by.
  std::string label;
  std::shared_ptr<PolicyBinding> policy;
  int32_t priority = 0;
  std::vector<int32_t> blocks;  // the block table
  int32_t length = 0;           // resident (committed) tokens
  int32_t logical = 0;          // tokens ever appended: the next token's position
  int32_t pending_layer = -1;   // next layer of a half-stepped token, -1 when none
  bool decoding = false;        // a Step has run: the prompt is fixed
  int32_t prompt = 0;
  // Positions: slots [0, explicit_end) have explicit positions per (layer, head); slots from
  // explicit_end on are contiguous, ending at logical - 1.
  int32_t explicit_end = 0;
  std::vector<std::vector<int32_t>> explicit_pos;  // [L * Hk][explicit_end]
  // Query cache for slots [q_first, q_first + q_count): [q_count][L][Hq][D] fp32.
  std::vector<float> queries;
  int32_t q_first = 0, q_count = 0;
  int32_t compactions = 0;
  uint64_t last_used = 0;  // the core's use clock at its last Append or Step (preemption's tie-break)
  // Metrics only: when the first Append arrived (cleared once the first decode step completes)
  // and when the current step's layer-0 Step began.
  std::optional<std::chrono::steady_clock::time_point> first_append;
  std::chrono::steady_clock::time_point step_started;
  // Quantized storage: the oldest quantized() slots live in qblocks, tokens_per_qblock each;
  // the block table `blocks` holds the rest (slot quantized() is its slot 0).
  bool quantize = false;
  kernels::QuantFormat format = kernels::QuantFormat::kKivi4;
  std::string storage;
  int32_t tokens_per_qblock = 0;
  int32_t residual = 128;
  uint64_t qseed = 0;  // TurboQuant's rotations: kernels::head_seed(qseed, layer, head)
  std::vector<int32_t> qblocks;
  // Prefix cache: the prompt's token ids while every prompt token came with one, the keys of its
  // full blocks, and whether it still publishes (no prefill policy, never compacted).
  std::string cache_namespace;
  bool publish = false;
  bool share_tier = false;  // its published blocks go to the prefix tier (its session gave a model fingerprint)
  std::vector<int32_t> prompt_ids;
  std::vector<PrefixKey> prompt_keys;
  // Leading tokens, whole blocks, that the sequence shares with others: the blocks it adopted from the
  // prefix cache, or the prompt it had when it was forked before decoding. Kara's `prompt = auto`
  // keeps them and windows the rest of the prompt.
  int32_t shared_prefix = 0;

  int32_t quantized() const { return static_cast<int32_t>(qblocks.size()) * tokens_per_qblock; }
  int32_t fp_length() const { return length - quantized(); }
  int32_t position(int lh, int32_t slot) const {
    return slot < explicit_end ? explicit_pos[lh][slot] : slot + (logical - length);
  }
};

}  // namespace karakv::server
