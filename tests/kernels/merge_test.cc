// CaM version 2 over a compaction (cpu::cam_merge_values) against a float64 loop written from the
// contract text (backend.h): each evicted e merges into its targets T(e), the next M kept tokens
// after it (fewer where fewer exist; the last min(M, kept) of the row when none follow), with
// p_e = min(1, a_e / mean(a_k over T(e))) (p_e = 1 if that mean is 0 and a_e > 0), w = 1/|T(e)|,
//   V'_k = (a_k V_k + sum_{e: k in T(e)} w p_e a_e V_e) / (a_k + sum_{e: k in T(e)} w p_e a_e),
// V_k unchanged where the denominator is 0; negative and non-finite scores read as 0.
#include "cpu/merge.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cpu/compress.h"
#include "gtest/gtest.h"
#include "karakv/kernels/half.h"

namespace karakv::kernels {
namespace {

// One sequence of 16 slots in blocks {5, 3, 1, 4} of an 8-block pool; blocks 0 and 2 are free
// destinations for up to 8 kept tokens. Rows are (layer, KV head) pairs: 2 x 2.
struct Cache {
  static constexpr int kBegin = 4, kEnd = 16, kN = kEnd - kBegin, kMaxKept = 8;
  Geometry g;
  std::vector<uint8_t> pool;
  const int32_t table[4] = {5, 3, 1, 4};
  const int32_t offsets[2] = {0, 4};
  const int32_t lengths[1] = {16};
  const int32_t dst[2] = {0, 2};

