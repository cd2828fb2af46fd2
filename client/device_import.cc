#include "device_import.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "util/fd_passing.h"

#if KARAKV_CLIENT_CUDA
#include <cuda_runtime.h>

#include <chrono>
#include <cstring>
#include <thread>
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

namespace {
absl::Status cuda_failed(const char* what, cudaError_t err, const char* hint = "") {
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")", hint));
}
}  // namespace

absl::Status create_worker_event(DeviceEvents* events) {
  cudaEvent_t e = nullptr;
  if (cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventInterprocess | cudaEventDisableTiming); err != cudaSuccess)
    return cuda_failed("stream_ordered: cudaEventCreateWithFlags(cudaEventInterprocess | cudaEventDisableTiming)", err);
  cudaIpcEventHandle_t h;
  if (cudaError_t err = cudaIpcGetEventHandle(&h, e); err != cudaSuccess) {
    cudaEventDestroy(e);
    return cuda_failed("stream_ordered: cudaIpcGetEventHandle", err);
  }
  events->worker = e;
  events->worker_handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  cudaGetDevice(&events->device);
  return absl::OkStatus();
}

absl::Status open_daemon_event(const std::string& handle, int device, DeviceEvents* events) {
  if (device != events->device) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Attach: stream_ordered: the worker's event was made on device ", events->device,
        " (the current CUDA device at Attach), karakvd's GPU is device ", device,
        " in this process; call cudaSetDevice(", device, ") before Attach"));
  }
  cudaIpcEventHandle_t h;
  if (handle.size() != sizeof(h)) {
    return absl::InternalError(absl::StrCat("Attach: staging_event_ipc_handle has ", handle.size(),
                                            " bytes, expected ", sizeof(h), " (SDK and karakvd disagree)"));
  }
  std::memcpy(&h, handle.data(), sizeof(h));
  cudaEvent_t e = nullptr;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaIpcOpenEventHandle(&e, h);
  cudaSetDevice(previous);
  if (err != cudaSuccess)
    return cuda_failed("Attach: cudaIpcOpenEventHandle of karakvd's event", err,
                       "; the worker must see karakvd's process (same PID namespace) and GPU, or attach without "
                       "stream_ordered");
  events->daemon = e;
  return absl::OkStatus();
}

absl::Status record_worker_event(const DeviceEvents& events, void* stream) {
  if (events.worker == nullptr)
    return absl::FailedPreconditionError("inputs_written: this client is not stream-ordered (ClientOptions::stream_ordered)");
  if (cudaError_t err = cudaEventRecord(static_cast<cudaEvent_t>(events.worker), static_cast<cudaStream_t>(stream));
      err != cudaSuccess)
    return cuda_failed("inputs_written: cudaEventRecord", err);
  return absl::OkStatus();
}

absl::Status wait_daemon_event(const DeviceEvents& events, void* stream) {
  if (events.daemon == nullptr)
    return absl::FailedPreconditionError("wait_outputs: this client is not stream-ordered (ClientOptions::stream_ordered)");
  if (cudaError_t err = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(events.daemon), 0);
      err != cudaSuccess)
    return cuda_failed("wait_outputs: cudaStreamWaitEvent", err);
  return absl::OkStatus();
}

void close_daemon_event(DeviceEvents* events) {
  if (events->daemon != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(events->daemon));
  events->daemon = nullptr;
}

void destroy_worker_event(DeviceEvents* events) {
  if (events->worker != nullptr) {
    // Its last record should be done before it goes; but that record may wait on karakvd's event,
    // which a failed or restarted daemon never completes: wait at most a second, then leave it.
    auto e = static_cast<cudaEvent_t>(events->worker);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    cudaError_t q = cudaEventQuery(e);
    while (q == cudaErrorNotReady && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      q = cudaEventQuery(e);
    }
    if (q != cudaErrorNotReady) cudaEventDestroy(e);
    cudaGetLastError();
  }
  events->worker = nullptr;
  events->worker_handle.clear();
}

#else

absl::Status create_worker_event(DeviceEvents*) {
  return absl::FailedPreconditionError(
      "Attach: stream_ordered needs the SDK built with CUDA (nvcc found at build time); this libkarakv_client was "
      "built without it");
}
absl::Status open_daemon_event(const std::string&, int, DeviceEvents*) { return create_worker_event(nullptr); }
absl::Status record_worker_event(const DeviceEvents&, void*) {
  return absl::FailedPreconditionError("inputs_written: this client is not stream-ordered (ClientOptions::stream_ordered)");
}
absl::Status wait_daemon_event(const DeviceEvents&, void*) {
  return absl::FailedPreconditionError("wait_outputs: this client is not stream-ordered (ClientOptions::stream_ordered)");
}
void close_daemon_event(DeviceEvents*) {}
void destroy_worker_event(DeviceEvents*) {}

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
