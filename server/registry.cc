// Sessions, sequences and block tables. Each operation runs in two phases under the lock: validate
// everything and count the blocks it needs, then change state; only the second phase mutates.
#include "server/registry.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace karakv::server {
namespace {

using kernels::Geometry;

std::string geometry_string(const Geometry& g) {
  return absl::StrFormat("layers=%d q_heads=%d kv_heads=%d head_dim=%d dtype=%s block_size=%d",
                         g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim,
                         kernels::dtype_name(g.dtype), g.block_size);
}

absl::Status to_status(const kernels::KernelStatus& s) {
  switch (s.code) {
    case kernels::KernelStatus::Code::kOk:
      return absl::OkStatus();
    case kernels::KernelStatus::Code::kInvalidArgument:
      return absl::InvalidArgumentError(s.message);
    case kernels::KernelStatus::Code::kUnsupported:
      return absl::UnimplementedError(s.message);
    default:
      return absl::InternalError(s.message);
  }
}

// UNIMPLEMENTED naming the op when `backend` cannot run one the policy needs (CaM's merge included
// when the policy merges).
absl::Status check_backend_runs(const kernels::Backend& backend, kernels::DType dtype, const Policy& policy,
                                const char* what) {
  std::vector<kernels::Op> ops = policy.required_ops();
  if (policy.merge_tokens() > 0) ops.push_back(kernels::Op::kCamMerge);
  for (kernels::Op op : ops) {
    if (!backend.supports(op, dtype)) {
      return absl::UnimplementedError(absl::StrCat(what, " '", policy.name(), "' needs ", kernels::op_name(op),
                                                   ", which backend ", std::string(backend.name()), " does not run for ",
                                                   kernels::dtype_name(dtype), "; start karakvd with --backend=cpu"));
    }
  }
  return absl::OkStatus();
}

// `layout` is only formatted when the size is wrong: this runs on every Step.
template <typename Layout>
absl::Status check_size(const char* what, size_t got, size_t want, Layout&& layout) {
  if (got == want) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " has ", got, " bytes, expected ", want, " (", layout(), ")"));
}

bool parse_quant_format(const std::string& name, kernels::QuantFormat* out) {
  static const std::pair<const char*, kernels::QuantFormat> kFormats[] = {
      {"kivi2", kernels::QuantFormat::kKivi2}, {"kivi4", kernels::QuantFormat::kKivi4},
      {"tq2", kernels::QuantFormat::kTq2},     {"tq3", kernels::QuantFormat::kTq3},
      {"tq4", kernels::QuantFormat::kTq4}};
  for (const auto& [n, f] : kFormats) {
    if (name == n) {
      *out = f;
      return true;
    }
  }
  return false;
}

float default_scale(float scale, int head_dim) {
  return scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

std::string new_session_id() {
  std::random_device rd;  // session ids double as capabilities: never sequential
  return absl::StrFormat("s-%08x%08x%08x", rd(), rd(), rd());
}

}  // namespace

absl::Status validate_geometry(const Geometry& g) {
  auto bad = [](const char* field, int v, const char* want) {
    return absl::InvalidArgumentError(absl::StrCat("geometry ", field, "=", v, " invalid: ", want));
  };
  if (g.num_layers < 1 || g.num_layers > 1024) return bad("num_layers", g.num_layers, "expected 1..1024");
  if (g.num_kv_heads < 1 || g.num_kv_heads > 1024) return bad("num_kv_heads", g.num_kv_heads, "expected 1..1024");
  if (g.num_q_heads < g.num_kv_heads || g.num_q_heads % g.num_kv_heads != 0) {
    return bad("num_q_heads", g.num_q_heads, "expected a multiple of num_kv_heads");
  }
  if (g.head_dim < 1 || g.head_dim > 1024) return bad("head_dim", g.head_dim, "expected 1..1024");
  if (g.block_size < 1 || g.block_size > 4096) return bad("block_size", g.block_size, "expected 1..4096");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Registry>> Registry::create(const RegistryConfig& config,
                                                           std::unique_ptr<kernels::Backend> backend) {
  if (absl::Status s = validate_geometry(config.geometry); !s.ok()) return s;
  const size_t block_bytes = config.geometry.block_bytes();
  const int64_t num_blocks = config.pool_bytes / static_cast<int64_t>(block_bytes);
  if (num_blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("pool of ", config.pool_bytes,
                                                   " bytes holds no block of ", block_bytes, " bytes"));
  }
  if (num_blocks > INT32_MAX) return absl::InvalidArgumentError("pool holds more than 2^31 blocks");
  for (kernels::Op op : {kernels::Op::kWriteKV, kernels::Op::kDecodeAttention,
                         kernels::Op::kCausalAttention, kernels::Op::kReadKV, kernels::Op::kCopyBlock}) {
    if (!backend->supports(op, config.geometry.dtype)) {
      return absl::UnimplementedError(absl::StrCat("backend ", std::string(backend->name()), " cannot run ",
                                                   kernels::op_name(op), " for dtype ",
                                                   kernels::dtype_name(config.geometry.dtype)));
    }
  }
  void* memory = nullptr;
  const size_t pool_bytes = static_cast<size_t>(num_blocks) * block_bytes;
  if (auto s = backend->allocate(pool_bytes, &memory); !s.is_ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate a ", pool_bytes, "-byte pool on ", std::string(backend->name()), ": ", s.message));
  }
  return std::unique_ptr<Registry>(
      new Registry(config, std::move(backend), memory, static_cast<int32_t>(num_blocks)));
}

Registry::Registry(const RegistryConfig& config, std::unique_ptr<kernels::Backend> backend,
                   void* pool_memory, int32_t num_blocks)
    : config_(config), backend_(std::move(backend)), pool_memory_(pool_memory), pool_(num_blocks) {}

Registry::~Registry() {
  {
    absl::MutexLock lock(&mu_);
    sessions_.clear();
    sequences_.clear();
  }
  backend_->free(pool_memory_);
}

size_t Registry::append_bytes(int32_t num_tokens) const {
  const Geometry& g = config_.geometry;
  return size_t(g.num_layers) * num_tokens * g.kv_token_elems() * kernels::dtype_size(g.dtype);
}
size_t Registry::step_kv_bytes(size_t batch) const {
  const Geometry& g = config_.geometry;
  return batch * g.kv_token_elems() * kernels::dtype_size(g.dtype);
}
size_t Registry::q_bytes(size_t rows) const { return rows * config_.geometry.q_token_elems() * 4; }

// ---- sessions ----

absl::StatusOr<AttachResult> Registry::attach(const std::string& worker_id, const std::string& tenant,
                                              uint64_t staging_bytes, const Geometry& wg,
                                              const std::string& cache_namespace,
                                              uint64_t reserved_bytes) {
  const Geometry& g = config_.geometry;
  if (!cache_namespace.empty() && !config_.prefix_cache_shared_namespaces) {
    return absl::PermissionDeniedError(absl::StrCat(
        "cache_namespace '", cache_namespace, "' asked for, but this daemon keeps each tenant's cached prompts "
        "private; leave cache_namespace empty, or start karakvd with --prefix_cache_shared_namespaces"));
  }
  if (wg.num_layers != 0 &&
      (wg.num_layers != g.num_layers || wg.num_q_heads != g.num_q_heads ||
       wg.num_kv_heads != g.num_kv_heads || wg.head_dim != g.head_dim || wg.dtype != g.dtype ||
       (wg.block_size != 0 && wg.block_size != g.block_size))) {
    return absl::InvalidArgumentError(absl::StrCat("worker geometry (", geometry_string(wg),
                                                   ") differs from the daemon's (",
                                                   geometry_string(g), ")"));
  }
  if (staging_bytes > config_.max_staging_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("staging_bytes ", staging_bytes,
                                                   " exceeds the daemon's limit of ",
                                                   config_.max_staging_bytes,
                                                   " (karakvd --max_staging_bytes); ask for less"));
  }
  std::shared_ptr<StagingRegion> staging;
  if (staging_bytes > 0) {
    auto region = StagingRegion::create(staging_bytes, reserved_bytes);
    if (!region.ok()) return region.status();
    staging = std::move(*region);
  }
  AttachResult result;
  result.session_id = new_session_id();
  // Distinct prefixes: a named namespace can never be a tenant's private one.
  result.cache_namespace = cache_namespace.empty() ? absl::StrCat("tenant:", tenant)
                                                   : absl::StrCat("shared:", cache_namespace);
  if (staging) {
    result.staging_name = staging->name();
    result.staging_bytes = staging->size();
  }
  absl::MutexLock lock(&mu_);
  if (config_.max_sessions > 0 && static_cast<int64_t>(sessions_.size()) >= config_.max_sessions) {
    // The staging region made above unmaps and unlinks as `staging` goes out of scope.
    return absl::ResourceExhaustedError(absl::StrCat(
        "session limit reached: ", sessions_.size(), " sessions attached, limit ", config_.max_sessions,
        ", wanted 1 more (karakvd --max_sessions); detach a session or raise the limit"));
  }
  Session& s = sessions_[result.session_id];
  s.id = result.session_id;
  s.worker_id = worker_id;
  s.tenant = tenant;
  s.cache_namespace = result.cache_namespace;
  s.staging = std::move(staging);
  s.lease_deadline = absl::Now() + config_.lease;
  return result;
}

namespace {
absl::Status unknown_session(const std::string& session_id) {
  return absl::NotFoundError(
      absl::StrCat("unknown session '", session_id, "' (never attached, detached, or its lease expired)"));
}
}  // namespace

absl::StatusOr<Registry::Session*> Registry::find_session(const std::string& session_id) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return unknown_session(session_id);
  return &it->second;
}

