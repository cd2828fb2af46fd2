#include "server/heap_usage.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace karakv::server {

HeapUsage read_heap_usage() {
  HeapUsage u;
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const struct mallinfo2 mi = mallinfo2();
  // arena: bytes of the main and thread arenas; hblkhd: bytes of chunks mmapped on their own.
  // uordblks counts what is in use inside the arenas, fordblks what is free there.
  // Under another allocator (LD_PRELOAD, a sanitizer's) glibc's arenas are never touched.
  if (mi.arena + mi.hblkhd == 0) return u;
  u.in_use_bytes = mi.uordblks + mi.hblkhd;
  u.held_bytes = mi.arena + mi.hblkhd;
  u.glibc = true;
#endif
  return u;
}

}  // namespace karakv::server
