// Isolation and limits against a real karakvd: a worker of another tenant gets PERMISSION_DENIED
// from every sequence RPC on a sequence it does not own and changes nothing (the victim's outputs
// stay bitwise equal to an undisturbed twin's); --max_message_bytes bounds inline tensors; the
// session limit holds over the wire; --allowed_uids / --allowed_gids admit Unix-socket peers by
// their kernel credentials.
#include <fcntl.h>
#include <grp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "common/synthetic.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "karakv/v1/karakv.grpc.pb.h"
#include <grpcpp/grpcpp.h>
#include "karakv/client.h"
#include "tests/integration/daemon.h"

namespace karakv {
namespace {

using ::testing::HasSubstr;
using synthetic::Tensor;
using testing::Daemon;
namespace v1 = ::karakv::v1;

constexpr uint64_t kSeed = 5;

std::vector<std::string> flags() {
  return {"--layers=3", "--q_heads=6", "--kv_heads=2", "--head_dim=32", "--block_size=16", "--dtype=fp32",
          "--pool_bytes=16MiB", "--check_invariants"};
}

ClientOptions as_tenant(const Daemon& d, const std::string& tenant, uint64_t staging = 0) {
  ClientOptions o = d.options(staging);
  o.tenant = tenant;
  return o;
}

// Every value of a sequence is keyed by `key`, so two sequences with one key hold equal data.
void append_prompt(Client& c, uint64_t id, int n, uint64_t key) {
  Buffer k = Client::alloc_heap(c.append_bytes(n)), v = Client::alloc_heap(c.append_bytes(n));
  synthetic::fill_prompt(k.data(), c.geometry(), kSeed, Tensor::kKey, key, 0, n);
  synthetic::fill_prompt(v.data(), c.geometry(), kSeed, Tensor::kValue, key, 0, n);
  auto r = c.Append(id, n, k, v);
  ASSERT_TRUE(r.ok()) << r.status();
}

// One decode step (all layers) of `ids`, all keyed by `key` at position `pos`; returns the outputs.
std::vector<float> decode_step(Client& c, const std::vector<uint64_t>& ids, uint64_t key, int64_t pos) {
  const Geometry& g = c.geometry();
  const int n = static_cast<int>(ids.size());
  const size_t kv_tok = g.kv_token_elems() * kernels::dtype_size(g.dtype);
  Buffer k = Client::alloc_heap(c.step_kv_bytes(n)), v = Client::alloc_heap(c.step_kv_bytes(n));
  Buffer q = Client::alloc_heap(c.q_bytes(n)), out = Client::alloc_heap(c.q_bytes(n));
  std::vector<float> all;
  for (int l = 0; l < g.num_layers; ++l) {
    for (int s = 0; s < n; ++s) {
      synthetic::fill_token(k.data() + s * kv_tok, g, kSeed, Tensor::kKey, key, l, pos);
      synthetic::fill_token(v.data() + s * kv_tok, g, kSeed, Tensor::kValue, key, l, pos);
      synthetic::fill_query(q.as<float>().data() + s * g.q_token_elems(), g, kSeed, key, l, pos);
    }
    auto r = c.Step(l, ids, k, v, q, out);
    EXPECT_TRUE(r.ok()) << r.status();
    all.insert(all.end(), out.as<float>().begin(), out.as<float>().end());
  }
  return all;
}

void expect_denied(const absl::Status& s, const char* rpc) {
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << rpc << ": " << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("belongs to another tenant")) << rpc;
}

// Tries every sequence RPC on `victim` from a session of another tenant.
void attack(Client& intruder, uint64_t victim) {
  const Geometry& g = intruder.geometry();
  Buffer k = Client::alloc_heap(intruder.append_bytes(4)), v = Client::alloc_heap(intruder.append_bytes(4));
  expect_denied(intruder.Append(victim, 4, k, v).status(), "Append");
  const std::vector<uint64_t> ids = {victim};
  Buffer sk = Client::alloc_heap(intruder.step_kv_bytes(1)), sv = Client::alloc_heap(intruder.step_kv_bytes(1));
  Buffer q = Client::alloc_heap(intruder.q_bytes(1)), out = Client::alloc_heap(intruder.q_bytes(1));
  expect_denied(intruder.Step(0, ids, sk, sv, q, out).status(), "Step");
  expect_denied(intruder.Attend(victim, 0, 1, q, out), "Attend");
  Buffer rk = Client::alloc_heap(intruder.append_bytes(64)), rv = Client::alloc_heap(intruder.append_bytes(64));
  Buffer pos = Client::alloc_heap(size_t(4) * 64 * g.num_layers * g.num_kv_heads);
  expect_denied(intruder.ReadKV(victim, rk, rv, pos).status(), "ReadKV");
  expect_denied(intruder.Fork(victim).status(), "Fork");
  expect_denied(intruder.Compact(victim).status(), "Compact");
  expect_denied(intruder.Compact(victim, /*dry_run=*/true).status(), "Compact(dry_run)");
  expect_denied(intruder.Release(victim).status(), "Release");
  auto listed = intruder.ListSequences();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty()) << "another tenant's session lists sequences it does not own";
}

