// Per-thread scratch buffers, reused by a thread across kernel calls so that steady work does not
// allocate.
#pragma once

#include <cstddef>
#include <vector>

namespace karakv::kernels::cpu {

// A thread keeps at most this many bytes per scratch buffer between calls. A buffer that grew past
// it (a long sequence's keys, widened to fp32) is given back when the call's parallel loop ends, so
// what each thread holds does not creep up to the longest sequence it ever scored. Making it again
// costs little next to the work it serves: the buffer is filled in full on every use anyway.
inline constexpr size_t kScratchKeepBytes = size_t(64) << 10;

template <typename T>
void release_if_large(std::vector<T>& buffer) {
  if (buffer.capacity() * sizeof(T) > kScratchKeepBytes) std::vector<T>().swap(buffer);
}

}  // namespace karakv::kernels::cpu
