// CaM over one compaction: per (layer, KV head) row, the kept values are widened to fp32 once,
// every evicted value is merged into the next merge_tokens of them (quant.h's cam_merge, the
// formula of COMPRESSION.md), and the row is written back once, so rounding happens once.
#include "merge.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "../common/checks.h"
#include "../common/validate.h"
#include "karakv/kernels/half.h"
#include "quant.h"

namespace karakv::kernels::cpu {

KernelStatus cam_merge_values(const PagedKV& kv, int seq, int begin, int end, const int32_t* kept, int num_kept,
                              const float* scores, int merge_tokens, const int32_t* dst_blocks,
                              long long pool_blocks) {
  KARAKV_RETURN_IF_ERROR(
      common::validate_cam_merge(kv, seq, begin, end, kept, num_kept, scores, merge_tokens, dst_blocks, pool_blocks));
  const Geometry& g = kv.geometry;
  const int d = g.head_dim, n = end - begin, rows = g.num_layers * g.num_kv_heads;
  KernelStatus failed = KernelStatus::ok();
#pragma omp parallel for schedule(dynamic)
  for (int r = 0; r < rows; ++r) {
    const int l = r / g.num_kv_heads, h = r % g.num_kv_heads;
    const int32_t* row = kept + size_t(r) * num_kept;
    const float* score = scores + size_t(r) * n;
    double total = 0;
    for (int i = 0; i < n; ++i) total += score[i];
    const float mean = float(total / n);
    auto dst_index = [&](int i) {
      return kv.run_offset(dst_blocks[i / g.block_size], l, 1, h) + size_t(i % g.block_size) * d;
    };
    std::vector<float> values(size_t(num_kept) * d), evicted(d);
    for (int i = 0; i < num_kept; ++i)
      for (int c = 0; c < d; ++c) values[size_t(i) * d + c] = load_element(kv.pool, dst_index(i) + c, g.dtype);
    int next = 0;  // first kept index after the evicted slot
    for (int slot = begin; slot < end; ++slot) {
      while (next < num_kept && row[next] <= slot) ++next;
      if (next > 0 && row[next - 1] == slot) continue;  // kept, not evicted
      const int m = std::min(merge_tokens, num_kept - next);
      if (m == 0) continue;
      const size_t src = kv.run_offset(kv.block_of(seq, slot), l, 1, h) + size_t(slot % g.block_size) * d;
      for (int c = 0; c < d; ++c) evicted[c] = load_element(kv.pool, src + c, g.dtype);
      KernelStatus st = cam_merge(evicted.data(), score[slot - begin], mean, merge_tokens,
                                  values.data() + size_t(next) * d, m, d);
      if (!st.is_ok()) {
#pragma omp critical
        failed = st;
      }
    }
    for (int i = 0; i < num_kept; ++i)
      for (int c = 0; c < d; ++c) store_element(kv.pool, dst_index(i) + c, values[size_t(i) * d + c], g.dtype);
  }
  return failed;
}

}  // namespace karakv::kernels::cpu
