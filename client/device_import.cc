#include "device_import.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "util/fd_passing.h"

#if KARAKV_CLIENT_CUDA
#include <cuda_runtime.h>

#include <cstring>
#endif

namespace karakv {

#if KARAKV_CLIENT_CUDA

absl::StatusOr<DeviceImport> import_device_staging(const std::string& handle, int device, uint64_t bytes) {
  cudaIpcMemHandle_t h;
  if (handle.size() != sizeof(h)) {
    return absl::InternalError(absl::StrCat("Attach: staging_ipc_handle has ", handle.size(), " bytes, expected ",
                                            sizeof(h), " (SDK and karakvd disagree)"));
  }
  std::memcpy(&h, handle.data(), sizeof(h));
  int previous = 0;
  cudaGetDevice(&previous);
  cudaError_t err = cudaSetDevice(device);
  void* p = nullptr;
  if (err == cudaSuccess) err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  cudaSetDevice(previous);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "Attach: cannot open the device staging region (", bytes, " bytes on device ", device,
        ") with cudaIpcOpenMemHandle: ", cudaGetErrorName(err), " (", cudaGetErrorString(err),
        "); the worker must see karakvd's process (same PID namespace) and its GPU as device ", device,
        ", or attach with Staging::kShm"));
  }
  return DeviceImport{p, device};
}

void close_device_staging(DeviceImport* import) {
  if (import->ptr == nullptr) return;
  if (import->vmm.handle != 0) {
    vmm::release(&import->vmm);
    *import = DeviceImport{};
    return;
  }
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(import->device);
  cudaIpcCloseMemHandle(import->ptr);
  cudaSetDevice(previous);
  *import = DeviceImport{};
}

#else

absl::StatusOr<DeviceImport> import_device_staging(const std::string&, int, uint64_t) {
  return absl::FailedPreconditionError(
      "Attach: device staging needs the SDK built with CUDA (nvcc found at build time); this libkarakv_client was "
      "built without it; use Staging::kShm");
}

void close_device_staging(DeviceImport* import) {
  vmm::release(&import->vmm);
  *import = DeviceImport{};
}

#endif

absl::StatusOr<DeviceImport> import_device_staging_fd(const std::string& fd_socket, const std::string& session_id,
                                                      uint64_t generation, uint64_t bytes) {
  if (!vmm::built_with_cuda()) {
    return absl::FailedPreconditionError(
        "Attach: Staging::kDeviceFd needs the SDK built with CUDA (nvcc found at build time); this "
        "libkarakv_client was built without it; use Staging::kShm");
  }
  if (fd_socket.empty()) {
    return absl::InvalidArgumentError(
        "Attach: Staging::kDeviceFd needs karakvd's staging fd socket: set ClientOptions::staging_fd_socket "
        "(the target is not a unix: socket to derive it from)");
  }
  auto received = fdpass::request_staging_fd(fd_socket, session_id, generation);
  if (!received.ok()) {
    return absl::Status(received.status().code(), absl::StrCat("Attach: ", received.status().message()));
  }
  if (received->bytes != bytes) {
    close(received->fd);
    return absl::InternalError(absl::StrCat("Attach: the staging fd socket sent a region of ", received->bytes,
                                            " bytes, the AttachReply says ", bytes, " (SDK and karakvd disagree)"));
  }
  auto mapped = vmm::import_fd(received->fd, received->device, received->bytes);
  close(received->fd);  // the mapping keeps the allocation
  if (!mapped.ok()) return mapped.status();
  DeviceImport out;
  out.ptr = mapped->ptr;
  out.device = mapped->device;
  out.vmm = *mapped;
  return out;
}

}  // namespace karakv
