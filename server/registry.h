// The daemon's state: sessions with leases and staging regions, sequences with block tables, and
// the pool they draw from. Every operation validates completely before it changes anything, so a
// refused request leaves no trace. One mutex serialises state changes and the kernels they run.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "karakv/kernels/backend.h"
#include "server/block_pool.h"
#include "server/policy.h"
#include "server/prefix_cache.h"
#include "server/staging.h"

namespace karakv::server {

struct RegistryConfig {
  kernels::Geometry geometry;
  int64_t pool_bytes = 256ll << 20;
  absl::Duration lease = absl::Seconds(30);
  uint64_t max_staging_bytes = 1ull << 30;
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

// What the event stream (WatchEvents) tells a session about its own sequences. Emitted under the
// registry's lock: observers must not block or call back into the registry.
struct RegistryEvent {
  enum class Kind { kPreempted, kCompaction, kSessionEnded };
  Kind kind = Kind::kCompaction;
  std::string session_id;
  uint64_t sequence_id = 0;
  // kPreempted: why (wanted vs free blocks, the request, the priority rule); kSessionEnded: why.
  std::string message;
  int32_t priority = 0;       // kPreempted: the victim's
  int32_t blocks_freed = 0;   // kPreempted: blocks that went back to the pool
  int32_t tokens = 0;         // kPreempted: resident tokens lost
  // kCompaction
  std::string policy;
  int32_t tokens_before = 0, tokens_after = 0;
  // kSessionEnded
  int32_t sequences_released = 0;
  bool lease_expired = false;
};

struct SequenceOptions {
  // "kara", or a policy with a storage format: "kara+kivi4". Formats: kivi2, kivi4, tq2, tq3, tq4.
  std::string policy = "none";
  // The storage format alone (same as the "+format" suffix); params["residual"] sets its
  // full-precision window (default 128 tokens).
  std::string storage;
  std::map<std::string, double> params;
  std::string prefill_policy;
  std::map<std::string, double> prefill_params;
  int32_t priority = 0;
  // Start from the longest cached prefix of these prompt token ids (whole blocks only).
  std::vector<int32_t> prefix_token_ids;
};

// One compaction, as the scheduler or the Compact RPC ran it (or would, for a dry run).
struct CompactionResult {
  uint64_t sequence_id = 0;
  std::string policy;
  int32_t tokens_before = 0, tokens_after = 0;
  std::string skipped;                       // non-empty: nothing was done, and why
  std::vector<std::vector<int32_t>> kept;    // dry run: [L * Hk] resident positions after
  double seconds = 0;
};

struct PolicyStats {
  int32_t sequences = 0;
  uint64_t resident_tokens = 0, logical_tokens = 0;
  uint64_t kv_bytes = 0, fp16_bytes = 0;  // actual compression ratio = fp16_bytes / kv_bytes
  double nominal_ratio = 1.0;
  uint64_t compactions = 0, tokens_removed = 0, failures = 0;
  double seconds = 0;
};

// Read-only input bytes and writable output bytes, already resolved by the service.
using ConstBytes = absl::Span<const uint8_t>;
using MutableBytes = absl::Span<uint8_t>;

struct AttachResult {
  std::string session_id;
  std::string cache_namespace;
  std::string staging_name;
  uint64_t staging_bytes = 0;
};

struct SequenceInfo {
  uint64_t id = 0;
  std::string session_id;
  std::string tenant;
  std::string policy;
  std::string prefill_policy;
  int32_t length = 0;          // resident
  int32_t logical_length = 0;  // ever appended
  std::string storage;         // "" (the daemon's dtype) or a quantized format
  int32_t quantized = 0;       // resident tokens held in quantized blocks
  int32_t quantized_blocks = 0;
  // docs/COMPRESSION.md section 4: bytes of the blocks the sequence holds (codes, scales, norms,
  // the full-precision window, partly filled blocks) and what its logical tokens take in fp16.
  uint64_t kv_bytes = 0, fp16_bytes = 0;
  double nominal_ratio = 1.0;  // of the storage format alone: 16 / bits
  int32_t prompt_length = 0;
  int32_t compactions = 0;
  int32_t blocks = 0;
  int32_t shared_blocks = 0;
  int32_t priority = 0;
  int32_t pending_layer = -1;
};

struct RegistryStats {
  int32_t blocks_total = 0;
  int32_t blocks_used = 0;
  int32_t blocks_free = 0;
  uint64_t resident_tokens = 0;
  int32_t sequences = 0;
  int32_t sessions = 0;
  uint64_t decode_steps = 0;
  uint64_t tokens_appended = 0;
  uint64_t decode_tokens = 0;  // tokens added by completed decode steps (one per sequence per step)
  uint64_t lease_expiries = 0;
  uint64_t preemptions = 0;    // sequences preempted on pool pressure (--preempt_on_pressure)
  uint64_t logical_tokens = 0;
  uint64_t query_cache_bytes = 0;
  uint64_t score_bytes = 0;
  std::map<std::string, PolicyStats> policies;
  // Prefix cache: lookups (Lookup calls and CreateSequence from a prefix), the tokens they asked
  // about and found, blocks indexed (of which no sequence holds `unused`), evictions.
  uint64_t prefix_lookups = 0, prefix_lookup_tokens = 0, prefix_hit_tokens = 0;
  int32_t prefix_cached_blocks = 0, prefix_unused_blocks = 0;
  uint64_t prefix_evictions = 0, prefix_published_blocks = 0;
};

// Where ReadKV writes, chosen by the caller once the token count is known.
struct ReadKVTargets {
  MutableBytes k, v, positions;
};

class Registry {
 public:
  // Allocates the pool in backend memory; fails if the geometry is invalid or memory is short.
  static absl::StatusOr<std::unique_ptr<Registry>> create(const RegistryConfig& config,
                                                          std::unique_ptr<kernels::Backend> backend);
  ~Registry();

