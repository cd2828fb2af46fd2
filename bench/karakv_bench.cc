// karakv-bench: measures karakv's performance targets, each side by side with its baseline in one
// run, and prints the numbers, their ratio, the target and PASS/MISS. It starts (and stops) its own
// karakvd and redis-server on Unix sockets in a private temporary directory.
//
//   p1  Append throughput (GB/s of K/V into the pool) vs Redis SET of the same payload   >= 3x
//   p2  decode attention bandwidth vs this machine's streaming-read bandwidth            >= 60%
//   p3  Step round-trip p50 vs an empty unary gRPC call (Ping) on the same server        <= 2x
//   p5  Kara's compaction time as a share of decode time (32 seqs x 2048 steps)          <= 5%
//       (with decode tokens/s of kara vs none, decoded side by side)
//   memory  resident KV bytes per sequence over 3000 decode steps: none, kara, snapkv, streaming
//   quant   quantized storage (kivi2/4, tq2/3/4, kara+kivi4): actual vs nominal compression ratio at
//           1k/4k/16k tokens, attention error vs fp16, quantized attention time vs fp16
//   serve   a continuous-batching serving sweep (serve.cc): output throughput vs max batch per policy (P4)
//   soak    N worker processes doing random operations and crashes against one karakvd for T minutes
//           (soak.cc): errors by code, pool invariant, sampled outputs vs a reference, daemon RSS
#include <emmintrin.h>
#include <fcntl.h>
#include <omp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/synthetic.h"
#include "harness.h"
#include "serve.h"
#include "soak.h"
#include "karakv/client.h"
#include "karakv/kernels/backend.h"
#include "karakv/kernels/half.h"

ABSL_FLAG(std::string, karakvd, "", "karakvd binary (default: ../server/karakvd next to this binary)");
ABSL_FLAG(std::string, redis_server, "redis-server", "redis-server binary for the P1 baseline (PATH is searched)");
ABSL_FLAG(std::string, out_dir, "",
          "Write one CSV per mode (p1.csv, p2.csv, p3.csv, p5.csv, memory.csv, quant.csv, prefix.csv; memory also "
          "memory_series.csv, quant also quant_ratio.csv and quant_formats.csv) "
          "into this directory");
ABSL_FLAG(bool, csv, false, "Also print the results as CSV on stdout");
ABSL_FLAG(double, seconds, 1.0, "P1: seconds per measurement of one configuration in one round");
ABSL_FLAG(int32_t, rounds, 5, "P1: interleaved rounds; the round with the median ratio is reported");
ABSL_FLAG(int32_t, p2_sequences, 32, "P2: sequences in the decode batch");
ABSL_FLAG(int32_t, p2_tokens, 4096, "P2: resident tokens per sequence");
ABSL_FLAG(int32_t, p2_reps, 3, "P2: passes over all layers (best pass vs best streaming read)");
ABSL_FLAG(bool, p2_daemon, true, "P2: also measure decode end to end through karakvd Step (info row)");
ABSL_FLAG(int32_t, p3_calls, 2000, "P3: timed Step and Ping calls each (interleaved)");
ABSL_FLAG(int32_t, p3_warmup, 200, "P3: untimed warm-up calls each");
ABSL_FLAG(int32_t, p5_sequences, 32, "P5: sequences in the decode batch (each policy)");
ABSL_FLAG(int32_t, p5_prompt, 128, "P5: prompt tokens per sequence (Append)");
ABSL_FLAG(int32_t, p5_steps, 2048, "P5: decode steps (each a Step per layer over the batch)");
ABSL_FLAG(int32_t, memory_sequences, 4, "memory: sequences per policy");
ABSL_FLAG(int32_t, memory_prompt, 256, "memory: prompt tokens per sequence (Append)");
ABSL_FLAG(int32_t, memory_steps, 3000, "memory: decode steps");
ABSL_FLAG(int32_t, memory_sample_every, 64, "memory: decode steps between samples (ListSequences)");
ABSL_FLAG(int32_t, memory_print_every, 256, "memory: steps between the printed table's rows (the CSV has all)");
ABSL_FLAG(std::string, quant_lengths, "1024,4096,16384", "quant: context lengths (tokens) of the compression-ratio sequences");
ABSL_FLAG(int32_t, quant_kara_max, 4096, "quant: kara and kara+kivi4 decode (Step) up to this length; longer lengths are skipped");
ABSL_FLAG(int32_t, quant_sequences, 8, "quant: sequences for the in-process attention error and time");
ABSL_FLAG(int32_t, quant_tokens, 4096, "quant: tokens per sequence for the attention error and time");
ABSL_FLAG(int32_t, quant_reps, 2, "quant: timed passes over all layers (best is reported)");
ABSL_FLAG(bool, quant_outlier, true, "quant: also measure the error with one key channel 10x larger");
ABSL_FLAG(int32_t, prefix_system_tokens, 1000, "prefix: tokens of the system prompt every request shares");
ABSL_FLAG(int32_t, prefix_own_tokens, 64, "prefix: tokens of each request after the system prompt");
ABSL_FLAG(int32_t, prefix_requests, 4, "prefix: requests per worker (after one cold request)");
ABSL_FLAG(std::string, prefix_workers, "2,4,8", "prefix: worker counts (one session each, concurrent)");
ABSL_FLAG(int32_t, ring_calls, 2000, "ring: timed calls each of ring Step, gRPC Step and Ping (interleaved)");
ABSL_FLAG(std::string, ring_batches, "1,8,64", "ring: decode batch sizes of the synthetic worker");
ABSL_FLAG(int32_t, ring_rounds, 3, "ring: synthetic-worker runs per path and batch (alternating; median reported)");
ABSL_FLAG(int32_t, ring_generate, 64, "ring: decode steps per synthetic-worker run");
ABSL_FLAG(std::string, synthetic_worker, "",
          "synthetic_worker binary (default: ../examples/synthetic_worker next to this binary)");
ABSL_FLAG(int32_t, timeout_s, 2400, "Abort (and stop the child processes) after this many seconds");
ABSL_FLAG(bool, strict, false, "Exit with status 3 when any target is missed");

namespace {

namespace kn = karakv::kernels;
using namespace karakv::bench;  // the process harness (harness.h)
using karakv::synthetic::Tensor;

// ---------------------------------------------------------------------------------------------
// Results.

struct Target {
  enum class Kind { kAtLeast, kAtMost } kind;
  double ratio;
};

struct Row {
  std::string mode;
  std::string metric;
  double karakv = 0;
  std::string baseline_name;
  double baseline = 0;
  std::string unit;
  bool percent = false;  // print the ratio as a percentage
  std::optional<Target> target;

  double ratio() const { return baseline > 0 ? karakv / baseline : 0; }
  std::string ratio_text() const {
    return percent ? absl::StrFormat("%.1f%%", 100 * ratio()) : absl::StrFormat("%.2fx", ratio());
  }
  std::string target_text() const {
    if (!target) return "-";
    const char* op = target->kind == Target::Kind::kAtLeast ? ">=" : "<=";
    return percent ? absl::StrFormat("%s %.0f%%", op, 100 * target->ratio) : absl::StrFormat("%s %gx", op, target->ratio);
  }
  std::string verdict() const {
    if (!target) return "info";
    const bool ok = target->kind == Target::Kind::kAtLeast ? ratio() >= target->ratio : ratio() <= target->ratio;
    return ok ? "PASS" : "MISS";
  }
};

std::string number(double v) {
  if (v >= 100) return absl::StrFormat("%.0f", v);
  if (v >= 10) return absl::StrFormat("%.1f", v);
  return absl::StrFormat("%.2f", v);
}

void print_table(const std::vector<Row>& rows) {
  std::vector<std::vector<std::string>> cells = {
      {"mode", "metric", "karakv", "baseline", "baseline value", "ratio", "target", "result"}};
  for (const Row& r : rows) {
    cells.push_back({r.mode, r.metric, number(r.karakv) + " " + r.unit, r.baseline_name,
                     number(r.baseline) + " " + r.unit, r.ratio_text(), r.target_text(), r.verdict()});
  }
  std::vector<size_t> width(cells[0].size(), 0);
  for (const auto& line : cells)
    for (size_t i = 0; i < line.size(); ++i) width[i] = std::max(width[i], line[i].size());
  for (size_t n = 0; n < cells.size(); ++n) {
    std::string out;
    for (size_t i = 0; i < cells[n].size(); ++i) {
      out += cells[n][i];
      if (i + 1 < cells[n].size()) out += std::string(width[i] - cells[n][i].size() + 2, ' ');
    }
    std::printf("%s\n", out.c_str());
    if (n == 0) {
      size_t total = 0;
      for (size_t w : width) total += w + 2;
      std::printf("%s\n", std::string(total - 2, '-').c_str());
    }
  }
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

std::string to_csv(const std::vector<Row>& rows) {
  std::string out = "mode,metric,karakv,baseline_name,baseline,unit,ratio,target,result,ratio_text\n";
  for (const Row& r : rows) {
    out += absl::StrCat(csv_field(r.mode), ",", csv_field(r.metric), ",", absl::StrFormat("%.6g", r.karakv), ",",
                        csv_field(r.baseline_name), ",", absl::StrFormat("%.6g", r.baseline), ",",
                        csv_field(r.unit), ",", absl::StrFormat("%.6g", r.ratio()), ",",
                        csv_field(r.target_text()), ",", r.verdict(), ",", r.ratio_text(), "\n");
  }
  return out;
}

// One karakv measurement and the baseline measured right next to it.
struct Pair {
  double karakv = 0, baseline = 0;
  double ratio() const { return baseline > 0 ? karakv / baseline : 0; }
};

// The pair whose ratio is the median (the lower middle one for an even count).
Pair median_pair(std::vector<Pair> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end(), [](const Pair& a, const Pair& b) { return a.ratio() < b.ratio(); });
  return v[(v.size() - 1) / 2];
}

// The best karakv value and the best baseline value: the best-of-N of each side. (The pair with
// the best ratio would favour karakv whenever a baseline sample dips.)
Pair best_of_each(const std::vector<Pair>& v) {
  Pair best;
  for (const Pair& p : v) {
    best.karakv = std::max(best.karakv, p.karakv);
    best.baseline = std::max(best.baseline, p.baseline);
  }
  return best;
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

// ---------------------------------------------------------------------------------------------
// P1: Append throughput vs Redis SET.

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
    auto len = client_.Append(seq_, tokens_, k_, v_);
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

absl::StatusOr<std::vector<Row>> run_p1(const TempDir& dir) {
  // One token of K+V is 2 * 8 heads * 128 dims * 2 B = 4 KiB, so 16 tokens = 64 KiB per Append and
  // 256 tokens = 1 MiB; a block (16 tokens) is 64 KiB.
  auto daemon = start_karakvd(dir, "karakvd-p1",
                              {"--layers=1", "--q_heads=8", "--kv_heads=8", "--head_dim=128", "--dtype=fp16",
                               "--block_size=16", "--pool_bytes=512MiB"});
  if (!daemon.ok()) return daemon.status();
  auto redis = start_redis(dir);
  if (!redis.ok()) return redis.status();

  const std::vector<size_t> payloads = {64 << 10, 1 << 20};
  const size_t max_payload = payloads.back();
  auto shm = attach(*daemon, max_payload * 2 + (1 << 20), "karakv-bench-p1-shm");
  if (!shm.ok()) return shm.status();
  auto inl = attach(*daemon, 0, "karakv-bench-p1-inline");
  if (!inl.ok()) return inl.status();
  const kn::Geometry g = (*shm)->geometry();
  const size_t token_bytes = 2 * (*shm)->append_bytes(1);  // K + V of one token
  constexpr int kMaxTokens = 8192;                          // 32 MiB of K+V per sequence

  struct Config {
    size_t payload;
    std::unique_ptr<AppendLoop> shm_loop, inl_loop;
    int tokens = 0;
    karakv::Buffer k, v;  // the payload in this process, for the copy-only measurement
    std::vector<uint8_t> redis_value;
    std::vector<Pair> shm, inl, copy;  // per round, each with that round's Redis SET
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
      auto w = write_kv_gbps(g, c.tokens, c.k.data(), c.v.data(), secs / 2);
      if (!w.ok()) return w.status();
      c.shm.push_back({*a, *b});
      c.inl.push_back({*i, *b});
      c.copy.push_back({*w, *b});
      progress(absl::StrFormat("P1   %zu B: shm %.2f GB/s, Redis SET %.2f GB/s, inline %.2f GB/s, write_kv alone %.2f GB/s",
                               c.payload, *a, *b, *i, *w));
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
    rows.push_back({"P1", absl::StrCat("Append ", size, ", shm staging"), shm_m.karakv, redis_name, shm_m.baseline,
                    "GB/s", false, Target{Target::Kind::kAtLeast, 3.0}});
    rows.push_back({"P1", absl::StrCat("Append ", size, ", inline in RPC"), inl_m.karakv, redis_name,
                    inl_m.baseline, "GB/s", false, std::nullopt});
    rows.push_back({"P1", absl::StrCat("write_kv alone (no RPC), ", size), copy_m.karakv, redis_name,
                    copy_m.baseline, "GB/s", false, std::nullopt});
  }
  rows.push_back({"P1", "empty call p50: karakv Ping (gRPC)", percentile(grpc_us, 50), "Redis PING p50",
                  percentile(resp_us, 50), "us", false, std::nullopt});
  configs.clear();
  shm->reset();
  inl->reset();
  stop_or_warn(*daemon);
  redis->client.reset();
  redis->process->stop();
  return rows;
}

// ---------------------------------------------------------------------------------------------
// P2: decode attention bandwidth vs streaming-read bandwidth.

// Best-of-`reps` bandwidth of summing `n` floats with `threads` OpenMP threads. SSE2 with eight
// independent accumulators keeps the adds far ahead of memory, so this measures the memory.
double stream_read_gbps(const float* data, size_t n, int threads, int reps) {
  double best = 0;
  volatile float sink = 0;
  for (int r = 0; r < reps; ++r) {
    const auto start = Clock::now();
    float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const size_t chunk = (n / nt + 31) / 32 * 32;
      const size_t begin = std::min(n, size_t(t) * chunk), end = std::min(n, begin + chunk);
      __m128 acc[8];
      for (auto& a : acc) a = _mm_setzero_ps();
      size_t i = begin;
      for (; i + 32 <= end; i += 32) {
        for (int j = 0; j < 8; ++j) acc[j] = _mm_add_ps(acc[j], _mm_load_ps(data + i + 4 * j));
      }
      for (int j = 1; j < 8; ++j) acc[0] = _mm_add_ps(acc[0], acc[j]);
      alignas(16) float lanes[4];
      _mm_store_ps(lanes, acc[0]);
      float s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
      for (; i < end; ++i) s += data[i];
      total += s;
    }
    const double el = seconds_since(start);
    sink = sink + total;
    best = std::max(best, double(n) * sizeof(float) / el / 1e9);
  }
  (void)sink;
  return best;
}

// Host memory aligned like the CPU backend's pool (2 MiB, huge-page hint), so both sides of the
// comparison get the same TLB treatment.
struct HugeBuffer {
  void* ptr = nullptr;
  explicit HugeBuffer(size_t bytes) {
    constexpr size_t kHuge = size_t(2) << 20;
    const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
    ptr = std::aligned_alloc(kHuge, rounded);
#ifdef MADV_HUGEPAGE
    if (ptr) madvise(ptr, rounded, MADV_HUGEPAGE);
#endif
  }
  ~HugeBuffer() { std::free(ptr); }
};

// The P2 baseline: a 1 GiB float array summed by every hardware thread (the threads the CPU
// backend uses). It is sampled right before every decode pass, so each pass is compared with the
// machine as it was at that moment (on a shared machine, a neighbour halves both).
class StreamBaseline {
 public:
  static absl::StatusOr<std::unique_ptr<StreamBaseline>> make(int threads) {
    auto b = std::unique_ptr<StreamBaseline>(new StreamBaseline(threads));
    if (b->buffer_.ptr == nullptr) return absl::ResourceExhaustedError("cannot allocate the 1 GiB stream buffer");
    auto* f = b->data();
#pragma omp parallel for schedule(static) num_threads(threads)
    for (size_t i = 0; i < kFloats; ++i) f[i] = float(i & 1023) * 0.001f;
    return b;
  }
  double sample() { return stream_read_gbps(data(), kFloats, threads_, 2); }
  double single_thread() { return stream_read_gbps(data(), kFloats, 1, 3); }
  int threads() const { return threads_; }

