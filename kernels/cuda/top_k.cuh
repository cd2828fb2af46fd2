// top_k on the GPU: the k largest of scores[0..n) (device), ties to the lower index, written to out
// (device) ascending. A stable descending radix sort of (score, index) pairs (CUB) keeps equal
// scores in index order; the first k indices are then sorted ascending.
#pragma once

#include "arena.h"
#include "common.cuh"

namespace karakv::kernels::cuda {

KernelStatus launch_top_k(const float* scores, int n, int k, int32_t* out, Arena& arena, cudaStream_t stream);

}  // namespace karakv::kernels::cuda
