// Every op on every available backend against the CPU reference, with a per-op tolerance. A
// backend that cannot be created here is skipped as "no device", an op it does not support as
// "not supported"; neither counts as passed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string_view>
#include <tuple>

#include "kernel_test_util.h"
#include "token2chunk_reference.h"

namespace karakv::kernels::test {
namespace {

// Backends this suite knows about: the CPU reference, the CUDA backend with its own decode kernels,
// and the CUDA backend with FlashInfer's decode where it covers the call ("flashinfer"; every other
// op is the same as "cuda"'s). On machines or builds without a GPU create_backend returns null with
// the reason, and the cuda cases skip saying "no device" and why; a build without FlashInfer skips
// the flashinfer cases saying "not built". "fused" is the CUDA backend with the fused quantized
// decode (KARAKV_CUDA_QUANT_DECODE=fused); it runs only the quantized tests, every other op being
// "cuda"'s. "deferred" is the CUDA backend (with FlashInfer's decode where built) with the test
// thread's waits deferred (Backend::set_deferred) and its stream held 200 us before every launch
// ($KARAKV_CUDA_TEST_STREAM_DELAY_US): calls whose outputs stay on the device return long before
// their uploads and kernels ran, while the tests rewrite the host tables they passed, so each op's
// outputs also show that what a call hands the stream is its own (the pinned upload slots, the
// FlashInfer plan buffer) and that later calls see earlier calls' writes in stream order.
std::vector<std::string> registered_backends() { return {"cpu", "cuda", "flashinfer", "fused", "deferred"}; }

std::unique_ptr<Backend> create_backend(const std::string& name, std::string* why) {
  if (name == "cpu") return make_cpu_backend();
  if (name == "cuda") return make_cuda_backend(0, CudaAttention::kOwn, why);
  if (name == "flashinfer") return make_cuda_backend(0, CudaAttention::kFlashInfer, why);
  if (name == "fused") return make_cuda_backend(0, CudaAttention::kOwn, CudaQuantDecode::kFused, why);
  if (name == "deferred") {
    // Every launch holds the stream for 200 us first, so a call's uploads and kernels run well after
    // it returned and the test rewrote what it passed.
    setenv("KARAKV_CUDA_TEST_STREAM_DELAY_US", "200", 1);
    auto b = make_cuda_backend(
        0, cuda_attention_missing(CudaAttention::kFlashInfer).empty() ? CudaAttention::kFlashInfer : CudaAttention::kOwn,
        why);
    unsetenv("KARAKV_CUDA_TEST_STREAM_DELAY_US");
    return b;
  }
  *why = "unknown backend";
  return nullptr;
}

// Per-op tolerance against the reference. Data movement ops are bit exact; attention may differ in
// fp32 summation order and exp implementation (outputs are O(1): |v| <= 1).
double reference_tolerance(Op op) {
  switch (op) {
    case Op::kDecodeAttention:
    case Op::kCausalAttention: return 1e-4;
    // Probabilities and their sums (up to window * group for window scores), compared relatively.
    case Op::kDecodeAttentionAccumulate:
    case Op::kDecodeAttentionObserve:
    case Op::kWindowScores:
    case Op::kWindowScoresObserved:
    case Op::kSnapKVScores: return 1e-4;
    // Attention straight from the codes: the same logits and values as the reference's but summed
    // in another order and with another expf, on O(1) outputs.
    case Op::kQuantizedAttention: return 1e-4;
    // Quantize and dequantize are the reference's IEEE operations step by step: bit exact.
    default: return 0.0;
  }
}

// Sequences for the quantized tests: random ones, and one whose values make the edge cases of
// both formats: whole zero tokens (TurboQuant's zero norm), constant channels (KIVI's zero scale)
// and values on a coarse grid (codes exactly halfway between two levels).
std::vector<int> quant_lens() { return {0, 1, 16, 33, 300, 256}; }
void write_structured_sequence(Backend& backend, PagedCache& cache, int seq, int len, std::mt19937 rng) {
  const Geometry& g = cache.geometry();
  const size_t n = size_t(g.num_layers) * len * g.kv_token_elems();
  std::vector<float> k(n), v(n);
  std::uniform_int_distribution<int> grid(-8, 8);
  for (size_t i = 0; i < n; ++i) {
    const size_t c = i % g.head_dim, t = i / g.kv_token_elems() % len;
    k[i] = t % 7 == 3 || c % 5 == 0 ? 0.0f : float(grid(rng)) / 8.0f;
    v[i] = t % 7 == 3 || c % 32 == 1 ? 0.0f : float(grid(rng)) / 16.0f;
  }
  write_sequence(backend, cache, seq, dense_kv(g, len, k, v));
}

// The geometries the suite runs on. The first is every backend's; the others reach the kernels'
// other code paths (a GPU kernel picks its lane layout by head_dim and its head chunks by group
// size): head_dim 128 with group 4 (Llama-8B's shape) and one sequence of 20k tokens (many splits),
// head_dim 96 (neither 64 nor 128: the generic layout) with group 1, head_dim 64 with group 8 (two
// head chunks), and the largest head_dim the CUDA kernels take with group 2. Blocks stay 16 tokens:
// the quantized tests' sequences must hold whole quantized blocks.
struct GeometryCase {
  const char* name;
  int num_layers, num_q_heads, num_kv_heads, head_dim, block_size;
  int long_len;  // > 0: a sixth sequence of this many tokens
};
constexpr GeometryCase kDefaultGeometry = {"hd64_g3", 3, 9, 3, 64, 16, 0};
constexpr GeometryCase kOtherGeometries[] = {
    {"hd128_g4_20k", 3, 12, 3, 128, 16, 20000},
    {"hd96_g1", 3, 3, 3, 96, 16, 0},
    {"hd64_g8", 3, 16, 2, 64, 16, 0},
    {"hd256_g2", 3, 6, 3, 256, 16, 0},
};

// For the fused quantized decode only (it serves up to 8 query heads of a KV head per pass): a group
// of 12 (a full pass and a partial one), and head_dim 32 with a group of 5 (KIVI's smallest
// head_dim). TurboQuant's smaller head_dims (8, 16) are not here: in an fp32 pool their quantized
// blocks hold these sequences whole, leaving the causal rows no unquantized tail.
constexpr GeometryCase kFusedGeometries[] = {
    {"hd64_g12", 3, 24, 2, 64, 16, 0},
    {"hd32_g5", 3, 10, 2, 32, 16, 0},
};

void PrintTo(const GeometryCase& c, std::ostream* os) { *os << c.name; }

using OpsParam = std::tuple<std::string, DType, GeometryCase>;

class BackendOpsTest : public ::testing::TestWithParam<OpsParam> {
 protected:
  void SetUp() override {
    std::string why;
    if (std::get<0>(GetParam()) == "flashinfer" && !cuda_attention_missing(CudaAttention::kFlashInfer).empty())
      GTEST_SKIP() << "not built: " << cuda_attention_missing(CudaAttention::kFlashInfer);
    // A TEST_P's name() is "<test>/<param>" (the instantiation's prefix is the suite's name).
    if (std::get<0>(GetParam()) == "fused" &&
        std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()).rfind("Quantized", 0) != 0)
      GTEST_SKIP() << "the fused backend differs from cuda only in quantized attention";
    backend_ = create_backend(std::get<0>(GetParam()), &why);
    if (backend_ == nullptr) GTEST_SKIP() << "no device: backend " << std::get<0>(GetParam()) << ": " << why;
    if (std::get<0>(GetParam()) == "deferred") backend_->set_deferred(true);
    const GeometryCase& c = std::get<2>(GetParam());
    geo_.num_layers = c.num_layers;
    geo_.num_q_heads = c.num_q_heads;
    geo_.num_kv_heads = c.num_kv_heads;
    geo_.head_dim = c.head_dim;
    geo_.block_size = c.block_size;
    geo_.dtype = std::get<1>(GetParam());
    if (c.long_len > 0) lens_.push_back(c.long_len);
  }
  void TearDown() override {
    if (backend_ != nullptr) backend_->set_deferred(false);
  }
  bool supported(Op op) const { return backend_->supports(op, geo_.dtype); }

  // The op's tolerance against the reference. FlashInfer's decode output is in the pool's dtype
  // (kernels/cuda/flashinfer_decode.h), rounded twice where it splits a sequence (its partials,
  // then their merge): two unit roundoffs of outputs of magnitude <= 1, 2 * 2^-11 for fp16 and
  // 2 * 2^-8 for bf16.
  double tolerance(Op op) const {
    double t = reference_tolerance(op);
    const std::string& name = std::get<0>(GetParam());
    const bool flashinfer =
        name == "flashinfer" || (name == "deferred" && cuda_attention_missing(CudaAttention::kFlashInfer).empty());
    if (op == Op::kDecodeAttention && flashinfer)
      t += geo_.dtype == DType::kFloat16 ? std::ldexp(1.0, -10) : geo_.dtype == DType::kBFloat16 ? std::ldexp(1.0, -7) : 0.0;
    return t;
  }

  // The same sequences, block tables (same seed) and values in a cache per backend.
  struct Pair {
    std::unique_ptr<PagedCache> test, ref;
  };
  Pair filled_caches(const std::vector<int>& lens, int spare_blocks = 3) {
    std::mt19937 table_rng_a(11), table_rng_b(11);
    Pair p{std::make_unique<PagedCache>(*backend_, geo_, lens, table_rng_a, spare_blocks),
           std::make_unique<PagedCache>(*reference_, geo_, lens, table_rng_b, spare_blocks)};
    for (size_t s = 0; s < lens.size(); ++s) {
      const DenseKV dense = random_dense_kv(geo_, lens[s], rng_);
      write_sequence(*backend_, *p.test, int(s), dense);
      write_sequence(*reference_, *p.ref, int(s), dense);
    }
    return p;
  }

