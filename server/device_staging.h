// Device staging: a session's staging region in the daemon's GPU memory, exported to its worker as
// a CUDA IPC handle (staging_kind CUDA_IPC), or as a file descriptor of a cuMemCreate allocation
// sent over the staging fd socket (CUDA_VMM_FD, staging_fd_server.h; util/vmm.h). Requests
// address it by offset as they do shm staging (Staging, staging.h); the CUDA backend reads inputs
// from and writes outputs to base() + offset with no host copy.
//
// Ordering: the worker synchronizes the stream that wrote a request's inputs before it sends the
// request, and the backend synchronizes its stream before each call returns, so a reply means the
// outputs are complete in device memory (docs/ARCHITECTURE.md, "Device staging"). A session that
// attached with its worker's interprocess event is stream-ordered instead (order_by_events): a
// request's device work waits on the worker's event, the daemon records its own after it and
// replies without waiting, and the worker's stream waits on the daemon's event.
//
// Allocations come from DeviceStagingPool's slots (staging_slots.h): never freed while the daemon
// runs, reused for the same tenant only after a Detach, never after a lease expiry. The two kinds
// keep separate slots (a region is never reused as the other kind); max_bytes covers both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "karakv/kernels/backend.h"
#include "util/vmm.h"
#include "server/staging.h"
#include "server/staging_slots.h"

namespace karakv::server {

class DeviceStaging;

class DeviceStagingPool : public std::enable_shared_from_this<DeviceStagingPool> {
 public:
  // max_bytes: device memory all slots together may hold (live, free for reuse and quarantined).
  // `backend` must outlive the pool and every region from it. cuda_device: the GPU VMM regions are
  // created on (the backend's, --cuda_device).
  static std::shared_ptr<DeviceStagingPool> create(kernels::Backend& backend, uint64_t max_bytes,
                                                   int cuda_device = 0);
  ~DeviceStagingPool();
  DeviceStagingPool(const DeviceStagingPool&) = delete;
  DeviceStagingPool& operator=(const DeviceStagingPool&) = delete;

  // A region of at least `bytes` (rounded up to 2 MiB) for a session of `tenant`, of `kind`
  // (kCudaIpc or kCudaVmmFd). FAILED_PRECONDITION when the backend has no device memory
  // (--backend=cpu) or the build has no CUDA, RESOURCE_EXHAUSTED over max_bytes or when the GPU has
  // no room; both name the numbers.
  absl::StatusOr<std::shared_ptr<DeviceStaging>> acquire(uint64_t bytes, const std::string& tenant,
                                                         StagingKind kind = StagingKind::kCudaIpc);

  size_t bytes_held() const;
  size_t quarantined_bytes() const;

 private:
  friend class DeviceStaging;
  DeviceStagingPool(kernels::Backend& backend, uint64_t max_bytes, int cuda_device)
      : backend_(backend), max_bytes_(max_bytes), cuda_device_(cuda_device) {}
  void release(StagingKind kind, int slot, uint64_t generation, bool importer_closed);

  kernels::Backend& backend_;
  const uint64_t max_bytes_;
  const int cuda_device_;
  mutable absl::Mutex mu_;
  StagingSlots slots_ ABSL_GUARDED_BY(mu_);      // CUDA IPC regions
  StagingSlots vmm_slots_ ABSL_GUARDED_BY(mu_);  // VMM regions
  std::vector<kernels::SharedDeviceMemory> memory_ ABSL_GUARDED_BY(mu_);  // by slot of slots_
  std::vector<vmm::Mapping> vmm_memory_ ABSL_GUARDED_BY(mu_);             // by slot of vmm_slots_
};

class DeviceStaging final : public Staging {
 public:
  ~DeviceStaging() override;
  StagingKind kind() const override { return kind_; }
  size_t size() const override { return kind_ == StagingKind::kCudaVmmFd ? vmm_.bytes : memory_.bytes; }
  uint8_t* base() const override {
    return static_cast<uint8_t*>(kind_ == StagingKind::kCudaVmmFd ? vmm_.ptr : memory_.ptr);
  }
  uint64_t generation() const override { return generation_; }
  // CUDA_IPC: the cudaIpcMemHandle_t; empty for VMM regions.
  const std::string& ipc_handle() const { return memory_.ipc_handle; }
  int device() const { return kind_ == StagingKind::kCudaVmmFd ? vmm_.device : memory_.device; }
  // CUDA_VMM_FD: a new file descriptor of the allocation for the worker; the caller closes it.
  // FAILED_PRECONDITION for CUDA IPC regions.
  absl::StatusOr<int> export_fd() const;
  // Stream order: opens the worker's interprocess event (its cudaIpcEventHandle_t) and makes the
  // daemon's, whose handle event_ipc_handle() then returns. INVALID_ARGUMENT for a handle that is
  // not 64 bytes, FAILED_PRECONDITION when the backend cannot open or make events (both say what
  // was expected). Called once, before the region is shared between threads.
  absl::Status order_by_events(const std::string& worker_event_handle);
  const StagingEvents* events() const override { return events_ ? &*events_ : nullptr; }
  absl::Status order_after_worker() const override;
  absl::Status order_before_worker() const override;
  const std::string& event_ipc_handle() const;

  // The session detached: its SDK closed the mapping before sending Detach, so the slot may go to
  // the same tenant's next session. Without this (lease expiry) the slot is quarantined.
  void mark_importer_closed() { importer_closed_ = true; }

 private:
  friend class DeviceStagingPool;
  DeviceStaging(std::shared_ptr<DeviceStagingPool> pool, int slot, uint64_t generation,
                kernels::SharedDeviceMemory memory)
      : pool_(std::move(pool)), kind_(StagingKind::kCudaIpc), slot_(slot), generation_(generation),
        memory_(std::move(memory)) {}
  DeviceStaging(std::shared_ptr<DeviceStagingPool> pool, int slot, uint64_t generation, vmm::Mapping memory)
      : pool_(std::move(pool)), kind_(StagingKind::kCudaVmmFd), slot_(slot), generation_(generation),
        vmm_(memory) {}
  std::shared_ptr<DeviceStagingPool> pool_;
  const StagingKind kind_;
  const int slot_;
  const uint64_t generation_;
  const kernels::SharedDeviceMemory memory_;  // CUDA IPC
  const vmm::Mapping vmm_;                    // VMM
  bool importer_closed_ = false;  // set under the core's lock, read when the last reference goes
  std::optional<StagingEvents> events_;  // destroyed with the region's last reference
};

}  // namespace karakv::server
