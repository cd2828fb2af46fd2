// h2o (Heavy-Hitter Oracle): the daemon accumulates every decode step's attention per resident
// token; at c_max keep the sinks, the newest `recent` tokens and the heaviest hitters, c_target in
// all per (layer, KV head).
#include <cmath>

#include "server/policy.h"
#include "server/policies/threshold.h"
#include "server/score_rows.h"

namespace karakv::server {
namespace {

// Accumulated decode attention per resident slot, in the backend's memory (on a GPU the decode
// step adds into it on the device): [num_layers * num_kv_heads][resident (+1 while a step's token
// is pending)].
struct H2OState final : PolicyState {
  explicit H2OState(std::unique_ptr<ScoreRows> r) : rows(std::move(r)) {}
  std::unique_ptr<ScoreRows> rows;
  absl::StatusOr<std::unique_ptr<PolicyState>> clone() const override {
    auto copy = rows->clone();
    if (!copy.ok()) return copy.status();
    return std::make_unique<H2OState>(std::move(*copy));
  }
  size_t bytes() const override { return rows->bytes(); }
};

ScoreRows& rows_of(PolicyState* state) { return *static_cast<H2OState*>(state)->rows; }

class H2OPolicy final : public ThresholdPolicy {
 public:
  H2OPolicy(const PolicyParams& p, const kernels::Geometry& g)
      : ThresholdPolicy("h2o", p),
        recent_(static_cast<int>(std::lround(p.get("recent_ratio") * p.geti("c_target")))),
        kv_heads_(g.num_kv_heads) {}

  bool needs_attention() const override { return true; }
  std::unique_ptr<State> make_state(const kernels::Geometry& g, kernels::Backend& backend) const override {
    return std::make_unique<H2OState>(std::make_unique<ScoreRows>(backend, size_t(g.num_layers) * g.num_kv_heads));
  }
  absl::Status on_grow(State* state, int32_t slots) const override { return rows_of(state).grow(slots); }
  // Kept slots keep their sums; the slots after the range shift down with their tokens.
  absl::Status on_compacted(State* state, const CompactionPlan& plan, int32_t resident_before, bool) const override {
    return rows_of(state).remap(plan, resident_before);
  }
  float* accumulator(State* state, int layer, int kv_head) const override {
    return rows_of(state).row(size_t(layer) * kv_heads_ + kv_head);
  }
  std::vector<kernels::Op> required_ops() const override {
    return {kernels::Op::kDecodeAttentionAccumulate, kernels::Op::kTopK, kernels::Op::kGatherTokens};
  }

  absl::StatusOr<CompactionPlan> plan(const SequenceView& seq, const kernels::PagedKV&,
                                      kernels::Backend& backend) const override {
    std::vector<float> scores;
    if (absl::Status s = static_cast<const H2OState*>(seq.state)->rows->read(seq.resident, &scores); !s.ok()) return s;
    return policy_util::top_budget_plan(seq, scores, c_target_, sinks_, recent_, backend, merge_ > 0);
  }

 protected:
  bool has_inputs(const SequenceView& seq) const override { return seq.state != nullptr; }
  std::string inputs_needed() const override { return "it needs accumulated decode attention"; }

 private:
  const int recent_;
  const size_t kv_heads_;
};

}  // namespace

std::vector<ParamSpec> h2o_params(const kernels::Geometry&) {
  auto p = scored_threshold_params();
  p.push_back({"recent_ratio", 0.5, 0.0, 1.0, false, "share of c_target kept as the newest tokens"});
  return p;
}

absl::StatusOr<std::unique_ptr<Policy>> make_h2o(const PolicyParams& p, const kernels::Geometry& g) {
  const int recent = static_cast<int>(std::lround(p.get("recent_ratio") * p.geti("c_target")));
  if (auto s = check_threshold("h2o", p, recent + p.geti("sinks")); !s.ok()) return s;
  return std::make_unique<H2OPolicy>(p, g);
}

KARAKV_REGISTER_POLICY("h2o", h2o_params, make_h2o);

}  // namespace karakv::server
