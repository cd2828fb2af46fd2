// CaM's value merging over one compaction on the CPU (Backend::cam_merge_values).
#pragma once

#include <cstdint>
#include <string_view>

#include "karakv/kernels/types.h"

namespace karakv::kernels::cpu {

// CaM's scores must be finite wherever they are used: in a (layer, KV head) row with an evicted
// slot before its last kept slot (that slot merges), every score of the row (their mean scales each
// merge). Checked before anything is written; shared by the backends.
KernelStatus check_cam_scores(std::string_view op, const int32_t* kept, int num_kept, const float* scores, int begin,
                              int end, int rows);

KernelStatus cam_merge_values(const PagedKV& kv, int seq, int begin, int end, const int32_t* kept, int num_kept,
                              const float* scores, int merge_tokens, const int32_t* dst_blocks,
                              long long pool_blocks = -1);

}  // namespace karakv::kernels::cpu
