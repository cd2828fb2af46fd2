// Request handling: every tensor reference is resolved and bounds-checked against the caller's own
// staging region before the core (and so any kernel) sees it.
#include "server/service.h"

#include "karakv/v1/geometry.h"
#include "karakv/v1/ring.h"
#include "server/heap_usage.h"
#include "server/ring.h"
#include "server/validation.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spdlog/spdlog.h"

namespace karakv::server {

using v1::from_proto;
using v1::to_proto;

namespace {

using Input = KaraKVService::Input;

absl::Status resolve_input(const v1::TensorRef& ref, const Staging* staging, const char* what,
                           Input* out) {
  switch (ref.location_case()) {
    case v1::TensorRef::kData: {
      const std::string& d = ref.data();
      if (reinterpret_cast<uintptr_t>(d.data()) % 4 != 0) {
        out->copy.assign(d.begin(), d.end());
        out->bytes = ConstBytes(out->copy.data(), out->copy.size());
      } else {
        out->bytes = ConstBytes(reinterpret_cast<const uint8_t*>(d.data()), d.size());
      }
      return absl::OkStatus();
    }
    case v1::TensorRef::kStaging: {
      if (staging == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, " refers to staging memory but this session attached without a staging region; "
                  "send it inline as data"));
      }
      auto p = staging->resolve(ref.staging().offset(), ref.staging().length(), 4, what);
      if (!p.ok()) return p.status();
      out->bytes = ConstBytes(*p, ref.staging().length());
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(what, " is missing: set staging {offset, length} or inline data"));
  }
}

// An output tensor: a staging range of exactly `want` bytes, or (no range given) the reply's own
// bytes field resized to `want`.
absl::StatusOr<MutableBytes> resolve_output(const v1::OutputRef& ref, const Staging* staging,
                                            size_t want, bool exact, const char* what,
                                            std::string* inline_dst) {
  if (!ref.has_staging()) {
    inline_dst->resize(want);
    return MutableBytes(reinterpret_cast<uint8_t*>(inline_dst->data()), want);
  }
  if (staging == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " refers to staging memory but this session attached without a staging region"));
  }
  const uint64_t length = ref.staging().length();
  if (absl::Status s = check_output_range(what, length, want, exact); !s.ok()) return s;
  auto p = staging->resolve(ref.staging().offset(), length, 4, what);
  if (!p.ok()) return p.status();
  return MutableBytes(*p, want);
}

bool uses_staging(const v1::TensorRef& r) { return r.has_staging(); }
bool uses_staging(const v1::OutputRef& r) { return r.has_staging(); }

// The session's staging region, looked up only when some tensor of the request lives there, and
// checked against the generation the request names (check_generation: FAILED_PRECONDITION when it
// is stale, or missing with device staging).
template <typename... Refs>
absl::StatusOr<std::shared_ptr<Staging>> staging_for(Core* core, const std::string& session, uint64_t generation,
                                                     const Refs&... refs) {
  if (!(uses_staging(refs) || ...)) return std::shared_ptr<Staging>();
  auto staging = core->staging(session);
  if (!staging.ok()) return staging.status();
  if (*staging != nullptr) {
    if (absl::Status s = check_generation(**staging, generation); !s.ok()) return s;
  }
  return staging;
}

}  // namespace

std::string KaraKVService::new_instance_id() {
  std::random_device rd;
  return absl::StrFormat("%08x%08x%08x%08x", rd(), rd(), rd(), rd());
}

grpc::Status to_grpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

