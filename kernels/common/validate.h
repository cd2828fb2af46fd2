// The argument checks of every op, shared by all backends so that they refuse exactly the same
// calls with the same messages (kInvalidArgument naming the op, the value and what was expected).
// Each reads only host-side tables and runs before any memory is touched, so a refused call
// changes nothing. A call with nothing to do (no tokens, no sequences) passes; the caller then
// returns early. pool_blocks: the blocks in kv.pool when the backend knows them, else -1.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "karakv/kernels/types.h"

namespace karakv::kernels::common {

KernelStatus validate_write_kv(const PagedKV& kv, int seq, int start_pos, int num_tokens, int layer_begin,
                               int num_layers, const void* k, const void* v, long long pool_blocks);
// write_step_kv: every sequence's position covered at `layer` (the message names the sequence).
KernelStatus validate_write_step_kv(const PagedKV& kv, int layer, const int32_t* positions, const void* k,
                                    const void* v, long long pool_blocks);
// decode_attention and decode_attention_accumulate (`op` names which).
KernelStatus validate_decode(std::string_view op, const PagedKV& kv, int layer, const float* q, const float* out,
                             long long pool_blocks);
// The accumulators of decode_attention_accumulate / _observe / _quantized: score_acc non-null,
// and acc_begin null or each acc_begin[s] in [0, slots of s]. After validate_decode.
// Slots of s: seq_len[s] without qkv; with qkv (decode_attention_quantized), its quantized tokens
// and then its seq_len[s] unquantized ones.
KernelStatus validate_accumulators(std::string_view op, const PagedKV& kv, float* const* score_acc,
                                   const int32_t* acc_begin, const QuantizedKV* qkv = nullptr);
// Of validated accumulators: per sequence, the first slot whose probability is wanted, acc_begin[s]
// (0 without acc_begin), or the sequence's slot count when none of its KV heads accumulates
// (nothing wanted).
std::vector<int32_t> first_observed_slots(const PagedKV& kv, float* const* score_acc, const int32_t* acc_begin,
                                          const QuantizedKV* qkv = nullptr);
KernelStatus validate_causal(const PagedKV& kv, int seq, int layer, int num_queries, const float* q,
                             const float* out, long long pool_blocks);
// The rows of causal_attention_quantized (both backends): tables, sequence, layer, 1 <= num_queries
// <= seq_len, and the sequence's tokens covered by its block table. The quantized view is each
// backend's own check.
KernelStatus validate_causal_quantized_rows(const PagedKV& kv, int seq, int layer, int num_queries,
                                            long long pool_blocks);
KernelStatus validate_read_kv(const PagedKV& kv, int seq, const void* k, const void* v, long long pool_blocks);
KernelStatus validate_copy_block(const PagedKV& kv, int32_t src, int32_t dst, long long pool_blocks);
KernelStatus validate_window_scores(const PagedKV& kv, int seq, int layer, int slot_begin, int window, const float* q,
                                    float scale, const float* out, long long pool_blocks);
KernelStatus validate_snapkv_scores(const PagedKV& kv, int seq, int layer, int num_obs, const float* q, float scale,
                                    int pool, const float* out, long long pool_blocks);
KernelStatus validate_top_k(const float* scores, int rows, int n, int k, const int32_t* out);
KernelStatus validate_token2chunk(const float* scores, int rows, int n, int budget, int num_candidates, int max_gap,
                                  const int32_t* out);
KernelStatus validate_gather_tokens(const PagedKV& kv, int seq, const int32_t* kept, int num_kept,
                                    const int32_t* dst_blocks, long long pool_blocks);
KernelStatus validate_gather_tokens_in_place(const PagedKV& kv, int seq, int begin, const int32_t* kept,
                                             int num_kept, long long pool_blocks);
KernelStatus validate_cam_merge(const PagedKV& kv, int seq, int begin, int end, const int32_t* kept, int num_kept,
                                const float* scores, int merge_tokens, const int32_t* dst_blocks,
                                long long pool_blocks);

}  // namespace karakv::kernels::common
