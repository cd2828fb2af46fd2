// Compression policies inside the registry, on random inputs over many seeds: the invariants of
// docs/COMPRESSION.md, and a property test of random Step / Compact / Fork / Release sequences.
#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "common/synthetic.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core.h"
#include "tests/server/core_driver.h"
#include "tests/server/delegating_backend.h"
#include "tests/server/test_geometry.h"
#include "karakv/kernels/half.h"
#include "tests/kernels/token2chunk_reference.h"

namespace karakv::server {
namespace {

using ::testing::HasSubstr;
using synthetic::Tensor;

kernels::Geometry geometry() { return testing::small_test_geometry(kernels::DType::kFloat16); }

// Drives one registry with deterministic random K/V/Q.
class Driver {
 public:
  explicit Driver(uint64_t seed, int blocks = 4096, std::unique_ptr<kernels::Backend> backend = nullptr)
      : seed_(seed) {
    CoreConfig c;
    c.geometry = geometry();
    c.pool_bytes = int64_t(blocks) * c.geometry.block_bytes();
    auto r = Core::create(c, backend != nullptr ? std::move(backend) : kernels::make_cpu_backend(1));
    EXPECT_TRUE(r.ok()) << r.status();
    reg = std::move(*r);
    session = reg->attach("w", "t", 0, kernels::Geometry{})->session_id;
  }

  absl::StatusOr<uint64_t> create(const SequenceOptions& o) { return reg->create_sequence(session, o); }

  // Appends `n` prompt tokens of `seq` starting at position `pos0`, with the queries of the last nq.
  absl::Status append(uint64_t seq, int64_t pos0, int n, int nq = 0) {
    const auto& g = reg->geometry();
    std::vector<uint8_t> k(reg->append_bytes(n)), v(k.size());
    synthetic::fill_prompt(k.data(), g, seed_, Tensor::kKey, seq, pos0, n);
    synthetic::fill_prompt(v.data(), g, seed_, Tensor::kValue, seq, pos0, n);
    std::vector<float> q(size_t(g.num_layers) * nq * g.q_token_elems());
    for (int l = 0; l < g.num_layers; ++l)
      for (int i = 0; i < nq; ++i)
        synthetic::fill_query(q.data() + (size_t(l) * nq + i) * g.q_token_elems(), g, seed_, seq, l, pos0 + n - nq + i);
    return reg->append(session, seq, n, k, v, ConstBytes(reinterpret_cast<uint8_t*>(q.data()), q.size() * 4), nq)
        .status();
  }

  // One whole decode step of every sequence in `seqs`, token positions from `logical`, at softmax
  // scale `scale` (0: the daemon's default, 1/sqrt(head_dim)).
  absl::Status step(const std::vector<uint64_t>& seqs, std::vector<int64_t>& logical, float scale = 0.0f) {
    const auto& g = reg->geometry();
    const size_t kvb = g.kv_token_elems() * 2;
    for (int l = 0; l < g.num_layers; ++l) {
      std::vector<uint8_t> k(kvb * seqs.size()), v(k.size());
      std::vector<float> q(g.q_token_elems() * seqs.size()), out(q.size());
      for (size_t i = 0; i < seqs.size(); ++i) {
        synthetic::fill_token(k.data() + i * kvb, g, seed_, Tensor::kKey, seqs[i], l, logical[i]);
        synthetic::fill_token(v.data() + i * kvb, g, seed_, Tensor::kValue, seqs[i], l, logical[i]);
        synthetic::fill_query(q.data() + i * g.q_token_elems(), g, seed_, seqs[i], l, logical[i]);
      }
      auto r = reg->step(session, l, seqs, k, v, ConstBytes(reinterpret_cast<uint8_t*>(q.data()), q.size() * 4),
                         MutableBytes(reinterpret_cast<uint8_t*>(out.data()), out.size() * 4), scale);
      if (!r.ok()) return r.status();
    }
    for (auto& p : logical) ++p;
    return absl::OkStatus();
  }

  std::vector<std::vector<int32_t>> positions(uint64_t seq) { return reg->inspect(seq)->second; }
  SequenceInfo info(uint64_t seq) { return reg->inspect(seq)->first; }

  std::unique_ptr<Core> reg;
  std::string session;

 private:
  uint64_t seed_;
};

// Every row sorted, unique, in range, all rows the same length, sinks present.
void expect_well_formed(const std::vector<std::vector<int32_t>>& rows, int32_t logical, int sinks) {
  ASSERT_FALSE(rows.empty());
  for (const auto& r : rows) {
    ASSERT_EQ(r.size(), rows[0].size());
    for (size_t i = 0; i < r.size(); ++i) {
      ASSERT_GE(r[i], 0);
      ASSERT_LT(r[i], logical);
      if (i > 0) {
        ASSERT_LT(r[i - 1], r[i]) << "positions not strictly increasing";
      }
    }
    for (int s = 0; s < std::min(sinks, logical); ++s) ASSERT_EQ(r[s], s) << "sink " << s << " evicted";
  }
}

// Version 2's windows (recent = 16) and version 1's parameter set (recent = 0): exactly B kept per
// window, the prompt and earlier windows never touched, the newest R tokens never in a window, and
// a full window compressed within one period of becoming due.
TEST(KaraPolicyTest, WindowsKeepExactlyBNeverTouchThePromptOrEarlierWindows) {
  for (int recent : {0, 16}) {
    for (uint64_t seed = 1; seed <= 12; ++seed) {
      Driver d(seed);
      std::mt19937 rng(seed);
      SequenceOptions o;
      o.policy = "kara";
      o.params = {{"window", 16}, {"rho", 0.25}, {"period", 4}, {"recent", recent}, {"prompt", 0}, {"budget", 0}};  // B = 4
      const uint64_t seq = *d.create(o);
      const int prompt = 1 + rng() % 23;
      ASSERT_TRUE(d.append(seq, 0, prompt).ok());
      std::vector<int64_t> logical{prompt};
      const int32_t tail_start = (prompt + 3) / 4 * 4;
      std::vector<std::vector<int32_t>> frozen;  // the compressed region after each compaction
      int compactions = 0;
      for (int t = 0; t < 140; ++t) {
        ASSERT_TRUE(d.step({seq}, logical).ok());
        const SequenceInfo info = d.info(seq);
        auto rows = d.positions(seq);
        expect_well_formed(rows, int32_t(logical[0]), 4);
        // The prompt and the tokens sharing its last block are never touched.
        for (const auto& r : rows)
          for (int p = 0; p < std::min<int>(tail_start, logical[0]); ++p) ASSERT_EQ(r[p], p);
        if (int(info.compactions) > compactions) {
          compactions = info.compactions;
          // Exactly B = 4 kept per window: resident = logical - 12 * compactions.
          EXPECT_EQ(int64_t(info.length), logical[0] - 12 * compactions);
          // Earlier windows are unchanged by later compactions.
          for (size_t r = 0; r < rows.size(); ++r) {
            if (frozen.empty()) break;
            for (size_t i = 0; i < frozen[r].size(); ++i) ASSERT_EQ(rows[r][i], frozen[r][i]);
          }
          frozen.assign(rows.size(), {});
          for (size_t r = 0; r < rows.size(); ++r) frozen[r].assign(rows[r].begin(), rows[r].begin() + tail_start + 4 * compactions);
        }
        // The uncompressed tail (everything after the compressed region) is contiguous; it holds at
        // least the recent region and at most W + R + P tokens (due, then at most P steps to a turn).
        const int32_t tail = int32_t(info.length) - (tail_start + 4 * compactions);
        EXPECT_LT(tail, 16 + recent + 4 + 1) << "tail should be compressed within a period of a window being full";
        if (compactions > 0) {
          EXPECT_GE(tail, recent) << "a compaction took a recent token";
          for (const auto& r : rows) {
            for (int i = 0; i < tail; ++i) ASSERT_EQ(r[r.size() - tail + i], logical[0] - tail + i);
          }
        }
      }
      EXPECT_GE(compactions, 6) << "seed " << seed << " recent " << recent;
      ASSERT_TRUE(d.reg->check_invariants().ok());
    }
  }
}

// End to end: the tokens Kara keeps from its first window are the ones docs/COMPRESSION.md section 1
// picks from the queries the decode steps sent and the keys the daemon stored, scored here in
// float64 from the same synthetic values (keys rounded to fp16 as stored) and selected by the plain
// reference of tests/kernels/token2chunk_reference.h. A query cache that held another token's or
// another layer's queries, or a window starting at the wrong slot, changes the kept positions.
TEST(KaraPolicyTest, KeepsWhatAFloat64ReferenceChoosesFromTheStepsQueries) {
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    Driver d(seed);
    const auto& g = d.reg->geometry();
    constexpr int kPrompt = 8, kWindow = 16, kBudget = 8, kCandidates = 4, kMaxGap = 8;
    SequenceOptions o;
    o.policy = "kara";
    // Version 1's parameter set: the window's own queries, softmax over the window, no recent region.
    o.params = {{"window", kWindow}, {"rho", 0.5}, {"period", 4}, {"recent", 0}, {"observers", 0}, {"norm", 0}};
    const uint64_t seq = *d.create(o);
    ASSERT_TRUE(d.append(seq, 0, kPrompt).ok());
    std::vector<int64_t> logical{kPrompt};
    while (d.info(seq).compactions == 0) {
      ASSERT_TRUE(d.step({seq}, logical).ok());
      ASSERT_LT(logical[0], kPrompt + 3 * kWindow) << "Kara never compacted";
    }
    EXPECT_EQ(d.info(seq).compactions, 1u);
    const auto rows = d.positions(seq);  // [L * Hk], each prompt + kept + the rest of the tail
    const int group = g.num_q_heads / g.num_kv_heads;
    const double scale = 1.0 / std::sqrt(double(g.head_dim));
    auto key = [&](int l, int h, int pos, int dim) {
      const float x = synthetic::value(seed, Tensor::kKey, seq, l, pos, h, dim);
      return double(kernels::half_to_float(kernels::float_to_half(x)));
    };
    for (int l = 0; l < g.num_layers; ++l) {
      for (int h = 0; h < g.num_kv_heads; ++h) {
        // s_i = sum over the group's query heads j and window queries t of softmax_i(q_t . k_i).
        std::vector<double> score(kWindow, 0.0);
        for (int j = h * group; j < (h + 1) * group; ++j) {
          for (int t = 0; t < kWindow; ++t) {
            std::vector<double> logits(kWindow);
            double mx = -INFINITY;
            for (int i = 0; i < kWindow; ++i) {
              double dot = 0;
              for (int dim = 0; dim < g.head_dim; ++dim)
                dot += double(synthetic::value(seed, Tensor::kQuery, seq, l, kPrompt + t, j, dim)) *
                       key(l, h, kPrompt + i, dim);
              logits[i] = dot * scale;
              mx = std::max(mx, logits[i]);
            }
            double sum = 0;
            for (double& x : logits) sum += (x = std::exp(x - mx));
            for (int i = 0; i < kWindow; ++i) score[i] += logits[i] / sum;
          }
        }
        const std::vector<float> s(score.begin(), score.end());
        std::vector<int32_t> want = kernels::test::naive_token2chunk(s, kBudget, kCandidates, kMaxGap);
        for (int32_t& x : want) x += kPrompt;
        const auto& row = rows[size_t(l) * g.num_kv_heads + h];
        ASSERT_GE(row.size(), size_t(kPrompt + kBudget));
        const std::vector<int32_t> got(row.begin() + kPrompt, row.begin() + kPrompt + kBudget);
        EXPECT_EQ(got, want) << "seed " << seed << " layer " << l << " kv head " << h;
      }
    }
  }
}

// Version 2's observers against float64: the first window's kept tokens are those Token2Chunk picks
// from scores computed here from the synthetic queries and keys, for every way of observing:
//   decode: s_i = D_i (sum) or D_i / c_i (mean), D_i the decode attention probability key i
//           received at every step since it arrived (summed over the group's query heads), c_i the
//           number of those steps;
//   both:   s_i = D_i + W_i (sum) or D_i / c_i + W_i / i (mean, each part's own), W_i what the window's queries
//           before key i pay it, normalised over the window's keys (norm = window) or over every key
//           the query saw at its own decode step (norm = full).
// Steps run at the daemon's default scale and, with norm = full, at other scales a worker may
// send (Step.scale): the decode probabilities and the window's logits are then taken at the
// Step's scale, so each query's probabilities stay a distribution.
TEST(KaraPolicyTest, DecodeAndBothObserversMatchAFloat64Reference) {
  struct Variant {
    int observers, norm, agg;
    double scale_factor = 1.0;  // the Step's scale in units of 1/sqrt(head_dim)
  };
  for (const Variant v : {Variant{1, 0, 0}, Variant{1, 0, 1}, Variant{2, 0, 0}, Variant{2, 1, 0}, Variant{2, 1, 1},
                          Variant{2, 1, 0, 2.0}, Variant{2, 1, 1, 0.5}, Variant{1, 0, 0, 3.0}}) {
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      Driver d(seed);
      const auto& g = d.reg->geometry();
      constexpr int kPrompt = 8, kWindow = 16, kBudget = 8, kCandidates = 4, kMaxGap = 8, kRecent = 8;
      SequenceOptions o;
      o.policy = "kara";
      o.params = {{"window", kWindow}, {"rho", 0.5}, {"period", 1}, {"recent", kRecent},
                  {"observers", v.observers}, {"norm", v.norm}, {"agg", v.agg}, {"prompt", 0}, {"budget", 0}};
      const uint64_t seq = *d.create(o);
      ASSERT_TRUE(d.append(seq, 0, kPrompt).ok());
      std::vector<int64_t> logical{kPrompt};
      const float step_scale = v.scale_factor == 1.0 ? 0.0f : float(v.scale_factor / std::sqrt(double(g.head_dim)));
      while (d.info(seq).compactions == 0) {
        ASSERT_TRUE(d.step({seq}, logical, step_scale).ok());
        ASSERT_LT(logical[0], kPrompt + 3 * kWindow) << "Kara never compacted";
      }
      // P = 1: compacted at the first step with W + R tail tokens; that step's token is the last
      // whose query observed.
      const int last = int(logical[0]) - 1;
      ASSERT_EQ(last, kPrompt + kWindow + kRecent - 1);
      const auto rows = d.positions(seq);
      const int group = g.num_q_heads / g.num_kv_heads;
      // The Step's scale; the window's own softmax (norm = window) is version 1's, at 1/sqrt(d).
      const double scale = v.scale_factor / std::sqrt(double(g.head_dim));
      const double window_scale = v.norm == 1 ? scale : 1.0 / std::sqrt(double(g.head_dim));
      for (int l = 0; l < g.num_layers; ++l) {
        for (int h = 0; h < g.num_kv_heads; ++h) {
          auto key = [&](int pos, int dim) {
            const float x = synthetic::value(seed, Tensor::kKey, seq, l, pos, h, dim);
            return double(kernels::half_to_float(kernels::float_to_half(x)));
          };
          // logit(query position t, query head j, key position i) at softmax scale `sc`
          auto logit = [&](int t, int j, int i, double sc) {
            double dot = 0;
            for (int dim = 0; dim < g.head_dim; ++dim)
              dot += double(synthetic::value(seed, Tensor::kQuery, seq, l, t, j, dim)) * key(i, dim);
            return dot * sc;
          };
          auto log_sum_exp = [&](int t, int j, int first, int end, double sc) {
            double mx = -INFINITY, sum = 0;
            for (int i = first; i < end; ++i) mx = std::max(mx, logit(t, j, i, sc));
            for (int i = first; i < end; ++i) sum += std::exp(logit(t, j, i, sc) - mx);
            return mx + std::log(sum);
          };
          std::vector<double> received(kWindow, 0.0), seen(kWindow, 0.0), own(kWindow, 0.0);
          for (int t = kPrompt; t <= last; ++t) {  // decode steps: the query at t sees keys 0..t
            for (int j = h * group; j < (h + 1) * group; ++j) {
              const double lse = log_sum_exp(t, j, 0, t + 1, scale);
              for (int i = 0; i < kWindow; ++i) {
                if (kPrompt + i <= t) received[i] += std::exp(logit(t, j, kPrompt + i, scale) - lse);
              }
            }
            for (int i = 0; i < kWindow; ++i) seen[i] += kPrompt + i <= t ? 1 : 0;
          }
          if (v.observers == 2) {
            for (int t = 0; t < kWindow; ++t) {  // window query at kPrompt + t over later window keys
              for (int j = h * group; j < (h + 1) * group; ++j) {
                const int qt = kPrompt + t;
                const double lse = v.norm == 1 ? log_sum_exp(qt, j, 0, qt + 1, window_scale)
                                               : log_sum_exp(qt, j, kPrompt, kPrompt + kWindow, window_scale);
                for (int i = t + 1; i < kWindow; ++i) own[i] += std::exp(logit(qt, j, kPrompt + i, window_scale) - lse);
              }
            }
          }
          std::vector<float> s(kWindow);
          for (int i = 0; i < kWindow; ++i) {
            // agg = mean: each part's own mean (decode steps that saw key i; window queries before it).
            s[i] = float(v.agg == 0 ? received[i] / std::max(1.0, seen[i]) + own[i] / std::max(1.0, double(i))
                                    : received[i] + own[i]);
          }
          std::vector<int32_t> want = kernels::test::naive_token2chunk(s, kBudget, kCandidates, kMaxGap);
          for (int32_t& x : want) x += kPrompt;
          const auto& row = rows[size_t(l) * g.num_kv_heads + h];
          const std::vector<int32_t> got(row.begin() + kPrompt, row.begin() + kPrompt + kBudget);
          EXPECT_EQ(got, want) << "observers " << v.observers << " norm " << v.norm << " agg " << v.agg << " scale x"
                               << v.scale_factor << " seed " << seed << " layer " << l << " kv head " << h;
        }
      }
    }
  }
}