namespace {

bool geometry_sent(const v1::Geometry& g) {
  return g.num_layers() != 0 || g.num_q_heads() != 0 || g.num_kv_heads() != 0 || g.head_dim() != 0 ||
         g.block_size() != 0 || g.dtype() != v1::DTYPE_UNSPECIFIED;
}

// A geometry with any field set is compared field by field, the zero ones included (a worker that
// sends only dtype and block_size has not said which model it runs), and every field that differs is
// named with the daemon's value.
absl::Status check_sent_geometry(const v1::Geometry& sent, const kernels::Geometry& daemon) {
  std::vector<std::string> diffs;
  auto compare = [&](const char* field, int64_t got, int64_t want) {
    if (got != want) diffs.push_back(absl::StrCat(field, " ", got, " (the daemon's: ", want, ")"));
  };
  compare("num_layers", sent.num_layers(), daemon.num_layers);
  compare("num_q_heads", sent.num_q_heads(), daemon.num_q_heads);
  compare("num_kv_heads", sent.num_kv_heads(), daemon.num_kv_heads);
  compare("head_dim", sent.head_dim(), daemon.head_dim);
  compare("block_size", sent.block_size(), daemon.block_size);
  const char* daemon_dtype = kernels::dtype_name(daemon.dtype);
  if (sent.dtype() == v1::DTYPE_UNSPECIFIED) {
    diffs.push_back(absl::StrCat("dtype unspecified (the daemon's: ", daemon_dtype, ")"));
  } else if (!v1::DType_IsValid(sent.dtype())) {
    diffs.push_back(absl::StrCat("dtype ", static_cast<int>(sent.dtype()), " unknown (the daemon's: ", daemon_dtype, ")"));
  } else if (from_proto(sent).dtype != daemon.dtype) {
    diffs.push_back(absl::StrCat("dtype ", kernels::dtype_name(from_proto(sent).dtype), " (the daemon's: ",
                                 daemon_dtype, ")"));
  }
  if (diffs.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "worker geometry differs from the daemon's in ", absl::StrJoin(diffs, ", "), "; send the daemon's whole geometry (",
      geometry_string(daemon), "), or none to be served it"));
}

}  // namespace

grpc::ServerUnaryReactor* KaraKVService::finish(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(to_grpc(status));
  return reactor;
}

absl::Status KaraKVService::DoAttach(const v1::AttachRequest& req, v1::AttachReply* reply) {
  // No geometry (or every field zero) means "the daemon's"; any field sent and all are compared.
  kernels::Geometry wg{.num_layers = 0, .num_q_heads = 0, .num_kv_heads = 0, .head_dim = 0};  // none
  if (req.has_geometry() && geometry_sent(req.geometry())) {
    if (absl::Status s = check_sent_geometry(req.geometry(), core_->geometry()); !s.ok()) return s;
    wg = from_proto(req.geometry());
  }
  if (req.fast_path() && rings_ == nullptr) {
    return absl::FailedPreconditionError("fast_path: this karakvd runs with --fast_path=false; attach without it");
  }
  if (req.fast_path() && req.staging_bytes() == 0) {
    return absl::InvalidArgumentError("fast_path needs a staging region: set staging_bytes > 0");
  }
  StagingKind kind = StagingKind::kShm;
  switch (req.staging_kind()) {
    case v1::STAGING_KIND_SHM: break;
    case v1::STAGING_KIND_CUDA_IPC: kind = StagingKind::kCudaIpc; break;
    case v1::STAGING_KIND_CUDA_VMM_FD: kind = StagingKind::kCudaVmmFd; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("staging_kind ", static_cast<int>(req.staging_kind()),
                                                     " unknown; expected SHM (0), CUDA_IPC (1) or CUDA_VMM_FD (2)"));
  }
  auto r = core_->attach(req.worker_id(), req.tenant().empty() ? "default" : req.tenant(),
                             req.staging_bytes(), wg, req.cache_namespace(),
                             req.fast_path() ? ring::kRingBytes : 0, kind, req.model_fingerprint(),
                             req.worker_event_ipc_handle());
  if (!r.ok()) return r.status();
  if (req.fast_path()) {
    // The rings follow shm staging in its region; device staging's have a region of their own.
    auto regions = core_->ring_regions(r->session_id);
    absl::Status s = !regions.ok() ? regions.status()
                     : regions->rings == nullptr
                         ? absl::InternalError("fast path: the session has no shared memory for its rings")
                         : rings_->start(r->session_id, regions->data, regions->rings);
    if (!s.ok()) {
      core_->detach(r->session_id).IgnoreError();
      return s;
    }
    reply->set_ring_offset(regions->rings->size());
    reply->set_ring_bytes(regions->rings->reserved_size());
  }
  reply->set_session_id(r->session_id);
  reply->set_lease_seconds(static_cast<uint32_t>(absl::ToInt64Seconds(core_->config().lease)));
  *reply->mutable_geometry() = to_proto(core_->geometry());
  reply->set_staging_name(r->staging_name);
  reply->set_staging_bytes(r->staging_bytes);
  if (kind != StagingKind::kShm) {
    reply->set_staging_kind(req.staging_kind());
    reply->set_staging_ipc_handle(r->staging_ipc_handle);
    reply->set_staging_device(r->staging_device);
    reply->set_staging_generation(r->staging_generation);
    reply->set_staging_event_ipc_handle(r->staging_event_ipc_handle);
  }
  reply->set_instance_id(instance_id_);
  spdlog::info("session {} attached: worker '{}', tenant '{}', {} bytes of {} staging{}", r->session_id,
               req.worker_id(), req.tenant().empty() ? "default" : req.tenant(), r->staging_bytes,
               staging_kind_name(kind), r->staging_event_ipc_handle.empty() ? "" : ", stream-ordered by CUDA events");
  return absl::OkStatus();
}

