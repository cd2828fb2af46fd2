// The CPU backend (the reference for every other backend) against naive float64 loops written
// independently of it: the pool layout is checked by direct indexing, attention by a dense
// double-precision softmax over the same rounded K/V values.
#include <gtest/gtest.h>
#include <dlfcn.h>


#include <cmath>
#include <condition_variable>
#include <mutex>
#include <filesystem>
#include <fstream>
#include <thread>
#include <tuple>

#include "cpu/attention.h"
#include "kernel_test_util.h"

namespace karakv::kernels::test {
namespace {

// Inputs are identical (rounded storage values, fp32 q), so the only difference from the float64
// reference is fp32 accumulation and the kernel's exp: with |v| <= 1 and O(1) scores the observed
// max abs error is ~1e-6 over 1029 tokens; 1e-5 leaves headroom without hiding a wrong softmax.
constexpr double kAttentionTolerance = 1e-5;

// softmax(q . k * scale) . v in double for every query head over tokens [0, num_tokens).
//   q: [num_q_heads][head_dim]; returns [num_q_heads][head_dim]
std::vector<double> naive_attention(const Geometry& g, const DenseKV& kv, int layer, int num_tokens,
                                    const float* q, float scale) {
  const int group = g.num_q_heads / g.num_kv_heads;
  std::vector<double> out(g.q_token_elems(), 0.0);
  if (num_tokens == 0) return out;
  std::vector<double> p(num_tokens);
  for (int qh = 0; qh < g.num_q_heads; ++qh) {
    const int h = qh / group;
    double max = -INFINITY;
    for (int t = 0; t < num_tokens; ++t) {
      double s = 0;
      for (int d = 0; d < g.head_dim; ++d)
        s += double(q[qh * g.head_dim + d]) * double(kv.k[kv.index(g, layer, t, h, d)]);
      p[t] = s * double(scale);
      max = std::max(max, p[t]);
    }
    double sum = 0;
    for (int t = 0; t < num_tokens; ++t) sum += (p[t] = std::exp(p[t] - max));
    for (int d = 0; d < g.head_dim; ++d) {
      double acc = 0;
      for (int t = 0; t < num_tokens; ++t) acc += p[t] * double(kv.v[kv.index(g, layer, t, h, d)]);
      out[qh * g.head_dim + d] = acc / sum;
    }
  }
  return out;
}

double max_abs_diff(const float* got, const std::vector<double>& want) {
  double err = 0;
  for (size_t i = 0; i < want.size(); ++i) err = std::max(err, std::fabs(double(got[i]) - want[i]));
  return err;
}

Geometry make_geometry(DType dtype, int group, int head_dim, int block_size, int layers = 2, int kv_heads = 2) {
  Geometry g;
  g.num_layers = layers;
  g.num_kv_heads = kv_heads;
  g.num_q_heads = kv_heads * group;
  g.head_dim = head_dim;
  g.block_size = block_size;
  g.dtype = dtype;
  return g;
}

class CpuReferenceTest : public ::testing::TestWithParam<DType> {
 protected:
  std::unique_ptr<Backend> backend_ = make_cpu_backend(2);
  std::mt19937 rng_{42};
};

TEST_P(CpuReferenceTest, WriteKvLayoutAndReadKvRoundtrip) {
  const Geometry g = make_geometry(GetParam(), 3, 20, 16, 3, 2);
  const std::vector<int> lens = {0, 1, 15, 16, 17, 50};
  PagedCache cache(*backend_, g, lens, rng_);
  std::vector<DenseKV> dense;
  for (size_t s = 0; s < lens.size(); ++s) {
    dense.push_back(random_dense_kv(g, lens[s], rng_));
    write_sequence(*backend_, cache, int(s), dense.back());
  }
  const PagedKV kv = cache.view();
  // The layout is part of the interface ([block][layer][K/V][head][slot][dim]); index it by hand.
  const size_t esize = dtype_size(g.dtype);
  for (size_t s = 0; s < lens.size(); ++s) {
    for (int l = 0; l < g.num_layers; ++l)
      for (int t = 0; t < lens[s]; ++t)
        for (int h = 0; h < g.num_kv_heads; ++h)
          for (int d = 0; d < g.head_dim; ++d) {
            const int32_t block = cache.block_table()[cache.table_offset()[s] + t / g.block_size];
            const size_t slot = t % g.block_size;
            const size_t base = size_t(block) * g.block_elems();
            const size_t k_at = base + (((size_t(l) * 2 + 0) * g.num_kv_heads + h) * g.block_size + slot) * g.head_dim + d;
            const size_t v_at = base + (((size_t(l) * 2 + 1) * g.num_kv_heads + h) * g.block_size + slot) * g.head_dim + d;
            ASSERT_EQ(std::memcmp(static_cast<uint8_t*>(kv.pool) + k_at * esize,
                                  dense[s].k_bytes.data() + dense[s].index(g, l, t, h, d) * esize, esize), 0)
                << "K seq " << s << " layer " << l << " token " << t << " head " << h << " dim " << d;
            ASSERT_EQ(std::memcmp(static_cast<uint8_t*>(kv.pool) + v_at * esize,
                                  dense[s].v_bytes.data() + dense[s].index(g, l, t, h, d) * esize, esize), 0)
                << "V seq " << s << " layer " << l << " token " << t << " head " << h << " dim " << d;
          }
    const size_t bytes = dense[s].k_bytes.size();
    BackendBuffer k(*backend_, bytes), v(*backend_, bytes);
    const KernelStatus st = backend_->read_kv(kv, int(s), k.get(), v.get());
    ASSERT_TRUE(st.is_ok()) << st.message;
    EXPECT_EQ(k.download<uint8_t>(bytes), dense[s].k_bytes) << "seq " << s;
    EXPECT_EQ(v.download<uint8_t>(bytes), dense[s].v_bytes) << "seq " << s;
  }
}

TEST_P(CpuReferenceTest, CopyBlockCopiesOneWholeBlock) {
  const Geometry g = make_geometry(GetParam(), 2, 16, 8);
  PagedCache cache(*backend_, g, {20}, rng_, /*spare_blocks=*/2);
  write_sequence(*backend_, cache, 0, random_dense_kv(g, 20, rng_));
  const std::vector<uint8_t> before = cache.pool_bytes();
  const int32_t src = cache.block_table()[1];
  int32_t dst = 0;
  while (std::find(cache.block_table().begin(), cache.block_table().end(), dst) != cache.block_table().end()) ++dst;
  const KernelStatus st = backend_->copy_block(cache.view(), src, dst);
  ASSERT_TRUE(st.is_ok()) << st.message;
  const std::vector<uint8_t> after = cache.pool_bytes();
  const size_t bb = g.block_bytes();
  for (int b = 0; b < cache.num_blocks(); ++b) {
    const auto* want = (b == dst ? before.data() + src * bb : before.data() + b * bb);
    EXPECT_EQ(std::memcmp(after.data() + b * bb, want, bb), 0) << "block " << b;
  }
}

TEST_P(CpuReferenceTest, SharpSoftmaxWithUnderflowingWeights) {
  // Large scores: most exp(s - max) underflow to 0 and a few tokens dominate.
  const Geometry g = make_geometry(GetParam(), 3, 32, 16);
  const std::vector<int> lens = {300, 9};
  PagedCache cache(*backend_, g, lens, rng_);
  std::vector<DenseKV> dense;
  for (size_t s = 0; s < lens.size(); ++s) {
    dense.push_back(random_dense_kv(g, lens[s], rng_));
    write_sequence(*backend_, cache, int(s), dense.back());
  }
  const float scale = 40.0f;
  const std::vector<float> q = random_values(lens.size() * g.q_token_elems(), -3.0f, 3.0f, rng_);
  std::vector<float> out(q.size(), NAN);
  const KernelStatus st = backend_->decode_attention(cache.view(), 1, q.data(), out.data(), scale);
  ASSERT_TRUE(st.is_ok()) << st.message;
  for (size_t s = 0; s < lens.size(); ++s) {
    const auto want = naive_attention(g, dense[s], 1, lens[s], q.data() + s * g.q_token_elems(), scale);
    EXPECT_LE(max_abs_diff(out.data() + s * g.q_token_elems(), want), kAttentionTolerance) << "seq " << s;
  }
}

// Attention folds chunks of cpu::attention_chunk_tokens into a running softmax. Three sequences of
// a little over three chunks (block size 24: chunks of 504 tokens, not a power of two): scores that
// rise chunk by chunk (every chunk raises the running max and rescales what came before), scores
// that fall (the first chunk's max holds), and sharp random scores.
TEST_P(CpuReferenceTest, OnlineSoftmaxAcrossChunks) {
  const Geometry g = make_geometry(GetParam(), 2, 16, 24);
  const int chunk = cpu::attention_chunk_tokens(g.block_size);
  ASSERT_EQ(chunk, 504);
  const int len = 3 * chunk + 7;
  const std::vector<int> lens = {len, len, len};
  PagedCache cache(*backend_, g, lens, rng_);
  const size_t n = size_t(g.num_layers) * len * g.kv_token_elems();
  std::vector<DenseKV> dense;
  for (int trend : {1, -1}) {
    // k[t] = level of t's chunk + noise; with q = 1 every score is head_dim * (level + noise).
    std::vector<float> k = random_values(n, -0.1f, 0.1f, rng_);
    for (size_t i = 0; i < n; ++i) {
      const int token = int(i / g.kv_token_elems()) % len;
      const int c = token / chunk;
      k[i] += 0.25f * float(trend > 0 ? c : 3 - c);
    }
    dense.push_back(dense_kv(g, len, k, random_values(n, -1.0f, 1.0f, rng_)));
  }
  dense.push_back(random_dense_kv(g, len, rng_));
  for (size_t s = 0; s < lens.size(); ++s) write_sequence(*backend_, cache, int(s), dense[s]);
  std::vector<float> q(lens.size() * g.q_token_elems(), 1.0f);
  const std::vector<float> sharp = random_values(g.q_token_elems(), -3.0f, 3.0f, rng_);
  std::copy(sharp.begin(), sharp.end(), q.begin() + 2 * g.q_token_elems());
  const std::vector<float> scales = {1.0f, 1.0f, 40.0f};
  for (size_t s = 0; s < lens.size(); ++s) {
    // decode_attention takes one scale for all sequences: one call per sequence's scale.
    std::vector<float> out(q.size(), NAN);
    const KernelStatus st = backend_->decode_attention(cache.view(), 1, q.data(), out.data(), scales[s]);
    ASSERT_TRUE(st.is_ok()) << st.message;
    const auto want = naive_attention(g, dense[s], 1, len, q.data() + s * g.q_token_elems(), scales[s]);
    EXPECT_LE(max_abs_diff(out.data() + s * g.q_token_elems(), want), kAttentionTolerance) << "seq " << s;
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, CpuReferenceTest,
                         ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                         [](const auto& info) { return std::string(name_of(info.param)); });

// (dtype, group size, head_dim, block_size, ISA): head_dim 64 and 128 are the unrolled fast paths,
// 40 is a multiple of the AVX2 width but not of AVX-512's (masked tail), 13 exercises the scalar and
// masked tails; group 5 splits into chunks of 3 and 2 heads. Every case runs on the baseline (AVX2)
// loops and on AVX-512, which is skipped, naming the missing feature, where the CPU lacks it.
using AttentionParam = std::tuple<DType, int, int, int, CpuIsa>;

class CpuAttentionTest : public ::testing::TestWithParam<AttentionParam> {
 protected:
  void SetUp() override {
    const CpuIsa isa = std::get<4>(GetParam());
    if (std::string missing = cpu_isa_missing(isa); !missing.empty()) {
      GTEST_SKIP() << cpu_isa_name(isa) << " attention not run: " << missing;
    }
    std::string why;
    backend_ = make_cpu_backend(2, isa, &why);
    ASSERT_NE(backend_, nullptr) << why;
  }
  Geometry geometry() const {
    const auto [dtype, group, head_dim, block_size, isa] = GetParam();
    return make_geometry(dtype, group, head_dim, block_size);
  }
  std::unique_ptr<Backend> backend_;
  std::mt19937 rng_{7};
};

TEST_P(CpuAttentionTest, DecodeMatchesFloat64) {
  const Geometry g = geometry();
  const int bs = g.block_size;
  const std::vector<int> lens = {0, 1, bs - 1, bs, bs + 1, 37, 100, 1029};
  PagedCache cache(*backend_, g, lens, rng_);
  std::vector<DenseKV> dense;
  for (size_t s = 0; s < lens.size(); ++s) {
    dense.push_back(random_dense_kv(g, lens[s], rng_));
    write_sequence(*backend_, cache, int(s), dense.back());
  }
  const float scale = 1.0f / std::sqrt(float(g.head_dim));
  const size_t qe = g.q_token_elems();
  const std::vector<float> q = random_values(lens.size() * qe, -3.0f, 3.0f, rng_);
  for (int layer = 0; layer < g.num_layers; ++layer) {
    std::vector<float> out(q.size(), NAN);
    const KernelStatus st = backend_->decode_attention(cache.view(), layer, q.data(), out.data(), scale);
    ASSERT_TRUE(st.is_ok()) << st.message;
    for (size_t s = 0; s < lens.size(); ++s) {
      const auto want = naive_attention(g, dense[s], layer, lens[s], q.data() + s * qe, scale);
      EXPECT_LE(max_abs_diff(out.data() + s * qe, want), kAttentionTolerance)
          << "layer " << layer << " seq " << s << " len " << lens[s];
    }
  }
}

// A NaN in a query or a key makes the heads that read it NaN, as the float64 loop says, and leaves
// every other head as it was: the vector exp must not turn NaN logits into weights near 0 (a
// silent, plausible output). Sequence 1 has a NaN in query head 0; sequence 3 (1029 tokens, many
// chunks) a NaN key of KV head 0 at position 500; sequence 2 a NaN value (one dimension only).
TEST_P(CpuAttentionTest, NaNPropagatesAsInFloat64) {
  const Geometry g = geometry();
  const std::vector<int> lens = {5, 37, 100, 1029};
  PagedCache cache(*backend_, g, lens, rng_);
  std::vector<DenseKV> dense;
  for (size_t s = 0; s < lens.size(); ++s) {
    const size_t n = size_t(g.num_layers) * lens[s] * g.kv_token_elems();
    std::vector<float> k = random_values(n, -1.0f, 1.0f, rng_), v = random_values(n, -1.0f, 1.0f, rng_);
    DenseKV probe;
    probe.len = lens[s];
    if (s == 3) k[probe.index(g, 1, 500, 0, 0)] = NAN;
    if (s == 2) v[probe.index(g, 1, 60, 0, g.head_dim - 1)] = NAN;
    dense.push_back(dense_kv(g, lens[s], k, v));
    write_sequence(*backend_, cache, int(s), dense.back());
  }
  const size_t qe = g.q_token_elems();
  std::vector<float> q = random_values(lens.size() * qe, -3.0f, 3.0f, rng_);
  q[1 * qe + 0] = NAN;
  std::vector<float> out(q.size(), 0.0f);
  const KernelStatus st = backend_->decode_attention(cache.view(), 1, q.data(), out.data(), 0.125f);
  ASSERT_TRUE(st.is_ok()) << st.message;
  int nans = 0;
  for (size_t s = 0; s < lens.size(); ++s) {
    const auto want = naive_attention(g, dense[s], 1, lens[s], q.data() + s * qe, 0.125f);
    for (size_t i = 0; i < qe; ++i) {
      const float got = out[s * qe + i];
      ASSERT_EQ(std::isnan(got), std::isnan(want[i])) << "seq " << s << " head " << i / g.head_dim << " dim "
                                                      << i % g.head_dim << ": " << got << " vs " << want[i];
      nans += std::isnan(want[i]);
      if (!std::isnan(want[i])) {
        EXPECT_LE(std::fabs(got - want[i]), kAttentionTolerance) << "seq " << s << " i " << i;
      }
    }
  }
  // Query head 0 of sequence 1 (all dims); every query head of KV head 0 in sequence 3; one dim of
  // each of KV head 0's query heads in sequence 2.
  const int group = g.num_q_heads / g.num_kv_heads;
  EXPECT_EQ(nans, g.head_dim + group * g.head_dim + group);
}

// One thread runs whole-sequence tasks (4 sequences per thread), two threads split by KV head:
// both must give bit-identical results.
TEST_P(CpuAttentionTest, DecodeDoesNotDependOnThreadCount) {
  const Geometry g = geometry();
  const std::vector<int> lens = {5, 200, 64, 1};
  PagedCache cache(*backend_, g, lens, rng_);
  for (size_t s = 0; s < lens.size(); ++s) write_sequence(*backend_, cache, int(s), random_dense_kv(g, lens[s], rng_));
  const std::vector<float> q = random_values(lens.size() * g.q_token_elems(), -3.0f, 3.0f, rng_);
  std::vector<float> out1(q.size()), out2(q.size());
  ASSERT_TRUE(make_cpu_backend(1, std::get<4>(GetParam()), nullptr)
                  ->decode_attention(cache.view(), 1, q.data(), out1.data(), 0.3f)
                  .is_ok());
  ASSERT_TRUE(backend_->decode_attention(cache.view(), 1, q.data(), out2.data(), 0.3f).is_ok());
  EXPECT_EQ(out1, out2);
}

TEST_P(CpuAttentionTest, CausalMatchesFloat64) {
  const Geometry g = geometry();
  const int len = 70;
  PagedCache cache(*backend_, g, {len}, rng_);
  const DenseKV dense = random_dense_kv(g, len, rng_);
  write_sequence(*backend_, cache, 0, dense);
  const float scale = 1.0f / std::sqrt(float(g.head_dim));
  const size_t qe = g.q_token_elems();
  for (int nq : {1, 5, len}) {
    const std::vector<float> q = random_values(nq * qe, -3.0f, 3.0f, rng_);
    std::vector<float> out(q.size(), NAN);
    const KernelStatus st = backend_->causal_attention(cache.view(), 0, 1, nq, q.data(), out.data(), scale);
    ASSERT_TRUE(st.is_ok()) << st.message;
    for (int i = 0; i < nq; ++i) {
      const int position = len - nq + i;
      const auto want = naive_attention(g, dense, 1, position + 1, q.data() + i * qe, scale);
      EXPECT_LE(max_abs_diff(out.data() + i * qe, want), kAttentionTolerance)
          << "num_queries " << nq << " query " << i;
    }
  }
}

std::string attention_param_name(const ::testing::TestParamInfo<AttentionParam>& info) {
  const auto [dtype, group, head_dim, block_size, isa] = info.param;
  return std::string(name_of(dtype)) + "_g" + std::to_string(group) + "_hd" + std::to_string(head_dim) +
         "_bs" + std::to_string(block_size) + "_" + std::string(cpu_isa_name(isa));
}

INSTANTIATE_TEST_SUITE_P(
    Geometries, CpuAttentionTest,
    ::testing::Combine(::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                       ::testing::Values(1, 3, 4, 5), ::testing::Values(64, 128, 40, 13),
                       ::testing::Values(16, 5), ::testing::Values(CpuIsa::kBaseline, CpuIsa::kAvx512)),
    attention_param_name);

// The attention scratch a thread keeps between calls is [query heads][chunk], however long the
// sequences it has attended over: long contexts must not leave megabytes behind on every thread.
TEST(CpuAttentionScratchTest, ScratchDoesNotGrowWithTheSequence) {
  const Geometry g = make_geometry(DType::kFloat16, 4, 32, 16);
  const int chunk = cpu::attention_chunk_tokens(g.block_size);
  const std::vector<int> lens = {10, chunk + 1, 10 * chunk + 3};
  auto backend = make_cpu_backend(1);
  std::mt19937 rng(11);
  PagedCache cache(*backend, g, lens, rng);
  for (size_t s = 0; s < lens.size(); ++s) write_sequence(*backend, cache, int(s), random_dense_kv(g, lens[s], rng));
  const std::vector<float> q = random_values(g.q_token_elems(), -1.0f, 1.0f, rng);
  std::vector<float> out(q.size());
  cpu::AttentionScratch scratch;
  for (size_t s = 0; s < lens.size(); ++s) {
    cpu::attend_heads(cache.view(), int(s), 0, 0, g.num_kv_heads, lens[s], q.data(), out.data(), 0.2f, scratch,
                      CpuIsa::kBaseline);
    EXPECT_LE(scratch.scores.capacity(), size_t(g.num_q_heads) * chunk) << "after " << lens[s] << " tokens";
  }
}

// Invalid arguments: kInvalidArgument with a message, and nothing written.
class CpuInvalidArgumentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    geo_ = make_geometry(DType::kFloat16, 3, 8, 4);
    cache_ = std::make_unique<PagedCache>(*backend_, geo_, std::vector<int>{10, 3}, rng_, 1);
    write_sequence(*backend_, *cache_, 0, random_dense_kv(geo_, 10, rng_));
    q_.assign(2 * geo_.q_token_elems() * 10, 0.5f);
    out_.assign(q_.size(), 0.0f);
    kbuf_.assign(geo_.block_bytes() * 10, 0);
  }
  static void expect_invalid(const KernelStatus& st) {
    EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument) << st.message;
    EXPECT_FALSE(st.message.empty());
  }
  std::unique_ptr<Backend> backend_ = make_cpu_backend(2);
  std::mt19937 rng_{3};
  Geometry geo_;
  std::unique_ptr<PagedCache> cache_;
  std::vector<float> q_, out_;
  std::vector<uint8_t> kbuf_;
};

