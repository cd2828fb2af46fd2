// Choosing the CPU attention's instruction set and the scorers' products: names, refusals that say
// what was wrong and what is expected, the environment variables, and backends made for a choice
// the CPU or build lacks.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>

#include "karakv/kernels/backend.h"
#include "karakv/kernels/cpu_isa.h"
#include "kernel_test_util.h"

namespace karakv::kernels::test {
namespace {

bool avx512_runs() { return cpu_isa_missing(CpuIsa::kAvx512).empty(); }

TEST(CpuIsaTest, BaselineAlwaysRunsAndAutoPicksTheBest) {
  EXPECT_EQ(cpu_isa_missing(CpuIsa::kBaseline), "");
  EXPECT_EQ(best_cpu_isa(), avx512_runs() ? CpuIsa::kAvx512 : CpuIsa::kBaseline);
  for (const char* text : {"", "auto"}) {
    CpuIsa isa = CpuIsa::kBaseline;
    ASSERT_TRUE(parse_cpu_isa(text, &isa).is_ok()) << text;
    EXPECT_EQ(isa, best_cpu_isa()) << text;
  }
  CpuIsa isa = CpuIsa::kAvx512;
  ASSERT_TRUE(parse_cpu_isa(cpu_isa_name(CpuIsa::kBaseline), &isa).is_ok());
  EXPECT_EQ(isa, CpuIsa::kBaseline);
}

TEST(CpuIsaTest, UnknownNameIsRefusedWithWhatIsExpected) {
  CpuIsa isa = CpuIsa::kBaseline;
  const KernelStatus st = parse_cpu_isa("sse9", &isa);
  EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument);
  EXPECT_NE(st.message.find("'sse9'"), std::string::npos) << st.message;
  EXPECT_NE(st.message.find("expected auto, " + std::string(cpu_isa_name(CpuIsa::kBaseline)) + " or avx512"),
            std::string::npos)
      << st.message;
}

TEST(CpuIsaTest, Avx512IsAcceptedExactlyWhereItRuns) {
  CpuIsa isa = CpuIsa::kBaseline;
  const KernelStatus st = parse_cpu_isa("avx512", &isa);
  std::string why;
  auto backend = make_cpu_backend(1, CpuIsa::kAvx512, &why);
  if (avx512_runs()) {
    EXPECT_TRUE(st.is_ok()) << st.message;
    EXPECT_EQ(isa, CpuIsa::kAvx512);
    ASSERT_NE(backend, nullptr) << why;
    EXPECT_NE(backend->description().find("avx512"), std::string::npos) << backend->description();
  } else {
    EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument);
    EXPECT_NE(st.message.find(cpu_isa_missing(CpuIsa::kAvx512)), std::string::npos) << st.message;
    EXPECT_EQ(backend, nullptr);
    EXPECT_NE(why.find(cpu_isa_missing(CpuIsa::kAvx512)), std::string::npos) << why;
  }
}

using CpuIsaEnvTest = EnvVarTest<kCpuIsaEnv>;

TEST_F(CpuIsaEnvTest, ForcesTheBackendsIsa) {
  unsetenv(kCpuIsaEnv);
  CpuIsa isa = CpuIsa::kBaseline;
  ASSERT_TRUE(cpu_isa_from_env(&isa).is_ok());
  EXPECT_EQ(isa, best_cpu_isa());

  setenv(kCpuIsaEnv, std::string(cpu_isa_name(CpuIsa::kBaseline)).c_str(), 1);
  ASSERT_TRUE(cpu_isa_from_env(&isa).is_ok());
  EXPECT_EQ(isa, CpuIsa::kBaseline);
  const std::string description = make_cpu_backend(1)->description();
  EXPECT_NE(description.find(std::string(cpu_isa_name(CpuIsa::kBaseline)) + " attention"), std::string::npos)
      << description;

  setenv(kCpuIsaEnv, "fast", 1);
  const KernelStatus st = cpu_isa_from_env(&isa);
  EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument);
  EXPECT_EQ(st.message.rfind(std::string(kCpuIsaEnv) + ": ", 0), 0u) << st.message;
  EXPECT_NE(st.message.find("'fast'"), std::string::npos) << st.message;
  // The library falls back to the best ISA (with a warning on stderr); karakvd refuses to start.
  const std::string fallback = make_cpu_backend(1)->description();
  EXPECT_NE(fallback.find(std::string(cpu_isa_name(best_cpu_isa())) + " attention"), std::string::npos) << fallback;
}

