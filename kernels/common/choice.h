// A run-time choice between two named implementations, parsed from text or an environment
// variable with errors a user can act on: the CPU attention's ISA and scorer products
// (karakv/kernels/cpu_isa.h) and the CUDA backend's decode attention (karakv/kernels/cuda_attention.h).
#pragma once

#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>

#include "karakv/kernels/types.h"

namespace karakv::kernels::common {

// `text` as one of two named choices, "auto" or empty meaning `best`; a choice this build or machine
// cannot run is refused with what is missing. `what` names the setting in messages ("CPU ISA").
template <typename T>
KernelStatus parse_choice(std::string_view what, std::string_view text, std::pair<std::string_view, T> first,
                          std::pair<std::string_view, T> second, T best, std::string (*missing_of)(T), T* out) {
  const std::string expected =
      "expected auto, " + std::string(first.first) + " or " + std::string(second.first);
  T value;
  if (text.empty() || text == "auto") {
    value = best;
  } else if (text == first.first) {
    value = first.second;
  } else if (text == second.first) {
    value = second.second;
  } else {
    return KernelStatus::invalid("unknown " + std::string(what) + " '" + std::string(text) + "', " + expected);
  }
  if (std::string missing = missing_of(value); !missing.empty()) {
    return KernelStatus::invalid(std::string(what) + " " + std::string(text) + " cannot run here: " + missing +
                                 "; use auto or " + std::string(first.first));
  }
  *out = value;
  return KernelStatus::ok();
}

// parse(getenv(env)), errors prefixed with the variable's name.
template <typename T>
KernelStatus choice_from_env(const char* env, KernelStatus (*parse)(std::string_view, T*), T* out) {
  const char* value = std::getenv(env);
  KernelStatus st = parse(value == nullptr ? "" : value, out);
  if (!st.is_ok()) st.message = std::string(env) + ": " + st.message;
  return st;
}

}  // namespace karakv::kernels::common
