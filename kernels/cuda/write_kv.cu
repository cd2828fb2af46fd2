#include "write_kv.cuh"

#include "copy_rows.cuh"

namespace karakv::kernels::cuda {
namespace {

// Row r of the dense input ([layer][token][head]) to its slot in the sequence's blocks, K and V.
struct WriteRows {
  static constexpr int kPairs = 2;
  DeviceKV kv;
  int seq, start_pos, num_tokens, layer_begin;
  size_t row_bytes, elem_size;
  const char* k;
  const char* v;
  __device__ void addresses(int r, const char* (&src)[2], char* (&dst)[2]) const {
    const int head = r % kv.num_kv_heads, rest = r / kv.num_kv_heads;
    const int token = rest % num_tokens, layer = layer_begin + rest / num_tokens;
    char* pool = static_cast<char*>(kv.pool);
    src[0] = k + size_t(r) * row_bytes;
    src[1] = v + size_t(r) * row_bytes;
    dst[0] = pool + kv.token_offset(seq, start_pos + token, layer, 0, head) * elem_size;
    dst[1] = pool + kv.token_offset(seq, start_pos + token, layer, 1, head) * elem_size;
  }
};

// Row r of a step's dense input ([seq][head]) to slot positions[seq] of its sequence at `layer`.
struct StepRows {
  static constexpr int kPairs = 2;
  DeviceKV kv;
  int layer;
  const int32_t* positions;
  size_t row_bytes, elem_size;
  const char* k;
  const char* v;
  __device__ void addresses(int r, const char* (&src)[2], char* (&dst)[2]) const {
    const int head = r % kv.num_kv_heads, seq = r / kv.num_kv_heads, pos = positions[seq];
    char* pool = static_cast<char*>(kv.pool);
    src[0] = k + size_t(r) * row_bytes;
    src[1] = v + size_t(r) * row_bytes;
    dst[0] = pool + kv.token_offset(seq, pos, layer, 0, head) * elem_size;
    dst[1] = pool + kv.token_offset(seq, pos, layer, 1, head) * elem_size;
  }
};

}  // namespace

KernelStatus launch_write_step_kv(const DeviceKV& kv, size_t elem_size, int layer, const int32_t* positions,
                                  const void* k, const void* v, cudaStream_t stream) {
  const size_t row_bytes = size_t(kv.head_dim) * elem_size;
  const StepRows rows{kv, layer, positions, row_bytes, elem_size, static_cast<const char*>(k),
                      static_cast<const char*>(v)};
  return launch_copy_rows(rows, (long long)kv.num_seqs * kv.num_kv_heads, row_bytes, {kv.pool, k, v}, stream,
                          "write_step_kv");
}

KernelStatus launch_write_kv(const DeviceKV& kv, size_t elem_size, int seq, int start_pos, int num_tokens,
                             int layer_begin, int num_layers, const void* k, const void* v, cudaStream_t stream) {
  const size_t row_bytes = size_t(kv.head_dim) * elem_size;
  const WriteRows rows{kv, seq, start_pos, num_tokens, layer_begin, row_bytes, elem_size,
                       static_cast<const char*>(k), static_cast<const char*>(v)};
  return launch_copy_rows(rows, (long long)num_layers * num_tokens * kv.num_kv_heads, row_bytes, {kv.pool, k, v},
                          stream, "write_kv");
}

}  // namespace karakv::kernels::cuda
