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
// Stream-ordered device staging (ClientOptions::stream_ordered): the worker's interprocess event,
// recorded after a request's inputs, and the daemon's, which the worker's stream waits on.
struct DeviceEvents {
  void* worker = nullptr;     // cudaEvent_t made here with cudaEventInterprocess | cudaEventDisableTiming
  std::string worker_handle;  // its cudaIpcEventHandle_t, sent in AttachRequest.worker_event_ipc_handle
  void* daemon = nullptr;     // cudaEvent_t opened from AttachReply.staging_event_ipc_handle
  int device = -1;            // the device the worker's event was made on
};
// Makes the worker's event on the current device. FAILED_PRECONDITION without CUDA in this SDK.
absl::Status create_worker_event(DeviceEvents* events);
// Opens the daemon's event on `device` (AttachReply.staging_device), which must be the device the
// worker's event was made on (FAILED_PRECONDITION naming both otherwise).
absl::Status open_daemon_event(const std::string& handle, int device, DeviceEvents* events);
// cudaEventRecord(worker, stream) / cudaStreamWaitEvent(stream, daemon); stream: a cudaStream_t.
absl::Status record_worker_event(const DeviceEvents& events, void* stream);
absl::Status wait_daemon_event(const DeviceEvents& events, void* stream);
// Destroys the daemon's event (before Detach) or the worker's (after Detach: karakvd may use it
// until then); each reset to null. Safe on null events.
void close_daemon_event(DeviceEvents* events);
void destroy_worker_event(DeviceEvents* events);

// Closes the mapping (cudaIpcCloseMemHandle, or for VMM: unmap, free the address range, release
// the handle); *import is reset. Safe on an empty import.
void close_device_staging(DeviceImport* import);

}  // namespace karakv
