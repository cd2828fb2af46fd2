// The service's handlers without a transport (KaraKVService::Handle, what each gRPC method runs
// before Finish, and what the fuzz harnesses call), the ring server without threads
// (RingServer::poll), and the regression tests of what fuzzing found (tests/fuzz).
#include "server/heap_usage.h"
#include "server/service.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "karakv/v1/geometry.h"
#include "karakv/v1/ring.h"
#include "server/metrics.h"
#include "server/ring.h"
#include "server/events.h"
#include "tests/server/delegating_backend.h"
#include "spdlog/spdlog.h"
#include "test_geometry.h"

namespace karakv::server {
namespace {

using ::testing::HasSubstr;

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::err);
    CoreConfig rc;
    rc.geometry = testing::small_test_geometry(kernels::DType::kFloat32);  // L2 Hq4 Hk2 D8, block 4
    rc.pool_bytes = 32 * rc.geometry.block_bytes();
    core_ = *Core::create(rc, kernels::make_cpu_backend(1));
    metrics_ = *Metrics::create("");
    service_ = std::make_unique<KaraKVService>(core_.get(), metrics_.get(), true);
    RingConfig cfg;
    cfg.threads = false;
    rings_ = std::make_unique<RingServer>(&service_->gate(), core_.get(), metrics_.get(), cfg);
    service_->set_rings(rings_.get());
  }
  void TearDown() override {
    rings_->stop_all();
    EXPECT_TRUE(core_->check_invariants().ok());
  }

  std::string attach(bool fast_path = false) {
    v1::AttachRequest req;
    req.set_staging_bytes(1 << 16);
    req.set_fast_path(fast_path);
    v1::AttachReply reply;
    EXPECT_TRUE(service_->Handle(req, &reply).ok());
    return reply.session_id();
  }
  uint64_t create_sequence(const std::string& session) {
    v1::CreateSequenceRequest c;
    c.set_session_id(session);
    v1::CreateSequenceReply cr;
    EXPECT_TRUE(service_->Handle(c, &cr).ok());
    return cr.sequence_id();
  }
  // An inline Append claiming `num_tokens` tokens, carrying K and V of `data_tokens`.
  v1::AppendRequest inline_append(const std::string& session, uint64_t id, uint32_t num_tokens, int data_tokens) {
    v1::AppendRequest a;
    a.set_session_id(session);
    a.set_sequence_id(id);
    a.set_num_tokens(num_tokens);
    a.mutable_k()->set_data(std::string(core_->append_bytes(data_tokens), '\0'));
    a.mutable_v()->set_data(std::string(core_->append_bytes(data_tokens), '\0'));
    return a;
  }
  // A sequence with `tokens` tokens appended inline.
  uint64_t sequence(const std::string& session, int tokens) {
    const uint64_t id = create_sequence(session);
    v1::AppendReply ar;
    EXPECT_TRUE(service_->Handle(inline_append(session, id, tokens, tokens), &ar).ok());
    return id;
  }

  std::unique_ptr<Core> core_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<KaraKVService> service_;
  std::unique_ptr<RingServer> rings_;
};

