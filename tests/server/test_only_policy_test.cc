// A policy that exists only in this test binary, added the way every policy is: one file with a
// KARAKV_REGISTER_POLICY line, nothing else edited. It keeps per-sequence state (how many times it
// compacted the sequence) and stops after `max_runs`, so the test sees the state follow the
// sequence, a fork, and the scheduler. Also: the proto's and the Python SDK's lists of policy
// names equal the policy table's.
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/policy.h"
#include "tests/server/core_driver.h"
#include "test_geometry.h"

namespace karakv::server {
namespace {

constexpr char kName[] = "test_keep_newest";

struct RunsState final : PolicyState {
  int runs = 0;
  absl::StatusOr<std::unique_ptr<PolicyState>> clone() const override { return std::make_unique<RunsState>(*this); }
};

// At c_max keeps the newest c_target tokens (block-aligned by construction: whole cache).
class KeepNewestPolicy final : public Policy {
 public:
  explicit KeepNewestPolicy(const PolicyParams& p)
      : c_max_(p.geti("c_max")), c_target_(p.geti("c_target")), max_runs_(p.geti("max_runs")),
        fail_remap_(p.geti("fail_remap") == 1) {}
  const std::string& name() const override { return name_; }
  Trigger trigger() const override { return Trigger::kThreshold; }
  std::vector<kernels::Op> required_ops() const override { return {kernels::Op::kGatherTokens}; }
  std::unique_ptr<State> make_state(const kernels::Geometry&, kernels::Backend&) const override {
    return std::make_unique<RunsState>();
  }
  absl::Status on_compacted(State* state, const CompactionPlan&, int32_t, bool own) const override {
    if (fail_remap_) return absl::InternalError("test_keep_newest: fail_remap=1");
    if (own) ++static_cast<RunsState*>(state)->runs;
    return absl::OkStatus();
  }
  bool due(const SequenceView& seq, bool forced) const override {
    const int runs = seq.state != nullptr ? static_cast<const RunsState*>(seq.state)->runs : 0;
    return runs < max_runs_ && (forced ? seq.resident > c_target_ : seq.resident >= c_max_);
  }
  absl::StatusOr<CompactionPlan> plan(const SequenceView& seq, const kernels::PagedKV&,
                                      kernels::Backend&) const override {
    const kernels::Geometry& g = *seq.geometry;
    CompactionPlan plan;
    plan.begin = 0;
    plan.end = seq.resident;
    plan.num_kept = c_target_;
    for (int r = 0; r < g.num_layers * g.num_kv_heads; ++r) {
      for (int32_t s = seq.resident - c_target_; s < seq.resident; ++s) plan.kept.push_back(s);
    }
    return plan;
  }

 private:
  const std::string name_ = kName;
  const int c_max_, c_target_, max_runs_;
  const bool fail_remap_;
};

std::vector<ParamSpec> keep_newest_params(const kernels::Geometry&) {
  return {{"c_max", 16, 2, 1 << 20, true, "cache length that triggers it"},
          {"c_target", 8, 1, 1 << 20, true, "newest tokens kept"},
          {"max_runs", 1, 0, 100, true, "compactions per sequence at most"},
          {"fail_remap", 0, 0, 1, true, "1: every compaction fails after the gather (the state cannot be remapped)"}};
}

absl::StatusOr<std::unique_ptr<Policy>> make_keep_newest(const PolicyParams& p, const kernels::Geometry&) {
  return std::make_unique<KeepNewestPolicy>(p);
}

KARAKV_REGISTER_POLICY(kName, keep_newest_params, make_keep_newest);

class TestOnlyPolicyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CoreConfig rc;
    rc.geometry = testing::small_test_geometry(kernels::DType::kFloat32);  // L2 Hq4 Hk2 D8, block 4
    rc.pool_bytes = 64 * rc.geometry.block_bytes();
    core_ = *Core::create(rc, kernels::make_cpu_backend(1));
    session_ = core_->attach("w", "t", 0, {})->session_id;
  }
  SequenceInfo info(uint64_t id) { return core_->inspect(id)->first; }
  std::unique_ptr<Core> core_;
  std::string session_;
};

TEST_F(TestOnlyPolicyTest, RegisteredFromItsOwnFileAndKeepsItsStatePerSequence) {
  EXPECT_THAT(policy_names(), ::testing::Contains(kName));
  SequenceOptions o;
  o.policy = kName;
  o.params = {{"c_max", 16}, {"c_target", 8}, {"max_runs", 1}};
  const uint64_t a = *core_->create_sequence(session_, o);
  ASSERT_TRUE(testing::append_synthetic(*core_, 1, session_, a, 15).ok());
  ASSERT_TRUE(testing::step_synthetic(*core_, 1, session_, {a}, 15).ok());  // 16 tokens: compacts to 8
  EXPECT_EQ(info(a).length, 8);
  EXPECT_EQ(info(a).compactions, 1);
  // The newest 8 positions (8..15) stayed, for every (layer, head).
  const auto inspected = core_->inspect(a);
  ASSERT_TRUE(inspected.ok());
  for (const auto& row : inspected->second) EXPECT_THAT(row, ::testing::ElementsAre(8, 9, 10, 11, 12, 13, 14, 15));
  // Its state says it ran once: it grows past c_max again without compacting.
  for (int pos = 16; pos < 26; ++pos) ASSERT_TRUE(testing::step_synthetic(*core_, 1, session_, {a}, pos).ok());
  EXPECT_EQ(info(a).length, 18);
  EXPECT_EQ(info(a).compactions, 1);
  // A fork carries a copy of the state; a new sequence starts with its own.
  const uint64_t child = *core_->fork_sequence(session_, a);
  auto compacted = core_->compact(session_, child, false);
  ASSERT_TRUE(compacted.ok());
  EXPECT_EQ(compacted->front().skipped, "nothing to compact yet");
  const uint64_t b = *core_->create_sequence(session_, o);
  ASSERT_TRUE(testing::append_synthetic(*core_, 2, session_, b, 12).ok());
  compacted = core_->compact(session_, b, false);
  ASSERT_TRUE(compacted.ok());
  EXPECT_EQ(compacted->front().tokens_after, 8);
  EXPECT_TRUE(core_->check_invariants().ok());
}

// The names a client reads in the proto's and the Python SDK's documentation are the table's
// (test-only policies aside), so neither list goes stale when a policy file is added.
std::set<std::string> names_in(const std::string& path, const std::regex& pattern) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::smatch m;
  const std::string s = text.str();
  EXPECT_TRUE(std::regex_search(s, m, pattern)) << path << " has no policy list";
  std::set<std::string> names;
  for (absl::string_view n : absl::StrSplit(m[1].str(), ',')) {
    n = absl::StripAsciiWhitespace(n);
    absl::ConsumeSuffix(&n, " (default)");
    if (!n.empty()) names.insert(std::string(n));
  }
  return names;
}

TEST(PolicyNamesTest, ProtoAndPythonSdkListTheTablesPolicies) {
  std::set<std::string> table;
  for (const std::string& n : policy_names()) {
    if (!n.starts_with("test_")) table.insert(n);  // the test-only policies of this binary
  }
  const std::string root = KARAKV_SOURCE_DIR;
  EXPECT_EQ(names_in(root + "/proto/karakv/v1/karakv.proto", std::regex(R"(// Compression policy: ([a-z0-9_, ()]+)\n)")),
            table);
  EXPECT_EQ(names_in(root + "/client/python/karakv/client.py", std::regex(R"(compressed by `policy` \(([a-z0-9_, ]+);)")),
            table);
}

}  // namespace
}  // namespace karakv::server
