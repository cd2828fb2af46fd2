// chunkkv: SnapKV scores summed over a layer's KV heads decide which fixed chunks of 10 slots
// survive; every head of a layer keeps the same slots. Chunks are taken whole, best first, while
// they fit; the rest of the budget is filled with the best single tokens (sinks and the
// observation window are always kept).
#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "server/policy.h"
#include "server/policies/threshold.h"

namespace karakv::server {
namespace {

class ChunkKVPolicy final : public SnapKVScoredPolicy {
 public:
  explicit ChunkKVPolicy(const PolicyParams& p) : SnapKVScoredPolicy("chunkkv", p), chunk_(p.geti("chunk")) {}

  absl::StatusOr<CompactionPlan> plan(const SequenceView& seq, const kernels::PagedKV& kv,
                                      kernels::Backend& backend) const override {
    const kernels::Geometry& g = *seq.geometry;
    const int32_t n = seq.resident;
    auto scores = snapkv_all_scores(seq, kv, backend, w_obs_, pool_);
    if (!scores.ok()) return scores.status();
    CompactionPlan plan;
    if (merge_ > 0) plan.scores = *scores;
    plan.begin = 0;
    plan.end = n;
    plan.num_kept = std::min(c_target_, n);
    plan.kept.resize(size_t(g.num_layers) * g.num_kv_heads * plan.num_kept);
    std::vector<double> u(n);
    std::vector<char> keep(n);
    for (int l = 0; l < g.num_layers; ++l) {
      std::fill(u.begin(), u.end(), 0.0);
      std::fill(keep.begin(), keep.end(), 0);
      int kept = 0;
      for (int h = 0; h < g.num_kv_heads; ++h) {
        const float* row = scores->data() + (size_t(l) * g.num_kv_heads + h) * n;
        for (int32_t s = 0; s < n; ++s) {
          u[s] += row[s];
          if (!keep[s] && (seq.position(l, h, s) < sinks_ || s >= n - w_obs_)) keep[s] = 1, ++kept;
        }
      }
      const int num_chunks = (n + chunk_ - 1) / chunk_;
      std::vector<double> chunk_score(num_chunks, 0.0);
      for (int32_t s = 0; s < n; ++s) chunk_score[s / chunk_] += u[s];
      std::vector<int> order(num_chunks);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return chunk_score[a] > chunk_score[b]; });
      for (int c : order) {
        const int32_t lo = c * chunk_, hi = std::min(n, lo + chunk_);
        int add = 0;
        for (int32_t s = lo; s < hi; ++s) add += keep[s] ? 0 : 1;
        if (kept + add > plan.num_kept) continue;
        for (int32_t s = lo; s < hi; ++s) keep[s] = 1;
        kept += add;
      }
      if (kept < plan.num_kept) {
        std::vector<int32_t> rest;
        for (int32_t s = 0; s < n; ++s) {
          if (!keep[s]) rest.push_back(s);
        }
        std::stable_sort(rest.begin(), rest.end(), [&](int32_t a, int32_t b) { return u[a] > u[b]; });
        for (size_t i = 0; kept < plan.num_kept && i < rest.size(); ++i) keep[rest[i]] = 1, ++kept;
      }
      std::vector<int32_t> slots;
      for (int32_t s = 0; s < n; ++s) {
        if (keep[s]) slots.push_back(s);
      }
      for (int h = 0; h < g.num_kv_heads; ++h) {
        std::copy(slots.begin(), slots.end(), plan.kept.begin() + (size_t(l) * g.num_kv_heads + h) * plan.num_kept);
      }
    }
    return plan;
  }

 private:
  const int chunk_;
};

}  // namespace

std::vector<ParamSpec> chunkkv_params(const kernels::Geometry&) {
  auto p = scored_threshold_params();
  for (ParamSpec& spec : snapkv_score_params()) p.push_back(std::move(spec));
  p.push_back({"chunk", 10, 1, 4096, true, "slots per chunk"});
  return p;
}

absl::StatusOr<std::unique_ptr<Policy>> make_chunkkv(const PolicyParams& p, const kernels::Geometry&) {
  if (auto s = check_snapkv_scored("chunkkv", p); !s.ok()) return s;
  return std::make_unique<ChunkKVPolicy>(p);
}

KARAKV_REGISTER_POLICY("chunkkv", chunkkv_params, make_chunkkv);

}  // namespace karakv::server