 private:
  static constexpr size_t kFloats = size_t(1) << 28;  // 1 GiB
  explicit StreamBaseline(int threads) : buffer_(kFloats * sizeof(float)), threads_(threads) {}
  float* data() { return static_cast<float*>(buffer_.ptr); }
  HugeBuffer buffer_;
  const int threads_;
};

kn::Geometry smollm_geometry() {
  kn::Geometry g;
  g.num_layers = 30;
  g.num_q_heads = 9;
  g.num_kv_heads = 3;
  g.head_dim = 64;
  g.block_size = 16;
  g.dtype = kn::DType::kFloat16;
  return g;
}

// K/V bytes one decode pass over every layer reads for sequences of these lengths.
double decode_bytes(const kn::Geometry& g, const std::vector<int32_t>& lengths) {
  const double per_token = double(g.num_layers) * 2 * g.kv_token_elems() * kn::dtype_size(g.dtype);
  return per_token * std::accumulate(lengths.begin(), lengths.end(), 0.0);
}

// A pattern of synthetic fp16 values, several blocks long, that fills the pool quickly.
std::vector<uint16_t> synthetic_pattern(size_t elems) {
  std::vector<uint16_t> p(elems);
  for (size_t i = 0; i < elems; ++i) p[i] = kn::float_to_half(karakv::synthetic::value(7, Tensor::kKey, 0, 0, int64_t(i), 0, 0));
  return p;
}

struct DirectDecode {
  Pair scattered;  // block tables are a random permutation of the pool
  Pair in_order;   // each sequence's blocks consecutive
};

absl::StatusOr<DirectDecode> decode_direct_gbps(const kn::Geometry& g, int seqs, int tokens, int reps,
                                                StreamBaseline& stream) {
  auto backend = kn::make_cpu_backend(0);
  const int blocks_per_seq = (tokens + g.block_size - 1) / g.block_size;
  const size_t num_blocks = size_t(seqs) * blocks_per_seq;
  void* pool = nullptr;
  progress(absl::StrFormat("P2 allocating %.2f GB pool (%zu blocks of %zu B)",
                           double(num_blocks) * g.block_bytes() / 1e9, num_blocks, g.block_bytes()));
  if (auto s = backend->allocate(num_blocks * g.block_bytes(), &pool); !s.is_ok()) {
    return absl::ResourceExhaustedError(s.message);
  }
  std::unique_ptr<void, std::function<void(void*)>> pool_owner(pool, [&](void* p) { backend->free(p); });

  // Fill every block from a rotating window of the pattern: values in [-1, 1), distinct per block.
  const size_t block_elems = g.block_elems();
  const std::vector<uint16_t> pattern = synthetic_pattern(4 * block_elems);
  auto* dst = static_cast<uint16_t*>(pool);
#pragma omp parallel for schedule(static)
  for (size_t b = 0; b < num_blocks; ++b) {
    const size_t shift = (b * 7919) % (pattern.size() - block_elems);
    std::memcpy(dst + b * block_elems, pattern.data() + shift, block_elems * sizeof(uint16_t));
  }

  // q: [layers][seqs][Hq][D] fp32; out: [seqs][Hq][D] fp32.
  const size_t q_elems = size_t(seqs) * g.q_token_elems();
  std::vector<float> q(q_elems * g.num_layers), out(q_elems);
  for (int l = 0; l < g.num_layers; ++l)
    for (int s = 0; s < seqs; ++s)
      karakv::synthetic::fill_query(q.data() + l * q_elems + s * g.q_token_elems(), g, 1, s, l, tokens - 1);
  const float scale = float(1.0 / std::sqrt(double(g.head_dim)));
  std::vector<int32_t> offsets(seqs + 1), lengths(seqs, tokens);
  for (int s = 0; s <= seqs; ++s) offsets[s] = s * blocks_per_seq;
  const double bytes = decode_bytes(g, lengths);

  // The best of `reps` passes (after one warm-up) of decode over every layer with this table, and
  // the best of the streaming reads sampled just before each of them.
  auto passes = [&](const std::vector<int32_t>& table, const char* label) -> absl::StatusOr<Pair> {
    kn::PagedKV kv;
    kv.pool = pool;
    kv.geometry = g;
    kv.block_table = table.data();
    kv.table_offset = offsets.data();
    kv.seq_len = lengths.data();
    kv.num_seqs = seqs;
    std::vector<Pair> measured;
    for (int r = 0; r <= reps; ++r) {
      const double stream_gbps = stream.sample();
      const auto start = Clock::now();
      for (int l = 0; l < g.num_layers; ++l) {
        if (auto st = backend->decode_attention(kv, l, q.data() + l * q_elems, out.data(), scale); !st.is_ok()) {
          return absl::InternalError(absl::StrCat("decode_attention: ", st.message));
        }
      }
      const double el = seconds_since(start);
      for (float x : out) {
        if (!std::isfinite(x)) return absl::InternalError("decode_attention produced a non-finite output");
      }
      if (r > 0) measured.push_back({bytes / el / 1e9, stream_gbps});
      progress(absl::StrFormat("P2 direct, %s, pass %d/%d: %.3f s = %.2f GB/s%s (streaming read just before: %.2f GB/s)",
                               label, r, reps, el, bytes / el / 1e9, r == 0 ? " (warm-up)" : "", stream_gbps));
    }
    return best_of_each(measured);
  };

  // The measured table is a shuffled permutation of the pool, so a sequence's blocks are scattered
  // the way a long-running daemon's would be; blocks in order show what scattering costs.
  std::vector<int32_t> table(num_blocks);
  std::iota(table.begin(), table.end(), 0);
  auto in_order = passes(table, "blocks in order");
  if (!in_order.ok()) return in_order.status();
  std::shuffle(table.begin(), table.end(), std::mt19937(42));
  auto scattered = passes(table, "scattered blocks");
  if (!scattered.ok()) return scattered.status();
  return DirectDecode{*scattered, *in_order};
}

// Bytes of K (or V) that Append of `tokens` tokens carries; the daemon's geometry equals `g`.
size_t append_tensor_bytes(const kn::Geometry& g, int tokens) {
  return size_t(g.num_layers) * tokens * g.kv_token_elems() * kn::dtype_size(g.dtype);
}

// Decode through the daemon: `seqs` sequences prefilled to `tokens`, then batched Steps over all
// layers. Returns the best step's GB/s of K/V read (the Step that appends a token also attends
// over it) and the best of the streaming reads sampled just before each step.
absl::StatusOr<Pair> decode_daemon_gbps(const TempDir& dir, const kn::Geometry& g, int seqs, int tokens,
                                          int reps, StreamBaseline& stream) {
  const int steps = reps + 1;
  const size_t blocks = size_t(seqs) * ((tokens + steps + g.block_size - 1) / g.block_size);
  const size_t pool_bytes = (blocks + 16) * g.block_bytes();
  auto daemon = start_karakvd(dir, "karakvd-p2",
                              {"--layers=30", "--q_heads=9", "--kv_heads=3", "--head_dim=64", "--dtype=fp16",
                               "--block_size=16", absl::StrCat("--pool_bytes=", pool_bytes)});
  if (!daemon.ok()) return daemon.status();
  // Prefill in chunks of up to 512 tokens; a shorter tail gets its own buffers.
  const int chunk = std::min(512, tokens), tail = tokens % chunk;
  auto client = attach(*daemon, 2 * (append_tensor_bytes(g, chunk) + append_tensor_bytes(g, tail)) + (4 << 20),
                       "karakv-bench-p2");
  if (!client.ok()) return client.status();
  karakv::Client& c = **client;
  auto k = c.alloc(c.append_bytes(chunk)), v = c.alloc(c.append_bytes(chunk));
  auto tk = c.alloc(c.append_bytes(std::max(tail, 1))), tv = c.alloc(c.append_bytes(std::max(tail, 1)));
  auto sk = c.alloc(c.step_kv_bytes(seqs)), sv = c.alloc(c.step_kv_bytes(seqs));
  auto q = c.alloc(c.q_bytes(seqs)), out = c.alloc(c.q_bytes(seqs));
  for (auto* b : {&k, &v, &tk, &tv, &sk, &sv, &q, &out}) {
    if (!b->ok()) return b->status();
  }
  karakv::synthetic::fill_prompt(k->data(), g, 1, Tensor::kKey, 0, 0, chunk);
  karakv::synthetic::fill_prompt(v->data(), g, 1, Tensor::kValue, 0, 0, chunk);
  if (tail > 0) {
    karakv::synthetic::fill_prompt(tk->data(), g, 1, Tensor::kKey, 0, 0, tail);
    karakv::synthetic::fill_prompt(tv->data(), g, 1, Tensor::kValue, 0, 0, tail);
  }
  std::vector<uint64_t> ids;
  const auto t_prefill = Clock::now();
  for (int s = 0; s < seqs; ++s) {
    auto id = c.CreateSequence();
    if (!id.ok()) return id.status();
    ids.push_back(*id);
    for (int done = 0; done < tokens; done += chunk) {
      const bool full = tokens - done >= chunk;
      auto len = full ? c.Append(*id, chunk, *k, *v) : c.Append(*id, tail, *tk, *tv);
      if (!len.ok()) return len.status();
    }
  }
  const double prefill_s = seconds_since(t_prefill);
  progress(absl::StrFormat("P2 daemon prefill: %d x %d tokens in %.2f s (%.2f GB/s)", seqs, tokens, prefill_s,
                           decode_bytes(g, std::vector<int32_t>(seqs, tokens)) / prefill_s / 1e9));
  const size_t kv_tok = g.kv_token_elems() * kn::dtype_size(g.dtype);
  std::vector<Pair> measured;
  for (int step = 0; step < steps; ++step) {  // step 0 warms up
    const double stream_gbps = stream.sample();
    const auto start = Clock::now();
    for (int l = 0; l < g.num_layers; ++l) {
      for (int s = 0; s < seqs; ++s) {
        karakv::synthetic::fill_token(sk->data() + s * kv_tok, g, 1, Tensor::kKey, ids[s], l, tokens + step);
        karakv::synthetic::fill_token(sv->data() + s * kv_tok, g, 1, Tensor::kValue, ids[s], l, tokens + step);
        karakv::synthetic::fill_query(q->as<float>().data() + s * g.q_token_elems(), g, 1, ids[s], l, tokens + step);
      }
      auto r = c.Step(l, ids, *sk, *sv, *q, *out);
      if (!r.ok()) return r.status();
    }
    const double el = seconds_since(start);
    const double bytes = decode_bytes(g, std::vector<int32_t>(seqs, tokens + step + 1));
    if (step > 0) measured.push_back({bytes / el / 1e9, stream_gbps});
    progress(absl::StrFormat("P2 daemon step %d/%d: %.3f s = %.2f GB/s%s (streaming read just before: %.2f GB/s)",
                             step, reps, el, bytes / el / 1e9, step == 0 ? " (warm-up)" : "", stream_gbps));
  }
  client->reset();
  stop_or_warn(*daemon);
  return best_of_each(measured);
}

absl::StatusOr<std::vector<Row>> run_p2(const TempDir& dir) {
  const kn::Geometry g = smollm_geometry();
  const int seqs = absl::GetFlag(FLAGS_p2_sequences), tokens = absl::GetFlag(FLAGS_p2_tokens);
  const int reps = std::max(1, absl::GetFlag(FLAGS_p2_reps));
  const int threads = omp_get_max_threads();

  auto stream = StreamBaseline::make(threads);
  if (!stream.ok()) return stream.status();
  const Pair one_thread{(*stream)->single_thread(), (*stream)->sample()};
  auto direct = decode_direct_gbps(g, seqs, tokens, reps, **stream);
  if (!direct.ok()) return direct.status();
  std::optional<Pair> via_daemon;
  if (absl::GetFlag(FLAGS_p2_daemon)) {
    auto d = decode_daemon_gbps(dir, g, seqs, tokens, reps, **stream);
    if (!d.ok()) return d.status();
    via_daemon = *d;
  }
  const std::string base = absl::StrFormat("streaming read, %d threads", threads);
  const std::string what = absl::StrFormat(", %d seqs x %d tokens", seqs, tokens);
  std::vector<Row> rows;
  rows.push_back({"P2", "decode_attention (CPU backend)" + what, direct->scattered.karakv, base,
                  direct->scattered.baseline, "GB/s", true, Target{Target::Kind::kAtLeast, 0.60}});
  rows.push_back({"P2", "decode_attention, blocks in order", direct->in_order.karakv, base,
                  direct->in_order.baseline, "GB/s", true, std::nullopt});
  if (via_daemon) {
    rows.push_back({"P2", "decode through karakvd Step, 30 layers", via_daemon->karakv, base, via_daemon->baseline,
                    "GB/s", true, std::nullopt});
  }
  rows.push_back({"P2", "streaming read, 1 thread", one_thread.karakv, base, one_thread.baseline, "GB/s", true,
                  std::nullopt});
  return rows;
}

// ---------------------------------------------------------------------------------------------
// P3: Step round trip vs Ping.

absl::StatusOr<std::vector<Row>> run_p3(const TempDir& dir) {
  auto daemon = start_karakvd(dir, "karakvd-p3",
                              {"--layers=1", "--q_heads=1", "--kv_heads=1", "--head_dim=8", "--dtype=fp32",
                               "--block_size=16", "--pool_bytes=16MiB"});
  if (!daemon.ok()) return daemon.status();
  auto client = attach(*daemon, 1 << 16, "karakv-bench-p3");
  if (!client.ok()) return client.status();
  karakv::Client& c = **client;
  const kn::Geometry g = c.geometry();
  auto k = c.alloc(c.step_kv_bytes(1)), v = c.alloc(c.step_kv_bytes(1));
  auto q = c.alloc(c.q_bytes(1)), out = c.alloc(c.q_bytes(1));
  for (auto* b : {&k, &v, &q, &out}) {
    if (!b->ok()) return b->status();
  }
  // The sequence stays tiny: it is replaced (untimed) every kMaxLength steps.
  constexpr int kMaxLength = 240;
  uint64_t seq = 0;
  int length = 0;
  auto fresh_sequence = [&]() -> absl::Status {
    if (seq != 0) {
      if (auto r = c.Release(seq); !r.ok()) return r.status();
    }
    auto id = c.CreateSequence();
    if (!id.ok()) return id.status();
    seq = *id;
    length = 0;
    return absl::OkStatus();
  };
  if (absl::Status s = fresh_sequence(); !s.ok()) return s;

  const int warmup = std::max(0, absl::GetFlag(FLAGS_p3_warmup));
  const int calls = std::max(1, absl::GetFlag(FLAGS_p3_calls));
  std::vector<double> step_us, ping_us;
  step_us.reserve(calls);
  ping_us.reserve(calls);
  for (int i = 0; i < warmup + calls; ++i) {
    if (length >= kMaxLength) {
      if (absl::Status s = fresh_sequence(); !s.ok()) return s;
    }
    karakv::synthetic::fill_token(k->data(), g, 1, Tensor::kKey, seq, 0, length);
    karakv::synthetic::fill_token(v->data(), g, 1, Tensor::kValue, seq, 0, length);
    karakv::synthetic::fill_query(q->as<float>().data(), g, 1, seq, 0, length);
    const uint64_t ids[1] = {seq};
    double step_t = 0, ping_t = 0;
    // Alternate which call goes first so neither always follows the other.
    for (int j = 0; j < 2; ++j) {
      const bool do_step = (j == 0) == (i % 2 == 0);
      const auto start = Clock::now();
      if (do_step) {
        auto r = c.Step(0, ids, *k, *v, *q, *out);
        step_t = seconds_since(start) * 1e6;
        if (!r.ok()) return r.status();
        ++length;
      } else {
        absl::Status s = c.Ping();
        ping_t = seconds_since(start) * 1e6;
        if (!s.ok()) return s;
      }
    }
    if (i >= warmup) {
      step_us.push_back(step_t);
      ping_us.push_back(ping_t);
    }
  }
  progress(absl::StrFormat("P3 %d Step + %d Ping calls after %d warm-up", calls, calls, warmup));
  if (auto r = c.Release(seq); !r.ok()) return r.status();
  client->reset();
  stop_or_warn(*daemon);

  std::vector<Row> rows;
  rows.push_back({"P3", "Step round trip p50 (1 seq, 1 layer, shm)", percentile(step_us, 50), "Ping p50 (empty gRPC)",
                  percentile(ping_us, 50), "us", false, Target{Target::Kind::kAtMost, 2.0}});
  rows.push_back({"P3", "Step round trip p99", percentile(step_us, 99), "Ping p99 (empty gRPC)",
                  percentile(ping_us, 99), "us", false, std::nullopt});
  return rows;
}

// ---------------------------------------------------------------------------------------------
// ring: the decode fast path. Round trip of a one-token Step through the shared-memory ring, the
// same Step through gRPC and an empty gRPC call, interleaved in one daemon; then decode tokens/s of
// the synthetic worker with and without the ring, runs alternating.

std::string default_synthetic_worker() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "synthetic_worker";
  const auto candidate = exe.parent_path().parent_path() / "examples" / "synthetic_worker";
  return std::filesystem::exists(candidate) ? candidate.string() : "synthetic_worker";
}