  // filled_caches(quant_lens()) with the last sequence structured and spare blocks to quantize into.
  Pair quant_caches() {
    Pair p = filled_caches(quant_lens(), 12);
    const int last = int(quant_lens().size()) - 1;
    write_structured_sequence(*backend_, *p.test, last, quant_lens()[last], std::mt19937(3));
    write_structured_sequence(*reference_, *p.ref, last, quant_lens()[last], std::mt19937(3));
    return p;
  }

  // One random decode query per sequence of lens_ (n floats), the same in a buffer of each backend,
  // and an output buffer in each.
  struct DecodeBuffers {
    DecodeBuffers(Backend& test, Backend& ref, size_t n)
        : n(n), q(test, n * 4), out(test, n * 4), ref_q(ref, n * 4), ref_out(ref, n * 4) {}
    size_t n;
    BackendBuffer q, out, ref_q, ref_out;
  };
  std::unique_ptr<DecodeBuffers> decode_buffers() {
    const size_t n = lens_.size() * geo_.q_token_elems();
    auto b = std::make_unique<DecodeBuffers>(*backend_, *reference_, n);
    const std::vector<float> q = random_values(n, -3.0f, 3.0f, rng_);
    b->q.upload(q);
    b->ref_q.upload(q);
    return b;
  }

  // The quantization formats the reference lays out at this geometry (TurboQuant's rotation needs
  // a power-of-two head_dim; at the default geometry every format), each with the backend agreeing
  // on tokens_per_block, also on the 0 of a format it cannot lay out.
  std::vector<QuantFormat> formats_here() const;

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Backend> reference_ = make_cpu_backend();
  Geometry geo_;
  std::mt19937 rng_{5};
  std::vector<int> lens_ = {0, 1, 16, 33, 300};  // and the geometry's long sequence
};

// Every backend runs every op for every storage dtype: the daemon refuses nothing on either.
TEST_P(BackendOpsTest, SupportsEveryOp) {
  for (int op = int(Op::kWriteKV); op <= int(Op::kWindowScoresObserved); ++op)
    EXPECT_TRUE(supported(Op(op))) << op_name(Op(op));
}

TEST_P(BackendOpsTest, WriteKv) {
  if (!supported(Op::kWriteKV)) GTEST_SKIP() << "not supported";
  const Pair caches = filled_caches(lens_);
  EXPECT_EQ(caches.test->pool_bytes(), caches.ref->pool_bytes());
}

// "" when a and b are equal, else how many bytes differ and where the first is.
std::string byte_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
  size_t differ = 0, first = a.size();
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) {
      ++differ;
      first = std::min(first, i);
    }
  if (differ == 0) return "";
  return std::to_string(differ) + " bytes differ, the first at byte " + std::to_string(first);
}

// byte_difference of two pools of geometry g, and where in the pool the first difference is: its
// block, (layer, K/V, head) run and byte within the run, with the eight bytes from there of each
// (a first), and how many runs differ.
std::string pool_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, const Geometry& g) {
  std::string out = byte_difference(a, b);
  if (out.empty() || a.size() != b.size()) return out;
  const size_t run = size_t(g.block_size) * g.head_dim * dtype_size(g.dtype);
  size_t first = 0, runs = 0;
  while (a[first] == b[first]) ++first;
  for (size_t r0 = 0; r0 < a.size(); r0 += run)
    runs += !std::equal(a.begin() + r0, a.begin() + std::min(a.size(), r0 + run), b.begin() + r0);
  const size_t r = (first % g.block_bytes()) / run, hk = size_t(g.num_kv_heads);
  auto hex8 = [&](const std::vector<uint8_t>& v) {
    std::string h;
    char buf[4];
    for (size_t i = first; i < std::min(v.size(), first + 8); ++i) {
      std::snprintf(buf, sizeof buf, "%02x", v[i]);
      h += buf;
    }
    return h;
  };
  return out + " (block " + std::to_string(first / g.block_bytes()) + ", layer " + std::to_string(r / (2 * hk)) +
         ((r / hk) % 2 == 0 ? " keys" : " values") + " head " + std::to_string(r % hk) + ", byte " +
         std::to_string(first % run) + " of the run: " + hex8(a) + " vs " + hex8(b) + "; " + std::to_string(runs) +
         " of " + std::to_string(a.size() / run) + " runs differ)";
}

// A step's writes in one call (one token per sequence at one layer) equal write_kv per sequence,
// byte for byte, with K/V in this backend's memory; a position its sequence's blocks do not cover
// is refused like write_kv's and nothing of the step is written, not even the earlier sequences'.
TEST_P(BackendOpsTest, WriteStepKvIsWriteKvPerSequence) {
  if (!supported(Op::kWriteKV)) GTEST_SKIP() << "not supported";
  // Every sequence with a block (a Step appends where its table already covers the slot).
  const std::vector<int> lens(std::find_if(lens_.begin(), lens_.end(), [](int len) { return len > 0; }), lens_.end());
  const Pair caches = filled_caches(lens);
  const int n = int(lens.size()), layer = geo_.num_layers - 1;
  const std::vector<int32_t>& offsets = caches.test->table_offset();
  auto covered = [&](int s) { return (offsets[s + 1] - offsets[s]) * geo_.block_size; };
  std::vector<int32_t> positions;
  for (int s = 0; s < n; ++s) positions.push_back(std::uniform_int_distribution<int>(0, covered(s) - 1)(rng_));
  positions[0] = covered(0) - 1;  // past the sequence's length, inside its last block
  const DenseKV step = random_dense_kv(geo_, n, rng_);  // its first layer: [n][kv heads][head_dim]
  const size_t bytes = size_t(n) * geo_.kv_token_elems() * dtype_size(geo_.dtype);
  BackendBuffer k(*backend_, bytes), v(*backend_, bytes);
  k.upload(step.k_bytes.data(), bytes);
  v.upload(step.v_bytes.data(), bytes);
  ASSERT_TRUE(backend_->write_step_kv(caches.test->view(), layer, positions.data(), k.get(), v.get()).is_ok());
  const size_t stride = geo_.kv_token_elems() * dtype_size(geo_.dtype);
  auto reference_step = [&](const DenseKV& kv, const std::vector<int32_t>& at, int l) {
    for (int s = 0; s < n; ++s)
      ASSERT_TRUE(reference_
                      ->write_kv(caches.ref->view(), s, at[s], 1, l, 1, kv.k_bytes.data() + s * stride,
                                 kv.v_bytes.data() + s * stride)
                      .is_ok());
  };
  reference_step(step, positions, layer);
  EXPECT_EQ(pool_difference(caches.test->pool_bytes(), caches.ref->pool_bytes(), geo_), "") << "device K/V";

  // K/V in host memory (a request's inline tensors, shm staging), at another layer.
  const DenseKV host_step = random_dense_kv(geo_, n, rng_);
  ASSERT_TRUE(
      backend_->write_step_kv(caches.test->view(), 0, positions.data(), host_step.k_bytes.data(), host_step.v_bytes.data())
          .is_ok());
  reference_step(host_step, positions, 0);
  EXPECT_EQ(pool_difference(caches.test->pool_bytes(), caches.ref->pool_bytes(), geo_), "") << "host K/V";

  // New values for every sequence, the last one's position outside its table: nothing may change.
  const DenseKV fresh = random_dense_kv(geo_, n, rng_);
  k.upload(fresh.k_bytes.data(), bytes);
  v.upload(fresh.v_bytes.data(), bytes);
  const std::vector<uint8_t> before = caches.test->pool_bytes();
  std::vector<int32_t> bad = positions;
  bad[n - 1] = covered(n - 1);
  const KernelStatus st = backend_->write_step_kv(caches.test->view(), layer, bad.data(), k.get(), v.get());
  const KernelStatus per_seq = reference_->write_kv(caches.ref->view(), n - 1, bad[n - 1], 1, layer, 1,
                                                    step.k_bytes.data(), step.v_bytes.data());
  EXPECT_EQ(int(st.code), int(KernelStatus::Code::kInvalidArgument)) << st.message;
  EXPECT_EQ(int(st.code), int(per_seq.code)) << st.message << " | " << per_seq.message;
  EXPECT_NE(st.message.find("write_step_kv"), std::string::npos) << st.message;
  EXPECT_NE(st.message.find("positions[" + std::to_string(n - 1) + "]"), std::string::npos) << st.message;
  EXPECT_EQ(byte_difference(caches.test->pool_bytes(), before), "") << "a refused step wrote";
}

TEST_P(BackendOpsTest, ReadKv) {
  if (!supported(Op::kWriteKV) || !supported(Op::kReadKV)) GTEST_SKIP() << "not supported";
  const Pair caches = filled_caches(lens_);
  for (size_t s = 0; s < lens_.size(); ++s) {
    const size_t bytes = size_t(geo_.num_layers) * lens_[s] * geo_.kv_token_elems() * dtype_size(geo_.dtype);
    BackendBuffer k(*backend_, bytes), v(*backend_, bytes);
    BackendBuffer rk(*reference_, bytes), rv(*reference_, bytes);
    ASSERT_TRUE(backend_->read_kv(caches.test->view(), int(s), k.get(), v.get()).is_ok());
    ASSERT_TRUE(reference_->read_kv(caches.ref->view(), int(s), rk.get(), rv.get()).is_ok());
    EXPECT_EQ(k.download<uint8_t>(bytes), rk.download<uint8_t>(bytes)) << "seq " << s;
    EXPECT_EQ(v.download<uint8_t>(bytes), rv.download<uint8_t>(bytes)) << "seq " << s;
  }
}

