// The heap figures karakvd reports (Stats, /metrics) follow this process's own malloc.
#include "server/heap_usage.h"

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
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

// Frees a 1 MiB chunk (mmapped: above glibc's initial 128 KiB threshold), then returns 1 when a
// 512 KiB chunk allocated after it is a mapping of its own as well, 0 when it came from an arena,
// 2 when the threshold (`fixed` > 0) was refused. The threshold is process-wide, so the test below
// runs this in a process of its own.
int large_chunk_mmapped_after_a_larger_one_was_freed(int fixed) {
  if (fixed > 0 && !fix_malloc_mmap_threshold(fixed)) return 2;
  // Called through volatile pointers: the compiler may drop a malloc / free pair it can see.
  static void* (*volatile const allocate)(size_t) = std::malloc;
  static void (*volatile const release)(void*) = std::free;
  void* first = allocate(1 << 20);
  std::memset(first, 1, 1 << 20);
  release(first);
  const size_t before = mallinfo2().hblkhd;  // bytes in chunks mmapped on their own
  void* second = allocate(512 << 10);
  std::memset(second, 1, 512 << 10);
  const size_t after = mallinfo2().hblkhd;
  release(second);
  return after >= before + (512 << 10) ? 1 : 0;
}

TEST(HeapUsageDeathTest, FixedMmapThresholdKeepsLargeChunksOutOfTheArenas) {
  if (!read_heap_usage().glibc) GTEST_SKIP() << "glibc's malloc is not the allocator in use";
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
      (std::getenv("GLIBC_TUNABLES") != nullptr && std::strstr(std::getenv("GLIBC_TUNABLES"), "mmap_threshold"))) {
    GTEST_SKIP() << "the environment sets glibc's mmap threshold already";
  }
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // glibc's dynamic threshold rose to 1 MiB when the first chunk was freed: the second one comes
  // from an arena. That is what karakvd's default setting prevents.
  EXPECT_EXIT(_exit(large_chunk_mmapped_after_a_larger_one_was_freed(0)), ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(_exit(large_chunk_mmapped_after_a_larger_one_was_freed(128 << 10)), ::testing::ExitedWithCode(1), "");
  // Below the fixed threshold a chunk still comes from an arena.
  EXPECT_EXIT(_exit(large_chunk_mmapped_after_a_larger_one_was_freed(1 << 20)), ::testing::ExitedWithCode(0), "");
}

TEST(HeapUsageTest, TcacheTunableIsAppendedOnceAndNeverOverridesTheOperators) {
  EXPECT_EQ(tunables_with_tcache_max(nullptr, 256), "glibc.malloc.tcache_max=256");
  EXPECT_EQ(tunables_with_tcache_max("", 0), "glibc.malloc.tcache_max=0");
  EXPECT_EQ(tunables_with_tcache_max("glibc.malloc.arena_max=1", 256),
            "glibc.malloc.arena_max=1:glibc.malloc.tcache_max=256");
  // Already set, by the operator or by the daemon before it re-executed itself: left alone.
  EXPECT_EQ(tunables_with_tcache_max("glibc.malloc.tcache_max=64", 256), std::nullopt);
  EXPECT_EQ(tunables_with_tcache_max("glibc.malloc.arena_max=1:glibc.malloc.tcache_max=64", 256), std::nullopt);
  // A name that merely starts the same is another tunable.
  EXPECT_EQ(tunables_with_tcache_max("glibc.malloc.tcache_max_x=1", 8), "glibc.malloc.tcache_max_x=1:glibc.malloc.tcache_max=8");
  EXPECT_EQ(tunables_with_tcache_max(nullptr, -1), std::nullopt);
  EXPECT_EQ(tunables_with_tcache_max("glibc.malloc.arena_max=1", -1), std::nullopt);
}

// On a thread of its own (an empty per-thread cache), frees 7 chunks of `size` bytes and returns 1
// when malloc still counts them as in use (they went to the thread's cache), 0 when they went back
// to the arena's free lists.
int freed_chunks_stay_cached(size_t size) {
  int cached = -1;
  std::thread([&] {
    void* chunks[7];
    for (void*& c : chunks) c = std::malloc(size);
    void* fence = std::malloc(size);  // keeps the seven from merging into the arena's top
    const size_t before = mallinfo2().uordblks;
    for (void* c : chunks) std::free(c);
    const size_t after = mallinfo2().uordblks;
    cached = before - after < 7 * size / 2 ? 1 : 0;
    std::free(fence);
  }).join();
  return cached;
}

// Each EXPECT_EXIT below runs in a freshly executed copy of this binary ("threadsafe"), which
// reads the environment's tunables at start as karakvd does after it re-executes itself; the copy
// runs the test body up to the statement, so what comes before it must decide the same there.
TEST(HeapUsageDeathTest, GlibcsDefaultCachesChunksOf512Bytes) {
  if (!read_heap_usage().glibc) GTEST_SKIP() << "glibc's malloc is not the allocator in use";
  const char* env = std::getenv("GLIBC_TUNABLES");
  if (env != nullptr && std::strstr(env, "tcache") != nullptr) {
    GTEST_SKIP() << "GLIBC_TUNABLES already sets the per-thread caches: " << env;
  }
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(_exit(freed_chunks_stay_cached(512)), ::testing::ExitedWithCode(1), "");
}

TEST(HeapUsageDeathTest, TcacheTunableKeepsLargerChunksOutOfThePerThreadCaches) {
  if (!read_heap_usage().glibc) GTEST_SKIP() << "glibc's malloc is not the allocator in use";
  const char* env = std::getenv("GLIBC_TUNABLES");
  const std::string saved = env ? env : "";
  const std::optional<std::string> tunables = tunables_with_tcache_max(env, 256);
  if (tunables.has_value()) {
    setenv("GLIBC_TUNABLES", tunables->c_str(), 1);  // here; the copies find it set already
  } else if (std::strstr(env, "glibc.malloc.tcache_max=256") == nullptr) {
    GTEST_SKIP() << "GLIBC_TUNABLES sets another tcache_max already: " << env;
  }
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // glibc ignores a tunable it does not know without a word: this is what shows the name is right.
  EXPECT_EXIT(_exit(freed_chunks_stay_cached(512)), ::testing::ExitedWithCode(0), "") << std::getenv("GLIBC_TUNABLES");
  EXPECT_EXIT(_exit(freed_chunks_stay_cached(128)), ::testing::ExitedWithCode(1), "") << std::getenv("GLIBC_TUNABLES");
  if (saved.empty()) unsetenv("GLIBC_TUNABLES");
  else setenv("GLIBC_TUNABLES", saved.c_str(), 1);
}

}  // namespace
}  // namespace karakv::server
