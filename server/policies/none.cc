// none: no compression (the vLLM-like baseline).
#include "server/policy.h"

namespace karakv::server {
namespace {

class NonePolicy final : public Policy {
 public:
  const std::string& name() const override { return name_; }
  Trigger trigger() const override { return Trigger::kNever; }
  bool due(const SequenceView&, bool) const override { return false; }
  absl::StatusOr<CompactionPlan> plan(const SequenceView&, const kernels::PagedKV&, kernels::Backend&) const override {
    return CompactionPlan{};
  }

 private:
  const std::string name_ = "none";
};

}  // namespace

std::vector<ParamSpec> none_params(const kernels::Geometry&) { return {}; }
absl::StatusOr<std::unique_ptr<Policy>> make_none(const PolicyParams&, const kernels::Geometry&) {
  return std::make_unique<NonePolicy>();
}

KARAKV_REGISTER_POLICY("none", none_params, make_none);

}  // namespace karakv::server
