#include "staging_io.h"

#include <cstring>

#include "absl/strings/str_cat.h"

#if KARAKV_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace karakv::bench {

absl::StatusOr<karakv::Staging> parse_staging(std::string_view flag, std::string_view value) {
  if (value == "shm") return karakv::Staging::kShm;
  if (value == "device") return karakv::Staging::kDevice;
  if (value == "device_fd") return karakv::Staging::kDeviceFd;
  return absl::InvalidArgumentError(
      absl::StrCat("--", std::string(flag), "=", std::string(value), ": expected shm, device (CUDA IPC) or device_fd (VMM over the fd socket)"));
}

std::string_view staging_name(karakv::Staging s) {
  switch (s) {
    case karakv::Staging::kShm: return "shm";
    case karakv::Staging::kDevice: return "device";
    case karakv::Staging::kDeviceFd: return "device_fd";
  }
  return "unknown";
}

StagedWrite::StagedWrite(karakv::Buffer& buffer, bool device) : buffer_(buffer), device_(device) {
  if (device_) host_.resize(buffer_.size());
}

absl::Status StagedWrite::flush(void* stream) {
  if (!device_) return absl::OkStatus();
#if KARAKV_HAVE_CUDA
  // From pageable memory: cudaMemcpyAsync returns once host_ is staged, so it may be rewritten.
  if (const cudaError_t err = stream != nullptr ? cudaMemcpyAsync(buffer_.data(), host_.data(), host_.size(),
                                                                  cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream))
                                                : cudaMemcpy(buffer_.data(), host_.data(), host_.size(), cudaMemcpyHostToDevice);
      err != cudaSuccess)
    return absl::InternalError(absl::StrCat("cudaMemcpy of ", host_.size(), " bytes into device staging: ",
                                            cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
  return absl::OkStatus();
#else
  return absl::FailedPreconditionError("device staging needs a build with CUDA (nvcc was not found at configure time)");
#endif
}

absl::Status flush_writes(std::initializer_list<StagedWrite*> writes) {
  bool device = false;
  for (StagedWrite* w : writes) {
    if (absl::Status s = w->flush(); !s.ok()) return s;
    device = device || w->device();
  }
  if (!device) return absl::OkStatus();
#if KARAKV_HAVE_CUDA
  if (const cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess)
    return absl::InternalError(absl::StrCat("cudaDeviceSynchronize after the writes into device staging: ",
                                            cudaGetErrorName(err)));
#endif
  return absl::OkStatus();
}

absl::Status flush_writes(std::initializer_list<StagedWrite*> writes, karakv::Client& client, void* stream) {
  for (StagedWrite* w : writes) {
    if (absl::Status s = w->flush(stream); !s.ok()) return s;
  }
  return client.inputs_written(stream);
}

#if KARAKV_HAVE_CUDA
absl::StatusOr<std::unique_ptr<WorkerStream>> WorkerStream::create() {
  std::unique_ptr<WorkerStream> s(new WorkerStream());
  cudaStream_t stream = nullptr;
  if (const cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); err != cudaSuccess)
    return absl::InternalError(absl::StrCat("cudaStreamCreateWithFlags: ", cudaGetErrorName(err)));
  s->stream_ = stream;
  return s;
}
WorkerStream::~WorkerStream() {
  if (stream_ == nullptr) return;
  cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}
absl::Status synchronize_stream(void* stream) {
  if (const cudaError_t err = cudaStreamSynchronize(static_cast<cudaStream_t>(stream)); err != cudaSuccess)
    return absl::InternalError(absl::StrCat("cudaStreamSynchronize of the worker's stream: ", cudaGetErrorName(err)));
  return absl::OkStatus();
}
#else
absl::StatusOr<std::unique_ptr<WorkerStream>> WorkerStream::create() {
  return absl::FailedPreconditionError("a stream-ordered worker needs a build with CUDA (nvcc was not found at configure time)");
}
WorkerStream::~WorkerStream() = default;
absl::Status synchronize_stream(void*) { return absl::OkStatus(); }
#endif

}  // namespace karakv::bench
