// The CPU compression kernels (kernels/cpu/compress.h) against naive float64 loops and hand-worked
// selections written from docs/COMPRESSION.md and the Backend comments, independently of the
// kernels: dense K/V indexed directly, O(n^2) rank-based top-k, Token2Chunk spelled out step by step.
#include <gtest/gtest.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <cmath>
#include <set>
#include <tuple>

#include "cpu/compress.h"
#include "kernel_test_util.h"
#include "token2chunk_reference.h"

namespace karakv::kernels::test {
namespace {

// Scores are sums of probabilities computed in fp32 (fp32 dot products over head_dim terms, an exp
// within ~2 ulp, fp32 column sums): relative error stays near 1e-6; the absolute floor covers
// probabilities that underflow to tiny values.
constexpr double kScoreRelTolerance = 1e-5;
constexpr double kScoreAbsTolerance = 1e-7;

constexpr int kSeeds = 50;

Geometry compress_geometry(DType dtype, int group, int head_dim, int block_size, int layers, int kv_heads) {
  Geometry g;
  g.num_layers = layers;
  g.num_kv_heads = kv_heads;
  g.num_q_heads = kv_heads * group;
  g.head_dim = head_dim;
  g.block_size = block_size;
  g.dtype = dtype;
  return g;
}

void expect_scores_near(const std::vector<float>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const double tol = kScoreAbsTolerance + kScoreRelTolerance * std::fabs(want[i]);
    ASSERT_NEAR(double(got[i]), want[i], tol) << what << " at " << i;
  }
}

// Row softmax in double of logits[0, len).
std::vector<double> softmax(std::vector<double> logits) {
  double max = -INFINITY;
  for (double x : logits) max = std::max(max, x);
  double sum = 0;
  for (double& x : logits) sum += (x = std::exp(x - max));
  for (double& x : logits) x /= sum;
  return logits;
}

// q_row . K[slot] * scale in double for query head qh (its KV head is qh / group).
double logit(const Geometry& g, const DenseKV& kv, int layer, const float* q_row, int qh, int slot, float scale) {
  const int h = qh / g.group_size();
  double s = 0;
  for (int d = 0; d < g.head_dim; ++d) s += double(q_row[d]) * double(kv.k[kv.index(g, layer, slot, h, d)]);
  return s * double(scale);
}

// COMPRESSION.md section 1, "Score": s_i = sum_j sum_t P_j[t, i] per KV head, window slots only.
//   q: [window][num_q_heads][head_dim]; returns [num_kv_heads][window]
std::vector<double> naive_window_scores(const Geometry& g, const DenseKV& kv, int layer, int begin, int window,
                                        const std::vector<float>& q, float scale) {
  const int group = g.group_size();
  std::vector<double> out(size_t(g.num_kv_heads) * window, 0.0);
  for (int h = 0; h < g.num_kv_heads; ++h)
    for (int j = h * group; j < (h + 1) * group; ++j)
      for (int t = 0; t < window; ++t) {
        const float* q_row = q.data() + (size_t(t) * g.num_q_heads + j) * g.head_dim;
        std::vector<double> logits(window);
        for (int i = 0; i < window; ++i) logits[i] = logit(g, kv, layer, q_row, j, begin + i, scale);
        const std::vector<double> p = softmax(logits);
        for (int i = 0; i < window; ++i) out[size_t(h) * window + i] += p[i];
      }
  return out;
}

// Section 2, snapkv: mean over the num_obs causal queries and the group's heads (a query that
// cannot see a slot contributes 0), then avg_pool1d(pool, padding pool/2, count_include_pad) over
// the prefix only.
std::vector<double> naive_snapkv_scores(const Geometry& g, const DenseKV& kv, int layer, int num_obs,
                                        const std::vector<float>& q, float scale, int pool) {
  const int n = kv.len;
  const int group = g.group_size();
  std::vector<double> mean(size_t(g.num_kv_heads) * n, 0.0);
  for (int h = 0; h < g.num_kv_heads; ++h)
    for (int j = h * group; j < (h + 1) * group; ++j)
      for (int i = 0; i < num_obs; ++i) {
        const int pos = n - num_obs + i;
        const float* q_row = q.data() + (size_t(i) * g.num_q_heads + j) * g.head_dim;
        std::vector<double> logits(pos + 1);
        for (int s = 0; s <= pos; ++s) logits[s] = logit(g, kv, layer, q_row, j, s, scale);
        const std::vector<double> p = softmax(logits);
        for (int s = 0; s <= pos; ++s) mean[size_t(h) * n + s] += p[s] / (double(num_obs) * group);
      }
  std::vector<double> out = mean;
  const int prefix = n - num_obs;
  for (int h = 0; h < g.num_kv_heads; ++h)
    for (int s = 0; s < prefix; ++s) {
      double sum = 0;
      for (int u = s - pool / 2; u <= s + pool / 2; ++u)
        if (u >= 0 && u < prefix) sum += mean[size_t(h) * n + u];
      out[size_t(h) * n + s] = sum / pool;
    }
  return out;
}

// Scores with many exact ties: small integers, or continuous values.
std::vector<float> random_scores(int n, bool ties, std::mt19937& rng) {
  std::vector<float> s(n);
  if (ties) {
    std::uniform_int_distribution<int> level(0, 4);
    for (float& x : s) x = float(level(rng)) * 0.25f;
  } else {
    s = random_values(n, 0.0f, 1.0f, rng);
  }
  return s;
}

// ---- window_scores and snapkv_scores -------------------------------------------------------------

// Each scorer with each of its products (CpuGemm), both against float64.
class CompressScoresTest : public ::testing::TestWithParam<std::tuple<DType, int, CpuGemm>> {
 protected:
  void SetUp() override {
    if (std::string missing = cpu_gemm_missing(gemm_); !missing.empty())
      GTEST_SKIP() << cpu_gemm_name(gemm_) << " products not run: " << missing;
    products_before_ = cpu::libxsmm_products();
  }
  // libxsmm ran where it was asked for and only there (a silent fallback to the tile would pass
  // every comparison above).
  void TearDown() override {
    if (IsSkipped() || !expect_libxsmm_) return;
    if (gemm_ == CpuGemm::kLibxsmm) EXPECT_GT(cpu::libxsmm_products(), products_before_) << "libxsmm never ran";
    else EXPECT_EQ(cpu::libxsmm_products(), products_before_) << "libxsmm ran for the tile";
  }
  std::unique_ptr<Backend> backend_ = make_cpu_backend(2);
  const CpuGemm gemm_ = std::get<2>(GetParam());
  uint64_t products_before_ = 0;
  bool expect_libxsmm_ = true;  // false where the test scores too few queries for a product
};

TEST_P(CompressScoresTest, WindowScoresMatchFloat64) {
  const auto [dtype, group, gemm] = GetParam();
  for (int seed = 0; seed < kSeeds; ++seed) {
    std::mt19937 rng(1000 + seed);
    std::uniform_int_distribution<int> pick(0, 1 << 30);
    const int head_dim = seed % 5 == 0 ? 64 : 8 + pick(rng) % 33;  // odd dims exercise the tails
    const int block_size = seed % 2 == 0 ? 16 : 5;
    const int kv_heads = 1 + pick(rng) % 3;
    const Geometry g = compress_geometry(dtype, group, head_dim, block_size, 2, kv_heads);
    // 128 and 129-200: whole and partial blocks of libxsmm's 64 queries and 128 keys.
    const int window = seed % 7 == 0 ? 128 : seed % 7 == 1 ? 129 + pick(rng) % 72 : 1 + pick(rng) % 60;
    const int len = window + 1 + pick(rng) % 40;
    const int slot_begin = 1 + pick(rng) % (len - window);  // never 0, may end at seq_len
    const int layer = pick(rng) % g.num_layers;
    // Sharper softmaxes than 1/sqrt(d) in some seeds, so a few keys dominate.
    const float scale = float(1.0 / std::sqrt(double(head_dim))) * (seed % 3 == 0 ? 6.0f : 1.0f);
    PagedCache cache(*backend_, g, {len + 3, len}, rng);
    const DenseKV dense = random_dense_kv(g, len, rng);
    write_sequence(*backend_, cache, 1, dense);
    const std::vector<float> q = random_values(size_t(window) * g.q_token_elems(), -1.0f, 1.0f, rng);
    std::vector<float> out(size_t(kv_heads) * window, -1.0f);
    const KernelStatus st = cpu::window_scores(cache.view(), 1, layer, slot_begin, window, q.data(), scale, out.data(),
                                               -1, gemm_);
    ASSERT_TRUE(st.is_ok()) << st.message;
    expect_scores_near(out, naive_window_scores(g, dense, layer, slot_begin, window, q, scale),
                       "seed " + std::to_string(seed) + " window " + std::to_string(window) + " begin " +
                           std::to_string(slot_begin));
    // Every query row is a distribution: each head's scores sum to window * group.
    for (int h = 0; h < kv_heads; ++h) {
      double total = 0;
      for (int i = 0; i < window; ++i) total += out[size_t(h) * window + i];
      EXPECT_NEAR(total, double(window) * group, 1e-5 * window * group) << "seed " << seed << " head " << h;
    }
  }
}

// Kara version 2's window scores (backend.h: window_scores_observed) in float64: a finite lse
// normalises a query's row by it (norm = full), NaN falls back to the window softmax, and
// later_keys_only counts keys after the query only (observers = both).
TEST_P(CompressScoresTest, ObservedWindowScoresMatchFloat64) {
  const auto [dtype, group, gemm] = GetParam();
  for (int seed = 0; seed < 20; ++seed) {
    std::mt19937 rng(2000 + seed);
    std::uniform_int_distribution<int> pick(0, 1 << 30);
    const int head_dim = seed % 4 == 0 ? 64 : 8 + pick(rng) % 33;
    const int kv_heads = 1 + pick(rng) % 3;
    const Geometry g = compress_geometry(dtype, group, head_dim, seed % 2 == 0 ? 16 : 5, 2, kv_heads);
    const int window = seed % 5 == 1 ? 100 + pick(rng) % 100 : 1 + pick(rng) % 48;
    const int len = window + 1 + pick(rng) % 40;
    const int slot_begin = 1 + pick(rng) % (len - window);
    const int layer = pick(rng) % g.num_layers;
    const float scale = float(1.0 / std::sqrt(double(head_dim)));
    PagedCache cache(*backend_, g, {len}, rng);
    const DenseKV dense = random_dense_kv(g, len, rng);
    write_sequence(*backend_, cache, 0, dense);
    const std::vector<float> q = random_values(size_t(window) * g.q_token_elems(), -1.0f, 1.0f, rng);
    // A normaliser per (query, head): the log-sum-exp over all keys up to the query's own slot (what
    // its decode step saw), except a few rows left NaN.
    std::vector<float> lse(size_t(window) * g.num_q_heads);
    for (int t = 0; t < window; ++t) {
      for (int j = 0; j < g.num_q_heads; ++j) {
        const float* q_row = q.data() + (size_t(t) * g.num_q_heads + j) * g.head_dim;
        double mx = -INFINITY, sum = 0;
        for (int i = 0; i <= slot_begin + t; ++i) mx = std::max(mx, logit(g, dense, layer, q_row, j, i, scale));
        for (int i = 0; i <= slot_begin + t; ++i) sum += std::exp(logit(g, dense, layer, q_row, j, i, scale) - mx);
        lse[size_t(t) * g.num_q_heads + j] = (t + j) % 5 == 3 ? NAN : float(mx + std::log(sum));
      }
    }
    for (int mode = 0; mode < 4; ++mode) {
      const bool with_lse = mode & 1, later = mode & 2;
      std::vector<double> want(size_t(kv_heads) * window, 0.0);
      for (int h = 0; h < kv_heads; ++h)
        for (int j = h * group; j < (h + 1) * group; ++j)
          for (int t = 0; t < window; ++t) {
            const float* q_row = q.data() + (size_t(t) * g.num_q_heads + j) * g.head_dim;
            std::vector<double> logits(window);
            for (int i = 0; i < window; ++i) logits[i] = logit(g, dense, layer, q_row, j, slot_begin + i, scale);
            const float norm = with_lse ? lse[size_t(t) * g.num_q_heads + j] : NAN;
            std::vector<double> p = softmax(logits);
            if (std::isfinite(norm)) {
              for (int i = 0; i < window; ++i) p[i] = std::exp(logits[i] - double(norm));
            }
            for (int i = later ? t + 1 : 0; i < window; ++i) want[size_t(h) * window + i] += p[i];
          }
      std::vector<float> out(size_t(kv_heads) * window, -1.0f);
      const KernelStatus st = cpu::window_scores_observed(cache.view(), 0, layer, slot_begin, window, q.data(), scale,
                                                          with_lse ? lse.data() : nullptr, later, out.data(), -1,
                                                          gemm_);
      ASSERT_TRUE(st.is_ok()) << st.message;
      // Rows normalised by a decode-time lse are exp(logit - lse) in fp32 against double: the same
      // relative tolerance, a little looser absolute floor for the fp32 rounding of lse itself.
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR(double(out[i]), want[i], 1e-6 + 2e-5 * std::fabs(want[i])) << "seed " << seed << " mode " << mode << " at " << i;
      }
    }
  }
}

