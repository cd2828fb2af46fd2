// Conversions between the wire Geometry (karakv.v1) and the kernels' Geometry, shared by the
// daemon and the SDK so both read the protocol the same way.
#pragma once

#include "karakv/kernels/types.h"
#include "karakv/v1/karakv.pb.h"

namespace karakv::v1 {

inline kernels::Geometry from_proto(const Geometry& g) {
  kernels::Geometry out;
  out.num_layers = g.num_layers();
  out.num_q_heads = g.num_q_heads();
  out.num_kv_heads = g.num_kv_heads();
  out.head_dim = g.head_dim();
  out.block_size = g.block_size();
  out.dtype = g.dtype() == DTYPE_FP32   ? kernels::DType::kFloat32
              : g.dtype() == DTYPE_BF16 ? kernels::DType::kBFloat16
                                        : kernels::DType::kFloat16;
  return out;
}

inline Geometry to_proto(const kernels::Geometry& g) {
  Geometry out;
  out.set_num_layers(g.num_layers);
  out.set_num_q_heads(g.num_q_heads);
  out.set_num_kv_heads(g.num_kv_heads);
  out.set_head_dim(g.head_dim);
  out.set_block_size(g.block_size);
  out.set_dtype(g.dtype == kernels::DType::kFloat32   ? DTYPE_FP32
                : g.dtype == kernels::DType::kBFloat16 ? DTYPE_BF16
                                                       : DTYPE_FP16);
  return out;
}

}  // namespace karakv::v1
