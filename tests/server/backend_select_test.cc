// Backend choice (--backend) and the core's refusal of what the chosen backend cannot run.
#include "server/backend_select.h"

#include <stdlib.h>

#include <optional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core.h"
#include "tests/server/test_geometry.h"

namespace karakv::server {
namespace {

using ::testing::HasSubstr;

// Puts an environment variable back as it was when the scope ends.
class RestoreEnv {
 public:
  explicit RestoreEnv(const char* name) : name_(name) {
    if (const char* v = getenv(name)) saved_ = v;
  }
  ~RestoreEnv() {
    if (saved_) setenv(name_, saved_->c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> saved_;
};

// Whether a CUDA backend can be made here, and if not, why.
bool gpu_here(std::string* why) { return kernels::make_cuda_backend(0, why) != nullptr; }

TEST(BackendSelectTest, CpuIsAlwaysCpu) {
  auto b = select_backend("cpu", 0, 1);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->backend->name(), "cpu");
  EXPECT_THAT(b->reason, HasSubstr("--backend=cpu"));
}

// KARAKV_CPU_ISA picks the CPU attention's ISA; a value that cannot be honoured refuses the start.
TEST(BackendSelectTest, CpuIsaFromTheEnvironment) {
  const RestoreEnv restore(kernels::kCpuIsaEnv);
  const std::string baseline(kernels::cpu_isa_name(kernels::CpuIsa::kBaseline));
  setenv(kernels::kCpuIsaEnv, baseline.c_str(), 1);
  auto b = select_backend("cpu", 0, 1);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(b->backend->description(), HasSubstr(baseline + " attention"));

  setenv(kernels::kCpuIsaEnv, "avx1024", 1);
  b = select_backend("cpu", 0, 1);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(b.status().message(), HasSubstr("KARAKV_CPU_ISA"));
  EXPECT_THAT(b.status().message(), HasSubstr("'avx1024'"));
  EXPECT_THAT(b.status().message(), HasSubstr("expected auto, " + baseline + " or avx512"));

  if (const std::string missing = kernels::cpu_isa_missing(kernels::CpuIsa::kAvx512); !missing.empty()) {
    setenv(kernels::kCpuIsaEnv, "avx512", 1);
    b = select_backend("cpu", 0, 1);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(b.status().message(), HasSubstr(missing));
  }
}

// KARAKV_CPU_GEMM picks the scorers' products the same way.
TEST(BackendSelectTest, CpuGemmFromTheEnvironment) {
  const RestoreEnv restore(kernels::kCpuGemmEnv);
  setenv(kernels::kCpuGemmEnv, "tile", 1);
  auto b = select_backend("cpu", 0, 1);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(b->backend->description(), HasSubstr("tile scorer"));

  setenv(kernels::kCpuGemmEnv, "cublas", 1);
  b = select_backend("cpu", 0, 1);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(b.status().message(), HasSubstr("KARAKV_CPU_GEMM"));
  EXPECT_THAT(b.status().message(), HasSubstr("'cublas'"));
  EXPECT_THAT(b.status().message(), HasSubstr("expected auto, tile or libxsmm"));

  if (const std::string missing = kernels::cpu_gemm_missing(kernels::CpuGemm::kLibxsmm); !missing.empty()) {
    setenv(kernels::kCpuGemmEnv, "libxsmm", 1);
    b = select_backend("cpu", 0, 1);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(b.status().message(), HasSubstr(missing));
  }
}

// KARAKV_CUDA_ATTENTION picks the CUDA backend's decode attention; a value that is unknown or that
// this build cannot run refuses the start wherever the CUDA backend is tried (auto or cuda, with or
// without a GPU), and --backend=cpu does not read it.
TEST(BackendSelectTest, CudaAttentionFromTheEnvironment) {
  const RestoreEnv restore(kernels::kCudaAttentionEnv);
  setenv(kernels::kCudaAttentionEnv, "cudnn", 1);
  for (const char* requested : {"auto", "cuda"}) {
    auto b = select_backend(requested, 0, 1);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << requested;
    EXPECT_THAT(b.status().message(), HasSubstr("KARAKV_CUDA_ATTENTION"));
    EXPECT_THAT(b.status().message(), HasSubstr("'cudnn'"));
    EXPECT_THAT(b.status().message(), HasSubstr("expected auto, own or flashinfer"));
  }
  auto cpu = select_backend("cpu", 0, 1);
  EXPECT_TRUE(cpu.ok()) << cpu.status();

  setenv(kernels::kCudaAttentionEnv, "own", 1);
  auto own = select_backend("auto", 0, 1);
  ASSERT_TRUE(own.ok()) << own.status();
  if (own->backend->name() == "cuda") {
    EXPECT_THAT(own->backend->description(), HasSubstr("own decode attention"));
  }

  if (const std::string missing = kernels::cuda_attention_missing(kernels::CudaAttention::kFlashInfer);
      !missing.empty()) {
    setenv(kernels::kCudaAttentionEnv, "flashinfer", 1);
    auto b = select_backend("auto", 0, 1);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(b.status().message(), HasSubstr(missing));
  }
}

// KARAKV_CUDA_QUANT_DECODE likewise: an unknown value refuses the start wherever the CUDA backend
// is tried; a known one is taken (and said in the backend's description on a GPU).
TEST(BackendSelectTest, CudaQuantDecodeFromTheEnvironment) {
  const RestoreEnv restore(kernels::kCudaQuantDecodeEnv);
  setenv(kernels::kCudaQuantDecodeEnv, "unfused", 1);
  for (const char* requested : {"auto", "cuda"}) {
    auto b = select_backend(requested, 0, 1);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << requested;
    EXPECT_THAT(b.status().message(), HasSubstr("KARAKV_CUDA_QUANT_DECODE"));
    EXPECT_THAT(b.status().message(), HasSubstr("'unfused'"));
    EXPECT_THAT(b.status().message(), HasSubstr("expected auto, staged or fused"));
  }
  EXPECT_TRUE(select_backend("cpu", 0, 1).ok());

  setenv(kernels::kCudaQuantDecodeEnv, "staged", 1);  // the default: accepted by every build
  EXPECT_TRUE(select_backend("auto", 0, 1).ok());

  setenv(kernels::kCudaQuantDecodeEnv, "fused", 1);
  auto fused = select_backend("auto", 0, 1);
  if (const std::string missing = kernels::cuda_quant_decode_missing(kernels::CudaQuantDecode::kFused);
      !missing.empty()) {
    EXPECT_EQ(fused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(fused.status().message(), HasSubstr("KARAKV_CUDA_QUANT_DECODE"));
    EXPECT_THAT(fused.status().message(), HasSubstr(missing));
  } else {
    ASSERT_TRUE(fused.ok()) << fused.status();
    if (fused->backend->name() == "cuda") {
      EXPECT_THAT(fused->backend->description(), HasSubstr("fused quantized decode"));
    }
  }
}

TEST(BackendSelectTest, AutoFallsBackToCpuAndSaysWhyOrRunsOnTheGpu) {
  std::string why;
  const bool gpu = gpu_here(&why);
  auto b = select_backend("auto", 0, 1);
  ASSERT_TRUE(b.ok()) << b.status();
  if (gpu) {
    EXPECT_EQ(b->backend->name(), "cuda");
  } else {
    EXPECT_EQ(b->backend->name(), "cpu");
    EXPECT_THAT(b->reason, HasSubstr("the CUDA backend is unavailable"));
    EXPECT_THAT(b->reason, HasSubstr(why));
  }
}

TEST(BackendSelectTest, CudaWithoutAGpuIsRefusedWithTheReason) {
  std::string why;
  if (gpu_here(&why)) GTEST_SKIP() << "a GPU works here, so --backend=cuda is not refused";
  EXPECT_FALSE(why.empty());
  auto b = select_backend("cuda", 0, 1);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(b.status().message(), HasSubstr("--backend=cuda cannot run: " + why));
  EXPECT_THAT(b.status().message(), HasSubstr("use --backend=cpu"));
  if (!kernels::cuda_backend_built()) {
    EXPECT_THAT(why, HasSubstr("this build has no CUDA backend"));
  }
}

TEST(BackendSelectTest, OutOfRangeDeviceAndUnknownNamesAreRefused) {
  std::string why;
  EXPECT_EQ(kernels::make_cuda_backend(1 << 20, &why), nullptr);
  EXPECT_FALSE(why.empty());
  auto b = select_backend("gpu", 0, 1);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(b.status().message(), HasSubstr("expected auto, cpu or cuda"));
}

// The daemon's geometry is checked against the CUDA backend's limits when the backend is picked,
// so head_dim > 256 is refused at start-up rather than on every call. No GPU needed: the check
// comes before any device is touched.
TEST(BackendSelectTest, CudaRefusesAHeadDimOverItsLimitAtStartUp) {
  const kernels::Geometry g = testing::small_test_geometry(kernels::DType::kFloat16, /*head_dim=*/512);
  auto b = select_backend("cuda", 0, 1, g);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(b.status().message(), HasSubstr("--backend=cuda cannot run: head_dim 512 exceeds the CUDA backend's "
                                              "limit of 256"));
  EXPECT_THAT(b.status().message(), HasSubstr("use --backend=cpu"));
}

TEST(BackendSelectTest, AutoTakesTheCpuForAHeadDimOverTheCudaLimitAndSaysWhy) {
  const kernels::Geometry g = testing::small_test_geometry(kernels::DType::kFloat16, /*head_dim=*/257);
  auto b = select_backend("auto", 0, 1, g);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->backend->name(), "cpu");
  EXPECT_THAT(b->reason, HasSubstr("the CUDA backend is unavailable (head_dim 257 exceeds the CUDA backend's limit "
                                   "of 256)"));
  auto cpu = select_backend("cpu", 0, 1, g);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(cpu->backend->name(), "cpu");
}

TEST(BackendSelectTest, AGeometryWithinTheCudaLimitsChoosesAsWithoutOne) {
  const kernels::Geometry g = testing::small_test_geometry(kernels::DType::kFloat16, /*head_dim=*/256);
  std::string why;
  const bool gpu = gpu_here(&why);
  auto a = select_backend("auto", 0, 1, g);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->backend->name(), gpu ? "cuda" : "cpu");
  auto c = select_backend("cuda", 0, 1, g);
  if (gpu) {
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->backend->name(), "cuda");
  } else {
    ASSERT_FALSE(c.ok());
    EXPECT_THAT(c.status().message(), HasSubstr("--backend=cuda cannot run: " + why));
  }
}

// The CPU backend with some ops declared missing, as a GPU backend without them would.
class PartialBackend final : public kernels::Backend {
 public:
  explicit PartialBackend(std::vector<kernels::Op> missing)
      : inner_(kernels::make_cpu_backend(1)), missing_(std::move(missing)) {}
  std::string_view name() const override { return "partial"; }
  bool supports(kernels::Op op, kernels::DType dtype) const override {
    return std::find(missing_.begin(), missing_.end(), op) == missing_.end() && inner_->supports(op, dtype);
  }
  kernels::KernelStatus allocate(size_t bytes, void** out) override { return inner_->allocate(bytes, out); }
  void free(void* p) override { inner_->free(p); }
  kernels::KernelStatus write_kv(const kernels::PagedKV& kv, int seq, int start, int n, int lb, int nl, const void* k,
                                 const void* v) override {
    return inner_->write_kv(kv, seq, start, n, lb, nl, k, v);
  }
  kernels::KernelStatus decode_attention(const kernels::PagedKV& kv, int layer, const float* q, float* out,
                                         float scale) override {
    return inner_->decode_attention(kv, layer, q, out, scale);
  }
  kernels::KernelStatus causal_attention(const kernels::PagedKV& kv, int seq, int layer, int nq, const float* q,
                                         float* out, float scale) override {
    return inner_->causal_attention(kv, seq, layer, nq, q, out, scale);
  }
  kernels::KernelStatus read_kv(const kernels::PagedKV& kv, int seq, void* k, void* v) override {
    return inner_->read_kv(kv, seq, k, v);
  }
  kernels::KernelStatus copy_block(const kernels::PagedKV& kv, int32_t src, int32_t dst) override {
    return inner_->copy_block(kv, src, dst);
  }
  int quantized_tokens_per_block(const kernels::Geometry& g, kernels::QuantFormat f) const override {
    return inner_->quantized_tokens_per_block(g, f);
  }

