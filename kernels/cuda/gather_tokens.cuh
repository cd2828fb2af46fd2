// gather_tokens on the GPU: for every (layer, KV head) row, source slot kept[row][i] of sequence
// `seq` goes to slot i of the destination blocks, K and V. Bit-exact copy; kept and dst_blocks in
// device memory, validated by the backend beforehand.
#pragma once

#include "common.cuh"

namespace karakv::kernels::cuda {

KernelStatus launch_gather_tokens(const DeviceKV& kv, size_t elem_size, int seq, const int32_t* kept, int num_kept,
                                  const int32_t* dst_blocks, cudaStream_t stream);

}  // namespace karakv::kernels::cuda
