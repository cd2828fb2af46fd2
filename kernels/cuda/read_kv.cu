#include "read_kv.cuh"

namespace karakv::kernels::cuda {
namespace {

// One thread per element, grid-stride, in dense destination order (coalesced writes).
template <typename E>
__global__ void read_kv_kernel(DeviceKV kv, int seq, int len, long long total, E* __restrict__ k, E* __restrict__ v) {
  const E* pool = static_cast<const E*>(kv.pool);
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const DenseTokenIndex x = split_dense_index(i, len, kv.num_kv_heads, kv.head_dim);
    k[i] = pool[kv.token_offset(seq, x.token, x.layer, 0, x.head) + x.dim];
    v[i] = pool[kv.token_offset(seq, x.token, x.layer, 1, x.head) + x.dim];
  }
}

template <typename E>
KernelStatus launch(const DeviceKV& kv, int seq, int len, void* k, void* v, cudaStream_t stream) {
  const long long total = (long long)kv.num_layers * len * kv.num_kv_heads * kv.head_dim;
  if (total == 0) return KernelStatus::ok();
  read_kv_kernel<E><<<copy_grid(total), kCopyThreads, 0, stream>>>(kv, seq, len, total, static_cast<E*>(k), static_cast<E*>(v));
  KARAKV_CUDA_CHECK_LAUNCH("read_kv");
  return KernelStatus::ok();
}

}  // namespace

KernelStatus launch_read_kv(const DeviceKV& kv, size_t elem_size, int seq, int len, void* k, void* v,
                            cudaStream_t stream) {
  if (elem_size == 4) return launch<uint32_t>(kv, seq, len, k, v, stream);
  return launch<uint16_t>(kv, seq, len, k, v, stream);
}

}  // namespace karakv::kernels::cuda