absl::Status KaraKVService::DoAppend(const std::string& session_id, const v1::AppendRequest& req,
                                     v1::AppendReply* reply) {
  auto staging = staging_for(core_, session_id, req.staging_generation(), req.k(), req.v(), req.q());
  if (!staging.ok()) return staging.status();
  Input k, v, q;
  if (auto s = resolve_input(req.k(), staging->get(), "k", &k); !s.ok()) return s;
  if (auto s = resolve_input(req.v(), staging->get(), "v", &v); !s.ok()) return s;
  if (req.num_query_tokens() > 0 || req.q().location_case() != v1::TensorRef::LOCATION_NOT_SET) {
    if (auto s = resolve_input(req.q(), staging->get(), "q", &q); !s.ok()) return s;
  }
  auto r = in_stream_order(staging->get(), [&](bool) {
    return core_->append(session_id, req.sequence_id(), int64_t{req.num_tokens()}, k.bytes, v.bytes, q.bytes,
                         int64_t{req.num_query_tokens()},
                         absl::MakeConstSpan(req.token_ids().data(), req.token_ids_size()));
  });
  if (!r.ok()) return r.status();
  reply->set_length(static_cast<uint32_t>(*r));
  return absl::OkStatus();
}

absl::Status KaraKVService::DoAppendBatch(const v1::AppendBatchRequest& req, v1::AppendBatchReply* reply) {
  // Each entry as its own Append, in order; the ring's Append command does the same (ring.cc).
  const size_t n = req.entries_size();
  if (absl::Status s = check_append_batch(n); !s.ok()) return s;
  v1::AppendReply one;
  for (size_t i = 0; i < n; ++i) {
    const v1::AppendRequest& e = req.entries(i);
    absl::Status s;
    if (!e.session_id().empty() && e.session_id() != req.session_id()) {
      s = absl::InvalidArgumentError(absl::StrCat("entries[", i, "].session_id is '", e.session_id(),
                                                  "', expected empty or the batch's session_id"));
    } else {
      s = DoAppend(req.session_id(), e, &one);
    }
    if (!s.ok()) {
      reply->Clear();
      return append_entry_status(s, i, n, e.sequence_id());
    }
    reply->add_lengths(one.length());
  }
  return absl::OkStatus();
}

absl::Status KaraKVService::DoCreateSequence(const v1::CreateSequenceRequest& req, v1::CreateSequenceReply* reply) {
  SequenceOptions o;
  o.policy = req.policy();
  o.params.insert(req.params().begin(), req.params().end());
  o.prefill_policy = req.prefill_policy();
  o.prefill_params.insert(req.prefill_params().begin(), req.prefill_params().end());
  o.priority = req.priority();
  o.storage = req.storage();
  o.prefix_token_ids.assign(req.prefix_token_ids().begin(), req.prefix_token_ids().end());
  auto r = core_->create_sequence_from_prefix(req.session_id(), o);
  if (!r.ok()) return r.status();
  reply->set_sequence_id(r->first);
  reply->set_cached_tokens(static_cast<uint32_t>(r->second));
  return absl::OkStatus();
}

