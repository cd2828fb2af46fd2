// Limits and isolation inside the core: session and sequence limits, per-tenant block quotas
// and the staging size limit refuse with a message naming the limit, the value asked and the flag,
// and leave the state (and the pool invariant) exactly as it was; another tenant's sequence is
// PERMISSION_DENIED; a staging object cannot be opened by another local user.
#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/synthetic.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core.h"
#include "tests/server/core_driver.h"
#include "tests/server/test_geometry.h"

namespace karakv::server {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kSeed = 11;

class LimitsTest : public ::testing::Test {
 protected:
  void make(const CoreConfig& overrides) {
    CoreConfig c = overrides;
    c.geometry = testing::small_test_geometry(kernels::DType::kFloat32);
    c.pool_bytes = int64_t(64) * c.geometry.block_bytes();
    auto r = Core::create(c, kernels::make_cpu_backend(1));
    ASSERT_TRUE(r.ok()) << r.status();
    reg_ = std::move(*r);
  }

  std::string attach(const std::string& tenant, uint64_t staging = 0) {
    auto a = reg_->attach("w", tenant, staging, kernels::Geometry{});
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? a->session_id : "";
  }

  absl::StatusOr<int32_t> append(const std::string& session, uint64_t seq, int n, int64_t pos0 = 0,
                                 absl::Span<const int32_t> ids = {}) {
    return testing::append_synthetic(*reg_, kSeed, session, seq, n, pos0, ids);
  }

  absl::Status step(const std::string& session, const std::vector<uint64_t>& ids, int64_t pos) {
    return testing::step_synthetic(*reg_, kSeed, session, ids, pos);
  }

  // Everything a refused request could have changed, checked against the pool invariant.
  std::string state() {
    EXPECT_TRUE(reg_->check_invariants().ok()) << reg_->check_invariants();
    CoreStats st = reg_->stats();
    std::string s = absl::StrCat("used=", st.blocks_used, " free=", st.blocks_free, " tokens=", st.resident_tokens,
                                 " sessions=", st.sessions, " sequences=", st.sequences);
    for (const auto& i : reg_->list_sequences("")) {
      absl::StrAppend(&s, " [", i.id, " ", i.session_id, " len=", i.length, " blocks=", i.blocks, "]");
    }
    return s;
  }

  std::unique_ptr<Core> reg_;
};

// Shared-memory objects this process made (the staging regions are named /karakv-<pid>-...).
int own_shm_objects() {
  const std::string prefix = absl::StrCat("karakv-", getpid(), "-");
  int n = 0;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) n += std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0;
    closedir(d);
  }
  return n;
}

TEST_F(LimitsTest, MaxSessionsRefusesAttachAndLeavesNoStaging) {
  CoreConfig c;
  c.max_sessions = 2;
  make(c);
  const int shm_before = own_shm_objects();
  const std::string a = attach("t", 1 << 16);
  attach("t", 1 << 16);
  const std::string before = state();
  auto r = reg_->attach("w", "t", 1 << 16, kernels::Geometry{});
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("2 sessions attached, limit 2, wanted 1 more (karakvd --max_sessions)"));
  EXPECT_EQ(state(), before);
  EXPECT_EQ(own_shm_objects(), shm_before + 2);  // the refused session's staging object is gone
  ASSERT_TRUE(reg_->detach(a).ok());
  EXPECT_TRUE(reg_->attach("w", "t", 1 << 16, kernels::Geometry{}).ok());
}

TEST_F(LimitsTest, MaxSequencesPerSessionRefusesCreateAndFork) {
  CoreConfig c;
  c.max_sequences_per_session = 2;
  make(c);
  const std::string s = attach("t");
  const uint64_t first = *reg_->create_sequence(s, {});
  ASSERT_EQ(*append(s, first, 6), 6);
  ASSERT_TRUE(reg_->fork_sequence(s, first).ok());
  const std::string before = state();
  auto created = reg_->create_sequence(s, {});
  ASSERT_EQ(created.status().code(), absl::StatusCode::kResourceExhausted) << created.status();
  EXPECT_THAT(std::string(created.status().message()),
              HasSubstr("holds 2 sequences, limit 2, wanted 1 more (karakvd --max_sequences_per_session)"));
  auto forked = reg_->fork_sequence(s, first);
  ASSERT_EQ(forked.status().code(), absl::StatusCode::kResourceExhausted) << forked.status();
  EXPECT_THAT(std::string(forked.status().message()), HasSubstr("--max_sequences_per_session"));
  EXPECT_EQ(state(), before);
  // The limit is per session: another session of the same tenant still creates.
  const std::string other = attach("t");
  EXPECT_TRUE(reg_->create_sequence(other, {}).ok());
  ASSERT_TRUE(reg_->release_sequence(s, first).ok());
  EXPECT_TRUE(reg_->create_sequence(s, {}).ok());
}

