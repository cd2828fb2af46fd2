// Device staging: a session's staging region in the daemon's GPU memory, exported to its worker as
// a CUDA IPC handle. Requests address it by offset as they do shm staging (Staging, staging.h); the
// CUDA backend reads inputs from and writes outputs to base() + offset with no host copy.
//
// Ordering: the worker synchronizes the stream that wrote a request's inputs before it sends the
// request, and the backend synchronizes its stream before each call returns, so a reply means the
// outputs are complete in device memory (docs/ARCHITECTURE.md, "Device staging").
//
// Allocations come from DeviceStagingPool's slots (staging_slots.h): never freed while the daemon
// runs, reused for the same tenant only after a Detach, never after a lease expiry.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "karakv/kernels/backend.h"
#include "server/staging.h"
#include "server/staging_slots.h"

namespace karakv::server {

class DeviceStaging;

class DeviceStagingPool : public std::enable_shared_from_this<DeviceStagingPool> {
 public:
  // max_bytes: device memory all slots together may hold (live, free for reuse and quarantined).
  // `backend` must outlive the pool and every region from it.
  static std::shared_ptr<DeviceStagingPool> create(kernels::Backend& backend, uint64_t max_bytes);
  ~DeviceStagingPool();
  DeviceStagingPool(const DeviceStagingPool&) = delete;
  DeviceStagingPool& operator=(const DeviceStagingPool&) = delete;

  // A region of at least `bytes` (rounded up to 2 MiB) for a session of `tenant`.
  // FAILED_PRECONDITION when the backend has no device memory (--backend=cpu), RESOURCE_EXHAUSTED
  // over max_bytes or when the GPU has no room; both name the numbers.
  absl::StatusOr<std::shared_ptr<DeviceStaging>> acquire(uint64_t bytes, const std::string& tenant);

  size_t bytes_held() const;
  size_t quarantined_bytes() const;

 private:
  friend class DeviceStaging;
  DeviceStagingPool(kernels::Backend& backend, uint64_t max_bytes) : backend_(backend), max_bytes_(max_bytes) {}
  void release(int slot, uint64_t generation, bool importer_closed);

  kernels::Backend& backend_;
  const uint64_t max_bytes_;
  mutable absl::Mutex mu_;
  StagingSlots slots_ ABSL_GUARDED_BY(mu_);
  std::vector<kernels::SharedDeviceMemory> memory_ ABSL_GUARDED_BY(mu_);  // by slot
};

class DeviceStaging final : public Staging {
 public:
  ~DeviceStaging() override;
  StagingKind kind() const override { return StagingKind::kCudaIpc; }
  size_t size() const override { return memory_.bytes; }
  uint8_t* base() const override { return static_cast<uint8_t*>(memory_.ptr); }
  uint64_t generation() const override { return generation_; }
  const std::string& ipc_handle() const { return memory_.ipc_handle; }
  int device() const { return memory_.device; }
  // The session detached: its SDK closed the mapping before sending Detach, so the slot may go to
  // the same tenant's next session. Without this (lease expiry) the slot is quarantined.
  void mark_importer_closed() { importer_closed_ = true; }

 private:
  friend class DeviceStagingPool;
  DeviceStaging(std::shared_ptr<DeviceStagingPool> pool, int slot, uint64_t generation,
                kernels::SharedDeviceMemory memory)
      : pool_(std::move(pool)), slot_(slot), generation_(generation), memory_(std::move(memory)) {}
  std::shared_ptr<DeviceStagingPool> pool_;
  const int slot_;
  const uint64_t generation_;
  const kernels::SharedDeviceMemory memory_;
  bool importer_closed_ = false;  // set under the core's lock, read when the last reference goes
};

}  // namespace karakv::server
