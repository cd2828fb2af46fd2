// Compaction plans whose kept tokens do not end on a block boundary (docs/COMPRESSION.md, Kara's
// `grain`): every shape of such a plan, by a test-only policy that compacts a given range to a
// given count, each (layer, KV head) row keeping its own random slots. After the compaction every
// slot holds the K and V of the position the sequence reports for it, positions are the kept ones
// in order followed by everything after the range, the pool's invariants hold, the sequence holds
// exactly the blocks its tokens need, and decoding goes on from there. In place and into fresh
// blocks alike.
#include <algorithm>
#include <numeric>
#include <random>
#include <tuple>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core.h"
#include "server/policy.h"
#include "tests/server/core_driver.h"
#include "tests/server/delegating_backend.h"
#include "tests/server/test_geometry.h"

namespace karakv::server {
namespace {

constexpr char kName[] = "test_cut_range";

// Row r's kept slots of [begin, end): `keep` of them, a random sorted choice (seed + r).
std::vector<int32_t> row_choice(int begin, int end, int keep, int seed, int r) {
  std::vector<int32_t> slots(end - begin);
  std::iota(slots.begin(), slots.end(), begin);
  std::mt19937 rng(uint32_t(seed + r));
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(keep);
  std::sort(slots.begin(), slots.end());
  return slots;
}

// On Compact: slots [begin, end) keep `keep` of them per row (row_choice).
class CutRangePolicy final : public Policy {
 public:
  explicit CutRangePolicy(const PolicyParams& p)
      : begin_(p.geti("begin")), end_(p.geti("end")), keep_(p.geti("keep")), seed_(p.geti("seed")),
        merge_(p.geti("merge")) {}
  const std::string& name() const override { return name_; }
  Trigger trigger() const override { return Trigger::kThreshold; }
  std::vector<kernels::Op> required_ops() const override { return {kernels::Op::kGatherTokens}; }
  int merge_tokens() const override { return merge_; }
  bool due(const SequenceView& seq, bool forced) const override { return forced && seq.resident >= end_; }
  absl::StatusOr<CompactionPlan> plan(const SequenceView& seq, const kernels::PagedKV&,
                                      kernels::Backend&) const override {
    const kernels::Geometry& g = *seq.geometry;
    CompactionPlan plan;
    plan.begin = begin_;
    plan.end = end_;
    plan.num_kept = keep_;
    for (int r = 0; r < g.num_layers * g.num_kv_heads; ++r) {
      const std::vector<int32_t> slots = row_choice(begin_, end_, keep_, seed_, r);
      plan.kept.insert(plan.kept.end(), slots.begin(), slots.end());
    }
    return plan;
  }

