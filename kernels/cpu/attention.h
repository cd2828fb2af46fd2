// The CPU attention core: one KV head and the query heads that share it (a GQA group) over a
// sequence's paged K/V. decode_attention and causal_attention are loops of this over
// (sequence or query, KV head).
#pragma once

#include <vector>

#include "karakv/kernels/types.h"

namespace karakv::kernels::cpu {

// Per-thread buffers reused across calls so the hot path never allocates once warm.
struct AttentionScratch {
  std::vector<float> scores;  // [group_size][num_tokens]
  std::vector<float> query;   // [group_size][head_dim], pre-scaled
  std::vector<float> acc;     // [group_size][head_dim]
  std::vector<float> inv_sum; // [group_size]
};

// softmax(q . k * scale) . v for the group_size query heads of KV head `kv_head`, over tokens
// [0, num_tokens) of sequence `seq` at `layer`. Reads every K and V element once for the whole
// group. num_tokens == 0 writes zeros. Arguments are assumed validated by the caller.
//   q:   [group_size][head_dim] fp32
//   out: [group_size][head_dim] fp32
void attend_group(const PagedKV& kv, int seq, int layer, int kv_head, int num_tokens,
                  const float* q, float* out, float scale, AttentionScratch& scratch);

}  // namespace karakv::kernels::cpu
