#include "server/device_staging.h"

#include "absl/strings/str_cat.h"

namespace karakv::server {

std::shared_ptr<DeviceStagingPool> DeviceStagingPool::create(kernels::Backend& backend, uint64_t max_bytes) {
  return std::shared_ptr<DeviceStagingPool>(new DeviceStagingPool(backend, max_bytes));
}

DeviceStagingPool::~DeviceStagingPool() {
  absl::MutexLock lock(&mu_);
  for (const kernels::SharedDeviceMemory& m : memory_) {
    if (m.ptr != nullptr) backend_.free_shared(m);  // abandoned slots have none
  }
}

absl::StatusOr<std::shared_ptr<DeviceStaging>> DeviceStagingPool::acquire(uint64_t bytes, const std::string& tenant) {
  const uint64_t rounded =
      (bytes + kernels::kSharedMemoryAlignment - 1) / kernels::kSharedMemoryAlignment * kernels::kSharedMemoryAlignment;
  if (!backend_.shares_device_memory()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "staging_kind CUDA_IPC (device staging) needs karakvd on a GPU, but this karakvd runs the ",
        std::string(backend_.name()), " backend; start karakvd with --backend=cuda, or attach with staging_kind SHM (the default)"));
  }
  absl::MutexLock lock(&mu_);
  StagingSlots::Lease lease = slots_.acquire(rounded, tenant);
  if (lease.fresh) {
    const size_t held = slots_.bytes_held() - rounded;
    if (held + rounded > max_bytes_) {
      slots_.abandon(lease);
      return absl::ResourceExhaustedError(absl::StrCat(
          "device staging: ", rounded, " bytes wanted (", bytes, " rounded up to 2 MiB), ", held,
          " bytes already held of the limit ", max_bytes_, " (", slots_.bytes_in(StagingSlots::SlotState::kQuarantined),
          " of them quarantined after lease expiries until karakvd restarts); raise --max_device_staging_bytes, "
          "ask for less, or use staging_kind SHM"));
    }
    kernels::SharedDeviceMemory m;
    kernels::KernelStatus st = backend_.allocate_shared(rounded, &m);
    if (!st.is_ok()) {
      slots_.abandon(lease);
      return absl::ResourceExhaustedError(absl::StrCat("device staging: ", st.message));
    }
    if (memory_.size() <= size_t(lease.slot)) memory_.resize(lease.slot + 1);
    memory_[lease.slot] = std::move(m);
  }
  return std::shared_ptr<DeviceStaging>(
      new DeviceStaging(shared_from_this(), lease.slot, lease.generation, memory_[lease.slot]));
}

void DeviceStagingPool::release(int slot, uint64_t generation, bool importer_closed) {
  absl::MutexLock lock(&mu_);
  slots_.release(slot, generation, importer_closed);
}

size_t DeviceStagingPool::bytes_held() const {
  absl::MutexLock lock(&mu_);
  return slots_.bytes_held();
}

size_t DeviceStagingPool::quarantined_bytes() const {
  absl::MutexLock lock(&mu_);
  return slots_.bytes_in(StagingSlots::SlotState::kQuarantined);
}

DeviceStaging::~DeviceStaging() { pool_->release(slot_, generation_, importer_closed_); }

}  // namespace karakv::server