TEST_F(CpuInvalidArgumentTest, WriteKv) {
  const PagedKV kv = cache_->view();
  const void* k = kbuf_.data();
  const std::vector<uint8_t> before = cache_->pool_bytes();
  expect_invalid(backend_->write_kv(kv, -1, 0, 1, 0, 1, k, k));
  expect_invalid(backend_->write_kv(kv, 2, 0, 1, 0, 1, k, k));
  expect_invalid(backend_->write_kv(kv, 0, -1, 1, 0, 1, k, k));
  expect_invalid(backend_->write_kv(kv, 0, 0, -1, 0, 1, k, k));
  expect_invalid(backend_->write_kv(kv, 0, 0, 1, 1, 2, k, k));   // layers [1, 3) of 2
  expect_invalid(backend_->write_kv(kv, 0, 0, 1, -1, 1, k, k));
  expect_invalid(backend_->write_kv(kv, 0, 0, 1, 0, 1, nullptr, k));
  expect_invalid(backend_->write_kv(kv, 0, 10, 3, 0, 1, k, k));  // table covers 12 tokens
  expect_invalid(backend_->write_kv(kv, 1, 0, 5, 0, 1, k, k));   // seq 1 has one block of 4
  PagedKV null_pool = kv;
  null_pool.pool = nullptr;
  expect_invalid(backend_->write_kv(null_pool, 0, 0, 1, 0, 1, k, k));
  PagedKV bad_heads = kv;
  bad_heads.geometry.num_q_heads = 5;
  expect_invalid(backend_->write_kv(bad_heads, 0, 0, 1, 0, 1, k, k));
  EXPECT_EQ(cache_->pool_bytes(), before);
}

