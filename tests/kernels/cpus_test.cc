// Usable CPUs (karakv/kernels/cpus.h): the cgroup quota read from fake cgroup trees, combined with
// the affinity count.
#include "karakv/kernels/cpus.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace karakv::kernels::test {
namespace {

namespace fs = std::filesystem;

class CgroupTree : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "karakv-cgroup-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    root_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  // Writes `text` to <root>/<rel>, making the directories on the way.
  void put(const std::string& rel, const std::string& text) {
    const fs::path p = root_ / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  CpuQuota read(const std::string& proc_self_cgroup) const {
    return read_cgroup_cpu_quota(root_.string(), proc_self_cgroup);
  }
  fs::path root_;
};

TEST_F(CgroupTree, V2MaxIsNoQuota) {
  put("kubepods/pod1/cpu.max", "max 100000\n");
  const CpuQuota q = read("0::/kubepods/pod1\n");
  EXPECT_EQ(q.version, "v2");
  EXPECT_EQ(q.cpus, 0);
  EXPECT_EQ(q.problem, "");
  const UsableCpus u = usable_cpus(8, q);
  EXPECT_EQ(u.count, 8);
  EXPECT_EQ(u.reason(), "affinity 8 CPUs; no cgroup v2 CPU quota");
}

TEST_F(CgroupTree, V2FractionalQuotaRoundsUp) {
  put("kubepods/pod1/cpu.max", "150000 100000\n");
  const CpuQuota q = read("0::/kubepods/pod1\n");
  EXPECT_DOUBLE_EQ(q.cpus, 1.5);
  EXPECT_EQ(q.source, (root_ / "kubepods/pod1/cpu.max").string());
  const UsableCpus u = usable_cpus(8, q);
  EXPECT_EQ(u.count, 2);
  EXPECT_EQ(u.reason(), "cgroup v2 quota 1.5 CPUs (" + q.source + "); affinity 8 CPUs");
}

TEST_F(CgroupTree, V2OneCpu) {
  put("cpu.max", "100000 100000\n");  // a container with its own cgroup namespace: the quota at the root
  const UsableCpus u = usable_cpus(2, read("0::/\n"));
  EXPECT_EQ(u.count, 1);
  EXPECT_EQ(u.reason(), "cgroup v2 quota 1.0 CPU (" + (root_ / "cpu.max").string() + "); affinity 2 CPUs");
}

TEST_F(CgroupTree, V2ParentQuotaBoundsTheChild) {
  put("a/cpu.max", "300000 100000\n");
  put("a/b/cpu.max", "max 100000\n");
  put("a/b/c/cpu.max", "500000 100000\n");
  const CpuQuota q = read("0::/a/b/c\n");
  EXPECT_DOUBLE_EQ(q.cpus, 3);
  EXPECT_EQ(q.source, (root_ / "a/cpu.max").string());
}

// A container without its own cgroup namespace sees the host's path in /proc/self/cgroup, but its
// own cgroup mounted at the root: levels that are not there are skipped.
TEST_F(CgroupTree, V2PathNotUnderTheMountFallsBackToTheLevelsThatAre) {
  put("cpu.max", "200000 100000\n");
  const CpuQuota q = read("0::/system.slice/docker-abc.scope\n");
  EXPECT_DOUBLE_EQ(q.cpus, 2);
  EXPECT_EQ(q.source, (root_ / "cpu.max").string());
}

TEST_F(CgroupTree, V1Quota) {
  put("cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "250000\n");
  put("cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n");
  put("cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  put("cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  const CpuQuota q = read("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n");
  EXPECT_EQ(q.version, "v1");
  EXPECT_DOUBLE_EQ(q.cpus, 2.5);
  EXPECT_EQ(q.source, (root_ / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us").string());
  EXPECT_EQ(usable_cpus(16, q).count, 3);
}

// Hybrid hosts list both; the cpu controller sits in the v1 hierarchy, which wins.
TEST_F(CgroupTree, V1ControllerWinsOverTheV2Line) {
  put("cpu/cpu.cfs_quota_us", "-1\n");
  put("cpu/cpu.cfs_period_us", "100000\n");
  put("unified/cpu.max", "100000 100000\n");
  const CpuQuota q = read("1:cpu:/\n0::/\n");
  EXPECT_EQ(q.version, "v1");
  EXPECT_EQ(q.cpus, 0);
  EXPECT_EQ(usable_cpus(4, q).reason(), "affinity 4 CPUs; no cgroup v1 CPU quota");
}

TEST_F(CgroupTree, NoCgroupFiles) {
  const CpuQuota none = read("");
  EXPECT_EQ(none.cpus, 0);
  EXPECT_EQ(none.version, "");
  EXPECT_EQ(usable_cpus(4, none).count, 4);
  EXPECT_EQ(usable_cpus(4, none).reason(), "affinity 4 CPUs; no cgroup CPU controller");
  // Named in /proc/self/cgroup but nothing on disk (cgroupfs not mounted): no quota either.
  const CpuQuota v2 = read("0::/kubepods/pod1\n");
  EXPECT_EQ(v2.cpus, 0);
  EXPECT_EQ(v2.problem, "");
  const CpuQuota v1 = read("3:cpu,cpuacct:/x\n");
  EXPECT_EQ(v1.cpus, 0);
  EXPECT_EQ(v1.problem, "no cgroup v1 cpu controller mounted under " + root_.string());
  EXPECT_EQ(usable_cpus(4, v1).count, 4);
}

TEST_F(CgroupTree, MalformedFilesAreIgnoredAndSaidSo) {
  put("bad/cpu.max", "lots 100000\n");
  const CpuQuota q = read("0::/bad\n");
  EXPECT_EQ(q.cpus, 0);
  const std::string file = (root_ / "bad/cpu.max").string();
  EXPECT_EQ(q.problem, file + " reads 'lots 100000', expected '<quota|max> <period>'");
  const UsableCpus u = usable_cpus(4, q);
  EXPECT_EQ(u.count, 4);
  EXPECT_EQ(u.reason(), "affinity 4 CPUs; cgroup CPU quota ignored: " + q.problem);

  put("zero/cpu.max", "100000 0\n");
  EXPECT_NE(read("0::/zero\n").problem.find("expected '<quota|max> <period>'"), std::string::npos);
  put("empty/cpu.max", "");
  EXPECT_NE(read("0::/empty\n").problem.find("reads ''"), std::string::npos);

  put("cpu/v1/cpu.cfs_quota_us", "200000\n");  // no period file
  const CpuQuota v1 = read("2:cpu:/v1\n");
  EXPECT_EQ(v1.cpus, 0);
  EXPECT_EQ(v1.problem, (root_ / "cpu/v1/cpu.cfs_period_us").string() +
                            " is missing, expected a positive number of microseconds");
  put("cpu/v1b/cpu.cfs_quota_us", "-7\n");
  EXPECT_NE(read("2:cpu:/v1b\n").problem.find("reads '-7', expected -1 or a positive"), std::string::npos);
}

// A malformed level does not hide a good one above it.
TEST_F(CgroupTree, MalformedLevelKeepsTheOthers) {
  put("cpu.max", "200000 100000\n");
  put("pod/cpu.max", "garbage");
  const CpuQuota q = read("0::/pod\n");
  EXPECT_DOUBLE_EQ(q.cpus, 2);
  EXPECT_FALSE(q.problem.empty());
  const UsableCpus u = usable_cpus(8, q);
  EXPECT_EQ(u.count, 2);
  EXPECT_NE(u.reason().find("; also ignored: "), std::string::npos) << u.reason();
}

// The memory limit walks the same levels: the smallest limit wins, "max" and v1's page-counter
// maximum are no limit, a malformed file is named and skipped.
TEST_F(CgroupTree, MemoryLimitV2SmallestLevelWins) {
  put("kubepods/memory.max", "8589934592\n");
  put("kubepods/pod1/memory.max", "max\n");
  put("kubepods/pod1/c1/memory.max", "2147483648\n");
  MemoryLimit m = read_cgroup_memory_limit(root_.string(), "0::/kubepods/pod1/c1\n");
  EXPECT_EQ(m.version, "v2");
  EXPECT_EQ(m.bytes, int64_t{2} << 30);
  EXPECT_EQ(m.source, (root_ / "kubepods/pod1/c1/memory.max").string());
  m = read_cgroup_memory_limit(root_.string(), "0::/kubepods/pod1\n");
  EXPECT_EQ(m.bytes, int64_t{8} << 30);
  put("kubepods/memory.max", "max\n");
  EXPECT_EQ(read_cgroup_memory_limit(root_.string(), "0::/kubepods/pod1\n").bytes, 0);
}

TEST_F(CgroupTree, MemoryLimitV1AndItsUnlimitedValue) {
  put("memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n");
  MemoryLimit m = read_cgroup_memory_limit(root_.string(), "4:memory:/docker/abc\n0::/\n");
  EXPECT_EQ(m.version, "v1");
  EXPECT_EQ(m.bytes, 0);
  put("memory/docker/abc/memory.limit_in_bytes", "1073741824\n");
  m = read_cgroup_memory_limit(root_.string(), "4:memory:/docker/abc\n0::/\n");
  EXPECT_EQ(m.bytes, int64_t{1} << 30);
  // The CPU quota of the same tree is not confused with it.
  EXPECT_EQ(read("4:memory:/docker/abc\n0::/\n").cpus, 0);
}

TEST_F(CgroupTree, MemoryLimitMalformedIsNamedAndSkipped) {
  put("a/memory.max", "lots\n");
  put("a/b/memory.max", "1048576\n");
  const MemoryLimit m = read_cgroup_memory_limit(root_.string(), "0::/a/b\n");
  EXPECT_EQ(m.bytes, 1 << 20);
  EXPECT_EQ(m.problem, (root_ / "a/memory.max").string() + " reads 'lots', expected 'max' or a number of bytes");
}

TEST(UsableCpus, AffinitySmallerThanQuota) {
  CpuQuota q;
  q.cpus = 4;
  q.version = "v2";
  q.source = "/sys/fs/cgroup/cpu.max";
  const UsableCpus u = usable_cpus(2, q);
  EXPECT_EQ(u.count, 2);
  EXPECT_EQ(u.reason(), "affinity 2 CPUs; cgroup v2 quota 4.0 CPUs (/sys/fs/cgroup/cpu.max)");
}

TEST(UsableCpus, QuotaBelowOneCpuIsOneThread) {
  CpuQuota q;
  q.cpus = 0.25;
  q.version = "v2";
  q.source = "cpu.max";
  const UsableCpus u = usable_cpus(8, q);
  EXPECT_EQ(u.count, 1);
  EXPECT_EQ(u.reason(), "cgroup v2 quota 0.25 CPUs (cpu.max); affinity 8 CPUs");
}

// This process: the affinity count is the mask's, and a quota only ever lowers it.
TEST(UsableCpus, ThisProcess) {
  cpu_set_t set;
  ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  EXPECT_EQ(affinity_cpus(), CPU_COUNT(&set));
  const UsableCpus u = usable_cpus();
  EXPECT_EQ(u.affinity, CPU_COUNT(&set));
  EXPECT_GE(u.count, 1);
  EXPECT_LE(u.count, u.affinity);
  EXPECT_FALSE(u.reason().empty());
}

}  // namespace
}  // namespace karakv::kernels::test
