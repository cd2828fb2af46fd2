// KV-cache events for cluster routers, in the wire format vLLM publishes (and NVIDIA Dynamo's KV
// router, llm-d's KV-cache indexer, AIBrix and others consume): a ZeroMQ PUB socket whose messages
// are three frames, [topic, 8-byte big-endian sequence number, msgpack payload]; the payload an
// event batch [timestamp, events, data_parallel_rank]; each event
//   ["BlockStored", [hash], parent hash or nil, [token ids], block_size, lora_id (nil), medium]
//   ["BlockRemoved", [hash], medium]
//   ["AllBlocksCleared"]
// or, with encoding "map", the same fields in a map with a "type" key (vLLM's newer encoding;
// consumers accept both). A ROUTER socket replays: a request [identity, "", 8-byte start sequence
// number] gets every buffered batch from that number on, [identity, "", seq, payload] each, then
// [identity, "", -1 (8 bytes, all ones), ""].
//
// What is announced: the prefix cache's uncompressed prompt blocks (server/prefix_cache.h): a block
// is stored when a prompt publishes it and removed when the cache evicts it; a compacted block is
// never in the cache (its content no longer equals its tokens). A block's hash is the high 64 bits
// of its chained content key, which covers the parent block's key, the token ids, the geometry and
// the cache namespace. The daemon announces AllBlocksCleared when it starts (a restarted daemon
// holds nothing).
//
// The core calls stored() and removed() under its lock: they only append to a queue. One thread
// owns the sockets, batches what the queue holds every `batch_interval`, publishes and keeps the
// last `buffer_batches` batches for replay.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/prefix_cache.h"

namespace karakv::server {

class Metrics;

struct KvEventsConfig {
  std::string endpoint;         // PUB: tcp://*:5557, ipc:///path, ...
  std::string replay_endpoint;  // ROUTER; empty: no replay
  std::string topic;            // the first frame of every message
  std::string encoding = "array";  // array | map
  std::string medium = "CPU";      // CPU | GPU: the backend that holds the blocks
  int buffer_batches = 10000;      // batches kept for replay
  size_t max_pending_events = 1 << 20;  // queued between batches; beyond: dropped and counted
  absl::Duration batch_interval = absl::Milliseconds(10);
};

// One event as queued, before encoding.
struct KvEvent {
  enum class Kind { kStored, kRemoved, kCleared } kind = Kind::kCleared;
  uint64_t hash = 0;
  std::optional<uint64_t> parent;
  std::vector<int32_t> tokens;
};

// The options a flag sets, checked before anything starts: an error names the flag.
absl::Status check_kv_events_options(const std::string& encoding, int buffer_batches);

// The msgpack payload of one batch, in `encoding` ("array" or "map"). Exposed for tests.
std::string encode_kv_event_batch(double timestamp, const std::vector<KvEvent>& events, int block_size,
                                  const std::string& medium, const std::string& encoding);

class KvEventPublisher final : public PrefixEventSink {
 public:
  // Binds both sockets (an endpoint that cannot be bound is an error naming it) and starts the
  // thread, which first publishes AllBlocksCleared.
  static absl::StatusOr<std::unique_ptr<KvEventPublisher>> start(const KvEventsConfig& config, int block_size,
                                                                 Metrics* metrics);
  ~KvEventPublisher() override;  // publishes what is queued, then closes the sockets

  void stored(const PrefixKey& key, const PrefixKey& parent, absl::Span<const int32_t> tokens) override;
  void removed(const PrefixKey& key) override;

  uint64_t dropped_events() const { return dropped_.load(); }

 private:
  KvEventPublisher(const KvEventsConfig& config, int block_size, Metrics* metrics);
  void enqueue(KvEvent e);
  void run();

  const KvEventsConfig config_;
  const int block_size_;
  Metrics* const metrics_;
  struct Sockets;
  std::unique_ptr<Sockets> sockets_;
  absl::Mutex mu_;
  std::vector<KvEvent> pending_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<uint64_t> dropped_{0};
  uint64_t next_seq_ = 0;                                        // the thread's own
  std::deque<std::pair<uint64_t, std::string>> replay_buffer_;  // the thread's own
  std::thread thread_;
};

// The 64-bit block hash the events carry for a prefix-cache key.
inline uint64_t kv_event_hash(const PrefixKey& key) { return key.hi; }

}  // namespace karakv::server