// Parameters outside the contract are refused naming the parameter and what was expected.
TEST(KaraPolicyTest, RefusesParametersOutsideTheContract) {
  Driver d(1);
  auto refused = [&](std::map<std::string, double> params, const std::string& words) {
    SequenceOptions o;
    o.policy = "kara";
    o.params = std::move(params);
    auto r = d.create(o);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << words;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(words));
  };
  refused({{"recent", 6}}, "recent=6 must be a multiple of the block size 4");
  refused({{"observers", 3}}, "observers=3 out of range");
  refused({{"norm", 0.5}}, "norm=0.5 out of range: expected an integer");
  refused({{"agg", -1}}, "agg=-1 out of range");
  refused({{"prompt", 3}}, "prompt=3 out of range");
  refused({{"budget", -1}}, "budget=-1 out of range");
  refused({{"budget", 64}, {"observers", 0}}, "budget=64 needs decode observations (observers=1 decode or 2 both)");
  refused({{"rho2", 1.0}}, "rho2=1 out of range");
  refused({{"rho2", 0.99}, {"window", 16}}, "rho2=0.99 keeps 16 of a 16-token second-level window");
  refused({{"rho2", 0.5}, {"observers", 0}}, "rho2=0.5 needs decode observations");
  refused({{"rho2", 0.5}, {"budget", 64}}, "alternatives to the budget's re-rank; set one of them");
  refused({{"grow", 0.5}, {"budget", 64}}, "grow=0.5 with budget=64");
  refused({{"grow", 0.5}, {"observers", 2}}, "grow=0.5 needs observers=1 (decode); observers=2");
  refused({{"grow", 0.96}}, "grow=0.96 out of range");
  refused({{"fit", 1}, {"budget", 0}}, "fit=1 needs a budget (budget > 0 or share > 0)");
  refused({{"fit", 1}, {"observers", 2}}, "fit=1 needs a budget");
  refused({{"fit", 1}, {"budget", 64}, {"observers", 2}}, "fit=1 needs observers=1 (decode); observers=2");
  refused({{"fit", 3}, {"budget", 64}}, "fit=3 out of range");
  refused({{"fit", 2}, {"budget", 0}}, "fit=2 needs a budget (budget > 0 or share > 0)");
  refused({{"share", 1.0}}, "share=1 out of range");
  refused({{"share", 0.5}, {"budget", 64}}, "budget=64 and share=0.5 both set the memory budget");
  refused({{"share", 0.5}, {"observers", 0}}, "share=0.5 needs decode observations (observers=1 decode or 2 both)");
  refused({{"grow", 0.5}, {"share", 0.5}}, "grow=0.5 with share=0.5");
  refused({{"grain", 2}, {"budget", 0}}, "grain=2 sets the granularity of fit's cut, and fit is 0 here");
  refused({{"grain", 2}, {"budget", 64}, {"fit", 0}}, "grain=2 sets the granularity of fit's cut");
  refused({{"grain", 2}, {"cam", 1}}, "grain=2 is not a multiple of the block size 4, so cuts move the recent tokens");
  refused({{"grain", -1}}, "grain=-1 out of range");
  // Not given, fit is off where it does not apply: a budget with observers = both is version 3's windows.
  SequenceOptions both;
  both.policy = "kara";
  both.params = {{"budget", 64}, {"observers", 2}};
  auto both_id = d.create(both);
  ASSERT_TRUE(both_id.ok()) << both_id.status();
  // What the sequence reports is the fit it applies: off there, and without a budget; on with one.
  EXPECT_EQ(d.info(*both_id).params.at("fit"), 0);
  SequenceOptions plain;
  plain.policy = "kara";
  plain.params = {{"budget", 0}};
  EXPECT_EQ(d.info(*d.create(plain)).params.at("fit"), 0);
  plain.params = {{"budget", 64}};
  EXPECT_EQ(d.info(*d.create(plain)).params.at("fit"), 1);
  plain.params = {{"share", 0.5}};
  EXPECT_EQ(d.info(*d.create(plain)).params.at("fit"), 1);
  // Not given, the budget is 768 (with fit 1) where it applies: decode observers and none of its
  // alternatives; elsewhere 0, so that each of them alone is version 2's form of it.
  auto params_of = [&](std::map<std::string, double> params) {
    SequenceOptions o;
    o.policy = "kara";
    o.params = std::move(params);
    auto id = d.create(o);
    EXPECT_TRUE(id.ok()) << id.status();
    return d.info(*id).params;
  };
  auto reported = [&](std::map<std::string, double> params) {
    const auto info = params_of(std::move(params));
    return std::make_pair(info.at("budget"), info.at("fit"));
  };
  EXPECT_EQ(reported({}), std::make_pair(768.0, 1.0));
  EXPECT_EQ(reported({{"observers", 0}}), std::make_pair(0.0, 0.0));
  EXPECT_EQ(reported({{"observers", 2}}), std::make_pair(0.0, 0.0));
  EXPECT_EQ(reported({{"share", 0.5}}), std::make_pair(0.0, 1.0));
  EXPECT_EQ(reported({{"rho2", 0.25}}), std::make_pair(0.0, 0.0));
  EXPECT_EQ(reported({{"grow", 0.5}}), std::make_pair(0.0, 0.0));
  EXPECT_EQ(reported({{"budget", 100}, {"fit", 2}}), std::make_pair(100.0, 2.0));
  // fit's grain: the block size unless given; a grain of whole blocks with CaM is allowed.
  EXPECT_EQ(params_of({}).at("grain"), 4.0);
  EXPECT_EQ(params_of({{"grain", 3}}).at("grain"), 3.0);
  EXPECT_EQ(params_of({{"grain", 8}, {"cam", 1}}).at("grain"), 8.0);
  // prompt: auto (2) where it decides per sequence (decode observers); with window or both
  // observers auto keeps the prompt, and the sequence says keep (0); given values as given.
  auto prompt = [&](std::map<std::string, double> params) { return params_of(std::move(params)).at("prompt"); };
  EXPECT_EQ(prompt({}), 2.0);
  EXPECT_EQ(prompt({{"observers", 0}}), 0.0);
  EXPECT_EQ(prompt({{"observers", 2}}), 0.0);
  EXPECT_EQ(prompt({{"observers", 2}, {"prompt", 1}}), 1.0);
  EXPECT_EQ(prompt({{"prompt", 0}}), 0.0);
}

