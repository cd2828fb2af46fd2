// Parameter validation and helpers shared by every policy.
#include "server/policy.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace karakv::server {

absl::StatusOr<PolicyParams> resolve_params(const std::string& policy, const std::vector<ParamSpec>& specs,
                                            const std::map<std::string, double>& given) {
  PolicyParams out;
  for (const ParamSpec& s : specs) out.set(s.name, s.default_value);
  for (const auto& [name, value] : given) {
    const ParamSpec* spec = nullptr;
    for (const ParamSpec& s : specs) {
      if (s.name == name) spec = &s;
    }
    if (spec == nullptr) {
      std::vector<std::string> names;
      for (const ParamSpec& s : specs) names.push_back(s.name);
      return absl::InvalidArgumentError(absl::StrCat("policy '", policy, "' has no parameter '", name,
                                                     "'; it takes: ", names.empty() ? "none" : absl::StrJoin(names, ", ")));
    }
    if (!(value >= spec->min && value <= spec->max) || (spec->integer && value != std::floor(value))) {
      return absl::InvalidArgumentError(absl::StrCat("policy '", policy, "' parameter ", name, "=", value,
                                                     " out of range: expected ", spec->integer ? "an integer " : "",
                                                     "in [", spec->min, ", ", spec->max, "] (", spec->help, ")"));
    }
    out.set(name, value);
    out.mark_given(name);
  }
  return out;
}

namespace {
// Filled by KARAKV_REGISTER_POLICY during static initialisation, read-only afterwards.
std::map<std::string, PolicyEntry>& policy_table() {
  static auto* table = new std::map<std::string, PolicyEntry>();
  return *table;
}
}  // namespace

bool register_policy(PolicyEntry entry) {
  std::string name = entry.name;
  if (!policy_table().emplace(name, std::move(entry)).second) {
    std::fprintf(stderr, "karakv: policy '%s' is registered twice\n", name.c_str());
    std::abort();
  }
  return true;
}

std::vector<std::string> policy_names() {
  std::vector<std::string> out;
  for (const auto& [name, e] : policy_table()) out.push_back(name);
  return out;
}

absl::StatusOr<PolicyParams> policy_params(const std::string& name, const std::map<std::string, double>& params,
                                           const kernels::Geometry& geometry) {
  auto it = policy_table().find(name);
  if (it == policy_table().end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown policy '", name, "'; expected one of: ", absl::StrJoin(policy_names(), ", ")));
  }
  return resolve_params(name, it->second.params(geometry), params);
}

absl::StatusOr<std::unique_ptr<Policy>> make_policy(const std::string& name,
                                                    const std::map<std::string, double>& params,
                                                    const kernels::Geometry& geometry, bool quantized_storage) {
  auto it = policy_table().find(name);
  if (it == policy_table().end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown policy '", name, "'; expected one of: ", absl::StrJoin(policy_names(), ", ")));
  }
  auto p = resolve_params(name, it->second.params(geometry), params);
  if (!p.ok()) return p.status();
  p->set_quantized_storage(quantized_storage);
  return it->second.make(*p, geometry);
}

namespace policy_util {

void gather_queries(const SequenceView& seq, int32_t first, int32_t n, int layer, float* out) {
  const size_t row = seq.geometry->q_token_elems();
  for (int32_t i = 0; i < n; ++i) std::memcpy(out + i * row, seq.queries_of(first + i, layer), row * 4);
}

std::vector<ParamSpec> cam_params() {
  return {
      {"cam", 0, 0, 1, true, "1: merge evicted values into the next kept tokens (CaM)"},
      {"merge", 4, 1, 4096, true, "M: kept tokens each evicted value is merged into (convex, normalised)"},
  };
}

int cam_merge_tokens(const PolicyParams& p) { return p.geti("cam") ? p.geti("merge") : 0; }

void force_sinks(const SequenceView& seq, int32_t begin, int32_t len, int sinks, float* scores) {
  const int hk = seq.geometry->num_kv_heads, rows = seq.geometry->num_layers * hk;
  for (int r = 0; r < rows; ++r) {
    for (int32_t i = 0; i < len && seq.position(r / hk, r % hk, begin + i) < sinks; ++i) {
      scores[size_t(r) * len + i] = kMustKeep;
    }
  }
}

absl::StatusOr<CompactionPlan> top_budget_plan(const SequenceView& seq, std::vector<float>& scores, int budget,
                                               int sinks, int keep_last, kernels::Backend& backend,
                                               bool keep_scores) {
  const kernels::Geometry& g = *seq.geometry;
  const int32_t n = seq.resident;
  CompactionPlan plan;
  if (keep_scores) plan.scores = scores;
  plan.begin = 0;
  plan.end = n;
  plan.num_kept = std::min(budget, n);
  plan.kept.resize(size_t(g.num_layers) * g.num_kv_heads * plan.num_kept);
  force_sinks(seq, 0, n, sinks, scores.data());
  for (size_t r = 0; r < size_t(g.num_layers) * g.num_kv_heads; ++r) {
    for (int32_t s = std::max(0, n - keep_last); s < n; ++s) scores[r * n + s] = kMustKeep;
  }
  if (absl::Status st =
          to_status(backend.top_k(scores.data(), g.num_layers * g.num_kv_heads, n, plan.num_kept, plan.kept.data()));
      !st.ok()) {
    return st;
  }
  return plan;
}

}  // namespace policy_util
}  // namespace karakv::server
