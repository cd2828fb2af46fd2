#include "read_kv.cuh"

#include "copy_rows.cuh"

namespace karakv::kernels::cuda {
namespace {

// Row r of the dense output ([layer][token][head]) from its slot in the sequence's blocks, K and V.
struct ReadRows {
  static constexpr int kPairs = 2;
  DeviceKV kv;
  int seq, len;
  size_t row_bytes, elem_size;
  char* k;
  char* v;
  __device__ void addresses(int r, const char* (&src)[2], char* (&dst)[2]) const {
    const int head = r % kv.num_kv_heads, rest = r / kv.num_kv_heads;
    const int token = rest % len, layer = rest / len;
    const char* pool = static_cast<const char*>(kv.pool);
    src[0] = pool + kv.token_offset(seq, token, layer, 0, head) * elem_size;
    src[1] = pool + kv.token_offset(seq, token, layer, 1, head) * elem_size;
    dst[0] = k + size_t(r) * row_bytes;
    dst[1] = v + size_t(r) * row_bytes;
  }
};

}  // namespace

KernelStatus launch_read_kv(const DeviceKV& kv, size_t elem_size, int seq, int len, void* k, void* v,
                            cudaStream_t stream) {
  const size_t row_bytes = size_t(kv.head_dim) * elem_size;
  const ReadRows rows{kv, seq, len, row_bytes, elem_size, static_cast<char*>(k), static_cast<char*>(v)};
  return launch_copy_rows(rows, (long long)kv.num_layers * len * kv.num_kv_heads, row_bytes, {kv.pool, k, v}, stream,
                          "read_kv");
}

}  // namespace karakv::kernels::cuda