// decode_attention_observe (the decode attention's own log-sum-exp and logits, exp(logit - lse)
// summed over the group) against float64, per slot: outputs, normalisers, and each accumulated slot's
// probability summed over the group; slots before acc_begin, null rows and null normalisers are
// left as they were. Several sequences (one may be empty), each with its own first slot.
// (One decode query always uses the tile: no product parameter.)
class CompressDecodeTest : public ::testing::TestWithParam<std::tuple<DType, int>> {
 protected:
  std::unique_ptr<Backend> backend_ = make_cpu_backend(2);
};

TEST_P(CompressDecodeTest, DecodeObserversMatchFloat64) {
  const auto [dtype, group] = GetParam();
  constexpr float kUntouched = 0.5f;
  for (int seed = 0; seed < 10; ++seed) {
    std::mt19937 rng(3000 + seed);
    std::uniform_int_distribution<int> pick(0, 1 << 30);
    const int head_dim = 8 + pick(rng) % 57;
    const Geometry g = compress_geometry(dtype, group, head_dim, 16, 2, 2);
    const int num_seqs = 3;
    std::vector<int> lens(num_seqs);
    // Some past the attention's 512-token chunks, so the kept logits come from several chunks.
    const int longest = seed % 3 == 2 ? 1300 : 200;
    for (int s = 0; s < num_seqs; ++s) lens[s] = seed == 3 && s == 1 ? 0 : 1 + pick(rng) % longest;
    PagedCache cache(*backend_, g, lens, rng);
    std::vector<DenseKV> dense;
    for (int s = 0; s < num_seqs; ++s) {
      dense.push_back(random_dense_kv(g, lens[s], rng));
      write_sequence(*backend_, cache, s, dense[s]);
    }
    // Even seeds: every slot (acc_begin null); odd: a first slot per sequence (0, inside, or the end).
    std::vector<int32_t> begin(num_seqs, 0);
    const bool with_begin = seed % 2 == 1;
    for (int s = 0; s < num_seqs && with_begin; ++s) begin[s] = s == 2 ? lens[s] : pick(rng) % (lens[s] + 1);
    const std::vector<float> q = random_values(size_t(num_seqs) * g.q_token_elems(), -2.0f, 2.0f, rng);
    const float scale = 0.3f;
    std::vector<float> out(q.size(), NAN), lse(size_t(num_seqs) * g.num_q_heads, NAN);
    std::vector<std::vector<float>> acc(size_t(num_seqs) * g.num_kv_heads);
    std::vector<float*> accs(acc.size(), nullptr), lse_rows(num_seqs, nullptr);
    for (int s = 0; s < num_seqs; ++s) {
      if ((s + seed) % 3 != 0) lse_rows[s] = lse.data() + size_t(s) * g.num_q_heads;
      for (int h = 0; h < g.num_kv_heads; ++h) {
        acc[size_t(s) * g.num_kv_heads + h].assign(lens[s], kUntouched);
        if ((s + h + seed) % 4 != 0) accs[size_t(s) * g.num_kv_heads + h] = acc[size_t(s) * g.num_kv_heads + h].data();
      }
    }
    const KernelStatus st = backend_->decode_attention_observe(cache.view(), 1, q.data(), out.data(), scale,
                                                               accs.data(), with_begin ? begin.data() : nullptr,
                                                               lse_rows.data());
    ASSERT_TRUE(st.is_ok()) << st.message;
    for (int s = 0; s < num_seqs; ++s) {
      for (int h = 0; h < g.num_kv_heads; ++h) {
        std::vector<double> want(lens[s], 0.0);
        for (int j = h * group; j < (h + 1) * group; ++j) {
          const float* q_row = q.data() + (size_t(s) * g.num_q_heads + j) * head_dim;
          std::vector<double> logits(lens[s]);
          for (int i = 0; i < lens[s]; ++i) logits[i] = logit(g, dense[s], 1, q_row, j, i, scale);
          double mx = -INFINITY, sum = 0;
          for (double x : logits) mx = std::max(mx, x);
          for (double x : logits) sum += std::exp(x - mx);
          const std::vector<double> p = softmax(logits);
          for (int i = 0; i < lens[s]; ++i) want[i] += p[i];
          const float got_lse = lse[size_t(s) * g.num_q_heads + j];
          if (lse_rows[s] == nullptr || lens[s] == 0) {
            EXPECT_TRUE(std::isnan(got_lse)) << "seed " << seed << " seq " << s << ": normaliser written";
          } else {
            ASSERT_NEAR(double(got_lse), mx + std::log(sum), 1e-5 * (1 + std::fabs(mx))) << "seed " << seed << " seq " << s;
          }
          for (int d = 0; d < head_dim && lens[s] > 0; ++d) {
            double o = 0;
            for (int i = 0; i < lens[s]; ++i) o += p[i] * dense[s].v[dense[s].index(g, 1, i, h, d)];
            ASSERT_NEAR(out[(size_t(s) * g.num_q_heads + j) * head_dim + d], o, 1e-5)
                << "seed " << seed << " seq " << s;
          }
        }
        const std::vector<float>& a = acc[size_t(s) * g.num_kv_heads + h];
        const bool accumulated = accs[size_t(s) * g.num_kv_heads + h] != nullptr;
        for (int i = 0; i < lens[s]; ++i) {
          if (!accumulated || i < begin[s]) {
            ASSERT_EQ(a[i], kUntouched) << "seed " << seed << " seq " << s << " head " << h << " slot " << i;
          } else {
            ASSERT_NEAR(double(a[i]) - kUntouched, want[i], 1e-6 + 2e-5 * want[i])
                << "seed " << seed << " seq " << s << " head " << h << " slot " << i;
          }
        }
      }
    }
  }
}

