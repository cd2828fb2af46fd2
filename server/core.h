// The daemon's core: one lock over the three owners of its state, called in order.
//   SessionTable   (sessions.h)       sessions, leases, staging, limits, preemption
//   SequenceStore  (sequence_store.h) the pool, block tables, prefix cache and the data path
//   Compactor      (compaction.h)     policies, their per-sequence state, the scheduler
// Sessions and the compactor use the store; the store uses neither. Every operation validates
// completely (server/validation.h) before it changes anything, so a refused request leaves no
// trace. Transports (service.cc for gRPC, ring.cc for the shared-memory ring) call this and
// nothing below it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "karakv/kernels/backend.h"
#include "server/compaction.h"
#include "server/core_types.h"
#include "server/prefix_tier.h"
#include "server/sequence_store.h"
#include "server/sessions.h"
#include "server/device_staging.h"
#include "server/staging.h"
#include "server/validation.h"

namespace karakv::server {

struct CoreConfig {
  kernels::Geometry geometry;
  int64_t pool_bytes = 256ll << 20;
  absl::Duration lease = absl::Seconds(30);
  uint64_t max_staging_bytes = 1ull << 30;
  // Device staging (Attach staging_kind CUDA_IPC): GPU memory all sessions' regions together may
  // hold, including regions kept for reuse and those quarantined after a lease expiry.
  uint64_t max_device_staging_bytes = 8ull << 30;
  // Device staging sessions may order their requests by CUDA IPC events (--stream_ordered_staging).
  bool stream_ordered_staging = false;
  // The GPU VMM device staging regions (CUDA_VMM_FD) are created on: the backend's (--cuda_device).
  int cuda_device = 0;
  // Kara: at most this many sequences compress per tick, longest tail first (0: no limit).
  int max_sequences_per_tick = 0;
  // Prefix caching (docs/PREFIX_CACHE.md): full prompt blocks appended with token ids are indexed
  // by content and shared with later sequences of the same cache namespace.
  bool prefix_cache = true;
  // Watermark: cached blocks no sequence holds may fill at most this fraction of the pool; beyond
  // it the least recently used go at once. Below it they stay until an allocation needs the space.
  double prefix_cache_max_fraction = 1.0;
  // Attach may name a cache namespace other than its tenant (sharing prompts across tenants).
  bool prefix_cache_shared_namespaces = false;
  // Limits (0: none). Sessions attached at once; sequences one session holds at once; block-table
  // entries the sequences of one tenant hold (a block shared by two of its sequences counts twice).
  int max_sessions = 0;
  int max_sequences_per_session = 0;
  int64_t tenant_block_quota = 0;
  // Pool pressure: when an Append or Step needs more blocks than are free (after evicting unused
  // cached prompt blocks), preempt whole sequences of lower priority than the request's instead of
  // refusing it, lowest priority first, the least recently used among equals; their owners get a
  // kPreempted event. Off: the request is refused with RESOURCE_EXHAUSTED.
  bool preempt_on_pressure = false;
};

class Core {
 public:
  // Allocates the pool in backend memory; fails if the geometry is invalid or memory is short.
  static absl::StatusOr<std::unique_ptr<Core>> create(const CoreConfig& config,
                                                      std::unique_ptr<kernels::Backend> backend);
  ~Core();

  const kernels::Geometry& geometry() const { return config_.geometry; }
  const CoreConfig& config() const { return config_; }
  std::string_view backend_name() const { return backend_->name(); }
  // The calling thread's kernel state, made up front (Backend::prepare_thread); for threads that
  // will serve requests for a long time (the fast path's ring threads).
  void prepare_kernel_thread() { backend_->prepare_thread(); }