// One synthetic_worker run; returns its decode tokens/s.
absl::StatusOr<double> synthetic_tokens_per_s(const Daemon& d, int batch, bool fast_path) {
  const std::string worker = absl::GetFlag(FLAGS_synthetic_worker).empty() ? default_synthetic_worker()
                                                                           : absl::GetFlag(FLAGS_synthetic_worker);
  const std::string cmd = absl::StrCat(worker, " --target=", d.target, " --sequences=", batch,
                                       " --prompt=64 --generate=", absl::GetFlag(FLAGS_ring_generate),
                                       " --check_every=0 --json", fast_path ? " --fast_path" : "", " 2>/dev/null");
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return absl::InternalError(absl::StrCat("cannot run ", cmd));
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  const size_t at = out.find("\"decode_tokens_per_s\":");
  if (status != 0 || at == std::string::npos) {
    return absl::InternalError(absl::StrCat(cmd, " failed (status ", status, "): ", out));
  }
  return std::strtod(out.c_str() + at + 22, nullptr);
}

absl::StatusOr<std::vector<Row>> run_ring(const TempDir& dir) {
  std::vector<Row> rows;
  {
    auto daemon = start_karakvd(dir, "karakvd-ring",
                                {"--layers=1", "--q_heads=1", "--kv_heads=1", "--head_dim=8", "--dtype=fp32",
                                 "--block_size=16", "--pool_bytes=16MiB"});
    if (!daemon.ok()) return daemon.status();
    karakv::ClientOptions o;
    o.target = daemon->target;
    o.staging_bytes = 1 << 16;
    o.worker_id = "karakv-bench-ring";
    o.fast_path = true;
    auto ring_client = karakv::Client::Attach(o);
    if (!ring_client.ok()) return ring_client.status();
    if (!(*ring_client)->fast_path()) return absl::FailedPreconditionError("karakvd did not enable the fast path");
    o.fast_path = false;
    o.worker_id = "karakv-bench-grpc";
    auto grpc_client = karakv::Client::Attach(o);
    if (!grpc_client.ok()) return grpc_client.status();
    struct Path {
      karakv::Client* c = nullptr;
      karakv::Buffer k{}, v{}, q{}, out{};
      uint64_t seq = 0;
      int length = 0;
    };
    std::vector<Path> paths;
    for (karakv::Client* c : {ring_client->get(), grpc_client->get()}) {
      Path p;
      p.c = c;
      p.k = *c->alloc(c->step_kv_bytes(1));
      p.v = *c->alloc(c->step_kv_bytes(1));
      p.q = *c->alloc(c->q_bytes(1));
      p.out = *c->alloc(c->q_bytes(1));
      paths.push_back(p);
    }
    const kn::Geometry g = paths[0].c->geometry();
    constexpr int kMaxLength = 240;  // sequences stay tiny: replaced (untimed) every kMaxLength steps
    auto step = [&](Path& p) -> absl::StatusOr<double> {
      if (p.seq == 0 || p.length >= kMaxLength) {
        if (p.seq != 0) {
          if (auto r = p.c->Release(p.seq); !r.ok()) return r.status();
        }
        auto id = p.c->CreateSequence();
        if (!id.ok()) return id.status();
        p.seq = *id;
        p.length = 0;
      }
      karakv::synthetic::fill_token(p.k.data(), g, 1, Tensor::kKey, p.seq, 0, p.length);
      karakv::synthetic::fill_token(p.v.data(), g, 1, Tensor::kValue, p.seq, 0, p.length);
      karakv::synthetic::fill_query(p.q.as<float>().data(), g, 1, p.seq, 0, p.length);
      const uint64_t ids[1] = {p.seq};
      const auto start = Clock::now();
      auto r = p.c->Step(0, ids, p.k, p.v, p.q, p.out);
      const double us = seconds_since(start) * 1e6;
      if (!r.ok()) return r.status();
      ++p.length;
      return us;
    };
    const int warmup = std::max(0, absl::GetFlag(FLAGS_p3_warmup));
    const int calls = std::max(1, absl::GetFlag(FLAGS_ring_calls));
    auto call = [&](int which) -> absl::StatusOr<double> {
      if (which < 2) return step(paths[which]);
      const auto start = Clock::now();
      absl::Status s = paths[1].c->Ping();
      if (!s.ok()) return s;
      return seconds_since(start) * 1e6;
    };
    // Two orders, each with the three calls side by side:
    //  - busy: runs of kRun consecutive calls of one kind (kinds rotating), as a decode loop issues
    //    Steps back to back: the ring thread is still spinning when the next command comes;
    //  - idle: the kinds rotate call by call, so each ring command finds the thread asleep in
    //    FUTEX_WAIT (its spin ended during the other two calls) and pays a futex wake-up each way.
    constexpr int kRun = 50;
    std::vector<double> busy[3], idle[3];
    for (int i = 0; i < warmup + calls; i += kRun) {
      for (int j = 0; j < 3; ++j) {
        const int which = (i / kRun + j) % 3;
        for (int r = 0; r < kRun; ++r) {
          auto us = call(which);
          if (!us.ok()) return us.status();
          if (i >= warmup) busy[which].push_back(*us);
        }
      }
    }
    for (int i = 0; i < warmup + calls; ++i) {
      for (int j = 0; j < 3; ++j) {
        const int which = (i + j) % 3;
        auto us = call(which);
        if (!us.ok()) return us.status();
        if (i >= warmup) idle[which].push_back(*us);
      }
    }
    const uint64_t ring_calls = (*ring_client)->ring_calls();
    progress(absl::StrFormat("ring: %d calls of each kind in each order after %d warm-up; %llu went through the ring",
                             calls, warmup, (unsigned long long)ring_calls));
    ring_client->reset();
    grpc_client->reset();
    stop_or_warn(*daemon);
    for (const auto& [order, t] : {std::pair<const char*, std::vector<double>*>{"busy", busy}, {"idle", idle}}) {
      const std::string o(order);
      rows.push_back({"ring", "Step p50 via ring, " + o + " (1 seq, 1 layer)", percentile(t[0], 50),
                      "Ping p50 (empty gRPC)", percentile(t[2], 50), "us", false,
                      o == "busy" ? std::optional<Target>(Target{Target::Kind::kAtMost, 0.1}) : std::nullopt});
      rows.push_back({"ring", "Step p99 via ring, " + o, percentile(t[0], 99), "Ping p99 (empty gRPC)",
                      percentile(t[2], 99), "us", false, std::nullopt});
      rows.push_back({"ring", "Step p50 via ring, " + o, percentile(t[0], 50), "Step p50 via gRPC",
                      percentile(t[1], 50), "us", false, std::nullopt});
      rows.push_back({"ring", "Step p99 via ring, " + o, percentile(t[0], 99), "Step p99 via gRPC",
                      percentile(t[1], 99), "us", false, std::nullopt});
    }
  }

  // Decode throughput of the synthetic worker (SmolLM2-135M geometry, fp16), one daemon per batch
  // size, ring and gRPC runs alternating; the run pair with the median ratio is reported.
  for (const absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_ring_batches), ',')) {
    int batch = 0;
    if (!absl::SimpleAtoi(b, &batch) || batch < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--ring_batches: '", std::string(b), "' is not a batch size"));
    }
    auto daemon = start_karakvd(dir, absl::StrCat("karakvd-ring-b", batch), {"--pool_bytes=512MiB"});
    if (!daemon.ok()) return daemon.status();
    std::vector<Pair> runs;
    for (int r = 0; r < std::max(1, absl::GetFlag(FLAGS_ring_rounds)); ++r) {
      Pair p;
      for (int j = 0; j < 2; ++j) {
        const bool fast = (j == 0) == (r % 2 == 0);
        auto tps = synthetic_tokens_per_s(*daemon, batch, fast);
        if (!tps.ok()) return tps.status();
        (fast ? p.karakv : p.baseline) = *tps;
      }
      runs.push_back(p);
    }
    stop_or_warn(*daemon);
    std::sort(runs.begin(), runs.end(), [](const Pair& a, const Pair& b) { return a.ratio() < b.ratio(); });
    const Pair& median = runs[runs.size() / 2];
    progress(absl::StrFormat("ring: batch %d: %.0f tokens/s via ring, %.0f via gRPC", batch, median.karakv,
                             median.baseline));
    rows.push_back({"ring", absl::StrFormat("decode tokens/s, batch %d, via ring", batch), median.karakv,
                    "via gRPC", median.baseline, "tok/s", false,
                    batch <= 8 ? std::optional<Target>(Target{Target::Kind::kAtLeast, 1.0}) : std::nullopt});
  }
  return rows;
}