// The accumulators' arguments are refused before anything is touched, naming what was wrong.
TEST(CompressDecodeArgumentsTest, RefusesMissingAccumulatorsAndFirstSlotsOutsideTheCache) {
  std::unique_ptr<Backend> backend = make_cpu_backend(1);
  std::mt19937 rng(5);
  const Geometry g = compress_geometry(DType::kFloat32, 2, 8, 4, 1, 1);
  PagedCache cache(*backend, g, {6, 9}, rng);
  write_sequence(*backend, cache, 0, random_dense_kv(g, 6, rng));
  write_sequence(*backend, cache, 1, random_dense_kv(g, 9, rng));
  const std::vector<float> q = random_values(2 * g.q_token_elems(), -1.0f, 1.0f, rng);
  std::vector<float> out(q.size(), -7.0f);
  std::vector<float> a0(6, 0.0f), a1(9, 0.0f);
  float* accs[2] = {a0.data(), a1.data()};
  KernelStatus st = backend->decode_attention_accumulate(cache.view(), 0, q.data(), out.data(), 1.0f, nullptr, nullptr);
  EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument);
  EXPECT_EQ(st.message, "decode_attention_accumulate: score_acc must be non-null");
  for (const auto& [b0, b1] : {std::pair{7, 0}, std::pair{0, -1}}) {
    const int32_t begin[2] = {b0, b1};
    st = backend->decode_attention_observe(cache.view(), 0, q.data(), out.data(), 1.0f, accs, begin, nullptr);
    EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument);
    const std::string want = b0 == 7 ? "decode_attention_observe: acc_begin[0] 7 outside [0, seq_len 6]"
                                     : "decode_attention_observe: acc_begin[1] -1 outside [0, seq_len 9]";
    EXPECT_EQ(st.message, want);
  }
  for (float x : out) EXPECT_EQ(x, -7.0f) << "a refused call wrote its output";
  for (float x : a0) EXPECT_EQ(x, 0.0f);
  // The ends are allowed: [0, seq_len] (nothing accumulated at seq_len).
  const int32_t ends[2] = {6, 0};
  ASSERT_TRUE(backend->decode_attention_accumulate(cache.view(), 0, q.data(), out.data(), 1.0f, accs, ends).is_ok());
  for (float x : a0) EXPECT_EQ(x, 0.0f);
  double total = 0;
  for (float x : a1) total += x;
  EXPECT_NEAR(total, g.group_size(), 1e-5);
}

