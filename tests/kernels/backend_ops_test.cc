// Every op on every available backend against the CPU reference, with a per-op tolerance. A
// backend that cannot be created here is skipped as "no device", an op it does not support as
// "not supported"; neither counts as passed.
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>

#include "kernel_test_util.h"

namespace karakv::kernels::test {
namespace {

// Backends this suite knows about. A GPU backend joins here; on machines or builds without it
// create_backend returns null and its cases skip.
std::vector<std::string> registered_backends() { return {"cpu"}; }

std::unique_ptr<Backend> create_backend(const std::string& name) {
  if (name == "cpu") return make_cpu_backend();
  return nullptr;
}

// Per-op tolerance against the reference. Data movement ops are bit exact; attention may differ in
// fp32 summation order and exp implementation (outputs are O(1): |v| <= 1).
double tolerance(Op op) {
  switch (op) {
    case Op::kDecodeAttention:
    case Op::kCausalAttention: return 1e-4;
    default: return 0.0;
  }
}

using OpsParam = std::tuple<std::string, DType>;

class BackendOpsTest : public ::testing::TestWithParam<OpsParam> {
 protected:
  void SetUp() override {
    backend_ = create_backend(std::get<0>(GetParam()));
    if (backend_ == nullptr) GTEST_SKIP() << "no device: backend " << std::get<0>(GetParam()) << " unavailable";
    geo_.num_layers = 3;
    geo_.num_q_heads = 9;
    geo_.num_kv_heads = 3;
    geo_.head_dim = 64;
    geo_.block_size = 16;
    geo_.dtype = std::get<1>(GetParam());
  }
  bool supported(Op op) const { return backend_->supports(op, geo_.dtype); }

  // The same sequences, block tables (same seed) and values in a cache per backend.
  struct Pair {
    std::unique_ptr<PagedCache> test, ref;
  };
  Pair filled_caches(const std::vector<int>& lens) {
    std::mt19937 table_rng_a(11), table_rng_b(11);
    Pair p{std::make_unique<PagedCache>(*backend_, geo_, lens, table_rng_a),
           std::make_unique<PagedCache>(*reference_, geo_, lens, table_rng_b)};
    for (size_t s = 0; s < lens.size(); ++s) {
      const DenseKV dense = random_dense_kv(geo_, lens[s], rng_);
      write_sequence(*backend_, *p.test, int(s), dense);
      write_sequence(*reference_, *p.ref, int(s), dense);
    }
    return p;
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Backend> reference_ = make_cpu_backend();
  Geometry geo_;
  std::mt19937 rng_{5};
  const std::vector<int> lens_ = {0, 1, 16, 33, 300};
};

TEST_P(BackendOpsTest, WriteKv) {
  if (!supported(Op::kWriteKV)) GTEST_SKIP() << "not supported";
  const Pair caches = filled_caches(lens_);
  EXPECT_EQ(caches.test->pool_bytes(), caches.ref->pool_bytes());
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
  const size_t n = lens_.size() * geo_.q_token_elems();
  const std::vector<float> q = random_values(n, -3.0f, 3.0f, rng_);
  BackendBuffer qb(*backend_, n * 4), ob(*backend_, n * 4), rqb(*reference_, n * 4), rob(*reference_, n * 4);
  qb.upload(q);
  rqb.upload(q);
  const float scale = 0.125f;
  for (int layer = 0; layer < geo_.num_layers; ++layer) {
    ASSERT_TRUE(backend_->decode_attention(caches.test->view(), layer, qb.get<float>(), ob.get<float>(), scale).is_ok());
    ASSERT_TRUE(reference_->decode_attention(caches.ref->view(), layer, rqb.get<float>(), rob.get<float>(), scale).is_ok());
    EXPECT_LE(max_abs_diff(ob.download<float>(n), rob.download<float>(n)), tolerance(Op::kDecodeAttention))
        << "layer " << layer;
  }
}

TEST_P(BackendOpsTest, CausalAttention) {
  if (!supported(Op::kWriteKV) || !supported(Op::kCausalAttention)) GTEST_SKIP() << "not supported";
  const Pair caches = filled_caches(lens_);
  const int seq = 3;
  for (int nq : {1, 5, lens_[seq]}) {
    const size_t n = size_t(nq) * geo_.q_token_elems();
    const std::vector<float> q = random_values(n, -3.0f, 3.0f, rng_);
    BackendBuffer qb(*backend_, n * 4), ob(*backend_, n * 4), rqb(*reference_, n * 4), rob(*reference_, n * 4);
    qb.upload(q);
    rqb.upload(q);
    ASSERT_TRUE(backend_->causal_attention(caches.test->view(), seq, 2, nq, qb.get<float>(), ob.get<float>(), 0.125f).is_ok());
    ASSERT_TRUE(reference_->causal_attention(caches.ref->view(), seq, 2, nq, rqb.get<float>(), rob.get<float>(), 0.125f).is_ok());
    EXPECT_LE(max_abs_diff(ob.download<float>(n), rob.download<float>(n)), tolerance(Op::kCausalAttention))
        << "num_queries " << nq;
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllBackends, BackendOpsTest,
    ::testing::Combine(::testing::ValuesIn(registered_backends()),
                       ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16)),
    [](const auto& info) { return std::get<0>(info.param) + "_" + name_of(std::get<1>(info.param)); });

}  // namespace
}  // namespace karakv::kernels::test