TEST_P(BackendOpsTest, CopyBlock) {
  if (!supported(Op::kWriteKV) || !supported(Op::kCopyBlock)) GTEST_SKIP() << "not supported";
  const Pair caches = filled_caches(lens_);
  const int32_t src = caches.test->block_table()[2];
  const int32_t dst = caches.test->block_table()[0];
  ASSERT_TRUE(backend_->copy_block(caches.test->view(), src, dst).is_ok());
  ASSERT_TRUE(reference_->copy_block(caches.ref->view(), src, dst).is_ok());
  EXPECT_EQ(caches.test->pool_bytes(), caches.ref->pool_bytes());
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double err = 0;
  for (size_t i = 0; i < a.size(); ++i) err = std::max(err, std::fabs(double(a[i]) - double(b[i])));
  return err;
}

TEST_P(BackendOpsTest, DecodeAttention) {
  if (!supported(Op::kWriteKV) || !supported(Op::kDecodeAttention)) GTEST_SKIP() << "not supported";
  const Pair caches = filled_caches(lens_);
  const auto io = decode_buffers();
  const size_t n = io->n;
  BackendBuffer &qb = io->q, &ob = io->out, &rqb = io->ref_q, &rob = io->ref_out;
  const float scale = 0.125f;
  for (int layer = 0; layer < geo_.num_layers; ++layer) {
    ASSERT_TRUE(backend_->decode_attention(caches.test->view(), layer, qb.get<float>(), ob.get<float>(), scale).is_ok());
    ASSERT_TRUE(reference_->decode_attention(caches.ref->view(), layer, rqb.get<float>(), rob.get<float>(), scale).is_ok());
    EXPECT_LE(max_abs_diff(ob.download<float>(n), rob.download<float>(n)), tolerance(Op::kDecodeAttention))
        << "layer " << layer;
  }
}

// Decode where every sequence has a token and none is long: FlashInfer's route takes the batch as it
// is (no row left out, no query gathered) and its planner splits no sequence (fewer than 128 tokens
// each), the two shapes the main decode test (an empty sequence, splits) does not reach; the own
// kernels run it too. Twice per layer, the second time with the first's plan.
TEST_P(BackendOpsTest, DecodeAttentionShortNonEmptyBatch) {
  if (!supported(Op::kWriteKV) || !supported(Op::kDecodeAttention)) GTEST_SKIP() << "not supported";
  lens_ = {1, 16, 33, 100};
  const Pair caches = filled_caches(lens_);
  const auto io = decode_buffers();
  const size_t n = io->n;
  for (int layer = 0; layer < geo_.num_layers; ++layer) {
    for (int round = 0; round < 2; ++round) {
      ASSERT_TRUE(backend_->decode_attention(caches.test->view(), layer, io->q.get<float>(), io->out.get<float>(),
                                             0.125f).is_ok());
      ASSERT_TRUE(reference_->decode_attention(caches.ref->view(), layer, io->ref_q.get<float>(),
                                               io->ref_out.get<float>(), 0.125f).is_ok());
      EXPECT_LE(max_abs_diff(io->out.download<float>(n), io->ref_out.download<float>(n)),
                tolerance(Op::kDecodeAttention))
          << "layer " << layer << ", round " << round;
    }
  }
}

// Causal attention: a few rows (one row kernel), and from 16 rows on tiles of rows sharing their K/V
// (a tile cut short at the end, a whole 300-token sequence, and with the geometry's 20k-token
// sequence 48 rows after a long prefix, split along the keys).
TEST_P(BackendOpsTest, CausalAttention) {
  if (!supported(Op::kWriteKV) || !supported(Op::kCausalAttention)) GTEST_SKIP() << "not supported";
  const Pair caches = filled_caches(lens_);
  std::vector<std::pair<int, int>> cases = {{3, 1}, {3, 5}, {3, lens_[3]}, {4, 17}, {4, lens_[4]}};
  if (lens_.size() > 5) cases.push_back({5, 48});
  for (auto [seq, nq] : cases) {
    const size_t n = size_t(nq) * geo_.q_token_elems();
    const std::vector<float> q = random_values(n, -3.0f, 3.0f, rng_);
    BackendBuffer qb(*backend_, n * 4), ob(*backend_, n * 4), rqb(*reference_, n * 4), rob(*reference_, n * 4);
    qb.upload(q);
    rqb.upload(q);
    ASSERT_TRUE(backend_->causal_attention(caches.test->view(), seq, 2, nq, qb.get<float>(), ob.get<float>(), 0.125f).is_ok());
    ASSERT_TRUE(reference_->causal_attention(caches.ref->view(), seq, 2, nq, rqb.get<float>(), rob.get<float>(), 0.125f).is_ok());
    EXPECT_LE(max_abs_diff(ob.download<float>(n), rob.download<float>(n)), tolerance(Op::kCausalAttention))
        << "seq " << seq << ", num_queries " << nq;
  }
}

// max |a - b| / max(1, |b|): scores are sums of probabilities of very different sizes.
double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double err = 0;
  for (size_t i = 0; i < a.size(); ++i)
    err = std::max(err, std::fabs(double(a[i]) - double(b[i])) / std::max(1.0, std::fabs(double(b[i]))));
  return err;
}

TEST_P(BackendOpsTest, DecodeAttentionAccumulate) {
  if (!supported(Op::kWriteKV) || !supported(Op::kDecodeAttentionAccumulate)) GTEST_SKIP() << "not supported";
  const Pair caches = filled_caches(lens_);
  const auto io = decode_buffers();
  const size_t n = io->n;
  BackendBuffer &qb = io->q, &ob = io->out, &rqb = io->ref_q, &rob = io->ref_out;
  // Accumulators start from the same non-zero values, and one (sequence, head) has none.
  const int hk = geo_.num_kv_heads;
  std::vector<std::vector<float>> acc(lens_.size() * hk), ref(lens_.size() * hk);
  std::vector<float*> accp, refp;
  for (size_t i = 0; i < acc.size(); ++i) {
    acc[i] = random_values(lens_[i / hk], 0.0f, 2.0f, rng_);
    ref[i] = acc[i];
    accp.push_back(i == 4 ? nullptr : acc[i].data());
    refp.push_back(i == 4 ? nullptr : ref[i].data());
  }
  ASSERT_TRUE(backend_->decode_attention_accumulate(caches.test->view(), 1, qb.get<float>(), ob.get<float>(), 0.125f,
                                                    accp.data(), nullptr).is_ok());
  ASSERT_TRUE(reference_->decode_attention_accumulate(caches.ref->view(), 1, rqb.get<float>(), rob.get<float>(),
                                                      0.125f, refp.data(), nullptr).is_ok());
  EXPECT_LE(max_abs_diff(ob.download<float>(n), rob.download<float>(n)), tolerance(Op::kDecodeAttention));
  for (size_t i = 0; i < acc.size(); ++i)
    EXPECT_LE(max_rel_diff(acc[i], ref[i]), tolerance(Op::kDecodeAttentionAccumulate)) << "row " << i;
}