TEST_P(CompressScoresTest, SnapKVScoresMatchFloat64) {
  const auto [dtype, group, gemm] = GetParam();
  for (int seed = 0; seed < kSeeds; ++seed) {
    std::mt19937 rng(2000 + seed);
    std::uniform_int_distribution<int> pick(0, 1 << 30);
    const int head_dim = seed % 5 == 0 ? 64 : 8 + pick(rng) % 33;
    const int block_size = seed % 2 == 0 ? 16 : 7;
    const int kv_heads = 1 + pick(rng) % 3;
    const Geometry g = compress_geometry(dtype, group, head_dim, block_size, 3, kv_heads);
    // Some past libxsmm's 128-key and 64-query blocks.
    const int n = seed % 10 == 2 ? 200 + pick(rng) % 150 : 1 + pick(rng) % 120;
    // num_obs == n (no prefix) and num_obs == 1 happen; otherwise anywhere in between.
    const int num_obs = seed % 10 == 0 ? n : seed % 10 == 1 ? 1 : 1 + pick(rng) % std::min(n, seed % 10 == 2 ? 90 : 40);
    const int pool = std::vector<int>{1, 3, 5}[seed % 3];
    const int layer = pick(rng) % g.num_layers;
    const float scale = float(1.0 / std::sqrt(double(head_dim))) * (seed % 4 == 0 ? 5.0f : 1.0f);
    PagedCache cache(*backend_, g, {n}, rng);
    const DenseKV dense = random_dense_kv(g, n, rng);
    write_sequence(*backend_, cache, 0, dense);
    const std::vector<float> q = random_values(size_t(num_obs) * g.q_token_elems(), -1.0f, 1.0f, rng);
    std::vector<float> out(size_t(kv_heads) * n, -1.0f);
    const KernelStatus st = cpu::snapkv_scores(cache.view(), 0, layer, num_obs, q.data(), scale, pool, out.data(),
                                               -1, gemm_);
    ASSERT_TRUE(st.is_ok()) << st.message;
    expect_scores_near(out, naive_snapkv_scores(g, dense, layer, num_obs, q, scale, pool),
                       "seed " + std::to_string(seed) + " n " + std::to_string(n) + " num_obs " +
                           std::to_string(num_obs) + " pool " + std::to_string(pool));
  }
}

INSTANTIATE_TEST_SUITE_P(DtypesAndGroups, CompressDecodeTest,
                         ::testing::Combine(::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                                            ::testing::Values(1, 2, 3)),
                         [](const auto& info) {
                           return std::string(name_of(std::get<0>(info.param))) + "_g" +
                                  std::to_string(std::get<1>(info.param));
                         });

INSTANTIATE_TEST_SUITE_P(DtypesGroupsAndProducts, CompressScoresTest,
                         ::testing::Combine(::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                                            ::testing::Values(1, 2, 3),
                                            ::testing::Values(CpuGemm::kTile, CpuGemm::kLibxsmm)),
                         [](const auto& info) {
                           return std::string(name_of(std::get<0>(info.param))) + "_g" +
                                  std::to_string(std::get<1>(info.param)) + "_" +
                                  std::string(cpu_gemm_name(std::get<2>(info.param)));
                         });

// Pool 1 and a window of the whole sequence have closed forms that do not need the float64 loop.
TEST(CompressSnapKVTest, PoolOneEqualsRawMeanAndUniformKeysGiveUniformRows) {
  std::unique_ptr<Backend> backend = make_cpu_backend(2);
  std::mt19937 rng(7);
  const Geometry g = compress_geometry(DType::kFloat32, 2, 8, 4, 1, 1);
  const int n = 10, num_obs = 3;
  PagedCache cache(*backend, g, {n}, rng);
  DenseKV dense = random_dense_kv(g, n, rng);
  // All-zero keys: every visible slot gets 1 / (visible count) from each query.
  std::fill(dense.k.begin(), dense.k.end(), 0.0f);
  dense.k_bytes = encode(g.dtype, dense.k);
  write_sequence(*backend, cache, 0, dense);
  const std::vector<float> q = random_values(size_t(num_obs) * g.q_token_elems(), -1.0f, 1.0f, rng);
  std::vector<float> out(n);
  ASSERT_TRUE(cpu::snapkv_scores(cache.view(), 0, 0, num_obs, q.data(), 1.0f, 1, out.data()).is_ok());
  // Queries at slots 7, 8, 9 see 8, 9, 10 slots.
  const double a = 1.0 / 8, b = 1.0 / 9, c = 1.0 / 10;
  for (int s = 0; s < 8; ++s) EXPECT_NEAR(out[s], (a + b + c) / 3, 1e-7) << s;
  EXPECT_NEAR(out[8], (b + c) / 3, 1e-7);
  EXPECT_NEAR(out[9], c / 3, 1e-7);
  // Pool 3 over the prefix [0, 7): the ends lose one neighbour to the zero padding.
  ASSERT_TRUE(cpu::snapkv_scores(cache.view(), 0, 0, num_obs, q.data(), 1.0f, 3, out.data()).is_ok());
  EXPECT_NEAR(out[0], 2 * (a + b + c) / 3 / 3, 1e-7);
  EXPECT_NEAR(out[3], (a + b + c) / 3, 1e-7);
  EXPECT_NEAR(out[6], 2 * (a + b + c) / 3 / 3, 1e-7);
  EXPECT_NEAR(out[7], (a + b + c) / 3, 1e-7);  // window slot: raw mean, not pooled
  EXPECT_NEAR(out[9], c / 3, 1e-7);
}

// Bytes malloc hands out now (arenas plus its own mmaps), or -1 where that cannot be read: not
// glibc's malloc, or a sanitizer's in its place.
long long malloc_in_use() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return -1;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
  return -1;
#endif
#endif
#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 33)
  const struct mallinfo2 m = mallinfo2();
  return (long long)(m.uordblks + m.hblkhd);
#else
  return -1;
#endif
}