// ---------------------------------------------------------------------------------------------
// P5 and memory: decode workloads through karakvd with compression policies.

// Per-mode text (tables) printed after the summary table.
std::vector<std::string>& extra_reports() {
  static std::vector<std::string> r;
  return r;
}

// K/V/Q of one decode step for every layer and sequence, generated once and copied into each
// client's staging buffers, so every policy decodes exactly the same tokens.
struct StepTensors {
  const kn::Geometry g;
  const int seqs;
  std::vector<uint8_t> k, v;  // [L][B][Hk][D] storage dtype
  std::vector<float> q;       // [L][B][Hq][D]
  StepTensors(const kn::Geometry& geometry, int batch)
      : g(geometry),
        seqs(batch),
        k(size_t(g.num_layers) * batch * g.kv_token_elems() * kn::dtype_size(g.dtype)),
        v(k.size()),
        q(size_t(g.num_layers) * batch * g.q_token_elems()) {}
  size_t kv_layer_bytes() const { return size_t(seqs) * g.kv_token_elems() * kn::dtype_size(g.dtype); }
  size_t q_layer_elems() const { return size_t(seqs) * g.q_token_elems(); }
  // Sequence s (0-based index, also its synthetic id) gets position `pos`'s token.
  void fill(int64_t pos) {
    const size_t kv_tok = g.kv_token_elems() * kn::dtype_size(g.dtype);
    for (int l = 0; l < g.num_layers; ++l) {
      for (int s = 0; s < seqs; ++s) {
        const size_t i = size_t(l) * seqs + s;
        karakv::synthetic::fill_token(k.data() + i * kv_tok, g, 1, Tensor::kKey, s, l, pos);
        karakv::synthetic::fill_token(v.data() + i * kv_tok, g, 1, Tensor::kValue, s, l, pos);
        karakv::synthetic::fill_query(q.data() + i * g.q_token_elems(), g, 1, s, l, pos);
      }
    }
  }
};

// One client's sequences (prefilled with the same synthetic prompt per index) and its Step buffers.
struct DecodeSet {
  std::string label;
  karakv::Client* c = nullptr;
  std::vector<uint64_t> ids;
  karakv::Buffer sk, sv, q, out;
  std::vector<double> step_s;  // wall time of the Step calls of each decode step
  double decode_s = 0;

  // One decode step: Step for every layer, timing only the calls.
  absl::Status step(const StepTensors& t) {
    double el = 0;
    for (int l = 0; l < t.g.num_layers; ++l) {
      std::memcpy(sk.data(), t.k.data() + l * t.kv_layer_bytes(), t.kv_layer_bytes());
      std::memcpy(sv.data(), t.v.data() + l * t.kv_layer_bytes(), t.kv_layer_bytes());
      std::memcpy(q.data(), t.q.data() + l * t.q_layer_elems(), t.q_layer_elems() * sizeof(float));
      const auto start = Clock::now();
      auto r = c->Step(l, ids, sk, sv, q, out);
      el += seconds_since(start);
      if (!r.ok()) return absl::Status(r.status().code(), absl::StrCat(label, ": ", r.status().message()));
    }
    step_s.push_back(el);
    decode_s += el;
    return absl::OkStatus();
  }
};

// Staging for prompts of `prompt` tokens (appended in chunks of up to 256) and Steps of `batch`.
uint64_t decode_staging_bytes(const kn::Geometry& g, int prompt, int batch) {
  const int chunk = std::min(prompt, 256);
  return 2 * append_tensor_bytes(g, chunk) + 2 * size_t(batch) * g.kv_token_elems() * kn::dtype_size(g.dtype) +
         2 * size_t(batch) * g.q_token_elems() * sizeof(float) + (4 << 20);
}

// Creates one sequence per entry of `policies` in client `c`, appends the synthetic prompt of
// index i (in chunks of up to 256 tokens) and allocates the Step buffers.
absl::Status prefill(DecodeSet& set, const kn::Geometry& g, const std::vector<std::string>& policies, int prompt) {
  karakv::Client& c = *set.c;
  const int batch = int(policies.size());
  const int chunk = std::min(prompt, 256);
  auto k = c.alloc(c.append_bytes(chunk)), v = c.alloc(c.append_bytes(chunk));
  auto sk = c.alloc(c.step_kv_bytes(batch)), sv = c.alloc(c.step_kv_bytes(batch));
  auto q = c.alloc(c.q_bytes(batch)), out = c.alloc(c.q_bytes(batch));
  for (auto* b : {&k, &v, &sk, &sv, &q, &out}) {
    if (!b->ok()) return b->status();
  }
  set.sk = *sk, set.sv = *sv, set.q = *q, set.out = *out;
  for (int s = 0; s < batch; ++s) {
    karakv::SequenceOptions o;
    o.policy = policies[s];
    auto id = c.CreateSequence(o);
    if (!id.ok()) return id.status();
    set.ids.push_back(*id);
    for (int done = 0; done < prompt; done += chunk) {
      const int n = std::min(chunk, prompt - done);
      // The layout is [L][T][Hk][D], so a shorter tail is filled at its own size.
      karakv::synthetic::fill_prompt(k->data(), g, 1, Tensor::kKey, s, done, n);
      karakv::synthetic::fill_prompt(v->data(), g, 1, Tensor::kValue, s, done, n);
      if (n == chunk) {
        if (auto r = c.Append(*id, n, *k, *v); !r.ok()) return r.status();
      } else {
        karakv::Buffer hk = karakv::Client::alloc_heap(c.append_bytes(n)), hv = karakv::Client::alloc_heap(c.append_bytes(n));
        std::memcpy(hk.data(), k->data(), hk.size());
        std::memcpy(hv.data(), v->data(), hv.size());
        if (auto r = c.Append(*id, n, hk, hv); !r.ok()) return r.status();
      }
    }
  }
  return absl::OkStatus();
}

std::vector<std::string> smollm_flags(size_t pool_bytes) {
  return {"--layers=30", "--q_heads=9", "--kv_heads=3", "--head_dim=64", "--dtype=fp16", "--block_size=16",
          absl::StrCat("--pool_bytes=", pool_bytes)};
}

// Pool for `seqs` uncompressed sequences of `tokens` tokens each, plus slack for compaction.
size_t decode_pool_bytes(const kn::Geometry& g, int seqs, int tokens) {
  const size_t blocks = size_t(seqs) * ((tokens + g.block_size - 1) / g.block_size + 2) + 64;
  return blocks * g.block_bytes();
}

absl::StatusOr<karakv::PolicyStats> policy_stats(karakv::Client& c, const std::string& policy) {
  auto st = c.Stats();
  if (!st.ok()) return st.status();
  for (const karakv::PolicyStats& p : st->policies) {
    if (p.policy == policy) return p;
  }
  karakv::PolicyStats empty;
  empty.policy = policy;
  return empty;
}

// P5: Kara's compaction time as a share of decode time, and decode throughput with Kara vs none.
// Two daemons (one per policy, so each has its own decode-step counter and Kara's ticks fall every
// 16 of its own steps); their steps alternate, so both see the machine as it is at that moment.
absl::StatusOr<std::vector<Row>> run_p5(const TempDir& dir) {
  const kn::Geometry g = smollm_geometry();
  const int seqs = std::max(1, absl::GetFlag(FLAGS_p5_sequences));
  const int steps = std::max(1, absl::GetFlag(FLAGS_p5_steps));
  const int prompt = std::max(1, absl::GetFlag(FLAGS_p5_prompt));
  const size_t pool = decode_pool_bytes(g, seqs, prompt + steps);
  struct Side {
    std::string policy;
    std::optional<Daemon> daemon;
    std::unique_ptr<karakv::Client> client;
    DecodeSet set;
  };
  std::vector<Side> sides(2);
  sides[0].policy = "kara";
  sides[1].policy = "none";
  for (Side& s : sides) {
    auto d = start_karakvd(dir, "karakvd-p5-" + s.policy, smollm_flags(pool));
    if (!d.ok()) return d.status();
    s.daemon = std::move(*d);
    auto c = attach(*s.daemon, decode_staging_bytes(g, prompt, seqs), "karakv-bench-p5-" + s.policy);
    if (!c.ok()) return c.status();
    s.client = std::move(*c);
    s.set.label = s.policy;
    s.set.c = s.client.get();
    const auto t = Clock::now();
    if (absl::Status st = prefill(s.set, g, std::vector<std::string>(seqs, s.policy), prompt); !st.ok()) return st;
    progress(absl::StrFormat("P5 %s: %d sequences x %d prompt tokens appended in %.2f s (pool %.2f GB)", s.policy,
                             seqs, prompt, seconds_since(t), pool / 1e9));
  }
  StepTensors tensors(g, seqs);
  const auto start = Clock::now();
  auto last_report = start;
  for (int step = 0; step < steps; ++step) {
    tensors.fill(prompt + step);
    for (int j = 0; j < 2; ++j) {
      Side& s = sides[(j + step) % 2];  // alternate which policy goes first
      if (absl::Status st = s.set.step(tensors); !st.ok()) return st;
    }
    if (seconds_since(last_report) >= 5 || step + 1 == steps) {
      last_report = Clock::now();
      auto ks = policy_stats(*sides[0].client, "kara");
      if (!ks.ok()) return ks.status();
      const int done = step + 1;
      progress(absl::StrFormat(
          "P5 step %d/%d (%.0f s): kara %.1f s in Step (%.0f tok/s, %d resident tokens/seq, compaction %.2f s = %.1f%%), "
          "none %.1f s in Step (%.0f tok/s)",
          done, steps, seconds_since(start), sides[0].set.decode_s, double(seqs) * done / sides[0].set.decode_s,
          int(ks->resident_tokens / std::max<uint32_t>(1, ks->sequences)), ks->compaction_seconds,
          100 * ks->compaction_seconds / sides[0].set.decode_s, sides[1].set.decode_s,
          double(seqs) * done / sides[1].set.decode_s));
    }
  }
  auto ks = policy_stats(*sides[0].client, "kara");
  if (!ks.ok()) return ks.status();
  auto ns = policy_stats(*sides[1].client, "none");
  if (!ns.ok()) return ns.status();
  const double kara_s = sides[0].set.decode_s, none_s = sides[1].set.decode_s;
  const double tokens = double(seqs) * steps;
  auto ms = [](std::vector<double> v, double p) {
    for (double& x : v) x *= 1e3;
    return percentile(std::move(v), p);
  };
  const double kara_p50 = ms(sides[0].set.step_s, 50), kara_p99 = ms(sides[0].set.step_s, 99);
  const double none_p50 = ms(sides[1].set.step_s, 50), none_p99 = ms(sides[1].set.step_s, 99);
  for (Side& s : sides) {
    s.set = DecodeSet{};
    s.client.reset();
    stop_or_warn(*s.daemon);
  }
  const std::string what = absl::StrFormat(", %d seqs, prompt %d + %d steps", seqs, prompt, steps);
  std::vector<Row> rows;
  rows.push_back({"P5", "Kara compaction time / decode time" + what, ks->compaction_seconds,
                  "time in Step, kara", kara_s, "s", true, Target{Target::Kind::kAtMost, 0.05}});
  rows.push_back({"P5", "decode tokens/s, kara", tokens / kara_s, "decode tokens/s, none", tokens / none_s,
                  "tok/s", false, std::nullopt});
  rows.push_back({"P5", "resident tokens/seq at the end, kara", double(ks->resident_tokens) / seqs,
                  "resident tokens/seq, none", double(ns->resident_tokens) / seqs, "tokens", true, std::nullopt});
  rows.push_back({"P5", absl::StrFormat("Kara compactions (%llu) mean time", (unsigned long long)ks->compactions),
                  ks->compactions ? 1e3 * ks->compaction_seconds / ks->compactions : 0, "decode step p50, kara",
                  kara_p50, "ms", false, std::nullopt});
  rows.push_back({"P5", "decode step p50 (all 30 layers), kara", kara_p50,
                  "decode step p50, none", none_p50, "ms", false, std::nullopt});
  rows.push_back({"P5", "decode step p99, kara", kara_p99, "decode step p99, none",
                  none_p99, "ms", false, std::nullopt});
  return rows;
}

