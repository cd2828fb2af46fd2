#include "write_kv.cuh"

namespace karakv::kernels::cuda {
namespace {

// One thread per element of K (and the same element of V), grid-stride; dense source order, so
// reads are coalesced and each head_dim row lands contiguously in its block.
template <typename E>
__global__ void write_kv_kernel(DeviceKV kv, int seq, int start_pos, int num_tokens, int layer_begin,
                                long long total, const E* __restrict__ k, const E* __restrict__ v) {
  E* pool = static_cast<E*>(kv.pool);
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const DenseTokenIndex x = split_dense_index(i, num_tokens, kv.num_kv_heads, kv.head_dim);
    const int pos = start_pos + x.token, layer = layer_begin + x.layer;
    pool[kv.token_offset(seq, pos, layer, 0, x.head) + x.dim] = k[i];
    pool[kv.token_offset(seq, pos, layer, 1, x.head) + x.dim] = v[i];
  }
}

template <typename E>
KernelStatus launch(const DeviceKV& kv, int seq, int start_pos, int num_tokens, int layer_begin, int num_layers,
                    const void* k, const void* v, cudaStream_t stream) {
  const long long total = (long long)num_layers * num_tokens * kv.num_kv_heads * kv.head_dim;
  if (total == 0) return KernelStatus::ok();
  write_kv_kernel<E><<<copy_grid(total), kCopyThreads, 0, stream>>>(kv, seq, start_pos, num_tokens, layer_begin, total,
                                                      static_cast<const E*>(k), static_cast<const E*>(v));
  KARAKV_CUDA_CHECK_LAUNCH("write_kv");
  return KernelStatus::ok();
}

}  // namespace

KernelStatus launch_write_kv(const DeviceKV& kv, size_t elem_size, int seq, int start_pos, int num_tokens,
                             int layer_begin, int num_layers, const void* k, const void* v, cudaStream_t stream) {
  if (elem_size == 4) return launch<uint32_t>(kv, seq, start_pos, num_tokens, layer_begin, num_layers, k, v, stream);
  return launch<uint16_t>(kv, seq, start_pos, num_tokens, layer_begin, num_layers, k, v, stream);
}

}  // namespace karakv::kernels::cuda