TEST_F(CpuInvalidArgumentTest, DecodeAttention) {
  const PagedKV kv = cache_->view();
  expect_invalid(backend_->decode_attention(kv, -1, q_.data(), out_.data(), 1.0f));
  const KernelStatus st = backend_->decode_attention(kv, 2, q_.data(), out_.data(), 1.0f);
  expect_invalid(st);
  EXPECT_NE(st.message.find("layer 2"), std::string::npos) << st.message;
  EXPECT_NE(st.message.find("[0, 2)"), std::string::npos) << st.message;
  expect_invalid(backend_->decode_attention(kv, 0, nullptr, out_.data(), 1.0f));
  expect_invalid(backend_->decode_attention(kv, 0, q_.data(), nullptr, 1.0f));
  PagedKV bad_heads = kv;
  bad_heads.geometry.num_kv_heads = 4;  // 6 query heads
  expect_invalid(backend_->decode_attention(bad_heads, 0, q_.data(), out_.data(), 1.0f));
  PagedKV zero_dim = kv;
  zero_dim.geometry.head_dim = 0;
  expect_invalid(backend_->decode_attention(zero_dim, 0, q_.data(), out_.data(), 1.0f));
  PagedKV no_table = kv;
  no_table.block_table = nullptr;
  expect_invalid(backend_->decode_attention(no_table, 0, q_.data(), out_.data(), 1.0f));
  cache_->set_seq_len(1, 5);  // seq 1 owns one block of 4 tokens
  expect_invalid(backend_->decode_attention(cache_->view(), 0, q_.data(), out_.data(), 1.0f));
  cache_->set_seq_len(1, -1);
  expect_invalid(backend_->decode_attention(cache_->view(), 0, q_.data(), out_.data(), 1.0f));
}

