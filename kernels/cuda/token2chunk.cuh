// Kara's Token2Chunk selection on the GPU (Backend::token2chunk) over `rows` windows of n scores
// each (device, [rows][n]): candidates by rank (score descending, ties to the lower index), chunks
// between consecutive candidates ranked the same way by their smaller end score and taken greedily
// while they fit, then the best remaining tokens up to `budget`; out (device, [rows][budget])
// ascending per row. One CTA per row: ranks are counted in parallel, the greedy pass (inherently
// in order) runs on one thread over at most num_candidates chunks.
#pragma once

#include "arena.h"
#include "common.cuh"

namespace karakv::kernels::cuda {

KernelStatus launch_token2chunk(const float* scores, int rows, int n, int budget, int num_candidates, int max_gap,
                                int32_t* out, Arena& arena, cudaStream_t stream);

}  // namespace karakv::kernels::cuda