  explicit Cache(DType dtype) {
    g.num_layers = 2;
    g.num_q_heads = 2;
    g.num_kv_heads = 2;
    g.head_dim = 4;
    g.block_size = 4;
    g.dtype = dtype;
    pool.assign(8 * g.block_bytes(), 0);
  }
  int rows() const { return g.num_layers * g.num_kv_heads; }
  PagedKV view() { return PagedKV{pool.data(), g, table, offsets, lengths, 1}; }
  size_t elems() const { return pool.size() / dtype_size(g.dtype); }
  float at(size_t i) const { return load_element(pool.data(), i, g.dtype); }
  void set(size_t i, float v) { store_element(pool.data(), i, v, g.dtype); }
  // Element c of the value of sequence slot `slot` of row r, and of kept token i in dst_blocks.
  size_t source_index(int r, int slot, int c) {
    return view().run_offset(table[slot / 4], r / g.num_kv_heads, 1, r % g.num_kv_heads) + size_t(slot % 4) * 4 + c;
  }
  size_t dst_index(int r, int i, int c) {
    return view().run_offset(dst[i / 4], r / g.num_kv_heads, 1, r % g.num_kv_heads) + size_t(i % 4) * 4 + c;
  }
};

double score_of(float s) { return std::isfinite(s) && s > 0 ? double(s) : 0.0; }

// T(e) as indices into the row's kept list (slots ascending), straight from the contract text.
std::vector<int> targets(const std::vector<int32_t>& kept_slots, int e, int M) {
  std::vector<int> t;
  for (int i = 0; i < int(kept_slots.size()) && int(t.size()) < M; ++i)
    if (kept_slots[i] > e) t.push_back(i);
  if (t.empty())  // none follow: the nearest kept tokens before e
    for (int i = std::max(0, int(kept_slots.size()) - M); i < int(kept_slots.size()); ++i) t.push_back(i);
  return t;
}

// V'_k of every kept token of one row: [num_kept][d]. a: score per slot of the range (raw);
// value(slot, c): the pre-merge value.
template <typename Value>
std::vector<double> reference_row(const std::vector<int32_t>& kept_slots, const float* raw_scores, int begin, int end,
                                  int M, int d, Value value) {
  const int K = int(kept_slots.size());
  auto a = [&](int slot) { return score_of(raw_scores[slot - begin]); };
  std::vector<double> num(size_t(K) * d), den(K);
  for (int i = 0; i < K; ++i) {
    den[i] = a(kept_slots[i]);
    for (int c = 0; c < d; ++c) num[size_t(i) * d + c] = den[i] * value(kept_slots[i], c);
  }
  for (int e = begin; e < end; ++e) {
    if (std::find(kept_slots.begin(), kept_slots.end(), e) != kept_slots.end()) continue;
    const std::vector<int> t = targets(kept_slots, e, M);
    if (t.empty()) continue;
    double mean = 0;
    for (int i : t) mean += a(kept_slots[i]);
    mean /= double(t.size());
    const double a_e = a(e);
    const double p = mean > 0 ? std::min(1.0, a_e / mean) : (a_e > 0 ? 1.0 : 0.0);
    const double w = 1.0 / double(t.size());
    for (int i : t) {
      den[i] += w * p * a_e;
      for (int c = 0; c < d; ++c) num[size_t(i) * d + c] += w * p * a_e * value(e, c);
    }
  }
  std::vector<double> out(size_t(K) * d);
  for (int i = 0; i < K; ++i)
    for (int c = 0; c < d; ++c)
      out[size_t(i) * d + c] = den[i] > 0 ? num[size_t(i) * d + c] / den[i] : value(kept_slots[i], c);
  return out;
}

enum class ScoreMode { kRandomWithZeros, kKeptZero, kAllZero, kEvictedZero };
enum class KeptMode { kRandom, kPrefix, kSuffix };

// Random values and kept lists, gather, merge; checks every kept value against reference_row
// (within the storage type's rounding) and that nothing else in the pool moved (keys included).
void check_against_reference(DType dtype, uint32_t seed, int num_kept, int M, KeptMode kept_mode,
                             ScoreMode score_mode) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " kept " + std::to_string(num_kept) + " M " + std::to_string(M) +
               " kept_mode " + std::to_string(int(kept_mode)) + " score_mode " + std::to_string(int(score_mode)) +
               " dtype " + dtype_name(dtype));
  Cache cache(dtype);
  const int begin = Cache::kBegin, end = Cache::kEnd, n = Cache::kN, d = cache.g.head_dim, rows = cache.rows();
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  for (size_t i = 0; i < cache.elems(); ++i) cache.set(i, u(rng));
  std::vector<int32_t> kept(size_t(rows) * num_kept);
  std::vector<float> scores(size_t(rows) * n);
  for (int r = 0; r < rows; ++r) {
    std::vector<int32_t> slots(n);
    for (int i = 0; i < n; ++i) slots[i] = begin + i;
    // Row 0 keeps the range's first (kPrefix: every evicted token follows the last kept one) or
    // last slots; the others are random.
    if (kept_mode == KeptMode::kRandom || r > 0) std::shuffle(slots.begin(), slots.end(), rng);
    else if (kept_mode == KeptMode::kSuffix) std::reverse(slots.begin(), slots.end());
    std::sort(slots.begin(), slots.begin() + num_kept);
    std::copy_n(slots.begin(), num_kept, kept.begin() + size_t(r) * num_kept);
    for (int i = 0; i < n; ++i) {
      const bool is_kept = std::find(slots.begin(), slots.begin() + num_kept, begin + i) != slots.begin() + num_kept;
      float s = (rng() % 5 == 0) ? 0.0f : std::abs(u(rng));
      if (score_mode == ScoreMode::kAllZero || (score_mode == ScoreMode::kKeptZero && is_kept) ||
          (score_mode == ScoreMode::kEvictedZero && !is_kept))
        s = 0.0f;
      scores[size_t(r) * n + i] = s;
    }
  }
  PagedKV kv = cache.view();
  ASSERT_TRUE(cpu::gather_tokens(kv, 0, kept.data(), num_kept, cache.dst).is_ok());
  const std::vector<uint8_t> before = cache.pool;
  auto pre_value = [&](size_t i) { return double(load_element(before.data(), i, dtype)); };
  std::vector<std::vector<double>> want(rows);
  for (int r = 0; r < rows; ++r) {
    const std::vector<int32_t> row(kept.begin() + size_t(r) * num_kept, kept.begin() + size_t(r + 1) * num_kept);
    want[r] = reference_row(row, scores.data() + size_t(r) * n, begin, end, M, d,
                            [&](int slot, int c) { return pre_value(cache.source_index(r, slot, c)); });
  }
  ASSERT_TRUE(cpu::cam_merge_values(kv, 0, begin, end, kept.data(), num_kept, scores.data(), M, cache.dst).is_ok());
  // Expected pool: the pre-merge one with the kept values replaced.
  std::vector<double> expect(cache.elems()), tol(cache.elems(), 0.0);
  for (size_t i = 0; i < expect.size(); ++i) expect[i] = pre_value(i);
  const double rel = dtype == DType::kFloat32 ? 1e-6 : dtype == DType::kFloat16 ? 1.0 / 1024 : 1.0 / 128;
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < num_kept; ++i)
      for (int c = 0; c < d; ++c) {
        const size_t idx = cache.dst_index(r, i, c);
        expect[idx] = want[r][size_t(i) * d + c];
        tol[idx] = rel * std::max(1e-3, std::fabs(expect[idx]));
      }
  for (size_t i = 0; i < expect.size(); ++i) {
    if (tol[i] == 0.0) {
      ASSERT_EQ(cache.at(i), float(expect[i])) << "element " << i << " outside the kept values moved";
    } else {
      ASSERT_NEAR(cache.at(i), expect[i], tol[i]) << "element " << i;
    }
  }
}

