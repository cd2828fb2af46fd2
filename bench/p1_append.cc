// karakv-bench p1: Append throughput (GB/s of K/V into the pool, through shared-memory staging with
// the fast-path ring or a gRPC call, and inline in the RPC) vs Redis SET of the same payload on a
// Unix socket (target >= 3x through the ring, >= 1x inline at 1 MiB).
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench_common.h"
#include "common/synthetic.h"
#include "grpc_floor.h"
#include "harness.h"
#include "karakv/client.h"
#include "karakv/kernels/backend.h"

ABSL_FLAG(std::string, redis_server, "redis-server", "redis-server binary for the P1 baseline (PATH is searched)");
ABSL_FLAG(double, seconds, 1.0, "P1: seconds per measurement of one configuration in one round");
ABSL_FLAG(int32_t, rounds, 5, "P1: interleaved rounds; the round with the median ratio is reported");
ABSL_FLAG(bool, p1_token_ids, false,
          "P1: Appends carry token ids (fresh ones per sequence), so every full block is published to the prefix "
          "cache (and announced, with karakvd --kv_events_endpoint): the publishing path's cost");

namespace karakv::bench {
namespace {

// The pair whose ratio is the median (the lower middle one for an even count).
Pair median_pair(std::vector<Pair> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end(), [](const Pair& a, const Pair& b) { return a.ratio() < b.ratio(); });
  return v[(v.size() - 1) / 2];
}

// Runs `op` (each call moves `bytes_per_call` payload bytes) until `seconds` have passed and at
// least 4 calls were made; returns GB/s (1e9 bytes).
template <typename Op>
absl::StatusOr<double> measure_gbps(size_t bytes_per_call, double seconds, Op&& op) {
  const auto start = Clock::now();
  uint64_t calls = 0;
  double elapsed = 0;
  do {
    if (absl::Status s = op(); !s.ok()) return s;
    ++calls;
    elapsed = seconds_since(start);
  } while (elapsed < seconds || calls < 4);
  return double(calls) * bytes_per_call / elapsed / 1e9;
}

// A minimal RESP client over a Unix socket: SET and PING, one request in flight.
class RedisClient {
 public:
  static absl::StatusOr<std::unique_ptr<RedisClient>> connect(const std::string& path) {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      const int err = errno;
      close(fd);
      return absl::UnavailableError(absl::StrCat("connect ", path, ": ", std::strerror(err)));
    }
    return std::unique_ptr<RedisClient>(new RedisClient(fd));
  }
  ~RedisClient() { close(fd_); }

  absl::Status ping() {
    static const char kPing[] = "*1\r\n$4\r\nPING\r\n";
    iovec iov{const_cast<char*>(kPing), sizeof(kPing) - 1};
    if (absl::Status s = send_all(&iov, 1); !s.ok()) return s;
    return expect_line("+PONG");
  }

  absl::Status set(const std::string& key, const uint8_t* value, size_t size) {
    const std::string header = absl::StrCat("*3\r\n$3\r\nSET\r\n$", key.size(), "\r\n", key, "\r\n$", size, "\r\n");
    static const char kCrlf[] = "\r\n";
    iovec iov[3] = {{const_cast<char*>(header.data()), header.size()},
                    {const_cast<uint8_t*>(value), size},
                    {const_cast<char*>(kCrlf), 2}};
    if (absl::Status s = send_all(iov, 3); !s.ok()) return s;
    return expect_line("+OK");
  }

 private:
  explicit RedisClient(int fd) : fd_(fd) {}

  absl::Status send_all(iovec* iov, int count) {
    while (count > 0) {
      const ssize_t n = writev(fd_, iov, count);
      if (n < 0) {
        if (errno == EINTR) continue;
        return absl::UnavailableError(absl::StrCat("redis write: ", std::strerror(errno)));
      }
      size_t left = size_t(n);
      while (count > 0 && left >= iov->iov_len) {
        left -= iov->iov_len;
        ++iov;
        --count;
      }
      if (count > 0) {
        iov->iov_base = static_cast<char*>(iov->iov_base) + left;
        iov->iov_len -= left;
      }
    }
    return absl::OkStatus();
  }