TEST_F(LimitsTest, TenantBlockQuotaRefusesAppendStepForkAndPrefixCreate) {
  CoreConfig c;
  c.tenant_block_quota = 3;
  make(c);
  const std::string a = attach("tenant-a");
  const std::string b = attach("tenant-b");
  const uint64_t seq = *reg_->create_sequence(a, {});
  std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6, 7, 8};
  ASSERT_EQ(*append(a, seq, 8, 0, ids), 8);  // 2 blocks, published to the prefix cache
  std::string before = state();

  auto r = append(a, seq, 8, 8);  // 2 more blocks: 4 > 3
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("tenant tenant-a holds 2 blocks, quota 3, wanted 2 (karakvd --tenant_block_quota)"));
  EXPECT_EQ(state(), before);
  auto f = reg_->fork_sequence(a, seq);  // the child would hold the parent's 2 blocks too
  ASSERT_EQ(f.status().code(), absl::StatusCode::kResourceExhausted) << f.status();
  EXPECT_THAT(std::string(f.status().message()), HasSubstr("holds 2 blocks, quota 3, wanted 2"));
  SequenceOptions from_prefix;
  from_prefix.prefix_token_ids = ids;
  auto p = reg_->create_sequence_from_prefix(a, from_prefix);
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("holds 2 blocks, quota 3, wanted 2"));
  EXPECT_EQ(state(), before);

  // Up to the quota exactly, then a decode step that needs a fourth block is refused.
  ASSERT_EQ(*append(a, seq, 4, 8), 12);
  before = state();
  absl::Status s = step(a, {seq}, 12);
  ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("tenant tenant-a holds 3 blocks, quota 3, wanted 1"));
  EXPECT_EQ(state(), before);

  // The quota is per tenant: tenant-b takes its own 3 blocks while tenant-a is at its quota.
  const uint64_t other = *reg_->create_sequence(b, {});
  EXPECT_EQ(*append(b, other, 12), 12);
  auto over = append(b, other, 1, 12);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  // Releasing gives the quota back.
  ASSERT_TRUE(reg_->release_sequence(a, seq).ok());
  const uint64_t again = *reg_->create_sequence(a, {});
  EXPECT_EQ(*append(a, again, 12), 12);
  EXPECT_EQ(step(a, {again}, 12).code(), absl::StatusCode::kResourceExhausted);  // 3 held + 1 wanted
  EXPECT_TRUE(reg_->check_invariants().ok());
}

TEST_F(LimitsTest, NoLimitsByDefault) {
  make(CoreConfig{});
  const std::string s = attach("t");
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(reg_->attach("w", "t", 0, kernels::Geometry{}).ok());
  std::vector<uint64_t> ids;
  for (int i = 0; i < 30; ++i) ids.push_back(*reg_->create_sequence(s, {}));
  for (uint64_t id : ids) ASSERT_EQ(*append(s, id, 5), 5);  // 2 blocks each, all of one tenant
  EXPECT_EQ(reg_->stats().blocks_used, 60);
  EXPECT_TRUE(reg_->check_invariants().ok());
}

TEST_F(LimitsTest, StagingLimitNamesItsFlag) {
  CoreConfig c;
  c.max_staging_bytes = 1 << 20;
  make(c);
  auto r = reg_->attach("w", "t", (1 << 20) + 1, kernels::Geometry{});
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("staging_bytes 1048577 exceeds the daemon's limit of 1048576 (karakvd --max_staging_bytes)"));
  EXPECT_EQ(reg_->stats().sessions, 0);
}

TEST_F(LimitsTest, AnotherTenantsSequenceIsPermissionDenied) {
  make(CoreConfig{});
  const std::string owner = attach("tenant-a");
  const std::string intruder = attach("tenant-b");
  const uint64_t seq = *reg_->create_sequence(owner, {});
  ASSERT_EQ(*append(owner, seq, 6), 6);
  const std::string before = state();
  auto denied = [](const absl::Status& s) {
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("belongs to another tenant"));
  };
  denied(append(intruder, seq, 1, 6).status());
  denied(step(intruder, {seq}, 6));
  denied(reg_->fork_sequence(intruder, seq).status());
  denied(reg_->compact(intruder, seq, false).status());
  denied(reg_->release_sequence(intruder, seq).status());
  std::vector<float> q(reg_->geometry().q_token_elems()), out(q.size());
  denied(reg_->attend(intruder, seq, 0, 1, ConstBytes(reinterpret_cast<const uint8_t*>(q.data()), q.size() * 4),
                      MutableBytes(reinterpret_cast<uint8_t*>(out.data()), out.size() * 4), 0.0f));
  bool asked = false;
  denied(reg_->read_kv(intruder, seq, [&](int32_t) -> absl::StatusOr<ReadKVTargets> {
           asked = true;
           return absl::InternalError("must not be reached");
         }).status());
  EXPECT_FALSE(asked);
  EXPECT_TRUE(reg_->list_sequences(intruder).empty());
  EXPECT_EQ(state(), before);
}

// DESIGN.md: a staging region is mode 0600. A child that drops to nobody (65534) must not open it,
// neither for writing nor for reading.
TEST(StagingIsolationTest, AnotherLocalUserCannotOpenTheStagingObject) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to drop privileges to another user (running as uid " << geteuid() << ")";
  auto region = StagingRegion::create(1 << 16);
  ASSERT_TRUE(region.ok()) << region.status();
  const std::string name = (*region)->name();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Exit codes: 0 refused with EACCES (expected), 1 privileges not dropped, 2 opened, 3 other errno.
    if (setgroups(0, nullptr) != 0 || setgid(65534) != 0 || setuid(65534) != 0 || getuid() != 65534) _exit(1);
    for (int flags : {O_RDWR, O_RDONLY}) {
      const int fd = shm_open(name.c_str(), flags, 0);
      if (fd >= 0) _exit(2);
      if (errno != EACCES) _exit(3);
    }
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: could not drop privileges, 2: the object opened, 3: not EACCES";
  // The owner itself still opens it: the refusal above is about the user, not a missing object.
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  EXPECT_GE(fd, 0) << std::strerror(errno);
  if (fd >= 0) close(fd);
}

}  // namespace
}  // namespace karakv::server
