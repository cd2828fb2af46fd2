// Device scratch memory for one backend call: chunks from cudaMalloc kept for the backend's life and
// handed out by a bump pointer, rewound at the start of each call. After warm-up a call allocates
// nothing. Not thread-safe: the backend serialises calls.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "karakv/kernels/types.h"

namespace karakv::kernels::cuda {

class Arena {
 public:
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena();

  // Rewinds every chunk; memory handed out before is free to reuse (the previous call has
  // synchronized its stream before returning).
  void reset();
  // `bytes` of device memory aligned to 256 bytes, valid until the next reset(). On failure *out is
  // null and the status names the size.
  KernelStatus take(size_t bytes, void** out);
  template <typename T>
  KernelStatus take(size_t count, T** out) {
    void* p = nullptr;
    KernelStatus st = take(count * sizeof(T), &p);
    *out = static_cast<T*>(p);
    return st;
  }

 private:
  struct Chunk {
    char* base = nullptr;
    size_t size = 0;
    size_t used = 0;
  };
  std::vector<Chunk> chunks_;
};

}  // namespace karakv::kernels::cuda
