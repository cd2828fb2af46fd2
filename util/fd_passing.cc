#include "util/fd_passing.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace karakv::fdpass {

absl::Status send_message(int sock, absl::string_view data, int fd) {
  iovec iov{const_cast<char*>(data.data()), data.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  ssize_t n;
  do {
    n = sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return absl::UnavailableError(absl::StrCat("sendmsg: ", std::strerror(errno)));
  if (size_t(n) != data.size()) {
    return absl::UnavailableError(absl::StrCat("sendmsg sent ", n, " of ", data.size(), " bytes"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> receive_message(int sock, size_t max, int* fd) {
  *fd = -1;
  std::string data(max, '\0');
  iovec iov{data.data(), data.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return absl::UnavailableError(absl::StrCat("recvmsg: ", std::strerror(errno)));
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int got;
      std::memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (*fd < 0) {
        *fd = got;
      } else {
        close(got);
      }
    }
  }
  if ((msg.msg_flags & MSG_CTRUNC) != 0 && *fd < 0) {
    return absl::InternalError("recvmsg: the attached descriptor was truncated");
  }
  data.resize(size_t(n));
  return data;
}

std::string ok_line(uint64_t bytes, int device) { return absl::StrCat("OK ", bytes, " ", device, "\n"); }

std::string error_line(const absl::Status& status) {
  std::string message(status.message());
  for (char& c : message) {
    if (c == '\n') c = ' ';
  }
  return absl::StrCat("ERR ", static_cast<int>(status.code()), " ", message, "\n");
}

absl::StatusOr<ReceivedFd> request_staging_fd(const std::string& socket_path, const std::string& session_id,
                                              uint64_t generation) {
  const std::string where = absl::StrCat("staging fd socket ", socket_path);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.empty() || socket_path.size() >= sizeof addr.sun_path) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not a usable Unix socket path"));
  }
  std::memcpy(addr.sun_path, socket_path.data(), socket_path.size());
  const int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sock < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  const timeval timeout{10, 0};
  setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  if (connect(sock, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    const int err = errno;
    close(sock);
    return absl::UnavailableError(absl::StrCat(
        where, ": connect: ", std::strerror(err),
        " (karakvd serves it beside its gRPC socket, --staging_fd_socket; the worker needs it mounted)"));
  }
  // A daemon that refuses the peer (its allow list) answers and closes without reading the request,
  // so the send may fail (EPIPE) with the answer already waiting: read it either way.
  const absl::Status sent = send_message(sock, absl::StrCat(session_id, " ", generation, "\n"), -1);
  int fd = -1;
  absl::StatusOr<std::string> reply = receive_message(sock, 1024, &fd);
  close(sock);
  if (!reply.ok()) {
    return absl::UnavailableError(absl::StrCat(where, ": ", sent.ok() ? reply.status().message() : sent.message()));
  }
  absl::string_view line = absl::StripSuffix(*reply, "\n");
  auto fail = [&](absl::Status s) {
    if (fd >= 0) close(fd);
    return s;
  };
  if (absl::ConsumePrefix(&line, "ERR ")) {
    const size_t space = line.find(' ');
    int code = 0;
    if (space == absl::string_view::npos || !absl::SimpleAtoi(line.substr(0, space), &code) || code <= 0 ||
        code > 16) {
      return fail(absl::InternalError(absl::StrCat(where, ": malformed reply '", *reply, "'")));
    }
    return fail(absl::Status(static_cast<absl::StatusCode>(code), line.substr(space + 1)));
  }
  ReceivedFd out;
  std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
  if (parts.size() != 3 || parts[0] != "OK" || !absl::SimpleAtoi(parts[1], &out.bytes) ||
      !absl::SimpleAtoi(parts[2], &out.device)) {
    return fail(absl::InternalError(absl::StrCat(where, ": malformed reply '", *reply, "'")));
  }
  if (fd < 0) return absl::InternalError(absl::StrCat(where, ": the reply carried no file descriptor"));
  out.fd = fd;
  return out;
}

std::string fd_socket_for_target(absl::string_view target) {
  if (!absl::ConsumePrefix(&target, "unix:")) return "";
  absl::ConsumePrefix(&target, "//");
  return absl::StrCat(target, ".fd");
}

}  // namespace karakv::fdpass
