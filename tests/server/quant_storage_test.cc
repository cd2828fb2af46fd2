// Quantized storage in the registry: tokens age out of the full-precision window into quantized
// blocks, attention straight from the codes equals attention over the dequantized cache that
// ReadKV returns, composition with Kara, and honest byte accounting.
#include <cmath>
#include <random>

#include "common/synthetic.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "karakv/kernels/half.h"
#include "server/core.h"
#include "tests/server/delegating_backend.h"
#include "tests/server/test_geometry.h"

namespace karakv::server {
namespace {

using ::testing::HasSubstr;
using synthetic::Tensor;

kernels::Geometry geometry() { return testing::small_test_geometry(kernels::DType::kFloat16, 32, 16); }

// One whole decode step of a batch: token pos[i] of seqs[i] (values keyed by keys[i], seeded by
// `seed`). Fills `outs` with each layer's attention outputs ([L][batch][Hq][D]) when given.
absl::Status step_tokens(Core& reg, const std::string& session, absl::Span<const uint64_t> seqs,
                         absl::Span<const uint64_t> keys, absl::Span<const int64_t> pos, uint64_t seed,
                         std::vector<float>* outs = nullptr) {
  const auto& g = reg.geometry();
  const size_t n = seqs.size(), kr = g.kv_token_elems(), qr = g.q_token_elems();
  if (outs) outs->assign(size_t(g.num_layers) * n * qr, 0.0f);
  for (int l = 0; l < g.num_layers; ++l) {
    std::vector<uint16_t> k(n * kr), v(k.size());
    std::vector<float> q(n * qr), out(q.size());
    for (size_t i = 0; i < n; ++i) {
      synthetic::fill_token(k.data() + i * kr, g, seed, Tensor::kKey, keys[i], l, pos[i]);
      synthetic::fill_token(v.data() + i * kr, g, seed, Tensor::kValue, keys[i], l, pos[i]);
      synthetic::fill_query(q.data() + i * qr, g, seed, keys[i], l, pos[i]);
    }
    auto r = reg.step(session, l, seqs, ConstBytes(reinterpret_cast<uint8_t*>(k.data()), k.size() * 2),
                      ConstBytes(reinterpret_cast<uint8_t*>(v.data()), v.size() * 2),
                      ConstBytes(reinterpret_cast<uint8_t*>(q.data()), q.size() * 4),
                      MutableBytes(reinterpret_cast<uint8_t*>(out.data()), out.size() * 4), 0.0f);
    if (!r.ok()) return r.status();
    if (outs) std::copy(out.begin(), out.end(), outs->begin() + size_t(l) * n * qr);
  }
  return absl::OkStatus();
}

// step_tokens for one sequence whose values are keyed by `key`.
absl::Status step_token(Core& reg, const std::string& session, uint64_t seq, uint64_t key, uint64_t seed,
                        int64_t pos, std::vector<float>* outs = nullptr) {
  return step_tokens(reg, session, {seq}, {key}, {pos}, seed, outs);
}

// Appends an n-token prompt to seq (values keyed by `key`, seeded by `seed`).
absl::Status append_prompt(Core& reg, const std::string& session, uint64_t seq, uint64_t key, uint64_t seed, int n) {
  const auto& g = reg.geometry();
  std::vector<uint8_t> k(reg.append_bytes(n)), v(k.size());
  synthetic::fill_prompt(k.data(), g, seed, Tensor::kKey, key, 0, n);
  synthetic::fill_prompt(v.data(), g, seed, Tensor::kValue, key, 0, n);
  return reg.append(session, seq, n, k, v).status();
}

class QuantStorageFixture : public ::testing::Test {
 protected:
  void SetUp() override { start(kernels::make_cpu_backend(2)); }

  void start(std::unique_ptr<kernels::Backend> backend) {
    CoreConfig c;
    c.geometry = geometry();
    c.pool_bytes = 512ll * c.geometry.block_bytes();
    reg_ = std::move(*Core::create(c, std::move(backend)));
    session_ = reg_->attach("w", "t", 0, kernels::Geometry{})->session_id;
  }

