// POSIX shared memory: shm_open(O_CREAT | O_EXCL, 0600) with a 128-bit random name, unlinked when
// the session ends. Only processes of the daemon's user that were told the name can open it.
// Every page is allocated when the region is made (posix_fallocate): a full /dev/shm refuses the
// Attach with RESOURCE_EXHAUSTED instead of raising SIGBUS in whichever process first touches a page
// that cannot be had. The pages are not mapped in up front (MAP_POPULATE): that made the daemon's
// RSS swing by a whole region with every session that came or went (docs/RELIABILITY.md).
#include "server/staging.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace karakv::server {
namespace {

std::string random_name() {
  std::random_device rd;  // kernel entropy: names must not be guessable by other local users
  uint64_t hi = (uint64_t(rd()) << 32) | rd();
  uint64_t lo = (uint64_t(rd()) << 32) | rd();
  return absl::StrFormat("/karakv-%d-%016x%016x", getpid(), hi, lo);
}

// " (/dev/shm: F of T bytes free)", or nothing where it cannot be read.
std::string shm_space() {
  struct statvfs st;
  if (statvfs("/dev/shm", &st) != 0) return "";
  return absl::StrCat(" (/dev/shm: ", uint64_t(st.f_bavail) * st.f_frsize, " of ",
                      uint64_t(st.f_blocks) * st.f_frsize, " bytes free)");
}

}  // namespace

absl::StatusOr<std::unique_ptr<StagingRegion>> StagingRegion::create(size_t bytes, size_t reserved_bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t data = (bytes + page - 1) / page * page;
  const size_t reserved = (reserved_bytes + page - 1) / page * page;
  const size_t size = data + reserved;
  for (int attempt = 0; attempt < 4; ++attempt) {
    std::string name = random_name();
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && errno == EEXIST) continue;
    if (fd < 0) {
      return absl::InternalError(absl::StrCat("shm_open(", name, "): ", std::strerror(errno)));
    }
    // Sizes the object and allocates its pages in one step (no ftruncate needed).
    if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(size)); err != 0) {
      close(fd);
      shm_unlink(name.c_str());
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot allocate a staging region of ", size, " bytes in shared memory: ", std::strerror(err),
          shm_space(), "; ask for less staging or give /dev/shm more room (Kubernetes: the emptyDir's "
          "sizeLimit; Docker: --shm-size)"));
    }
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
      const int err = errno;
      shm_unlink(name.c_str());
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot map staging region of ", size, " bytes: ", std::strerror(err)));
    }
    return std::unique_ptr<StagingRegion>(
        new StagingRegion(std::move(name), static_cast<uint8_t*>(p), data, reserved));
  }
  return absl::InternalError("could not find a free shared-memory name");
}

StagingRegion::~StagingRegion() {
  munmap(base_, size_ + reserved_);
  shm_unlink(name_.c_str());
}

const char* staging_kind_name(StagingKind kind) {
  switch (kind) {
    case StagingKind::kShm: return "shm";
    case StagingKind::kCudaIpc: return "cuda_ipc";
    case StagingKind::kCudaVmmFd: return "cuda_vmm_fd";
  }
  return "?";
}

absl::Status check_generation(const Staging& staging, uint64_t requested) {
  if (requested == staging.generation()) return absl::OkStatus();
  if (requested == 0 && !staging.on_device()) return absl::OkStatus();
  if (requested == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "staging_generation is missing: this session's ", staging_kind_name(staging.kind()),
        " staging region is generation ", staging.generation(),
        "; set staging_generation to AttachReply.staging_generation"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "stale staging handle: the request names staging generation ", requested, ", this session's ",
      staging_kind_name(staging.kind()), " staging region is generation ", staging.generation(),
      "; use the handle and generation of this session's AttachReply (re-attach if it was lost)"));
}

absl::StatusOr<uint8_t*> Staging::resolve(uint64_t offset, uint64_t length, size_t align, const char* what) const {
  const size_t region = size();
  if (offset > region || length > region - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": staging range [", offset, ", ", offset + length, ") falls outside the session's ",
        region, "-byte staging region"));
  }
  if (align > 1 && offset % align != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": staging offset ", offset, " is not a multiple of ", align));
  }
  return base() + offset;
}

}  // namespace karakv::server
