// The heap figures karakvd reports (Stats, /metrics) follow this process's own malloc.
#include "server/heap_usage.h"

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace karakv::server {
namespace {

TEST(HeapUsageTest, FollowsAllocationsAndFrees) {
  const HeapUsage before = read_heap_usage();
  if (!before.glibc) GTEST_SKIP() << "glibc's malloc is not the allocator in use (a sanitizer's or a preloaded one)";
  EXPECT_GT(before.in_use_bytes, 0u);
  EXPECT_LE(before.in_use_bytes, before.held_bytes);
  // 200 chunks of 64 KiB: below glibc's mmap threshold, so they come from an arena.
  constexpr size_t kChunk = 64 << 10, kCount = 200;
  void* chunks[kCount];
  for (void*& c : chunks) {
    c = std::malloc(kChunk);
    ASSERT_NE(c, nullptr);
    std::memset(c, 1, kChunk);
  }
  // One chunk large enough to be mmapped on its own.
  void* big = std::malloc(32 << 20);
  ASSERT_NE(big, nullptr);
  const HeapUsage during = read_heap_usage();
  EXPECT_GE(during.in_use_bytes, before.in_use_bytes + kChunk * kCount + (32 << 20));
  EXPECT_LE(during.in_use_bytes, during.held_bytes);
  std::free(big);
  for (void* c : chunks) std::free(c);
  const HeapUsage after = read_heap_usage();
  EXPECT_LE(after.in_use_bytes + kChunk * kCount + (32 << 20), during.in_use_bytes);
}

// Caps the arenas at `cap` (0: glibc's default), lets 8 threads allocate at once, and returns how
// many arenas malloc_info lists (-1 when the cap was refused). The cap is process-wide and one-way,
// so the tests below run this in a process of its own.
int arenas_after_8_threads(int cap) {
  if (!limit_malloc_arenas(cap)) return -1;
  std::vector<std::thread> threads;
  std::atomic<int> ready{0};
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      void* p = std::malloc(1000);
      ready.fetch_add(1);
      while (ready.load() < 8) std::this_thread::yield();  // all eight alive at once
      std::free(p);
    });
  }
  for (auto& t : threads) t.join();
  char* text = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&text, &size);
  malloc_info(0, f);
  std::fclose(f);
  int n = 0;
  for (const char* at = text; (at = std::strstr(at, "<heap nr=")) != nullptr; ++at) ++n;
  std::free(text);
  return n;
}

TEST(HeapUsageDeathTest, ArenaCapLimitsTheArenasThreadsGet) {
  if (!read_heap_usage().glibc) GTEST_SKIP() << "glibc's malloc is not the allocator in use";
  // "threadsafe" runs each statement in a freshly started copy of this binary: no arenas yet
  // beyond the main one.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(_exit(arenas_after_8_threads(1)), ::testing::ExitedWithCode(1), "");
  EXPECT_EXIT(_exit(std::min(arenas_after_8_threads(2), 3)), ::testing::ExitedWithCode(2), "");
  // The same threads without a cap get arenas of their own (glibc allows 8 per core; how many it
  // makes for eight threads varies from run to run, never one).
  EXPECT_EXIT(_exit(std::min(arenas_after_8_threads(0), 2)), ::testing::ExitedWithCode(2), "");
}

}  // namespace
}  // namespace karakv::server