TEST(CamMergeValuesTest, MatchesTheContractInFloat64) {
  uint32_t seed = 1;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16})
    for (int num_kept : {1, 3, 6, 8})
      for (int M : {1, 2, 3, 4, 7, 9, 50})  // 7, 9 and 50 exceed some or all kept counts
        for (KeptMode km : {KeptMode::kRandom, KeptMode::kPrefix, KeptMode::kSuffix})
          for (ScoreMode sm : {ScoreMode::kRandomWithZeros, ScoreMode::kKeptZero, ScoreMode::kAllZero,
                               ScoreMode::kEvictedZero}) {
            if (dtype != DType::kFloat32 && sm != ScoreMode::kRandomWithZeros) continue;
            check_against_reference(dtype, seed++, num_kept, M, km, sm);
            if (HasFatalFailure()) return;
          }
}

// Where no kept token follows an evicted one, it merges into the nearest kept tokens before it:
// kept slots {4, 5} of [4, 8), M = 1: slots 6 and 7 both merge into slot 5 only.
TEST(CamMergeValuesTest, EvictedAfterTheLastKeptMergeBackwards) {
  Cache cache(DType::kFloat32);
  const int d = cache.g.head_dim;
  PagedKV kv = cache.view();
  for (int r = 0; r < cache.rows(); ++r)
    for (int slot = 4; slot < 8; ++slot)
      for (int c = 0; c < d; ++c) cache.set(cache.source_index(r, slot, c), float(slot));
  std::vector<int32_t> k;
  for (int r = 0; r < cache.rows(); ++r) k.insert(k.end(), {4, 5});
  // a = (1, 1, 1, 3): T(6) = T(7) = {5}; p_6 = 1, p_7 = min(1, 3/1) = 1; slot 5 becomes
  // (1*5 + 1*6 + 3*7) / (1 + 1 + 3) = 32/5; slot 4 absorbs nothing and stays 4.
  std::vector<float> scores(size_t(cache.rows()) * 4);
  const float row_scores[4] = {1, 1, 1, 3};
  for (int r = 0; r < cache.rows(); ++r) std::copy_n(row_scores, 4, scores.begin() + 4 * r);
  ASSERT_TRUE(cpu::gather_tokens(kv, 0, k.data(), 2, cache.dst).is_ok());
  ASSERT_TRUE(cpu::cam_merge_values(kv, 0, 4, 8, k.data(), 2, scores.data(), 1, cache.dst).is_ok());
  for (int r = 0; r < cache.rows(); ++r)
    for (int c = 0; c < d; ++c) {
      EXPECT_EQ(cache.at(cache.dst_index(r, 0, c)), 4.0f);
      EXPECT_FLOAT_EQ(cache.at(cache.dst_index(r, 1, c)), 32.0f / 5.0f);
    }
}

