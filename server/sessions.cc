// Sessions, leases, limits and preemption.
#include "server/sessions.h"

#include <algorithm>
#include <random>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace karakv::server {
namespace {

std::string new_session_id() {
  std::random_device rd;  // session ids double as capabilities: never sequential
  return absl::StrFormat("s-%08x%08x%08x", rd(), rd(), rd());
}

}  // namespace

absl::Status unknown_session(const std::string& session_id) {
  return absl::NotFoundError(
      absl::StrCat("unknown session '", session_id, "' (never attached, detached, or its lease expired)"));
}

SessionTable::SessionTable(const SessionLimits& limits, SequenceStore& store, DeviceStagingPool* device_staging)
    : limits_(limits), store_(store), device_staging_(device_staging) {}

void SessionTable::release_unseen(Admission& admission) {
  if (admission.session.staging != nullptr && admission.session.staging->on_device()) {
    static_cast<DeviceStaging&>(*admission.session.staging).mark_importer_closed();
  }
}

absl::StatusOr<SessionTable::Admission> SessionTable::prepare(const std::string& worker_id, const std::string& tenant,
                                                              uint64_t staging_bytes,
                                                              const std::string& cache_namespace,
                                                              uint64_t reserved_bytes,
                                                              StagingKind staging_kind,
                                                              const std::string& worker_event_handle) const {
  if (!cache_namespace.empty() && !limits_.prefix_cache_shared_namespaces) {
    return absl::PermissionDeniedError(absl::StrCat(
        "cache_namespace '", cache_namespace, "' asked for, but this daemon keeps each tenant's cached prompts "
        "private; leave cache_namespace empty, or start karakvd with --prefix_cache_shared_namespaces"));
  }
  if (staging_bytes > limits_.max_staging_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("staging_bytes ", staging_bytes, " exceeds the daemon's limit of ",
                                                   limits_.max_staging_bytes,
                                                   " (karakvd --max_staging_bytes); ask for less"));
  }
  if (!worker_event_handle.empty() && staging_kind == StagingKind::kShm) {
    return absl::InvalidArgumentError(
        "worker_event_ipc_handle orders device staging by CUDA events; with SHM staging there is no device work "
        "to order: attach with staging_kind CUDA_IPC or CUDA_VMM_FD, or without the event");
  }
  if (!worker_event_handle.empty() && !limits_.stream_ordered_staging) {
    return absl::FailedPreconditionError(
        "worker_event_ipc_handle: this karakvd orders device staging by host waits only; attach without the event "
        "(ClientOptions::stream_ordered = false), or start karakvd with --stream_ordered_staging (trusted workers "
        "only: its one stream then waits on each such worker's event)");
  }
  Admission a;
  if (staging_kind != StagingKind::kShm) {
    if (staging_kind != StagingKind::kCudaIpc && staging_kind != StagingKind::kCudaVmmFd) {
      return absl::InvalidArgumentError(absl::StrCat(
          "staging_kind ", staging_kind_name(staging_kind), " is not served by this karakvd; use CUDA_IPC, CUDA_VMM_FD or SHM"));
    }
    if (device_staging_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("staging_kind ", staging_kind_name(staging_kind),
                                                        ": this daemon has no device staging; use SHM"));
    }
    if (staging_bytes == 0) {
      return absl::InvalidArgumentError(absl::StrCat("staging_kind ", staging_kind_name(staging_kind),
                                                     " needs a staging region: set staging_bytes > 0"));
    }
    auto region = device_staging_->acquire(staging_bytes, tenant, staging_kind);
    if (!region.ok()) return region.status();
    DeviceStaging& r = **region;
    a.session.staging = std::move(*region);
    if (!worker_event_handle.empty()) {
      if (absl::Status s = r.order_by_events(worker_event_handle); !s.ok()) {
        release_unseen(a);
        return s;
      }
      a.result.staging_event_ipc_handle = r.event_ipc_handle();
    }
    a.result.staging_bytes = r.size();
    a.result.staging_ipc_handle = r.ipc_handle();
    a.result.staging_device = r.device();
    a.result.staging_generation = r.generation();
    if (reserved_bytes > 0) {
      // The fast path's rings: host shared memory of their own (the worker maps it by name); the
      // commands' tensors stay in the device region.
      auto rings = StagingRegion::create(0, reserved_bytes);
      if (!rings.ok()) {
        release_unseen(a);
        return rings.status();
      }
      a.result.staging_name = (*rings)->name();
      a.session.rings = std::move(*rings);
    }
  } else if (staging_bytes > 0) {
    auto region = StagingRegion::create(staging_bytes, reserved_bytes);
    if (!region.ok()) return region.status();
    a.result.staging_name = (*region)->name();
    a.result.staging_bytes = (*region)->size();
    a.session.staging = std::move(*region);
  }
  a.result.session_id = new_session_id();
  // Distinct prefixes: a named namespace can never be a tenant's private one.
  a.result.cache_namespace = cache_namespace.empty() ? absl::StrCat("tenant:", tenant)
                                                     : absl::StrCat("shared:", cache_namespace);
  a.session.id = a.result.session_id;
  a.session.worker_id = worker_id;
  a.session.tenant = tenant;
  a.session.cache_namespace = a.result.cache_namespace;
  return a;
}