// The per-thread scratch a long sequence's scoring needed (its keys widened to fp32: 1 MiB here)
// is given back when the call ends, so a thread does not hold memory for the longest sequence it
// ever scored (kernels/cpu/scratch.h).
TEST(CompressScratchTest, LongSequenceScratchIsGivenBackAfterTheCall) {
  if (malloc_in_use() < 0) GTEST_SKIP() << "malloc is not glibc's here";
  std::unique_ptr<Backend> backend = make_cpu_backend(2);
  std::mt19937 rng(11);
  const Geometry g = compress_geometry(DType::kFloat32, 2, 64, 16, 1, 2);
  const int n = 4096, num_obs = 4;
  PagedCache cache(*backend, g, {n}, rng);
  write_sequence(*backend, cache, 0, random_dense_kv(g, n, rng));
  const std::vector<float> q = random_values(size_t(num_obs) * g.q_token_elems(), -1.0f, 1.0f, rng);
  const int window = 2048;  // its keys: 512 KiB per thread
  const std::vector<float> q_window = random_values(size_t(window) * g.q_token_elems(), -1.0f, 1.0f, rng);
  std::vector<float> out(size_t(g.num_kv_heads) * n);
  // A short call first, so the thread team and its small buffers exist before the baseline.
  cache.set_seq_len(0, 64);
  ASSERT_TRUE(cpu::snapkv_scores(cache.view(), 0, 0, num_obs, q.data(), 0.125f, 1, out.data()).is_ok());
  cache.set_seq_len(0, n);
  for (int call = 0; call < 3; ++call) {
    const long long before = malloc_in_use();
    ASSERT_TRUE(cpu::snapkv_scores(cache.view(), 0, 0, num_obs, q.data(), 0.125f, 1, out.data()).is_ok());
    ASSERT_TRUE(cpu::window_scores(cache.view(), 0, 0, n - window, window, q_window.data(), 0.125f, out.data()).is_ok());
    const long long kept = malloc_in_use() - before;
    EXPECT_LT(kept, 128 << 10) << "call " << call << ": " << kept << " bytes still held after scoring " << n
                               << " keys of head_dim " << g.head_dim;
  }
}

// ---- top_k ----------------------------------------------------------------------------------------

TEST(CompressTopKTest, MatchesRankDefinitionWithTies) {
  for (int seed = 0; seed < 4 * kSeeds; ++seed) {
    std::mt19937 rng(3000 + seed);
    const int n = 1 + int(rng() % 200);
    const int k = int(rng() % (n + 1));
    const std::vector<float> s = random_scores(n, seed % 2 == 0, rng);
    std::vector<int32_t> out(k, -1);
    const KernelStatus st = cpu::top_k(s.data(), 1, n, k, out.data());
    ASSERT_TRUE(st.is_ok()) << st.message;
    ASSERT_EQ(out, naive_top_k(s, k)) << "seed " << seed << " n " << n << " k " << k;
  }
}