  // Sessions. A `worker_geometry` with every field zero means "whatever the daemon serves"; any
  // field set and every field is compared (validation.h, check_worker_geometry).
  // `reserved_bytes` follow the staging region in the same mapping, out of the requests' reach
  // (the fast path's rings). `worker_event_handle` (device staging only): the worker's
  // interprocess event, making the session stream-ordered (DeviceStaging::order_by_events).
  absl::StatusOr<AttachResult> attach(const std::string& worker_id, const std::string& tenant,
                                      uint64_t staging_bytes,
                                      const kernels::Geometry& worker_geometry,
                                      const std::string& cache_namespace = "",
                                      uint64_t reserved_bytes = 0, StagingKind staging_kind = StagingKind::kShm,
                                      const std::string& model_fingerprint = "",
                                      const std::string& worker_event_handle = "");
  absl::StatusOr<int> detach(const std::string& session_id);
  absl::Status heartbeat(const std::string& session_id);
  // The session's staging region, kept alive by the returned pointer even if the session ends.
  absl::StatusOr<std::shared_ptr<Staging>> staging(const std::string& session_id);
  // The fast path's regions: the staging its commands' tensors are in, and the shared memory whose
  // reserved tail holds the rings (the same shm region, or device staging's rings-only region).
  struct RingRegions {
    std::shared_ptr<Staging> data;
    std::shared_ptr<StagingRegion> rings;
  };
  absl::StatusOr<RingRegions> ring_regions(const std::string& session_id);
  // The staging fd socket's lookup: the session's VMM device staging region when `generation` is
  // its generation. NOT_FOUND for an unknown session, FAILED_PRECONDITION for another staging kind
  // or a stale generation, each saying so.
  absl::StatusOr<std::shared_ptr<DeviceStaging>> vmm_staging(const std::string& session_id, uint64_t generation);
  // Bytes of GPU memory held for device staging (live, kept for reuse, quarantined).
  size_t device_staging_bytes() const { return device_staging_->bytes_held(); }
  // Whether `p` is the backend's device memory (a device staging pointer), never to be read on the host.
  bool is_device_memory(const void* p) const { return backend_->is_device_memory(p); }
  // Frees every session whose lease ended before `now`; returns how many.
  int expire_leases(absl::Time now);

  // Sequences.
  absl::StatusOr<uint64_t> create_sequence(const std::string& session_id, const SequenceOptions& options);
  // The same, also returning how many leading tokens came from the prefix cache.
  absl::StatusOr<std::pair<uint64_t, int32_t>> create_sequence_from_prefix(const std::string& session_id,
                                                                          const SequenceOptions& options);
  // How many leading tokens of `token_ids` (whole blocks) the session's cache namespace holds.
  absl::StatusOr<int32_t> lookup_prefix(const std::string& session_id, absl::Span<const int32_t> token_ids);
  absl::StatusOr<uint64_t> fork_sequence(const std::string& session_id, uint64_t parent_id);
  absl::StatusOr<int> release_sequence(const std::string& session_id, uint64_t sequence_id);

  //   k, v: [L][T][Hk][D] storage dtype; q (optional): [L][Nq][Hq][D] fp32, the queries of the
  // last Nq tokens. Returns the new resident length.
  //   token_ids (optional): [T] the appended tokens' ids; full prompt blocks with ids are published
  // to the prefix cache.
  //   The counts are taken as sent (64 bits, so a wire value of 2^32 - 1 is refused as itself, never
  // as -1): num_tokens 1..kMaxAppendTokens, num_query_tokens 0..num_tokens.
  static constexpr int64_t kMaxAppendTokens = INT32_MAX / 2;
  absl::StatusOr<int32_t> append(const std::string& session_id, uint64_t sequence_id,
                                 int64_t num_tokens, ConstBytes k, ConstBytes v, ConstBytes q = {},
                                 int64_t num_query_tokens = 0, absl::Span<const int32_t> token_ids = {});
  struct StepResult {
    uint64_t decode_step = 0;
    int compactions = 0;
    // Set when this call completed a decode step (last layer): seconds since the batch's earliest
    // layer-0 Step began (the worker's compute between layers included), and, for each sequence
    // whose first decode step this was, seconds since its first Append (TTFT as the daemon sees it).
    double step_seconds = 0;
    std::vector<double> first_step_seconds;
  };
  //   k, v: [B][Hk][D] storage dtype; q: [B][Hq][D] fp32; out: [B][Hq][D] fp32.
  // When this completes a decode step (last layer), the scheduler runs: threshold policies of the
  // batch's sequences, then periodic policies (Kara's tick) over every sequence.
  // The step's kernels queue without waiting for each other (backend.h, set_deferred) and the host
  // waits once at the end, so `out` is complete on return; with stream_ordered (a session whose
  // device staging is ordered by events, staging.h) it does not wait at all: the caller records
  // the daemon's event after the call and the worker's stream waits on it.
  absl::StatusOr<StepResult> step(const std::string& session_id, int64_t layer,
                                  absl::Span<const uint64_t> sequence_ids, ConstBytes k, ConstBytes v,
                                  ConstBytes q, MutableBytes out, float scale, bool stream_ordered = false);
  //   q, out: [N][Hq][D] fp32; stream_ordered as for step().
  absl::Status attend(const std::string& session_id, uint64_t sequence_id, int64_t layer,
                      int64_t num_queries, ConstBytes q, MutableBytes out, float scale,
                      bool stream_ordered = false);
  // Calls `targets(T)` under the lock to learn where to write T tokens, then copies them there.
  absl::StatusOr<int32_t> read_kv(
      const std::string& session_id, uint64_t sequence_id,
      absl::FunctionRef<absl::StatusOr<ReadKVTargets>(int32_t num_tokens)> targets);

