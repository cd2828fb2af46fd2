// End-to-end tests against a real karakvd: attention outputs against a dense float64 reference,
// staging vs inline equality, forks, leases, malformed requests, pool exhaustion, drain, CLI and
// the example worker.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
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
using testing::http_get;
using testing::read_file;
namespace v1 = ::karakv::v1;

constexpr uint64_t kSeed = 3;

std::vector<std::string> geometry_flags(const char* dtype) {
  return {"--layers=3", "--q_heads=6", "--kv_heads=2", "--head_dim=32", "--block_size=16",
          std::string("--dtype=") + dtype, "--pool_bytes=16MiB"};
}

std::string run(const std::string& cmd, int* exit_code) { return testing::run_command(cmd, exit_code); }

// Tolerance of the attention outputs against the float64 reference. Both sides read the same
// rounded K/V, so what remains is fp32 accumulation over a few hundred tokens.
constexpr double kTolerance = 2e-5;

struct Workload {
  Client* client;
  bool use_staging;
  Buffer buf(size_t bytes) { return use_staging ? *client->alloc(bytes) : Client::alloc_heap(bytes); }
};

// Prefills two sequences, decodes `steps` tokens, checks every output of every layer against the
// dense reference, and returns all outputs concatenated (for bitwise comparison between modes).
std::vector<float> decode_and_check(Client& c, bool use_staging, int steps) {
  const Geometry& g = c.geometry();
  Workload w{&c, use_staging};
  const std::vector<int> prompts = {40, 17};
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto id = c.CreateSequence();
    EXPECT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  // Values are keyed by the position in `ids` (not the daemon's id) so both modes see equal data.
  for (size_t s = 0; s < ids.size(); ++s) {
    c.reset_staging();
    Buffer k = w.buf(c.append_bytes(prompts[s])), v = w.buf(c.append_bytes(prompts[s]));
    synthetic::fill_prompt(k.data(), g, kSeed, Tensor::kKey, s, 0, prompts[s]);
    synthetic::fill_prompt(v.data(), g, kSeed, Tensor::kValue, s, 0, prompts[s]);
    auto len = c.Append(ids[s], prompts[s], k, v);
    EXPECT_TRUE(len.ok()) << len.status();
  }
  c.reset_staging();
  const int n = static_cast<int>(ids.size());
  Buffer k = w.buf(c.step_kv_bytes(n)), v = w.buf(c.step_kv_bytes(n));
  Buffer q = w.buf(c.q_bytes(n)), out = w.buf(c.q_bytes(n));
  const size_t kv_tok = g.kv_token_elems() * kernels::dtype_size(g.dtype);
  std::vector<float> all;
  double max_err = 0;
  for (int t = 0; t < steps; ++t) {
    for (int l = 0; l < g.num_layers; ++l) {
      for (int s = 0; s < n; ++s) {
        const int64_t pos = prompts[s] + t;
        synthetic::fill_token(k.data() + s * kv_tok, g, kSeed, Tensor::kKey, s, l, pos);
        synthetic::fill_token(v.data() + s * kv_tok, g, kSeed, Tensor::kValue, s, l, pos);
        synthetic::fill_query(q.as<float>().data() + s * g.q_token_elems(), g, kSeed, s, l, pos);
      }
      auto r = c.Step(l, ids, k, v, q, out);
      EXPECT_TRUE(r.ok()) << r.status();
      for (int s = 0; s < n; ++s) {
        auto ref = synthetic::dense_attention(g, kSeed, s, l, prompts[s] + t);
        const float* got = out.as<float>().data() + s * g.q_token_elems();
        for (size_t i = 0; i < ref.size(); ++i) max_err = std::max(max_err, std::abs(got[i] - ref[i]));
        all.insert(all.end(), got, got + g.q_token_elems());
      }
    }
  }
  EXPECT_LE(max_err, kTolerance);
  auto seqs = c.ListSequences();
  EXPECT_TRUE(seqs.ok());
  EXPECT_EQ((*seqs)[0].length, uint32_t(prompts[0] + steps));
  EXPECT_EQ((*seqs)[1].length, uint32_t(prompts[1] + steps));
  for (uint64_t id : ids) EXPECT_TRUE(c.Release(id).ok());
  return all;
}

class DecodeTest : public ::testing::TestWithParam<const char*> {};

TEST_P(DecodeTest, StepOutputsMatchDenseReferenceAndInlineEqualsStaging) {
  Daemon d(geometry_flags(GetParam()));
  ASSERT_TRUE(d.ready());
  auto staged = Client::Attach(d.options());
  ASSERT_TRUE(staged.ok()) << staged.status();
  auto a = decode_and_check(**staged, true, 24);
  auto inl = Client::Attach(d.options(0));
  ASSERT_TRUE(inl.ok());
  auto b = decode_and_check(**inl, false, 24);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << "inline and staging outputs differ";
  auto st = (*staged)->Stats(true);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->blocks_used, 0u);
  EXPECT_EQ(st->invariant_error, "");
  EXPECT_TRUE(st->invariants_checked);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DecodeTest, ::testing::Values("fp32", "fp16", "bf16"));

