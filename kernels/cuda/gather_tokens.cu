#include "gather_tokens.cuh"

namespace karakv::kernels::cuda {
namespace {

// One thread per element of [layer][head][K/V][kept index][head_dim]; the sources are scattered
// rows, the destinations contiguous runs.
template <typename E>
__global__ void gather_kernel(DeviceKV kv, int seq, const int32_t* __restrict__ kept, int num_kept,
                              const int32_t* __restrict__ dst_blocks, long long total) {
  E* pool = static_cast<E*>(kv.pool);
  const int hd = kv.head_dim, hk = kv.num_kv_heads, bs = kv.block_size;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const int d = int(i % hd);
    long long rest = i / hd;
    const int t = int(rest % num_kept);
    rest /= num_kept;
    const int kv_index = int(rest % 2);
    const int row = int(rest / 2);  // layer * hk + head
    const int l = row / hk, h = row % hk;
    const int src_slot = kept[size_t(row) * num_kept + t];
    const size_t src = kv.token_offset(seq, src_slot, l, kv_index, h) + d;
    const size_t dst = kv.run_offset(dst_blocks[t / bs], l, kv_index, h) + size_t(t % bs) * hd + d;
    pool[dst] = pool[src];
  }
}

template <typename E>
KernelStatus launch(const DeviceKV& kv, int seq, const int32_t* kept, int num_kept, const int32_t* dst_blocks,
                    cudaStream_t stream) {
  const long long total = (long long)kv.num_layers * kv.num_kv_heads * 2 * num_kept * kv.head_dim;
  if (total == 0) return KernelStatus::ok();
  gather_kernel<E><<<copy_grid(total), kCopyThreads, 0, stream>>>(kv, seq, kept, num_kept, dst_blocks, total);
  KARAKV_CUDA_CHECK_LAUNCH("gather_tokens");
  return KernelStatus::ok();
}

}  // namespace

KernelStatus launch_gather_tokens(const DeviceKV& kv, size_t elem_size, int seq, const int32_t* kept, int num_kept,
                                  const int32_t* dst_blocks, cudaStream_t stream) {
  if (elem_size == 4) return launch<uint32_t>(kv, seq, kept, num_kept, dst_blocks, stream);
  return launch<uint16_t>(kv, seq, kept, num_kept, dst_blocks, stream);
}

}  // namespace karakv::kernels::cuda
