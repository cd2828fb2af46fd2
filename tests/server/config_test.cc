// Config: byte sizes, config files, and refusal of inconsistent settings.
#include "server/config.h"

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <fstream>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "server/peer_gate.h"

ABSL_DECLARE_FLAG(int32_t, layers);
ABSL_DECLARE_FLAG(int32_t, ring_idle_threads);
ABSL_DECLARE_FLAG(int32_t, threads);
ABSL_DECLARE_FLAG(int32_t, malloc_arenas);
ABSL_DECLARE_FLAG(int32_t, malloc_tcache_max);
ABSL_DECLARE_FLAG(int32_t, malloc_mmap_threshold);
ABSL_DECLARE_FLAG(bool, mutex_deadlock_detection);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(std::string, pool_bytes);
ABSL_DECLARE_FLAG(std::string, prefix_cache);
ABSL_DECLARE_FLAG(std::string, prefix_tier);
ABSL_DECLARE_FLAG(std::string, prefix_tier_password_file);
ABSL_DECLARE_FLAG(int32_t, prefix_tier_timeout_ms);
ABSL_DECLARE_FLAG(double, prefix_cache_max_fraction);
ABSL_DECLARE_FLAG(int32_t, max_sessions);
ABSL_DECLARE_FLAG(std::string, max_message_bytes);
ABSL_DECLARE_FLAG(std::string, socket);
ABSL_DECLARE_FLAG(std::string, listen_tcp);
ABSL_DECLARE_FLAG(std::string, allowed_uids);
ABSL_DECLARE_FLAG(std::string, allowed_gids);

namespace karakv::server {
namespace {

TEST(ConfigTest, ParsesByteSizes) {
  EXPECT_EQ(*parse_bytes("1048576"), 1048576);
  EXPECT_EQ(*parse_bytes("64KiB"), 65536);
  EXPECT_EQ(*parse_bytes("512MiB"), 512ll << 20);
  EXPECT_EQ(*parse_bytes("2GiB"), 2ll << 30);
  EXPECT_EQ(*parse_bytes("1GB"), 1000000000);
  EXPECT_FALSE(parse_bytes("lots").ok());
  EXPECT_FALSE(parse_bytes("-5MiB").ok());
  EXPECT_FALSE(parse_bytes("99999999999GiB").ok());
}

class ConfigFileTest : public ::testing::Test {
 protected:
  absl::FlagSaver saver_;  // restores every flag after each test
  std::string write(const std::string& text) {
    // Per process: ctest runs each test in its own process, several at once.
    std::string path = absl::StrCat(::testing::TempDir(), "/karakvd_test.", getpid(), ".conf");
    std::ofstream(path) << text;
    return path;
  }
};

TEST_F(ConfigFileTest, AppliesValuesAndComments) {
  ASSERT_TRUE(apply_config_file(write("# geometry\nlayers = 5\n--dtype=bf16  # storage\n\npool_bytes=64MiB\n")).ok());
  auto c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->core.geometry.num_layers, 5);
  EXPECT_EQ(c->core.geometry.dtype, kernels::DType::kBFloat16);
  EXPECT_EQ(c->core.pool_bytes, 64ll << 20);
}

TEST_F(ConfigFileTest, RefusesUnknownSettingsAndBadValues) {
  absl::Status s = apply_config_file(write("colour = blue\n"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(":1: unknown setting 'colour'"), std::string::npos) << s;
  s = apply_config_file(write("layers = many\n"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(apply_config_file("/nonexistent/karakvd.conf").ok());
}

TEST_F(ConfigFileTest, RefusesInconsistentGeometry) {
  absl::SetFlag(&FLAGS_dtype, "fp8");
  EXPECT_NE(config_from_flags().status().message().find("--dtype=fp8"), std::string::npos);
  absl::SetFlag(&FLAGS_dtype, "fp16");
  absl::SetFlag(&FLAGS_layers, 0);
  EXPECT_NE(config_from_flags().status().message().find("num_layers=0"), std::string::npos);
  absl::SetFlag(&FLAGS_layers, 2);
  absl::SetFlag(&FLAGS_pool_bytes, "huge");
  EXPECT_NE(config_from_flags().status().message().find("--pool_bytes"), std::string::npos);
}

TEST_F(ConfigFileTest, PrefixCacheSettings) {
  auto c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->core.prefix_cache);
  EXPECT_EQ(c->core.prefix_cache_max_fraction, 1.0);
  EXPECT_FALSE(c->core.prefix_cache_shared_namespaces);
  ASSERT_TRUE(apply_config_file(write("prefix_cache = off\nprefix_cache_max_fraction = 0.25\n"
                                      "prefix_cache_shared_namespaces = true\n")).ok());
  c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->core.prefix_cache);
  EXPECT_EQ(c->core.prefix_cache_max_fraction, 0.25);
  EXPECT_TRUE(c->core.prefix_cache_shared_namespaces);
  absl::SetFlag(&FLAGS_prefix_cache, "maybe");
  EXPECT_NE(config_from_flags().status().message().find("--prefix_cache=maybe, expected on or off"), std::string::npos);
  absl::SetFlag(&FLAGS_prefix_cache, "on");
  absl::SetFlag(&FLAGS_prefix_cache_max_fraction, 1.5);
  EXPECT_NE(config_from_flags().status().message().find("--prefix_cache_max_fraction=1.5, expected 0..1"),
            std::string::npos);
}

TEST_F(ConfigFileTest, PrefixTierSettingsAreCheckedByName) {
  auto c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->prefix_tier.empty());
  EXPECT_EQ(c->prefix_tier_timeout_ms, 50);
  EXPECT_EQ(c->prefix_tier_queue_blocks, 256);
  ASSERT_TRUE(apply_config_file(write("prefix_tier = redis://cache:6379\nprefix_tier_timeout_ms = 80\n")).ok());
  c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->prefix_tier, "redis://cache:6379");
  EXPECT_EQ(c->prefix_tier_timeout_ms, 80);
  absl::SetFlag(&FLAGS_prefix_cache, "off");
  EXPECT_NE(config_from_flags().status().message().find("but --prefix_cache=off"), std::string::npos);
  absl::SetFlag(&FLAGS_prefix_cache, "on");
  absl::SetFlag(&FLAGS_prefix_tier_timeout_ms, 0);
  EXPECT_NE(config_from_flags().status().message().find("--prefix_tier_timeout_ms=0 is out of range"),
            std::string::npos);
  absl::SetFlag(&FLAGS_prefix_tier_timeout_ms, 50);
  absl::SetFlag(&FLAGS_prefix_tier, "cache:6379");
  EXPECT_NE(config_from_flags().status().message().find("expected redis://HOST:PORT"), std::string::npos);
  absl::SetFlag(&FLAGS_prefix_tier, "");
  absl::SetFlag(&FLAGS_prefix_tier_password_file, "/etc/pw");
  EXPECT_NE(config_from_flags().status().message().find("the password of --prefix_tier, which is empty"),
            std::string::npos);
}