  uint64_t create(const std::string& policy, std::map<std::string, double> params) {
    SequenceOptions o;
    o.policy = policy;
    o.params = std::move(params);
    auto id = reg_->create_sequence(session_, o);
    EXPECT_TRUE(id.ok()) << id.status();
    return *id;
  }

  void append(uint64_t seq, int n) { ASSERT_TRUE(append_prompt(*reg_, session_, seq, seq, 7, n).ok()); }

  // Dense K/V as the model sees them (dequantized), [L][T][Hk][D] as doubles.
  void read(uint64_t seq, std::vector<double>* k, std::vector<double>* v, int* n) {
    const auto& g = reg_->geometry();
    std::vector<uint8_t> kb, vb, pb;
    auto r = reg_->read_kv(session_, seq, [&](int32_t t) -> absl::StatusOr<ReadKVTargets> {
      kb.resize(reg_->append_bytes(t));
      vb.resize(kb.size());
      pb.resize(size_t(g.num_layers) * g.num_kv_heads * t * 4);
      return ReadKVTargets{MutableBytes(kb), MutableBytes(vb), MutableBytes(pb)};
    });
    ASSERT_TRUE(r.ok()) << r.status();
    *n = *r;
    k->resize(kb.size() / 2);
    v->resize(vb.size() / 2);
    for (size_t i = 0; i < k->size(); ++i) {
      (*k)[i] = kernels::half_to_float(reinterpret_cast<uint16_t*>(kb.data())[i]);
      (*v)[i] = kernels::half_to_float(reinterpret_cast<uint16_t*>(vb.data())[i]);
    }
  }

  // Decodes `steps` tokens of every sequence of `seqs` in one batch, sequence i from position
  // pos[i], comparing each layer's output with float64 attention over that sequence's dequantized
  // cache read just before (plus the new token). Returns the largest absolute difference.
  double decode_and_compare(std::vector<uint64_t> seqs, std::vector<int64_t> pos, int steps) {
    const auto& g = reg_->geometry();
    const int gs = g.group_size(), d = g.head_dim;
    const size_t batch = seqs.size();
    double max_err = 0;
    for (int t = 0; t < steps; ++t) {
      std::vector<std::vector<double>> kd(batch), vd(batch);
      std::vector<int> n(batch);
      for (size_t i = 0; i < batch; ++i) read(seqs[i], &kd[i], &vd[i], &n[i]);
      std::vector<float> outs;
      absl::Status st = step_tokens(*reg_, session_, seqs, seqs, pos, 7, &outs);
      EXPECT_TRUE(st.ok()) << st;
      for (size_t i = 0; i < batch; ++i) {
        for (int l = 0; l < g.num_layers; ++l) {
          // The token the step appended, regenerated for the reference.
          std::vector<uint16_t> k(g.kv_token_elems()), v(k.size());
          std::vector<float> q(g.q_token_elems());
          synthetic::fill_token(k.data(), g, 7, Tensor::kKey, seqs[i], l, pos[i]);
          synthetic::fill_token(v.data(), g, 7, Tensor::kValue, seqs[i], l, pos[i]);
          synthetic::fill_query(q.data(), g, 7, seqs[i], l, pos[i]);
          const float* out = outs.data() + (size_t(l) * batch + i) * g.q_token_elems();
          const int len = n[i];
          for (int qh = 0; qh < g.num_q_heads; ++qh) {
            const int h = qh / gs;
            std::vector<double> s(len + 1);
            auto key = [&](int j, int c) {
              return j < len ? kd[i][((size_t(l) * len + j) * g.num_kv_heads + h) * d + c]
                             : double(kernels::half_to_float(k[h * d + c]));
            };
            auto val = [&](int j, int c) {
              return j < len ? vd[i][((size_t(l) * len + j) * g.num_kv_heads + h) * d + c]
                             : double(kernels::half_to_float(v[h * d + c]));
            };
            double mx = -INFINITY, sum = 0;
            for (int j = 0; j <= len; ++j) {
              double dot = 0;
              for (int c = 0; c < d; ++c) dot += q[qh * d + c] * key(j, c);
              s[j] = dot / std::sqrt(double(d));
              mx = std::max(mx, s[j]);
            }
            for (double& x : s) sum += (x = std::exp(x - mx));
            for (int c = 0; c < d; ++c) {
              double o = 0;
              for (int j = 0; j <= len; ++j) o += s[j] / sum * val(j, c);
              max_err = std::max(max_err, std::abs(o - out[qh * d + c]));
            }
          }
        }
        ++pos[i];
      }
    }
    return max_err;
  }
  double decode_and_compare(uint64_t seq, int64_t pos, int steps) { return decode_and_compare(std::vector<uint64_t>{seq}, std::vector<int64_t>{pos}, steps);
  }

