// Starts a real karakvd on a temporary Unix socket for one test and stops it with SIGTERM.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "karakv/client.h"
#include "tests/integration/spawn.h"

namespace karakv::testing {

class Daemon {
 public:
  // `args` are extra karakvd flags (geometry, pool size, lease ...); `socket` reuses a path (a
  // daemon restarted where another one was), empty makes a new one.
  explicit Daemon(std::vector<std::string> args, std::string socket = "") {
    static int counter = 0;
    socket_ = socket.empty()
                  ? "/tmp/karakv-test-" + std::to_string(getpid()) + "-" + std::to_string(counter++) + ".sock"
                  : socket;
    // $KARAKV_TEST_KARAKVD: another karakvd binary (scripts/gpu-check.sh runs the carried one).
    const char* karakvd = std::getenv("KARAKV_TEST_KARAKVD");
    args.insert(args.begin(), {karakvd != nullptr && *karakvd != '\0' ? std::string(karakvd) : std::string(KARAKVD_PATH),
                               "--socket=" + socket_, "--log_level=warn", "--threads=2"});
    pid_ = spawn_child(std::move(args));  // a test that crashes must not leave its daemon running
    ready_ = wait_ready();
  }
  ~Daemon() {
    if (pid_ > 0) stop();
    unlink((socket_ + ".alive").c_str());  // the heartbeat a killed daemon leaves behind
  }

  bool ready() const { return ready_; }
  std::string target() const { return "unix:" + socket_; }
  pid_t pid() const { return pid_; }
  const std::string& socket() const { return socket_; }

  // SIGKILL: a crash. It leaves its socket file behind, as a crashed daemon does.
  void kill_now() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  // SIGTERM, then the exit status (or -1 if it had to be killed).
  int stop() {
    kill(pid_, SIGTERM);
    int status = 0;
    for (int i = 0; i < 200; ++i) {
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    kill(pid_, SIGKILL);
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return -1;
  }

  ClientOptions options(uint64_t staging_bytes = 8 << 20) const {
    ClientOptions o;
    o.target = target();
    o.staging_bytes = staging_bytes;
    o.rpc_timeout = absl::Seconds(20);
    return o;
  }

 private:
  bool wait_ready() {
    for (int i = 0; i < 200; ++i) {
      if (access(socket_.c_str(), F_OK) == 0) {
        ClientOptions o = options(0);
        o.heartbeat = false;
        auto c = Client::Attach(o);
        if (c.ok()) return true;
      }
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  std::string socket_;
  pid_t pid_ = -1;
  bool ready_ = false;
};

// A whole file's bytes ("" when it cannot be read): outputs workers wrote, files under /proc.
inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// A plain HTTP/1.0 GET on loopback (a daemon's /metrics); returns the body, or "" when the
// connection or the request fails.
inline std::string http_get(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string resp;
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      write(fd, req.data(), req.size()) == ssize_t(req.size())) {
    char buf[4096];
    ssize_t n;
    while ((n = read(fd, buf, sizeof buf)) > 0) resp.append(buf, n);
  }
  close(fd);
  const size_t body = resp.find("\r\n\r\n");
  return body == std::string::npos ? "" : resp.substr(body + 4);
}

// Runs `cmd` through the shell; returns its standard output and sets *exit_code (-1 when it did
// not exit normally).
inline std::string run_command(const std::string& cmd, int* exit_code) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) {
    *exit_code = -1;
    return out;
  }
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

// A TCP port nobody listens on now (the kernel's pick for port 0 on loopback).
inline int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// A daemon listening on a loopback port the kernel called free: `args_for(port)` gives its flags.
// Tests run in parallel, so the port can be taken between the pick and the daemon's bind (the
// daemon then exits, not ready): that costs another pick, never the test. `*port` is the port of
// the daemon returned.
template <typename ArgsFor>
std::unique_ptr<Daemon> start_on_free_port(ArgsFor args_for, int* port) {
  for (int attempt = 0;; ++attempt) {
    *port = free_port();
    auto d = std::make_unique<Daemon>(args_for(*port));
    if (d->ready() || attempt == 4) return d;
  }
}

// A daemon with `args`, serving /metrics on a free loopback port (start_on_free_port).
inline std::unique_ptr<Daemon> start_with_metrics(const std::vector<std::string>& args, int* port) {
  return start_on_free_port(
      [&](int p) {
        std::vector<std::string> flags = args;
        flags.push_back("--metrics_listen=127.0.0.1:" + std::to_string(p));
        return flags;
      },
      port);
}

}  // namespace karakv::testing
