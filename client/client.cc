// The SDK over the generated gRPC stub: maps the staging region at Attach, turns Buffers into
// TensorRefs (staging offset or inline bytes), and keeps the lease alive from a background thread.
#include "karakv/client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <tuple>
#include <thread>
#include <unordered_set>

#include "absl/strings/match.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/cord.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "karakv/v1/geometry.h"
#include "karakv/v1/karakv.grpc.pb.h"
#include "karakv/v1/ring.h"
#include "device_import.h"
#include "inline_request.h"
#include "util/fd_passing.h"
#include "ring_client.h"

namespace karakv {
namespace v1 = ::karakv::v1;
using v1::from_proto;
using v1::to_proto;

namespace {

absl::Status from_grpc(const grpc::Status& s, const char* method) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(method, ": ", s.error_message()));
}

constexpr char kDaemonRestartedPayload[] = "karakv.v1/daemon_restarted";

// Maps `bytes` of the shared-memory object karakvd named at Attach (`what`: what it holds, for the
// errors) and removes the name: both sides have it mapped then, and no other process can open it.
absl::StatusOr<uint8_t*> map_named_shm(const std::string& name, size_t bytes, const char* what) {
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open ", what, " ", name, ": ", std::strerror(errno),
                     " (is the worker on the same host, as the same user, sharing /dev/shm with karakvd?)"));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return absl::ResourceExhaustedError(absl::StrCat("cannot map ", what, ": ", std::strerror(errno)));
  shm_unlink(name.c_str());
  return static_cast<uint8_t*>(p);
}

// The fast path's ring of `ring_bytes` at `base`, when its layout is this SDK's.
absl::StatusOr<std::unique_ptr<RingClient>> ring_at(uint8_t* base, uint64_t ring_bytes, absl::Duration spin) {
  if (ring_bytes < ring::kRingBytes || !ring::layout_matches(base)) {
    return absl::FailedPreconditionError(
        "Attach: the fast-path ring's layout differs from this SDK's (karakv/v1/ring.h version); "
        "attach without fast_path or use a matching SDK");
  }
  return std::make_unique<RingClient>(base, spin);
}

}  // namespace

bool IsDaemonRestarted(const absl::Status& status) {
  return status.code() == absl::StatusCode::kAborted && status.GetPayload(kDaemonRestartedPayload).has_value();
}

struct Client::Impl {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::KaraKV::Stub> stub;
  // Requests with inline tensors: their encoded bytes, kept for the next call (inline_request.h).
  std::shared_ptr<client_internal::SendBuffers> send_buffers = std::make_shared<client_internal::SendBuffers>();
  std::string session_id;
  Geometry geometry;
  uint32_t lease_seconds = 0;
  uint8_t* staging = nullptr;
  size_t staging_size = 0;
  size_t staging_used = 0;
  size_t mapped_size = 0;
  DeviceImport device;  // Staging::kDevice: the imported region (staging points into it)
  DeviceEvents events;  // ClientOptions::stream_ordered
  uint64_t staging_generation = 0;
  std::unique_ptr<RingClient> ring;
  std::mutex ring_mu;  // the ring has one producer
  // Device staging's fast path: the rings' own shared-memory mapping (shm staging's rings are in
  // the staging mapping).
  uint8_t* ring_map = nullptr;
  size_t ring_map_size = 0;
  bool attached = false;
  absl::Notification stop_heartbeat;
  std::thread heartbeat;

  // ---- re-attaching after a daemon restart ----
  // Guards what the heartbeat thread reads or sets: session_id, instance_id, down and its backoff.
  mutable std::mutex state_mu;
  std::string instance_id;
  std::string geometry_proto;  // the daemon's geometry at the first Attach, serialized
  bool down = false;           // a call or heartbeat found karakvd unreachable (or restarted)
  int failed_probes = 0;       // since it went down
  absl::Time next_probe;
  std::string given_up;        // set once max_attempts probes failed, or re-attaching cannot work
  absl::StatusCode given_up_code = absl::StatusCode::kUnavailable;
  uint64_t reattaches = 0, probes = 0;
  std::mt19937_64 rng{std::random_device{}()};
  // Sequence ids this client got from the current daemon instance, and those lost with earlier ones.
  std::unordered_set<uint64_t> live, lost;

