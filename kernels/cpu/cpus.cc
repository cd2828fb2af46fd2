// Usable CPUs: affinity mask capped by the cgroup CPU quota (karakv/kernels/cpus.h).
#include "karakv/kernels/cpus.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <initializer_list>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

namespace karakv::kernels {
namespace {

namespace fs = std::filesystem;

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\n' || s.front() == '\r')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  return s;
}

std::optional<long long> parse_int(std::string_view s) {
  long long v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}

// The whole file, or nullopt when it is not there or unreadable.
std::optional<std::string> read_text(const fs::path& p) {
  std::ifstream in(p);
  if (!in) return std::nullopt;
  std::ostringstream s;
  s << in.rdbuf();
  if (in.bad()) return std::nullopt;
  return s.str();
}

std::string in_quotes(std::string_view s) {
  s = trim(s);
  if (s.size() > 40) return "'" + std::string(s.substr(0, 40)) + "...'";
  return "'" + std::string(s) + "'";
}

// The levels of `cgroup_path` from the cgroup itself up to the mount point: "/a/b" -> a/b, a, "".
std::vector<fs::path> levels(std::string_view cgroup_path) {
  std::vector<std::string> parts;
  size_t i = 0;
  while (i < cgroup_path.size()) {
    size_t j = cgroup_path.find('/', i);
    if (j == std::string_view::npos) j = cgroup_path.size();
    std::string part(cgroup_path.substr(i, j - i));
    // ".." would climb out of the mount point; such a path is not one the kernel writes.
    if (!part.empty() && part != "." && part != "..") parts.push_back(std::move(part));
    i = j + 1;
  }
  std::vector<fs::path> out;
  for (size_t n = parts.size() + 1; n-- > 0;) {
    fs::path p;
    for (size_t k = 0; k < n; ++k) p /= parts[k];
    out.push_back(p);
  }
  return out;
}

// One level's quota in CPUs: 0 for none, nullopt (with *problem set) for a file that is not usable.
using LevelReader = std::optional<double> (*)(const fs::path& dir, std::string* problem, fs::path* file);

std::optional<double> read_v2(const fs::path& dir, std::string* problem, fs::path* file) {
  *file = dir / "cpu.max";
  const std::optional<std::string> text = read_text(*file);
  if (!text) return 0.0;
  const std::string_view t = trim(*text);
  const size_t space = t.find(' ');
  const std::string_view quota = t.substr(0, space);
  const std::string_view period = space == std::string_view::npos ? std::string_view("100000") : trim(t.substr(space));
  const std::optional<long long> p = parse_int(period);
  if (!p || *p <= 0) {
    *problem = file->string() + " reads " + in_quotes(t) + ", expected '<quota|max> <period>'";
    return std::nullopt;
  }
  if (quota == "max") return 0.0;
  const std::optional<long long> q = parse_int(quota);
  if (!q || *q <= 0) {
    *problem = file->string() + " reads " + in_quotes(t) + ", expected '<quota|max> <period>'";
    return std::nullopt;
  }
  return double(*q) / double(*p);
}

std::optional<double> read_v1(const fs::path& dir, std::string* problem, fs::path* file) {
  *file = dir / "cpu.cfs_quota_us";
  const std::optional<std::string> quota_text = read_text(*file);
  if (!quota_text) return 0.0;
  const std::optional<long long> q = parse_int(trim(*quota_text));
  if (!q || *q == 0 || *q < -1) {
    *problem = file->string() + " reads " + in_quotes(*quota_text) + ", expected -1 or a positive number of microseconds";
    return std::nullopt;
  }
  if (*q == -1) return 0.0;
  const fs::path period_file = dir / "cpu.cfs_period_us";
  const std::optional<std::string> period_text = read_text(period_file);
  const std::optional<long long> p = period_text ? parse_int(trim(*period_text)) : std::nullopt;
  if (!p || *p <= 0) {
    *problem = period_file.string() + (period_text ? " reads " + in_quotes(*period_text) : std::string(" is missing")) +
               ", expected a positive number of microseconds";
    return std::nullopt;
  }
  return double(*q) / double(*p);
}

// Memory limits in bytes, in the same shape: 0 for none ("max", v1's page-counter maximum).
std::optional<double> read_memory_file(const fs::path& file, std::string* problem) {
  const std::optional<std::string> text = read_text(file);
  if (!text) return 0.0;
  const std::string_view t = trim(*text);
  if (t == "max") return 0.0;
  const std::optional<long long> b = parse_int(t);
  if (!b || *b <= 0) {
    *problem = file.string() + " reads " + in_quotes(t) + ", expected 'max' or a number of bytes";
    return std::nullopt;
  }
  if (*b >= (1LL << 62)) return 0.0;  // v1's "unlimited": PAGE_COUNTER_MAX pages
  return double(*b);
}

std::optional<double> read_memory_v2(const fs::path& dir, std::string* problem, fs::path* file) {
  *file = dir / "memory.max";
  return read_memory_file(*file, problem);
}

std::optional<double> read_memory_v1(const fs::path& dir, std::string* problem, fs::path* file) {
  *file = dir / "memory.limit_in_bytes";
  return read_memory_file(*file, problem);
}

// The smallest quota over the levels of `cgroup_path` below `base`.
CpuQuota walk(const fs::path& base, std::string_view cgroup_path, const char* version, LevelReader reader) {
  CpuQuota out;
  out.version = version;
  for (const fs::path& level : levels(cgroup_path)) {
    const fs::path dir = level.empty() ? base : base / level;
    std::string problem;
    fs::path file;
    const std::optional<double> cpus = reader(dir, &problem, &file);
    if (!cpus) {
      if (out.problem.empty()) out.problem = problem;
      continue;
    }
    if (*cpus > 0 && (out.cpus == 0 || *cpus < out.cpus)) {
      out.cpus = *cpus;
      out.source = file.string();
    }
  }
  return out;
}

bool is_dir(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);
}

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