// prompt = window: the prompt after the sinks is windowed like the tail (its queries kept from
// Append), the sinks stay.
TEST(KaraPolicyTest, PromptWindowCompressesThePromptAfterTheSinks) {
  Driver d(3);
  SequenceOptions o;
  o.policy = "kara";
  o.params = {{"window", 16}, {"period", 1}, {"recent", 16}, {"prompt", 1}, {"budget", 0}};
  const uint64_t seq = *d.create(o);
  ASSERT_TRUE(d.append(seq, 0, 40, 40).ok());  // the prompt's queries too
  std::vector<int64_t> logical{40};
  ASSERT_TRUE(d.step({seq}, logical).ok());  // tail = slots 4..40: 37 >= W + R
  EXPECT_EQ(d.info(seq).compactions, 1u);
  for (const auto& row : d.positions(seq)) {
    for (int p = 0; p < 4; ++p) EXPECT_EQ(row[p], p);  // the sinks' block
    for (int i = 4; i < 8; ++i) EXPECT_GE(row[i], 4) << "kept from the first window, slots 4..19";
    EXPECT_LE(row[7], 19);
    EXPECT_EQ(row[8], 20);  // the rest of the prompt and the step's token, untouched
    EXPECT_EQ(row.size(), 41u - 12u);
  }
}

// With no parameters Kara holds a sequence at its default budget: never more than 768 resident
// tokens plus the P = 16 a turn may let in, and the budget used (not a floor far below it).
TEST(KaraPolicyTest, DefaultsHoldTheDefaultBudget) {
  Driver d(11);
  SequenceOptions o;
  o.policy = "kara";
  const uint64_t seq = *d.create(o);
  ASSERT_TRUE(d.append(seq, 0, 100).ok());
  std::vector<int64_t> logical{100};
  int32_t most = 0;
  for (int i = 0; i < 1100; ++i) {
    ASSERT_TRUE(d.step({seq}, logical).ok());
    most = std::max<int32_t>(most, d.info(seq).length);
  }
  EXPECT_LE(most, 768 + 16);
  EXPECT_GT(most, 768);
  EXPECT_GE(d.info(seq).length, 768 - 16);
  EXPECT_GT(d.info(seq).compactions, 0);
}

// prompt = auto (the default): a prompt no other sequence shares is windowed exactly as with
// prompt = window; with window or both observers (which would need the prompt's queries) it is
// kept exactly as with prompt = keep.
TEST(KaraPolicyTest, PromptAutoWindowsAnUnsharedPromptAndKeepsItForWindowObservers) {
  auto run = [](std::map<std::string, double> params) {
    Driver d(3);
    SequenceOptions o;
    o.policy = "kara";
    o.params = {{"window", 16}, {"period", 1}, {"recent", 16}, {"budget", 0}};
    for (const auto& [k, v] : params) o.params[k] = v;
    const uint64_t seq = *d.create(o);
    EXPECT_TRUE(d.append(seq, 0, 40, 40).ok());
    std::vector<int64_t> logical{40};
    for (int i = 0; i < 40; ++i) EXPECT_TRUE(d.step({seq}, logical).ok());
    return std::make_pair(d.info(seq).compactions, d.positions(seq));
  };
  const auto automatic = run({}), window = run({{"prompt", 1}}), keep = run({{"prompt", 0}});
  EXPECT_GT(automatic.first, 0u);
  EXPECT_EQ(automatic, window);
  EXPECT_NE(automatic.second, keep.second);
  for (double observers : {0.0, 2.0}) {
    const auto kept = run({{"prompt", 0}, {"observers", observers}});
    EXPECT_GT(kept.first, 0u) << "the generated tokens are windowed";
    EXPECT_EQ(run({{"observers", observers}}), kept) << "observers " << observers;
    for (const auto& row : kept.second) {
      for (int p = 0; p < 40; ++p) ASSERT_EQ(row[p], p) << "observers " << observers;
    }
  }
}

// prompt = auto keeps the prompt a fork shares: windowing it would give parent and child private
// compacted copies of what they share. A twin that was not forked windows it at its first step.
TEST(KaraPolicyTest, PromptAutoKeepsThePromptAForkShares) {
  Driver d(3);
  SequenceOptions o;
  o.policy = "kara";
  o.params = {{"window", 16}, {"period", 1}, {"recent", 16}, {"budget", 0}};
  const uint64_t parent = *d.create(o), twin = *d.create(o);
  ASSERT_TRUE(d.append(parent, 0, 42, 42).ok());
  ASSERT_TRUE(d.append(twin, 0, 42, 42).ok());
  auto child = d.reg->fork_sequence(d.session, parent);
  ASSERT_TRUE(child.ok()) << child.status();
  std::vector<int64_t> logical{42, 42, 42};
  ASSERT_TRUE(d.step({parent, *child, twin}, logical).ok());
  EXPECT_EQ(d.info(twin).compactions, 1u);
  EXPECT_EQ(d.info(parent).compactions, 0u);
  EXPECT_EQ(d.info(*child).compactions, 0u);
  // The whole blocks of the prompt (40 of 42 tokens) are kept; the tail from slot 40 on is windowed
  // once it holds W + R tokens.
  logical.pop_back();
  for (int i = 0; i < 30; ++i) ASSERT_TRUE(d.step({parent, *child}, logical).ok());
  for (uint64_t seq : {parent, *child}) {
    EXPECT_GT(d.info(seq).compactions, 0u) << seq;
    for (const auto& row : d.positions(seq)) {
      for (int p = 0; p < 40; ++p) ASSERT_EQ(row[p], p) << seq;
      EXPECT_LT(row.size(), size_t(logical[0])) << seq;
    }
  }
}

// Each sequence counts its own decode steps and is looked at on the steps n with
// n mod P == id mod P, so sequences that fill a window together compress on different steps.
TEST(KaraPolicyTest, EachSequenceCompressesOnItsOwnTurns) {
  Driver d(5);
  SequenceOptions o;
  o.policy = "kara";
  o.params = {{"window", 16}, {"period", 4}, {"recent", 0}, {"budget", 0}};
  std::vector<uint64_t> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(*d.create(o));
  for (uint64_t id : ids) ASSERT_TRUE(d.append(id, 0, 4).ok());  // tails start at slot 4
  std::vector<int64_t> logical(4, 4);
  std::vector<int> compacted_at(4, 0);
  for (int step = 1; step <= 24; ++step) {
    ASSERT_TRUE(d.step(ids, logical).ok());
    for (int i = 0; i < 4; ++i) {
      if (compacted_at[i] == 0 && d.info(ids[i]).compactions > 0) compacted_at[i] = step;
    }
  }
  // A full window from step 16 on; sequence id k first looks at step n >= 16 with n % 4 == k % 4.
  for (int i = 0; i < 4; ++i) {
    int want = 16;
    while (want % 4 != int(ids[i] % 4)) ++want;
    EXPECT_EQ(compacted_at[i], want) << "sequence " << ids[i];
  }
  // One sequence stepping alone does not advance another's count.
  const uint64_t lone = *d.create(o);
  ASSERT_TRUE(d.append(lone, 0, 4).ok());
  std::vector<int64_t> lone_logical{4};
  for (int step = 0; step < 8; ++step) ASSERT_TRUE(d.step(ids, logical).ok());
  for (int step = 1; step <= 16; ++step) {
    ASSERT_TRUE(d.step({lone}, lone_logical).ok());
    EXPECT_EQ(d.info(lone).compactions, 0u) << "step " << step;
  }
}

// A backend that records the first accumulated slot of every decode observation (-1: none given)
// and, with `whole`, accumulates every slot instead.
class FirstSlotBackend : public karakv::testing::DelegatingBackend {
 public:
  FirstSlotBackend(bool whole, std::vector<std::pair<int32_t, int32_t>>* seen)
      : DelegatingBackend(kernels::make_cpu_backend(1)), whole_(whole), seen_(seen) {}
  KernelStatus decode_attention_accumulate(const PagedKV& kv, int layer, const float* q, float* out, float scale,
                                           float* const* score_acc, const int32_t* acc_begin) override {
    record(kv, acc_begin);
    return DelegatingBackend::decode_attention_accumulate(kv, layer, q, out, scale, score_acc,
                                                          whole_ ? nullptr : acc_begin);
  }
  KernelStatus decode_attention_observe(const PagedKV& kv, int layer, const float* q, float* out, float scale,
                                        float* const* score_acc, const int32_t* acc_begin,
                                        float* const* lse) override {
    record(kv, acc_begin);
    return DelegatingBackend::decode_attention_observe(kv, layer, q, out, scale, score_acc,
                                                       whole_ ? nullptr : acc_begin, lse);
  }

 private:
  // (first slot, sequence length) per sequence.
  void record(const PagedKV& kv, const int32_t* acc_begin) {
    for (int s = 0; s < kv.num_seqs; ++s) seen_->push_back({acc_begin != nullptr ? acc_begin[s] : -1, kv.seq_len[s]});
  }
  const bool whole_;
  std::vector<std::pair<int32_t, int32_t>>* seen_;
};

// Kara's decode observers add probabilities only from the tail's start on (the block-aligned start
// may lie past a short cache: then nothing), since nothing before it is scored again: every window
// keeps the same tokens as when every slot accumulates, for each observer and aggregation. H2O reads
// every slot, so its first slot stays 0.
TEST(KaraPolicyTest, AccumulatingOnlyTheTailKeepsTheSameTokens) {
  struct Variant {
    std::string policy;
    int observers, norm, agg;
  };
  for (const Variant& v : {Variant{"kara", 1, 0, 0}, Variant{"kara", 1, 0, 1}, Variant{"kara", 2, 1, 0},
                           Variant{"h2o", 0, 0, 0}}) {
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      std::vector<std::vector<std::vector<std::vector<int32_t>>>> kept(2);
      std::vector<std::vector<std::pair<int32_t, int32_t>>> seen(2);
      for (const bool whole : {false, true}) {
        Driver d(seed, 4096, std::make_unique<FirstSlotBackend>(whole, &seen[whole]));
        SequenceOptions o;
        o.policy = v.policy;
        if (v.policy == "kara") {
          o.params = {{"window", 16}, {"rho", 0.25}, {"period", 2}, {"recent", 8},
                      {"observers", v.observers}, {"norm", v.norm}, {"agg", v.agg}, {"prompt", 0}, {"budget", 0}};
        } else {
          o.params = {{"c_max", 48}, {"c_target", 32}};
        }
        const uint64_t a = *d.create(o), b = *d.create(o);
        ASSERT_TRUE(d.append(a, 0, 13).ok());  // a's tail starts at 16, past its first steps' caches
        ASSERT_TRUE(d.append(b, 0, 21).ok());
        std::vector<int64_t> logical{13, 21};
        for (int step = 0; step < 90; ++step) ASSERT_TRUE(d.step({a, b}, logical).ok());
        ASSERT_GE(d.info(a).compactions, 3u);
        kept[whole] = {d.positions(a), d.positions(b)};
      }
      const std::string what = v.policy + " observers " + std::to_string(v.observers) + " norm " +
                               std::to_string(v.norm) + " agg " + std::to_string(v.agg) + " seed " +
                               std::to_string(seed);
      EXPECT_EQ(kept[0], kept[1]) << what;
      ASSERT_FALSE(seen[0].empty()) << what;
      int32_t largest = 0;
      for (const auto& [first, len] : seen[0]) {
        ASSERT_GE(first, 0) << what;
        ASSERT_LE(first, len) << what;
        largest = std::max(largest, first);
      }
      if (v.policy == "kara") {
        EXPECT_GE(largest, 16 + 3 * 4) << what << ": the first slot follows the tail past three windows";
      } else {
        EXPECT_EQ(largest, 0) << what;
      }
    }
  }
}

