// A prefix tier shared across nodes on Redis (or Valkey, or a Redis Cluster): karakvd writes every
// prompt block its prefix cache publishes to Redis, and a Lookup or a CreateSequence with a prompt
// prefix that misses locally asks Redis for the rest of the chain and fills the pool from it, so a
// prompt prefilled on one node is a prefix hit on every other node sharing the tier.
//
// Key: "karakv:kv1:" + the block's 128-bit chained content key in hex (server/prefix_cache.h),
// which covers the parent block's key, the token ids, the geometry with the dtype, and the cache
// namespace; a session's namespace carries the model fingerprint its worker gave at Attach, so two
// models of one geometry never share a key. Sessions without a fingerprint do not use the tier.
// Value: a 64-byte little-endian header (magic "KKVB", format version, the geometry, the key again,
// the payload size and an XXH3-64 checksum of the payload), then the block's K/V bytes as the pool
// stores them ([layers][2][kv_heads][block_size][head_dim]). Redis's maxmemory policy evicts;
// karakvd never deletes.
//
// Never fatal, never on a Step's path: published blocks are pinned in the pool and queued under
// the core's lock, and a thread of the tier's own (at nice 10) sends them from the pool and unpins;
// reads wait at most `timeout` per round trip. Redis down, slow, full or a corrupt value is a local
// miss, a counter and a log line at most once a minute; after an error the tier is skipped for
// `retry_after` (doubling to 30 s while errors go on), so a dead Redis costs nothing per request.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "karakv/kernels/types.h"
#include "server/prefix_cache.h"

struct redisContext;

namespace karakv::server {

class Metrics;

struct RedisAddress {
  std::string host;
  int port = 6379;
  std::string str() const;
};

struct PrefixTierConfig {
  std::vector<RedisAddress> seeds;  // one node, or some nodes of a Redis Cluster
  std::string user, password;       // AUTH [user] password when password is set
  absl::Duration timeout = absl::Milliseconds(50);   // connect and per round trip
  absl::Duration retry_after = absl::Seconds(1);     // first pause after an error
  size_t max_queued_blocks = 256;                   // writes waiting (each pins its block); beyond: dropped
  int write_batch = 32;                             // blocks per pipelined write
};

// Parses --prefix_tier ("redis://host:port[,host:port...]") and --prefix_tier_password_file (one
// line: "password" or "user password"); an error names the flag and what was expected.
absl::StatusOr<PrefixTierConfig> parse_prefix_tier(const std::string& spec, const std::string& password_file);

// Redis Cluster's hash slot of a key: CRC16 (XMODEM) of the key, or of its {hash tag}, mod 16384.
int redis_key_slot(std::string_view key);

// A Redis client for one thread at a time: a connection per node (made when first needed, with
// AUTH), Redis Cluster's slot map (CLUSTER SLOTS; a node with cluster support disabled is a single
// node), and the redirections: MOVED updates the map and retries there, ASK sends ASKING and the
// command once to the node named. Commands go out pipelined, one round trip per node.
class RedisClient {
 public:
  struct Reply {
    enum class Kind { kNil, kString, kInteger, kStatus, kError, kOther } kind = Kind::kNil;
    std::string str;
    long long integer = 0;
  };
  explicit RedisClient(PrefixTierConfig config);
  ~RedisClient();
  RedisClient(const RedisClient&) = delete;
  RedisClient& operator=(const RedisClient&) = delete;

  // Runs every command (args[1] is its key); a connection error or timeout fails the whole call
  // and drops that node's connection. Error replies other than redirections come back as kError.
  absl::StatusOr<std::vector<Reply>> run(const std::vector<std::vector<std::string>>& commands);
  // SET key value for each item, the value the concatenation of its parts, written to the socket
  // from where the parts lie (no copy into a command buffer). As run() otherwise.
  struct SetItem {
    std::string key;
    std::vector<std::string_view> value;
  };
  absl::StatusOr<std::vector<Reply>> set(const std::vector<SetItem>& items);
  bool is_cluster() const { return cluster_; }
  // MOVED and ASK replies followed so far.
  uint64_t moved() const { return moved_; }
  uint64_t asked() const { return asked_; }

 private:
  struct Node;
  // Sends the commands of `members` (with ASKING first where asking[i]) on one node's connection.
  using SendFn = std::function<absl::Status(redisContext* ctx, const std::vector<size_t>& members,
                                            const std::vector<char>& asking)>;
  // Routes command i by keys[i], sends each node's share, reads the replies, follows redirections.
  absl::StatusOr<std::vector<Reply>> execute(const std::vector<std::string_view>& keys, const SendFn& send);
  absl::StatusOr<Node*> node(const std::string& address);
  absl::Status discover();
  void drop(const std::string& address);

