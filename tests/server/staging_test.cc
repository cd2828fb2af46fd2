// StagingRegion: bounds and alignment checks, permissions, and cleanup of the shm object.
#include "server/staging.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>

#include "gtest/gtest.h"

namespace karakv::server {
namespace {

TEST(StagingTest, ResolvesInsideAndRefusesOutside) {
  auto r = StagingRegion::create(10000);
  ASSERT_TRUE(r.ok()) << r.status();
  const size_t size = (*r)->size();
  EXPECT_GE(size, 10000u);
  auto ok = (*r)->resolve(64, 128, 4, "q");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, (*r)->base() + 64);
  EXPECT_TRUE((*r)->resolve(0, size, 4, "q").ok());
  EXPECT_EQ((*r)->resolve(size - 4, 8, 4, "q").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*r)->resolve(size + 4, 0, 4, "q").status().code(), absl::StatusCode::kInvalidArgument);
  // offset + length wraps around 2^64: must still be refused.
  EXPECT_EQ((*r)->resolve(8, UINT64_MAX - 4, 4, "q").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*r)->resolve(UINT64_MAX, 2, 4, "q").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*r)->resolve(2, 8, 4, "q").status().code(), absl::StatusCode::kInvalidArgument);  // misaligned
}

TEST(StagingTest, ObjectIsOwnerOnlyAndRemovedWithTheRegion) {
  std::string name;
  {
    auto r = StagingRegion::create(4096);
    ASSERT_TRUE(r.ok());
    name = (*r)->name();
    EXPECT_GE(name.size(), 32u);  // 128 random bits in the name
    int fd = shm_open(name.c_str(), O_RDONLY, 0);
    ASSERT_GE(fd, 0);
    struct stat st;
    ASSERT_EQ(fstat(fd, &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    close(fd);
  }
  EXPECT_LT(shm_open(name.c_str(), O_RDONLY, 0), 0);
}

TEST(StagingTest, NamesDiffer) {
  auto a = StagingRegion::create(4096);
  auto b = StagingRegion::create(4096);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE((*a)->name(), (*b)->name());
}

}  // namespace
}  // namespace karakv::server
