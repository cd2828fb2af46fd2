// Run-time choice of the CPU attention's instruction set (karakv/kernels/cpu_isa.h).
#include "karakv/kernels/cpu_isa.h"

#include <cstdlib>
#include <string>

#include "simd.h"

namespace karakv::kernels {
namespace {

constexpr std::string_view kBaselineName = KARAKV_CPU_AVX2 ? "avx2" : "scalar";

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
  const std::string expected = "expected auto, " + std::string(kBaselineName) + " or avx512";
  CpuIsa isa;
  if (text.empty() || text == "auto") {
    isa = best_cpu_isa();
  } else if (text == kBaselineName) {
    isa = CpuIsa::kBaseline;
  } else if (text == "avx512") {
    isa = CpuIsa::kAvx512;
  } else {
    return KernelStatus::invalid("unknown CPU ISA '" + std::string(text) + "', " + expected);
  }
  if (std::string missing = cpu_isa_missing(isa); !missing.empty()) {
    return KernelStatus::invalid("CPU ISA " + std::string(text) + " cannot run here: " + missing + "; use auto or " +
                                 std::string(kBaselineName));
  }
  *out = isa;
  return KernelStatus::ok();
}

KernelStatus cpu_isa_from_env(CpuIsa* out) {
  const char* value = std::getenv(kCpuIsaEnv);
  KernelStatus st = parse_cpu_isa(value == nullptr ? "" : value, out);
  if (!st.is_ok()) st.message = std::string(kCpuIsaEnv) + ": " + st.message;
  return st;
}

}  // namespace karakv::kernels
