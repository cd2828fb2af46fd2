// BlockPool: all-or-nothing allocation, reference counts, and the invariant check catching
// each kind of corruption it is meant to catch.
#include "server/block_pool.h"

#include <algorithm>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace karakv::server {
namespace {

using ::testing::HasSubstr;

TEST(BlockPoolTest, AllocatesDistinctBlocksAndFreesOnLastRelease) {
  BlockPool pool(8);
  std::vector<int32_t> a;
  ASSERT_TRUE(pool.allocate(5, &a).ok());
  ASSERT_EQ(a.size(), 5u);
  std::vector<int32_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::unique(sorted.begin(), sorted.end()), sorted.end());
  EXPECT_EQ(pool.used_count(), 5);
  EXPECT_EQ(pool.free_count(), 3);
  pool.add_ref(a[0]);
  EXPECT_FALSE(pool.release(a[0]));  // still held by the fork
  EXPECT_EQ(pool.used_count(), 5);
  EXPECT_TRUE(pool.release(a[0]));
  EXPECT_EQ(pool.used_count(), 4);
}

TEST(BlockPoolTest, ExhaustionIsAllOrNothingAndSaysWantedVsFree) {
  BlockPool pool(4);
  std::vector<int32_t> a;
  ASSERT_TRUE(pool.allocate(3, &a).ok());
  std::vector<int32_t> b;
  absl::Status s = pool.allocate(2, &b);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), HasSubstr("wanted 2 blocks, 1 free of 4"));
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(pool.free_count(), 1);
}

TEST(BlockPoolTest, CheckAcceptsMatchingReferences) {
  BlockPool pool(6);
  std::vector<int32_t> a;
  ASSERT_TRUE(pool.allocate(3, &a).ok());
  pool.add_ref(a[1]);
  std::vector<int32_t> refs(6, 0);
  for (int32_t b : a) ++refs[b];
  ++refs[a[1]];
  EXPECT_TRUE(pool.check(refs).ok());
}

TEST(BlockPoolTest, CheckCatchesLeakWrongCountAndReferencedFreeBlock) {
  BlockPool pool(6);
  std::vector<int32_t> a;
  ASSERT_TRUE(pool.allocate(2, &a).ok());
  std::vector<int32_t> refs(6, 0);
  refs[a[0]] = 1;  // a[1] is used but no table holds it: a leak
  EXPECT_THAT(std::string(pool.check(refs).message()), HasSubstr("tables hold it"));
  refs[a[1]] = 2;  // held twice but counts one reference
  EXPECT_FALSE(pool.check(refs).ok());
  refs[a[1]] = 1;
  ASSERT_TRUE(pool.check(refs).ok());
  const int32_t free_block = a[0] == 5 || a[1] == 5 ? 4 : 5;
  refs[free_block] = 1;  // a table holds a free block: use after free
  EXPECT_THAT(std::string(pool.check(refs).message()), HasSubstr("free block"));
}

}  // namespace
}  // namespace karakv::server
