// Which code the CPU backend runs, chosen at run time from what the CPU and the build have (or
// forced, for tests and benchmarks): the attention's vector instruction set (the build's baseline
// or AVX-512), and the scorers' matrix products (the project's register tile or libxsmm).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "karakv/kernels/types.h"

namespace karakv::kernels {

enum class CpuIsa : uint8_t {
  kBaseline,  // what the library is compiled for: AVX2 + FMA + F16C on x86-64 (default), else scalar
  kAvx512,    // AVX-512 F/BW/VL loops (kernels/cpu/attention_avx512.cc)
};

// "avx2" (or "scalar" where the library is not built for AVX2) and "avx512".
std::string_view cpu_isa_name(CpuIsa isa);

// Empty when this build and CPU can run `isa`, else what is missing, e.g. "the CPU lacks avx512bw"
// or "this build has no AVX-512 kernels (not x86-64)".
std::string cpu_isa_missing(CpuIsa isa);

// AVX-512 where it can run, else the baseline.
CpuIsa best_cpu_isa();

// "auto" (or empty): best_cpu_isa(); "avx512" or the baseline's name: that one, if it can run.
// Anything else, or an ISA this CPU lacks, is kInvalidArgument saying what was wrong and what is
// expected.
KernelStatus parse_cpu_isa(std::string_view text, CpuIsa* out);

// The environment variable that forces the CPU backend's ISA, parsed by parse_cpu_isa.
inline constexpr char kCpuIsaEnv[] = "KARAKV_CPU_ISA";

// parse_cpu_isa of $KARAKV_CPU_ISA; unset is "auto". Errors name the variable.
KernelStatus cpu_isa_from_env(CpuIsa* out);

// The matrix products of the scorers that score many queries at once (window_scores,
// window_scores_observed, snapkv_scores; kernels/cpu/compress.cc). One decode query (H2O's and
// Kara's decode observers) always uses the tile: for a matrix-vector product it beats the libraries
// (docs/BENCHMARKS.md, "GEMM candidates for the scorers").
enum class CpuGemm : uint8_t {
  kTile,     // the project's AVX2 register tile (scalar loops without AVX2)
  kLibxsmm,  // libxsmm's JIT kernels, where the build found libxsmm (KARAKV_HAVE_LIBXSMM)
};

// "tile" and "libxsmm".
std::string_view cpu_gemm_name(CpuGemm gemm);

// Empty when this build and CPU can run `gemm`, else what is missing.
std::string cpu_gemm_missing(CpuGemm gemm);

// libxsmm where it can run, else the tile.
CpuGemm best_cpu_gemm();

// "auto" (or empty): best_cpu_gemm(); "tile" or "libxsmm": that one, if it can run. Anything else
// is kInvalidArgument saying what was wrong and what is expected.
KernelStatus parse_cpu_gemm(std::string_view text, CpuGemm* out);

// The environment variable that forces the scorers' products, parsed by parse_cpu_gemm.
inline constexpr char kCpuGemmEnv[] = "KARAKV_CPU_GEMM";

// parse_cpu_gemm of $KARAKV_CPU_GEMM; unset is "auto". Errors name the variable.
KernelStatus cpu_gemm_from_env(CpuGemm* out);

}  // namespace karakv::kernels
