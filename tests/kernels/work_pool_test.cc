// The CPU backend's WorkPool (kernels/cpu/work_pool.h): every index of a loop runs exactly once,
// the caller finishes a loop alone when no helper is scheduled, a second caller never waits for
// the first one's loop, loops inside loops run on their thread, and each participating thread's
// done() runs once after its last chunk.
#include "cpu/work_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace karakv::kernels::cpu {
namespace {

using Clock = std::chrono::steady_clock;

TEST(WorkPoolTest, EveryIndexRunsExactlyOnce) {
  WorkPool pool(3);
  for (int64_t n : {1, 2, 7, 64, 1000, 4099}) {
    for (int64_t grain : {1, 3, 64, 5000}) {
      std::vector<std::atomic<int>> hits(n);
      std::atomic<int> done_calls{0}, chunks{0};
      std::mutex mu;
      std::set<std::thread::id> ran_on;
      pool.parallel_for(n, grain, [&](int64_t b, int64_t e) {
        ASSERT_LT(b, e);
        ASSERT_LE(e - b, grain);
        for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
        chunks.fetch_add(1);
        std::lock_guard<std::mutex> lock(mu);
        ran_on.insert(std::this_thread::get_id());
      }, true, [&] { done_calls.fetch_add(1); });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n " << n << " grain " << grain << " i " << i;
      EXPECT_EQ(chunks.load(), (n + grain - 1) / grain);
      EXPECT_EQ(done_calls.load(), int(ran_on.size())) << "one done() per thread that ran a chunk";
    }
  }
}

// No helper scheduled (held): the caller claims every chunk and returns; it never waits for them.
TEST(WorkPoolTest, TheCallerFinishesAloneWhenNoHelperIsScheduled) {
  WorkPool pool(4);
  pool.start();
  pool.hold_helpers(true);
  std::vector<int> hits(5000, 0);  // plain ints: only the caller may touch them
  const std::thread::id caller = std::this_thread::get_id();
  bool elsewhere = false;
  for (int rep = 0; rep < 20; ++rep) {
    pool.parallel_for(int64_t(hits.size()), 7, [&](int64_t b, int64_t e) {
      if (std::this_thread::get_id() != caller) elsewhere = true;
      for (int64_t i = b; i < e; ++i) ++hits[i];
    });
  }
  pool.hold_helpers(false);
  EXPECT_FALSE(elsewhere);
  for (int h : hits) ASSERT_EQ(h, 20);
  EXPECT_EQ(pool.chunks_by_helpers(), 0u);
  EXPECT_EQ(pool.chunks_by_callers(), 20u * ((5000 + 6) / 7));
  EXPECT_EQ(pool.helpers(), 3);
}

// Helpers that are scheduled do join: the caller's first chunk waits (up to 10 s) until some other
// thread has run a chunk, which only a helper can.
TEST(WorkPoolTest, ScheduledHelpersTakeChunks) {
  WorkPool pool(3);
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<int> by_others{0};
  pool.parallel_for(64, 1, [&](int64_t, int64_t) {
    if (std::this_thread::get_id() != caller) {
      by_others.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      return;
    }
    const auto until = Clock::now() + std::chrono::seconds(10);
    while (by_others.load() == 0 && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  EXPECT_GT(by_others.load(), 0);
  EXPECT_EQ(pool.chunks_by_helpers(), uint64_t(by_others.load()));
  EXPECT_EQ(pool.chunks_by_callers() + pool.chunks_by_helpers(), 64u);
}

// A second caller whose loop finds the helpers busy with another caller's runs on its own thread
// at once: here the first loop cannot end until the second has.
TEST(WorkPoolTest, ASecondCallerDoesNotWaitForTheFirstOnesLoop) {
  WorkPool pool(2);
  std::atomic<bool> second_done{false};
  std::atomic<int> first_started{0};
  std::thread first([&] {
    pool.parallel_for(2, 1, [&](int64_t, int64_t) {
      first_started.fetch_add(1);
      const auto until = Clock::now() + std::chrono::seconds(20);
      while (!second_done.load() && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
  });
  while (first_started.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const std::thread::id me = std::this_thread::get_id();
  int mine = 0, total = 0;
  pool.parallel_for(100, 1, [&](int64_t b, int64_t e) {
    total += int(e - b);
    if (std::this_thread::get_id() == me) mine += int(e - b);
  });
  second_done.store(true);
  first.join();
  EXPECT_EQ(total, 100);
  EXPECT_EQ(mine, 100);
}

// A loop inside a loop's body runs on that body's thread; the outer loop still covers everything.
TEST(WorkPoolTest, NestedLoopsRunOnTheirThread) {
  WorkPool pool(3);
  ScopedPool scope(&pool);
  std::vector<std::atomic<int>> hits(40 * 50);
  std::atomic<bool> crossed{false};
  parallel_for(40, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const std::thread::id outer = std::this_thread::get_id();
      EXPECT_TRUE(in_parallel_loop());
      parallel_for(50, 4, [&](int64_t ib, int64_t ie) {
        if (std::this_thread::get_id() != outer) crossed.store(true);
        for (int64_t j = ib; j < ie; ++j) hits[i * 50 + j].fetch_add(1);
      });
    }
  });
  EXPECT_FALSE(in_parallel_loop());
  EXPECT_FALSE(crossed.load());
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
}

// Without a pool (no ScopedPool), or with `parallel` false, a loop runs on the caller alone.
TEST(WorkPoolTest, NoPoolOrNotParallelRunsOnTheCaller) {
  EXPECT_EQ(pool_width(), 1);
  const std::thread::id me = std::this_thread::get_id();
  int n = 0, dones = 0;
  parallel_for(30, 4, [&](int64_t b, int64_t e) {
    EXPECT_EQ(std::this_thread::get_id(), me);
    n += int(e - b);
  }, true, [&] { ++dones; });
  EXPECT_EQ(n, 30);
  EXPECT_EQ(dones, 1);
  WorkPool pool(4);
  pool.parallel_for(1000, 1, [&](int64_t b, int64_t e) {
    EXPECT_EQ(std::this_thread::get_id(), me);
    n += int(e - b);
  }, false);
  EXPECT_EQ(n, 1030);
  EXPECT_EQ(pool.helpers(), 0);  // never started
}

}  // namespace
}  // namespace karakv::kernels::cpu
