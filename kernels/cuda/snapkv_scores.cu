#include "snapkv_scores.cuh"

#include "cuda_limits.h"
#include "score_common.cuh"

namespace karakv::kernels::cuda {
namespace {

__global__ void snapkv_pool_kernel(int n, int num_obs, int pool, const float* __restrict__ mean, float* __restrict__ out) {
  const int h = blockIdx.y;
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= n) return;
  const int prefix = n - num_obs, half = pool / 2;
  const float* m = mean + size_t(h) * n;
  if (s >= prefix) {
    out[size_t(h) * n + s] = m[s];
    return;
  }
  float sum = 0.0f;
  for (int u = max(0, s - half); u <= min(prefix - 1, s + half); ++u) sum += m[u];
  out[size_t(h) * n + s] = sum / float(pool);
}

}  // namespace

KernelStatus launch_snapkv_scores(const DeviceKV& kv, DType dtype, int seq, int layer, int n, int num_obs,
                                  const float* q, float scale, int pool, float* out, Arena& arena,
                                  cudaStream_t stream) {
  if (kv.head_dim > kMaxHeadDim)
    return KernelStatus::invalid("cuda snapkv_scores: head_dim " + std::to_string(kv.head_dim) + " exceeds " +
                                 std::to_string(kMaxHeadDim));
  float *lse = nullptr, *mean = nullptr;
  if (auto st = arena.take(size_t(kv.num_q_heads) * num_obs, &lse); !st.is_ok()) return st;
  if (auto st = arena.take(size_t(kv.num_kv_heads) * n, &mean); !st.is_ok()) return st;
  return common::dispatch_dtype(dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    using T = storage_t<D>;
    row_lse_kernel<T><<<dim3(ceil_div(num_obs, kScoreWarps), kv.num_q_heads), kScoreWarps * 32, 0, stream>>>(
        kv, seq, layer, q, scale, num_obs, 0, n - num_obs, true, lse);
    KARAKV_CUDA_CHECK_LAUNCH("snapkv_scores rows");
    // mean[h][s]: over the group's heads and the observation rows that see s (row t sees slots
    // 0..prefix + t), divided by num_obs * group as every query counts.
    if (auto st = launch_score_columns<T>(kv, seq, layer, 0, n, q, scale, num_obs, lse, nullptr,
                                          ColumnRows::kCausalPrefix, n - num_obs,
                                          1.0f / float(size_t(num_obs) * kv.group_size()), mean, stream,
                                          "snapkv_scores mean");
        !st.is_ok())
      return st;
    snapkv_pool_kernel<<<dim3(ceil_div(n, 128), kv.num_kv_heads), 128, 0, stream>>>(n, num_obs, pool, mean, out);
    KARAKV_CUDA_CHECK_LAUNCH("snapkv_scores pool");
    return KernelStatus::ok();
  });
}

}  // namespace karakv::kernels::cuda
