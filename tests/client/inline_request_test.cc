// The SDK's hand-encoded requests with inline tensors: protobuf parses them into exactly the
// message that setting the data fields would have made, and their buffers are reused only after
// gRPC has let go of them.
#include "client/inline_request.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "google/protobuf/util/message_differencer.h"
#include "karakv/v1/karakv.pb.h"

namespace karakv::client_internal {
namespace {

std::vector<uint8_t> random_bytes(size_t n, std::mt19937& rng) {
  std::vector<uint8_t> b(n);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

std::string flatten(const grpc::ByteBuffer& bb) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(bb.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// Sizes around the varint boundaries of the lengths (127/128, 16383/16384) and a megabyte.
TEST(InlineRequestTest, ParsesAsTheMessageWithItsDataFieldsSet) {
  std::mt19937 rng(7);
  auto buffers = std::make_shared<SendBuffers>();
  for (size_t n : {size_t{0}, size_t{1}, size_t{124}, size_t{125}, size_t{127}, size_t{128}, size_t{16380},
                   size_t{16384}, size_t{1} << 20}) {
    const std::vector<uint8_t> k = random_bytes(n, rng), v = random_bytes(n + 3, rng), q = random_bytes(n / 2, rng);
    v1::AppendRequest head;
    head.set_session_id("s-1");
    head.set_sequence_id(1234567890123ull);
    head.set_num_tokens(45);
    head.set_num_query_tokens(2);
    head.set_staging_generation(9);
    for (int i = 0; i < 5; ++i) head.add_token_ids(1000 * i - 7);
    v1::AppendRequest expected = head;
    expected.mutable_k()->set_data(k.data(), k.size());
    expected.mutable_v()->set_data(v.data(), v.size());
    expected.mutable_q()->set_data(q.data(), q.size());

    const InlineTensor tensors[] = {{v1::AppendRequest::kKFieldNumber, k},
                                    {v1::AppendRequest::kVFieldNumber, v},
                                    {v1::AppendRequest::kQFieldNumber, q}};
    const std::string wire = flatten(encode_with_inline_tensors(head, tensors, *buffers));
    EXPECT_EQ(wire.size(), expected.ByteSizeLong()) << n;
    v1::AppendRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(wire)) << n;
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(parsed, expected)) << n;
    EXPECT_EQ(parsed.k().location_case(), v1::TensorRef::kData);
  }
}

// A staging reference in the head stays as it is; only the inline tensor is added.
TEST(InlineRequestTest, AStagedTensorBesideAnInlineOneKeepsItsRange) {
  auto buffers = std::make_shared<SendBuffers>();
  const std::vector<uint8_t> v(300, 0x5a);
  v1::AppendRequest head;
  head.mutable_k()->mutable_staging()->set_offset(4096);
  head.mutable_k()->mutable_staging()->set_length(300);
  const InlineTensor tensors[] = {{v1::AppendRequest::kVFieldNumber, v}};
  v1::AppendRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(flatten(encode_with_inline_tensors(head, tensors, *buffers))));
  EXPECT_EQ(parsed.k().staging().offset(), 4096u);
  EXPECT_EQ(parsed.k().staging().length(), 300u);
  EXPECT_EQ(parsed.v().data(), std::string(300, '\x5a'));
  EXPECT_FALSE(parsed.has_q());
}

// A batch: each entry's tensors inline or staged, with token ids; parses as the message built with
// protobuf's own setters, entries in order.
TEST(InlineRequestTest, BatchEntriesParseAsTheMessageWithTheirDataFieldsSet) {
  std::mt19937 rng(9);
  auto buffers = std::make_shared<SendBuffers>();
  v1::AppendBatchRequest outer;
  outer.set_session_id("s-2");
  v1::AppendBatchRequest expected = outer;
  std::vector<v1::AppendRequest> heads(4);
  std::vector<std::vector<uint8_t>> data;
  std::vector<InlineEntry> entries(heads.size());
  for (size_t i = 0; i < heads.size(); ++i) {
    heads[i].set_sequence_id(10 + i);
    heads[i].set_num_tokens(uint32_t(3 * i + 1));
    heads[i].set_staging_generation(4);
    heads[i].add_token_ids(int32_t(i));
    v1::AppendRequest full = heads[i];
    entries[i].head = &heads[i];
    for (int field : {v1::AppendRequest::kKFieldNumber, v1::AppendRequest::kVFieldNumber}) {
      v1::TensorRef* ref = field == v1::AppendRequest::kKFieldNumber ? full.mutable_k() : full.mutable_v();
      if (i == 2 && field == v1::AppendRequest::kKFieldNumber) {  // a staged tensor among inline ones
        heads[i].mutable_k()->mutable_staging()->set_offset(64);
        heads[i].mutable_k()->mutable_staging()->set_length(8);
        *ref = heads[i].k();
        continue;
      }
      data.push_back(random_bytes(i == 3 ? 200000 : 100 * i + 5, rng));
      ref->set_data(data.back().data(), data.back().size());
      entries[i].tensors.push_back({field, data.back()});
    }
    *expected.add_entries() = full;
  }
  v1::AppendBatchRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(
      flatten(encode_entries_with_inline_tensors(outer, v1::AppendBatchRequest::kEntriesFieldNumber, entries, *buffers))));
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(parsed, expected));
  EXPECT_EQ(parsed.entries(2).k().staging().offset(), 64u);
}