TEST_F(CpuInvalidArgumentTest, CausalAttention) {
  const PagedKV kv = cache_->view();
  expect_invalid(backend_->causal_attention(kv, 2, 0, 1, q_.data(), out_.data(), 1.0f));
  expect_invalid(backend_->causal_attention(kv, 0, 2, 1, q_.data(), out_.data(), 1.0f));
  const KernelStatus st = backend_->causal_attention(kv, 0, 0, 11, q_.data(), out_.data(), 1.0f);
  expect_invalid(st);
  EXPECT_NE(st.message.find("11"), std::string::npos) << st.message;
  expect_invalid(backend_->causal_attention(kv, 0, 0, -1, q_.data(), out_.data(), 1.0f));
  expect_invalid(backend_->causal_attention(kv, 0, 0, 2, nullptr, out_.data(), 1.0f));
  EXPECT_TRUE(backend_->causal_attention(kv, 0, 0, 0, q_.data(), out_.data(), 1.0f).is_ok());
}

TEST_F(CpuInvalidArgumentTest, ReadKvAndCopyBlock) {
  const PagedKV kv = cache_->view();
  expect_invalid(backend_->read_kv(kv, 5, kbuf_.data(), kbuf_.data()));
  expect_invalid(backend_->read_kv(kv, 0, nullptr, kbuf_.data()));
  const int blocks = cache_->num_blocks();
  expect_invalid(backend_->copy_block(kv, -1, 0));
  expect_invalid(backend_->copy_block(kv, 0, blocks));  // the pool came from allocate: size known
  PagedKV foreign = kv;
  foreign.pool = kbuf_.data();  // not from allocate: only the lower bound is known
  expect_invalid(backend_->copy_block(foreign, 0, -2));
  EXPECT_TRUE(backend_->copy_block(kv, 0, 0).is_ok());
}