  std::unique_ptr<Core> reg_;
  std::string session_;
};

class QuantStorageTest : public QuantStorageFixture, public ::testing::WithParamInterface<const char*> {};

TEST_P(QuantStorageTest, AttentionFromCodesEqualsAttentionOverDequantizedCache) {
  const std::string format = GetParam();
  const uint64_t seq = create("none+" + format, {{"residual", 16}});
  append(seq, 150);
  SequenceInfo info = reg_->inspect(seq)->first;
  EXPECT_EQ(info.storage, format);
  EXPECT_GT(info.quantized, 0);
  EXPECT_LE(info.length - info.quantized, 16 + info.quantized_blocks * 0 + 160) << "window";
  // ReadKV hands back the dequantized values rounded to the fp16 storage dtype (relative 2^-11),
  // while attention uses them unrounded: with |v| <= 1 that bounds the difference near 5e-4; a
  // mis-addressed block or code would be off by ~1e-1.
  EXPECT_LE(decode_and_compare(seq, 150, 40), 1e-4);
  info = reg_->inspect(seq)->first;
  // Only tokens older than the residual window are quantized, a block at a time.
  EXPECT_GE(info.length - info.quantized, 16);
  EXPECT_EQ(info.length, 190);
  EXPECT_TRUE(reg_->check_invariants().ok()) << reg_->check_invariants();
  // Honest accounting: every block counts whole; quantized blocks hold more tokens than full ones.
  EXPECT_EQ(info.kv_bytes, uint64_t(info.blocks) * reg_->geometry().block_bytes());
  EXPECT_EQ(info.fp16_bytes, 190ull * 2 * 2 * 32 * 2 * 2);
  EXPECT_GT(double(info.fp16_bytes) / double(info.kv_bytes), 1.3);
  ASSERT_TRUE(reg_->release_sequence(session_, seq).ok());
  EXPECT_EQ(reg_->stats().blocks_used, 0);
}

TEST_P(QuantStorageTest, DequantizedCacheStaysCloseToWhatWasWritten) {
  const std::string format = GetParam();
  const uint64_t seq = create("none+" + format, {{"residual", 0}});
  append(seq, 128);
  std::vector<double> kd, vd;
  int n = 0;
  read(seq, &kd, &vd, &n);
  ASSERT_EQ(n, 128);
  const auto& g = reg_->geometry();
  std::vector<uint16_t> want(reg_->append_bytes(n) / 2);
  synthetic::fill_prompt(want.data(), g, 7, Tensor::kKey, seq, 0, n);
  double err = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double w = kernels::half_to_float(want[i]);
    err += (kd[i] - w) * (kd[i] - w);
    norm += w * w;
  }
  // Relative MSE bounds of the methods on uniform inputs: generous multiples of 4-bit (~0.01)
  // and 2-bit (~0.12) distortions.
  const double bound = format.back() == '4' ? 0.02 : format.back() == '3' ? 0.06 : 0.2;
  EXPECT_LT(err / norm, bound) << format;
  EXPECT_GT(err / norm, 0.0) << "quantized storage must not be lossless";
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantStorageTest, ::testing::Values("kivi2", "kivi4", "tq2", "tq3", "tq4"));

// The batch sizes of each layer-0 attention call, by kind ('q' quantized, 'p' plain).
class CallSizesBackend final : public karakv::testing::DelegatingBackend {
 public:
  explicit CallSizesBackend(std::vector<std::pair<char, int>>* calls)
      : DelegatingBackend(kernels::make_cpu_backend(2)), calls_(calls) {}
  KernelStatus decode_attention(const PagedKV& kv, int layer, const float* q, float* out, float scale) override {
    if (layer == 0) calls_->emplace_back('p', kv.num_seqs);
    return DelegatingBackend::decode_attention(kv, layer, q, out, scale);
  }
  KernelStatus decode_attention_quantized(const PagedKV& kv, const QuantizedKV& qkv, int layer, const float* q,
                                          float* out, float scale, float* const* score_acc, const int32_t* acc_begin,
                                          float* const* lse) override {
    if (layer == 0) calls_->emplace_back('q', kv.num_seqs);
    return DelegatingBackend::decode_attention_quantized(kv, qkv, layer, q, out, scale, score_acc, acc_begin, lse);
  }

