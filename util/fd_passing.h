// File descriptors over a Unix socket (SCM_RIGHTS), and the staging fd socket's exchange: VMM
// device staging (staging_kind CUDA_VMM_FD) hands each worker its region as a file descriptor,
// which gRPC cannot carry. karakvd listens beside its gRPC socket (--staging_fd_socket, default
// "<socket>.fd"); a worker connects, sends one line "<session id> <staging generation>\n" and
// receives one reply: "OK <bytes> <device>\n" with the descriptor attached, or
// "ERR <absl status code> <message>\n" without one. One request per connection.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace karakv::fdpass {

// Sends `data` in one message, with `fd` attached (SCM_RIGHTS) when fd >= 0. The caller keeps `fd`.
absl::Status send_message(int sock, absl::string_view data, int fd);
// Receives one message of at most `max` bytes; *fd is the descriptor attached to it (close-on-exec)
// or -1. Descriptors beyond the first are closed.
absl::StatusOr<std::string> receive_message(int sock, size_t max, int* fd);

// The reply lines.
std::string ok_line(uint64_t bytes, int device);
std::string error_line(const absl::Status& status);

struct ReceivedFd {
  int fd = -1;  // the caller owns it
  uint64_t bytes = 0;
  int device = -1;
};
// The worker's side: asks the daemon at `socket_path` for the region of (session, generation).
// The daemon's refusal comes back with its status code and message.
absl::StatusOr<ReceivedFd> request_staging_fd(const std::string& socket_path, const std::string& session_id,
                                              uint64_t generation);

// The fd socket a gRPC target implies: "unix:/run/karakv.sock" -> "/run/karakv.sock.fd"; empty for
// targets that are not Unix sockets.
std::string fd_socket_for_target(absl::string_view target);

}  // namespace karakv::fdpass