TEST_F(ServiceTest, HandleServesTheSessionlessAndSessionMethods) {
  const std::string s = attach();
  const uint64_t id = sequence(s, 5);
  v1::ForkSequenceRequest fork;
  fork.set_session_id(s);
  fork.set_sequence_id(id);
  v1::ForkSequenceReply forked;
  ASSERT_TRUE(service_->Handle(fork, &forked).ok());
  EXPECT_EQ(forked.sequence_id(), id + 1);
  v1::ListSequencesRequest list;
  list.set_session_id(s);
  v1::ListSequencesReply listed;
  ASSERT_TRUE(service_->Handle(list, &listed).ok());
  ASSERT_EQ(listed.sequences_size(), 2);
  EXPECT_EQ(listed.sequences(0).session_id(), s);
  v1::HeartbeatRequest hb;
  hb.set_session_id(s);
  v1::HeartbeatReply hbr;
  ASSERT_TRUE(service_->Handle(hb, &hbr).ok());
  EXPECT_EQ(hbr.lease_seconds(), 30u);
  v1::ReleaseSequenceRequest rel;
  rel.set_session_id(s);
  rel.set_sequence_id(forked.sequence_id());
  v1::ReleaseSequenceReply relr;
  ASSERT_TRUE(service_->Handle(rel, &relr).ok());
  v1::DetachRequest det;
  det.set_session_id(s);
  v1::DetachReply detr;
  ASSERT_TRUE(service_->Handle(det, &detr).ok());
  EXPECT_EQ(detr.sequences_released(), 1u);
  const absl::Status again = service_->Handle(hb, &hbr);
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(again.message(), HasSubstr("unknown session"));
  // A gone session's listing is refused the same way, not answered with "no sequences" (a client
  // would take that for an empty session of its own).
  listed.Clear();
  const absl::Status gone = service_->Handle(list, &listed);
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(gone.message(), HasSubstr("unknown session"));
  EXPECT_EQ(listed.sequences_size(), 0);
  v1::StatsRequest st;
  st.set_check_invariants(true);
  v1::StatsReply str;
  ASSERT_TRUE(service_->Handle(st, &str).ok());
  EXPECT_TRUE(str.invariants_checked());
  EXPECT_EQ(str.invariant_error(), "");
  EXPECT_EQ(str.blocks_used(), 0u);
  EXPECT_EQ(str.sessions(), 0u);
  // This test process's own malloc (zero under a sanitizer's allocator).
  EXPECT_EQ(str.heap_in_use_bytes() > 0, read_heap_usage().glibc);
  EXPECT_LE(str.heap_in_use_bytes(), str.heap_held_bytes());
  // The failed Heartbeat is counted as the gRPC method would count it.
  bool counted = false;
  for (const auto& e : str.rpc_errors()) counted |= e.method() == "Heartbeat" && e.code() == "NOT_FOUND";
  EXPECT_TRUE(counted);
}

TEST_F(ServiceTest, DrainingRefusesThroughHandleToo) {
  service_->start_draining();
  v1::PingReply reply;
  const absl::Status s = service_->Handle(v1::PingRequest(), &reply);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("draining"));
}

// The ring server without threads: poll() runs exactly what the thread would.
TEST_F(ServiceTest, RingPollRunsCommandsOnTheCallersThread) {
  const std::string s = attach(true);
  const uint64_t id = sequence(s, 5);
  auto staging = core_->ring_regions(s)->rings;
  ring::Header* h = ring::header(staging->reserved());
  ring::Command c{};
  c.tag = 42;
  c.op = uint32_t(ring::Op::kAttend);
  c.sequence_id = id;
  c.count = 1;
  c.q = {0, core_->q_bytes(1)};
  c.out = {4096, core_->q_bytes(1)};
  std::memcpy(&ring::commands(staging->reserved())[0], &c, sizeof c);
  h->sq_tail.store(1);
  auto ran = rings_->poll(s);
  ASSERT_TRUE(ran.ok()) << ran.status();
  EXPECT_EQ(*ran, 1);
  ASSERT_EQ(h->cq_tail.load(), 1u);
  const ring::Completion& done = ring::completions(staging->reserved())[0];
  EXPECT_EQ(done.tag, 42u);
  EXPECT_EQ(done.code, 0u) << std::string(done.message, done.message_bytes);
  // Nothing waiting: nothing run.
  EXPECT_EQ(*rings_->poll(s), 0);
  // A garbage command closes the ring and the session, as on the thread.
  c.op = 9;
  std::memcpy(&ring::commands(staging->reserved())[1], &c, sizeof c);
  h->sq_tail.store(2);
  EXPECT_EQ(*rings_->poll(s), 0);
  EXPECT_EQ(h->state.load(), uint32_t(ring::State::kClosed));
  EXPECT_THAT(std::string(h->close_message), HasSubstr("has op 9"));
  EXPECT_FALSE(core_->staging(s).ok());
  const auto gone = rings_->poll(s);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
}