 private:
  std::vector<std::pair<char, int>>* calls_;
};

class QuantBatchTest : public QuantStorageFixture {
 protected:
  void SetUp() override { start(std::make_unique<CallSizesBackend>(&calls_)); }
  std::vector<std::pair<char, int>> calls_;
};

// Quantized sequences of one format share one kernel call per layer whatever their lengths, other
// formats and unquantized sequences get their own, and every sequence's output is still float64
// attention over its own dequantized cache (a sequence attended with another's rotation or tables
// would be off by far more than the bound).
TEST_F(QuantBatchTest, SequencesOfOneFormatShareAKernelCall) {
  std::vector<uint64_t> seqs;
  std::vector<int64_t> pos;
  // kivi4 at three lengths, tq4 at two, tq2, one unquantized, one quantized-to-be (shorter than its
  // residual window, so nothing is quantized yet).
  const std::vector<std::pair<std::string, int>> made = {{"none+kivi4", 150}, {"none+tq4", 170}, {"none+kivi4", 230},
                                                         {"none", 90},        {"none+tq2", 200}, {"none+tq4", 300},
                                                         {"none+kivi4", 12},  {"none+kivi4", 260}};
  for (const auto& [policy, tokens] : made) {
    std::map<std::string, double> params;
    if (policy != "none") params["residual"] = 16;
    seqs.push_back(create(policy, params));
    append(seqs.back(), tokens);
    pos.push_back(tokens);
  }
  EXPECT_EQ(reg_->inspect(seqs[6])->first.quantized, 0);
  calls_.clear();
  EXPECT_LE(decode_and_compare(seqs, pos, 3), 1e-4);
  // Per step: the two unquantized sequences together, kivi4's three quantized ones, tq4's two,
  // tq2's one.
  std::vector<std::pair<char, int>> per_step = {{'p', 2}, {'q', 3}, {'q', 2}, {'q', 1}};
  std::vector<std::pair<char, int>> want;
  for (int t = 0; t < 3; ++t) want.insert(want.end(), per_step.begin(), per_step.end());
  EXPECT_EQ(calls_, want);
  EXPECT_TRUE(reg_->check_invariants().ok()) << reg_->check_invariants();
}

// With quantized storage Kara's budget defaults to 0: a budget keeps the whole region open for its
// re-ranks, so nothing would ever be quantized; version 2's windows are final and age into it.
TEST_F(QuantStorageFixture, KaraWithQuantizedStorageDefaultsToFinalWindows) {
  const std::map<std::string, double> params = {{"window", 64}, {"period", 4}, {"recent", 32}};
  std::map<std::string, double> stored = params;
  stored["residual"] = 16;
  const uint64_t seq = create("kara+kivi4", stored);
  ASSERT_TRUE(append_prompt(*reg_, session_, seq, seq, 3, 40).ok());
  for (int64_t pos = 40; pos < 400; ++pos) ASSERT_TRUE(step_token(*reg_, session_, seq, seq, 3, pos).ok());
  const SequenceInfo info = reg_->inspect(seq)->first;
  EXPECT_EQ(info.params.at("budget"), 0);
  EXPECT_EQ(info.params.at("fit"), 0);
  EXPECT_GE(info.compactions, 4);
  EXPECT_GT(info.quantized, 0);
  // Without storage the same request gets the default budget.
  EXPECT_EQ(reg_->inspect(create("kara", params))->first.params.at("budget"), 768);
}

TEST(QuantStorageCompositionTest, KaraCompactsThenQuantizesOnlyWhatItWillNeverTouch) {
  CoreConfig c;
  c.geometry = geometry();
  c.pool_bytes = 512ll * c.geometry.block_bytes();
  auto reg = std::move(*Core::create(c, kernels::make_cpu_backend(2)));
  const std::string session = reg->attach("w", "t", 0, kernels::Geometry{})->session_id;
  SequenceOptions o;
  o.policy = "kara+kivi4";
  o.params = {{"window", 64}, {"period", 4}, {"recent", 0}, {"residual", 16}, {"budget", 0}};  // B = 16: one block per window
  const uint64_t seq = *reg->create_sequence(session, o);
  ASSERT_TRUE(append_prompt(*reg, session, seq, seq, 3, 40).ok());
  for (int64_t pos = 40; pos < 400; ++pos) {
    ASSERT_TRUE(step_token(*reg, session, seq, seq, 3, pos).ok());
    ASSERT_TRUE(reg->check_invariants().ok()) << reg->check_invariants();
  }
  const SequenceInfo info = reg->inspect(seq)->first;
  EXPECT_EQ(info.policy, "kara+kivi4");
  EXPECT_GE(info.compactions, 4);  // 360 decode steps, a 64-token window each ~64 steps
  EXPECT_GT(info.quantized, 0);
  // Kara's kept tokens (and the prompt) are what got quantized: the tail never is.
  EXPECT_LT(info.quantized, info.length - 16);
  EXPECT_LT(info.length, 400);
  const CoreStats st = reg->stats();
  const PolicyStats& ps = st.policies.at("kara+kivi4");
  EXPECT_GT(double(ps.fp16_bytes) / double(ps.kv_bytes), 2.0);
  EXPECT_EQ(ps.nominal_ratio, 4.0);
}

// What the decode and window scorers are handed for Kara's observers over quantized storage.
class ObserverSpyBackend final : public karakv::testing::DelegatingBackend {
 public:
  struct Seen {
    int quantized_calls = 0, with_begin = 0, with_lse = 0, begin_inside_quantized = 0;
    int window_rows = 0, window_rows_normalised = 0;
  };
  explicit ObserverSpyBackend(Seen* seen) : DelegatingBackend(kernels::make_cpu_backend(1)), seen_(seen) {}
  KernelStatus decode_attention_quantized(const PagedKV& kv, const QuantizedKV& qkv, int layer, const float* q,
                                          float* out, float scale, float* const* score_acc, const int32_t* acc_begin,
                                          float* const* lse) override {
    ++seen_->quantized_calls;
    bool any_lse = false;
    for (int s = 0; lse != nullptr && s < kv.num_seqs; ++s) any_lse |= lse[s] != nullptr;
    seen_->with_lse += any_lse;
    if (acc_begin != nullptr) {
      ++seen_->with_begin;
      for (int s = 0; s < kv.num_seqs; ++s) seen_->begin_inside_quantized += acc_begin[s] < qkv.quantized(s);
    }
    return DelegatingBackend::decode_attention_quantized(kv, qkv, layer, q, out, scale, score_acc, acc_begin, lse);
  }
  KernelStatus window_scores_observed(const PagedKV& kv, int seq, int layer, int slot_begin, int window,
                                      const float* q, float scale, const float* lse, bool later_keys_only,
                                      float* out) override {
    const int hq = kv.geometry.num_q_heads;
    for (int t = 0; t < window; ++t) {
      bool normalised = lse != nullptr;
      for (int j = 0; normalised && j < hq; ++j) normalised = std::isfinite(lse[size_t(t) * hq + j]);
      ++seen_->window_rows;
      seen_->window_rows_normalised += normalised;
    }
    return DelegatingBackend::window_scores_observed(kv, seq, layer, slot_begin, window, q, scale, lse,
                                                     later_keys_only, out);
  }