// ||V'_k|| <= max(||V_k||, ||V_e|| for e with k in T(e)): the merge is a convex combination. Values
// of widely different norms and scores over twelve orders of magnitude (zeros included).
TEST(CamMergeValuesTest, MergedNormNeverExceedsTheLargestInputNorm) {
  const int begin = Cache::kBegin, end = Cache::kEnd, n = Cache::kN;
  for (uint32_t seed = 1; seed <= 200; ++seed) {
    Cache cache(DType::kFloat32);
    const int d = cache.g.head_dim, rows = cache.rows();
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1, 1), exponent(-6, 6);
    for (int r = 0; r < rows; ++r)
      for (int slot = 0; slot < 16; ++slot) {
        const float scale = std::pow(10.0f, exponent(rng) / 3);
        for (int c = 0; c < d; ++c) cache.set(cache.source_index(r, slot, c), scale * u(rng));
      }
    const int num_kept = 1 + int(rng() % Cache::kMaxKept), M = 1 + int(rng() % 10);
    std::vector<int32_t> kept(size_t(rows) * num_kept);
    std::vector<float> scores(size_t(rows) * n);
    for (int r = 0; r < rows; ++r) {
      std::vector<int32_t> slots(n);
      for (int i = 0; i < n; ++i) slots[i] = begin + i;
      std::shuffle(slots.begin(), slots.end(), rng);
      std::sort(slots.begin(), slots.begin() + num_kept);
      std::copy_n(slots.begin(), num_kept, kept.begin() + size_t(r) * num_kept);
      for (int i = 0; i < n; ++i) scores[size_t(r) * n + i] = rng() % 4 == 0 ? 0.0f : std::pow(10.0f, exponent(rng));
    }
    PagedKV kv = cache.view();
    ASSERT_TRUE(cpu::gather_tokens(kv, 0, kept.data(), num_kept, cache.dst).is_ok());
    auto norm_at = [&](auto index) {
      double s = 0;
      for (int c = 0; c < d; ++c) s += double(cache.at(index(c))) * cache.at(index(c));
      return std::sqrt(s);
    };
    std::vector<double> bound(size_t(rows) * num_kept, 0.0);
    for (int r = 0; r < rows; ++r) {
      const std::vector<int32_t> row(kept.begin() + size_t(r) * num_kept, kept.begin() + size_t(r + 1) * num_kept);
      for (int i = 0; i < num_kept; ++i)
        bound[size_t(r) * num_kept + i] = norm_at([&](int c) { return cache.dst_index(r, i, c); });
      for (int e = begin; e < end; ++e) {
        if (std::find(row.begin(), row.end(), e) != row.end()) continue;
        const double ne = norm_at([&](int c) { return cache.source_index(r, e, c); });
        for (int i : targets(row, e, M)) bound[size_t(r) * num_kept + i] = std::max(bound[size_t(r) * num_kept + i], ne);
      }
    }
    ASSERT_TRUE(cpu::cam_merge_values(kv, 0, begin, end, kept.data(), num_kept, scores.data(), M, cache.dst).is_ok());
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < num_kept; ++i) {
        const double got = norm_at([&](int c) { return cache.dst_index(r, i, c); });
        ASSERT_LE(got, bound[size_t(r) * num_kept + i] * (1 + 1e-6)) << "seed " << seed << " row " << r << " kept " << i;
      }
  }
}