// Found with service_fuzzer (tests/fuzz/corpus/service_fuzzer/finding-attend-num-queries-4294967295):
// a 17-byte Attend claiming 2^32 - 1 queries had the handler size its inline output, 512 GiB,
// before anything checked num_queries against q. Now the output is sized only once q agrees.
TEST_F(ServiceTest, AttendClaimingMoreQueriesThanItSendsAllocatesNothing) {
  const std::string s = attach();
  const uint64_t id = sequence(s, 5);
  v1::AttendRequest req;
  req.set_session_id(s);
  req.set_sequence_id(id);
  req.set_num_queries(4294967295u);
  req.mutable_q()->set_data(std::string(core_->q_bytes(1), '\0'));
  v1::AttendReply reply;
  absl::Status st = service_->Handle(req, &reply);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "num_queries 4294967295 is out of range, expected 1..2147483647");
  EXPECT_EQ(reply.out().size(), 0u);
  req.set_num_queries(1u << 24);  // in range, but q holds one query
  st = service_->Handle(req, &reply);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "q has 128 bytes, expected 2147483648 ([N=16777216][Hq=4][D=8] fp32)");
  EXPECT_EQ(reply.out().size(), 0u);
  // Staging output: the range's length is checked against the claim, nothing is allocated.
  req.mutable_out()->mutable_staging()->set_offset(0);
  req.mutable_out()->mutable_staging()->set_length(128);
  st = service_->Handle(req, &reply);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "out staging range has 128 bytes, expected 2147483648");
}

TEST_F(ServiceTest, StepWithMoreSequencesThanItsQueriesAllocatesNothing) {
  const std::string s = attach();
  const uint64_t id = sequence(s, 5);
  v1::StepRequest req;
  req.set_session_id(s);
  for (int i = 0; i < 100000; ++i) req.add_sequence_ids(id);
  req.mutable_k()->set_data(std::string(core_->step_kv_bytes(1), '\0'));
  req.mutable_v()->set_data(std::string(core_->step_kv_bytes(1), '\0'));
  req.mutable_q()->set_data(std::string(core_->q_bytes(1), '\0'));
  v1::StepReply reply;
  const absl::Status st = service_->Handle(req, &reply);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "k has 64 bytes, expected 6400000 ([B=100000][Hk=2][D=8] fp32)");
  EXPECT_EQ(reply.out().size(), 0u);
}

}  // namespace
}  // namespace karakv::server

