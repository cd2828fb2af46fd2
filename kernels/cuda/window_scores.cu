#include "window_scores.cuh"

#include "cuda_limits.h"
#include "score_common.cuh"

namespace karakv::kernels::cuda {

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
    // Key i's column: the window rows (with later_keys_only the rows before i), each normalised by
    // its given log-sum-exp where that is finite (norm = full), else by its softmax over the window.
    return launch_score_columns<T>(kv, seq, layer, slot_begin, window, q, scale, window, lse, given_lse,
                                   later_keys_only ? ColumnRows::kEarlierRows : ColumnRows::kAll, 0, 1.0f, out, stream,
                                   "window_scores columns");
  });
}

}  // namespace karakv::kernels::cuda
