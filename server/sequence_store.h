// The sequence store: the block pool and its memory, every sequence's record and block tables, the
// prefix cache's blocks, and the data path over them (write, attend, read, quantize, apply a
// compaction plan). It knows no policy and no session: what a policy decides reaches it as plain
// numbers (slots to keep, where quantization must stop, which queries to keep). Not thread-safe:
// the core calls it under its lock.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "karakv/kernels/backend.h"
#include "server/block_pool.h"
#include "server/core_types.h"
#include "server/policy.h"
#include "server/prefix_cache.h"
#include "server/sequence.h"

namespace karakv::server {

// Byte sizes of the tensors the calls carry: [L][T][Hk][D] and [B][Hk][D] in the storage dtype,
// and [rows][Hq][D] fp32.
size_t append_bytes(const kernels::Geometry& g, int64_t num_tokens);
size_t step_kv_bytes(const kernels::Geometry& g, size_t batch);
size_t q_bytes(const kernels::Geometry& g, size_t rows);

struct StoreConfig {
  kernels::Geometry geometry;
  int64_t pool_bytes = 256ll << 20;
  // Prefix caching (docs/PREFIX_CACHE.md) and the share of the pool unused cached blocks may fill.
  bool prefix_cache = true;
  double prefix_cache_max_fraction = 1.0;
};

// What a Step's decode attention records for the policies: per (sequence, KV head) where each
// slot's attention probability adds up ([B * Hk], null entries: none) and per sequence the first
// slot that adds ([B], with the accumulators), and per sequence where each query head's
// log-sum-exp goes ([B], null: none). Either may be empty.
struct Observers {
  std::vector<float*> accumulators;
  std::vector<int32_t> first_slot;
  std::vector<float*> lse;
};

// Kernel views of some sequences' caches: the plain blocks of each (the first `lengths` slots of
// its block table) and, when the first sequence is quantized, its quantized blocks. Owns the tables
// the views point into, so it cannot be copied.
struct PagedView {
  kernels::PagedKV kv;
  kernels::QuantizedKV qkv;
  bool quantized = false;
  std::vector<int32_t> table, offsets, lengths, qtable, qoffsets;
  PagedView() = default;
  PagedView(const PagedView&) = delete;
  PagedView& operator=(const PagedView&) = delete;
  PagedView(PagedView&&) = default;
};

class SequenceStore {
 public:
  // Allocates the pool in backend memory; fails if the geometry is invalid, the backend cannot run
  // the data path's ops, or memory is short.
  static absl::StatusOr<std::unique_ptr<SequenceStore>> create(const StoreConfig& config, kernels::Backend& backend);
  ~SequenceStore();

  const kernels::Geometry& geometry() const { return config_.geometry; }
  const StoreConfig& config() const { return config_; }
  kernels::Backend& backend() const { return backend_; }
  const BlockPool& pool() const { return pool_; }

  // Where the prefix cache's stores and removals are announced (null: nowhere).
  void set_prefix_event_sink(PrefixEventSink* sink) { prefix_events_ = sink; }
  // Where published prompt blocks of sequences with `share_tier` go (null: nowhere).
  void set_prefix_tier_sink(PrefixTierSink* sink) { prefix_tier_ = sink; }

  // ---- records ----
  Sequence& add();  // a new empty record with a fresh id
  Sequence* find(uint64_t id);
  const Sequence* find(uint64_t id) const;
  // A copy of `parent` under a fresh id, sharing every block (copy on write).
  Sequence& fork(const Sequence& parent);
  // Releases the sequence's blocks and drops its record; returns the blocks that went back to the pool.
  int erase(uint64_t id);
  absl::flat_hash_map<uint64_t, Sequence>& sequences() { return sequences_; }
  const absl::flat_hash_map<uint64_t, Sequence>& sequences() const { return sequences_; }

  // ---- blocks ----
  // Blocks (new plus copy-on-write) that writing tokens [length, new_length) would take.
  int32_t blocks_needed(const Sequence& seq, int32_t new_length) const;
  // Makes the table cover new_length tokens and gives the sequence its own copy of a shared block
  // it is about to write. Callers check blocks_needed against the free count first.
  absl::Status reserve(Sequence& seq, int32_t new_length);
  // Evicts unused cached prompt blocks, least recently used first, until `need` blocks are free;
  // when even that cannot free enough it evicts nothing and returns false.
  bool make_room(int32_t need);
  // Cached prompt blocks no sequence holds.
  int32_t unused_cached_blocks() const;
  // Enforces prefix_cache_max_fraction after blocks became unused.
  void trim_prefix_cache();
  // Block ids the prefix cache indexes.
  std::vector<int32_t> cached_blocks() const;

