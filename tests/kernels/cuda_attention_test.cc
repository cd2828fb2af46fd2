// Choosing the CUDA backend's decode attention: names, refusals that say what was wrong and what is
// expected, the environment variable, a backend asked for FlashInfer where the build lacks it, and
// which geometries FlashInfer's decode covers (where it is built). The attention itself is checked
// against the CPU reference by backend_ops_test.cc (the "flashinfer" cases), on a device.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/flashinfer_pages.h"
#include "cuda/quant_fused_layout.h"
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
    if (backend != nullptr) {
      EXPECT_NE(backend->description().find("flashinfer decode attention"), std::string::npos)
          << backend->description();
    }
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

TEST(CudaQuantDecodeTest, NamesDefaultAndRefusals) {
  EXPECT_EQ(cuda_quant_decode_missing(CudaQuantDecode::kStaged), "") << "the default must start every build";
  EXPECT_EQ(cuda_quant_decode_name(CudaQuantDecode::kStaged), "staged");
  EXPECT_EQ(cuda_quant_decode_name(CudaQuantDecode::kFused), "fused");
  for (const char* text : {"", "auto"}) {
    CudaQuantDecode q = CudaQuantDecode::kFused;
    ASSERT_TRUE(parse_cuda_quant_decode(text, &q).is_ok()) << text;
    EXPECT_EQ(q, default_cuda_quant_decode()) << text;
  }
  CudaQuantDecode q = CudaQuantDecode::kStaged;
  KernelStatus st = parse_cuda_quant_decode("tensorcore", &q);
  EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument);
  EXPECT_NE(st.message.find("'tensorcore'"), std::string::npos) << st.message;
  EXPECT_NE(st.message.find("expected auto, staged or fused"), std::string::npos) << st.message;
  EXPECT_EQ(q, CudaQuantDecode::kStaged);
  // Both need only the CUDA backend: accepted where it is built, refused saying so where not.
  st = parse_cuda_quant_decode("fused", &q);
  if (cuda_backend_built()) {
    ASSERT_TRUE(st.is_ok()) << st.message;
    EXPECT_EQ(q, CudaQuantDecode::kFused);
  } else {
    EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument);
    EXPECT_NE(st.message.find("this build has no CUDA backend"), std::string::npos) << st.message;
  }
}

using CudaQuantDecodeEnvTest = EnvVarTest<kCudaQuantDecodeEnv>;

TEST_F(CudaQuantDecodeEnvTest, PicksTheQuantizedDecode) {
  unsetenv(kCudaQuantDecodeEnv);
  CudaQuantDecode q = CudaQuantDecode::kFused;
  ASSERT_TRUE(cuda_quant_decode_from_env(&q).is_ok());
  EXPECT_EQ(q, default_cuda_quant_decode());
  setenv(kCudaQuantDecodeEnv, "fastest", 1);
  const KernelStatus st = cuda_quant_decode_from_env(&q);
  EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument);
  EXPECT_EQ(st.message.rfind(std::string(kCudaQuantDecodeEnv) + ": ", 0), 0u) << st.message;
}

// The fused kernel launches without opting in to more than 48 KiB of shared memory: every format
// and head_dim the quantized kernels take (up to the CUDA kernels' 256) must fit, its staging must
// hold what a warp or the CTA copies (kFusedTile records from the pieces' aligned starts), and the
// record offsets it keeps must fit an int.
TEST(CudaQuantDecodeTest, FusedSharedMemoryFitsEveryFormatAndHeadDim) {
  using namespace cuda;
  int checked = 0;
  for (QuantFormat f : {QuantFormat::kKivi2, QuantFormat::kKivi4, QuantFormat::kTq2, QuantFormat::kTq3,
                        QuantFormat::kTq4}) {
    const bool kivi = common::is_kivi(f);
    const int bits = common::quant_bits(f);
    for (int d = 1; d <= 256; ++d) {
      if (!common::quant_head_dim_ok(f, d)) continue;
      SCOPED_TRACE("format " + std::to_string(int(f)) + ", head_dim " + std::to_string(d));
      const size_t total = fused_shared_bytes(kivi, bits, d) + kFusedStaticShared;
      EXPECT_LE(total, kFusedSharedLimit);
      // What is staged, at worst: every record a piece of its own, 3 bytes before and after each.
      const int key_rec = kivi ? int(common::kivi_key_group_bytes(bits, d)) : int(common::tq_token_bytes(bits, d));
      const int key_records = kivi ? 1 : kFusedTile;
      EXPECT_GE(fused_key_stage(kivi, bits, d), key_records * (key_rec + 6));
      const int value_rec =
          kivi ? int(common::kivi_value_token_bytes(bits, d)) : int(common::tq_token_bytes(bits, d));
      EXPECT_GE(fused_value_stage(kivi, bits, d), kFusedTile * (value_rec + 6));
      EXPECT_EQ(fused_key_stage(kivi, bits, d) % 16, 0);
      // The values: token groups of d / 4 threads, at least one group in the CTA; their sums fit
      // the staging area they reuse.
      EXPECT_EQ(d % kFusedChannels, 0);
      EXPECT_GE(kFusedThreads / (d / kFusedChannels), 1);
      const size_t floats = size_t(kFusedHeads) * d * (kivi ? 1 : 2) + size_t(kFusedHeads) * kFusedSplit;
      EXPECT_GE(fused_shared_bytes(kivi, bits, d) - floats * sizeof(float), size_t(fused_value_sums(d)));
      ++checked;
    }
  }
  EXPECT_EQ(checked, 2 * 8 + 3 * 6);  // KIVI: 32, 64, ..., 256; TurboQuant: 8, 16, ..., 256
}