TEST(DaemonTest, AttendIsCausalOverTheLastQueries) {
  Daemon d(geometry_flags("fp16"));
  ASSERT_TRUE(d.ready());
  auto c = Client::Attach(d.options());
  ASSERT_TRUE(c.ok());
  const Geometry& g = (*c)->geometry();
  auto id = *(*c)->CreateSequence();
  Buffer k = *(*c)->alloc((*c)->append_bytes(30)), v = *(*c)->alloc((*c)->append_bytes(30));
  synthetic::fill_prompt(k.data(), g, kSeed, Tensor::kKey, 0, 0, 30);
  synthetic::fill_prompt(v.data(), g, kSeed, Tensor::kValue, 0, 0, 30);
  ASSERT_TRUE((*c)->Append(id, 30, k, v).ok());
  const int nq = 5, layer = 1;
  Buffer q = *(*c)->alloc((*c)->q_bytes(nq)), out = *(*c)->alloc((*c)->q_bytes(nq));
  for (int i = 0; i < nq; ++i) synthetic::fill_query(q.as<float>().data() + i * g.q_token_elems(), g, kSeed, 0, layer, 25 + i);
  ASSERT_TRUE((*c)->Attend(id, layer, nq, q, out).ok());
  for (int i = 0; i < nq; ++i) {
    auto ref = synthetic::dense_attention(g, kSeed, 0, layer, 25 + i);
    for (size_t j = 0; j < ref.size(); ++j) {
      ASSERT_NEAR(out.as<float>()[i * g.q_token_elems() + j], ref[j], kTolerance) << "query " << i;
    }
  }
  // ReadKV returns exactly what was appended, in staging and inline.
  Buffer rk = *(*c)->alloc((*c)->append_bytes(30)), rv = *(*c)->alloc((*c)->append_bytes(30));
  const size_t rows = size_t(g.num_layers) * g.num_kv_heads;
  Buffer rp = *(*c)->alloc(rows * 30 * 4);
  ASSERT_EQ(*(*c)->ReadKV(id, rk, rv, rp), 30);
  EXPECT_EQ(0, std::memcmp(rk.data(), k.data(), k.size()));
  EXPECT_EQ(0, std::memcmp(rv.data(), v.data(), v.size()));
  for (size_t r = 0; r < rows; ++r) EXPECT_EQ(rp.as<int32_t>()[r * 30 + 29], 29);
  Buffer hk = Client::alloc_heap(k.size()), hv = Client::alloc_heap(v.size()), hp = Client::alloc_heap(rows * 120);
  ASSERT_EQ(*(*c)->ReadKV(id, hk, hv, hp), 30);
  EXPECT_EQ(0, std::memcmp(hk.data(), k.data(), k.size()));
}

TEST(DaemonTest, ForkSharesThenDiverges) {
  Daemon d(geometry_flags("fp32"));
  ASSERT_TRUE(d.ready());
  auto c = Client::Attach(d.options());
  ASSERT_TRUE(c.ok());
  const Geometry& g = (*c)->geometry();
  auto parent = *(*c)->CreateSequence();
  Buffer k = *(*c)->alloc((*c)->append_bytes(20)), v = *(*c)->alloc((*c)->append_bytes(20));
  synthetic::fill_prompt(k.data(), g, kSeed, Tensor::kKey, 0, 0, 20);
  synthetic::fill_prompt(v.data(), g, kSeed, Tensor::kValue, 0, 0, 20);
  ASSERT_TRUE((*c)->Append(parent, 20, k, v).ok());
  auto child = *(*c)->Fork(parent);
  auto seqs = *(*c)->ListSequences();
  ASSERT_EQ(seqs.size(), 2u);
  EXPECT_EQ(seqs[1].shared_blocks, 2u);
  EXPECT_EQ((*c)->Stats()->blocks_used, 2u);
  // The child appends different data: it gets its own copy of the partial block.
  Buffer k2 = *(*c)->alloc((*c)->append_bytes(1)), v2 = *(*c)->alloc((*c)->append_bytes(1));
  synthetic::fill_prompt(k2.data(), g, kSeed, Tensor::kKey, 9, 20, 1);
  synthetic::fill_prompt(v2.data(), g, kSeed, Tensor::kValue, 9, 20, 1);
  ASSERT_EQ(*(*c)->Append(child, 1, k2, v2), 21);
  EXPECT_EQ((*c)->Stats()->blocks_used, 3u);
  Buffer rk = Client::alloc_heap((*c)->append_bytes(21)), rv = Client::alloc_heap(rk.size());
  Buffer rp = Client::alloc_heap(size_t(g.num_layers) * g.num_kv_heads * 84);
  ASSERT_EQ(*(*c)->ReadKV(parent, rk, rv, rp), 20);
  EXPECT_EQ(0, std::memcmp(rk.data(), k.data(), k.size()));
  ASSERT_EQ(*(*c)->ReadKV(child, rk, rv, rp), 21);
  const size_t tok = g.kv_token_elems() * 4;
  for (int l = 0; l < g.num_layers; ++l) {
    EXPECT_EQ(0, std::memcmp(rk.data() + (l * 21) * tok, k.data() + (l * 20) * tok, 20 * tok));
    EXPECT_EQ(0, std::memcmp(rk.data() + (l * 21 + 20) * tok, k2.data() + l * tok, tok));
  }
  EXPECT_TRUE((*c)->Stats(true)->invariant_error.empty());
}

