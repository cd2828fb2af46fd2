// The fast path's SPSC ring (karakv/v1/ring.h): index arithmetic at the edges, wrap-around, a
// producer and a consumer on two threads, and the futex doorbell. Built twice: plainly, and with
// -fsanitize=thread (ring_spsc_tsan_test) so the memory ordering is checked by ThreadSanitizer.
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "karakv/v1/ring.h"

namespace karakv {
namespace {

struct Entry {
  uint64_t value;
  uint64_t check;  // ~value: a torn or stale read shows as a mismatch
};

struct TestRing {
  std::vector<Entry> slots = std::vector<Entry>(ring::kSlots);
  std::atomic<uint64_t> head{0}, tail{0};
  ring::Producer<Entry> producer{slots.data(), &tail, &head};
  ring::Consumer<Entry> consumer{slots.data(), &head, &tail};
};

TEST(Ring, EmptyPopsNothing) {
  TestRing r;
  Entry e{};
  EXPECT_EQ(r.consumer.depth(), 0);
  EXPECT_EQ(r.consumer.pop(&e), ring::PopResult::kEmpty);
  EXPECT_EQ(r.producer.room(), int64_t(ring::kSlots));
}

TEST(Ring, FullHasNoRoomAndKeepsOrder) {
  TestRing r;
  for (uint64_t i = 0; i < ring::kSlots; ++i) {
    ASSERT_GT(r.producer.room(), 0);
    r.producer.push({i, ~i});
  }
  EXPECT_EQ(r.producer.room(), 0);
  EXPECT_EQ(r.consumer.depth(), int64_t(ring::kSlots));
  Entry e{};
  ASSERT_EQ(r.consumer.pop(&e), ring::PopResult::kOk);
  EXPECT_EQ(e.value, 0u);
  EXPECT_EQ(r.producer.room(), 1);
}

TEST(Ring, WrapsAroundManyTimes) {
  TestRing r;
  uint64_t next_in = 0, next_out = 0;
  // Uneven batches so the indices cross the end of the slot array at every offset.
  for (int round = 0; round < 500; ++round) {
    const int batch = 1 + round % 7;
    for (int i = 0; i < batch && r.producer.room() > 0; ++i, ++next_in) r.producer.push({next_in, ~next_in});
    Entry e{};
    for (int i = 0; i < batch - round % 2; ++i) {
      if (r.consumer.pop(&e) != ring::PopResult::kOk) break;
      ASSERT_EQ(e.value, next_out++);
      ASSERT_EQ(e.check, ~e.value);
    }
  }
  Entry e{};
  while (r.consumer.pop(&e) == ring::PopResult::kOk) ASSERT_EQ(e.value, next_out++);
  EXPECT_EQ(next_out, next_in);
  EXPECT_GT(next_in, 4u * ring::kSlots);
}

TEST(Ring, ImpossibleIndicesAreCorrupt) {
  TestRing r;
  r.producer.push({1, ~1ull});
  // A tail more than a ring ahead, or behind the head, cannot come from an honest producer.
  r.tail.store(ring::kSlots + 5);
  Entry e{};
  EXPECT_EQ(r.consumer.pop(&e), ring::PopResult::kCorrupt);
  r.tail.store(1);
  ASSERT_EQ(r.consumer.pop(&e), ring::PopResult::kOk);
  r.tail.store(0);  // behind the consumer's own head
  EXPECT_EQ(r.consumer.pop(&e), ring::PopResult::kCorrupt);
  // The producer's view: a head ahead of its tail.
  r.head.store(1000);
  EXPECT_EQ(r.producer.room(), -1);
}

TEST(Ring, ConcurrentProducerAndConsumerSeeEveryEntryInOrder) {
  TestRing r;
  constexpr uint64_t kCount = 200000;
  std::thread producer([&] {
    for (uint64_t i = 0; i < kCount;) {
      if (r.producer.room() > 0) {
        r.producer.push({i, ~i});
        ++i;
      } else {
        std::this_thread::yield();
      }
    }
  });
  uint64_t expected = 0, bad = 0;
  Entry e{};
  while (expected < kCount) {
    const ring::PopResult p = r.consumer.pop(&e);
    ASSERT_NE(p, ring::PopResult::kCorrupt);
    if (p == ring::PopResult::kEmpty) {
      std::this_thread::yield();
      continue;
    }
    bad += e.value != expected || e.check != ~expected;
    ++expected;
  }
  producer.join();
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(r.consumer.depth(), 0);
}

TEST(Ring, FutexWaitTimesOutAndWakes) {
  std::atomic<uint32_t> word{7};
  // A stale expected value returns at once; the right one sleeps until the timeout.
  EXPECT_EQ(ring::futex_wait(&word, 6, 1'000'000'000), 0);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(ring::futex_wait(&word, 7, 20'000'000), ETIMEDOUT);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(15));
  std::thread waker([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    word.fetch_add(1);
    ring::futex_wake(&word);
  });
  int rc = ETIMEDOUT;
  while (word.load() == 7 && rc != 0) rc = ring::futex_wait(&word, 7, 5'000'000'000);
  waker.join();
  EXPECT_EQ(word.load(), 8u);
}

// The spin policy (ring.h): quick yields keep spinning; a slow one (another task took the CPU)
// opens a window without spinning that doubles with each slow yield up to 100 ms, and only a long
// run of quick yields brings it back to 1 ms.
TEST(SpinPolicy, SlowYieldsOpenDoublingWindowsThatOnlyALongQuickRunResets) {
  using P = ring::SpinPolicy;
  P p;
  const int64_t quick = 1'000, slow = 2'000'000;
  int64_t now = 1'000'000'000;
  EXPECT_TRUE(p.may_spin(now));
  EXPECT_TRUE(p.record(quick, now));
  EXPECT_TRUE(p.may_spin(now));
  EXPECT_FALSE(p.record(slow, now));
  EXPECT_FALSE(p.may_spin(now + P::kMinWindowNs - 1));
  EXPECT_TRUE(p.may_spin(now + P::kMinWindowNs));
  // Busy: slow yields keep coming, each window twice the last, capped.
  int64_t window = P::kMinWindowNs;
  for (int i = 0; i < 12; ++i) {
    now += window;
    window = std::min(P::kMaxWindowNs, window * 2);
    ASSERT_TRUE(p.may_spin(now));
    EXPECT_FALSE(p.record(slow, now));
    EXPECT_FALSE(p.may_spin(now + window - 1)) << i;
    EXPECT_TRUE(p.may_spin(now + window)) << i;
  }
  EXPECT_EQ(window, P::kMaxWindowNs);
  // Mostly quick yields with an odd slow one (EEVDF lets a yielder run on when the other task is
  // not eligible): the window stays long.
  now += window;
  for (int i = 0; i < P::kQuickYieldsToReset - 1; ++i) EXPECT_TRUE(p.record(quick, now));
  EXPECT_FALSE(p.record(slow, now));
  EXPECT_FALSE(p.may_spin(now + P::kMaxWindowNs - 1));
  // Quiet again: a thousand quick yields in a row, and the next slow one costs 1 ms.
  now += P::kMaxWindowNs;
  for (int i = 0; i < P::kQuickYieldsToReset; ++i) EXPECT_TRUE(p.record(quick, now));
  EXPECT_FALSE(p.record(slow, now));
  EXPECT_TRUE(p.may_spin(now + P::kMinWindowNs));
}

}  // namespace
}  // namespace karakv