 private:
  const std::string name_ = kName;
  const int begin_, end_, keep_, seed_, merge_;
};

std::vector<ParamSpec> cut_range_params(const kernels::Geometry&) {
  return {{"begin", 0, 0, 1 << 20, true, "first slot of the range (block-aligned)"},
          {"end", 1, 1, 1 << 20, true, "slot after the range"},
          {"keep", 1, 0, 1 << 20, true, "tokens the range keeps"},
          {"seed", 1, 0, 1 << 20, true, "the rows' random choices"},
          {"merge", 0, 0, 64, true, "CaM: the evicted values merged into this many kept tokens (0: none)"}};
}

absl::StatusOr<std::unique_ptr<Policy>> make_cut_range(const PolicyParams& p, const kernels::Geometry&) {
  return std::make_unique<CutRangePolicy>(p);
}

KARAKV_REGISTER_POLICY(kName, cut_range_params, make_cut_range);

struct Fixture {
  explicit Fixture(bool in_place, int pool_blocks = 64) {
    rc.geometry = testing::small_test_geometry(kernels::DType::kFloat16);  // L2 Hq4 Hk2 D8, block 4
    rc.pool_bytes = int64_t(pool_blocks) * rc.geometry.block_bytes();
    auto backend = kernels::make_cpu_backend(1);
    if (!in_place) backend = std::make_unique<karakv::testing::NoInPlaceBackend>(std::move(backend));
    core = *Core::create(rc, std::move(backend));
    session = core->attach("w", "t", 0, {})->session_id;
  }
  uint64_t create(int begin, int end, int keep, int seed, int merge = 0) {
    SequenceOptions o;
    o.policy = kName;
    o.params = {{"begin", begin}, {"end", end}, {"keep", keep}, {"seed", seed}, {"merge", merge}};
    return *core->create_sequence(session, o);
  }
  CoreConfig rc;
  std::unique_ptr<Core> core;
  std::string session;
};

TEST(CompactionShiftTest, EveryPlanShapeKeepsEachTokensKAndVAtItsSlot) {
  constexpr int kLength = 30;  // 7.5 blocks of 4
  // (begin, end, keep): what moves after the range.
  const std::vector<std::tuple<int, int, int, const char*>> cases = {
      {4, 16, 8, "whole blocks: nothing after the range moves"},
      {4, 14, 6, "the range ends inside a block and removes a whole block: the rest of that block moves"},
      {8, 29, 13, "the same, in the last block (part filled)"},
      {8, 23, 11, "the same, the range's kept tokens also ending inside a block"},
      {4, 14, 7, "removes 3: everything after the range moves"},
      {4, 16, 9, "an aligned range keeping part of a block: everything after it moves"},
      {0, 25, 1, "one kept token: everything after it moves"},
      {0, kLength, 13, "the range reaches the end: nothing after it"},
      {12, 13, 0, "a one-token range kept none of"},
  };
  for (const bool in_place : {true, false}) {
    for (const auto& [begin, end, keep, what] : cases) {
      SCOPED_TRACE(::testing::Message() << what << ": [" << begin << ", " << end << ") keeps " << keep
                                        << (in_place ? ", in place" : ", into fresh blocks"));
      Fixture f(in_place);
      Core* core = f.core.get();
      const std::string& session = f.session;
      const CoreConfig& rc = f.rc;
      const uint64_t seed = 7 + begin + end + keep;
      const uint64_t seq = f.create(begin, end, keep, int(seed));
      ASSERT_TRUE(testing::append_synthetic(*core, seed, session, seq, kLength).ok());
      const int32_t blocks_before = core->stats().blocks_used;
      auto r = core->compact(session, seq, false);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(r->front().tokens_after, kLength - (end - begin - keep)) << r->front().skipped;
      ASSERT_TRUE(core->check_invariants().ok()) << core->check_invariants();
      // Positions: [0, begin), each row's kept slots (slot s holds position s before), then [end, L).
      const auto inspected = core->inspect(seq);
      ASSERT_TRUE(inspected.ok());
      const int rows = rc.geometry.num_layers * rc.geometry.num_kv_heads;
      for (int row = 0; row < rows; ++row) {
        std::vector<int32_t> expected(begin);
        std::iota(expected.begin(), expected.end(), 0);
        const std::vector<int32_t> kept = row_choice(begin, end, keep, int(seed), row);
        expected.insert(expected.end(), kept.begin(), kept.end());
        for (int s = end; s < kLength; ++s) expected.push_back(s);
        ASSERT_EQ(inspected->second[row], expected) << "row " << row;
      }
      const int32_t length = kLength - (end - begin - keep);
      EXPECT_EQ(inspected->first.blocks, (length + 3) / 4);
      EXPECT_EQ(core->stats().blocks_used, (length + 3) / 4) << "before: " << blocks_before;
      EXPECT_EQ(testing::kv_mismatches(*core, session, seed, seq), 0);
      // Decoding goes on behind the moved tokens.
      for (int pos = kLength; pos < kLength + 6; ++pos) {
        ASSERT_TRUE(testing::step_synthetic(*core, seed, session, {seq}, pos).ok());
      }
      ASSERT_TRUE(core->check_invariants().ok()) << core->check_invariants();
      EXPECT_EQ(testing::kv_mismatches(*core, session, seed, seq), 0) << "after six decode steps";
      EXPECT_EQ(core->inspect(seq)->second[0].back(), kLength + 5);
    }
  }
}

// Moved in place, a cut needs no free block: with the pool full it still runs, and the blocks it
// frees go back. A fork sharing the blocks the move would write makes it gather into fresh blocks
// instead, and the fork's tokens stay as they were.
TEST(CompactionShiftTest, InPlaceNeedsNoFreeBlockAndNeverWritesAForksBlocks) {
  constexpr int kLength = 30;
  for (const auto& [begin, end, keep] : {std::tuple{4, 14, 6}, std::tuple{4, 14, 7}}) {
    SCOPED_TRACE(::testing::Message() << "[" << begin << ", " << end << ") keeps " << keep);
    {
      Fixture f(true, /*pool_blocks=*/8);  // the sequence's 8 blocks are the whole pool
      const uint64_t seq = f.create(begin, end, keep, 3);
      ASSERT_TRUE(testing::append_synthetic(*f.core, 3, f.session, seq, kLength).ok());
      ASSERT_EQ(f.core->stats().blocks_free, 0);
      auto r = f.core->compact(f.session, seq, false);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->front().tokens_after, kLength - (end - begin - keep));
      EXPECT_EQ(f.core->stats().blocks_free, 8 - (r->front().tokens_after + 3) / 4);
      EXPECT_EQ(testing::kv_mismatches(*f.core, f.session, 3, seq), 0);
    }
    Fixture f(true);
    const uint64_t seq = f.create(begin, end, keep, 5);
    ASSERT_TRUE(testing::append_synthetic(*f.core, 5, f.session, seq, kLength).ok());
    auto fork = f.core->fork_sequence(f.session, seq);
    ASSERT_TRUE(fork.ok()) << fork.status();
    ASSERT_TRUE(f.core->compact(f.session, seq, false).ok());
    ASSERT_TRUE(f.core->check_invariants().ok()) << f.core->check_invariants();
    EXPECT_EQ(testing::kv_mismatches(*f.core, f.session, 5, seq), 0);
    // The fork's tokens are the parent's (same synthetic sequence id), all still at their slots.
    const auto forked = f.core->inspect(*fork);
    ASSERT_TRUE(forked.ok());
    EXPECT_EQ(int(forked->second[0].size()), kLength);
    std::vector<uint8_t> fork_keys, parent_keys;
    const std::vector<uint8_t> fork_values = testing::read_values(*f.core, f.session, *fork, &fork_keys);
    Fixture g(true);
    const uint64_t twin = g.create(begin, end, keep, 5);
    ASSERT_EQ(twin, seq) << "the twin must draw the same synthetic tokens";
    ASSERT_TRUE(testing::append_synthetic(*g.core, 5, g.session, twin, kLength).ok());
    const std::vector<uint8_t> twin_values = testing::read_values(*g.core, g.session, twin, &parent_keys);
    EXPECT_TRUE(fork_keys == parent_keys) << "the compaction wrote the fork's K";
    EXPECT_TRUE(fork_values == twin_values) << "the compaction wrote the fork's V";
  }
}

// CaM merges into the range's kept tokens only: a plan that would move the tokens after the range
// is refused, naming why, and the sequence stays as it was.
TEST(CompactionShiftTest, CamRefusesACutInPartBlocksAndChangesNothing) {
  Fixture f(true);
  const uint64_t seq = f.create(4, 14, 7, 9, /*merge=*/2);
  ASSERT_TRUE(testing::append_synthetic(*f.core, 9, f.session, seq, 30).ok());
  const auto before = f.core->inspect(seq);
  auto r = f.core->compact(f.session, seq, false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("which CaM merging does not support"));
  EXPECT_EQ(f.core->inspect(seq)->second, before->second);
  EXPECT_EQ(testing::kv_mismatches(*f.core, f.session, 9, seq), 0);
  EXPECT_TRUE(f.core->check_invariants().ok());
}

}  // namespace
}  // namespace karakv::server
