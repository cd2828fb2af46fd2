// StagingRegion: bounds and alignment checks, permissions, and cleanup of the shm object.
#include "server/staging.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
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

// Every page exists once the region does, so touching one later cannot fail (SIGBUS on a full
// /dev/shm); the object's allocated blocks cover the whole region.
TEST(StagingTest, EveryPageIsAllocatedAtCreation) {
  auto r = StagingRegion::create(1 << 20, 1 << 16);
  ASSERT_TRUE(r.ok()) << r.status();
  int fd = shm_open((*r)->name().c_str(), O_RDONLY, 0);
  ASSERT_GE(fd, 0);
  struct stat st;
  ASSERT_EQ(fstat(fd, &st), 0);
  close(fd);
  EXPECT_EQ(size_t(st.st_size), (*r)->size() + (*r)->reserved_size());
  EXPECT_GE(uint64_t(st.st_blocks) * 512, uint64_t(st.st_size));
}

// A region larger than /dev/shm can ever hold is refused with RESOURCE_EXHAUSTED naming the space
// there. (tmpfs refuses such an fallocate before allocating a page.)
TEST(StagingTest, RefusesMoreThanSharedMemoryHolds) {
  struct statvfs vfs;
  ASSERT_EQ(statvfs("/dev/shm", &vfs), 0);
  const uint64_t total = uint64_t(vfs.f_blocks) * vfs.f_frsize;
  if (total == 0) GTEST_SKIP() << "/dev/shm reports no size";
  auto r = StagingRegion::create(total + (1 << 20));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_NE(r.status().message().find("/dev/shm"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("bytes free"), std::string::npos) << r.status();
}

TEST(StagingTest, NamesDiffer) {
  auto a = StagingRegion::create(4096);
  auto b = StagingRegion::create(4096);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE((*a)->name(), (*b)->name());
}

}  // namespace
}  // namespace karakv::server
