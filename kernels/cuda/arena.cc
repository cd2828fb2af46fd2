#include "arena.h"

#include <algorithm>
#include <string>

namespace karakv::kernels::cuda {

Arena::~Arena() { release_chunks(); }

void Arena::release_chunks() {
  for (Chunk& c : chunks_) memory_.free(c.base);
  chunks_.clear();
}

size_t Arena::reserved_bytes() const {
  size_t total = 0;
  for (const Chunk& c : chunks_) total += c.size;
  return total;
}

void Arena::reset() {
  size_t used = 0;
  for (const Chunk& c : chunks_) used += c.used;
  recent_use_[next_slot_] = used;
  next_slot_ = (next_slot_ + 1) % kShrinkWindow;
  calls_ = std::min(calls_ + 1, kShrinkWindow);
  for (Chunk& c : chunks_) c.used = 0;

  if (chunks_.size() > 1) {
    // Grown during a call: one chunk of the total serves the same peak without the seams.
    next_chunk_ = reserved_bytes();
    release_chunks();
    calls_ = 0;
    return;
  }
  if (chunks_.size() == 1 && calls_ == kShrinkWindow) {
    size_t peak = 0;
    for (size_t u : recent_use_) peak = std::max(peak, u);
    const size_t keep = std::max(peak, kMinChunk);
    if (chunks_[0].size > 2 * keep) {
      next_chunk_ = keep;
      release_chunks();
      calls_ = 0;
    }
  }
}

KernelStatus Arena::take(size_t bytes, void** out) {
  *out = nullptr;
  const size_t want = std::max<size_t>((bytes + kAlign - 1) / kAlign * kAlign, kAlign);
  for (Chunk& c : chunks_) {
    if (c.size - c.used >= want) {
      *out = c.base + c.used;
      c.used += want;
      return KernelStatus::ok();
    }
  }
  Chunk c;
  c.size = std::max({want, kMinChunk, next_chunk_});
  void* p = nullptr;
  KernelStatus st = memory_.allocate(c.size, &p);
  if (!st.is_ok() && c.size > std::max(want, kMinChunk)) {
    // The coalesced or peak-sized chunk does not fit: what this call asks for may.
    c.size = std::max(want, kMinChunk);
    st = memory_.allocate(c.size, &p);
  }
  if (!st.is_ok()) {
    st.message = "scratch memory: " + st.message;
    return st;
  }
  next_chunk_ = 0;
  calls_ = 0;
  c.base = static_cast<char*>(p);
  c.used = want;
  *out = c.base;
  chunks_.push_back(c);
  return KernelStatus::ok();
}

}  // namespace karakv::kernels::cuda
