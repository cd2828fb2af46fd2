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

grpc::ByteBuffer encode_with_inline_tensors(const google::protobuf::MessageLite& head,
                                            std::span<const InlineTensor> tensors, SendBuffers& buffers) {
  constexpr int kData = v1::TensorRef::kDataFieldNumber;
  const uint32_t data_tag = WireFormatLite::MakeTag(kData, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
  const size_t head_size = head.ByteSizeLong();
  size_t total = head_size;
  std::vector<size_t> ref_sizes;  // each TensorRef message's size
  for (const InlineTensor& t : tensors) {
    const size_t n = t.bytes.size();
    const size_t ref = CodedOutputStream::VarintSize32(data_tag) + CodedOutputStream::VarintSize64(n) + n;
    ref_sizes.push_back(ref);
    const uint32_t tag = WireFormatLite::MakeTag(t.field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
    total += CodedOutputStream::VarintSize32(tag) + CodedOutputStream::VarintSize64(ref) + ref;
  }
  uint8_t* out = nullptr;
  grpc::Slice slice = buffers.take(total, &out);
  uint8_t* p = head.SerializeWithCachedSizesToArray(out);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const InlineTensor& t = tensors[i];
    p = CodedOutputStream::WriteTagToArray(WireFormatLite::MakeTag(t.field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED),
                                           p);
    p = CodedOutputStream::WriteVarint64ToArray(ref_sizes[i], p);
    p = CodedOutputStream::WriteTagToArray(data_tag, p);
    p = CodedOutputStream::WriteVarint64ToArray(t.bytes.size(), p);
    if (!t.bytes.empty()) std::memcpy(p, t.bytes.data(), t.bytes.size());
    p += t.bytes.size();
  }
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace karakv::client_internal