// Accumulators in the backend's own memory (allocate(): H2O's sums, added into on a device with no
// copy back) for every other sequence, host memory for the rest, through decode_attention_accumulate
// and decode_attention_observe (from a first slot): every row equals the reference's host
// accumulators (sequence 4's first head, in backend memory, has none). On a backend with device
// memory a sequence with heads of both kinds is refused, naming the sequence, and nothing is added;
// so is a row whose allocation ends before the sequence does.
TEST_P(BackendOpsTest, AccumulatorsInBackendMemory) {
  if (!supported(Op::kWriteKV) || !supported(Op::kDecodeAttentionObserve)) GTEST_SKIP() << "not supported";
  const Pair caches = filled_caches(lens_);
  const auto io = decode_buffers();
  const size_t n = io->n;
  BackendBuffer &qb = io->q, &ob = io->out, &rqb = io->ref_q, &rob = io->ref_out;
  const int hk = geo_.num_kv_heads;
  auto in_backend = [&](size_t row) { return (row / hk) % 2 == 0; };
  std::vector<std::vector<float>> host(lens_.size() * hk), ref(host.size());
  std::vector<std::unique_ptr<BackendBuffer>> dev(host.size());
  std::vector<float*> accp, refp;
  for (size_t i = 0; i < host.size(); ++i) {
    host[i] = random_values(lens_[i / hk], 0.0f, 2.0f, rng_);
    ref[i] = host[i];
    refp.push_back(i == size_t(4) * hk ? nullptr : ref[i].data());
    if (i == size_t(4) * hk) {
      accp.push_back(nullptr);
    } else if (in_backend(i)) {
      dev[i] = std::make_unique<BackendBuffer>(*backend_, host[i].size() * 4);
      dev[i]->upload(host[i]);
      accp.push_back(dev[i]->get<float>());
    } else {
      accp.push_back(host[i].data());
    }
  }
  auto expect_rows = [&](const char* what) {
    for (size_t i = 0; i < host.size(); ++i) {
      const std::vector<float> got = dev[i] != nullptr ? dev[i]->download<float>(host[i].size()) : host[i];
      EXPECT_LE(max_rel_diff(got, ref[i]), tolerance(Op::kDecodeAttentionAccumulate))
          << what << ", row " << i << (dev[i] != nullptr ? " (backend memory)" : " (host memory)");
    }
  };
  ASSERT_TRUE(backend_->decode_attention_accumulate(caches.test->view(), 1, qb.get<float>(), ob.get<float>(), 0.125f,
                                                    accp.data(), nullptr).is_ok());
  ASSERT_TRUE(reference_->decode_attention_accumulate(caches.ref->view(), 1, rqb.get<float>(), rob.get<float>(),
                                                      0.125f, refp.data(), nullptr).is_ok());
  EXPECT_LE(max_abs_diff(ob.download<float>(n), rob.download<float>(n)), tolerance(Op::kDecodeAttention));
  expect_rows("accumulate");
  std::vector<int32_t> first(lens_.size());
  for (size_t s = 0; s < lens_.size(); ++s) first[s] = lens_[s] / 2;
  ASSERT_TRUE(backend_->decode_attention_observe(caches.test->view(), 2, qb.get<float>(), ob.get<float>(), 0.125f,
                                                 accp.data(), first.data(), nullptr).is_ok());
  ASSERT_TRUE(reference_->decode_attention_observe(caches.ref->view(), 2, rqb.get<float>(), rob.get<float>(), 0.125f,
                                                   refp.data(), first.data(), nullptr).is_ok());
  expect_rows("observe from the middle");

  if (!backend_->shares_device_memory()) return;  // host memory on both sides: nothing to mix up
  std::vector<float*> mixed = accp;
  const size_t row = size_t(2) * hk;  // sequence 2 (16 tokens): head 1 on the host, the others not
  mixed[row + 1] = host[row + 1].data();
  const std::vector<float> before = dev[row]->download<float>(host[row].size());
  const KernelStatus st = backend_->decode_attention_accumulate(caches.test->view(), 1, qb.get<float>(),
                                                                ob.get<float>(), 0.125f, mixed.data(), nullptr);
  EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument);
  EXPECT_NE(st.message.find("score_acc of sequence 2 has " + std::to_string(hk - 1) +
                            " KV heads in device memory and 1 in host memory"),
            std::string::npos)
      << st.message;
  EXPECT_EQ(dev[row]->download<float>(host[row].size()), before) << "a refused call added";
  // A row in backend memory shorter than its sequence would be written past its end.
  std::vector<float*> short_row = accp;
  BackendBuffer one(*backend_, sizeof(float));
  short_row[row] = one.get<float>();
  const KernelStatus cut = backend_->decode_attention_accumulate(caches.test->view(), 1, qb.get<float>(),
                                                                 ob.get<float>(), 0.125f, short_row.data(), nullptr);
  EXPECT_EQ(cut.code, KernelStatus::Code::kInvalidArgument);
  EXPECT_NE(cut.message.find("has 1 floats left in its allocation; expected at least the sequence's 16 slots"),
            std::string::npos)
      << cut.message;
}

// Kara's decode observers: the accumulated probabilities from each sequence's first slot on (the
// slots before it keep their values exactly) and each query head's log-sum-exp; a sequence
// without an lse pointer (and the empty one) keeps what its buffer held.
TEST_P(BackendOpsTest, DecodeAttentionObserve) {
  if (!supported(Op::kWriteKV) || !supported(Op::kDecodeAttentionObserve)) GTEST_SKIP() << "not supported";
  const Pair caches = filled_caches(lens_);
  const auto io = decode_buffers();
  const size_t n = io->n;
  BackendBuffer &qb = io->q, &ob = io->out, &rqb = io->ref_q, &rob = io->ref_out;
  const int hk = geo_.num_kv_heads, hq = geo_.num_q_heads;
  std::vector<std::vector<float>> acc(lens_.size() * hk), ref(lens_.size() * hk);
  std::vector<float*> accp, refp;
  for (size_t i = 0; i < acc.size(); ++i) {
    acc[i] = random_values(lens_[i / hk], 0.0f, 2.0f, rng_);
    ref[i] = acc[i];
    accp.push_back(i == 7 ? nullptr : acc[i].data());
    refp.push_back(i == 7 ? nullptr : ref[i].data());
  }
  const std::vector<std::vector<float>> before = acc;
  // First slots: 0, a third in, two thirds in, ... and the last sequence's whole length.
  std::vector<int32_t> first(lens_.size());
  for (size_t s = 0; s < lens_.size(); ++s)
    first[s] = s + 1 == lens_.size() ? lens_[s] : int32_t(int64_t(lens_[s]) * (s % 3) / 3);
  std::vector<std::vector<float>> lse(lens_.size(), std::vector<float>(hq, -7.0f)), rlse = lse;
  std::vector<float*> lsep, rlsep;
  for (size_t s = 0; s < lens_.size(); ++s) {
    lsep.push_back(s == 2 ? nullptr : lse[s].data());
    rlsep.push_back(s == 2 ? nullptr : rlse[s].data());
  }
  ASSERT_TRUE(backend_->decode_attention_observe(caches.test->view(), 1, qb.get<float>(), ob.get<float>(), 0.125f,
                                                 accp.data(), first.data(), lsep.data()).is_ok());
  ASSERT_TRUE(reference_->decode_attention_observe(caches.ref->view(), 1, rqb.get<float>(), rob.get<float>(), 0.125f,
                                                   refp.data(), first.data(), rlsep.data()).is_ok());
  EXPECT_LE(max_abs_diff(ob.download<float>(n), rob.download<float>(n)), tolerance(Op::kDecodeAttention));
  for (size_t i = 0; i < acc.size(); ++i) {
    EXPECT_LE(max_rel_diff(acc[i], ref[i]), tolerance(Op::kDecodeAttentionObserve)) << "row " << i;
    for (int32_t t = 0; t < first[i / hk]; ++t) ASSERT_EQ(acc[i][t], before[i][t]) << "row " << i << " slot " << t;
  }
  for (size_t s = 0; s < lens_.size(); ++s) {
    EXPECT_LE(max_abs_diff(lse[s], rlse[s]), tolerance(Op::kDecodeAttentionObserve)) << "seq " << s;
    if (s == 2 || lens_[s] == 0) {
      EXPECT_EQ(lse[s], std::vector<float>(hq, -7.0f)) << "seq " << s;
    }
  }
}

// Kara's window scores with a given normaliser on some rows (NaN elsewhere: the window softmax),
// and with only the keys after each query counted.
TEST_P(BackendOpsTest, WindowScoresObserved) {
  if (!supported(Op::kWriteKV) || !supported(Op::kWindowScoresObserved)) GTEST_SKIP() << "not supported";
  const Pair caches = filled_caches(lens_);
  const int seq = 4, window = 64, begin = lens_[seq] - window - 5, hq = geo_.num_q_heads;
  const size_t nq = size_t(window) * geo_.q_token_elems(), no = size_t(geo_.num_kv_heads) * window;
  const std::vector<float> q = random_values(nq, -2.0f, 2.0f, rng_);
  std::vector<float> lse = random_values(size_t(window) * hq, 4.0f, 6.0f, rng_);
  for (size_t i = 0; i < lse.size(); i += 5) lse[i] = NAN;
  BackendBuffer qb(*backend_, nq * 4), ob(*backend_, no * 4), rqb(*reference_, nq * 4), rob(*reference_, no * 4);
  qb.upload(q);
  rqb.upload(q);
  for (const bool later : {false, true}) {
    for (const float* given : {static_cast<const float*>(nullptr), static_cast<const float*>(lse.data())}) {
      ASSERT_TRUE(backend_->window_scores_observed(caches.test->view(), seq, 2, begin, window, qb.get<float>(), 0.125f,
                                                   given, later, ob.get<float>()).is_ok());
      ASSERT_TRUE(reference_->window_scores_observed(caches.ref->view(), seq, 2, begin, window, rqb.get<float>(),
                                                     0.125f, given, later, rob.get<float>()).is_ok());
      EXPECT_LE(max_rel_diff(ob.download<float>(no), rob.download<float>(no)), tolerance(Op::kWindowScoresObserved))
          << "later_keys_only " << later << ", lse " << (given != nullptr);
    }
  }
}

TEST_P(BackendOpsTest, WindowScores) {
  if (!supported(Op::kWriteKV) || !supported(Op::kWindowScores)) GTEST_SKIP() << "not supported";
  const Pair caches = filled_caches(lens_);
  const int seq = 4, window = 64, begin = lens_[seq] - window - 5;
  const size_t nq = size_t(window) * geo_.q_token_elems(), no = size_t(geo_.num_kv_heads) * window;
  const std::vector<float> q = random_values(nq, -2.0f, 2.0f, rng_);
  BackendBuffer qb(*backend_, nq * 4), ob(*backend_, no * 4), rqb(*reference_, nq * 4), rob(*reference_, no * 4);
  qb.upload(q);
  rqb.upload(q);
  ASSERT_TRUE(backend_->window_scores(caches.test->view(), seq, 2, begin, window, qb.get<float>(), 0.125f,
                                      ob.get<float>()).is_ok());
  ASSERT_TRUE(reference_->window_scores(caches.ref->view(), seq, 2, begin, window, rqb.get<float>(), 0.125f,
                                        rob.get<float>()).is_ok());
  EXPECT_LE(max_rel_diff(ob.download<float>(no), rob.download<float>(no)), tolerance(Op::kWindowScores));
}