  std::string session() const {
    std::lock_guard<std::mutex> lock(state_mu);
    return session_id;
  }
  void mark_down() {
    if (!options.reattach.enabled) return;
    std::lock_guard<std::mutex> lock(state_mu);
    if (down) return;
    down = true;
    failed_probes = 0;
    next_probe = absl::Now();
  }
  // The wait before the next probe after `failed` failed ones: exponential, jittered, bounded.
  absl::Duration backoff(int failed) {
    const ReattachOptions& r = options.reattach;
    double d = absl::ToDoubleSeconds(r.initial_backoff) * std::pow(std::max(1.0, r.multiplier), failed - 1);
    d = std::min(d, absl::ToDoubleSeconds(r.max_backoff));
    const double j = std::clamp(r.jitter, 0.0, 1.0);
    d *= std::uniform_real_distribution<double>(1 - j, 1 + j)(rng);
    return absl::Seconds(std::min(d, absl::ToDoubleSeconds(r.max_backoff)));
  }
  absl::Status probe_failed(const absl::Status& why) {
    std::lock_guard<std::mutex> lock(state_mu);
    ++failed_probes;
    if (options.reattach.max_attempts > 0 && failed_probes >= options.reattach.max_attempts) {
      given_up = absl::StrCat("karakvd at ", options.target, " unreachable: gave up re-attaching after ",
                              failed_probes, " attempts (ReattachOptions.max_attempts); last: ", why.message());
      return absl::UnavailableError(given_up);
    }
    const absl::Duration wait = backoff(failed_probes);
    next_probe = absl::Now() + wait;
    return absl::Status(why.code(), absl::StrCat(why.message(), " (re-attach attempt ", failed_probes,
                                                 " failed; next in ", absl::FormatDuration(wait), ")"));
  }
  absl::Status ping(v1::PingReply* reply) const {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::microseconds(absl::ToInt64Microseconds(std::min(options.rpc_timeout, absl::Seconds(2)))));
    return from_grpc(stub->Ping(&ctx, v1::PingRequest(), reply), "Ping");
  }
  // The daemon answers as another instance than the one this client attached to.
  bool restarted(const v1::PingReply& reply) const {
    std::lock_guard<std::mutex> lock(state_mu);
    return !reply.instance_id().empty() && reply.instance_id() != instance_id;
  }

  // Before a call, when karakvd was found gone: probe it (no sooner than the backoff allows) and,
  // if it is a new instance, attach again. OK when the call may go ahead. The heartbeat thread
  // probes too (`reattach_if_restarted` false): the same instance back means the session may still
  // be alive, and beats resume before its lease runs out; a new instance is left to the next call.
  absl::Status recover(const char* method, bool reattach_if_restarted = true);
  absl::Status reattach(const char* method);
  absl::Status attach_rpc(v1::AttachReply* reply);
  // The typed error for a call naming a sequence lost with an earlier daemon instance.
  absl::Status check_lost(const char* method, std::span<const uint64_t> ids) const {
    if (lost.empty()) return absl::OkStatus();
    for (uint64_t id : ids) {
      if (lost.count(id) && !live.count(id)) {
        absl::Status s = absl::AbortedError(absl::StrCat(
            method, ": sequence ", id, " was lost: the daemon restarted; re-prefill (karakvd at ", options.target,
            " restarted and holds none of this client's earlier sequences; create a new sequence and append the "
            "prompt again)"));
        s.SetPayload(kDaemonRestartedPayload, absl::Cord(absl::StrCat(id)));
        return s;
      }
    }
    return absl::OkStatus();
  }
  // Runs one call (`fn` builds its request with session()): recovers first, refuses lost
  // sequences, and notes a daemon found gone. A call that names no sequence and meets a restarted
  // daemon is repeated once on the new session.
  template <typename F>
  absl::Status call(const char* method, std::span<const uint64_t> ids, F&& fn) {
    if (absl::Status s = recover(method); !s.ok()) return s;
    if (absl::Status s = check_lost(method, ids); !s.ok()) return s;
    absl::Status s = fn();
    if (s.ok() || !options.reattach.enabled || !attached) return s;
    if (s.code() == absl::StatusCode::kUnavailable) {
      mark_down();
      return s;
    }
    if (s.code() != absl::StatusCode::kNotFound || !absl::StrContains(s.message(), "unknown session")) return s;
    v1::PingReply reply;
    if (!ping(&reply).ok() || !restarted(reply)) return s;  // detached, or the lease ran out: as it says
    if (absl::Status r = reattach(method); !r.ok()) return r;
    if (absl::Status l = check_lost(method, ids); !l.ok()) return l;
    return fn();
  }
  // Records a sequence id the daemon handed out. False if this client had one with that id before
  // a restart: the new sequence is released (the caller asks again), so an old id never names new data.
  absl::StatusOr<bool> take_id(uint64_t id) {
    if (!lost.count(id)) {
      live.insert(id);
      return true;
    }
    absl::Status s = call("ReleaseSequence", {}, [&] {
      v1::ReleaseSequenceRequest req;
      req.set_session_id(session());
      req.set_sequence_id(id);
      v1::ReleaseSequenceReply reply;
      grpc::ClientContext ctx;
      prepare(&ctx);
      return from_grpc(stub->ReleaseSequence(&ctx, req, &reply), "ReleaseSequence");
    });
    if (!s.ok()) return s;
    return false;
  }

  void prepare(grpc::ClientContext* ctx) const {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::microseconds(absl::ToInt64Microseconds(options.rpc_timeout)));
  }

  void set_input(const Buffer& b, v1::TensorRef* ref) const {
    if (b.in_staging()) {
      ref->mutable_staging()->set_offset(b.offset());
      ref->mutable_staging()->set_length(b.size());
    } else {
      ref->set_data(reinterpret_cast<const char*>(b.data()), b.size());
    }
  }
  // As set_input, except that a tensor in this process's memory is not copied into `ref` but added
  // to `inline_tensors` as field `field` (encoded with the request by encode_with_inline_tensors).
  void set_input(const Buffer& b, v1::TensorRef* ref, int field,
                 std::vector<client_internal::InlineTensor>* inline_tensors) const {
    if (b.in_staging()) {
      set_input(b, ref);
    } else {
      inline_tensors->push_back({field, {static_cast<const uint8_t*>(b.data()), b.size()}});
    }
  }

  // A unary call whose request is already encoded, run on the calling thread as the stub's are.
  template <typename Reply>
  grpc::Status call_encoded(grpc::ClientContext* ctx, const std::string& method, const grpc::ByteBuffer& request,
                            Reply* reply) const {
    grpc::TemplatedGenericStub<grpc::ByteBuffer, Reply> generic(channel);
    grpc::CompletionQueue cq;
    grpc::Status status;
    {
      auto call = generic.PrepareUnaryCall(ctx, method, request, &cq);
      call->StartCall();
      call->Finish(reply, &status, nullptr);
      void* tag = nullptr;
      bool ok = false;
      cq.Next(&tag, &ok);
    }
    cq.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq.Next(&tag, &ok)) {
    }
    return status;
  }

  void set_output(const Buffer& b, v1::OutputRef* ref) const {
    if (b.in_staging()) {
      ref->mutable_staging()->set_offset(b.offset());
      ref->mutable_staging()->set_length(b.size());
    }
  }
  // Device staging's fast path (reply.ring_bytes > 0): maps the rings' shared-memory object, which
  // holds nothing else (ring_offset 0), and removes its name.
  absl::Status map_device_rings(const v1::AttachReply& reply) {
    if (reply.ring_bytes() == 0) return absl::OkStatus();
    if (reply.staging_name().empty() || reply.ring_offset() != 0 || reply.ring_bytes() < ring::kRingBytes) {
      return absl::InternalError(absl::StrCat("Attach: device staging's rings at offset ", reply.ring_offset(), ", ",
                                              reply.ring_bytes(), " bytes in '", reply.staging_name(),
                                              "' (SDK and karakvd disagree on the layout)"));
    }
    auto mapped = map_named_shm(reply.staging_name(), reply.ring_bytes(), "the fast path's rings");
    if (!mapped.ok()) return mapped.status();
    ring_map = *mapped;
    ring_map_size = reply.ring_bytes();
    auto r = ring_at(ring_map, reply.ring_bytes(), options.ring_spin);
    if (!r.ok()) return r.status();
    ring = std::move(*r);
    return absl::OkStatus();
  }
  bool ring_ready(std::initializer_list<const Buffer*> buffers) const {
    if (ring == nullptr || !ring->usable() || !attached) return false;
    for (const Buffer* b : buffers) {
      if (!b->in_staging()) return false;
    }
    return true;
  }
  // For Append and ReadKV, which only a newer daemon takes on the ring.
  bool ring_ready_data(std::initializer_list<const Buffer*> buffers) const {
    return ring_ready(buffers) && ring->supports(ring::kOpsAppendReadKV);
  }
  // An optional input: in staging, or absent (an empty range, as gRPC sends an unset tensor).
  static bool staged_or_empty(const Buffer& b) { return b.in_staging() || b.size() == 0; }
  static ring::Range range(const Buffer& b) { return {b.offset(), b.size()}; }
  // The daemon's loss, as seen from a ring wait that lasts: an empty call answered UNAVAILABLE
  // (connection refused or reset). A slow answer is not a loss: the wait goes on to its deadline.
  absl::Status daemon_alive() {
    v1::PingRequest req;
    v1::PingReply reply;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    grpc::Status s = stub->Ping(&ctx, req, &reply);
    if (s.ok() && restarted(reply)) {
      return absl::UnavailableError("karakvd restarted: a fast-path command got no completion and Ping answered "
                                    "from a new daemon instance");
    }
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat("karakvd is gone: a fast-path command got no completion and Ping failed (",
                                               s.error_message(), ")"));
  }
  // Runs `cmd` through the ring; nullopt when the caller should use gRPC (ring full). Errors carry
  // the method's name as the gRPC path's do.
  std::optional<absl::StatusOr<ring::Completion>> ring_call(ring::Command& cmd, const char* method) {
    std::lock_guard<std::mutex> lock(ring_mu);
    if (!ring->usable()) return std::nullopt;
    auto r = ring->call(cmd, absl::Now() + options.rpc_timeout, options.ring_full_wait,
                        [this] { return daemon_alive(); });
    if (!r.ok()) return absl::Status(r.status().code(), absl::StrCat(method, ": ", r.status().message()));
    if (!r->has_value()) return std::nullopt;
    const ring::Completion& c = **r;
    if (c.code != 0) {
      const size_t n = std::min<size_t>(c.message_bytes, ring::Completion::kMessageBytes);
      return absl::Status(static_cast<absl::StatusCode>(c.code),
                          absl::StrCat(method, ": ", std::string(c.message, n)));
    }
    return c;
  }

  // Copies an inline reply into a heap buffer; staging buffers were written by the daemon.
  static absl::Status take_output(const Buffer& b, const std::string& bytes, const char* what) {
    if (b.in_staging()) return absl::OkStatus();
    if (bytes.size() > b.size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": reply has ", bytes.size(),
                                                     " bytes but the buffer holds ", b.size()));
    }
    std::memcpy(b.data(), bytes.data(), bytes.size());
    return absl::OkStatus();
  }
};

