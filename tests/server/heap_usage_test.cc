// The heap figures karakvd reports (Stats, /metrics) follow this process's own malloc.
#include "server/heap_usage.h"

#include <cstdlib>
#include <cstring>

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

}  // namespace
}  // namespace karakv::server
