#include "top_k.cuh"

#include <cub/device/device_radix_sort.cuh>

namespace karakv::kernels::cuda {
namespace {

// Keys for the sort: -0.0 becomes +0.0 (the radix order puts -0.0 below +0.0, the reference's
// comparison calls them equal); values are the indices.
__global__ void prepare_kernel(const float* __restrict__ scores, int n, float* __restrict__ keys,
                               int32_t* __restrict__ idx) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float s = scores[i];
  keys[i] = s == 0.0f ? 0.0f : s;
  idx[i] = i;
}

}  // namespace

KernelStatus launch_top_k(const float* scores, int rows, int n, int k, int32_t* out, Arena& arena,
                          cudaStream_t stream) {
  if (k == 0 || rows == 0) return KernelStatus::ok();
  float *keys = nullptr, *keys_sorted = nullptr;
  int32_t *idx = nullptr, *idx_sorted = nullptr;
  if (auto st = arena.take(size_t(n), &keys); !st.is_ok()) return st;
  if (auto st = arena.take(size_t(n), &keys_sorted); !st.is_ok()) return st;
  if (auto st = arena.take(size_t(n), &idx); !st.is_ok()) return st;
  if (auto st = arena.take(size_t(n), &idx_sorted); !st.is_ok()) return st;
  size_t pair_bytes = 0, key_bytes = 0;
  KARAKV_CUDA_RETURN_IF_ERROR(
      cub::DeviceRadixSort::SortPairsDescending(nullptr, pair_bytes, keys, keys_sorted, idx, idx_sorted, n));
  KARAKV_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortKeys(nullptr, key_bytes, idx_sorted, out, k));
  void* temp = nullptr;
  const size_t temp_bytes = std::max(pair_bytes, key_bytes);
  if (auto st = arena.take(temp_bytes, &temp); !st.is_ok()) return st;
  // Stream order makes the scratch free again for the next row.
  for (int r = 0; r < rows; ++r) {
    prepare_kernel<<<ceil_div(n, 256), 256, 0, stream>>>(scores + size_t(r) * n, n, keys, idx);
    KARAKV_CUDA_CHECK_LAUNCH("top_k prepare");
    size_t bytes = temp_bytes;
    KARAKV_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairsDescending(temp, bytes, keys, keys_sorted, idx,
                                                                          idx_sorted, n, 0, 32, stream));
    bytes = temp_bytes;
    KARAKV_CUDA_RETURN_IF_ERROR(
        cub::DeviceRadixSort::SortKeys(temp, bytes, idx_sorted, out + size_t(r) * k, k, 0, 32, stream));
  }
  return KernelStatus::ok();
}

}  // namespace karakv::kernels::cuda