TEST(DaemonTest, LeaseExpiryFreesBlocksAndStaging) {
  auto flags = geometry_flags("fp32");
  flags.push_back("--lease_seconds=1");
  Daemon d(flags);
  ASSERT_TRUE(d.ready());
  ClientOptions o = d.options();
  o.heartbeat = false;  // a worker that died: no more heartbeats
  auto dead = Client::Attach(o);
  ASSERT_TRUE(dead.ok());
  auto id = *(*dead)->CreateSequence();
  Buffer k = *(*dead)->alloc((*dead)->append_bytes(50)), v = *(*dead)->alloc((*dead)->append_bytes(50));
  ASSERT_TRUE((*dead)->Append(id, 50, k, v).ok());
  auto watcher = Client::Attach(d.options(0));
  ASSERT_TRUE(watcher.ok());
  EXPECT_EQ((*watcher)->Stats()->blocks_used, 4u);
  uint64_t used = 1;
  for (int i = 0; i < 60 && used != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    used = (*watcher)->Stats()->blocks_used;
  }
  EXPECT_EQ(used, 0u);
  auto st = *(*watcher)->Stats(true);
  EXPECT_EQ(st.lease_expiries, 1u);
  EXPECT_EQ(st.sessions, 1u);  // the watcher's heartbeats keep it alive
  EXPECT_EQ((*dead)->Heartbeat().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*dead)->CreateSequence().status().code(), absl::StatusCode::kNotFound);
}

class MalformedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<Daemon>(geometry_flags("fp16"));
    ASSERT_TRUE(daemon_->ready());
    channel_ = grpc::CreateChannel(daemon_->target(), grpc::InsecureChannelCredentials());
    stub_ = v1::KaraKV::NewStub(channel_);
    v1::AttachRequest a;
    a.set_staging_bytes(65536);
    v1::AttachReply r;
    ASSERT_TRUE(call(&v1::KaraKV::Stub::Attach, a, &r).ok());
    session_ = r.session_id();
    staging_ = r.staging_bytes();
    v1::CreateSequenceRequest cr;
    cr.set_session_id(session_);
    v1::CreateSequenceReply crr;
    ASSERT_TRUE(call(&v1::KaraKV::Stub::CreateSequence, cr, &crr).ok());
    seq_ = crr.sequence_id();
    // One good append so there is state to preserve.
    ASSERT_TRUE(call(&v1::KaraKV::Stub::Append, append(seq_, 3, 0, kv_bytes(3)), &ar_).ok());
  }

  template <typename Req, typename Rep>
  grpc::Status call(grpc::Status (v1::KaraKV::Stub::*m)(grpc::ClientContext*, const Req&, Rep*), const Req& req, Rep* rep) {
    grpc::ClientContext ctx;
    return (stub_.get()->*m)(&ctx, req, rep);
  }

  uint64_t kv_bytes(int tokens) const { return uint64_t(3) * tokens * 2 * 32 * 2; }

  v1::AppendRequest append(uint64_t seq, int tokens, uint64_t offset, uint64_t length) {
    v1::AppendRequest req;
    req.set_session_id(session_);
    req.set_sequence_id(seq);
    req.set_num_tokens(tokens);
    req.mutable_k()->mutable_staging()->set_offset(offset);
    req.mutable_k()->mutable_staging()->set_length(length);
    req.mutable_v()->mutable_staging()->set_offset(offset);
    req.mutable_v()->mutable_staging()->set_length(length);
    return req;
  }

  std::string state() {
    v1::StatsRequest req;
    req.set_check_invariants(true);
    v1::StatsReply r;
    EXPECT_TRUE(call(&v1::KaraKV::Stub::Stats, req, &r).ok());
    EXPECT_EQ(r.invariant_error(), "");
    v1::ListSequencesReply l;
    EXPECT_TRUE(call(&v1::KaraKV::Stub::ListSequences, v1::ListSequencesRequest(), &l).ok());
    return absl::StrCat(r.blocks_used(), "/", r.resident_tokens(), "/", l.ShortDebugString());
  }

  void expect_refused(const grpc::Status& s, grpc::StatusCode code, const std::string& words) {
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(words));
  }

  std::unique_ptr<Daemon> daemon_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KaraKV::Stub> stub_;
  std::string session_;
  uint64_t staging_ = 0;
  uint64_t seq_ = 0;
  v1::AppendReply ar_;
};