// memory: resident KV bytes per sequence over decode steps, per policy. One daemon, one Step batch
// holding every policy's sequences, so the daemon's decode-step counter (Kara's ticks) advances
// once per step as in a real batch.
absl::StatusOr<std::vector<Row>> run_memory(const TempDir& dir) {
  const kn::Geometry g = smollm_geometry();
  const std::vector<std::string> policies = {"none", "kara", "snapkv", "streaming"};
  const int per = std::max(1, absl::GetFlag(FLAGS_memory_sequences));
  const int steps = std::max(1, absl::GetFlag(FLAGS_memory_steps));
  const int prompt = std::max(1, absl::GetFlag(FLAGS_memory_prompt));
  const int every = std::max(1, absl::GetFlag(FLAGS_memory_sample_every));
  const int batch = per * int(policies.size());
  auto daemon = start_karakvd(dir, "karakvd-memory", smollm_flags(decode_pool_bytes(g, batch, prompt + steps)));
  if (!daemon.ok()) return daemon.status();
  auto client = attach(*daemon, decode_staging_bytes(g, prompt, batch), "karakv-bench-memory");
  if (!client.ok()) return client.status();
  std::vector<std::string> of_seq;  // policy of each sequence, in batch order
  for (const std::string& p : policies) of_seq.insert(of_seq.end(), per, p);
  DecodeSet set;
  set.label = "memory";
  set.c = client->get();
  if (absl::Status s = prefill(set, g, of_seq, prompt); !s.ok()) return s;

  // bytes of one resident token: K and V of every layer and KV head.
  const double token_bytes = double(g.num_layers) * g.kv_token_elems() * 2 * kn::dtype_size(g.dtype);
  struct Sample {
    int step;
    std::string policy;
    double resident = 0, logical = 0, blocks = 0;  // means over the policy's sequences
  };
  std::vector<Sample> samples;
  auto sample = [&](int step) -> absl::Status {
    auto list = (*client)->ListSequences();
    if (!list.ok()) return list.status();
    for (const std::string& p : policies) {
      Sample s{step, p};
      int n = 0;
      for (const karakv::SequenceInfo& info : *list) {
        if (info.policy != p) continue;
        s.resident += info.length;
        s.logical += info.logical_length;
        s.blocks += info.blocks;
        ++n;
      }
      if (n != per) {
        return absl::InternalError(absl::StrCat("ListSequences reported ", n, " ", p, " sequences, expected ", per));
      }
      s.resident /= n, s.logical /= n, s.blocks /= n;
      samples.push_back(s);
    }
    return absl::OkStatus();
  };
  if (absl::Status s = sample(0); !s.ok()) return s;
  StepTensors tensors(g, batch);
  const auto start = Clock::now();
  auto last_report = start;
  for (int step = 1; step <= steps; ++step) {
    tensors.fill(prompt + step - 1);
    if (absl::Status s = set.step(tensors); !s.ok()) return s;
    if (step % every == 0 || step == steps) {
      if (absl::Status s = sample(step); !s.ok()) return s;
    }
    if (seconds_since(last_report) >= 5 || step == steps) {
      last_report = Clock::now();
      std::string now;
      for (size_t i = samples.size() - policies.size(); i < samples.size(); ++i) {
        absl::StrAppend(&now, now.empty() ? "" : ", ", samples[i].policy, " ", int(samples[i].resident));
      }
      progress(absl::StrFormat("memory step %d/%d (%.0f s); resident tokens/seq at step %d: %s", step, steps,
                               seconds_since(start), samples.back().step, now));
    }
  }
  auto stats = (*client)->Stats();
  if (!stats.ok()) return stats.status();
  set = DecodeSet{};
  client->reset();
  stop_or_warn(*daemon);

  auto mib = [&](double tokens) { return tokens * token_bytes / double(1 << 20); };
  // The series, one line per (step, policy).
  std::string csv = "step,policy,sequences,resident_tokens,logical_tokens,blocks,kv_mib,block_mib\n";
  for (const Sample& s : samples) {
    absl::StrAppend(&csv, s.step, ",", s.policy, ",", per, ",", absl::StrFormat("%.2f", s.resident), ",",
                    absl::StrFormat("%.2f", s.logical), ",", absl::StrFormat("%.2f", s.blocks), ",",
                    absl::StrFormat("%.4f", mib(s.resident)), ",",
                    absl::StrFormat("%.4f", s.blocks * g.block_bytes() / double(1 << 20)), "\n");
  }
  if (const std::string out = absl::GetFlag(FLAGS_out_dir); !out.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(out, ec);
    std::ofstream f(out + "/memory_series.csv");
    f << csv;
    if (!f) return absl::InternalError(absl::StrCat("cannot write ", out, "/memory_series.csv"));
  }
  // The table: step rows x policy columns, MiB of resident K/V per sequence.
  const int print_every = std::max(every, absl::GetFlag(FLAGS_memory_print_every));
  std::vector<std::vector<std::string>> cells = {{"step"}};
  for (const std::string& p : policies) cells[0].push_back(p);
  for (size_t i = 0; i < samples.size(); i += policies.size()) {
    const int step = samples[i].step;
    if (step % print_every != 0 && step != steps) continue;
    std::vector<std::string> line = {absl::StrCat(step)};
    for (size_t j = 0; j < policies.size(); ++j) line.push_back(absl::StrFormat("%.1f", mib(samples[i + j].resident)));
    cells.push_back(line);
  }
  std::string table = absl::StrFormat(
      "memory: resident K/V MiB per sequence (mean of %d; resident tokens x %d layers x %d KV heads x %d dims x 2 "
      "(K, V) x %d B), SmolLM2-135M geometry, prompt %d, every %d steps%s:\n",
      per, g.num_layers, g.num_kv_heads, g.head_dim, int(kn::dtype_size(g.dtype)), prompt, print_every,
      absl::GetFlag(FLAGS_out_dir).empty() ? "" : " (every sample in memory_series.csv)");
  for (const auto& line : cells) {
    std::string out;
    for (size_t i = 0; i < line.size(); ++i) {
      const size_t w = i == 0 ? 6 : std::max<size_t>(10, cells[0][i].size() + 1);
      out += std::string(w > line[i].size() ? w - line[i].size() : 0, ' ') + line[i];
    }
    absl::StrAppend(&table, out, "\n");
  }
  extra_reports().push_back(table);

  // Summary rows: each policy at the last step and its peak, against none.
  auto last = [&](const std::string& p) {
    for (auto it = samples.rbegin(); it != samples.rend(); ++it)
      if (it->policy == p) return *it;
    return Sample{};
  };
  auto peak = [&](const std::string& p) {
    double m = 0;
    for (const Sample& s : samples)
      if (s.policy == p) m = std::max(m, s.resident);
    return m;
  };
  const Sample none_last = last("none");
  std::vector<Row> rows;
  for (const std::string& p : policies) {
    if (p == "none") continue;
    rows.push_back({"memory", absl::StrFormat("resident KV/seq after %d steps, %s", steps, p), mib(last(p).resident),
                    "none", mib(none_last.resident), "MiB", true, std::nullopt});
    rows.push_back({"memory", absl::StrFormat("peak resident KV/seq, %s", p), mib(peak(p)), "none (peak)",
                    mib(peak("none")), "MiB", true, std::nullopt});
  }
  for (const karakv::PolicyStats& p : stats->policies) {
    if (p.policy == "none") continue;
    progress(absl::StrFormat("memory: %s %llu compactions, %llu tokens removed, %.3f s compacting, %llu failures",
                             p.policy, (unsigned long long)p.compactions, (unsigned long long)p.tokens_removed,
                             p.compaction_seconds, (unsigned long long)p.failures));
  }
  return rows;
}

// ---------------------------------------------------------------------------------------------
// quant: quantized storage formats. (1) actual compression ratio through a real daemon at several
// context lengths, beside the format's nominal ratio; (2) decode attention output error against
// full precision on the same inputs; (3) decode attention time against fp16 decode_attention. (2)
// and (3) call the CPU backend in this process.

struct QuantCase {
  std::string name;    // fp16, kivi2, ..., kara+kivi4
  std::string policy;  // the CreateSequence policy string
  std::optional<kn::QuantFormat> format;
  bool decode = false;  // reached by Step (Kara) rather than by Append
};

std::vector<QuantCase> quant_cases() {
  return {{"fp16", "none", std::nullopt},
          {"kivi2", "none+kivi2", kn::QuantFormat::kKivi2},
          {"kivi4", "none+kivi4", kn::QuantFormat::kKivi4},
          {"tq2", "none+tq2", kn::QuantFormat::kTq2},
          {"tq3", "none+tq3", kn::QuantFormat::kTq3},
          {"tq4", "none+tq4", kn::QuantFormat::kTq4},
          {"kara+kivi4", "kara+kivi4", kn::QuantFormat::kKivi4, true},
          {"kara", "kara", std::nullopt, true}};  // context: Kara's eviction alone
}

struct QuantRatio {
  std::string name;
  int context = 0;  // logical tokens
  karakv::SequenceInfo info;
  double actual() const { return info.kv_bytes ? double(info.fp16_bytes) / double(info.kv_bytes) : 0; }
};

std::vector<int> parse_lengths(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) v.push_back(std::max(1, std::atoi(item.c_str())));
  }
  return v;
}

absl::StatusOr<karakv::SequenceInfo> sequence_info(karakv::Client& c, uint64_t id) {
  auto list = c.ListSequences();
  if (!list.ok()) return list.status();
  for (const karakv::SequenceInfo& info : *list) {
    if (info.id == id) return info;
  }
  return absl::NotFoundError(absl::StrCat("sequence ", id, " not in ListSequences"));
}

// Part 1: through karakvd. Append formats: one sequence per (format, length), the prompt appended
// 1024 tokens per call (the same synthetic chunk each time: the ratio does not depend on the
// values). Kara: one sequence per case, a 128-token prompt, then batched Steps up to the longest
// length, sampled on the way.
absl::StatusOr<std::vector<QuantRatio>> quant_ratios(const TempDir& dir, const kn::Geometry& g) {
  const std::vector<int> lengths = parse_lengths(absl::GetFlag(FLAGS_quant_lengths));
  const int kara_max = absl::GetFlag(FLAGS_quant_kara_max);
  const int longest = *std::max_element(lengths.begin(), lengths.end());
  constexpr int kChunk = 1024, kPrompt = 128;
  const std::vector<QuantCase> cases = quant_cases();
  int decoders = 0;
  for (const QuantCase& c : cases) decoders += c.decode;
  const size_t pool = decode_pool_bytes(g, 1, longest) + decode_pool_bytes(g, decoders, kara_max);
  auto daemon = start_karakvd(dir, "karakvd-quant", smollm_flags(pool));
  if (!daemon.ok()) return daemon.status();
  auto client = attach(*daemon, 2 * append_tensor_bytes(g, kChunk) + (8 << 20), "karakv-bench-quant");
  if (!client.ok()) return client.status();
  karakv::Client& c = **client;
  std::vector<QuantRatio> out;
  {
    auto k = c.alloc(c.append_bytes(kChunk)), v = c.alloc(c.append_bytes(kChunk));
    if (!k.ok()) return k.status();
    if (!v.ok()) return v.status();
    karakv::synthetic::fill_prompt(k->data(), g, 1, Tensor::kKey, 0, 0, kChunk);
    karakv::synthetic::fill_prompt(v->data(), g, 1, Tensor::kValue, 0, 0, kChunk);
    for (const QuantCase& qc : cases) {
      if (qc.decode) continue;
      for (int len : lengths) {
        const auto t = Clock::now();
        karakv::SequenceOptions o;
        o.policy = qc.policy;
        auto id = c.CreateSequence(o);
        if (!id.ok()) return id.status();
        for (int done = 0; done < len; done += kChunk) {
          const int n = std::min(kChunk, len - done);
          karakv::Buffer hk = *k, hv = *v;
          if (n < kChunk) {  // [L][T][Hk][D]: a shorter chunk is its own tensor
            hk = karakv::Client::alloc_heap(c.append_bytes(n));
            hv = karakv::Client::alloc_heap(c.append_bytes(n));
            karakv::synthetic::fill_prompt(hk.data(), g, 1, Tensor::kKey, 0, 0, n);
            karakv::synthetic::fill_prompt(hv.data(), g, 1, Tensor::kValue, 0, 0, n);
          }
          if (auto r = c.Append(*id, n, hk, hv); !r.ok()) return r.status();
        }
        auto info = sequence_info(c, *id);
        if (!info.ok()) return info.status();
        out.push_back({qc.name, len, *info});
        progress(absl::StrFormat("quant %s %d tokens: %u blocks (%u quantized tokens), actual %.2fx, nominal %.2fx (%.1f s)",
                                 qc.name, len, info->blocks, info->quantized_tokens, out.back().actual(),
                                 info->nominal_ratio, seconds_since(t)));
        if (auto r = c.Release(*id); !r.ok()) return r.status();
      }
    }
  }
  // Kara cases: decoded together in one Step batch.
  std::vector<std::string> policies;
  std::vector<const QuantCase*> decoded;
  for (const QuantCase& qc : cases) {
    if (qc.decode) policies.push_back(qc.policy), decoded.push_back(&qc);
  }
  std::vector<int> samples;
  for (int len : lengths) {
    if (len > kPrompt && len <= kara_max) samples.push_back(len);
  }
  if (!policies.empty() && !samples.empty()) {
    c.reset_staging();
    DecodeSet set;
    set.label = "quant";
    set.c = &c;
    if (absl::Status s = prefill(set, g, policies, kPrompt); !s.ok()) return s;
    StepTensors tensors(g, int(policies.size()));
    const int last = *std::max_element(samples.begin(), samples.end());
    const auto start = Clock::now();
    auto last_report = start;
    for (int len = kPrompt + 1; len <= last; ++len) {
      tensors.fill(len - 1);
      if (absl::Status s = set.step(tensors); !s.ok()) return s;
      if (std::find(samples.begin(), samples.end(), len) != samples.end()) {
        for (size_t i = 0; i < decoded.size(); ++i) {
          auto info = sequence_info(c, set.ids[i]);
          if (!info.ok()) return info.status();
          out.push_back({decoded[i]->name, len, *info});
          progress(absl::StrFormat("quant %s %d tokens (prompt %d + %d steps): %u resident, %u blocks (%u quantized "
                                   "tokens), actual %.2fx, nominal %.2fx",
                                   decoded[i]->name, len, kPrompt, len - kPrompt, info->length, info->blocks,
                                   info->quantized_tokens, out.back().actual(), info->nominal_ratio));
        }
      }
      if (seconds_since(last_report) >= 5) {
        last_report = Clock::now();
        progress(absl::StrFormat("quant decode %d/%d tokens (%.0f s)", len, last, seconds_since(start)));
      }
    }
    set = DecodeSet{};
  }
  client->reset();
  stop_or_warn(*daemon);
  return out;
}

