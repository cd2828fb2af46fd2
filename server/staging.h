// A session's staging region, addressed by requests as offset ranges: a POSIX shared-memory object
// with an unguessable name, mode 0600, mapped by the daemon and the one worker it was made for
// (StagingRegion, here), or device memory exported to that worker (DeviceStaging, device_staging.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "karakv/kernels/backend.h"

namespace karakv::server {

enum class StagingKind { kShm, kCudaIpc, kCudaVmmFd };
const char* staging_kind_name(StagingKind kind);  // "shm", "cuda_ipc", "cuda_vmm_fd"

// Stream-ordered device staging (AttachRequest.worker_event_ipc_handle): the worker's event, after
// whose last record a request's device work starts, and the daemon's, recorded after it, on the
// backend's stream. Neither side's host waits for the other's GPU work.
struct StagingEvents {
  kernels::SharedEvent worker;  // opened from the worker's handle
  kernels::SharedEvent daemon;  // made here; its handle goes to the worker in AttachReply
};

// What requests see of a staging region, whichever memory it is.
class Staging {
 public:
  virtual ~Staging() = default;
  virtual StagingKind kind() const = 0;
  // Bytes requests may address, from base().
  virtual size_t size() const = 0;
  // Host memory for shm; a device pointer (the daemon's GPU) for device staging: never read it on
  // the host.
  virtual uint8_t* base() const = 0;
  bool on_device() const { return kind() != StagingKind::kShm; }
  // Unique per device region this daemon handed out; 0 for shm.
  virtual uint64_t generation() const { return 0; }
  // The session's events when its device staging is stream-ordered, else null.
  virtual const StagingEvents* events() const { return nullptr; }
  // Stream order (events() set): queue, on the backend's stream, the wait for the worker's latest
  // record before a request's device work, or the daemon's record after it. OK and nothing queued
  // for other regions. A failed record waits for the device work on the host, so the reply still
  // means the work is done.
  virtual absl::Status order_after_worker() const { return absl::OkStatus(); }
  virtual absl::Status order_before_worker() const { return absl::OkStatus(); }

  // Resolves [offset, offset + length) to a pointer, refusing ranges outside the region or not
  // aligned to `align` bytes. `what` names the tensor in the error message.
  absl::StatusOr<uint8_t*> resolve(uint64_t offset, uint64_t length, size_t align, const char* what) const;
};

// Runs `request(stream_ordered)` (returning absl::Status or absl::StatusOr) in the stream order of
// `staging` (null: a request with no tensor in staging): between the wait for the worker's event
// and the daemon's record when the region is stream-ordered, else as it is.
template <typename Request>
auto in_stream_order(const Staging* staging, Request&& request) -> decltype(request(false)) {
  using Result = decltype(request(false));
  const bool ordered = staging != nullptr && staging->events() != nullptr;
  if (ordered) {
    if (absl::Status s = staging->order_after_worker(); !s.ok()) return Result(s);
  }
  Result r = request(ordered);
  if (ordered) {
    if (absl::Status s = staging->order_before_worker(); !s.ok() && r.ok()) return Result(s);
  }
  return r;
}

// The generation a request names against its session's region: OK when they match; a request
// without one (0) is accepted for shm and refused for device staging. FAILED_PRECONDITION names
// both generations.
absl::Status check_generation(const Staging& staging, uint64_t requested);

class StagingRegion final : public Staging {
 public:
  // Creates and maps a new region of `bytes` bytes (rounded up to the page size), followed by
  // `reserved_bytes` (page-rounded) that requests cannot address: the fast path's rings live there.
  static absl::StatusOr<std::unique_ptr<StagingRegion>> create(size_t bytes, size_t reserved_bytes = 0);
  ~StagingRegion();
  StagingRegion(const StagingRegion&) = delete;
  StagingRegion& operator=(const StagingRegion&) = delete;

  StagingKind kind() const override { return StagingKind::kShm; }
  const std::string& name() const { return name_; }
  size_t size() const override { return size_; }
  uint8_t* base() const override { return base_; }
  // The reserved tail: it starts at offset size() and has reserved_size() bytes.
  uint8_t* reserved() const { return base_ + size_; }
  size_t reserved_size() const { return reserved_; }

 private:
  StagingRegion(std::string name, uint8_t* base, size_t size, size_t reserved)
      : name_(std::move(name)), base_(base), size_(size), reserved_(reserved) {}
  std::string name_;
  uint8_t* base_;
  size_t size_;      // addressable by requests
  size_t reserved_;  // after size_, not addressable
};

}  // namespace karakv::server
