// Staging::kDevice on the worker's side: opens the daemon's device staging region from its CUDA IPC
// handle (cudaIpcOpenMemHandle) and closes it again; Staging::kDeviceFd: imports its VMM allocation
// from the file descriptor the staging fd socket sends (util/vmm.h, util/fd_passing.h). Built with
// CUDA when the SDK is (nvcc found); otherwise importing refuses, saying so.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "util/vmm.h"

namespace karakv {

struct DeviceImport {
  void* ptr = nullptr;  // this process's device pointer to the region's first byte
  int device = -1;
  vmm::Mapping vmm;  // Staging::kDeviceFd: the imported VMM allocation (ptr == vmm.ptr)
};

// handle: AttachReply.staging_ipc_handle (64 bytes); device: the daemon's device ordinal, which
// must name the same GPU in this process (same CUDA_VISIBLE_DEVICES).
absl::StatusOr<DeviceImport> import_device_staging(const std::string& handle, int device, uint64_t bytes);
// Staging::kDeviceFd: asks karakvd's staging fd socket for the region of (session, generation),
// imports the file descriptor it sends (cuMemImportFromShareableHandle, reserve, map, set access)
// and closes the descriptor. `bytes`: AttachReply.staging_bytes, which the daemon's answer must match.
absl::StatusOr<DeviceImport> import_device_staging_fd(const std::string& fd_socket, const std::string& session_id,
                                                      uint64_t generation, uint64_t bytes);
// Closes the mapping (cudaIpcCloseMemHandle, or for VMM: unmap, free the address range, release
// the handle); *import is reset. Safe on an empty import.
void close_device_staging(DeviceImport* import);

}  // namespace karakv
