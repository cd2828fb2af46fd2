#include "device_import.h"

#include "absl/strings/str_cat.h"

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

void close_device_staging(DeviceImport* import) { *import = DeviceImport{}; }

#endif

}  // namespace karakv
