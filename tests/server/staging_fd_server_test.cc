// The staging fd socket (VMM device staging, CUDA_VMM_FD) without a GPU: SCM_RIGHTS round trips of
// ordinary descriptors (a pipe, a memfd), the refusals and their codes, the socket file's mode and
// its SO_PEERCRED allow list, and the core's lookup refusing unknown sessions and other kinds.
#include "server/staging_fd_server.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "karakv/kernels/backend.h"
#include "server/core.h"
#include "spdlog/spdlog.h"
#include "test_geometry.h"
#include "util/fd_passing.h"

namespace karakv::server {
namespace {

std::string temp_socket(const char* tag) {
  return std::string("/tmp/karakv-fd-test-") + tag + "-" + std::to_string(getpid()) + ".sock.fd";
}

TEST(FdPassingTest, APipeDescriptorRoundTripsOverASocketPair) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  int pipe_fds[2];
  ASSERT_EQ(pipe2(pipe_fds, O_CLOEXEC), 0);
  ASSERT_TRUE(fdpass::send_message(pair[0], "hello", pipe_fds[1]).ok());
  close(pipe_fds[1]);  // the receiver's copy keeps the pipe's write end open
  int got = -1;
  absl::StatusOr<std::string> msg = fdpass::receive_message(pair[1], 64, &got);
  ASSERT_TRUE(msg.ok()) << msg.status();
  EXPECT_EQ(*msg, "hello");
  ASSERT_GE(got, 0);
  EXPECT_NE(fcntl(got, F_GETFD) & FD_CLOEXEC, 0);
  ASSERT_EQ(write(got, "xy", 2), 2);
  close(got);
  char buf[4] = {};
  EXPECT_EQ(read(pipe_fds[0], buf, sizeof buf), 2);
  EXPECT_STREQ(buf, "xy");
  // A message without a descriptor: none comes out.
  ASSERT_TRUE(fdpass::send_message(pair[0], "plain", -1).ok());
  msg = fdpass::receive_message(pair[1], 64, &got);
  ASSERT_TRUE(msg.ok());
  EXPECT_EQ(got, -1);
  close(pipe_fds[0]);
  close(pair[0]);
  close(pair[1]);
}

TEST(FdPassingTest, TheFdSocketOfAUnixTarget) {
  EXPECT_EQ(fdpass::fd_socket_for_target("unix:/run/karakv.sock"), "/run/karakv.sock.fd");
  EXPECT_EQ(fdpass::fd_socket_for_target("unix:///run/karakv.sock"), "/run/karakv.sock.fd");
  EXPECT_EQ(fdpass::fd_socket_for_target("localhost:50051"), "");
}

// A memfd stands in for the VMM allocation's descriptor.
class StagingFdServerTest : public ::testing::Test {
 protected:
  void SetUp() override { spdlog::set_level(spdlog::level::err); }

  std::unique_ptr<StagingFdServer> serve(const std::string& path, PeerAllowList allow = {}) {
    auto s = StagingFdServer::listen(path, std::move(allow), [this](const std::string& session, uint64_t generation)
                                                                  -> absl::StatusOr<StagingFdGrant> {
      if (session != "s1") return absl::NotFoundError("session " + session + " unknown");
      if (generation != 7) {
        return absl::FailedPreconditionError("stale staging handle: generation " + std::to_string(generation) +
                                             ", the region is generation 7");
      }
      const int fd = memfd_create("karakv-fd-test", MFD_CLOEXEC);
      if (fd < 0 || pwrite(fd, "region", 6, 0) != 6) return absl::InternalError("memfd");
      lookups_.fetch_add(1);
      return StagingFdGrant{fd, 6, 3};
    });
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }

  std::atomic<int> lookups_{0};
};

TEST_F(StagingFdServerTest, SendsTheSessionsDescriptor) {
  const std::string path = temp_socket("grant");
  auto server = serve(path);
  ASSERT_NE(server, nullptr);
  absl::StatusOr<fdpass::ReceivedFd> got = fdpass::request_staging_fd(path, "s1", 7);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->bytes, 6u);
  EXPECT_EQ(got->device, 3);
  char buf[8] = {};
  EXPECT_EQ(pread(got->fd, buf, 6, 0), 6);
  EXPECT_STREQ(buf, "region");
  close(got->fd);
  EXPECT_EQ(server->granted(), 1u);
  EXPECT_EQ(lookups_.load(), 1);
}