 private:
  Seen* seen_;
};

// Kara's norm = full over quantized storage: a decode step over quantized blocks records each query
// head's log-sum-exp, so every window query Kara scores is divided by its own decode step's
// normaliser (none falls back to the window's softmax), and the decode observers accumulate only
// Kara's tail, which is never quantized.
TEST(QuantStorageCompositionTest, KaraNormFullAndDecodeObserversWorkOverQuantizedBlocks) {
  ObserverSpyBackend::Seen seen;
  CoreConfig c;
  c.geometry = geometry();
  c.pool_bytes = 512ll * c.geometry.block_bytes();
  auto reg = std::move(*Core::create(c, std::make_unique<ObserverSpyBackend>(&seen)));
  const std::string session = reg->attach("w", "t", 0, kernels::Geometry{})->session_id;
  SequenceOptions o;
  o.policy = "kara+kivi4";
  o.params = {{"window", 64}, {"period", 4}, {"recent", 32}, {"residual", 16}, {"norm", 1}, {"observers", 2}};
  const uint64_t seq = *reg->create_sequence(session, o);
  ASSERT_TRUE(append_prompt(*reg, session, seq, seq, 3, 40).ok());
  for (int64_t pos = 40; pos < 500; ++pos) ASSERT_TRUE(step_token(*reg, session, seq, seq, 3, pos).ok());
  const SequenceInfo info = reg->inspect(seq)->first;
  EXPECT_GE(info.compactions, 4);
  EXPECT_GT(info.quantized, 0);
  EXPECT_EQ(reg->stats().policies.at("kara+kivi4").failures, 0u);
  EXPECT_GT(seen.quantized_calls, 0);
  EXPECT_EQ(seen.with_lse, seen.quantized_calls);
  EXPECT_EQ(seen.with_begin, seen.quantized_calls);
  EXPECT_EQ(seen.begin_inside_quantized, 0);
  EXPECT_GT(seen.window_rows, 0);
  EXPECT_EQ(seen.window_rows_normalised, seen.window_rows);
  EXPECT_TRUE(reg->check_invariants().ok()) << reg->check_invariants();
}

// Kara's two levels over quantized storage: level 1 may be compressed again, so it stays in full
// precision and keeps accumulating; the decode observers never begin inside the quantized prefix,
// and second-level windows take the sequence below what one level keeps.
TEST(QuantStorageCompositionTest, KaraTwoLevelsQuantizeOnlyWhatLevelTwoWillNeverTouchAgain) {
  ObserverSpyBackend::Seen seen;
  CoreConfig c;
  c.geometry = geometry();
  c.pool_bytes = 1024ll * c.geometry.block_bytes();
  auto reg = std::move(*Core::create(c, std::make_unique<ObserverSpyBackend>(&seen)));
  const std::string session = reg->attach("w", "t", 0, kernels::Geometry{})->session_id;
  SequenceOptions o;
  o.policy = "kara+kivi4";
  o.params = {{"window", 64}, {"rho", 0.5}, {"period", 4}, {"recent", 0}, {"residual", 16}};
  const uint64_t one = *reg->create_sequence(session, o);
  o.params["rho2"] = 0.25;  // B2 = 16
  const uint64_t two = *reg->create_sequence(session, o);
  for (uint64_t seq : {one, two}) ASSERT_TRUE(append_prompt(*reg, session, seq, seq, 3, 40).ok());
  for (int64_t pos = 40; pos < 700; ++pos) {
    for (uint64_t seq : {one, two}) ASSERT_TRUE(step_token(*reg, session, seq, seq, 3, pos).ok());
  }
  const SequenceInfo a = reg->inspect(one)->first, b = reg->inspect(two)->first;
  EXPECT_GT(b.compactions, a.compactions) << "no second-level window ran";
  EXPECT_LT(b.length, a.length - 64);
  EXPECT_GT(b.quantized, 0);
  EXPECT_EQ(reg->stats().policies.at("kara+kivi4").failures, 0u);
  EXPECT_GT(seen.with_begin, 0);
  EXPECT_EQ(seen.begin_inside_quantized, 0);
  EXPECT_TRUE(reg->check_invariants().ok()) << reg->check_invariants();
}

// The window Kara scores is never quantized, so quantizing the prompt and the compressed region
// must not change which tokens Kara keeps.
TEST(QuantStorageCompositionTest, KaraKeepsTheSameTokensWithOrWithoutQuantizedStorage) {
  std::vector<std::vector<int32_t>> kept[2];
  for (int quantized = 0; quantized < 2; ++quantized) {
    CoreConfig c;
    c.geometry = geometry();
    c.pool_bytes = 512ll * c.geometry.block_bytes();
    auto reg = std::move(*Core::create(c, kernels::make_cpu_backend(1)));
    const std::string session = reg->attach("w", "t", 0, kernels::Geometry{})->session_id;
    SequenceOptions o;
    o.policy = quantized ? "kara+tq4" : "kara";
    // The window's own queries score it (version 1): decode observers would see the quantized
    // prefix's dequantized keys, which is not what this test is about.
    o.params = {{"window", 64}, {"period", 4}, {"recent", 0}, {"observers", 0}};
    if (quantized) o.params["residual"] = 0;
    const uint64_t seq = *reg->create_sequence(session, o);
    ASSERT_TRUE(append_prompt(*reg, session, seq, 1, 5, 100).ok());
    for (int64_t pos = 100; pos < 330; ++pos) ASSERT_TRUE(step_token(*reg, session, seq, 1, 5, pos).ok());
    const SequenceInfo info = reg->inspect(seq)->first;
    EXPECT_GE(info.compactions, 2);
    if (quantized) {
      EXPECT_GT(info.quantized, 100);
    }
    EXPECT_EQ(reg->stats().policies.begin()->second.failures, 0u);
    kept[quantized] = reg->inspect(seq)->second;
  }
  EXPECT_EQ(kept[0], kept[1]);
}

// The baselines recompress the whole cache, quantized prefix included: the prefix is dequantized
// for them, the survivors re-quantized as they age out again. Attention stays exactly attention
// over what ReadKV shows, and the pool invariant holds throughout.
TEST_P(QuantStorageTest, ThresholdPoliciesRecompressQuantizedCaches) {
  const std::string format = GetParam();
  for (const char* policy : {"snapkv", "streaming", "h2o", "chunkkv"}) {
    std::map<std::string, double> params = {{"residual", 16}, {"c_max", 200}, {"c_target", 120}};
    if (std::string(policy) == "snapkv" || std::string(policy) == "chunkkv") params["w_obs"] = 8;
    const uint64_t seq = create(std::string(policy) + "+" + format, params);
    append(seq, 150);
    EXPECT_GT(reg_->inspect(seq)->first.quantized, 0);
    // Dry run first: nothing changes.
    const auto before = reg_->inspect(seq)->second;
    const uint64_t used = reg_->stats().blocks_used;
    EXPECT_TRUE(reg_->compact(session_, seq, true).ok());
    EXPECT_EQ(reg_->inspect(seq)->second, before);
    EXPECT_EQ(reg_->stats().blocks_used, used);
    EXPECT_LE(decode_and_compare(seq, 150, 70), 1e-4) << policy << "+" << format;
    const SequenceInfo info = reg_->inspect(seq)->first;
    EXPECT_GE(info.compactions, 1) << policy;
    EXPECT_LT(info.length, 200);
    EXPECT_GT(info.quantized, 0) << "survivors are quantized again";
    EXPECT_EQ(reg_->stats().policies[info.policy].failures, 0u);
    ASSERT_TRUE(reg_->check_invariants().ok()) << reg_->check_invariants();
    ASSERT_TRUE(reg_->release_sequence(session_, seq).ok());
  }
  EXPECT_EQ(reg_->stats().blocks_used, 0);
}

// A threshold compaction of a quantized cache runs on a dequantized copy that shares the
// sequence's unquantized blocks. When it fails after the copy was gathered (here the policy cannot
// remap its state), the copy is dropped and the sequence is exactly as it was: its K/V, positions
// and blocks, and the pool's reference counts. Afterwards it still compacts.
TEST_P(QuantStorageTest, FailedCompactionOfAQuantizedCacheLeavesItExactlyAsItWas) {
  const std::string format = GetParam();
  const uint64_t seq = create("test_keep_newest+" + format,
                              {{"residual", 16}, {"c_max", 1000}, {"c_target", 40}, {"fail_remap", 1}});
  append(seq, 150);
  ASSERT_GT(reg_->inspect(seq)->first.quantized, 0);
  std::vector<double> k0, v0, k1, v1;
  int n0 = 0, n1 = 0;
  read(seq, &k0, &v0, &n0);
  const auto before = *reg_->inspect(seq);
  const int64_t used = reg_->stats().blocks_used;
  auto r = reg_->compact(session_, seq, false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
  ASSERT_TRUE(reg_->check_invariants().ok()) << reg_->check_invariants();
  EXPECT_EQ(reg_->stats().blocks_used, used);
  const auto after = *reg_->inspect(seq);
  EXPECT_EQ(after.second, before.second);
  EXPECT_EQ(after.first.length, before.first.length);
  EXPECT_EQ(after.first.quantized, before.first.quantized);
  EXPECT_EQ(after.first.blocks, before.first.blocks);
  read(seq, &k1, &v1, &n1);
  EXPECT_EQ(n1, n0);
  EXPECT_TRUE(k1 == k0) << "K changed by a compaction that failed";
  EXPECT_TRUE(v1 == v0) << "V changed by a compaction that failed";
  ASSERT_TRUE(reg_->release_sequence(session_, seq).ok());
  EXPECT_EQ(reg_->stats().blocks_used, 0);
}

TEST(QuantStorageCompositionTest, RefusesWhatItCannotServeNamingWhy) {
  CoreConfig c;
  c.geometry = geometry();
  c.pool_bytes = 64ll * c.geometry.block_bytes();
  auto reg = std::move(*Core::create(c, kernels::make_cpu_backend(1)));
  const std::string session = reg->attach("w", "t", 0, kernels::Geometry{})->session_id;
  SequenceOptions o;
  o.policy = "none+kivi8";
  EXPECT_THAT(std::string(reg->create_sequence(session, o).status().message()), HasSubstr("unknown storage 'kivi8'"));
  o.policy = "none";
  o.storage = "tq4";
  o.params = {{"residual", -3}};
  EXPECT_THAT(std::string(reg->create_sequence(session, o).status().message()), HasSubstr("residual=-3"));
  // KIVI needs head_dim % 32 == 0.
  c.geometry.head_dim = 24;
  auto small = std::move(*Core::create(c, kernels::make_cpu_backend(1)));
  const std::string s2 = small->attach("w", "t", 0, kernels::Geometry{})->session_id;
  SequenceOptions k;
  k.policy = "none+kivi4";
  EXPECT_THAT(std::string(small->create_sequence(s2, k).status().message()), HasSubstr("cannot hold head_dim 24"));
}

}  // namespace
}  // namespace karakv::server
