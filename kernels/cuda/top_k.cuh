// top_k on the GPU, per row of scores [rows][n] (device): the k largest of the row, ties to the
// lower index, written to the row's part of out [rows][k] (device) ascending. A stable descending
// radix sort of (score, index) pairs (CUB) keeps equal scores in index order; the first k indices
// are then sorted ascending. The rows are sorted one after another on the stream, reusing one set
// of scratch buffers (launches, but no synchronize, between rows).
#pragma once

#include "arena.h"
#include "common.cuh"

namespace karakv::kernels::cuda {

KernelStatus launch_top_k(const float* scores, int rows, int n, int k, int32_t* out, Arena& arena,
                          cudaStream_t stream);

}  // namespace karakv::kernels::cuda
