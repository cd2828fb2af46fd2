// libFuzzer harness over every unary handler of karakvd: each record's body is parsed by the
// generated protobuf code (the proto decoding path of a gRPC call) and, when it parses, handed to
// KaraKVService::Handle, the very function the gRPC method runs before Finish. Session ids are
// mapped onto sessions attached during the input, so staging-borne tensors reach the bounds
// checks. After every call the pool invariant must hold and a refusal must carry a message.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_daemon.h"
#include "fuzz_input.h"

namespace karakv::fuzz {
namespace {

namespace v1 = ::karakv::v1;

server::CoreConfig config_for(uint8_t options) {
  server::CoreConfig c;
  c.geometry = fuzz_geometry((options & kOptFloat16)    ? kernels::DType::kFloat16
                             : (options & kOptBFloat16) ? kernels::DType::kBFloat16
                                                        : kernels::DType::kFloat32);
  c.pool_bytes = int64_t(kPoolBlocks) * c.geometry.block_bytes();
  c.max_staging_bytes = kMaxStagingBytes;
  c.prefix_cache = !(options & kOptNoPrefixCache);
  c.prefix_cache_shared_namespaces = options & kOptSharedNamespaces;
  if (options & kOptLimits) {
    c.max_sessions = 3;
    c.max_sequences_per_session = 4;
    c.tenant_block_quota = 24;
    c.max_sequences_per_tick = 1;
  }
  return c;
}

struct Input {
  explicit Input(uint8_t options) : daemon(config_for(options)) {}
  Daemon daemon;
  std::vector<std::string> sessions;
};

template <typename Request, typename Reply>
void call(Input& in, const char* method, const std::string& body, uint8_t session) {
  Request req;
  if (!req.ParseFromString(body)) return;  // refused by the decoder, as gRPC would
  if constexpr (requires { req.set_session_id(std::string()); }) {
    if (session < kKeepSessionId && !in.sessions.empty()) {
      req.set_session_id(in.sessions[session % in.sessions.size()]);
    }
  }
  Reply reply;
  const absl::Status s = in.daemon.service->Handle(req, &reply);
  check_refusal(s, method);
  std::string wire;
  if (!reply.SerializeToString(&wire)) {
    std::fprintf(stderr, "fuzz: %s reply does not serialize\n", method);
    std::abort();
  }
  if constexpr (std::is_same_v<Reply, v1::AttachReply>) {
    if (s.ok()) in.sessions.push_back(reply.session_id());
  }
  if constexpr (std::is_same_v<Reply, v1::StatsReply>) {
    if (s.ok() && !reply.invariant_error().empty()) {
      std::fprintf(stderr, "fuzz: Stats reports %s\n", reply.invariant_error().c_str());
      std::abort();
    }
  }
  in.daemon.check(method);
}

void write_staging(Input& in, const std::string& body, uint8_t session) {
  if (in.sessions.empty()) return;
  auto staging = in.daemon.core->staging(in.sessions[session % in.sessions.size()]);
  if (!staging.ok() || *staging == nullptr || body.size() < 2) return;
  const size_t offset = uint8_t(body[0]) | (size_t(uint8_t(body[1])) << 8);
  if (offset >= (*staging)->size()) return;
  const size_t n = std::min(body.size() - 2, (*staging)->size() - offset);
  std::memcpy((*staging)->base() + offset, body.data() + 2, n);
}

}  // namespace
}  // namespace karakv::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace karakv::fuzz;
  namespace v1 = ::karakv::v1;
  Reader r(data, size);
  const uint8_t options = r.u8();
  Input in(options);
  {
    // The worker every input starts with: a session with 64 KiB of staging.
    v1::AttachRequest req;
    req.set_worker_id("fuzz");
    req.set_tenant("t0");
    req.set_staging_bytes(64 << 10);
    req.set_fast_path(options & kOptFastPathSession);
    v1::AttachReply reply;
    if (!in.daemon.service->Handle(req, &reply).ok()) std::abort();
    in.sessions.push_back(reply.session_id());
  }
  while (!r.empty()) {
    const uint8_t op = r.u8() % kNumOps;
    const uint8_t session = r.u8();
    const std::string body = r.bytes(r.u16());
    switch (op) {
      case kAttach: call<v1::AttachRequest, v1::AttachReply>(in, "Attach", body, session); break;
      case kDetach: call<v1::DetachRequest, v1::DetachReply>(in, "Detach", body, session); break;
      case kHeartbeat: call<v1::HeartbeatRequest, v1::HeartbeatReply>(in, "Heartbeat", body, session); break;
      case kCreateSequence:
        call<v1::CreateSequenceRequest, v1::CreateSequenceReply>(in, "CreateSequence", body, session);
        break;
      case kForkSequence:
        call<v1::ForkSequenceRequest, v1::ForkSequenceReply>(in, "ForkSequence", body, session);
        break;
      case kReleaseSequence:
        call<v1::ReleaseSequenceRequest, v1::ReleaseSequenceReply>(in, "ReleaseSequence", body, session);
        break;
      case kAppend: call<v1::AppendRequest, v1::AppendReply>(in, "Append", body, session); break;
      case kStep: call<v1::StepRequest, v1::StepReply>(in, "Step", body, session); break;
      case kAttend: call<v1::AttendRequest, v1::AttendReply>(in, "Attend", body, session); break;
      case kReadKV: call<v1::ReadKVRequest, v1::ReadKVReply>(in, "ReadKV", body, session); break;
      case kStats: call<v1::StatsRequest, v1::StatsReply>(in, "Stats", body, session); break;
      case kListSequences:
        call<v1::ListSequencesRequest, v1::ListSequencesReply>(in, "ListSequences", body, session);
        break;
      case kCompact: call<v1::CompactRequest, v1::CompactReply>(in, "Compact", body, session); break;
      case kInspect: call<v1::InspectRequest, v1::InspectReply>(in, "Inspect", body, session); break;
      case kLookup: call<v1::LookupRequest, v1::LookupReply>(in, "Lookup", body, session); break;
      case kPing: call<v1::PingRequest, v1::PingReply>(in, "Ping", body, session); break;
      case kExpireLeases:
        in.daemon.core->expire_leases(absl::Now() + absl::Hours(1));
        in.daemon.check("lease expiry");
        break;
      case kWriteStaging: write_staging(in, body, session); break;
      case kAppendBatch:
        call<v1::AppendBatchRequest, v1::AppendBatchReply>(in, "AppendBatch", body, session);
        break;
    }
  }
  return 0;
}
