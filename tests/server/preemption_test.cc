// Pool pressure with --preempt_on_pressure: the request that does not fit preempts the sequences
// of lowest priority (least recently used among equals) until it fits, never one it serves and
// never one of its own priority or higher; when preempting cannot make it fit, it is refused and
// nothing changes. The owners of preempted sequences get an event; calls on a preempted sequence
// say so. Also the event queue's bound (a slow reader loses the oldest events, counted).
#include <vector>

#include "common/synthetic.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/events.h"
#include "server/core.h"
#include "tests/server/core_driver.h"
#include "tests/server/delegating_backend.h"
#include "tests/server/test_geometry.h"

namespace karakv::server {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kSeed = 23;
constexpr int kBlocks = 16;  // block_size 4: 64 tokens in all

class PreemptionTest : public ::testing::Test {
 protected:
  void make(bool preempt, std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend(1)) {
    CoreConfig c;
    c.geometry = testing::small_test_geometry(kernels::DType::kFloat32);
    c.pool_bytes = int64_t(kBlocks) * c.geometry.block_bytes();
    c.preempt_on_pressure = preempt;
    auto r = Core::create(c, std::move(backend));
    ASSERT_TRUE(r.ok()) << r.status();
    reg_ = std::move(*r);
    reg_->set_event_observer([this](const CoreEvent& e) { events_.push_back(e); });
  }

  std::string attach(const std::string& tenant) {
    auto a = reg_->attach("w", tenant, 0, kernels::Geometry{});
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? a->session_id : "";
  }

  uint64_t create(const std::string& session, int priority, const std::string& policy = "none") {
    SequenceOptions o;
    o.priority = priority;
    o.policy = policy;
    if (policy == "streaming") o.params = {{"c_max", 1000}, {"c_target", 8}};
    auto id = reg_->create_sequence(session, o);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : 0;
  }

  absl::StatusOr<int32_t> append(const std::string& session, uint64_t seq, int n) {
    return testing::append_synthetic(*reg_, kSeed, session, seq, n);
  }

  absl::Status step(const std::string& session, const std::vector<uint64_t>& ids, int64_t pos) {
    return testing::step_synthetic(*reg_, kSeed, session, ids, pos);
  }

  std::string state() {
    EXPECT_TRUE(reg_->check_invariants().ok()) << reg_->check_invariants();
    CoreStats st = reg_->stats();
    std::string s = absl::StrCat("used=", st.blocks_used, " free=", st.blocks_free, " tokens=", st.resident_tokens,
                                 " sequences=", st.sequences, " preemptions=", st.preemptions);
    for (const auto& i : reg_->list_sequences("")) absl::StrAppend(&s, " [", i.id, " len=", i.length, "]");
    return s;
  }

  std::vector<CoreEvent> preempted() const {
    std::vector<CoreEvent> out;
    for (const auto& e : events_) {
      if (e.kind == CoreEvent::Kind::kPreempted) out.push_back(e);
    }
    return out;
  }

  std::unique_ptr<Core> reg_;
  std::vector<CoreEvent> events_;
};

TEST_F(PreemptionTest, PreemptsTheLowestPriorityLeastRecentlyUsedAndServesTheRequest) {
  make(true);
  const std::string a = attach("ta"), b = attach("tb"), c = attach("tc");
  const uint64_t low_a = create(a, 0), low_b = create(b, 0), mid = create(b, 5), high = create(c, 10);
  ASSERT_EQ(*append(a, low_a, 8), 8);
  ASSERT_EQ(*append(b, low_b, 16), 16);
  ASSERT_EQ(*append(a, low_a, 8), 16);  // low_a is now the more recently used of the two
  ASSERT_EQ(*append(b, mid, 16), 16);
  ASSERT_EQ(*append(c, high, 16), 16);
  ASSERT_EQ(reg_->stats().blocks_free, 0);

  auto r = append(c, high, 4);  // one block more: low_b goes
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, 20);
  ASSERT_EQ(preempted().size(), 1u);
  const CoreEvent e = preempted()[0];
  EXPECT_EQ(e.session_id, b);
  EXPECT_EQ(e.sequence_id, low_b);
  EXPECT_EQ(e.priority, 0);
  EXPECT_EQ(e.blocks_freed, 4);
  EXPECT_EQ(e.tokens, 16);
  EXPECT_THAT(e.message, HasSubstr(absl::StrCat("sequence ", low_b, " (priority 0) was preempted to free blocks for a "
                                                "higher-priority request: appending 4 tokens to sequence ",
                                                high, " (priority 10) wanted 1 blocks, 0 free of 16")));
  EXPECT_THAT(e.message, HasSubstr("re-prefill"));
  const CoreStats st = reg_->stats();
  EXPECT_EQ(st.preemptions, 1u);
  EXPECT_EQ(st.blocks_free, 3);
  EXPECT_EQ(st.sequences, 3);
  EXPECT_TRUE(reg_->check_invariants().ok()) << reg_->check_invariants();