TEST(CompressTopKTest, HandMadeTies) {
  // Ranks: 3 (0.9) first, then the 0.5s in index order 1, 4, 6, then the 0.1s 0, 2, 5.
  const std::vector<float> s = {0.1f, 0.5f, 0.1f, 0.9f, 0.5f, 0.1f, 0.5f};
  auto top = [&](int k) {
    std::vector<int32_t> out(k);
    EXPECT_TRUE(cpu::top_k(s.data(), 1, int(s.size()), k, out.data()).is_ok());
    return out;
  };
  EXPECT_EQ(top(0), std::vector<int32_t>{});
  EXPECT_EQ(top(1), (std::vector<int32_t>{3}));
  EXPECT_EQ(top(2), (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(top(3), (std::vector<int32_t>{1, 3, 4}));
  EXPECT_EQ(top(5), (std::vector<int32_t>{0, 1, 3, 4, 6}));
  EXPECT_EQ(top(7), (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6}));
  // All equal: the lowest indices.
  const std::vector<float> flat(9, 2.0f);
  std::vector<int32_t> out(4);
  ASSERT_TRUE(cpu::top_k(flat.data(), 1, 9, 4, out.data()).is_ok());
  EXPECT_EQ(out, (std::vector<int32_t>{0, 1, 2, 3}));
  // -0.0 and +0.0 tie; -inf is a valid (lowest) score.
  const std::vector<float> signed_zero = {-INFINITY, 0.0f, -0.0f, -1.0f};
  std::vector<int32_t> two(2);
  ASSERT_TRUE(cpu::top_k(signed_zero.data(), 1, 4, 2, two.data()).is_ok());
  EXPECT_EQ(two, (std::vector<int32_t>{1, 2}));
  // -0.0 first: the tie goes to it (a selection that ranked +0.0 above -0.0 would take index 1).
  const std::vector<float> zero_first = {-1.0f, -0.0f, 0.0f, -2.0f};
  std::vector<int32_t> one(1);
  ASSERT_TRUE(cpu::top_k(zero_first.data(), 1, 4, 1, one.data()).is_ok());
  EXPECT_EQ(one, (std::vector<int32_t>{1}));
  // The same tie in Token2Chunk's candidates and in its fill (candidates 1, budget 2, no chunks).
  std::vector<int32_t> kept(2);
  const std::vector<float> zeros = {-0.0f, -1.0f, 0.0f, -0.0f, 0.0f};
  ASSERT_TRUE(cpu::token2chunk(zeros.data(), 1, 5, 2, 1, 0, kept.data()).is_ok());
  EXPECT_EQ(kept, (std::vector<int32_t>{0, 2}));
}

// ---- token2chunk ----------------------------------------------------------------------------------

std::vector<int32_t> run_token2chunk(const std::vector<float>& s, int budget, int num_candidates, int max_gap) {
  std::vector<int32_t> out(budget, -1);
  const KernelStatus st = cpu::token2chunk(s.data(), 1, int(s.size()), budget, num_candidates, max_gap, out.data());
  EXPECT_TRUE(st.is_ok()) << st.message;
  return out;
}

TEST(CompressToken2ChunkTest, InvariantsAndFloat64ReferenceOverRandomScores) {
  for (int seed = 0; seed < 4 * kSeeds; ++seed) {
    std::mt19937 rng(4000 + seed);
    const int n = 1 + int(rng() % 160);
    const int budget = int(rng() % (n + 1));
    const int num_candidates = int(rng() % (budget + 1));
    const int max_gap = int(rng() % 10);
    const std::vector<float> s = random_scores(n, seed % 2 == 0, rng);
    const std::vector<int32_t> out = run_token2chunk(s, budget, num_candidates, max_gap);
    const std::string ctx = "seed " + std::to_string(seed) + " n " + std::to_string(n) + " budget " +
                            std::to_string(budget) + " candidates " + std::to_string(num_candidates) +
                            " max_gap " + std::to_string(max_gap);
    ASSERT_EQ(int(out.size()), budget) << ctx;
    for (int i = 0; i < budget; ++i) {
      ASSERT_GE(out[i], 0) << ctx;
      ASSERT_LT(out[i], n) << ctx;
      if (i > 0) {
        ASSERT_LT(out[i - 1], out[i]) << ctx << ": not strictly ascending at " << i;
      }
    }
    const std::set<int32_t> chosen(out.begin(), out.end());
    for (int32_t c : naive_top_k(s, num_candidates)) ASSERT_TRUE(chosen.count(c)) << ctx << ": candidate " << c << " dropped";
    ASSERT_EQ(out, naive_token2chunk(s, budget, num_candidates, max_gap)) << ctx;
    // Without chunks the selection is just the top `budget`.
    if (max_gap == 0) {
      ASSERT_EQ(out, naive_top_k(s, budget)) << ctx;
    }
  }
}

TEST(CompressToken2ChunkTest, ChunkTooBigIsSkippedAndLaterSmallerOneTaken) {
  // n = 16, budget = 6, candidates = 4, max_gap = 3.
  //   Top 4: 8 (.95), 4 (.8), 13 (.7), 2 (.6); next best is 14 (.5). By position: 2, 4, 8, 13.
  //   (2, 4):  interior {3}, size 1, score min(.6, .8) = .6
  //   (4, 8):  interior {5, 6, 7}, size 3, score min(.8, .95) = .8
  //   (8, 13): interior of 4 > max_gap: not a chunk.
  //   Kept 4. (4, 8) first: 4 + 3 = 7 > 6, skipped. (2, 4): 4 + 1 = 5, taken.
  //   Fill 1: best of the rest is 14 (.5).  Result: 2, 3, 4, 8, 13, 14.
  const std::vector<float> s = {.1f, .2f, .6f, .05f, .8f, .3f, .1f, .1f, .95f, .4f, 0, 0, 0, .7f, .5f, 0};
  EXPECT_EQ(run_token2chunk(s, 6, 4, 3), (std::vector<int32_t>{2, 3, 4, 8, 13, 14}));
  // With budget 8 both chunks fit: (4, 8) then (2, 4) reach 8, no fill.
  EXPECT_EQ(run_token2chunk(s, 8, 4, 3), (std::vector<int32_t>{2, 3, 4, 5, 6, 7, 8, 13}));
  // With max_gap 4, (8, 13) (interior {9..12}, score min(.95, .7) = .7) is a chunk too. Budget 8:
  // (4, 8) .8 -> 7 kept; (8, 13) .7 needs 4 -> 11 > 8, skipped; (2, 4) .6 -> 8 kept.
  EXPECT_EQ(run_token2chunk(s, 8, 4, 4), (std::vector<int32_t>{2, 3, 4, 5, 6, 7, 8, 13}));
  // Budget 9 with max_gap 4: as above then fill 1 with 14.
  EXPECT_EQ(run_token2chunk(s, 9, 4, 4), (std::vector<int32_t>{2, 3, 4, 5, 6, 7, 8, 13, 14}));
}

TEST(CompressToken2ChunkTest, AdjacentCandidatesAndChunkScoreTieGoesToLowerPosition) {
  // n = 16, budget = 6, candidates = 4, max_gap = 3.
  //   Top 4: 1 (.9), 4 (.6), 3 (.5), 7 (.5); next best is 10 (.45). By position: 1, 3, 4, 7.
  //   (1, 3): interior {2}, score min(.9, .5) = .5
  //   (3, 4): adjacent, empty interior: not a chunk.
  //   (4, 7): interior {5, 6}, score min(.6, .5) = .5   -- ties with (1, 3)
  //   Tie -> lower position first: (1, 3) takes {2}, 5 kept; (4, 7) needs 2 -> 7 > 6, skipped.
  //   (The other order would keep 5, 6 and then skip {2}.)  Fill 1: 10 (.45).
  //   Result: 1, 2, 3, 4, 7, 10.
  const std::vector<float> s = {.1f, .9f, 0, .5f, .6f, .05f, .05f, .5f, .2f, .3f, .45f, .1f, .1f, .1f, .1f, .1f};
  EXPECT_EQ(run_token2chunk(s, 6, 4, 3), (std::vector<int32_t>{1, 2, 3, 4, 7, 10}));
}

TEST(CompressToken2ChunkTest, CandidateAndFillTiesGoToLowerIndex) {
  // n = 16, budget = 10, candidates = 4, max_gap = 3.
  //   Scores 0 except 5, 9: 1.0 and 10, 12, 14: 0.5. Top 4: 5, 9, then of the tied 0.5s the lower
  //   indices 10, 12 (14 is left out). By position: 5, 9, 10, 12.
  //   (5, 9): interior {6, 7, 8}, size 3 <= 3, score 1.0;  (9, 10): adjacent;  (10, 12): {11}, .5.
  //   Kept 4 -> 7 -> 8. Fill 2: 14 (.5), then of the tied zeros the lowest index, 0.
  //   Result: 0, 5, 6, 7, 8, 9, 10, 11, 12, 14.
  std::vector<float> s(16, 0.0f);
  s[5] = s[9] = 1.0f;
  s[10] = s[12] = s[14] = 0.5f;
  EXPECT_EQ(run_token2chunk(s, 10, 4, 3), (std::vector<int32_t>{0, 5, 6, 7, 8, 9, 10, 11, 12, 14}));
  // budget == candidates: the candidates alone, no room for any chunk.
  EXPECT_EQ(run_token2chunk(s, 4, 4, 3), (std::vector<int32_t>{5, 9, 10, 12}));
  // Zero candidates: no chunks, the top `budget` (5, 9, 10, 12, 14, then 0).
  EXPECT_EQ(run_token2chunk(s, 6, 0, 3), (std::vector<int32_t>{0, 5, 9, 10, 12, 14}));
}

TEST(CompressToken2ChunkTest, LowEndScoreDemotesChunk) {
  // n = 12, budget = 5, candidates = 3, max_gap = 3. Both ends must matter.
  //   Top 3: 0 (1.0), 4 (.9), 8 (.2); next best 10 (.15). By position: 0, 4, 8.
  //   (0, 4): interior {1, 2, 3}, score min(1.0, .9) = .9
  //   (4, 8): interior {5, 6, 7}, score min(.9, .2) = .2
  //   Budget leaves 2: neither chunk of 3 fits. Fill 2: 10 (.15), 11 (.12).
  //   Result: 0, 4, 8, 10, 11.  With budget 6: (0, 4) fits (6), (4, 8) does not: 0..4, 8.
  const std::vector<float> s = {1.0f, .1f, .1f, .1f, .9f, .1f, .1f, .1f, .2f, .1f, .15f, .12f};
  EXPECT_EQ(run_token2chunk(s, 5, 3, 3), (std::vector<int32_t>{0, 4, 8, 10, 11}));
  EXPECT_EQ(run_token2chunk(s, 6, 3, 3), (std::vector<int32_t>{0, 1, 2, 3, 4, 8}));
}

// Kara defaults on a real window size: W = 128, B = 32, k = 16, G = 8.
TEST(CompressToken2ChunkTest, KaraDefaultsMatchReference) {
  for (int seed = 0; seed < kSeeds; ++seed) {
    std::mt19937 rng(5000 + seed);
    const std::vector<float> s = random_scores(128, seed % 2 == 0, rng);
    ASSERT_EQ(run_token2chunk(s, 32, 16, 8), naive_token2chunk(s, 32, 16, 8)) << "seed " << seed;
  }
}

// ---- gather_tokens --------------------------------------------------------------------------------

class CompressGatherTest : public ::testing::TestWithParam<DType> {};

TEST_P(CompressGatherTest, CopiesKeptRowsPerLayerAndHeadAndNothingElse) {
  std::unique_ptr<Backend> backend = make_cpu_backend(2);
  for (int seed = 0; seed < kSeeds; ++seed) {
    std::mt19937 rng(6000 + seed);
    std::uniform_int_distribution<int> pick(0, 1 << 30);
    const int block_size = std::vector<int>{1, 4, 16, 5}[seed % 4];
    const Geometry g = compress_geometry(GetParam(), 1 + seed % 3, 4 + pick(rng) % 20, block_size,
                                         1 + pick(rng) % 4, 1 + pick(rng) % 3);
    const int len = 1 + pick(rng) % 90;
    const int num_kept = seed % 10 == 0 ? len : 1 + pick(rng) % len;
    const int num_dst = (num_kept + block_size - 1) / block_size;
    PagedCache cache(*backend, g, {7, len}, rng, /*spare_blocks=*/num_dst + 2);
    write_sequence(*backend, cache, 0, random_dense_kv(g, 7, rng));
    const DenseKV dense = random_dense_kv(g, len, rng);
    write_sequence(*backend, cache, 1, dense);
    // Destination: spare blocks (in no table), in shuffled order.
    std::vector<int32_t> spare;
    for (int32_t b = 0; b < cache.num_blocks(); ++b)
      if (std::find(cache.block_table().begin(), cache.block_table().end(), b) == cache.block_table().end())
        spare.push_back(b);
    std::shuffle(spare.begin(), spare.end(), rng);
    const std::vector<int32_t> dst(spare.begin(), spare.begin() + num_dst);
    // A different random ascending subset per (layer, head).
    std::vector<int32_t> kept;
    for (int r = 0; r < g.num_layers * g.num_kv_heads; ++r) {
      std::vector<int32_t> all(len);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      all.resize(num_kept);
      std::sort(all.begin(), all.end());
      kept.insert(kept.end(), all.begin(), all.end());
    }

    // Expected pool: the old one with each destination row overwritten by hand indexing.
    std::vector<uint8_t> want = cache.pool_bytes();
    const size_t esize = dtype_size(g.dtype);
    for (int l = 0; l < g.num_layers; ++l)
      for (int h = 0; h < g.num_kv_heads; ++h)
        for (int i = 0; i < num_kept; ++i) {
          const int32_t src = kept[(size_t(l) * g.num_kv_heads + h) * num_kept + i];
          for (int kv = 0; kv < 2; ++kv) {
            const size_t at = size_t(dst[i / block_size]) * g.block_elems() +
                              (((size_t(l) * 2 + kv) * g.num_kv_heads + h) * block_size + i % block_size) * g.head_dim;
            const std::vector<uint8_t>& from = kv == 0 ? dense.k_bytes : dense.v_bytes;
            std::memcpy(want.data() + at * esize, from.data() + dense.index(g, l, src, h, 0) * esize,
                        size_t(g.head_dim) * esize);
          }
        }
    const KernelStatus st = cpu::gather_tokens(cache.view(), 1, kept.data(), num_kept, dst.data());
    ASSERT_TRUE(st.is_ok()) << st.message;
    ASSERT_TRUE(cache.pool_bytes() == want) << "seed " << seed << " len " << len << " num_kept " << num_kept;
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, CompressGatherTest,
                         ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                         [](const auto& info) { return std::string(name_of(info.param)); });

// ---- invalid arguments ----------------------------------------------------------------------------

class CompressInvalidArgumentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cache_ = std::make_unique<PagedCache>(*backend_, geo_, std::vector<int>{40}, rng_, /*spare_blocks=*/4);
    write_sequence(*backend_, *cache_, 0, random_dense_kv(geo_, 40, rng_));
  }
  static void expect_invalid(const KernelStatus& st, const std::string& needle) {
    EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument) << st.message;
    EXPECT_NE(st.message.find(needle), std::string::npos) << "message \"" << st.message << "\" lacks \"" << needle << "\"";
  }
  int32_t spare_block(int i) const {
    int32_t b = 0;
    for (int found = -1;; ++b)
      if (std::find(cache_->block_table().begin(), cache_->block_table().end(), b) == cache_->block_table().end() &&
          ++found == i)
        return b;
  }

  std::unique_ptr<Backend> backend_ = make_cpu_backend(2);
  std::mt19937 rng_{11};
  Geometry geo_ = compress_geometry(DType::kFloat16, 2, 8, 16, 2, 2);
  std::unique_ptr<PagedCache> cache_;
  std::vector<float> q_ = std::vector<float>(64 * 4 * 8, 0.5f);
  std::vector<float> out_ = std::vector<float>(2 * 64, 0.0f);
};