  const kernels::Geometry& geometry() const { return config_.geometry; }
  const RegistryConfig& config() const { return config_; }
  std::string_view backend_name() const { return backend_->name(); }
  // The calling thread's kernel state, made up front (Backend::prepare_thread); for threads that
  // will serve requests for a long time (the fast path's ring threads).
  void prepare_kernel_thread() { backend_->prepare_thread(); }

  // Sessions. `worker_geometry` with num_layers == 0 means "whatever the daemon serves".
  // `reserved_bytes` follow the staging region in the same mapping, out of the requests' reach
  // (the fast path's rings).
  absl::StatusOr<AttachResult> attach(const std::string& worker_id, const std::string& tenant,
                                      uint64_t staging_bytes,
                                      const kernels::Geometry& worker_geometry,
                                      const std::string& cache_namespace = "",
                                      uint64_t reserved_bytes = 0);
  absl::StatusOr<int> detach(const std::string& session_id);
  absl::Status heartbeat(const std::string& session_id);
  // The session's staging region, kept alive by the returned pointer even if the session ends.
  absl::StatusOr<std::shared_ptr<StagingRegion>> staging(const std::string& session_id);
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
  absl::StatusOr<int32_t> append(const std::string& session_id, uint64_t sequence_id,
                                 int32_t num_tokens, ConstBytes k, ConstBytes v, ConstBytes q = {},
                                 int32_t num_query_tokens = 0, absl::Span<const int32_t> token_ids = {});
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
  // batch's sequences, then Kara's periodic tick over every sequence.
  absl::StatusOr<StepResult> step(const std::string& session_id, int32_t layer,
                                  absl::Span<const uint64_t> sequence_ids, ConstBytes k, ConstBytes v,
                                  ConstBytes q, MutableBytes out, float scale);
  //   q, out: [N][Hq][D] fp32
  absl::Status attend(const std::string& session_id, uint64_t sequence_id, int32_t layer,
                      int32_t num_queries, ConstBytes q, MutableBytes out, float scale);
  // Calls `targets(T)` under the lock to learn where to write T tokens, then copies them there.
  absl::StatusOr<int32_t> read_kv(
      const std::string& session_id, uint64_t sequence_id,
      absl::FunctionRef<absl::StatusOr<ReadKVTargets>(int32_t num_tokens)> targets);

  // Runs the policy of one sequence (or, with id 0, of every sequence of the session) now.
  absl::StatusOr<std::vector<CompactionResult>> compact(const std::string& session_id, uint64_t sequence_id,
                                                        bool dry_run);
  // A sequence's info and resident positions ([L * Hk] rows), without a session: operator view.
  absl::StatusOr<std::pair<SequenceInfo, std::vector<std::vector<int32_t>>>> inspect(uint64_t sequence_id);
  // Called, under the registry's lock, after every compaction that ran (for metrics).
  void set_compaction_observer(std::function<void(const CompactionResult&)> observer);
  // Called, under the registry's lock, for every RegistryEvent (preemption, compaction, session end).
  void set_event_observer(std::function<void(const RegistryEvent&)> observer);
  // Whether the session exists now (WatchEvents checks it before subscribing).
  bool has_session(const std::string& session_id) const;

