// Every policy's parameter list and factory; registry.cc maps names to them.
#pragma once

#include <memory>
#include <vector>

#include "server/policy.h"

namespace karakv::server {

#define KARAKV_DECLARE_POLICY(name)                                  \
  std::vector<ParamSpec> name##_params(const kernels::Geometry& g); \
  absl::StatusOr<std::unique_ptr<Policy>> make_##name(const PolicyParams& p, const kernels::Geometry& g);

KARAKV_DECLARE_POLICY(none)
KARAKV_DECLARE_POLICY(kara)
KARAKV_DECLARE_POLICY(snapkv)
KARAKV_DECLARE_POLICY(chunkkv)
KARAKV_DECLARE_POLICY(streaming)
KARAKV_DECLARE_POLICY(h2o)

#undef KARAKV_DECLARE_POLICY

}  // namespace karakv::server
