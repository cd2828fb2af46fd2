// snapkv: at c_max, the last w_obs tokens' queries score every resident key (causal inside the
// observation window, mean over queries and the group's heads, average-pooled); the window and
// the sinks are kept plus the top-scoring rest, c_target tokens per (layer, KV head).
#include <cmath>

#include "absl/strings/str_cat.h"
#include "server/policy.h"
#include "server/policies/threshold.h"

namespace karakv::server {

absl::StatusOr<std::vector<float>> snapkv_all_scores(const SequenceView& seq, const kernels::PagedKV& kv,
                                                     kernels::Backend& backend, int w_obs, int pool) {
  const kernels::Geometry& g = *seq.geometry;
  const int32_t n = seq.resident;
  std::vector<float> scores(size_t(g.num_layers) * g.num_kv_heads * n);
  std::vector<float> q(size_t(w_obs) * g.q_token_elems());
  const float scale = 1.0f / std::sqrt(float(g.head_dim));
  for (int l = 0; l < g.num_layers; ++l) {
    policy_util::gather_queries(seq, n - w_obs, w_obs, l, q.data());
    float* out = scores.data() + size_t(l) * g.num_kv_heads * n;
    if (auto s = to_status(backend.snapkv_scores(kv, 0, l, w_obs, q.data(), scale, pool, out)); !s.ok()) {
      return s;
    }
  }
  return scores;
}

namespace {

class SnapKVPolicy final : public SnapKVScoredPolicy {
 public:
  explicit SnapKVPolicy(const PolicyParams& p) : SnapKVScoredPolicy("snapkv", p) {}

  absl::StatusOr<CompactionPlan> plan(const SequenceView& seq, const kernels::PagedKV& kv,
                                      kernels::Backend& backend) const override {
    auto scores = snapkv_all_scores(seq, kv, backend, w_obs_, pool_);
    if (!scores.ok()) return scores.status();
    return policy_util::top_budget_plan(seq, *scores, c_target_, sinks_, w_obs_, backend, merge_ > 0);
  }
};

}  // namespace

std::vector<ParamSpec> snapkv_params(const kernels::Geometry&) {
  auto p = scored_threshold_params();
  for (ParamSpec& spec : snapkv_score_params()) p.push_back(std::move(spec));
  return p;
}

absl::StatusOr<std::unique_ptr<Policy>> make_snapkv(const PolicyParams& p, const kernels::Geometry&) {
  if (auto s = check_snapkv_scored("snapkv", p); !s.ok()) return s;
  return std::make_unique<SnapKVPolicy>(p);
}

KARAKV_REGISTER_POLICY("snapkv", snapkv_params, make_snapkv);

}  // namespace karakv::server
