// Allocations: a backend's live allocate() results and their sizes, the same for every backend, so
// the validators can bound block ids by the pool they index.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <mutex>

#include "karakv/kernels/types.h"

namespace karakv::kernels::common {

// The memory a backend handed out with allocate(), so block ids can be checked against the size of
// the pool they index (a stale or corrupt block table must not reach outside it). Thread-safe.
class Allocations {
 public:
  void add(const void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    map_[p] = bytes;
  }
  void remove(const void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    map_.erase(p);
  }
  // Blocks in kv.pool when it is one of these allocations, else -1 (then block ids are only
  // checked against 0). Asked before the arguments are validated (on every decode), so it only
  // guards its own division: a geometry the validators will refuse (a zero or negative size) has
  // no block count.
  long long pool_blocks(const PagedKV& kv) const {
    const Geometry& g = kv.geometry;
    if (g.num_layers <= 0 || g.num_kv_heads <= 0 || g.block_size <= 0 || g.head_dim <= 0) return -1;
    const size_t block_bytes = g.block_bytes();
    if (block_bytes == 0) return -1;  // the product wrapped
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(kv.pool);
    if (it == map_.end()) return -1;
    return static_cast<long long>(it->second / block_bytes);
  }
  // Whether p lies inside one of these allocations.
  bool contains(const void* p) const { return bytes_from(p) > 0; }
  // Bytes from p to the end of the allocation p lies in, or 0 when it lies in none.
  size_t bytes_from(const void* p) const {
    std::lock_guard<std::mutex> lock(mu_);
    return room_locked(p);
  }
  // bytes_from for each of n pointers, under one lock (a decode layer's accumulators).
  void bytes_from(const void* const* ptrs, size_t n, size_t* out) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < n; ++i) out[i] = ptrs[i] == nullptr ? 0 : room_locked(ptrs[i]);
  }
  // Calls f(pointer) for every live allocation and forgets them (a backend's destructor).
  template <typename F>
  void release_all(F&& f) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [p, bytes] : map_) f(const_cast<void*>(p));
    map_.clear();
  }

 private:
  size_t room_locked(const void* p) const {
    auto it = map_.upper_bound(p);
    if (it == map_.begin()) return 0;
    --it;
    const char* end = static_cast<const char*>(it->first) + it->second;
    if (!std::less<const void*>()(p, end)) return 0;
    return size_t(end - static_cast<const char*>(p));
  }

  mutable std::mutex mu_;
  std::map<const void*, size_t> map_;  // live allocate() results -> requested bytes
};

}  // namespace karakv::kernels::common