absl::Status Client::Impl::attach_rpc(v1::AttachReply* reply) {
  v1::AttachRequest req;
  req.set_worker_id(options.worker_id);
  req.set_tenant(options.tenant);
  req.set_staging_bytes(options.staging_bytes);
  req.set_cache_namespace(options.cache_namespace);
  req.set_model_fingerprint(options.model_fingerprint);
  req.set_fast_path(options.fast_path && options.staging_bytes > 0);
  if (options.staging == Staging::kDevice) req.set_staging_kind(v1::STAGING_KIND_CUDA_IPC);
  if (options.staging == Staging::kDeviceFd) req.set_staging_kind(v1::STAGING_KIND_CUDA_VMM_FD);
  if (!events.worker_handle.empty()) req.set_worker_event_ipc_handle(events.worker_handle);
  if (options.geometry) *req.mutable_geometry() = to_proto(*options.geometry);
  grpc::ClientContext ctx;
  prepare(&ctx);
  ctx.set_wait_for_ready(false);
  return from_grpc(stub->Attach(&ctx, req, reply), "Attach");
}

absl::Status Client::Impl::recover(const char* method, bool reattach_if_restarted) {
  {
    std::lock_guard<std::mutex> lock(state_mu);
    if (!down || !attached) return absl::OkStatus();
    if (!given_up.empty()) return absl::Status(given_up_code, absl::StrCat(method, ": ", given_up));
    const absl::Time now = absl::Now();
    if (now < next_probe) {
      return absl::UnavailableError(absl::StrCat(method, ": karakvd at ", options.target, " is unreachable (",
                                                 failed_probes, " re-attach attempt(s) failed); next attempt in ",
                                                 absl::FormatDuration(next_probe - now)));
    }
    ++probes;
  }
  v1::PingReply reply;
  if (absl::Status s = ping(&reply); !s.ok()) {
    return probe_failed(absl::Status(s.code(), absl::StrCat(method, ": karakvd at ", options.target,
                                                            " is unreachable: ", s.message())));
  }
  if (restarted(reply)) return reattach_if_restarted ? reattach(method) : absl::OkStatus();
  // The same daemon instance: the session may have survived the gap.
  v1::HeartbeatRequest req;
  req.set_session_id(session());
  v1::HeartbeatReply hb;
  grpc::ClientContext ctx;
  prepare(&ctx);
  const grpc::Status s = stub->Heartbeat(&ctx, req, &hb);
  if (!s.ok() && s.error_code() != grpc::StatusCode::NOT_FOUND) return probe_failed(from_grpc(s, method));
  // OK, or NOT_FOUND: the session's lease ran out meanwhile, and the calls will say so.
  std::lock_guard<std::mutex> lock(state_mu);
  down = false;
  failed_probes = 0;
  return absl::OkStatus();
}