absl::StatusOr<Registry::Sequence*> Registry::find_sequence(const Session& session,
                                                            uint64_t sequence_id) {
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) {
    if (auto t = preempted_.find(sequence_id); t != preempted_.end()) {
      if (t->second.tenant != session.tenant) {
        return absl::PermissionDeniedError(absl::StrCat("sequence ", sequence_id, " belongs to another tenant"));
      }
      return absl::FailedPreconditionError(t->second.reason);
    }
    return absl::NotFoundError(absl::StrCat("unknown sequence ", sequence_id));
  }
  if (it->second.tenant != session.tenant) {
    return absl::PermissionDeniedError(
        absl::StrCat("sequence ", sequence_id, " belongs to another tenant"));
  }
  return &it->second;
}

absl::Status Registry::check_sequence_limit(const Session& session) const {
  if (config_.max_sequences_per_session > 0 &&
      static_cast<int64_t>(session.sequences.size()) >= config_.max_sequences_per_session) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequence limit reached: session ", session.id, " holds ", session.sequences.size(),
        " sequences, limit ", config_.max_sequences_per_session,
        ", wanted 1 more (karakvd --max_sequences_per_session); release a sequence or raise the limit"));
  }
  return absl::OkStatus();
}

int64_t Registry::tenant_blocks(const std::string& tenant) const {
  int64_t n = 0;
  for (const auto& [id, seq] : sequences_) {
    if (seq.tenant == tenant) n += static_cast<int64_t>(seq.blocks.size() + seq.qblocks.size());
  }
  return n;
}

absl::Status Registry::check_tenant_quota(const std::string& tenant, int64_t wanted) const {
  if (config_.tenant_block_quota <= 0 || wanted <= 0) return absl::OkStatus();
  const int64_t held = tenant_blocks(tenant);
  if (held + wanted > config_.tenant_block_quota) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant ", tenant, " holds ", held, " blocks, quota ", config_.tenant_block_quota, ", wanted ", wanted,
        " (karakvd --tenant_block_quota); release or compact sequences of this tenant, or raise the quota"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> Registry::detach(const std::string& session_id) {
  absl::MutexLock lock(&mu_);
  auto session = find_session(session_id);
  if (!session.ok()) return session.status();
  const int n = static_cast<int>((*session)->sequences.size());
  end_session_locked(session_id, false);
  trim_prefix_cache();
  return n;
}

absl::Status Registry::heartbeat(const std::string& session_id) {
  absl::MutexLock lock(&mu_);
  auto session = find_session(session_id);
  if (!session.ok()) return session.status();
  (*session)->lease_deadline = absl::Now() + config_.lease;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<StagingRegion>> Registry::staging(const std::string& session_id) {
  absl::MutexLock lock(&mu_);
  auto session = find_session(session_id);
  if (!session.ok()) return session.status();
  return (*session)->staging;
}

int Registry::expire_leases(absl::Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> expired;
  for (const auto& [id, s] : sessions_) {
    if (s.lease_deadline < now) expired.push_back(id);
  }
  for (const auto& id : expired) end_session_locked(id, true);
  lease_expiries_ += expired.size();
  if (!expired.empty()) trim_prefix_cache();
  return static_cast<int>(expired.size());
}

void Registry::end_session_locked(const std::string& session_id, bool lease_expired) {
  auto it = sessions_.find(session_id);
  for (uint64_t id : it->second.sequences) {
    auto seq = sequences_.find(id);
    release_locked(seq->second);
    sequences_.erase(seq);
  }
  for (uint64_t id : it->second.preempted) preempted_.erase(id);
  RegistryEvent e;
  e.kind = RegistryEvent::Kind::kSessionEnded;
  e.session_id = session_id;
  e.sequences_released = static_cast<int32_t>(it->second.sequences.size());
  e.lease_expired = lease_expired;
  e.message = lease_expired
                  ? absl::StrCat("lease expired: no Heartbeat for ", absl::FormatDuration(config_.lease),
                                 "; the session's ", e.sequences_released, " sequences and staging were freed")
                  : absl::StrCat("detached; the session's ", e.sequences_released, " sequences were freed");
  sessions_.erase(it);  // drops our reference to the staging region; it unmaps when unused
  emit(e);
}

absl::Status Registry::make_room_for(int32_t need, int32_t priority, absl::Span<Sequence* const> served,
                                     const std::string& what) {
  if (make_room(need)) return absl::OkStatus();
  const int32_t free_before = pool_.free_count();
  auto refusal = [&](const std::string& extra) {
    return absl::ResourceExhaustedError(absl::StrCat("KV pool full: ", what, " wanted ", need, " blocks, ",
                                                     free_before, " free of ", pool_.total(), extra));
  };
  if (!config_.preempt_on_pressure) return refusal("");
  // Candidates: every other sequence of lower priority, lowest first, least recently used among equals.
  absl::flat_hash_set<const Sequence*> keep(served.begin(), served.end());
  std::vector<Sequence*> candidates;
  for (auto& [id, seq] : sequences_) {
    if (seq.priority < priority && !keep.contains(&seq)) candidates.push_back(&seq);
  }
  std::sort(candidates.begin(), candidates.end(), [](const Sequence* a, const Sequence* b) {
    return std::tie(a->priority, a->last_used, a->id) < std::tie(b->priority, b->last_used, b->id);
  });
  // Count what releasing each in turn would give back: a block whose last holder goes, or a cached
  // prompt block left held by the cache alone (then evictable).
  absl::flat_hash_set<int32_t> cached;
  for (const auto& [key, e] : prefix_cache_.entries()) cached.insert(e.block);
  absl::flat_hash_map<int32_t, int32_t> dropped;
  int32_t available = pool_.free_count() + unused_cached_blocks();
  size_t victims = 0;
  while (available < need && victims < candidates.size()) {
    const Sequence* v = candidates[victims++];
    for (const std::vector<int32_t>* table : {&v->blocks, &v->qblocks}) {
      for (int32_t b : *table) {
        const int32_t left = pool_.refcount(b) - ++dropped[b];
        if (left == (cached.contains(b) ? 1 : 0)) ++available;
      }
    }
  }
  if (available < need) {
    return refusal(absl::StrCat("; preempting every sequence of lower priority than ", priority, " (",
                                candidates.size(), ") would make only ", available,
                                " available (karakvd --preempt_on_pressure)"));
  }
  for (size_t i = 0; i < victims; ++i) {
    Sequence& v = *candidates[i];
    RegistryEvent e;
    e.kind = RegistryEvent::Kind::kPreempted;
    e.session_id = v.session_id;
    e.sequence_id = v.id;
    e.priority = v.priority;
    e.tokens = v.length;
    e.message = absl::StrCat(
        "sequence ", v.id, " (priority ", v.priority, ") was preempted to free blocks for a higher-priority request: ",
        what, " (priority ", priority, ") wanted ", need, " blocks, ", free_before, " free of ", pool_.total(),
        "; lower priority numbers go first, the least recently used among equals (karakvd --preempt_on_pressure). "
        "Its K/V is gone: release it and re-prefill");
    e.blocks_freed = release_locked(v);
    auto owner = sessions_.find(v.session_id);
    if (owner != sessions_.end()) {
      owner->second.sequences.erase(v.id);
      owner->second.preempted.insert(v.id);
    }
    preempted_[v.id] = Tombstone{v.session_id, v.tenant, e.message};
    const uint64_t id = v.id;
    sequences_.erase(id);
    ++preemptions_;
    emit(e);
  }
  if (!make_room(need)) return absl::InternalError("preemption freed fewer blocks than it counted");
  return absl::OkStatus();
}

// ---- sequences ----

absl::StatusOr<uint64_t> Registry::create_sequence(const std::string& session_id,
                                                   const SequenceOptions& options) {
  auto r = create_sequence_from_prefix(session_id, options);
  if (!r.ok()) return r.status();
  return r->first;
}

absl::StatusOr<std::pair<uint64_t, int32_t>> Registry::create_sequence_from_prefix(
    const std::string& session_id, const SequenceOptions& options) {
  std::string name = options.policy.empty() ? "none" : options.policy;
  std::string storage = options.storage;
  if (const size_t plus = name.find('+'); plus != std::string::npos) {
    if (!storage.empty() && storage != name.substr(plus + 1)) {
      return absl::InvalidArgumentError(absl::StrCat("policy '", name, "' names storage '", name.substr(plus + 1),
                                                     "' but storage is '", storage, "'"));
    }
    storage = name.substr(plus + 1);
    name = name.substr(0, plus);
    if (name.empty()) name = "none";
  }
  std::map<std::string, double> policy_params = options.params;
  int32_t residual = 128;
  if (auto it = policy_params.find("residual"); it != policy_params.end() && !storage.empty()) {
    if (it->second < 0 || it->second > (1 << 20) || it->second != std::floor(it->second)) {
      return absl::InvalidArgumentError(absl::StrCat("parameter residual=", it->second,
                                                     " out of range: expected an integer in [0, 1048576]"));
    }
    residual = static_cast<int32_t>(it->second);
    policy_params.erase(it);
  }
  auto policy = make_policy(name, policy_params, config_.geometry);
  if (!policy.ok()) return policy.status();
  if (absl::Status s = check_backend_runs(*backend_, config_.geometry.dtype, **policy, "policy"); !s.ok()) return s;
  kernels::QuantFormat format = kernels::QuantFormat::kKivi4;
  int32_t tokens_per_qblock = 0;
  if (!storage.empty() && storage != "fp16" && storage != kernels::dtype_name(config_.geometry.dtype)) {
    if (!parse_quant_format(storage, &format)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown storage '", storage,
                                                     "'; expected kivi2, kivi4, tq2, tq3 or tq4 (or none)"));
    }
    for (kernels::Op op : {kernels::Op::kQuantize, kernels::Op::kDequantize, kernels::Op::kQuantizedAttention}) {
      if (!backend_->supports(op, config_.geometry.dtype)) {
        return absl::UnimplementedError(absl::StrCat(
            "storage '", storage, "' needs ", kernels::op_name(op), ", which backend ", std::string(backend_->name()),
            " does not run (quantized storage is CPU-only so far); start karakvd with --backend=cpu for it"));
      }
    }
    tokens_per_qblock = backend_->quantized_tokens_per_block(config_.geometry, format);
    if (tokens_per_qblock == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "storage '", storage, "' cannot hold head_dim ", config_.geometry.head_dim, " on backend ",
          std::string(backend_->name()), " (KIVI needs a multiple of 32, TurboQuant a power of two)"));
    }
  }
  std::shared_ptr<const Policy> prefill;
  if (!options.prefill_policy.empty() && options.prefill_policy != "none") {
    auto p = make_policy(options.prefill_policy, options.prefill_params, config_.geometry);
    if (!p.ok()) return absl::InvalidArgumentError(absl::StrCat("prefill_policy: ", p.status().message()));
    if (absl::Status s = check_backend_runs(*backend_, config_.geometry.dtype, **p, "prefill_policy"); !s.ok()) return s;
    if ((*p)->trigger() != Trigger::kThreshold) {
      return absl::InvalidArgumentError(absl::StrCat("prefill_policy '", options.prefill_policy,
                                                     "' is not a one-shot policy; expected snapkv, chunkkv, "
                                                     "streaming or h2o-style threshold policies"));
    }
    if ((*p)->needs_attention()) {
      return absl::InvalidArgumentError(absl::StrCat("prefill_policy '", options.prefill_policy,
                                                     "' needs decode-time attention, which a prompt does not have"));
    }
    prefill = std::move(*p);
  } else if (!options.prefill_params.empty()) {
    return absl::InvalidArgumentError("prefill_params given without a prefill_policy");
  }
  absl::MutexLock lock(&mu_);
  auto session = find_session(session_id);
  if (!session.ok()) return session.status();
  if (absl::Status s = check_sequence_limit(**session); !s.ok()) return s;
  std::vector<PrefixCache::Hit> hits;
  if (config_.prefix_cache && !options.prefix_token_ids.empty()) {
    hits = prefix_cache_.match(options.prefix_token_ids, config_.geometry, (*session)->cache_namespace);
    if (absl::Status s = check_tenant_quota((*session)->tenant, static_cast<int64_t>(hits.size())); !s.ok()) {
      return s;
    }
  }
  const uint64_t id = next_sequence_id_++;
  Sequence& seq = sequences_[id];
  seq.id = id;
  seq.session_id = session_id;
  seq.tenant = (*session)->tenant;
  seq.policy = std::move(*policy);
  seq.prefill = std::move(prefill);
  seq.prefill_name = seq.prefill ? options.prefill_policy : "";
  seq.priority = options.priority;
  if (tokens_per_qblock > 0) {
    seq.quantize = true;
    seq.format = format;
    seq.storage = storage;
    seq.tokens_per_qblock = tokens_per_qblock;
    seq.residual = residual;
    seq.qseed = 0x6b617261ull ^ id;  // fixed per sequence: reproducible rotations
  }
  if (seq.policy->needs_attention()) seq.attention.resize(size_t(config_.geometry.num_layers) * config_.geometry.num_kv_heads);
  (*session)->sequences.insert(id);
  seq.cache_namespace = (*session)->cache_namespace;
  // A prompt the prefill policy will compress is not what another sequence's prompt would be.
  seq.publish = config_.prefix_cache && !seq.prefill;
  int32_t cached = 0;
  if (!options.prefix_token_ids.empty()) {
    ++prefix_lookups_;
    prefix_lookup_tokens_ += options.prefix_token_ids.size();
  }
  if (config_.prefix_cache && !options.prefix_token_ids.empty()) {
    prefix_cache_.touch(hits);
    cached = static_cast<int32_t>(hits.size()) * config_.geometry.block_size;
    prefix_hit_tokens_ += cached;
    for (const PrefixCache::Hit& h : hits) {
      pool_.add_ref(h.block);  // shared like a fork's: the first write past them copies nothing
      seq.blocks.push_back(h.block);
      seq.prompt_keys.push_back(h.key);
    }
    seq.prompt_ids.assign(options.prefix_token_ids.begin(), options.prefix_token_ids.begin() + cached);
    seq.length = seq.logical = cached;
    for (auto& row : seq.attention) row.resize(seq.length, 0.0f);
  }
  return std::make_pair(id, cached);
}