TEST_F(MalformedTest, EveryBadRequestGetsItsCodeAndLeavesThePoolAsItWas) {
  const std::string before = state();
  v1::AppendReply ar;
  // Offsets past the region, ranges that wrap, wrong sizes, zero tokens, unknown ids.
  expect_refused(call(&v1::KaraKV::Stub::Append, append(seq_, 2, staging_ - 8, kv_bytes(2)), &ar),
                 grpc::StatusCode::INVALID_ARGUMENT, "falls outside");
  expect_refused(call(&v1::KaraKV::Stub::Append, append(seq_, 2, UINT64_MAX - 16, kv_bytes(2)), &ar),
                 grpc::StatusCode::INVALID_ARGUMENT, "falls outside");
  expect_refused(call(&v1::KaraKV::Stub::Append, append(seq_, 2, 0, kv_bytes(2) - 2), &ar),
                 grpc::StatusCode::INVALID_ARGUMENT, "expected 768");
  expect_refused(call(&v1::KaraKV::Stub::Append, append(seq_, 0, 0, 0), &ar), grpc::StatusCode::INVALID_ARGUMENT,
                 "num_tokens is 0");
  expect_refused(call(&v1::KaraKV::Stub::Append, append(4242, 2, 0, kv_bytes(2)), &ar),
                 grpc::StatusCode::NOT_FOUND, "unknown sequence 4242");
  v1::AppendRequest missing = append(seq_, 2, 0, kv_bytes(2));
  missing.clear_v();
  expect_refused(call(&v1::KaraKV::Stub::Append, missing, &ar), grpc::StatusCode::INVALID_ARGUMENT, "v is missing");
  v1::AppendRequest nosession = append(seq_, 2, 0, kv_bytes(2));
  nosession.set_session_id("s-forged");
  expect_refused(call(&v1::KaraKV::Stub::Append, nosession, &ar), grpc::StatusCode::NOT_FOUND, "unknown session");
  v1::AppendRequest inline_wrong;
  inline_wrong.set_session_id(session_);
  inline_wrong.set_sequence_id(seq_);
  inline_wrong.set_num_tokens(1);
  inline_wrong.mutable_k()->set_data(std::string(10, 'x'));
  inline_wrong.mutable_v()->set_data(std::string(10, 'x'));
  expect_refused(call(&v1::KaraKV::Stub::Append, inline_wrong, &ar), grpc::StatusCode::INVALID_ARGUMENT,
                 "k has 10 bytes");

  // Step: output range outside the region, misaligned, wrong batch sizes, bad layer, empty batch.
  v1::StepRequest step;
  step.set_session_id(session_);
  step.set_layer(0);
  step.add_sequence_ids(seq_);
  auto range = [](v1::StagingRange* r, uint64_t off, uint64_t len) {
    r->set_offset(off);
    r->set_length(len);
  };
  range(step.mutable_k()->mutable_staging(), 0, 128);
  range(step.mutable_v()->mutable_staging(), 128, 128);
  range(step.mutable_q()->mutable_staging(), 256, 6 * 32 * 4);
  range(step.mutable_out()->mutable_staging(), staging_ - 100, 6 * 32 * 4);
  v1::StepReply sr;
  expect_refused(call(&v1::KaraKV::Stub::Step, step, &sr), grpc::StatusCode::INVALID_ARGUMENT, "out: staging range");
  range(step.mutable_out()->mutable_staging(), 2, 6 * 32 * 4);
  expect_refused(call(&v1::KaraKV::Stub::Step, step, &sr), grpc::StatusCode::INVALID_ARGUMENT, "not a multiple of 4");
  range(step.mutable_out()->mutable_staging(), 4096, 6 * 32 * 4);
  range(step.mutable_q()->mutable_staging(), 256, 100);
  expect_refused(call(&v1::KaraKV::Stub::Step, step, &sr), grpc::StatusCode::INVALID_ARGUMENT, "q has 100 bytes");
  range(step.mutable_q()->mutable_staging(), 256, 6 * 32 * 4);
  step.set_layer(3);
  expect_refused(call(&v1::KaraKV::Stub::Step, step, &sr), grpc::StatusCode::INVALID_ARGUMENT, "expected 0..2");
  step.set_layer(1);
  expect_refused(call(&v1::KaraKV::Stub::Step, step, &sr), grpc::StatusCode::FAILED_PRECONDITION, "starts at layer 0");
  step.set_layer(0);
  step.clear_sequence_ids();
  expect_refused(call(&v1::KaraKV::Stub::Step, step, &sr), grpc::StatusCode::INVALID_ARGUMENT, "sequence_ids is empty");

  // Attach with the wrong geometry, or a staging region over the limit.
  v1::AttachRequest a;
  a.mutable_geometry()->set_num_layers(3);
  a.mutable_geometry()->set_num_q_heads(6);
  a.mutable_geometry()->set_num_kv_heads(3);
  a.mutable_geometry()->set_head_dim(32);
  v1::AttachReply r;
  expect_refused(call(&v1::KaraKV::Stub::Attach, a, &r), grpc::StatusCode::INVALID_ARGUMENT, "differs from the daemon's");
  v1::AttachRequest huge;
  huge.set_staging_bytes(uint64_t(1) << 40);
  expect_refused(call(&v1::KaraKV::Stub::Attach, huge, &r), grpc::StatusCode::INVALID_ARGUMENT, "exceeds the daemon's limit");
  EXPECT_EQ(state(), before);
}

TEST(DaemonTest, PoolExhaustionSaysWantedVsFreeAndKeepsServing) {
  auto flags = geometry_flags("fp32");
  flags.back() = "--pool_bytes=98304";  // 4 blocks of 24 KiB
  Daemon d(flags);
  ASSERT_TRUE(d.ready());
  auto c = Client::Attach(d.options());
  ASSERT_TRUE(c.ok());
  auto id = *(*c)->CreateSequence();
  Buffer k = *(*c)->alloc((*c)->append_bytes(80)), v = *(*c)->alloc((*c)->append_bytes(80));
  auto r = (*c)->Append(id, 80, k, v);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("wanted 5 blocks, 4 free of 4"));
  EXPECT_EQ((*c)->Stats()->blocks_used, 0u);
  c.value()->reset_staging();
  Buffer k2 = *(*c)->alloc((*c)->append_bytes(64)), v2 = *(*c)->alloc((*c)->append_bytes(64));
  EXPECT_EQ(*(*c)->Append(id, 64, k2, v2), 64);
  EXPECT_EQ((*c)->Stats(true)->blocks_free, 0u);
}

