// The small model geometry the server's unit tests run on: 2 layers, 4 query heads over 2 KV heads
// (GQA group 2), with the head dimension, block size and storage dtype a test needs.
#pragma once

#include "karakv/kernels/types.h"

namespace karakv::server::testing {

inline kernels::Geometry small_test_geometry(kernels::DType dtype, int head_dim = 8, int block_size = 4) {
  kernels::Geometry g;
  g.num_layers = 2;
  g.num_q_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = head_dim;
  g.block_size = block_size;
  g.dtype = dtype;
  return g;
}

}  // namespace karakv::server::testing