namespace karakv::server {
namespace {

// A softmax scale that is NaN, negative or infinite is refused naming `scale`, on every path that
// reaches attention (Step and Attend, through gRPC's handler and through the ring); 0 still means
// 1/sqrt(head_dim) and a positive scale is used as given.
TEST_F(ServiceTest, StepAndAttendRefuseABadScaleNamingIt) {
  const std::string s = attach(true);
  const uint64_t id = sequence(s, 5);
  const float kBad[] = {std::nanf(""), -1.0f, std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity()};
  auto step = [&](float scale) {
    v1::StepRequest req;
    req.set_session_id(s);
    req.set_layer(0);
    req.add_sequence_ids(id);
    req.mutable_k()->set_data(std::string(core_->step_kv_bytes(1), '\0'));
    req.mutable_v()->set_data(std::string(core_->step_kv_bytes(1), '\0'));
    req.mutable_q()->set_data(std::string(core_->q_bytes(1), '\0'));
    req.set_scale(scale);
    v1::StepReply reply;
    return service_->Handle(req, &reply);
  };
  auto attend = [&](float scale) {
    v1::AttendRequest req;
    req.set_session_id(s);
    req.set_sequence_id(id);
    req.set_num_queries(1);
    req.mutable_q()->set_data(std::string(core_->q_bytes(1), '\0'));
    req.set_scale(scale);
    v1::AttendReply reply;
    return service_->Handle(req, &reply);
  };
  auto staging = core_->ring_regions(s)->rings;
  ring::Header* h = ring::header(staging->reserved());
  uint64_t submitted = 0;
  auto ring_attend = [&](float scale) {
    ring::Command c{};
    c.op = uint32_t(ring::Op::kAttend);
    c.sequence_id = id;
    c.count = 1;
    c.q = {0, core_->q_bytes(1)};
    c.out = {4096, core_->q_bytes(1)};
    c.scale = scale;
    std::memcpy(&ring::commands(staging->reserved())[submitted % ring::kSlots], &c, sizeof c);
    h->sq_tail.store(++submitted);
    EXPECT_EQ(*rings_->poll(s), 1);
    const ring::Completion& done = ring::completions(staging->reserved())[(submitted - 1) % ring::kSlots];
    h->cq_head.store(submitted);
    return absl::Status(static_cast<absl::StatusCode>(done.code), std::string(done.message, done.message_bytes));
  };
  for (float bad : kBad) {
    for (const absl::Status& st : {attend(bad), ring_attend(bad), step(bad)}) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
      EXPECT_THAT(std::string(st.message()), HasSubstr("scale is ")) << bad;
      EXPECT_THAT(std::string(st.message()), HasSubstr("expected a finite number > 0")) << bad;
    }
  }
  EXPECT_THAT(std::string(attend(std::nanf("")).message()), HasSubstr("scale is NaN"));
  // Refused before anything changed: the sequence has no step in progress.
  v1::InspectRequest ireq;
  ireq.set_sequence_id(id);
  v1::InspectReply irep;
  ASSERT_TRUE(service_->Handle(ireq, &irep).ok());
  EXPECT_EQ(irep.info().pending_layer(), -1);
  EXPECT_EQ(irep.info().length(), 5u);
  EXPECT_TRUE(attend(0.0f).ok());
  EXPECT_TRUE(attend(0.125f).ok());
  EXPECT_TRUE(ring_attend(2.0f).ok());
  EXPECT_TRUE(step(0.0f).ok());
}

// Attach without a geometry is served the daemon's (the reply says which); a geometry with any of
// layers, heads or head_dim set has every field compared, so a partial one cannot slip through.
TEST_F(ServiceTest, AttachComparesAnyGeometryItIsSent) {
  const kernels::Geometry& g = core_->geometry();
  v1::AttachRequest none;
  v1::AttachReply reply;
  ASSERT_TRUE(service_->Handle(none, &reply).ok());
  EXPECT_EQ(reply.geometry().num_layers(), g.num_layers);
  EXPECT_EQ(reply.geometry().head_dim(), g.head_dim);
  v1::AttachRequest empty;
  empty.mutable_geometry();  // present, every field zero
  ASSERT_TRUE(service_->Handle(empty, &reply).ok());
  v1::AttachRequest partial;
  partial.mutable_geometry()->set_head_dim(g.head_dim * 2);  // layers left at 0
  absl::Status st = service_->Handle(partial, &reply);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("differs from the daemon's"));
  v1::AttachRequest same;
  *same.mutable_geometry() = v1::to_proto(g);
  EXPECT_TRUE(service_->Handle(same, &reply).ok());
  same.mutable_geometry()->set_num_kv_heads(g.num_kv_heads * 2);
  st = service_->Handle(same, &reply);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()),
              HasSubstr(absl::StrCat("num_kv_heads ", g.num_kv_heads * 2, " (the daemon's: ", g.num_kv_heads, ")")));
  EXPECT_THAT(std::string(st.message()), ::testing::Not(HasSubstr("num_layers")));  // only what differs
}

