// The daemon's end of the fast path (server/ring.h), in process: errors equal to the RPC handler's,
// garbage commands and indices written where the worker's side of the ring lives, a fuzzer, and the
// thread's end with its session. The ring itself is tested in ring_spsc_test.cc.
#include "server/ring.h"

#include <fcntl.h>
#include <sys/mman.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "karakv/v1/ring.h"
#include "server/metrics.h"
#include "server/service.h"
#include "spdlog/spdlog.h"
#include "tests/kernels/kernel_test_util.h"
#include "tests/server/delegating_backend.h"

namespace karakv::server {
namespace {

using ::testing::HasSubstr;

// The daemon's consumer, in process: a registry, the service and the ring server, with the test
// playing the worker by writing into the ring directly.
class RingServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::err);  // the garbage tests log a warning per closed session
    CoreConfig rc;
    rc.geometry = {2, 2, 1, 8, 4, kernels::DType::kFloat32};
    rc.pool_bytes = 1 << 20;
    core_ = *Core::create(rc, kernels::make_cpu_backend(1));
    metrics_ = *Metrics::create("");
    service_ = std::make_unique<KaraKVService>(core_.get(), metrics_.get(), true);
    RingConfig cfg;
    cfg.spin = absl::ZeroDuration();
    cfg.poll = absl::Milliseconds(5);
    rings_ = std::make_unique<RingServer>(&service_->gate(), core_.get(), metrics_.get(), cfg);
    service_->set_rings(rings_.get());
  }
  void TearDown() override { rings_->stop_all(); }

  struct Session {
    std::string id;
    std::shared_ptr<StagingRegion> staging;
    ring::Header* h;
  };
  Session attach() {
    v1::AttachRequest req;
    req.set_staging_bytes(1 << 16);
    req.set_fast_path(true);
    v1::AttachReply reply;
    EXPECT_TRUE(service_->Handle(req, &reply).ok());
    EXPECT_EQ(reply.ring_offset(), reply.staging_bytes());
    EXPECT_GE(reply.ring_bytes(), ring::kRingBytes);
    Session s{reply.session_id(), core_->ring_regions(reply.session_id())->rings, nullptr};
    s.h = ring::header(s.staging->reserved());
    EXPECT_TRUE(ring::layout_matches(s.staging->reserved()));
    return s;
  }
  static void submit(Session& s, const ring::Command& c) {
    const uint64_t t = s.h->sq_tail.load();
    std::memcpy(&ring::commands(s.staging->reserved())[t % ring::kSlots], &c, sizeof c);
    s.h->sq_tail.store(t + 1);
    s.h->sq_doorbell.fetch_add(1);
    ring::futex_wake(&s.h->sq_doorbell);
  }
  // A one-sequence Step of `sequence` with small fixed staging ranges, tagged `tag`.
  static ring::Command step_of(uint64_t sequence, uint64_t tag) {
    ring::Command c{};
    c.op = uint32_t(ring::Op::kStep);
    c.count = 1;
    c.ids[0] = sequence;
    c.k = {0, 32};
    c.v = {64, 32};
    c.q = {128, 64};
    c.out = {256, 64};
    c.tag = tag;
    return c;
  }
  // Waits for the next completion, or for the ring to close.
  static bool next_completion(Session& s, ring::Completion* out) {
    for (int i = 0; i < 2000; ++i) {
      const uint64_t head = s.h->cq_head.load();
      if (s.h->cq_tail.load() > head) {
        std::memcpy(out, &ring::completions(s.staging->reserved())[head % ring::kSlots], sizeof *out);
        s.h->cq_head.store(head + 1);
        return true;
      }
      if (s.h->state.load() != uint32_t(ring::State::kOpen)) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ADD_FAILURE() << "no completion within 2 s";
    return false;
  }
  bool session_alive(const std::string& id) { return core_->staging(id).ok(); }

  std::unique_ptr<Core> core_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<KaraKVService> service_;
  std::unique_ptr<RingServer> rings_;
};

