// Sessions: who is attached (worker, tenant, cache namespace), their leases and staging regions,
// the limits on sessions, sequences and tenant blocks, and preemption under pool pressure. It owns
// which sequences each session holds; the blocks behind them are the sequence store's. Not
// thread-safe: the core calls it under its lock.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/core_types.h"
#include "server/sequence_store.h"
#include "server/device_staging.h"
#include "server/staging.h"

namespace karakv::server {

struct SessionLimits {
  absl::Duration lease = absl::Seconds(30);
  uint64_t max_staging_bytes = 1ull << 30;
  // Attach may name a cache namespace other than its tenant (sharing prompts across tenants).
  bool prefix_cache_shared_namespaces = false;
  // 0: no limit. Sessions attached at once; sequences one session holds at once; block-table
  // entries the sequences of one tenant hold (a block shared by two of its sequences counts twice).
  int max_sessions = 0;
  int max_sequences_per_session = 0;
  int64_t tenant_block_quota = 0;
  // Preempt lower-priority sequences instead of refusing a request the pool cannot hold.
  bool preempt_on_pressure = false;
  // Attach may send a worker event (stream-ordered device staging, --stream_ordered_staging).
  bool stream_ordered_staging = false;
};

struct Session {
  std::string id;
  std::string worker_id;
  std::string tenant;
  std::string cache_namespace;
  std::string model_fingerprint;  // from Attach; empty: the session does not use the prefix tier
  std::shared_ptr<Staging> staging;  // shm (StagingRegion) or device (DeviceStaging), or none
  // Device staging with the fast path: the shared memory the rings live in (with shm staging they
  // live in the staging region's reserved tail, and this is null).
  std::shared_ptr<StagingRegion> rings;
  absl::Time lease_deadline;
  absl::flat_hash_set<uint64_t> sequences;
  absl::flat_hash_set<uint64_t> preempted;  // its sequences preempted and not yet released
};

class SessionTable {
 public:
  // device_staging: where device staging regions come from (null: every device staging request is
  // refused); it must outlive the table.
  SessionTable(const SessionLimits& limits, SequenceStore& store, DeviceStagingPool* device_staging = nullptr);

  const SessionLimits& limits() const { return limits_; }

  // A new session's id, namespace and staging region, made outside the core's lock (creating the
  // region touches /dev/shm); add() then admits it.
  struct Admission {
    AttachResult result;
    Session session;
  };
  // An admission that will not be added (the session refused): its worker never saw the device
  // region, so it may go to the tenant's next session instead of quarantine.
  static void release_unseen(Admission& admission);
  absl::StatusOr<Admission> prepare(const std::string& worker_id, const std::string& tenant, uint64_t staging_bytes,
                                    const std::string& cache_namespace, uint64_t reserved_bytes,
                                    StagingKind staging_kind = StagingKind::kShm,
                                    const std::string& worker_event_handle = "") const;
  // RESOURCE_EXHAUSTED at --max_sessions.
  absl::Status add(Admission admission);

  absl::StatusOr<Session*> find(const std::string& session_id);
  bool contains(const std::string& session_id) const { return sessions_.contains(session_id); }
  size_t size() const { return sessions_.size(); }
  // Block-table entries per tenant, for every tenant with an attached session (CoreStats::tenant_blocks).
  std::map<std::string, int64_t> blocks_by_tenant() const;
  void renew(Session& session) { session.lease_deadline = absl::Now() + limits_.lease; }
  // Ends the session, erasing its sequences from the store; tells its event watchers why.
  void end(const std::string& session_id, bool lease_expired);
  // Ends every session whose lease ended before `now`; returns how many.
  int expire(absl::Time now);

  // A sequence of the session's tenant: NOT_FOUND when unknown, PERMISSION_DENIED when another
  // tenant's, FAILED_PRECONDITION (the reason) when preempted.
  absl::StatusOr<Sequence*> find_sequence(const Session& session, uint64_t sequence_id);
  // Records a new (or forked) sequence as the session's.
  void adopt(Session& session, uint64_t sequence_id) { session.sequences.insert(sequence_id); }
  // ReleaseSequence: frees it (or forgets its preemption); returns the blocks freed.
  absl::StatusOr<int> release(Session& session, uint64_t sequence_id);

  // Limits: RESOURCE_EXHAUSTED naming the limit, the value asked and the flag that sets it.
  absl::Status check_sequence_limit(const Session& session) const;
  absl::Status check_tenant_quota(const std::string& tenant, int64_t wanted) const;
  // The store's make_room, then (with preempt_on_pressure) preemption of sequences of priority
  // below `priority` other than `served`. When even that cannot free `need` blocks it changes
  // nothing and returns RESOURCE_EXHAUSTED: `what` (the request) wanted `need` blocks, F free of T.
  absl::Status make_room_for(int32_t need, int32_t priority, absl::Span<Sequence* const> served,
                             const std::string& what);

  uint64_t lease_expiries() const { return lease_expiries_; }
  uint64_t preemptions() const { return preemptions_; }
  void set_event_observer(std::function<void(const CoreEvent&)> observer) { event_observer_ = std::move(observer); }
  // `e` to every session attached, each under its own id.
  void announce(CoreEvent e) {
    for (const auto& [id, session] : sessions_) {
      e.session_id = id;
      emit(e);
    }
  }

 private:
  // A preempted sequence, remembered until its owner releases it or the session ends, so that
  // calls on it say what happened instead of "unknown sequence".
  struct Tombstone {
    std::string session_id, tenant, reason;
  };
  void emit(const CoreEvent& e) {
    if (event_observer_) event_observer_(e);
  }
  // Block-table entries (full-precision and quantized) of the tenant's sequences.
  int64_t tenant_blocks(const std::string& tenant) const;

  const SessionLimits limits_;
  SequenceStore& store_;
  DeviceStagingPool* const device_staging_;
  absl::flat_hash_map<std::string, Session> sessions_;
  absl::flat_hash_map<uint64_t, Tombstone> preempted_;
  uint64_t lease_expiries_ = 0, preemptions_ = 0;
  std::function<void(const CoreEvent&)> event_observer_;
};

// NOT_FOUND for a session id that is not attached.
absl::Status unknown_session(const std::string& session_id);

}  // namespace karakv::server