// A geometry that sets only dtype and block_size has not said which model the worker runs: it is
// refused (it was once served the daemon's geometry silently), naming every field that differs,
// the zero ones too, with the daemon's values.
TEST_F(ServiceTest, AttachRefusesAPartialGeometryNamingTheFieldsThatDiffer) {
  const kernels::Geometry& g = core_->geometry();  // fp32, block 4
  v1::AttachRequest partial;
  partial.mutable_geometry()->set_dtype(v1::DTYPE_FP16);
  partial.mutable_geometry()->set_block_size(g.block_size * 8);
  v1::AttachReply reply;
  absl::Status st = service_->Handle(partial, &reply);
  ASSERT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  const std::string m(st.message());
  EXPECT_THAT(m, HasSubstr(absl::StrCat("num_layers 0 (the daemon's: ", g.num_layers, ")")));
  EXPECT_THAT(m, HasSubstr(absl::StrCat("num_q_heads 0 (the daemon's: ", g.num_q_heads, ")")));
  EXPECT_THAT(m, HasSubstr(absl::StrCat("num_kv_heads 0 (the daemon's: ", g.num_kv_heads, ")")));
  EXPECT_THAT(m, HasSubstr(absl::StrCat("head_dim 0 (the daemon's: ", g.head_dim, ")")));
  EXPECT_THAT(m, HasSubstr(absl::StrCat("block_size ", g.block_size * 8, " (the daemon's: ", g.block_size, ")")));
  EXPECT_THAT(m, HasSubstr("dtype fp16 (the daemon's: fp32)"));
  EXPECT_TRUE(reply.session_id().empty());
  // The whole geometry but the dtype left unspecified: the dtype is named, nothing else.
  v1::AttachRequest no_dtype;
  *no_dtype.mutable_geometry() = v1::to_proto(g);
  no_dtype.mutable_geometry()->set_dtype(v1::DTYPE_UNSPECIFIED);
  st = service_->Handle(no_dtype, &reply);
  ASSERT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("dtype unspecified (the daemon's: fp32)"));
  EXPECT_THAT(std::string(st.message()), ::testing::Not(HasSubstr("num_layers")));
  // Only a block size, equal to the daemon's: still partial.
  v1::AttachRequest block_only;
  block_only.mutable_geometry()->set_block_size(g.block_size);
  EXPECT_EQ(service_->Handle(block_only, &reply).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core_->stats().sessions, 0);
}

// Counts are reported as they were sent: 2^32 - 1 tokens is "4294967295", never "-1".
TEST_F(ServiceTest, ARefusedCountIsReportedAsTheNumberSent) {
  const std::string session = attach();
  v1::AppendRequest a = inline_append(session, create_sequence(session), 4294967295u, 1);
  v1::AppendReply ar;
  absl::Status st = service_->Handle(a, &ar);
  ASSERT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()),
              HasSubstr(absl::StrCat("num_tokens is 4294967295, expected 1..", Core::kMaxAppendTokens)));
  a.set_num_tokens(2147483648u);  // INT32_MAX + 1: was negative once cast
  st = service_->Handle(a, &ar);
  EXPECT_THAT(std::string(st.message()), HasSubstr("num_tokens is 2147483648"));
  a.set_num_tokens(1);
  a.set_num_query_tokens(4294967295u);
  a.mutable_q()->set_data(std::string(core_->q_bytes(1) * core_->geometry().num_layers, '\0'));
  st = service_->Handle(a, &ar);
  ASSERT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("num_query_tokens is 4294967295, expected 0..num_tokens (1)"));
  a.set_num_query_tokens(0);
  a.clear_q();
  ASSERT_TRUE(service_->Handle(a, &ar).ok());  // the same request with honest counts is served
  EXPECT_EQ(ar.length(), 1u);
}

}  // namespace
}  // namespace karakv::server

