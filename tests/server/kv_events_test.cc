// KV-cache events (server/kv_events.h): the msgpack encoding in both forms, decoded by msgpack-cxx
// against the fields vLLM's consumers read, and the publisher under concurrent stores and
// removals (the core's threads), read back through its replay socket in order. Under the
// sanitizer stages this is where the publisher's thread and queue are checked.
#include "server/kv_events.h"

#include <unistd.h>

#include <filesystem>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <msgpack.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "gtest/gtest.h"

namespace karakv::server {
namespace {

msgpack::object_handle unpack(const std::string& s) { return msgpack::unpack(s.data(), s.size()); }

std::string str(const msgpack::object& o) { return o.as<std::string>(); }

TEST(KvEvents, ArrayEncodingIsVllmsTaggedArrays) {
  KvEvent stored;
  stored.kind = KvEvent::Kind::kStored;
  stored.hash = 0xfedcba9876543210ull;
  stored.parent = 42;
  stored.tokens = {1, 2, 3, 4};
  KvEvent first = stored;
  first.parent.reset();
  KvEvent removed;
  removed.kind = KvEvent::Kind::kRemoved;
  removed.hash = 7;
  const std::string payload =
      encode_kv_event_batch(1700000000.5, {KvEvent{}, stored, first, removed}, 4, "CPU", "array");
  auto h = unpack(payload);
  const msgpack::object& batch = h.get();
  ASSERT_EQ(batch.type, msgpack::type::ARRAY);
  ASSERT_EQ(batch.via.array.size, 3u);
  EXPECT_DOUBLE_EQ(batch.via.array.ptr[0].as<double>(), 1700000000.5);
  EXPECT_TRUE(batch.via.array.ptr[2].is_nil());  // data_parallel_rank
  const msgpack::object& events = batch.via.array.ptr[1];
  ASSERT_EQ(events.via.array.size, 4u);
  const msgpack::object* e = events.via.array.ptr;
  ASSERT_EQ(e[0].via.array.size, 1u);
  EXPECT_EQ(str(e[0].via.array.ptr[0]), "AllBlocksCleared");
  ASSERT_EQ(e[1].via.array.size, 7u);
  const msgpack::object* f = e[1].via.array.ptr;
  EXPECT_EQ(str(f[0]), "BlockStored");
  EXPECT_EQ(f[1].as<std::vector<uint64_t>>(), std::vector<uint64_t>{0xfedcba9876543210ull});
  EXPECT_EQ(f[2].as<uint64_t>(), 42u);
  EXPECT_EQ(f[3].as<std::vector<int32_t>>(), (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(f[4].as<int>(), 4);
  EXPECT_TRUE(f[5].is_nil());  // lora_id
  EXPECT_EQ(str(f[6]), "CPU");
  EXPECT_TRUE(e[2].via.array.ptr[2].is_nil());  // the first block of a chain has no parent
  ASSERT_EQ(e[3].via.array.size, 3u);
  EXPECT_EQ(str(e[3].via.array.ptr[0]), "BlockRemoved");
  EXPECT_EQ(e[3].via.array.ptr[1].as<std::vector<uint64_t>>(), std::vector<uint64_t>{7});
  EXPECT_EQ(str(e[3].via.array.ptr[2]), "CPU");
}

TEST(KvEvents, MapEncodingNamesEveryField) {
  KvEvent stored;
  stored.kind = KvEvent::Kind::kStored;
  stored.hash = 9;
  stored.tokens = {5, 6};
  const std::string payload = encode_kv_event_batch(1.0, {stored, KvEvent{}}, 2, "GPU", "map");
  auto h = unpack(payload);
  const msgpack::object& events = h.get().via.array.ptr[1];
  auto m = events.via.array.ptr[0].as<std::map<std::string, msgpack::object>>();
  EXPECT_EQ(str(m.at("type")), "BlockStored");
  EXPECT_EQ(m.at("block_hashes").as<std::vector<uint64_t>>(), std::vector<uint64_t>{9});
  EXPECT_TRUE(m.at("parent_block_hash").is_nil());
  EXPECT_EQ(m.at("token_ids").as<std::vector<int32_t>>(), (std::vector<int32_t>{5, 6}));
  EXPECT_EQ(m.at("block_size").as<int>(), 2);
  EXPECT_TRUE(m.at("lora_id").is_nil());
  EXPECT_EQ(str(m.at("medium")), "GPU");
  EXPECT_EQ(m.size(), 7u);
  auto cleared = events.via.array.ptr[1].as<std::map<std::string, msgpack::object>>();
  EXPECT_EQ(cleared.size(), 1u);
  EXPECT_EQ(str(cleared.at("type")), "AllBlocksCleared");
}

// Four threads store and remove blocks at once; every event comes back through the replay socket,
// AllBlocksCleared first, batches numbered from 0 without a gap, each thread's events in its order.
TEST(KvEvents, PublisherKeepsEveryEventOfConcurrentCallersInOrder) {
  const std::string dir = std::filesystem::temp_directory_path() / ("karakv-kvev-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  KvEventsConfig config;
  config.endpoint = "ipc://" + dir + "/events";
  config.replay_endpoint = "ipc://" + dir + "/replay";
  config.batch_interval = absl::Milliseconds(1);
  auto publisher = KvEventPublisher::start(config, 4, nullptr);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  constexpr int kThreads = 4, kEach = 200;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        const PrefixKey key{uint64_t(t) << 32 | uint64_t(i), 1};
        const std::vector<int32_t> tokens = {t, i, 0, 0};
        if (i % 3 == 2) (*publisher)->removed(key);
        else (*publisher)->stored(key, PrefixKey{}, tokens);
      }
    });
  }
  for (auto& th : threads) th.join();