TEST_F(RingServerTest, StepErrorsMatchTheRpcHandler) {
  Session s = attach();
  ring::Command c = step_of(12345, 9);  // an unknown sequence
  submit(s, c);
  ring::Completion done{};
  ASSERT_TRUE(next_completion(s, &done));
  EXPECT_EQ(done.tag, 9u);
  // The same request through the RPC handler's body.
  v1::StepRequest req;
  req.set_session_id(s.id);
  req.add_sequence_ids(12345);
  auto set = [](const ring::Range& r, v1::StagingRange* o) { o->set_offset(r.offset); o->set_length(r.length); };
  set(c.k, req.mutable_k()->mutable_staging());
  set(c.v, req.mutable_v()->mutable_staging());
  set(c.q, req.mutable_q()->mutable_staging());
  set(c.out, req.mutable_out()->mutable_staging());
  v1::StepReply reply;
  const absl::Status want = service_->Handle(req, &reply);
  ASSERT_FALSE(want.ok());
  EXPECT_EQ(done.code, uint32_t(want.code()));
  EXPECT_EQ(std::string(done.message, done.message_bytes), std::string(want.message()));
  // Out of the staging region (into the rings): refused, as by the RPC.
  c.out = {(1 << 16) + 4096, 64};
  submit(s, c);
  ASSERT_TRUE(next_completion(s, &done));
  EXPECT_EQ(done.code, uint32_t(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(done.message, done.message_bytes), HasSubstr("outside the session's"));
  EXPECT_TRUE(session_alive(s.id));
}

TEST_F(RingServerTest, GarbageCommandClosesTheSessionOnly) {
  Session bad = attach(), good = attach();
  ring::Command c{};
  c.op = 77;
  submit(bad, c);
  ring::Completion done{};
  EXPECT_FALSE(next_completion(bad, &done));
  EXPECT_EQ(bad.h->state.load(), uint32_t(ring::State::kClosed));
  EXPECT_THAT(std::string(bad.h->close_message), HasSubstr("op 77"));
  EXPECT_FALSE(session_alive(bad.id));
  // The other session's ring still answers.
  ring::Command a{};
  a.op = uint32_t(ring::Op::kAttend);
  a.sequence_id = 1;
  a.count = 1;
  a.q = {0, 64};
  a.out = {64, 64};
  submit(good, a);
  ASSERT_TRUE(next_completion(good, &done));
  EXPECT_EQ(done.code, uint32_t(absl::StatusCode::kNotFound));
  EXPECT_TRUE(core_->check_invariants().ok());
}

TEST_F(RingServerTest, AppendErrorsMatchTheRpcHandler) {
  Session s = attach();
  v1::CreateSequenceRequest creq;
  creq.set_session_id(s.id);
  v1::CreateSequenceReply crep;
  ASSERT_TRUE(service_->Handle(creq, &crep).ok());
  // Entry 0 appends 2 tokens (L=2, T=2, Hk=1, D=8 fp32: 128 bytes each of K and V); entry 1 names
  // an unknown sequence; entry 2 is never reached.
  ring::Command c{};
  c.op = uint32_t(ring::Op::kAppend);
  c.count = 3;
  c.tag = 4;
  ring::AppendEntry e{};
  e.sequence_id = crep.sequence_id();
  e.num_tokens = 2;
  e.k = {0, 128};
  e.v = {128, 128};
  ring::set_append_entry(c, 0, e);
  e.sequence_id = 4242;
  ring::set_append_entry(c, 1, e);
  e.sequence_id = crep.sequence_id();
  ring::set_append_entry(c, 2, e);
  submit(s, c);
  ring::Completion done{};
  ASSERT_TRUE(next_completion(s, &done));
  EXPECT_EQ(done.tag, 4u);
  EXPECT_EQ(done.compactions, 1u) << "entries applied; " << std::string(done.message, done.message_bytes);
  EXPECT_EQ(done.decode_step, 2u) << "the last applied entry's length";
  // The same batch through the RPC handler, in a second session with its own sequence.
  Session g = attach();
  creq.set_session_id(g.id);
  ASSERT_TRUE(service_->Handle(creq, &crep).ok());
  v1::AppendBatchRequest req;
  req.set_session_id(g.id);
  for (uint64_t id : {crep.sequence_id(), uint64_t{4242}, crep.sequence_id()}) {
    v1::AppendRequest* a = req.add_entries();
    a->set_sequence_id(id);
    a->set_num_tokens(2);
    a->mutable_k()->mutable_staging()->set_offset(0);
    a->mutable_k()->mutable_staging()->set_length(128);
    a->mutable_v()->mutable_staging()->set_offset(128);
    a->mutable_v()->mutable_staging()->set_length(128);
  }
  v1::AppendBatchReply reply;
  const absl::Status want = service_->Handle(req, &reply);
  ASSERT_EQ(want.code(), absl::StatusCode::kNotFound) << want;
  EXPECT_EQ(done.code, uint32_t(want.code()));
  EXPECT_EQ(std::string(done.message, done.message_bytes), std::string(want.message()));
  EXPECT_THAT(std::string(want.message()), HasSubstr("entry 1 of 3 (sequence 4242)"));
  // A token_ids range that is not whole int32s is refused before anything is appended.
  c.count = 1;
  e.token_ids = {512, 6};
  ring::set_append_entry(c, 0, e);
  submit(s, c);
  ASSERT_TRUE(next_completion(s, &done));
  EXPECT_EQ(done.code, uint32_t(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(done.message, done.message_bytes), HasSubstr("token_ids staging range has 6 bytes"));
  EXPECT_EQ(done.compactions, 0u);
  // More entries than a command holds: garbage, the session closes.
  c.count = ring::Command::kMaxAppends + 1;
  submit(s, c);
  EXPECT_FALSE(next_completion(s, &done));
  EXPECT_THAT(std::string(s.h->close_message), HasSubstr("op 3 (Append) with at most 50 entries"));
  EXPECT_TRUE(core_->check_invariants().ok());
}

TEST_F(RingServerTest, GarbageIndicesCloseTheSession) {
  Session s = attach();
  s.h->sq_tail.store(0xdeadbeefcafeull);
  s.h->sq_doorbell.fetch_add(1);
  ring::futex_wake(&s.h->sq_doorbell);
  ring::Completion done{};
  EXPECT_FALSE(next_completion(s, &done));
  EXPECT_THAT(std::string(s.h->close_message), HasSubstr("impossible"));
  EXPECT_FALSE(session_alive(s.id));
}

// Random bytes in every field the worker writes: the daemon never crashes, answers or closes.
TEST_F(RingServerTest, FuzzedCommandsNeverHurtTheDaemon) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 40; ++round) {
    Session s = attach();
    // A real sequence, so some commands reach the kernels.
    v1::CreateSequenceRequest creq;
    creq.set_session_id(s.id);
    v1::CreateSequenceReply crep;
    ASSERT_TRUE(service_->Handle(creq, &crep).ok());
    for (int i = 0; i < 20 && s.h->state.load() == uint32_t(ring::State::kOpen); ++i) {
      ring::Command c{};
      auto* words = reinterpret_cast<uint64_t*>(&c);
      for (size_t w = 0; w < ring::Command::kHeaderBytes / 8 + 4; ++w) words[w] = rng();
      // Mostly plausible values, sometimes wild ones.
      if (rng() % 4 != 0) {
        c.op = 1 + rng() % 4;  // Step, Attend, Append, ReadKV
        c.count = rng() % 3;
        c.layer = int32_t(rng() % 3);
        c.sequence_id = crep.sequence_id();
        c.ids[0] = crep.sequence_id();
        for (ring::Range* r : {&c.k, &c.v, &c.q, &c.out}) *r = {(rng() % 64) * 64, (rng() % 5) * 32};
      }
      submit(s, c);
      ring::Completion done{};
      if (!next_completion(s, &done)) break;
    }
    ASSERT_TRUE(core_->check_invariants().ok());
  }
  EXPECT_TRUE(core_->check_invariants().ok());
}