namespace karakv::server {
namespace {

// Inspect and Compact's dry run show every parameter of the policy as the daemon resolved it, the
// defaults filled in, so an operator sees what a sequence runs without knowing the defaults.
TEST_F(ServiceTest, InspectAndDryRunShowTheResolvedParameters) {
  const std::string s = attach();
  v1::CreateSequenceRequest c;
  c.set_session_id(s);
  c.set_policy("kara");
  (*c.mutable_params())["window"] = 16;
  (*c.mutable_params())["observers"] = 2;
  v1::CreateSequenceReply cr;
  ASSERT_TRUE(service_->Handle(c, &cr).ok());
  v1::InspectRequest ireq;
  ireq.set_sequence_id(cr.sequence_id());
  v1::InspectReply irep;
  ASSERT_TRUE(service_->Handle(ireq, &irep).ok());
  const auto& params = irep.info().params();
  EXPECT_EQ(params.at("window"), 16);
  EXPECT_EQ(params.at("observers"), 2);
  EXPECT_EQ(params.at("recent"), 256);  // a default, filled in
  EXPECT_EQ(params.at("rho"), 0.25);
  EXPECT_EQ(params.count("residual"), 0u);  // no storage format
  v1::CompactRequest dry;
  dry.set_session_id(s);
  dry.set_sequence_id(cr.sequence_id());
  dry.set_dry_run(true);
  v1::CompactReply drep;
  ASSERT_TRUE(service_->Handle(dry, &drep).ok());
  ASSERT_EQ(drep.sequences_size(), 1);
  EXPECT_EQ(drep.sequences(0).params().at("window"), 16);
  EXPECT_EQ(drep.sequences(0).params().at("norm"), 0);
}

// Device staging on the CPU backend: refused at Attach, naming the backend and what to do; no
// session is left behind.
TEST_F(ServiceTest, DeviceStagingOnTheCpuBackendIsRefusedNamingTheFix) {
  v1::AttachRequest req;
  req.set_staging_bytes(1 << 20);
  req.set_staging_kind(v1::STAGING_KIND_CUDA_IPC);
  v1::AttachReply reply;
  const absl::Status s = service_->Handle(req, &reply);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("cpu backend"));
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("--backend=cuda"));
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("staging_kind SHM"));
  EXPECT_TRUE(reply.session_id().empty());
  EXPECT_EQ(core_->device_staging_bytes(), 0u);

  req.set_fast_path(true);  // the same refusal, and no rings region left behind
  const absl::Status with_rings = service_->Handle(req, &reply);
  EXPECT_EQ(with_rings.code(), absl::StatusCode::kFailedPrecondition) << with_rings;
  EXPECT_THAT(std::string(with_rings.message()), ::testing::HasSubstr("--backend=cuda"));
  req.set_fast_path(false);
  // VMM staging (file descriptors for workers in another PID namespace): refused the same way.
  req.set_staging_kind(v1::STAGING_KIND_CUDA_VMM_FD);
  const absl::Status vmm = service_->Handle(req, &reply);
  EXPECT_EQ(vmm.code(), absl::StatusCode::kFailedPrecondition) << vmm;
  EXPECT_THAT(std::string(vmm.message()), ::testing::HasSubstr("staging_kind CUDA_VMM_FD"));
  EXPECT_THAT(std::string(vmm.message()), ::testing::HasSubstr("cpu backend"));
  EXPECT_THAT(std::string(vmm.message()), ::testing::HasSubstr("--backend=cuda"));
  EXPECT_TRUE(reply.session_id().empty());
  EXPECT_EQ(core_->device_staging_bytes(), 0u);
  req.set_staging_kind(static_cast<v1::StagingKind>(9));
  const absl::Status unknown = service_->Handle(req, &reply);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unknown.message()), ::testing::HasSubstr("staging_kind 9 unknown"));
  v1::StatsRequest stats_req;
  v1::StatsReply stats;
  ASSERT_TRUE(service_->Handle(stats_req, &stats).ok());
  EXPECT_EQ(stats.sessions(), 0u);
}

