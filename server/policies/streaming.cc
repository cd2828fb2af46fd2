// streaming (StreamingLLM): at c_max keep the attention sinks plus the most recent tokens,
// c_target in all.
#include "server/policy.h"
#include "server/policies/threshold.h"

namespace karakv::server {
namespace {

class StreamingPolicy final : public ThresholdPolicy {
 public:
  explicit StreamingPolicy(const PolicyParams& p) : ThresholdPolicy("streaming", p) {}

  absl::StatusOr<CompactionPlan> plan(const SequenceView& seq, const kernels::PagedKV&,
                                      kernels::Backend& backend) const override {
    const kernels::Geometry& g = *seq.geometry;
    // Recency as the score: the top c_target after the sinks are the newest slots.
    std::vector<float> scores(size_t(g.num_layers) * g.num_kv_heads * seq.resident);
    for (size_t i = 0; i < scores.size(); ++i) scores[i] = float(i % seq.resident);
    return policy_util::top_budget_plan(seq, scores, c_target_, sinks_, 0, backend);
  }
};

}  // namespace

std::vector<ParamSpec> streaming_params(const kernels::Geometry&) { return threshold_params(); }

absl::StatusOr<std::unique_ptr<Policy>> make_streaming(const PolicyParams& p, const kernels::Geometry&) {
  if (auto s = check_threshold("streaming", p, p.geti("sinks")); !s.ok()) return s;
  return std::make_unique<StreamingPolicy>(p);
}

KARAKV_REGISTER_POLICY("streaming", streaming_params, make_streaming);

}  // namespace karakv::server
