// Paged GQA attention on the GPU, for decode (one query row per sequence) and causal attention
// (several query rows of one sequence): row r attends to tokens [0, row_len[r]) of sequence
// `seq` (AttentionRows) at `layer`, fp32 accumulation, softmax(q . k * scale).
//
// Split along the sequence (flash-decoding): a CTA takes one (row, KV head, split) and the query
// heads of the KV head's group (all of a group of up to 4, else chunks of 4), so each K/V element
// is read once per group; token groups of TPT lanes stream 16-byte vectors of a row, two tokens per
// step with both tokens' K and V loads in flight, keep an online softmax each (rescaled once per
// step), and merge in shared memory. A second kernel merges the splits. The split length spreads
// the rows' total length over about four waves of the CTAs the SMs hold at once, so one long
// sequence among short ones, or long contexts with few sequences, still fill the GPU.
#pragma once

#include "arena.h"
#include "common.cuh"
#include "cuda_limits.h"

namespace karakv::kernels::cuda {

struct AttentionRows {
  // -1: row r is sequence r (decode). Else every row is of this sequence (causal attention): from
  // 16 rows on, tiles of rows share their K/V reads through shared memory (a tiled,
  // FlashAttention-style kernel).
  int seq = -1;
  const int32_t* row_len = nullptr;  // device, [num_rows]
  int num_rows = 0;
  int max_len = 0;         // the largest row_len (host-known; bounds the split)
  long long total_len = 0;  // the sum of row_len (host-known; the work the split spreads over the SMs)
};

// q, out: device [num_rows][num_q_heads][head_dim] fp32. lse: null, or device [num_rows][num_q_heads]
// receiving each row's log-sum-exp of the scaled scores (-inf for an empty row), for
// launch_attention_probabilities. An empty row writes zeros to out.
KernelStatus launch_paged_attention(const DeviceKV& kv, DType dtype, int layer, const AttentionRows& rows,
                                    const float* q, float* out, float scale, float* lse, int num_sms, Arena& arena,
                                    cudaStream_t stream);

// H2O's and Kara's accumulation: for sequence s (decode rows, row s = sequence s), KV head h and
// slots t in [first[s], seq_len[s]) (n = seq_len[s] - first[s] of them; none when n <= 0), with
// p_t = sum over the group's query heads j of exp(q_j . k_t * scale - lse[s][j]):
//   acc[s * num_kv_heads + h][t] += p_t             where acc is non-null and that entry too
//                                                   (device accumulators), else
//   probs[prob_offset[s] + h * n + t - first[s]] = p_t   where prob_offset[s] >= 0.
// first, prob_offset: device [num_seqs]; acc: null or device [num_seqs * num_kv_heads] pointers.
KernelStatus launch_attention_probabilities(const DeviceKV& kv, DType dtype, int layer, const float* q, float scale,
                                            const float* lse, const int32_t* first, const int64_t* prob_offset,
                                            float* probs, float* const* acc, cudaStream_t stream);

}  // namespace karakv::kernels::cuda
