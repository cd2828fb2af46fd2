// Requests whose tensors travel inline (a session without staging): the message is encoded by hand
// into a buffer kept from call to call, and handed to gRPC as one slice. Protobuf's bytes field and
// gRPC's serialization were two copies of every tensor into freshly mapped memory, faulted in and
// zeroed on each call (docs/BENCHMARKS.md, "Inline Append of 1 MiB"); this is one copy into pages
// that are already mapped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"

namespace karakv::client_internal {

// Send buffers kept for reuse. A buffer goes back when gRPC releases the slice that points at it,
// whenever that is (after the call, or later if the transport still holds it), so no call ever
// reuses memory gRPC may still read. Shared by every thread of one Client.
class SendBuffers : public std::enable_shared_from_this<SendBuffers> {
 public:
  static constexpr size_t kKeepBuffers = 4;       // at most this many kept
  static constexpr size_t kKeepBytes = 64 << 20;  // and at most this many bytes among them

  // A slice of `size` bytes; `*data` is where to write them. The smallest kept buffer that fits,
  // else a new one (its capacity rounded up to 64 KiB).
  grpc::Slice take(size_t size, uint8_t** data);

  size_t kept_buffers() const;
  size_t kept_bytes() const;

 private:
  struct Chunk {
    std::unique_ptr<uint8_t[]> data;
    size_t capacity = 0;
  };
  struct Lease;
  static void release(void* lease);
  void put(Chunk chunk);

  mutable std::mutex mu_;
  std::vector<Chunk> kept_;
};

// One tensor of the request, sent as `field` (a TensorRef message) holding `bytes` as its data.
struct InlineTensor {
  int field = 0;
  std::span<const uint8_t> bytes;
};

// `head` (the request without these tensors) serialized, then each tensor as its TensorRef field,
// all in one buffer from `buffers`. Protobuf takes fields in any order, so the daemon parses exactly
// the message that setting the tensors' data fields in `head` would have made.
grpc::ByteBuffer encode_with_inline_tensors(const google::protobuf::MessageLite& head,
                                            std::span<const InlineTensor> tensors, SendBuffers& buffers);

// One entry of a repeated message field: the entry without its inline tensors, and those tensors.
struct InlineEntry {
  const google::protobuf::MessageLite* head = nullptr;
  std::vector<InlineTensor> tensors;
};

// `outer` serialized (without the entries), then each entry as the repeated message field `field`,
// encoded as encode_with_inline_tensors encodes a message (AppendBatchRequest.entries).
grpc::ByteBuffer encode_entries_with_inline_tensors(const google::protobuf::MessageLite& outer, int field,
                                                    std::span<const InlineEntry> entries, SendBuffers& buffers);

}  // namespace karakv::client_internal