absl::Status SessionTable::add(Admission admission) {
  if (limits_.max_sessions > 0 && static_cast<int64_t>(sessions_.size()) >= limits_.max_sessions) {
    // The staging region made by prepare() unmaps and unlinks as `admission` goes out of scope; a
    // device region its worker never saw goes back for reuse.
    release_unseen(admission);
    return absl::ResourceExhaustedError(absl::StrCat(
        "session limit reached: ", sessions_.size(), " sessions attached, limit ", limits_.max_sessions,
        ", wanted 1 more (karakvd --max_sessions); detach a session or raise the limit"));
  }
  Session& s = sessions_[admission.session.id];
  s = std::move(admission.session);
  renew(s);
  return absl::OkStatus();
}

absl::StatusOr<Session*> SessionTable::find(const std::string& session_id) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return unknown_session(session_id);
  return &it->second;
}

void SessionTable::end(const std::string& session_id, bool lease_expired) {
  auto it = sessions_.find(session_id);
  for (uint64_t id : it->second.sequences) store_.erase(id);
  for (uint64_t id : it->second.preempted) preempted_.erase(id);
  CoreEvent e;
  e.kind = CoreEvent::Kind::kSessionEnded;
  e.session_id = session_id;
  e.sequences_released = static_cast<int32_t>(it->second.sequences.size());
  e.lease_expired = lease_expired;
  e.message = lease_expired
                  ? absl::StrCat("lease expired: no Heartbeat for ", absl::FormatDuration(limits_.lease),
                                 "; the session's ", e.sequences_released, " sequences and staging were freed")
                  : absl::StrCat("detached; the session's ", e.sequences_released, " sequences were freed");
  // The SDK closes a device region's mapping before it sends Detach; after a lease expiry the worker
  // may still hold it, and the region is quarantined instead of reused (device_staging.h).
  if (!lease_expired && it->second.staging != nullptr && it->second.staging->on_device()) {
    static_cast<DeviceStaging&>(*it->second.staging).mark_importer_closed();
  }
  sessions_.erase(it);  // drops our reference to the staging region; it unmaps when unused
  emit(e);
}

int SessionTable::expire(absl::Time now) {
  std::vector<std::string> expired;
  for (const auto& [id, s] : sessions_) {
    if (s.lease_deadline < now) expired.push_back(id);
  }
  for (const auto& id : expired) end(id, true);
  lease_expiries_ += expired.size();
  return static_cast<int>(expired.size());
}

absl::StatusOr<Sequence*> SessionTable::find_sequence(const Session& session, uint64_t sequence_id) {
  Sequence* seq = store_.find(sequence_id);
  if (seq == nullptr) {
    if (auto t = preempted_.find(sequence_id); t != preempted_.end()) {
      if (t->second.tenant != session.tenant) {
        return absl::PermissionDeniedError(absl::StrCat("sequence ", sequence_id, " belongs to another tenant"));
      }
      return absl::FailedPreconditionError(t->second.reason);
    }
    return absl::NotFoundError(absl::StrCat("unknown sequence ", sequence_id));
  }
  if (seq->tenant != session.tenant) {
    return absl::PermissionDeniedError(absl::StrCat("sequence ", sequence_id, " belongs to another tenant"));
  }
  return seq;
}

absl::StatusOr<int> SessionTable::release(Session& session, uint64_t sequence_id) {
  if (auto t = preempted_.find(sequence_id); t != preempted_.end() && t->second.tenant == session.tenant) {
    // The owner acknowledges the preemption: its blocks went back to the pool then.
    if (auto owner = sessions_.find(t->second.session_id); owner != sessions_.end()) {
      owner->second.preempted.erase(sequence_id);
    }
    preempted_.erase(t);
    return 0;
  }
  auto seq = find_sequence(session, sequence_id);
  if (!seq.ok()) return seq.status();
  if (auto owner = sessions_.find((*seq)->session_id); owner != sessions_.end()) {
    owner->second.sequences.erase(sequence_id);
  }
  return store_.erase(sequence_id);
}