TEST(DaemonTest, SigtermDrainsAndExitsZero) {
  auto flags = geometry_flags("fp32");
  flags.back() = "--pool_bytes=64MiB";
  // The drain waits for the Attend, which takes well under a second in a plain build but over ten
  // under ThreadSanitizer, and over 20 (the tests' usual call deadline) under TSan on a machine whose
  // CPUs other work keeps busy; the daemon exits as soon as it is done either way.
  flags.push_back("--drain_seconds=600");
  Daemon d(flags);
  ASSERT_TRUE(d.ready());
  ClientOptions long_calls = d.options(32 << 20);
  long_calls.rpc_timeout = absl::Seconds(600);
  auto c = Client::Attach(long_calls);
  ASSERT_TRUE(c.ok());
  auto other = Client::Attach(d.options(0));
  ASSERT_TRUE(other.ok());
  const Geometry& g = (*c)->geometry();
  // A long call: 1536 causal queries over an 8192-token sequence.
  const int tokens = 8192, nq = 1536, layer = 2;
  auto id = *(*c)->CreateSequence();
  Buffer k = *(*c)->alloc((*c)->append_bytes(tokens)), v = *(*c)->alloc((*c)->append_bytes(tokens));
  synthetic::fill_prompt(k.data(), g, kSeed, Tensor::kKey, 0, 0, tokens);
  synthetic::fill_prompt(v.data(), g, kSeed, Tensor::kValue, 0, 0, tokens);
  ASSERT_TRUE((*c)->Append(id, tokens, k, v).ok());
  Buffer q = *(*c)->alloc((*c)->q_bytes(nq)), out = *(*c)->alloc((*c)->q_bytes(nq));
  for (int i = 0; i < nq; ++i) {
    synthetic::fill_query(q.as<float>().data() + i * g.q_token_elems(), g, kSeed, 0, layer, tokens - nq + i);
  }
  std::atomic<bool> done{false};
  absl::Status attend;
  std::thread t([&] {
    attend = (*c)->Attend(id, layer, nq, q, out);
    done = true;
  });
  // SIGTERM once the daemon serves it (Ping, which takes no lock, counts itself, hence 2).
  auto stub = v1::KaraKV::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  auto ping = [&](v1::PingReply* r) {
    grpc::ClientContext ctx;
    return stub->Ping(&ctx, v1::PingRequest(), r);
  };
  bool in_flight = false;
  for (int i = 0; i < 100000 && !in_flight && !done; ++i) {
    v1::PingReply r;
    in_flight = ping(&r).ok() && r.calls_in_flight() >= 2;
  }
  ASSERT_TRUE(in_flight) << "the Attend was never seen in flight";
  ASSERT_EQ(kill(d.pid(), SIGTERM), 0);
  // Once the daemon has taken the signal, new calls are refused, on another connection and on the
  // one the Attend uses, while the Attend goes on.
  grpc::Status refused_first;
  for (int i = 0; i < 100000 && refused_first.ok(); ++i) {
    v1::PingReply r;
    refused_first = ping(&r);
  }
  const absl::Status refused = (*other)->Ping();
  const absl::Status refused_same = (*c)->CreateSequence().status();
  const bool refused_while_in_flight = !done;
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_EQ(refused_same.code(), absl::StatusCode::kUnavailable) << refused_same;
  t.join();
  EXPECT_TRUE(refused_while_in_flight) << "the Attend finished before the new calls were refused";
  // The call in flight finished, with the right result.
  ASSERT_TRUE(attend.ok()) << attend;
  for (int i : {0, nq - 1}) {
    auto ref = synthetic::dense_attention(g, kSeed, 0, layer, tokens - nq + i);
    for (size_t j = 0; j < ref.size(); ++j) {
      ASSERT_NEAR(out.as<float>()[i * g.q_token_elems() + j], ref[j], 1e-4) << "query " << i;
    }
  }
  EXPECT_EQ(d.stop(), 0);
  EXPECT_EQ((*other)->Ping().code(), absl::StatusCode::kUnavailable);
}

// A daemon process's environment entry `name=...`, or "" without one.
std::string environ_entry(pid_t pid, const std::string& name) {
  const std::string all = read_file(absl::StrCat("/proc/", pid, "/environ"));
  for (absl::string_view entry : absl::StrSplit(all, '\0')) {
    if (absl::ConsumePrefix(&entry, name + "=")) return std::string(entry);
  }
  return "";
}

