// CaM version 2 over one compaction: per (layer, KV head) row, the values of the range's slots are
// widened to fp32 once (kept ones from dst_blocks, where gather_tokens put them; evicted ones from
// the sequence's still intact blocks), quant.h's cam_merge forms the convex normalised merge
//   V'_k = (a_k V_k + sum_{e: k in T(e)} c_e V_e) / (a_k + sum_{e: k in T(e)} c_e),
//   c_e = min(1, a_e / mean(a over T(e))) * a_e / |T(e)|
// (accumulated in double, targets and edge cases documented there and in backend.h), and each kept
// value is written back once, so the stored value is rounded once from fp32.
#include "merge.h"

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "../common/checks.h"
#include "../common/validate.h"
#include "karakv/kernels/half.h"
#include "quant.h"
#include "work_pool.h"

namespace karakv::kernels::cpu {

KernelStatus cam_merge_values(const PagedKV& kv, int seq, int begin, int end, const int32_t* kept, int num_kept,
                              const float* scores, int merge_tokens, const int32_t* dst_blocks,
                              long long pool_blocks) {
  KARAKV_RETURN_IF_ERROR(
      common::validate_cam_merge(kv, seq, begin, end, kept, num_kept, scores, merge_tokens, dst_blocks, pool_blocks));
  const Geometry& g = kv.geometry;
  const int d = g.head_dim, n = end - begin, rows = g.num_layers * g.num_kv_heads;
  // Nothing kept: nothing to write. Nothing evicted: every kept value stays as it is.
  if (num_kept == 0 || num_kept == n) return KernelStatus::ok();
  KernelStatus failed = KernelStatus::ok();
  std::mutex failed_mu;
  parallel_for(rows, 1, [&](int64_t row_begin, int64_t row_end) {
  for (int r = int(row_begin); r < int(row_end); ++r) {
    const int l = r / g.num_kv_heads, h = r % g.num_kv_heads;
    const int32_t* row = kept + size_t(r) * num_kept;
    auto dst_index = [&](int i) {
      return kv.run_offset(dst_blocks[i / g.block_size], l, 1, h) + size_t(i % g.block_size) * d;
    };
    std::vector<int32_t> local(num_kept);  // kept slots relative to begin
    std::vector<float> values(size_t(n) * d), merged(size_t(num_kept) * d);
    int next = 0;
    for (int slot = begin; slot < end; ++slot) {
      float* v = values.data() + size_t(slot - begin) * d;
      if (next < num_kept && row[next] == slot) {
        local[next] = slot - begin;
        const size_t src = dst_index(next++);
        for (int c = 0; c < d; ++c) v[c] = load_element(kv.pool, src + c, g.dtype);
      } else {
        const size_t src = kv.run_offset(kv.block_of(seq, slot), l, 1, h) + size_t(slot % g.block_size) * d;
        for (int c = 0; c < d; ++c) v[c] = load_element(kv.pool, src + c, g.dtype);
      }
    }
    const KernelStatus st = cam_merge(scores + size_t(r) * n, n, local.data(), num_kept, merge_tokens, values.data(),
                                      d, merged.data());
    if (!st.is_ok()) {
      std::lock_guard<std::mutex> lock(failed_mu);
      failed = st;
      continue;
    }
    for (int i = 0; i < num_kept; ++i)
      for (int c = 0; c < d; ++c) store_element(kv.pool, dst_index(i) + c, merged[size_t(i) * d + c], g.dtype);
  }
  });
  return failed;
}

}  // namespace karakv::kernels::cpu