// Gaussian fp16 values from a table of N(0, 1) samples, copied from rotating offsets (fast to
// fill a large pool; values iid enough for error and timing).
const std::vector<uint16_t>& gaussian_table() {
  static const std::vector<uint16_t> t = [] {
    std::vector<uint16_t> v(size_t(1) << 22);
    std::mt19937_64 rng(20261129);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (uint16_t& x : v) x = kn::float_to_half(n(rng));
    return v;
  }();
  return t;
}

struct QuantKernelResult {
  double rel_err = 0, rel_err_outlier = -1, fp16_s = 0, quant_s = 0;
  int tokens_per_block = 0, quantized_tokens = 0;
};

// Parts 2 and 3: `seqs` sequences of `tokens` Gaussian tokens in a pool of this geometry. For
// each format the first tokens - residual tokens (rounded down to whole quantized blocks) are
// quantized into blocks of their own with quantize_tokens, the rest stays in the fp16 blocks, and
// decode_attention_quantized runs against decode_attention over the fp16 copy of all tokens.
absl::StatusOr<std::map<std::string, QuantKernelResult>> quant_kernels(const kn::Geometry& g) {
  const int seqs = std::max(1, absl::GetFlag(FLAGS_quant_sequences));
  const int tokens = std::max(g.block_size, absl::GetFlag(FLAGS_quant_tokens) / g.block_size * g.block_size);
  const int reps = std::max(1, absl::GetFlag(FLAGS_quant_reps));
  constexpr int kResidual = 128;
  auto backend = kn::make_cpu_backend(0);
  const int fp_blocks = tokens / g.block_size;
  // Quantized blocks hold at least block_size tokens each, so fp_blocks per sequence suffice.
  const size_t num_blocks = size_t(seqs) * fp_blocks * 2;
  void* pool = nullptr;
  progress(absl::StrFormat("quant kernels: %d seqs x %d tokens, pool %.2f GB", seqs, tokens,
                           double(num_blocks) * g.block_bytes() / 1e9));
  if (auto s = backend->allocate(num_blocks * g.block_bytes(), &pool); !s.is_ok()) {
    return absl::ResourceExhaustedError(s.message);
  }
  std::unique_ptr<void, std::function<void(void*)>> pool_owner(pool, [&](void* p) { backend->free(p); });
  const std::vector<uint16_t>& table = gaussian_table();
  const size_t block_elems = g.block_elems();
  auto* base = static_cast<uint16_t*>(pool);
  for (size_t b = 0; b < size_t(seqs) * fp_blocks; ++b) {
    const size_t shift = (b * 7919 * 64) % (table.size() - block_elems);
    std::memcpy(base + b * block_elems, table.data() + shift, block_elems * sizeof(uint16_t));
  }
  // Full-precision view: sequence s owns blocks [s * fp_blocks, (s + 1) * fp_blocks).
  std::vector<int32_t> fp_table(size_t(seqs) * fp_blocks), fp_offsets(seqs + 1), fp_lengths(seqs, tokens);
  std::iota(fp_table.begin(), fp_table.end(), 0);
  for (int s = 0; s <= seqs; ++s) fp_offsets[s] = s * fp_blocks;
  kn::PagedKV full;
  full.pool = pool;
  full.geometry = g;
  full.block_table = fp_table.data();
  full.table_offset = fp_offsets.data();
  full.seq_len = fp_lengths.data();
  full.num_seqs = seqs;

  const size_t q_elems = size_t(seqs) * g.q_token_elems();
  std::vector<float> q(q_elems * g.num_layers), ref(q.size()), got(q.size());
  {
    std::mt19937_64 rng(7);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (float& x : q) x = n(rng);
  }
  const float scale = float(1.0 / std::sqrt(double(g.head_dim)));
  // One pass over every layer; returns seconds.
  auto pass = [&](auto&& call, std::vector<float>& out) -> absl::StatusOr<double> {
    const auto start = Clock::now();
    for (int l = 0; l < g.num_layers; ++l) {
      kn::KernelStatus st = call(l, q.data() + l * q_elems, out.data() + l * q_elems);
      if (!st.is_ok()) return absl::InternalError(st.message);
    }
    return seconds_since(start);
  };
  auto fp16_call = [&](int l, const float* ql, float* ol) { return backend->decode_attention(full, l, ql, ol, scale); };
  auto rel_error = [&]() {
    double sum = 0;
    size_t n = 0;
    for (size_t r = 0; r < q.size() / g.head_dim; ++r) {
      double num = 0, den = 0;
      for (int c = 0; c < g.head_dim; ++c) {
        const double d = double(got[r * g.head_dim + c]) - ref[r * g.head_dim + c];
        num += d * d;
        den += double(ref[r * g.head_dim + c]) * ref[r * g.head_dim + c];
      }
      if (den > 0) sum += std::sqrt(num / den), ++n;
    }
    return n ? sum / n : 0.0;
  };
  double fp16_best = 1e30;
  for (int r = 0; r <= reps; ++r) {
    auto el = pass(fp16_call, ref);
    if (!el.ok()) return el.status();
    if (r > 0) fp16_best = std::min(fp16_best, *el);
  }
  progress(absl::StrFormat("quant kernels: fp16 decode_attention, all %d layers: %.3f s (best of %d)", g.num_layers,
                           fp16_best, reps));

  // Builds the quantized copy of every sequence for `format`; fills `qkv`'s tables and the
  // fp16-tail view `tail`.
  struct Quantized {
    std::vector<int32_t> qtable, qoffsets, ttable, toffsets, tlengths;
    kn::QuantizedKV qkv;
    kn::PagedKV tail;
  };
  auto quantize = [&](kn::QuantFormat f, Quantized& z) -> absl::Status {
    const int tpb = backend->quantized_tokens_per_block(g, f);
    if (tpb <= 0) return absl::FailedPreconditionError("format cannot hold this geometry");
    const int nq = std::max(0, tokens - kResidual) / tpb * tpb;
    z.qkv.format = f;
    z.qkv.tokens_per_block = tpb;
    z.qkv.seed = 0x6b617261ull;
    z.qoffsets.assign(1, 0);
    z.toffsets.assign(1, 0);
    z.qtable.clear(), z.ttable.clear(), z.tlengths.clear();
    int32_t next = seqs * fp_blocks;  // quantized blocks after the fp16 ones
    for (int s = 0; s < seqs; ++s) {
      for (int i = 0; i < nq / tpb; ++i) z.qtable.push_back(next++);
      z.qoffsets.push_back(int32_t(z.qtable.size()));
      for (int b = nq / g.block_size; b < fp_blocks; ++b) z.ttable.push_back(s * fp_blocks + b);
      z.toffsets.push_back(int32_t(z.ttable.size()));
      z.tlengths.push_back(tokens - nq);
    }
    z.qkv.block_table = z.qtable.data();
    z.qkv.table_offset = z.qoffsets.data();
    for (int s = 0; s < seqs; ++s) {
      for (int i = 0; i < nq / tpb; ++i) {
        kn::KernelStatus st = backend->quantize_tokens(full, s, i * tpb, z.qkv, z.qtable[z.qoffsets[s] + i]);
        if (!st.is_ok()) return absl::InternalError(absl::StrCat("quantize_tokens: ", st.message));
      }
    }
    z.tail = full;
    z.tail.block_table = z.ttable.data();
    z.tail.table_offset = z.toffsets.data();
    z.tail.seq_len = z.tlengths.data();
    return absl::OkStatus();
  };

  std::map<std::string, QuantKernelResult> results;
  results["fp16"] = {0, 0, fp16_best, fp16_best, 0, 0};
  for (const QuantCase& qc : quant_cases()) {
    if (!qc.format || qc.decode) continue;
    Quantized z;
    const auto t = Clock::now();
    if (absl::Status s = quantize(*qc.format, z); !s.ok()) return s;
    const double quantize_s = seconds_since(t);
    auto call = [&](int l, const float* ql, float* ol) {
      return backend->decode_attention_quantized(z.tail, z.qkv, l, ql, ol, scale, nullptr);
    };
    QuantKernelResult r;
    r.tokens_per_block = z.qkv.tokens_per_block;
    r.quantized_tokens = z.qkv.quantized(0);
    r.fp16_s = fp16_best;
    r.quant_s = 1e30;
    for (int rep = 0; rep < reps; ++rep) {
      auto el = pass(call, got);
      if (!el.ok()) return el.status();
      r.quant_s = std::min(r.quant_s, *el);
    }
    r.rel_err = rel_error();
    results[qc.name] = r;
    progress(absl::StrFormat("quant kernels: %s (%d tokens/block, %d of %d tokens quantized, quantize %.2f s): "
                             "attention %.3f s = %.1fx fp16, mean relative L2 error %.4f",
                             qc.name, r.tokens_per_block, r.quantized_tokens, tokens, quantize_s, r.quant_s,
                             r.quant_s / fp16_best, r.rel_err));
  }

  // Heavy-tailed keys: one channel of every (layer, KV head) 10x larger, the rest unchanged.
  // Error only (one pass each), on the same queries.
  if (absl::GetFlag(FLAGS_quant_outlier)) {
    constexpr int kChannel = 7;
    for (size_t b = 0; b < size_t(seqs) * fp_blocks; ++b) {
      for (int l = 0; l < g.num_layers; ++l) {
        for (int h = 0; h < g.num_kv_heads; ++h) {
          uint16_t* run = base + full.run_offset(int32_t(b), l, 0, h);
          for (int t = 0; t < g.block_size; ++t) {
            uint16_t& x = run[size_t(t) * g.head_dim + kChannel];
            x = kn::float_to_half(10.0f * kn::half_to_float(x));
          }
        }
      }
    }
    if (auto el = pass(fp16_call, ref); !el.ok()) return el.status();
    for (const QuantCase& qc : quant_cases()) {
      if (!qc.format || qc.decode) continue;
      Quantized z;
      if (absl::Status s = quantize(*qc.format, z); !s.ok()) return s;
      auto call = [&](int l, const float* ql, float* ol) {
        return backend->decode_attention_quantized(z.tail, z.qkv, l, ql, ol, scale, nullptr);
      };
      if (auto el = pass(call, got); !el.ok()) return el.status();
      results[qc.name].rel_err_outlier = rel_error();
      progress(absl::StrFormat("quant kernels: %s with an outlier key channel: mean relative L2 error %.4f", qc.name,
                               results[qc.name].rel_err_outlier));
    }
    results["fp16"].rel_err_outlier = 0;
  }
  return results;
}