  // Reads one reply line and checks that it is `want` followed by CRLF.
  absl::Status expect_line(const char* want) {
    char buf[512];
    size_t got = 0;
    while (got < 2 || buf[got - 2] != '\r' || buf[got - 1] != '\n') {
      if (got == sizeof(buf)) return absl::InternalError("redis reply line too long");
      const ssize_t n = read(fd_, buf + got, sizeof(buf) - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return absl::UnavailableError("redis closed the connection");
      got += size_t(n);
    }
    const std::string line(buf, got - 2);
    if (line != want) return absl::InternalError(absl::StrCat("redis replied '", line, "', expected '", want, "'"));
    return absl::OkStatus();
  }

  int fd_;
};

struct Redis {
  std::unique_ptr<ChildProcess> process;
  std::unique_ptr<RedisClient> client;
};

absl::StatusOr<Redis> start_redis(const TempDir& dir) {
  const std::string socket = dir.file("redis.sock");
  register_cleanup_path(socket);
  std::vector<std::string> argv = {absl::GetFlag(FLAGS_redis_server), "--port", "0", "--unixsocket", socket,
                                   "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
                                   "--dir", dir.file(""), "--daemonize", "no"};
  progress(absl::StrCat("starting ", absl::StrJoin(argv, " ")));
  auto child = ChildProcess::start("redis-server", argv, dir.file("redis.log"));
  if (!child.ok()) return child.status();
  Redis r{std::move(*child), nullptr};
  const auto start = Clock::now();
  while (true) {
    if (!r.process->running()) {
      return absl::FailedPreconditionError(absl::StrCat(
          argv[0], " exited at startup (install it: apt-get install redis-server, or pass --redis_server); log tail:\n",
          r.process->log_tail()));
    }
    auto c = RedisClient::connect(socket);
    if (c.ok()) {
      if (absl::Status s = (*c)->ping(); !s.ok()) return s;
      r.client = std::move(*c);
      return r;
    }
    if (seconds_since(start) > 15) return absl::DeadlineExceededError("redis-server did not answer within 15 s");
    sleep_ms(50);
  }
}

// Appends one fixed payload again and again to one sequence, replacing the sequence by a fresh
// one before it outgrows `max_tokens` so the pool never fills. Create/Release are in the timing.
class AppendLoop {
 public:
  AppendLoop(karakv::Client& client, int tokens, karakv::Buffer k, karakv::Buffer v, int max_tokens)
      : client_(client), tokens_(tokens), k_(std::move(k)), v_(std::move(v)), max_tokens_(max_tokens) {}

  absl::Status append() {
    if (seq_ == 0 || length_ + tokens_ > max_tokens_) {
      if (seq_ != 0) {
        if (auto r = client_.Release(seq_); !r.ok()) return r.status();
      }
      auto id = client_.CreateSequence();
      if (!id.ok()) return id.status();
      seq_ = *id;
      length_ = 0;
    }
    absl::StatusOr<int> len;
    if (absl::GetFlag(FLAGS_p1_token_ids)) {
      // Ids no other sequence used: each block is new to the cache, published, later evicted.
      // With K and V in staging the ids go there too, which keeps a fast-path Append on the ring.
      if (ids_.size() == 0) {
        auto staged = k_.in_staging() ? client_.alloc(4 * size_t(tokens_)) : absl::StatusOr<karakv::Buffer>();
        ids_ = staged.ok() ? *staged : karakv::Client::alloc_heap(4 * size_t(tokens_));
      }
      std::span<int32_t> ids = ids_.as<int32_t>();
      for (int i = 0; i < tokens_; ++i) ids[size_t(i)] = int32_t(next_id_++ & 0x3fffffff);
      len = client_.Append(seq_, std::span<const int32_t>(ids.data(), ids.size()), k_, v_);
    } else {
      len = client_.Append(seq_, tokens_, k_, v_);
    }
    if (!len.ok()) return len.status();
    length_ = *len;
    return absl::OkStatus();
  }

 private:
  karakv::Client& client_;
  const int tokens_;
  karakv::Buffer k_, v_;
  const int max_tokens_;
  uint64_t seq_ = 0;
  int length_ = 0;
  karakv::Buffer ids_;  // the token ids (--p1_token_ids), in staging when K and V are
  uint64_t next_id_ = uint64_t(reinterpret_cast<uintptr_t>(this)) & 0xffff0000;  // apart from other loops' ids
};

// A prefill batch: `n` sequences each get the same payload in one AppendBatch (one ring command),
// replaced together before they outgrow `max_tokens`.
class AppendBatchLoop {
 public:
  AppendBatchLoop(karakv::Client& client, int n, int tokens, karakv::Buffer k, karakv::Buffer v, int max_tokens)
      : client_(client), tokens_(tokens), max_tokens_(max_tokens), entries_(n) {
    for (karakv::AppendEntry& e : entries_) {
      e.num_tokens = tokens;
      e.k = k;
      e.v = v;
    }
  }

