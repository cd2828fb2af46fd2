// Run-time choice of the CPU attention's instruction set and the scorers' products
// (karakv/kernels/cpu_isa.h).
#include "karakv/kernels/cpu_isa.h"

#include <cstdlib>
#include <string>
#include <utility>

#include "simd.h"

namespace karakv::kernels {
namespace {

constexpr std::string_view kBaselineName = KARAKV_CPU_AVX2 ? "avx2" : "scalar";

// `text` as one of two named choices, "auto" or empty meaning `best`; a choice this build or CPU
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
KernelStatus from_env(const char* env, KernelStatus (*parse)(std::string_view, T*), T* out) {
  const char* value = std::getenv(env);
  KernelStatus st = parse(value == nullptr ? "" : value, out);
  if (!st.is_ok()) st.message = std::string(env) + ": " + st.message;
  return st;
}

}  // namespace

std::string_view cpu_isa_name(CpuIsa isa) { return isa == CpuIsa::kAvx512 ? "avx512" : kBaselineName; }

std::string cpu_isa_missing(CpuIsa isa) {
  if (isa == CpuIsa::kBaseline) return "";
#if KARAKV_HAVE_AVX512_ATTENTION
  // __builtin_cpu_supports also checks that the OS saves the AVX-512 registers (XCR0).
  if (!__builtin_cpu_supports("avx512f")) return "the CPU lacks avx512f";
  if (!__builtin_cpu_supports("avx512bw")) return "the CPU lacks avx512bw";
  if (!__builtin_cpu_supports("avx512vl")) return "the CPU lacks avx512vl";
  return "";
#else
  return "this build has no AVX-512 kernels (not x86-64, or the compiler lacks -mavx512bw)";
#endif
}

CpuIsa best_cpu_isa() { return cpu_isa_missing(CpuIsa::kAvx512).empty() ? CpuIsa::kAvx512 : CpuIsa::kBaseline; }

KernelStatus parse_cpu_isa(std::string_view text, CpuIsa* out) {
  return parse_choice<CpuIsa>("CPU ISA", text, {kBaselineName, CpuIsa::kBaseline}, {"avx512", CpuIsa::kAvx512},
                              best_cpu_isa(), cpu_isa_missing, out);
}

KernelStatus cpu_isa_from_env(CpuIsa* out) { return from_env(kCpuIsaEnv, parse_cpu_isa, out); }

std::string_view cpu_gemm_name(CpuGemm gemm) { return gemm == CpuGemm::kLibxsmm ? "libxsmm" : "tile"; }

std::string cpu_gemm_missing(CpuGemm gemm) {
  if (gemm == CpuGemm::kTile) return "";
#if KARAKV_HAVE_LIBXSMM
#if defined(__x86_64__)
  return "";
#else
  return "libxsmm's JIT needs x86-64";
#endif
#else
  return "this build has no libxsmm (install libxsmm-dev and configure again)";
#endif
}

CpuGemm best_cpu_gemm() {
  return cpu_gemm_missing(CpuGemm::kLibxsmm).empty() ? CpuGemm::kLibxsmm : CpuGemm::kTile;
}

KernelStatus parse_cpu_gemm(std::string_view text, CpuGemm* out) {
  return parse_choice<CpuGemm>("CPU GEMM", text, {"tile", CpuGemm::kTile}, {"libxsmm", CpuGemm::kLibxsmm},
                               best_cpu_gemm(), cpu_gemm_missing, out);
}

KernelStatus cpu_gemm_from_env(CpuGemm* out) { return from_env(kCpuGemmEnv, parse_cpu_gemm, out); }

}  // namespace karakv::kernels