absl::StatusOr<int32_t> Registry::lookup_prefix(const std::string& session_id, absl::Span<const int32_t> token_ids) {
  absl::MutexLock lock(&mu_);
  auto session = find_session(session_id);
  if (!session.ok()) return session.status();
  ++prefix_lookups_;
  prefix_lookup_tokens_ += token_ids.size();
  if (!config_.prefix_cache) return 0;
  const int32_t hit = static_cast<int32_t>(
      prefix_cache_.match(token_ids, config_.geometry, (*session)->cache_namespace).size() * config_.geometry.block_size);
  prefix_hit_tokens_ += hit;
  return hit;
}

void Registry::publish_prompt(Sequence& seq) {
  if (!seq.publish) return;
  if (seq.compactions > 0 || seq.length != seq.logical) {
    seq.publish = false;  // the resident prompt is no longer the appended one
    return;
  }
  const Geometry& g = config_.geometry;
  const size_t b = size_t(g.block_size);
  bool published = false;
  while ((seq.prompt_keys.size() + 1) * b <= seq.prompt_ids.size()) {
    const size_t i = seq.prompt_keys.size();
    const PrefixKey parent = i == 0 ? PrefixKey{} : seq.prompt_keys[i - 1];
    const absl::Span<const int32_t> tokens(seq.prompt_ids.data() + i * b, b);
    const PrefixKey key = prefix_block_key(parent, tokens, g, seq.cache_namespace);
    seq.prompt_keys.push_back(key);
    const int32_t slot = static_cast<int32_t>(i * b);
    if (slot < seq.quantized()) continue;  // its full-precision block is gone
    const int32_t block = seq.blocks[size_t(slot - seq.quantized()) / b];
    PrefixCache::Entry e;
    e.parent = parent;
    e.cache_namespace = seq.cache_namespace;
    e.tokens.assign(tokens.begin(), tokens.end());
    e.block = block;
    if (prefix_cache_.insert(key, std::move(e))) {
      pool_.add_ref(block);
      ++prefix_published_;
      published = true;
    }
  }
  // The chain's earlier blocks become newer than its new end: eviction takes chains from the end.
  if (published) prefix_cache_.touch(seq.prompt_keys);
}

int32_t Registry::unused_cached_blocks() const {
  int32_t n = 0;
  for (const auto& [key, e] : prefix_cache_.entries()) n += pool_.refcount(e.block) == 1 ? 1 : 0;
  return n;
}

int32_t Registry::evict_unused_cached(int32_t count) {
  int32_t evicted = 0;
  for (const PrefixKey& key : prefix_cache_.lru_order()) {
    if (evicted >= count) break;
    const int32_t block = prefix_cache_.entries().at(key).block;
    if (pool_.refcount(block) != 1) continue;  // a sequence still reads it
    prefix_cache_.erase(key);
    pool_.release(block);  // the cache held the only reference: one block freed
    ++prefix_evictions_;
    ++evicted;
  }
  return evicted;
}

bool Registry::make_room(int32_t need) {
  if (pool_.free_count() >= need) return true;
  if (prefix_cache_.size() == 0 || pool_.free_count() + unused_cached_blocks() < need) return false;
  evict_unused_cached(need - pool_.free_count());
  return pool_.free_count() >= need;
}

void Registry::trim_prefix_cache() {
  if (config_.prefix_cache_max_fraction >= 1.0 || prefix_cache_.size() == 0) return;
  const int32_t limit = static_cast<int32_t>(config_.prefix_cache_max_fraction * pool_.total());
  const int32_t unused = unused_cached_blocks();
  if (unused > limit) evict_unused_cached(unused - limit);
}

absl::StatusOr<uint64_t> Registry::fork_sequence(const std::string& session_id, uint64_t parent_id) {
  absl::MutexLock lock(&mu_);
  auto session = find_session(session_id);
  if (!session.ok()) return session.status();
  auto parent = find_sequence(**session, parent_id);
  if (!parent.ok()) return parent.status();
  if ((*parent)->pending_layer >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", parent_id, " is in the middle of a step (expects layer ",
        (*parent)->pending_layer, "); finish the step before forking"));
  }
  if (absl::Status s = check_sequence_limit(**session); !s.ok()) return s;
  if (absl::Status s = check_tenant_quota(
          (*session)->tenant, static_cast<int64_t>((*parent)->blocks.size() + (*parent)->qblocks.size()));
      !s.ok()) {
    return s;
  }
  const uint64_t id = next_sequence_id_++;
  Sequence child = **parent;  // copies the table; the blocks are now shared
  child.id = id;
  child.session_id = session_id;
  child.first_append.reset();  // the parent's TTFT is the parent's
  for (int32_t b : child.blocks) pool_.add_ref(b);
  for (int32_t b : child.qblocks) pool_.add_ref(b);
  sequences_[id] = std::move(child);
  (*session)->sequences.insert(id);
  return id;
}

absl::StatusOr<int> Registry::release_sequence(const std::string& session_id, uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  auto session = find_session(session_id);
  if (!session.ok()) return session.status();
  if (auto t = preempted_.find(sequence_id); t != preempted_.end() && t->second.tenant == (*session)->tenant) {
    // The owner acknowledges the preemption: its blocks went back to the pool then.
    if (auto owner = sessions_.find(t->second.session_id); owner != sessions_.end()) {
      owner->second.preempted.erase(sequence_id);
    }
    preempted_.erase(t);
    return 0;
  }
  auto seq = find_sequence(**session, sequence_id);
  if (!seq.ok()) return seq.status();
  const int freed = release_locked(**seq);
  auto owner = sessions_.find((*seq)->session_id);
  if (owner != sessions_.end()) owner->second.sequences.erase(sequence_id);
  sequences_.erase(sequence_id);
  trim_prefix_cache();
  return freed;
}