TEST(CpuBackendTest, AllocateIsZeroedAndAligned) {
  auto backend = make_cpu_backend();
  for (size_t bytes : {size_t(1), size_t(1000), size_t(3) << 20}) {
    void* p = nullptr;
    ASSERT_TRUE(backend->allocate(bytes, &p).is_ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    const auto* b = static_cast<const uint8_t*>(p);
    EXPECT_TRUE(std::all_of(b, b + bytes, [](uint8_t x) { return x == 0; }));
    backend->free(p);
  }
  void* p = nullptr;
  EXPECT_EQ(backend->allocate(0, &p).code, KernelStatus::Code::kInvalidArgument);
  EXPECT_EQ(backend->allocate(16, nullptr).code, KernelStatus::Code::kInvalidArgument);
}

TEST(CpuBackendTest, NamesAndSupport) {
  auto backend = make_cpu_backend(1);
  EXPECT_EQ(backend->name(), "cpu");
  for (Op op : {Op::kWriteKV, Op::kDecodeAttention, Op::kCausalAttention, Op::kReadKV, Op::kCopyBlock})
    for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) EXPECT_TRUE(backend->supports(op, t));
  EXPECT_STREQ(op_name(Op::kDecodeAttention), "decode_attention");
  for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    DType parsed;
    ASSERT_TRUE(parse_dtype(dtype_name(t), &parsed));
    EXPECT_EQ(parsed, t);
  }
  DType parsed;
  EXPECT_FALSE(parse_dtype("fp8", &parsed));
  EXPECT_FALSE(parse_dtype("", &parsed));
}

}  // namespace
}  // namespace karakv::kernels::test