// At most max_sequences_per_tick compactions in one decode step of the daemon, longest tail first
// (ties: the older sequence); the others wait for their next turn (P = 1: every step).
TEST(KaraPolicyTest, CapPerStepTakesTheLongestTailFirst) {
  CoreConfig c;
  c.geometry = geometry();
  c.pool_bytes = 4096ll * c.geometry.block_bytes();
  c.max_sequences_per_tick = 1;
  Driver d(5);
  d.reg = *Core::create(c, kernels::make_cpu_backend(1));
  d.session = d.reg->attach("w", "t", 0, kernels::Geometry{})->session_id;
  SequenceOptions o;
  o.policy = "kara";
  o.params = {{"window", 16}, {"period", 1}, {"recent", 0}, {"budget", 0}};
  const uint64_t c_id = *d.create(o), a = *d.create(o), b = *d.create(o);
  for (uint64_t id : {c_id, a, b}) ASSERT_TRUE(d.append(id, 0, 4).ok());  // tails start at slot 4
  std::vector<int64_t> ab{4, 4};
  ASSERT_TRUE(d.step({a, b}, ab).ok());  // a and b one token ahead of c
  std::vector<int64_t> all{4, ab[0], ab[1]};
  auto counts = [&] {
    return std::vector<int>{int(d.info(c_id).compactions), int(d.info(a).compactions), int(d.info(b).compactions)};
  };
  for (int step = 0; step < 14; ++step) ASSERT_TRUE(d.step({c_id, a, b}, all).ok());
  EXPECT_EQ(counts(), (std::vector<int>{0, 0, 0}));  // tails 14, 15, 15
  ASSERT_TRUE(d.step({c_id, a, b}, all).ok());  // tails 15, 16, 16: a and b due, tie: a (older)
  EXPECT_EQ(counts(), (std::vector<int>{0, 1, 0}));
  ASSERT_TRUE(d.step({c_id, a, b}, all).ok());  // c 16 and b 17 due: b, the longer tail, though younger
  EXPECT_EQ(counts(), (std::vector<int>{0, 1, 1}));
  ASSERT_TRUE(d.step({c_id, a, b}, all).ok());  // c 17
  EXPECT_EQ(counts(), (std::vector<int>{1, 1, 1}));
}

// Float64 decode observers, as the daemon's decode attention accumulates them: per (layer, KV head)
// row, each position's attention probability summed over the decode steps whose query saw it (and
// over the group's query heads), and how many steps saw it; positions before `from` are not kept.
struct ReferenceObservers {
  ReferenceObservers(uint64_t seed, uint64_t seq, const kernels::Geometry& g, int from)
      : seed(seed), seq(seq), g(g), from(from), received(g.num_layers * g.num_kv_heads),
        seen(g.num_layers * g.num_kv_heads) {}

  // Step `t`'s query over `rows` (each row's resident positions before the step) and its own token.
  void observe(const std::vector<std::vector<int32_t>>& rows, int t) {
    const int group = g.num_q_heads / g.num_kv_heads;
    const double scale = 1.0 / std::sqrt(double(g.head_dim));
    for (size_t r = 0; r < received.size(); ++r) {
      const int l = int(r) / g.num_kv_heads, h = int(r) % g.num_kv_heads;
      std::vector<int32_t> keys = rows[r];
      keys.push_back(t);
      auto key = [&](int pos, int dim) {
        return double(kernels::half_to_float(kernels::float_to_half(synthetic::value(seed, Tensor::kKey, seq, l, pos, h, dim))));
      };
      for (int j = h * group; j < (h + 1) * group; ++j) {
        std::vector<double> logits;
        double mx = -INFINITY, sum = 0;
        for (int32_t pos : keys) {
          double dot = 0;
          for (int dim = 0; dim < g.head_dim; ++dim)
            dot += double(synthetic::value(seed, Tensor::kQuery, seq, l, t, j, dim)) * key(pos, dim);
          logits.push_back(dot * scale);
          mx = std::max(mx, logits.back());
        }
        for (double x : logits) sum += std::exp(x - mx);
        for (size_t i = 0; i < keys.size(); ++i) {
          if (keys[i] >= from) received[r][keys[i]] += std::exp(logits[i] - mx) / sum;
        }
      }
      for (int32_t pos : keys) {
        if (pos >= from) seen[r][pos] += 1;
      }
    }
  }

  // Token2Chunk over the scores of row r's slots [begin, begin + len), keeping `keep`: the positions
  // it chooses (agg 0 mean, 1 sum); positions below `sinks` are kept whatever their score.
  std::vector<int32_t> choose(const std::vector<int32_t>& row, size_t r, int begin, int len, int keep, int agg,
                              int max_gap, int sinks = 0) {
    std::vector<float> scores;
    for (int i = 0; i < len; ++i) {
      const int pos = row[begin + i];
      scores.push_back(pos < sinks ? 3.0e38f
                                   : float(agg == 0 ? received[r][pos] / std::max(1.0, seen[r][pos]) : received[r][pos]));
    }
    std::vector<int32_t> want;
    for (int32_t slot : kernels::test::naive_token2chunk(scores, keep, int(std::ceil(0.5 * keep)), max_gap)) {
      want.push_back(row[begin + slot]);
    }
    return want;
  }

  uint64_t seed, seq;
  const kernels::Geometry& g;
  int from;
  std::vector<std::map<int, double>> received, seen;
};

// Version 3 (docs/COMPRESSION.md section 1): with a budget, turns act only above it; a window is
// compressed while the tail has one, otherwise the compressed region is re-ranked down to
// C' = max(b, floor_b(budget - (n - C))) by its decode-time scores over every step since each
// token arrived. The schedule is simulated step by step, and every re-rank's kept tokens are
// compared with Token2Chunk over a float64 reference of those scores, computed over the keys each
// step's query actually saw.
TEST(KaraBudgetTest, ReRanksTheCompressedRegionAsAFloat64ReferenceChooses) {
  for (const int agg : {0, 1}) {
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      Driver d(seed);
      const auto& g = d.reg->geometry();
      const int b = g.block_size;
      constexpr int kPrompt = 8, kWindow = 16, kB = 8, kRecent = 8, kBudget = 40, kMaxGap = 8;
      SequenceOptions o;
      o.policy = "kara";
      o.params = {{"window", kWindow}, {"rho", 0.5}, {"period", 1}, {"recent", kRecent}, {"budget", kBudget},
                  {"agg", agg}, {"fit", 0}, {"prompt", 0}};
      const uint64_t seq = *d.create(o);
      ASSERT_TRUE(d.append(seq, 0, kPrompt).ok());
      std::vector<int64_t> logical{kPrompt};
      const int rows_n = g.num_layers * g.num_kv_heads;
      ReferenceObservers ref(seed, seq, g, kPrompt);
      int tail_start = kPrompt, windows = 0, reranks = 0;
      std::vector<std::vector<int32_t>> rows = d.positions(seq);
      for (int step = 0; step < 160; ++step) {
        const int t = int(logical[0]);
        ASSERT_TRUE(d.step({seq}, logical).ok());
        ref.observe(rows, t);
        // The turn, as the contract says (P = 1: every step is one).
        const int n = int(rows[0].size()) + 1;
        const int compressed = tail_start - kPrompt;
        int expect_n = n;
        bool rerank = false;
        int keep = 0;
        if (n > kBudget) {
          if (n - tail_start >= kWindow + kRecent) {
            tail_start += kB;
            expect_n = n - (kWindow - kB);
            ++windows;
          } else {
            keep = std::max(b, (kBudget - (n - compressed)) / b * b);
            if (keep < compressed) {
              rerank = true;
              tail_start = kPrompt + keep;
              expect_n = n - (compressed - keep);
              ++reranks;
            }
          }
        }
        const std::vector<std::vector<int32_t>> after = d.positions(seq);
        ASSERT_EQ(int(after[0].size()), expect_n) << "step " << step << " seed " << seed;
        expect_well_formed(after, int32_t(logical[0]), 4);
        for (const auto& row : after) {
          for (int p = 0; p < kPrompt; ++p) ASSERT_EQ(row[p], p) << "the prompt is never touched";
        }
        if (rerank) {
          for (int r = 0; r < rows_n; ++r) {
            const std::vector<int32_t> want = ref.choose(rows[r], r, kPrompt, compressed, keep, agg, kMaxGap);
            const std::vector<int32_t> got(after[r].begin() + kPrompt, after[r].begin() + kPrompt + keep);
            EXPECT_EQ(got, want) << "agg " << agg << " seed " << seed << " step " << step << " row " << r;
          }
        }
        rows = after;
      }
      EXPECT_GE(windows, 3);
      EXPECT_GE(reranks, 3) << "the budget never made the compressed region shrink";
      EXPECT_LE(int(rows[0].size()), kBudget);
    }
  }
}

// Resident tokens stay within max(budget, p + b + W + R) + P whenever P <= W - B, whatever the
// budget (below, near and above what the prompt and the tail need), with several sequences on
// their own turns; a budget never reached compresses nothing; budget 0 is version 2.
TEST(KaraBudgetTest, ResidentTokensStayWithinTheBound) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 12; ++trial) {
    Driver d(100 + trial);
    const int b = d.reg->geometry().block_size;
    const int window = b * (4 + int(rng() % 5));
    const double rho = 0.25 + 0.25 * (rng() % 2);
    const int kept = std::max(b, int(std::lround(std::lround(rho * window) / double(b))) * b);
    const int recent = b * int(rng() % 4);
    const int period = 1 + int(rng() % std::max(1, window - kept));
    const int prompt = 4 + int(rng() % 20);
    const int budget = int(rng() % 3) == 0 ? 1 + int(rng() % 24) : prompt + int(rng() % 80);
    SequenceOptions o;
    o.policy = "kara";
    o.params = {{"window", window}, {"rho", rho}, {"recent", recent}, {"period", period}, {"budget", budget},
                {"observers", 1 + int(rng() % 2)}, {"fit", 0}, {"prompt", 0}};
    std::vector<uint64_t> seqs;
    for (int i = 0; i < 3; ++i) {
      seqs.push_back(*d.create(o));
      ASSERT_TRUE(d.append(seqs.back(), 0, prompt, prompt).ok());
    }
    std::vector<int64_t> logical(seqs.size(), prompt);
    const int bound = std::max(budget, (prompt + b - 1) / b * b + b + window + recent) + period;
    for (int step = 0; step < 300; ++step) {
      ASSERT_TRUE(d.step(seqs, logical).ok());
      for (uint64_t s : seqs) {
        ASSERT_LE(d.info(s).length, bound) << "trial " << trial << " step " << step << ": W " << window << " B "
                                           << kept << " R " << recent << " P " << period << " prompt " << prompt
                                           << " budget " << budget;
      }
    }
    for (uint64_t s : seqs) expect_well_formed(d.positions(s), int32_t(logical[0]), 4);
  }
  // Never above the budget: nothing compressed.
  Driver d(7);
  SequenceOptions o;
  o.policy = "kara";
  o.params = {{"window", 16}, {"recent", 0}, {"period", 1}, {"budget", 1000}, {"fit", 0}};
  const uint64_t big = *d.create(o);
  ASSERT_TRUE(d.append(big, 0, 8).ok());
  std::vector<int64_t> logical{8};
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(d.step({big}, logical).ok());
  EXPECT_EQ(d.info(big).compactions, 0u);
  EXPECT_EQ(d.info(big).length, 108);
}

