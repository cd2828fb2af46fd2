// write_kv on the GPU: tokens [start_pos, start_pos + num_tokens) of sequence `seq`, layers
// [layer_begin, layer_begin + num_layers), from dense device K/V
// ([num_layers][num_tokens][num_kv_heads][head_dim]) into the sequence's blocks. Bit-exact copy.
#pragma once

#include "common.cuh"

namespace karakv::kernels::cuda {

KernelStatus launch_write_kv(const DeviceKV& kv, size_t elem_size, int seq, int start_pos, int num_tokens,
                             int layer_begin, int num_layers, const void* k, const void* v, cudaStream_t stream);

// write_step_kv on the GPU: one token of every sequence s of kv, at slot positions[s] (device
// memory) of `layer`, from dense device K/V ([num_seqs][num_kv_heads][head_dim]). Bit-exact copy.
KernelStatus launch_write_step_kv(const DeviceKV& kv, size_t elem_size, int layer, const int32_t* positions,
                                  const void* k, const void* v, cudaStream_t stream);

}  // namespace karakv::kernels::cuda