TEST(IsolationTest, AnotherTenantGetsPermissionDeniedAndChangesNothing) {
  Daemon d(flags());
  ASSERT_TRUE(d.ready());
  auto owner = Client::Attach(as_tenant(d, "tenant-a"));
  ASSERT_TRUE(owner.ok()) << owner.status();
  auto intruder = Client::Attach(as_tenant(d, "tenant-b"));
  ASSERT_TRUE(intruder.ok()) << intruder.status();
  Client& c = **owner;
  // The victim and its twin hold the same data; only the victim is attacked.
  const uint64_t victim = *c.CreateSequence("kara");
  const uint64_t twin = *c.CreateSequence("kara");
  constexpr int kPrompt = 40;
  append_prompt(c, victim, kPrompt, 9);
  append_prompt(c, twin, kPrompt, 9);
  attack(**intruder, victim);
  for (int t = 0; t < 4; ++t) {
    std::vector<float> out = decode_step(c, {victim, twin}, 9, kPrompt + t);
    const size_t row = c.geometry().q_token_elems();
    for (int l = 0; l < c.geometry().num_layers; ++l) {
      const float* base = out.data() + size_t(l) * 2 * row;
      EXPECT_EQ(0, std::memcmp(base, base + row, row * 4)) << "step " << t << " layer " << l;
    }
    if (t == 1) attack(**intruder, victim);  // again, between decode steps
  }
  // Resident K/V and positions equal too.
  const Geometry& g = c.geometry();
  const int n = kPrompt + 4;
  auto read = [&](uint64_t id) {
    Buffer k = Client::alloc_heap(c.append_bytes(n)), v = Client::alloc_heap(c.append_bytes(n));
    Buffer p = Client::alloc_heap(size_t(4) * n * g.num_layers * g.num_kv_heads);
    EXPECT_EQ(*c.ReadKV(id, k, v, p), n);
    std::vector<uint8_t> all(k.data(), k.data() + k.size());
    all.insert(all.end(), v.data(), v.data() + v.size());
    all.insert(all.end(), p.data(), p.data() + p.size());
    return all;
  };
  EXPECT_EQ(read(victim), read(twin));
  auto seqs = c.ListSequences();
  ASSERT_TRUE(seqs.ok());
  ASSERT_EQ(seqs->size(), 2u);
  for (const auto& s : *seqs) EXPECT_EQ(s.length, uint32_t(n));
  auto st = c.Stats(true);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->invariant_error, "");
  EXPECT_EQ(st->sequences, 2u);
}

TEST(IsolationTest, MaxMessageBytesRefusesLargeInlineTensorsButNotStaging) {
  auto f = flags();
  f.push_back("--max_message_bytes=64KiB");
  Daemon d(f);
  ASSERT_TRUE(d.ready());
  auto c = Client::Attach(as_tenant(d, "t", 1 << 20));
  ASSERT_TRUE(c.ok()) << c.status();
  const uint64_t id = *(*c)->CreateSequence();
  // 50 tokens inline: 2 x 50 x 768 bytes of K/V in one message, over 64 KiB.
  Buffer k = Client::alloc_heap((*c)->append_bytes(50)), v = Client::alloc_heap((*c)->append_bytes(50));
  auto r = (*c)->Append(id, 50, k, v);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("65536"));
  EXPECT_EQ((*c)->Stats(true)->blocks_used, 0u);
  // The same tensors through the staging region travel outside the message.
  Buffer sk = *(*c)->alloc((*c)->append_bytes(50)), sv = *(*c)->alloc((*c)->append_bytes(50));
  EXPECT_EQ(*(*c)->Append(id, 50, sk, sv), 50);
  // Small inline appends still pass.
  Buffer k2 = Client::alloc_heap((*c)->append_bytes(8)), v2 = Client::alloc_heap((*c)->append_bytes(8));
  EXPECT_EQ(*(*c)->Append(id, 8, k2, v2), 58);
}

TEST(IsolationTest, SessionLimitRefusesAttachOverTheWire) {
  auto f = flags();
  f.push_back("--max_sessions=2");  // the readiness probe's session is detached before the test
  Daemon d(f);
  ASSERT_TRUE(d.ready());
  auto a = Client::Attach(as_tenant(d, "t"));
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = Client::Attach(as_tenant(d, "t"));
  ASSERT_TRUE(b.ok()) << b.status();
  auto c = Client::Attach(as_tenant(d, "t"));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("limit 2, wanted 1 more (karakvd --max_sessions)"));
  ASSERT_TRUE((*a)->Detach().ok());
  EXPECT_TRUE(Client::Attach(as_tenant(d, "t")).ok());
}