// fit = 1 (docs/COMPRESSION.md section 1, version 3; the default with a budget and decode
// observers): a turn above the budget re-ranks everything
// from the compressed region's start C0 (slot 0 with the prompt windowed, the sinks kept inside it;
// the prompt's end rounded up to a block with it kept) to the tail's whole blocks before the newest
// R, down to max(b, len - ceil_b(n - budget)), by the decode-time scores over every step since each
// token arrived. Simulated step by step; every re-rank's kept tokens against Token2Chunk over a
// float64 reference of those scores; what follows the region moves down unchanged.
TEST(KaraFitTest, ReRanksEverythingOlderThanTheRecentRegionAsAFloat64ReferenceChooses) {
  // fit 1 cuts the excess, fit 2 at least W - B; the cases without `fit` get the default, 1. With a
  // share the budget is floor(share * L) at each turn, L the tokens ever appended (0: budget 40).
  // `grain` (0: the block size, 4 here) is the cut's granularity: 1 and 3 leave part blocks, so every
  // cut moves the recent tokens down behind the kept ones; 8 is two blocks.
  for (const auto& [agg, prompt_window, fit, share, grain] :
       {std::tuple{0, 1, 1, 0.0, 0}, std::tuple{1, 1, 1, 0.0, 0}, std::tuple{0, 0, 1, 0.0, 0},
        std::tuple{0, 1, 2, 0.0, 0}, std::tuple{1, 0, 2, 0.0, 0}, std::tuple{0, 1, 1, 0.5, 0},
        std::tuple{0, 0, 1, 0.7, 0}, std::tuple{1, 1, 2, 0.4, 0}, std::tuple{0, 1, 1, 0.0, 1},
        std::tuple{0, 0, 1, 0.0, 3}, std::tuple{1, 1, 2, 0.0, 3}, std::tuple{0, 1, 1, 0.5, 1},
        std::tuple{0, 0, 1, 0.0, 8}}) {
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      Driver d(seed);
      const auto& g = d.reg->geometry();
      const int b = g.block_size;
      const int gr = grain > 0 ? grain : b;
      // The prompt ends inside a block; a window would remove W - B = 12 tokens.
      constexpr int kPrompt = 22, kRecent = 8, kBudget = 40, kMaxGap = 8, kSinks = 4, kWindow = 16, kB = 4;
      SequenceOptions o;
      o.policy = "kara";
      o.params = {{"window", kWindow}, {"rho", 0.25}, {"period", 1}, {"recent", kRecent}, {"agg", agg},
                  {"prompt", prompt_window}};
      if (share > 0) o.params["share"] = share;
      else o.params["budget"] = kBudget;
      if (prompt_window == 1 || fit == 2) o.params["fit"] = fit;
      if (grain > 0) o.params["grain"] = grain;
      // floor(share * L) in exact integers: every share here is a whole number of hundredths.
      auto budget_at = [&](int l) {
        return share > 0 ? std::max(1, int(std::lround(share * 100)) * l / 100) : kBudget;
      };
      const uint64_t seq = *d.create(o);
      ASSERT_TRUE(d.append(seq, 0, kPrompt).ok());
      std::vector<int64_t> logical{kPrompt};
      const int rows_n = g.num_layers * g.num_kv_heads;
      ReferenceObservers ref(seed, seq, g, 0);
      const int c0 = prompt_window == 1 ? 0 : (kPrompt + b - 1) / b * b;
      int tail_start = c0, reranks = 0;
      std::vector<std::vector<int32_t>> rows = d.positions(seq);
      for (int step = 0; step < 120; ++step) {
        const int t = int(logical[0]);
        ASSERT_TRUE(d.step({seq}, logical).ok());
        ref.observe(rows, t);
        const int n = int(rows[0].size()) + 1;  // P = 1: every step is a turn
        const int budget = budget_at(t + 1);
        const int end = tail_start + std::max(0, n - kRecent - tail_start) / gr * gr;
        const int len = end - c0;
        const bool rerank = n > budget && len > b;
        const int excess = (n - budget + gr - 1) / gr * gr;
        const int keep = rerank ? std::max(b, len - (fit == 2 ? std::max(excess, kWindow - kB) : excess)) : len;
        const std::vector<std::vector<int32_t>> after = d.positions(seq);
        ASSERT_EQ(int(after[0].size()), n - (len - keep)) << "step " << step << " seed " << seed << " grain " << grain << " fit " << fit << " share " << share;
        expect_well_formed(after, int32_t(logical[0]), kSinks);
        for (int r = 0; r < rows_n; ++r) {
          for (int p = 0; p < std::min<int>(c0, after[r].size()); ++p) {
            ASSERT_EQ(after[r][p], p) << "a kept prompt (and its last block) is never touched";
          }
          if (rerank) {
            const std::vector<int32_t> want = ref.choose(rows[r], r, c0, len, keep, agg, kMaxGap, kSinks);
            EXPECT_EQ(std::vector<int32_t>(after[r].begin() + c0, after[r].begin() + c0 + keep), want)
                << "agg " << agg << " prompt " << prompt_window << " fit " << fit << " share " << share << " grain "
                << grain << " seed " << seed << " step " << step << " row " << r;
          }
          // What follows the region (everything, without a re-rank) moves down unchanged.
          const int from = rerank ? end : 0;
          std::vector<int32_t> moved(rows[r].begin() + from, rows[r].end());
          moved.push_back(t);
          ASSERT_EQ(std::vector<int32_t>(after[r].begin() + (rerank ? c0 + keep : 0), after[r].end()), moved)
              << "row " << r << " step " << step;
        }
        if (rerank) {
          tail_start = c0 + keep;
          ++reranks;
        }
        rows = after;
      }
      EXPECT_GE(reranks, 8) << "the budget never bound";
      // Every turn removes the whole excess here, unless the region is at its floor (a block) with
      // fewer than R + grain tokens after it: with a grain of two blocks and the prompt kept, that
      // is more than the budget.
      EXPECT_LE(int(rows[0].size()), std::max(budget_at(int(logical[0])), c0 + b + kRecent + std::max(b, gr) - 1))
          << "grain " << grain << " fit " << fit << " share " << share << " prompt " << prompt_window;
    }
  }
}

// fit: from a sequence's first turn on, resident tokens stay within max(budget, C0 + F + g + R) + P,
// g = max(b, grain),
// F = max(b, ceil_b(S - C0)) the region's floor (it keeps every sink),
// whatever the budget (below what the prompt and the recent region need, near it, above it), with
// several sequences on their own turns.
TEST(KaraFitTest, ResidentTokensStayWithinTheBound) {
  std::mt19937 rng(13);
  for (int trial = 0; trial < 12; ++trial) {
    Driver d(200 + trial);
    const int b = d.reg->geometry().block_size;
    const int recent = b * int(rng() % 4);
    const int period = 1 + int(rng() % 12);
    const int prompt = 4 + int(rng() % 40);
    const int prompt_window = int(rng() % 2);
    const int budget = int(rng() % 3) == 0 ? 1 + int(rng() % 24) : prompt / 2 + int(rng() % 80);
    // Every third trial sets the budget as a share of the length instead (floor(share * L)).
    const double share = trial % 3 == 2 ? 0.05 * (1 + int(rng() % 18)) : 0.0;
    const int sinks = 4 * (1 + int(rng() % 3));  // up to three blocks: the region's floor holds them all
    // fit's grain: every other trial one of 1..2b (part blocks, or more than one).
    const int grain = trial % 2 == 1 ? 1 + int(rng() % (2 * b)) : 0;
    const int gr = grain > 0 ? grain : b;
    SequenceOptions o;
    o.policy = "kara";
    o.params = {{"recent", recent}, {"period", period}, {"fit", 1 + int(rng() % 2)}, {"prompt", prompt_window},
                {"sinks", sinks}, {"grain", grain}};
    if (share > 0) o.params["share"] = share;
    else o.params["budget"] = budget;
    std::vector<uint64_t> seqs;
    for (int i = 0; i < 3; ++i) {
      seqs.push_back(*d.create(o));
      ASSERT_TRUE(d.append(seqs.back(), 0, prompt).ok());
    }
    std::vector<int64_t> logical(seqs.size(), prompt);
    const int c0 = prompt_window == 1 ? 0 : (prompt + b - 1) / b * b;
    const int floor = std::max(b, (std::max(0, sinks - c0) + b - 1) / b * b);
    for (int step = 0; step < 300; ++step) {
      ASSERT_TRUE(d.step(seqs, logical).ok());
      if (step + 1 < period) continue;  // every sequence has had its first turn
      // A share's budget only grows, so the one of this length bounds what the last turn left.
      const int now = share > 0 ? std::max(1, int(std::lround(share * 100) * logical[0] / 100)) : budget;
      const int bound = std::max(now, c0 + floor + std::max(b, gr) + recent) + period;
      for (uint64_t s : seqs) {
        ASSERT_LE(d.info(s).length, bound) << "trial " << trial << " step " << step << ": R " << recent << " P "
                                           << period << " prompt " << prompt << " windowed " << prompt_window
                                           << " budget " << budget << " share " << share << " sinks " << sinks
                                           << " grain " << grain;
      }
    }
    for (uint64_t s : seqs) expect_well_formed(d.positions(s), int32_t(logical[0]), sinks);
  }
}