// A shm session's requests may name a staging generation; a wrong one is refused before any
// tensor is touched, naming both generations.
TEST_F(ServiceTest, AWrongStagingGenerationIsRefusedNamingBoth) {
  const std::string s = attach();
  const uint64_t seq = sequence(s, 4);
  v1::StepRequest step;
  step.set_session_id(s);
  step.set_layer(0);
  step.add_sequence_ids(seq);
  const size_t kv = core_->step_kv_bytes(1), q = core_->q_bytes(1);
  step.mutable_k()->mutable_staging()->set_offset(0);
  step.mutable_k()->mutable_staging()->set_length(kv);
  step.mutable_v()->mutable_staging()->set_offset(1024);
  step.mutable_v()->mutable_staging()->set_length(kv);
  step.mutable_q()->mutable_staging()->set_offset(2048);
  step.mutable_q()->mutable_staging()->set_length(q);
  step.mutable_out()->mutable_staging()->set_offset(4096);
  step.mutable_out()->mutable_staging()->set_length(q);
  step.set_staging_generation(5);
  v1::StepReply reply;
  const absl::Status refused = service_->Handle(step, &reply);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(std::string(refused.message()), ::testing::HasSubstr("generation 5"));
  EXPECT_THAT(std::string(refused.message()), ::testing::HasSubstr("generation 0"));
  // Nothing happened: the sequence is not mid-step, and the same Step without a generation runs.
  step.set_staging_generation(0);
  EXPECT_TRUE(service_->Handle(step, &reply).ok());
}

// The device staging fields survive the wire: 64 handle bytes (any byte values), the generation,
// the device, and the request's generation; an old client's AttachRequest parses as SHM.
TEST(StagingProtoTest, DeviceStagingFieldsRoundTrip) {
  v1::AttachReply reply;
  std::string handle(64, '\0');
  for (int i = 0; i < 64; ++i) handle[i] = static_cast<char>(255 - 3 * i);
  reply.set_staging_kind(v1::STAGING_KIND_CUDA_IPC);
  reply.set_staging_ipc_handle(handle);
  reply.set_staging_device(3);
  reply.set_staging_generation(uint64_t(1) << 40);
  reply.set_staging_bytes(4u << 20);
  v1::AttachReply back;
  ASSERT_TRUE(back.ParseFromString(reply.SerializeAsString()));
  EXPECT_EQ(back.staging_kind(), v1::STAGING_KIND_CUDA_IPC);
  EXPECT_EQ(back.staging_ipc_handle(), handle);
  EXPECT_EQ(back.staging_device(), 3);
  EXPECT_EQ(back.staging_generation(), uint64_t(1) << 40);
  v1::StepRequest step;
  step.set_staging_generation(42);
  v1::StepRequest step_back;
  ASSERT_TRUE(step_back.ParseFromString(step.SerializeAsString()));
  EXPECT_EQ(step_back.staging_generation(), 42u);
  v1::AttachRequest old_client;  // no staging_kind on the wire
  old_client.set_staging_bytes(1 << 16);
  v1::AttachRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(old_client.SerializeAsString()));
  EXPECT_EQ(parsed.staging_kind(), v1::STAGING_KIND_SHM);
}


// A device fault (a lost CUDA context, Backend::fault) on the CPU: a backend whose decode fails
// with a sticky error once told to. The call that meets it fails with the op's error; every
// session hears of it once on its event stream; every later call but Ping and Stats is refused
// with UNAVAILABLE naming it.
class FaultingBackend final : public karakv::testing::DelegatingBackend {
 public:
  FaultingBackend() : DelegatingBackend(kernels::make_cpu_backend(1)) {}
  KernelStatus decode_attention(const PagedKV& kv, int layer, const float* q, float* out, float scale) override {
    if (!failing) return DelegatingBackend::decode_attention(kv, layer, q, out, scale);
    fault_ = "decode_attention: cudaStreamSynchronize: cudaErrorIllegalAddress (fake)";
    return {KernelStatus::Code::kInternal, fault_};
  }
  std::string fault() const override { return fault_; }
  bool failing = false;