TEST_P(BackendOpsTest, SnapKVScores) {
  if (!supported(Op::kWriteKV) || !supported(Op::kSnapKVScores)) GTEST_SKIP() << "not supported";
  const Pair caches = filled_caches(lens_);
  const int seq = 4, n = lens_[seq], obs = 32;
  const size_t nq = size_t(obs) * geo_.q_token_elems(), no = size_t(geo_.num_kv_heads) * n;
  const std::vector<float> q = random_values(nq, -2.0f, 2.0f, rng_);
  BackendBuffer qb(*backend_, nq * 4), ob(*backend_, no * 4), rqb(*reference_, nq * 4), rob(*reference_, no * 4);
  qb.upload(q);
  rqb.upload(q);
  for (int pool : {1, 7}) {
    ASSERT_TRUE(backend_->snapkv_scores(caches.test->view(), seq, 0, obs, qb.get<float>(), 0.125f, pool,
                                        ob.get<float>()).is_ok());
    ASSERT_TRUE(reference_->snapkv_scores(caches.ref->view(), seq, 0, obs, rqb.get<float>(), 0.125f, pool,
                                          rob.get<float>()).is_ok());
    EXPECT_LE(max_rel_diff(ob.download<float>(no), rob.download<float>(no)), tolerance(Op::kSnapKVScores))
        << "pool " << pool;
  }
}

// Scores on a coarse grid so ties are common, with signed zeros among them.
std::vector<float> tied_scores(int n, std::mt19937& rng) {
  std::uniform_int_distribution<int> dist(-20, 20);
  std::vector<float> s(n);
  for (float& x : s) x = dist(rng) == 0 ? -0.0f : float(dist(rng)) / 4.0f;
  return s;
}

// Each row's selection equals the plain definition's over that row alone, whether it comes in a
// call of its own or among many (a policy's every (layer, KV head) row at once); and equals the
// CPU reference's.
TEST_P(BackendOpsTest, TopKIsExactPerRow) {
  if (!supported(Op::kTopK)) GTEST_SKIP() << "not supported";
  struct Case { int rows, n, k; };
  for (const Case c : {Case{1, 1, 1}, Case{1, 100, 7}, Case{3, 5000, 1234}, Case{2, 300, 300}, Case{90, 128, 32},
                       Case{5, 64, 0}}) {
    const std::vector<float> scores = tied_scores(c.rows * c.n, rng_);
    std::vector<int32_t> out(size_t(c.rows) * c.k, -1), ref(size_t(c.rows) * c.k, -2);
    ASSERT_TRUE(backend_->top_k(scores.data(), c.rows, c.n, c.k, out.data()).is_ok());
    ASSERT_TRUE(reference_->top_k(scores.data(), c.rows, c.n, c.k, ref.data()).is_ok());
    EXPECT_EQ(out, ref) << "rows " << c.rows << " n " << c.n << " k " << c.k;
    for (int r = 0; r < c.rows; ++r) {
      const std::vector<float> row(scores.begin() + size_t(r) * c.n, scores.begin() + size_t(r + 1) * c.n);
      const std::vector<int32_t> got(out.begin() + size_t(r) * c.k, out.begin() + size_t(r + 1) * c.k);
      ASSERT_EQ(got, naive_top_k(row, c.k)) << "rows " << c.rows << " n " << c.n << " row " << r;
    }
  }
}

TEST_P(BackendOpsTest, Token2ChunkIsExactPerRow) {
  if (!supported(Op::kToken2Chunk)) GTEST_SKIP() << "not supported";
  struct Case { int rows, n, budget, candidates, max_gap; };
  for (const Case c : {Case{1, 128, 32, 8, 8}, Case{1, 96, 24, 6, 16}, Case{2, 1000, 250, 60, 12},
                       Case{1, 16, 16, 16, 4}, Case{90, 128, 32, 16, 8}, Case{240, 128, 32, 16, 8}}) {
    const std::vector<float> scores = tied_scores(c.rows * c.n, rng_);
    std::vector<int32_t> out(size_t(c.rows) * c.budget, -1), ref(size_t(c.rows) * c.budget, -2);
    ASSERT_TRUE(
        backend_->token2chunk(scores.data(), c.rows, c.n, c.budget, c.candidates, c.max_gap, out.data()).is_ok());
    ASSERT_TRUE(
        reference_->token2chunk(scores.data(), c.rows, c.n, c.budget, c.candidates, c.max_gap, ref.data()).is_ok());
    EXPECT_EQ(out, ref) << "rows " << c.rows << " n " << c.n << " budget " << c.budget;
    for (int r = 0; r < c.rows; ++r) {
      const std::vector<float> row(scores.begin() + size_t(r) * c.n, scores.begin() + size_t(r + 1) * c.n);
      const std::vector<int32_t> got(out.begin() + size_t(r) * c.budget, out.begin() + size_t(r + 1) * c.budget);
      ASSERT_EQ(got, naive_token2chunk(row, c.budget, c.candidates, c.max_gap))
          << "rows " << c.rows << " n " << c.n << " row " << r;
    }
  }
}

// Per (layer, head) row, num_kept ascending slots of [begin, end), different per row.
std::vector<int32_t> random_kept(const Geometry& g, int begin, int end, int num_kept, std::mt19937& rng) {
  std::vector<int32_t> kept;
  std::vector<int32_t> slots(end - begin);
  std::iota(slots.begin(), slots.end(), begin);
  for (int r = 0; r < g.num_layers * g.num_kv_heads; ++r) {
    std::shuffle(slots.begin(), slots.end(), rng);
    std::vector<int32_t> row(slots.begin(), slots.begin() + num_kept);
    std::sort(row.begin(), row.end());
    kept.insert(kept.end(), row.begin(), row.end());
  }
  return kept;
}

// The pool's blocks no sequence uses (PagedCache mixes spare blocks into the permutation).
std::vector<int32_t> spare_blocks(const PagedCache& cache) {
  std::vector<int32_t> used = cache.block_table(), spare;
  std::sort(used.begin(), used.end());
  for (int32_t b = 0; b < cache.num_blocks(); ++b)
    if (!std::binary_search(used.begin(), used.end(), b)) spare.push_back(b);
  return spare;
}

// CaM version 2 against the reference: merge width 3 with random scores; a width (64) larger than
// the 40 kept tokens; scores with zeros (kept tokens of score 0 take p_e = 1) and with negative and
// non-finite ones (read as 0). Rows of 40 kept among 160 slots have evicted tokens after their last
// kept one almost surely (they merge into the row's last kept tokens).
TEST_P(BackendOpsTest, GatherTokensThenCamMerge) {
  if (!supported(Op::kWriteKV) || !supported(Op::kGatherTokens)) GTEST_SKIP() << "not supported";
  const int seq = 4, begin = 100, end = 260, num_kept = 40;
  const int rows = geo_.num_layers * geo_.num_kv_heads;
  struct Case {
    int merge_tokens;
    int zero_every;     // every zero_every-th score is 0 (0: none)
    bool non_finite;    // some scores negative, NaN or infinite
  };
  for (const Case& cam : {Case{3, 0, false}, Case{64, 3, false}, Case{5, 4, true}}) {
    SCOPED_TRACE("merge_tokens " + std::to_string(cam.merge_tokens));
    const Pair caches = filled_caches(lens_);
    const std::vector<int32_t> dst = spare_blocks(*caches.test);
    ASSERT_GE(int(dst.size()) * geo_.block_size, num_kept);
    const std::vector<int32_t> kept = random_kept(geo_, begin, end, num_kept, rng_);
    ASSERT_TRUE(backend_->gather_tokens(caches.test->view(), seq, kept.data(), num_kept, dst.data()).is_ok());
    ASSERT_TRUE(reference_->gather_tokens(caches.ref->view(), seq, kept.data(), num_kept, dst.data()).is_ok());
    EXPECT_EQ(caches.test->pool_bytes(), caches.ref->pool_bytes()) << "gather";

    if (!supported(Op::kCamMerge)) GTEST_SKIP() << "cam_merge_values not supported";
    // CaM needs the kept slots relative to the range's sequence positions.
    std::vector<float> scores = random_values(size_t(rows) * (end - begin), 0.0f, 1.0f, rng_);
    const float specials[] = {-0.5f, NAN, INFINITY, -INFINITY};
    for (size_t i = 0; i < scores.size(); ++i) {
      if (cam.zero_every > 0 && i % cam.zero_every == 0) scores[i] = 0.0f;
      if (cam.non_finite && i % 7 == 3) scores[i] = specials[(i / 7) % 4];
    }
    ASSERT_TRUE(backend_->cam_merge_values(caches.test->view(), seq, begin, end, kept.data(), num_kept, scores.data(),
                                           cam.merge_tokens, dst.data()).is_ok());
    ASSERT_TRUE(reference_->cam_merge_values(caches.ref->view(), seq, begin, end, kept.data(), num_kept,
                                             scores.data(), cam.merge_tokens, dst.data()).is_ok());
    // The same double arithmetic rounded to fp32, then to storage once: at most one unit in the
    // last place of the storage type.
    const std::vector<uint8_t> a = caches.test->pool_bytes(), b = caches.ref->pool_bytes();
    const double ulp = geo_.dtype == DType::kFloat32 ? 1e-6 : geo_.dtype == DType::kFloat16 ? 1.0 / 1024 : 1.0 / 128;
    const size_t elems = a.size() / dtype_size(geo_.dtype);
    double worst = 0;
    for (size_t i = 0; i < elems; ++i) {
      const double x = decode_at(geo_.dtype, a.data(), i), y = decode_at(geo_.dtype, b.data(), i);
      worst = std::max(worst, std::fabs(x - y) / std::max(1e-3, std::fabs(y)));
    }
    EXPECT_LE(worst, ulp);
  }
}