// Two levels (rho2): a tail window is compressed to B as in version 2; once level 1 (the compressed
// windows not yet compressed again) holds W + R tokens, its oldest W are compressed to B2 by their
// decode-time scores over every step since each token arrived, as a float64 reference chooses;
// level 2 is never touched again. Simulated step by step against the contract.
TEST(KaraTwoLevelTest, SecondLevelWindowsKeepWhatAFloat64ReferenceChooses) {
  // observers = both also keeps the Step's queries, so a plan inside the explicit positions moves
  // the query cache too; the second level scores by the decode part only.
  for (const auto& [agg, observers] : {std::pair{0, 1}, std::pair{1, 1}, std::pair{0, 2}}) {
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      Driver d(seed);
      const auto& g = d.reg->geometry();
      constexpr int kPrompt = 8, kWindow = 16, kB = 8, kB2 = 4, kRecent = 8, kMaxGap = 8;
      SequenceOptions o;
      o.policy = "kara";
      o.params = {{"window", kWindow}, {"rho", 0.5}, {"rho2", 0.25}, {"period", 1}, {"recent", kRecent},
                  {"agg", agg}, {"observers", observers}, {"prompt", 0}};
      const uint64_t seq = *d.create(o);
      ASSERT_TRUE(d.append(seq, 0, kPrompt).ok());
      std::vector<int64_t> logical{kPrompt};
      const int rows_n = g.num_layers * g.num_kv_heads;
      ReferenceObservers ref(seed, seq, g, kPrompt);
      int level1 = kPrompt, tail_start = kPrompt, windows = 0, second = 0;
      std::vector<std::vector<int32_t>> rows = d.positions(seq);
      for (int step = 0; step < 200; ++step) {
        const int t = int(logical[0]);
        ASSERT_TRUE(d.step({seq}, logical).ok());
        ref.observe(rows, t);
        const int n = int(rows[0].size()) + 1;
        int expect_n = n;
        bool again = false;
        const int level1_before = level1;
        if (n - tail_start >= kWindow + kRecent) {
          tail_start += kB;
          expect_n = n - (kWindow - kB);
          ++windows;
        } else if (tail_start - level1 >= kWindow + kRecent) {
          again = true;
          level1 += kB2;
          tail_start -= kWindow - kB2;
          expect_n = n - (kWindow - kB2);
          ++second;
        }
        const std::vector<std::vector<int32_t>> after = d.positions(seq);
        ASSERT_EQ(int(after[0].size()), expect_n) << "step " << step << " seed " << seed;
        expect_well_formed(after, int32_t(logical[0]), 4);
        for (int r = 0; r < rows_n; ++r) {
          for (int p = 0; p < kPrompt; ++p) ASSERT_EQ(after[r][p], p) << "the prompt is never touched";
          for (int i = kPrompt; i < level1_before; ++i) ASSERT_EQ(after[r][i], rows[r][i]) << "level 2 is final";
        }
        if (again) {
          for (int r = 0; r < rows_n; ++r) {
            const std::vector<int32_t> want = ref.choose(rows[r], r, level1_before, kWindow, kB2, agg, kMaxGap);
            const std::vector<int32_t> got(after[r].begin() + level1_before, after[r].begin() + level1_before + kB2);
            EXPECT_EQ(got, want) << "agg " << agg << " observers " << observers << " seed " << seed << " step "
                                 << step << " row " << r;
            // Level 1's newer tokens and the tail (with the step's token) move down unchanged.
            std::vector<int32_t> moved(rows[r].begin() + level1_before + kWindow, rows[r].end());
            moved.push_back(t);
            EXPECT_EQ(std::vector<int32_t>(after[r].begin() + level1_before + kB2, after[r].end()), moved) << "row " << r;
          }
        }
        rows = after;
      }
      EXPECT_GE(windows, 8);
      EXPECT_GE(second, 3) << "level 1 was never compressed again";
    }
  }
}

// grow: a window is due only when the tail holds W + R' tokens, R' = max(R, floor_b(grow * t)), t
// the tokens that entered the tail since decoding began; with the prompt windowed, the tail starts
// after the sinks. Each compaction lands exactly on the step the contract says, and the newest R'
// tokens are never touched.
TEST(KaraGrowTest, WindowsWaitForARecentRegionThatGrowsWithTheTail) {
  for (const int prompt_window : {0, 1}) {
    Driver d(5);
    const int b = d.reg->geometry().block_size;
    constexpr int kPrompt = 22, kWindow = 16, kB = 4, kRecent = 8;  // the prompt ends inside a block
    constexpr double kGrow = 0.5;
    SequenceOptions o;
    o.policy = "kara";
    o.params = {{"window", kWindow}, {"rho", 0.25}, {"period", 1}, {"recent", kRecent}, {"grow", kGrow},
                {"prompt", prompt_window}};
    const uint64_t seq = *d.create(o);
    ASSERT_TRUE(d.append(seq, 0, kPrompt, kPrompt).ok());
    std::vector<int64_t> logical{kPrompt};
    const int origin = prompt_window == 1 ? b : (kPrompt + b - 1) / b * b;  // sinks 4 = one block
    int tail_start = origin, removed = 0, windows = 0;
    for (int step = 0; step < 300; ++step) {
      ASSERT_TRUE(d.step({seq}, logical).ok());
      // The turn's view: resident before its compaction.
      const int before = int(logical[0]) - removed;
      const int entered = before + removed - origin;
      const int grown = std::max(kRecent, int(std::floor(kGrow * entered)) / b * b);
      int expect = before;
      if (before - tail_start >= kWindow + grown) {
        tail_start += kB;
        removed += kWindow - kB;
        expect = before - (kWindow - kB);
        ++windows;
      }
      const auto rows = d.positions(seq);
      ASSERT_EQ(int(rows[0].size()), expect) << "step " << step << " prompt " << prompt_window;
      expect_well_formed(rows, int32_t(logical[0]), 4);
      // Everything from the tail's start on is whole: the newest tokens in order.
      for (const auto& row : rows) {
        for (int i = tail_start; i < int(row.size()); ++i) ASSERT_EQ(row[i], int(logical[0]) - int(row.size()) + i);
      }
    }
    EXPECT_GE(windows, 5);
  }
}

TEST(SnapKVPolicyTest, RecompressesTheWholeCacheAndKeepsTheObservationWindow) {
  bool dropped_earlier_survivor = false;
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    Driver d(seed);
    SequenceOptions o;
    o.policy = "snapkv";
    o.params = {{"c_max", 40}, {"c_target", 24}, {"w_obs", 6}};
    const uint64_t seq = *d.create(o);
    ASSERT_TRUE(d.append(seq, 0, 10).ok());
    std::vector<int64_t> logical{10};
    std::vector<std::vector<int32_t>> before, last_kept;
    for (int t = 0; t < 80; ++t) {
      before = d.positions(seq);
      const int c0 = d.info(seq).compactions;
      ASSERT_TRUE(d.step({seq}, logical).ok());
      auto rows = d.positions(seq);
      expect_well_formed(rows, int32_t(logical[0]), 4);
      if (int(d.info(seq).compactions) == c0) continue;
      ASSERT_EQ(rows[0].size(), 24u);
      for (size_t r = 0; r < rows.size(); ++r) {
        // The observation window: the newest 6 tokens, including this step's.
        for (int i = 0; i < 6; ++i) {
          const int32_t p = int32_t(logical[0]) - 6 + i;
          EXPECT_TRUE(std::binary_search(rows[r].begin(), rows[r].end(), p)) << "window position " << p << " evicted";
        }
        if (!last_kept.empty()) {
          for (int32_t p : last_kept[r]) {
            if (p >= 4 && !std::binary_search(rows[r].begin(), rows[r].end(), p)) dropped_earlier_survivor = true;
          }
        }
      }
      last_kept = rows;
    }
    EXPECT_GE(d.info(seq).compactions, 3u);
  }
  // The behaviour the Kara paper criticises: tokens kept by one compaction are evicted by the next.
  EXPECT_TRUE(dropped_earlier_survivor);
}

TEST(BaselinePolicyTest, StreamingH2OChunkKVKeepBudgetSinksAndRecent) {
  for (const char* policy : {"streaming", "h2o", "chunkkv"}) {
    for (uint64_t seed = 1; seed <= 6; ++seed) {
      Driver d(seed);
      SequenceOptions o;
      o.policy = policy;
      o.params = {{"c_max", 48}, {"c_target", 30}};
      if (std::string(policy) == "chunkkv") o.params["w_obs"] = 6;
      auto created = d.create(o);
      ASSERT_TRUE(created.ok()) << created.status();
      const uint64_t seq = *created;
      ASSERT_TRUE(d.append(seq, 0, 20).ok());
      std::vector<int64_t> logical{20};
      for (int t = 0; t < 70; ++t) {
        ASSERT_TRUE(d.step({seq}, logical).ok()) << policy;
        auto rows = d.positions(seq);
        expect_well_formed(rows, int32_t(logical[0]), 4);
        ASSERT_LT(rows[0].size(), 48u);
        if (std::string(policy) == "streaming") {
          // Sinks plus a contiguous run of the newest tokens.
          for (const auto& r : rows)
            for (size_t i = 4; i + 1 < r.size(); ++i) ASSERT_EQ(r[i] + 1, r[i + 1]);
        }
        if (std::string(policy) == "chunkkv") {
          const int hk = geometry().num_kv_heads;
          for (size_t r = 0; r < rows.size(); ++r)
            ASSERT_EQ(rows[r], rows[r / hk * hk]) << "chunkkv keeps the same slots for every head of a layer";
        }
      }
      EXPECT_GE(d.info(seq).compactions, 2u) << policy;
      ASSERT_TRUE(d.reg->check_invariants().ok());
    }
  }
}

