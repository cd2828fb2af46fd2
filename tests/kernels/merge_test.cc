// CaM's merge over a compaction (cpu::cam_merge_values) against a float64 loop written from
// COMPRESSION.md: V_k += p * V_e / M for the next M kept tokens after each evicted e,
// p = clamp(a_e / mean(a over the range), 0, 1).
#include "cpu/merge.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "cpu/compress.h"
#include "gtest/gtest.h"

namespace karakv::kernels {
namespace {

TEST(CamMergeValuesTest, MatchesTheFormulaInFloat64) {
  Geometry g;
  g.num_layers = 2;
  g.num_q_heads = 2;
  g.num_kv_heads = 2;
  g.head_dim = 4;
  g.block_size = 4;
  g.dtype = DType::kFloat32;
  for (uint32_t seed = 1; seed <= 30; ++seed) {
    std::mt19937 rng(seed);
    const int begin = 4, end = 16, n = 12, num_kept = 6, merge = 1 + rng() % 4;
    std::vector<float> pool(8 * g.block_elems());
    std::uniform_real_distribution<float> u(-1, 1);
    for (float& x : pool) x = u(rng);
    const int32_t table[] = {5, 3, 1, 4};  // slots 0..15
    const int32_t offsets[] = {0, 4};
    const int32_t lengths[] = {16};
    PagedKV kv;
    kv.pool = pool.data();
    kv.geometry = g;
    kv.block_table = table;
    kv.table_offset = offsets;
    kv.seq_len = lengths;
    kv.num_seqs = 1;
    const int rows = g.num_layers * g.num_kv_heads;
    std::vector<int32_t> kept(size_t(rows) * num_kept);
    std::vector<float> scores(size_t(rows) * n);
    for (int r = 0; r < rows; ++r) {
      std::vector<int32_t> slots(n);
      for (int i = 0; i < n; ++i) slots[i] = begin + i;
      std::shuffle(slots.begin(), slots.end(), rng);
      std::sort(slots.begin(), slots.begin() + num_kept);
      std::copy_n(slots.begin(), num_kept, kept.begin() + r * num_kept);
      for (int i = 0; i < n; ++i) scores[r * n + i] = (rng() % 5 == 0) ? 0.0f : std::abs(u(rng));
    }
    auto v_at = [&](int32_t block, int l, int h, int slot, int c) -> float& {
      return pool[kv.run_offset(block, l, 1, h) + size_t(slot) * g.head_dim + c];
    };
    const int32_t dst[] = {0, 2};
    ASSERT_TRUE(cpu::gather_tokens(kv, 0, kept.data(), num_kept, dst).is_ok());
    // Reference from the pre-merge pool.
    std::vector<double> want(size_t(rows) * num_kept * g.head_dim);
    for (int r = 0; r < rows; ++r) {
      const int l = r / g.num_kv_heads, h = r % g.num_kv_heads;
      const int32_t* row = kept.data() + r * num_kept;
      double mean = 0;
      for (int i = 0; i < n; ++i) mean += scores[r * n + i];
      mean /= n;
      for (int i = 0; i < num_kept; ++i)
        for (int c = 0; c < g.head_dim; ++c)
          want[(size_t(r) * num_kept + i) * g.head_dim + c] = v_at(dst[i / 4], l, h, i % 4, c);
      for (int e = begin; e < end; ++e) {
        if (std::find(row, row + num_kept, e) != row + num_kept) continue;
        const double p = mean > 0 ? std::clamp(scores[r * n + e - begin] / mean, 0.0, 1.0) : 0.0;
        const int next = int(std::upper_bound(row, row + num_kept, e) - row);
        for (int i = next; i < std::min(num_kept, next + merge); ++i)
          for (int c = 0; c < g.head_dim; ++c)
            want[(size_t(r) * num_kept + i) * g.head_dim + c] +=
                p * v_at(table[e / 4], l, h, e % 4, c) / merge;
      }
    }
    ASSERT_TRUE(cpu::cam_merge_values(kv, 0, begin, end, kept.data(), num_kept, scores.data(), merge, dst).is_ok());
    for (int r = 0; r < rows; ++r) {
      const int l = r / g.num_kv_heads, h = r % g.num_kv_heads;
      for (int i = 0; i < num_kept; ++i)
        for (int c = 0; c < g.head_dim; ++c)
          ASSERT_NEAR(v_at(dst[i / 4], l, h, i % 4, c), want[(size_t(r) * num_kept + i) * g.head_dim + c], 1e-6)
              << "seed " << seed << " row " << r << " kept " << i;
    }
  }
}

TEST(CamMergeValuesTest, RefusesBadArguments) {
  Geometry g;
  g.num_layers = 1;
  g.num_q_heads = 1;
  g.num_kv_heads = 1;
  g.head_dim = 4;
  g.block_size = 4;
  g.dtype = DType::kFloat32;
  std::vector<float> pool(4 * g.block_elems());
  const int32_t table[] = {1, 2}, offsets[] = {0, 2}, lengths[] = {8};
  PagedKV kv{pool.data(), g, table, offsets, lengths, 1};
  const int32_t kept[] = {2, 1}, dst[] = {3};
  const float scores[8] = {};
  EXPECT_EQ(cpu::cam_merge_values(kv, 0, 0, 8, kept, 2, scores, 4, dst).code, KernelStatus::Code::kInvalidArgument);
  EXPECT_EQ(cpu::cam_merge_values(kv, 0, 0, 9, kept, 2, scores, 4, dst).code, KernelStatus::Code::kInvalidArgument);
  EXPECT_EQ(cpu::cam_merge_values(kv, 0, 0, 8, kept, 2, scores, 0, dst).code, KernelStatus::Code::kInvalidArgument);
}

}  // namespace
}  // namespace karakv::kernels