absl::Status SessionTable::check_sequence_limit(const Session& session) const {
  if (limits_.max_sequences_per_session > 0 &&
      static_cast<int64_t>(session.sequences.size()) >= limits_.max_sequences_per_session) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequence limit reached: session ", session.id, " holds ", session.sequences.size(),
        " sequences, limit ", limits_.max_sequences_per_session,
        ", wanted 1 more (karakvd --max_sequences_per_session); release a sequence or raise the limit"));
  }
  return absl::OkStatus();
}

int64_t SessionTable::tenant_blocks(const std::string& tenant) const {
  int64_t n = 0;
  for (const auto& [id, seq] : store_.sequences()) {
    if (seq.tenant == tenant) n += static_cast<int64_t>(seq.blocks.size() + seq.qblocks.size());
  }
  return n;
}

std::map<std::string, int64_t> SessionTable::blocks_by_tenant() const {
  std::map<std::string, int64_t> out;
  for (const auto& [id, session] : sessions_) out.emplace(session.tenant, 0);
  for (const auto& [id, seq] : store_.sequences()) {
    auto it = out.find(seq.tenant);
    if (it != out.end()) it->second += static_cast<int64_t>(seq.blocks.size() + seq.qblocks.size());
  }
  return out;
}

absl::Status SessionTable::check_tenant_quota(const std::string& tenant, int64_t wanted) const {
  if (limits_.tenant_block_quota <= 0 || wanted <= 0) return absl::OkStatus();
  const int64_t held = tenant_blocks(tenant);
  if (held + wanted > limits_.tenant_block_quota) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant ", tenant, " holds ", held, " blocks, quota ", limits_.tenant_block_quota, ", wanted ", wanted,
        " (karakvd --tenant_block_quota); release or compact sequences of this tenant, or raise the quota"));
  }
  return absl::OkStatus();
}

absl::Status SessionTable::make_room_for(int32_t need, int32_t priority, absl::Span<Sequence* const> served,
                                         const std::string& what) {
  if (store_.make_room(need)) return absl::OkStatus();
  const BlockPool& pool = store_.pool();
  const int32_t free_before = pool.free_count();
  auto refusal = [&](const std::string& extra) {
    return absl::ResourceExhaustedError(absl::StrCat("KV pool full: ", what, " wanted ", need, " blocks, ",
                                                     free_before, " free of ", pool.total(), extra));
  };
  if (!limits_.preempt_on_pressure) return refusal("");
  // Candidates: every other sequence of lower priority, lowest first, least recently used among equals.
  absl::flat_hash_set<const Sequence*> keep(served.begin(), served.end());
  std::vector<Sequence*> candidates;
  for (auto& [id, seq] : store_.sequences()) {
    if (seq.priority < priority && !keep.contains(&seq)) candidates.push_back(&seq);
  }
  std::sort(candidates.begin(), candidates.end(), [](const Sequence* a, const Sequence* b) {
    return std::tie(a->priority, a->last_used, a->id) < std::tie(b->priority, b->last_used, b->id);
  });
  // Count what releasing each in turn would give back: a block whose last holder goes, or a cached
  // prompt block left held by the cache alone (then evictable).
  const std::vector<int32_t> cached_list = store_.cached_blocks();
  const absl::flat_hash_set<int32_t> cached(cached_list.begin(), cached_list.end());
  absl::flat_hash_map<int32_t, int32_t> dropped;
  int32_t available = pool.free_count() + store_.unused_cached_blocks();
  size_t victims = 0;
  while (available < need && victims < candidates.size()) {
    const Sequence* v = candidates[victims++];
    for (const std::vector<int32_t>* table : {&v->blocks, &v->qblocks}) {
      for (int32_t b : *table) {
        const int32_t left = pool.refcount(b) - ++dropped[b];
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
    CoreEvent e;
    e.kind = CoreEvent::Kind::kPreempted;
    e.session_id = v.session_id;
    e.sequence_id = v.id;
    e.priority = v.priority;
    e.tokens = v.length;
    e.message = absl::StrCat(
        "sequence ", v.id, " (priority ", v.priority, ") was preempted to free blocks for a higher-priority request: ",
        what, " (priority ", priority, ") wanted ", need, " blocks, ", free_before, " free of ", pool.total(),
        "; lower priority numbers go first, the least recently used among equals (karakvd --preempt_on_pressure). "
        "Its K/V is gone: release it and re-prefill");
    if (auto owner = sessions_.find(v.session_id); owner != sessions_.end()) {
      owner->second.sequences.erase(v.id);
      owner->second.preempted.insert(v.id);
    }
    preempted_[v.id] = Tombstone{v.session_id, v.tenant, e.message};
    e.blocks_freed = store_.erase(v.id);
    ++preemptions_;
    emit(e);
  }
  if (!store_.make_room(need)) return absl::InternalError("preemption freed fewer blocks than it counted");
  return absl::OkStatus();
}

}  // namespace karakv::server
