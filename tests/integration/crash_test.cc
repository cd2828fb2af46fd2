// Crash safety against real processes. Workers are this binary re-executed (each a separate process
// with its own SDK client): two of them are killed with SIGKILL while they decode, one stopped
// between two layers of a decode step, one in a tight loop of Steps on the fast path. The others'
// outputs must be bitwise equal to a run without the victims, and everything the victims held
// (sessions, sequences, blocks, staging mappings) must go back to the daemon when their leases run
// out. The measured time is printed (docs/RELIABILITY.md records it).
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <atomic>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/synthetic.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "karakv/client.h"
#include "karakv/v1/karakv.grpc.pb.h"
#include "tests/integration/daemon.h"

namespace karakv {
namespace {

using ::testing::HasSubstr;
using synthetic::Tensor;
using testing::Daemon;
using testing::read_file;
namespace v1 = ::karakv::v1;

constexpr uint64_t kSeed = 11;
constexpr int kSteps = 40;       // decode steps of a surviving worker
constexpr int kPauseStep = 20;   // where a survivor stops (mid-step, after layer 0) until told to go on
constexpr int kVictimStep = 9;   // where the stopped victim hangs (mid-step, after layers 0 and 1)
const int kPrompts[2] = {37, 20};

std::vector<std::string> daemon_flags() {
  return {"--layers=3", "--q_heads=6", "--kv_heads=2", "--head_dim=32", "--block_size=16", "--dtype=fp16",
          "--pool_bytes=16MiB", "--lease_seconds=1"};
}

// ---- worker processes (KARAKV_CRASH_WORKER=role): protocol on stdout, one line per event ----
//   "seqs A B"  its two sequence ids, after the prompts are in
//   "paused"    it stopped inside a decode step and waits for one byte on stdin
//   "looping"   (spinner) it completed a decode step and goes on forever
// A survivor writes its outputs (all Step outputs, in order, fp32) to KARAKV_CRASH_OUT.

int fail(const std::string& what) {
  std::fprintf(stderr, "crash worker: %s\n", what.c_str());
  return 1;
}

void say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

struct Decoder {
  Decoder(Client& client, uint64_t k) : c(client), key(k) {}
  Client& c;
  const uint64_t key;  // data of sequence s is keyed by key + s, so twins of a worker see equal data
  uint64_t ids[2] = {0, 0};
  Buffer k, v, q, out;

  absl::Status start() {
    const Geometry& g = c.geometry();
    c.reset_staging();
    for (int s = 0; s < 2; ++s) {
      auto id = c.CreateSequence();
      if (!id.ok()) return id.status();
      ids[s] = *id;
      auto pk = c.alloc(c.append_bytes(kPrompts[s])), pv = c.alloc(c.append_bytes(kPrompts[s]));
      if (!pk.ok() || !pv.ok()) return absl::ResourceExhaustedError("staging");
      synthetic::fill_prompt(pk->data(), g, kSeed, Tensor::kKey, key + s, 0, kPrompts[s]);
      synthetic::fill_prompt(pv->data(), g, kSeed, Tensor::kValue, key + s, 0, kPrompts[s]);
      if (auto r = c.Append(*id, kPrompts[s], *pk, *pv); !r.ok()) return r.status();
    }
    c.reset_staging();
    k = *c.alloc(c.step_kv_bytes(2));
    v = *c.alloc(c.step_kv_bytes(2));
    q = *c.alloc(c.q_bytes(2));
    out = *c.alloc(c.q_bytes(2));
    return absl::OkStatus();
  }

