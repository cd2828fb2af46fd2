// The staging fd socket: hands VMM device staging regions (staging_kind CUDA_VMM_FD) to workers as
// file descriptors over a Unix socket (SCM_RIGHTS), for workers that do not share karakvd's PID
// namespace and so cannot open a CUDA IPC handle. The exchange is in util/fd_passing.h.
//
// A worker connects after Attach and sends its session id and the staging generation from the
// AttachReply; `lookup` answers with a fresh descriptor (exported per request) or refuses (session
// unknown, generation stale, session not VMM staging). The descriptor is closed here after it is
// sent, so the worker's copy is the only one outside the driver. With an allow list the peer's
// SO_PEERCRED uid / gid are checked first, as on the gRPC socket (peer_gate.h). The socket file is
// created mode 0600 (karakvd's user only) without an allow list and 0666 with one (the list gates).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "server/peer_gate.h"

namespace karakv::server {

struct StagingFdGrant {
  int fd = -1;  // owned by the server from here on: closed after it is sent
  uint64_t bytes = 0;
  int device = -1;
};
using StagingFdLookup =
    std::function<absl::StatusOr<StagingFdGrant>(const std::string& session_id, uint64_t generation)>;

class StagingFdServer {
 public:
  // Binds `socket_path` (a stale file there is removed first) and starts serving on a thread.
  static absl::StatusOr<std::unique_ptr<StagingFdServer>> listen(const std::string& socket_path, PeerAllowList allow,
                                                                  StagingFdLookup lookup);
  // Stops serving and removes the socket file.
  ~StagingFdServer();
  StagingFdServer(const StagingFdServer&) = delete;
  StagingFdServer& operator=(const StagingFdServer&) = delete;

  const std::string& path() const { return path_; }
  uint64_t granted() const { return granted_.load(); }  // lookups answered with a descriptor
  uint64_t refused() const { return refused_.load(); }

 private:
  StagingFdServer(std::string path, int listen_fd, int wake_fd, PeerAllowList allow, StagingFdLookup lookup)
      : path_(std::move(path)), listen_fd_(listen_fd), wake_fd_(wake_fd), allow_(std::move(allow)),
        lookup_(std::move(lookup)) {}
  void run();
  void handle(int conn, const absl::StatusOr<PeerCredentials>& peer);

  const std::string path_;
  const int listen_fd_;
  const int wake_fd_;
  const PeerAllowList allow_;
  const StagingFdLookup lookup_;
  std::thread thread_;
  std::atomic<uint64_t> granted_{0};
  std::atomic<uint64_t> refused_{0};
};

}  // namespace karakv::server
