#include <cfloat>

#include "cam_merge.cuh"

namespace karakv::kernels::cuda {
namespace {

// a of a slot, as cpu::cam_merge reads it: negative, NaN and infinite scores are 0.
__device__ __forceinline__ double cam_score(float x) { return x > 0.0f && x <= FLT_MAX ? double(x) : 0.0; }

// c_e of evicted slot `slot` of `row` (0 for a kept slot): the weight it lends each of its targets.
__device__ double cam_weight(int slot, int begin, const int32_t* __restrict__ row, int num_kept,
                             const float* __restrict__ score, int merge_tokens) {
  int lo = 0, hi = num_kept;  // next = the first kept index with row[next] > slot
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (row[mid] <= slot) lo = mid + 1; else hi = mid;
  }
  const int next = lo, width = min(merge_tokens, num_kept);
  if (next > 0 && row[next - 1] == slot) return 0.0;  // kept
  const int first = next < num_kept ? next : num_kept - width;
  const int count = next < num_kept ? min(merge_tokens, num_kept - next) : width;
  double sum = 0.0;
  for (int j = first; j < first + count; ++j) sum = __dadd_rn(sum, cam_score(score[row[j] - begin]));
  const double mean = __ddiv_rn(sum, double(count)), a_e = cam_score(score[slot - begin]);
  const double p = mean > 0.0 ? fmin(1.0, __ddiv_rn(a_e, mean)) : (a_e > 0.0 ? 1.0 : 0.0);
  return __ddiv_rn(__dmul_rn(p, a_e), double(count));
}

template <typename T>
__global__ void cam_merge_kernel(DeviceKV kv, int seq, int begin, int end, const int32_t* __restrict__ kept,
                                 int num_kept, const float* __restrict__ scores, int merge_tokens,
                                 const int32_t* __restrict__ dst_blocks, double* __restrict__ weights) {
  const int r = blockIdx.x;
  const int hk = kv.num_kv_heads, hd = kv.head_dim, bs = kv.block_size;
  const int l = r / hk, h = r % hk, n = end - begin;
  const int32_t* row = kept + size_t(r) * num_kept;
  const float* score = scores + size_t(r) * n;
  double* weight = weights + size_t(r) * n;
  // Phase 1: c_e of every slot of the row, one slot per thread.
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    weight[i] = cam_weight(begin + i, begin, row, num_kept, score, merge_tokens);
  __syncthreads();
  // Phase 2: one thread per channel gathers, for each kept index i, the evicted slots whose targets
  // include i, in ascending slot order (the order in which the reference scatters them):
  //   following ones: next(e) in [lo, i], lo = max(0, i - M + 1), i.e. the slots strictly between
  //     row[lo - 1] (or begin - 1) and row[i] (kept ones there have weight 0);
  //   when i is among the last min(M, num_kept), every slot after the row's last kept one.
  T* pool = static_cast<T*>(kv.pool);
  const int width = min(merge_tokens, num_kept);
  for (int c = threadIdx.x; c < hd; c += blockDim.x) {
    for (int i = 0; i < num_kept; ++i) {
      const size_t dst = kv.run_offset(dst_blocks[i / bs], l, 1, h) + size_t(i % bs) * hd + c;
      const double a_k = cam_score(score[row[i] - begin]);
      double num = __dmul_rn(a_k, double(to_float(pool[dst]))), absorbed = 0.0;
      auto absorb = [&](int slot) {
        const double w = weight[slot - begin];
        if (w == 0.0) return;
        absorbed = __dadd_rn(absorbed, w);
        num = __fma_rn(w, double(to_float(pool[kv.token_offset(seq, slot, l, 1, h) + c])), num);
      };
      const int lo = max(0, i - merge_tokens + 1);
      for (int slot = lo == 0 ? begin : row[lo - 1] + 1; slot < row[i]; ++slot) absorb(slot);
      if (i >= num_kept - width)
        for (int slot = row[num_kept - 1] + 1; slot < end; ++slot) absorb(slot);
      // Nothing absorbed (also a zero denominator): V_k stays as it is, as in the reference.
      if (absorbed != 0.0)
        pool[dst] = from_float<T>(__double2float_rn(__ddiv_rn(num, __dadd_rn(a_k, absorbed))));
    }
  }
}

}  // namespace

KernelStatus launch_cam_merge(const DeviceKV& kv, DType dtype, int seq, int begin, int end, const int32_t* kept,
                              int num_kept, const float* scores, int merge_tokens, const int32_t* dst_blocks,
                              Arena& arena, cudaStream_t stream) {
  const int rows = kv.num_layers * kv.num_kv_heads, n = end - begin;
  // Nothing kept: nothing to write. Nothing evicted: every kept value stays as it is.
  if (num_kept == 0 || rows == 0 || n <= 0 || num_kept == n) return KernelStatus::ok();
  double* weights = nullptr;
  if (auto st = arena.take(size_t(rows) * n, &weights); !st.is_ok()) return st;
  return common::dispatch_dtype(dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    cam_merge_kernel<storage_t<D>><<<rows, std::min(kv.head_dim, 256), 0, stream>>>(
        kv, seq, begin, end, kept, num_kept, scores, merge_tokens, dst_blocks, weights);
    KARAKV_CUDA_CHECK_LAUNCH("cam_merge");
    return KernelStatus::ok();
  });
}

}  // namespace karakv::kernels::cuda