absl::Status Client::Impl::reattach(const char* method) {
  v1::AttachReply reply;
  if (absl::Status s = attach_rpc(&reply); !s.ok()) {
    mark_down();
    return probe_failed(absl::Status(s.code(), absl::StrCat(method, ": re-attaching to the restarted karakvd: ",
                                                            s.message())));
  }
  // What cannot work: the client's geometry or staging layout differs in the new daemon.
  auto give_up = [&](const std::string& why) {
    v1::DetachRequest dreq;
    dreq.set_session_id(reply.session_id());
    v1::DetachReply drep;
    grpc::ClientContext ctx;
    prepare(&ctx);
    stub->Detach(&ctx, dreq, &drep);
    std::lock_guard<std::mutex> lock(state_mu);
    down = true;
    given_up_code = absl::StatusCode::kFailedPrecondition;
    given_up = absl::StrCat("karakvd restarted and this client cannot re-attach: ", why, "; attach a new Client");
    return absl::FailedPreconditionError(absl::StrCat(method, ": ", given_up));
  };
  if (reply.geometry().SerializeAsString() != geometry_proto) return give_up("it serves another geometry");
  if (device.ptr != nullptr) return give_up("its device staging region cannot take the old one's address");
  const size_t map_size = reply.staging_bytes() + reply.ring_bytes();
  if (reply.staging_bytes() != staging_size || (staging != nullptr && map_size > mapped_size) ||
      (staging != nullptr) != !reply.staging_name().empty()) {
    return give_up(absl::StrCat("its staging region has ", reply.staging_bytes(), " bytes, this client's ", staging_size));
  }
  {
    std::lock_guard<std::mutex> lock(ring_mu);
    ring.reset();
    if (staging != nullptr) {
      // The new region takes the old one's address, with its bytes: Buffers stay valid and keep
      // what the caller wrote into them.
      int fd = shm_open(reply.staging_name().c_str(), O_RDWR, 0);
      if (fd < 0) return give_up(absl::StrCat("cannot open its staging region: ", std::strerror(errno)));
      void* p = mmap(nullptr, map_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
      if (p == MAP_FAILED) return give_up(absl::StrCat("cannot map its staging region: ", std::strerror(errno)));
      std::memcpy(p, staging, staging_size);
      if (mremap(p, map_size, map_size, MREMAP_MAYMOVE | MREMAP_FIXED, staging) == MAP_FAILED) {
        const int err = errno;
        munmap(p, map_size);
        return give_up(absl::StrCat("cannot move its staging region into place: ", std::strerror(err)));
      }
      shm_unlink(reply.staging_name().c_str());
      if (reply.ring_bytes() > 0) {
        uint8_t* ring_base = staging + reply.ring_offset();
        if (reply.ring_offset() != reply.staging_bytes() || reply.ring_bytes() < ring::kRingBytes ||
            !ring::layout_matches(ring_base)) {
          return give_up("its fast-path ring's layout differs from this SDK's");
        }
        ring = std::make_unique<RingClient>(ring_base, options.ring_spin);
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(state_mu);
    session_id = reply.session_id();
    instance_id = reply.instance_id();
    down = false;
    failed_probes = 0;
    ++reattaches;
  }
  lost.insert(live.begin(), live.end());
  live.clear();
  return absl::OkStatus();
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

namespace {

absl::StatusOr<std::string> read_file(const char* what, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat("ClientOptions.", what, "=", path, ": cannot read it (",
                                                   std::strerror(errno), ")"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials(const ClientOptions& o) {
  if (!o.tls && o.tls_ca_file.empty() && o.tls_cert_file.empty() && o.tls_key_file.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("ClientOptions.tls_cert_file and tls_key_file go together (mutual TLS)");
  }
  grpc::SslCredentialsOptions tls;
  for (auto [what, path, out] : {std::tuple{"tls_ca_file", &o.tls_ca_file, &tls.pem_root_certs},
                                 std::tuple{"tls_cert_file", &o.tls_cert_file, &tls.pem_cert_chain},
                                 std::tuple{"tls_key_file", &o.tls_key_file, &tls.pem_private_key}}) {
    if (path->empty()) continue;
    auto text = read_file(what, *path);
    if (!text.ok()) return text.status();
    *out = std::move(*text);
  }
  return grpc::SslCredentials(tls);
}

}  // namespace

std::string default_target() {
  const char* env = std::getenv("KARAKV_TARGET");
  return env != nullptr && *env != '\0' ? std::string(env) : std::string("unix:/tmp/karakv.sock");
}

absl::StatusOr<std::unique_ptr<Client>> Client::Attach(const ClientOptions& given) {
  ClientOptions options = given;
  if (options.target.empty()) options.target = default_target();
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetMaxSendMessageSize(1 << 30);
  // As karakvd's: large HTTP/2 windows and frames for inline tensors (a new stream's 64 KiB
  // window would cost a window update per 64 KiB of a reply).
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16 << 20);
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, (16 << 20) - 1);
  args.SetInt(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 8 << 20);
  auto creds = credentials(options);
  if (!creds.ok()) return creds.status();
  impl->channel = grpc::CreateCustomChannel(options.target, *creds, args);
  impl->stub = v1::KaraKV::NewStub(impl->channel);
  if (options.stream_ordered) {
    if (options.staging == Staging::kShm) {
      return absl::InvalidArgumentError(
          "ClientOptions.stream_ordered orders device staging by CUDA events: set staging to kDevice or kDeviceFd, "
          "or leave stream_ordered false");
    }
    if (auto s = create_worker_event(&impl->events); !s.ok()) return s;
  }
  // An Attach that fails below leaves nothing of ours in karakvd to use the event: drop it.
  absl::Cleanup events_on_failure = [im = impl.get()] { destroy_worker_event(&im->events); };

  v1::AttachReply reply;
  if (auto s = impl->attach_rpc(&reply); !s.ok()) return s;
  impl->session_id = reply.session_id();
  impl->instance_id = reply.instance_id();
  impl->geometry_proto = reply.geometry().SerializeAsString();
  impl->geometry = from_proto(reply.geometry());
  impl->lease_seconds = reply.lease_seconds();
  impl->attached = true;
  std::move(events_on_failure).Cancel();  // from here the client's destructor detaches, then drops it
  std::unique_ptr<Client> client(new Client(std::move(impl)));
  Impl& im = *client->impl_;
  if (options.stream_ordered) {
    if (reply.staging_event_ipc_handle().empty()) {
      return absl::FailedPreconditionError(
          "Attach: stream_ordered, but karakvd answered without its event (a karakvd without stream-ordered "
          "staging); attach without stream_ordered");
    }
    if (auto s = open_daemon_event(reply.staging_event_ipc_handle(), reply.staging_device(), &im.events); !s.ok())
      return s;
  }

  if (reply.staging_kind() == v1::STAGING_KIND_CUDA_IPC) {
    auto imported = import_device_staging(reply.staging_ipc_handle(), reply.staging_device(), reply.staging_bytes());
    if (!imported.ok()) return imported.status();
    im.device = *imported;
    im.staging = static_cast<uint8_t*>(im.device.ptr);
    im.staging_size = reply.staging_bytes();
    im.staging_generation = reply.staging_generation();
    if (auto s = im.map_device_rings(reply); !s.ok()) return s;
  } else if (reply.staging_kind() == v1::STAGING_KIND_CUDA_VMM_FD) {
    const std::string fd_socket = options.staging_fd_socket.empty() ? fdpass::fd_socket_for_target(options.target)
                                                                    : options.staging_fd_socket;
    auto imported = import_device_staging_fd(fd_socket, reply.session_id(), reply.staging_generation(),
                                             reply.staging_bytes());
    if (!imported.ok()) return imported.status();
    im.device = *imported;
    im.staging = static_cast<uint8_t*>(im.device.ptr);
    im.staging_size = reply.staging_bytes();
    im.staging_generation = reply.staging_generation();
    if (auto s = im.map_device_rings(reply); !s.ok()) return s;
  } else if (options.staging != Staging::kShm) {
    return absl::FailedPreconditionError("Attach: asked for device staging but karakvd answered with another kind");
  } else if (!reply.staging_name().empty()) {
    if (reply.ring_bytes() > 0 && reply.ring_offset() != reply.staging_bytes()) {
      return absl::InternalError(absl::StrCat("Attach: ring_offset ", reply.ring_offset(), " != staging_bytes ",
                                              reply.staging_bytes(), " (SDK and karakvd disagree on the layout)"));
    }
    const size_t map_size = reply.staging_bytes() + reply.ring_bytes();
    auto mapped = map_named_shm(reply.staging_name(), map_size, "staging region");
    if (!mapped.ok()) return mapped.status();
    im.staging = *mapped;
    im.staging_size = reply.staging_bytes();
    im.mapped_size = map_size;
    if (reply.ring_bytes() > 0) {
      auto r = ring_at(im.staging + reply.ring_offset(), reply.ring_bytes(), options.ring_spin);
      if (!r.ok()) return r.status();
      im.ring = std::move(*r);
    }
  }
  if (options.heartbeat && im.lease_seconds > 0) {
    const absl::Duration period = absl::Seconds(im.lease_seconds) / 3;
    Impl* raw = &im;
    im.heartbeat = std::thread([raw, period] {
      absl::Duration wait = period;
      while (!raw->stop_heartbeat.WaitForNotificationWithTimeout(wait)) {
        wait = period;
        bool down = false;
        {
          std::lock_guard<std::mutex> lock(raw->state_mu);
          down = raw->down;
        }
        if (down) {
          // Probe, with the calls' backoff, so that a session that outlived a transient UNAVAILABLE
          // keeps its lease even when no call comes (the probe's Heartbeat is the beat). A restarted
          // daemon is left to the next call, which re-attaches.
          raw->recover("Heartbeat", /*reattach_if_restarted=*/false).IgnoreError();
          std::lock_guard<std::mutex> lock(raw->state_mu);
          const absl::Duration until_probe = raw->next_probe - absl::Now();
          // Still down after a failed probe: try again when the backoff allows, not a beat later.
          if (raw->down && raw->given_up.empty() && until_probe > absl::ZeroDuration()) {
            wait = std::clamp(until_probe, absl::Milliseconds(10), period);
          }
          continue;
        }
        v1::HeartbeatRequest hreq;
        hreq.set_session_id(raw->session());
        v1::HeartbeatReply hrep;
        grpc::ClientContext hctx;
        raw->prepare(&hctx);
        const grpc::Status s = raw->stub->Heartbeat(&hctx, hreq, &hrep);
        if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
          raw->mark_down();
        } else if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
          v1::PingReply p;
          if (raw->ping(&p).ok() && raw->restarted(p)) raw->mark_down();
        }
      }
    });
  }
  return client;
}

Client::~Client() {
  if (impl_->attached) Detach().IgnoreError();
  if (impl_->heartbeat.joinable()) {
    impl_->stop_heartbeat.Notify();
    impl_->heartbeat.join();
  }
  if (impl_->device.ptr != nullptr) {
    close_device_staging(&impl_->device);
  } else if (impl_->staging) {
    munmap(impl_->staging, impl_->mapped_size);
  }
  close_daemon_event(&impl_->events);
  destroy_worker_event(&impl_->events);
  if (impl_->ring_map != nullptr) munmap(impl_->ring_map, impl_->ring_map_size);
}

absl::Status Client::Detach() {
  if (!impl_->attached) return absl::FailedPreconditionError("Detach: not attached");
  impl_->attached = false;
  if (impl_->heartbeat.joinable()) {
    impl_->stop_heartbeat.Notify();
    impl_->heartbeat.join();
  }
  // Device staging: the mapping is closed before Detach, so karakvd may give the region to this
  // tenant's next session (device_staging.h); Buffers of this client are invalid from here on.
  if (impl_->device.ptr != nullptr) {
    close_device_staging(&impl_->device);
    impl_->staging = nullptr;
    impl_->staging_size = 0;
  }
  close_daemon_event(&impl_->events);
  v1::DetachRequest req;
  req.set_session_id(impl_->session());
  v1::DetachReply reply;
  grpc::ClientContext ctx;
  impl_->prepare(&ctx);
  absl::Status s = from_grpc(impl_->stub->Detach(&ctx, req, &reply), "Detach");
  // karakvd waits on the worker's event until the session is gone: only now may it be destroyed.
  destroy_worker_event(&impl_->events);
  return s;
}

bool Client::stream_ordered() const { return impl_->events.daemon != nullptr; }
absl::Status Client::inputs_written(void* stream) { return record_worker_event(impl_->events, stream); }
absl::Status Client::wait_outputs(void* stream) { return wait_daemon_event(impl_->events, stream); }

const Geometry& Client::geometry() const { return impl_->geometry; }
const std::string& Client::session_id() const { return impl_->session_id; }
const std::string& Client::instance_id() const { return impl_->instance_id; }
uint64_t Client::reattaches() const {
  std::lock_guard<std::mutex> lock(impl_->state_mu);
  return impl_->reattaches;
}
uint64_t Client::reattach_probes() const {
  std::lock_guard<std::mutex> lock(impl_->state_mu);
  return impl_->probes;
}
uint64_t Client::staging_bytes() const { return impl_->staging_size; }
bool Client::device_staging() const { return impl_->device.ptr != nullptr; }
uint64_t Client::staging_generation() const { return impl_->staging_generation; }
bool Client::fast_path() const { return impl_->ring != nullptr && impl_->ring->usable(); }
uint64_t Client::ring_calls() const { return impl_->ring ? impl_->ring->calls() : 0; }
uint64_t Client::ring_sleeps() const { return impl_->ring ? impl_->ring->sleeps() : 0; }

absl::StatusOr<Buffer> Client::alloc(size_t bytes) {
  const size_t start = (impl_->staging_used + 63) / 64 * 64;
  if (impl_->staging == nullptr || start + bytes > impl_->staging_size) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "staging region full: wanted ", bytes, " bytes at offset ", start, ", region holds ",
        impl_->staging_size, " (attach with a larger staging_bytes, or reset_staging())"));
  }
  impl_->staging_used = start + bytes;
  Buffer b;
  b.data_ = impl_->staging + start;
  b.size_ = bytes;
  b.in_staging_ = true;
  b.offset_ = start;
  return b;
}