  absl::Status step(int t, int layer, std::vector<float>* all) {
    const Geometry& g = c.geometry();
    const size_t kv_tok = g.kv_token_elems() * kernels::dtype_size(g.dtype);
    for (int s = 0; s < 2; ++s) {
      const int64_t pos = kPrompts[s] + t;
      synthetic::fill_token(k.data() + s * kv_tok, g, kSeed, Tensor::kKey, key + s, layer, pos);
      synthetic::fill_token(v.data() + s * kv_tok, g, kSeed, Tensor::kValue, key + s, layer, pos);
      synthetic::fill_query(q.as<float>().data() + s * g.q_token_elems(), g, kSeed, key + s, layer, pos);
    }
    auto r = c.Step(layer, ids, k, v, q, out);
    if (!r.ok()) return r.status();
    if (all) all->insert(all->end(), out.as<float>().begin(), out.as<float>().end());
    return absl::OkStatus();
  }
};

absl::StatusOr<std::unique_ptr<Client>> attach(bool fast_path) {
  ClientOptions o;
  o.target = std::getenv("KARAKV_TEST_TARGET");
  o.worker_id = std::getenv("KARAKV_CRASH_WORKER");
  o.staging_bytes = 1 << 20;
  o.fast_path = fast_path;
  o.rpc_timeout = absl::Seconds(20);
  return Client::Attach(o);
}

// survivor: decodes kSteps steps, stopping once inside step kPauseStep (after layer 0) until the
// parent writes a byte; writes its outputs and releases its sequences.
// hang: stops inside step kVictimStep (after layers 0 and 1) and waits for a byte that never comes.
int decode_worker(const std::string& role, uint64_t key, bool fast_path) {
  auto c = attach(fast_path);
  if (!c.ok()) return fail(c.status().ToString());
  if (fast_path && !(*c)->fast_path()) return fail("fast path not granted");
  Decoder d(**c, key);
  if (auto s = d.start(); !s.ok()) return fail(s.ToString());
  say(absl::StrCat("seqs ", d.ids[0], " ", d.ids[1]));
  const Geometry& g = (*c)->geometry();
  const bool hang = role == "hang";
  std::vector<float> all;
  for (int t = 0; t < kSteps; ++t) {
    for (int l = 0; l < g.num_layers; ++l) {
      if ((!hang && t == kPauseStep && l == 1) || (hang && t == kVictimStep && l == 2)) {
        say("paused");
        char b;
        if (read(0, &b, 1) != 1) return fail("stdin closed while paused");
      }
      if (auto s = d.step(t, l, &all); !s.ok()) return fail(s.ToString());
    }
  }
  std::ofstream f(std::getenv("KARAKV_CRASH_OUT"), std::ios::binary);
  f.write(reinterpret_cast<const char*>(all.data()), all.size() * sizeof(float));
  if (!f) return fail("cannot write the outputs");
  for (uint64_t id : d.ids) {
    if (auto r = (*c)->Release(id); !r.ok()) return fail(r.status().ToString());
  }
  return 0;
}

// spinner: Steps on the fast path without end; every 32 steps it releases its sequences and
// starts over (so the pool does not fill), and reports once it is looping.
int spin_worker(uint64_t key) {
  auto c = attach(true);
  if (!c.ok()) return fail(c.status().ToString());
  if (!(*c)->fast_path()) return fail("fast path not granted");
  bool told = false;
  for (;;) {
    Decoder d(**c, key);
    if (auto s = d.start(); !s.ok()) return fail(s.ToString());
    for (int t = 0; t < 32; ++t) {
      for (int l = 0; l < (*c)->geometry().num_layers; ++l) {
        if (auto s = d.step(t, l, nullptr); !s.ok()) return fail(s.ToString());
      }
      if (!told) say(absl::StrCat("looping ", d.ids[0], " ", d.ids[1]));
      told = true;
    }
    for (uint64_t id : d.ids) (*c)->Release(id).IgnoreError();
  }
}

// ---- the parent's side ----

struct Worker {
  pid_t pid = -1;
  int to_child = -1;        // the worker's stdin
  FILE* from_child = nullptr;  // the worker's stdout
  std::string out_path;

