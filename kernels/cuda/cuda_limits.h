// What the CUDA backend's kernels can take, in plain C++ (no CUDA headers), so that code built
// without nvcc can check a geometry against it: the daemon checks its geometry when it picks the
// backend (server/backend_select.cc), before any request, and the backend checks each call.
#pragma once

#include <string>

#include "karakv/kernels/types.h"

namespace karakv::kernels::cuda {

// Largest head_dim the attention and scoring kernels take: they keep a query row per lane group in
// registers or shared memory, sized for at most this many elements.
constexpr int kMaxHeadDim = 256;

// OK when the CUDA backend's kernels can run every op on geometry `g`, else kInvalidArgument whose
// message names the field, its value and the limit ("head_dim 512 exceeds the CUDA backend's limit
// of 256"); callers add the op or the remedy.
inline KernelStatus check_geometry(const Geometry& g) {
  if (g.head_dim > kMaxHeadDim)
    return KernelStatus::invalid("head_dim " + std::to_string(g.head_dim) + " exceeds the CUDA backend's limit of " +
                                 std::to_string(kMaxHeadDim));
  return KernelStatus::ok();
}

}  // namespace karakv::kernels::cuda