// The host side of FlashInfer's route, which runs here: a call's tables as its pages. Sequences of
// 0, 1, 16, 17, 32, 0 and 5 tokens (block 16), each table one block longer than it needs.
TEST(FlashInferPagesTest, TablesBecomeTheNonEmptySequencesPages) {
  Geometry g;
  g.num_layers = 1;
  g.num_q_heads = g.num_kv_heads = 1;
  g.head_dim = 64;
  g.block_size = 16;
  const std::vector<int32_t> lens = {0, 1, 16, 17, 32, 0, 5};
  std::vector<int32_t> table, offset = {0};
  int32_t next = 100;
  for (int32_t len : lens) {
    for (int32_t i = 0; i < (len + 15) / 16 + 1; ++i) table.push_back(next++);
    offset.push_back(int32_t(table.size()));
  }
  PagedKV kv;
  kv.geometry = g;
  kv.block_table = table.data();
  kv.table_offset = offset.data();
  kv.seq_len = lens.data();
  kv.num_seqs = int(lens.size());
  const cuda::FlashInferHostPages p = cuda::flashinfer_pages(kv);
  EXPECT_EQ(p.batch(), 5);
  EXPECT_FALSE(p.every_row);
  EXPECT_EQ(p.row_map, (std::vector<int32_t>{-1, 0, 1, 2, 3, -1, 4}));
  EXPECT_EQ(p.indptr, (std::vector<int32_t>{0, 1, 2, 4, 6, 7}));
  // Tables: seq 0 [100], 1 [101 102], 2 [103 104], 3 [105 106 107], 4 [108 109 110], 5 [111], 6 [112 113].
  EXPECT_EQ(p.indices, (std::vector<int32_t>{101, 103, 105, 106, 108, 109, 112}));
  EXPECT_EQ(p.last_page_len, (std::vector<int32_t>{1, 16, 1, 16, 5}));

  // Random shapes: every token of every sequence is found in its page, and the pages hold exactly
  // its tokens.
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    g.block_size = 1 << (rng() % 6);
    kv.geometry = g;
    std::vector<int32_t> ls(1 + rng() % 8), t, o = {0};
    for (auto& l : ls) {
      l = rng() % 4 == 0 ? 0 : int32_t(rng() % 90);
      const int32_t blocks = (l + g.block_size - 1) / g.block_size + int32_t(rng() % 3);
      for (int32_t i = 0; i < blocks; ++i) t.push_back(int32_t(rng() % 100000));
      o.push_back(int32_t(t.size()));
    }
    kv.block_table = t.data();
    kv.table_offset = o.data();
    kv.seq_len = ls.data();
    kv.num_seqs = int(ls.size());
    const cuda::FlashInferHostPages q = cuda::flashinfer_pages(kv);
    int expected_batch = 0;
    for (size_t s = 0; s < ls.size(); ++s) {
      if (ls[s] == 0) {
        EXPECT_EQ(q.row_map[s], -1);
        continue;
      }
      const int32_t b = q.row_map[s];
      ASSERT_EQ(b, expected_batch++) << "trial " << trial << ", sequence " << s;
      const int32_t pages = q.indptr[b + 1] - q.indptr[b];
      ASSERT_GE(q.last_page_len[b], 1);
      ASSERT_LE(q.last_page_len[b], g.block_size);
      EXPECT_EQ((pages - 1) * g.block_size + q.last_page_len[b], ls[s]) << "trial " << trial;
      for (int32_t tok = 0; tok < ls[s]; ++tok)
        ASSERT_EQ(q.indices[q.indptr[b] + tok / g.block_size], kv.block_of(int(s), tok)) << "trial " << trial;
    }
    EXPECT_EQ(q.batch(), expected_batch);
    EXPECT_EQ(q.every_row, expected_batch == int(ls.size()));
    EXPECT_EQ(q.indptr.back(), int32_t(q.indices.size()));
  }
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