std::string process_name(pid_t pid) {
  return std::string(absl::StripTrailingAsciiWhitespace(read_file(absl::StrCat("/proc/", pid, "/comm"))));
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitizedMalloc = true;
#else
constexpr bool kSanitizedMalloc = false;
#endif

TEST(DaemonTest, CapsMallocsPerThreadCachesByReexecutingOnceUnderItsOwnName) {
  if (kSanitizedMalloc) GTEST_SKIP() << "a sanitizer's malloc has no glibc tunables (the daemon says so and runs on)";
  const char* env = std::getenv("GLIBC_TUNABLES");
  if (env != nullptr) GTEST_SKIP() << "GLIBC_TUNABLES is set for the tests already: " << env;
  {
    Daemon d(geometry_flags("fp16"));  // the default, 256 bytes
    ASSERT_TRUE(d.ready());
    EXPECT_EQ(environ_entry(d.pid(), "GLIBC_TUNABLES"), "glibc.malloc.tcache_max=256");
    EXPECT_EQ(process_name(d.pid()), "karakvd");  // not "exe": `pgrep karakvd` still finds it
    auto c = Client::Attach(d.options(1 << 20));
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_TRUE((*c)->CreateSequence().ok());
    EXPECT_EQ(d.stop(), 0);
  }
  {
    auto flags = geometry_flags("fp16");
    flags.push_back("--malloc_tcache_max=-1");  // glibc's default: no re-exec, nothing added
    Daemon d(flags);
    ASSERT_TRUE(d.ready());
    EXPECT_EQ(environ_entry(d.pid(), "GLIBC_TUNABLES"), "");
    EXPECT_EQ(d.stop(), 0);
  }
  {
    // The operator's own setting wins over the flag.
    setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_max=64", 1);
    Daemon d(geometry_flags("fp16"));
    unsetenv("GLIBC_TUNABLES");
    ASSERT_TRUE(d.ready());
    EXPECT_EQ(environ_entry(d.pid(), "GLIBC_TUNABLES"), "glibc.malloc.tcache_max=64");
    EXPECT_EQ(d.stop(), 0);
  }
}

TEST(DaemonTest, CliReportsHealthStatsAndSequencesAsTextAndJson) {
  Daemon d(geometry_flags("fp16"));
  ASSERT_TRUE(d.ready());
  auto c = Client::Attach(d.options());
  ASSERT_TRUE(c.ok());
  auto id = *(*c)->CreateSequence();
  Buffer k = *(*c)->alloc((*c)->append_bytes(20)), v = *(*c)->alloc((*c)->append_bytes(20));
  ASSERT_TRUE((*c)->Append(id, 20, k, v).ok());
  const std::string cli = std::string(KARAKV_CLI_PATH) + " --target=" + d.target();
  int code;
  EXPECT_EQ(run(cli + " health", &code), "SERVING\n");
  EXPECT_EQ(code, 0);
  std::string json = run(cli + " --json --check_invariants stats", &code);
  EXPECT_EQ(code, 0);
  // protobuf's JSON mapping: proto field names, 64-bit integers as strings (tests/integration/cli_test.cc
  // parses it back).
  EXPECT_THAT(json, HasSubstr("\"blocks_used\":\"2\","));
  EXPECT_THAT(json, HasSubstr("\"resident_tokens\":\"20\","));
  EXPECT_THAT(json, HasSubstr("\"invariants_checked\":true,\"invariant_error\":\"\""));
  EXPECT_THAT(json, HasSubstr("\"heap_in_use_bytes\":"));
  std::string seqs = run(cli + " --json sequences", &code);
  EXPECT_THAT(seqs, HasSubstr(absl::StrCat("{\"sequence_id\":\"", id, "\",")));
  EXPECT_THAT(seqs, HasSubstr("\"length\":20,"));
  EXPECT_THAT(run(cli + " stats", &code), HasSubstr("blocks used/free 2 / "));
  // "N MiB in use of M MiB held by malloc", or "not reported" under a sanitizer's malloc.
  EXPECT_THAT(run(cli + " stats", &code), HasSubstr("\nheap             "));
  // A refused call shows up in both forms, by method and status code.
  EXPECT_EQ((*c)->Append(id + 1000, 20, k, v).status().code(), absl::StatusCode::kNotFound);
  json = run(cli + " --json stats", &code);
  EXPECT_THAT(json, HasSubstr("\"decode_tokens\":\"0\","));
  EXPECT_THAT(json, HasSubstr("{\"method\":\"Append\",\"code\":\"NOT_FOUND\",\"count\":\"1\"}"));
  EXPECT_THAT(run(cli + " stats", &code), HasSubstr("failed RPCs      1: Append NOT_FOUND x1"));
  run(cli + " bogus 2>&1", &code);
  EXPECT_EQ(code, 2);
  run(std::string(KARAKV_CLI_PATH) + " --target=unix:/nonexistent.sock --timeout=1 health 2>&1", &code);
  EXPECT_EQ(code, 1);
}

TEST(DaemonTest, ExampleWorkerMatchesTheReferenceInBothModes) {
  Daemon d(geometry_flags("fp16"));
  ASSERT_TRUE(d.ready());
  for (const char* extra : {"", " --inline_tensors"}) {
    int code;
    std::string out = run(std::string(SYNTHETIC_WORKER_PATH) + " --target=" + d.target() +
                              " --sequences=3 --prompt=50 --generate=12 --check_every=3" + extra + " 2>&1",
                          &code);
    EXPECT_EQ(code, 0) << out;
    EXPECT_THAT(out, HasSubstr("ALL MATCHED"));
  }
}

}  // namespace
}  // namespace karakv

