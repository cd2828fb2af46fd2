// The CPU compression kernels of docs/COMPRESSION.md: Kara's window scores and Token2Chunk
// selection, SnapKV scores, top-k and the gather that compacts kept tokens into fresh blocks.
// Each function has the signature of the Backend method of the same name (see backend.h for the
// full contract) plus the pool's size for its checks and, for the scorers, which matrix products
// to use (karakv/kernels/cpu_isa.h: CpuGemm; both are checked against float64 in the tests),
// validates its arguments before touching memory, and runs on the OpenMP threads of the calling
// context.
#pragma once

#include <cstddef>
#include <cstdint>

#include "karakv/kernels/cpu_isa.h"
#include "karakv/kernels/types.h"

namespace karakv::kernels::cpu {

// out[h][i] = sum_j sum_t softmax_row(Qw_j . Kw^T * scale)[t][i] over the window slots
// [slot_begin, slot_begin + window) of `seq` at `layer`, j over the query heads of KV head h.
// Requires 0 <= slot_begin and slot_begin + window <= seq_len[seq], window >= 1.
//   q:   [window][num_q_heads][head_dim] fp32
//   out: [num_kv_heads][window] fp32
KernelStatus window_scores(const PagedKV& kv, int seq, int layer, int slot_begin, int window,
                           const float* q, float scale, float* out, long long pool_blocks = -1,
                           CpuGemm gemm = best_cpu_gemm());

// window_scores with Kara version 2's options (backend.h: window_scores_observed): row t uses
// exp(logit - lse[t][j]) where lse[t][j] is finite, else the window softmax; later_keys_only
// counts only keys after the query (i > t).
//   lse: null or [window][num_q_heads] fp32
KernelStatus window_scores_observed(const PagedKV& kv, int seq, int layer, int slot_begin, int window,
                                    const float* q, float scale, const float* lse, bool later_keys_only, float* out,
                                    long long pool_blocks = -1, CpuGemm gemm = best_cpu_gemm());

// SnapKV scores over all n = seq_len[seq] slots: the mean attention of the last num_obs slots'
// queries (causal inside the observation window) over them and the group's query heads, then an
// average pool of odd width `pool` (zero padding, divisor pool) over the prefix [0, n - num_obs).
// Requires 1 <= num_obs <= n.
//   q:   [num_obs][num_q_heads][head_dim] fp32
//   out: [num_kv_heads][n] fp32
KernelStatus snapkv_scores(const PagedKV& kv, int seq, int layer, int num_obs, const float* q,
                           float scale, int pool, float* out, long long pool_blocks = -1,
                           CpuGemm gemm = best_cpu_gemm());

// How many libxsmm kernel calls the scorers have made in this process (the tests check that
// CpuGemm::kLibxsmm takes that path rather than falling back to the tile).
uint64_t libxsmm_products();

// The tile product alone (for the benchmarks that compare it with the libraries):
// rows[r][s] = query[r] . key[s] for r < num_rows and s < num_keys rounded up to 8, keys as the
// scorers keep them for the tile, [ceil(num_keys / 8)][head_dim][8] fp32 with zero padding.
//   query: [num_rows][head_dim] fp32; rows: [num_rows][row_stride]
void tile_product(const float* query, int num_rows, int head_dim, const float* key_tiles, int num_keys, float* rows,
                  size_t row_stride);

// The selections split their rows over the backend's pool when they hold at least this many scores
// in all: SmolLM2's Kara tick (90 rows of 128) does; a 4-layer, 2-head model's (8 rows) is not worth
// waking the helpers for.
inline constexpr size_t kParallelSelectScores = 8192;
inline bool selection_is_parallel(int rows, int n) {
  return rows > 1 && n > 0 && size_t(rows) * size_t(n) >= kParallelSelectScores;
}

// Per row of n scores, the indices of the k largest (ties: lower index first), written ascending.
// Scores must not be NaN (there is no order to break them by); -0.0 and +0.0 tie. Rows run on
// the calling context's OpenMP threads when there are enough of them.
//   scores: [rows][n] fp32; out: [rows][k] int32
KernelStatus top_k(const float* scores, int rows, int n, int k, int32_t* out);

// Kara's Token2Chunk selection (COMPRESSION.md section 1) per row of n scores: exactly `budget`
// indices, ascending. Requires 0 <= num_candidates <= budget <= n and max_gap >= 0.
//   scores: [rows][n] fp32; out: [rows][budget] int32
KernelStatus token2chunk(const float* scores, int rows, int n, int budget, int num_candidates, int max_gap,
                         int32_t* out);

// For every (layer l, KV head h): K and V of source slot kept[l][h][i] of `seq` are copied byte
// for byte to destination slot i (block dst_blocks[i / block_size], in-block slot
// i % block_size). Slots of the last destination block past num_kept are left as they were.
// Block ids are checked to be >= 0 only: the pool's size is not known here.
//   kept:       [num_layers][num_kv_heads][num_kept] int32, each row strictly ascending
//   dst_blocks: [ceil(num_kept / block_size)] int32, distinct, none of them in seq's table
KernelStatus gather_tokens(const PagedKV& kv, int seq, const int32_t* kept, int num_kept,
                           const int32_t* dst_blocks, long long pool_blocks = -1);

// gather_tokens into seq's own blocks: K and V of slot kept[l][h][i] are copied to slot begin + i,
// in ascending i per (l, h) row (each row strictly ascending within [begin, seq_len), so no slot is
// written before it is read); slots already in place are not copied, other slots not written.
KernelStatus gather_tokens_in_place(const PagedKV& kv, int seq, int begin, const int32_t* kept, int num_kept,
                                    long long pool_blocks = -1);

}  // namespace karakv::kernels::cpu