// H2O against float64: every decode step's attention probabilities over the keys resident at that
// step (summed over the group's query heads) are added per position here, from the synthetic
// queries and keys; each compaction must keep the sinks, the newest `recent` slots and the heaviest
// hitters by these sums. The prompt (250 tokens) makes the daemon's accumulators move to a larger
// allocation during the decode steps, two compactions remap them, and a fork continues from a copy
// of them with its own tokens (positions after the fork are the child's).
TEST(H2OPolicyTest, KeepsWhatAFloat64ReferenceOfAccumulatedAttentionChooses) {
  constexpr int kPrompt = 250, kCMax = 304, kCTarget = 272, kRecent = 68, kSinks = 4;
  for (uint64_t seed = 1; seed <= 2; ++seed) {
    Driver d(seed);
    const auto& g = d.reg->geometry();
    const int hk = g.num_kv_heads, group = g.num_q_heads / g.num_kv_heads;
    const double scale = 1.0 / std::sqrt(double(g.head_dim));
    SequenceOptions o;
    o.policy = "h2o";
    o.params = {{"c_max", kCMax}, {"c_target", kCTarget}, {"recent_ratio", double(kRecent) / kCTarget}};
    const uint64_t parent = *d.create(o);
    ASSERT_TRUE(d.append(parent, 0, kPrompt).ok());
    // Whose synthetic data a position holds: the parent's before the fork, the sequence's own after.
    struct Tracked {
      uint64_t id;
      int64_t fork_pos;  // positions >= this are the sequence's own (parent: never)
      std::vector<std::map<int64_t, double>> sums;  // [layer * hk + head]: position -> sum
      int32_t compactions = 0;
    };
    auto owner = [&](const Tracked& t, int64_t pos) { return pos >= t.fork_pos ? t.id : parent; };
    // One decode step's reference accumulation, over the keys the daemon held (rows before the
    // step) plus the step's token.
    auto accumulate = [&](Tracked& t, const std::vector<std::vector<int32_t>>& rows, int64_t pos) {
      for (int l = 0; l < g.num_layers; ++l) {
        for (int h = 0; h < hk; ++h) {
          std::vector<int64_t> keys(rows[size_t(l) * hk + h].begin(), rows[size_t(l) * hk + h].end());
          keys.push_back(pos);
          auto& sums = t.sums[size_t(l) * hk + h];
          for (int j = h * group; j < (h + 1) * group; ++j) {
            std::vector<double> logit(keys.size());
            double mx = -INFINITY;
            for (size_t i = 0; i < keys.size(); ++i) {
              double dot = 0;
              for (int dim = 0; dim < g.head_dim; ++dim) {
                const float k = synthetic::value(seed, Tensor::kKey, owner(t, keys[i]), l, keys[i], h, dim);
                dot += double(synthetic::value(seed, Tensor::kQuery, owner(t, pos), l, pos, j, dim)) *
                       double(kernels::half_to_float(kernels::float_to_half(k)));
              }
              mx = std::max(mx, logit[i] = dot * scale);
            }
            double z = 0;
            for (double x : logit) z += std::exp(x - mx);
            for (size_t i = 0; i < keys.size(); ++i) sums[keys[i]] += std::exp(logit[i] - mx) / z;
          }
        }
      }
    };
    // The compaction just made `rows` from the `before` rows (each with the step's token): forced
    // slots kept, the rest the heaviest by the reference sums (near-ties either way).
    auto check_compaction = [&](Tracked& t, const std::vector<std::vector<int32_t>>& before,
                                const std::vector<std::vector<int32_t>>& rows, const std::string& what) {
      for (size_t r = 0; r < rows.size(); ++r) {
        ASSERT_EQ(rows[r].size(), size_t(kCTarget)) << what;
        const std::vector<int32_t>& was = before[r];
        std::vector<double> free_sums;
        for (size_t i = 0; i < was.size(); ++i)
          if (was[i] >= kSinks && i + kRecent < was.size()) free_sums.push_back(t.sums[r][was[i]]);
        const size_t forced = was.size() - free_sums.size();
        std::sort(free_sums.rbegin(), free_sums.rend());
        const double kth = free_sums[kCTarget - forced - 1];
        const double eps = 1e-5 * std::max(1.0, kth);
        for (size_t i = 0; i < was.size(); ++i) {
          const bool kept = std::binary_search(rows[r].begin(), rows[r].end(), was[i]);
          if (was[i] < kSinks || i + kRecent >= was.size()) {
            ASSERT_TRUE(kept) << what << " row " << r << ": forced position " << was[i] << " dropped";
          } else if (kept) {
            ASSERT_GE(t.sums[r][was[i]], kth - eps) << what << " row " << r << ": kept light position " << was[i];
          } else {
            ASSERT_LE(t.sums[r][was[i]], kth + eps) << what << " row " << r << ": dropped heavy position " << was[i];
          }
        }
        for (auto it = t.sums[r].begin(); it != t.sums[r].end();)  // evicted positions leave
          it = std::binary_search(rows[r].begin(), rows[r].end(), int32_t(it->first)) ? std::next(it)
                                                                                      : t.sums[r].erase(it);
      }
    };
    auto step = [&](Tracked& t, int64_t& logical, const std::string& what) {
      const auto before = d.positions(t.id);
      accumulate(t, before, logical);
      std::vector<int64_t> l{logical};
      ASSERT_TRUE(d.step({t.id}, l).ok()) << what;
      const auto rows = d.positions(t.id);
      if (d.info(t.id).compactions > t.compactions) {
        t.compactions = d.info(t.id).compactions;
        auto with_step = before;
        for (auto& row : with_step) row.push_back(int32_t(logical));
        check_compaction(t, with_step, rows, what + " compaction " + std::to_string(t.compactions));
      }
      logical = l[0];
    };

    Tracked p{parent, INT64_MAX, std::vector<std::map<int64_t, double>>(size_t(g.num_layers) * hk)};
    int64_t logical = kPrompt;
    while (p.compactions < 1) {
      step(p, logical, "parent");
      ASSERT_LT(logical, kCMax + 2) << "h2o never compacted";
    }
    for (int i = 0; i < 10; ++i) step(p, logical, "parent");
    // The fork starts from a copy of the parent's sums; both go on to a second compaction.
    auto child_id = d.reg->fork_sequence(d.session, parent);
    ASSERT_TRUE(child_id.ok()) << child_id.status();
    Tracked c{*child_id, logical, p.sums, p.compactions};
    int64_t child_logical = logical;
    while (p.compactions < 2 || c.compactions < 2) {
      step(p, logical, "parent");
      step(c, child_logical, "child");
      ASSERT_LT(logical, kPrompt + 3 * (kCMax - kCTarget) + 60) << "h2o stopped compacting";
    }
    // Two sequences' sums, 4 rows of 512 slots each (grown past 256 during the steps).
    EXPECT_EQ(d.reg->stats().score_bytes, 2u * g.num_layers * hk * 512 * sizeof(float));
  }
}

// A backend whose allocate() fails while *fail is set (device memory used up).
class NoMemoryBackend : public karakv::testing::DelegatingBackend {
 public:
  explicit NoMemoryBackend(const bool* fail) : DelegatingBackend(kernels::make_cpu_backend(1)), fail_(fail) {}
  KernelStatus allocate(size_t bytes, void** out) override {
    if (*fail_) return {KernelStatus::Code::kInternal, "allocate: out of memory for " + std::to_string(bytes) + " bytes"};
    return DelegatingBackend::allocate(bytes, out);
  }

 private:
  const bool* fail_;
};

// H2O's sums live in backend memory: when that cannot be had, the Append, Step or Fork that needed
// it is refused with RESOURCE_EXHAUSTED naming the sequence, the policy and the sizes, and nothing
// changes; the same request succeeds once memory is there.
TEST(H2OPolicyTest, StateMemoryThatCannotBeHadRefusesTheRequestAndChangesNothing) {
  bool fail = false;
  Driver d(1, 4096, std::make_unique<NoMemoryBackend>(&fail));
  SequenceOptions o;
  o.policy = "h2o";
  o.params = {{"c_max", 1024}, {"c_target", 512}};
  const uint64_t seq = *d.create(o);  // no sums yet: nothing allocated
  fail = true;
  absl::Status s = d.append(seq, 0, 20);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("sequence " + std::to_string(seq) +
                                                  " policy 'h2o' cannot grow its state to 20 slots: accumulated "
                                                  "attention of 4 rows x 256 slots (4096 bytes) does not fit"));
  EXPECT_EQ(d.info(seq).length, 0u);
  fail = false;
  ASSERT_TRUE(d.append(seq, 0, 256).ok());
  std::vector<int64_t> logical{256};
  fail = true;  // the step's token is slot 257: the sums move to a larger allocation
  s = d.step({seq}, logical);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("cannot grow its state to 257 slots"));
  EXPECT_EQ(d.info(seq).length, 256u);
  EXPECT_EQ(d.info(seq).prompt_length, 0u) << "a refused first Step fixed the prompt";
  EXPECT_EQ(logical[0], 256);
  const int32_t sequences = d.reg->stats().sequences;
  auto child = d.reg->fork_sequence(d.session, seq);
  EXPECT_EQ(child.status().code(), absl::StatusCode::kResourceExhausted) << child.status();
  EXPECT_THAT(std::string(child.status().message()), HasSubstr("accumulated attention for the fork"));
  EXPECT_EQ(d.reg->stats().sequences, sequences);
  fail = false;
  ASSERT_TRUE(d.step({seq}, logical).ok());
  EXPECT_EQ(d.info(seq).length, 257u);
  EXPECT_EQ(d.info(seq).prompt_length, 256u);
  ASSERT_TRUE(d.reg->fork_sequence(d.session, seq).ok());
  EXPECT_TRUE(d.reg->check_invariants().ok());
}

TEST(PrefillPolicyTest, SnapKVCompressesThePromptOnceAtTheFirstStep) {
  Driver d(3);
  SequenceOptions o;
  o.policy = "kara";
  o.params = {{"window", 16}};
  o.prefill_policy = "snapkv";
  o.prefill_params = {{"c_target", 20}, {"c_max", 21}, {"w_obs", 8}};
  const uint64_t seq = *d.create(o);
  ASSERT_TRUE(d.append(seq, 0, 50, 8).ok());
  std::vector<int64_t> logical{50};
  EXPECT_EQ(d.info(seq).length, 50u);
  ASSERT_TRUE(d.step({seq}, logical).ok());
  EXPECT_EQ(d.info(seq).length, 21u);  // 20 prompt tokens + this step's
  EXPECT_EQ(d.info(seq).prompt_length, 50u);
  auto rows = d.positions(seq);
  expect_well_formed(rows, 51, 4);
  for (const auto& r : rows) EXPECT_EQ(r.back(), 50);
  // Without the prompt's queries the first Step is refused, naming what is missing.
  const uint64_t other = *d.create(o);
  ASSERT_TRUE(d.append(other, 0, 50, 0).ok());
  std::vector<int64_t> lo{50};
  absl::Status s = d.step({other}, lo);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("queries of the newest 8 tokens"));
  EXPECT_EQ(d.info(other).length, 50u);
  EXPECT_TRUE(d.reg->check_invariants().ok());
}

// SnapKV and ChunkKV keep the queries of the observation window they keep, so with
// c_max - c_target < w_obs the next compaction still has its w_obs queries: the cache never grows
// past c_max, compaction fires every time the cache reaches it, and a dry run never says queries
// are missing.
TEST(SnapKVPolicyTest, KeepsTheObservationWindowsQueriesSoItFiresExactlyAtCMax) {
  for (const char* policy : {"snapkv", "chunkkv"}) {
    Driver d(4);
    SequenceOptions o;
    o.policy = policy;
    o.params = {{"c_max", 40}, {"c_target", 36}, {"w_obs", 8}};  // 4 steps between compactions, w_obs 8
    const uint64_t seq = *d.create(o);
    ASSERT_TRUE(d.append(seq, 0, 20, 8).ok());
    std::vector<int64_t> logical{20};
    int compactions = 0;
    for (int t = 0; t < 60; ++t) {
      const uint32_t before = d.info(seq).length;
      ASSERT_TRUE(d.step({seq}, logical).ok());
      const SequenceInfo info = d.info(seq);
      ASSERT_LE(info.length, 40u) << policy << " step " << t;
      if (before + 1 == 40) {
        EXPECT_EQ(info.length, 36u) << policy << ": did not compact on reaching c_max at step " << t;
        ++compactions;
      } else {
        EXPECT_EQ(info.length, before + 1) << policy << " step " << t;
      }
      auto dry = d.reg->compact(d.session, seq, true);
      ASSERT_TRUE(dry.ok());
      EXPECT_THAT(dry->front().skipped, ::testing::Not(HasSubstr("queries"))) << policy << " step " << t;
    }
    EXPECT_EQ(int(d.info(seq).compactions), compactions);
    EXPECT_EQ(compactions, 11) << policy;  // at step 20, then every 4 steps
    ASSERT_TRUE(d.reg->check_invariants().ok());
  }
}

TEST(PolicyParamsTest, BadValuesAreRefusedNamingParameterAndRange) {
  Driver d(1);
  auto refused = [&](const std::string& policy, std::map<std::string, double> params, const std::string& words) {
    SequenceOptions o;
    o.policy = policy;
    o.params = std::move(params);
    auto r = d.create(o);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << policy;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(words));
  };
  refused("kara", {{"rho", 1.5}}, "rho=1.5 out of range: expected in [0.01, 0.99]");
  refused("kara", {{"window", 18}}, "multiple of the block size 4");
  refused("kara", {{"period", 0}}, "period=0 out of range");
  refused("kara", {{"colour", 1}}, "has no parameter 'colour'");
  refused("snapkv", {{"c_target", 2000}}, "must be below c_max=1024");
  refused("snapkv", {{"pool", 4}}, "must be odd");
  refused("snapkv", {{"w_obs", 2.5}}, "expected an integer");
  refused("h2o", {{"recent_ratio", -1}}, "recent_ratio=-1 out of range");
  refused("magic", {}, "unknown policy 'magic'; expected one of: chunkkv, h2o, kara, none, snapkv, streaming");
  SequenceOptions o;
  o.policy = "none";
  o.prefill_policy = "kara";
  EXPECT_THAT(std::string(d.create(o).status().message()), HasSubstr("not a one-shot policy"));
}