  const PrefixTierConfig config_;
  std::vector<std::unique_ptr<Node>> nodes_;
  bool discovered_ = false, cluster_ = false;
  std::vector<std::string> slots_;  // [16384] node address per slot (cluster)
  uint64_t moved_ = 0, asked_ = 0;
};

struct PrefixTierStats {
  uint64_t hits = 0;          // blocks found and valid
  uint64_t misses = 0;        // blocks asked for and not found (or after the first miss of a chain)
  uint64_t corrupt = 0;       // values found but refused (header, geometry, key or checksum)
  uint64_t errors = 0;        // failed round trips (connection, timeout, error reply)
  uint64_t skipped = 0;       // requests not sent while the tier pauses after an error
  uint64_t writes = 0;        // blocks written
  uint64_t write_dropped = 0; // blocks not written (queue full, paused, gone from the cache, error)
  uint64_t bytes_read = 0, bytes_written = 0;
};

// How the writer reaches the blocks the store pinned for it (the core implements it).
struct TierBlockSource {
  // Host memory holding a pinned block's bytes, read without the core's lock (a pinned cached
  // block is never written); null when the pool is device memory.
  std::function<const char*(int32_t block)> host_block;
  // A copy of a pinned block's bytes, for device pools (empty: unavailable).
  std::function<std::string(int32_t block)> copy_block;
  // Gives the pins back (under the core's lock).
  std::function<void(const std::vector<int32_t>& blocks)> unpin;
};

class PrefixTier final : public PrefixTierSink {
 public:
  // A value's header; the block's bytes follow it.
  static constexpr size_t kHeaderBytes = 64;
  // Starts the writer thread. Nothing is contacted yet: a Redis that is down at start-up is an
  // error counted at the first request, not a failed start.
  static std::unique_ptr<PrefixTier> start(const PrefixTierConfig& config, const kernels::Geometry& geometry,
                                           TierBlockSource source, Metrics* metrics);
  ~PrefixTier() override;  // stops the writer; what is still queued is dropped (and unpinned)

  // Under the core's lock: queues the pinned block for writing; false when the queue is full.
  bool published(const PrefixKey& key, int32_t block) override;
  // The values of the leading keys the tier holds, checked, stopping at the first miss or bad
  // value; each block's bytes start at kHeaderBytes. One pipelined round trip. Empty when the
  // tier pauses after an error.
  std::vector<std::string> fetch(const std::vector<PrefixKey>& keys);
  // Blocks until every write queued so far has been sent or dropped (tests, shutdown).
  void flush();

  PrefixTierStats stats() const;
  static std::string redis_key(const PrefixKey& key);
  // The header of `payload` stored under `key`.
  std::string header(const PrefixKey& key, std::string_view payload) const;
  // Header + payload; and the check of a value: false with the reason when it is not a block of
  // this geometry stored under `key`.
  std::string encode(const PrefixKey& key, std::string_view payload) const;
  bool check(const PrefixKey& key, std::string_view value, std::string* why) const;

 private:
  PrefixTier(const PrefixTierConfig& config, const kernels::Geometry& geometry, TierBlockSource source,
             Metrics* metrics);
  void write(RedisClient& client, const std::vector<std::pair<PrefixKey, int32_t>>& batch);
  void run();
  bool paused();
  void failed(const absl::Status& s, const char* what);  // counts, pauses, logs (limited)
  void answered();                                        // a round trip succeeded: the pause resets
  void log_limited(const std::string& line) ABSL_EXCLUSIVE_LOCKS_REQUIRED(health_mu_);  // once a minute
  std::unique_ptr<RedisClient> take_client();
  void give_back(std::unique_ptr<RedisClient> c);

  const PrefixTierConfig config_;
  const kernels::Geometry geometry_;
  const TierBlockSource source_;
  Metrics* const metrics_;

  absl::Mutex mu_;
  std::deque<std::pair<PrefixKey, int32_t>> queue_ ABSL_GUARDED_BY(mu_);
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // What the writer and flush() wait for, kept as plain flags: absl evaluates a flag's Condition
  // inside the library, where the TSan stage's shim sees the mutex order it, and a lambda's not.
  bool work_ ABSL_GUARDED_BY(mu_) = false;  // stop_ or something queued
  bool idle_ ABSL_GUARDED_BY(mu_) = true;   // stop_ or nothing queued nor in flight
  void update_flags() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<std::unique_ptr<RedisClient>> idle_clients_ ABSL_GUARDED_BY(mu_);

  absl::Mutex health_mu_;
  absl::Time paused_until_ ABSL_GUARDED_BY(health_mu_) = absl::InfinitePast();
  absl::Duration pause_ ABSL_GUARDED_BY(health_mu_);
  absl::Time last_log_ ABSL_GUARDED_BY(health_mu_) = absl::InfinitePast();
  uint64_t unlogged_ ABSL_GUARDED_BY(health_mu_) = 0;

  std::atomic<uint64_t> hits_{0}, misses_{0}, corrupt_{0}, errors_{0}, skipped_{0}, writes_{0}, write_dropped_{0},
      bytes_read_{0}, bytes_written_{0};
  std::thread thread_;
};

}  // namespace karakv::server