int Registry::release_locked(Sequence& seq) {
  int freed = 0;
  for (int32_t b : seq.blocks) freed += pool_.release(b) ? 1 : 0;
  for (int32_t b : seq.qblocks) freed += pool_.release(b) ? 1 : 0;
  seq.blocks.clear();
  seq.qblocks.clear();
  return freed;
}

int32_t Registry::blocks_needed(const Sequence& seq, int32_t new_length) const {
  const int32_t b = config_.geometry.block_size;
  const int32_t have = static_cast<int32_t>(seq.blocks.size());
  const int32_t fp_new = new_length - seq.quantized();  // the block table covers unquantized slots
  const int32_t want = (fp_new + b - 1) / b;
  int32_t n = want > have ? want - have : 0;
  // Writing into a partly filled block that a fork shares needs a private copy first.
  const int32_t first = seq.fp_length() / b;
  if (new_length > seq.length && first < have && pool_.refcount(seq.blocks[first]) > 1) ++n;
  return n;
}

absl::Status Registry::reserve(Sequence& seq, int32_t new_length) {
  const int32_t b = config_.geometry.block_size;
  const int32_t have = static_cast<int32_t>(seq.blocks.size());
  const int32_t first = seq.fp_length() / b;
  if (new_length > seq.length && first < have && pool_.refcount(seq.blocks[first]) > 1) {
    std::vector<int32_t> fresh;
    if (absl::Status s = pool_.allocate(1, &fresh); !s.ok()) return s;
    kernels::PagedKV kv;
    kv.pool = pool_memory_;
    kv.geometry = config_.geometry;
    if (auto s = backend_->copy_block(kv, seq.blocks[first], fresh[0]); !s.is_ok()) {
      pool_.release(fresh[0]);
      return to_status(s);
    }
    pool_.release(seq.blocks[first]);
    seq.blocks[first] = fresh[0];
  }
  const int32_t want = (new_length - seq.quantized() + b - 1) / b;
  if (want > have) {
    if (absl::Status s = pool_.allocate(want - static_cast<int32_t>(seq.blocks.size()), &seq.blocks);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

kernels::PagedKV Registry::paged_view(const std::vector<const Sequence*>& seqs,
                                      const std::vector<int32_t>& lengths,
                                      std::vector<int32_t>* table,
                                      std::vector<int32_t>* offsets) const {
  offsets->assign(1, 0);
  table->clear();
  for (const Sequence* s : seqs) {
    table->insert(table->end(), s->blocks.begin(), s->blocks.end());
    offsets->push_back(static_cast<int32_t>(table->size()));
  }
  kernels::PagedKV kv;
  kv.pool = pool_memory_;
  kv.geometry = config_.geometry;
  kv.block_table = table->data();
  kv.table_offset = offsets->data();
  kv.seq_len = lengths.data();
  kv.num_seqs = static_cast<int>(seqs.size());
  return kv;
}

absl::StatusOr<int32_t> Registry::append(const std::string& session_id, uint64_t sequence_id,
                                         int32_t num_tokens, ConstBytes k, ConstBytes v, ConstBytes q,
                                         int32_t num_query_tokens, absl::Span<const int32_t> token_ids) {
  const auto received = std::chrono::steady_clock::now();
  const Geometry& g = config_.geometry;
  if (num_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_tokens is ", num_tokens, ", expected >= 1"));
  }
  if (!token_ids.empty() && token_ids.size() != size_t(num_tokens)) {
    return absl::InvalidArgumentError(absl::StrCat("token_ids has ", token_ids.size(), " entries, expected ",
                                                   "num_tokens = ", num_tokens, " (or none)"));
  }
  auto layout = [&] {
    return absl::StrFormat("[L=%d][T=%d][Hk=%d][D=%d] %s", g.num_layers, num_tokens, g.num_kv_heads,
                           g.head_dim, kernels::dtype_name(g.dtype));
  };
  if (auto s = check_size("k", k.size(), append_bytes(num_tokens), layout); !s.ok()) return s;
  if (auto s = check_size("v", v.size(), append_bytes(num_tokens), layout); !s.ok()) return s;
  if (num_query_tokens < 0 || num_query_tokens > num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("num_query_tokens is ", num_query_tokens,
                                                   ", expected 0..num_tokens (", num_tokens, ")"));
  }
  if (auto s = check_size("q", q.size(), size_t(g.num_layers) * q_bytes(num_query_tokens),
                          [&] {
                            return absl::StrFormat("[L=%d][Nq=%d][Hq=%d][D=%d] fp32", g.num_layers,
                                                   num_query_tokens, g.num_q_heads, g.head_dim);
                          });
      !s.ok()) {
    return s;
  }

  absl::MutexLock lock(&mu_);
  auto session = find_session(session_id);
  if (!session.ok()) return session.status();
  auto found = find_sequence(**session, sequence_id);
  if (!found.ok()) return found.status();
  Sequence& seq = **found;
  if (seq.pending_layer >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", sequence_id, " is in the middle of a step (expects layer ", seq.pending_layer,
        "); finish the step or restart it at layer 0 before appending"));
  }
  if (seq.decoding && seq.policy->query_window() < 0 && num_query_tokens != num_tokens) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", sequence_id, " uses '", seq.policy->name(),
        "', which scores generated tokens by their queries: after decoding started, Append must carry "
        "q for every token (num_query_tokens = num_tokens = ", num_tokens, ")"));
  }
  if (int64_t(seq.logical) + num_tokens > INT32_MAX / 2) {
    return absl::InvalidArgumentError("sequence would exceed 2^30 tokens");
  }
  const int32_t new_length = seq.length + num_tokens;
  const int32_t need = blocks_needed(seq, new_length);
  if (absl::Status s = check_tenant_quota(seq.tenant, need); !s.ok()) return s;
  Sequence* served = &seq;
  if (absl::Status s = make_room_for(need, seq.priority, absl::MakeSpan(&served, 1),
                                     absl::StrCat("appending ", num_tokens, " tokens to sequence ", sequence_id));
      !s.ok()) {
    return s;
  }
  seq.last_used = ++use_clock_;
  if (absl::Status s = reserve(seq, new_length); !s.ok()) return s;
  std::vector<int32_t> table, offsets, lengths{new_length - seq.quantized()};
  kernels::PagedKV kv = paged_view({&seq}, lengths, &table, &offsets);
  if (auto s = backend_->write_kv(kv, 0, seq.fp_length(), num_tokens, 0, g.num_layers, k.data(), v.data());
      !s.is_ok()) {
    return to_status(s);
  }
  const int32_t first_q = new_length - num_query_tokens;
  if (seq.logical == 0) seq.first_append = received;
  seq.length = new_length;
  seq.logical += num_tokens;
  for (auto& row : seq.attention) row.resize(seq.length, 0.0f);
  tokens_appended_ += num_tokens;
  const float* qf = reinterpret_cast<const float*>(q.data());
  const size_t row = g.q_token_elems();
  for (int32_t i = 0; i < num_query_tokens; ++i) {
    float* entry = query_entry(seq, first_q + i);
    for (int l = 0; l < g.num_layers; ++l) {
      std::memcpy(entry + l * row, qf + (size_t(l) * num_query_tokens + i) * row, row * 4);
    }
  }
  trim_queries(seq);
  if (!seq.decoding && seq.publish) {
    // The prompt keeps its ids only while every prompt token came with one.
    if (token_ids.empty() || seq.prompt_ids.size() + size_t(num_tokens) != size_t(seq.logical)) {
      seq.publish = false;
      seq.prompt_ids.clear();
    } else {
      seq.prompt_ids.insert(seq.prompt_ids.end(), token_ids.begin(), token_ids.end());
      publish_prompt(seq);
    }
  }
  quantize_aged(seq);
  return new_length;
}

float* Registry::query_entry(Sequence& seq, int32_t slot) {
  const size_t entry = size_t(config_.geometry.num_layers) * config_.geometry.q_token_elems();
  if (seq.q_count > 0 && slot >= seq.q_first && slot < seq.q_first + seq.q_count) {
    return seq.queries.data() + size_t(slot - seq.q_first) * entry;  // a restarted step
  }
  if (seq.q_count == 0 || slot != seq.q_first + seq.q_count) {
    // Not contiguous with what is cached (tokens arrived without queries): start afresh.
    seq.q_first = slot;
    seq.q_count = 0;
    seq.queries.clear();
  }
  if (seq.queries.capacity() == 0) seq.queries.reserve(size_t(std::max(1, seq.policy->query_capacity_hint())) * entry);
  seq.queries.resize((size_t(seq.q_count) + 1) * entry);
  return seq.queries.data() + size_t(seq.q_count++) * entry;
}

void Registry::trim_queries(Sequence& seq) {
  int window = seq.policy->query_window();
  if (!seq.decoding && seq.prefill) window = std::max(window, seq.prefill->query_window());
  int32_t keep_from;  // first slot whose queries stay
  if (window < 0) {
    keep_from = seq.decoding ? seq.tail_start : seq.length;  // Kara: only the tail is ever scored
    if (!seq.decoding && seq.prefill) keep_from = seq.length - seq.prefill->query_window();
  } else {
    keep_from = seq.length - window;
  }
  const int32_t drop = std::clamp(keep_from - seq.q_first, 0, seq.q_count);
  if (drop == 0) return;
  const size_t entry = size_t(config_.geometry.num_layers) * config_.geometry.q_token_elems();
  seq.queries.erase(seq.queries.begin(), seq.queries.begin() + drop * entry);
  seq.q_first += drop;
  seq.q_count -= drop;
  if (seq.q_count == 0) seq.queries.shrink_to_fit();
}