namespace karakv::kernels::test {
namespace {

// Threads of this process, as the kernel lists them.
int process_threads() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// Callers on many threads (a ring thread per fast-path session) share the backend's one pool:
// while 6 fresh threads have each run kernels, small (on the caller alone) and large (on the pool),
// the process has the pool's width - 1 helpers (karakv-kernels), not helpers per caller, and the
// results still match the float64 reference. The helpers end with the backend.
TEST(CpuWorkPoolTest, CallersOnManyThreadsShareOnePool) {
  const int width = 3, callers = 6;
  const int workers = width - 1;
  // 40 tokens x 2 KV heads x dim 16: a few KiB of K/V, run on the caller; 600 tokens x dim 128:
  // over 1 MiB, run on the pool.
  const Geometry small{1, 4, 2, 16, 8, DType::kFloat32}, large{1, 4, 2, 128, 8, DType::kFloat32};
  const int small_len = 40, large_len = 600;
  const int baseline = threads_named("karakv-kernels");
  {
    std::unique_ptr<Backend> backend = make_cpu_backend(width);
    std::mt19937 rng(7);
    PagedCache small_cache(*backend, small, {small_len}, rng), large_cache(*backend, large, {large_len}, rng);
    const DenseKV small_kv = random_dense_kv(small, small_len, rng), large_kv = random_dense_kv(large, large_len, rng);
    write_sequence(*backend, small_cache, 0, small_kv);
    write_sequence(*backend, large_cache, 0, large_kv);
    const std::vector<float> small_q = random_values(small.q_token_elems(), -2.0f, 2.0f, rng);
    const std::vector<float> large_q = random_values(large.q_token_elems(), -2.0f, 2.0f, rng);
    const std::vector<double> small_want = naive_attention(small, small_kv, 0, small_len, small_q.data(), 0.25f);
    const std::vector<double> large_want = naive_attention(large, large_kv, 0, large_len, large_q.data(), 0.08f);

    std::mutex mu;
    std::condition_variable cv;
    int ran = 0;
    bool release = false;
    std::vector<std::vector<float>> small_outs(callers), large_outs(callers);
    std::vector<std::thread> threads;
    for (int c = 0; c < callers; ++c) {
      threads.emplace_back([&, c] {  // fresh threads, as ring threads are
        backend->prepare_thread();
        std::vector<float> small_out(small_q.size()), large_out(large_q.size());
        for (int rep = 0; rep < 3; ++rep) {
          ASSERT_TRUE(
              backend->decode_attention(small_cache.view(), 0, small_q.data(), small_out.data(), 0.25f).is_ok());
          ASSERT_TRUE(
              backend->decode_attention(large_cache.view(), 0, large_q.data(), large_out.data(), 0.08f).is_ok());
        }
        small_outs[c] = small_out;
        large_outs[c] = large_out;
        std::unique_lock<std::mutex> lock(mu);
        ++ran;
        cv.notify_all();
        cv.wait(lock, [&] { return release; });  // stay alive while the threads are counted
      });
    }
    int during = 0;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return ran == callers; });
      during = threads_named("karakv-kernels");
      release = true;
      cv.notify_all();
    }
    for (std::thread& t : threads) t.join();
    EXPECT_EQ(during - baseline, workers);
    for (int c = 0; c < callers; ++c) {
      ASSERT_EQ(small_outs[c].size(), small_want.size());
      ASSERT_EQ(large_outs[c].size(), large_want.size());
      for (size_t i = 0; i < small_want.size(); ++i)
        EXPECT_NEAR(small_outs[c][i], small_want[i], kAttentionTolerance) << c << " " << i;
      for (size_t i = 0; i < large_want.size(); ++i)
        EXPECT_NEAR(large_outs[c][i], large_want[i], kAttentionTolerance) << c << " " << i;
    }
    EXPECT_EQ(threads_named("karakv-kernels") - baseline, workers);  // the callers ended; the helpers stay
  }
  EXPECT_EQ(threads_named("karakv-kernels"), baseline);  // joined by the backend's destructor
}

