// Bench workers on either kind of staging (--serve_staging, --p3_staging): shm, where a buffer is
// host memory written in place, or device staging (CUDA IPC or the VMM fd path), where a buffer is
// a device pointer written from host memory with cudaMemcpy and the copies are complete before the
// call that reads them (the worker's half of the ordering contract, docs/ARCHITECTURE.md "Device
// staging").
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "karakv/client.h"

namespace karakv::bench {

// "shm", "device" (Staging::kDevice) or "device_fd" (Staging::kDeviceFd); anything else is
// INVALID_ARGUMENT naming the flag and the choices.
absl::StatusOr<karakv::Staging> parse_staging(std::string_view flag, std::string_view value);
std::string_view staging_name(karakv::Staging s);

// Host bytes on their way into staging buffers. For shm staging, where() is the buffer itself and
// flush() does nothing; for device staging, where() is host memory of the buffer's size and flush()
// starts its copy into the buffer (flush_writes() also waits for it).
class StagedWrite {
 public:
  StagedWrite(karakv::Buffer& buffer, bool device);
  uint8_t* where() { return device_ ? host_.data() : buffer_.data(); }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(where());
  }
  // stream (a cudaStream_t): queue the copy on it and return (a stream-ordered worker); null: copy
  // now.
  absl::Status flush(void* stream = nullptr);
  bool device() const { return device_; }

 private:
  karakv::Buffer& buffer_;
  bool device_;
  std::vector<uint8_t> host_;
};

// Flushes each write and, when any went to device staging, waits for the copies
// (cudaDeviceSynchronize): the buffers are then complete for the call that reads them.
absl::Status flush_writes(std::initializer_list<StagedWrite*> writes);

// A stream-ordered worker's one stream (ClientOptions::stream_ordered): the writes of a request's
// inputs are queued on it (flush_writes(writes, stream)), inputs_written() marks them for karakvd,
// and after the request wait_outputs() orders the stream's next work after karakvd's.
class WorkerStream {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerStream>> create();
  ~WorkerStream();
  WorkerStream(const WorkerStream&) = delete;
  WorkerStream& operator=(const WorkerStream&) = delete;
  void* get() const { return stream_; }

 private:
  WorkerStream() = default;
  void* stream_ = nullptr;
};

// flush_writes for a stream-ordered worker: each copy queued on `stream` (a cudaStream_t), then
// client.inputs_written(stream); no host wait.
absl::Status flush_writes(std::initializer_list<StagedWrite*> writes, karakv::Client& client, void* stream);
// cudaStreamSynchronize(stream), its error named.
absl::Status synchronize_stream(void* stream);

}  // namespace karakv::bench
