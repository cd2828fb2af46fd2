#include "window_scores.cuh"

#include "cuda_limits.h"
#include "score_common.cuh"

namespace karakv::kernels::cuda {
namespace {

// One thread per window key i of KV head h: the sum over the group's heads and the window rows t
// (every row, or with later_keys_only the rows before i) of exp(score - normaliser), the normaliser
// being the row's given log-sum-exp where `given` has a finite one ([window][num_q_heads]: the
// decode step's, norm = full), else the row's log-sum-exp over the window's keys (lse, [heads][window]).
template <typename T>
__global__ void window_columns_kernel(DeviceKV kv, int seq, int layer, int slot_begin, int window,
                                      const float* __restrict__ q, float scale, const float* __restrict__ lse,
                                      const float* __restrict__ given, bool later_keys_only,
                                      float* __restrict__ out) {
  const int h = blockIdx.y;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= window) return;
  const int g = kv.group_size(), hd = kv.head_dim, hq = kv.num_q_heads;
  const T* k = static_cast<const T*>(kv.pool) + kv.token_offset(seq, slot_begin + i, layer, 0, h);
  float sum = 0.0f;
  for (int j = 0; j < g; ++j) {
    const int qh = h * g + j;
    const int rows = later_keys_only ? i : window;
    for (int t = 0; t < rows; ++t) {
      const float* qrow = q + (size_t(t) * hq + qh) * hd;
      float s = 0.0f;
      for (int d = 0; d < hd; ++d) s = fmaf(qrow[d] * scale, to_float(k[d]), s);
      const float g_lse = given != nullptr ? given[size_t(t) * hq + qh] : NAN;
      sum += expf(s - (isfinite(g_lse) ? g_lse : lse[size_t(qh) * window + t]));
    }
  }
  out[size_t(h) * window + i] = sum;
}

}  // namespace

KernelStatus launch_window_scores(const DeviceKV& kv, DType dtype, int seq, int layer, int slot_begin, int window,
                                  const float* q, float scale, float* out, Arena& arena, cudaStream_t stream) {
  return launch_window_scores_observed(kv, dtype, seq, layer, slot_begin, window, q, scale, nullptr, false, out, arena,
                                       stream);
}

KernelStatus launch_window_scores_observed(const DeviceKV& kv, DType dtype, int seq, int layer, int slot_begin,
                                           int window, const float* q, float scale, const float* given_lse,
                                           bool later_keys_only, float* out, Arena& arena, cudaStream_t stream) {
  if (kv.head_dim > kMaxHeadDim)
    return KernelStatus::invalid("cuda window_scores: head_dim " + std::to_string(kv.head_dim) + " exceeds " +
                                 std::to_string(kMaxHeadDim));
  float* lse = nullptr;
  if (auto st = arena.take(size_t(kv.num_q_heads) * window, &lse); !st.is_ok()) return st;
  return common::dispatch_dtype(dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    using T = storage_t<D>;
    row_lse_kernel<T><<<dim3(ceil_div(window, kScoreWarps), kv.num_q_heads), kScoreWarps * 32, 0, stream>>>(
        kv, seq, layer, q, scale, window, slot_begin, window, false, lse);
    KARAKV_CUDA_CHECK_LAUNCH("window_scores rows");
    window_columns_kernel<T><<<dim3(ceil_div(window, 128), kv.num_kv_heads), 128, 0, stream>>>(
        kv, seq, layer, slot_begin, window, q, scale, lse, given_lse, later_keys_only, out);
    KARAKV_CUDA_CHECK_LAUNCH("window_scores columns");
    return KernelStatus::ok();
  });
}

}  // namespace karakv::kernels::cuda
