// h2o (Heavy-Hitter Oracle): the daemon accumulates every decode step's attention per resident
// token; at c_max keep the sinks, the newest `recent` tokens and the heaviest hitters, c_target in
// all per (layer, KV head).
#include <cmath>

#include "server/policies/policies.h"
#include "server/policies/threshold.h"

namespace karakv::server {
namespace {

class H2OPolicy final : public ThresholdPolicy {
 public:
  explicit H2OPolicy(const PolicyParams& p)
      : ThresholdPolicy("h2o", p), recent_(static_cast<int>(std::lround(p.get("recent_ratio") * p.geti("c_target")))) {}

  bool needs_attention() const override { return true; }
  std::vector<kernels::Op> required_ops() const override {
    return {kernels::Op::kDecodeAttentionAccumulate, kernels::Op::kTopK, kernels::Op::kGatherTokens};
  }

  absl::StatusOr<CompactionPlan> plan(const SequenceView& seq, const kernels::PagedKV&,
                                      kernels::Backend& backend) const override {
    std::vector<float> scores;
    scores.reserve(size_t(seq.geometry->num_layers) * seq.geometry->num_kv_heads * seq.resident);
    for (const std::vector<float>& row : *seq.attention) scores.insert(scores.end(), row.begin(), row.begin() + seq.resident);
    return policy_util::top_budget_plan(seq, scores, c_target_, sinks_, recent_, backend, merge_ > 0);
  }

 protected:
  bool has_inputs(const SequenceView& seq) const override { return seq.attention != nullptr; }
  std::string inputs_needed() const override { return "it needs accumulated decode attention"; }

 private:
  const int recent_;
};

}  // namespace

std::vector<ParamSpec> h2o_params(const kernels::Geometry&) {
  auto p = scored_threshold_params();
  p.push_back({"recent_ratio", 0.5, 0.0, 1.0, false, "share of c_target kept as the newest tokens"});
  return p;
}

absl::StatusOr<std::unique_ptr<Policy>> make_h2o(const PolicyParams& p, const kernels::Geometry&) {
  const int recent = static_cast<int>(std::lround(p.get("recent_ratio") * p.geti("c_target")));
  if (auto s = check_threshold("h2o", p, recent + p.geti("sinks")); !s.ok()) return s;
  return std::make_unique<H2OPolicy>(p);
}

}  // namespace karakv::server
