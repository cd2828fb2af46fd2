// karakv-bench ring: the decode fast path. Round trip of a one-token Step through the shared-memory
// ring vs the same Step through gRPC vs Ping; synthetic_worker decode tokens/s with and without it.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "bench_common.h"
#include "common/synthetic.h"
#include "harness.h"
#include "google/protobuf/util/json_util.h"
#include "karakv/client.h"
#include "karakv/tools/v1/output.pb.h"

ABSL_FLAG(int32_t, ring_calls, 2000, "ring: timed calls each of ring Step, gRPC Step and Ping (interleaved)");
ABSL_FLAG(std::string, ring_batches, "1,8,64", "ring: decode batch sizes of the synthetic worker (empty: none)");
ABSL_FLAG(int32_t, ring_rounds, 3, "ring: synthetic-worker runs per path and batch (alternating; median reported)");
ABSL_FLAG(int32_t, ring_generate, 64, "ring: decode steps per synthetic-worker run");
ABSL_FLAG(std::string, ring_spins_us, "",
          "ring: latency for each DAEMON:CLIENT pair of spin times in microseconds (karakvd --ring_spin_us, "
          "ClientOptions::ring_spin), comma-separated, e.g. 0:0,50:50,200:200; empty: the defaults only");
ABSL_FLAG(double, ring_idle_s, 5, "ring: seconds the daemon's CPU time is measured with a fast-path session idle");
ABSL_FLAG(std::string, synthetic_worker, "",
          "synthetic_worker binary (default: ../examples/synthetic_worker next to this binary)");
ABSL_DECLARE_FLAG(int32_t, p3_warmup);  // p3_step.cc: the ring's warm-up calls too