namespace {
// A session id is the bearer credential of its session: whoever knows it can use the session's
// sequences. Views that need no session (ListSequences without one, Inspect) therefore show a tag
// that tells sessions apart within this daemon's lifetime and cannot be turned back into the id.
SequenceInfo operator_view(SequenceInfo info) {
  const uint64_t h = absl::Hash<std::string>{}(info.session_id);
  info.session_id = absl::StrFormat("session#%012x", h & 0xffffffffffffull);
  return info;
}

void fill_info(const SequenceInfo& info, v1::SequenceInfo* s) {
  s->set_sequence_id(info.id);
  s->set_session_id(info.session_id);
  s->set_tenant(info.tenant);
  s->set_policy(info.policy);
  s->set_prefill_policy(info.prefill_policy);
  s->set_length(info.length);
  s->set_logical_length(info.logical_length);
  s->set_prompt_length(info.prompt_length);
  s->set_compactions(info.compactions);
  s->set_blocks(info.blocks);
  s->set_shared_blocks(info.shared_blocks);
  s->set_priority(info.priority);
  s->set_pending_layer(info.pending_layer);
  s->set_storage(info.storage);
  s->set_quantized_tokens(info.quantized);
  s->set_kv_bytes(info.kv_bytes);
  s->set_fp16_bytes(info.fp16_bytes);
  s->set_nominal_ratio(info.nominal_ratio);
  s->mutable_params()->insert(info.params.begin(), info.params.end());
  s->mutable_prefill_params()->insert(info.prefill_params.begin(), info.prefill_params.end());
}

void fill_heads(const std::vector<std::vector<int32_t>>& rows, int num_kv_heads,
                google::protobuf::RepeatedPtrField<v1::HeadPositions>* out) {
  for (size_t r = 0; r < rows.size(); ++r) {
    v1::HeadPositions* h = out->Add();
    h->set_layer(static_cast<int32_t>(r / num_kv_heads));
    h->set_head(static_cast<int32_t>(r % num_kv_heads));
    h->mutable_positions()->Add(rows[r].begin(), rows[r].end());
  }
}
}  // namespace

absl::Status KaraKVService::DoCompact(const v1::CompactRequest& req, v1::CompactReply* reply) {
  auto r = core_->compact(req.session_id(), req.sequence_id(), req.dry_run());
  if (!r.ok()) return r.status();
  for (const CompactionResult& c : *r) {
    v1::SequenceCompaction* s = reply->add_sequences();
    s->set_sequence_id(c.sequence_id);
    s->set_policy(c.policy);
    s->set_tokens_before(c.tokens_before);
    s->set_tokens_after(c.tokens_after);
    s->set_skipped(c.skipped);
    s->mutable_params()->insert(c.params.begin(), c.params.end());
    fill_heads(c.kept, core_->geometry().num_kv_heads, s->mutable_kept());
  }
  return absl::OkStatus();
}

absl::Status KaraKVService::DoInspect(const v1::InspectRequest& req, v1::InspectReply* reply) {
  auto r = core_->inspect(req.sequence_id());
  if (!r.ok()) return r.status();
  fill_info(operator_view(r->first), reply->mutable_info());
  fill_heads(r->second, core_->geometry().num_kv_heads, reply->mutable_heads());
  return absl::OkStatus();
}

// Bytes of the [rows][Hq][D] fp32 output of a Step or Attend. An inline output is allocated at
// that size, so it is sized only when q (the same shape, already received) agrees with `rows`:
// otherwise a request of a few bytes claiming 2^32 queries would have the daemon allocate half a
// terabyte. A disagreeing q gets an empty output and the registry refuses q with its own message.
size_t KaraKVService::output_bytes(const v1::OutputRef& out, const Input& q, size_t rows) const {
  const size_t want = core_->q_bytes(rows);
  return out.has_staging() || q.bytes.size() == want ? want : 0;
}