std::string format_cpus(double cpus) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", cpus);
  std::string s(buf);
  while (s.size() > 2 && s.back() == '0' && s[s.size() - 2] != '.') s.pop_back();  // 1.50 -> 1.5, 1.00 -> 1.0
  return s + (cpus == 1.0 ? " CPU" : " CPUs");
}

}  // namespace

namespace {

// The smallest limit of one controller over the cgroup named in `proc_self_cgroup`: a v1 hierarchy
// with `controller` (mounted as its list of controllers or one of `v1_dirs`) wins over v2.
CpuQuota read_cgroup_limit(const std::string& mount_root, std::string_view proc_self_cgroup,
                           std::string_view controller, std::initializer_list<const char*> v1_dirs,
                           LevelReader v1_reader, LevelReader v2_reader) {
  const fs::path root(mount_root);
  std::optional<std::string> v1_controllers, v1_path, v2_path;
  std::string_view text = proc_self_cgroup;
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    const std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    // hierarchy-id:controllers:path (the path may itself hold ':')
    const size_t a = line.find(':');
    if (a == std::string_view::npos) continue;
    const size_t b = line.find(':', a + 1);
    if (b == std::string_view::npos) continue;
    const std::string_view id = line.substr(0, a), controllers = line.substr(a + 1, b - a - 1);
    const std::string_view path = trim(line.substr(b + 1));
    if (id == "0" && controllers.empty()) {
      v2_path = std::string(path);
      continue;
    }
    std::string_view rest = controllers;
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      if (rest.substr(0, comma) == controller) {
        v1_controllers = std::string(controllers);
        v1_path = std::string(path);
      }
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    }
  }
  if (v1_path) {
    if (is_dir(root / *v1_controllers)) return walk(root / *v1_controllers, *v1_path, "v1", v1_reader);
    for (const char* name : v1_dirs) {
      if (is_dir(root / name)) return walk(root / name, *v1_path, "v1", v1_reader);
    }
    CpuQuota none;
    none.version = "v1";
    none.problem = "no cgroup v1 " + std::string(controller) + " controller mounted under " + root.string();
    return none;
  }
  if (v2_path) {
    // Hybrid hosts mount the v2 hierarchy at <root>/unified.
    const fs::path base = is_dir(root / "unified") && !is_file(root / "cgroup.controllers") ? root / "unified" : root;
    return walk(base, *v2_path, "v2", v2_reader);
  }
  return {};
}

}  // namespace