  absl::Status append() {
    if (entries_[0].sequence_id == 0 || length_ + tokens_ > max_tokens_) {
      for (karakv::AppendEntry& e : entries_) {
        if (e.sequence_id != 0) {
          if (auto r = client_.Release(e.sequence_id); !r.ok()) return r.status();
        }
        auto id = client_.CreateSequence();
        if (!id.ok()) return id.status();
        e.sequence_id = *id;
      }
      length_ = 0;
    }
    auto lengths = client_.AppendBatch(entries_);
    if (!lengths.ok()) return lengths.status();
    length_ = lengths->front();
    return absl::OkStatus();
  }

 private:
  karakv::Client& client_;
  const int tokens_;
  const int max_tokens_;
  std::vector<karakv::AppendEntry> entries_;
  int length_ = 0;
};

// The copy an Append does inside the daemon, without the RPC: write_kv of `tokens` tokens from
// `k`/`v` into a 64 MiB pool of this geometry, cycling through its blocks. Returns GB/s of K+V.
absl::StatusOr<double> write_kv_gbps(const kn::Geometry& g, int tokens, const void* k, const void* v,
                                     double seconds) {
  auto backend = kn::make_cpu_backend(0);
  const int blocks = int((size_t(64) << 20) / g.block_bytes());
  const int blocks_per_call = (tokens + g.block_size - 1) / g.block_size;
  void* pool = nullptr;
  if (auto st = backend->allocate(size_t(blocks) * g.block_bytes(), &pool); !st.is_ok()) {
    return absl::ResourceExhaustedError(st.message);
  }
  std::vector<int32_t> table(blocks_per_call), offsets = {0, blocks_per_call}, lengths = {tokens};
  kn::PagedKV kv;
  kv.pool = pool;
  kv.geometry = g;
  kv.block_table = table.data();
  kv.table_offset = offsets.data();
  kv.seq_len = lengths.data();
  kv.num_seqs = 1;
  int next = 0;
  auto gbps = measure_gbps(2 * size_t(g.num_layers) * tokens * g.kv_token_elems() * kn::dtype_size(g.dtype), seconds,
                           [&]() -> absl::Status {
                             for (int32_t& b : table) b = next++ % blocks;
                             auto st = backend->write_kv(kv, 0, 0, tokens, 0, g.num_layers, k, v);
                             return st.is_ok() ? absl::OkStatus() : absl::InternalError(st.message);
                           });
  backend->free(pool);
  return gbps;
}
}  // namespace

