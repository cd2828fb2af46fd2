// The core: takes the lock, validates, then calls the sessions, the sequence store and the
// compactor in order. Each operation runs in two phases: check everything and count the blocks it
// needs, then change state; only the second phase mutates.
#include "server/core.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/prefix_tier.h"

namespace karakv::server {
namespace {

using kernels::Geometry;

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

// A CreateSequence's policy name split from its "+storage" suffix, and the storage's own
// parameter (`residual`) taken out of the policy's parameters.
struct SequenceSpec {
  std::string policy;
  std::string storage;
  std::map<std::string, double> params;
  int32_t residual = 128;
};

absl::StatusOr<SequenceSpec> split_spec(const SequenceOptions& options) {
  SequenceSpec spec;
  spec.policy = options.policy.empty() ? "none" : options.policy;
  spec.storage = options.storage;
  if (const size_t plus = spec.policy.find('+'); plus != std::string::npos) {
    if (!spec.storage.empty() && spec.storage != spec.policy.substr(plus + 1)) {
      return absl::InvalidArgumentError(absl::StrCat("policy '", spec.policy, "' names storage '",
                                                     spec.policy.substr(plus + 1), "' but storage is '", spec.storage,
                                                     "'"));
    }
    spec.storage = spec.policy.substr(plus + 1);
    spec.policy = spec.policy.substr(0, plus);
    if (spec.policy.empty()) spec.policy = "none";
  }
  spec.params = options.params;
  if (auto it = spec.params.find("residual"); it != spec.params.end() && !spec.storage.empty()) {
    if (it->second < 0 || it->second > (1 << 20) || it->second != std::floor(it->second)) {
      return absl::InvalidArgumentError(absl::StrCat("parameter residual=", it->second,
                                                     " out of range: expected an integer in [0, 1048576]"));
    }
    spec.residual = static_cast<int32_t>(it->second);
    spec.params.erase(it);
  }
  return spec;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Core>> Core::create(const CoreConfig& config, std::unique_ptr<kernels::Backend> backend) {
  std::unique_ptr<Core> core(new Core(config, std::move(backend)));
  core->device_staging_ = DeviceStagingPool::create(*core->backend_, config.max_device_staging_bytes, config.cuda_device);
  StoreConfig sc;
  sc.geometry = config.geometry;
  sc.pool_bytes = config.pool_bytes;
  sc.prefix_cache = config.prefix_cache;
  sc.prefix_cache_max_fraction = config.prefix_cache_max_fraction;
  auto store = SequenceStore::create(sc, *core->backend_);
  if (!store.ok()) return store.status();
  SessionLimits limits;
  limits.lease = config.lease;
  limits.max_staging_bytes = config.max_staging_bytes;
  limits.prefix_cache_shared_namespaces = config.prefix_cache_shared_namespaces;
  limits.max_sessions = config.max_sessions;
  limits.max_sequences_per_session = config.max_sequences_per_session;
  limits.tenant_block_quota = config.tenant_block_quota;
  limits.preempt_on_pressure = config.preempt_on_pressure;
  limits.stream_ordered_staging = config.stream_ordered_staging;
  absl::MutexLock lock(&core->mu_);
  core->store_ = std::move(*store);
  core->sessions_ = std::make_unique<SessionTable>(limits, *core->store_, core->device_staging_.get());
  core->compactor_ = std::make_unique<Compactor>(*core->store_, config.max_sequences_per_tick);
  return core;
}

Core::Core(const CoreConfig& config, std::unique_ptr<kernels::Backend> backend)
    : config_(config), backend_(std::move(backend)) {}

Core::~Core() {
  absl::MutexLock lock(&mu_);
  compactor_.reset();
  sessions_.reset();
  store_.reset();  // frees the pool while the backend is alive
}

size_t Core::append_bytes(int32_t num_tokens) const { return server::append_bytes(config_.geometry, num_tokens); }
size_t Core::step_kv_bytes(size_t batch) const { return server::step_kv_bytes(config_.geometry, batch); }
size_t Core::q_bytes(size_t rows) const { return server::q_bytes(config_.geometry, rows); }

// ---- sessions ----

absl::StatusOr<AttachResult> Core::attach(const std::string& worker_id, const std::string& tenant,
                                          uint64_t staging_bytes, const Geometry& worker_geometry,
                                          const std::string& cache_namespace, uint64_t reserved_bytes,
                                          StagingKind staging_kind, const std::string& model_fingerprint,
                                          const std::string& worker_event_handle) {
  if (absl::Status s = check_worker_geometry(worker_geometry, config_.geometry); !s.ok()) return s;
  if (model_fingerprint.size() > 256 ||
      std::any_of(model_fingerprint.begin(), model_fingerprint.end(), [](char c) { return c < 0x21 || c > 0x7e; })) {
    return absl::InvalidArgumentError(absl::StrCat("model_fingerprint of ", model_fingerprint.size(),
                                                   " bytes refused; expected at most 256 printable ASCII characters "
                                                   "without spaces (e.g. the model's name and revision or weights hash)"));
  }
  absl::StatusOr<SessionTable::Admission> admission;
  {
    // prepare() reads only the table's immutable limits; the region is made outside the lock.
    SessionTable* sessions;
    {
      absl::MutexLock lock(&mu_);
      sessions = sessions_.get();
    }
    admission = sessions->prepare(worker_id, tenant, staging_bytes, cache_namespace, reserved_bytes, staging_kind,
                                  worker_event_handle);
  }
  if (!admission.ok()) return admission.status();
  if (!model_fingerprint.empty()) {
    // Two models of one geometry must never share a cached block, here or in the tier.
    admission->session.model_fingerprint = model_fingerprint;
    absl::StrAppend(&admission->session.cache_namespace, "|model:", model_fingerprint);
    admission->result.cache_namespace = admission->session.cache_namespace;
  }
  AttachResult result = admission->result;
  absl::MutexLock lock(&mu_);
  if (absl::Status s = sessions_->add(std::move(*admission)); !s.ok()) return s;
  return result;
}

absl::StatusOr<int> Core::detach(const std::string& session_id) {
  absl::MutexLock lock(&mu_);
  auto session = sessions_->find(session_id);
  if (!session.ok()) return session.status();
  const int n = static_cast<int>((*session)->sequences.size());
  sessions_->end(session_id, false);
  store_->trim_prefix_cache();
  return n;
}

absl::Status Core::heartbeat(const std::string& session_id) {
  absl::MutexLock lock(&mu_);
  auto session = sessions_->find(session_id);
  if (!session.ok()) return session.status();
  sessions_->renew(**session);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Staging>> Core::staging(const std::string& session_id) {
  absl::MutexLock lock(&mu_);
  auto session = sessions_->find(session_id);
  if (!session.ok()) return session.status();
  return (*session)->staging;
}

absl::StatusOr<Core::RingRegions> Core::ring_regions(const std::string& session_id) {
  absl::MutexLock lock(&mu_);
  auto session = sessions_->find(session_id);
  if (!session.ok()) return session.status();
  RingRegions r;
  r.data = (*session)->staging;
  r.rings = (*session)->rings != nullptr ? (*session)->rings : std::dynamic_pointer_cast<StagingRegion>(r.data);
  return r;
}

absl::StatusOr<std::shared_ptr<DeviceStaging>> Core::vmm_staging(const std::string& session_id,
                                                                 uint64_t generation) {
  auto staging = this->staging(session_id);
  if (!staging.ok()) return staging.status();
  if (*staging == nullptr || (*staging)->kind() != StagingKind::kCudaVmmFd) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", session_id, " attached with staging_kind ",
        *staging == nullptr ? "none (no staging region)" : staging_kind_name((*staging)->kind()),
        "; the staging fd socket serves only sessions attached with staging_kind CUDA_VMM_FD"));
  }
  if (generation == 0) {
    return absl::FailedPreconditionError(
        "staging generation 0: send AttachReply.staging_generation with the session id");
  }
  if (absl::Status s = check_generation(**staging, generation); !s.ok()) return s;
  return std::static_pointer_cast<DeviceStaging>(*staging);
}

int Core::expire_leases(absl::Time now) {
  absl::MutexLock lock(&mu_);
  const int n = sessions_->expire(now);
  if (n > 0) store_->trim_prefix_cache();
  return n;
}

bool Core::has_session(const std::string& session_id) const {
  absl::MutexLock lock(&mu_);
  return sessions_->contains(session_id);
}

// ---- sequences ----

absl::StatusOr<uint64_t> Core::create_sequence(const std::string& session_id, const SequenceOptions& options) {
  auto r = create_sequence_from_prefix(session_id, options);
  if (!r.ok()) return r.status();
  return r->first;
}

absl::StatusOr<std::pair<uint64_t, int32_t>> Core::create_sequence_from_prefix(const std::string& session_id,
                                                                               const SequenceOptions& options) {
  auto spec = split_spec(options);
  if (!spec.ok()) return spec.status();
  const Geometry& g = config_.geometry;
  fill_from_tier(session_id, options.prefix_token_ids);
  absl::MutexLock lock(&mu_);
  const bool quantized = !spec->storage.empty() && spec->storage != "fp16" && spec->storage != kernels::dtype_name(g.dtype);
  auto binding = compactor_->bind(spec->policy, spec->params, options.prefill_policy, options.prefill_params, quantized);
  if (!binding.ok()) return binding.status();
  kernels::QuantFormat format = kernels::QuantFormat::kKivi4;
  int32_t tokens_per_qblock = 0;
  const std::string& storage = spec->storage;
  if (quantized) {
    if (!parse_quant_format(storage, &format)) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown storage '", storage, "'; expected kivi2, kivi4, tq2, tq3 or tq4 (or none)"));
    }
    for (kernels::Op op : {kernels::Op::kQuantize, kernels::Op::kDequantize, kernels::Op::kQuantizedAttention}) {
      if (!backend_->supports(op, g.dtype)) {
        return absl::UnimplementedError(absl::StrCat(
            "storage '", storage, "' needs ", kernels::op_name(op), ", which backend ", std::string(backend_->name()),
            " does not run for ", kernels::dtype_name(g.dtype), "; start karakvd with --backend=cpu"));
      }
    }
    tokens_per_qblock = backend_->quantized_tokens_per_block(g, format);
    if (tokens_per_qblock == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "storage '", storage, "' cannot hold head_dim ", g.head_dim, " on backend ", std::string(backend_->name()),
          " (KIVI needs a multiple of 32, TurboQuant a power of two)"));
    }
  }
  auto session = sessions_->find(session_id);
  if (!session.ok()) return session.status();
  if (absl::Status s = sessions_->check_sequence_limit(**session); !s.ok()) return s;
  std::vector<PrefixCache::Hit> hits = store_->match_prefix(options.prefix_token_ids, (*session)->cache_namespace);
  if (absl::Status s = sessions_->check_tenant_quota((*session)->tenant, static_cast<int64_t>(hits.size())); !s.ok()) {
    return s;
  }
  Sequence& seq = store_->add();
  seq.session_id = session_id;
  seq.tenant = (*session)->tenant;
  seq.policy = std::move(*binding);
  seq.label = tokens_per_qblock > 0 ? absl::StrCat(spec->policy, "+", storage) : seq.policy->policy->name();
  seq.priority = options.priority;
  if (tokens_per_qblock > 0) {
    seq.quantize = true;
    seq.format = format;
    seq.storage = storage;
    seq.tokens_per_qblock = tokens_per_qblock;
    seq.residual = spec->residual;
    // One rotation per (layer, KV head) for every sequence (the contract's "fixed random rotation
    // per head"), so that quantized sequences of one format share a kernel call.
    seq.qseed = kQuantSeed;
  }
  sessions_->adopt(**session, seq.id);
  seq.cache_namespace = (*session)->cache_namespace;
  // A prompt the prefill policy will compress is not what another sequence's prompt would be.
  seq.publish = config_.prefix_cache && !seq.policy->prefill;
  seq.share_tier = !(*session)->model_fingerprint.empty();
  int32_t cached = 0;
  if (!options.prefix_token_ids.empty()) {
    if (config_.prefix_cache) cached = store_->adopt_prefix(seq, hits, options.prefix_token_ids);
    store_->count_lookup(options.prefix_token_ids.size(), cached);
  }
  if (absl::Status s = compactor_->on_grow(seq, seq.length); !s.ok()) {
    (void)sessions_->release(**session, seq.id);
    return s;
  }
  return std::make_pair(seq.id, cached);
}

