// CaM's value merging over one compaction on the CPU (Backend::cam_merge_values).
#pragma once

#include <cstdint>

#include "karakv/kernels/types.h"

namespace karakv::kernels::cpu {

KernelStatus cam_merge_values(const PagedKV& kv, int seq, int begin, int end, const int32_t* kept, int num_kept,
                              const float* scores, int merge_tokens, const int32_t* dst_blocks,
                              long long pool_blocks = -1);

}  // namespace karakv::kernels::cpu
