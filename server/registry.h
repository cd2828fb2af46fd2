// The daemon's state: sessions with leases and staging regions, sequences with block tables, and
// the pool they draw from. Every operation validates completely before it changes anything, so a
// refused request leaves no trace. One mutex serialises state changes and the kernels they run.
#pragma once

#include <cstdint>
#include <memory>
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
#include "server/staging.h"

namespace karakv::server {

struct RegistryConfig {
  kernels::Geometry geometry;
  int64_t pool_bytes = 256ll << 20;
  absl::Duration lease = absl::Seconds(30);
  uint64_t max_staging_bytes = 1ull << 30;
};

// Read-only input bytes and writable output bytes, already resolved by the service.
using ConstBytes = absl::Span<const uint8_t>;
using MutableBytes = absl::Span<uint8_t>;

struct AttachResult {
  std::string session_id;
  std::string staging_name;
  uint64_t staging_bytes = 0;
};

struct SequenceInfo {
  uint64_t id = 0;
  std::string session_id;
  std::string tenant;
  std::string policy;
  int32_t length = 0;
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
  uint64_t lease_expiries = 0;
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

  // Sessions. `worker_geometry` with num_layers == 0 means "whatever the daemon serves".
  absl::StatusOr<AttachResult> attach(const std::string& worker_id, const std::string& tenant,
                                      uint64_t staging_bytes,
                                      const kernels::Geometry& worker_geometry);
  absl::StatusOr<int> detach(const std::string& session_id);
  absl::Status heartbeat(const std::string& session_id);
  // The session's staging region, kept alive by the returned pointer even if the session ends.
  absl::StatusOr<std::shared_ptr<StagingRegion>> staging(const std::string& session_id);
  // Frees every session whose lease ended before `now`; returns how many.
  int expire_leases(absl::Time now);

  // Sequences.
  absl::StatusOr<uint64_t> create_sequence(const std::string& session_id, const std::string& policy,
                                           int32_t priority);
  absl::StatusOr<uint64_t> fork_sequence(const std::string& session_id, uint64_t parent_id);
  absl::StatusOr<int> release_sequence(const std::string& session_id, uint64_t sequence_id);

  //   k, v: [L][T][Hk][D] storage dtype. Returns the new length.
  absl::StatusOr<int32_t> append(const std::string& session_id, uint64_t sequence_id,
                                 int32_t num_tokens, ConstBytes k, ConstBytes v);
  //   k, v: [B][Hk][D] storage dtype; q: [B][Hq][D] fp32; out: [B][Hq][D] fp32.
  // Returns the decode-step counter.
  absl::StatusOr<uint64_t> step(const std::string& session_id, int32_t layer,
                                absl::Span<const uint64_t> sequence_ids, ConstBytes k, ConstBytes v,
                                ConstBytes q, MutableBytes out, float scale);
  //   q, out: [N][Hq][D] fp32
  absl::Status attend(const std::string& session_id, uint64_t sequence_id, int32_t layer,
                      int32_t num_queries, ConstBytes q, MutableBytes out, float scale);
  // Calls `targets(T)` under the lock to learn where to write T tokens, then copies them there.
  absl::StatusOr<int32_t> read_kv(
      const std::string& session_id, uint64_t sequence_id,
      absl::FunctionRef<absl::StatusOr<ReadKVTargets>(int32_t num_tokens)> targets);

  RegistryStats stats() const;
  // Empty session id lists every sequence.
  std::vector<SequenceInfo> list_sequences(const std::string& session_id) const;
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
    std::shared_ptr<StagingRegion> staging;
    absl::Time lease_deadline;
    absl::flat_hash_set<uint64_t> sequences;
  };
  struct Sequence {
    uint64_t id = 0;
    std::string session_id;
    std::string tenant;
    std::string policy;
    int32_t priority = 0;
    std::vector<int32_t> blocks;  // the block table
    int32_t length = 0;           // committed tokens
    int32_t pending_layer = -1;   // next layer of a half-stepped token, -1 when none
  };

  Registry(const RegistryConfig& config, std::unique_ptr<kernels::Backend> backend, void* pool_memory,
           int32_t num_blocks);

  absl::StatusOr<Session*> find_session(const std::string& session_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Sequence*> find_sequence(const Session& session, uint64_t sequence_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blocks (new plus copy-on-write) that writing tokens [length, new_length) would take.
  int32_t blocks_needed(const Sequence& seq, int32_t new_length) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes the table cover new_length tokens and gives the sequence its own copy of a shared block
  // it is about to write. Callers check blocks_needed against the free count first.
  absl::Status reserve(Sequence& seq, int32_t new_length) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int release_locked(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void end_session_locked(const std::string& session_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  uint64_t lease_expiries_ ABSL_GUARDED_BY(mu_) = 0;
};

// Checks a geometry for values the pool and kernels can serve; names the bad field.
absl::Status validate_geometry(const kernels::Geometry& g);

}  // namespace karakv::server
