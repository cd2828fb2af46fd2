// What the process's malloc holds: bytes handed out and bytes taken from the OS. Read from glibc's
// mallinfo2(), which sums every arena; it tells a growing live heap (in use rises) apart from
// fragmentation (held rises while in use stays flat). Under another allocator (LD_PRELOAD, a
// sanitizer's) glibc's malloc holds nothing: the figures are 0 and `glibc` is false.
#pragma once

#include <cstdint>

namespace karakv::server {

struct HeapUsage {
  uint64_t in_use_bytes = 0;  // allocated and not freed (including blocks mmapped on their own)
  uint64_t held_bytes = 0;    // taken from the OS by malloc: in use + free chunks it keeps
  bool glibc = false;         // glibc's malloc is the allocator in use (and mallinfo2 exists)
};

HeapUsage read_heap_usage();

// Caps glibc's malloc arenas at `n` (mallopt M_ARENA_MAX; 0 leaves glibc's default of 8 per core,
// or MALLOC_ARENA_MAX from the environment). Call before threads start. glibc gives every new
// thread an arena of its own up to the cap, and each arena's partly used pages add to RSS as
// threads come and go; the daemon's big memory is the pool, not malloc, so a few arenas serve it.
// Returns false where mallopt refused the value or the allocator is not glibc's.
bool limit_malloc_arenas(int n);

}  // namespace karakv::server
