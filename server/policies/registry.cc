// The policy table: one line per policy.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/policies/policies.h"

namespace karakv::server {
namespace {

struct Entry {
  const char* name;
  std::vector<ParamSpec> (*params)(const kernels::Geometry&);
  absl::StatusOr<std::unique_ptr<Policy>> (*make)(const PolicyParams&, const kernels::Geometry&);
};

const Entry kPolicies[] = {
    {"none", none_params, make_none},
    {"kara", kara_params, make_kara},
    {"snapkv", snapkv_params, make_snapkv},
    {"chunkkv", chunkkv_params, make_chunkkv},
    {"streaming", streaming_params, make_streaming},
    {"h2o", h2o_params, make_h2o},
};

}  // namespace

std::vector<std::string> policy_names() {
  std::vector<std::string> out;
  for (const Entry& e : kPolicies) out.push_back(e.name);
  return out;
}

absl::StatusOr<std::unique_ptr<Policy>> make_policy(const std::string& name,
                                                    const std::map<std::string, double>& params,
                                                    const kernels::Geometry& geometry) {
  for (const Entry& e : kPolicies) {
    if (name != e.name) continue;
    auto p = resolve_params(name, e.params(geometry), params);
    if (!p.ok()) return p.status();
    return e.make(*p, geometry);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown policy '", name, "'; expected one of: ", absl::StrJoin(policy_names(), ", ")));
}

}  // namespace karakv::server
