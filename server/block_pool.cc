// Free list plus reference counts; allocation is all-or-nothing so a refused request leaves no trace.
#include "server/block_pool.h"

#include "absl/strings/str_cat.h"

namespace karakv::server {

BlockPool::BlockPool(int32_t num_blocks) : refcount_(num_blocks, 0) {
  free_.reserve(num_blocks);
  // Hand out low ids first: easier to read in dumps and tests.
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

absl::Status BlockPool::allocate(int32_t n, std::vector<int32_t>* out) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("cannot allocate ", n, " blocks"));
  if (n > free_count()) {
    return absl::ResourceExhaustedError(absl::StrCat("KV pool full: wanted ", n, " blocks, ",
                                                     free_count(), " free of ", total()));
  }
  for (int32_t i = 0; i < n; ++i) {
    const int32_t b = free_.back();
    free_.pop_back();
    refcount_[b] = 1;
    out->push_back(b);
  }
  return absl::OkStatus();
}

void BlockPool::add_ref(int32_t block) { ++refcount_[block]; }

bool BlockPool::release(int32_t block) {
  if (--refcount_[block] > 0) return false;
  free_.push_back(block);
  return true;
}

absl::Status BlockPool::check(const std::vector<int32_t>& references) const {
  if (static_cast<int32_t>(references.size()) != total()) {
    return absl::InternalError(
        absl::StrCat("reference table has ", references.size(), " entries, pool has ", total()));
  }
  std::vector<char> in_free(refcount_.size(), 0);
  for (int32_t b : free_) {
    if (b < 0 || b >= total()) return absl::InternalError(absl::StrCat("free list holds bad id ", b));
    if (in_free[b]) return absl::InternalError(absl::StrCat("block ", b, " is on the free list twice"));
    in_free[b] = 1;
  }
  int32_t used = 0;
  for (int32_t b = 0; b < total(); ++b) {
    if (in_free[b]) {
      if (refcount_[b] != 0 || references[b] != 0) {
        return absl::InternalError(absl::StrCat("free block ", b, " has refcount ", refcount_[b],
                                                " and ", references[b], " table references"));
      }
      continue;
    }
    ++used;
    if (refcount_[b] <= 0) {
      return absl::InternalError(absl::StrCat("block ", b, " is neither free nor referenced (leak)"));
    }
    if (refcount_[b] != references[b]) {
      return absl::InternalError(absl::StrCat("block ", b, " counts ", refcount_[b],
                                              " references but ", references[b], " tables hold it"));
    }
  }
  if (used + free_count() != total()) {
    return absl::InternalError(absl::StrCat("free ", free_count(), " + used ", used, " != total ", total()));
  }
  return absl::OkStatus();
}

}  // namespace karakv::server