TEST_F(CompressInvalidArgumentTest, WindowScores) {
  const PagedKV kv = cache_->view();
  const float s = 0.3f;
  expect_invalid(cpu::window_scores(kv, 1, 0, 0, 16, q_.data(), s, out_.data()), "seq 1");
  expect_invalid(cpu::window_scores(kv, -1, 0, 0, 16, q_.data(), s, out_.data()), "seq -1");
  expect_invalid(cpu::window_scores(kv, 0, 2, 0, 16, q_.data(), s, out_.data()), "layer 2");
  expect_invalid(cpu::window_scores(kv, 0, -1, 0, 16, q_.data(), s, out_.data()), "layer -1");
  expect_invalid(cpu::window_scores(kv, 0, 0, 0, 0, q_.data(), s, out_.data()), "window 0");
  expect_invalid(cpu::window_scores(kv, 0, 0, 0, 41, q_.data(), s, out_.data()), "window 41");
  expect_invalid(cpu::window_scores(kv, 0, 0, 25, 16, q_.data(), s, out_.data()), "slot_begin 25");
  expect_invalid(cpu::window_scores(kv, 0, 0, -1, 16, q_.data(), s, out_.data()), "slot_begin -1");
  expect_invalid(cpu::window_scores(kv, 0, 0, 0, 16, nullptr, s, out_.data()), "non-null");
  expect_invalid(cpu::window_scores(kv, 0, 0, 0, 16, q_.data(), s, nullptr), "non-null");
  expect_invalid(cpu::window_scores(kv, 0, 0, 0, 16, q_.data(), NAN, out_.data()), "scale");
  PagedKV bad = kv;
  bad.pool = nullptr;
  expect_invalid(cpu::window_scores(bad, 0, 0, 0, 16, q_.data(), s, out_.data()), "pool");
  bad = kv;
  bad.geometry.num_q_heads = 3;
  expect_invalid(cpu::window_scores(bad, 0, 0, 0, 16, q_.data(), s, out_.data()), "num_q_heads 3");
  EXPECT_TRUE(cpu::window_scores(kv, 0, 0, 24, 16, q_.data(), s, out_.data()).is_ok());
}

