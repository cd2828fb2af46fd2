#include "server/peer_gate.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "grpcpp/server.h"
#include "grpcpp/server_posix.h"
#include "spdlog/spdlog.h"

namespace karakv::server {

bool PeerAllowList::admits(uid_t uid, gid_t gid) const {
  if (empty()) return true;
  return std::find(uids.begin(), uids.end(), uid) != uids.end() ||
         std::find(gids.begin(), gids.end(), gid) != gids.end();
}

absl::StatusOr<std::vector<uint32_t>> parse_id_list(const std::string& text, const char* flag) {
  std::vector<uint32_t> ids;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    uint32_t id = 0;
    if (!absl::SimpleAtoi(item, &id) || id == uint32_t(-1)) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", item,
                                                     "' is not a numeric id; expected e.g. 0,1000,1001"));
    }
    ids.push_back(id);
  }
  return ids;
}

absl::StatusOr<std::unique_ptr<PeerGate>> PeerGate::listen(const std::string& socket_path, PeerAllowList allow) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("--socket=", socket_path, " is longer than ",
                                                   sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, socket_path.c_str(), socket_path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
  unlink(socket_path.c_str());  // a stale socket from a crashed daemon
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    const int e = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot listen on ", socket_path, ": ", std::strerror(e)));
  }
  const int wake = eventfd(0, EFD_CLOEXEC);
  if (wake < 0) {
    close(fd);
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  return std::unique_ptr<PeerGate>(new PeerGate(fd, wake, std::move(allow)));
}

PeerGate::~PeerGate() {
  stop();
  if (wake_fd_ >= 0) close(wake_fd_);
}

void PeerGate::serve(grpc::Server* server) {
  thread_ = std::thread([this, server] { run(server); });
}

void PeerGate::stop() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof one);
    thread_.join();
  }
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    listen_fd_ = -1;
  }
}

void accept_peers(int listen_fd, int wake_fd, int accept_flags, const char* what,
                  const std::function<void(int conn, absl::StatusOr<PeerCredentials> peer)>& on_connection) {
  pollfd fds[2] = {{listen_fd, POLLIN, 0}, {wake_fd, POLLIN, 0}};
  while (true) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("{}: poll: {}", what, std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int conn = accept4(listen_fd, nullptr, nullptr, accept_flags);
    if (conn < 0) {
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
        spdlog::warn("{}: accept: {}", what, std::strerror(errno));
      }
      continue;
    }
    ucred cred{};
    socklen_t len = sizeof cred;
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof cred) {
      on_connection(conn, absl::PermissionDeniedError(
                              absl::StrCat("SO_PEERCRED failed: ", len != sizeof cred ? "short reply" :
                                                                                       std::strerror(errno))));
      continue;
    }
    on_connection(conn, PeerCredentials{cred.pid, cred.uid, cred.gid});
  }
}

void PeerGate::run(grpc::Server* server) {
  accept_peers(listen_fd_, wake_fd_, SOCK_CLOEXEC | SOCK_NONBLOCK, "peer gate",
               [&](int conn, absl::StatusOr<PeerCredentials> peer) {
                 if (!peer.ok()) {
                   spdlog::warn("peer gate: refused a connection: {}", std::string(peer.status().message()));
                   refused_.fetch_add(1);
                   close(conn);
                   return;
                 }
                 if (!allow_.admits(peer->uid, peer->gid)) {
                   spdlog::warn("peer gate: refused a connection from pid {} uid {} gid {}: neither is on "
                                "--allowed_uids / --allowed_gids",
                                peer->pid, peer->uid, peer->gid);
                   refused_.fetch_add(1);
                   close(conn);
                   return;
                 }
                 spdlog::debug("peer gate: admitted pid {} uid {} gid {}", peer->pid, peer->uid, peer->gid);
                 grpc::AddInsecureChannelFromFd(server, conn);  // gRPC owns the descriptor from here
               });
}

}  // namespace karakv::server