TEST_F(ConfigFileTest, LimitsDefaultToNoneAndRefuseBadValues) {
  auto c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->core.max_sessions, 0);
  EXPECT_EQ(c->core.max_sequences_per_session, 0);
  EXPECT_EQ(c->core.tenant_block_quota, 0);
  EXPECT_EQ(c->max_message_bytes, 1 << 30);  // what the server always allowed
  ASSERT_TRUE(apply_config_file(
                  write("max_sessions = 8\nmax_sequences_per_session = 64\ntenant_block_quota = 1000\n"
                        "max_message_bytes = 4MiB\n"))
                  .ok());
  c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->core.max_sessions, 8);
  EXPECT_EQ(c->core.max_sequences_per_session, 64);
  EXPECT_EQ(c->core.tenant_block_quota, 1000);
  EXPECT_EQ(c->max_message_bytes, 4 << 20);
  absl::SetFlag(&FLAGS_max_sessions, -1);
  c = config_from_flags();
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("--max_sessions=-1"), std::string::npos) << c.status();
  absl::SetFlag(&FLAGS_max_sessions, 0);
  absl::SetFlag(&FLAGS_max_message_bytes, "4GiB");
  c = config_from_flags();
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("--max_message_bytes=4GiB out of range"), std::string::npos) << c.status();
}

TEST_F(ConfigFileTest, PeerAllowListsParseAndRefuseTcp) {
  absl::SetFlag(&FLAGS_allowed_uids, "0, 1000,1001");
  absl::SetFlag(&FLAGS_allowed_gids, "27");
  auto c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->allowed_uids, (std::vector<uint32_t>{0, 1000, 1001}));
  EXPECT_EQ(c->allowed_gids, (std::vector<uint32_t>{27}));
  absl::SetFlag(&FLAGS_allowed_uids, "0,root");
  c = config_from_flags();
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("--allowed_uids: 'root' is not a numeric id"), std::string::npos) << c.status();
  absl::SetFlag(&FLAGS_allowed_uids, "0");
  absl::SetFlag(&FLAGS_listen_tcp, "127.0.0.1:0");
  c = config_from_flags();
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("TCP has no peer credentials"), std::string::npos) << c.status();
}

TEST(PeerAllowListTest, AdmitsByUidOrGidAndEveryoneWhenEmpty) {
  PeerAllowList none;
  EXPECT_TRUE(none.admits(65534, 65534));
  PeerAllowList list{{0, 1000}, {27}};
  EXPECT_TRUE(list.admits(0, 0));
  EXPECT_TRUE(list.admits(1000, 1000));
  EXPECT_TRUE(list.admits(4242, 27));
  EXPECT_FALSE(list.admits(4242, 4242));
  EXPECT_FALSE(list.admits(65534, 0));
}

