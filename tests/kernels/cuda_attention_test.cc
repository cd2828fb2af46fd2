// Choosing the CUDA backend's decode attention: names, refusals that say what was wrong and what is
// expected, the environment variable, a backend asked for FlashInfer where the build lacks it, and
// which geometries FlashInfer's decode covers (where it is built). The attention itself is checked
// against the CPU reference by backend_ops_test.cc (the "flashinfer" cases), on a device.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "karakv/kernels/backend.h"
#include "karakv/kernels/cuda_attention.h"
#include "kernel_test_util.h"
#if KARAKV_TEST_EXPECT_FLASHINFER
#include "cuda/flashinfer_decode.h"
#endif

namespace karakv::kernels::test {
namespace {

bool flashinfer_built() { return cuda_attention_missing(CudaAttention::kFlashInfer).empty(); }

TEST(CudaAttentionTest, OwnAlwaysBuiltAndAutoIsTheDefault) {
  EXPECT_EQ(cuda_attention_missing(CudaAttention::kOwn), "");
  EXPECT_EQ(cuda_attention_name(CudaAttention::kOwn), "own");
  EXPECT_EQ(cuda_attention_name(CudaAttention::kFlashInfer), "flashinfer");
  for (const char* text : {"", "auto"}) {
    CudaAttention a = CudaAttention::kFlashInfer;
    ASSERT_TRUE(parse_cuda_attention(text, &a).is_ok()) << text;
    EXPECT_EQ(a, default_cuda_attention()) << text;
  }
  CudaAttention a = CudaAttention::kFlashInfer;
  ASSERT_TRUE(parse_cuda_attention("own", &a).is_ok());
  EXPECT_EQ(a, CudaAttention::kOwn);
}

TEST(CudaAttentionTest, UnknownNameIsRefusedWithWhatIsExpected) {
  CudaAttention a = CudaAttention::kOwn;
  const KernelStatus st = parse_cuda_attention("cudnn", &a);
  EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument);
  EXPECT_NE(st.message.find("'cudnn'"), std::string::npos) << st.message;
  EXPECT_NE(st.message.find("expected auto, own or flashinfer"), std::string::npos) << st.message;
  EXPECT_EQ(a, CudaAttention::kOwn);
}

TEST(CudaAttentionTest, FlashInferIsAcceptedExactlyWhereBuilt) {
#if KARAKV_TEST_EXPECT_FLASHINFER
  EXPECT_TRUE(flashinfer_built()) << "configured with FlashInfer, but: "
                                  << cuda_attention_missing(CudaAttention::kFlashInfer);
#endif
  CudaAttention a = CudaAttention::kOwn;
  const KernelStatus st = parse_cuda_attention("flashinfer", &a);
  std::string why;
  auto backend = make_cuda_backend(0, CudaAttention::kFlashInfer, &why);
  if (flashinfer_built()) {
    EXPECT_TRUE(st.is_ok()) << st.message;
    EXPECT_EQ(a, CudaAttention::kFlashInfer);
    if (backend != nullptr)
      EXPECT_NE(backend->description().find("flashinfer decode attention"), std::string::npos)
          << backend->description();
  } else {
    EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument);
    EXPECT_NE(st.message.find("CUDA attention flashinfer cannot run here: " +
                              cuda_attention_missing(CudaAttention::kFlashInfer)),
              std::string::npos)
        << st.message;
    EXPECT_EQ(backend, nullptr);
    // Refused for the build, before any device is looked for.
    EXPECT_NE(why.find("CUDA attention flashinfer: " + cuda_attention_missing(CudaAttention::kFlashInfer)),
              std::string::npos)
        << why;
  }
}

using CudaAttentionEnvTest = EnvVarTest<kCudaAttentionEnv>;

TEST_F(CudaAttentionEnvTest, PicksTheDecodeAttention) {
  unsetenv(kCudaAttentionEnv);
  CudaAttention a = CudaAttention::kFlashInfer;
  ASSERT_TRUE(cuda_attention_from_env(&a).is_ok());
  EXPECT_EQ(a, default_cuda_attention());

  setenv(kCudaAttentionEnv, "own", 1);
  a = CudaAttention::kFlashInfer;
  ASSERT_TRUE(cuda_attention_from_env(&a).is_ok());
  EXPECT_EQ(a, CudaAttention::kOwn);

  setenv(kCudaAttentionEnv, "fastest", 1);
  const KernelStatus st = cuda_attention_from_env(&a);
  EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument);
  EXPECT_EQ(st.message.rfind(std::string(kCudaAttentionEnv) + ": ", 0), 0u) << st.message;
  EXPECT_NE(st.message.find("'fastest'"), std::string::npos) << st.message;
}

#if KARAKV_TEST_EXPECT_FLASHINFER
Geometry geometry(int q_heads, int kv_heads, int head_dim, DType dtype) {
  Geometry g;
  g.num_layers = 32;
  g.num_q_heads = q_heads;
  g.num_kv_heads = kv_heads;
  g.head_dim = head_dim;
  g.dtype = dtype;
  return g;
}

TEST(FlashInferDecodeTest, CoversTheGeometriesItIsBuiltFor) {
  using cuda::flashinfer_decode_gap;
  // SmolLM2-135M (9 / 3 heads, 64), Llama-3.1-8B (32 / 8, 128, bf16), head_dim 256 with MHA.
  EXPECT_EQ(flashinfer_decode_gap(geometry(9, 3, 64, DType::kFloat16)), "");
  EXPECT_EQ(flashinfer_decode_gap(geometry(32, 8, 128, DType::kBFloat16)), "");
  EXPECT_EQ(flashinfer_decode_gap(geometry(8, 8, 256, DType::kFloat16)), "");
  EXPECT_EQ(flashinfer_decode_gap(geometry(32, 2, 128, DType::kFloat16)), "");  // group 16
  EXPECT_NE(flashinfer_decode_gap(geometry(9, 3, 64, DType::kFloat32)).find("not fp32"), std::string::npos);
  EXPECT_NE(flashinfer_decode_gap(geometry(3, 3, 96, DType::kFloat16)).find("not 96"), std::string::npos);
  EXPECT_NE(flashinfer_decode_gap(geometry(15, 3, 64, DType::kFloat16)).find("not 5"), std::string::npos);
  EXPECT_NE(flashinfer_decode_gap(geometry(24, 2, 128, DType::kFloat16)).find("not 12"), std::string::npos);
  Geometry huge = geometry(128, 128, 256, DType::kFloat16);
  huge.num_layers = 400;
  huge.block_size = 256;  // 400 * 2 * 128 * 256 * 256 elements per block: beyond 32 bits
  ASSERT_GT(huge.block_elems(), size_t(UINT32_MAX));
  EXPECT_NE(flashinfer_decode_gap(huge).find("32-bit page stride"), std::string::npos);
}
#endif

}  // namespace
}  // namespace karakv::kernels::test
