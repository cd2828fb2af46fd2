#include "gather_tokens.cuh"

#include "copy_rows.cuh"

namespace karakv::kernels::cuda {
namespace {

// Row r = (layer * num_kv_heads + head) * num_kept + i: kept slot kept[r] of that (layer, head) to
// slot i of the destination blocks, K and V. The sources are scattered rows, the destinations
// contiguous runs.
struct GatherRows {
  static constexpr int kPairs = 2;
  DeviceKV kv;
  int seq, num_kept;
  size_t elem_size;
  const int32_t* kept;
  const int32_t* dst_blocks;
  __device__ void addresses(int r, const char* (&src)[2], char* (&dst)[2]) const {
    const int i = r % num_kept, row = r / num_kept;
    const int l = row / kv.num_kv_heads, h = row % kv.num_kv_heads;
    const int bs = kv.block_size;
    char* pool = static_cast<char*>(kv.pool);
    const int32_t slot = kept[r];
    const size_t dst_slot = size_t(i % bs) * kv.head_dim;
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      src[x] = pool + kv.token_offset(seq, slot, l, x, h) * elem_size;
      dst[x] = pool + (kv.run_offset(dst_blocks[i / bs], l, x, h) + dst_slot) * elem_size;
    }
  }
};

}  // namespace

KernelStatus launch_gather_tokens(const DeviceKV& kv, size_t elem_size, int seq, const int32_t* kept, int num_kept,
                                  const int32_t* dst_blocks, cudaStream_t stream) {
  const GatherRows rows{kv, seq, num_kept, elem_size, kept, dst_blocks};
  return launch_copy_rows(rows, (long long)kv.num_layers * kv.num_kv_heads * num_kept,
                          size_t(kv.head_dim) * elem_size, {kv.pool}, stream, "gather_tokens");
}

}  // namespace karakv::kernels::cuda
