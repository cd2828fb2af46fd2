// Kara's bidirectional window scores on the GPU (Backend::window_scores): for KV head h,
// out[h][i] = sum over the group's query heads j and window rows t of softmax_row(Qw_j . Kw^T * scale)[t][i].
// q: device [window][num_q_heads][head_dim] fp32; out: device [num_kv_heads][window].
#pragma once

#include "arena.h"
#include "common.cuh"

namespace karakv::kernels::cuda {

KernelStatus launch_window_scores(const DeviceKV& kv, DType dtype, int seq, int layer, int slot_begin, int window,
                                  const float* q, float scale, float* out, Arena& arena, cudaStream_t stream);

// Backend::window_scores_observed: as above, but a row t whose given_lse[t][j] is finite is
// normalised by it (norm = full) instead of by its softmax over the window, and with
// later_keys_only key i sums only the rows t < i. given_lse: null or device [window][num_q_heads].
KernelStatus launch_window_scores_observed(const DeviceKV& kv, DType dtype, int seq, int layer, int slot_begin,
                                           int window, const float* q, float scale, const float* given_lse,
                                           bool later_keys_only, float* out, Arena& arena, cudaStream_t stream);

}  // namespace karakv::kernels::cuda
