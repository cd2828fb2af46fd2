// How many CPUs this process may use: the CPUs of its affinity mask (taskset, a cpuset cgroup),
// capped by its cgroup's CPU quota (a container's CPU limit), which the affinity mask does not show
// and omp_get_max_threads() ignores. The CPU backend's default thread count.
//
// The quota is read from the cgroup /proc/self/cgroup names, under the cgroup file systems' mount
// point: cgroup v2 cpu.max ("max 100000", or "150000 100000" for 1.5 CPUs), else cgroup v1
// cpu.cfs_quota_us / cpu.cfs_period_us (-1: none). A parent's quota bounds its children's, so every
// level from the process's cgroup up to the mount point counts and the smallest quota wins; levels
// that are not there are skipped (a container's /proc/self/cgroup may name the host's path while
// its own cgroup is mounted at the root). A fractional quota rounds up: 1.5 CPUs is 2 threads.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace karakv::kernels {

struct CpuQuota {
  double cpus = 0;        // quota / period; 0: no quota
  std::string source;     // the file the quota came from, relative to the mount point ("" when none)
  std::string version;    // "v2", "v1", or "" when no cgroup with a CPU controller was found
  std::string problem;    // a file that was there but could not be used (the quota is then ignored)
};

// The quota of the cgroup named in `proc_self_cgroup` (the text of /proc/self/cgroup), with the
// cgroup file systems mounted at `mount_root` (normally /sys/fs/cgroup). A controller listed for
// cgroup v1 ("N:cpu,cpuacct:/path") wins over the v2 line ("0::/path"), as it does in the kernel on
// hybrid hosts.
CpuQuota read_cgroup_cpu_quota(const std::string& mount_root, std::string_view proc_self_cgroup);

// The same walk for the memory controller: the smallest cgroup memory limit over the levels (v2
// memory.max, v1 memory.limit_in_bytes), for the daemon's karakv_memory_limit_bytes gauge.
struct MemoryLimit {
  int64_t bytes = 0;      // 0: no limit
  std::string source;     // the file the limit came from ("" when none)
  std::string version;    // "v2", "v1", or ""
  std::string problem;    // a file that was there but could not be used
};
MemoryLimit read_cgroup_memory_limit(const std::string& mount_root, std::string_view proc_self_cgroup);
// This process's: /proc/self/cgroup and the files under /sys/fs/cgroup.
MemoryLimit memory_limit();

struct UsableCpus {
  int count = 1;     // min(affinity, ceil(quota)), at least 1
  int affinity = 0;  // CPUs in the affinity mask
  CpuQuota quota;
  // Why `count`, for logs: "cgroup v2 quota 1.5 CPUs (cpu.max); affinity 4 CPUs".
  std::string reason() const;
};

// Combines an affinity CPU count with a quota (the part of usable_cpus() that reads nothing).
UsableCpus usable_cpus(int affinity, CpuQuota quota);
// This process: sched_getaffinity, /proc/self/cgroup and the files under /sys/fs/cgroup.
UsableCpus usable_cpus();
// CPUs in this process's affinity mask (std::thread::hardware_concurrency() if it cannot be read).
int affinity_cpus();

}  // namespace karakv::kernels