CpuQuota read_cgroup_cpu_quota(const std::string& mount_root, std::string_view proc_self_cgroup) {
  return read_cgroup_limit(mount_root, proc_self_cgroup, "cpu", {"cpu", "cpu,cpuacct", "cpuacct,cpu"}, read_v1,
                           read_v2);
}

MemoryLimit read_cgroup_memory_limit(const std::string& mount_root, std::string_view proc_self_cgroup) {
  const CpuQuota q =
      read_cgroup_limit(mount_root, proc_self_cgroup, "memory", {"memory"}, read_memory_v1, read_memory_v2);
  MemoryLimit out;
  out.bytes = int64_t(q.cpus);
  out.source = q.source;
  out.version = q.version;
  out.problem = q.problem;
  return out;
}

MemoryLimit memory_limit() {
  const std::optional<std::string> cgroup = read_text("/proc/self/cgroup");
  return cgroup ? read_cgroup_memory_limit("/sys/fs/cgroup", *cgroup) : MemoryLimit{};
}

UsableCpus usable_cpus(int affinity, CpuQuota quota) {
  UsableCpus out;
  out.affinity = std::max(1, affinity);
  out.quota = std::move(quota);
  out.count = out.affinity;
  if (out.quota.cpus > 0) {
    // A hair over a whole number is rounding in the files, not another CPU's worth of time.
    const int limit = std::max(1, int(std::ceil(out.quota.cpus - 1e-9)));
    out.count = std::min(out.count, limit);
  }
  return out;
}

std::string UsableCpus::reason() const {
  const std::string aff = "affinity " + std::to_string(affinity) + (affinity == 1 ? " CPU" : " CPUs");
  std::string quota_part;
  if (quota.cpus > 0) {
    quota_part = "cgroup " + quota.version + " quota " + format_cpus(quota.cpus) + " (" + quota.source + ")";
  } else if (!quota.problem.empty()) {
    quota_part = "cgroup CPU quota ignored: " + quota.problem;
  } else {
    quota_part = quota.version.empty() ? "no cgroup CPU controller" : "no cgroup " + quota.version + " CPU quota";
  }
  // The binding limit first.
  const bool quota_binds = quota.cpus > 0 && count < affinity;
  std::string s = quota_binds ? quota_part + "; " + aff : aff + "; " + quota_part;
  if (quota.cpus > 0 && !quota.problem.empty()) s += "; also ignored: " + quota.problem;
  return s;
}

int affinity_cpus() {
  for (int n = CPU_SETSIZE; n <= (1 << 20); n *= 2) {
    cpu_set_t* set = CPU_ALLOC(n);
    if (set == nullptr) break;
    const size_t size = CPU_ALLOC_SIZE(n);
    CPU_ZERO_S(size, set);
    if (sched_getaffinity(0, size, set) == 0) {
      const int count = CPU_COUNT_S(size, set);
      CPU_FREE(set);
      if (count > 0) return count;
      break;
    }
    CPU_FREE(set);
    if (errno != EINVAL) break;  // EINVAL: the kernel's mask is larger than this one
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

UsableCpus usable_cpus() {
  const std::optional<std::string> cgroup = read_text("/proc/self/cgroup");
  return usable_cpus(affinity_cpus(), cgroup ? read_cgroup_cpu_quota("/sys/fs/cgroup", *cgroup) : CpuQuota{});
}

}  // namespace karakv::kernels
