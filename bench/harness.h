// karakv-bench's process harness, shared by its modes: child processes (daemons, workers) that are
// stopped however the benchmark ends, the run's private directory, and karakvd on its own socket.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "karakv/client.h"

namespace karakv::bench {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t);
// One progress line on stderr.
void progress(const std::string& line);
// Nearest-rank percentile, p in (0, 100].
double percentile(std::vector<double> v, double p);
// A straight line fitted after Theil and Sen: its slope is the median of the slopes between every
// two points with different x, its intercept the median of y - slope * x (medians of an even count
// average the middle two). Unlike least squares it is not tilted by short swings or outliers (up to
// about 29% of the points). Needs at least two distinct x; otherwise the slope is 0.
struct Line {
  double slope = 0, intercept = 0;
  double at(double x) const { return intercept + slope * x; }
};
Line theil_sen(const std::vector<double>& x, const std::vector<double>& y);
void sleep_ms(int ms);

// Children are tracked in async-signal-safe globals so that SIGINT, SIGTERM and the --timeout_s
// alarm stop them too (on_fatal_signal); PR_SET_PDEATHSIG covers the bench dying outright.
constexpr int kMaxChildren = 16;
constexpr int kMaxCleanupPaths = 32;
extern std::atomic<pid_t> g_children[kMaxChildren];
// Files to unlink on a fatal signal; slot 0 is the temporary directory, removed last.
void register_cleanup_path(const std::string& path);
// The handler for SIGINT, SIGTERM, SIGALRM and SIGHUP: stops the children, removes the files, exits.
void on_fatal_signal(int sig);

// karakv-bench --busy: one process per hardware thread that spins until it is stopped or this
// process ends (PR_SET_PDEATHSIG), so that every mode, its baselines included, runs on CPUs that other
// work keeps busy, as a sidecar's node is. At normal priority, like the node's other processes.
class Burners {
 public:
  explicit Burners(int count);
  ~Burners();
  Burners(const Burners&) = delete;
  Burners& operator=(const Burners&) = delete;
  int count() const { return static_cast<int>(pids_.size()); }

 private:
  std::vector<pid_t> pids_;
};

class ChildProcess {
 public:
  // Starts argv[0] (PATH searched) with stdout and stderr going to `log_path`. When `pass_fd` is
  // set, the child gets it as its file descriptor 3 (a socketpair end to talk to it).
  static absl::StatusOr<std::unique_ptr<ChildProcess>> start(std::string name, std::vector<std::string> argv,
                                                            std::string log_path, int pass_fd = -1) {
    std::vector<char*> cargv;
    for (std::string& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    register_cleanup_path(log_path);
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) return absl::InternalError(absl::StrCat("fork for ", name, ": ", std::strerror(errno)));
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent) _exit(127);
      const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (fd >= 0) {
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        close(fd);
      }
      if (pass_fd >= 0 && pass_fd != 3) {
        dup2(pass_fd, 3);  // dup2 clears FD_CLOEXEC on the copy
        close(pass_fd);
      } else if (pass_fd == 3) {
        fcntl(3, F_SETFD, 0);
      }
      execvp(cargv[0], cargv.data());
      std::fprintf(stderr, "exec %s: %s\n", cargv[0], std::strerror(errno));
      _exit(127);
    }
    auto child = std::unique_ptr<ChildProcess>(new ChildProcess(std::move(name), pid, std::move(log_path)));
    for (auto& c : g_children) {
      pid_t empty = 0;
      if (c.compare_exchange_strong(empty, pid)) break;
    }
    return child;
  }

  ~ChildProcess() {
    if (pid_ > 0) stop();
  }

  const std::string& name() const { return name_; }
  // The process id while it runs (-1 once it has ended and been reaped).
  pid_t pid() const { return pid_; }

  bool running() {
    if (pid_ <= 0) return false;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exit_ = describe(status);
      forget();
      return false;
    }
    return true;
  }

  // SIGTERM, up to `grace` to exit, then SIGKILL. Returns how it ended ("exit 0", "signal 9").
  std::string stop(absl::Duration grace = absl::Seconds(10)) {
    if (!running()) return exit_;
    kill(pid_, SIGTERM);
    const auto start = Clock::now();
    int status = 0;
    while (true) {
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exit_ = describe(status);
        break;
      }
      if (seconds_since(start) > absl::ToDoubleSeconds(grace)) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        exit_ = describe(status) + " (did not exit within " + absl::FormatDuration(grace) + " of SIGTERM)";
        break;
      }
      sleep_ms(20);
    }
    forget();
    return exit_;
  }

  std::string log_tail(size_t bytes = 2000) const {
    std::ifstream in(log_path_);
    std::stringstream ss;
    ss << in.rdbuf();
    std::string s = ss.str();
    return s.size() > bytes ? s.substr(s.size() - bytes) : s;
  }

 private:
  ChildProcess(std::string name, pid_t pid, std::string log_path)
      : name_(std::move(name)), pid_(pid), log_path_(std::move(log_path)) {}

  static std::string describe(int status) {
    if (WIFEXITED(status)) return absl::StrCat("exit ", WEXITSTATUS(status));
    if (WIFSIGNALED(status)) return absl::StrCat("signal ", WTERMSIG(status));
    return "unknown";
  }
  void forget() {
    for (auto& c : g_children) {
      pid_t p = pid_;
      c.compare_exchange_strong(p, 0);
    }
    pid_ = -1;
  }

  std::string name_;
  pid_t pid_;
  std::string log_path_;
  std::string exit_;
};

// The run's private directory for sockets and logs; removed at exit.
class TempDir {
 public:
  static absl::StatusOr<TempDir> make() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "karakv-bench.XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) return absl::InternalError(absl::StrCat("mkdtemp: ", std::strerror(errno)));
    register_cleanup_path(tmpl);  // slot 0: the directory itself
    return TempDir(tmpl);
  }
  TempDir(TempDir&& o) noexcept : path_(std::move(o.path_)) { o.path_.clear(); }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  explicit TempDir(std::string p) : path_(std::move(p)) {}
  std::string path_;
};

// ../server/karakvd next to this binary, or "karakvd" (PATH) when it is not there.
std::string default_karakvd();

// A karakvd on its own socket, with a client attached once it answers.
struct Daemon {
  std::unique_ptr<ChildProcess> process;
  std::string target;  // "unix:/..."

  // Stops the daemon and checks that it honoured SIGTERM with exit status 0.
  absl::Status stop();
};

// A daemon that does not exit 0 on SIGTERM is a bug worth seeing, but not worth the numbers.
void stop_or_warn(Daemon& d);

// Starts --karakvd with `flags` (geometry, pool) on `dir`/`name`.sock and waits until it answers.
absl::StatusOr<Daemon> start_karakvd(const TempDir& dir, const std::string& name,
                                     const std::vector<std::string>& geometry_flags);

absl::StatusOr<std::unique_ptr<karakv::Client>> attach(const Daemon& d, uint64_t staging_bytes,
                                                       const std::string& worker,
                                                       karakv::Staging staging = karakv::Staging::kShm,
                                                       bool fast_path = false, bool stream_ordered = false);

// Policy parameters as a flag spells them, "name=value,name=value" (e.g. "budget=768,prompt=1");
// `flag` names the flag in the error of an entry that is not name=number.
absl::StatusOr<std::map<std::string, double>> parse_policy_params(const std::string& flag, const std::string& text);

}  // namespace karakv::bench