TEST_F(ConfigFileTest, RingIdleThreadsDefaultAndRefusal) {
  auto c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->ring_idle_threads, 16);
  ASSERT_TRUE(apply_config_file(write("ring_idle_threads = 0\n")).ok());
  c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->ring_idle_threads, 0);
  absl::SetFlag(&FLAGS_ring_idle_threads, -1);
  c = config_from_flags();
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("--ring_idle_threads=-1, expected 0..4096"), std::string::npos) << c.status();
}

// --threads: 0 (the default) leaves the count to the CPUs the daemon may use; a negative count is
// refused rather than taken as "default".
TEST_F(ConfigFileTest, KernelThreadsDefaultAndRefusal) {
  auto c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->kernel_threads, 0);
  ASSERT_TRUE(apply_config_file(write("threads = 3\n")).ok());
  c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->kernel_threads, 3);
  absl::SetFlag(&FLAGS_threads, -2);
  c = config_from_flags();
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("--threads=-2, expected 0 (the CPUs this process may use) or 1..4096"),
            std::string::npos)
      << c.status();
}

TEST_F(ConfigFileTest, MallocTcacheMaxDefaultAndRefusal) {
  auto c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->malloc_tcache_max, 256);
  absl::SetFlag(&FLAGS_malloc_tcache_max, -1);
  c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->malloc_tcache_max, -1);
  for (int bad : {-2, 4097}) {
    absl::SetFlag(&FLAGS_malloc_tcache_max, bad);
    c = config_from_flags();
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(absl::StrCat("--malloc_tcache_max=", bad,
                                                     ", expected -1 (glibc's default) or 0..4096 bytes")),
              std::string::npos)
        << c.status();
  }
}

TEST_F(ConfigFileTest, MallocMmapThresholdDefaultAndRefusal) {
  auto c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->malloc_mmap_threshold, 256 << 10);
  for (int good : {0, 4096, 32 << 20}) {
    absl::SetFlag(&FLAGS_malloc_mmap_threshold, good);
    c = config_from_flags();
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->malloc_mmap_threshold, good);
  }
  for (int bad : {-1, 4095, (32 << 20) + 1}) {
    absl::SetFlag(&FLAGS_malloc_mmap_threshold, bad);
    c = config_from_flags();
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(absl::StrCat("--malloc_mmap_threshold=", bad,
                                                     ", expected 0 (glibc's dynamic threshold) or 4096..33554432 bytes")),
              std::string::npos)
        << c.status();
  }
}

TEST_F(ConfigFileTest, MutexDeadlockDetectionIsOffUnlessAsked) {
  auto c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->mutex_deadlock_detection);
  absl::SetFlag(&FLAGS_mutex_deadlock_detection, true);
  c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->mutex_deadlock_detection);
}

// In a child process: sets `mode`, takes two Mutexes in one order and then in the other, exits 0.
// Returns the child's wait status.
int inverted_lock_order_in_child(absl::OnDeadlockCycle mode) {
  const pid_t pid = fork();
  if (pid == 0) {
    absl::SetMutexDeadlockDetectionMode(mode);
    absl::Mutex a, b;
    {
      absl::MutexLock l(&a);
      absl::MutexLock m(&b);
    }
    {
      absl::MutexLock l(&b);
      absl::MutexLock m(&a);
    }
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

// karakvd sets kIgnore unless --mutex_deadlock_detection: a libabsl built without NDEBUG (Debian's)
// otherwise checks every lock taken while another is held against a process-wide graph.
TEST(AbslMutexTest, IgnoreModeTurnsTheLockOrderCheckOff) {
  const int checked = inverted_lock_order_in_child(absl::OnDeadlockCycle::kAbort);
  if (WIFEXITED(checked) && WEXITSTATUS(checked) == 0) {
    GTEST_SKIP() << "this libabsl was built with NDEBUG: it has no lock-order check to turn off";
  }
  EXPECT_TRUE(WIFSIGNALED(checked) && WTERMSIG(checked) == SIGABRT) << "status " << checked;
  const int ignored = inverted_lock_order_in_child(absl::OnDeadlockCycle::kIgnore);
  EXPECT_TRUE(WIFEXITED(ignored) && WEXITSTATUS(ignored) == 0) << "status " << ignored;
}

TEST_F(ConfigFileTest, MallocArenasDefaultAndRefusal) {
  auto c = config_from_flags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->malloc_arenas, 2);
  absl::SetFlag(&FLAGS_malloc_arenas, -3);
  c = config_from_flags();
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("--malloc_arenas=-3, expected 0 (glibc's default) or 1..1024"),
            std::string::npos)
      << c.status();
}

}  // namespace
}  // namespace karakv::server