  // Runs the policy of one sequence (or, with id 0, of every sequence of the session) now.
  absl::StatusOr<std::vector<CompactionResult>> compact(const std::string& session_id, uint64_t sequence_id,
                                                        bool dry_run);
  // A sequence's info and resident positions ([L * Hk] rows), without a session: operator view.
  absl::StatusOr<std::pair<SequenceInfo, std::vector<std::vector<int32_t>>>> inspect(uint64_t sequence_id);
  // Called, under the core's lock, after every compaction that ran (for metrics).
  void set_compaction_observer(std::function<void(const CompactionResult&)> observer);
  // Called, under the core's lock, for every CoreEvent (preemption, compaction, session end).
  void set_event_observer(std::function<void(const CoreEvent&)> observer);
  // The backend's fault (Backend::fault): empty while it can serve. Once set, every request is
  // refused (RequestGate) and the daemon reports itself unhealthy; only a restart recovers.
  std::string device_fault() const { return backend_->fault(); }
  // Announces the fault to every session's event stream, once (later calls do nothing); false
  // when there is no fault.
  bool announce_device_fault();
  // The prefix cache's stores and removals go to `sink` (server/kv_events.h); it must outlive the
  // core or be unset (null) first.
  void set_prefix_event_sink(PrefixEventSink* sink);
  // The prefix tier shared across nodes (server/prefix_tier.h): published blocks of sessions with a
  // model fingerprint are written to it, and prefix lookups that miss locally ask it. It must
  // outlive the core or be unset (null) first.
  void set_prefix_tier(PrefixTier* tier);
  // How the tier's writer reaches the blocks the store pinned for it.
  TierBlockSource tier_block_source();
  // Whether the session exists now (WatchEvents checks it before subscribing).
  bool has_session(const std::string& session_id) const;

  CoreStats stats() const;
  // Empty session id lists every sequence.
  std::vector<SequenceInfo> list_sequences(const std::string& session_id) const;
  // The sequences of one session; NOT_FOUND when the session is gone (a worker must not read that
  // as an empty session of its own).
  absl::StatusOr<std::vector<SequenceInfo>> list_session_sequences(const std::string& session_id) const;
  // DESIGN.md's invariant: free + used == total, and every used block is held by exactly as many
  // sequence tables as its reference count says.
  absl::Status check_invariants() const;

  // Byte sizes of the tensors each call carries, for validation and for clients.
  size_t append_bytes(int32_t num_tokens) const;
  size_t step_kv_bytes(size_t batch) const;
  size_t q_bytes(size_t rows) const;

 private:
  Core(const CoreConfig& config, std::unique_ptr<kernels::Backend> backend);
  // `bytes` as host floats: themselves, or (device staging, when `needed`) a copy into `copy` made
  // through the backend. The query cache is host memory.
  absl::StatusOr<const float*> host_floats(ConstBytes bytes, bool needed, std::vector<float>* copy) const;
  std::vector<SequenceInfo> list_locked(const std::string& session_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Before a prefix lookup: asks the tier for the whole blocks of `token_ids` past the local
  // chain and indexes what it returns. Takes the lock only around the local parts.
  void fill_from_tier(const std::string& session_id, absl::Span<const int32_t> token_ids) ABSL_LOCKS_EXCLUDED(mu_);

  const CoreConfig config_;
  const std::unique_ptr<kernels::Backend> backend_;
  // Device staging regions; destroyed before the backend, after the sessions that hold regions.
  std::shared_ptr<DeviceStagingPool> device_staging_;

  mutable absl::Mutex mu_;
  std::unique_ptr<SequenceStore> store_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<SessionTable> sessions_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Compactor> compactor_ ABSL_GUARDED_BY(mu_);
  uint64_t decode_steps_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t decode_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t use_clock_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void(const CoreEvent&)> event_observer_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> fault_announced_{false};
  std::atomic<PrefixTier*> tier_{nullptr};
};

}  // namespace karakv::server