absl::Status KaraKVService::Handle(const v1::StepRequest& req, v1::StepReply* reply) {
  Input k, v, q;
  absl::StatusOr<MutableBytes> out = MutableBytes();
  // An empty batch first: the output is sized by it.
  absl::Status resolution = check_batch(req.sequence_ids_size());
  auto staging = staging_for(core_, req.session_id(), req.staging_generation(), req.k(), req.v(), req.q(), req.out());
  if (resolution.ok()) resolution = staging.status();
  if (resolution.ok()) resolution = resolve_input(req.k(), staging->get(), "k", &k);
  if (resolution.ok()) resolution = resolve_input(req.v(), staging->get(), "v", &v);
  if (resolution.ok()) resolution = resolve_input(req.q(), staging->get(), "q", &q);
  if (resolution.ok()) {
    out = resolve_output(req.out(), staging->get(), output_bytes(req.out(), q, req.sequence_ids_size()), true, "out",
                         reply->mutable_out());
    resolution = out.status();
  }
  StepCall call;
  call.session_id = req.session_id();
  call.layer = req.layer();
  call.sequence_ids = absl::MakeConstSpan(req.sequence_ids().data(), req.sequence_ids_size());
  call.k = k.bytes;
  call.v = v.bytes;
  call.q = q.bytes;
  if (out.ok()) call.out = *out;
  call.scale = req.scale();
  auto r = in_stream_order(resolution.ok() ? staging->get() : nullptr, [&](bool ordered) {
    call.stream_ordered = ordered;
    return gate_.step(call, resolution);
  });
  if (!r.ok()) {
    reply->clear_out();
    return r.status();
  }
  reply->set_decode_step(r->decode_step);
  reply->set_compactions(r->compactions);
  return absl::OkStatus();
}

absl::Status KaraKVService::Handle(const v1::AttendRequest& req, v1::AttendReply* reply) {
  Input q;
  absl::StatusOr<MutableBytes> out = MutableBytes();
  auto staging = staging_for(core_, req.session_id(), req.staging_generation(), req.q(), req.out());
  absl::Status resolution = staging.status();
  if (resolution.ok()) resolution = resolve_input(req.q(), staging->get(), "q", &q);
  if (resolution.ok()) {
    out = resolve_output(req.out(), staging->get(), output_bytes(req.out(), q, req.num_queries()), true, "out",
                         reply->mutable_out());
    resolution = out.status();
  }
  AttendCall call;
  call.session_id = req.session_id();
  call.sequence_id = req.sequence_id();
  call.layer = req.layer();
  call.num_queries = req.num_queries();
  call.q = q.bytes;
  if (out.ok()) call.out = *out;
  call.scale = req.scale();
  absl::Status s = in_stream_order(resolution.ok() ? staging->get() : nullptr, [&](bool ordered) {
    call.stream_ordered = ordered;
    return gate_.attend(call, resolution);
  });
  if (!s.ok()) reply->clear_out();
  return s;
}

absl::Status KaraKVService::DoReadKV(const v1::ReadKVRequest& req, v1::ReadKVReply* reply) {
  auto staging = staging_for(core_, req.session_id(), req.staging_generation(), req.k(), req.v(), req.positions());
  if (!staging.ok()) return staging.status();
  auto targets = [&](int32_t tokens) -> absl::StatusOr<ReadKVTargets> {
    ReadKVTargets t;
    const size_t kv_bytes = core_->append_bytes(tokens);
    auto k = resolve_output(req.k(), staging->get(), kv_bytes, false, "k", reply->mutable_k());
    if (!k.ok()) return k.status();
    auto v = resolve_output(req.v(), staging->get(), kv_bytes, false, "v", reply->mutable_v());
    if (!v.ok()) return v.status();
    const size_t rows = size_t(core_->geometry().num_layers) * core_->geometry().num_kv_heads;
    auto p = resolve_output(req.positions(), staging->get(), rows * tokens * 4, false, "positions",
                            reply->mutable_positions());
    if (!p.ok()) return p.status();
    t.k = *k;
    t.v = *v;
    t.positions = *p;
    return t;
  };
  auto r = in_stream_order(staging->get(), [&](bool) { return core_->read_kv(req.session_id(), req.sequence_id(), targets); });
  if (!r.ok()) {
    reply->Clear();
    return r.status();
  }
  reply->set_num_tokens(static_cast<uint32_t>(*r));
  return absl::OkStatus();
}

