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
  // Creates and maps a new region of `bytes` bytes (rounded up to the page size), followed by
  // `reserved_bytes` (page-rounded) that requests cannot address: the fast path's rings live there.
  static absl::StatusOr<std::unique_ptr<StagingRegion>> create(size_t bytes, size_t reserved_bytes = 0);
  ~StagingRegion();
  StagingRegion(const StagingRegion&) = delete;
  StagingRegion& operator=(const StagingRegion&) = delete;

  const std::string& name() const { return name_; }
  size_t size() const { return size_; }
  uint8_t* base() const { return base_; }
  // The reserved tail: it starts at offset size() and has reserved_size() bytes.
  uint8_t* reserved() const { return base_ + size_; }
  size_t reserved_size() const { return reserved_; }

  // Resolves [offset, offset + length) to a pointer, refusing ranges outside the region or not
  // aligned to `align` bytes. `what` names the tensor in the error message.
  absl::StatusOr<uint8_t*> resolve(uint64_t offset, uint64_t length, size_t align,
                                   const char* what) const;

 private:
  StagingRegion(std::string name, uint8_t* base, size_t size, size_t reserved)
      : name_(std::move(name)), base_(base), size_(size), reserved_(reserved) {}
  std::string name_;
  uint8_t* base_;
  size_t size_;      // addressable by requests
  size_t reserved_;  // after size_, not addressable
};

}  // namespace karakv::server
