// Device scratch memory for one backend call: chunks from a memory source (cudaMalloc in the CUDA
// backend) handed out by a bump pointer and rewound at the start of each call. After warm-up a call
// allocates nothing. Not thread-safe: the backend serialises calls.
//
// What one large call (H2O's probabilities, a long causal split) made it take is given back: at a
// rewind, several chunks (the arena grew during a call) are freed and replaced, at the next take,
// by one chunk of their total size, so growth ends in one chunk that fits the peak; and one chunk
// larger than twice what any of the last kShrinkWindow calls used (and than the minimum chunk) is
// freed and replaced by one of the largest of those calls' use. The memory source is an interface,
// so the policy is tested without a GPU (tests/kernels/arena_test.cc); nothing here includes CUDA.
#pragma once

#include <array>
#include <cstddef>
#include <vector>

#include "karakv/kernels/types.h"

namespace karakv::kernels::cuda {

// Where the arena's chunks come from.
class ArenaMemory {
 public:
  virtual ~ArenaMemory() = default;
  // `bytes` of memory aligned to at least 256 bytes, or an error naming the size.
  virtual KernelStatus allocate(size_t bytes, void** out) = 0;
  virtual void free(void* p) = 0;
};

class Arena {
 public:
  static constexpr size_t kAlign = 256;
  static constexpr size_t kMinChunk = size_t(8) << 20;
  // Calls whose use a chunk is compared with before it shrinks.
  static constexpr int kShrinkWindow = 256;

  explicit Arena(ArenaMemory& memory) : memory_(memory) {}
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena();

  // Ends the previous call (its memory is free to reuse: the next call's work runs after the
  // previous call's on the same stream, and a chunk is freed only after the stream passed it),
  // coalescing or shrinking as described above.
  void reset();
  // `bytes` of memory aligned to 256 bytes, valid until the next reset(). On failure *out is null
  // and the status names the size.
  KernelStatus take(size_t bytes, void** out);
  template <typename T>
  KernelStatus take(size_t count, T** out) {
    void* p = nullptr;
    KernelStatus st = take(count * sizeof(T), &p);
    *out = static_cast<T*>(p);
    return st;
  }

  // Bytes held in chunks now, and how many chunks.
  size_t reserved_bytes() const;
  size_t num_chunks() const { return chunks_.size(); }

 private:
  struct Chunk {
    char* base = nullptr;
    size_t size = 0;
    size_t used = 0;
  };
  void release_chunks();

  ArenaMemory& memory_;
  std::vector<Chunk> chunks_;
  size_t next_chunk_ = 0;  // the size of the next chunk take() allocates, at least
  std::array<size_t, kShrinkWindow> recent_use_{};
  int calls_ = 0;  // calls seen since the chunks last changed (capped at kShrinkWindow)
  int next_slot_ = 0;
};

}  // namespace karakv::kernels::cuda
