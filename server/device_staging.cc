#include "server/device_staging.h"

#include "absl/strings/str_cat.h"

namespace karakv::server {

std::shared_ptr<DeviceStagingPool> DeviceStagingPool::create(kernels::Backend& backend, uint64_t max_bytes,
                                                             int cuda_device) {
  return std::shared_ptr<DeviceStagingPool>(new DeviceStagingPool(backend, max_bytes, cuda_device));
}

DeviceStagingPool::~DeviceStagingPool() {
  const kernels::KernelStatus waited = backend_.synchronize();  // nothing queued may still use a region
  (void)waited;
  absl::MutexLock lock(&mu_);
  for (const kernels::SharedDeviceMemory& m : memory_) {
    if (m.ptr != nullptr) backend_.free_shared(m);  // abandoned slots have none
  }
  for (vmm::Mapping& m : vmm_memory_) vmm::release(&m);
}

absl::StatusOr<std::shared_ptr<DeviceStaging>> DeviceStagingPool::acquire(uint64_t bytes, const std::string& tenant,
                                                                          StagingKind kind) {
  const uint64_t rounded =
      (bytes + kernels::kSharedMemoryAlignment - 1) / kernels::kSharedMemoryAlignment * kernels::kSharedMemoryAlignment;
  const bool is_vmm = kind == StagingKind::kCudaVmmFd;
  const char* kind_text = is_vmm ? "CUDA_VMM_FD" : "CUDA_IPC";
  if (kind != StagingKind::kCudaIpc && !is_vmm) {
    return absl::InvalidArgumentError(
        absl::StrCat("device staging: staging_kind ", staging_kind_name(kind), " is not device staging"));
  }
  if (!backend_.shares_device_memory()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "staging_kind ", kind_text, " (device staging) needs karakvd on a GPU, but this karakvd runs the ",
        std::string(backend_.name()),
        " backend; start karakvd with --backend=cuda, or attach with staging_kind SHM (the default)"));
  }
  if (is_vmm && !vmm::built_with_cuda()) {
    return absl::FailedPreconditionError(
        "staging_kind CUDA_VMM_FD needs karakvd built with CUDA; attach with staging_kind SHM (the default)");
  }
  absl::MutexLock lock(&mu_);
  StagingSlots& slots = is_vmm ? vmm_slots_ : slots_;
  StagingSlots::Lease lease = slots.acquire(rounded, tenant);
  if (lease.fresh) {
    const size_t held = slots_.bytes_held() + vmm_slots_.bytes_held() - rounded;
    if (held + rounded > max_bytes_) {
      slots.abandon(lease);
      return absl::ResourceExhaustedError(absl::StrCat(
          "device staging: ", rounded, " bytes wanted (", bytes, " rounded up to 2 MiB), ", held,
          " bytes already held of the limit ", max_bytes_, " (",
          slots_.bytes_in(StagingSlots::SlotState::kQuarantined) +
              vmm_slots_.bytes_in(StagingSlots::SlotState::kQuarantined),
          " of them quarantined after lease expiries until karakvd restarts); raise --max_device_staging_bytes, "
          "ask for less, or use staging_kind SHM"));
    }
    if (is_vmm) {
      absl::StatusOr<vmm::Mapping> m = vmm::allocate(cuda_device_, rounded);
      if (!m.ok()) {
        slots.abandon(lease);
        return absl::Status(m.status().code(), absl::StrCat("device staging: ", m.status().message()));
      }
      if (vmm_memory_.size() <= size_t(lease.slot)) vmm_memory_.resize(lease.slot + 1);
      vmm_memory_[lease.slot] = *m;
    } else {
      kernels::SharedDeviceMemory m;
      kernels::KernelStatus st = backend_.allocate_shared(rounded, &m);
      if (!st.is_ok()) {
        slots.abandon(lease);
        return absl::ResourceExhaustedError(absl::StrCat("device staging: ", st.message));
      }
      if (memory_.size() <= size_t(lease.slot)) memory_.resize(lease.slot + 1);
      memory_[lease.slot] = std::move(m);
    }
  }
  if (is_vmm) {
    return std::shared_ptr<DeviceStaging>(
        new DeviceStaging(shared_from_this(), lease.slot, lease.generation, vmm_memory_[lease.slot]));
  }
  return std::shared_ptr<DeviceStaging>(
      new DeviceStaging(shared_from_this(), lease.slot, lease.generation, memory_[lease.slot]));
}

