// read_kv on the GPU: the first seq_len[seq] tokens of sequence `seq`, every layer, out of the pool
// into dense device K/V ([num_layers][seq_len][num_kv_heads][head_dim]). Bit-exact copy.
#pragma once

#include "common.cuh"

namespace karakv::kernels::cuda {

KernelStatus launch_read_kv(const DeviceKV& kv, size_t elem_size, int seq, int len, void* k, void* v,
                            cudaStream_t stream);

}  // namespace karakv::kernels::cuda
