// Argument checks of the paged cache shared by every backend: each returns kInvalidArgument with a
// message that names the op, the bad value and the allowed range, before any memory is touched.
#pragma once

#include <string>
#include <string_view>

#include "karakv/kernels/types.h"

namespace karakv::kernels::common {

#define KARAKV_RETURN_IF_ERROR(expr)      \
  do {                                    \
    KernelStatus status_ = (expr);        \
    if (!status_.is_ok()) return status_; \
  } while (0)

// "op: what value out of range [lo, hi)"
std::string out_of_range(std::string_view op, std::string_view what, long long value, long long lo, long long hi);
// Pool pointer, geometry values and dtype.
KernelStatus check_geometry(std::string_view op, const PagedKV& kv);
// check_geometry plus the per-sequence arrays.
KernelStatus check_tables(std::string_view op, const PagedKV& kv);
KernelStatus check_seq_index(std::string_view op, const PagedKV& kv, int seq);
KernelStatus check_layer(std::string_view op, const PagedKV& kv, int layer);
// Tokens [begin, end) of `seq` must be covered by its block table, with block ids inside the pool
// (pool_blocks < 0: pool size unknown, only the lower bound is checked).
KernelStatus check_covered(std::string_view op, const PagedKV& kv, int seq, long long begin, long long end,
                           long long pool_blocks = -1);

}  // namespace karakv::kernels::common