 private:
  std::string fault_;
};

TEST(DeviceFaultTest, TheCallThatMeetsItFailsEverySessionHearsOfItAndLaterCallsAreRefused) {
  auto owner = std::make_unique<FaultingBackend>();
  FaultingBackend& backend = *owner;
  CoreConfig rc;
  rc.geometry = testing::small_test_geometry(kernels::DType::kFloat32);
  rc.pool_bytes = 32 * rc.geometry.block_bytes();
  auto core = Core::create(rc, std::move(owner));
  ASSERT_TRUE(core.ok());
  std::vector<CoreEvent> events;
  (*core)->set_event_observer([&](const CoreEvent& e) { events.push_back(e); });
  auto metrics = Metrics::create("");
  ASSERT_TRUE(metrics.ok());
  KaraKVService service(core->get(), metrics->get(), true);
  std::string sessions[2];
  for (std::string& id : sessions) {
    v1::AttachRequest a;
    v1::AttachReply r;
    ASSERT_TRUE(service.Handle(a, &r).ok());
    id = r.session_id();
  }
  v1::CreateSequenceRequest cr;
  cr.set_session_id(sessions[0]);
  v1::CreateSequenceReply crr;
  ASSERT_TRUE(service.Handle(cr, &crr).ok());
  Core& k = **core;
  auto step = [&] {
    v1::StepRequest st;
    st.set_session_id(sessions[0]);
    st.add_sequence_ids(crr.sequence_id());
    st.set_layer(0);
    st.mutable_k()->set_data(std::string(k.step_kv_bytes(1), '\0'));
    st.mutable_v()->set_data(std::string(k.step_kv_bytes(1), '\0'));
    st.mutable_q()->set_data(std::string(k.q_bytes(1), '\0'));
    v1::StepReply sr;
    return service.Handle(st, &sr);
  };
  ASSERT_TRUE(step().ok());
  EXPECT_TRUE(events.empty());

  backend.failing = true;
  absl::Status met = step();
  EXPECT_EQ(met.code(), absl::StatusCode::kInternal) << met;
  EXPECT_THAT(std::string(met.message()), HasSubstr("decode_attention: cudaStreamSynchronize"));
  ASSERT_EQ(events.size(), 2u);
  std::set<std::string> told;
  for (const CoreEvent& e : events) {
    EXPECT_EQ(e.kind, CoreEvent::Kind::kDeviceFailed);
    EXPECT_THAT(e.message, HasSubstr("cudaErrorIllegalAddress"));
    EXPECT_EQ(to_event(e).device_failed().reason(), e.message);
    told.insert(e.session_id);
  }
  EXPECT_EQ(told, (std::set<std::string>{sessions[0], sessions[1]}));

  for (const std::string& id : sessions) {
    v1::CreateSequenceRequest again;
    again.set_session_id(id);
    absl::Status refused = service.Handle(again, &crr);
    EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
    EXPECT_THAT(std::string(refused.message()), HasSubstr("device failed and it cannot serve until it restarts"));
    EXPECT_THAT(std::string(refused.message()), HasSubstr("cudaErrorIllegalAddress"));
  }
  EXPECT_EQ(step().code(), absl::StatusCode::kUnavailable);
  v1::PingReply pr;
  EXPECT_TRUE(service.Handle(v1::PingRequest(), &pr).ok());
  v1::StatsReply sr;
  EXPECT_TRUE(service.Handle(v1::StatsRequest(), &sr).ok());
  EXPECT_EQ(events.size(), 2u);  // announced once
}

}  // namespace
}  // namespace karakv::server