// A buffer returns to the pool only when the last reference to its slice goes, and the next
// request of a size it fits gets the same memory (pages already mapped).
TEST(InlineRequestTest, ABufferIsReusedOnlyAfterItsSliceIsReleased) {
  auto buffers = std::make_shared<SendBuffers>();
  uint8_t* first = nullptr;
  uint8_t* second = nullptr;
  {
    grpc::Slice a = buffers->take(1 << 20, &first);
    grpc::Slice held = a;  // gRPC's own reference, say
    EXPECT_EQ(buffers->kept_buffers(), 0u);
    { grpc::Slice drop = std::move(a); }
    EXPECT_EQ(buffers->kept_buffers(), 0u) << "returned while a reference was still held";
    grpc::Slice b = buffers->take(1 << 20, &second);
    EXPECT_NE(first, second) << "a buffer still referenced was handed out again";
  }
  EXPECT_EQ(buffers->kept_buffers(), 2u);
  uint8_t* third = nullptr;
  grpc::Slice c = buffers->take(100 << 10, &third);
  EXPECT_TRUE(third == first || third == second);
  EXPECT_EQ(buffers->kept_buffers(), 1u);
}

TEST(InlineRequestTest, KeepsAtMostItsLimits) {
  auto buffers = std::make_shared<SendBuffers>();
  {
    std::vector<grpc::Slice> held;
    for (int i = 0; i < 8; ++i) {
      uint8_t* p = nullptr;
      held.push_back(buffers->take(size_t(i + 1) << 20, &p));
    }
  }
  EXPECT_EQ(buffers->kept_buffers(), SendBuffers::kKeepBuffers);
  EXPECT_EQ(buffers->kept_bytes(), size_t(8 + 7 + 6 + 5) << 20) << "the largest are the ones kept";
  {
    uint8_t* p = nullptr;
    grpc::Slice huge = buffers->take(SendBuffers::kKeepBytes + 1, &p);
  }
  EXPECT_LE(buffers->kept_bytes(), SendBuffers::kKeepBytes);
}

// A slice that outlives its pool's owner still returns safely (the lease keeps the pool alive).
TEST(InlineRequestTest, ASliceMayOutliveTheClientsReference) {
  auto buffers = std::make_shared<SendBuffers>();
  uint8_t* p = nullptr;
  grpc::Slice s = buffers->take(4096, &p);
  std::memset(p, 1, 4096);
  std::weak_ptr<SendBuffers> weak = buffers;
  buffers.reset();
  EXPECT_FALSE(weak.expired());
  { grpc::Slice drop = std::move(s); }
  EXPECT_TRUE(weak.expired());
}

}  // namespace
}  // namespace karakv::client_internal
