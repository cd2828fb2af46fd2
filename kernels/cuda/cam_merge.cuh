// CaM version 2 on the GPU (Backend::cam_merge_values, the convex normalised merge of backend.h):
// one CTA per (layer, KV head) row. Phase 1, one thread per slot of [begin, end): the weight
// c_e = min(1, a_e / mean(a over T(e))) * a_e / |T(e)| each evicted slot lends its targets (0 for
// kept slots), into a [rows][end - begin] double scratch from the arena. Phase 2, one thread per
// value channel: for each kept token, the evicted slots whose targets include it are gathered in
// ascending slot order, V'_k = (a_k V_k + sum c_e V_e) / (a_k + sum c_e) in double, rounded to fp32
// and written once; a kept token that absorbs nothing is not written. Every operation is the
// reference's (cpu::cam_merge in cpu/quant.h) in the same order with explicitly rounded intrinsics
// (__dadd_rn, __dmul_rn, __ddiv_rn, __fma_rn, no contraction), so the result agrees with the CPU to
// the last bit of fp32. kept, scores, dst_blocks: device.
#pragma once

#include "arena.h"
#include "common.cuh"

namespace karakv::kernels::cuda {

KernelStatus launch_cam_merge(const DeviceKV& kv, DType dtype, int seq, int begin, int end, const int32_t* kept,
                              int num_kept, const float* scores, int merge_tokens, const int32_t* dst_blocks,
                              Arena& arena, cudaStream_t stream);

}  // namespace karakv::kernels::cuda