void Core::fill_from_tier(const std::string& session_id, absl::Span<const int32_t> token_ids) {
  PrefixTier* tier = tier_.load();
  const size_t b = size_t(config_.geometry.block_size);
  if (tier == nullptr || !config_.prefix_cache || token_ids.size() < b) return;
  std::string cache_namespace;
  size_t local = 0;
  {
    absl::MutexLock lock(&mu_);
    auto session = sessions_->find(session_id);
    if (!session.ok() || (*session)->model_fingerprint.empty()) return;
    cache_namespace = (*session)->cache_namespace;
    local = store_->match_prefix(token_ids, cache_namespace).size();
  }
  if (local >= token_ids.size() / b) return;
  const std::vector<PrefixKey> keys = prefix_chain_keys(token_ids, config_.geometry, cache_namespace);
  std::vector<PrefixKey> missing(keys.begin() + ptrdiff_t(local), keys.end());
  std::vector<std::string> values = tier->fetch(missing);  // without the lock: Steps go on
  if (values.empty()) return;
  absl::MutexLock lock(&mu_);
  if (store_->install_prefix(cache_namespace, token_ids, keys, local, values, PrefixTier::kHeaderBytes) > 0) {
    store_->trim_prefix_cache();
  }
}

absl::StatusOr<int32_t> Core::lookup_prefix(const std::string& session_id, absl::Span<const int32_t> token_ids) {
  fill_from_tier(session_id, token_ids);
  absl::MutexLock lock(&mu_);
  auto session = sessions_->find(session_id);
  if (!session.ok()) return session.status();
  const int32_t hit =
      static_cast<int32_t>(store_->match_prefix(token_ids, (*session)->cache_namespace).size()) * config_.geometry.block_size;
  store_->count_lookup(token_ids.size(), hit);
  return hit;
}