absl::StatusOr<std::vector<Row>> run_quant(const TempDir& dir) {
  const kn::Geometry g = smollm_geometry();
  auto ratios = quant_ratios(dir, g);
  if (!ratios.ok()) return ratios.status();
  auto kernels = quant_kernels(g);
  if (!kernels.ok()) return kernels.status();
  const std::vector<int> lengths = parse_lengths(absl::GetFlag(FLAGS_quant_lengths));
  auto find = [&](const std::string& name, int len) -> const QuantRatio* {
    for (const QuantRatio& r : *ratios)
      if (r.name == name && r.context == len) return &r;
    return nullptr;
  };
  auto kernel_of = [&](const QuantCase& qc) -> const QuantKernelResult* {
    // kara+kivi4 stores kivi4 blocks: the kernel numbers are kivi4's
    const std::string key = qc.name == "kara+kivi4" ? "kivi4" : qc.name;
    auto it = kernels->find(key);
    return it == kernels->end() ? nullptr : &it->second;
  };
  auto len_label = [](int len) { return len % 1024 == 0 ? absl::StrCat(len / 1024, "k") : absl::StrCat(len); };

  // Long CSV of every ratio sample (plotted) and the per-format table.
  std::string ratio_csv = "format,policy,context,nominal_ratio,actual_ratio,kv_bytes,fp16_bytes,resident_tokens,"
                          "quantized_tokens,blocks\n";
  for (const QuantRatio& r : *ratios) {
    std::string policy;
    for (const QuantCase& qc : quant_cases())
      if (qc.name == r.name) policy = qc.policy;
    absl::StrAppend(&ratio_csv, r.name, ",", policy, ",", r.context, ",", absl::StrFormat("%.4f", r.info.nominal_ratio),
                    ",", absl::StrFormat("%.4f", r.actual()), ",", r.info.kv_bytes, ",", r.info.fp16_bytes, ",",
                    r.info.length, ",", r.info.quantized_tokens, ",", r.info.blocks, "\n");
  }
  std::vector<std::vector<std::string>> cells;
  std::vector<std::string> head = {"format", "nominal"};
  for (int len : lengths) head.push_back("actual " + len_label(len));
  for (const char* h : {"tok/qblock", "rel err", "rel err outl.", "attn time/fp16"}) head.push_back(h);
  cells.push_back(head);
  std::string formats_csv = "format,policy,nominal_ratio";
  for (int len : lengths) absl::StrAppend(&formats_csv, ",actual_ratio_", len);
  absl::StrAppend(&formats_csv, ",tokens_per_qblock,rel_err,rel_err_outlier,attn_time_s,fp16_attn_time_s,attn_time_ratio\n");
  std::vector<Row> rows;
  for (const QuantCase& qc : quant_cases()) {
    double nominal = 0;
    for (const QuantRatio& r : *ratios)
      if (r.name == qc.name) nominal = r.info.nominal_ratio;
    std::vector<std::string> line = {qc.name, absl::StrFormat("%.2fx", nominal)};
    std::string csv_line = absl::StrCat(qc.name, ",", qc.policy, ",", absl::StrFormat("%.4f", nominal));
    const QuantRatio* longest = nullptr;
    for (int len : lengths) {
      const QuantRatio* r = find(qc.name, len);
      line.push_back(r ? absl::StrFormat("%.2fx", r->actual()) : "-");
      absl::StrAppend(&csv_line, ",", r ? absl::StrFormat("%.4f", r->actual()) : "");
      if (r) longest = r;
    }
    const QuantKernelResult* k = kernel_of(qc);
    const bool quantized = qc.format.has_value();
    if (k && (quantized || qc.name == "fp16")) {
      line.push_back(quantized ? absl::StrCat(k->tokens_per_block) : "16");
      line.push_back(absl::StrFormat("%.4f", k->rel_err));
      line.push_back(k->rel_err_outlier < 0 ? "-" : absl::StrFormat("%.4f", k->rel_err_outlier));
      line.push_back(absl::StrFormat("%.2fx", k->quant_s / k->fp16_s));
      absl::StrAppend(&csv_line, ",", quantized ? k->tokens_per_block : 16, ",", absl::StrFormat("%.6g", k->rel_err), ",",
                      k->rel_err_outlier < 0 ? "" : absl::StrFormat("%.6g", k->rel_err_outlier), ",",
                      absl::StrFormat("%.6g", k->quant_s), ",", absl::StrFormat("%.6g", k->fp16_s), ",",
                      absl::StrFormat("%.4f", k->quant_s / k->fp16_s), "\n");
    } else {
      for (int i = 0; i < 4; ++i) line.push_back("-");
      absl::StrAppend(&csv_line, ",,,,,,\n");
    }
    cells.push_back(line);
    formats_csv += csv_line;
    if (longest && qc.name != "fp16") {
      rows.push_back({"quant", absl::StrFormat("actual compression ratio, %s, %s tokens", qc.name,
                                               len_label(longest->context)),
                      longest->actual(), "nominal ratio", nominal, "x", true, std::nullopt});
    }
    if (k && quantized && qc.name != "kara+kivi4") {
      rows.push_back({"quant", absl::StrFormat("decode attention time, %s (CPU, scalar quantized path)", qc.name),
                      k->quant_s, "fp16 decode_attention", k->fp16_s, "s", false, std::nullopt});
    }
  }
  if (const std::string out = absl::GetFlag(FLAGS_out_dir); !out.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(out, ec);
    for (const auto& [name, text] : {std::pair<std::string, const std::string*>{"quant_ratio.csv", &ratio_csv},
                                     {"quant_formats.csv", &formats_csv}}) {
      std::ofstream f(out + "/" + name);
      f << *text;
      if (!f) return absl::InternalError(absl::StrCat("cannot write ", out, "/", name));
    }
  }
  std::string table = absl::StrFormat(
      "quant: SmolLM2-135M geometry fp16, residual 128. actual = fp16 bytes of the logical tokens / bytes of "
      "the blocks held (ListSequences); Append formats: one sequence per length, prompt appended 1024 tokens per "
      "call; kara, kara+kivi4: 128-token prompt then Step (batch of both) up to %d tokens. rel err: mean relative L2 "
      "error of decode attention outputs vs fp16 over %d seqs x %d Gaussian tokens x %d layers x %d q heads "
      "(outl.: key channel 7 x10); attn time: decode_attention_quantized / decode_attention, best of %d "
      "(kara+kivi4: kivi4's kernels):\n",
      absl::GetFlag(FLAGS_quant_kara_max), absl::GetFlag(FLAGS_quant_sequences), absl::GetFlag(FLAGS_quant_tokens),
      g.num_layers, g.num_q_heads, absl::GetFlag(FLAGS_quant_reps));
  std::vector<size_t> width(cells[0].size(), 0);
  for (const auto& line : cells)
    for (size_t i = 0; i < line.size(); ++i) width[i] = std::max(width[i], line[i].size());
  for (const auto& line : cells) {
    std::string out;
    for (size_t i = 0; i < line.size(); ++i) {
      out += i == 0 ? line[i] + std::string(width[i] - line[i].size(), ' ')
                    : std::string(width[i] - line[i].size() + 2, ' ') + line[i];
    }
    absl::StrAppend(&table, out, "\n");
  }
  extra_reports().push_back(table);
  return rows;
}

// ---------------------------------------------------------------------------------------------
// prefix: W workers serve requests that share a system prompt and differ after it, against a
// daemon with the prefix cache and one without, in one run. A request's time to first token is
// everything the worker asks of the daemon before the first generated token exists: start the
// sequence (from the cached prefix when there is one), Append the K/V of every token it had to
// prefill, Attend those tokens' queries on every layer (their prefill attention over the whole
// prompt, cached part included), then the first decode Step on every layer. The worker's own
// projections and MLP are not modelled; they scale with the prefill tokens, counted separately.

struct PrefixRequestResult {
  double ttft_s = 0;
  int prefilled = 0, cached = 0;
};

// Token ids of request `r`: the shared system prompt, then tokens of its own.
std::vector<int32_t> prefix_prompt(int system_tokens, int own_tokens, int request) {
  std::vector<int32_t> ids(system_tokens + own_tokens);
  std::iota(ids.begin(), ids.begin() + system_tokens, 1);
  std::iota(ids.begin() + system_tokens, ids.end(), 1000000 + request * own_tokens);
  return ids;
}

absl::StatusOr<PrefixRequestResult> prefix_request(karakv::Client& c, const kn::Geometry& g,
                                                   const std::vector<int32_t>& prompt) {
  const int n = int(prompt.size());
  const auto start = Clock::now();
  auto created = c.CreateFromPrefix(karakv::SequenceOptions{}, prompt);
  if (!created.ok()) return created.status();
  const int cached = created->cached_tokens, todo = n - cached;
  // K/V of token i depends on its id and position (as a model's would, given the same prefix).
  c.reset_staging();
  auto k = c.alloc(c.append_bytes(todo)), v = c.alloc(c.append_bytes(todo));
  auto q = c.alloc(c.q_bytes(todo)), out = c.alloc(c.q_bytes(todo));
  for (auto* b : {&k, &v, &q, &out}) {
    if (!b->ok()) return b->status();
  }
  const size_t tok = g.kv_token_elems() * kn::dtype_size(g.dtype);
  for (int l = 0; l < g.num_layers; ++l) {
    for (int i = 0; i < todo; ++i) {
      const int p = cached + i;
      karakv::synthetic::fill_token(k->data() + (size_t(l) * todo + i) * tok, g, 1, Tensor::kKey, prompt[p], l, p);
      karakv::synthetic::fill_token(v->data() + (size_t(l) * todo + i) * tok, g, 1, Tensor::kValue, prompt[p], l, p);
    }
  }
  auto len = c.Append(created->id, std::span<const int32_t>(prompt.data() + cached, todo), *k, *v);
  if (!len.ok()) return len.status();
  for (int l = 0; l < g.num_layers; ++l) {
    for (int i = 0; i < todo; ++i) {
      karakv::synthetic::fill_query(q->as<float>().data() + size_t(i) * g.q_token_elems(), g, 1, prompt[cached + i], l,
                                    cached + i);
    }
    if (auto s = c.Attend(created->id, l, todo, *q, *out); !s.ok()) return s;
  }
  auto sk = c.alloc(c.step_kv_bytes(1)), sv = c.alloc(c.step_kv_bytes(1));
  auto sq = c.alloc(c.q_bytes(1)), so = c.alloc(c.q_bytes(1));
  for (auto* b : {&sk, &sv, &sq, &so}) {
    if (!b->ok()) return b->status();
  }
  const uint64_t ids[] = {created->id};
  for (int l = 0; l < g.num_layers; ++l) {
    karakv::synthetic::fill_token(sk->data(), g, 1, Tensor::kKey, 7, l, n);
    karakv::synthetic::fill_token(sv->data(), g, 1, Tensor::kValue, 7, l, n);
    karakv::synthetic::fill_query(sq->as<float>().data(), g, 1, 7, l, n);
    if (auto r = c.Step(l, ids, *sk, *sv, *sq, *so); !r.ok()) return r.status();
  }
  PrefixRequestResult r;
  r.ttft_s = seconds_since(start);
  r.prefilled = todo;
  r.cached = cached;
  if (auto s = c.Release(created->id); !s.ok()) return s.status();
  return r;
}

absl::StatusOr<std::vector<Row>> run_prefix(const TempDir& dir) {
  const kn::Geometry g = smollm_geometry();
  const int system = std::max(1, absl::GetFlag(FLAGS_prefix_system_tokens));
  const int own = std::max(1, absl::GetFlag(FLAGS_prefix_own_tokens));
  const int requests = std::max(1, absl::GetFlag(FLAGS_prefix_requests));
  const std::vector<int> workers_list = parse_lengths(absl::GetFlag(FLAGS_prefix_workers));
  const int n = system + own;
  std::vector<Row> rows;
  std::string table = absl::StrFormat(
      "prefix: %d-token system prompt + %d own tokens per request, %d requests per worker (TTFT in ms)\n"
      "%8s %6s %10s %10s %10s %12s %12s %9s\n",
      system, own, requests, "workers", "cache", "TTFT p50", "TTFT mean", "TTFT p90", "prefilled", "cached", "hit rate");
  for (int workers : workers_list) {
    std::map<std::string, std::vector<double>> ttft;
    std::map<std::string, uint64_t> prefilled, cached;
    double hit_rate = 0;
    uint64_t hit_tokens = 0, lookup_tokens = 0;
    for (const std::string cache : {"on", "off"}) {
      // Every worker's live sequence, the cached prompt, and slack.
      const size_t blocks = size_t(workers + 1) * ((n + g.block_size - 1) / g.block_size + 2) + 64;
      std::vector<std::string> flags = smollm_flags(blocks * g.block_bytes());
      flags.push_back("--prefix_cache=" + cache);
      auto d = start_karakvd(dir, absl::StrCat("karakvd-prefix-", workers, "-", cache), flags);
      if (!d.ok()) return d.status();
      const uint64_t staging = 2 * append_tensor_bytes(g, n) + 2 * size_t(n) * g.q_token_elems() * 4 + (4 << 20);
      std::vector<std::unique_ptr<karakv::Client>> clients;
      for (int w = 0; w < workers; ++w) {
        auto c = attach(*d, staging, absl::StrCat("karakv-bench-prefix-", w));
        if (!c.ok()) return c.status();
        clients.push_back(std::move(*c));
      }
      // The first request of the system prompt (a cold cache); then every worker at once.
      auto first = prefix_request(*clients[0], g, prefix_prompt(system, own, 0));
      if (!first.ok()) return first.status();
      auto before = clients[0]->Stats();
      if (!before.ok()) return before.status();
      std::vector<std::vector<PrefixRequestResult>> results(workers);
      std::vector<absl::Status> errors(workers);
      std::vector<std::thread> threads;
      for (int w = 0; w < workers; ++w) {
        threads.emplace_back([&, w] {
          for (int r = 0; r < requests; ++r) {
            auto res = prefix_request(*clients[w], g, prefix_prompt(system, own, 1 + w * requests + r));
            if (!res.ok()) {
              errors[w] = res.status();
              return;
            }
            results[w].push_back(*res);
          }
        });
      }
      for (auto& t : threads) t.join();
      for (const absl::Status& e : errors) {
        if (!e.ok()) return e;
      }
      auto after = clients[0]->Stats(true);
      if (!after.ok()) return after.status();
      if (!after->invariant_error.empty()) return absl::InternalError(after->invariant_error);
      for (const auto& per : results) {
        for (const PrefixRequestResult& r : per) {
          ttft[cache].push_back(r.ttft_s * 1e3);
          prefilled[cache] += r.prefilled;
          cached[cache] += r.cached;
        }
      }
      if (cache == "on") {
        lookup_tokens = after->prefix_lookup_tokens - before->prefix_lookup_tokens;
        hit_tokens = after->prefix_hit_tokens - before->prefix_hit_tokens;
        hit_rate = lookup_tokens > 0 ? double(hit_tokens) / double(lookup_tokens) : 0;
      }
      clients.clear();
      stop_or_warn(*d);
    }
    for (const std::string cache : {"on", "off"}) {
      const std::vector<double>& t = ttft[cache];
      const double mean = std::accumulate(t.begin(), t.end(), 0.0) / double(t.size());
      absl::StrAppend(&table, absl::StrFormat("%8d %6s %10.1f %10.1f %10.1f %12llu %12llu %8.1f%%\n", workers, cache,
                                              percentile(t, 50), mean, percentile(t, 90),
                                              (unsigned long long)prefilled[cache], (unsigned long long)cached[cache],
                                              cache == "on" ? 100 * hit_rate : 0.0));
    }
    Row ttft_row;
    ttft_row.mode = "prefix";
    ttft_row.metric = absl::StrFormat("TTFT p50, %d workers", workers);
    ttft_row.karakv = percentile(ttft["on"], 50);
    ttft_row.baseline_name = "no prefix cache";
    ttft_row.baseline = percentile(ttft["off"], 50);
    ttft_row.unit = "ms";
    rows.push_back(ttft_row);
    Row avoided;
    avoided.mode = "prefix";
    avoided.metric = absl::StrFormat("prefill tokens avoided, %d workers", workers);
    avoided.karakv = double(prefilled["off"] - prefilled["on"]);
    avoided.baseline_name = "prefilled without cache";
    avoided.baseline = double(prefilled["off"]);
    avoided.unit = "tokens";
    avoided.percent = true;
    rows.push_back(avoided);
    Row hits;
    hits.mode = "prefix";
    hits.metric = absl::StrFormat("hit rate, %d workers", workers);
    hits.karakv = double(hit_tokens);
    hits.baseline_name = "looked-up tokens";
    hits.baseline = double(lookup_tokens);
    hits.unit = "tokens";
    hits.percent = true;
    rows.push_back(hits);
  }
  extra_reports().push_back(table);
  return rows;
}

