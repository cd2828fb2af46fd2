#include "arena.h"

#include <algorithm>
#include <string>

namespace karakv::kernels::cuda {

namespace {
constexpr size_t kAlign = 256;
constexpr size_t kMinChunk = size_t(8) << 20;
}  // namespace

Arena::~Arena() {
  for (Chunk& c : chunks_) cudaFree(c.base);
}

void Arena::reset() {
  for (Chunk& c : chunks_) c.used = 0;
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
  c.size = std::max(want, kMinChunk);
  const cudaError_t err = cudaMalloc(reinterpret_cast<void**>(&c.base), c.size);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state of a failed allocation
    return {KernelStatus::Code::kInternal, "cuda scratch: cudaMalloc of " + std::to_string(c.size) +
                                               " bytes failed: " + cudaGetErrorString(err)};
  }
  c.used = want;
  *out = c.base;
  chunks_.push_back(c);
  return KernelStatus::ok();
}

}  // namespace karakv::kernels::cuda
