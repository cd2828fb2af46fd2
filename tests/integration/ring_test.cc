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

void record_error(const absl::Status& s, std::vector<std::string>* errors) {
  errors->push_back(absl::StatusCodeToString(s.code()) + ": " + std::string(s.message()));
}
void record_error(const absl::Status& s, Trace* t) { record_error(s, &t->errors); }

// Three kara sequences with a small window (so compaction ticks happen during decode), decoded for
// 40 steps over both layers, an Attend after every 10 steps, and a handful of refused calls.
Trace workload(Client& c) {
  Trace t;
  const Geometry& g = c.geometry();
  SequenceOptions o;
  o.policy = "kara";
  o.params = {{"window", 16}, {"recent", 0}, {"budget", 0}};
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

struct DataTrace {
  std::vector<int> lengths;            // every Append / AppendBatch / ReadKV result, in order
  std::vector<uint8_t> read;           // every ReadKV's K, V and positions
  std::vector<std::string> errors;     // code and message of each refused call
};

// Three sequences prefilled with one AppendBatch (one entry with queries, one with token ids),
// one more Append, ReadKV of each checked against the synthetic values that went in, then refused
// calls of each kind. `heap` puts the batch's tensors in this process (inline in the RPC).
DataTrace data_workload(Client& c, bool heap) {
  DataTrace t;
  const Geometry& g = c.geometry();
  c.reset_staging();
  auto buffer = [&](size_t bytes) { return heap ? Client::alloc_heap(bytes) : *c.alloc(bytes); };
  std::vector<uint64_t> seqs;
  std::vector<AppendEntry> entries;
  std::vector<int> tokens = {5, 9, 13};
  for (int s = 0; s < 3; ++s) {
    auto id = c.CreateSequence();
    EXPECT_TRUE(id.ok()) << id.status();
    seqs.push_back(*id);
    AppendEntry e;
    e.sequence_id = *id;
    e.num_tokens = tokens[s];
    e.k = buffer(c.append_bytes(tokens[s]));
    e.v = buffer(c.append_bytes(tokens[s]));
    synthetic::fill_prompt(e.k.data(), g, kSeed, Tensor::kKey, s, 0, tokens[s]);
    synthetic::fill_prompt(e.v.data(), g, kSeed, Tensor::kValue, s, 0, tokens[s]);
    if (s == 1) {
      e.num_query_tokens = 2;
      e.q = buffer(size_t(g.num_layers) * c.q_bytes(2));
      for (size_t i = 0; i < e.q.size() / 4; ++i) e.q.as<float>()[i] = float(i % 7) * 0.25f;
    }
    if (s == 2) {
      e.token_ids = buffer(4 * size_t(tokens[s]));
      for (int i = 0; i < tokens[s]; ++i) e.token_ids.as<int32_t>()[i] = 100 + i;
    }
    entries.push_back(e);
  }
  auto batch = c.AppendBatch(entries);
  EXPECT_TRUE(batch.ok()) << batch.status();
  if (batch.ok()) t.lengths.insert(t.lengths.end(), batch->begin(), batch->end());
  // Three more tokens for sequence 0, through Append.
  Buffer k3 = *c.alloc(c.append_bytes(3)), v3 = *c.alloc(c.append_bytes(3));
  synthetic::fill_prompt(k3.data(), g, kSeed, Tensor::kKey, 0, 5, 3);
  synthetic::fill_prompt(v3.data(), g, kSeed, Tensor::kValue, 0, 5, 3);
  auto len = c.Append(seqs[0], 3, k3, v3);
  EXPECT_TRUE(len.ok()) << len.status();
  t.lengths.push_back(len.ok() ? *len : -1);
  tokens[0] = 8;
  // ReadKV of each: the values that went in, positions 0..T-1 in every (layer, head) row.
  constexpr int kMax = 16;
  const size_t rows = size_t(g.num_layers) * g.num_kv_heads;
  Buffer rk = *c.alloc(c.append_bytes(kMax)), rv = *c.alloc(c.append_bytes(kMax)), rp = *c.alloc(rows * kMax * 4);
  for (int s = 0; s < 3; ++s) {
    std::memset(rk.data(), 0xee, rk.size());
    auto n = c.ReadKV(seqs[s], rk, rv, rp);
    EXPECT_TRUE(n.ok()) << n.status();
    if (!n.ok()) continue;
    t.lengths.push_back(*n);
    EXPECT_EQ(*n, tokens[s]);
    const size_t bytes = c.append_bytes(tokens[s]);
    std::vector<uint8_t> want(bytes);
    synthetic::fill_prompt(want.data(), g, kSeed, Tensor::kKey, s, 0, tokens[s]);
    EXPECT_EQ(0, std::memcmp(want.data(), rk.data(), bytes)) << "K of sequence " << s;
    synthetic::fill_prompt(want.data(), g, kSeed, Tensor::kValue, s, 0, tokens[s]);
    EXPECT_EQ(0, std::memcmp(want.data(), rv.data(), bytes)) << "V of sequence " << s;
    for (size_t r = 0; r < rows; ++r) {
      for (int p = 0; p < tokens[s]; ++p) EXPECT_EQ(rp.as<int32_t>()[r * tokens[s] + p], p);
    }
    t.read.insert(t.read.end(), rk.data(), rk.data() + bytes);
    t.read.insert(t.read.end(), rv.data(), rv.data() + bytes);
    t.read.insert(t.read.end(), rp.data(), rp.data() + rows * tokens[s] * 4);
  }
  // Refused: a batch whose second entry names an unknown sequence (the first stays applied), an
  // empty batch, K one token short, queries announced but not sent, ReadKV into too small a
  // buffer, ReadKV of an unknown sequence.
  AppendEntry bad = entries[0];
  bad.sequence_id = 999;
  AppendEntry good = entries[0];
  good.sequence_id = seqs[1];
  good.q = Buffer();
  good.num_query_tokens = 0;
  const AppendEntry pair[2] = {good, bad};
  record_error(c.AppendBatch(pair).status(), &t.errors);
  record_error(c.AppendBatch({}).status(), &t.errors);
  Buffer short_k = *c.alloc(c.append_bytes(3) - c.append_bytes(1));
  record_error(c.Append(seqs[0], 3, short_k, v3).status(), &t.errors);
  record_error(c.Append(seqs[0], 3, k3, v3, Buffer(), 1).status(), &t.errors);
  Buffer tiny = *c.alloc(8);
  record_error(c.ReadKV(seqs[1], tiny, rv, rp).status(), &t.errors);
  record_error(c.ReadKV(12345, rk, rv, rp).status(), &t.errors);
  auto after = c.ReadKV(seqs[1], rk, rv, rp);
  EXPECT_TRUE(after.ok()) << after.status();
  t.lengths.push_back(after.ok() ? *after : -1);
  EXPECT_EQ(t.lengths.back(), 9 + 5) << "the batch's first entry stays applied";
  return t;
}

TEST(FastPath, AppendBatchAndReadKVSameAsGrpc) {
  Daemon a(flags()), b(flags()), inl(flags());
  ASSERT_TRUE(a.ready() && b.ready() && inl.ready());
  auto ring_client = attach(a, true);
  auto grpc_client = attach(b, false);
  auto inline_client = attach(inl, true);
  ASSERT_TRUE(ring_client && grpc_client && inline_client);
  const uint64_t ring_before = ring_client->ring_calls();
  const DataTrace via_ring = data_workload(*ring_client, false);
  const DataTrace via_grpc = data_workload(*grpc_client, false);
  const DataTrace via_inline = data_workload(*inline_client, true);
  // The batch, Append, 3 ReadKV, and 6 refusals and a ReadKV: only the inline batch takes gRPC.
  EXPECT_EQ(ring_client->ring_calls() - ring_before, 12u);
  EXPECT_EQ(grpc_client->ring_calls(), 0u);
  EXPECT_EQ(via_ring.lengths, (std::vector<int>{5, 9, 13, 8, 8, 9, 13, 14}));
  EXPECT_EQ(via_ring.lengths, via_grpc.lengths);
  EXPECT_EQ(via_ring.lengths, via_inline.lengths);
  EXPECT_TRUE(via_ring.read == via_grpc.read) << "ReadKV bytes differ between the ring and gRPC";
  EXPECT_TRUE(via_ring.read == via_inline.read);
  EXPECT_EQ(via_ring.errors, via_grpc.errors);
  ASSERT_EQ(via_ring.errors.size(), 6u);
  EXPECT_THAT(via_ring.errors[0], HasSubstr("NOT_FOUND: AppendBatch: entry 1 of 2 (sequence 999): "));
  EXPECT_THAT(via_ring.errors[0], HasSubstr("entry 0 was applied, none after it"));
  EXPECT_THAT(via_ring.errors[1], HasSubstr("INVALID_ARGUMENT: AppendBatch: entries is empty"));
  EXPECT_THAT(via_ring.errors[2], HasSubstr("INVALID_ARGUMENT: Append: k has"));
  EXPECT_THAT(via_ring.errors[4], HasSubstr("INVALID_ARGUMENT: ReadKV: k staging range has 8 bytes"));
  EXPECT_THAT(via_ring.errors[5], HasSubstr("NOT_FOUND: ReadKV: "));
  // The inline run refused the same things, but its batches went through gRPC.
  EXPECT_EQ(via_inline.errors, via_ring.errors);
  for (Client* c : {ring_client.get(), grpc_client.get(), inline_client.get()}) {
    auto st = c->Stats(true);
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->invariant_error, "");
  }
}