// Fraction of all CPUs busy over `window` (from /proc/stat), taken while this benchmark is idle:
// what other processes are using. -1 when /proc/stat cannot be read.
double busy_fraction(absl::Duration window) {
  auto read = [](uint64_t* idle, uint64_t* total) {
    std::ifstream in("/proc/stat");
    std::string cpu;
    in >> cpu;
    uint64_t v = 0, i = 0;
    *idle = *total = 0;
    while (in >> v) {
      *total += v;
      if (i == 3 || i == 4) *idle += v;  // idle, iowait
      if (++i == 8) break;                 // user..steal; guest time is already in user
    }
    return cpu == "cpu" && i == 8;
  };
  uint64_t idle0, total0, idle1, total1;
  if (!read(&idle0, &total0)) return -1;
  absl::SleepFor(window);
  if (!read(&idle1, &total1) || total1 <= total0) return -1;
  return 1.0 - double(idle1 - idle0) / double(total1 - total0);
}

// serve: the P4 comparisons as rows (the per-run table goes to the extra reports).
std::string& serve_how() {
  static std::string how;
  return how;
}

absl::StatusOr<std::vector<Row>> run_serve_rows(const TempDir& dir) {
  auto result = run_serve(dir, absl::GetFlag(FLAGS_out_dir));
  if (!result.ok()) return result.status();
  std::vector<Row> rows;
  for (const ServeComparison& c : result->comparisons) {
    std::optional<Target> target;
    if (c.at_least > 0) target = Target{Target::Kind::kAtLeast, c.at_least};
    rows.push_back({"P4", c.metric, c.value, c.baseline_name, c.baseline, c.unit, false, target});
  }
  extra_reports().push_back(result->report);
  serve_how() = result->how;
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "karakv-bench p1|p2|p3|p5|memory|quant|prefix|ring|serve|soak|all [--karakvd=PATH] [--redis_server=PATH] [--out_dir=DIR] [--csv]\n"
      "  p1      Append throughput vs Redis SET (target >= 3x)\n"
      "  p2      decode attention bandwidth vs streaming-read bandwidth (target >= 60%)\n"
      "  p3      Step round-trip p50 vs empty gRPC Ping p50 (target <= 2x)\n"
      "  p5      Kara compaction time / decode time (target <= 5%), decode tokens/s kara vs none\n"
      "  memory  resident KV per sequence over decode steps: none, kara, snapkv, streaming\n"
      "  quant   quantized storage: actual vs nominal compression ratio, attention error and time vs fp16\n"
      "  prefix  2-8 workers sharing a 1000-token system prompt: TTFT and prefill avoided with vs without prefix cache\n"
      "  serve   continuous-batching serving sweep: output throughput vs max batch per policy (P4), TPOT,\n"
      "          TTFT, preemptions, KV held, compression by context length (not part of 'all': ~25 min;\n"
      "          --quick: ~1 min)\n"
      "  ring    decode fast path: Step round trip via the shared-memory ring vs gRPC vs Ping (target <= 0.1x\n"
      "          of Ping), synthetic-worker decode tokens/s with and without the ring\n"
      "  soak    --workers=N worker processes doing random Attach/Create/Append/Step/Compact/Fork/Release/\n"
      "          Detach and crashes for --minutes=T against one karakvd (--seed): ops/s, errors by code,\n"
      "          pool invariant, sampled Step outputs vs a float64 reference, daemon RSS growth; exits 1 on\n"
      "          anything unexpected (runs alone, not part of 'all')\n"
      "  Several modes may be given: karakv-bench p5 memory");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() == 2 && std::string(args[1]) == "serve-worker") return serve_worker_main();
  if (args.size() == 2 && std::string(args[1]) == "soak-worker") return soak_worker_main();
  if (args.size() < 2) {
    std::fprintf(stderr, "usage: karakv-bench p1|p2|p3|p5|memory|quant|prefix|ring|serve|soak|all... [flags]  (--help for the flags)\n");
    return 2;
  }
  const bool soak = std::any_of(args.begin() + 1, args.end(), [](const char* a) { return std::string(a) == "soak"; });
  if (soak && args.size() != 2) {
    std::fprintf(stderr, "karakv-bench: soak runs alone (it has its own table and exit status)\n");
    return 2;
  }
  const std::vector<std::string> known = {"p1", "p2", "p3", "p5", "memory", "quant", "prefix", "ring"};
  std::vector<std::string> modes;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string m = args[i];
    if (m == "all") {
      modes.insert(modes.end(), known.begin(), known.end());
    } else if (m == "serve" || m == "soak" || std::find(known.begin(), known.end(), m) != known.end()) {
      modes.push_back(m);
    } else {
      std::fprintf(stderr, "karakv-bench: unknown mode '%s'; expected p1, p2, p3, p5, memory, quant, prefix, ring, serve, soak or all\n", m.c_str());
      return 2;
    }
  }
  const std::string mode = absl::StrJoin(std::vector<char*>(args.begin() + 1, args.end()), " ");

  struct sigaction sa{};
  sa.sa_handler = on_fatal_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGALRM, SIGHUP}) sigaction(sig, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
  // A soak longer than --timeout_s gets its length plus five minutes to stop and report.
  const double limit = std::max<double>(1, absl::GetFlag(FLAGS_timeout_s));
  alarm(static_cast<unsigned>(soak ? std::max(limit, soak_seconds() + 300) : limit));

  auto dir = TempDir::make();
  if (!dir.ok()) {
    std::fprintf(stderr, "karakv-bench: %s\n", dir.status().ToString().c_str());
    return 1;
  }
  if (soak) return run_soak(*dir, absl::GetFlag(FLAGS_out_dir));
  std::vector<Row> all;
  std::vector<std::string> busy;  // other processes' CPU use just before each mode
  for (const std::string& m : modes) {
    const double b = busy_fraction(absl::Seconds(1));
    busy.push_back(b < 0 ? m + " ?" : absl::StrFormat("%s %.0f%%", m, 100 * b));
    const auto start = Clock::now();
    absl::StatusOr<std::vector<Row>> rows = m == "p1"     ? run_p1(*dir)
                                            : m == "p2"     ? run_p2(*dir)
                                            : m == "p3"     ? run_p3(*dir)
                                            : m == "p5"     ? run_p5(*dir)
                                            : m == "quant"  ? run_quant(*dir)
                                            : m == "prefix" ? run_prefix(*dir)
                                            : m == "serve"  ? run_serve_rows(*dir)
                                            : m == "ring"   ? run_ring(*dir)
                                                            : run_memory(*dir);
    if (!rows.ok()) {
      std::fprintf(stderr, "karakv-bench: %s failed: %s\n", m.c_str(), rows.status().ToString().c_str());
      return 1;
    }
    progress(absl::StrFormat("%s done in %.1f s", m, seconds_since(start)));
    if (const std::string out = absl::GetFlag(FLAGS_out_dir); !out.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(out, ec);
      std::ofstream f(out + "/" + m + ".csv");
      f << to_csv(*rows);
      if (!f) {
        std::fprintf(stderr, "karakv-bench: cannot write %s/%s.csv\n", out.c_str(), m.c_str());
        return 1;
      }
    }
    all.insert(all.end(), rows->begin(), rows->end());
  }

  std::vector<std::string> how;
  for (const std::string& m : modes) {
    if (m == "p1") how.push_back(absl::StrFormat("P1 median-ratio round of %d interleaved rounds of %.1f s each",
                                              absl::GetFlag(FLAGS_rounds), absl::GetFlag(FLAGS_seconds)));
    if (m == "p2") how.push_back(absl::StrFormat("P2 SmolLM2-135M geometry fp16, best of %d passes vs best of the streaming "
                                              "reads sampled just before each", absl::GetFlag(FLAGS_p2_reps)));
    if (m == "p3") how.push_back(absl::StrFormat("P3 %d interleaved calls each", absl::GetFlag(FLAGS_p3_calls)));
    if (m == "p5") how.push_back(absl::StrFormat("P5 SmolLM2-135M geometry fp16, %d seqs, prompt %d, %d decode steps; "
                                              "kara and none in two daemons, steps alternating; time in Step calls",
                                              absl::GetFlag(FLAGS_p5_sequences), absl::GetFlag(FLAGS_p5_prompt),
                                              absl::GetFlag(FLAGS_p5_steps)));
    if (m == "memory") how.push_back(absl::StrFormat("memory SmolLM2-135M geometry fp16, %d seqs per policy in one Step "
                                                  "batch, prompt %d, %d decode steps, default policy parameters",
                                                  absl::GetFlag(FLAGS_memory_sequences),
                                                  absl::GetFlag(FLAGS_memory_prompt), absl::GetFlag(FLAGS_memory_steps)));
    if (m == "ring") how.push_back(absl::StrFormat("ring %d calls of each kind in each order (busy: runs of 50, idle: "
                                                "call by call; 1 layer, 1 KV head, dim 8, fp32); "
                                                "synthetic_worker SmolLM2-135M geometry fp16, prompt 64, %d steps, "
                                                "batches %s, median of %d alternating run pairs",
                                                absl::GetFlag(FLAGS_ring_calls), absl::GetFlag(FLAGS_ring_generate),
                                                absl::GetFlag(FLAGS_ring_batches), absl::GetFlag(FLAGS_ring_rounds)));
    if (m == "quant") how.push_back(absl::StrFormat("quant SmolLM2-135M geometry fp16, residual 128; ratios through karakvd "
                                                 "at %s tokens (kara cases by Step up to %d); error and time in process, "
                                                 "CPU backend, %d seqs x %d tokens",
                                                 absl::GetFlag(FLAGS_quant_lengths), absl::GetFlag(FLAGS_quant_kara_max),
                                                 absl::GetFlag(FLAGS_quant_sequences), absl::GetFlag(FLAGS_quant_tokens)));
    if (m == "serve") how.push_back(serve_how());
  }
  for (const std::string& m : modes) {
    if (m == "prefix") how.push_back(absl::StrFormat("prefix SmolLM2-135M geometry fp16, %d-token system prompt + %d own "
                                                  "tokens, %d requests per worker after one cold request, workers %s; "
                                                  "cache on and off in two daemons", absl::GetFlag(FLAGS_prefix_system_tokens),
                                                  absl::GetFlag(FLAGS_prefix_own_tokens), absl::GetFlag(FLAGS_prefix_requests),
                                                  absl::GetFlag(FLAGS_prefix_workers)));
  }
  std::printf("\nkarakv-bench %s on %d hardware threads; CPU busy with other work in the second before each "
              "mode: %s (above a few %% the ratios are unreliable)\n%s\n\n",
              mode.c_str(), int(std::thread::hardware_concurrency()), absl::StrJoin(busy, ", ").c_str(),
              absl::StrJoin(how, "\n").c_str());
  print_table(all);
  for (const std::string& r : extra_reports()) std::printf("\n%s", r.c_str());
  if (absl::GetFlag(FLAGS_csv)) std::printf("\n%s", to_csv(all).c_str());
  const bool missed = std::any_of(all.begin(), all.end(), [](const Row& r) { return r.verdict() == "MISS"; });
  return missed && absl::GetFlag(FLAGS_strict) ? 3 : 0;
}