absl::StatusOr<Registry::StepResult> Registry::step(const std::string& session_id, int32_t layer,
                                                    absl::Span<const uint64_t> sequence_ids, ConstBytes k,
                                                    ConstBytes v, ConstBytes q, MutableBytes out, float scale) {
  const auto started = std::chrono::steady_clock::now();
  const Geometry& g = config_.geometry;
  const size_t batch = sequence_ids.size();
  if (batch == 0) return absl::InvalidArgumentError("sequence_ids is empty, expected >= 1 sequence");
  if (layer < 0 || layer >= g.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range, expected 0..", g.num_layers - 1));
  }
  auto kv_layout = [&] {
    return absl::StrFormat("[B=%d][Hk=%d][D=%d] %s", batch, g.num_kv_heads, g.head_dim, kernels::dtype_name(g.dtype));
  };
  auto q_layout = [&] { return absl::StrFormat("[B=%d][Hq=%d][D=%d] fp32", batch, g.num_q_heads, g.head_dim); };
  if (auto s = check_size("k", k.size(), step_kv_bytes(batch), kv_layout); !s.ok()) return s;
  if (auto s = check_size("v", v.size(), step_kv_bytes(batch), kv_layout); !s.ok()) return s;
  if (auto s = check_size("q", q.size(), q_bytes(batch), q_layout); !s.ok()) return s;
  if (auto s = check_size("out", out.size(), q_bytes(batch), q_layout); !s.ok()) return s;

  absl::MutexLock lock(&mu_);
  auto session = find_session(session_id);
  if (!session.ok()) return session.status();
  std::vector<Sequence*> seqs;
  seqs.reserve(batch);
  absl::flat_hash_set<uint64_t> seen;
  int32_t need = 0;
  for (uint64_t id : sequence_ids) {
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", id, " appears twice in one Step"));
    }
    auto found = find_sequence(**session, id);
    if (!found.ok()) return found.status();
    Sequence& seq = **found;
    if (layer == 0) {
      need += blocks_needed(seq, seq.length + 1);
      if (!seq.decoding && seq.prefill) {
        const SequenceView view = view_of(seq);
        if (absl::Status s = seq.prefill->ready(view); !s.ok()) {
          return absl::FailedPreconditionError(absl::StrCat("sequence ", id, " prefill_", s.message()));
        }
        // The prompt's one-time compression gathers into fresh blocks before it frees the old ones.
        if (seq.prefill->due(view, true)) need += (seq.length + g.block_size - 1) / g.block_size;
      }
    } else if (seq.pending_layer != layer) {
      return absl::FailedPreconditionError(
          seq.pending_layer < 0
              ? absl::StrCat("sequence ", id, " has no step in progress: a step starts at layer 0, got layer ", layer)
              : absl::StrCat("sequence ", id, " expects layer ", seq.pending_layer, " next, got layer ", layer));
    }
    seqs.push_back(&seq);
  }
  if (absl::Status s = check_tenant_quota((*session)->tenant, need); !s.ok()) return s;
  // A batch is served whole: its priority is the highest of its sequences'.
  int32_t priority = seqs.front()->priority;
  for (const Sequence* seq : seqs) priority = std::max(priority, seq->priority);
  if (absl::Status s = make_room_for(need, priority, seqs, absl::StrCat("Step over ", batch, " sequences"));
      !s.ok()) {
    return s;
  }
  for (Sequence* seq : seqs) seq->last_used = ++use_clock_;
  if (layer == 0) {
    for (Sequence* seq : seqs) {
      if (!seq->decoding) {
        if (absl::Status s = begin_decode(*seq); !s.ok()) return s;
      }
      if (absl::Status s = reserve(*seq, seq->length + 1); !s.ok()) return s;  // counted above
      for (auto& row : seq->attention) row.resize(seq->length + 1, 0.0f);
      seq->step_started = started;
    }
  }
  std::vector<const Sequence*> view(seqs.begin(), seqs.end());
  std::vector<int32_t> lengths, table, offsets;
  for (const Sequence* seq : seqs) lengths.push_back(seq->fp_length() + 1);
  kernels::PagedKV kv = paged_view(view, lengths, &table, &offsets);
  const size_t kv_stride = g.kv_token_elems() * kernels::dtype_size(g.dtype);
  for (size_t i = 0; i < batch; ++i) {
    if (auto s = backend_->write_kv(kv, static_cast<int>(i), seqs[i]->fp_length(), 1, layer, 1,
                                    k.data() + i * kv_stride, v.data() + i * kv_stride);
        !s.is_ok()) {
      return to_status(s);
    }
  }
  const float* qf = reinterpret_cast<const float*>(q.data());
  float* of = reinterpret_cast<float*>(out.data());
  bool accumulate = false;
  for (const Sequence* seq : seqs) accumulate |= !seq->attention.empty();
  if (absl::Status s = batch_attention(seqs, lengths, layer, qf, of, default_scale(scale, g.head_dim), accumulate);
      !s.ok()) {
    return s;
  }
  const size_t row = g.q_token_elems();
  for (size_t i = 0; i < batch; ++i) {
    Sequence& seq = *seqs[i];
    if (seq.policy->query_window() != 0) {
      std::memcpy(query_entry(seq, seq.length) + size_t(layer) * row, qf + i * row, row * 4);
    }
  }
  StepResult result;
  if (layer + 1 < g.num_layers) {
    for (Sequence* seq : seqs) seq->pending_layer = layer + 1;
    result.decode_step = decode_steps_;
    return result;
  }
  auto earliest = started;
  std::vector<std::chrono::steady_clock::time_point> first_appends;
  for (Sequence* seq : seqs) {
    earliest = std::min(earliest, seq->step_started);
    if (seq->first_append) {
      first_appends.push_back(*seq->first_append);
      seq->first_append.reset();
    }
    seq->length += 1;
    seq->logical += 1;
    seq->pending_layer = -1;
    trim_queries(*seq);
    quantize_aged(*seq);
  }
  ++decode_steps_;
  decode_tokens_ += batch;
  result.decode_step = decode_steps_;
  result.compactions = run_scheduler(seqs);
  // The reply follows the scheduler, so the step's compactions count in its latency.
  const auto finished = std::chrono::steady_clock::now();
  result.step_seconds = std::chrono::duration<double>(finished - earliest).count();
  for (const auto& t : first_appends) {
    result.first_step_seconds.push_back(std::chrono::duration<double>(finished - t).count());
  }
  return result;
}

kernels::QuantizedKV Registry::quantized_view(const std::vector<const Sequence*>& seqs, std::vector<int32_t>* table,
                                              std::vector<int32_t>* offsets) const {
  offsets->assign(1, 0);
  table->clear();
  for (const Sequence* s : seqs) {
    table->insert(table->end(), s->qblocks.begin(), s->qblocks.end());
    offsets->push_back(static_cast<int32_t>(table->size()));
  }
  kernels::QuantizedKV q;
  q.format = seqs.front()->format;
  q.tokens_per_block = seqs.front()->tokens_per_qblock;
  q.seed = seqs.front()->qseed;
  q.block_table = table->data();
  q.table_offset = offsets->data();
  return q;
}

absl::Status Registry::batch_attention(const std::vector<Sequence*>& seqs, const std::vector<int32_t>& fp_lengths,
                                       int layer, const float* q, float* out, float scale, bool accumulate) {
  const Geometry& g = config_.geometry;
  const size_t row = g.q_token_elems();
  // Groups of sequences one kernel call can serve: unquantized ones together; each quantized
  // sequence alone (its rotation seed is its own).
  std::vector<std::vector<size_t>> groups;
  std::vector<size_t> plain;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (seqs[i]->qblocks.empty()) plain.push_back(i);
    else groups.push_back({i});
  }
  if (!plain.empty()) groups.insert(groups.begin(), plain);
  for (const std::vector<size_t>& group : groups) {
    const bool whole = group.size() == seqs.size();
    std::vector<const Sequence*> members;
    std::vector<int32_t> lengths;
    std::vector<float> gq, gout;
    for (size_t i : group) {
      members.push_back(seqs[i]);
      lengths.push_back(fp_lengths[i]);
      if (!whole) gq.insert(gq.end(), q + i * row, q + (i + 1) * row);
    }
    if (!whole) gout.resize(gq.size());
    const float* gqp = whole ? q : gq.data();
    float* goutp = whole ? out : gout.data();
    std::vector<float*> acc;
    if (accumulate) {
      acc.assign(group.size() * g.num_kv_heads, nullptr);
      for (size_t j = 0; j < group.size(); ++j) {
        Sequence* seq = seqs[group[j]];
        if (seq->attention.empty()) continue;
        for (int h = 0; h < g.num_kv_heads; ++h) {
          acc[j * g.num_kv_heads + h] = seq->attention[size_t(layer) * g.num_kv_heads + h].data();
        }
      }
    }
    std::vector<int32_t> table, offsets, qtable, qoffsets;
    kernels::PagedKV kv = paged_view(members, lengths, &table, &offsets);
    kernels::KernelStatus ks;
    if (!members.front()->qblocks.empty()) {
      kernels::QuantizedKV qkv = quantized_view(members, &qtable, &qoffsets);
      ks = backend_->decode_attention_quantized(kv, qkv, layer, gqp, goutp, scale, accumulate ? acc.data() : nullptr);
    } else if (accumulate) {
      ks = backend_->decode_attention_accumulate(kv, layer, gqp, goutp, scale, acc.data());
    } else {
      ks = backend_->decode_attention(kv, layer, gqp, goutp, scale);
    }
    if (!ks.is_ok()) return to_status(ks);
    if (!whole) {
      for (size_t j = 0; j < group.size(); ++j) std::copy_n(gout.data() + j * row, row, out + group[j] * row);
    }
  }
  return absl::OkStatus();
}

