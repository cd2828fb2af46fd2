// The paged block pool's bookkeeping: which blocks are free and how many sequences reference each
// used one. The bytes themselves live in backend memory owned by the sequence store. Not thread-safe:
// the core serialises access.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace karakv::server {

class BlockPool {
 public:
  explicit BlockPool(int32_t num_blocks);

  int32_t total() const { return static_cast<int32_t>(refcount_.size()); }
  int32_t free_count() const { return static_cast<int32_t>(free_.size()); }
  int32_t used_count() const { return total() - free_count(); }

  // Takes `n` free blocks with reference count 1, or none at all: RESOURCE_EXHAUSTED names how
  // many were wanted and how many are free.
  absl::Status allocate(int32_t n, std::vector<int32_t>* out);
  // Adds one reference (a fork now shares the block).
  void add_ref(int32_t block);
  // Drops one reference; the block returns to the free list when none remain. Returns true if
  // the block was freed.
  bool release(int32_t block);
  int32_t refcount(int32_t block) const { return refcount_[block]; }

  // Checks the pool's own invariants and that `references` (block id -> how many sequence tables
  // hold it, as the caller counted them) matches the reference counts exactly:
  // free + used == total, no free block is referenced, every used block is referenced by exactly
  // as many tables as it counts.
  absl::Status check(const std::vector<int32_t>& references) const;

 private:
  std::vector<int32_t> refcount_;  // [total] 0 = free
  std::vector<int32_t> free_;      // stack of free block ids
};

}  // namespace karakv::server
