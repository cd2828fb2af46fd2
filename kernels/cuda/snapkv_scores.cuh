// SnapKV scores on the GPU (Backend::snapkv_scores): the last num_obs slots' queries attend
// causally to all n slots; per key and KV head the mean over the observation queries and the
// group's heads, then the prefix [0, n - num_obs) average-pooled with width `pool` (zero padding,
// divisor pool). q: device [num_obs][num_q_heads][head_dim]; out: device [num_kv_heads][n].
#pragma once

#include "arena.h"
#include "common.cuh"

namespace karakv::kernels::cuda {

KernelStatus launch_snapkv_scores(const DeviceKV& kv, DType dtype, int seq, int layer, int n, int num_obs,
                                  const float* q, float scale, int pool, float* out, Arena& arena,
                                  cudaStream_t stream);

}  // namespace karakv::kernels::cuda
