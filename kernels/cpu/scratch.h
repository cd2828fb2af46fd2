// Per-thread scratch buffers, reused by a thread across kernel calls so that steady work does not
// allocate.
#pragma once

#include <cstddef>
#include <vector>

namespace karakv::kernels::cpu {

// A thread keeps at most this many bytes per scratch buffer between calls. A buffer that grew past
// it (a long sequence's keys, widened to fp32: 16 MiB for 32k tokens of head_dim 128) is given back
// when the call's parallel loop ends, so what each thread holds does not grow to the longest
// sequence it ever scored. The bound is glibc's mmap threshold as karakvd sets it
// (--malloc_mmap_threshold, 256 KiB): larger buffers are mappings of their own, so giving them back
// returns the memory to the system and cannot fragment malloc's heaps; freeing smaller ones on
// every call did (a soak's malloc heaps grew 1 MiB in ten minutes with 64 KiB). Making a buffer
// again costs little next to the work it serves: it is filled in full on every use anyway.
inline constexpr size_t kScratchKeepBytes = size_t(256) << 10;

template <typename T>
void release_if_large(std::vector<T>& buffer) {
  if (buffer.capacity() * sizeof(T) > kScratchKeepBytes) std::vector<T>().swap(buffer);
}

}  // namespace karakv::kernels::cpu