absl::StatusOr<uint64_t> Core::fork_sequence(const std::string& session_id, uint64_t parent_id) {
  absl::MutexLock lock(&mu_);
  auto session = sessions_->find(session_id);
  if (!session.ok()) return session.status();
  auto parent = sessions_->find_sequence(**session, parent_id);
  if (!parent.ok()) return parent.status();
  if ((*parent)->pending_layer >= 0) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", parent_id, " is in the middle of a step (expects layer ",
                                                      (*parent)->pending_layer, "); finish the step before forking"));
  }
  if (absl::Status s = sessions_->check_sequence_limit(**session); !s.ok()) return s;
  if (absl::Status s = sessions_->check_tenant_quota(
          (*session)->tenant, static_cast<int64_t>((*parent)->blocks.size() + (*parent)->qblocks.size()));
      !s.ok()) {
    return s;
  }
  auto binding = compactor_->fork(**parent);
  if (!binding.ok()) return binding.status();
  if (!(*parent)->decoding) {
    // Parent and child now share the prompt's whole blocks (the child copies this).
    const int32_t b = store_->geometry().block_size;
    (*parent)->shared_prefix = std::max((*parent)->shared_prefix, (*parent)->length / b * b);
  }
  Sequence& child = store_->fork(**parent);  // `parent` may move: the store's map may grow
  child.session_id = session_id;
  child.policy = std::move(*binding);
  sessions_->adopt(**session, child.id);
  return child.id;
}