void Client::reset_staging() { impl_->staging_used = 0; }

Buffer Client::alloc_heap(size_t bytes) {
  Buffer b;
  b.heap_ = std::make_shared<std::vector<uint8_t>>(bytes);
  b.data_ = b.heap_->data();
  b.size_ = bytes;
  return b;
}

size_t Client::append_bytes(int num_tokens) const {
  const Geometry& g = impl_->geometry;
  return size_t(g.num_layers) * num_tokens * g.kv_token_elems() * kernels::dtype_size(g.dtype);
}
size_t Client::step_kv_bytes(int batch) const {
  const Geometry& g = impl_->geometry;
  return size_t(batch) * g.kv_token_elems() * kernels::dtype_size(g.dtype);
}
size_t Client::q_bytes(int rows) const { return size_t(rows) * impl_->geometry.q_token_elems() * 4; }

absl::StatusOr<uint64_t> Client::CreateSequence(const std::string& policy, int priority) {
  SequenceOptions o;
  o.policy = policy;
  o.priority = priority;
  return CreateSequence(o);
}

absl::StatusOr<uint64_t> Client::CreateSequence(const SequenceOptions& options) {
  auto r = CreateFromPrefix(options, {});
  if (!r.ok()) return r.status();
  return r->id;
}

absl::StatusOr<CreatedSequence> Client::CreateFromPrefix(const SequenceOptions& options,
                                                         std::span<const int32_t> prompt_token_ids) {
  v1::CreateSequenceRequest req;
  req.mutable_prefix_token_ids()->Add(prompt_token_ids.begin(), prompt_token_ids.end());
  req.set_policy(options.policy);
  req.set_priority(options.priority);
  req.mutable_params()->insert(options.params.begin(), options.params.end());
  req.set_prefill_policy(options.prefill_policy);
  req.set_storage(options.storage);
  req.mutable_prefill_params()->insert(options.prefill_params.begin(), options.prefill_params.end());
  // An id this client held before a daemon restart is released and asked for again (the daemon's
  // ids only grow, so this ends): an old id must never name a new sequence.
  for (;;) {
    v1::CreateSequenceReply reply;
    absl::Status s = impl_->call("CreateSequence", {}, [&] {
      req.set_session_id(impl_->session());
      grpc::ClientContext ctx;
      impl_->prepare(&ctx);
      return from_grpc(impl_->stub->CreateSequence(&ctx, req, &reply), "CreateSequence");
    });
    if (!s.ok()) return s;
    auto fresh = impl_->take_id(reply.sequence_id());
    if (!fresh.ok()) return fresh.status();
    if (*fresh) return CreatedSequence{reply.sequence_id(), static_cast<int>(reply.cached_tokens())};
  }
}

absl::StatusOr<int> Client::Lookup(std::span<const int32_t> prompt_token_ids) {
  v1::LookupRequest req;
  req.mutable_token_ids()->Add(prompt_token_ids.begin(), prompt_token_ids.end());
  v1::LookupReply reply;
  absl::Status s = impl_->call("Lookup", {}, [&] {
    req.set_session_id(impl_->session());
    grpc::ClientContext ctx;
    impl_->prepare(&ctx);
    return from_grpc(impl_->stub->Lookup(&ctx, req, &reply), "Lookup");
  });
  if (!s.ok()) return s;
  return static_cast<int>(reply.cached_tokens());
}

absl::StatusOr<uint64_t> Client::Fork(uint64_t sequence_id) {
  const uint64_t ids[] = {sequence_id};
  for (;;) {
    v1::ForkSequenceReply reply;
    absl::Status s = impl_->call("ForkSequence", ids, [&] {
      v1::ForkSequenceRequest req;
      req.set_session_id(impl_->session());
      req.set_sequence_id(sequence_id);
      grpc::ClientContext ctx;
      impl_->prepare(&ctx);
      return from_grpc(impl_->stub->ForkSequence(&ctx, req, &reply), "ForkSequence");
    });
    if (!s.ok()) return s;
    auto fresh = impl_->take_id(reply.sequence_id());
    if (!fresh.ok()) return fresh.status();
    if (*fresh) return reply.sequence_id();
  }
}

absl::StatusOr<int> Client::Release(uint64_t sequence_id) {
  const uint64_t ids[] = {sequence_id};
  v1::ReleaseSequenceReply reply;
  absl::Status s = impl_->call("ReleaseSequence", ids, [&] {
    v1::ReleaseSequenceRequest req;
    req.set_session_id(impl_->session());
    req.set_sequence_id(sequence_id);
    grpc::ClientContext ctx;
    impl_->prepare(&ctx);
    return from_grpc(impl_->stub->ReleaseSequence(&ctx, req, &reply), "ReleaseSequence");
  });
  if (!s.ok()) return s;
  impl_->live.erase(sequence_id);
  return static_cast<int>(reply.blocks_freed());
}

absl::StatusOr<int> Client::Append(uint64_t sequence_id, int num_tokens, const Buffer& k, const Buffer& v) {
  return Append(sequence_id, num_tokens, k, v, Buffer(), 0);
}