void Registry::quantize_aged(Sequence& seq) {
  if (!seq.quantize || seq.pending_layer >= 0) return;
  // Tokens a policy may still rewrite stay in full precision: Kara's tail, and a prompt whose
  // prefill policy has not run yet.
  int32_t frozen_end = seq.length;
  if (seq.policy->trigger() == Trigger::kPeriodic) frozen_end = seq.decoding ? seq.tail_start : seq.length;
  if (!seq.decoding && seq.prefill) frozen_end = 0;
  const int32_t limit = std::min(seq.length - seq.residual, frozen_end);
  const int32_t b = config_.geometry.block_size;
  while (seq.quantized() + seq.tokens_per_qblock <= limit) {
    std::vector<int32_t> fresh;
    if (!make_room(1) || !pool_.allocate(1, &fresh).ok()) return;  // retried after the next step
    std::vector<int32_t> table, offsets, lengths{seq.fp_length()}, qtable, qoffsets;
    kernels::PagedKV kv = paged_view({&seq}, lengths, &table, &offsets);
    kernels::QuantizedKV qkv = quantized_view({&seq}, &qtable, &qoffsets);
    if (!backend_->quantize_tokens(kv, 0, 0, qkv, fresh[0]).is_ok()) {
      pool_.release(fresh[0]);
      return;
    }
    const int32_t freed_blocks = seq.tokens_per_qblock / b;
    for (int32_t i = 0; i < freed_blocks; ++i) pool_.release(seq.blocks[i]);
    seq.blocks.erase(seq.blocks.begin(), seq.blocks.begin() + freed_blocks);
    seq.qblocks.push_back(fresh[0]);
  }
}

absl::Status Registry::begin_decode(Sequence& seq) {
  if (seq.prefill) {
    const std::shared_ptr<const Policy> prefill = seq.prefill;
    if (prefill->due(view_of(seq), true)) {
      auto r = compact_locked(seq, *prefill, false);
      if (!r.ok()) return r.status();
    }
    seq.prefill.reset();
  }
  seq.decoding = true;
  seq.prompt = seq.logical;
  seq.publish = false;  // the prompt is fixed; generated tokens are never published
  seq.prompt_ids.clear();
  seq.prompt_ids.shrink_to_fit();
  const int32_t b = config_.geometry.block_size;
  seq.tail_start = (seq.length + b - 1) / b * b;
  trim_queries(seq);
  return absl::OkStatus();
}

int Registry::run_scheduler(const std::vector<Sequence*>& batch) {
  int ran = 0;
  // Threshold policies: the sequences that just grew.
  for (Sequence* seq : batch) {
    if (seq->policy->trigger() != Trigger::kThreshold || !seq->policy->due(view_of(*seq), false)) continue;
    auto r = compact_locked(*seq, *seq->policy, false);
    ran += r.ok() && r->skipped.empty() ? 1 : 0;
  }
  // Kara: a tick every `period` steps over every sequence with a full window, longest tail first.
  std::vector<Sequence*> due;
  for (auto& [id, seq] : sequences_) {
    if (seq.policy->trigger() != Trigger::kPeriodic || seq.pending_layer >= 0) continue;
    if (decode_steps_ % uint64_t(seq.policy->period()) != 0) continue;
    if (seq.policy->due(view_of(seq), false)) due.push_back(&seq);
  }
  std::stable_sort(due.begin(), due.end(), [](const Sequence* a, const Sequence* b) {
    return a->length - a->tail_start > b->length - b->tail_start ||
           (a->length - a->tail_start == b->length - b->tail_start && a->id < b->id);
  });
  if (config_.max_sequences_per_tick > 0 && int(due.size()) > config_.max_sequences_per_tick) {
    due.resize(config_.max_sequences_per_tick);
  }
  for (Sequence* seq : due) {
    auto r = compact_locked(*seq, *seq->policy, false);
    ran += r.ok() && r->skipped.empty() ? 1 : 0;
  }
  if (ran > 0) trim_prefix_cache();
  return ran;
}

SequenceView Registry::view_of(const Sequence& seq) const {
  SequenceView v;
  v.geometry = &config_.geometry;
  v.resident = seq.length;
  v.logical = seq.logical;
  v.prompt = seq.prompt;
  v.tail_start = seq.tail_start;
  v.fp_offset = seq.quantized();
  v.queries = seq.queries.data();
  v.queries_first = seq.q_first;
  v.num_queries = seq.q_count;
  v.attention = seq.attention.empty() ? nullptr : &seq.attention;
  const int hk = config_.geometry.num_kv_heads;
  v.position = [&seq, hk](int layer, int head, int32_t slot) { return seq.position(layer * hk + head, slot); };
  return v;
}

absl::Status Registry::attend(const std::string& session_id, uint64_t sequence_id, int32_t layer,
                              int32_t num_queries, ConstBytes q, MutableBytes out, float scale) {
  const Geometry& g = config_.geometry;
  if (layer < 0 || layer >= g.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " out of range, expected 0..", g.num_layers - 1));
  }
  if (num_queries < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_queries is ", num_queries, ", expected >= 1"));
  }
  auto layout = [&] { return absl::StrFormat("[N=%d][Hq=%d][D=%d] fp32", num_queries, g.num_q_heads, g.head_dim); };
  if (auto s = check_size("q", q.size(), q_bytes(num_queries), layout); !s.ok()) return s;
  if (auto s = check_size("out", out.size(), q_bytes(num_queries), layout); !s.ok()) return s;

  absl::MutexLock lock(&mu_);
  auto session = find_session(session_id);
  if (!session.ok()) return session.status();
  auto found = find_sequence(**session, sequence_id);
  if (!found.ok()) return found.status();
  const Sequence& seq = **found;
  if (seq.pending_layer >= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", sequence_id, " is in the middle of a step; finish it before Attend"));
  }
  if (num_queries > seq.length) {
    return absl::InvalidArgumentError(absl::StrCat("num_queries ", num_queries, " exceeds the ",
                                                   seq.length, " tokens cached in sequence ", sequence_id));
  }
  if (num_queries > seq.fp_length()) {
    return absl::InvalidArgumentError(absl::StrCat("num_queries ", num_queries, " exceeds the ", seq.fp_length(),
                                                   " unquantized tokens of sequence ", sequence_id,
                                                   " (queries must sit in the full-precision window)"));
  }
  std::vector<int32_t> lengths{seq.fp_length()}, table, offsets;
  kernels::PagedKV kv = paged_view({&seq}, lengths, &table, &offsets);
  const float* qf = reinterpret_cast<const float*>(q.data());
  float* of = reinterpret_cast<float*>(out.data());
  if (!seq.qblocks.empty()) {
    std::vector<int32_t> qtable, qoffsets;
    kernels::QuantizedKV qkv = quantized_view({&seq}, &qtable, &qoffsets);
    return to_status(backend_->causal_attention_quantized(kv, qkv, 0, layer, num_queries, qf, of,
                                                          default_scale(scale, g.head_dim)));
  }
  return to_status(backend_->causal_attention(kv, 0, layer, num_queries, qf, of, default_scale(scale, g.head_dim)));
}

absl::StatusOr<int32_t> Registry::read_kv(
    const std::string& session_id, uint64_t sequence_id,
    absl::FunctionRef<absl::StatusOr<ReadKVTargets>(int32_t)> targets) {
  absl::MutexLock lock(&mu_);
  auto session = find_session(session_id);
  if (!session.ok()) return session.status();
  auto found = find_sequence(**session, sequence_id);
  if (!found.ok()) return found.status();
  const Sequence& seq = **found;
  auto out = targets(seq.length);
  if (!out.ok()) return out.status();
  const size_t want = append_bytes(seq.length);
  const size_t rows = size_t(config_.geometry.num_layers) * config_.geometry.num_kv_heads;
  if (out->k.size() < want || out->v.size() < want || out->positions.size() < rows * seq.length * 4) {
    return absl::InvalidArgumentError(absl::StrCat("ReadKV outputs too small for ", seq.length,
                                                   " tokens: k and v need ", want,
                                                   " bytes each, positions ", rows * seq.length * 4));
  }
  if (seq.length > 0) {
    // Quantized blocks come back dequantized (what attention sees), then the unquantized slots.
    const Geometry& g = config_.geometry;
    const size_t tok = g.kv_token_elems() * kernels::dtype_size(g.dtype);  // one token, one layer
    const int32_t nq = seq.quantized(), nf = seq.fp_length();
    std::vector<int32_t> lengths{nf}, table, offsets, qtable, qoffsets;
    kernels::PagedKV kv = paged_view({&seq}, lengths, &table, &offsets);
    auto place = [&](const uint8_t* src_k, const uint8_t* src_v, int32_t n, int32_t at) {
      for (int l = 0; l < g.num_layers; ++l) {
        std::memcpy(out->k.data() + (size_t(l) * seq.length + at) * tok, src_k + size_t(l) * n * tok, n * tok);
        std::memcpy(out->v.data() + (size_t(l) * seq.length + at) * tok, src_v + size_t(l) * n * tok, n * tok);
      }
    };
    if (nq > 0) {
      kernels::QuantizedKV qkv = quantized_view({&seq}, &qtable, &qoffsets);
      std::vector<uint8_t> bk(size_t(g.num_layers) * seq.tokens_per_qblock * tok), bv(bk.size());
      for (size_t i = 0; i < seq.qblocks.size(); ++i) {
        if (auto s = backend_->dequantize_block(kv, qkv, seq.qblocks[i], bk.data(), bv.data()); !s.is_ok()) {
          return to_status(s);
        }
        place(bk.data(), bv.data(), seq.tokens_per_qblock, int32_t(i) * seq.tokens_per_qblock);
      }
    }
    if (nf > 0) {
      std::vector<uint8_t> fk(size_t(g.num_layers) * nf * tok), fv(fk.size());
      if (auto s = backend_->read_kv(kv, 0, fk.data(), fv.data()); !s.is_ok()) return to_status(s);
      place(fk.data(), fv.data(), nf, nq);
    }
  }
  int32_t* pos = reinterpret_cast<int32_t*>(out->positions.data());
  for (size_t r = 0; r < rows; ++r) {
    for (int32_t t = 0; t < seq.length; ++t) pos[r * seq.length + t] = seq.position(int(r), t);
  }
  return seq.length;
}