// In place: each kept slot's K and V land on slot begin + i of the sequence's own blocks, byte for
// byte as a naive copy from the pool as it was says, and nothing else in the pool changes (slots
// before begin, the row's slots from begin + num_kept on, other sequences, spare blocks). Rows
// drawn at random, rows that keep a prefix in place and drop the newest (as a re-rank mostly does),
// and a begin inside a block.
TEST_P(BackendOpsTest, GatherTokensInPlaceMovesExactlyWhatANaiveCopySays) {
  if (!supported(Op::kWriteKV) || !supported(Op::kGatherTokensInPlace)) GTEST_SKIP() << "not supported";
  const int seq = 4, len = lens_[seq];
  const int hk = geo_.num_kv_heads, rows = geo_.num_layers * hk, bs = geo_.block_size;
  const size_t esize = dtype_size(geo_.dtype), row_bytes = size_t(geo_.head_dim) * esize;
  struct Case {
    int begin, num_kept;
    bool prefix_in_place;
  };
  for (const Case& c : {Case{96, 40, false}, Case{37, 120, false}, Case{0, 250, true}, Case{64, 200, true},
                        Case{100, 0, false}, Case{16, len - 16, false}}) {
    SCOPED_TRACE("begin " + std::to_string(c.begin) + " num_kept " + std::to_string(c.num_kept));
    const Pair caches = filled_caches(lens_);
    std::vector<int32_t> kept = random_kept(geo_, c.begin, len, c.num_kept, rng_);
    if (c.prefix_in_place) {
      // Every other row keeps all but a few slots of [begin, begin + num_kept + drop), the newest
      // dropped, or one early slot dropped.
      for (int r = 0; r < rows; r += 2) {
        for (int i = 0; i < c.num_kept; ++i) kept[size_t(r) * c.num_kept + i] = c.begin + i + (r % 4 == 2 && i >= 3);
      }
    }
    const PagedKV kv = caches.test->view();
    const std::vector<uint8_t> before = caches.test->pool_bytes();
    std::vector<uint8_t> want = before;
    auto at = [&](int32_t slot, int l, int h, int k_or_v) {
      return (kv.run_offset(kv.block_of(seq, slot), l, k_or_v, h) + size_t(slot % bs) * geo_.head_dim) * esize;
    };
    for (int r = 0; r < rows; ++r) {
      for (int k_or_v = 0; k_or_v < 2; ++k_or_v) {
        for (int i = 0; i < c.num_kept; ++i) {
          const size_t src = at(kept[size_t(r) * c.num_kept + i], r / hk, r % hk, k_or_v);
          std::memcpy(want.data() + at(c.begin + i, r / hk, r % hk, k_or_v), before.data() + src, row_bytes);
        }
      }
    }
    ASSERT_TRUE(backend_->gather_tokens_in_place(kv, seq, c.begin, kept.data(), c.num_kept).is_ok());
    EXPECT_TRUE(caches.test->pool_bytes() == want) << "the pool differs from the naive copy";
  }
}

// Refused, naming what is wrong, with the pool unchanged: a kept slot before begin or past the
// sequence, a row not ascending, begin past the sequence, more kept than the slots from begin.
TEST_P(BackendOpsTest, GatherTokensInPlaceRefusesWhatCouldOverwriteUnreadSlots) {
  if (!supported(Op::kWriteKV) || !supported(Op::kGatherTokensInPlace)) GTEST_SKIP() << "not supported";
  const int seq = 4, len = lens_[seq], num_kept = 8;
  const Pair caches = filled_caches(lens_);
  const std::vector<uint8_t> before = caches.test->pool_bytes();
  const PagedKV kv = caches.test->view();
  auto refused = [&](int begin, std::vector<int32_t> kept, int n, const std::string& words) {
    const KernelStatus st = backend_->gather_tokens_in_place(kv, seq, begin, kept.data(), n);
    EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument) << words;
    EXPECT_NE(st.message.find(words), std::string::npos) << st.message;
  };
  std::vector<int32_t> ok = random_kept(geo_, 50, len, num_kept, rng_);
  std::vector<int32_t> below = ok;
  below[0] = 49;
  refused(50, below, num_kept, "kept[layer 0][head 0][0] = 49 out of range [50, " + std::to_string(len) + ")");
  std::vector<int32_t> past = ok;
  past[num_kept - 1] = len;
  refused(50, past, num_kept, "out of range [50, " + std::to_string(len) + ")");
  std::vector<int32_t> unordered = ok;
  std::swap(unordered[0], unordered[1]);
  refused(50, unordered, num_kept, "is not strictly ascending at index 1");
  refused(len + 1, ok, num_kept, "begin " + std::to_string(len + 1) + " out of range [0, " + std::to_string(len) + "]");
  refused(len - 4, ok, num_kept, "num_kept 8 out of range [0, 4]");
  EXPECT_TRUE(caches.test->pool_bytes() == before) << "a refused call changed the pool";
}

// ---- quantized storage (docs/COMPRESSION.md section 3): every format and bit width.

constexpr QuantFormat kQuantFormats[] = {QuantFormat::kKivi2, QuantFormat::kKivi4, QuantFormat::kTq2,
                                         QuantFormat::kTq3, QuantFormat::kTq4};
const char* format_name(QuantFormat f) {
  switch (f) {
    case QuantFormat::kKivi2: return "kivi2";
    case QuantFormat::kKivi4: return "kivi4";
    case QuantFormat::kTq2: return "tq2";
    case QuantFormat::kTq3: return "tq3";
    case QuantFormat::kTq4: return "tq4";
  }
  return "unknown";
}
constexpr uint64_t kQuantSeed = 0x5eed1234abcdull;

std::vector<QuantFormat> BackendOpsTest::formats_here() const {
  std::vector<QuantFormat> out;
  for (QuantFormat f : kQuantFormats) {
    const int tpb = reference_->quantized_tokens_per_block(geo_, f);
    EXPECT_EQ(backend_->quantized_tokens_per_block(geo_, f), tpb) << format_name(f);
    if (tpb > 0) out.push_back(f);
  }
  if (std::string_view(std::get<2>(GetParam()).name) == kDefaultGeometry.name) {
    EXPECT_EQ(out.size(), std::size(kQuantFormats));
  }
  EXPECT_FALSE(out.empty());
  return out;
}

// Each sequence's quantized prefix (its first blocks' tokens quantized into spare blocks) and the
// unquantized rest, as the daemon keeps them: QuantizedKV tables plus a PagedKV of the remainder.
struct QuantizedLayout {
  int tokens_per_block = 0;
  std::vector<int32_t> qtable, qoffset{0};           // quantized blocks per sequence
  std::vector<int32_t> fp_table, fp_offset{0}, fp_len;  // the unquantized remainder

  QuantizedKV qkv(QuantFormat f) const {
    QuantizedKV q;
    q.format = f;
    q.tokens_per_block = tokens_per_block;
    q.seed = kQuantSeed;
    q.block_table = qtable.data();
    q.table_offset = qoffset.data();
    return q;
  }
  PagedKV remainder(const PagedCache& cache) const {
    PagedKV kv = cache.view();
    kv.block_table = fp_table.data();
    kv.table_offset = fp_offset.data();
    kv.seq_len = fp_len.data();
    return kv;
  }
};

// Up to two quantized blocks per sequence (fewer when it is shorter), the first tokens of each.
QuantizedLayout quantized_layout(const PagedCache& cache, int tokens_per_block, const std::vector<int32_t>& spare) {
  QuantizedLayout q;
  q.tokens_per_block = tokens_per_block;
  const int bs = cache.geometry().block_size;
  size_t next = 0;
  for (int s = 0; s + 1 < int(cache.table_offset().size()); ++s) {
    const int len = cache.seq_len(s);
    const int blocks = std::min(2, len / tokens_per_block);
    for (int b = 0; b < blocks; ++b) q.qtable.push_back(spare.at(next++));
    q.qoffset.push_back(int32_t(q.qtable.size()));
    const int nq = blocks * tokens_per_block;
    for (int32_t i = cache.table_offset()[s] + nq / bs; i < cache.table_offset()[s + 1]; ++i)
      q.fp_table.push_back(cache.block_table()[i]);
    q.fp_offset.push_back(int32_t(q.fp_table.size()));
    q.fp_len.push_back(len - nq);
  }
  return q;
}

// Quantizes every sequence's prefix as quantized_layout lays it out.
void quantize_prefixes(Backend& backend, const PagedCache& cache, const QuantizedLayout& q, QuantFormat f) {
  const QuantizedKV qkv = q.qkv(f);
  for (int s = 0; s + 1 < int(q.qoffset.size()); ++s)
    for (int32_t i = q.qoffset[s]; i < q.qoffset[s + 1]; ++i) {
      const KernelStatus st =
          backend.quantize_tokens(cache.view(), s, (i - q.qoffset[s]) * q.tokens_per_block, qkv, q.qtable[i]);
      ASSERT_TRUE(st.is_ok()) << backend.name() << ": " << st.message;
    }
}

// The same codes, scales, zero points and norms as the reference, byte for byte, for every
// sequence's quantized blocks; tokens_per_block agrees too.
TEST_P(BackendOpsTest, QuantizeIsBitExact) {
  if (!supported(Op::kWriteKV) || !supported(Op::kQuantize)) GTEST_SKIP() << "not supported";
  const Pair caches = quant_caches();
  ASSERT_EQ(caches.test->block_table(), caches.ref->block_table());
  const std::vector<int32_t> spare = spare_blocks(*caches.test);
  for (QuantFormat f : formats_here()) {
    SCOPED_TRACE(format_name(f));
    const int tpb = reference_->quantized_tokens_per_block(geo_, f);
    ASSERT_GT(tpb, 0);
    ASSERT_EQ(backend_->quantized_tokens_per_block(geo_, f), tpb);
    const QuantizedLayout q = quantized_layout(*caches.ref, tpb, spare);
    ASSERT_GE(q.qtable.size(), 2u) << "the structured sequence and the long one are quantized";
    quantize_prefixes(*backend_, *caches.test, q, f);
    quantize_prefixes(*reference_, *caches.ref, q, f);
    ASSERT_EQ(tolerance(Op::kQuantize), 0.0);
    EXPECT_EQ(pool_difference(caches.test->pool_bytes(), caches.ref->pool_bytes(), geo_), "");
  }
}

