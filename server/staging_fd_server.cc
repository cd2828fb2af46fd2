#include "server/staging_fd_server.h"

#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "spdlog/spdlog.h"
#include "util/fd_passing.h"

namespace karakv::server {

absl::StatusOr<std::unique_ptr<StagingFdServer>> StagingFdServer::listen(const std::string& socket_path,
                                                                         PeerAllowList allow, StagingFdLookup lookup) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.empty() || socket_path.size() >= sizeof addr.sun_path) {
    return absl::InvalidArgumentError(absl::StrCat("--staging_fd_socket '", socket_path, "': expected a path of 1 to ",
                                                   sizeof addr.sun_path - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, socket_path.data(), socket_path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
  unlink(socket_path.c_str());  // a stale socket from a crashed daemon
  // Created owner-only (umask), then opened to others only when the allow list gates them.
  const mode_t old_mask = umask(0177);
  const bool bound = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  const int bind_errno = errno;
  umask(old_mask);
  if (!bound || ::listen(fd, SOMAXCONN) != 0 || chmod(socket_path.c_str(), allow.empty() ? 0600 : 0666) != 0) {
    const int e = bound ? errno : bind_errno;
    close(fd);
    if (bound) unlink(socket_path.c_str());
    return absl::UnavailableError(absl::StrCat("cannot listen on the staging fd socket ", socket_path, ": ",
                                               std::strerror(e)));
  }
  const int wake = eventfd(0, EFD_CLOEXEC);
  if (wake < 0) {
    close(fd);
    unlink(socket_path.c_str());
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  std::unique_ptr<StagingFdServer> s(new StagingFdServer(socket_path, fd, wake, std::move(allow), std::move(lookup)));
  s->thread_ = std::thread([p = s.get()] { p->run(); });
  return s;
}

StagingFdServer::~StagingFdServer() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof one);
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
  close(wake_fd_);
  unlink(path_.c_str());
}

void StagingFdServer::run() {
  accept_peers(listen_fd_, wake_fd_, SOCK_CLOEXEC, "staging fd socket",
               [this](int conn, absl::StatusOr<PeerCredentials> peer) {
                 // A silent peer must not hold the socket: one short request, one reply.
                 const timeval timeout{2, 0};
                 setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
                 setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
                 handle(conn, peer);
                 close(conn);
               });
}

void StagingFdServer::handle(int conn, const absl::StatusOr<PeerCredentials>& peer) {
  auto refuse = [&](const absl::Status& s) {
    refused_.fetch_add(1);
    [[maybe_unused]] absl::Status sent = fdpass::send_message(conn, fdpass::error_line(s), -1);
  };
  if (!peer.ok()) {
    spdlog::warn("staging fd socket: refused a connection: {}", std::string(peer.status().message()));
    refuse(absl::PermissionDeniedError("staging fd socket: the peer's credentials (SO_PEERCRED) are unavailable"));
    return;
  }
  if (!allow_.empty() && !allow_.admits(peer->uid, peer->gid)) {
    spdlog::warn("staging fd socket: refused pid {} uid {} gid {}: neither is on --allowed_uids / --allowed_gids",
                 peer->pid, peer->uid, peer->gid);
    refuse(absl::PermissionDeniedError(absl::StrCat("staging fd socket: uid ", peer->uid, " gid ", peer->gid,
                                                    " is not on karakvd's --allowed_uids / --allowed_gids")));
    return;
  }
  int stray = -1;
  absl::StatusOr<std::string> request = fdpass::receive_message(conn, 512, &stray);
  if (stray >= 0) close(stray);
  if (!request.ok()) return;  // the peer went away or stayed silent; nobody to answer
  absl::string_view line = absl::StripSuffix(*request, "\n");
  std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
  uint64_t generation = 0;
  if (parts.size() != 2 || parts[0].empty() || !absl::SimpleAtoi(parts[1], &generation)) {
    refuse(absl::InvalidArgumentError(
        "staging fd socket: expected one line '<session id> <staging generation>' (AttachReply's values)"));
    return;
  }
  const std::string session(parts[0]);
  absl::StatusOr<StagingFdGrant> grant = lookup_(session, generation);
  if (!grant.ok()) {
    spdlog::info("staging fd socket: refused session {} generation {} (pid {}): {}", session, generation, peer->pid,
                 std::string(grant.status().message()));
    refuse(grant.status());
    return;
  }
  granted_.fetch_add(1);  // before the send, so a peer that has its descriptor sees the count
  absl::Status sent = fdpass::send_message(conn, fdpass::ok_line(grant->bytes, grant->device), grant->fd);
  close(grant->fd);  // the worker's copy, if sent, is the only one left
  if (!sent.ok()) {
    spdlog::warn("staging fd socket: sending session {}'s descriptor failed: {}", session,
                 std::string(sent.message()));
    return;
  }
  spdlog::info("staging fd socket: sent session {}'s staging region ({} bytes) to pid {}", session, grant->bytes,
               peer->pid);
}

}  // namespace karakv::server
