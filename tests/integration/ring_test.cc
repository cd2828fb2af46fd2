// The decode fast path against real karakvd processes: the same workload through the ring and
// through gRPC gives bit-identical outputs, decode-step counters, compactions and errors; a
// hostile worker's garbage closes only its own session; a worker killed mid-ring loses its blocks
// at lease expiry; a worker whose daemon died gets UNAVAILABLE instead of hanging.
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <thread>

#include "common/synthetic.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "karakv/client.h"
#include "karakv/v1/ring.h"
#include "tests/integration/daemon.h"

namespace karakv {
namespace {

using ::testing::HasSubstr;
using synthetic::Tensor;
using testing::Daemon;

constexpr uint64_t kSeed = 5;

std::vector<std::string> flags(std::vector<std::string> extra = {}) {
  std::vector<std::string> f = {"--layers=2", "--q_heads=4", "--kv_heads=2", "--head_dim=16", "--block_size=8",
                                "--dtype=fp16", "--pool_bytes=8MiB"};
  f.insert(f.end(), extra.begin(), extra.end());
  return f;
}

std::unique_ptr<Client> attach(const Daemon& d, bool fast_path, const std::string& tenant = "default") {
  ClientOptions o = d.options(1 << 20);
  o.fast_path = fast_path;
  o.tenant = tenant;
  auto c = Client::Attach(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

struct Trace {
  std::vector<uint8_t> outputs;          // every Step and Attend output, in order
  std::vector<uint64_t> decode_steps;    // the counter each Step returned
  std::vector<uint32_t> compactions;     // per sequence at the end
  std::vector<std::string> errors;       // code and message of each refused call
};

void record_error(const absl::Status& s, Trace* t) {
  t->errors.push_back(absl::StatusCodeToString(s.code()) + ": " + std::string(s.message()));
}

// Three kara sequences with a small window (so compaction ticks happen during decode), decoded for
// 40 steps over both layers, an Attend after every 10 steps, and a handful of refused calls.
Trace workload(Client& c) {
  Trace t;
  const Geometry& g = c.geometry();
  SequenceOptions o;
  o.policy = "kara";
  o.params = {{"window", 16}, {"recent", 0}};
  std::vector<uint64_t> seqs;
  constexpr int kPrompt = 20;
  for (int s = 0; s < 3; ++s) {
    auto id = c.CreateSequence(o);
    EXPECT_TRUE(id.ok()) << id.status();
    seqs.push_back(*id);
    c.reset_staging();
    Buffer k = *c.alloc(c.append_bytes(kPrompt)), v = *c.alloc(c.append_bytes(kPrompt));
    synthetic::fill_prompt(k.data(), g, kSeed, Tensor::kKey, *id, 0, kPrompt);
    synthetic::fill_prompt(v.data(), g, kSeed, Tensor::kValue, *id, 0, kPrompt);
    EXPECT_TRUE(c.Append(*id, kPrompt, k, v).ok());
  }
  const int n = static_cast<int>(seqs.size());
  c.reset_staging();
  Buffer k = *c.alloc(c.step_kv_bytes(n)), v = *c.alloc(c.step_kv_bytes(n));
  Buffer q = *c.alloc(c.q_bytes(n)), out = *c.alloc(c.q_bytes(n));
  Buffer aq = *c.alloc(c.q_bytes(2)), aout = *c.alloc(c.q_bytes(2));
  const size_t kv_tok = g.kv_token_elems() * kernels::dtype_size(g.dtype);
  for (int step = 0; step < 40; ++step) {
    for (int l = 0; l < g.num_layers; ++l) {
      for (int s = 0; s < n; ++s) {
        synthetic::fill_token(k.data() + s * kv_tok, g, kSeed, Tensor::kKey, seqs[s], l, kPrompt + step);
        synthetic::fill_token(v.data() + s * kv_tok, g, kSeed, Tensor::kValue, seqs[s], l, kPrompt + step);
        synthetic::fill_query(q.as<float>().data() + s * g.q_token_elems(), g, kSeed, seqs[s], l, kPrompt + step);
      }
      std::memset(out.data(), 0xab, out.size());
      auto r = c.Step(l, seqs, k, v, q, out);
      EXPECT_TRUE(r.ok()) << r.status();
      if (r.ok()) t.decode_steps.push_back(*r);
      t.outputs.insert(t.outputs.end(), out.data(), out.data() + out.size());
    }
    if (step % 10 == 9) {
      for (int i = 0; i < 2; ++i) synthetic::fill_query(aq.as<float>().data() + i * g.q_token_elems(), g, kSeed + 1, seqs[0], 1, step + i);
      std::memset(aout.data(), 0xcd, aout.size());
      absl::Status s = c.Attend(seqs[0], 1, 2, aq, aout);
      EXPECT_TRUE(s.ok()) << s;
      t.outputs.insert(t.outputs.end(), aout.data(), aout.data() + aout.size());
    }
  }
  // Refused calls: unknown sequence, a layer out of order, a range past the region, a bad layer.
  const uint64_t unknown[3] = {999, 998, 997};
  record_error(c.Step(0, unknown, k, v, q, out).status(), &t);
  record_error(c.Step(1, std::span<const uint64_t>(seqs.data(), 1), k, v, q, out).status(), &t);
  Buffer small_out = *c.alloc(8);
  record_error(c.Step(0, seqs, k, v, q, small_out).status(), &t);
  record_error(c.Attend(seqs[0], 7, 2, aq, aout), &t);
  record_error(c.Attend(seqs[0], 0, 1000, aq, aout), &t);
  auto list = c.ListSequences();
  EXPECT_TRUE(list.ok());
  for (const auto& info : *list) t.compactions.push_back(info.compactions);
  return t;
}

TEST(FastPath, SameOutputsCountersAndErrorsAsGrpc) {
  Daemon a(flags()), b(flags());
  ASSERT_TRUE(a.ready() && b.ready());
  auto ring_client = attach(a, true);
  auto grpc_client = attach(b, false);
  ASSERT_TRUE(ring_client && grpc_client);
  ASSERT_TRUE(ring_client->fast_path());
  ASSERT_FALSE(grpc_client->fast_path());
  const Trace via_ring = workload(*ring_client);
  const Trace via_grpc = workload(*grpc_client);
  // 40 steps x 2 layers plus the refused Steps that reached the ring.
  EXPECT_GE(ring_client->ring_calls(), 80u + 4u + 5u);
  EXPECT_EQ(grpc_client->ring_calls(), 0u);
  ASSERT_EQ(via_ring.outputs.size(), via_grpc.outputs.size());
  EXPECT_TRUE(via_ring.outputs == via_grpc.outputs) << "outputs differ between the ring and gRPC";
  EXPECT_EQ(via_ring.decode_steps, via_grpc.decode_steps);
  EXPECT_EQ(via_ring.compactions, via_grpc.compactions);
  EXPECT_GT(std::accumulate(via_ring.compactions.begin(), via_ring.compactions.end(), 0u), 0u)
      << "the workload should have triggered Kara compactions";
  EXPECT_EQ(via_ring.errors, via_grpc.errors);
  ASSERT_EQ(via_ring.errors.size(), 5u);
  EXPECT_THAT(via_ring.errors[0], HasSubstr("NOT_FOUND: Step: "));
  auto sa = ring_client->Stats(true), sb = grpc_client->Stats(true);
  ASSERT_TRUE(sa.ok() && sb.ok());
  EXPECT_EQ(sa->decode_steps, sb->decode_steps);
  EXPECT_EQ(sa->blocks_used, sb->blocks_used);
  EXPECT_EQ(sa->invariant_error, "");
}

// The ring area of a fast-path client's own mapping: right after its staging region.
uint8_t* ring_of(Client& c) {
  Buffer b = *c.alloc(64);
  return b.data() - b.offset() + c.staging_bytes();
}

TEST(FastPath, HostileGarbageClosesOnlyThatSession) {
  Daemon d(flags());
  ASSERT_TRUE(d.ready());
  auto hostile = attach(d, true, "mallory");
  auto honest = attach(d, true);
  ASSERT_TRUE(hostile && honest);
  auto seq = honest->CreateSequence();
  ASSERT_TRUE(seq.ok());
  ASSERT_TRUE(hostile->CreateSequence().ok());
  // Garbage indices: a tail far beyond anything a producer could have written.
  ring::Header* h = ring::header(ring_of(*hostile));
  h->sq_tail.store(0x7766554433221100ull);
  h->sq_doorbell.fetch_add(1);
  ring::futex_wake(&h->sq_doorbell);
  absl::Status hb;
  for (int i = 0; i < 100; ++i) {
    hb = hostile->Heartbeat();
    if (!hb.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(hb.code(), absl::StatusCode::kNotFound) << hb;
  // Its Step reports why the ring was closed.
  const uint64_t ids[1] = {*seq};
  Buffer k = *hostile->alloc(hostile->step_kv_bytes(1)), v = *hostile->alloc(hostile->step_kv_bytes(1));
  Buffer q = *hostile->alloc(hostile->q_bytes(1)), out = *hostile->alloc(hostile->q_bytes(1));
  auto r = hostile->Step(0, ids, k, v, q, out);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("impossible"));
  // The daemon serves everyone else, through the ring too.
  Buffer hk = *honest->alloc(honest->step_kv_bytes(1)), hv = *honest->alloc(honest->step_kv_bytes(1));
  Buffer hq = *honest->alloc(honest->q_bytes(1)), hout = *honest->alloc(honest->q_bytes(1));
  const uint64_t honest_ids[1] = {*seq};
  for (int l = 0; l < 2; ++l) EXPECT_TRUE(honest->Step(l, honest_ids, hk, hv, hq, hout).ok());
  EXPECT_GE(honest->ring_calls(), 2u);
  auto st = honest->Stats(true);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->sessions, 1u);
  EXPECT_EQ(st->sequences, 1u);
  EXPECT_EQ(st->invariant_error, "");
}

TEST(FastPath, WorkerKilledMidRingFreesItsBlocksAtLeaseExpiry) {
  Daemon d(flags({"--lease_seconds=1"}));
  ASSERT_TRUE(d.ready());
  auto observer = attach(d, false);
  ASSERT_TRUE(observer);
  const pid_t child = fork();
  if (child == 0) {
    const std::string target = "--target=" + d.target();
    execl(SYNTHETIC_WORKER_PATH, SYNTHETIC_WORKER_PATH, target.c_str(), "--fast_path", "--sequences=4",
          "--prompt=32", "--generate=1000000", "--check_every=0", static_cast<char*>(nullptr));
    _exit(127);
  }
  // Kill it once it is decoding through the ring.
  bool decoding = false;
  for (int i = 0; i < 2400 && !decoding; ++i) {  // up to 60 s: sanitized builds on a loaded machine start slowly
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
    auto s = observer->Stats();
    decoding = s.ok() && s->decode_steps > 2;
  }
  ASSERT_TRUE(decoding) << "the worker never started decoding";
  auto before = observer->Stats();
  ASSERT_TRUE(before.ok());
  EXPECT_GT(before->blocks_used, 0u);
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  // The observer keeps its own lease alive by its heartbeat thread; the worker's runs out.
  absl::StatusOr<DaemonStats> after;
  for (int i = 0; i < 200; ++i) {
    after = observer->Stats(true);
    if (after.ok() && after->blocks_used == 0 && after->sessions == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->blocks_used, 0u);
  EXPECT_EQ(after->sequences, 0u);
  EXPECT_EQ(after->sessions, 1u);
  EXPECT_GE(after->lease_expiries, 1u);
  EXPECT_EQ(after->invariant_error, "");
}

TEST(FastPath, DaemonGoneIsUnavailableNotAHang) {
  Daemon d(flags());
  ASSERT_TRUE(d.ready());
  ClientOptions o = d.options(1 << 20);
  o.fast_path = true;
  o.heartbeat = false;
  auto c = Client::Attach(o);
  ASSERT_TRUE(c.ok());
  auto seq = (*c)->CreateSequence();
  ASSERT_TRUE(seq.ok());
  const uint64_t ids[1] = {*seq};
  Buffer k = *(*c)->alloc((*c)->step_kv_bytes(1)), v = *(*c)->alloc((*c)->step_kv_bytes(1));
  Buffer q = *(*c)->alloc((*c)->q_bytes(1)), out = *(*c)->alloc((*c)->q_bytes(1));
  ASSERT_TRUE((*c)->Step(0, ids, k, v, q, out).ok());
  kill(d.pid(), SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = (*c)->Step(1, ids, k, v, q, out);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_LT(waited, 10.0);  // far below the 20 s rpc_timeout: the liveness check ended the wait
  d.stop();
}

// Threads of process `pid` by name (/proc/PID/task/*/comm). Threads inherit their creator's name,
// so OpenMP workers carry the name of the thread whose team they are.
std::map<std::string, int> thread_names(pid_t pid) {
  std::map<std::string, int> out;
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::ifstream in(e.path() / "comm");
    std::string name;
    if (std::getline(in, name)) ++out[name];
  }
  return out;
}

// Ring threads share the daemon's one kernel team: with 4 ring threads and 3 kernel threads the
// daemon has 4 threads named karakv-ring and 3 named karakv-kernels (the team thread and its 2
// OpenMP workers), both at start and after 4 fast-path sessions ran Steps at once. A team per ring
// thread would be 4 + 4 x 2 karakv-ring threads.
TEST(FastPath, RingThreadsShareOneKernelTeam) {
  const int width = 3, rings = 4;
  int limit = width;  // OMP_THREAD_LIMIT (the TSan runs set 1) caps the team, the daemon inherits it
  if (const char* env = std::getenv("OMP_THREAD_LIMIT"); env != nullptr && std::atoi(env) > 0) {
    limit = std::min(limit, std::atoi(env));
  }
  Daemon d(flags({"--threads=" + std::to_string(width), "--ring_idle_threads=" + std::to_string(rings)}));
  ASSERT_TRUE(d.ready());
  // The ring threads start with the daemon and make the team before they wait for sessions.
  std::map<std::string, int> names;
  for (int i = 0; i < 400; ++i) {
    names = thread_names(d.pid());
    if (names["karakv-kernels"] == limit && names["karakv-ring"] >= rings) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(names["karakv-ring"], rings);
  EXPECT_EQ(names["karakv-kernels"], limit);

  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < rings; ++i) {
    clients.push_back(attach(d, true));
    ASSERT_TRUE(clients.back() && clients.back()->fast_path());
  }
  std::vector<std::thread> workers;
  std::vector<Trace> traces(rings);
  for (int i = 0; i < rings; ++i) workers.emplace_back([&, i] { traces[i] = workload(*clients[i]); });
  for (std::thread& t : workers) t.join();
  for (int i = 0; i < rings; ++i) {
    EXPECT_GE(clients[i]->ring_calls(), 80u) << i;
    EXPECT_EQ(traces[i].errors.size(), 5u) << i;  // the workload's deliberately refused calls only
  }
  names = thread_names(d.pid());
  EXPECT_EQ(names["karakv-ring"], rings);
  EXPECT_EQ(names["karakv-kernels"], limit);
}

}  // namespace
}  // namespace karakv
