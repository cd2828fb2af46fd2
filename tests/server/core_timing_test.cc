// The core's step timings behind the TTFT and decode-step histograms: TTFT is reported once
// per sequence, at the end of its first decode step, from its first Append; forks inherit none; a
// decode step is timed from its layer-0 Step. Lower bounds come from sleeps, never upper bounds.
#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/core.h"

namespace karakv::server {
namespace {

using std::chrono::milliseconds;

class RegistryTimingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CoreConfig c;
    c.geometry.num_layers = 2;
    c.geometry.num_q_heads = 2;
    c.geometry.num_kv_heads = 1;
    c.geometry.head_dim = 8;
    c.geometry.block_size = 4;
    c.geometry.dtype = kernels::DType::kFloat32;
    c.pool_bytes = 64 * c.geometry.block_bytes();
    auto r = Core::create(c, kernels::make_cpu_backend(1));
    ASSERT_TRUE(r.ok()) << r.status();
    reg_ = std::move(*r);
    auto a = reg_->attach("w", "t", 0, kernels::Geometry{});
    ASSERT_TRUE(a.ok());
    session_ = a->session_id;
  }

  uint64_t sequence_with_prompt(int tokens) {
    auto id = reg_->create_sequence(session_, SequenceOptions{});
    EXPECT_TRUE(id.ok()) << id.status();
    std::vector<uint8_t> kv(reg_->append_bytes(tokens), 0);
    EXPECT_TRUE(reg_->append(session_, *id, tokens, kv, kv).ok());
    return *id;
  }

  Core::StepResult step(int layer, const std::vector<uint64_t>& ids) {
    std::vector<uint8_t> kv(reg_->step_kv_bytes(ids.size()), 0);
    std::vector<uint8_t> q(reg_->q_bytes(ids.size()), 0), out(q.size());
    auto r = reg_->step(session_, layer, ids, kv, kv, q, MutableBytes(out), 0.0f);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : Core::StepResult{};
  }

  std::unique_ptr<Core> reg_;
  std::string session_;
};

TEST_F(RegistryTimingTest, FirstStepReportsTimeSinceFirstAppendOncePerSequence) {
  const uint64_t a = sequence_with_prompt(5);
  const uint64_t b = sequence_with_prompt(3);
  std::this_thread::sleep_for(milliseconds(30));
  Core::StepResult first = step(0, {a, b});
  EXPECT_TRUE(first.first_step_seconds.empty()) << "layer 0 does not complete a step";
  EXPECT_EQ(first.step_seconds, 0.0);
  std::this_thread::sleep_for(milliseconds(20));
  Core::StepResult last = step(1, {a, b});
  ASSERT_EQ(last.first_step_seconds.size(), 2u);
  for (double s : last.first_step_seconds) EXPECT_GE(s, 0.050);
  EXPECT_GE(last.step_seconds, 0.020) << "timed from the layer-0 Step, not from the last layer";
  EXPECT_LT(last.step_seconds, *std::min_element(last.first_step_seconds.begin(), last.first_step_seconds.end()));

  // Later steps: no TTFT, still a step time.
  step(0, {a, b});
  Core::StepResult second = step(1, {a, b});
  EXPECT_TRUE(second.first_step_seconds.empty());
  EXPECT_GT(second.step_seconds, 0.0);

  // A fork's first step is not a first token; a new sequence's is, even in a batch with old ones.
  auto child = reg_->fork_sequence(session_, a);
  ASSERT_TRUE(child.ok());
  const uint64_t c = sequence_with_prompt(2);
  step(0, {*child, c, b});
  Core::StepResult mixed = step(1, {*child, c, b});
  EXPECT_EQ(mixed.first_step_seconds.size(), 1u);
}

TEST_F(RegistryTimingTest, RestartedStepIsTimedFromItsNewLayerZero) {
  const uint64_t a = sequence_with_prompt(4);
  step(0, {a});
  std::this_thread::sleep_for(milliseconds(300));
  step(0, {a});  // the worker retries the step from layer 0
  Core::StepResult r = step(1, {a});
  ASSERT_EQ(r.first_step_seconds.size(), 1u);
  EXPECT_GE(r.first_step_seconds[0], 0.300);
  // Counting the abandoned attempt would make it at least the 300 ms slept.
  EXPECT_LT(r.step_seconds, 0.300) << "the abandoned attempt does not count";
}

}  // namespace
}  // namespace karakv::server
