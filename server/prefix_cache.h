// Content-addressed prompt blocks shared across workers: stable chained block keys and the index
// of cached blocks with their least-recently-used order. The sequence store owns the references: the
// cache holds one reference on every block it indexes, and evicts only blocks no sequence holds.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"
#include "karakv/kernels/types.h"

namespace karakv::server {

// SipHash-2-4 (Aumasson and Bernstein, 2012) of `data` under a 16-byte key, 64-bit output. Stable
// across processes, builds and machines (little-endian by definition), unlike absl::Hash.
uint64_t siphash24(const uint8_t key[16], const void* data, size_t size);

// A block's content key: 128 bits, two SipHash-2-4 outputs under two fixed keys.
struct PrefixKey {
  uint64_t hi = 0, lo = 0;
  bool operator==(const PrefixKey&) const = default;
  template <typename H>
  friend H AbslHashValue(H h, const PrefixKey& k) {
    return H::combine(std::move(h), k.hi, k.lo);
  }
};

// The key of one full prompt block, chained like vLLM's: it covers the previous block's key (the
// zero key for the first block), this block's token ids, the model geometry (dtype included) and
// the cache namespace. Equal keys mean equal prefixes up to a 2^-128-scale collision, and the
// cache also compares token ids, parent key and namespace on every hit, so a collision can cost a
// miss but never hand out the wrong K/V.
PrefixKey prefix_block_key(const PrefixKey& parent, absl::Span<const int32_t> tokens,
                           const kernels::Geometry& geometry, std::string_view cache_namespace);

// The chained keys of the whole blocks of `tokens` (a partial last block has none).
std::vector<PrefixKey> prefix_chain_keys(absl::Span<const int32_t> tokens, const kernels::Geometry& geometry,
                                         std::string_view cache_namespace);

// Told of every block the cache indexes and drops (server/kv_events.h publishes them). Called under
// the core's lock: an implementation only queues.
class PrefixEventSink {
 public:
  virtual ~PrefixEventSink() = default;
  // `parent` is the zero key for a chain's first block.
  virtual void stored(const PrefixKey& key, const PrefixKey& parent, absl::Span<const int32_t> tokens) = 0;
  virtual void removed(const PrefixKey& key) = 0;
};

// Told of every block a prompt publishes (server/prefix_tier.h writes them to a shared store). Called
// under the core's lock: an implementation only queues. The store pins the block for it (one pool
// reference, so it is neither evicted nor reused) until the sink gives it back
// (SequenceStore::unpin_for_tier); false: not taken, and the store unpins it at once. Blocks filled
// from that store are not told.
class PrefixTierSink {
 public:
  virtual ~PrefixTierSink() = default;
  virtual bool published(const PrefixKey& key, int32_t block) = 0;
};

class PrefixCache {
 public:
  struct Entry {
    PrefixKey parent;
    std::string cache_namespace;
    std::vector<int32_t> tokens;  // [block_size] the block's token ids
    int32_t block = -1;
    uint64_t tick = 0;            // last use, for LRU
  };
  struct Hit {
    PrefixKey key;
    int32_t block;
  };

  // The longest chain of cached whole blocks that starts `tokens` in `cache_namespace`.
  std::vector<Hit> match(absl::Span<const int32_t> tokens, const kernels::Geometry& geometry,
                         std::string_view cache_namespace) const;
  // Indexes `block` under `key`; false (nothing changes) when the key or the block is already there.
  bool insert(const PrefixKey& key, Entry entry);
  // Marks the hits used now. Later blocks of a chain count as older, so eviction takes a chain
  // from its end and never leaves later blocks cached behind a missing first one.
  void touch(const std::vector<Hit>& hits);
  void touch(absl::Span<const PrefixKey> chain);
  // Removes the entry; returns its block.
  int32_t erase(const PrefixKey& key);
  // Keys from least to most recently used.
  std::vector<PrefixKey> lru_order() const;

  size_t size() const { return entries_.size(); }
  bool holds_block(int32_t block) const { return by_block_.contains(block); }
  const absl::flat_hash_map<PrefixKey, Entry>& entries() const { return entries_; }
  // Internal consistency of the three indexes; empty string when fine.
  std::string check() const;

 private:
  absl::flat_hash_map<PrefixKey, Entry> entries_;
  absl::flat_hash_map<int32_t, PrefixKey> by_block_;
  std::map<uint64_t, PrefixKey> lru_;  // tick -> key
  uint64_t clock_ = 0;
};

}  // namespace karakv::server
