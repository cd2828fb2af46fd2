// Run-time choice of the CPU attention's instruction set and the scorers' products
// (karakv/kernels/cpu_isa.h).
#include "karakv/kernels/cpu_isa.h"

#include <cstdlib>
#include <string>
#include <utility>

#include "../common/choice.h"
#include "simd.h"

namespace karakv::kernels {
namespace {

using common::parse_choice;

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
  return parse_choice<CpuIsa>("CPU ISA", text, {kBaselineName, CpuIsa::kBaseline}, {"avx512", CpuIsa::kAvx512},
                              best_cpu_isa(), cpu_isa_missing, out);
}

KernelStatus cpu_isa_from_env(CpuIsa* out) { return common::choice_from_env(kCpuIsaEnv, parse_cpu_isa, out); }

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

KernelStatus cpu_gemm_from_env(CpuGemm* out) { return common::choice_from_env(kCpuGemmEnv, parse_cpu_gemm, out); }

}  // namespace karakv::kernels