  // Calls on the preempted sequence say what happened; another tenant still gets PERMISSION_DENIED.
  auto again = append(b, low_b, 4);
  ASSERT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
  EXPECT_EQ(again.status().message(), e.message);
  EXPECT_EQ(reg_->fork_sequence(b, low_b).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(append(a, low_b, 4).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(reg_->release_sequence(a, low_b).status().code(), absl::StatusCode::kPermissionDenied);
  // Releasing it acknowledges the preemption; then it is unknown.
  auto released = reg_->release_sequence(b, low_b);
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(*released, 0);
  EXPECT_EQ(append(b, low_b, 4).status().code(), absl::StatusCode::kNotFound);
  // The other sequences are intact.
  EXPECT_EQ(reg_->list_sequences(a)[0].length, 16);
  EXPECT_TRUE(reg_->check_invariants().ok());
}

TEST_F(PreemptionTest, RefusesAndChangesNothingWhenPreemptingCannotMakeItFit) {
  make(true);
  const std::string a = attach("ta"), c = attach("tc");
  const uint64_t low = create(a, 0), peer = create(a, 10), high = create(c, 10);
  ASSERT_TRUE(append(a, low, 16).ok());
  ASSERT_TRUE(append(a, peer, 16).ok());
  ASSERT_TRUE(append(c, high, 32).ok());
  const std::string before = state();
  // 8 blocks wanted; only low (4 blocks) has a lower priority: peer, of equal priority, is never taken.
  auto r = append(c, high, 32);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(r.status().message(),
            absl::StrCat("KV pool full: appending 32 tokens to sequence ", high,
                         " wanted 8 blocks, 0 free of 16; preempting every sequence of lower priority than 10 (1) "
                         "would make only 4 available (karakvd --preempt_on_pressure)"));
  EXPECT_EQ(state(), before);
  EXPECT_TRUE(preempted().empty());
  // A request of the lowest priority preempts nothing.
  auto lowest = append(a, low, 4);
  ASSERT_EQ(lowest.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(lowest.status().message()), HasSubstr("lower priority than 0 (0) would make only 0"));
  EXPECT_EQ(state(), before);
}

TEST_F(PreemptionTest, OffByDefaultTheFullPoolRefuses) {
  make(false);
  const std::string a = attach("ta"), c = attach("tc");
  const uint64_t low = create(a, 0), high = create(c, 10);
  ASSERT_TRUE(append(a, low, 32).ok());
  ASSERT_TRUE(append(c, high, 32).ok());
  const std::string before = state();
  auto r = append(c, high, 4);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(r.status().message(),
            absl::StrCat("KV pool full: appending 4 tokens to sequence ", high, " wanted 1 blocks, 0 free of 16"));
  EXPECT_EQ(state(), before);
  EXPECT_TRUE(preempted().empty());
}

TEST_F(PreemptionTest, StepNeverPreemptsItsOwnBatchAndCountsSharedBlocksOnce) {
  make(true);
  const std::string a = attach("ta"), b = attach("tb");
  // The batch: high (10) and low_in_batch (0), each at a block boundary, so the Step wants 2 blocks.
  const uint64_t high = create(a, 10), low_in_batch = create(a, 0);
  ASSERT_TRUE(append(a, high, 16).ok());
  ASSERT_TRUE(append(a, low_in_batch, 16).ok());
  // Outside it: a priority-0 parent and its fork share 4 blocks (so one alone frees nothing), and
  // a priority-1 sequence of 4 blocks.
  const uint64_t parent = create(b, 0);
  ASSERT_TRUE(append(b, parent, 16).ok());
  auto child = reg_->fork_sequence(b, parent);
  ASSERT_TRUE(child.ok());
  const uint64_t one = create(b, 1);
  ASSERT_TRUE(append(b, one, 16).ok());
  ASSERT_EQ(reg_->stats().blocks_free, 0);
  // Lowest first: parent (frees nothing, its fork still holds the blocks), then child (frees 4).
  // low_in_batch has priority 0 too but is served; `one` is not needed.
  ASSERT_TRUE(step(a, {high, low_in_batch}, 16).ok());
  ASSERT_EQ(preempted().size(), 2u);
  EXPECT_EQ(preempted()[0].sequence_id, parent);
  EXPECT_EQ(preempted()[0].blocks_freed, 0);
  EXPECT_EQ(preempted()[1].sequence_id, *child);
  EXPECT_EQ(preempted()[1].blocks_freed, 4);
  EXPECT_THAT(preempted()[1].message, HasSubstr("Step over 2 sequences (priority 10) wanted 2 blocks, 0 free of 16"));
  const CoreStats st = reg_->stats();
  EXPECT_EQ(st.blocks_free, 2);
  EXPECT_EQ(st.preemptions, 2u);
  std::vector<uint64_t> live;
  for (const auto& i : reg_->list_sequences("")) live.push_back(i.id);
  EXPECT_THAT(live, ::testing::UnorderedElementsAre(high, low_in_batch, one));
  EXPECT_TRUE(reg_->check_invariants().ok()) << reg_->check_invariants();
}

// The CPU backend whose gathers (what applying a compaction's plan runs) fail, as a device kernel
// that faulted would, while `fail` is set.
class FailingGather : public karakv::testing::DelegatingBackend {
 public:
  using DelegatingBackend::DelegatingBackend;
  bool fail = false;
  KernelStatus gather_tokens(const PagedKV& kv, int seq, const int32_t* kept, int num_kept,
                             const int32_t* dst_blocks) override {
    if (fail) return {KernelStatus::Code::kInternal, "gather_tokens: injected device fault"};
    return DelegatingBackend::gather_tokens(kv, seq, kept, num_kept, dst_blocks);
  }
  KernelStatus gather_tokens_in_place(const PagedKV& kv, int seq, int begin, const int32_t* kept,
                                      int num_kept) override {
    if (fail) return {KernelStatus::Code::kInternal, "gather_tokens_in_place: injected device fault"};
    return DelegatingBackend::gather_tokens_in_place(kv, seq, begin, kept, num_kept);
  }
};

// A compaction whose kernel fails is an event of the sequence's session naming the op: the one the
// scheduler runs after a Step (whose reply is OK and says nothing of it) and the one Compact asks
// for (whose reply carries the error too). The sequence stays usable and compacts once the kernel
// works again.
TEST_F(PreemptionTest, AFailedCompactionIsAnEventNamingTheKernel) {
  auto backend = std::make_unique<FailingGather>(kernels::make_cpu_backend(1));
  FailingGather* gather = backend.get();
  make(false, std::move(backend));
  const std::string a = attach("ta");
  SequenceOptions o;
  o.policy = "streaming";
  o.params = {{"c_max", 24}, {"c_target", 8}};
  auto seq = reg_->create_sequence(a, o);
  ASSERT_TRUE(seq.ok()) << seq.status();
  ASSERT_TRUE(append(a, *seq, 20).ok());
  gather->fail = true;
  for (int64_t pos = 20; pos < 26; ++pos) ASSERT_TRUE(step(a, {*seq}, pos).ok()) << "step at " << pos;
  ASSERT_FALSE(events_.empty());
  for (const CoreEvent& e : events_) {
    EXPECT_EQ(e.kind, CoreEvent::Kind::kCompactionFailed);
    EXPECT_EQ(e.session_id, a);
    EXPECT_EQ(e.sequence_id, *seq);
    EXPECT_EQ(e.policy, "streaming");
    EXPECT_THAT(e.message, HasSubstr("INTERNAL"));
    EXPECT_THAT(e.message, HasSubstr("injected device fault"));
  }
  const size_t after_steps = events_.size();
  auto compacted = reg_->compact(a, *seq, false);
  EXPECT_FALSE(compacted.ok());
  ASSERT_EQ(events_.size(), after_steps + 1);
  EXPECT_EQ(events_.back().kind, CoreEvent::Kind::kCompactionFailed);
  EXPECT_THAT(events_.back().message, HasSubstr(std::string(compacted.status().message())));
  // The published form (WatchEvents) carries the same.
  const v1::Event published = to_event(events_.back());
  ASSERT_TRUE(published.has_compaction_failed());
  EXPECT_EQ(published.compaction_failed().sequence_id(), *seq);
  EXPECT_EQ(published.compaction_failed().policy(), "streaming");
  EXPECT_EQ(published.compaction_failed().reason(), events_.back().message);
  EXPECT_TRUE(reg_->check_invariants().ok()) << reg_->check_invariants();

  gather->fail = false;
  compacted = reg_->compact(a, *seq, false);
  ASSERT_TRUE(compacted.ok()) << compacted.status();
  EXPECT_EQ(events_.back().kind, CoreEvent::Kind::kCompaction);
  EXPECT_EQ(events_.back().tokens_after, 8);
  EXPECT_TRUE(reg_->check_invariants().ok()) << reg_->check_invariants();
}

TEST_F(PreemptionTest, CompactionsAndSessionEndsAreEvents) {
  make(false);
  const std::string a = attach("ta"), b = attach("tb");
  const uint64_t seq = create(a, 0, "streaming");
  ASSERT_TRUE(append(a, seq, 20).ok());
  ASSERT_TRUE(reg_->compact(a, seq, true).ok());  // a dry run is no event
  EXPECT_TRUE(events_.empty());
  ASSERT_TRUE(reg_->compact(a, seq, false).ok());
  ASSERT_EQ(events_.size(), 1u);
  EXPECT_EQ(events_[0].kind, CoreEvent::Kind::kCompaction);
  EXPECT_EQ(events_[0].session_id, a);
  EXPECT_EQ(events_[0].sequence_id, seq);
  EXPECT_EQ(events_[0].policy, "streaming");
  EXPECT_EQ(events_[0].tokens_before, 20);
  EXPECT_EQ(events_[0].tokens_after, 8);
  ASSERT_TRUE(reg_->detach(a).ok());
  ASSERT_EQ(events_.size(), 2u);
  EXPECT_EQ(events_[1].kind, CoreEvent::Kind::kSessionEnded);
  EXPECT_EQ(events_[1].session_id, a);
  EXPECT_FALSE(events_[1].lease_expired);
  EXPECT_EQ(events_[1].sequences_released, 1);
  create(b, 0);
  EXPECT_EQ(reg_->expire_leases(absl::Now() + absl::Hours(1)), 1);
  ASSERT_EQ(events_.size(), 3u);
  EXPECT_EQ(events_[2].session_id, b);
  EXPECT_TRUE(events_[2].lease_expired);
  EXPECT_EQ(events_[2].message, "lease expired: no Heartbeat for 30s; the session's 1 sequences and staging were freed");
}

TEST(EventQueueTest, ASlowReaderLosesTheOldestEventsAndIsToldHowMany) {
  EventQueue q(4);
  for (int i = 0; i < 10; ++i) {
    v1::Event e;
    e.mutable_compaction()->set_sequence_id(100 + i);
    q.push(e);
  }
  EXPECT_EQ(q.size(), 4u);
  EXPECT_EQ(q.dropped_total(), 6u);
  auto marker = q.pop();
  ASSERT_TRUE(marker.has_value());
  ASSERT_TRUE(marker->has_dropped());
  EXPECT_EQ(marker->dropped().count(), 6u);
  EXPECT_EQ(marker->number(), 0u);
  for (int i = 6; i < 10; ++i) {
    auto e = q.pop();
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->number(), uint64_t(i + 1));
    EXPECT_EQ(e->compaction().sequence_id(), uint64_t(100 + i));
  }
  EXPECT_FALSE(q.pop().has_value());
  // A loss after that is announced again, with its own count.
  for (int i = 0; i < 5; ++i) q.push(v1::Event());
  EXPECT_EQ(q.pop()->dropped().count(), 1u);
  EXPECT_EQ(q.pop()->number(), 12u);
}

}  // namespace
}  // namespace karakv::server