 private:
  std::unique_ptr<kernels::Backend> inner_;
  std::vector<kernels::Op> missing_;
};

class BackendRefusalTest : public ::testing::Test {
 protected:
  std::unique_ptr<Core> make(std::vector<kernels::Op> missing) {
    CoreConfig c;
    c.geometry = testing::small_test_geometry(kernels::DType::kFloat16, /*head_dim=*/32);
    c.pool_bytes = int64_t(32) * c.geometry.block_bytes();
    auto r = Core::create(c, std::make_unique<PartialBackend>(std::move(missing)));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? std::move(*r) : nullptr;
  }
  absl::StatusOr<uint64_t> create(Core& reg, SequenceOptions o) {
    auto a = reg.attach("w", "t", 0, kernels::Geometry{});
    if (!a.ok()) return a.status();
    return reg.create_sequence(a->session_id, o);
  }
};

TEST_F(BackendRefusalTest, PolicyNeedingAMissingOpIsRefusedNamingTheOpAndOthersWork) {
  auto reg = make({kernels::Op::kWindowScores});
  ASSERT_NE(reg, nullptr);
  SequenceOptions kara;
  kara.policy = "kara";
  kara.params["observers"] = 0;  // the window's own queries: window_scores
  auto s = create(*reg, kara);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.status().message(), HasSubstr("policy 'kara' needs window_scores, which backend partial does not run"));
  EXPECT_THAT(s.status().message(), HasSubstr("--backend=cpu"));
  SequenceOptions snap;
  snap.policy = "snapkv";
  EXPECT_TRUE(create(*reg, snap).ok());
  SequenceOptions prefill;
  prefill.prefill_policy = "snapkv";
  EXPECT_TRUE(create(*reg, prefill).ok());
  // Kara's default (decode observers) needs no window scores, but the accumulating decode attention.
  SequenceOptions by_default;
  by_default.policy = "kara";
  EXPECT_TRUE(create(*reg, by_default).ok());
  auto no_accumulate = make({kernels::Op::kDecodeAttentionAccumulate});
  ASSERT_NE(no_accumulate, nullptr);
  auto d = create(*no_accumulate, by_default);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(d.status().message(), HasSubstr("policy 'kara' needs decode_attention_accumulate"));
  EXPECT_TRUE(reg->check_invariants().ok());
}

TEST_F(BackendRefusalTest, PrefillPolicyCamAndQuantizedStorageAreCheckedToo) {
  auto reg = make({kernels::Op::kSnapKVScores, kernels::Op::kCamMerge, kernels::Op::kQuantize});
  ASSERT_NE(reg, nullptr);
  SequenceOptions prefill;
  prefill.prefill_policy = "snapkv";
  auto a = create(*reg, prefill);
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(a.status().message(), HasSubstr("prefill_policy 'snapkv' needs snapkv_scores"));
  SequenceOptions cam;
  cam.policy = "kara";
  cam.params["cam"] = 1;
  auto b = create(*reg, cam);
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(b.status().message(), HasSubstr("needs cam_merge_values"));
  SequenceOptions kivi;
  kivi.policy = "none+kivi4";
  auto c = create(*reg, kivi);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(c.status().message(), HasSubstr("storage 'kivi4' needs quantize_tokens"));
  SequenceOptions plain;
  plain.policy = "kara";
  EXPECT_TRUE(create(*reg, plain).ok());
}

}  // namespace
}  // namespace karakv::server
