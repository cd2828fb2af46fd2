#include "inline_request.h"

#include <algorithm>
#include <cstring>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "karakv/v1/karakv.pb.h"

namespace karakv::client_internal {

using google::protobuf::io::CodedOutputStream;
using google::protobuf::internal::WireFormatLite;

// What a slice's destroy callback gets: the buffer, and the pool to give it back to (which a
// released slice keeps alive, even past its Client).
struct SendBuffers::Lease {
  std::shared_ptr<SendBuffers> pool;
  Chunk chunk;
};

grpc::Slice SendBuffers::take(size_t size, uint8_t** data) {
  Chunk chunk;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto best = kept_.end();
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->capacity >= size && (best == kept_.end() || it->capacity < best->capacity)) best = it;
    }
    if (best != kept_.end()) {
      chunk = std::move(*best);
      kept_.erase(best);
    }
  }
  if (chunk.data == nullptr) {
    chunk.capacity = std::max<size_t>(size + (64 << 10) - 1, 1) / (64 << 10) * (64 << 10);
    chunk.data.reset(new uint8_t[chunk.capacity]);
  }
  *data = chunk.data.get();
  auto* lease = new Lease{shared_from_this(), std::move(chunk)};
  return grpc::Slice(*data, size, &SendBuffers::release, lease);
}

void SendBuffers::release(void* p) {
  std::unique_ptr<Lease> lease(static_cast<Lease*>(p));
  lease->pool->put(std::move(lease->chunk));
}

void SendBuffers::put(Chunk chunk) {
  std::lock_guard<std::mutex> lock(mu_);
  kept_.push_back(std::move(chunk));
  // Within both limits, the largest first (a large buffer's pages are what a fresh one costs most);
  // one too large for the byte limit alone is dropped.
  std::sort(kept_.begin(), kept_.end(), [](const Chunk& a, const Chunk& b) { return a.capacity > b.capacity; });
  std::vector<Chunk> keep;
  size_t bytes = 0;
  for (Chunk& c : kept_) {
    if (keep.size() < kKeepBuffers && bytes + c.capacity <= kKeepBytes) {
      bytes += c.capacity;
      keep.push_back(std::move(c));
    }
  }
  kept_ = std::move(keep);
}

size_t SendBuffers::kept_buffers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kept_.size();
}

size_t SendBuffers::kept_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t bytes = 0;
  for (const Chunk& c : kept_) bytes += c.capacity;
  return bytes;
}

namespace {

uint32_t length_delimited_tag(int field) {
  return WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
}

// A length-delimited field's bytes: its tag, the length, then `length` bytes of payload.
size_t field_size(int field, size_t length) {
  return CodedOutputStream::VarintSize32(length_delimited_tag(field)) + CodedOutputStream::VarintSize64(length) +
         length;
}

// A tensor as its TensorRef field: TensorRef{data = bytes}.
size_t tensor_field_size(const InlineTensor& t) {
  return field_size(t.field, field_size(v1::TensorRef::kDataFieldNumber, t.bytes.size()));
}

// Bytes of `head` (its cached size: ByteSizeLong ran) followed by its inline tensors.
size_t message_size(const google::protobuf::MessageLite& head, std::span<const InlineTensor> tensors) {
  size_t n = head.GetCachedSize();
  for (const InlineTensor& t : tensors) n += tensor_field_size(t);
  return n;
}

uint8_t* write_field_header(int field, size_t length, uint8_t* p) {
  p = CodedOutputStream::WriteTagToArray(length_delimited_tag(field), p);
  return CodedOutputStream::WriteVarint64ToArray(length, p);
}

uint8_t* write_message(const google::protobuf::MessageLite& head, std::span<const InlineTensor> tensors, uint8_t* p) {
  p = head.SerializeWithCachedSizesToArray(p);
  for (const InlineTensor& t : tensors) {
    p = write_field_header(t.field, field_size(v1::TensorRef::kDataFieldNumber, t.bytes.size()), p);
    p = write_field_header(v1::TensorRef::kDataFieldNumber, t.bytes.size(), p);
    if (!t.bytes.empty()) std::memcpy(p, t.bytes.data(), t.bytes.size());
    p += t.bytes.size();
  }
  return p;
}

}  // namespace

grpc::ByteBuffer encode_with_inline_tensors(const google::protobuf::MessageLite& head,
                                            std::span<const InlineTensor> tensors, SendBuffers& buffers) {
  head.ByteSizeLong();  // caches the sizes SerializeWithCachedSizesToArray writes with
  uint8_t* out = nullptr;
  grpc::Slice slice = buffers.take(message_size(head, tensors), &out);
  write_message(head, tensors, out);
  return grpc::ByteBuffer(&slice, 1);
}

grpc::ByteBuffer encode_entries_with_inline_tensors(const google::protobuf::MessageLite& outer, int field,
                                                    std::span<const InlineEntry> entries, SendBuffers& buffers) {
  size_t total = outer.ByteSizeLong();
  std::vector<size_t> sizes;
  for (const InlineEntry& e : entries) {
    e.head->ByteSizeLong();
    sizes.push_back(message_size(*e.head, e.tensors));
    total += field_size(field, sizes.back());
  }
  uint8_t* out = nullptr;
  grpc::Slice slice = buffers.take(total, &out);
  uint8_t* p = outer.SerializeWithCachedSizesToArray(out);
  for (size_t i = 0; i < entries.size(); ++i) {
    p = write_field_header(field, sizes[i], p);
    p = write_message(*entries[i].head, entries[i].tensors, p);
  }
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace karakv::client_internal