absl::Status KaraKVService::DoStats(const v1::StatsRequest& req, v1::StatsReply* reply) {
  const CoreStats s = core_->stats();
  const kernels::Geometry& g = core_->geometry();
  *reply->mutable_geometry() = to_proto(g);
  reply->set_backend(std::string(core_->backend_name()));
  reply->set_blocks_total(s.blocks_total);
  reply->set_blocks_used(s.blocks_used);
  reply->set_blocks_free(s.blocks_free);
  reply->set_block_bytes(g.block_bytes());
  reply->set_pool_bytes(uint64_t(s.blocks_total) * g.block_bytes());
  reply->set_resident_tokens(s.resident_tokens);
  reply->set_sequences(s.sequences);
  reply->set_sessions(s.sessions);
  reply->set_decode_steps(s.decode_steps);
  reply->set_tokens_appended(s.tokens_appended);
  reply->set_decode_tokens(s.decode_tokens);
  for (const RpcErrorCount& e : metrics_->rpc_errors()) {
    v1::RpcErrorCount* out = reply->add_rpc_errors();
    out->set_method(e.method);
    out->set_code(e.code);
    out->set_count(e.count);
  }
  reply->set_lease_expiries(s.lease_expiries);
  reply->set_preemptions(s.preemptions);
  reply->set_uptime_seconds(absl::ToDoubleSeconds(absl::Now() - started_));
  reply->set_logical_tokens(s.logical_tokens);
  reply->set_query_cache_bytes(s.query_cache_bytes);
  reply->set_score_bytes(s.score_bytes);
  for (const auto& [name, p] : s.policies) {
    v1::PolicyStats* ps = reply->add_policies();
    ps->set_policy(name);
    ps->set_sequences(p.sequences);
    ps->set_resident_tokens(p.resident_tokens);
    ps->set_logical_tokens(p.logical_tokens);
    ps->set_compactions(p.compactions);
    ps->set_tokens_removed(p.tokens_removed);
    ps->set_compaction_seconds(p.seconds);
    ps->set_compaction_failures(p.failures);
    ps->set_kv_bytes(p.kv_bytes);
    ps->set_fp16_bytes(p.fp16_bytes);
    ps->set_nominal_ratio(p.nominal_ratio);
    ps->set_actual_ratio(p.kv_bytes ? double(p.fp16_bytes) / double(p.kv_bytes) : 0.0);
  }
  reply->set_prefix_cache_enabled(core_->config().prefix_cache);
  reply->set_prefix_lookups(s.prefix_lookups);
  reply->set_prefix_lookup_tokens(s.prefix_lookup_tokens);
  reply->set_prefix_hit_tokens(s.prefix_hit_tokens);
  reply->set_prefix_cached_blocks(s.prefix_cached_blocks);
  reply->set_prefix_unused_blocks(s.prefix_unused_blocks);
  reply->set_prefix_evictions(s.prefix_evictions);
  reply->set_prefix_published_blocks(s.prefix_published_blocks);
  const HeapUsage heap = read_heap_usage();
  reply->set_heap_in_use_bytes(heap.in_use_bytes);
  reply->set_heap_held_bytes(heap.held_bytes);
  if (req.check_invariants()) {
    reply->set_invariants_checked(true);
    reply->set_invariant_error(std::string(core_->check_invariants().message()));
  }
  return absl::OkStatus();
}