namespace karakv {
namespace {


TEST(DaemonTest, MetricsEndpointReportsPoolRpcsAndErrors) {
  int port = 0;
  auto started = testing::start_with_metrics(geometry_flags("fp16"), &port);
  Daemon& d = *started;
  ASSERT_TRUE(d.ready());
  auto c = Client::Attach(d.options());
  ASSERT_TRUE(c.ok());
  auto id = *(*c)->CreateSequence();
  Buffer k = *(*c)->alloc((*c)->append_bytes(20)), v = *(*c)->alloc((*c)->append_bytes(20));
  ASSERT_TRUE((*c)->Append(id, 20, k, v).ok());
  EXPECT_FALSE((*c)->Release(id + 100).ok());
  const std::string m = http_get(port, "/metrics");
  EXPECT_THAT(m, HasSubstr("karakv_pool_blocks_used 2\n"));
  EXPECT_THAT(m, HasSubstr("karakv_resident_tokens 20\n"));
  EXPECT_THAT(m, HasSubstr("karakv_rpc_duration_seconds_count{method=\"Append\"} 1\n"));
  EXPECT_THAT(m, HasSubstr("karakv_rpc_errors_total{code=\"NOT_FOUND\",method=\"ReleaseSequence\"} 1\n"));
  // 20 fp16 tokens in 2 blocks of 16: 20/32 of the bytes held are tokens.
  EXPECT_THAT(m, HasSubstr("karakv_compression_factor{kind=\"actual\",policy=\"none\"} 0.625\n"));
  EXPECT_THAT(m, HasSubstr("karakv_compression_factor{kind=\"nominal\",policy=\"none\"} 1\n"));
  EXPECT_THAT(m, HasSubstr("karakv_tenant_blocks_in_use{tenant=\"default\"} 2\n"));
  EXPECT_THAT(m, ::testing::ContainsRegex(
                     "\nkarakv_build_info\\{backend=\"(cpu|cuda)\",revision=\"([0-9a-f]+|unknown)\",version=\"[0-9.]+\"\\} 1\n"));
  EXPECT_THAT(m, ::testing::ContainsRegex("\nkarakv_kv_cache_usage_perc 0\\.[0-9]+\n"));
  EXPECT_THAT(m, ::testing::ContainsRegex("\nprocess_start_time_seconds [0-9.e+]+\n"));
}

}  // namespace
}  // namespace karakv

