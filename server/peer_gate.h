// Peer credentials on the Unix socket. gRPC's C++ API does not expose SO_PEERCRED, so when an allow
// list is configured karakvd listens on the socket itself: it accepts each connection, reads the
// kernel's credentials of the connecting process (SO_PEERCRED: uid, gid, pid as of connect, which the
// client cannot forge), closes connections whose uid and gid are both off the lists (logging why),
// and hands the others to the gRPC server (grpc::AddInsecureChannelFromFd).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace grpc {
class Server;
}

namespace karakv::server {

struct PeerAllowList {
  std::vector<uid_t> uids;
  std::vector<gid_t> gids;
  // Both empty: every local peer is admitted (the file mode of the socket still applies).
  bool empty() const { return uids.empty() && gids.empty(); }
  // A peer is admitted when its uid is on `uids` or its (primary) gid is on `gids`.
  bool admits(uid_t uid, gid_t gid) const;
};

// Parses "0,1000, 1001" into ids; names the bad item.
absl::StatusOr<std::vector<uint32_t>> parse_id_list(const std::string& text, const char* flag);

// What the kernel says of a connected Unix-socket peer (SO_PEERCRED, as of its connect).
struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

// The accept loop both karakvd sockets that check peers run (the gRPC socket's gate, the staging fd
// socket): until `wake_fd` becomes readable (or poll fails, logged), accepts each connection with
// `accept_flags` (SOCK_CLOEXEC and the like) and calls `on_connection` with it and the peer's
// credentials, or the reason they are unavailable; `on_connection` owns the descriptor. `what` names
// the socket in logs ("peer gate").
void accept_peers(int listen_fd, int wake_fd, int accept_flags, const char* what,
                  const std::function<void(int conn, absl::StatusOr<PeerCredentials> peer)>& on_connection);

class PeerGate {
 public:
  // Binds and listens on `socket_path` (a stale socket file is removed first).
  static absl::StatusOr<std::unique_ptr<PeerGate>> listen(const std::string& socket_path, PeerAllowList allow);
  ~PeerGate();
  PeerGate(const PeerGate&) = delete;
  PeerGate& operator=(const PeerGate&) = delete;

  // Starts accepting connections for `server` (already started).
  void serve(grpc::Server* server);
  // Stops accepting and closes the listening socket; connections already handed over stay.
  void stop();
  uint64_t refused() const { return refused_.load(); }

 private:
  PeerGate(int listen_fd, int wake_fd, PeerAllowList allow)
      : listen_fd_(listen_fd), wake_fd_(wake_fd), allow_(std::move(allow)) {}
  void run(grpc::Server* server);

  int listen_fd_;
  int wake_fd_;  // eventfd: stop() wakes the accept loop
  PeerAllowList allow_;
  std::thread thread_;
  std::atomic<uint64_t> refused_{0};
};

}  // namespace karakv::server