absl::StatusOr<int> Core::release_sequence(const std::string& session_id, uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  auto session = sessions_->find(session_id);
  if (!session.ok()) return session.status();
  auto freed = sessions_->release(**session, sequence_id);
  if (freed.ok()) store_->trim_prefix_cache();
  return freed;
}

// ---- the data path ----

absl::StatusOr<const float*> Core::host_floats(ConstBytes bytes, bool needed, std::vector<float>* copy) const {
  if (!needed || bytes.empty() || !backend_->is_device_memory(bytes.data())) {
    return reinterpret_cast<const float*>(bytes.data());
  }
  copy->resize(bytes.size() / sizeof(float));
  if (auto s = backend_->copy_out(copy->data(), bytes.data(), bytes.size()); !s.is_ok()) return to_status(s);
  return copy->data();
}

absl::StatusOr<int32_t> Core::append(const std::string& session_id, uint64_t sequence_id, int64_t sent_tokens,
                                     ConstBytes k, ConstBytes v, ConstBytes q, int64_t sent_query_tokens,
                                     absl::Span<const int32_t> token_ids) {
  const auto received = std::chrono::steady_clock::now();
  const Geometry& g = config_.geometry;
  if (sent_tokens < 1 || sent_tokens > kMaxAppendTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens is ", sent_tokens, ", expected 1..", kMaxAppendTokens));
  }
  if (sent_query_tokens < 0 || sent_query_tokens > sent_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("num_query_tokens is ", sent_query_tokens,
                                                   ", expected 0..num_tokens (", sent_tokens, ")"));
  }
  const auto num_tokens = static_cast<int32_t>(sent_tokens);
  const auto num_query_tokens = static_cast<int32_t>(sent_query_tokens);
  if (!token_ids.empty() && token_ids.size() != size_t(num_tokens)) {
    return absl::InvalidArgumentError(absl::StrCat("token_ids has ", token_ids.size(), " entries, expected ",
                                                   "num_tokens = ", num_tokens, " (or none)"));
  }
  auto layout = [&] {
    return absl::StrFormat("[L=%d][T=%d][Hk=%d][D=%d] %s", g.num_layers, num_tokens, g.num_kv_heads, g.head_dim,
                           kernels::dtype_name(g.dtype));
  };
  if (auto s = check_size("k", k.size(), append_bytes(num_tokens), layout); !s.ok()) return s;
  if (auto s = check_size("v", v.size(), append_bytes(num_tokens), layout); !s.ok()) return s;
  if (auto s = check_size("q", q.size(), size_t(g.num_layers) * q_bytes(num_query_tokens),
                          [&] {
                            return absl::StrFormat("[L=%d][Nq=%d][Hq=%d][D=%d] fp32", g.num_layers, num_query_tokens,
                                                   g.num_q_heads, g.head_dim);
                          });
      !s.ok()) {
    return s;
  }

  absl::MutexLock lock(&mu_);
  auto session = sessions_->find(session_id);
  if (!session.ok()) return session.status();
  auto found = sessions_->find_sequence(**session, sequence_id);
  if (!found.ok()) return found.status();
  Sequence& seq = **found;
  if (seq.pending_layer >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", sequence_id, " is in the middle of a step (expects layer ", seq.pending_layer,
        "); finish the step or restart it at layer 0 before appending"));
  }
  if (absl::Status s = compactor_->check_append(seq, num_tokens, num_query_tokens); !s.ok()) return s;
  if (int64_t(seq.logical) + num_tokens > INT32_MAX / 2) {
    return absl::InvalidArgumentError("sequence would exceed 2^30 tokens");
  }
  const int32_t new_length = seq.length + num_tokens;
  const int32_t need = store_->blocks_needed(seq, new_length);
  if (absl::Status s = sessions_->check_tenant_quota(seq.tenant, need); !s.ok()) return s;
  Sequence* served = &seq;
  if (absl::Status s = sessions_->make_room_for(need, seq.priority, absl::MakeSpan(&served, 1),
                                                absl::StrCat("appending ", num_tokens, " tokens to sequence ",
                                                             sequence_id));
      !s.ok()) {
    return s;
  }
  seq.last_used = ++use_clock_;
  if (absl::Status s = store_->reserve(seq, new_length); !s.ok()) return s;
  if (absl::Status s = store_->write_prompt(seq, num_tokens, k, v); !s.ok()) return s;
  // Before the length moves: a state that cannot grow leaves the sequence as it was.
  if (absl::Status s = compactor_->on_grow(seq, new_length); !s.ok()) return s;
  const int32_t first_q = new_length - num_query_tokens;
  if (seq.logical == 0) seq.first_append = received;
  seq.length = new_length;
  seq.logical += num_tokens;
  std::vector<float> host_q;
  auto qf = host_floats(q, num_query_tokens > 0, &host_q);
  if (!qf.ok()) return qf.status();
  const size_t row = g.q_token_elems();
  for (int32_t i = 0; i < num_query_tokens; ++i) {
    float* entry = store_->query_entry(seq, first_q + i, compactor_->query_capacity_hint(seq));
    for (int l = 0; l < g.num_layers; ++l) {
      std::memcpy(entry + l * row, *qf + (size_t(l) * num_query_tokens + i) * row, row * 4);
    }
  }
  compactor_->trim_queries(seq);
  store_->publish_prompt(seq, token_ids, num_tokens);
  compactor_->quantize_aged(seq);
  return new_length;
}

