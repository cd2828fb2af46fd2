// A session's staging region: a POSIX shared-memory object with an unguessable name, mode 0600,
// mapped by the daemon and by the one worker it was made for. Requests address it by offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace karakv::server {

class StagingRegion {
 public:
  // Creates and maps a new region of `bytes` bytes (rounded up to the page size).
  static absl::StatusOr<std::unique_ptr<StagingRegion>> create(size_t bytes);
  ~StagingRegion();
  StagingRegion(const StagingRegion&) = delete;
  StagingRegion& operator=(const StagingRegion&) = delete;

  const std::string& name() const { return name_; }
  size_t size() const { return size_; }
  uint8_t* base() const { return base_; }

  // Resolves [offset, offset + length) to a pointer, refusing ranges outside the region or not
  // aligned to `align` bytes. `what` names the tensor in the error message.
  absl::StatusOr<uint8_t*> resolve(uint64_t offset, uint64_t length, size_t align,
                                   const char* what) const;

 private:
  StagingRegion(std::string name, uint8_t* base, size_t size)
      : name_(std::move(name)), base_(base), size_(size) {}
  std::string name_;
  uint8_t* base_;
  size_t size_;
};

}  // namespace karakv::server