// Value of a counter (or a histogram's sample count) with the given labels, -1 when absent.
double metric(Metrics& m, const std::string& family, const std::map<std::string, std::string>& labels) {
  for (const auto& f : m.registry()->Collect()) {
    if (f.name != family) continue;
    for (const auto& metric : f.metric) {
      std::map<std::string, std::string> got;
      for (const auto& l : metric.label) got[l.name] = l.value;
      if (got != labels) continue;
      if (f.type == prometheus::MetricType::Histogram) return double(metric.histogram.sample_count);
      return f.type == prometheus::MetricType::Gauge ? metric.gauge.value : metric.counter.value;
    }
  }
  return -1;
}

TEST_F(RingServerTest, CountsCommandsByPathAndWakeUps) {
  Session s = attach();
  ring::Command a{};
  a.op = uint32_t(ring::Op::kAttend);
  a.sequence_id = 1;
  a.count = 1;
  a.q = {0, 64};
  a.out = {64, 64};
  ring::Completion done{};
  for (int i = 0; i < 3; ++i) {
    // Long enough for the thread (spin 0) to be asleep: each command is a futex wake-up.
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    submit(s, a);
    ASSERT_TRUE(next_completion(s, &done));
  }
  rings_->count("Attend", "grpc");
  EXPECT_EQ(metric(*metrics_, "karakv_decode_commands_total", {{"method", "Attend"}, {"path", "ring"}}), 3);
  EXPECT_EQ(metric(*metrics_, "karakv_decode_commands_total", {{"method", "Attend"}, {"path", "grpc"}}), 1);
  EXPECT_GE(metric(*metrics_, "karakv_ring_wakeups_total", {}), 1);
  EXPECT_LE(metric(*metrics_, "karakv_ring_wakeups_total", {}), 3);
  EXPECT_EQ(metric(*metrics_, "karakv_ring_depth", {}), 3);
  // The ring's commands are RPC-accounted under their method too (NOT_FOUND: no sequence 1).
  EXPECT_EQ(metric(*metrics_, "karakv_rpc_errors_total", {{"method", "Attend"}, {"code", "NOT_FOUND"}}), 3);
}

