#include "cam_merge.cuh"

namespace karakv::kernels::cuda {
namespace {

template <typename T>
__global__ void cam_merge_kernel(DeviceKV kv, int seq, int begin, int end, const int32_t* __restrict__ kept,
                                 int num_kept, const float* __restrict__ scores, int merge_tokens,
                                 const int32_t* __restrict__ dst_blocks, float* __restrict__ values) {
  __shared__ float s_mean;
  const int r = blockIdx.x;
  const int hk = kv.num_kv_heads, hd = kv.head_dim, bs = kv.block_size;
  const int l = r / hk, h = r % hk, n = end - begin;
  const int32_t* row = kept + size_t(r) * num_kept;
  const float* score = scores + size_t(r) * n;
  if (threadIdx.x == 0) {
    double total = 0;
    for (int i = 0; i < n; ++i) total += score[i];
    s_mean = float(total / n);
  }
  __syncthreads();
  const float mean = s_mean;
  T* pool = static_cast<T*>(kv.pool);
  float* vals = values + size_t(r) * num_kept * hd;
  for (int c = threadIdx.x; c < hd; c += blockDim.x) {
    for (int i = 0; i < num_kept; ++i)
      vals[size_t(i) * hd + c] = to_float(pool[kv.run_offset(dst_blocks[i / bs], l, 1, h) + size_t(i % bs) * hd + c]);
    int next = 0;
    for (int slot = begin; slot < end; ++slot) {
      while (next < num_kept && row[next] <= slot) ++next;
      if (next > 0 && row[next - 1] == slot) continue;  // kept
      const int m = min(merge_tokens, num_kept - next);
      if (m == 0) continue;
      const float p = mean > 0.0f ? fminf(fmaxf(__fdiv_rn(score[slot - begin], mean), 0.0f), 1.0f) : 0.0f;
      const float weight = __fdiv_rn(p, float(merge_tokens));
      if (weight == 0.0f) continue;
      const float ev = to_float(pool[kv.token_offset(seq, slot, l, 1, h) + c]);
      for (int i = 0; i < m; ++i) {
        float& v = vals[size_t(next + i) * hd + c];
        v = __fmaf_rn(weight, ev, v);
      }
    }
    for (int i = 0; i < num_kept; ++i)
      pool[kv.run_offset(dst_blocks[i / bs], l, 1, h) + size_t(i % bs) * hd + c] = from_float<T>(vals[size_t(i) * hd + c]);
  }
}

}  // namespace

KernelStatus launch_cam_merge(const DeviceKV& kv, DType dtype, int seq, int begin, int end, const int32_t* kept,
                              int num_kept, const float* scores, int merge_tokens, const int32_t* dst_blocks,
                              Arena& arena, cudaStream_t stream) {
  const int rows = kv.num_layers * kv.num_kv_heads;
  if (num_kept == 0 || rows == 0 || end <= begin) return KernelStatus::ok();
  float* values = nullptr;
  if (auto st = arena.take(size_t(rows) * num_kept * kv.head_dim, &values); !st.is_ok()) return st;
  return common::dispatch_dtype(dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    cam_merge_kernel<storage_t<D>><<<rows, std::min(kv.head_dim, 256), 0, stream>>>(
        kv, seq, begin, end, kept, num_kept, scores, merge_tokens, dst_blocks, values);
    KARAKV_CUDA_CHECK_LAUNCH("cam_merge");
    return KernelStatus::ok();
  });
}

}  // namespace karakv::kernels::cuda