  zmq::context_t ctx;
  zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.connect(config.replay_endpoint);
  size_t events = 0;
  std::vector<int> next(kThreads, 0);
  bool cleared_first = false;
  // The last events may still be queued: ask again until all have come.
  for (int attempt = 0; attempt < 200 && events < 1 + kThreads * kEach; ++attempt) {
    events = 0;
    std::fill(next.begin(), next.end(), 0);
    const std::string start(8, '\0');
    dealer.send(zmq::buffer(std::string()), zmq::send_flags::sndmore);
    dealer.send(zmq::buffer(start), zmq::send_flags::none);
    uint64_t expected_seq = 0;
    for (;;) {
      std::vector<zmq::message_t> frames;
      ASSERT_TRUE(zmq::recv_multipart(dealer, std::back_inserter(frames)));
      ASSERT_EQ(frames.size(), 3u);
      ASSERT_EQ(frames[1].size(), 8u);
      if (frames[1].to_string() == std::string(8, '\xff')) break;
      uint64_t seq = 0;
      for (char c : frames[1].to_string()) seq = seq << 8 | uint8_t(c);
      ASSERT_EQ(seq, expected_seq++);
      auto h = unpack(frames[2].to_string());
      const msgpack::object& list = h.get().via.array.ptr[1];
      for (uint32_t i = 0; i < list.via.array.size; ++i) {
        const msgpack::object* f = list.via.array.ptr[i].via.array.ptr;
        const std::string kind = str(f[0]);
        if (events == 0) cleared_first = kind == "AllBlocksCleared";
        ++events;
        if (kind == "AllBlocksCleared") continue;
        const uint64_t hash = f[1].via.array.ptr[0].as<uint64_t>();
        const int t = int(hash >> 32), idx = int(hash & 0xffffffff);
        ASSERT_LT(t, kThreads);
        EXPECT_EQ(idx, next[size_t(t)]) << "thread " << t << "'s events out of order";
        next[size_t(t)] = idx + 1;
        EXPECT_EQ(kind, idx % 3 == 2 ? "BlockRemoved" : "BlockStored");
      }
    }
    if (events < 1 + kThreads * kEach) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(cleared_first);
  EXPECT_EQ(events, size_t(1 + kThreads * kEach));
  EXPECT_EQ((*publisher)->dropped_events(), 0u);
  publisher->reset();
  std::filesystem::remove_all(dir);
}

TEST(KvEvents, BadEndpointIsRefusedNamingIt) {
  KvEventsConfig config;
  config.endpoint = "nonsense://x";
  auto p = KvEventPublisher::start(config, 4, nullptr);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(std::string(p.status().message()).find("--kv_events_endpoint=nonsense://x: cannot bind"), std::string::npos)
      << p.status();
  config.endpoint = "inproc://ok";
  config.encoding = "json";
  p = KvEventPublisher::start(config, 4, nullptr);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(std::string(p.status().message()).find("expected array or map"), std::string::npos);
}

}  // namespace
}  // namespace karakv::server