TEST_F(RingServerTest, ThreadEndsWithItsSession) {
  Session s = attach();
  EXPECT_EQ(rings_->active(), 1);
  ASSERT_TRUE(core_->detach(s.id).ok());
  for (int i = 0; i < 200 && rings_->active() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(rings_->active(), 0);
  EXPECT_EQ(s.h->state.load(), uint32_t(ring::State::kClosed));
  EXPECT_EQ(s.h->close_code, uint32_t(absl::StatusCode::kNotFound));
  rings_->reap();
  // The test holds the last reference to the mapping now.
  EXPECT_EQ(s.staging.use_count(), 1);
}

// Sessions one after another reuse the ring thread of the one before (and its kernel thread team);
// with no idle threads allowed each session starts its own.
TEST_F(RingServerTest, ThreadsAreReusedAcrossSessionsUpToTheIdleLimit) {
  int idle_limit = 16;
  auto sessions_one_after_another = [&](int n) {
    for (int i = 0; i < n; ++i) {
      Session s = attach();
      ASSERT_TRUE(core_->detach(s.id).ok());
      for (int j = 0; j < 400 && rings_->active() > 0; ++j) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      ASSERT_EQ(rings_->active(), 0);
      // The ring is closed before its thread goes back to waiting: wait for that too.
      for (int j = 0; j < 400 && rings_->waiting() < std::min(rings_->threads(), idle_limit); ++j) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
  };
  const double started0 = metric(*metrics_, "karakv_ring_threads_started_total", {});
  sessions_one_after_another(5);
  EXPECT_EQ(metric(*metrics_, "karakv_ring_threads_started_total", {}) - started0, 1);
  EXPECT_EQ(rings_->threads(), 1);  // waiting for the next session
  EXPECT_EQ(rings_->waiting(), 1);
  EXPECT_EQ(metric(*metrics_, "karakv_ring_threads", {}), 1);

  // Three at once need three threads; afterwards at most idle_threads (here 2) stay.
  rings_->stop_all();
  RingConfig cfg;
  cfg.spin = absl::ZeroDuration();
  cfg.poll = absl::Milliseconds(5);
  cfg.idle_threads = 2;
  rings_ = std::make_unique<RingServer>(&service_->gate(), core_.get(), nullptr, cfg);
  service_->set_rings(rings_.get());
  std::vector<Session> three = {attach(), attach(), attach()};
  EXPECT_EQ(rings_->threads(), 3);
  for (Session& s : three) ASSERT_TRUE(core_->detach(s.id).ok());
  for (int j = 0; j < 400 && (rings_->active() > 0 || rings_->threads() > 2 || rings_->waiting() < 2); ++j) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(rings_->active(), 0);
  EXPECT_EQ(rings_->threads(), 2);
  EXPECT_EQ(rings_->waiting(), 2);
  // A reused thread serves its new session's commands: an unknown sequence is refused as before.
  Session again = attach();
  EXPECT_EQ(rings_->threads(), 2);
  submit(again, step_of(777, 5));
  ring::Completion done{};
  ASSERT_TRUE(next_completion(again, &done));
  EXPECT_EQ(done.tag, 5u);
  EXPECT_EQ(done.code, uint32_t(absl::StatusCode::kNotFound));

  // With no idle threads allowed, every session starts its own.
  rings_->stop_all();
  cfg.idle_threads = 0;
  idle_limit = 0;
  rings_ = std::make_unique<RingServer>(&service_->gate(), core_.get(), metrics_.get(), cfg);
  service_->set_rings(rings_.get());
  const double started1 = metric(*metrics_, "karakv_ring_threads_started_total", {});
  sessions_one_after_another(3);
  EXPECT_EQ(metric(*metrics_, "karakv_ring_threads_started_total", {}) - started1, 3);
  for (int j = 0; j < 400 && rings_->threads() > 0; ++j) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(rings_->threads(), 0);
}

// karakvd's ring threads start with it: the first sessions take them (no thread starts), a session
// beyond them starts one more, and once they end the started set is what waits again.
TEST_F(RingServerTest, ThreadsStartedWithTheServerServeTheFirstSessions) {
  rings_->stop_all();
  RingConfig cfg;
  cfg.spin = absl::ZeroDuration();
  cfg.poll = absl::Milliseconds(5);
  cfg.idle_threads = 3;
  cfg.start_threads = 3;
  const double started0 = metric(*metrics_, "karakv_ring_threads_started_total", {});
  rings_ = std::make_unique<RingServer>(&service_->gate(), core_.get(), metrics_.get(), cfg);
  service_->set_rings(rings_.get());
  EXPECT_EQ(rings_->threads(), 3);
  EXPECT_EQ(rings_->waiting(), 3);  // counted as waiting at once, before they have made their teams
  EXPECT_EQ(metric(*metrics_, "karakv_ring_threads_started_total", {}) - started0, 3);
  EXPECT_EQ(metric(*metrics_, "karakv_ring_threads", {}), 3);
  // Named, so top -H and /proc show them (this registry's backend runs one kernel thread, so it
  // has no helper threads).
  for (int j = 0; j < 400 && kernels::test::threads_named("karakv-ring") < 3; ++j) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(kernels::test::threads_named("karakv-ring"), 3);

  std::vector<Session> sessions = {attach(), attach(), attach()};
  EXPECT_EQ(rings_->threads(), 3);
  EXPECT_EQ(rings_->waiting(), 0);
  EXPECT_EQ(metric(*metrics_, "karakv_ring_threads_started_total", {}) - started0, 3);
  sessions.push_back(attach());
  EXPECT_EQ(rings_->threads(), 4);
  EXPECT_EQ(metric(*metrics_, "karakv_ring_threads_started_total", {}) - started0, 4);
  // Each session is served by a thread of its own: an unknown sequence is refused on every ring.
  for (size_t i = 0; i < sessions.size(); ++i) submit(sessions[i], step_of(900 + i, i + 1));
  for (size_t i = 0; i < sessions.size(); ++i) {
    ring::Completion done{};
    ASSERT_TRUE(next_completion(sessions[i], &done)) << i;
    EXPECT_EQ(done.tag, i + 1);
    EXPECT_EQ(done.code, uint32_t(absl::StatusCode::kNotFound));
  }

  for (Session& s : sessions) ASSERT_TRUE(core_->detach(s.id).ok());
  for (int j = 0; j < 400 && (rings_->active() > 0 || rings_->threads() > 3 || rings_->waiting() < 3); ++j) {
    rings_->reap();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(rings_->active(), 0);
  EXPECT_EQ(rings_->threads(), 3);
  EXPECT_EQ(rings_->waiting(), 3);
  EXPECT_EQ(metric(*metrics_, "karakv_ring_threads", {}), 3);
  rings_->stop_all();
  EXPECT_EQ(rings_->threads(), 0);
  EXPECT_EQ(rings_->waiting(), 0);
}

// Stopping with one thread waiting for a session and one running a session ends both, and the
// running session's worker is told why.
TEST_F(RingServerTest, StopAllEndsWaitingAndRunningThreads) {
  Session running = attach();
  Session gone = attach();
  ASSERT_TRUE(core_->detach(gone.id).ok());
  for (int j = 0; j < 400 && (rings_->active() > 1 || rings_->waiting() < 1); ++j) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(rings_->active(), 1);
  EXPECT_EQ(rings_->threads(), 2);
  EXPECT_EQ(rings_->waiting(), 1);
  rings_->stop_all();
  EXPECT_EQ(rings_->threads(), 0);
  EXPECT_EQ(running.h->state.load(), uint32_t(ring::State::kClosed));
  EXPECT_EQ(running.h->close_code, uint32_t(absl::StatusCode::kUnavailable));
}

// The CPU backend with device staging from the heap: what the CUDA backend hands out, here host
// memory its kernels read directly, which the server must treat as device memory.
class HeapDeviceBackend final : public karakv::testing::DelegatingBackend {
 public:
  HeapDeviceBackend() : DelegatingBackend(kernels::make_cpu_backend(1)) {}
  bool shares_device_memory() const override { return true; }
  KernelStatus allocate_shared(size_t bytes, kernels::SharedDeviceMemory* out) override {
    karakv::testing::heap_shared_memory(bytes, "h", out);
    std::lock_guard<std::mutex> lock(mu_);
    regions_[static_cast<uint8_t*>(out->ptr)] = bytes;
    return KernelStatus::ok();
  }
  void free_shared(const kernels::SharedDeviceMemory& m) override {
    std::lock_guard<std::mutex> lock(mu_);
    regions_.erase(static_cast<uint8_t*>(m.ptr));
    std::free(m.ptr);
  }
  bool is_device_memory(const void* p) const override {
    std::lock_guard<std::mutex> lock(mu_);
    const auto* b = static_cast<const uint8_t*>(p);
    for (const auto& [base, bytes] : regions_)
      if (b >= base && b < base + bytes) return true;
    return false;
  }

 private:
  mutable std::mutex mu_;
  std::map<uint8_t*, size_t> regions_;
};

// Device staging with the fast path: the rings come in a shared-memory object of their own
// (ring_offset 0), offer Step and Attend only, and give exactly the RPCs' outputs and errors for
// tensors in the device region; an Append sent anyway is garbage (the session closes).
TEST(RingDeviceStagingTest, StepAndAttendMatchTheRpcsAndTheOtherOpsStayOffTheRing) {
  spdlog::set_level(spdlog::level::err);
  CoreConfig rc;
  rc.geometry = {2, 2, 1, 8, 4, kernels::DType::kFloat32};
  rc.pool_bytes = 1 << 20;
  std::unique_ptr<Core> core = *Core::create(rc, std::make_unique<HeapDeviceBackend>());
  std::unique_ptr<Metrics> metrics = *Metrics::create("");
  KaraKVService service(core.get(), metrics.get(), true);
  RingConfig cfg;
  cfg.threads = false;  // poll() runs the commands on this thread
  RingServer rings(&service.gate(), core.get(), metrics.get(), cfg);
  service.set_rings(&rings);

  v1::AttachRequest areq;
  areq.set_staging_bytes(1 << 16);
  areq.set_fast_path(true);
  areq.set_staging_kind(v1::STAGING_KIND_CUDA_IPC);
  v1::AttachReply attached;
  ASSERT_TRUE(service.Handle(areq, &attached).ok());
  const std::string session = attached.session_id();
  const uint64_t generation = attached.staging_generation();
  EXPECT_EQ(attached.staging_kind(), v1::STAGING_KIND_CUDA_IPC);
  EXPECT_GT(generation, 0u);
  EXPECT_EQ(attached.ring_offset(), 0u);
  ASSERT_GE(attached.ring_bytes(), ring::kRingBytes);
  ASSERT_FALSE(attached.staging_name().empty());
  // The worker's side: the rings' object, mapped as the SDK maps it.
  const int fd = shm_open(attached.staging_name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0) << attached.staging_name();
  void* mapped = mmap(nullptr, attached.ring_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  ASSERT_NE(mapped, MAP_FAILED);
  uint8_t* base = static_cast<uint8_t*>(mapped);
  ASSERT_TRUE(ring::layout_matches(base));
  ring::Header* h = ring::header(base);
  EXPECT_EQ(h->ops, 0u) << "a device ring offers Step and Attend only";
  uint8_t* dev = (*core->staging(session))->base();  // the "device" region
  ASSERT_NE(dev, nullptr);
  auto run = [&](const ring::Command& c, ring::Completion* done) {
    const uint64_t tail = h->sq_tail.load();
    std::memcpy(&ring::commands(base)[tail % ring::kSlots], &c, sizeof c);
    h->sq_tail.store(tail + 1);
    EXPECT_EQ(*rings.poll(session), 1);
    const uint64_t head = h->cq_head.load();
    ASSERT_EQ(h->cq_tail.load(), head + 1);
    std::memcpy(done, &ring::completions(base)[head % ring::kSlots], sizeof *done);
    h->cq_head.store(head + 1);
  };
  auto range = [](uint64_t offset, uint64_t length, v1::StagingRange* r) {
    r->set_offset(offset);
    r->set_length(length);
  };
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  auto fill = [&](uint64_t offset, size_t bytes) {
    for (size_t i = 0; i < bytes / 4; ++i) {
      const float f = value(rng);
      std::memcpy(dev + offset + 4 * i, &f, 4);
    }
  };
  // Two sequences with the same 6-token prompt (Append by gRPC, from the device region).
  std::vector<uint64_t> seqs;
  fill(0, 2 * core->append_bytes(6));
  for (int i = 0; i < 2; ++i) {
    v1::CreateSequenceRequest creq;
    creq.set_session_id(session);
    v1::CreateSequenceReply created;
    ASSERT_TRUE(service.Handle(creq, &created).ok());
    seqs.push_back(created.sequence_id());
    v1::AppendRequest app;
    app.set_session_id(session);
    app.set_sequence_id(created.sequence_id());
    app.set_num_tokens(6);
    app.set_staging_generation(generation);
    range(0, core->append_bytes(6), app.mutable_k()->mutable_staging());
    range(core->append_bytes(6), core->append_bytes(6), app.mutable_v()->mutable_staging());
    v1::AppendReply appended;
    ASSERT_TRUE(service.Handle(app, &appended).ok());
  }
  const uint64_t kv = core->step_kv_bytes(1), q = core->q_bytes(1);
  const uint64_t k_at = 8192, v_at = 12288, q_at = 16384, rpc_out = 20480, ring_out = 24576;
  for (int layer = 0; layer < 2; ++layer) {
    fill(k_at, kv);
    fill(v_at, kv);
    fill(q_at, q);
    v1::StepRequest step;
    step.set_session_id(session);
    step.set_layer(layer);
    step.add_sequence_ids(seqs[0]);
    step.set_staging_generation(generation);
    range(k_at, kv, step.mutable_k()->mutable_staging());
    range(v_at, kv, step.mutable_v()->mutable_staging());
    range(q_at, q, step.mutable_q()->mutable_staging());
    range(rpc_out, q, step.mutable_out()->mutable_staging());
    v1::StepReply stepped;
    ASSERT_TRUE(service.Handle(step, &stepped).ok());
    ring::Command c{};
    c.op = uint32_t(ring::Op::kStep);
    c.layer = layer;
    c.count = 1;
    c.ids[0] = seqs[1];
    c.k = {k_at, kv};
    c.v = {v_at, kv};
    c.q = {q_at, q};
    c.out = {ring_out, q};
    c.tag = 10 + layer;
    ring::Completion done{};
    run(c, &done);
    ASSERT_EQ(done.code, 0u) << std::string(done.message, done.message_bytes);
    EXPECT_EQ(done.tag, uint64_t(10 + layer));
    EXPECT_EQ(std::memcmp(dev + rpc_out, dev + ring_out, q), 0) << "layer " << layer;
  }
  float first = 0;
  std::memcpy(&first, dev + ring_out, 4);
  EXPECT_NE(first, 0.0f) << "the Step wrote its output into the device region";
  // Attend of 3 queries at layer 1, both ways.
  fill(q_at, 3 * q);
  v1::AttendRequest att;
  att.set_session_id(session);
  att.set_sequence_id(seqs[0]);
  att.set_layer(1);
  att.set_num_queries(3);
  att.set_staging_generation(generation);
  range(q_at, 3 * q, att.mutable_q()->mutable_staging());
  range(rpc_out, 3 * q, att.mutable_out()->mutable_staging());
  v1::AttendReply attended;
  ASSERT_TRUE(service.Handle(att, &attended).ok());
  ring::Command c{};
  c.op = uint32_t(ring::Op::kAttend);
  c.sequence_id = seqs[1];
  c.layer = 1;
  c.count = 3;
  c.q = {q_at, 3 * q};
  c.out = {ring_out, 3 * q};
  ring::Completion done{};
  run(c, &done);
  ASSERT_EQ(done.code, 0u) << std::string(done.message, done.message_bytes);
  EXPECT_EQ(std::memcmp(dev + rpc_out, dev + ring_out, 3 * q), 0);
  // An output past the device region: the RPC's refusal, word for word.
  const uint64_t past = attached.staging_bytes() - 8;  // the region is rounded up to 2 MiB
  c.out = {past, 3 * q};
  range(past, 3 * q, att.mutable_out()->mutable_staging());
  const absl::Status want = service.Handle(att, &attended);
  ASSERT_EQ(want.code(), absl::StatusCode::kInvalidArgument) << want;
  run(c, &done);
  EXPECT_EQ(done.code, uint32_t(want.code()));
  EXPECT_EQ(std::string(done.message, done.message_bytes), std::string(want.message()));
  // Append is not offered here: sent anyway, it closes the ring and the session.
  ring::Command append{};
  append.op = uint32_t(ring::Op::kAppend);
  append.count = 1;
  const uint64_t tail = h->sq_tail.load();
  std::memcpy(&ring::commands(base)[tail % ring::kSlots], &append, sizeof append);
  h->sq_tail.store(tail + 1);
  rings.poll(session).IgnoreError();
  EXPECT_EQ(h->state.load(), uint32_t(ring::State::kClosed));
  EXPECT_FALSE(core->staging(session).ok()) << "the session ended";
  munmap(mapped, attached.ring_bytes());
  rings.stop_all();
}

}  // namespace
}  // namespace karakv::server