absl::StatusOr<std::vector<Row>> run_p1(const TempDir& dir) {
  // One token of K+V is 2 * 8 heads * 128 dims * 2 B = 4 KiB, so 16 tokens = 64 KiB per Append and
  // 256 tokens = 1 MiB; a block (16 tokens) is 64 KiB.
  auto daemon = start_karakvd(dir, "karakvd-p1",
                              {"--layers=1", "--q_heads=8", "--kv_heads=8", "--head_dim=128", "--dtype=fp16",
                               "--block_size=16", "--pool_bytes=512MiB"});
  if (!daemon.ok()) return daemon.status();
  auto redis = start_redis(dir);
  if (!redis.ok()) return redis.status();
  auto floor = GrpcFloor::Start(dir.file("grpc-floor.sock"));
  if (!floor.ok()) return floor.status();

  const std::vector<size_t> payloads = {64 << 10, 1 << 20};
  const size_t max_payload = payloads.back();
  auto shm = attach(*daemon, max_payload * 2 + (1 << 20), "karakv-bench-p1-shm");
  if (!shm.ok()) return shm.status();
  auto inl = attach(*daemon, 0, "karakv-bench-p1-inline");
  if (!inl.ok()) return inl.status();
  // The same staging Append through the fast path's command ring instead of a gRPC call.
  karakv::ClientOptions ro;
  ro.target = daemon->target;
  ro.worker_id = "karakv-bench-p1-ring";
  ro.staging_bytes = max_payload * 2 + (1 << 20);
  ro.fast_path = true;
  auto rng = karakv::Client::Attach(ro);
  if (!rng.ok()) return rng.status();
  if (!(*rng)->fast_path()) return absl::FailedPreconditionError("karakvd did not enable the fast path");
  const kn::Geometry g = (*shm)->geometry();
  const size_t token_bytes = 2 * (*shm)->append_bytes(1);  // K + V of one token
  constexpr int kMaxTokens = 8192;                          // 32 MiB of K+V per sequence
  constexpr int kBatch = 16;  // sequences per AppendBatch (64 KiB each), kept to kMaxTokens / 2 (the pool holds them)

  struct Config {
    size_t payload;
    std::unique_ptr<AppendLoop> shm_loop, inl_loop, ring_loop;
    int tokens = 0;
    karakv::Buffer k, v;  // the payload in this process, for the copy-only measurement
    std::vector<uint8_t> redis_value;
    std::unique_ptr<AppendBatchLoop> batch_loop;  // 64 KiB only: 16 sequences per ring command
    std::vector<Pair> shm, inl, copy, ring, batch, floor;  // per round, each with that round's Redis SET
  };
  std::vector<Config> configs;
  for (size_t payload : payloads) {
    const int tokens = static_cast<int>(payload / token_bytes);
    const size_t half = (*shm)->append_bytes(tokens);
    Config c;
    c.payload = payload;
    auto k = (*shm)->alloc(half);
    auto v = (*shm)->alloc(half);
    if (!k.ok()) return k.status();
    if (!v.ok()) return v.status();
    karakv::synthetic::fill_prompt(k->data(), g, 1, Tensor::kKey, 0, 0, tokens);
    karakv::synthetic::fill_prompt(v->data(), g, 1, Tensor::kValue, 0, 0, tokens);
    karakv::Buffer hk = karakv::Client::alloc_heap(half), hv = karakv::Client::alloc_heap(half);
    std::memcpy(hk.data(), k->data(), half);
    std::memcpy(hv.data(), v->data(), half);
    c.redis_value.resize(payload);
    std::memcpy(c.redis_value.data(), k->data(), half);
    std::memcpy(c.redis_value.data() + half, v->data(), half);
    auto rk = (*rng)->alloc(half);
    auto rv = (*rng)->alloc(half);
    if (!rk.ok()) return rk.status();
    if (!rv.ok()) return rv.status();
    std::memcpy(rk->data(), k->data(), half);
    std::memcpy(rv->data(), v->data(), half);
    c.ring_loop = std::make_unique<AppendLoop>(**rng, tokens, *rk, *rv, kMaxTokens);
    if (payload < (1 << 20)) c.batch_loop = std::make_unique<AppendBatchLoop>(**rng, kBatch, tokens, *rk, *rv, kMaxTokens / 2);
    c.shm_loop = std::make_unique<AppendLoop>(**shm, tokens, *k, *v, kMaxTokens);
    c.inl_loop = std::make_unique<AppendLoop>(**inl, tokens, hk, hv, kMaxTokens);
    c.tokens = tokens;
    c.k = hk;
    c.v = hv;
    configs.push_back(std::move(c));
  }

  const double secs = absl::GetFlag(FLAGS_seconds);
  const int rounds = std::max(1, absl::GetFlag(FLAGS_rounds));
  uint64_t redis_key = 0;
  for (int r = 0; r < rounds; ++r) {
    progress(absl::StrFormat("P1 round %d/%d", r + 1, rounds));
    for (Config& c : configs) {
      auto a = measure_gbps(c.payload, secs, [&] { return c.shm_loop->append(); });
      if (!a.ok()) return a.status();
      // 32 rotating keys: SET overwrites, so Redis holds at most 32 values, as the pool holds a
      // bounded number of sequences.
      auto b = measure_gbps(c.payload, secs, [&] {
        return redis->client->set(absl::StrCat("kv:", redis_key++ % 32), c.redis_value.data(), c.payload);
      });
      if (!b.ok()) return b.status();
      auto i = measure_gbps(c.payload, secs, [&] { return c.inl_loop->append(); });
      if (!i.ok()) return i.status();
      auto f = measure_gbps(c.payload, secs, [&] { return c.ring_loop->append(); });
      if (!f.ok()) return f.status();
      auto g0 = measure_gbps(c.payload, secs, [&] { return (*floor)->call(c.redis_value.data(), c.payload); });
      if (!g0.ok()) return g0.status();
      c.floor.push_back({*g0, *b});
      if (c.batch_loop) {
        auto m = measure_gbps(c.payload * kBatch, secs, [&] { return c.batch_loop->append(); });
        if (!m.ok()) return m.status();
        c.batch.push_back({*m, *b});
      }
      auto w = write_kv_gbps(g, c.tokens, c.k.data(), c.v.data(), secs / 2);
      if (!w.ok()) return w.status();
      c.shm.push_back({*a, *b});
      c.inl.push_back({*i, *b});
      c.copy.push_back({*w, *b});
      c.ring.push_back({*f, *b});
      progress(absl::StrFormat("P1   %zu B: ring %.2f GB/s, shm %.2f GB/s, Redis SET %.2f GB/s, inline %.2f GB/s, "
                               "write_kv alone %.2f GB/s, raw gRPC %.2f GB/s",
                               c.payload, *f, *a, *b, *i, *w, *g0));
    }
  }

  // Context for the small payload: the per-call floor of each protocol, an empty request each.
  std::vector<double> grpc_us, resp_us;
  for (int i = 0; i < 1000; ++i) {
    auto start = Clock::now();
    if (absl::Status s = (*shm)->Ping(); !s.ok()) return s;
    grpc_us.push_back(seconds_since(start) * 1e6);
    start = Clock::now();
    if (absl::Status s = redis->client->ping(); !s.ok()) return s;
    resp_us.push_back(seconds_since(start) * 1e6);
  }

  std::vector<Row> rows;
  for (const Config& c : configs) {
    const std::string size = c.payload >= (1 << 20) ? absl::StrCat(c.payload >> 20, " MiB")
                                                    : absl::StrCat(c.payload >> 10, " KiB");
    const std::string redis_name = absl::StrCat("Redis SET ", size, " (unix socket)");
    const Pair shm_m = median_pair(c.shm), inl_m = median_pair(c.inl), copy_m = median_pair(c.copy);
    const Pair ring_m = median_pair(c.ring);
    rows.push_back({"P1", absl::StrCat("Append ", size, ", shm staging, fast-path ring"), ring_m.karakv, redis_name,
                    ring_m.baseline, "GB/s", false, Target{Target::Kind::kAtLeast, 3.0}});
    if (!c.batch.empty()) {
      const Pair batch_m = median_pair(c.batch);
      rows.push_back({"P1", absl::StrCat("AppendBatch ", kBatch, " seqs x ", size, ", one ring command"),
                      batch_m.karakv, redis_name, batch_m.baseline, "GB/s", false, std::nullopt});
    }
    rows.push_back({"P1", absl::StrCat("Append ", size, ", shm staging, gRPC"), shm_m.karakv, redis_name,
                    shm_m.baseline, "GB/s", false, std::nullopt});
    rows.push_back({"P1", absl::StrCat("Append ", size, ", inline in RPC"), inl_m.karakv, redis_name,
                    inl_m.baseline, "GB/s", false,
                    c.payload >= (1 << 20) ? std::optional<Target>(Target{Target::Kind::kAtLeast, 1.0})
                                           : std::nullopt});
    rows.push_back({"P1", absl::StrCat("write_kv alone (no RPC), ", size), copy_m.karakv, redis_name,
                    copy_m.baseline, "GB/s", false, std::nullopt});
    // What gRPC alone costs at this size (bench/grpc_floor.h): an inline Append cannot beat it.
    const Pair floor_m = median_pair(c.floor);
    rows.push_back({"P1", absl::StrCat("raw gRPC unary, ", size, " (no parse, no copy; floor of inline)"),
                    floor_m.karakv, redis_name, floor_m.baseline, "GB/s", false, std::nullopt});
  }
  rows.push_back({"P1", "empty call p50: karakv Ping (gRPC)", percentile(grpc_us, 50), "Redis PING p50",
                  percentile(resp_us, 50), "us", false, std::nullopt});
  configs.clear();
  shm->reset();
  inl->reset();
  rng->reset();
  stop_or_warn(*daemon);
  floor->reset();
  redis->client.reset();
  redis->process->stop();
  return rows;
}

std::string p1_how() {
  return absl::StrFormat("P1 median-ratio round of %d interleaved rounds of %.1f s each", absl::GetFlag(FLAGS_rounds),
                         absl::GetFlag(FLAGS_seconds));
}

}  // namespace karakv::bench