absl::StatusOr<int> Client::Append(uint64_t sequence_id, std::span<const int32_t> token_ids, const Buffer& k,
                                   const Buffer& v, const Buffer& q, int num_query_tokens) {
  return AppendWithIds(sequence_id, static_cast<int>(token_ids.size()), k, v, q, num_query_tokens, token_ids);
}

absl::StatusOr<int> Client::Append(uint64_t sequence_id, int num_tokens, const Buffer& k, const Buffer& v,
                                   const Buffer& q, int num_query_tokens) {
  return AppendWithIds(sequence_id, num_tokens, k, v, q, num_query_tokens, {});
}

absl::StatusOr<int> Client::AppendWithIds(uint64_t sequence_id, int num_tokens, const Buffer& k, const Buffer& v,
                                          const Buffer& q, int num_query_tokens,
                                          std::span<const int32_t> token_ids) {
  v1::AppendRequest req;
  req.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  req.set_sequence_id(sequence_id);
  req.set_num_tokens(static_cast<uint32_t>(num_tokens));
  req.set_staging_generation(impl_->staging_generation);
  std::vector<client_internal::InlineTensor> inline_tensors;
  impl_->set_input(k, req.mutable_k(), v1::AppendRequest::kKFieldNumber, &inline_tensors);
  impl_->set_input(v, req.mutable_v(), v1::AppendRequest::kVFieldNumber, &inline_tensors);
  if (num_query_tokens > 0) {
    impl_->set_input(q, req.mutable_q(), v1::AppendRequest::kQFieldNumber, &inline_tensors);
    req.set_num_query_tokens(static_cast<uint32_t>(num_query_tokens));
  }
  const uint64_t ids[] = {sequence_id};
  v1::AppendReply reply;
  absl::Status s = impl_->call("Append", ids, [&]() -> absl::Status {
    // Token ids go on the ring when they lie in the staging region (allocated with alloc()),
    // as AppendBatch's do; ids elsewhere in this process go through gRPC.
    const auto* ids_begin = reinterpret_cast<const uint8_t*>(token_ids.data());
    const bool ids_staged = !token_ids.empty() && impl_->staging != nullptr && ids_begin >= impl_->staging &&
                            ids_begin + token_ids.size_bytes() <= impl_->staging + impl_->staging_size;
    if ((token_ids.empty() || ids_staged) && impl_->ring_ready_data({&k, &v}) && Impl::staged_or_empty(q)) {
      ring::Command cmd{};  // fields this op does not use go out as zeros, not stack bytes
      cmd.op = uint32_t(ring::Op::kAppend);
      cmd.count = 1;
      ring::AppendEntry e{};
      e.sequence_id = sequence_id;
      e.num_tokens = static_cast<uint32_t>(num_tokens);
      e.num_query_tokens = static_cast<uint32_t>(std::max(0, num_query_tokens));
      e.k = Impl::range(k);
      e.v = Impl::range(v);
      if (num_query_tokens > 0) e.q = Impl::range(q);
      if (ids_staged) e.token_ids = {uint64_t(ids_begin - impl_->staging), token_ids.size_bytes()};
      ring::set_append_entry(cmd, 0, e);
      if (auto r = impl_->ring_call(cmd, "Append")) {
        if (!r->ok()) return r->status();
        reply.set_length(static_cast<uint32_t>((*r)->decode_step));
        return absl::OkStatus();
      }
    }
    req.set_session_id(impl_->session());
    grpc::ClientContext ctx;
    impl_->prepare(&ctx);
    if (!inline_tensors.empty()) {
      const grpc::ByteBuffer encoded =
          client_internal::encode_with_inline_tensors(req, inline_tensors, *impl_->send_buffers);
      return from_grpc(impl_->call_encoded(&ctx, "/karakv.v1.KaraKV/Append", encoded, &reply), "Append");
    }
    return from_grpc(impl_->stub->Append(&ctx, req, &reply), "Append");
  });
  if (!s.ok()) return s;
  return static_cast<int>(reply.length());
}