// Negative, NaN and infinite scores are read as 0: the merge equals the one with zeros there, and
// is not refused.
TEST(CamMergeValuesTest, NegativeAndNonFiniteScoresReadAsZero) {
  const int begin = Cache::kBegin, end = Cache::kEnd, n = Cache::kN, num_kept = 5, M = 2;
  Cache bad(DType::kFloat32), zero(DType::kFloat32);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1);
  for (size_t i = 0; i < bad.elems(); ++i) bad.set(i, u(rng));
  zero.pool = bad.pool;
  const int rows = bad.rows();
  std::vector<int32_t> kept;
  for (int r = 0; r < rows; ++r) kept.insert(kept.end(), {5, 6, 9, 10, 12});
  std::vector<float> bad_scores(size_t(rows) * n), zero_scores(bad_scores.size());
  const float specials[] = {-1.0f, -INFINITY, INFINITY, NAN, -0.0f};
  for (size_t i = 0; i < bad_scores.size(); ++i) {
    if (i % 3 == 0) {
      bad_scores[i] = specials[(i / 3) % 5];
      zero_scores[i] = 0.0f;
    } else {
      bad_scores[i] = zero_scores[i] = std::abs(u(rng));
    }
  }
  PagedKV bkv = bad.view(), zkv = zero.view();
  ASSERT_TRUE(cpu::gather_tokens(bkv, 0, kept.data(), num_kept, bad.dst).is_ok());
  ASSERT_TRUE(cpu::gather_tokens(zkv, 0, kept.data(), num_kept, zero.dst).is_ok());
  const std::vector<uint8_t> gathered = bad.pool;
  ASSERT_TRUE(cpu::cam_merge_values(bkv, 0, begin, end, kept.data(), num_kept, bad_scores.data(), M, bad.dst).is_ok());
  ASSERT_TRUE(cpu::cam_merge_values(zkv, 0, begin, end, kept.data(), num_kept, zero_scores.data(), M, zero.dst).is_ok());
  EXPECT_EQ(bad.pool, zero.pool);
  EXPECT_NE(bad.pool, gathered);  // something merged
}

// Nothing evicted (num_kept = n), nothing kept, or all scores 0: the pool is unchanged, bit for bit.
TEST(CamMergeValuesTest, NothingToMergeLeavesThePoolAlone) {
  const int begin = Cache::kBegin, n = 8;
  Cache cache(DType::kFloat16);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  for (size_t i = 0; i < cache.elems(); ++i) cache.set(i, u(rng));
  PagedKV kv = cache.view();
  const int rows = cache.rows();
  std::vector<int32_t> all;
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < n; ++i) all.push_back(begin + i);
  std::vector<float> scores(size_t(rows) * n, 0.5f), zeros(scores.size(), 0.0f);
  ASSERT_TRUE(cpu::gather_tokens(kv, 0, all.data(), n, cache.dst).is_ok());
  const std::vector<uint8_t> gathered = cache.pool;
  ASSERT_TRUE(cpu::cam_merge_values(kv, 0, begin, begin + n, all.data(), n, scores.data(), 3, cache.dst).is_ok());
  EXPECT_EQ(cache.pool, gathered) << "nothing evicted";
  ASSERT_TRUE(cpu::cam_merge_values(kv, 0, begin, begin + n, all.data(), 0, scores.data(), 3, cache.dst).is_ok());
  EXPECT_EQ(cache.pool, gathered) << "nothing kept";
  // Kept slots {4, 5, 6, 7} of [4, 12), all scores 0: every weight is 0.
  std::vector<int32_t> half;
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < 4; ++i) half.push_back(begin + i);
  ASSERT_TRUE(cpu::cam_merge_values(kv, 0, begin, begin + n, half.data(), 4, zeros.data(), 3, cache.dst).is_ok());
  EXPECT_EQ(cache.pool, gathered) << "all scores 0";
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
  const int32_t sorted[] = {1, 2};
  EXPECT_EQ(cpu::cam_merge_values(kv, 0, 0, 8, sorted, 2, nullptr, 4, dst).code, KernelStatus::Code::kInvalidArgument);
}

}  // namespace
}  // namespace karakv::kernels
