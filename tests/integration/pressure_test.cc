// Pool pressure against a real karakvd: with --preempt_on_pressure a request of higher priority
// preempts a lower-priority sequence of another worker, whose event stream says so and whose later
// calls on it are FAILED_PRECONDITION; the stream survives to the SIGTERM drain, which still exits
// 0. Without the flag the full pool refuses and the other worker's stream gets no event before
// its session's end.
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "karakv/client.h"
#include "tests/integration/daemon.h"

namespace karakv {
namespace {

using ::testing::HasSubstr;
using testing::Daemon;

// 24 KiB blocks (3 layers x 2 KV heads x 32 x 16 tokens x K,V x fp32); the pool holds 4.
std::vector<std::string> flags(bool preempt) {
  std::vector<std::string> f = {"--layers=3", "--q_heads=6", "--kv_heads=2", "--head_dim=32", "--block_size=16",
                                "--dtype=fp32", "--pool_bytes=98304", "--check_invariants"};
  if (preempt) f.push_back("--preempt_on_pressure");
  return f;
}

ClientOptions as_tenant(const Daemon& d, const std::string& tenant) {
  ClientOptions o = d.options(1 << 20);
  o.tenant = tenant;
  o.worker_id = tenant;
  return o;
}

absl::StatusOr<int> append(Client& c, uint64_t seq, int tokens) {
  c.reset_staging();
  Buffer k = *c.alloc(c.append_bytes(tokens)), v = *c.alloc(c.append_bytes(tokens));
  return c.Append(seq, tokens, k, v);
}

TEST(PressureTest, PreemptedSequenceOwnerIsToldThroughTheEventStream) {
  int port = 0;
  auto started = testing::start_with_metrics(flags(true), &port);
  Daemon& d = *started;
  ASSERT_TRUE(d.ready());
  auto low_worker = Client::Attach(as_tenant(d, "batch"));
  auto high_worker = Client::Attach(as_tenant(d, "interactive"));
  ASSERT_TRUE(low_worker.ok() && high_worker.ok());
  Client& a = **low_worker;
  Client& b = **high_worker;
  auto events = a.WatchEvents();
  ASSERT_TRUE(events.ok()) << events.status();

  const uint64_t low = *a.CreateSequence("none", 0);
  ASSERT_EQ(*append(a, low, 48), 48);  // 3 of the 4 blocks
  const uint64_t high = *b.CreateSequence("none", 5);
  auto served = append(b, high, 32);   // 2 blocks, 1 free: low goes
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ(*served, 32);

  Event e;
  ASSERT_TRUE((*events)->Next(&e));
  EXPECT_EQ(e.kind, Event::Kind::kPreempted);
  EXPECT_EQ(e.number, 1u);
  EXPECT_EQ(e.sequence_id, low);
  EXPECT_EQ(e.priority, 0);
  EXPECT_EQ(e.blocks_freed, 3u);
  EXPECT_EQ(e.tokens_lost, 48u);
  EXPECT_THAT(e.reason, HasSubstr(absl::StrCat("sequence ", low, " (priority 0) was preempted to free blocks for a "
                                               "higher-priority request: appending 32 tokens to sequence ", high,
                                               " (priority 5) wanted 2 blocks, 1 free of 4")));

  // The owner's later calls on it say what happened.
  auto again = append(a, low, 16);
  ASSERT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("was preempted"));
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("re-prefill"));
  auto stats = b.Stats(true);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->preemptions, 1u);
  EXPECT_EQ(stats->invariant_error, "");
  EXPECT_EQ(stats->blocks_used, 2u);
  EXPECT_THAT(testing::http_get(port, "/metrics"), HasSubstr("\nkarakv_preemptions_total 1\n"));

  // SIGTERM with the stream still open: the daemon drains and exits 0; the stream ends UNAVAILABLE.
  EXPECT_EQ(d.stop(), 0);
  EXPECT_FALSE((*events)->Next(&e));
  EXPECT_EQ((*events)->Finish().code(), absl::StatusCode::kUnavailable);
}

TEST(PressureTest, WithoutTheFlagTheFullPoolRefusesAndPreemptsNothing) {
  Daemon d(flags(false));
  ASSERT_TRUE(d.ready());
  auto low_worker = Client::Attach(as_tenant(d, "batch"));
  auto high_worker = Client::Attach(as_tenant(d, "interactive"));
  ASSERT_TRUE(low_worker.ok() && high_worker.ok());
  Client& a = **low_worker;
  Client& b = **high_worker;
  auto events = a.WatchEvents();
  ASSERT_TRUE(events.ok());
  const uint64_t low = *a.CreateSequence("none", 0);
  ASSERT_EQ(*append(a, low, 48), 48);
  const uint64_t high = *b.CreateSequence("none", 5);
  auto refused = append(b, high, 32);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr(absl::StrCat("KV pool full: appending 32 tokens to sequence ", high,
                                     " wanted 2 blocks, 1 free of 4")));
  EXPECT_EQ(a.ListSequences()->at(0).length, 48u);
  EXPECT_EQ(b.Stats()->preemptions, 0u);

  // The stream's first event is the session's end: nothing was preempted before it.
  ASSERT_TRUE(a.Detach().ok());
  Event e;
  ASSERT_TRUE((*events)->Next(&e));
  EXPECT_EQ(e.kind, Event::Kind::kSessionEnded);
  EXPECT_EQ(e.number, 1u);
  EXPECT_FALSE(e.lease_expired);
  EXPECT_EQ(e.sequences_released, 1u);
  EXPECT_EQ(e.reason, "detached; the session's 1 sequences were freed");
  EXPECT_FALSE((*events)->Next(&e));
  EXPECT_TRUE((*events)->Finish().ok());

  // A stream needs a live session.
  auto late = a.WatchEvents();
  ASSERT_TRUE(late.ok());
  EXPECT_FALSE((*late)->Next(&e));
  const absl::Status s = (*late)->Finish();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()), HasSubstr("unknown session"));
  EXPECT_EQ(d.stop(), 0);
}

}  // namespace
}  // namespace karakv