absl::Status KaraKVService::Handle(const v1::AttachRequest& req, v1::AttachReply* reply) {
  return gate_.run("Attach", true, [&] { return DoAttach(req, reply); });
}

absl::Status KaraKVService::Handle(const v1::DetachRequest& req, v1::DetachReply* reply) {
  return gate_.run("Detach", true, [&]() -> absl::Status {
    auto n = core_->detach(req.session_id());
    if (!n.ok()) return n.status();
    spdlog::info("session {} detached: {} sequence(s) released", req.session_id(), *n);
    reply->set_sequences_released(static_cast<uint32_t>(*n));
    return absl::OkStatus();
  });
}

absl::Status KaraKVService::Handle(const v1::HeartbeatRequest& req, v1::HeartbeatReply* reply) {
  return gate_.run("Heartbeat", false, [&]() -> absl::Status {
    reply->set_lease_seconds(static_cast<uint32_t>(absl::ToInt64Seconds(core_->config().lease)));
    reply->set_instance_id(instance_id_);
    return core_->heartbeat(req.session_id());
  });
}

absl::Status KaraKVService::Handle(const v1::CreateSequenceRequest& req, v1::CreateSequenceReply* reply) {
  return gate_.run("CreateSequence", true, [&] { return DoCreateSequence(req, reply); });
}

absl::Status KaraKVService::Handle(const v1::ForkSequenceRequest& req, v1::ForkSequenceReply* reply) {
  return gate_.run("ForkSequence", true, [&]() -> absl::Status {
    auto id = core_->fork_sequence(req.session_id(), req.sequence_id());
    if (!id.ok()) return id.status();
    reply->set_sequence_id(*id);
    return absl::OkStatus();
  });
}

absl::Status KaraKVService::Handle(const v1::ReleaseSequenceRequest& req, v1::ReleaseSequenceReply* reply) {
  return gate_.run("ReleaseSequence", true, [&]() -> absl::Status {
    auto n = core_->release_sequence(req.session_id(), req.sequence_id());
    if (!n.ok()) return n.status();
    reply->set_blocks_freed(static_cast<uint32_t>(*n));
    return absl::OkStatus();
  });
}

absl::Status KaraKVService::Handle(const v1::AppendRequest& req, v1::AppendReply* reply) {
  return gate_.run("Append", true, [&] { return DoAppend(req.session_id(), req, reply); });
}

absl::Status KaraKVService::Handle(const v1::AppendBatchRequest& req, v1::AppendBatchReply* reply) {
  // A batch of one is a plain Append, as on the ring.
  return gate_.run(req.entries_size() == 1 ? "Append" : "AppendBatch", true, [&] { return DoAppendBatch(req, reply); });
}

absl::Status KaraKVService::Handle(const v1::ReadKVRequest& req, v1::ReadKVReply* reply) {
  return gate_.run("ReadKV", false, [&] { return DoReadKV(req, reply); });
}

absl::Status KaraKVService::Handle(const v1::StatsRequest& req, v1::StatsReply* reply) {
  return gate_.run("Stats", false, [&] { return DoStats(req, reply); });
}

absl::Status KaraKVService::Handle(const v1::ListSequencesRequest& req, v1::ListSequencesReply* reply) {
  return gate_.run("ListSequences", false, [&]() -> absl::Status {
    // A session's own listing shows its id; the operator view (no session) shows a tag instead.
    if (req.session_id().empty()) {
      for (const SequenceInfo& info : core_->list_sequences("")) fill_info(operator_view(info), reply->add_sequences());
      return absl::OkStatus();
    }
    auto own = core_->list_session_sequences(req.session_id());
    if (!own.ok()) return own.status();
    for (const SequenceInfo& info : *own) fill_info(info, reply->add_sequences());
    return absl::OkStatus();
  });
}

absl::Status KaraKVService::Handle(const v1::CompactRequest& req, v1::CompactReply* reply) {
  return gate_.run("Compact", !req.dry_run(), [&] { return DoCompact(req, reply); });
}

absl::Status KaraKVService::Handle(const v1::InspectRequest& req, v1::InspectReply* reply) {
  return gate_.run("Inspect", false, [&] { return DoInspect(req, reply); });
}

