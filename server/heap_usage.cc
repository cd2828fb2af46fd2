#include "server/heap_usage.h"

#include <cstdlib>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KARAKV_SANITIZER_MALLOC 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define KARAKV_SANITIZER_MALLOC 1
#endif
#endif

namespace karakv::server {

#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33)) && \
    !defined(KARAKV_SANITIZER_MALLOC)
namespace {

// Whether malloc is glibc's: an allocation must show up in mallinfo2. Under LD_PRELOAD of another
// allocator it never does. Other threads freeing at the same moment can hide one probe, so three
// are made; any one that shows settles it.
bool glibc_malloc_in_use() {
  static const bool in_use = [] {
    for (int attempt = 0; attempt < 3; ++attempt) {
      const size_t before = mallinfo2().uordblks;
      void* volatile p = std::malloc(16 << 10);  // below the mmap threshold: from an arena
      const size_t after = mallinfo2().uordblks;
      std::free(p);
      if (after >= before + (16 << 10)) return true;
    }
    return false;
  }();
  return in_use;
}

}  // namespace

HeapUsage read_heap_usage() {
  HeapUsage u;
  if (!glibc_malloc_in_use()) return u;
  const struct mallinfo2 mi = mallinfo2();
  // arena: bytes of the main and thread arenas; hblkhd: bytes of chunks mmapped on their own.
  // uordblks counts what is in use inside the arenas (chunks in per-thread caches included),
  // fordblks what is free there.
  u.in_use_bytes = mi.uordblks + mi.hblkhd;
  u.held_bytes = mi.arena + mi.hblkhd;
  u.glibc = true;
  return u;
}

bool limit_malloc_arenas(int n) {
  if (n == 0) return true;
  return glibc_malloc_in_use() && mallopt(M_ARENA_MAX, n) == 1;
}

#else

HeapUsage read_heap_usage() { return {}; }
bool limit_malloc_arenas(int n) { return n == 0; }

#endif

}  // namespace karakv::server