  std::string line() {
    char buf[256];
    if (!std::fgets(buf, sizeof buf, from_child)) return "";
    std::string s(buf);
    if (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }
  void go() { ASSERT_EQ(write(to_child, "g", 1), 1); }
  int wait() {
    int status = 0;
    waitpid(pid, &status, 0);
    pid = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  ~Worker() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    if (to_child >= 0) close(to_child);
    if (from_child) std::fclose(from_child);
  }
};

std::unique_ptr<Worker> spawn(const Daemon& d, const std::string& role, uint64_t key, bool fast_path,
                              const std::string& out_path = "") {
  int in[2], out[2];
  if (pipe(in) != 0 || pipe(out) != 0) return nullptr;
  auto w = std::make_unique<Worker>();
  w->out_path = out_path;
  w->pid = fork();
  if (w->pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    dup2(in[0], 0);
    dup2(out[1], 1);
    close(in[1]);
    close(out[0]);
    setenv("KARAKV_CRASH_WORKER", role.c_str(), 1);
    setenv("KARAKV_CRASH_KEY", std::to_string(key).c_str(), 1);
    setenv("KARAKV_CRASH_FAST", fast_path ? "1" : "0", 1);
    setenv("KARAKV_CRASH_OUT", out_path.c_str(), 1);
    setenv("KARAKV_TEST_TARGET", d.target().c_str(), 1);
    execl("/proc/self/exe", "crash_integration_test", static_cast<char*>(nullptr));
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  w->to_child = in[1];
  w->from_child = fdopen(out[0], "r");
  return w;
}

std::vector<uint64_t> ids_of(const std::string& line) {
  std::vector<uint64_t> ids;
  for (absl::string_view part : absl::StrSplit(line, ' ')) {
    uint64_t id;
    if (absl::SimpleAtoi(part, &id)) ids.push_back(id);
  }
  return ids;
}

// Staging objects the daemon still maps (they are unlinked from /dev/shm once the worker has
// mapped them; what keeps their memory is these mappings).
int staging_mappings(pid_t daemon) {
  std::ifstream maps("/proc/" + std::to_string(daemon) + "/maps");
  std::set<std::string> objects;
  std::string l;
  const std::string prefix = "/dev/shm/karakv-" + std::to_string(daemon) + "-";
  while (std::getline(maps, l)) {
    const size_t at = l.find(prefix);
    if (at != std::string::npos) objects.insert(l.substr(at, l.find(' ', at) - at));
  }
  return static_cast<int>(objects.size());
}

// Names of the daemon's staging objects still in /dev/shm.
int staging_names(pid_t daemon) {
  int n = 0;
  const std::string prefix = "karakv-" + std::to_string(daemon) + "-";
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* e = readdir(dir)) n += std::string(e->d_name).rfind(prefix, 0) == 0 ? 1 : 0;
    closedir(dir);
  }
  return n;
}

// Every sequence of the daemon (the operator view: no session).
std::vector<v1::SequenceInfo> all_sequences(const Daemon& d) {
  auto stub = v1::KaraKV::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::ListSequencesReply r;
  EXPECT_TRUE(stub->ListSequences(&ctx, v1::ListSequencesRequest(), &r).ok());
  return {r.sequences().begin(), r.sequences().end()};
}

std::string temp_path(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/crash-", getpid(), "-", name);
}

// A Unix socket that forwards each connection to the daemon's and can cut them: cut_for(d) closes
// every connection it carries and, for `d`, closes new ones as soon as they come, so calls and
// heartbeats see UNAVAILABLE while the daemon itself runs on untouched.
class CuttableProxy {
 public:
  explicit CuttableProxy(const std::string& daemon_socket)
      : to_(daemon_socket), path_(temp_path("proxy.sock")) {
    unlink(path_.c_str());
    listen_fd_ = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un a = address(path_);
    ok_ = listen_fd_ >= 0 && bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
          listen(listen_fd_, 16) == 0;
    if (ok_) acceptor_ = std::thread([this] { accept_loop(); });
  }
  ~CuttableProxy() {
    stopping_ = true;
    shutdown(listen_fd_, SHUT_RDWR);
    if (acceptor_.joinable()) acceptor_.join();
    close(listen_fd_);
    cut_all();
    for (auto& t : pumps_) t.join();
    unlink(path_.c_str());
  }
  bool ok() const { return ok_; }
  std::string target() const { return "unix:" + path_; }
  void cut_for(std::chrono::milliseconds d) {
    refuse_until_ = std::chrono::steady_clock::now() + d;
    cut_all();
  }