// One thread: no helpers; kernels run on the caller, every loop included.
TEST(CpuWorkPoolTest, OneThreadRunsOnTheCallerWithoutHelpers) {
  const Geometry g{1, 4, 2, 16, 8, DType::kFloat32};
  std::unique_ptr<Backend> backend = make_cpu_backend(1);
  std::mt19937 rng(11);
  PagedCache cache(*backend, g, {40}, rng);
  write_sequence(*backend, cache, 0, random_dense_kv(g, 40, rng));
  const std::vector<float> q = random_values(g.q_token_elems(), -2.0f, 2.0f, rng);
  std::vector<float> out(q.size());
  std::vector<std::vector<float>> acc(g.num_kv_heads, std::vector<float>(40, 0.0f));
  std::vector<float*> accp;
  for (auto& a : acc) accp.push_back(a.data());
  int before = 0, after = 0;
  std::thread caller([&] {
    before = process_threads();
    backend->prepare_thread();
    ASSERT_TRUE(backend->decode_attention(cache.view(), 0, q.data(), out.data(), 0.25f).is_ok());
    ASSERT_TRUE(
        backend->decode_attention_accumulate(cache.view(), 0, q.data(), out.data(), 0.25f, accp.data(), nullptr).is_ok());
    after = process_threads();
  });
  caller.join();
  EXPECT_EQ(after, before);
  double total = 0;
  for (const auto& a : acc)
    for (float x : a) total += x;
  EXPECT_NEAR(total, g.num_q_heads, 1e-3);  // each query head's probabilities sum to 1
}

}  // namespace
}  // namespace karakv::kernels::test
