#include "server/heap_usage.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

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

namespace {

absl::Status not_glibc(int max_bytes) {
  return absl::FailedPreconditionError(absl::StrCat(
      "--malloc_tcache_max=", max_bytes, " not applied: malloc is not glibc's (a sanitizer's or a preloaded one)"));
}

}  // namespace

std::optional<std::string> tunables_with_tcache_max(const char* current, int max_bytes) {
  if (max_bytes < 0) return std::nullopt;
  const std::string setting = absl::StrCat("glibc.malloc.tcache_max=", max_bytes);
  if (current == nullptr || *current == '\0') return setting;
  // GLIBC_TUNABLES is a colon-separated list of name=value pairs.
  for (absl::string_view pair : absl::StrSplit(current, ':')) {
    if (absl::StartsWith(pair, "glibc.malloc.tcache_max=")) return std::nullopt;
  }
  return absl::StrCat(current, ":", setting);
}

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

bool fix_malloc_mmap_threshold(int bytes) {
  if (bytes == 0) return true;
  return glibc_malloc_in_use() && mallopt(M_MMAP_THRESHOLD, bytes) == 1;
}

absl::Status apply_tcache_max(int max_bytes, char** argv) {
  const char* current = std::getenv("GLIBC_TUNABLES");
  const std::optional<std::string> tunables = tunables_with_tcache_max(current, max_bytes);
  if (!tunables.has_value()) return absl::OkStatus();
  const std::optional<std::string> before = current ? std::optional<std::string>(current) : std::nullopt;
  if (!glibc_malloc_in_use()) {
    return not_glibc(max_bytes);
  }
  if (setenv("GLIBC_TUNABLES", tunables->c_str(), 1) != 0) {
    return absl::InternalError(absl::StrCat("--malloc_tcache_max not applied: setenv: ", std::strerror(errno)));
  }
  // The binary's own path, not /proc/self/exe: the kernel names the process after the file it
  // executes, and `ps` / `pgrep karakvd` should still find it. A binary replaced on disk since it
  // started reads "... (deleted)": then /proc/self/exe still reaches the running one.
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  std::string path = "/proc/self/exe";
  if (n > 0 && !absl::EndsWith(absl::string_view(self, size_t(n)), " (deleted)")) path.assign(self, size_t(n));
  execv(path.c_str(), argv);
  const int err = errno;  // still here: the exec failed; put the environment back as it was
  if (before.has_value()) setenv("GLIBC_TUNABLES", before->c_str(), 1);
  else unsetenv("GLIBC_TUNABLES");
  return absl::InternalError(absl::StrCat("--malloc_tcache_max=", max_bytes, " not applied: re-executing ", path,
                                          " with GLIBC_TUNABLES=", *tunables,
                                          " failed: ", std::strerror(err)));
}

#else

HeapUsage read_heap_usage() { return {}; }
bool limit_malloc_arenas(int n) { return n == 0; }
bool fix_malloc_mmap_threshold(int bytes) { return bytes == 0; }
absl::Status apply_tcache_max(int max_bytes, char**) {
  if (max_bytes < 0) return absl::OkStatus();
  return not_glibc(max_bytes);
}

#endif

}  // namespace karakv::server