absl::StatusOr<CompactionResult> Registry::compact_locked(Sequence& seq, const Policy& policy, bool dry_run) {
  if (seq.qblocks.empty() || policy.trigger() != Trigger::kThreshold) return compact_in_place(seq, policy, dry_run);
  // The baselines rewrite the whole cache, quantized prefix included: they work on a copy of the
  // sequence whose prefix is dequantized into fresh blocks, adopted only if the compaction ran.
  // Kept tokens are re-quantized as they age out again, so their error compounds per compaction.
  const Geometry& g = config_.geometry;
  const int32_t fresh_count = seq.quantized() / g.block_size;
  std::vector<int32_t> fresh;
  make_room(fresh_count);
  if (absl::Status s = pool_.allocate(fresh_count, &fresh); !s.ok()) {
    PolicyStats& ps = policy_stats_[seq.label()];
    ++ps.failures;
    return absl::ResourceExhaustedError(absl::StrCat("compaction of quantized sequence ", seq.id, " by ",
                                                     policy.name(), " must first dequantize into ", fresh_count,
                                                     " blocks: ", s.message()));
  }
  Sequence copy = seq;
  copy.qblocks.clear();
  copy.blocks = fresh;
  copy.blocks.insert(copy.blocks.end(), seq.blocks.begin(), seq.blocks.end());
  {
    const size_t bytes = size_t(g.num_layers) * seq.tokens_per_qblock * g.kv_token_elems() * kernels::dtype_size(g.dtype);
    std::vector<uint8_t> k(bytes), v(bytes);
    std::vector<int32_t> table, offsets, lengths{copy.length}, qtable, qoffsets;
    kernels::PagedKV kv = paged_view({&copy}, lengths, &table, &offsets);
    kernels::QuantizedKV qkv = quantized_view({&seq}, &qtable, &qoffsets);
    for (size_t i = 0; i < seq.qblocks.size(); ++i) {
      kernels::KernelStatus ks = backend_->dequantize_block(kv, qkv, seq.qblocks[i], k.data(), v.data());
      if (ks.is_ok()) {
        ks = backend_->write_kv(kv, 0, int(i) * seq.tokens_per_qblock, seq.tokens_per_qblock, 0, g.num_layers,
                                k.data(), v.data());
      }
      if (!ks.is_ok()) {
        for (int32_t blk : fresh) pool_.release(blk);
        return to_status(ks);
      }
    }
  }
  auto r = compact_in_place(copy, policy, dry_run);
  if (r.ok() && !dry_run && r->skipped.empty()) {
    // The copy's table now holds the sequence's references (compaction released what it replaced).
    for (int32_t blk : seq.qblocks) pool_.release(blk);
    seq = std::move(copy);
  } else {
    for (int32_t blk : fresh) pool_.release(blk);
  }
  return r;
}

absl::StatusOr<CompactionResult> Registry::compact_in_place(Sequence& seq, const Policy& policy, bool dry_run) {
  const auto start = absl::Now();
  CompactionResult result;
  result.sequence_id = seq.id;
  result.policy = &policy == seq.policy.get() ? seq.label() : policy.name();
  result.tokens_before = result.tokens_after = seq.length;
  const SequenceView view = view_of(seq);
  if (!policy.due(view, true)) {
    if (absl::Status s = policy.ready(view); !s.ok()) {
      result.skipped = std::string(s.message());
    } else {
      result.skipped = policy.trigger() == Trigger::kNever ? "policy 'none' never compacts"
                                                           : "nothing to compact yet";
    }
    if (dry_run) result.kept = positions_of(seq);
    return result;
  }
  std::vector<int32_t> table, offsets, lengths{seq.fp_length()};
  kernels::PagedKV kv = paged_view({&seq}, lengths, &table, &offsets);
  auto plan = policy.plan(view, kv, *backend_);
  if (!plan.ok()) {
    record(result, seq, 0, true);
    return plan.status();
  }
  const Geometry& g = config_.geometry;
  const int32_t b = g.block_size;
  const size_t rows = size_t(g.num_layers) * g.num_kv_heads;
  // A policy that breaks the plan contract is a bug, never the user's fault.
  if (plan->begin % b != 0 || plan->begin < 0 || plan->end > seq.length || plan->begin > plan->end ||
      (plan->end < seq.length && (plan->end % b != 0 || plan->num_kept % b != 0)) ||
      plan->num_kept > plan->end - plan->begin || plan->kept.size() != rows * plan->num_kept ||
      plan->end < seq.explicit_end || plan->begin < seq.quantized()) {
    record(result, seq, 0, true);
    return absl::InternalError(absl::StrCat("policy ", policy.name(), " produced an invalid plan [", plan->begin, ", ",
                                            plan->end, ") keeping ", plan->num_kept, " of ", seq.length));
  }
  for (size_t r = 0; r < rows; ++r) {
    const int32_t* row = plan->kept.data() + r * plan->num_kept;
    for (int32_t i = 0; i < plan->num_kept; ++i) {
      if (row[i] < plan->begin || row[i] >= plan->end || (i > 0 && row[i] <= row[i - 1])) {
        record(result, seq, 0, true);
        return absl::InternalError(absl::StrCat("policy ", policy.name(), " kept slot ", row[i],
                                                " out of order or outside [", plan->begin, ", ", plan->end, ")"));
      }
    }
  }
  result.tokens_after = seq.length - (plan->end - plan->begin - plan->num_kept);
  if (dry_run) {
    std::vector<std::vector<int32_t>> kept(rows);
    for (size_t r = 0; r < rows; ++r) {
      for (int32_t s = 0; s < plan->begin; ++s) kept[r].push_back(seq.position(int(r), s));
      for (int32_t i = 0; i < plan->num_kept; ++i) kept[r].push_back(seq.position(int(r), plan->kept[r * plan->num_kept + i]));
      for (int32_t s = plan->end; s < seq.length; ++s) kept[r].push_back(seq.position(int(r), s));
    }
    result.kept = std::move(kept);
    return result;
  }
  if (absl::Status s = apply_plan(seq, policy, *plan); !s.ok()) {
    record(result, seq, 0, true);
    return s;
  }
  result.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  record(result, seq, result.tokens_before - result.tokens_after, false);
  return result;
}

absl::Status Registry::apply_plan(Sequence& seq, const Policy& policy, const CompactionPlan& plan) {
  const Geometry& g = config_.geometry;
  const int32_t b = g.block_size;
  const int32_t fresh_count = (plan.num_kept + b - 1) / b;
  std::vector<int32_t> fresh;
  make_room(fresh_count);
  if (absl::Status s = pool_.allocate(fresh_count, &fresh); !s.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("compaction of sequence ", seq.id, " by ", policy.name(),
                                                     " needs ", fresh_count, " fresh blocks: ", s.message()));
  }
  std::vector<int32_t> table, offsets, lengths{seq.fp_length()};
  kernels::PagedKV kv = paged_view({&seq}, lengths, &table, &offsets);
  // Kernels address unquantized slots from 0; plans speak of all resident slots.
  const int32_t q0 = seq.quantized();
  std::vector<int32_t> local(plan.kept);
  for (int32_t& slot : local) slot -= q0;
  if (auto s = backend_->gather_tokens(kv, 0, local.data(), plan.num_kept, fresh.data()); !s.is_ok()) {
    for (int32_t blk : fresh) pool_.release(blk);
    return to_status(s);
  }
  if (policy.merge_tokens() > 0 && !plan.scores.empty()) {
    // CaM reads the evicted values from the old blocks, which are still the sequence's here.
    if (auto s = backend_->cam_merge_values(kv, 0, plan.begin - q0, plan.end - q0, local.data(), plan.num_kept,
                                            plan.scores.data(), policy.merge_tokens(), fresh.data());
        !s.is_ok()) {
      for (int32_t blk : fresh) pool_.release(blk);
      return to_status(s);
    }
  }
  // From here on nothing can fail: rewrite positions, table, caches.
  const size_t rows = size_t(g.num_layers) * g.num_kv_heads;
  const int32_t removed = plan.end - plan.begin - plan.num_kept;
  std::vector<std::vector<int32_t>> pos(rows);
  for (size_t r = 0; r < rows; ++r) {
    pos[r].reserve(plan.begin + plan.num_kept);
    for (int32_t s = 0; s < plan.begin; ++s) pos[r].push_back(seq.position(int(r), s));
    for (int32_t i = 0; i < plan.num_kept; ++i) pos[r].push_back(seq.position(int(r), plan.kept[r * plan.num_kept + i]));
  }
  if (!seq.attention.empty()) {
    for (size_t r = 0; r < rows; ++r) {
      std::vector<float>& acc = seq.attention[r];
      std::vector<float> next(acc.begin(), acc.begin() + plan.begin);
      for (int32_t i = 0; i < plan.num_kept; ++i) next.push_back(acc[plan.kept[r * plan.num_kept + i]]);
      next.insert(next.end(), acc.begin() + plan.end, acc.begin() + seq.length);
      acc = std::move(next);
    }
  }
  const int32_t first_old = (plan.begin - q0) / b;
  const int32_t end_old = (plan.end - q0 + b - 1) / b;
  for (int32_t i = first_old; i < end_old; ++i) pool_.release(seq.blocks[i]);
  std::vector<int32_t> blocks(seq.blocks.begin(), seq.blocks.begin() + first_old);
  blocks.insert(blocks.end(), fresh.begin(), fresh.end());
  blocks.insert(blocks.end(), seq.blocks.begin() + end_old, seq.blocks.end());
  seq.blocks = std::move(blocks);
  // Queries: those of removed or regathered slots go; later ones shift down with their slots.
  const int32_t q_end = seq.q_first + seq.q_count;
  if (seq.q_count > 0 && seq.q_first < plan.end && q_end > plan.begin) {
    const int32_t drop = seq.q_first >= plan.begin ? std::min(plan.end, q_end) - seq.q_first : seq.q_count;
    const size_t entry = size_t(g.num_layers) * g.q_token_elems();
    seq.queries.erase(seq.queries.begin(), seq.queries.begin() + size_t(drop) * entry);
    seq.q_first += drop;
    seq.q_count -= drop;
  }
  if (seq.q_first >= plan.end) seq.q_first -= removed;
  if (seq.q_count == 0) seq.q_first = seq.length - removed;
  seq.length -= removed;
  seq.explicit_end = plan.begin + plan.num_kept;
  seq.explicit_pos = std::move(pos);
  if (policy.trigger() == Trigger::kPeriodic) seq.tail_start = plan.begin + plan.num_kept;
  ++seq.compactions;
  seq.publish = false;  // compacted blocks are never content-addressed
  return absl::OkStatus();
}

