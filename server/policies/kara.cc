// Kara: periodic sliding-window compression of generated tokens (docs/COMPRESSION.md section 1).
// The oldest W tail tokens are scored with bidirectional attention among themselves and replaced
// by B = rho * W of them chosen by Token2Chunk; the prompt and earlier windows are never touched.
#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "server/policy.h"

namespace karakv::server {
namespace {

// Where the uncompressed tail begins: block-aligned, right after the prompt and the windows
// already compressed. Set when decoding starts and after each of Kara's own compactions.
struct KaraState final : PolicyState {
  int32_t tail_start = 0;
  std::unique_ptr<PolicyState> clone() const override { return std::make_unique<KaraState>(*this); }
};

int32_t tail_start(const SequenceView& seq) {
  return seq.state != nullptr ? static_cast<const KaraState*>(seq.state)->tail_start : seq.resident;
}

class KaraPolicy final : public Policy {
 public:
  KaraPolicy(const PolicyParams& p, const kernels::Geometry& g)
      : window_(p.geti("window")),
        budget_(budget_for(p.get("rho"), window_, g.block_size)),
        candidates_(static_cast<int>(std::ceil(p.get("alpha") * budget_))),
        max_gap_(p.geti("max_gap")),
        period_(p.geti("period")),
        sinks_(p.geti("sinks")),
        merge_(policy_util::cam_merge_tokens(p)) {}

  // B = round(rho * W), rounded to a multiple of the block size (at least one block).
  static int budget_for(double rho, int window, int block) {
    const int b = static_cast<int>(std::lround(rho * window));
    return std::max(block, static_cast<int>(std::lround(double(b) / block)) * block);
  }

  const std::string& name() const override { return name_; }
  Trigger trigger() const override { return Trigger::kPeriodic; }
  int period() const override { return period_; }
  int query_window() const override { return -1; }
  // A window, the steps until the next tick, and the tokens sharing the prompt's last block.
  int query_capacity_hint() const override { return window_ + 2 * period_ + 16; }
  int merge_tokens() const override { return merge_; }
  std::vector<kernels::Op> required_ops() const override {
    return {kernels::Op::kWindowScores, kernels::Op::kToken2Chunk, kernels::Op::kGatherTokens};
  }

  std::unique_ptr<State> make_state(const kernels::Geometry&) const override { return std::make_unique<KaraState>(); }
  void on_decode_start(State* state, const SequenceView& seq) const override {
    const int32_t b = seq.geometry->block_size;
    static_cast<KaraState*>(state)->tail_start = (seq.resident + b - 1) / b * b;
  }
  void on_compacted(State* state, const CompactionPlan& plan, int32_t, bool own) const override {
    if (own) static_cast<KaraState*>(state)->tail_start = plan.begin + plan.num_kept;
  }
  // The tail may still be compressed; before decoding, nothing is fixed yet.
  int32_t first_open_slot(const SequenceView& seq) const override {
    return seq.decoding ? tail_start(seq) : seq.resident;
  }
  // Longest tail first.
  int64_t urgency(const SequenceView& seq) const override { return seq.resident - tail_start(seq); }

  bool due(const SequenceView& seq, bool) const override {
    const int32_t tail = tail_start(seq);
    return seq.resident - tail >= window_ && seq.queries_first <= tail && seq.queries_first + seq.num_queries >= tail + window_;
  }

  absl::StatusOr<CompactionPlan> plan(const SequenceView& seq, const kernels::PagedKV& kv,
                                      kernels::Backend& backend) const override {
    const kernels::Geometry& g = *seq.geometry;
    if (!due(seq, true)) {
      return absl::FailedPreconditionError(absl::StrCat("kara: tail holds ", seq.resident - tail_start(seq),
                                                        " tokens with queries, a window needs ", window_));
    }
    CompactionPlan plan;
    plan.begin = tail_start(seq);
    plan.end = plan.begin + window_;
    plan.num_kept = budget_;
    plan.kept.resize(size_t(g.num_layers) * g.num_kv_heads * budget_);
    if (merge_ > 0) plan.scores.resize(size_t(g.num_layers) * g.num_kv_heads * window_);
    std::vector<float> q(size_t(window_) * g.q_token_elems());
    std::vector<float> scores(size_t(g.num_kv_heads) * window_);
    const float scale = 1.0f / std::sqrt(float(g.head_dim));
    for (int l = 0; l < g.num_layers; ++l) {
      policy_util::gather_queries(seq, plan.begin, window_, l, q.data());
      if (auto s = to_status(backend.window_scores(kv, 0, l, plan.begin - seq.fp_offset, window_, q.data(),
                                                            scale, scores.data()));
          !s.ok()) {
        return s;
      }
      if (merge_ > 0) {
        std::copy(scores.begin(), scores.end(), plan.scores.begin() + size_t(l) * g.num_kv_heads * window_);
      }
      for (int h = 0; h < g.num_kv_heads; ++h) {
        float* row = scores.data() + size_t(h) * window_;
        // Attention sinks that fall inside a window (a prompt shorter than S) are always kept.
        for (int i = 0; i < window_; ++i) {
          if (seq.position(l, h, plan.begin + i) < sinks_) row[i] = policy_util::kMustKeep;
        }
        int32_t* out = plan.kept.data() + (size_t(l) * g.num_kv_heads + h) * budget_;
        if (auto s = to_status(backend.token2chunk(row, window_, budget_, candidates_, max_gap_, out));
            !s.ok()) {
          return s;
        }
        for (int i = 0; i < budget_; ++i) out[i] += plan.begin;
      }
    }
    return plan;
  }

 private:
  const std::string name_ = "kara";
  const int window_, budget_, candidates_, max_gap_, period_, sinks_, merge_;
};

}  // namespace

std::vector<ParamSpec> kara_params(const kernels::Geometry& g) {
  std::vector<ParamSpec> p = {
      {"window", 128, double(g.block_size), 8192, true, "W: tail tokens per window, a multiple of the block size"},
      {"rho", 0.25, 0.01, 0.99, false, "kept fraction of a window"},
      {"alpha", 0.5, 0.01, 1.0, false, "fraction of the budget taken as top-scoring candidates"},
      {"max_gap", 8, 0, 8192, true, "G: longest gap between candidates filled as a chunk"},
      {"period", 16, 1, 1 << 20, true, "P: decode steps between compression ticks"},
      {"sinks", 4, 0, 8192, true, "S: first positions always kept"},
  };
  for (ParamSpec& spec : policy_util::cam_params()) p.push_back(std::move(spec));
  return p;
}

absl::StatusOr<std::unique_ptr<Policy>> make_kara(const PolicyParams& p, const kernels::Geometry& g) {
  if (p.geti("window") % g.block_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("policy 'kara' parameter window=", p.geti("window"),
                                                   " must be a multiple of the block size ", g.block_size));
  }
  const int budget = KaraPolicy::budget_for(p.get("rho"), p.geti("window"), g.block_size);
  if (budget >= p.geti("window")) {
    return absl::InvalidArgumentError(absl::StrCat("policy 'kara': rho=", p.get("rho"), " keeps ", budget,
                                                   " of a ", p.geti("window"),
                                                   "-token window after rounding to blocks; expected fewer"));
  }
  return std::make_unique<KaraPolicy>(p, g);
}

KARAKV_REGISTER_POLICY("kara", kara_params, make_kara);

}  // namespace karakv::server
