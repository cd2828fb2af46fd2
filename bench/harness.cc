// karakv-bench's process harness: child processes (daemons, workers) stopped on any exit, the
// run's private directory, and karakvd started on its own socket.
#include "harness.h"

#include <algorithm>
#include <cmath>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

ABSL_DECLARE_FLAG(std::string, karakvd);
ABSL_DECLARE_FLAG(std::vector<std::string>, karakvd_flags);

namespace karakv::bench {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void progress(const std::string& line) { std::fprintf(stderr, "karakv-bench: %s\n", line.c_str()); }

// Nearest-rank percentile, p in (0, 100].
double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * v.size()));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

namespace {
double median(std::vector<double>& v) {
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + mid, v.end());
  const double hi = v[mid];
  if (v.size() % 2 == 1) return hi;
  return (*std::max_element(v.begin(), v.begin() + mid) + hi) / 2;
}
}  // namespace

Line theil_sen(const std::vector<double>& x, const std::vector<double>& y) {
  const size_t n = std::min(x.size(), y.size());
  std::vector<double> v;
  v.reserve(n * (n - (n > 0)) / 2);
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = i + 1; j < n; ++j) {
      if (x[j] != x[i]) v.push_back((y[j] - y[i]) / (x[j] - x[i]));
    }
  }
  Line line;
  if (!v.empty()) line.slope = median(v);
  if (n == 0) return line;
  v.clear();
  for (size_t i = 0; i < n; ++i) v.push_back(y[i] - line.slope * x[i]);
  line.intercept = median(v);
  return line;
}

std::atomic<pid_t> g_children[kMaxChildren];
namespace {
char g_cleanup_paths[kMaxCleanupPaths][512];  // files to unlink, then the temp dir (last) to rmdir
std::atomic<int> g_cleanup_count{0};
}  // namespace

void register_cleanup_path(const std::string& path) {
  const int i = g_cleanup_count.load();
  if (i >= kMaxCleanupPaths || path.size() >= sizeof(g_cleanup_paths[0])) return;
  for (int j = 0; j < i; ++j) {
    if (path == g_cleanup_paths[j]) return;  // a daemon restarted on the same socket
  }
  std::memcpy(g_cleanup_paths[i], path.c_str(), path.size() + 1);
  g_cleanup_count.store(i + 1);
}

void sleep_ms(int ms) {
  timespec ts{ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, nullptr);
}

// Only async-signal-safe calls: kill, waitpid, nanosleep, unlink, rmdir, write, _exit.
void on_fatal_signal(int sig) {
  static const char kMsg[] = "\nkarakv-bench: interrupted or timed out; stopping child processes\n";
  ssize_t ignored = write(STDERR_FILENO, kMsg, sizeof(kMsg) - 1);
  (void)ignored;
  for (auto& c : g_children) {
    if (pid_t p = c.load(); p > 0) kill(p, SIGTERM);
  }
  for (int waited = 0; waited < 3000; waited += 50) {
    bool any = false;
    for (auto& c : g_children) {
      if (pid_t p = c.load(); p > 0) {
        if (waitpid(p, nullptr, WNOHANG) == p) c.store(0); else any = true;
      }
    }
    if (!any) break;
    sleep_ms(50);
  }
  for (auto& c : g_children) {
    if (pid_t p = c.load(); p > 0) kill(p, SIGKILL);
  }
  const int n = g_cleanup_count.load();
  for (int i = 0; i < n; ++i) {
    if (i == 0) continue;  // the directory, removed last
    unlink(g_cleanup_paths[i]);
  }
  if (n > 0) rmdir(g_cleanup_paths[0]);
  _exit(sig == SIGALRM ? 124 : 128 + sig);
}

Burners::Burners(int count) {
  for (int i = 0; i < count; ++i) {
    const pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() == 1) _exit(0);  // the benchmark is already gone
      // A busy loop the compiler must keep: the empty asm claims to read and change n.
      for (uint64_t n = 0;; ++n) asm volatile("" : "+r"(n));
    }
    if (pid > 0) pids_.push_back(pid);
  }
}

