// Shared by the CUDA kernels: storage loads and stores per dtype, the paged cache as kernels see it
// on the device, and the rule for checking every CUDA call. Host-side only the backend
// (cuda_backend.cc) includes the kernels' .cuh entry points; nothing here touches gRPC or proto.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "../common/dispatch.h"
#include "karakv/kernels/types.h"

namespace karakv::kernels::cuda {

// The result of a CUDA call as a KernelStatus: kInternal naming the call and CUDA's own words.
inline KernelStatus cuda_status(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return KernelStatus::ok();
  return {KernelStatus::Code::kInternal,
          std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")"};
}

// Returns from the enclosing function (which returns KernelStatus) when a CUDA call fails.
#define KARAKV_CUDA_RETURN_IF_ERROR(call)                                    \
  do {                                                                       \
    const cudaError_t karakv_err_ = (call);                                  \
    if (karakv_err_ != cudaSuccess) return ::karakv::kernels::cuda::cuda_status(karakv_err_, #call); \
  } while (0)

// As KARAKV_CUDA_RETURN_IF_ERROR, the message naming the op the call is part of and what the call
// does: "op: what: cudaErrorX (CUDA's words)".
#define KARAKV_CUDA_RETURN_IF_ERROR_IN(op, what, call)                                     \
  do {                                                                                     \
    const cudaError_t karakv_err_ = (call);                                                \
    if (karakv_err_ != cudaSuccess)                                                        \
      return ::karakv::kernels::cuda::cuda_status(karakv_err_,                             \
                                                  std::string(op) + ": " + std::string(what)); \
  } while (0)

// After a kernel launch: a configuration error (grid, shared memory, no kernel image for this GPU)
// surfaces at cudaGetLastError and is returned naming the kernel, e.g. "launch of write_kv:
// cudaErrorInvalidConfiguration (...)". Execution errors (faults) surface at the stream synchronize
// that ends the backend's call, which names the op (cuda_backend.cu); the backend also puts the op's
// name in front of every error a launcher returns.
#define KARAKV_CUDA_CHECK_LAUNCH(name)                                                     \
  do {                                                                                     \
    const cudaError_t karakv_err_ = cudaGetLastError();                                    \
    if (karakv_err_ != cudaSuccess)                                                        \
      return ::karakv::kernels::cuda::cuda_status(karakv_err_,                             \
                                                  std::string("launch of ") + std::string(name)); \
  } while (0)

// The paged cache with every array in device memory (block_table, table_offset, seq_len uploaded by
// the backend for the call).
struct DeviceKV {
  void* pool = nullptr;
  int num_layers = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0, block_size = 0;
  const int32_t* block_table = nullptr;
  const int32_t* table_offset = nullptr;
  const int32_t* seq_len = nullptr;
  int num_seqs = 0;

  __host__ __device__ int group_size() const { return num_q_heads / num_kv_heads; }
  __host__ __device__ size_t block_elems() const {
    return size_t(num_layers) * 2 * num_kv_heads * block_size * head_dim;
  }
  // Element offset of (block, layer, K=0/V=1, head, slot 0) in the pool, as PagedKV::run_offset.
  __host__ __device__ size_t run_offset(int32_t block, int layer, int kv, int head) const {
    return size_t(block) * block_elems() + ((size_t(layer) * 2 + kv) * num_kv_heads + head) * size_t(block_size) * head_dim;
  }
  // Element offset of token `slot`'s row (head_dim elements) for a sequence whose slice of the
  // block table is `table` (block_table + table_offset[seq]), in run `run` (run_offset(0, layer,
  // kv, head)). A kernel that computes the slice and the run once finds a token one table load away.
  __device__ size_t row_offset(const int32_t* table, int slot, size_t run) const {
    const int b = slot / block_size;
    return size_t(table[b]) * block_elems() + run + size_t(slot - b * block_size) * head_dim;
  }
  // Element offset of token `slot` of sequence `seq` (row of head_dim elements).
  __device__ size_t token_offset(int seq, int slot, int layer, int kv, int head) const {
    return row_offset(block_table + table_offset[seq], slot, run_offset(0, layer, kv, head));
  }
};

// Storage element types.
template <DType D> struct Storage;
template <> struct Storage<DType::kFloat32> { using type = float; };
template <> struct Storage<DType::kFloat16> { using type = __half; };
template <> struct Storage<DType::kBFloat16> { using type = __nv_bfloat16; };
template <DType D> using storage_t = typename Storage<D>::type;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Round to nearest even, as the CPU reference's float_to_half / float_to_bf16.
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// q . k over head_dim with q already in fp32 (shared or global memory) and k in storage.
template <typename T>
__device__ __forceinline__ float dot_row(const float* q, const T* k, int head_dim) {
  float s = 0.0f;
  for (int d = 0; d < head_dim; ++d) s = fmaf(q[d], to_float(k[d]), s);
  return s;
}

inline int ceil_div(long long a, long long b) { return int((a + b - 1) / b); }

// Copy kernels run one thread per element, grid-stride: threads per block, and a grid of at most
// 65535 blocks (the loop covers the rest).
constexpr int kCopyThreads = 256;
inline int copy_grid(long long total) { return int(std::min<long long>(ceil_div(total, kCopyThreads), 65535)); }

// Element i of a dense [layer][token][kv_head][head_dim] tensor (the layout of write_kv's input and
// read_kv's output), split into its coordinates.
struct DenseTokenIndex {
  int layer, token, head, dim;
};
__device__ __forceinline__ DenseTokenIndex split_dense_index(long long i, int num_tokens, int num_kv_heads,
                                                             int head_dim) {
  DenseTokenIndex r;
  r.dim = int(i % head_dim);
  long long rest = i / head_dim;
  r.head = int(rest % num_kv_heads);
  rest /= num_kv_heads;
  r.token = int(rest % num_tokens);
  r.layer = int(rest / num_tokens);
  return r;
}

}  // namespace karakv::kernels::cuda