namespace karakv {
namespace {

// After compaction, every Step's output must equal dense attention over exactly the positions
// resident before it plus the new token: nothing mis-gathered, for every policy.
class CompactedAttentionTest : public ::testing::TestWithParam<const char*> {};

TEST_P(CompactedAttentionTest, StepOverCompactedCacheEqualsDenseOverKeptTokens) {
  Daemon d(geometry_flags("fp16"));
  ASSERT_TRUE(d.ready());
  auto c = Client::Attach(d.options(32 << 20));
  ASSERT_TRUE(c.ok());
  const Geometry& g = (*c)->geometry();
  SequenceOptions o;
  o.policy = GetParam();
  if (o.policy == "kara") o.params = {{"window", 32}, {"period", 4}, {"recent", 16}, {"budget", 0}};
  else if (o.policy != "none") o.params = {{"c_max", 64}, {"c_target", 40}, {"w_obs", 8}};
  if (o.policy == "streaming" || o.policy == "h2o") o.params.erase("w_obs");
  auto id = (*c)->CreateSequence(o);
  ASSERT_TRUE(id.ok()) << id.status();
  const int prompt = 21, nq = 8;
  Buffer k = *(*c)->alloc((*c)->append_bytes(prompt)), v = *(*c)->alloc((*c)->append_bytes(prompt));
  Buffer pq = *(*c)->alloc(size_t(g.num_layers) * (*c)->q_bytes(nq));
  synthetic::fill_prompt(k.data(), g, kSeed, Tensor::kKey, *id, 0, prompt);
  synthetic::fill_prompt(v.data(), g, kSeed, Tensor::kValue, *id, 0, prompt);
  for (int l = 0; l < g.num_layers; ++l)
    for (int i = 0; i < nq; ++i)
      synthetic::fill_query(pq.as<float>().data() + (l * nq + i) * g.q_token_elems(), g, kSeed, *id, l, prompt - nq + i);
  ASSERT_TRUE((*c)->Append(*id, prompt, k, v, pq, nq).ok());
  (*c)->reset_staging();
  Buffer sk = *(*c)->alloc((*c)->step_kv_bytes(1)), sv = *(*c)->alloc((*c)->step_kv_bytes(1));
  Buffer sq = *(*c)->alloc((*c)->q_bytes(1)), out = *(*c)->alloc((*c)->q_bytes(1));
  const size_t rows = size_t(g.num_layers) * g.num_kv_heads;
  Buffer rk = Client::alloc_heap((*c)->append_bytes(200)), rv = Client::alloc_heap(rk.size());
  Buffer rp = Client::alloc_heap(rows * 200 * 4);
  const uint64_t ids[] = {*id};
  double max_err = 0;
  for (int64_t pos = prompt; pos < prompt + 120; ++pos) {
    auto n = (*c)->ReadKV(*id, rk, rv, rp);
    ASSERT_TRUE(n.ok()) << n.status();
    for (int l = 0; l < g.num_layers; ++l) {
      synthetic::fill_token(sk.data(), g, kSeed, Tensor::kKey, *id, l, pos);
      synthetic::fill_token(sv.data(), g, kSeed, Tensor::kValue, *id, l, pos);
      synthetic::fill_query(sq.as<float>().data(), g, kSeed, *id, l, pos);
      ASSERT_TRUE((*c)->Step(l, ids, sk, sv, sq, out).ok());
      std::vector<std::vector<int32_t>> heads(g.num_kv_heads);
      for (int h = 0; h < g.num_kv_heads; ++h) {
        const int32_t* p = rp.as<int32_t>().data() + (size_t(l) * g.num_kv_heads + h) * *n;
        heads[h].assign(p, p + *n);
        heads[h].push_back(int32_t(pos));
      }
      auto ref = synthetic::dense_attention_over(g, kSeed, *id, l, pos, heads);
      for (size_t i = 0; i < ref.size(); ++i) max_err = std::max(max_err, std::abs(out.as<float>()[i] - ref[i]));
    }
  }
  EXPECT_LE(max_err, kTolerance);
  auto info = (*(*c)->ListSequences())[0];
  EXPECT_EQ(info.logical_length, uint32_t(prompt + 120));
  if (std::string(GetParam()) != "none") {
    EXPECT_GE(info.compactions, 2u);
    EXPECT_LT(info.length, info.logical_length);
  }
  auto st = (*c)->Stats(true);
  EXPECT_EQ(st->invariant_error, "");
}

INSTANTIATE_TEST_SUITE_P(Policies, CompactedAttentionTest,
                         ::testing::Values("none", "kara", "snapkv", "streaming", "h2o", "chunkkv"));

// ListSequences says a sequence's parameters as the daemon resolved them: the one given, and the
// defaults of the rest filled in (the quality runs record these, so a run says what ran).
TEST(DaemonTest, ListSequencesSaysTheResolvedParameters) {
  Daemon d(geometry_flags("fp16"));
  ASSERT_TRUE(d.ready());
  auto c = Client::Attach(d.options());
  ASSERT_TRUE(c.ok());
  SequenceOptions o;
  o.policy = "kara";
  o.params = {{"rho", 0.5}};
  ASSERT_TRUE((*c)->CreateSequence(o).ok());
  SequenceOptions none;
  ASSERT_TRUE((*c)->CreateSequence(none).ok());
  auto list = (*c)->ListSequences();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 2u);
  const SequenceInfo& kara = (*list)[0].policy == "kara" ? (*list)[0] : (*list)[1];
  EXPECT_EQ(kara.params.at("rho"), 0.5);
  for (const char* name : {"window", "period", "recent", "budget"}) {
    ASSERT_TRUE(kara.params.count(name)) << name << " was not filled in";
  }
  EXPECT_GT(kara.params.at("window"), 0);
  EXPECT_TRUE(kara.prefill_params.empty());
  const SequenceInfo& plain = (*list)[0].policy == "kara" ? (*list)[1] : (*list)[0];
  EXPECT_EQ(plain.policy, "none");
  EXPECT_TRUE(plain.params.empty());
}

TEST(DaemonTest, CliCompactAndInspect) {
  Daemon d(geometry_flags("fp16"));
  ASSERT_TRUE(d.ready());
  auto c = Client::Attach(d.options());
  ASSERT_TRUE(c.ok());
  const Geometry& g = (*c)->geometry();
  SequenceOptions o;
  o.policy = "snapkv";
  o.params = {{"c_max", 1000}, {"c_target", 24}, {"w_obs", 4}};
  auto id = *(*c)->CreateSequence(o);
  Buffer k = *(*c)->alloc((*c)->append_bytes(40)), v = *(*c)->alloc((*c)->append_bytes(40));
  Buffer q = *(*c)->alloc(size_t(g.num_layers) * (*c)->q_bytes(4));
  ASSERT_TRUE((*c)->Append(id, 40, k, v, q, 4).ok());
  const std::string cli = std::string(KARAKV_CLI_PATH) + " --target=" + d.target();
  int code;
  std::string dry = run(cli + " --dry_run compact " + std::to_string(id), &code);
  EXPECT_EQ(code, 0) << dry;
  EXPECT_THAT(dry, HasSubstr("40 -> 24 resident tokens (dry run)"));
  EXPECT_EQ((*(*c)->ListSequences())[0].length, 40u);
  std::string done = run(cli + " compact", &code);
  EXPECT_THAT(done, HasSubstr("40 -> 24 resident tokens"));
  EXPECT_EQ((*(*c)->ListSequences())[0].length, 24u);
  std::string map = run(cli + " inspect " + std::to_string(id), &code);
  EXPECT_EQ(code, 0);
  EXPECT_THAT(map, HasSubstr("resident 24 of 40 logical tokens"));
  EXPECT_THAT(map, HasSubstr("L0  H0  ["));
  // K/V/Q are all zero: every score ties, so the lowest positions win (the tie rule), plus the
  // observation window 36-39.
  EXPECT_THAT(map, HasSubstr("] 0-19 36-39\n"));
  EXPECT_THAT(map, HasSubstr("[####################................####]"));
  std::string json = run(cli + " --json inspect " + std::to_string(id), &code);
  EXPECT_THAT(json, HasSubstr(",\"length\":24,"));
  EXPECT_THAT(json, HasSubstr(",\"logical_length\":40,"));
  std::string stats = run(cli + " stats", &code);
  EXPECT_THAT(stats, HasSubstr("snapkv"));
  run(cli + " inspect 999999 2>&1", &code);
  EXPECT_EQ(code, 1);
}

}  // namespace
}  // namespace karakv
