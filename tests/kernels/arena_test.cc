// The CUDA backend's scratch arena (kernels/cuda/arena.h) on host memory: alignment, reuse after a
// rewind, coalescing after growth, shrinking after a large call, and a failed allocation; and the
// allocation records it asks before the driver (kernels/common/allocations.h).
#include "cuda/arena.h"

#include "common/allocations.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <map>

namespace karakv::kernels::cuda {
namespace {

// Host memory standing in for cudaMalloc, counting what is held; allocations above `limit` fail.
class HostMemory final : public ArenaMemory {
 public:
  KernelStatus allocate(size_t bytes, void** out) override {
    ++allocations;
    if (held + bytes > limit) return {KernelStatus::Code::kInternal, "out of memory for " + std::to_string(bytes)};
    *out = std::aligned_alloc(Arena::kAlign, bytes);
    live[*out] = bytes;
    held += bytes;
    return KernelStatus::ok();
  }
  void free(void* p) override {
    auto it = live.find(p);
    ASSERT_NE(it, live.end()) << "freed memory it did not hand out";
    held -= it->second;
    live.erase(it);
    std::free(p);
  }
  std::map<void*, size_t> live;
  size_t held = 0, limit = SIZE_MAX;
  int allocations = 0;
};

constexpr size_t kMiB = size_t(1) << 20;

TEST(ArenaTest, AlignsAndReusesAfterARewind) {
  HostMemory mem;
  {
    Arena arena(mem);
    void *a = nullptr, *b = nullptr;
    ASSERT_TRUE(arena.take(1, &a).is_ok());
    ASSERT_TRUE(arena.take(300, &b).is_ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % Arena::kAlign, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % Arena::kAlign, 0u);
    EXPECT_EQ(static_cast<char*>(b) - static_cast<char*>(a), ptrdiff_t(Arena::kAlign));
    EXPECT_EQ(arena.reserved_bytes(), Arena::kMinChunk);
    arena.reset();
    void* c = nullptr;
    ASSERT_TRUE(arena.take(64, &c).is_ok());
    EXPECT_EQ(c, a) << "a rewound arena hands out its memory again";
    EXPECT_EQ(mem.allocations, 1);
  }
  EXPECT_TRUE(mem.live.empty()) << "the arena frees its chunks";
}

// A call that outgrows the chunk leaves two; the next rewind replaces them with one of their total
// size, and the same call then fits in it with no further allocation.
TEST(ArenaTest, GrowthEndsInOneChunk) {
  HostMemory mem;
  Arena arena(mem);
  auto big_call = [&] {
    void* p = nullptr;
    ASSERT_TRUE(arena.take(6 * kMiB, &p).is_ok());
    ASSERT_TRUE(arena.take(6 * kMiB, &p).is_ok());
  };
  big_call();
  EXPECT_EQ(arena.num_chunks(), 2u);
  const size_t total = arena.reserved_bytes();
  arena.reset();
  EXPECT_EQ(arena.num_chunks(), 0u);
  EXPECT_EQ(mem.held, 0u);
  big_call();
  EXPECT_EQ(arena.num_chunks(), 1u);
  EXPECT_EQ(arena.reserved_bytes(), total);
  const int allocations = mem.allocations;
  for (int i = 0; i < 10; ++i) {
    arena.reset();
    big_call();
  }
  EXPECT_EQ(mem.allocations, allocations) << "a call that fits allocates nothing";
  EXPECT_EQ(arena.num_chunks(), 1u);
}

// One large call's memory is kept while any of the last kShrinkWindow calls needed it, then given
// back down to what they needed (never below the minimum chunk).
TEST(ArenaTest, ShrinksAfterTheWindowOfSmallCalls) {
  HostMemory mem;
  Arena arena(mem);
  void* p = nullptr;
  ASSERT_TRUE(arena.take(100 * kMiB, &p).is_ok());
  EXPECT_EQ(arena.reserved_bytes(), 100 * kMiB);
  for (int call = 0; call < Arena::kShrinkWindow; ++call) {
    arena.reset();
    EXPECT_EQ(arena.reserved_bytes(), 100 * kMiB) << "call " << call << " is inside the window of the large one";
    ASSERT_TRUE(arena.take(kMiB, &p).is_ok());
  }
  arena.reset();
  EXPECT_EQ(arena.reserved_bytes(), 0u) << "the large chunk is given back";
  ASSERT_TRUE(arena.take(kMiB, &p).is_ok());
  EXPECT_EQ(arena.reserved_bytes(), Arena::kMinChunk);
  EXPECT_EQ(mem.held, Arena::kMinChunk);
}

// Calls that each use 30 MiB keep a 40 MiB chunk (not twice their use): no shrinking back and forth.
TEST(ArenaTest, KeepsAChunkItsCallsUse) {
  HostMemory mem;
  Arena arena(mem);
  void* p = nullptr;
  ASSERT_TRUE(arena.take(40 * kMiB, &p).is_ok());
  for (int call = 0; call < 3 * Arena::kShrinkWindow; ++call) {
    arena.reset();
    ASSERT_TRUE(arena.take(30 * kMiB, &p).is_ok());
  }
  EXPECT_EQ(arena.reserved_bytes(), 40 * kMiB);
  EXPECT_EQ(mem.allocations, 1);
}

// A coalesced chunk that cannot be had falls back to what the call asks for; an allocation that
// cannot be had at all is an error naming scratch memory, with a null pointer.
TEST(ArenaTest, FailedAllocations) {
  HostMemory mem;
  Arena arena(mem);
  void* p = nullptr;
  ASSERT_TRUE(arena.take(10 * kMiB, &p).is_ok());
  ASSERT_TRUE(arena.take(10 * kMiB, &p).is_ok());
  arena.reset();
  mem.limit = 12 * kMiB;  // the 20 MiB coalesced chunk no longer fits
  ASSERT_TRUE(arena.take(10 * kMiB, &p).is_ok());
  EXPECT_EQ(arena.reserved_bytes(), 10 * kMiB);
  const KernelStatus st = arena.take(10 * kMiB, &p);
  EXPECT_FALSE(st.is_ok());
  EXPECT_EQ(p, nullptr);
  EXPECT_NE(st.message.find("scratch memory"), std::string::npos) << st.message;
}

// The CUDA backend asks its records whether a tensor is its own device memory before asking the
// driver: every byte inside an allocation is, the byte after it and memory before the first one
// are not, and a removed allocation is no longer.
TEST(AllocationsTest, ContainsEveryByteOfALiveAllocation) {
  common::Allocations a;
  static char memory[4096];
  EXPECT_FALSE(a.contains(memory));
  a.add(memory + 1024, 1000);
  a.add(memory + 2048, 16);
  EXPECT_FALSE(a.contains(memory + 1023));
  EXPECT_TRUE(a.contains(memory + 1024));
  EXPECT_TRUE(a.contains(memory + 2023));
  EXPECT_FALSE(a.contains(memory + 2024));
  EXPECT_TRUE(a.contains(memory + 2063));
  EXPECT_FALSE(a.contains(memory + 2064));
  a.remove(memory + 1024);
  EXPECT_FALSE(a.contains(memory + 1500));
  EXPECT_TRUE(a.contains(memory + 2050));
}

}  // namespace
}  // namespace karakv::kernels::cuda
