// Staging::kDevice on the worker's side: opens the daemon's device staging region from its CUDA IPC
// handle (cudaIpcOpenMemHandle) and closes it again. Built with CUDA when the SDK is (nvcc found);
// otherwise importing refuses, saying so.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace karakv {

struct DeviceImport {
  void* ptr = nullptr;  // this process's device pointer to the region's first byte
  int device = -1;
};

// handle: AttachReply.staging_ipc_handle (64 bytes); device: the daemon's device ordinal, which
// must name the same GPU in this process (same CUDA_VISIBLE_DEVICES).
absl::StatusOr<DeviceImport> import_device_staging(const std::string& handle, int device, uint64_t bytes);
// Closes the mapping (cudaIpcCloseMemHandle); *import is reset. Safe on an empty import.
void close_device_staging(DeviceImport* import);

}  // namespace karakv
