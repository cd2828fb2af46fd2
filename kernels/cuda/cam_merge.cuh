// CaM on the GPU (Backend::cam_merge_values): one CTA per (layer, KV head) row, one thread per
// value channel. Each thread walks the range's slots in order exactly as the CPU reference does,
// widening the kept values to fp32 once, adding weight * V_e of every evicted slot to the next
// merge_tokens kept values with one fused multiply-add each (std::fma in the reference, so the
// arithmetic is the same), and rounding once on the write back. kept, scores, dst_blocks: device; the mean of each row's scores
// is summed in double in slot order, as the reference does.
#pragma once

#include "arena.h"
#include "common.cuh"

namespace karakv::kernels::cuda {

KernelStatus launch_cam_merge(const DeviceKV& kv, DType dtype, int seq, int begin, int end, const int32_t* kept,
                              int num_kept, const float* scores, int merge_tokens, const int32_t* dst_blocks,
                              Arena& arena, cudaStream_t stream);

}  // namespace karakv::kernels::cuda
