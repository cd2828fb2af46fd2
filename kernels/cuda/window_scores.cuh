// Kara's bidirectional window scores on the GPU (Backend::window_scores): for KV head h,
// out[h][i] = sum over the group's query heads j and window rows t of softmax_row(Qw_j . Kw^T * scale)[t][i].
// q: device [window][num_q_heads][head_dim] fp32; out: device [num_kv_heads][window].
#pragma once

#include "arena.h"
#include "common.cuh"

namespace karakv::kernels::cuda {

KernelStatus launch_window_scores(const DeviceKV& kv, DType dtype, int seq, int layer, int slot_begin, int window,
                                  const float* q, float scale, float* out, Arena& arena, cudaStream_t stream);

}  // namespace karakv::kernels::cuda
