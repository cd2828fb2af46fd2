// What the process's malloc holds: bytes handed out and bytes taken from the OS. Read from glibc's
// mallinfo2(), which sums every arena; it tells a growing live heap (in use rises) apart from
// fragmentation (held rises while in use stays flat). Under another allocator (LD_PRELOAD, a
// sanitizer's) glibc's malloc holds nothing: the figures are 0 and `glibc` is false.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"

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

// Fixes glibc's mmap threshold at `bytes` (mallopt M_MMAP_THRESHOLD; 0 keeps glibc's dynamic
// threshold). glibc starts at 128 KiB and raises the threshold to the size of each mmapped chunk
// that is freed (up to 32 MiB), so after the daemon's first large short-lived buffer (a ReadKV or
// Step reply, a compaction's scratch, a gRPC message) every later one comes from an arena; a burst
// of them alive at once grows the arena, and small long-lived chunks allocated above the gap keep
// it resident: RSS that steps up and does not come back (docs/RELIABILITY.md, soak). With the
// threshold fixed, every chunk this large or larger is a mapping of its own, returned on free.
// Returns false where mallopt refused the value or the allocator is not glibc's.
bool fix_malloc_mmap_threshold(int bytes);

// glibc's per-thread caches (tcache) keep up to 7 freed chunks of each size up to 1,032 bytes on
// every thread, and mallinfo2 counts them as in use: the arena cannot hand them to another thread.
// A thread's cache fills as it frees chunk sizes it has not cached yet, so with ~40 threads that
// allocate (gRPC's, the ring threads, the kernels' helpers) the daemon's RSS creeps for minutes
// (docs/RELIABILITY.md, soak). glibc reads the cache's limits only from GLIBC_TUNABLES at exec.
//
// The GLIBC_TUNABLES value that caps cached chunks at `max_bytes` (glibc.malloc.tcache_max),
// appended to `current` (the variable's value, or null when unset). nullopt when there is
// nothing to do: `max_bytes` < 0 (keep glibc's default), or `current` already sets tcache_max
// (the operator's own setting wins, and a re-executed daemon finds its own).
std::optional<std::string> tunables_with_tcache_max(const char* current, int max_bytes);
// Caps glibc's per-thread caches at `max_bytes` (< 0: glibc's default) by re-executing this
// program (its own binary, same argv, same pid) with GLIBC_TUNABLES extended, when the setting is
// not in force yet and malloc is glibc's. Call first thing in main, before any thread starts.
// Returns only when no re-exec was needed, or when it failed (the error says why; the daemon can
// run on with glibc's default caches).
absl::Status apply_tcache_max(int max_bytes, char** argv);

}  // namespace karakv::server