TEST_F(StagingFdServerTest, RefusesAnUnknownSessionAndAStaleGenerationWithoutADescriptor) {
  const std::string path = temp_socket("refuse");
  auto server = serve(path);
  ASSERT_NE(server, nullptr);
  absl::StatusOr<fdpass::ReceivedFd> unknown = fdpass::request_staging_fd(path, "nope", 7);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
  EXPECT_THAT(std::string(unknown.status().message()), ::testing::HasSubstr("session nope unknown"));
  absl::StatusOr<fdpass::ReceivedFd> stale = fdpass::request_staging_fd(path, "s1", 6);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
  EXPECT_THAT(std::string(stale.status().message()), ::testing::HasSubstr("stale staging handle"));
  EXPECT_EQ(server->refused(), 2u);
  EXPECT_EQ(server->granted(), 0u);
}

TEST_F(StagingFdServerTest, RefusesAMalformedRequest) {
  const std::string path = temp_socket("malformed");
  auto server = serve(path);
  ASSERT_NE(server, nullptr);
  absl::StatusOr<fdpass::ReceivedFd> got = fdpass::request_staging_fd(path, "s1 extra", 7);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  EXPECT_THAT(std::string(got.status().message()), ::testing::HasSubstr("<session id> <staging generation>"));
}

TEST_F(StagingFdServerTest, TheSocketIsOwnerOnlyWithoutAnAllowListAndRemovedAtTheEnd) {
  const std::string path = temp_socket("mode");
  {
    auto server = serve(path);
    ASSERT_NE(server, nullptr);
    struct stat st {};
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, 0600u);
  }
  struct stat st {};
  EXPECT_NE(stat(path.c_str(), &st), 0);
}

TEST_F(StagingFdServerTest, AnAllowListGatesPeersBySoPeercred) {
  const std::string path = temp_socket("allow");
  PeerAllowList others;  // neither this process's uid nor its gid
  others.uids = {getuid() + 1};
  others.gids = {getgid() + 1};
  {
    auto server = serve(path, others);
    ASSERT_NE(server, nullptr);
    struct stat st {};
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0666u);  // the list gates, not the file mode
    // The daemon answers a refused peer and closes without reading its request, so the request's
    // send may fail first: the refusal must still be what the worker sees, every time.
    for (int i = 0; i < 200; ++i) {
      absl::StatusOr<fdpass::ReceivedFd> got = fdpass::request_staging_fd(path, "s1", 7);
      ASSERT_EQ(got.status().code(), absl::StatusCode::kPermissionDenied) << "attempt " << i << ": " << got.status();
      ASSERT_THAT(std::string(got.status().message()), ::testing::HasSubstr("--allowed_uids"));
    }
    EXPECT_EQ(lookups_.load(), 0);
  }
  PeerAllowList me;
  me.uids = {getuid()};
  auto server = serve(path, me);
  ASSERT_NE(server, nullptr);
  absl::StatusOr<fdpass::ReceivedFd> got = fdpass::request_staging_fd(path, "s1", 7);
  ASSERT_TRUE(got.ok()) << got.status();
  close(got->fd);
}

TEST_F(StagingFdServerTest, NoDaemonListeningSaysWhere) {
  absl::StatusOr<fdpass::ReceivedFd> got = fdpass::request_staging_fd(temp_socket("absent"), "s1", 7);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(got.status().message()), ::testing::HasSubstr("--staging_fd_socket"));
}

// The daemon's lookup on the CPU backend: no session can hold VMM staging, so an shm session is
// refused as another kind and an unknown session as unknown.
TEST(CoreVmmStagingTest, RefusesUnknownSessionsAndOtherKinds) {
  spdlog::set_level(spdlog::level::err);
  CoreConfig rc;
  rc.geometry = testing::small_test_geometry(kernels::DType::kFloat32);
  rc.pool_bytes = 32 * rc.geometry.block_bytes();
  auto core = *Core::create(rc, kernels::make_cpu_backend(1));
  auto unknown = core->vmm_staging("no-such-session", 1);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
  auto attached = core->attach("w", "t", 1 << 16, kernels::Geometry{});
  ASSERT_TRUE(attached.ok()) << attached.status();
  auto shm = core->vmm_staging(attached->session_id, 1);
  EXPECT_EQ(shm.status().code(), absl::StatusCode::kFailedPrecondition) << shm.status();
  EXPECT_THAT(std::string(shm.status().message()), ::testing::HasSubstr("staging_kind shm"));
  EXPECT_THAT(std::string(shm.status().message()), ::testing::HasSubstr("CUDA_VMM_FD"));
}

}  // namespace
}  // namespace karakv::server