TEST(CompactTest, DryRunChangesNothingAndMatchesTheRealRun) {
  Driver d(9);
  SequenceOptions o;
  o.policy = "snapkv";
  o.params = {{"c_max", 1000}, {"c_target", 16}, {"w_obs", 4}};
  const uint64_t seq = *d.create(o);
  ASSERT_TRUE(d.append(seq, 0, 30, 4).ok());
  const auto before = d.positions(seq);
  auto dry = d.reg->compact(d.session, seq, true);
  ASSERT_TRUE(dry.ok()) << dry.status();
  EXPECT_EQ(d.positions(seq), before);
  ASSERT_EQ((*dry)[0].tokens_after, 16);
  auto real = d.reg->compact(d.session, seq, false);
  ASSERT_TRUE(real.ok());
  EXPECT_EQ(d.positions(seq), (*dry)[0].kept);
  EXPECT_EQ(d.reg->stats().policies["snapkv"].compactions, 1u);
  // Nothing left to do: reported as skipped, not as an error.
  auto again = d.reg->compact(d.session, seq, false);
  EXPECT_THAT((*again)[0].skipped, HasSubstr("nothing to compact"));
}

// Thousands of random operations over several policies, with the pool invariant and the
// per-sequence position invariants checked after every one.
TEST(PolicyPropertyTest, RandomStepCompactForkReleaseKeepInvariants) {
  for (uint64_t seed : {11u, 22u, 33u, 44u}) {
    Driver d(seed, 400);
    std::mt19937 rng(seed);
    struct Live {
      uint64_t id;
      int64_t logical;
    };
    std::vector<Live> live;
    const char* policies[] = {"none", "kara", "snapkv", "streaming", "h2o", "chunkkv"};
    int ops = 0, refused = 0;
    for (int op = 0; op < 700; ++op) {
      const int kind = rng() % 10;
      if (kind == 0 || live.empty()) {
        SequenceOptions o;
        o.policy = policies[rng() % 6];
        if (o.policy == "kara") o.params = {{"window", 8}, {"period", 2}, {"recent", 0}, {"budget", 0}};
        else if (o.policy != "none") o.params = {{"c_max", 24}, {"c_target", 12}, {"sinks", 2}};
        if (o.policy == "snapkv" || o.policy == "chunkkv") o.params["w_obs"] = 4;
        auto id = d.create(o);
        ASSERT_TRUE(id.ok()) << id.status();
        const int n = 1 + rng() % 12;
        if (d.append(*id, 0, n, std::min(n, 4)).ok()) live.push_back({*id, n});
        else ++refused;
      } else if (kind <= 5) {
        std::vector<uint64_t> batch;
        std::vector<int64_t> logical;
        for (const Live& l : live) {
          if (rng() % 2) batch.push_back(l.id), logical.push_back(l.logical);
        }
        if (batch.empty()) continue;
        if (d.step(batch, logical).ok()) {
          for (size_t i = 0; i < batch.size(); ++i)
            for (Live& l : live)
              if (l.id == batch[i]) l.logical = logical[i];
        } else {
          ++refused;
        }
      } else if (kind == 6) {
        auto r = d.reg->compact(d.session, live[rng() % live.size()].id, rng() % 2);
        ASSERT_TRUE(r.ok() || r.status().code() == absl::StatusCode::kResourceExhausted) << r.status();
      } else if (kind == 7) {
        const Live parent = live[rng() % live.size()];
        auto child = d.reg->fork_sequence(d.session, parent.id);
        ASSERT_TRUE(child.ok());
        live.push_back({*child, parent.logical});
      } else {
        const size_t i = rng() % live.size();
        ASSERT_TRUE(d.reg->release_sequence(d.session, live[i].id).ok());
        live.erase(live.begin() + i);
      }
      ++ops;
      ASSERT_TRUE(d.reg->check_invariants().ok()) << d.reg->check_invariants() << " after op " << op;
      for (const Live& l : live) {
        const SequenceInfo info = d.info(l.id);
        ASSERT_EQ(int64_t(info.logical_length), l.logical);
        expect_well_formed(d.positions(l.id), info.logical_length, 0);
      }
    }
    EXPECT_GT(ops, 600);
    for (const Live& l : live) ASSERT_TRUE(d.reg->release_sequence(d.session, l.id).ok());
    EXPECT_EQ(d.reg->stats().blocks_used, 0);
  }
}

}  // namespace
}  // namespace karakv::server

namespace karakv::server {
namespace {

// A compaction that cannot get its fresh blocks is refused and changes nothing; the sequence
// compacts at a later trigger once blocks are free.
TEST(CompactTest, FailedCompactionLeavesTheSequenceExactlyAsItWas) {
  Driver d(4, /*blocks=*/12);
  SequenceOptions o;
  o.policy = "snapkv";
  o.params = {{"c_max", 1000}, {"c_target", 16}, {"w_obs", 4}};
  const uint64_t seq = *d.create(o);
  ASSERT_TRUE(d.append(seq, 0, 32, 4).ok());  // 8 blocks
  // A fork shares them, so the compaction cannot move tokens in place: it needs fresh blocks.
  const auto fork = d.reg->fork_sequence(d.session, seq);
  ASSERT_TRUE(fork.ok()) << fork.status();
  const uint64_t filler = *d.create(SequenceOptions{});
  ASSERT_TRUE(d.append(filler, 0, 16).ok());  // the last 4 blocks: none free
  const auto positions = d.positions(seq);
  const SequenceInfo info = d.info(seq);
  auto r = d.reg->compact(d.session, seq, false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("needs 4 fresh blocks"));
  EXPECT_EQ(d.positions(seq), positions);
  EXPECT_EQ(d.info(seq).length, info.length);
  EXPECT_EQ(d.info(seq).blocks, info.blocks);
  EXPECT_EQ(d.reg->stats().policies["snapkv"].failures, 1u);
  EXPECT_TRUE(d.reg->check_invariants().ok());
  ASSERT_TRUE(d.reg->release_sequence(d.session, filler).ok());
  r = d.reg->compact(d.session, seq, false);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(d.info(seq).length, 16u);
  EXPECT_EQ(d.info(seq).blocks, 4u);
  EXPECT_TRUE(d.reg->check_invariants().ok());
  ASSERT_TRUE(d.reg->release_sequence(d.session, *fork).ok());
}

}  // namespace
}  // namespace karakv::server

namespace karakv::server {
namespace {

using testing::read_values;

// A compaction whose range is the sequence's own (no fork or cache entry shares a block) moves the
// kept tokens down in place: it needs no free block, so it runs with the pool full, and it leaves
// exactly the K, V and positions that gathering into fresh blocks leaves (a forked twin, whose
// shared blocks cannot be written, compacted first by that path).
TEST(CompactTest, InPlaceNeedsNoFreeBlockAndKeepsWhatFreshBlocksKeep) {
  Driver d(4, /*blocks=*/16);
  SequenceOptions o;
  o.policy = "snapkv";
  o.params = {{"c_max", 1000}, {"c_target", 16}, {"w_obs", 4}};
  const uint64_t seq = *d.create(o);
  ASSERT_TRUE(d.append(seq, 0, 32, 4).ok());  // 8 blocks
  auto twin = d.reg->fork_sequence(d.session, seq);
  ASSERT_TRUE(twin.ok()) << twin.status();
  // The fork shares every block: the first compaction gathers into 4 fresh ones.
  ASSERT_TRUE(d.reg->compact(d.session, *twin, false).ok());
  EXPECT_EQ(d.reg->stats().blocks_used, 12);
  // Now the original's blocks are its own again; fill the pool.
  const uint64_t filler = *d.create(SequenceOptions{});
  ASSERT_TRUE(d.append(filler, 0, 16).ok());
  ASSERT_EQ(d.reg->stats().blocks_free, 0);
  auto r = d.reg->compact(d.session, seq, false);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(d.info(seq).length, 16u);
  EXPECT_EQ(d.info(seq).blocks, 4u);
  EXPECT_EQ(d.reg->stats().blocks_free, 4) << "the range's other four blocks went back";
  EXPECT_TRUE(d.reg->check_invariants().ok()) << d.reg->check_invariants();
  ASSERT_EQ(d.positions(seq), d.positions(*twin));
  std::vector<uint8_t> keys, twin_keys;
  const std::vector<uint8_t> values = read_values(*d.reg, d.session, seq, &keys);
  const std::vector<uint8_t> twin_values = read_values(*d.reg, d.session, *twin, &twin_keys);
  EXPECT_TRUE(keys == twin_keys) << "K differs from the fresh-block gather's";
  EXPECT_TRUE(values == twin_values) << "V differs from the fresh-block gather's";
}

// Kara's fit with a grain that leaves part blocks (1 and 3 tokens; the block is 4): its cuts move
// the newer tokens down behind the kept ones, in place or into fresh blocks. Afterwards every slot
// of every (layer, KV head) row holds exactly the K and V of the position the sequence reports for
// it, the slots are consecutive (the pool's invariants), and the sequence holds whole blocks only
// for what it keeps. (tests/server/compaction_shift_test.cc checks every shape of such a plan.)
TEST(CompactTest, CutsInPartBlocksMoveTheNewerTokensWithTheirKAndV) {
  for (const bool in_place : {true, false}) {
    for (const int grain : {1, 3}) {
      const uint64_t seed = 30 + grain;
      Driver d(seed, 4096, in_place ? nullptr : std::make_unique<karakv::testing::NoInPlaceBackend>(kernels::make_cpu_backend(1)));
      const auto& g = d.reg->geometry();
      SequenceOptions o;
      o.policy = "kara";
      o.params = {{"budget", 29}, {"recent", 8}, {"period", 2}, {"grain", grain}};
      const uint64_t seq = *d.create(o);
      ASSERT_TRUE(d.append(seq, 0, 18).ok());
      std::vector<int64_t> logical{18};
      for (int t = 0; t < 90; ++t) {
        ASSERT_TRUE(d.step({seq}, logical).ok());
        ASSERT_TRUE(d.reg->check_invariants().ok()) << d.reg->check_invariants();
        const SequenceInfo info = d.info(seq);
        EXPECT_EQ(info.blocks, (info.length + g.block_size - 1) / g.block_size) << "step " << t;
      }
      EXPECT_GE(d.info(seq).compactions, 20) << "grain " << grain;
      expect_well_formed(d.positions(seq), int32_t(logical[0]), 4);
      EXPECT_EQ(testing::kv_mismatches(*d.reg, d.session, seed, seq), 0) << "in place " << in_place << " grain " << grain;
    }
  }
}

// CaM changes the values of kept tokens, never which tokens are kept or the keys.
TEST(CamPolicyTest, MergingKeepsTheSameTokensAndChangesOnlyValues) {
  for (const char* policy : {"kara", "snapkv", "h2o"}) {
    std::vector<std::vector<int32_t>> positions[2];
    std::vector<uint8_t> values[2], keys[2];
    for (int cam = 0; cam < 2; ++cam) {
      Driver d(8);
      SequenceOptions o;
      o.policy = policy;
      if (o.policy == "kara") o.params = {{"window", 16}, {"period", 4}, {"recent", 0}, {"budget", 0}};
      else o.params = {{"c_max", 40}, {"c_target", 24}};
      if (o.policy == "snapkv") o.params["w_obs"] = 4;
      o.params["cam"] = cam;
      o.params["merge"] = 4;
      const uint64_t seq = *d.create(o);
      ASSERT_TRUE(d.append(seq, 0, 10, 4).ok());
      std::vector<int64_t> logical{10};
      for (int t = 0; t < 60; ++t) ASSERT_TRUE(d.step({seq}, logical).ok()) << policy;
      EXPECT_GE(d.info(seq).compactions, 2) << policy;
      ASSERT_TRUE(d.reg->check_invariants().ok());
      positions[cam] = d.positions(seq);
      values[cam] = read_values(*d.reg, d.session, seq, &keys[cam]);
    }
    EXPECT_EQ(positions[0], positions[1]) << policy;
    EXPECT_EQ(keys[0], keys[1]) << policy;
    EXPECT_NE(values[0], values[1]) << policy << ": CaM merged nothing";
  }
}

}  // namespace
}  // namespace karakv::server