 private:
  static sockaddr_un address(const std::string& path) {
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::snprintf(a.sun_path, sizeof(a.sun_path), "%s", path.c_str());
    return a;
  }
  void cut_all() {
    std::lock_guard<std::mutex> lock(mu_);
    for (int fd : open_) shutdown(fd, SHUT_RDWR);  // both pumps see EOF and close their fds
  }
  void accept_loop() {
    while (!stopping_) {
      const int client = accept(listen_fd_, nullptr, nullptr);
      if (client < 0) continue;
      if (std::chrono::steady_clock::now() < refuse_until_.load()) {
        close(client);
        continue;
      }
      const int daemon = socket(AF_UNIX, SOCK_STREAM, 0);
      sockaddr_un a = address(to_);
      if (daemon < 0 || connect(daemon, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
        close(client);
        if (daemon >= 0) close(daemon);
        continue;
      }
      std::lock_guard<std::mutex> lock(mu_);
      open_.insert(client);
      open_.insert(daemon);
      pumps_.emplace_back([this, client, daemon] { pump(client, daemon); });
    }
  }
  void pump(int a, int b) {
    pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
    char buf[1 << 16];
    for (bool open = true; open;) {
      if (poll(fds, 2, 200) < 0) break;
      for (int i = 0; i < 2 && open; ++i) {
        if (fds[i].revents == 0) continue;
        const ssize_t n = read(fds[i].fd, buf, sizeof(buf));
        open = n > 0;
        for (ssize_t off = 0; open && off < n;) {
          const ssize_t w = write(fds[1 - i].fd, buf + off, size_t(n - off));
          open = w > 0;
          off += w;
        }
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    open_.erase(a);
    open_.erase(b);
    close(a);
    close(b);
  }

  const std::string to_, path_;
  int listen_fd_ = -1;
  bool ok_ = false;
  std::atomic<bool> stopping_{false};
  std::atomic<std::chrono::steady_clock::time_point> refuse_until_{};
  std::thread acceptor_;
  std::mutex mu_;
  std::set<int> open_;
  std::vector<std::thread> pumps_;
};

// The survivors alone: the reference outputs.
std::vector<std::string> undisturbed_run() {
  Daemon d(daemon_flags());
  EXPECT_TRUE(d.ready());
  std::vector<std::unique_ptr<Worker>> ws;
  ws.push_back(spawn(d, "survivor", 100, false, temp_path("ref-grpc")));
  ws.push_back(spawn(d, "survivor", 200, true, temp_path("ref-ring")));
  std::vector<std::string> outs;
  for (auto& w : ws) {
    EXPECT_THAT(w->line(), HasSubstr("seqs "));
    EXPECT_EQ(w->line(), "paused");
    w->go();
  }
  for (auto& w : ws) {
    EXPECT_EQ(w->wait(), 0);
    outs.push_back(read_file(w->out_path));
  }
  return outs;
}

TEST(CrashTest, WorkerKilledMidStepLosesNothingForOthersAndItsBlocksAndStagingReturnWithinTwoLeases) {
  const std::vector<std::string> reference = undisturbed_run();
  ASSERT_EQ(reference.size(), 2u);
  const size_t want_bytes = size_t(kSteps) * 3 * 2 * 6 * 32 * sizeof(float);
  ASSERT_EQ(reference[0].size(), want_bytes);
  ASSERT_EQ(reference[1].size(), want_bytes);

  Daemon d(daemon_flags());
  ASSERT_TRUE(d.ready());
  ClientOptions wo = d.options(0);
  auto watcher = Client::Attach(wo);
  ASSERT_TRUE(watcher.ok()) << watcher.status();

  std::vector<std::unique_ptr<Worker>> survivors;
  survivors.push_back(spawn(d, "survivor", 100, false, temp_path("grpc")));
  survivors.push_back(spawn(d, "survivor", 200, true, temp_path("ring")));
  auto hung = spawn(d, "hang", 300, false);
  auto spinner = spawn(d, "spin", 400, true);
  std::set<uint64_t> survivor_ids, hung_ids;
  for (auto& w : survivors) {
    for (uint64_t id : ids_of(w->line())) survivor_ids.insert(id);
    ASSERT_EQ(w->line(), "paused");
  }
  for (uint64_t id : ids_of(hung->line())) hung_ids.insert(id);
  ASSERT_EQ(hung->line(), "paused");
  ASSERT_THAT(spinner->line(), HasSubstr("looping "));
  ASSERT_EQ(survivor_ids.size(), 4u);
  ASSERT_EQ(hung_ids.size(), 2u);

  // Everyone is inside a decode step: the survivors after layer 0, the hung victim after layer 1.
  for (const auto& s : all_sequences(d)) {
    if (survivor_ids.count(s.sequence_id())) {
      EXPECT_EQ(s.pending_layer(), 1) << s.ShortDebugString();
    }
    if (hung_ids.count(s.sequence_id())) {
      EXPECT_EQ(s.pending_layer(), 2) << s.ShortDebugString();
    }
  }
  ASSERT_EQ((*watcher)->Stats()->sessions, 5u);
  ASSERT_EQ(staging_mappings(d.pid()), 4);

  const auto killed = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(hung->pid, SIGKILL), 0);
  ASSERT_EQ(kill(spinner->pid, SIGKILL), 0);
  EXPECT_EQ(hung->wait(), 128 + SIGKILL);
  EXPECT_EQ(spinner->wait(), 128 + SIGKILL);

  // Wait (at most 30 lease periods) until the victims' sessions are gone and their staging is unmapped.
  double sessions_back = -1, staging_back = -1;
  for (int i = 0; i < 3000 && (sessions_back < 0 || staging_back < 0); ++i) {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
    auto st = (*watcher)->Stats();
    ASSERT_TRUE(st.ok()) << st.status();
    if (sessions_back < 0 && st->sessions == 3) sessions_back = elapsed;
    if (staging_back < 0 && staging_mappings(d.pid()) == 2) staging_back = elapsed;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_GE(sessions_back, 0) << "the victims' sessions were not freed";
  ASSERT_GE(staging_back, 0) << "the victims' staging regions are still mapped";
  const double lease = 1.0;
  std::printf("[ figure ] killed workers' sessions and blocks freed after %.2f lease periods, staging unmapped "
              "after %.2f lease periods (lease %.0f s)\n",
              sessions_back / lease, staging_back / lease, lease);
  ::testing::Test::RecordProperty("sessions_back_lease_periods", std::to_string(sessions_back / lease));
  ::testing::Test::RecordProperty("staging_back_lease_periods", std::to_string(staging_back / lease));

  // Nothing of the victims is left, nothing of the survivors is gone: the pool holds exactly the
  // survivors' blocks (they are stopped, so this is exact), and its invariant holds.
  auto st = (*watcher)->Stats(true);
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(st->invariants_checked);
  EXPECT_EQ(st->invariant_error, "");
  EXPECT_EQ(st->lease_expiries, 2u);
  uint64_t survivor_blocks = 0;
  std::set<uint64_t> present;
  for (const auto& s : all_sequences(d)) {
    present.insert(s.sequence_id());
    survivor_blocks += s.blocks();
    EXPECT_EQ(s.pending_layer(), 1) << "a survivor's step in progress was disturbed";
  }
  EXPECT_EQ(present, survivor_ids);
  EXPECT_EQ(st->blocks_used, survivor_blocks);
  EXPECT_EQ(st->blocks_used + st->blocks_free, st->blocks_total);
  EXPECT_EQ(staging_names(d.pid()), 0);

  // The survivors finish: outputs bitwise equal to the undisturbed run.
  for (auto& w : survivors) w->go();
  for (size_t i = 0; i < survivors.size(); ++i) {
    ASSERT_EQ(survivors[i]->wait(), 0);
    const std::string got = read_file(survivors[i]->out_path);
    ASSERT_EQ(got.size(), reference[i].size());
    EXPECT_TRUE(got == reference[i]) << "survivor " << i << "'s outputs differ from the undisturbed run";
  }
  st = (*watcher)->Stats(true);
  EXPECT_EQ(st->invariant_error, "");
  EXPECT_EQ(st->blocks_used, 0u);
  EXPECT_EQ(st->sessions, 1u);
  // A detached fast-path session's ring lets go of its mapping at the reaper's next round.
  int mapped = 1;
  for (int i = 0; i < 500 && mapped != 0; ++i) {
    mapped = staging_mappings(d.pid());
    if (mapped != 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(mapped, 0);
}


// ---- the SDK across a daemon crash and restart ----

class ReattachTest : public ::testing::TestWithParam<bool> {};

std::vector<float> decode(Decoder& d, int from, int to) {
  std::vector<float> all;
  for (int t = from; t < to; ++t) {
    for (int l = 0; l < 3; ++l) EXPECT_TRUE(d.step(t, l, &all).ok());
  }
  return all;
}

TEST_P(ReattachTest, SdkReattachesWithBackoffAfterARestartAndLostSequencesAreATypedError) {
  auto d = std::make_unique<Daemon>(daemon_flags());
  ASSERT_TRUE(d->ready());
  ClientOptions o = d->options(1 << 20);
  o.fast_path = GetParam();
  o.heartbeat = false;  // the probes counted below are the calls' (a heartbeat would probe as well)
  o.reattach.initial_backoff = absl::Milliseconds(200);
  o.reattach.max_backoff = absl::Milliseconds(400);
  auto c = Client::Attach(o);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ((*c)->fast_path(), GetParam());
  Decoder old(**c, 500);
  ASSERT_TRUE(old.start().ok());
  const std::vector<float> before = decode(old, 0, 4);
  const std::string old_session = (*c)->session_id(), old_instance = (*c)->instance_id();
  ASSERT_FALSE(old_instance.empty());
  const std::string socket = d->socket();

  d->kill_now();
  // The daemon is gone: calls fail with UNAVAILABLE. The first finds it gone, the second probes
  // it (attempt 1) and the third, inside the backoff, does not even try.
  EXPECT_EQ(old.step(4, 0, nullptr).code(), absl::StatusCode::kUnavailable);
  absl::Status s = old.step(4, 0, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(s.message()), HasSubstr("re-attach attempt 1 failed; next in"));
  s = (*c)->Ping();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(s.message()), HasSubstr("is unreachable (1 re-attach attempt(s) failed); next attempt in"));
  EXPECT_EQ((*c)->reattach_probes(), 1u);

  d = std::make_unique<Daemon>(daemon_flags(), socket);
  ASSERT_TRUE(d->ready());
  // Calls keep failing with UNAVAILABLE until a probe, at the backoff's pace, finds the new daemon.
  int failed = 0;
  for (int i = 0; i < 500; ++i) {
    s = (*c)->Ping();
    if (s.ok()) break;
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    ++failed;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ((*c)->reattaches(), 1u);
  EXPECT_GE((*c)->reattach_probes(), 2u);
  EXPECT_NE((*c)->session_id(), old_session);
  EXPECT_NE((*c)->instance_id(), old_instance);
  EXPECT_EQ((*c)->fast_path(), GetParam());

  // Every call naming an old sequence: the typed error, and nothing written into the output.
  std::memset(old.out.data(), 0xA5, old.out.size());
  const std::vector<uint8_t> untouched(old.out.data(), old.out.data() + old.out.size());
  s = old.step(4, 0, nullptr);
  EXPECT_TRUE(IsDaemonRestarted(s)) << s;
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat("Step: sequence ", old.ids[0], " was lost: the daemon restarted; re-prefill")));
  EXPECT_EQ(0, std::memcmp(old.out.data(), untouched.data(), untouched.size()));
  EXPECT_TRUE(IsDaemonRestarted((*c)->Attend(old.ids[1], 0, 2, old.q, old.out)));
  EXPECT_EQ(0, std::memcmp(old.out.data(), untouched.data(), untouched.size()));
  EXPECT_TRUE(IsDaemonRestarted((*c)->Append(old.ids[0], 1, old.k, old.v).status()));
  EXPECT_TRUE(IsDaemonRestarted((*c)->Fork(old.ids[0]).status()));
  EXPECT_TRUE(IsDaemonRestarted((*c)->Compact(old.ids[0]).status()));
  Buffer rk = Client::alloc_heap((*c)->append_bytes(64)), rv = Client::alloc_heap(rk.size());
  Buffer rp = Client::alloc_heap(3 * 2 * 64 * 4);
  EXPECT_TRUE(IsDaemonRestarted((*c)->ReadKV(old.ids[1], rk, rv, rp).status()));
  EXPECT_TRUE(IsDaemonRestarted((*c)->Release(old.ids[1]).status()));
  EXPECT_FALSE(IsDaemonRestarted(absl::AbortedError("the daemon restarted; re-prefill")));

  // New sequences work, on the staging buffers allocated before the restart; the new daemon counts
  // ids from 1 again, and the client never hands out an id it had before. Re-prefilled, they decode
  // bitwise as before.
  Decoder again(**c, 500);
  ASSERT_TRUE(again.start().ok());
  for (uint64_t id : again.ids) EXPECT_TRUE(id != old.ids[0] && id != old.ids[1]) << id;
  EXPECT_TRUE(decode(again, 0, 4) == before);
  if (GetParam()) {
    EXPECT_GT((*c)->ring_calls(), 0u);
  }
  auto st = (*c)->Stats(true);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->invariant_error, "");
  EXPECT_EQ(st->sequences, 2u);
  EXPECT_EQ(st->sessions, 1u);
}

INSTANTIATE_TEST_SUITE_P(GrpcAndFastPath, ReattachTest, ::testing::Bool());

TEST(CrashTest, SdkReattachesOnTheNextCallAfterARestartItDidNotSee) {
  auto d = std::make_unique<Daemon>(daemon_flags());
  ASSERT_TRUE(d->ready());
  ClientOptions o = d->options(1 << 20);
  o.heartbeat = false;
  auto c = Client::Attach(o);
  ASSERT_TRUE(c.ok()) << c.status();
  Decoder old(**c, 600);
  ASSERT_TRUE(old.start().ok());
  const std::string socket = d->socket();
  d->kill_now();
  d = std::make_unique<Daemon>(daemon_flags(), socket);
  ASSERT_TRUE(d->ready());
  // The old session is unknown to the new daemon: a call that names no sequence re-attaches and
  // goes through; one that names an old sequence gets the typed error.
  auto id = (*c)->CreateSequence();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_TRUE(*id != old.ids[0] && *id != old.ids[1]) << *id;
  EXPECT_EQ((*c)->reattaches(), 1u);
  EXPECT_EQ((*c)->reattach_probes(), 0u);
  Buffer k = Client::alloc_heap((*c)->append_bytes(1)), v = Client::alloc_heap(k.size());
  auto r = (*c)->Append(old.ids[0], 1, k, v);
  EXPECT_TRUE(IsDaemonRestarted(r.status())) << r.status();
  r = (*c)->Append(*id, 1, k, v);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, 1);
  auto seqs = (*c)->ListSequences();
  ASSERT_TRUE(seqs.ok());
  ASSERT_EQ(seqs->size(), 1u);
  EXPECT_EQ((*seqs)[0].id, *id);
  EXPECT_EQ((*c)->Stats(true)->invariant_error, "");
}

// A connection cut while the client makes no call: a heartbeat gets UNAVAILABLE. The heartbeat
// thread must probe the daemon by itself and, finding the same instance, keep beating; otherwise
// the session's lease runs out although daemon and client are both fine.
TEST(CrashTest, HeartbeatsResumeAfterATransientUnavailableWithoutAnyCall) {
  auto flags = daemon_flags();
  flags.back() = "--lease_seconds=6";  // beats every 2 s
  Daemon d(flags);
  ASSERT_TRUE(d.ready());
  CuttableProxy proxy(d.socket());
  ASSERT_TRUE(proxy.ok());
  ClientOptions o = d.options(0);
  o.target = proxy.target();
  auto c = Client::Attach(o);
  ASSERT_TRUE(c.ok()) << c.status();
  auto id = (*c)->CreateSequence();
  ASSERT_TRUE(id.ok()) << id.status();
  // Longer than a beat's period, so that at least one beat meets a refused connection; gRPC's own
  // reconnect backoff (1 s, then 1.6 s) may keep the channel failing for a while after it.
  proxy.cut_for(std::chrono::milliseconds(2200));
  std::this_thread::sleep_for(std::chrono::seconds(13));  // two leases without a call
  // Probes happen only once a call or a heartbeat found the daemon unreachable: the cut was seen.
  EXPECT_GE((*c)->reattach_probes(), 1u) << "no heartbeat saw the cut";
  EXPECT_EQ((*c)->reattaches(), 0u);
  auto direct = Client::Attach(d.options(0));
  ASSERT_TRUE(direct.ok());
  auto st = (*direct)->Stats(false);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->lease_expiries, 0u);
  EXPECT_EQ(st->sessions, 2u);
  auto seqs = (*c)->ListSequences();
  ASSERT_TRUE(seqs.ok()) << seqs.status();
  ASSERT_EQ(seqs->size(), 1u);
  EXPECT_EQ((*seqs)[0].id, *id);
}

TEST(CrashTest, SdkGivesUpAfterMaxAttemptsAndADetachedClientNeverReattaches) {
  auto d = std::make_unique<Daemon>(daemon_flags());
  ASSERT_TRUE(d->ready());
  ClientOptions o = d->options(0);
  o.heartbeat = false;  // the probes counted below are the calls' (a heartbeat would probe as well)
  o.reattach.initial_backoff = absl::Milliseconds(1);
  o.reattach.max_backoff = absl::Milliseconds(1);
  o.reattach.max_attempts = 3;
  auto c = Client::Attach(o);
  ASSERT_TRUE(c.ok());
  auto detached = Client::Attach(d->options(0));
  ASSERT_TRUE(detached.ok());
  ASSERT_TRUE((*detached)->Detach().ok());
  const std::string socket = d->socket();
  d->kill_now();
  absl::Status s;
  for (int i = 0; i < 100; ++i) {
    s = (*c)->Ping();
    if (absl::StrContains(s.message(), "gave up")) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(s.message()), HasSubstr("gave up re-attaching after 3 attempts (ReattachOptions.max_attempts)"));
  EXPECT_EQ((*c)->reattach_probes(), 3u);
  d = std::make_unique<Daemon>(daemon_flags(), socket);
  ASSERT_TRUE(d->ready());
  EXPECT_THAT(std::string((*c)->Ping().message()), HasSubstr("gave up"));
  EXPECT_EQ((*c)->reattaches(), 0u);
  // Detached before the restart: it stays detached (NOT_FOUND, as after any Detach).
  EXPECT_EQ((*detached)->CreateSequence().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*detached)->reattaches(), 0u);
}

}  // namespace
}  // namespace karakv

int main(int argc, char** argv) {
  if (const char* role = std::getenv("KARAKV_CRASH_WORKER")) {
    const std::string r = role;
    const uint64_t key = std::strtoull(std::getenv("KARAKV_CRASH_KEY"), nullptr, 10);
    const bool fast = std::string(std::getenv("KARAKV_CRASH_FAST")) == "1";
    if (r == "survivor" || r == "hang") return karakv::decode_worker(r, key, fast);
    if (r == "spin") return karakv::spin_worker(key);
    return 2;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