namespace {

// A request's kernels queue without waiting for each other (backend.h, set_deferred); finish()
// waits once for all of them, or not at all for a stream-ordered request (the caller records the
// daemon's event instead). A request that fails on the way waits too: its worker may reuse the
// staging its kernels still read as soon as the refusal arrives.
class DeferredWaits {
 public:
  DeferredWaits(kernels::Backend& backend, bool stream_ordered) : backend_(backend), ordered_(stream_ordered) {
    backend_.set_deferred(true);
  }
  ~DeferredWaits() {
    if (done_) return;
    backend_.set_deferred(false);
    if (ordered_) return;
    const kernels::KernelStatus ignored = backend_.synchronize();  // the request failed with its own error
    (void)ignored;
  }
  DeferredWaits(const DeferredWaits&) = delete;
  DeferredWaits& operator=(const DeferredWaits&) = delete;

  absl::Status finish() {
    done_ = true;
    backend_.set_deferred(false);
    return ordered_ ? absl::OkStatus() : to_status(backend_.synchronize());
  }

 private:
  kernels::Backend& backend_;
  const bool ordered_;
  bool done_ = false;
};

}  // namespace

absl::StatusOr<Core::StepResult> Core::step(const std::string& session_id, int64_t layer,
                                            absl::Span<const uint64_t> sequence_ids, ConstBytes k, ConstBytes v,
                                            ConstBytes q, MutableBytes out, float scale, bool stream_ordered) {
  const auto started = std::chrono::steady_clock::now();
  const Geometry& g = config_.geometry;
  const size_t batch = sequence_ids.size();
  if (absl::Status s = check_batch(batch); !s.ok()) return s;
  if (absl::Status s = check_layer(layer, g); !s.ok()) return s;
  if (absl::Status s = check_scale(scale); !s.ok()) return s;
  auto kv_layout = [&] {
    return absl::StrFormat("[B=%d][Hk=%d][D=%d] %s", batch, g.num_kv_heads, g.head_dim, kernels::dtype_name(g.dtype));
  };
  auto q_layout = [&] { return absl::StrFormat("[B=%d][Hq=%d][D=%d] fp32", batch, g.num_q_heads, g.head_dim); };
  if (auto s = check_size("k", k.size(), step_kv_bytes(batch), kv_layout); !s.ok()) return s;
  if (auto s = check_size("v", v.size(), step_kv_bytes(batch), kv_layout); !s.ok()) return s;
  if (auto s = check_size("q", q.size(), q_bytes(batch), q_layout); !s.ok()) return s;
  if (auto s = check_size("out", out.size(), q_bytes(batch), q_layout); !s.ok()) return s;

  absl::MutexLock lock(&mu_);
  auto session = sessions_->find(session_id);
  if (!session.ok()) return session.status();
  std::vector<Sequence*> seqs;
  seqs.reserve(batch);
  absl::flat_hash_set<uint64_t> seen;
  int32_t need = 0;
  for (uint64_t id : sequence_ids) {
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", id, " appears twice in one Step"));
    }
    auto found = sessions_->find_sequence(**session, id);
    if (!found.ok()) return found.status();
    Sequence& seq = **found;
    if (layer == 0) {
      need += store_->blocks_needed(seq, seq.length + 1);
      auto prompt_blocks = compactor_->step_blocks(seq);
      if (!prompt_blocks.ok()) return prompt_blocks.status();
      need += *prompt_blocks;
    } else if (seq.pending_layer != layer) {
      return absl::FailedPreconditionError(
          seq.pending_layer < 0
              ? absl::StrCat("sequence ", id, " has no step in progress: a step starts at layer 0, got layer ", layer)
              : absl::StrCat("sequence ", id, " expects layer ", seq.pending_layer, " next, got layer ", layer));
    }
    seqs.push_back(&seq);
  }
  if (absl::Status s = sessions_->check_tenant_quota((*session)->tenant, need); !s.ok()) return s;
  // A batch is served whole: its priority is the highest of its sequences'.
  int32_t priority = seqs.front()->priority;
  for (const Sequence* seq : seqs) priority = std::max(priority, seq->priority);
  if (absl::Status s = sessions_->make_room_for(need, priority, seqs, absl::StrCat("Step over ", batch, " sequences"));
      !s.ok()) {
    return s;
  }
  for (Sequence* seq : seqs) seq->last_used = ++use_clock_;
  if (layer == 0) {
    // Policy state first, before anything is fixed: memory it cannot have refuses the Step with
    // every sequence as it was (a first Step's prefill compaction only shortens the cache, so the
    // second call below has room already).
    for (Sequence* seq : seqs) {
      if (absl::Status s = compactor_->on_grow(*seq, seq->length + 1); !s.ok()) return s;
    }
    for (Sequence* seq : seqs) {
      if (!seq->decoding) {
        if (absl::Status s = compactor_->begin_decode(*seq); !s.ok()) return s;
      }
      if (absl::Status s = store_->reserve(*seq, seq->length + 1); !s.ok()) return s;  // counted above
      if (absl::Status s = compactor_->on_grow(*seq, seq->length + 1); !s.ok()) return s;
      seq->step_started = started;
    }
  }
  DeferredWaits deferred(*backend_, stream_ordered);
  if (absl::Status s = store_->write_step(seqs, static_cast<int>(layer), k, v); !s.ok()) return s;
  const float* qf = reinterpret_cast<const float*>(q.data());
  float* of = reinterpret_cast<float*>(out.data());
  const float step_scale = effective_scale(scale, g.head_dim);
  const Observers observers = compactor_->observers(seqs, static_cast<int>(layer), step_scale);
  if (absl::Status s = store_->decode_attention(seqs, static_cast<int>(layer), qf, of, step_scale, observers);
      !s.ok()) {
    return s;
  }
  const size_t row = g.q_token_elems();
  bool keeps_queries = false;
  for (const Sequence* seq : seqs) keeps_queries |= compactor_->keeps_step_queries(*seq);
  std::vector<float> host_q;
  auto host_qf = host_floats(q, keeps_queries, &host_q);
  if (!host_qf.ok()) return host_qf.status();
  for (size_t i = 0; i < batch; ++i) {
    Sequence& seq = *seqs[i];
    if (compactor_->keeps_step_queries(seq)) {
      std::memcpy(store_->query_entry(seq, seq.length, compactor_->query_capacity_hint(seq)) + size_t(layer) * row,
                  *host_qf + i * row, row * 4);
    }
  }
  StepResult result;
  if (layer + 1 < g.num_layers) {
    if (absl::Status s = deferred.finish(); !s.ok()) return s;
    for (Sequence* seq : seqs) seq->pending_layer = static_cast<int32_t>(layer) + 1;
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
    compactor_->on_step(*seq);
    compactor_->trim_queries(*seq);
    compactor_->quantize_aged(*seq);
  }
  ++decode_steps_;
  decode_tokens_ += batch;
  result.decode_step = decode_steps_;
  result.compactions = compactor_->run_scheduler(seqs);
  if (absl::Status s = deferred.finish(); !s.ok()) return s;
  // The reply follows the scheduler, so the step's compactions count in its latency.
  const auto finished = std::chrono::steady_clock::now();
  result.step_seconds = std::chrono::duration<double>(finished - earliest).count();
  for (const auto& t : first_appends) {
    result.first_step_seconds.push_back(std::chrono::duration<double>(finished - t).count());
  }
  return result;
}