absl::StatusOr<std::vector<int>> Client::AppendBatch(std::span<const AppendEntry> entries) {
  std::vector<uint64_t> ids;
  for (const AppendEntry& e : entries) ids.push_back(e.sequence_id);
  std::vector<int> lengths;
  absl::Status s = impl_->call("AppendBatch", ids, [&]() -> absl::Status {
    lengths.clear();
    bool ring = entries.size() <= ring::Command::kMaxAppends && impl_->ring_ready_data({});
    for (const AppendEntry& e : entries) {
      ring = ring && e.k.in_staging() && e.v.in_staging() && Impl::staged_or_empty(e.q) &&
             Impl::staged_or_empty(e.token_ids);
    }
    if (ring) {
      ring::Command cmd{};  // fields this op does not use go out as zeros, not stack bytes
      cmd.op = uint32_t(ring::Op::kAppend);
      cmd.count = static_cast<uint32_t>(entries.size());
      for (size_t i = 0; i < entries.size(); ++i) {
        const AppendEntry& in = entries[i];
        ring::AppendEntry e{};
        e.sequence_id = in.sequence_id;
        e.num_tokens = static_cast<uint32_t>(in.num_tokens);
        e.num_query_tokens = static_cast<uint32_t>(std::max(0, in.num_query_tokens));
        e.k = Impl::range(in.k);
        e.v = Impl::range(in.v);
        if (in.num_query_tokens > 0 || in.q.size() > 0) e.q = Impl::range(in.q);
        if (in.token_ids.size() > 0) e.token_ids = Impl::range(in.token_ids);
        ring::set_append_entry(cmd, i, e);
      }
      if (auto r = impl_->ring_call(cmd, "AppendBatch")) {
        if (!r->ok()) return r->status();
        for (size_t i = 0; i < entries.size(); ++i) lengths.push_back(int(ring::append_length(**r, i)));
        return absl::OkStatus();
      }
    }
    v1::AppendBatchRequest req;
    req.set_session_id(impl_->session());
    // Each entry without its inline tensors; those are encoded into the request (inline_request.h).
    std::vector<v1::AppendRequest> heads(entries.size());
    std::vector<client_internal::InlineEntry> inline_entries(entries.size());
    bool any_inline = false;
    for (size_t i = 0; i < entries.size(); ++i) {
      const AppendEntry& in = entries[i];
      v1::AppendRequest* e = &heads[i];
      std::vector<client_internal::InlineTensor>* tensors = &inline_entries[i].tensors;
      inline_entries[i].head = e;
      e->set_sequence_id(in.sequence_id);
      e->set_num_tokens(static_cast<uint32_t>(in.num_tokens));
      e->set_staging_generation(impl_->staging_generation);  // required with device staging
      impl_->set_input(in.k, e->mutable_k(), v1::AppendRequest::kKFieldNumber, tensors);
      impl_->set_input(in.v, e->mutable_v(), v1::AppendRequest::kVFieldNumber, tensors);
      if (in.num_query_tokens > 0 || in.q.size() > 0) {
        impl_->set_input(in.q, e->mutable_q(), v1::AppendRequest::kQFieldNumber, tensors);
        e->set_num_query_tokens(static_cast<uint32_t>(std::max(0, in.num_query_tokens)));
      }
      const auto* tok = reinterpret_cast<const int32_t*>(in.token_ids.data());
      e->mutable_token_ids()->Add(tok, tok + in.token_ids.size() / sizeof(int32_t));
      any_inline = any_inline || !tensors->empty();
    }
    v1::AppendBatchReply reply;
    grpc::ClientContext ctx;
    impl_->prepare(&ctx);
    grpc::Status status;
    if (any_inline) {
      const grpc::ByteBuffer encoded = client_internal::encode_entries_with_inline_tensors(
          req, v1::AppendBatchRequest::kEntriesFieldNumber, inline_entries, *impl_->send_buffers);
      status = impl_->call_encoded(&ctx, "/karakv.v1.KaraKV/AppendBatch", encoded, &reply);
    } else {
      for (v1::AppendRequest& e : heads) *req.add_entries() = std::move(e);
      status = impl_->stub->AppendBatch(&ctx, req, &reply);
    }
    if (auto st = from_grpc(status, "AppendBatch"); !st.ok()) return st;
    lengths.assign(reply.lengths().begin(), reply.lengths().end());
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  return lengths;
}

absl::StatusOr<uint64_t> Client::Step(int layer, std::span<const uint64_t> sequence_ids, const Buffer& k,
                                      const Buffer& v, const Buffer& q, const Buffer& out, float scale) {
  uint64_t decode_step = 0;
  absl::Status s = impl_->call("Step", sequence_ids, [&]() -> absl::Status {
    if (impl_->ring_ready({&k, &v, &q, &out}) && sequence_ids.size() <= ring::Command::kMaxIds) {
      ring::Command cmd;
      cmd.op = uint32_t(ring::Op::kStep);
      cmd.layer = layer;
      cmd.scale = scale;
      cmd.count = static_cast<uint32_t>(sequence_ids.size());
      cmd.sequence_id = 0;
      cmd.k = Impl::range(k);
      cmd.v = Impl::range(v);
      cmd.q = Impl::range(q);
      cmd.out = Impl::range(out);
      std::copy(sequence_ids.begin(), sequence_ids.end(), cmd.ids);
      if (auto r = impl_->ring_call(cmd, "Step")) {
        if (!r->ok()) return r->status();
        decode_step = (*r)->decode_step;
        return absl::OkStatus();
      }
    }
    v1::StepRequest req;
    req.set_session_id(impl_->session());
    req.set_layer(layer);
    req.set_staging_generation(impl_->staging_generation);
    req.mutable_sequence_ids()->Add(sequence_ids.begin(), sequence_ids.end());
    impl_->set_input(k, req.mutable_k());
    impl_->set_input(v, req.mutable_v());
    impl_->set_input(q, req.mutable_q());
    impl_->set_output(out, req.mutable_out());
    req.set_scale(scale);
    v1::StepReply reply;
    grpc::ClientContext ctx;
    impl_->prepare(&ctx);
    if (auto st = from_grpc(impl_->stub->Step(&ctx, req, &reply), "Step"); !st.ok()) return st;
    if (auto st = Impl::take_output(out, reply.out(), "Step.out"); !st.ok()) return st;
    decode_step = reply.decode_step();
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  return decode_step;
}

absl::Status Client::Attend(uint64_t sequence_id, int layer, int num_queries, const Buffer& q,
                            const Buffer& out, float scale) {
  const uint64_t ids[] = {sequence_id};
  return impl_->call("Attend", ids, [&]() -> absl::Status {
    if (impl_->ring_ready({&q, &out})) {
      ring::Command cmd;
      cmd.op = uint32_t(ring::Op::kAttend);
      cmd.layer = layer;
      cmd.scale = scale;
      cmd.count = static_cast<uint32_t>(num_queries);
      cmd.sequence_id = sequence_id;
      cmd.k = cmd.v = ring::Range{0, 0};
      cmd.q = Impl::range(q);
      cmd.out = Impl::range(out);
      if (auto r = impl_->ring_call(cmd, "Attend")) return r->status();
    }
    v1::AttendRequest req;
    req.set_session_id(impl_->session());
    req.set_sequence_id(sequence_id);
    req.set_layer(layer);
    req.set_num_queries(static_cast<uint32_t>(num_queries));
    req.set_staging_generation(impl_->staging_generation);
    impl_->set_input(q, req.mutable_q());
    impl_->set_output(out, req.mutable_out());
    req.set_scale(scale);
    v1::AttendReply reply;
    grpc::ClientContext ctx;
    impl_->prepare(&ctx);
    if (auto s = from_grpc(impl_->stub->Attend(&ctx, req, &reply), "Attend"); !s.ok()) return s;
    return Impl::take_output(out, reply.out(), "Attend.out");
  });
}

absl::StatusOr<std::vector<Compaction>> Client::Compact(uint64_t sequence_id, bool dry_run) {
  v1::CompactRequest req;
  req.set_sequence_id(sequence_id);
  req.set_dry_run(dry_run);
  v1::CompactReply reply;
  const uint64_t ids[] = {sequence_id};
  absl::Status s = impl_->call("Compact", std::span<const uint64_t>(ids, sequence_id == 0 ? 0 : 1), [&] {
    req.set_session_id(impl_->session());
    grpc::ClientContext ctx;
    impl_->prepare(&ctx);
    return from_grpc(impl_->stub->Compact(&ctx, req, &reply), "Compact");
  });
  if (!s.ok()) return s;
  std::vector<Compaction> out;
  for (const auto& c : reply.sequences()) {
    Compaction r;
    r.sequence_id = c.sequence_id();
    r.policy = c.policy();
    r.tokens_before = c.tokens_before();
    r.tokens_after = c.tokens_after();
    r.skipped = c.skipped();
    for (const auto& h : c.kept()) r.kept.emplace_back(h.positions().begin(), h.positions().end());
    out.push_back(std::move(r));
  }
  return out;
}

absl::StatusOr<int> Client::ReadKV(uint64_t sequence_id, const Buffer& k, const Buffer& v,
                                   const Buffer& positions) {
  v1::ReadKVRequest req;
  req.set_sequence_id(sequence_id);
  req.set_staging_generation(impl_->staging_generation);
  impl_->set_output(k, req.mutable_k());
  impl_->set_output(v, req.mutable_v());
  impl_->set_output(positions, req.mutable_positions());
  v1::ReadKVReply reply;
  const uint64_t ids[] = {sequence_id};
  absl::Status st = impl_->call("ReadKV", ids, [&]() -> absl::Status {
    if (impl_->ring_ready_data({&k, &v, &positions})) {
      ring::Command cmd{};  // fields this op does not use go out as zeros, not stack bytes
      cmd.op = uint32_t(ring::Op::kReadKV);
      cmd.sequence_id = sequence_id;
      cmd.k = Impl::range(k);
      cmd.v = Impl::range(v);
      cmd.out = Impl::range(positions);
      if (auto r = impl_->ring_call(cmd, "ReadKV")) {
        if (!r->ok()) return r->status();
        reply.set_num_tokens(static_cast<uint32_t>((*r)->decode_step));
        return absl::OkStatus();
      }
    }
    req.set_session_id(impl_->session());
    grpc::ClientContext ctx;
    impl_->prepare(&ctx);
    return from_grpc(impl_->stub->ReadKV(&ctx, req, &reply), "ReadKV");
  });
  if (!st.ok()) return st;
  if (auto s = Impl::take_output(k, reply.k(), "ReadKV.k"); !s.ok()) return s;
  if (auto s = Impl::take_output(v, reply.v(), "ReadKV.v"); !s.ok()) return s;
  if (auto s = Impl::take_output(positions, reply.positions(), "ReadKV.positions"); !s.ok()) return s;
  return static_cast<int>(reply.num_tokens());
}

absl::StatusOr<DaemonStats> Client::Stats(bool check_invariants) {
  v1::StatsRequest req;
  req.set_check_invariants(check_invariants);
  v1::StatsReply r;
  absl::Status st = impl_->call("Stats", {}, [&] {
    grpc::ClientContext ctx;
    impl_->prepare(&ctx);
    return from_grpc(impl_->stub->Stats(&ctx, req, &r), "Stats");
  });
  if (!st.ok()) return st;
  DaemonStats out;
  out.geometry = from_proto(r.geometry());
  out.backend = r.backend();
  out.blocks_total = r.blocks_total();
  out.blocks_used = r.blocks_used();
  out.blocks_free = r.blocks_free();
  out.block_bytes = r.block_bytes();
  out.pool_bytes = r.pool_bytes();
  out.resident_tokens = r.resident_tokens();
  out.decode_steps = r.decode_steps();
  out.tokens_appended = r.tokens_appended();
  out.decode_tokens = r.decode_tokens();
  out.lease_expiries = r.lease_expiries();
  out.preemptions = r.preemptions();
  out.sequences = r.sequences();
  out.sessions = r.sessions();
  out.logical_tokens = r.logical_tokens();
  out.query_cache_bytes = r.query_cache_bytes();
  out.score_bytes = r.score_bytes();
  out.prefix_cache_enabled = r.prefix_cache_enabled();
  out.prefix_lookups = r.prefix_lookups();
  out.prefix_lookup_tokens = r.prefix_lookup_tokens();
  out.prefix_hit_tokens = r.prefix_hit_tokens();
  out.prefix_cached_blocks = r.prefix_cached_blocks();
  out.prefix_unused_blocks = r.prefix_unused_blocks();
  out.prefix_evictions = r.prefix_evictions();
  out.prefix_published_blocks = r.prefix_published_blocks();
  out.heap_in_use_bytes = r.heap_in_use_bytes();
  out.heap_held_bytes = r.heap_held_bytes();
  for (const auto& p : r.policies()) {
    PolicyStats ps;
    ps.policy = p.policy();
    ps.sequences = p.sequences();
    ps.resident_tokens = p.resident_tokens();
    ps.logical_tokens = p.logical_tokens();
    ps.compactions = p.compactions();
    ps.tokens_removed = p.tokens_removed();
    ps.failures = p.compaction_failures();
    ps.compaction_seconds = p.compaction_seconds();
    ps.kv_bytes = p.kv_bytes();
    ps.fp16_bytes = p.fp16_bytes();
    ps.nominal_ratio = p.nominal_ratio();
    ps.actual_ratio = p.actual_ratio();
    out.policies.push_back(std::move(ps));
  }
  out.invariants_checked = r.invariants_checked();
  out.invariant_error = r.invariant_error();
  return out;
}

absl::StatusOr<std::vector<SequenceInfo>> Client::ListSequences() {
  v1::ListSequencesRequest req;
  v1::ListSequencesReply r;
  absl::Status st = impl_->call("ListSequences", {}, [&] {
    req.set_session_id(impl_->session());
    grpc::ClientContext ctx;
    impl_->prepare(&ctx);
    return from_grpc(impl_->stub->ListSequences(&ctx, req, &r), "ListSequences");
  });
  if (!st.ok()) return st;
  std::vector<SequenceInfo> out;
  for (const auto& s : r.sequences()) {
    SequenceInfo i;
    i.id = s.sequence_id();
    i.session_id = s.session_id();
    i.tenant = s.tenant();
    i.policy = s.policy();
    i.prefill_policy = s.prefill_policy();
    i.logical_length = s.logical_length();
    i.prompt_length = s.prompt_length();
    i.compactions = s.compactions();
    i.storage = s.storage();
    i.quantized_tokens = s.quantized_tokens();
    i.kv_bytes = s.kv_bytes();
    i.fp16_bytes = s.fp16_bytes();
    i.nominal_ratio = s.nominal_ratio();
    i.length = s.length();
    i.blocks = s.blocks();
    i.shared_blocks = s.shared_blocks();
    i.priority = s.priority();
    i.pending_layer = s.pending_layer();
    i.params.insert(s.params().begin(), s.params().end());
    i.prefill_params.insert(s.prefill_params().begin(), s.prefill_params().end());
    out.push_back(std::move(i));
  }
  return out;
}

namespace {

class GrpcEventStream final : public EventStream {
 public:
  GrpcEventStream(v1::KaraKV::Stub* stub, const std::string& session_id) {
    v1::WatchEventsRequest req;
    req.set_session_id(session_id);
    reader_ = stub->WatchEvents(&ctx_, req);
    reader_->WaitForInitialMetadata();
  }
  ~GrpcEventStream() override {
    if (!finished_) {
      ctx_.TryCancel();
      Finish().IgnoreError();
    }
  }
  bool Next(Event* out) override {
    v1::Event e;
    if (finished_ || !reader_->Read(&e)) return false;
    *out = Event();
    out->number = e.number();
    out->time_unix = e.time_unix();
    switch (e.kind_case()) {
      case v1::Event::kPreempted:
        out->kind = Event::Kind::kPreempted;
        out->sequence_id = e.preempted().sequence_id();
        out->reason = e.preempted().reason();
        out->priority = e.preempted().priority();
        out->blocks_freed = e.preempted().blocks_freed();
        out->tokens_lost = e.preempted().tokens_lost();
        break;
      case v1::Event::kCompaction:
        out->kind = Event::Kind::kCompaction;
        out->sequence_id = e.compaction().sequence_id();
        out->policy = e.compaction().policy();
        out->tokens_before = e.compaction().tokens_before();
        out->tokens_after = e.compaction().tokens_after();
        break;
      case v1::Event::kSessionEnded:
        out->kind = Event::Kind::kSessionEnded;
        out->reason = e.session_ended().reason();
        out->lease_expired = e.session_ended().lease_expired();
        out->sequences_released = e.session_ended().sequences_released();
        break;
      case v1::Event::kDropped:
        out->kind = Event::Kind::kDropped;
        out->dropped = e.dropped().count();
        break;
      case v1::Event::kCompactionFailed:
        out->kind = Event::Kind::kCompactionFailed;
        out->sequence_id = e.compaction_failed().sequence_id();
        out->policy = e.compaction_failed().policy();
        out->reason = e.compaction_failed().reason();
        break;
      case v1::Event::kDeviceFailed:
        out->kind = Event::Kind::kDeviceFailed;
        out->reason = e.device_failed().reason();
        break;
      default:  // a kind newer than this SDK: skip it
        return Next(out);
    }
    return true;
  }
  absl::Status Finish() override {
    if (!finished_) {
      finished_ = true;
      status_ = from_grpc(reader_->Finish(), "WatchEvents");
    }
    return status_;
  }
  void Cancel() override { ctx_.TryCancel(); }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::Event>> reader_;
  bool finished_ = false;
  absl::Status status_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<EventStream>> Client::WatchEvents() {
  return std::unique_ptr<EventStream>(new GrpcEventStream(impl_->stub.get(), impl_->session_id));
}

absl::Status Client::Heartbeat() {
  return impl_->call("Heartbeat", {}, [&] {
    v1::HeartbeatRequest req;
    req.set_session_id(impl_->session());
    v1::HeartbeatReply reply;
    grpc::ClientContext ctx;
    impl_->prepare(&ctx);
    return from_grpc(impl_->stub->Heartbeat(&ctx, req, &reply), "Heartbeat");
  });
}

absl::Status Client::Ping() {
  return impl_->call("Ping", {}, [&] {
    v1::PingRequest req;
    v1::PingReply reply;
    grpc::ClientContext ctx;
    impl_->prepare(&ctx);
    return from_grpc(impl_->stub->Ping(&ctx, req, &reply), "Ping");
  });
}

}  // namespace karakv