void DeviceStagingPool::release(StagingKind kind, int slot, uint64_t generation, bool importer_closed) {
  absl::MutexLock lock(&mu_);
  (kind == StagingKind::kCudaVmmFd ? vmm_slots_ : slots_).release(slot, generation, importer_closed);
}

size_t DeviceStagingPool::bytes_held() const {
  absl::MutexLock lock(&mu_);
  return slots_.bytes_held() + vmm_slots_.bytes_held();
}

size_t DeviceStagingPool::quarantined_bytes() const {
  absl::MutexLock lock(&mu_);
  return slots_.bytes_in(StagingSlots::SlotState::kQuarantined) +
         vmm_slots_.bytes_in(StagingSlots::SlotState::kQuarantined);
}

absl::StatusOr<int> DeviceStaging::export_fd() const {
  if (kind_ != StagingKind::kCudaVmmFd) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this session attached with staging_kind ", staging_kind_name(kind_),
        "; the staging fd socket serves only CUDA_VMM_FD sessions (CUDA_IPC workers open AttachReply's handle)"));
  }
  return vmm::export_fd(vmm_);
}

DeviceStaging::~DeviceStaging() {
  if (events_) {
    // Stream-ordered requests may have kernels queued that write this region: they finish before
    // the slot can go to another session.
    const kernels::KernelStatus waited = pool_->backend_.synchronize();
    (void)waited;  // a fault here is the next request's to report
    pool_->backend_.destroy_shared_event(&events_->worker);
    // After a lease expiry the worker may be alive and still hold the daemon's event: destroying the
    // exported event would leave it with undefined behaviour, so it stays, like the region itself
    // (quarantined), until karakvd exits.
    if (importer_closed_) pool_->backend_.destroy_shared_event(&events_->daemon);
  }
  pool_->release(kind_, slot_, generation_, importer_closed_);
}

absl::Status DeviceStaging::order_by_events(const std::string& worker_event_handle) {
  constexpr size_t kHandleBytes = 64;  // cudaIpcEventHandle_t
  if (worker_event_handle.size() != kHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("worker_event_ipc_handle of ", worker_event_handle.size(),
                                                   " bytes; expected the ", kHandleBytes,
                                                   " bytes of a cudaIpcEventHandle_t (cudaIpcGetEventHandle)"));
  }
  kernels::Backend& backend = pool_->backend_;
  StagingEvents events;
  if (kernels::KernelStatus st = backend.open_shared_event(worker_event_handle, &events.worker); !st.is_ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker_event_ipc_handle: ", st.message,
        "; expected an event made with cudaEventInterprocess | cudaEventDisableTiming by a process on the daemon's "
        "GPU, or attach without one (the daemon then waits for its kernels before each reply)"));
  }
  if (kernels::KernelStatus st = backend.create_shared_event(&events.daemon); !st.is_ok()) {
    backend.destroy_shared_event(&events.worker);
    return absl::FailedPreconditionError(absl::StrCat("stream-ordered staging: ", st.message));
  }
  events_ = std::move(events);
  return absl::OkStatus();
}

absl::Status DeviceStaging::order_after_worker() const {
  if (!events_) return absl::OkStatus();
  if (kernels::KernelStatus st = pool_->backend_.wait_event(events_->worker); !st.is_ok()) {
    return absl::InternalError(absl::StrCat("stream order: waiting for the worker's event: ", st.message));
  }
  return absl::OkStatus();
}

absl::Status DeviceStaging::order_before_worker() const {
  if (!events_) return absl::OkStatus();
  kernels::KernelStatus st = pool_->backend_.record_event(events_->daemon);
  if (st.is_ok()) return absl::OkStatus();
  // Without the record the worker's wait would not cover this request's kernels: finish them here.
  const kernels::KernelStatus waited = pool_->backend_.synchronize();
  return absl::InternalError(absl::StrCat("stream order: recording the daemon's event: ", st.message,
                                          waited.is_ok() ? " (the request's kernels were waited for on the host)"
                                                         : "; then " + waited.message));
}

const std::string& DeviceStaging::event_ipc_handle() const {
  static const std::string kNone;
  return events_ ? events_->daemon.ipc_handle : kNone;
}

}  // namespace karakv::server
