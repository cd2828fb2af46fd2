// ScoreRows against a plain host model: [rows][slots] vectors that grow with zeros, remap as the
// compactor's plans say, and copy on fork. Backend memory here is the CPU backend's allocate(); the
// kernel tests check that a GPU adds into such memory as the CPU does.
#include "server/score_rows.h"

#include <random>

#include "gtest/gtest.h"
#include "server/policy.h"
#include "tests/server/delegating_backend.h"

namespace karakv::server {
namespace {

using Model = std::vector<std::vector<float>>;

// Adds a value to every slot of every row, in backend memory (as a decode step would) and in the model.
void add_everywhere(const ScoreRows& s, Model& model, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (size_t r = 0; r < model.size(); ++r) {
    for (size_t i = 0; i < model[r].size(); ++i) {
      const float x = u(rng);
      s.row(r)[i] += x;
      model[r][i] += x;
    }
  }
}

std::vector<float> flat(const Model& model) {
  std::vector<float> out;
  for (const auto& row : model) out.insert(out.end(), row.begin(), row.end());
  return out;
}

// Every slot past the length reads zero: what a decode step's new slot starts from.
void expect_zero_past_length(const ScoreRows& s) {
  for (size_t r = 0; r < s.rows(); ++r)
    for (int32_t i = s.length(); i < s.capacity(); ++i) ASSERT_EQ(s.row(r)[i], 0.0f) << "row " << r << " slot " << i;
}

TEST(ScoreRowsTest, GrowRemapAndCloneMatchAHostModel) {
  auto backend = kernels::make_cpu_backend(1);
  constexpr size_t kRows = 3;
  std::mt19937 rng(7);
  ScoreRows s(*backend, kRows);
  EXPECT_EQ(s.row(0), nullptr);
  EXPECT_EQ(s.bytes(), 0u);
  Model model(kRows);
  std::vector<float> got;
  // Growth one slot at a time (decode steps) and in jumps (Appends), across two reallocations.
  for (int32_t slots : {5, 6, 7, 200, 256, 257, 258, 600}) {
    ASSERT_TRUE(s.grow(slots).ok());
    for (auto& row : model) row.resize(slots, 0.0f);
    ASSERT_EQ(s.length(), slots);
    ASSERT_GE(s.capacity(), slots);
    ASSERT_EQ(s.capacity() % ScoreRows::kSlotGranule, 0);
    add_everywhere(s, model, rng);
    ASSERT_TRUE(s.read(slots, &got).ok());
    ASSERT_EQ(got, flat(model)) << "after growing to " << slots;
    expect_zero_past_length(s);
  }
  // 5 -> one granule; 257 -> twice 256; 600 -> twice 512.
  EXPECT_EQ(s.capacity(), 1024);
  EXPECT_EQ(s.bytes(), kRows * 1024 * sizeof(float));

  // A compaction of slots [8, 520) keeping 4 per row (different slots per row), the rest shifting down.
  CompactionPlan plan;
  plan.begin = 8;
  plan.end = 520;
  plan.num_kept = 4;
  plan.kept = {9, 100, 300, 519, 8, 9, 10, 11, 400, 401, 515, 516};
  ASSERT_TRUE(s.remap(plan, 600).ok());
  for (size_t r = 0; r < kRows; ++r) {
    std::vector<float> next(model[r].begin(), model[r].begin() + 8);
    for (int i = 0; i < 4; ++i) next.push_back(model[r][plan.kept[r * 4 + i]]);
    next.insert(next.end(), model[r].begin() + 520, model[r].end());
    model[r] = next;
  }
  ASSERT_EQ(s.length(), 8 + 4 + 80);
  ASSERT_TRUE(s.read(s.length(), &got).ok());
  EXPECT_EQ(got, flat(model));
  expect_zero_past_length(s);  // the old sums past the new length are gone

  // A fork's copy is its own: adding to one leaves the other as it was.
  auto copy = s.clone();
  ASSERT_TRUE(copy.ok()) << copy.status();
  ASSERT_NE((*copy)->row(0), s.row(0));
  Model copy_model = model;
  add_everywhere(**copy, copy_model, rng);
  ASSERT_TRUE(s.read(s.length(), &got).ok());
  EXPECT_EQ(got, flat(model));
  ASSERT_TRUE((*copy)->read((*copy)->length(), &got).ok());
  EXPECT_EQ(got, flat(copy_model));
  EXPECT_EQ((*copy)->bytes(), s.bytes());

  // A plan or a read that does not fit the rows is a bug, refused without a change.
  CompactionPlan bad = plan;
  bad.kept.pop_back();
  EXPECT_EQ(s.remap(bad, s.length()).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(s.remap(plan, s.length() + 1).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(s.read(s.length() + 1, &got).code(), absl::StatusCode::kInternal);
  ASSERT_TRUE(s.read(s.length(), &got).ok());
  EXPECT_EQ(got, flat(model));
}

// The CPU backend with allocate() or copy_out failing on demand.
class FailingBackend : public karakv::testing::DelegatingBackend {
 public:
  FailingBackend() : DelegatingBackend(kernels::make_cpu_backend(1)) {}
  kernels::KernelStatus allocate(size_t bytes, void** out) override {
    if (fail_allocate) return {kernels::KernelStatus::Code::kInternal, "no memory"};
    return DelegatingBackend::allocate(bytes, out);
  }
  kernels::KernelStatus copy_out(void* dst, const void* src, size_t bytes) override {
    if (fail_copy_out) return {kernels::KernelStatus::Code::kInternal, "copy failed"};
    return DelegatingBackend::copy_out(dst, src, bytes);
  }
  bool fail_allocate = false, fail_copy_out = false;
};

// A growth that cannot have its memory, or cannot read the old sums, changes nothing; a remap whose
// read fails still follows the compacted cache (length moved, sums zero) and says why.
TEST(ScoreRowsTest, FailuresKeepTheRowsConsistent) {
  FailingBackend backend;
  constexpr size_t kRows = 2;
  std::mt19937 rng(3);
  ScoreRows s(backend, kRows);
  Model model(kRows, std::vector<float>(100, 0.0f));
  ASSERT_TRUE(s.grow(100).ok());
  add_everywhere(s, model, rng);
  std::vector<float> got;
  for (const bool allocate : {true, false}) {
    backend.fail_allocate = allocate;
    backend.fail_copy_out = !allocate;
    const absl::Status st = s.grow(300);
    EXPECT_FALSE(st.ok());
    if (allocate) {
      EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    }
    backend.fail_allocate = backend.fail_copy_out = false;
    EXPECT_EQ(s.length(), 100);
    EXPECT_EQ(s.capacity(), 256);
    ASSERT_TRUE(s.read(100, &got).ok());
    EXPECT_EQ(got, flat(model)) << (allocate ? "failed allocate" : "failed copy_out");
  }
  CompactionPlan plan;
  plan.begin = 0;
  plan.end = 96;
  plan.num_kept = 4;
  plan.kept = {0, 1, 2, 3, 92, 93, 94, 95};
  backend.fail_copy_out = true;
  EXPECT_EQ(s.remap(plan, 100).code(), absl::StatusCode::kInternal);
  backend.fail_copy_out = false;
  EXPECT_EQ(s.length(), 8);
  ASSERT_TRUE(s.read(8, &got).ok());
  EXPECT_EQ(got, std::vector<float>(kRows * 8, 0.0f));
  expect_zero_past_length(s);
}

// A state that never grew holds nothing and copies to nothing.
TEST(ScoreRowsTest, EmptyRowsCloneAndReadNothing) {
  auto backend = kernels::make_cpu_backend(1);
  ScoreRows s(*backend, 4);
  std::vector<float> got{1.0f};
  ASSERT_TRUE(s.read(0, &got).ok());
  EXPECT_TRUE(got.empty());
  auto copy = s.clone();
  ASSERT_TRUE(copy.ok());
  EXPECT_EQ((*copy)->row(0), nullptr);
  ASSERT_TRUE(s.grow(0).ok());
  EXPECT_EQ(s.bytes(), 0u);
}

}  // namespace
}  // namespace karakv::server