// The ring area of a fast-path client's own mapping: right after its staging region.
uint8_t* ring_of(Client& c) {
  Buffer b = *c.alloc(64);
  return b.data() - b.offset() + c.staging_bytes();
}

// An Append with token ids stays on the ring when the ids are in the staging region, and its full
// blocks are published as through gRPC (a second session's Lookup finds them); ids elsewhere in
// the process send it through gRPC, with the same result.
TEST(FastPath, AppendWithStagedTokenIdsStaysOnTheRing) {
  Daemon d(flags());
  ASSERT_TRUE(d.ready());
  auto c = attach(d, true);
  auto other = attach(d, false);
  ASSERT_TRUE(c && other && c->fast_path());
  const Geometry& g = c->geometry();
  const int n = 2 * g.block_size;
  for (bool staged : {true, false}) {
    c->reset_staging();
    Buffer k = *c->alloc(c->append_bytes(n)), v = *c->alloc(c->append_bytes(n));
    synthetic::fill_prompt(k.data(), g, kSeed, Tensor::kKey, 0, 0, n);
    synthetic::fill_prompt(v.data(), g, kSeed, Tensor::kValue, 0, 0, n);
    Buffer ids_buffer = staged ? *c->alloc(4 * size_t(n)) : Client::alloc_heap(4 * size_t(n));
    std::span<int32_t> ids = ids_buffer.as<int32_t>();
    for (int i = 0; i < n; ++i) ids[size_t(i)] = (staged ? 1000 : 2000) + i;
    auto seq = c->CreateSequence();
    ASSERT_TRUE(seq.ok()) << seq.status();
    const uint64_t before = c->ring_calls();
    auto len = c->Append(*seq, std::span<const int32_t>(ids.data(), ids.size()), k, v);
    ASSERT_TRUE(len.ok()) << len.status();
    EXPECT_EQ(*len, n);
    EXPECT_EQ(c->ring_calls() - before, staged ? 1u : 0u) << (staged ? "staged ids" : "heap ids");
    auto hit = other->Lookup(std::vector<int32_t>(ids.begin(), ids.end()));
    ASSERT_TRUE(hit.ok()) << hit.status();
    EXPECT_EQ(*hit, n) << (staged ? "staged ids" : "heap ids");
  }
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

// Threads of process `pid` by name (/proc/PID/task/*/comm).
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

// Ring threads share the daemon's one kernel pool: with 4 ring threads and 3 kernel threads the
// daemon has 4 threads named karakv-ring and 2 named karakv-kernels (the pool's helpers; each
// caller is the third), both at start and after 4 fast-path sessions ran Steps at once. Helpers per
// ring thread would be 4 x 2.
TEST(FastPath, RingThreadsShareOneKernelPool) {
  const int width = 3, rings = 4;
  const int limit = width - 1;  // the pool's helpers; the calling ring thread is the third
  Daemon d(flags({"--threads=" + std::to_string(width), "--ring_idle_threads=" + std::to_string(rings)}));
  ASSERT_TRUE(d.ready());
  // The ring threads start with the daemon and start the pool's helpers before they wait for sessions.
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