TEST_F(CompressInvalidArgumentTest, SnapKVScores) {
  const PagedKV kv = cache_->view();
  std::vector<float> out(2 * 40);
  const float s = 0.3f;
  expect_invalid(cpu::snapkv_scores(kv, 3, 0, 8, q_.data(), s, 5, out.data()), "seq 3");
  expect_invalid(cpu::snapkv_scores(kv, 0, 5, 8, q_.data(), s, 5, out.data()), "layer 5");
  expect_invalid(cpu::snapkv_scores(kv, 0, 0, 0, q_.data(), s, 5, out.data()), "num_obs 0");
  expect_invalid(cpu::snapkv_scores(kv, 0, 0, 41, q_.data(), s, 5, out.data()), "num_obs 41");
  expect_invalid(cpu::snapkv_scores(kv, 0, 0, 8, q_.data(), s, 4, out.data()), "pool 4");
  expect_invalid(cpu::snapkv_scores(kv, 0, 0, 8, q_.data(), s, 0, out.data()), "pool 0");
  expect_invalid(cpu::snapkv_scores(kv, 0, 0, 8, nullptr, s, 5, out.data()), "non-null");
  expect_invalid(cpu::snapkv_scores(kv, 0, 0, 8, q_.data(), INFINITY, 5, out.data()), "scale");
  cache_->set_seq_len(0, 0);
  expect_invalid(cpu::snapkv_scores(cache_->view(), 0, 0, 1, q_.data(), s, 5, out.data()), "empty");
  // A table too short for seq_len.
  cache_->set_seq_len(0, 49);
  expect_invalid(cpu::snapkv_scores(cache_->view(), 0, 0, 8, q_.data(), s, 5, out.data()), "blocks in its table");
}

TEST_F(CompressInvalidArgumentTest, TopKAndToken2Chunk) {
  const std::vector<float> s = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f};
  std::vector<int32_t> out(8);
  expect_invalid(cpu::top_k(s.data(), 1, 6, 7, out.data()), "k 7");
  expect_invalid(cpu::top_k(s.data(), 1, 6, -1, out.data()), "k -1");
  expect_invalid(cpu::top_k(nullptr, 1, 6, 2, out.data()), "scores is null");
  expect_invalid(cpu::top_k(s.data(), 1, 6, 2, nullptr), "out is null");
  expect_invalid(cpu::top_k(s.data(), 1, -1, 0, out.data()), "n -1");
  const std::vector<float> with_nan = {0.1f, NAN, 0.3f};
  expect_invalid(cpu::top_k(with_nan.data(), 1, 3, 1, out.data()), "scores[0][1] (row, slot) is NaN");
  // Rows: at least one; a NaN is named by its row and slot.
  expect_invalid(cpu::top_k(s.data(), 0, 6, 2, out.data()), "rows 0 must be >= 1");
  expect_invalid(cpu::top_k(s.data(), -1, 6, 2, out.data()), "rows -1");
  expect_invalid(cpu::top_k(with_nan.data(), 3, 1, 1, out.data()), "scores[1][0] (row, slot) is NaN");
  expect_invalid(cpu::token2chunk(s.data(), 0, 6, 3, 2, 3, out.data()), "rows 0 must be >= 1");
  EXPECT_TRUE(cpu::top_k(s.data(), 1, 6, 0, nullptr).is_ok());

  expect_invalid(cpu::token2chunk(s.data(), 1, 6, 7, 2, 3, out.data()), "budget 7");
  expect_invalid(cpu::token2chunk(s.data(), 1, 6, -1, 0, 3, out.data()), "budget -1");
  expect_invalid(cpu::token2chunk(s.data(), 1, 6, 3, 4, 3, out.data()), "num_candidates 4");
  expect_invalid(cpu::token2chunk(s.data(), 1, 6, 3, -1, 3, out.data()), "num_candidates -1");
  expect_invalid(cpu::token2chunk(s.data(), 1, 6, 3, 2, -1, out.data()), "max_gap -1");
  expect_invalid(cpu::token2chunk(s.data(), 1, 6, 3, 2, 3, nullptr), "out is null");
  expect_invalid(cpu::token2chunk(nullptr, 1, 6, 3, 2, 3, out.data()), "scores is null");
  expect_invalid(cpu::token2chunk(with_nan.data(), 1, 3, 2, 1, 3, out.data()), "NaN");
}

TEST_F(CompressInvalidArgumentTest, GatherTokensChangesNothingOnError) {
  const PagedKV kv = cache_->view();
  const int rows = geo_.num_layers * geo_.num_kv_heads;
  const int num_kept = 20;  // two destination blocks
  std::vector<int32_t> kept;
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < num_kept; ++i) kept.push_back(2 * i);
  const std::vector<int32_t> dst = {spare_block(0), spare_block(1)};
  const std::vector<uint8_t> before = cache_->pool_bytes();
  auto expect_gather_invalid = [&](const PagedKV& v, int seq, const std::vector<int32_t>& k, int n,
                                   const std::vector<int32_t>& d, const std::string& needle) {
    expect_invalid(cpu::gather_tokens(v, seq, k.data(), n, d.data()), needle);
    EXPECT_TRUE(cache_->pool_bytes() == before) << needle;
  };
  expect_gather_invalid(kv, 1, kept, num_kept, dst, "seq 1");
  expect_gather_invalid(kv, 0, kept, 41, dst, "num_kept 41");
  expect_gather_invalid(kv, 0, kept, -1, dst, "num_kept -1");
  std::vector<int32_t> bad = kept;
  bad[3 * num_kept + 19] = 40;  // last row, past seq_len
  expect_gather_invalid(kv, 0, bad, num_kept, dst, "out of range [0, 40)");
  bad = kept;
  bad[num_kept + 5] = bad[num_kept + 4];  // layer 0 head 1 repeats a slot
  expect_gather_invalid(kv, 0, bad, num_kept, dst, "[head 1] is not strictly ascending at index 5");
  bad = kept;
  bad[0] = -2;
  expect_gather_invalid(kv, 0, bad, num_kept, dst, "= -2");
  expect_gather_invalid(kv, 0, kept, num_kept, {dst[0], -1}, "destination block id -1");
  expect_gather_invalid(kv, 0, kept, num_kept, {dst[0], dst[0]}, "listed twice");
  expect_gather_invalid(kv, 0, kept, num_kept, {dst[0], cache_->block_table()[1]}, "(a source)");
  EXPECT_EQ(cpu::gather_tokens(kv, 0, nullptr, num_kept, dst.data()).code, KernelStatus::Code::kInvalidArgument);
  EXPECT_EQ(cpu::gather_tokens(kv, 0, kept.data(), num_kept, nullptr).code, KernelStatus::Code::kInvalidArgument);
  EXPECT_TRUE(cpu::gather_tokens(kv, 0, kept.data(), num_kept, dst.data()).is_ok());
}

}  // namespace
}  // namespace karakv::kernels::test