void Registry::record(const CompactionResult& r, const Sequence& seq, int32_t removed, bool failed) {
  PolicyStats& ps = policy_stats_[r.policy];
  if (failed) {
    ++ps.failures;
    return;
  }
  ++ps.compactions;
  ps.tokens_removed += uint64_t(removed);
  ps.seconds += r.seconds;
  if (observer_) observer_(r);
  if (r.skipped.empty()) {
    RegistryEvent e;
    e.kind = RegistryEvent::Kind::kCompaction;
    e.session_id = seq.session_id;
    e.sequence_id = seq.id;
    e.policy = r.policy;
    e.tokens_before = r.tokens_before;
    e.tokens_after = r.tokens_after;
    emit(e);
  }
}

std::vector<std::vector<int32_t>> Registry::positions_of(const Sequence& seq) const {
  const size_t rows = size_t(config_.geometry.num_layers) * config_.geometry.num_kv_heads;
  std::vector<std::vector<int32_t>> out(rows);
  for (size_t r = 0; r < rows; ++r) {
    out[r].reserve(seq.length);
    for (int32_t s = 0; s < seq.length; ++s) out[r].push_back(seq.position(int(r), s));
  }
  return out;
}

absl::StatusOr<std::vector<CompactionResult>> Registry::compact(const std::string& session_id,
                                                                uint64_t sequence_id, bool dry_run) {
  absl::MutexLock lock(&mu_);
  auto session = find_session(session_id);
  if (!session.ok()) return session.status();
  std::vector<Sequence*> targets;
  if (sequence_id != 0) {
    auto found = find_sequence(**session, sequence_id);
    if (!found.ok()) return found.status();
    targets.push_back(*found);
  } else {
    std::vector<uint64_t> ids((*session)->sequences.begin(), (*session)->sequences.end());
    std::sort(ids.begin(), ids.end());
    for (uint64_t id : ids) targets.push_back(&sequences_.at(id));
  }
  std::vector<CompactionResult> out;
  for (Sequence* seq : targets) {
    if (seq->pending_layer >= 0) {
      CompactionResult r;
      r.sequence_id = seq->id;
      r.policy = seq->label();
      r.tokens_before = r.tokens_after = seq->length;
      r.skipped = absl::StrCat("in the middle of a step (expects layer ", seq->pending_layer, ")");
      out.push_back(std::move(r));
      continue;
    }
    auto r = compact_locked(*seq, *seq->policy, dry_run);
    if (!r.ok()) return r.status();
    out.push_back(std::move(*r));
  }
  trim_prefix_cache();
  return out;
}

absl::StatusOr<std::pair<SequenceInfo, std::vector<std::vector<int32_t>>>> Registry::inspect(uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(sequence_id);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("unknown sequence ", sequence_id));
  return std::make_pair(info_of(it->second), positions_of(it->second));
}

void Registry::set_event_observer(std::function<void(const RegistryEvent&)> observer) {
  absl::MutexLock lock(&mu_);
  event_observer_ = std::move(observer);
}

bool Registry::has_session(const std::string& session_id) const {
  absl::MutexLock lock(&mu_);
  return sessions_.contains(session_id);
}

void Registry::set_compaction_observer(std::function<void(const CompactionResult&)> observer) {
  absl::MutexLock lock(&mu_);
  observer_ = std::move(observer);
}

SequenceInfo Registry::info_of(const Sequence& seq) const {
  SequenceInfo info;
  info.id = seq.id;
  info.session_id = seq.session_id;
  info.tenant = seq.tenant;
  info.policy = seq.label();
  info.prefill_policy = seq.prefill_name;
  info.length = seq.length;
  info.logical_length = seq.logical;
  info.prompt_length = seq.prompt;
  info.compactions = seq.compactions;
  info.storage = seq.storage;
  info.quantized = seq.quantized();
  info.quantized_blocks = static_cast<int32_t>(seq.qblocks.size());
  info.blocks = static_cast<int32_t>(seq.blocks.size() + seq.qblocks.size());
  for (int32_t b : seq.blocks) info.shared_blocks += pool_.refcount(b) > 1 ? 1 : 0;
  for (int32_t b : seq.qblocks) info.shared_blocks += pool_.refcount(b) > 1 ? 1 : 0;
  const Geometry& g = config_.geometry;
  info.kv_bytes = uint64_t(info.blocks) * g.block_bytes();
  info.fp16_bytes = uint64_t(seq.logical) * g.num_layers * g.kv_token_elems() * 2 * 2;
  const int bits = !seq.quantize ? 8 * int(kernels::dtype_size(g.dtype))
                   : seq.format == kernels::QuantFormat::kKivi2 || seq.format == kernels::QuantFormat::kTq2 ? 2
                   : seq.format == kernels::QuantFormat::kTq3                                               ? 3
                                                                                                             : 4;
  info.nominal_ratio = 16.0 / bits;
  info.priority = seq.priority;
  info.pending_layer = seq.pending_layer;
  return info;
}

RegistryStats Registry::stats() const {
  absl::MutexLock lock(&mu_);
  RegistryStats s;
  s.blocks_total = pool_.total();
  s.blocks_used = pool_.used_count();
  s.blocks_free = pool_.free_count();
  for (const auto& [id, seq] : sequences_) s.resident_tokens += seq.length;
  s.sequences = static_cast<int32_t>(sequences_.size());
  s.sessions = static_cast<int32_t>(sessions_.size());
  s.decode_steps = decode_steps_;
  s.tokens_appended = tokens_appended_;
  s.decode_tokens = decode_tokens_;
  s.lease_expiries = lease_expiries_;
  s.preemptions = preemptions_;
  s.policies = policy_stats_;
  s.prefix_lookups = prefix_lookups_;
  s.prefix_lookup_tokens = prefix_lookup_tokens_;
  s.prefix_hit_tokens = prefix_hit_tokens_;
  s.prefix_cached_blocks = static_cast<int32_t>(prefix_cache_.size());
  s.prefix_unused_blocks = unused_cached_blocks();
  s.prefix_evictions = prefix_evictions_;
  s.prefix_published_blocks = prefix_published_;
  for (const auto& [id, seq] : sequences_) {
    s.logical_tokens += seq.logical;
    s.query_cache_bytes += seq.queries.size() * sizeof(float);
    for (const auto& row : seq.attention) s.score_bytes += row.size() * sizeof(float);
    const SequenceInfo info = info_of(seq);
    PolicyStats& ps = s.policies[info.policy];
    ++ps.sequences;
    ps.resident_tokens += seq.length;
    ps.logical_tokens += seq.logical;
    ps.kv_bytes += info.kv_bytes;
    ps.fp16_bytes += info.fp16_bytes;
    ps.nominal_ratio = info.nominal_ratio;
  }
  return s;
}

absl::StatusOr<std::vector<SequenceInfo>> Registry::list_session_sequences(const std::string& session_id) const {
  absl::MutexLock lock(&mu_);
  if (!sessions_.contains(session_id)) return unknown_session(session_id);
  return list_sequences_locked(session_id);
}

std::vector<SequenceInfo> Registry::list_sequences(const std::string& session_id) const {
  absl::MutexLock lock(&mu_);
  return list_sequences_locked(session_id);
}

std::vector<SequenceInfo> Registry::list_sequences_locked(const std::string& session_id) const {
  std::vector<SequenceInfo> out;
  for (const auto& [id, seq] : sequences_) {
    if (!session_id.empty() && seq.session_id != session_id) continue;
    SequenceInfo info = info_of(seq);
    out.push_back(std::move(info));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  return out;
}

absl::Status Registry::check_invariants() const {
  absl::MutexLock lock(&mu_);
  std::vector<int32_t> references(pool_.total(), 0);
  const int32_t b = config_.geometry.block_size;
  for (const auto& [id, seq] : sequences_) {
    const int32_t covered = seq.fp_length() + (seq.pending_layer >= 0 ? 1 : 0);
    if (static_cast<int32_t>(seq.blocks.size()) != (covered + b - 1) / b) {
      return absl::InternalError(absl::StrCat("sequence ", id, " holds ", seq.blocks.size(),
                                              " blocks for ", covered, " unquantized tokens"));
    }
    for (int32_t block : seq.qblocks) {
      if (block < 0 || block >= pool_.total()) {
        return absl::InternalError(absl::StrCat("sequence ", id, " holds bad quantized block id ", block));
      }
      ++references[block];
    }
    for (int32_t block : seq.blocks) {
      if (block < 0 || block >= pool_.total()) {
        return absl::InternalError(absl::StrCat("sequence ", id, " holds bad block id ", block));
      }
      ++references[block];
    }
    if (!sessions_.contains(seq.session_id)) {
      return absl::InternalError(absl::StrCat("sequence ", id, " outlived its session"));
    }
  }
  // The prefix cache holds one reference on each block it indexes.
  if (std::string e = prefix_cache_.check(); !e.empty()) return absl::InternalError(e);
  for (const auto& [key, e] : prefix_cache_.entries()) {
    if (e.block < 0 || e.block >= pool_.total()) {
      return absl::InternalError(absl::StrCat("prefix cache holds bad block id ", e.block));
    }
    ++references[e.block];
  }
  return pool_.check(references);
}

}  // namespace karakv::server