  RegistryStats stats() const;
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
  struct Session {
    std::string id;
    std::string worker_id;
    std::string tenant;
    std::string cache_namespace;
    std::shared_ptr<StagingRegion> staging;
    absl::Time lease_deadline;
    absl::flat_hash_set<uint64_t> sequences;
    absl::flat_hash_set<uint64_t> preempted;  // its sequences preempted and not yet released
  };
  // A preempted sequence, remembered until its owner releases it or the session ends, so that
  // calls on it say what happened instead of "unknown sequence".
  struct Tombstone {
    std::string session_id, tenant, reason;
  };
  struct Sequence {
    uint64_t id = 0;
    std::string session_id;
    std::string tenant;
    std::shared_ptr<const Policy> policy;
    std::shared_ptr<const Policy> prefill;  // null: none, or already applied
    std::string prefill_name;
    int32_t priority = 0;
    std::vector<int32_t> blocks;  // the block table
    int32_t length = 0;           // resident (committed) tokens
    int32_t logical = 0;          // tokens ever appended: the next token's position
    int32_t pending_layer = -1;   // next layer of a half-stepped token, -1 when none
    bool decoding = false;        // a Step has run: the prompt is fixed
    int32_t prompt = 0;
    int32_t tail_start = 0;       // Kara: first slot of the uncompressed tail, block-aligned
    // Positions: slots [0, explicit_end) have explicit positions per (layer, head); slots from
    // explicit_end on are contiguous, ending at logical - 1.
    int32_t explicit_end = 0;
    std::vector<std::vector<int32_t>> explicit_pos;  // [L * Hk][explicit_end]
    // Query cache for slots [q_first, q_first + q_count): [q_count][L][Hq][D] fp32.
    std::vector<float> queries;
    int32_t q_first = 0, q_count = 0;
    // H2O accumulated attention per slot: [L * Hk][length (+1 while a token is pending)].
    std::vector<std::vector<float>> attention;
    int32_t compactions = 0;
    uint64_t last_used = 0;       // use_clock_ at its last Append or Step (preemption's tie-break)
    // Metrics only: when the first Append arrived (cleared once the first decode step completes)
    // and when the current step's layer-0 Step began.
    std::optional<std::chrono::steady_clock::time_point> first_append;
    std::chrono::steady_clock::time_point step_started;
    // Quantized storage: the oldest quantized() slots live in qblocks, tokens_per_qblock each;
    // the block table `blocks` holds the rest (slot quantized() is its slot 0).
    bool quantize = false;
    kernels::QuantFormat format = kernels::QuantFormat::kKivi4;
    std::string storage;
    int32_t tokens_per_qblock = 0;
    int32_t residual = 128;
    uint64_t qseed = 0;
    std::vector<int32_t> qblocks;
    // Prefix cache: the prompt's token ids while every prompt token came with one, the keys of its
    // full blocks, and whether it still publishes (no prefill policy, never compacted).
    std::string cache_namespace;
    bool publish = false;
    std::vector<int32_t> prompt_ids;
    std::vector<PrefixKey> prompt_keys;

    // "kara+kivi4": what stats and metrics group by.
    std::string label() const { return storage.empty() ? policy->name() : policy->name() + "+" + storage; }
    int32_t quantized() const { return static_cast<int32_t>(qblocks.size()) * tokens_per_qblock; }
    int32_t fp_length() const { return length - quantized(); }
    int32_t position(int lh, int32_t slot) const {
      return slot < explicit_end ? explicit_pos[lh][slot] : slot + (logical - length);
    }
  };

  Registry(const RegistryConfig& config, std::unique_ptr<kernels::Backend> backend, void* pool_memory,
           int32_t num_blocks);

