// The gRPC face of the core (callback API): resolves tensors to staging or inline bytes and calls
// the core through the request gate (draining, metrics, invariant checks); maps absl::Status to
// gRPC status.
#pragma once

#include <atomic>
#include <memory>
#include <vector>

#include "karakv/v1/karakv.grpc.pb.h"
#include "server/events.h"
#include "server/metrics.h"
#include "server/core.h"
#include "server/request_gate.h"

namespace karakv::server {

namespace v1 = ::karakv::v1;
class RingServer;

class KaraKVService final : public v1::KaraKV::CallbackService {
 public:
  // An input tensor resolved to bytes. Inline bytes that are not 4-byte aligned are copied so the
  // kernels can read them as floats.
  struct Input {
    ConstBytes bytes;
    std::vector<uint8_t> copy;
  };

  // check_invariants: debug mode that verifies the pool invariant after every mutating call.
  KaraKVService(Core* core, Metrics* metrics, bool check_invariants = false)
      : core_(core), metrics_(metrics), gate_(core, metrics, check_invariants) {}

  // After this, every new call is refused with UNAVAILABLE; calls already running finish.
  // Open event streams end with UNAVAILABLE (after what they hold is sent).
  void start_draining();
  // The gate every call goes through; the fast path's ring uses it too.
  RequestGate& gate() { return gate_; }
  // The event streams (WatchEvents); the core's events are published here.
  EventHub& events() { return events_; }
  // Enables fast_path at Attach (server/ring.h); null (the default) refuses it.
  void set_rings(RingServer* rings) { rings_ = rings; }
  int in_flight() const { return gate_.in_flight(); }
  // Random for each daemon instance (AttachReply, HeartbeatReply and PingReply carry it).
  const std::string& instance_id() const { return instance_id_; }

  grpc::ServerUnaryReactor* Attach(grpc::CallbackServerContext*, const v1::AttachRequest*, v1::AttachReply*) override;
  grpc::ServerUnaryReactor* Detach(grpc::CallbackServerContext*, const v1::DetachRequest*, v1::DetachReply*) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext*, const v1::HeartbeatRequest*, v1::HeartbeatReply*) override;
  grpc::ServerUnaryReactor* CreateSequence(grpc::CallbackServerContext*, const v1::CreateSequenceRequest*, v1::CreateSequenceReply*) override;
  grpc::ServerUnaryReactor* ForkSequence(grpc::CallbackServerContext*, const v1::ForkSequenceRequest*, v1::ForkSequenceReply*) override;
  grpc::ServerUnaryReactor* ReleaseSequence(grpc::CallbackServerContext*, const v1::ReleaseSequenceRequest*, v1::ReleaseSequenceReply*) override;
  grpc::ServerUnaryReactor* Append(grpc::CallbackServerContext*, const v1::AppendRequest*, v1::AppendReply*) override;
  grpc::ServerUnaryReactor* AppendBatch(grpc::CallbackServerContext*, const v1::AppendBatchRequest*,
                                        v1::AppendBatchReply*) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext*, const v1::StepRequest*, v1::StepReply*) override;
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext*, const v1::AttendRequest*, v1::AttendReply*) override;
  grpc::ServerUnaryReactor* ReadKV(grpc::CallbackServerContext*, const v1::ReadKVRequest*, v1::ReadKVReply*) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext*, const v1::StatsRequest*, v1::StatsReply*) override;
  grpc::ServerUnaryReactor* ListSequences(grpc::CallbackServerContext*, const v1::ListSequencesRequest*, v1::ListSequencesReply*) override;
  grpc::ServerUnaryReactor* Compact(grpc::CallbackServerContext*, const v1::CompactRequest*, v1::CompactReply*) override;
  grpc::ServerUnaryReactor* Inspect(grpc::CallbackServerContext*, const v1::InspectRequest*, v1::InspectReply*) override;
  grpc::ServerUnaryReactor* Lookup(grpc::CallbackServerContext*, const v1::LookupRequest*, v1::LookupReply*) override;
  grpc::ServerWriteReactor<v1::Event>* WatchEvents(grpc::CallbackServerContext*, const v1::WatchEventsRequest*) override;
  grpc::ServerUnaryReactor* Ping(grpc::CallbackServerContext*, const v1::PingRequest*, v1::PingReply*) override;

  // Every unary call exactly as its gRPC method serves it (draining check, metrics, invariant
  // check after mutating calls), without a transport: the gRPC methods are these plus Finish, and
  // tests and fuzzers (tests/fuzz) call them directly. Step and Attend resolve their tensors and
  // call the gate's span entries (RequestGate::step / attend), as the ring does.
  absl::Status Handle(const v1::AttachRequest&, v1::AttachReply*);
  absl::Status Handle(const v1::DetachRequest&, v1::DetachReply*);
  absl::Status Handle(const v1::HeartbeatRequest&, v1::HeartbeatReply*);
  absl::Status Handle(const v1::CreateSequenceRequest&, v1::CreateSequenceReply*);
  absl::Status Handle(const v1::ForkSequenceRequest&, v1::ForkSequenceReply*);
  absl::Status Handle(const v1::ReleaseSequenceRequest&, v1::ReleaseSequenceReply*);
  absl::Status Handle(const v1::AppendRequest&, v1::AppendReply*);
  absl::Status Handle(const v1::AppendBatchRequest&, v1::AppendBatchReply*);
  absl::Status Handle(const v1::StepRequest&, v1::StepReply*);
  absl::Status Handle(const v1::AttendRequest&, v1::AttendReply*);
  absl::Status Handle(const v1::ReadKVRequest&, v1::ReadKVReply*);
  absl::Status Handle(const v1::StatsRequest&, v1::StatsReply*);
  absl::Status Handle(const v1::ListSequencesRequest&, v1::ListSequencesReply*);
  absl::Status Handle(const v1::CompactRequest&, v1::CompactReply*);
  absl::Status Handle(const v1::InspectRequest&, v1::InspectReply*);
  absl::Status Handle(const v1::LookupRequest&, v1::LookupReply*);
  absl::Status Handle(const v1::PingRequest&, v1::PingReply*);

 private:
  absl::Status DoAttach(const v1::AttachRequest&, v1::AttachReply*);
  absl::Status DoCreateSequence(const v1::CreateSequenceRequest&, v1::CreateSequenceReply*);
  // One Append, in `session_id` (an AppendBatch entry's own session_id is checked by the caller).
  absl::Status DoAppend(const std::string& session_id, const v1::AppendRequest&, v1::AppendReply*);
  absl::Status DoAppendBatch(const v1::AppendBatchRequest&, v1::AppendBatchReply*);
  absl::Status DoCompact(const v1::CompactRequest&, v1::CompactReply*);
  absl::Status DoInspect(const v1::InspectRequest&, v1::InspectReply*);
  absl::Status DoReadKV(const v1::ReadKVRequest&, v1::ReadKVReply*);
  absl::Status DoStats(const v1::StatsRequest&, v1::StatsReply*);
  static grpc::ServerUnaryReactor* finish(grpc::CallbackServerContext* ctx, const absl::Status& status);

  size_t output_bytes(const v1::OutputRef& out, const Input& q, size_t rows) const;

  Core* const core_;
  Metrics* const metrics_;
  RequestGate gate_;
  RingServer* rings_ = nullptr;
  EventHub events_;
  const absl::Time started_ = absl::Now();
  const std::string instance_id_ = new_instance_id();

  static std::string new_instance_id();
};

grpc::Status to_grpc(const absl::Status& s);

}  // namespace karakv::server
