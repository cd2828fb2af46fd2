// h2o (Heavy-Hitter Oracle): the daemon accumulates every decode step's attention per resident
// token; at c_max keep the sinks, the newest `recent` tokens and the heaviest hitters, c_target in
// all per (layer, KV head).
#include <cmath>

#include "server/policy.h"
#include "server/policies/threshold.h"

namespace karakv::server {
namespace {

// Accumulated decode attention per resident slot: [num_layers * num_kv_heads][resident (+1 while a
// step's token is pending)].
struct H2OState final : PolicyState {
  std::vector<std::vector<float>> rows;
  std::unique_ptr<PolicyState> clone() const override { return std::make_unique<H2OState>(*this); }
  size_t bytes() const override {
    size_t n = 0;
    for (const auto& row : rows) n += row.size() * sizeof(float);
    return n;
  }
};

class H2OPolicy final : public ThresholdPolicy {
 public:
  H2OPolicy(const PolicyParams& p, const kernels::Geometry& g)
      : ThresholdPolicy("h2o", p),
        recent_(static_cast<int>(std::lround(p.get("recent_ratio") * p.geti("c_target")))),
        kv_heads_(g.num_kv_heads) {}

  bool needs_attention() const override { return true; }
  std::unique_ptr<State> make_state(const kernels::Geometry& g) const override {
    auto state = std::make_unique<H2OState>();
    state->rows.resize(size_t(g.num_layers) * g.num_kv_heads);
    return state;
  }
  void on_grow(State* state, int32_t slots) const override {
    for (auto& row : static_cast<H2OState*>(state)->rows) row.resize(slots, 0.0f);
  }
  // Kept slots keep their sums; the slots after the range shift down with their tokens.
  void on_compacted(State* state, const CompactionPlan& plan, int32_t resident_before, bool) const override {
    auto& rows = static_cast<H2OState*>(state)->rows;
    for (size_t r = 0; r < rows.size(); ++r) {
      std::vector<float>& acc = rows[r];
      std::vector<float> next(acc.begin(), acc.begin() + plan.begin);
      for (int32_t i = 0; i < plan.num_kept; ++i) next.push_back(acc[plan.kept[r * plan.num_kept + i]]);
      next.insert(next.end(), acc.begin() + plan.end, acc.begin() + resident_before);
      acc = std::move(next);
    }
  }
  float* accumulator(State* state, int layer, int kv_head) const override {
    auto& rows = static_cast<H2OState*>(state)->rows;
    return rows[size_t(layer) * kv_heads_ + kv_head].data();
  }
  std::vector<kernels::Op> required_ops() const override {
    return {kernels::Op::kDecodeAttentionAccumulate, kernels::Op::kTopK, kernels::Op::kGatherTokens};
  }

  absl::StatusOr<CompactionPlan> plan(const SequenceView& seq, const kernels::PagedKV&,
                                      kernels::Backend& backend) const override {
    std::vector<float> scores;
    scores.reserve(size_t(seq.geometry->num_layers) * seq.geometry->num_kv_heads * seq.resident);
    for (const std::vector<float>& row : static_cast<const H2OState*>(seq.state)->rows) {
      scores.insert(scores.end(), row.begin(), row.begin() + seq.resident);
    }
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