absl::Status Core::attend(const std::string& session_id, uint64_t sequence_id, int64_t layer, int64_t num_queries,
                          ConstBytes q, MutableBytes out, float scale, bool stream_ordered) {
  const Geometry& g = config_.geometry;
  if (absl::Status s = check_layer(layer, g); !s.ok()) return s;
  if (num_queries < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_queries is ", num_queries, ", expected >= 1"));
  }
  if (num_queries > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_queries ", num_queries, " is out of range, expected 1..", INT32_MAX));
  }
  if (absl::Status s = check_scale(scale); !s.ok()) return s;
  auto layout = [&] { return absl::StrFormat("[N=%d][Hq=%d][D=%d] fp32", num_queries, g.num_q_heads, g.head_dim); };
  if (auto s = check_size("q", q.size(), q_bytes(num_queries), layout); !s.ok()) return s;
  if (auto s = check_size("out", out.size(), q_bytes(num_queries), layout); !s.ok()) return s;

  absl::MutexLock lock(&mu_);
  auto session = sessions_->find(session_id);
  if (!session.ok()) return session.status();
  auto found = sessions_->find_sequence(**session, sequence_id);
  if (!found.ok()) return found.status();
  const Sequence& seq = **found;
  if (seq.pending_layer >= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", sequence_id, " is in the middle of a step; finish it before Attend"));
  }
  if (num_queries > seq.length) {
    return absl::InvalidArgumentError(absl::StrCat("num_queries ", num_queries, " exceeds the ", seq.length,
                                                   " tokens cached in sequence ", sequence_id));
  }
  if (num_queries > seq.fp_length()) {
    return absl::InvalidArgumentError(absl::StrCat("num_queries ", num_queries, " exceeds the ", seq.fp_length(),
                                                   " unquantized tokens of sequence ", sequence_id,
                                                   " (queries must sit in the full-precision window)"));
  }
  DeferredWaits deferred(*backend_, stream_ordered);
  if (absl::Status s = store_->attend(seq, static_cast<int>(layer), static_cast<int32_t>(num_queries),
                                      reinterpret_cast<const float*>(q.data()), reinterpret_cast<float*>(out.data()),
                                      effective_scale(scale, g.head_dim));
      !s.ok()) {
    return s;
  }
  return deferred.finish();
}

