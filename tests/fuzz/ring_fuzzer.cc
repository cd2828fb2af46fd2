// libFuzzer harness over the fast path's shared memory: the fuzzer plays a hostile worker that
// writes raw commands (any op, count, layer, ranges, ids) and any ring indices into its session's
// rings, and the daemon's own consumer (RingServer::poll, the loop body its thread runs) decodes
// and runs them through the Step, Attend, Append and ReadKV entries the gRPC handlers use. After every turn the pool
// invariant must hold, every completion must be well formed, and a ring the daemon closed must
// have ended its session.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "fuzz_daemon.h"
#include "fuzz_input.h"
#include "karakv/v1/ring.h"

namespace karakv::fuzz {
namespace {

namespace v1 = ::karakv::v1;

[[noreturn]] void fail(const std::string& why) {
  std::fprintf(stderr, "fuzz: %s\n", why.c_str());
  std::abort();
}

server::CoreConfig ring_config() {
  server::CoreConfig c;
  c.geometry = fuzz_geometry(kernels::DType::kFloat32);
  c.pool_bytes = int64_t(kPoolBlocks) * c.geometry.block_bytes();
  c.max_staging_bytes = kMaxStagingBytes;
  return c;
}

struct Worker {
  std::string session;
  std::shared_ptr<server::StagingRegion> staging;
  ring::Header* h = nullptr;
};

Worker attach(Daemon& d) {
  v1::AttachRequest req;
  req.set_worker_id("fuzz");
  req.set_staging_bytes(64 << 10);
  req.set_fast_path(true);
  v1::AttachReply reply;
  if (!d.service->Handle(req, &reply).ok()) fail("fast-path Attach refused");
  Worker w;
  w.session = reply.session_id();
  w.staging = d.core->ring_regions(w.session)->rings;
  w.h = ring::header(w.staging->reserved());
  // Small finite floats everywhere, so commands that pass validation run real attention.
  float* f = reinterpret_cast<float*>(w.staging->base());
  for (size_t i = 0; i < w.staging->size() / 4; ++i) f[i] = float(int(i * 37 % 17) - 8) / 8.0f;
  for (int s = 0; s < 2; ++s) {
    v1::CreateSequenceRequest c;
    c.set_session_id(w.session);
    v1::CreateSequenceReply cr;
    if (!d.service->Handle(c, &cr).ok()) fail("CreateSequence refused");
    v1::AppendRequest a;
    a.set_session_id(w.session);
    a.set_sequence_id(cr.sequence_id());
    a.set_num_tokens(5);
    const uint64_t bytes = d.core->append_bytes(5);
    a.mutable_k()->mutable_staging()->set_offset(0);
    a.mutable_k()->mutable_staging()->set_length(bytes);
    a.mutable_v()->mutable_staging()->set_offset(bytes);
    a.mutable_v()->mutable_staging()->set_length(bytes);
    v1::AppendReply ar;
    if (!d.service->Handle(a, &ar).ok()) fail("Append refused");
  }
  return w;
}

void submit(Worker& w, Reader& r) {
  static auto cmd = std::make_unique<ring::Command>();
  const size_t ids = r.u8() % 9;
  std::memset(cmd.get(), 0, sizeof(ring::Command));
  r.fill(cmd.get(), ring::Command::kHeaderBytes);
  r.fill(cmd->ids, ids * 8);
  const uint64_t tail = w.h->sq_tail.load();
  std::memcpy(&ring::commands(w.staging->reserved())[tail % ring::kSlots], cmd.get(), sizeof(ring::Command));
  w.h->sq_tail.store(tail + 1);
}

void poll(Daemon& d, Worker& w) {
  auto ran = d.rings->poll(w.session);
  if (!ran.ok() && ran.status().code() != absl::StatusCode::kNotFound) fail(ran.status().ToString());
  d.check("a ring turn");
  // The worker's side: take what was answered.
  for (int i = 0; i < int(ring::kSlots) && w.h->cq_head.load() < w.h->cq_tail.load(); ++i) {
    const uint64_t head = w.h->cq_head.load();
    const ring::Completion& c = ring::completions(w.staging->reserved())[head % ring::kSlots];
    if (c.code > uint32_t(absl::StatusCode::kUnauthenticated)) fail("completion with an impossible status code");
    if (c.message_bytes > ring::Completion::kMessageBytes) fail("completion message longer than its field");
    if (c.code != 0 && c.message_bytes == 0) fail("refused command without a message");
    w.h->cq_head.store(head + 1);
  }
  if (w.h->state.load() == uint32_t(ring::State::kClosed)) {
    if (w.h->close_code == 0 || w.h->close_message[0] == '\0') fail("ring closed without a reason");
    if (std::memchr(w.h->close_message, '\0', sizeof(w.h->close_message)) == nullptr) {
      fail("ring close message not terminated");
    }
    if (d.core->staging(w.session).ok()) fail("ring closed but its session lives on");
  }
}

void session_event(Daemon& d, Worker& w, uint8_t e) {
  switch (e % 4) {
    case 0: {
      v1::DetachRequest req;
      req.set_session_id(w.session);
      v1::DetachReply reply;
      check_refusal(d.service->Handle(req, &reply), "Detach");
      break;
    }
    case 1: d.core->expire_leases(absl::Now() + absl::Hours(1)); break;
    case 2: {
      v1::HeartbeatRequest req;
      req.set_session_id(w.session);
      v1::HeartbeatReply reply;
      check_refusal(d.service->Handle(req, &reply), "Heartbeat");
      break;
    }
    case 3: {
      v1::ReleaseSequenceRequest req;
      req.set_session_id(w.session);
      req.set_sequence_id(1);
      v1::ReleaseSequenceReply reply;
      check_refusal(d.service->Handle(req, &reply), "ReleaseSequence");
      break;
    }
  }
  d.check("a session event");
}

}  // namespace
}  // namespace karakv::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace karakv::fuzz;
  Reader r(data, size);
  Daemon d(ring_config());
  Worker w = attach(d);
  while (!r.empty()) {
    switch (r.u8() % kNumRingOps) {
      case kSubmit: submit(w, r); break;
      case kPoll: poll(d, w); break;
      case kScribble: {
        const uint8_t which = r.u8() % 4;
        const uint64_t value = r.u64();
        std::atomic<uint64_t>* idx[] = {&w.h->sq_tail, &w.h->cq_head, &w.h->sq_head, &w.h->cq_tail};
        idx[which]->store(value);
        break;
      }
      case kSessionEvent: session_event(d, w, r.u8()); break;
    }
  }
  poll(d, w);
  return 0;
}