void KaraKVService::start_draining() {
  gate_.start_draining();
  events_.close_all(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                 "karakvd is draining for shutdown; the event stream ends"));
}

grpc::ServerWriteReactor<v1::Event>* KaraKVService::WatchEvents(grpc::CallbackServerContext*,
                                                                 const v1::WatchEventsRequest* req) {
  absl::Status refusal;
  if (gate_.draining()) {
    refusal = draining_status();
  } else if (absl::Status failed = gate_.device_failed("WatchEvents"); !failed.ok()) {
    refusal = failed;  // a stream opened now would never hear of it
  } else if (req->session_id().empty()) {
    refusal = absl::InvalidArgumentError("session_id is empty: WatchEvents shows one session's events; Attach first");
  } else if (!core_->has_session(req->session_id())) {
    refusal = absl::NotFoundError(absl::StrCat("unknown session '", req->session_id(),
                                               "' (never attached, detached, or its lease expired)"));
  }
  if (!refusal.ok()) metrics_->observe_rpc("WatchEvents", 0, refusal.code());
  auto* reactor = events_.open(req->session_id(), to_grpc(refusal));
  // The session may have ended between the check and the subscription: then nothing would end it.
  if (refusal.ok() && !core_->has_session(req->session_id())) {
    events_.close_session(req->session_id(), grpc::Status::OK);
  }
  return reactor;
}

absl::Status KaraKVService::Handle(const v1::LookupRequest& req, v1::LookupReply* reply) {
  return gate_.run("Lookup", false, [&]() -> absl::Status {
    auto n = core_->lookup_prefix(req.session_id(), absl::MakeConstSpan(req.token_ids().data(),
                                                                             req.token_ids_size()));
    if (!n.ok()) return n.status();
    reply->set_cached_tokens(static_cast<uint32_t>(*n));
    return absl::OkStatus();
  });
}

absl::Status KaraKVService::Handle(const v1::PingRequest&, v1::PingReply* reply) {
  return gate_.run("Ping", false, [&] {
    reply->set_instance_id(instance_id_);
    reply->set_calls_in_flight(static_cast<uint32_t>(std::max(0, gate_.in_flight())));
    return absl::OkStatus();
  });
}

// The gRPC methods: the handler above, then Finish. Step and Attend also count their path.
#define KARAKV_UNARY(Method)                                                                        \
  grpc::ServerUnaryReactor* KaraKVService::Method(grpc::CallbackServerContext* ctx,                 \
                                                  const v1::Method##Request* req, v1::Method##Reply* reply) { \
    return finish(ctx, Handle(*req, reply));                                                          \
  }
KARAKV_UNARY(Attach)
KARAKV_UNARY(Detach)
KARAKV_UNARY(Heartbeat)
KARAKV_UNARY(CreateSequence)
KARAKV_UNARY(ForkSequence)
KARAKV_UNARY(ReleaseSequence)
KARAKV_UNARY(Append)
KARAKV_UNARY(AppendBatch)
KARAKV_UNARY(ReadKV)
KARAKV_UNARY(Stats)
KARAKV_UNARY(ListSequences)
KARAKV_UNARY(Compact)
KARAKV_UNARY(Inspect)
KARAKV_UNARY(Lookup)
KARAKV_UNARY(Ping)
#undef KARAKV_UNARY

grpc::ServerUnaryReactor* KaraKVService::Step(grpc::CallbackServerContext* ctx, const v1::StepRequest* req,
                                              v1::StepReply* reply) {
  if (rings_ != nullptr) rings_->count("Step", "grpc");
  return finish(ctx, Handle(*req, reply));
}

grpc::ServerUnaryReactor* KaraKVService::Attend(grpc::CallbackServerContext* ctx, const v1::AttendRequest* req,
                                                v1::AttendReply* reply) {
  if (rings_ != nullptr) rings_->count("Attend", "grpc");
  return finish(ctx, Handle(*req, reply));
}

}  // namespace karakv::server