Burners::~Burners() {
  for (pid_t p : pids_) kill(p, SIGKILL);
  for (pid_t p : pids_) waitpid(p, nullptr, 0);
}

std::string default_karakvd() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "karakvd";
  const auto candidate = exe.parent_path().parent_path() / "server" / "karakvd";
  return std::filesystem::exists(candidate) ? candidate.string() : "karakvd";
}

absl::Status Daemon::stop() {
  if (!process) return absl::OkStatus();
  const std::string how = process->stop();
  if (how != "exit 0") {
    return absl::InternalError(absl::StrCat("karakvd ended with ", how, " after SIGTERM; log tail:\n",
                                            process->log_tail()));
  }
  process.reset();
  return absl::OkStatus();
}

// A daemon that does not exit 0 on SIGTERM is a bug worth seeing, but not worth the numbers.
void stop_or_warn(Daemon& d) {
  if (absl::Status s = d.stop(); !s.ok()) progress(absl::StrCat("WARNING: ", s.message()));
}

absl::StatusOr<Daemon> start_karakvd(const TempDir& dir, const std::string& name,
                                     const std::vector<std::string>& geometry_flags) {
  const std::string socket = dir.file(name + ".sock");
  register_cleanup_path(socket);
  std::vector<std::string> argv = {absl::GetFlag(FLAGS_karakvd).empty() ? default_karakvd()
                                                                        : absl::GetFlag(FLAGS_karakvd),
                                   "--socket=" + socket, "--log_level=warn", "--drain_seconds=2"};
  argv.insert(argv.end(), geometry_flags.begin(), geometry_flags.end());
  const std::vector<std::string> extra = absl::GetFlag(FLAGS_karakvd_flags);
  argv.insert(argv.end(), extra.begin(), extra.end());
  progress(absl::StrCat("starting ", absl::StrJoin(argv, " ")));
  auto child = ChildProcess::start(name, argv, dir.file(name + ".log"));
  if (!child.ok()) return child.status();
  Daemon d{std::move(*child), "unix:" + socket};
  // Ready when it accepts a session; Attach fails fast (no wait_for_ready) until then.
  const auto start = Clock::now();
  while (true) {
    if (!d.process->running()) {
      return absl::FailedPreconditionError(absl::StrCat(argv[0], " exited at startup; log tail:\n",
                                                        d.process->log_tail()));
    }
    karakv::ClientOptions probe;
    probe.target = d.target;
    probe.staging_bytes = 0;
    probe.heartbeat = false;
    probe.rpc_timeout = absl::Seconds(2);
    probe.worker_id = "karakv-bench-probe";
    auto c = karakv::Client::Attach(probe);
    if (c.ok()) return d;
    if (seconds_since(start) > 30) {
      return absl::DeadlineExceededError(absl::StrCat("karakvd did not answer within 30 s: ",
                                                      c.status().ToString(), "; log tail:\n",
                                                      d.process->log_tail()));
    }
    sleep_ms(50);
  }
}

absl::StatusOr<std::unique_ptr<karakv::Client>> attach(const Daemon& d, uint64_t staging_bytes,
                                                       const std::string& worker, karakv::Staging staging,
                                                       bool fast_path, bool stream_ordered) {
  karakv::ClientOptions o;
  o.target = d.target;
  o.fast_path = fast_path;
  o.stream_ordered = stream_ordered;
  o.staging = staging;
  o.staging_bytes = staging_bytes;
  o.worker_id = worker;
  return karakv::Client::Attach(o);
}

absl::StatusOr<std::map<std::string, double>> parse_policy_params(const std::string& flag, const std::string& text) {
  std::map<std::string, double> params;
  for (absl::string_view kv : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const std::vector<std::string> nv = absl::StrSplit(kv, absl::MaxSplits('=', 1));
    double value = 0;
    if (nv.size() != 2 || nv[0].empty() || !absl::SimpleAtod(nv[1], &value)) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": expected name=value (a number), got '", kv, "'"));
    }
    params[nv[0]] = value;
  }
  return params;
}

}  // namespace karakv::bench