  // ---- prefix cache ----
  // The leading whole blocks of `token_ids` the namespace holds (counted as a lookup).
  std::vector<PrefixCache::Hit> match_prefix(absl::Span<const int32_t> token_ids, const std::string& cache_namespace);
  // Counts a lookup of `tokens` tokens that found `hit` of them.
  void count_lookup(size_t tokens, int32_t hit);
  // Starts `seq` from cached blocks: shares them and their token ids. Returns the tokens taken.
  int32_t adopt_prefix(Sequence& seq, const std::vector<PrefixCache::Hit>& hits, absl::Span<const int32_t> token_ids);
  // Keys and indexes the sequence's newly full prompt blocks; records the appended ids first.
  void publish_prompt(Sequence& seq, absl::Span<const int32_t> token_ids, int32_t num_tokens);
  // The tier's pins (PrefixTierSink): a block published to it keeps one pool reference until then.
  void unpin_for_tier(int32_t block);
  int32_t tier_pinned_blocks() const;
  // Where a block's bytes are in host memory (null when the pool is device memory), and a copy.
  const char* host_block(int32_t block) const;
  std::string copy_block(int32_t block) const;
  // Indexes blocks filled from a shared tier: values[j] holds block `first + j` of `token_ids`
  // (whose keys are `keys`) from byte `offset` on. Stops where the chain's parent is not cached or
  // the pool has no room (unused cached blocks are evicted for them). Returns the blocks added.
  int32_t install_prefix(const std::string& cache_namespace, absl::Span<const int32_t> token_ids,
                         const std::vector<PrefixKey>& keys, size_t first, const std::vector<std::string>& values,
                         size_t offset = 0);

  // ---- views and data ----
  // The view of `seqs` with `lengths` full-precision slots each.
  PagedView view(absl::Span<const Sequence* const> seqs, absl::Span<const int32_t> lengths) const;
  //   k, v: [L][T][Hk][D] storage dtype, written at the sequence's slot fp_length().
  absl::Status write_prompt(Sequence& seq, int32_t num_tokens, ConstBytes k, ConstBytes v);
  // One token at `layer` for each sequence of a Step (their tables already cover it).
  //   k, v: [B][Hk][D] storage dtype
  absl::Status write_step(absl::Span<Sequence* const> seqs, int layer, ConstBytes k, ConstBytes v);
  // Decode attention of a Step batch over each sequence's fp_length() + 1 slots, split into groups
  // that share a storage format, recording what `observers` asks for (quantized sequences record
  // no log-sum-exp: their entries stay as they were).
  //   q, out: [B][Hq][D] fp32
  absl::Status decode_attention(absl::Span<Sequence* const> seqs, int layer, const float* q, float* out, float scale,
                                const Observers& observers);
  // Causal attention of the newest `num_queries` tokens.  q, out: [N][Hq][D] fp32
  absl::Status attend(const Sequence& seq, int layer, int32_t num_queries, const float* q, float* out,
                      float scale) const;
  // Calls `targets(T)` to learn where to write the T resident tokens, then copies them there
  // (quantized blocks dequantized) with their positions.
  absl::StatusOr<int32_t> read_kv(const Sequence& seq,
                                  absl::FunctionRef<absl::StatusOr<ReadKVTargets>(int32_t num_tokens)> targets) const;

  // ---- query cache ----
  // Room for the queries of slot `slot` (dropping the cache if it would not be contiguous); a
  // pointer to its [L][Hq][D] entry. `capacity_hint` tokens are reserved up front.
  float* query_entry(Sequence& seq, int32_t slot, int capacity_hint);
  // Drops the queries of slots before `keep_from`.
  void trim_queries(Sequence& seq, int32_t keep_from);

  // ---- quantized storage ----
  // Quantizes the oldest full-precision tokens that have aged out of the residual window and lie
  // before `frozen_end` (slots a policy may still rewrite stay), a quantized block at a time.
  void quantize_aged(Sequence& seq, int32_t frozen_end);
  // A copy of `seq` whose quantized prefix is dequantized into fresh blocks, for a policy that
  // rewrites the whole cache; it holds a reference of its own to every block it shares with `seq`
  // (so compacting it never writes one of them). adopt_copy makes it the sequence, drop_copy gives
  // back everything it holds, leaving `seq` as it was.
  absl::StatusOr<Sequence> dequantized_copy(const Sequence& seq);
  void adopt_copy(Sequence& seq, Sequence&& copy);
  void drop_copy(const Sequence& copy);

  // ---- compaction ----
  // Replaces slots [plan.begin, plan.end) by the plan's kept slots (gathered into fresh blocks),
  // merging evicted values into the next `merge_tokens` kept ones when > 0 (CaM). A failure leaves
  // the sequence unchanged.
  absl::Status apply_plan(Sequence& seq, const CompactionPlan& plan, int merge_tokens, const std::string& by);

  // ---- introspection ----
  std::vector<std::vector<int32_t>> positions_of(const Sequence& seq) const;
  SequenceInfo info_of(const Sequence& seq) const;
  // Pool, sequence and prefix-cache counters into `s`.
  void fill_stats(CoreStats& s) const;
  // DESIGN.md's invariant: free + used == total, and every used block is held by exactly as many
  // tables (sequences and the prefix cache) as its reference count says.
  absl::Status check_invariants() const;

 private:
  SequenceStore(const StoreConfig& config, kernels::Backend& backend, void* pool_memory, int32_t num_blocks);
  int32_t evict_unused_cached(int32_t count);
  int release(Sequence& seq);

  const StoreConfig config_;
  kernels::Backend& backend_;
  void* const pool_memory_;
  BlockPool pool_;
  absl::flat_hash_map<uint64_t, Sequence> sequences_;
  uint64_t next_id_ = 1;
  uint64_t tokens_appended_ = 0;
  PrefixCache prefix_cache_;
  PrefixEventSink* prefix_events_ = nullptr;
  PrefixTierSink* prefix_tier_ = nullptr;
  absl::flat_hash_map<int32_t, int32_t> tier_pins_;  // block -> pins the tier holds
  uint64_t prefix_lookups_ = 0, prefix_lookup_tokens_ = 0, prefix_hit_tokens_ = 0;
  uint64_t prefix_evictions_ = 0, prefix_published_ = 0;
};

}  // namespace karakv::server