namespace karakv::bench {
namespace {

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
  if (status != 0) return absl::InternalError(absl::StrCat(cmd, " failed (status ", status, "): ", out));
  // The summary message synthetic_worker printed, read back by protobuf's JSON parser.
  karakv::tools::v1::SyntheticWorkerSummary summary;
  if (auto s = google::protobuf::util::JsonStringToMessage(out, &summary); !s.ok()) {
    return absl::InternalError(absl::StrCat(cmd, " printed no SyntheticWorkerSummary JSON (", s.ToString(), "): ", out));
  }
  return summary.decode_tokens_per_s();
}


// Step round trip through the ring, through gRPC and Ping, busy and idle orders, with the daemon's
// ring thread spinning `daemon_spin_us` and the client `client_spin_us` before they sleep. With
// `defaults`, the rows carry the target; otherwise the rows name the spins.
absl::Status ring_latency(const TempDir& dir, int daemon_spin_us, int client_spin_us, bool defaults,
                          std::vector<Row>* rows) {
  {
    std::vector<std::string> flags = {"--layers=1", "--q_heads=1", "--kv_heads=1", "--head_dim=8", "--dtype=fp32",
                                      "--block_size=16", "--pool_bytes=16MiB"};
    if (daemon_spin_us >= 0) flags.push_back(absl::StrCat("--ring_spin_us=", daemon_spin_us));
    auto daemon = start_karakvd(dir, absl::StrCat("karakvd-ring-", daemon_spin_us, "-", client_spin_us), flags);
    if (!daemon.ok()) return daemon.status();
    karakv::ClientOptions o;
    o.target = daemon->target;
    o.staging_bytes = 1 << 16;
    o.worker_id = "karakv-bench-ring";
    o.fast_path = true;
    if (client_spin_us >= 0) o.ring_spin = absl::Microseconds(client_spin_us);
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
    const uint64_t sleeps = (*ring_client)->ring_sleeps();
    progress(absl::StrFormat("ring: spins daemon %d us / client %d us: %d calls of each kind in each order after %d "
                             "warm-up; %llu went through the ring, the client slept in FUTEX_WAIT %llu times",
                             daemon_spin_us, client_spin_us, calls, warmup, (unsigned long long)ring_calls,
                             (unsigned long long)sleeps));
    // The daemon's CPU with the fast-path session attached and idle: its ring thread's spin ends
    // and it sleeps in FUTEX_WAIT slices (--ring_poll_ms is not a flag; 20 ms).
    const double idle_s = absl::GetFlag(FLAGS_ring_idle_s);
    if (idle_s > 0) {
      const double before = cpu_seconds(daemon->process->pid());
      const auto t0 = Clock::now();
      sleep_ms(int(idle_s * 1000));
      const double after = cpu_seconds(daemon->process->pid());
      const double wall = seconds_since(t0);
      if (before >= 0 && after >= 0) {
        progress(absl::StrFormat("ring: daemon CPU while the session idles: %.3f s over %.1f s (%.2f%% of one core)",
                                 after - before, wall, 100 * (after - before) / wall));
        rows->push_back({"ring", defaults ? std::string("daemon CPU, fast-path session idle, default spin")
                                  : absl::StrFormat("daemon CPU, fast-path session idle, spin %d us", daemon_spin_us),
                         100 * (after - before) / wall, "one core", 100, "%", false, std::nullopt});
      }
    }
    ring_client->reset();
    grpc_client->reset();
    stop_or_warn(*daemon);
    const std::string spins =
        defaults ? std::string() : absl::StrFormat(", spin %d/%d us", daemon_spin_us, client_spin_us);
    for (const auto& [order, t] : {std::pair<const char*, std::vector<double>*>{"busy", busy}, {"idle", idle}}) {
      const std::string o = std::string(order) + spins;
      rows->push_back({"ring", "Step p50 via ring, " + o + " (1 seq, 1 layer)", percentile(t[0], 50),
                      "Ping p50 (empty gRPC)", percentile(t[2], 50), "us", false,
                      defaults && std::string(order) == "busy" ? std::optional<Target>(Target{Target::Kind::kAtMost, 0.1}) : std::nullopt});
      rows->push_back({"ring", "Step p99 via ring, " + o, percentile(t[0], 99), "Ping p99 (empty gRPC)",
                      percentile(t[2], 99), "us", false, std::nullopt});
      rows->push_back({"ring", "Step p50 via ring, " + o, percentile(t[0], 50), "Step p50 via gRPC",
                      percentile(t[1], 50), "us", false, std::nullopt});
      rows->push_back({"ring", "Step p99 via ring, " + o, percentile(t[0], 99), "Step p99 via gRPC",
                      percentile(t[1], 99), "us", false, std::nullopt});
    }
  }

  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<Row>> run_ring(const TempDir& dir) {
  std::vector<Row> rows;
  for (const absl::string_view pair : absl::StrSplit(absl::GetFlag(FLAGS_ring_spins_us), ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> dc = absl::StrSplit(pair, ':');
    int d = 0, c = 0;
    if (!absl::SimpleAtoi(dc.first, &d) || !absl::SimpleAtoi(dc.second, &c) || d < 0 || c < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--ring_spins_us: '", std::string(pair),
                                                     "' is not DAEMON_US:CLIENT_US"));
    }
    if (absl::Status s = ring_latency(dir, d, c, false, &rows); !s.ok()) return s;
  }
  if (absl::Status s = ring_latency(dir, -1, -1, true, &rows); !s.ok()) return s;

  // Decode throughput of the synthetic worker (SmolLM2-135M geometry, fp16), one daemon per batch
  // size, ring and gRPC runs alternating; the run pair with the median ratio is reported.
  for (const absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_ring_batches), ',', absl::SkipEmpty())) {
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

std::string ring_how() {
  return absl::StrFormat("ring %d calls of each kind in each order (busy: runs of 50, idle: "
                         "call by call; 1 layer, 1 KV head, dim 8, fp32); "
                         "synthetic_worker SmolLM2-135M geometry fp16, prompt 64, %d steps, "
                         "batches %s, median of %d alternating run pairs",
                         absl::GetFlag(FLAGS_ring_calls), absl::GetFlag(FLAGS_ring_generate),
                         absl::GetFlag(FLAGS_ring_batches), absl::GetFlag(FLAGS_ring_rounds));
}

}  // namespace karakv::bench