absl::StatusOr<int32_t> Core::read_kv(const std::string& session_id, uint64_t sequence_id,
                                      absl::FunctionRef<absl::StatusOr<ReadKVTargets>(int32_t)> targets) {
  absl::MutexLock lock(&mu_);
  auto session = sessions_->find(session_id);
  if (!session.ok()) return session.status();
  auto found = sessions_->find_sequence(**session, sequence_id);
  if (!found.ok()) return found.status();
  return store_->read_kv(**found, targets);
}

// ---- compaction and introspection ----

absl::StatusOr<std::vector<CompactionResult>> Core::compact(const std::string& session_id, uint64_t sequence_id,
                                                            bool dry_run) {
  absl::MutexLock lock(&mu_);
  auto session = sessions_->find(session_id);
  if (!session.ok()) return session.status();
  std::vector<Sequence*> targets;
  if (sequence_id != 0) {
    auto found = sessions_->find_sequence(**session, sequence_id);
    if (!found.ok()) return found.status();
    targets.push_back(*found);
  } else {
    std::vector<uint64_t> ids((*session)->sequences.begin(), (*session)->sequences.end());
    std::sort(ids.begin(), ids.end());
    for (uint64_t id : ids) targets.push_back(store_->find(id));
  }
  std::vector<CompactionResult> out;
  for (Sequence* seq : targets) {
    auto r = compactor_->compact(*seq, dry_run);
    if (!r.ok()) return r.status();
    out.push_back(std::move(*r));
  }
  store_->trim_prefix_cache();
  return out;
}

