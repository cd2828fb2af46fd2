// The SDK over the generated gRPC stub: maps the staging region at Attach, turns Buffers into
// TensorRefs (staging offset or inline bytes), and keeps the lease alive from a background thread.
#include "karakv/client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/grpcpp.h"
#include "karakv/v1/geometry.h"
#include "karakv/v1/karakv.grpc.pb.h"
#include "karakv/v1/ring.h"
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

}  // namespace

struct Client::Impl {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::KaraKV::Stub> stub;
  std::string session_id;
  Geometry geometry;
  uint32_t lease_seconds = 0;
  uint8_t* staging = nullptr;
  size_t staging_size = 0;
  size_t staging_used = 0;
  size_t mapped_size = 0;
  std::unique_ptr<RingClient> ring;
  std::mutex ring_mu;  // the ring has one producer
  bool attached = false;
  absl::Notification stop_heartbeat;
  std::thread heartbeat;

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
  void set_output(const Buffer& b, v1::OutputRef* ref) const {
    if (b.in_staging()) {
      ref->mutable_staging()->set_offset(b.offset());
      ref->mutable_staging()->set_length(b.size());
    }
  }
  bool ring_ready(std::initializer_list<const Buffer*> buffers) const {
    if (ring == nullptr || !ring->usable() || !attached) return false;
    for (const Buffer* b : buffers) {
      if (!b->in_staging()) return false;
    }
    return true;
  }
  static ring::Range range(const Buffer& b) { return {b.offset(), b.size()}; }
  // The daemon's loss, as seen from a ring wait that lasts: an empty call answered UNAVAILABLE
  // (connection refused or reset). A slow answer is not a loss: the wait goes on to its deadline.
  absl::Status daemon_alive() {
    v1::PingRequest req;
    v1::PingReply reply;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    grpc::Status s = stub->Ping(&ctx, req, &reply);
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

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<Client>> Client::Attach(const ClientOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetMaxSendMessageSize(1 << 30);
  impl->channel = grpc::CreateCustomChannel(options.target, grpc::InsecureChannelCredentials(), args);
  impl->stub = v1::KaraKV::NewStub(impl->channel);

  v1::AttachRequest req;
  req.set_worker_id(options.worker_id);
  req.set_tenant(options.tenant);
  req.set_staging_bytes(options.staging_bytes);
  req.set_cache_namespace(options.cache_namespace);
  req.set_fast_path(options.fast_path && options.staging_bytes > 0);
  if (options.geometry) *req.mutable_geometry() = to_proto(*options.geometry);
  v1::AttachReply reply;
  grpc::ClientContext ctx;
  impl->prepare(&ctx);
  ctx.set_wait_for_ready(false);
  if (auto s = from_grpc(impl->stub->Attach(&ctx, req, &reply), "Attach"); !s.ok()) return s;
  impl->session_id = reply.session_id();
  impl->geometry = from_proto(reply.geometry());
  impl->lease_seconds = reply.lease_seconds();
  impl->attached = true;
  std::unique_ptr<Client> client(new Client(std::move(impl)));
  Impl& im = *client->impl_;

  if (!reply.staging_name().empty()) {
    int fd = shm_open(reply.staging_name().c_str(), O_RDWR, 0);
    if (fd < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot open staging region ", reply.staging_name(), ": ", std::strerror(errno),
          " (is the worker on the same host, as the same user, sharing /dev/shm with karakvd?)"));
    }
    if (reply.ring_bytes() > 0 && reply.ring_offset() != reply.staging_bytes()) {
      close(fd);
      return absl::InternalError(absl::StrCat("Attach: ring_offset ", reply.ring_offset(), " != staging_bytes ",
                                              reply.staging_bytes(), " (SDK and karakvd disagree on the layout)"));
    }
    const size_t map_size = reply.staging_bytes() + reply.ring_bytes();
    void* p = mmap(nullptr, map_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot map staging region: ", std::strerror(errno)));
    }
    // Both sides have it mapped now; removing the name means no other process can open it.
    shm_unlink(reply.staging_name().c_str());
    im.staging = static_cast<uint8_t*>(p);
    im.staging_size = reply.staging_bytes();
    im.mapped_size = map_size;
    if (reply.ring_bytes() > 0) {
      uint8_t* ring_base = im.staging + reply.ring_offset();
      if (reply.ring_bytes() < ring::kRingBytes || !ring::layout_matches(ring_base)) {
        return absl::FailedPreconditionError(
            "Attach: the fast-path ring's layout differs from this SDK's (karakv/v1/ring.h version); "
            "attach without fast_path or use a matching SDK");
      }
      im.ring = std::make_unique<RingClient>(ring_base, options.ring_spin);
    }
  }
  if (options.heartbeat && im.lease_seconds > 0) {
    const absl::Duration period = absl::Seconds(im.lease_seconds) / 3;
    Impl* raw = &im;
    im.heartbeat = std::thread([raw, period] {
      while (!raw->stop_heartbeat.WaitForNotificationWithTimeout(period)) {
        v1::HeartbeatRequest hreq;
        hreq.set_session_id(raw->session_id);
        v1::HeartbeatReply hrep;
        grpc::ClientContext hctx;
        raw->prepare(&hctx);
        raw->stub->Heartbeat(&hctx, hreq, &hrep);
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
  if (impl_->staging) munmap(impl_->staging, impl_->mapped_size);
}

absl::Status Client::Detach() {
  if (!impl_->attached) return absl::FailedPreconditionError("Detach: not attached");
  impl_->attached = false;
  if (impl_->heartbeat.joinable()) {
    impl_->stop_heartbeat.Notify();
    impl_->heartbeat.join();
  }
  v1::DetachRequest req;
  req.set_session_id(impl_->session_id);
  v1::DetachReply reply;
  grpc::ClientContext ctx;
  impl_->prepare(&ctx);
  return from_grpc(impl_->stub->Detach(&ctx, req, &reply), "Detach");
}

const Geometry& Client::geometry() const { return impl_->geometry; }
const std::string& Client::session_id() const { return impl_->session_id; }
uint64_t Client::staging_bytes() const { return impl_->staging_size; }
bool Client::fast_path() const { return impl_->ring != nullptr && impl_->ring->usable(); }
uint64_t Client::ring_calls() const { return impl_->ring ? impl_->ring->calls() : 0; }

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
  req.set_session_id(impl_->session_id);
  req.set_policy(options.policy);
  req.set_priority(options.priority);
  req.mutable_params()->insert(options.params.begin(), options.params.end());
  req.set_prefill_policy(options.prefill_policy);
  req.set_storage(options.storage);
  req.mutable_prefill_params()->insert(options.prefill_params.begin(), options.prefill_params.end());
  v1::CreateSequenceReply reply;
  grpc::ClientContext ctx;
  impl_->prepare(&ctx);
  if (auto s = from_grpc(impl_->stub->CreateSequence(&ctx, req, &reply), "CreateSequence"); !s.ok()) return s;
  return CreatedSequence{reply.sequence_id(), static_cast<int>(reply.cached_tokens())};
}

absl::StatusOr<int> Client::Lookup(std::span<const int32_t> prompt_token_ids) {
  v1::LookupRequest req;
  req.set_session_id(impl_->session_id);
  req.mutable_token_ids()->Add(prompt_token_ids.begin(), prompt_token_ids.end());
  v1::LookupReply reply;
  grpc::ClientContext ctx;
  impl_->prepare(&ctx);
  if (auto s = from_grpc(impl_->stub->Lookup(&ctx, req, &reply), "Lookup"); !s.ok()) return s;
  return static_cast<int>(reply.cached_tokens());
}

absl::StatusOr<uint64_t> Client::Fork(uint64_t sequence_id) {
  v1::ForkSequenceRequest req;
  req.set_session_id(impl_->session_id);
  req.set_sequence_id(sequence_id);
  v1::ForkSequenceReply reply;
  grpc::ClientContext ctx;
  impl_->prepare(&ctx);
  if (auto s = from_grpc(impl_->stub->ForkSequence(&ctx, req, &reply), "ForkSequence"); !s.ok()) return s;
  return reply.sequence_id();
}

absl::StatusOr<int> Client::Release(uint64_t sequence_id) {
  v1::ReleaseSequenceRequest req;
  req.set_session_id(impl_->session_id);
  req.set_sequence_id(sequence_id);
  v1::ReleaseSequenceReply reply;
  grpc::ClientContext ctx;
  impl_->prepare(&ctx);
  if (auto s = from_grpc(impl_->stub->ReleaseSequence(&ctx, req, &reply), "ReleaseSequence"); !s.ok()) return s;
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
  req.set_session_id(impl_->session_id);
  req.set_sequence_id(sequence_id);
  req.set_num_tokens(static_cast<uint32_t>(num_tokens));
  impl_->set_input(k, req.mutable_k());
  impl_->set_input(v, req.mutable_v());
  if (num_query_tokens > 0) {
    impl_->set_input(q, req.mutable_q());
    req.set_num_query_tokens(static_cast<uint32_t>(num_query_tokens));
  }
  v1::AppendReply reply;
  grpc::ClientContext ctx;
  impl_->prepare(&ctx);
  if (auto s = from_grpc(impl_->stub->Append(&ctx, req, &reply), "Append"); !s.ok()) return s;
  return static_cast<int>(reply.length());
}

absl::StatusOr<uint64_t> Client::Step(int layer, std::span<const uint64_t> sequence_ids, const Buffer& k,
                                      const Buffer& v, const Buffer& q, const Buffer& out, float scale) {
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
      return (*r)->decode_step;
    }
  }
  v1::StepRequest req;
  req.set_session_id(impl_->session_id);
  req.set_layer(layer);
  req.mutable_sequence_ids()->Add(sequence_ids.begin(), sequence_ids.end());
  impl_->set_input(k, req.mutable_k());
  impl_->set_input(v, req.mutable_v());
  impl_->set_input(q, req.mutable_q());
  impl_->set_output(out, req.mutable_out());
  req.set_scale(scale);
  v1::StepReply reply;
  grpc::ClientContext ctx;
  impl_->prepare(&ctx);
  if (auto s = from_grpc(impl_->stub->Step(&ctx, req, &reply), "Step"); !s.ok()) return s;
  if (auto s = Impl::take_output(out, reply.out(), "Step.out"); !s.ok()) return s;
  return reply.decode_step();
}

absl::Status Client::Attend(uint64_t sequence_id, int layer, int num_queries, const Buffer& q,
                            const Buffer& out, float scale) {
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
  req.set_session_id(impl_->session_id);
  req.set_sequence_id(sequence_id);
  req.set_layer(layer);
  req.set_num_queries(static_cast<uint32_t>(num_queries));
  impl_->set_input(q, req.mutable_q());
  impl_->set_output(out, req.mutable_out());
  req.set_scale(scale);
  v1::AttendReply reply;
  grpc::ClientContext ctx;
  impl_->prepare(&ctx);
  if (auto s = from_grpc(impl_->stub->Attend(&ctx, req, &reply), "Attend"); !s.ok()) return s;
  return Impl::take_output(out, reply.out(), "Attend.out");
}

absl::StatusOr<std::vector<Compaction>> Client::Compact(uint64_t sequence_id, bool dry_run) {
  v1::CompactRequest req;
  req.set_session_id(impl_->session_id);
  req.set_sequence_id(sequence_id);
  req.set_dry_run(dry_run);
  v1::CompactReply reply;
  grpc::ClientContext ctx;
  impl_->prepare(&ctx);
  if (auto s = from_grpc(impl_->stub->Compact(&ctx, req, &reply), "Compact"); !s.ok()) return s;
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
  req.set_session_id(impl_->session_id);
  req.set_sequence_id(sequence_id);
  impl_->set_output(k, req.mutable_k());
  impl_->set_output(v, req.mutable_v());
  impl_->set_output(positions, req.mutable_positions());
  v1::ReadKVReply reply;
  grpc::ClientContext ctx;
  impl_->prepare(&ctx);
  if (auto s = from_grpc(impl_->stub->ReadKV(&ctx, req, &reply), "ReadKV"); !s.ok()) return s;
  if (auto s = Impl::take_output(k, reply.k(), "ReadKV.k"); !s.ok()) return s;
  if (auto s = Impl::take_output(v, reply.v(), "ReadKV.v"); !s.ok()) return s;
  if (auto s = Impl::take_output(positions, reply.positions(), "ReadKV.positions"); !s.ok()) return s;
  return static_cast<int>(reply.num_tokens());
}

absl::StatusOr<DaemonStats> Client::Stats(bool check_invariants) {
  v1::StatsRequest req;
  req.set_check_invariants(check_invariants);
  v1::StatsReply r;
  grpc::ClientContext ctx;
  impl_->prepare(&ctx);
  if (auto s = from_grpc(impl_->stub->Stats(&ctx, req, &r), "Stats"); !s.ok()) return s;
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
  req.set_session_id(impl_->session_id);
  v1::ListSequencesReply r;
  grpc::ClientContext ctx;
  impl_->prepare(&ctx);
  if (auto s = from_grpc(impl_->stub->ListSequences(&ctx, req, &r), "ListSequences"); !s.ok()) return s;
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
    out.push_back(std::move(i));
  }
  return out;
}

absl::Status Client::Heartbeat() {
  v1::HeartbeatRequest req;
  req.set_session_id(impl_->session_id);
  v1::HeartbeatReply reply;
  grpc::ClientContext ctx;
  impl_->prepare(&ctx);
  return from_grpc(impl_->stub->Heartbeat(&ctx, req, &reply), "Heartbeat");
}

absl::Status Client::Ping() {
  v1::PingRequest req;
  v1::PingReply reply;
  grpc::ClientContext ctx;
  impl_->prepare(&ctx);
  return from_grpc(impl_->stub->Ping(&ctx, req, &reply), "Ping");
}

}  // namespace karakv
