// A real redis-server on a loopback port for one test (Debian's redis-server), alone or as a node
// of a Redis Cluster made by the test; it dies with the test process.
#pragma once

#include <arpa/inet.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/spawn.h"

namespace karakv::testing {

// A TCP port nothing listens on now (its +10000 cluster bus port too).
inline int free_redis_port() {
  for (int attempt = 0; attempt < 100; ++attempt) {
    int ports[2] = {0, 0};
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t len = sizeof(a);
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      close(fd);
      continue;
    }
    ports[0] = ntohs(a.sin_port);
    close(fd);
    if (ports[0] + 10000 > 65535) continue;
    fd = socket(AF_INET, SOCK_STREAM, 0);
    a.sin_port = htons(uint16_t(ports[0] + 10000));
    const bool bus_free = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    close(fd);
    if (bus_free) return ports[0];
  }
  return 0;
}

class RedisServer {
 public:
  // `extra`: more redis-server options ("--cluster-enabled", "yes", ...).
  explicit RedisServer(std::vector<std::string> extra = {}, int port = 0) : extra_(std::move(extra)) {
    port_ = port > 0 ? port : free_redis_port();
    dir_ = "/tmp/karakv-redis-" + std::to_string(getpid()) + "-" + std::to_string(port_);
    start();
  }
  ~RedisServer() {
    kill_now();
    std::system(("rm -rf " + dir_).c_str());
  }

  bool ready() const { return ready_; }
  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

  void start() {
    std::system(("mkdir -p " + dir_).c_str());
    std::vector<std::string> args = {"redis-server", "--port", std::to_string(port_), "--bind", "127.0.0.1",
                                     "--save", "", "--appendonly", "no", "--dir", dir_, "--loglevel", "warning", "--logfile", dir_ + "/redis.log"};
    args.insert(args.end(), extra_.begin(), extra_.end());  // PATH is searched: Debian's redis-server
    pid_ = spawn_child(std::move(args));
    ready_ = false;
    for (int i = 0; i < 200 && !ready_; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
      const std::string pong = command({"PING"});
      ready_ = pong == "PONG" || pong.rfind("NOAUTH", 0) == 0;  // up, with the default user off
    }
  }
  void kill_now() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  // One command on a fresh connection: a string, status or integer reply as text, an error as
  // "ERR..." text, nil as "(nil)", anything else (or no connection) as "".
  std::string command(const std::vector<std::string>& args) const {
    timeval tv{2, 0};
    redisContext* c = redisConnectWithTimeout("127.0.0.1", port_, tv);
    if (c == nullptr || c->err) {
      if (c) redisFree(c);
      return "";
    }
    std::vector<const char*> argv;
    std::vector<size_t> len;
    for (const auto& a : args) {
      argv.push_back(a.data());
      len.push_back(a.size());
    }
    auto* r = static_cast<redisReply*>(redisCommandArgv(c, int(argv.size()), argv.data(), len.data()));
    std::string out;
    if (r != nullptr) {
      if (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS || r->type == REDIS_REPLY_ERROR) {
        out.assign(r->str, r->len);
      } else if (r->type == REDIS_REPLY_INTEGER) {
        out = std::to_string(r->integer);
      } else if (r->type == REDIS_REPLY_NIL) {
        out = "(nil)";
      }
      freeReplyObject(r);
    }
    redisFree(c);
    return out;
  }

 private:
  std::vector<std::string> extra_;
  int port_ = 0;
  pid_t pid_ = -1;
  std::string dir_;
  bool ready_ = false;
};

// Three (or more) cluster-enabled nodes on loopback, the 16384 slots split evenly, met and with
// cluster_state:ok.
class RedisCluster {
 public:
  explicit RedisCluster(int n = 3) {
    for (int i = 0; i < n; ++i) {
      nodes_.push_back(std::make_unique<RedisServer>(
          std::vector<std::string>{"--cluster-enabled", "yes", "--cluster-node-timeout", "5000", "--cluster-config-file",
                                   "nodes-" + std::to_string(i) + ".conf"}));
      if (!nodes_.back()->ready()) return;
    }
    for (int i = 0; i < n; ++i) {
      const int lo = 16384 * i / n, hi = 16384 * (i + 1) / n - 1;
      if (nodes_[i]->command({"CLUSTER", "ADDSLOTSRANGE", std::to_string(lo), std::to_string(hi)}) != "OK") return;
      if (i > 0 && nodes_[i]->command({"CLUSTER", "MEET", "127.0.0.1", std::to_string(nodes_[0]->port())}) != "OK") {
        return;
      }
    }
    for (int i = 0; i < 400 && !ready_; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      ready_ = true;
      for (auto& node : nodes_) {
        ready_ = ready_ && node->command({"CLUSTER", "INFO"}).find("cluster_state:ok") != std::string::npos &&
                 node->command({"CLUSTER", "INFO"}).find("cluster_known_nodes:" + std::to_string(n)) !=
                     std::string::npos;
      }
    }
  }
  bool ready() const { return ready_; }
  RedisServer& node(int i) { return *nodes_[size_t(i)]; }
  int size() const { return static_cast<int>(nodes_.size()); }
  // The node serving `slot` (by the slot ranges above).
  int owner(int slot) const {
    const int n = static_cast<int>(nodes_.size());
    for (int i = 0; i < n; ++i) {
      if (slot <= 16384 * (i + 1) / n - 1) return i;
    }
    return n - 1;
  }
  std::string id(int i) { return nodes_[size_t(i)]->command({"CLUSTER", "MYID"}); }

 private:
  std::vector<std::unique_ptr<RedisServer>> nodes_;
  bool ready_ = false;
};

}  // namespace karakv::testing