bool libxsmm_runs() { return cpu_gemm_missing(CpuGemm::kLibxsmm).empty(); }

TEST(CpuGemmTest, TileAlwaysRunsAndAutoPicksLibxsmmWhereBuilt) {
  EXPECT_EQ(cpu_gemm_missing(CpuGemm::kTile), "");
  EXPECT_EQ(best_cpu_gemm(), libxsmm_runs() ? CpuGemm::kLibxsmm : CpuGemm::kTile);
#if KARAKV_TEST_EXPECT_LIBXSMM
  EXPECT_TRUE(libxsmm_runs()) << "configured with libxsmm, but: " << cpu_gemm_missing(CpuGemm::kLibxsmm);
#endif
  for (const char* text : {"", "auto"}) {
    CpuGemm gemm = CpuGemm::kTile;
    ASSERT_TRUE(parse_cpu_gemm(text, &gemm).is_ok()) << text;
    EXPECT_EQ(gemm, best_cpu_gemm()) << text;
  }
  CpuGemm gemm = CpuGemm::kLibxsmm;
  ASSERT_TRUE(parse_cpu_gemm("tile", &gemm).is_ok());
  EXPECT_EQ(gemm, CpuGemm::kTile);

  const KernelStatus st = parse_cpu_gemm("blas", &gemm);
  EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument);
  EXPECT_NE(st.message.find("'blas'"), std::string::npos) << st.message;
  EXPECT_NE(st.message.find("expected auto, tile or libxsmm"), std::string::npos) << st.message;
}

TEST(CpuGemmTest, LibxsmmIsAcceptedExactlyWhereItRuns) {
  CpuGemm gemm = CpuGemm::kTile;
  const KernelStatus st = parse_cpu_gemm("libxsmm", &gemm);
  std::string why;
  auto backend = make_cpu_backend(1, CpuIsa::kBaseline, CpuGemm::kLibxsmm, &why);
  if (libxsmm_runs()) {
    EXPECT_TRUE(st.is_ok()) << st.message;
    EXPECT_EQ(gemm, CpuGemm::kLibxsmm);
    ASSERT_NE(backend, nullptr) << why;
    EXPECT_NE(backend->description().find("libxsmm scorer"), std::string::npos) << backend->description();
  } else {
    EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument);
    EXPECT_NE(st.message.find(cpu_gemm_missing(CpuGemm::kLibxsmm)), std::string::npos) << st.message;
    EXPECT_EQ(backend, nullptr);
    EXPECT_NE(why.find("CPU GEMM libxsmm cannot run here"), std::string::npos) << why;
  }
  auto tile = make_cpu_backend(1, CpuIsa::kBaseline, CpuGemm::kTile, &why);
  ASSERT_NE(tile, nullptr) << why;
  EXPECT_NE(tile->description().find("tile scorer"), std::string::npos) << tile->description();
}

using CpuGemmEnvTest = EnvVarTest<kCpuGemmEnv>;

TEST_F(CpuGemmEnvTest, ForcesTheBackendsProducts) {
  unsetenv(kCpuGemmEnv);
  CpuGemm gemm = CpuGemm::kTile;
  ASSERT_TRUE(cpu_gemm_from_env(&gemm).is_ok());
  EXPECT_EQ(gemm, best_cpu_gemm());

  setenv(kCpuGemmEnv, "tile", 1);
  ASSERT_TRUE(cpu_gemm_from_env(&gemm).is_ok());
  EXPECT_EQ(gemm, CpuGemm::kTile);
  const std::string description = make_cpu_backend(1)->description();
  EXPECT_NE(description.find("tile scorer"), std::string::npos) << description;

  setenv(kCpuGemmEnv, "mkl", 1);
  const KernelStatus st = cpu_gemm_from_env(&gemm);
  EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument);
  EXPECT_EQ(st.message.rfind(std::string(kCpuGemmEnv) + ": ", 0), 0u) << st.message;
  EXPECT_NE(st.message.find("'mkl'"), std::string::npos) << st.message;
  const std::string fallback = make_cpu_backend(1)->description();
  EXPECT_NE(fallback.find(std::string(cpu_gemm_name(best_cpu_gemm())) + " scorer"), std::string::npos) << fallback;
}

}  // namespace
}  // namespace karakv::kernels::test