absl::StatusOr<std::pair<SequenceInfo, std::vector<std::vector<int32_t>>>> Core::inspect(uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  const Sequence* seq = store_->find(sequence_id);
  if (seq == nullptr) return absl::NotFoundError(absl::StrCat("unknown sequence ", sequence_id));
  SequenceInfo info = store_->info_of(*seq);
  compactor_->describe(*seq, info);
  return std::make_pair(std::move(info), store_->positions_of(*seq));
}

void Core::set_event_observer(std::function<void(const CoreEvent&)> observer) {
  absl::MutexLock lock(&mu_);
  sessions_->set_event_observer(observer);
  compactor_->set_event_observer(std::move(observer));
}

bool Core::announce_device_fault() {
  const std::string fault = backend_->fault();
  if (fault.empty()) return false;
  if (fault_announced_.exchange(true)) return true;
  CoreEvent e;
  e.kind = CoreEvent::Kind::kDeviceFailed;
  e.message = fault;
  absl::MutexLock lock(&mu_);
  sessions_->announce(e);
  return true;
}

void Core::set_prefix_event_sink(PrefixEventSink* sink) {
  absl::MutexLock lock(&mu_);
  store_->set_prefix_event_sink(sink);
}

void Core::set_prefix_tier(PrefixTier* tier) {
  absl::MutexLock lock(&mu_);
  store_->set_prefix_tier_sink(tier);
  tier_.store(tier);
}

TierBlockSource Core::tier_block_source() {
  TierBlockSource source;
  const char* pool = nullptr;  // the pool never moves: its base, read once (null: device memory)
  {
    absl::MutexLock lock(&mu_);
    pool = store_->host_block(0);
  }
  const size_t block_bytes = config_.geometry.block_bytes();
  source.host_block = [pool, block_bytes](int32_t block) -> const char* {
    return pool == nullptr ? nullptr : pool + size_t(block) * block_bytes;  // pinned: read unlocked
  };
  source.copy_block = [this](int32_t block) {
    absl::MutexLock lock(&mu_);
    return store_->copy_block(block);
  };
  source.unpin = [this](const std::vector<int32_t>& blocks) {
    absl::MutexLock lock(&mu_);
    for (int32_t b : blocks) store_->unpin_for_tier(b);
  };
  return source;
}

void Core::set_compaction_observer(std::function<void(const CompactionResult&)> observer) {
  absl::MutexLock lock(&mu_);
  compactor_->set_compaction_observer(std::move(observer));
}

CoreStats Core::stats() const {
  absl::MutexLock lock(&mu_);
  CoreStats s;
  store_->fill_stats(s);
  compactor_->fill_stats(s);
  s.sessions = static_cast<int32_t>(sessions_->size());
  s.decode_steps = decode_steps_;
  s.decode_tokens = decode_tokens_;
  s.lease_expiries = sessions_->lease_expiries();
  s.preemptions = sessions_->preemptions();
  s.tenant_blocks = sessions_->blocks_by_tenant();
  return s;
}

absl::StatusOr<std::vector<SequenceInfo>> Core::list_session_sequences(const std::string& session_id) const {
  absl::MutexLock lock(&mu_);
  if (!sessions_->contains(session_id)) return unknown_session(session_id);
  return list_locked(session_id);
}

std::vector<SequenceInfo> Core::list_sequences(const std::string& session_id) const {
  absl::MutexLock lock(&mu_);
  return list_locked(session_id);
}

std::vector<SequenceInfo> Core::list_locked(const std::string& session_id) const {
  std::vector<SequenceInfo> out;
  for (const auto& [id, seq] : store_->sequences()) {
    if (!session_id.empty() && seq.session_id != session_id) continue;
    SequenceInfo info = store_->info_of(seq);
    compactor_->describe(seq, info);
    out.push_back(std::move(info));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  return out;
}

absl::Status Core::check_invariants() const {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, seq] : store_->sequences()) {
    if (!sessions_->contains(seq.session_id)) {
      return absl::InternalError(absl::StrCat("sequence ", id, " outlived its session"));
    }
  }
  return store_->check_invariants();
}

}  // namespace karakv::server
