// karakv-bench p3: round trip of a one-token Step (1 sequence, 1 layer, shared-memory staging, or
// device staging with --p3_staging; by gRPC, or through the fast path's ring with --p3_fast_path)
// vs an empty unary gRPC call (Ping) on the same karakvd, interleaved (target p50 <= 2x; with
// device staging on a GPU, <= 1x).
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench_common.h"
#include "common/synthetic.h"
#include "harness.h"
#include "karakv/client.h"
#include "staging_io.h"

ABSL_FLAG(int32_t, p3_calls, 2000, "P3: timed Step and Ping calls each (interleaved)");
ABSL_FLAG(int32_t, p3_warmup, 200, "P3: untimed warm-up calls each");
ABSL_FLAG(std::string, p3_staging, "shm",
          "P3: the Step's staging: shm, device (CUDA IPC) or device_fd (VMM); device staging needs "
          "--karakvd_flags=--backend=cuda");

ABSL_FLAG(int32_t, p3_write_every, 1,
          "P3: write the Step's K, V and Q into staging before every Nth call only (1: every call); with "
          "device staging the worker's copies to the GPU then stop coming between Steps, which shows "
          "what they cost the daemon's next Step (the same staged values are appended again)");
ABSL_FLAG(bool, p3_fast_path, false,
          "P3: attach with fast_path, so the Step goes through the command ring (with device staging too)");
ABSL_FLAG(bool, p3_stream_ordered, false,
          "P3: device staging ordered by CUDA events (ClientOptions::stream_ordered): the worker queues its "
          "writes on its stream and does not wait for them, karakvd replies without waiting for its kernels; "
          "adds a row for the Step until its output is on the worker's stream and read back");

namespace karakv::bench {

absl::StatusOr<std::vector<Row>> run_p3(const TempDir& dir) {
  auto staging = parse_staging("p3_staging", absl::GetFlag(FLAGS_p3_staging));
  if (!staging.ok()) return staging.status();
  const bool fast_path = absl::GetFlag(FLAGS_p3_fast_path);
  const bool ordered = absl::GetFlag(FLAGS_p3_stream_ordered);
  if (ordered && *staging == karakv::Staging::kShm) {
    return absl::InvalidArgumentError("--p3_stream_ordered orders device staging: add --p3_staging=device or device_fd");
  }
  std::vector<std::string> flags = {"--layers=1",      "--q_heads=1",        "--kv_heads=1",       "--head_dim=8",
                                    "--dtype=fp32",    "--block_size=16",    "--pool_bytes=16MiB"};
  if (ordered) flags.push_back("--stream_ordered_staging");  // only then: an older --karakvd lacks the flag
  auto daemon = start_karakvd(dir, "karakvd-p3", flags);
  if (!daemon.ok()) return daemon.status();
  std::unique_ptr<WorkerStream> stream;
  if (ordered) {
    auto s = WorkerStream::create();
    if (!s.ok()) return s.status();
    stream = std::move(*s);
  }
  auto client = attach(*daemon, 1 << 16, "karakv-bench-p3", *staging, fast_path, ordered);
  if (!client.ok()) return client.status();
  if (fast_path && !(*client)->fast_path()) {
    return absl::FailedPreconditionError("P3 --p3_fast_path: karakvd attached the session without its ring");
  }
  const bool device = (*client)->device_staging();
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

  const int write_every = absl::GetFlag(FLAGS_p3_write_every);
  if (write_every < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--p3_write_every is ", write_every, ", expected >= 1"));
  }
  const int warmup = std::max(0, absl::GetFlag(FLAGS_p3_warmup));
  const int calls = std::max(1, absl::GetFlag(FLAGS_p3_calls));
  std::vector<double> step_us, ping_us, ready_us;
  step_us.reserve(calls);
  ping_us.reserve(calls);
  for (int i = 0; i < warmup + calls; ++i) {
    if (length >= kMaxLength) {
      if (absl::Status s = fresh_sequence(); !s.ok()) return s;
    }
    // Written and (device staging) copied and synchronised before the timed call, as a worker's
    // model writes its K/V/Q before it calls Step; with --p3_write_every N only before every Nth.
    if (i % write_every == 0) {
      StagedWrite kw(*k, device), vw(*v, device), qw(*q, device);
      karakv::synthetic::fill_token(kw.where(), g, 1, Tensor::kKey, seq, 0, length);
      karakv::synthetic::fill_token(vw.where(), g, 1, Tensor::kValue, seq, 0, length);
      karakv::synthetic::fill_query(qw.as<float>(), g, 1, seq, 0, length);
      absl::Status s = ordered ? flush_writes({&kw, &vw, &qw}, c, stream->get()) : flush_writes({&kw, &vw, &qw});
      if (!s.ok()) return s;
    } else if (ordered) {
      if (absl::Status s = c.inputs_written(stream->get()); !s.ok()) return s;
    }
    double ready_t = 0;
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
        if (ordered) {
          // The worker's view: its stream waits for karakvd's kernels, then it has the output.
          if (absl::Status s = c.wait_outputs(stream->get()); !s.ok()) return s;
          if (absl::Status s = synchronize_stream(stream->get()); !s.ok()) return s;
          ready_t = seconds_since(start) * 1e6;
        }
      } else {
        absl::Status s = c.Ping();
        ping_t = seconds_since(start) * 1e6;
        if (!s.ok()) return s;
      }
    }
    if (i >= warmup) {
      step_us.push_back(step_t);
      ping_us.push_back(ping_t);
      if (ordered) ready_us.push_back(ready_t);
    }
  }
  progress(absl::StrFormat("P3 %d Step + %d Ping calls after %d warm-up", calls, calls, warmup));
  if (fast_path && c.ring_calls() < uint64_t(warmup + calls)) {
    return absl::InternalError(absl::StrCat("P3 --p3_fast_path: only ", c.ring_calls(), " of ", warmup + calls,
                                            " Steps went through the ring"));
  }
  if (auto r = c.Release(seq); !r.ok()) return r.status();
  client->reset();
  stop_or_warn(*daemon);

  std::vector<Row> rows;
  rows.push_back({"P3",
                  absl::StrFormat("Step round trip p50 (1 seq, 1 layer, %s staging%s%s%s)", staging_name(*staging),
                                  fast_path ? ", fast path" : "", ordered ? ", stream-ordered" : "",
                                  write_every >= warmup + calls ? ", staging written once"
                                  : write_every > 1 ? absl::StrFormat(", written every %d calls", write_every)
                                                    : ""),
                  percentile(step_us, 50), "Ping p50 (empty gRPC)",
                  percentile(ping_us, 50), "us", false, Target{Target::Kind::kAtMost, device ? 1.0 : 2.0}});
  rows.push_back({"P3", "Step round trip p99", percentile(step_us, 99), "Ping p99 (empty gRPC)",
                  percentile(ping_us, 99), "us", false, std::nullopt});
  if (ordered) {
    // Comparable with a synchronous Step's round trip: the output is complete and the worker's host knows it.
    rows.push_back({"P3", "Step until its output is ready on the worker's stream p50", percentile(ready_us, 50),
                    "Ping p50 (empty gRPC)", percentile(ping_us, 50), "us", false, std::nullopt});
  }
  return rows;
}

std::string p3_how() { return absl::StrFormat("P3 %d interleaved calls each", absl::GetFlag(FLAGS_p3_calls)); }

}  // namespace karakv::bench