  absl::StatusOr<Session*> find_session(const std::string& session_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<SequenceInfo> list_sequences_locked(const std::string& session_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Sequence*> find_sequence(const Session& session, uint64_t sequence_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blocks (new plus copy-on-write) that writing tokens [length, new_length) would take.
  int32_t blocks_needed(const Sequence& seq, int32_t new_length) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes the table cover new_length tokens and gives the sequence its own copy of a shared block
  // it is about to write. Callers check blocks_needed against the free count first.
  absl::Status reserve(Sequence& seq, int32_t new_length) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int release_locked(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Limits: RESOURCE_EXHAUSTED naming the limit, the value asked and the flag that sets it.
  absl::Status check_sequence_limit(const Session& session) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status check_tenant_quota(const std::string& tenant, int64_t wanted) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Block-table entries (full-precision and quantized) of the tenant's sequences.
  int64_t tenant_blocks(const std::string& tenant) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the session, freeing its sequences; tells its event watchers why.
  void end_session_locked(const std::string& session_id, bool lease_expired) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // make_room, then (with preempt_on_pressure) preemption of sequences of priority below
  // `priority` other than `served`. When even that cannot free `need` blocks it changes nothing
  // and returns RESOURCE_EXHAUSTED: `what` (the request) wanted `need` blocks, F free of T.
  absl::Status make_room_for(int32_t need, int32_t priority, absl::Span<Sequence* const> served,
                             const std::string& what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void emit(const RegistryEvent& event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (event_observer_) event_observer_(event);
  }
  // Quantizes the oldest full-precision tokens that have aged out of the residual window and that
  // the policy will never rewrite, a quantized block at a time.
  void quantize_aged(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prefix cache. make_room evicts unused cached blocks, least recently used first, until `need`
  // blocks are free; when even that cannot free enough it evicts nothing and returns false.
  bool make_room(int32_t need) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts up to `count` cached blocks no sequence holds, least recently used first; returns how many.
  int32_t evict_unused_cached(int32_t count) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int32_t unused_cached_blocks() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Enforces prefix_cache_max_fraction after blocks became unused.
  void trim_prefix_cache() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Keys and indexes the sequence's newly full prompt blocks.
  void publish_prompt(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  kernels::QuantizedKV quantized_view(const std::vector<const Sequence*>& seqs, std::vector<int32_t>* table,
                                      std::vector<int32_t>* offsets) const;
  // Attention of a Step batch, split into groups that share a storage format.
  absl::Status batch_attention(const std::vector<Sequence*>& seqs, const std::vector<int32_t>& fp_lengths,
                               int layer, const float* q, float* out, float scale, bool accumulate)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Query cache bookkeeping: make room for the queries of slot `slot` (dropping the cache if it
  // would not be contiguous), returns a pointer to its [L][Hq][D] entry.
  float* query_entry(Sequence& seq, int32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void trim_queries(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SequenceView view_of(const Sequence& seq) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Plans and (unless dry_run) applies `policy` to `seq`. A failure leaves the sequence unchanged.
  absl::StatusOr<CompactionResult> compact_locked(Sequence& seq, const Policy& policy, bool dry_run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // compact_locked for a sequence whose slots the plan may take from are all unquantized.
  absl::StatusOr<CompactionResult> compact_in_place(Sequence& seq, const Policy& policy, bool dry_run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status apply_plan(Sequence& seq, const Policy& policy, const CompactionPlan& plan)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Prompt is complete: runs the prefill policy, fixes the prompt and the Kara tail.
  absl::Status begin_decode(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The scheduler, after a completed decode step.
  int run_scheduler(const std::vector<Sequence*>& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void record(const CompactionResult& r, const Sequence& seq, int32_t removed, bool failed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<std::vector<int32_t>> positions_of(const Sequence& seq) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SequenceInfo info_of(const Sequence& seq) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  kernels::PagedKV paged_view(const std::vector<const Sequence*>& seqs,
                              const std::vector<int32_t>& lengths, std::vector<int32_t>* table,
                              std::vector<int32_t>* offsets) const;

  const RegistryConfig config_;
  const std::unique_ptr<kernels::Backend> backend_;
  void* const pool_memory_;

  mutable absl::Mutex mu_;
  BlockPool pool_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Sequence> sequences_ ABSL_GUARDED_BY(mu_);
  uint64_t next_sequence_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t decode_steps_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t tokens_appended_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t decode_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t lease_expiries_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, PolicyStats> policy_stats_ ABSL_GUARDED_BY(mu_);
  std::function<void(const CompactionResult&)> observer_ ABSL_GUARDED_BY(mu_);
  std::function<void(const RegistryEvent&)> event_observer_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Tombstone> preempted_ ABSL_GUARDED_BY(mu_);
  uint64_t preemptions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t use_clock_ ABSL_GUARDED_BY(mu_) = 0;
  PrefixCache prefix_cache_ ABSL_GUARDED_BY(mu_);
  uint64_t prefix_lookups_ ABSL_GUARDED_BY(mu_) = 0, prefix_lookup_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t prefix_hit_tokens_ ABSL_GUARDED_BY(mu_) = 0, prefix_evictions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t prefix_published_ ABSL_GUARDED_BY(mu_) = 0;
};

// Checks a geometry for values the pool and kernels can serve; names the bad field.
absl::Status validate_geometry(const kernels::Geometry& g);

}  // namespace karakv::server