// The operator views (ListSequences without a session, Inspect) need no session, so they must not
// hand out session ids: an id is all it takes to use a session's sequences.
TEST(IsolationTest, OperatorViewsDoNotRevealSessionIds) {
  Daemon d(flags());
  ASSERT_TRUE(d.ready());
  auto owner = Client::Attach(as_tenant(d, "tenant-a"));
  ASSERT_TRUE(owner.ok()) << owner.status();
  const uint64_t seq = *(*owner)->CreateSequence("none");
  const std::string secret = (*owner)->session_id();
  ASSERT_FALSE(secret.empty());
  // The owner's own listing still shows its id.
  auto own = (*owner)->ListSequences();
  ASSERT_TRUE(own.ok());
  ASSERT_EQ(own->size(), 1u);
  EXPECT_EQ((*own)[0].session_id, secret);
  // The raw RPCs, as any client that can connect may send them.
  auto stub = v1::KaraKV::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  v1::ListSequencesRequest lreq;  // no session: the operator view
  v1::ListSequencesReply lrep;
  grpc::ClientContext lctx;
  ASSERT_TRUE(stub->ListSequences(&lctx, lreq, &lrep).ok());
  ASSERT_EQ(lrep.sequences_size(), 1);
  v1::InspectRequest ireq;
  ireq.set_sequence_id(seq);
  v1::InspectReply irep;
  grpc::ClientContext ictx;
  ASSERT_TRUE(stub->Inspect(&ictx, ireq, &irep).ok());
  for (const std::string& shown : {lrep.sequences(0).session_id(), irep.info().session_id()}) {
    EXPECT_NE(shown, secret);
    EXPECT_THAT(shown, HasSubstr("session#"));
    EXPECT_EQ(shown.find(secret.substr(0, 8)), std::string::npos) << shown;
  }
  // Both views tag the session the same way, so an operator can still group sequences by session.
  EXPECT_EQ(lrep.sequences(0).session_id(), irep.info().session_id());
}

// Runs `karakv stats` against `target` as user and group nobody (65534); returns its exit code
// (126: nobody cannot run the CLI here) and its output.
int cli_as_nobody(const std::string& target, std::string* output) {
  const std::string out_path = ::testing::TempDir() + "/karakv-nobody-" + std::to_string(getpid()) + ".out";
  std::string cli = KARAKV_CLI_PATH, target_flag = "--target=" + target, timeout = "--timeout=3", cmd = "stats";
  char* argv[] = {cli.data(), target_flag.data(), timeout.data(), cmd.data(), nullptr};
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0) _exit(125);
    if (setgroups(0, nullptr) != 0 || setgid(65534) != 0 || setuid(65534) != 0) _exit(125);
    if (access(cli.c_str(), X_OK) != 0) _exit(126);
    execv(argv[0], argv);
    _exit(126);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  std::ifstream in(out_path);
  std::stringstream ss;
  ss << in.rdbuf();
  *output = ss.str();
  unlink(out_path.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(IsolationTest, PeerCredentialsAdmitOnlyAllowedUidsAndGids) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another user (running as uid " << geteuid() << ")";
  // Admits root only. The gated channel keeps the daemon's other settings (message size here).
  auto f = flags();
  f.insert(f.end(), {"--allowed_uids=0", "--max_message_bytes=64KiB"});
  Daemon d(f);
  ASSERT_TRUE(d.ready()) << "root is on --allowed_uids but could not attach";
  auto c = Client::Attach(as_tenant(d, "t"));
  ASSERT_TRUE(c.ok()) << c.status();
  const uint64_t id = *(*c)->CreateSequence();
  Buffer k = Client::alloc_heap((*c)->append_bytes(50)), v = Client::alloc_heap((*c)->append_bytes(50));
  EXPECT_EQ((*c)->Append(id, 50, k, v).status().code(), absl::StatusCode::kResourceExhausted);
  Buffer k2 = Client::alloc_heap((*c)->append_bytes(8)), v2 = Client::alloc_heap((*c)->append_bytes(8));
  EXPECT_EQ(*(*c)->Append(id, 8, k2, v2), 8);
  // Let any local user reach the socket file, so that only the credential check stands in the way.
  const std::string path = d.target().substr(5);
  ASSERT_EQ(chmod(path.c_str(), 0777), 0) << std::strerror(errno);
  std::string out;
  const int refused = cli_as_nobody(d.target(), &out);
  if (refused == 126) GTEST_SKIP() << "user nobody cannot execute " << KARAKV_CLI_PATH << " on this machine";
  EXPECT_NE(refused, 0) << "nobody was admitted: " << out;
  EXPECT_THAT(out, HasSubstr("UNAVAILABLE"));
  // Root's session is untouched by the refused connection.
  EXPECT_EQ((*c)->ListSequences()->size(), 1u);

  // The same user is admitted through --allowed_gids.
  auto f2 = flags();
  f2.insert(f2.end(), {"--allowed_uids=0", "--allowed_gids=65534"});
  Daemon d2(f2);
  ASSERT_TRUE(d2.ready());
  ASSERT_EQ(chmod(d2.target().substr(5).c_str(), 0777), 0);
  const int admitted = cli_as_nobody(d2.target(), &out);
  EXPECT_EQ(admitted, 0) << out;
  EXPECT_THAT(out, HasSubstr("blocks"));
  EXPECT_EQ(d2.stop(), 0) << "SIGTERM with the peer gate did not exit 0";
  c->reset();
  EXPECT_EQ(d.stop(), 0);
}

}  // namespace
}  // namespace karakv