// Dequantizing the reference's quantized blocks (copied into this backend's pool) gives the
// reference's dense K and V bit for bit.
TEST_P(BackendOpsTest, DequantizeIsBitExact) {
  if (!supported(Op::kWriteKV) || !supported(Op::kDequantize)) GTEST_SKIP() << "not supported";
  const Pair caches = quant_caches();
  const std::vector<int32_t> spare = spare_blocks(*caches.ref);
  for (QuantFormat f : formats_here()) {
    SCOPED_TRACE(format_name(f));
    const int tpb = reference_->quantized_tokens_per_block(geo_, f);
    const QuantizedLayout q = quantized_layout(*caches.ref, tpb, spare);
    quantize_prefixes(*reference_, *caches.ref, q, f);
    const std::vector<uint8_t> pool = caches.ref->pool_bytes();
    ASSERT_TRUE(backend_->copy_in(caches.test->view().pool, pool.data(), pool.size()).is_ok());
    const size_t bytes = size_t(geo_.num_layers) * tpb * geo_.kv_token_elems() * dtype_size(geo_.dtype);
    BackendBuffer k(*backend_, bytes), v(*backend_, bytes);
    std::vector<uint8_t> rk(bytes), rv(bytes);
    for (int32_t block : q.qtable) {
      const KernelStatus st = backend_->dequantize_block(caches.test->view(), q.qkv(f), block, k.get(), v.get());
      ASSERT_TRUE(st.is_ok()) << st.message;
      ASSERT_TRUE(reference_->dequantize_block(caches.ref->view(), q.qkv(f), block, rk.data(), rv.data()).is_ok());
      ASSERT_EQ(tolerance(Op::kDequantize), 0.0);
      EXPECT_EQ(byte_difference(k.download<uint8_t>(bytes), rk), "") << "keys of block " << block;
      EXPECT_EQ(byte_difference(v.download<uint8_t>(bytes), rv), "") << "values of block " << block;
    }
  }
}

// Decode attention (with and without the accumulated probabilities) and causal attention over
// quantized prefixes followed by unquantized tokens, on the reference's codes. Sequences: none at
// all, unquantized only, one or two quantized blocks with a short or a long unquantized tail.
TEST_P(BackendOpsTest, QuantizedAttention) {
  if (!supported(Op::kWriteKV) || !supported(Op::kQuantizedAttention)) GTEST_SKIP() << "not supported";
  const Pair caches = quant_caches();
  const std::vector<int32_t> spare = spare_blocks(*caches.ref);
  const int hk = geo_.num_kv_heads, num_seqs = int(quant_lens().size());
  const size_t n = size_t(num_seqs) * geo_.q_token_elems();
  for (QuantFormat f : formats_here()) {
    SCOPED_TRACE(format_name(f));
    const int tpb = reference_->quantized_tokens_per_block(geo_, f);
    const QuantizedLayout q = quantized_layout(*caches.ref, tpb, spare);
    quantize_prefixes(*reference_, *caches.ref, q, f);
    const std::vector<uint8_t> pool = caches.ref->pool_bytes();
    ASSERT_TRUE(backend_->copy_in(caches.test->view().pool, pool.data(), pool.size()).is_ok());
    const PagedKV kv = q.remainder(*caches.test), rkv = q.remainder(*caches.ref);
    const QuantizedKV qkv = q.qkv(f);

    const std::vector<float> query = random_values(n, -3.0f, 3.0f, rng_);
    BackendBuffer qb(*backend_, n * 4), ob(*backend_, n * 4), rqb(*reference_, n * 4), rob(*reference_, n * 4);
    qb.upload(query);
    rqb.upload(query);
    for (int layer : {0, 2}) {
      ASSERT_TRUE(backend_->decode_attention_quantized(kv, qkv, layer, qb.get<float>(), ob.get<float>(), 0.125f,
                                                       nullptr, nullptr, nullptr).is_ok());
      ASSERT_TRUE(reference_->decode_attention_quantized(rkv, qkv, layer, rqb.get<float>(), rob.get<float>(), 0.125f,
                                                         nullptr, nullptr, nullptr).is_ok());
      EXPECT_LE(max_abs_diff(ob.download<float>(n), rob.download<float>(n)), tolerance(Op::kQuantizedAttention))
          << "decode, layer " << layer;
    }

    // Accumulators over quantized + unquantized slots, from the same values; one row has none.
    std::vector<std::vector<float>> acc(size_t(num_seqs) * hk), ref(acc.size());
    std::vector<float*> accp, refp;
    for (size_t i = 0; i < acc.size(); ++i) {
      const int s = int(i) / hk;
      acc[i] = random_values(size_t(qkv.quantized(s) + q.fp_len[s]), 0.0f, 2.0f, rng_);
      ref[i] = acc[i];
      accp.push_back(i == 13 ? nullptr : acc[i].data());
      refp.push_back(i == 13 ? nullptr : ref[i].data());
    }
    ASSERT_TRUE(backend_->decode_attention_quantized(kv, qkv, 1, qb.get<float>(), ob.get<float>(), 0.125f,
                                                     accp.data(), nullptr, nullptr).is_ok());
    ASSERT_TRUE(reference_->decode_attention_quantized(rkv, qkv, 1, rqb.get<float>(), rob.get<float>(), 0.125f,
                                                       refp.data(), nullptr, nullptr).is_ok());
    EXPECT_LE(max_abs_diff(ob.download<float>(n), rob.download<float>(n)), tolerance(Op::kQuantizedAttention));
    for (size_t i = 0; i < acc.size(); ++i)
      EXPECT_LE(max_rel_diff(acc[i], ref[i]), tolerance(Op::kQuantizedAttention)) << "accumulator row " << i;
    {
      // The same with every other sequence's accumulators in backend memory (H2O over quantized
      // storage); the reference keeps adding into its host rows.
      std::vector<std::unique_ptr<BackendBuffer>> dev(acc.size());
      std::vector<float*> mixed = accp;
      for (size_t i = 0; i < acc.size(); ++i) {
        if ((i / hk) % 2 != 0 || accp[i] == nullptr) continue;
        dev[i] = std::make_unique<BackendBuffer>(*backend_, acc[i].size() * 4);
        dev[i]->upload(acc[i]);
        mixed[i] = dev[i]->get<float>();
      }
      ASSERT_TRUE(backend_->decode_attention_quantized(kv, qkv, 1, qb.get<float>(), ob.get<float>(), 0.125f,
                                                       mixed.data(), nullptr, nullptr).is_ok());
      ASSERT_TRUE(reference_->decode_attention_quantized(rkv, qkv, 1, rqb.get<float>(), rob.get<float>(), 0.125f,
                                                         refp.data(), nullptr, nullptr).is_ok());
      for (size_t i = 0; i < acc.size(); ++i) {
        if (dev[i] != nullptr) {  // into the same storage: accp still points at it
          const std::vector<float> got = dev[i]->download<float>(acc[i].size());
          std::copy(got.begin(), got.end(), acc[i].begin());
        }
        EXPECT_LE(max_rel_diff(acc[i], ref[i]), tolerance(Op::kQuantizedAttention))
            << "accumulator row " << i << (dev[i] != nullptr ? " (backend memory)" : " (host memory)");
      }
    }

    // Kara's decode observers over quantized storage: accumulation from acc_begin (in the quantized
    // part, in the unquantized tail, at the end, and 0) and each query head's log-sum-exp, one
    // sequence without one.
    std::vector<int32_t> begin(num_seqs);
    for (int s = 0; s < num_seqs; ++s) {
      const int32_t slots = qkv.quantized(s) + q.fp_len[s];
      begin[s] = s % 4 == 0 ? 0 : s % 4 == 1 ? slots : s % 4 == 2 ? std::min(slots, qkv.quantized(s) + 3) : slots / 3;
    }
    std::vector<std::vector<float>> lse(num_seqs, std::vector<float>(geo_.num_q_heads, -5.0f)), rlse = lse;
    std::vector<float*> lsep, rlsep;
    for (int s = 0; s < num_seqs; ++s) {
      lsep.push_back(s == 1 ? nullptr : lse[s].data());
      rlsep.push_back(s == 1 ? nullptr : rlse[s].data());
    }
    ASSERT_TRUE(backend_->decode_attention_quantized(kv, qkv, 1, qb.get<float>(), ob.get<float>(), 0.125f,
                                                     accp.data(), begin.data(), lsep.data()).is_ok());
    ASSERT_TRUE(reference_->decode_attention_quantized(rkv, qkv, 1, rqb.get<float>(), rob.get<float>(), 0.125f,
                                                       refp.data(), begin.data(), rlsep.data()).is_ok());
    EXPECT_LE(max_abs_diff(ob.download<float>(n), rob.download<float>(n)), tolerance(Op::kQuantizedAttention));
    for (size_t i = 0; i < acc.size(); ++i)
      EXPECT_LE(max_rel_diff(acc[i], ref[i]), tolerance(Op::kQuantizedAttention)) << "accumulator row " << i;
    for (int s = 0; s < num_seqs; ++s)
      EXPECT_LE(max_abs_diff(lse[s], rlse[s]), tolerance(Op::kQuantizedAttention)) << "lse of sequence " << s;
    EXPECT_EQ(lse[1], std::vector<float>(geo_.num_q_heads, -5.0f)) << "a null lse pointer was written";

    for (int seq : {4, 5}) {
      ASSERT_GT(qkv.quantized(seq), 0);
      for (int nq : {1, 5, q.fp_len[seq]}) {
        const size_t m = size_t(nq) * geo_.q_token_elems();
        const std::vector<float> cq = random_values(m, -3.0f, 3.0f, rng_);
        BackendBuffer cqb(*backend_, m * 4), cob(*backend_, m * 4), rcqb(*reference_, m * 4), rcob(*reference_, m * 4);
        cqb.upload(cq);
        rcqb.upload(cq);
        const KernelStatus st =
            backend_->causal_attention_quantized(kv, qkv, seq, 2, nq, cqb.get<float>(), cob.get<float>(), 0.125f);
        ASSERT_TRUE(st.is_ok()) << st.message;
        ASSERT_TRUE(reference_->causal_attention_quantized(rkv, qkv, seq, 2, nq, rcqb.get<float>(), rcob.get<float>(),
                                                           0.125f).is_ok());
        EXPECT_LE(max_abs_diff(cob.download<float>(m), rcob.download<float>(m)), tolerance(Op::kQuantizedAttention))
            << "causal, seq " << seq << ", num_queries " << nq;
      }
    }
  }
}

