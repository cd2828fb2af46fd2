// The CUDA backend's geometry limits (kernels/cuda/cuda_limits.h): a plain C++ check, run on every
// machine, that the daemon applies to its geometry when it picks the backend; and, where a GPU
// works, the backend refusing the same geometry on each call in the same words (skipped as
// "no device" elsewhere).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cuda/cuda_limits.h"
#include "kernel_test_util.h"

namespace karakv::kernels::test {
namespace {

Geometry geometry_with_head_dim(int head_dim) {
  Geometry g;
  g.num_layers = 2;
  g.num_q_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = head_dim;
  g.block_size = 16;
  g.dtype = DType::kFloat16;
  return g;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(CudaLimitsTest, HeadDimUpToTheLimitIsAccepted) {
  EXPECT_EQ(cuda::kMaxHeadDim, 256);
  for (int head_dim : {8, 64, 96, 128, 200, cuda::kMaxHeadDim}) {
    const KernelStatus st = cuda::check_geometry(geometry_with_head_dim(head_dim));
    EXPECT_TRUE(st.is_ok()) << "head_dim " << head_dim << ": " << st.message;
  }
}

TEST(CudaLimitsTest, HeadDimOverTheLimitIsRefusedNamingTheValueAndTheLimit) {
  for (int head_dim : {cuda::kMaxHeadDim + 1, 512}) {
    const KernelStatus st = cuda::check_geometry(geometry_with_head_dim(head_dim));
    EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument) << head_dim;
    EXPECT_TRUE(contains(st.message, "head_dim " + std::to_string(head_dim))) << st.message;
    EXPECT_TRUE(contains(st.message, "limit of 256")) << st.message;
  }
}

// What the start-up check promises: the calls it saves the daemon from are refused by the backend
// with the same reason, naming the op.
TEST(CudaLimitsTest, TheCudaBackendRefusesTheSameGeometryOnEachCall) {
  std::string why;
  std::unique_ptr<Backend> backend = make_cuda_backend(0, &why);
  if (backend == nullptr) GTEST_SKIP() << "no device: backend cuda: " << why;
  const Geometry g = geometry_with_head_dim(512);
  const std::string reason = cuda::check_geometry(g).message;
  ASSERT_FALSE(reason.empty());
  std::mt19937 rng(3);
  PagedCache cache(*backend, g, {16}, rng);
  cache.set_seq_len(0, 16);
  const PagedKV kv = cache.view();
  std::vector<float> q(g.q_token_elems(), 0.5f), out(g.q_token_elems(), 0.0f);

  KernelStatus st = backend->decode_attention(kv, 0, q.data(), out.data(), 1.0f);
  EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument) << st.message;
  EXPECT_EQ(st.message, "decode_attention: " + reason + " (use --backend=cpu)");
  st = backend->causal_attention(kv, 0, 0, 1, q.data(), out.data(), 1.0f);
  EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument) << st.message;
  EXPECT_EQ(st.message, "causal_attention: " + reason + " (use --backend=cpu)");
}

}  // namespace
}  // namespace karakv::kernels::test