// Values the reference cannot quantize (outside fp16 for KIVI, a norm above 65504 for TurboQuant):
// refused with the same code, the run that holds them left unwritten and every other run written,
// as the reference does. fp16 storage cannot hold such values.
TEST_P(BackendOpsTest, QuantizeRefusesWhatTheReferenceRefuses) {
  if (!supported(Op::kWriteKV) || !supported(Op::kQuantize)) GTEST_SKIP() << "not supported";
  if (geo_.dtype == DType::kFloat16) GTEST_SKIP() << "fp16 storage holds no value outside the fp16 range";
  const std::vector<int> lens = {300};
  Pair caches = filled_caches(lens, 4);
  const size_t elems = size_t(geo_.num_layers) * lens[0] * geo_.kv_token_elems();
  std::vector<float> k = random_values(elems, -1.0f, 1.0f, rng_), v = random_values(elems, -1.0f, 1.0f, rng_);
  auto at = [&](int layer, int token, int head, int c) {
    return ((size_t(layer) * lens[0] + token) * geo_.num_kv_heads + head) * geo_.head_dim + c;
  };
  k[at(1, 5, geo_.num_kv_heads - 1, 7)] = 1e6f;  // keys of layer 1, the last head
  v[at(2, 40, 0, 3)] = -7e4f;                    // values of layer 2, head 0
  const DenseKV dense = dense_kv(geo_, lens[0], k, v);
  write_sequence(*backend_, *caches.test, 0, dense);
  write_sequence(*reference_, *caches.ref, 0, dense);
  const int32_t dst = spare_blocks(*caches.ref).at(0);
  for (QuantFormat f : kQuantFormats) {
    SCOPED_TRACE(format_name(f));
    QuantizedKV q;
    q.format = f;
    q.tokens_per_block = reference_->quantized_tokens_per_block(geo_, f);
    q.seed = kQuantSeed;
    const KernelStatus a = backend_->quantize_tokens(caches.test->view(), 0, 0, q, dst);
    const KernelStatus b = reference_->quantize_tokens(caches.ref->view(), 0, 0, q, dst);
    EXPECT_EQ(int(b.code), int(KernelStatus::Code::kInvalidArgument)) << b.message;
    EXPECT_EQ(int(a.code), int(b.code)) << a.message << " | " << b.message;
    EXPECT_EQ(pool_difference(caches.test->pool_bytes(), caches.ref->pool_bytes(), geo_), "");
  }
}

// Every refusal of the CPU backend is a refusal here too, with the same code.
TEST_P(BackendOpsTest, InvalidArgumentsAreRefusedLikeTheReference) {
  if (!supported(Op::kWriteKV)) GTEST_SKIP() << "not supported";
  const Pair caches = filled_caches(lens_);
  const PagedKV kv = caches.test->view(), rkv = caches.ref->view();
  std::vector<float> q(4 * geo_.q_token_elems()), out(q.size());
  auto same = [](const KernelStatus& a, const KernelStatus& b) {
    EXPECT_EQ(int(a.code), int(b.code)) << a.message << " | " << b.message;
    EXPECT_FALSE(a.is_ok());
  };
  same(backend_->causal_attention(kv, 4, 0, 400, q.data(), out.data(), 1.0f),
       reference_->causal_attention(rkv, 4, 0, 400, q.data(), out.data(), 1.0f));
  same(backend_->decode_attention(kv, 7, q.data(), out.data(), 1.0f),
       reference_->decode_attention(rkv, 7, q.data(), out.data(), 1.0f));
  same(backend_->window_scores(kv, 4, 0, 290, 64, q.data(), 1.0f, out.data()),
       reference_->window_scores(rkv, 4, 0, 290, 64, q.data(), 1.0f, out.data()));
  same(backend_->snapkv_scores(kv, 4, 0, 8, q.data(), 1.0f, 4, out.data()),
       reference_->snapkv_scores(rkv, 4, 0, 8, q.data(), 1.0f, 4, out.data()));
  const float nan_scores[3] = {1.0f, std::nanf(""), 0.0f};
  int32_t idx[3];
  same(backend_->top_k(nan_scores, 1, 3, 2, idx), reference_->top_k(nan_scores, 1, 3, 2, idx));
  same(backend_->token2chunk(nan_scores, 1, 3, 2, 3, 1, idx), reference_->token2chunk(nan_scores, 1, 3, 2, 3, 1, idx));
  same(backend_->top_k(nan_scores, 0, 3, 2, idx), reference_->top_k(nan_scores, 0, 3, 2, idx));
  const std::vector<int32_t> own = {caches.test->block_table()[caches.test->table_offset()[4]]};
  const std::vector<int32_t> kept(size_t(geo_.num_layers) * geo_.num_kv_heads, 0);
  same(backend_->gather_tokens(kv, 4, kept.data(), 1, own.data()),
       reference_->gather_tokens(rkv, 4, kept.data(), 1, own.data()));
  if (supported(Op::kQuantize) && supported(Op::kQuantizedAttention) && supported(Op::kDequantize)) {
    QuantizedKV qkv;
    qkv.format = QuantFormat::kTq3;
    qkv.tokens_per_block = reference_->quantized_tokens_per_block(geo_, qkv.format);
    const std::vector<int32_t> none(lens_.size() + 1, 0);
    qkv.table_offset = none.data();
    const int32_t spare = spare_blocks(*caches.test).at(0);
    QuantizedKV wrong = qkv;
    wrong.tokens_per_block += 16;
    same(backend_->quantize_tokens(kv, 4, 0, wrong, spare), reference_->quantize_tokens(rkv, 4, 0, wrong, spare));
    same(backend_->quantize_tokens(kv, 4, 300 - qkv.tokens_per_block + 1, qkv, spare),
         reference_->quantize_tokens(rkv, 4, 300 - qkv.tokens_per_block + 1, qkv, spare));
    same(backend_->quantize_tokens(kv, 9, 0, qkv, spare), reference_->quantize_tokens(rkv, 9, 0, qkv, spare));
    same(backend_->dequantize_block(kv, wrong, spare, out.data(), out.data()),
         reference_->dequantize_block(rkv, wrong, spare, out.data(), out.data()));
    same(backend_->decode_attention_quantized(kv, qkv, 3, q.data(), out.data(), 1.0f, nullptr, nullptr, nullptr),
         reference_->decode_attention_quantized(rkv, qkv, 3, q.data(), out.data(), 1.0f, nullptr, nullptr, nullptr));
    same(backend_->causal_attention_quantized(kv, qkv, 4, 0, 301, q.data(), out.data(), 1.0f),
         reference_->causal_attention_quantized(rkv, qkv, 4, 0, 301, q.data(), out.data(), 1.0f));
  }
  EXPECT_EQ(caches.test->pool_bytes(), caches.ref->pool_bytes()) << "a refused call changed the pool";
}

INSTANTIATE_TEST_SUITE_P(
    AllBackends, BackendOpsTest,
    ::testing::Combine(::testing::ValuesIn(registered_backends()),
                       ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                       ::testing::Values(kDefaultGeometry)),
    [](const auto& info) { return std::get<0>(info.param) + "_" + name_of(std::get<1>(info.param)); });

// The other geometries on every backend but the CPU one: the reference is the CPU backend, so
// there they would compare it with itself.
std::vector<std::string> backends_under_test() {
  std::vector<std::string> b;
  for (const std::string& name : registered_backends())
    if (name != "cpu" && name != "deferred") b.push_back(name);  // deferred: the default geometry only
  return b;
}

// "<backend>_<dtype>_<geometry>", e.g. cuda_fp16_hd96_g1.
std::string backend_dtype_geometry(const ::testing::TestParamInfo<OpsParam>& info) {
  return std::get<0>(info.param) + "_" + name_of(std::get<1>(info.param)) + "_" + std::get<2>(info.param).name;
}

INSTANTIATE_TEST_SUITE_P(
    FusedGeometries, BackendOpsTest,
    ::testing::Combine(::testing::Values(std::string("fused")),
                       ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                       ::testing::ValuesIn(kFusedGeometries)),
    backend_dtype_geometry);

INSTANTIATE_TEST_SUITE_P(
    Geometries, BackendOpsTest,
    ::testing::Combine(::testing::ValuesIn(backends_under_test()),
                       ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                       ::testing::ValuesIn(kOtherGeometries)),
    backend_dtype_geometry);

}  // namespace
}  // namespace karakv::kernels::test
