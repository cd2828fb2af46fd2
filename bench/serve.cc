// karakv-bench serve: a continuous-batching engine in the style of vLLM / nano-vLLM, run against a
// real karakvd. One scheduler (this process) owns the request queue and decides admission and
// preemption from the daemon's Stats; worker processes (this binary, role serve-worker) each own a
// share of the running sequences and drive them through the SDK: a prefill Append per admitted
// request, then every engine step a Step per layer over their sequences. The model's own compute
// is a modeled cost (a sleep of base + per_seq * batch microseconds per step, split over layers),
// so the daemon's share of a step is what is measured.
//
// Requests come either closed loop (the default: the queue is never empty, so the engine always has
// work and TTFT is admission to first token) or open loop (--serve_rates): Poisson arrivals at a
// given rate, seeded, and TTFT from arrival to first token, queueing included, as an online
// serving benchmark measures it.
//
// Preemption is vLLM's recompute: when a Step or Append is refused with RESOURCE_EXHAUSTED the
// most recently admitted sequence is released and its request goes back to the front of the
// queue; when readmitted, its prompt and the tokens it already generated are prefilled again.
#include "serve.h"

#include <sys/socket.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <thread>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/synthetic.h"
#include "karakv/kernels/half.h"
#include "gpu_forward.h"
#include "staging_io.h"

ABSL_FLAG(bool, quick, false,
          "serve: a small sweep (every policy at max batch 8 and 32, 150 steps or 4 s each, short outputs, 8 MiB pool) "
          "that finishes in about a minute; for smoke tests");
ABSL_FLAG(std::string, serve_policies, "none,snapkv,kara,streaming,kara+kivi4",
          "serve: policies swept, comma separated (policy names as CreateSequence takes them)");
ABSL_FLAG(std::string, serve_kara_params, "",
          "serve: Kara's parameters over its defaults for every kara sequence (kara+kivi4 too), name=value,... "
          "(e.g. budget=512, or budget=0 for contract version 2's unbounded windows)");
ABSL_FLAG(std::string, serve_batches, "8,16,32,64,128,256", "serve: max decode batch sizes swept");
ABSL_FLAG(int32_t, serve_steps, 1600,
          "serve: engine decode steps per (policy, max batch) run; every run covers the same steps, so contexts "
          "reach the same lengths whatever the batch");
ABSL_FLAG(double, serve_seconds, 150, "serve: a run also ends after this many seconds (a safety cap)");
ABSL_FLAG(std::string, serve_prompt, "100-500", "serve: prompt tokens per request, uniform MIN-MAX");
ABSL_FLAG(std::string, serve_output, "1000-8000", "serve: output tokens per request, uniform MIN-MAX");
ABSL_FLAG(std::string, serve_pool_bytes, "96MiB", "serve: karakvd --pool_bytes (the same for every run)");
ABSL_FLAG(int32_t, serve_layers, 4, "serve: model layers (one Step per layer per decode step)");
ABSL_FLAG(int32_t, serve_q_heads, 4, "serve: query heads");
ABSL_FLAG(int32_t, serve_kv_heads, 2, "serve: KV heads (block 16)");
ABSL_FLAG(int32_t, serve_head_dim, 64, "serve: head_dim");
ABSL_FLAG(std::string, serve_dtype, "fp16", "serve: the pool's dtype: fp16, bf16 or fp32");
ABSL_FLAG(std::string, serve_worker_compute, "sleep",
          "serve: the workers' own model work: sleep (its time modeled by --serve_model_*_us and "
          "--serve_prefill_us_per_token) or gemm (the projections' and MLP's matrix products of every layer "
          "on the GPU with cuBLAS, around each Step; needs --serve_staging=device or device_fd)");
ABSL_FLAG(int32_t, serve_mlp, 0, "serve: with gemm, the MLP's intermediate width (0: 3.5 x hidden, e.g. 14336)");
ABSL_FLAG(std::string, serve_cublas, "libcublas.so.13:libcublas.so.12:libcublas.so",
          "serve: with gemm, cuBLAS libraries tried in order (names on the loader's path, or paths)");
ABSL_FLAG(double, serve_model_base_us, 3000, "serve: modeled model compute per decode step, fixed part (us)");
ABSL_FLAG(double, serve_model_per_seq_us, 30, "serve: modeled model compute per decode step per running sequence (us)");
ABSL_FLAG(double, serve_prefill_us_per_token, 10, "serve: modeled model compute per prefilled token (us)");
ABSL_FLAG(int32_t, serve_workers, 4, "serve: worker processes (each owns a share of the running sequences)");
ABSL_FLAG(int32_t, serve_sample_every, 50,
          "serve: engine steps between the workers' ListSequences samples (compression ratio by context)");
ABSL_FLAG(std::string, serve_rates, "",
          "serve: open loop: request arrival rates swept (requests per second, Poisson arrivals from --serve_seed; "
          "comma list); TTFT then counts from arrival, queueing included. Empty: closed loop (the queue never "
          "empties)");
ABSL_FLAG(uint64_t, serve_seed, 1, "serve: seed of the request lengths (every run sees the same requests)");
// The worker role's own settings, passed by the scheduler on its command line.
ABSL_FLAG(std::string, serve_staging, "shm",
          "serve: the workers' staging: shm, device (CUDA IPC; karakvd --backend=cuda) or device_fd (VMM over the "
          "staging fd socket)");
ABSL_FLAG(bool, serve_stream_ordered, false,
          "serve: device staging ordered by CUDA events (ClientOptions::stream_ordered): a worker queues its "
          "writes (and with --serve_worker_compute=gemm its products) on one stream and waits on the host only "
          "once per decode step, karakvd replies without waiting for its kernels; needs --serve_staging=device "
          "or device_fd");
ABSL_FLAG(bool, serve_recompute_windows, false,
          "serve: re-prefill a preempted Kara request with Kara's prompt=window, so that its windows "
          "compress the recomputed tokens (by default they count as prompt, which Kara keeps whole)");
ABSL_FLAG(std::string, serve_worker_target, "", "serve-worker (internal): karakvd address");
ABSL_FLAG(std::string, serve_worker_policy, "", "serve-worker (internal): policy of every sequence");
ABSL_FLAG(int32_t, serve_worker_max_batch, 0, "serve-worker (internal): most sequences it may hold");

namespace karakv::bench {
namespace {

namespace kn = karakv::kernels;

// Prompt tokens a worker appends (and, with --serve_worker_compute=gemm, runs through its forward
// pass) at a time.
constexpr int kPrefillChunk = 256;

// Context-length buckets of the compression ratio (logical tokens).
constexpr int kBuckets = 4;
const char* const kBucketNames[kBuckets] = {"<1k", "1-4k", "4-16k", ">=16k"};
int bucket_of(uint64_t logical) { return logical < 1024 ? 0 : logical < 4096 ? 1 : logical < 16384 ? 2 : 3; }

struct Range {
  int lo = 0, hi = 0;
};

absl::StatusOr<Range> parse_range(const std::string& flag, const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, '-');
  Range r;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &r.lo) || !absl::SimpleAtoi(parts[1], &r.hi) || r.lo < 2 ||
      r.hi < r.lo) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", text, ": expected MIN-MAX with 2 <= MIN <= MAX"));
  }
  return r;
}

// "64MiB", "1GiB", "500000": the same spelling as karakvd --pool_bytes.
absl::StatusOr<size_t> parse_bytes_flag(const std::string& text) {
  std::string digits = text;
  size_t mult = 1;
  for (auto [suffix, m] : {std::pair<const char*, size_t>{"KiB", 1ull << 10}, {"MiB", 1ull << 20}, {"GiB", 1ull << 30}}) {
    if (absl::EndsWith(digits, suffix)) {
      digits.resize(digits.size() - 3);
      mult = m;
      break;
    }
  }
  uint64_t v = 0;
  if (!absl::SimpleAtoi(digits, &v) || v == 0) {
    return absl::InvalidArgumentError(absl::StrCat("--serve_pool_bytes=", text, ": expected a size such as 64MiB"));
  }
  return size_t(v) * mult;
}

void sleep_us(double us) {
  if (us <= 0) return;
  const auto ns = static_cast<int64_t>(us * 1e3);
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  nanosleep(&ts, nullptr);
}

double model_step_us(int batch) {
  return absl::GetFlag(FLAGS_serve_model_base_us) + absl::GetFlag(FLAGS_serve_model_per_seq_us) * batch;
}

// ---------------------------------------------------------------------------------------------
// Messages between the scheduler and a worker: one SOCK_SEQPACKET datagram each, text lines.
//
//   scheduler -> worker                         worker -> scheduler
//   release <req>          (preempted)          prefill <req> ok|full <seconds>
//   admit <req> <context> <remaining> <windowed> step ok|full|idle <seconds in Step calls>
//   step <total batch> <do_step> <sample>       done <req>          (finished and released)
//   quit                                        bucket <b> <seqs> <fp16 bytes> <kv bytes>
//                                               error <message>

constexpr size_t kMaxMessage = 1 << 20;

absl::Status send_message(int fd, const std::string& text) {
  if (text.size() > kMaxMessage) return absl::InternalError("serve: message too long");
  if (send(fd, text.data(), text.size(), MSG_NOSIGNAL) != ssize_t(text.size())) {
    return absl::UnavailableError(absl::StrCat("serve: send: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> receive_message(int fd) {
  std::string buf(kMaxMessage, '\0');
  while (true) {
    const ssize_t n = recv(fd, buf.data(), buf.size(), 0);
    if (n > 0) {
      buf.resize(n);
      return buf;
    }
    if (n < 0 && errno == EINTR) continue;
    return absl::UnavailableError(n == 0 ? "serve: the peer closed the connection"
                                         : absl::StrCat("serve: recv: ", std::strerror(errno)));
  }
}

// ---------------------------------------------------------------------------------------------
// The worker.

// Precomputed synthetic tokens: a token's K, V and Q are table rows chosen by a hash of (request,
// layer, position), so a preempted request's recompute appends exactly the K/V it had, and filling
// a batch costs a memcpy per token instead of generating every value.
class TokenTable {
 public:
  static constexpr int kRows = 509;
  explicit TokenTable(const kn::Geometry& g)
      : g_(g),
        kv_bytes_(g.kv_token_elems() * kn::dtype_size(g.dtype)),
        k_(kRows * kv_bytes_),
        v_(kRows * kv_bytes_),
        q_(size_t(kRows) * g.q_token_elems()) {
    for (int r = 0; r < kRows; ++r) {
      synthetic::fill_token(k_.data() + r * kv_bytes_, g, 7, synthetic::Tensor::kKey, r, 0, r);
      synthetic::fill_token(v_.data() + r * kv_bytes_, g, 7, synthetic::Tensor::kValue, r, 0, r);
      synthetic::fill_query(q_.data() + size_t(r) * g.q_token_elems(), g, 7, r, 0, r);
    }
  }
  size_t kv_bytes() const { return kv_bytes_; }
  const uint8_t* k(uint64_t req, int layer, int64_t pos) const { return k_.data() + row(req, layer, pos) * kv_bytes_; }
  const uint8_t* v(uint64_t req, int layer, int64_t pos) const {
    return v_.data() + row(req, layer, pos + 1) * kv_bytes_;
  }
  const float* q(uint64_t req, int layer, int64_t pos) const {
    return q_.data() + row(req, layer, pos + 2) * g_.q_token_elems();
  }

 private:
  static size_t row(uint64_t req, int layer, int64_t pos) {
    uint64_t x = req * 0x9e3779b97f4a7c15ull ^ (uint64_t(layer) << 48) ^ uint64_t(pos);
    x = (x ^ (x >> 31)) * 0xbf58476d1ce4e5b9ull;
    return (x ^ (x >> 29)) % kRows;
  }
  kn::Geometry g_;
  size_t kv_bytes_;
  std::vector<uint8_t> k_, v_;
  std::vector<float> q_;
};

struct WorkerSequence {
  uint64_t request = 0, id = 0;
  int64_t position = 0;  // tokens in the sequence (the next token's position)
  int remaining = 0;     // output tokens still to generate
};

class Worker {
 public:
  // forward: the model's matrix products on the GPU (--serve_worker_compute=gemm), or null (sleep).
  // own_stream: a stream-ordered worker's stream when it has no forward pass (whose stream it uses).
  Worker(std::unique_ptr<karakv::Client> client, std::string policy, std::map<std::string, double> kara_params,
         std::unique_ptr<GpuForward> forward, std::unique_ptr<WorkerStream> own_stream)
      : c_(std::move(client)), g_(c_->geometry()), table_(g_), policy_(std::move(policy)),
        kara_params_(std::move(kara_params)), device_(c_->device_staging()), forward_(std::move(forward)),
        own_stream_(std::move(own_stream)) {
    if (c_->stream_ordered()) {
      stream_ = forward_ ? forward_->stream() : own_stream_->get();
      if (forward_) forward_->set_queued(true);
    }
  }

  // Executes one command message; returns the reply.
  std::string execute(const std::string& message, bool* quit) {
    std::string reply;
    int total_batch = 0;
    bool do_step = false, sample = false;
    for (absl::string_view line : absl::StrSplit(message, '\n', absl::SkipEmpty())) {
      std::vector<std::string> f = absl::StrSplit(line, ' ');
      if (f[0] == "quit") {
        *quit = true;
      } else if (f[0] == "release" && f.size() == 2) {
        uint64_t req = 0;
        (void)absl::SimpleAtoi(f[1], &req);
        if (absl::Status s = release(req); !s.ok()) absl::StrAppend(&reply, "error ", s.message(), "\n");
      } else if (f[0] == "admit" && f.size() == 5) {
        uint64_t req = 0;
        int context = 0, remaining = 0;
        (void)absl::SimpleAtoi(f[1], &req);
        (void)absl::SimpleAtoi(f[2], &context);
        (void)absl::SimpleAtoi(f[3], &remaining);
        const auto start = Clock::now();
        absl::Status s = admit(req, context, remaining, f[4] == "1");
        if (s.ok() || absl::IsResourceExhausted(s)) {
          absl::StrAppend(&reply, "prefill ", req, s.ok() ? " ok " : " full ",
                          absl::StrFormat("%.6f", seconds_since(start)), "\n");
        } else {
          absl::StrAppend(&reply, "error admitting request ", req, ": ", s.message(), "\n");
        }
      } else if (f[0] == "step" && f.size() == 4) {
        (void)absl::SimpleAtoi(f[1], &total_batch);
        do_step = f[2] == "1";
        sample = f[3] == "1";
      }
    }
    if (do_step) absl::StrAppend(&reply, step(total_batch));
    if (sample) absl::StrAppend(&reply, buckets());
    if (reply.empty()) reply = "idle\n";
    return reply;
  }

  // Releases everything left (the end of a run).
  void release_all() {
    for (const WorkerSequence& s : seqs_) (void)c_->Release(s.id);
    seqs_.clear();
  }

 private:
  absl::Status release(uint64_t req) {
    auto it = std::find_if(seqs_.begin(), seqs_.end(), [&](const WorkerSequence& s) { return s.request == req; });
    if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("release of request ", req, ", which this worker does not hold"));
    auto r = c_->Release(it->id);
    seqs_.erase(it);
    return r.ok() ? absl::OkStatus() : r.status();
  }

  // Prefill: the model's compute for `context` tokens (modeled), then their K/V appended in chunks.
  // `windowed`: a Kara sequence's appended tokens are windowed like its decoded ones (prompt=window).
  absl::Status admit(uint64_t req, int context, int remaining, bool windowed) {
    karakv::SequenceOptions o;
    o.policy = policy_;
    if (absl::StartsWith(policy_, "kara")) o.params = kara_params_;
    if (windowed && absl::StartsWith(policy_, "kara")) o.params["prompt"] = 1;
    auto id = c_->CreateSequence(o);
    if (!id.ok()) return id.status();
    if (!forward_) sleep_us(absl::GetFlag(FLAGS_serve_prefill_us_per_token) * context);
    for (int done = 0; done < context; done += kPrefillChunk) {
      const int n = std::min(kPrefillChunk, context - done);
      for (int l = 0; forward_ && l < g_.num_layers; ++l) {  // the chunk's forward pass, every layer
        absl::Status st = forward_->before_attention(n);
        if (st.ok()) st = forward_->after_attention(n);
        if (!st.ok()) {
          (void)c_->Release(*id);
          return st;
        }
      }
      c_->reset_staging();
      auto k = c_->alloc(c_->append_bytes(n));
      auto v = c_->alloc(c_->append_bytes(n));
      if (!k.ok() || !v.ok()) {
        (void)c_->Release(*id);
        return k.ok() ? v.status() : k.status();
      }
      const size_t kv = table_.kv_bytes();
      StagedWrite kw(*k, device_), vw(*v, device_);
      for (int l = 0; l < g_.num_layers; ++l) {
        for (int t = 0; t < n; ++t) {
          const size_t at = (size_t(l) * n + t) * kv;
          std::memcpy(kw.where() + at, table_.k(req, l, done + t), kv);
          std::memcpy(vw.where() + at, table_.v(req, l, done + t), kv);
        }
      }
      if (absl::Status st = write({&kw, &vw}); !st.ok()) {
        (void)c_->Release(*id);
        return st;
      }
      auto r = c_->Append(*id, n, *k, *v);
      if (absl::Status st = after_request(); !st.ok()) {
        (void)c_->Release(*id);
        return st;
      }
      if (!r.ok()) {
        (void)c_->Release(*id);  // a refused Append leaves no trace; the sequence itself goes too
        return r.status();
      }
    }
    // A stream-ordered worker's prefill ends, as a model's does, in a host wait for its first token,
    // so its GPU work counts in the prefill, not in the next decode step.
    if (stream_ != nullptr) {
      if (absl::Status st = synchronize_stream(stream_); !st.ok()) {
        (void)c_->Release(*id);
        return st;
      }
    }
    seqs_.push_back({req, *id, context, remaining});
    return absl::OkStatus();
  }

  // One decode step: per layer, the model's compute (modeled) then Step over this worker's batch.
  std::string step(int total_batch) {
    if (seqs_.empty()) return "step idle 0\n";
    const int n = int(seqs_.size());
    std::vector<uint64_t> ids;
    for (const WorkerSequence& s : seqs_) ids.push_back(s.id);
    c_->reset_staging();
    auto k = c_->alloc(c_->step_kv_bytes(n)), v = c_->alloc(c_->step_kv_bytes(n));
    auto q = c_->alloc(c_->q_bytes(n)), out = c_->alloc(c_->q_bytes(n));
    for (auto* b : {&k, &v, &q, &out}) {
      if (!b->ok()) return absl::StrCat("error staging: ", b->status().message(), "\n");
    }
    const double layer_us = model_step_us(total_batch) / g_.num_layers;
    const size_t kv = table_.kv_bytes(), qe = g_.q_token_elems();
    double in_step = 0;
    StagedWrite kw(*k, device_), vw(*v, device_), qw(*q, device_);
    for (int l = 0; l < g_.num_layers; ++l) {
      if (!forward_) {
        sleep_us(layer_us);
      } else if (absl::Status st = forward_->before_attention(n); !st.ok()) {
        return absl::StrCat("error in layer ", l, "'s forward pass: ", st.message(), "\n");
      }
      for (int i = 0; i < n; ++i) {
        const WorkerSequence& s = seqs_[i];
        std::memcpy(kw.where() + i * kv, table_.k(s.request, l, s.position), kv);
        std::memcpy(vw.where() + i * kv, table_.v(s.request, l, s.position), kv);
        std::memcpy(qw.as<float>() + i * qe, table_.q(s.request, l, s.position), qe * sizeof(float));
      }
      if (absl::Status st = write({&kw, &vw, &qw}); !st.ok())
        return absl::StrCat("error staging layer ", l, ": ", st.message(), "\n");
      const auto start = Clock::now();
      auto r = c_->Step(l, ids, *k, *v, *q, *out);
      in_step += seconds_since(start);
      if (absl::Status st = after_request(); !st.ok()) return absl::StrCat("error ordering layer ", l, ": ", st.message(), "\n");
      if (!r.ok()) {
        // The pool check runs at layer 0, before anything changes: the step can be retried.
        if (l == 0 && absl::IsResourceExhausted(r.status())) return "step full 0\n";
        return absl::StrCat("error Step layer ", l, ": ", r.status().message(), "\n");
      }
      if (forward_) {
        if (absl::Status st = forward_->after_attention(n); !st.ok())
          return absl::StrCat("error in layer ", l, "'s forward pass: ", st.message(), "\n");
      }
    }
    // A stream-ordered worker's one host wait per step: the model's output (its next token).
    if (stream_ != nullptr) {
      if (absl::Status st = synchronize_stream(stream_); !st.ok()) return absl::StrCat("error ", st.message(), "\n");
    }
    std::string reply = absl::StrFormat("step ok %.6f\n", in_step);
    for (auto it = seqs_.begin(); it != seqs_.end();) {
      ++it->position;
      if (--it->remaining > 0) {
        ++it;
        continue;
      }
      (void)c_->Release(it->id);
      absl::StrAppend(&reply, "done ", it->request, "\n");
      it = seqs_.erase(it);
    }
    return reply;
  }

  // Actual compression by context length: fp16 bytes of the logical tokens vs bytes held.
  std::string buckets() {
    auto list = c_->ListSequences();
    if (!list.ok()) return absl::StrCat("error ListSequences: ", list.status().message(), "\n");
    uint64_t n[kBuckets] = {}, fp16[kBuckets] = {}, held[kBuckets] = {};
    for (const karakv::SequenceInfo& s : *list) {
      const int b = bucket_of(s.logical_length);
      ++n[b];
      fp16[b] += s.fp16_bytes;
      held[b] += s.kv_bytes;
    }
    std::string out;
    for (int b = 0; b < kBuckets; ++b) {
      if (n[b] > 0) absl::StrAppend(&out, "bucket ", b, " ", n[b], " ", fp16[b], " ", held[b], "\n");
    }
    return out;
  }

  std::unique_ptr<karakv::Client> c_;
  kn::Geometry g_;
  TokenTable table_;
  std::string policy_;
  std::map<std::string, double> kara_params_;
  // Writes into staging: finished before the call that reads them, or, stream-ordered, queued on
  // the stream and marked for karakvd (flush_writes).
  absl::Status write(std::initializer_list<StagedWrite*> writes) {
    return stream_ != nullptr ? flush_writes(writes, *c_, stream_) : flush_writes(writes);
  }
  // Stream-ordered: the stream's next work (reading outputs, writing staging) after karakvd's.
  absl::Status after_request() { return stream_ != nullptr ? c_->wait_outputs(stream_) : absl::OkStatus(); }

  bool device_;  // device staging: buffers are device pointers, written through StagedWrite
  std::unique_ptr<GpuForward> forward_;
  std::unique_ptr<WorkerStream> own_stream_;
  void* stream_ = nullptr;  // stream-ordered: the one stream of this worker's GPU work
  std::vector<WorkerSequence> seqs_;
};

// ---------------------------------------------------------------------------------------------
// The scheduler.

struct Request {
  uint64_t id = 0;
  int prompt = 0, output = 0;
  int generated = 0;     // output tokens produced so far (kept across preemptions)
  bool started = false;  // its first token was produced (TTFT counted)
  double arrival_t = 0;  // open loop: when it arrived (run seconds)
  double queued_t = 0;   // when it last joined the queue (arrival, preemption, refused prefill)
  double first_token_t = -1, last_token_t = -1;
  int decode_tokens = 0;  // tokens after the first, within the run
};

// Requests in arrival order, drawn from the seed (every run sees the same sequence of requests).
// Open loop: arrival times too, from a generator of their own, so the lengths are the same ones
// as in a closed-loop run whatever the rate.
class RequestSource {
 public:
  RequestSource(uint64_t seed, Range prompt, Range output, double rate)
      : rng_(seed), arrival_rng_(seed ^ 0x9e3779b97f4a7c15ull), prompt_(prompt.lo, prompt.hi),
        output_(output.lo, output.hi), gap_(rate > 0 ? rate : 1.0) {}
  Request next() {
    Request r;
    r.id = next_id_++;
    r.prompt = prompt_(rng_);
    r.output = output_(rng_);
    return r;
  }
  // Open loop: the next request's arrival, exponential gaps of mean 1 / rate from time 0.
  double next_arrival() { return arrival_ += gap_(arrival_rng_); }

 private:
  std::mt19937_64 rng_, arrival_rng_;
  std::uniform_int_distribution<int> prompt_, output_;
  std::exponential_distribution<double> gap_;
  double arrival_ = 0;
  uint64_t next_id_ = 1;
};

struct SeriesPoint {
  int step = 0;
  double t = 0;
  int decoding = 0, waiting = 0;
  uint64_t blocks_used = 0;
  double kv_mib = 0;  // bytes the daemon holds for sequences' K/V (Stats, per policy kv_bytes)
};

struct RunResult {
  std::string policy;
  int max_batch = 0;
  double rate = 0;  // open loop: requests per second; 0: closed loop
  double seconds = 0;
  uint64_t tokens = 0;
  int steps = 0, preemptions = 0, admitted = 0, finished = 0, prefill_refusals = 0;
  double tpot_mean_ms = 0, tpot_p99_ms = 0, ttft_mean_ms = 0, ttft_p50_ms = 0, ttft_p99_ms = 0;
  // Open loop: requests that arrived, and those still without a first token at the end (a queue
  // that grows over the run: the rate is above what the engine serves). TTFT counts the latter with
  // their wait so far.
  int arrived = 0, unserved = 0;
  // Queue length: the mean over engine steps (idle time, when no step runs, not counted), and the
  // mean over the run's time (Little's law: request-seconds spent queued / run seconds).
  double mean_waiting = 0, mean_queue = 0;
  double mean_decoding = 0, mean_kv_mib = 0, peak_kv_mib = 0;
  double step_call_ms = 0;  // per engine step, the workers' time inside Step calls, summed
  double compaction_s = 0;
  uint64_t compactions = 0;
  double ratio[kBuckets] = {};
  uint64_t ratio_samples[kBuckets] = {};
  std::vector<SeriesPoint> series;
  double throughput() const { return seconds > 0 ? tokens / seconds : 0; }
};

struct WorkerHandle {
  std::unique_ptr<ChildProcess> process;
  int fd = -1;
  int running = 0;
  ~WorkerHandle() {
    if (fd >= 0) close(fd);
  }
};

std::string self_exe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "karakv-bench" : p.string();
}

std::vector<std::string> geometry_flags(size_t pool_bytes) {
  std::vector<std::string> flags = {absl::StrCat("--layers=", absl::GetFlag(FLAGS_serve_layers)),
          absl::StrCat("--q_heads=", absl::GetFlag(FLAGS_serve_q_heads)),
          absl::StrCat("--kv_heads=", absl::GetFlag(FLAGS_serve_kv_heads)),
          absl::StrCat("--head_dim=", absl::GetFlag(FLAGS_serve_head_dim)),
          "--dtype=" + absl::GetFlag(FLAGS_serve_dtype), "--block_size=16", absl::StrCat("--pool_bytes=", pool_bytes)};
  // Only when asked for: an older --karakvd lacks the flag.
  if (absl::GetFlag(FLAGS_serve_stream_ordered)) flags.push_back("--stream_ordered_staging");
  return flags;
}

uint64_t held_bytes(const karakv::DaemonStats& st) {
  uint64_t b = 0;
  for (const karakv::PolicyStats& p : st.policies) b += p.kv_bytes;
  return b;
}

class Scheduler {
 public:
  Scheduler(const TempDir& dir, std::string policy, int max_batch, size_t pool_bytes, Range prompt, Range output,
            double rate)
      : dir_(dir), policy_(std::move(policy)), max_batch_(max_batch), pool_bytes_(pool_bytes), rate_(rate),
        source_(absl::GetFlag(FLAGS_serve_seed), prompt, output, rate) {}

  absl::StatusOr<RunResult> run(int steps, double seconds) {
    auto d = start_karakvd(dir_, "karakvd-serve", geometry_flags(pool_bytes_));
    if (!d.ok()) return d.status();
    daemon_ = std::move(*d);
    auto c = attach(*daemon_, 0, "karakv-bench-serve-scheduler");
    if (!c.ok()) return c.status();
    client_ = std::move(*c);
    if (absl::Status s = start_workers(); !s.ok()) return s;
    absl::StatusOr<RunResult> r = loop(steps, seconds);
    for (WorkerHandle& w : workers_) {
      if (w.fd >= 0) (void)send_message(w.fd, "quit\n");
    }
    for (WorkerHandle& w : workers_) {
      if (w.process) {
        // Up to 10 s: a worker with a forward pass on the GPU also tears down cuBLAS and its memory.
        for (int i = 0; i < 1000 && w.process->running(); ++i) sleep_ms(10);
        if (std::string how = w.process->stop(); r.ok() && how != "exit 0") {
          r = absl::InternalError(absl::StrCat("serve worker ended with ", how, "; log tail:\n", w.process->log_tail()));
        }
      }
    }
    workers_.clear();
    client_.reset();
    stop_or_warn(*daemon_);
    return r;
  }

 private:
  absl::Status start_workers() {
    const int n = std::clamp(absl::GetFlag(FLAGS_serve_workers), 1, std::min(max_batch_, kMaxChildren - 2));
    workers_ = std::vector<WorkerHandle>(n);
    for (int i = 0; i < n; ++i) {
      int fds[2];
      if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) != 0) {
        return absl::InternalError(absl::StrCat("socketpair: ", std::strerror(errno)));
      }
      std::vector<std::string> argv = {
          self_exe(), "serve-worker", "--serve_worker_target=" + daemon_->target,
          "--serve_worker_policy=" + policy_, absl::StrCat("--serve_worker_max_batch=", max_batch_),
          "--serve_kara_params=" + absl::GetFlag(FLAGS_serve_kara_params),
          "--serve_staging=" + absl::GetFlag(FLAGS_serve_staging),
          "--serve_worker_compute=" + absl::GetFlag(FLAGS_serve_worker_compute),
          absl::StrCat("--serve_stream_ordered=", absl::GetFlag(FLAGS_serve_stream_ordered)),
          absl::StrCat("--serve_mlp=", absl::GetFlag(FLAGS_serve_mlp)), "--serve_cublas=" + absl::GetFlag(FLAGS_serve_cublas),
          absl::StrCat("--serve_model_base_us=", absl::GetFlag(FLAGS_serve_model_base_us)),
          absl::StrCat("--serve_model_per_seq_us=", absl::GetFlag(FLAGS_serve_model_per_seq_us)),
          absl::StrCat("--serve_prefill_us_per_token=", absl::GetFlag(FLAGS_serve_prefill_us_per_token))};
      auto p = ChildProcess::start(absl::StrCat("serve-worker-", i), argv, dir_.file(absl::StrCat("serve-worker-", i, ".log")),
                                   fds[1]);
      close(fds[1]);
      if (!p.ok()) {
        close(fds[0]);
        return p.status();
      }
      workers_[i].process = std::move(*p);
      workers_[i].fd = fds[0];
    }
    for (WorkerHandle& w : workers_) {  // each says "ready" once attached
      auto m = receive_message(w.fd);
      if (!m.ok() || *m != "ready\n") {
        return absl::InternalError(absl::StrCat("serve worker did not start: ", m.ok() ? *m : m.status().ToString(),
                                                "; log tail:\n", w.process->log_tail()));
      }
    }
    return absl::OkStatus();
  }

  struct Running {
    Request req;
    int worker = 0;
    uint64_t order = 0;  // admission order: the newest is preempted first
  };

  double now() const { return seconds_since(start_); }

  // Open loop: every request whose arrival time has come joins the back of the queue.
  void arrive() {
    while (next_arrival_ <= now()) {
      Request r = source_.next();
      r.arrival_t = r.queued_t = next_arrival_;
      waiting_.push_back(r);
      ++result_.arrived;
      next_arrival_ = source_.next_arrival();
    }
  }

  // vLLM's admission: FCFS, while the batch has room and the pool keeps a watermark free.
  void admit(std::vector<std::string>& commands, uint64_t free_blocks, uint64_t total_blocks) {
    const int64_t watermark = std::max<int64_t>(1, total_blocks / 100);
    int64_t free = int64_t(free_blocks) - 2 * int64_t(running_.size() / 16 + 1);  // this step's growth, roughly
    while (int(running_.size()) < max_batch_) {
      if (waiting_.empty()) {
        if (rate_ > 0) break;  // open loop: nobody is waiting
        waiting_.push_back(source_.next());
        waiting_.back().queued_t = now();
      }
      Request& r = waiting_.front();
      const int context = r.prompt + r.generated;
      const int64_t need = (context + 1 + 15) / 16 + 1;
      if (free - need < watermark) break;
      free -= need;
      auto w = std::min_element(workers_.begin(), workers_.end(),
                                [](const WorkerHandle& a, const WorkerHandle& b) { return a.running < b.running; });
      const int wi = int(w - workers_.begin());
      ++w->running;
      // The first admission's prefill produces the first token; a recompute produces none.
      const int remaining = r.started ? r.output - r.generated : r.output - 1;
      const bool windowed = r.started && absl::GetFlag(FLAGS_serve_recompute_windows);
      absl::StrAppend(&commands[wi], "admit ", r.id, " ", context, " ", remaining, " ", windowed ? 1 : 0, "\n");
      queued_s_ += now() - r.queued_t;
      running_.push_back({r, wi, ++order_});
      waiting_.pop_front();
      ++result_.admitted;
    }
  }

  Running* find(uint64_t req) {
    for (Running& r : running_) {
      if (r.req.id == req) return &r;
    }
    return nullptr;
  }

  // Back to the queue's front (preempted, or its prefill refused), queued again from now.
  void requeue_front(Request r) {
    r.queued_t = now();
    waiting_.push_front(r);
  }

  void drop(uint64_t req, bool requeue) {
    auto it = std::find_if(running_.begin(), running_.end(), [&](const Running& r) { return r.req.id == req; });
    if (it == running_.end()) return;
    --workers_[it->worker].running;
    if (requeue) requeue_front(it->req);
    running_.erase(it);
  }

  // Sends each non-empty command, collects every reply. Returns the workers whose Step was refused.
  absl::StatusOr<std::vector<int>> exchange(const std::vector<std::string>& commands, std::vector<int>* stepped) {
    std::vector<int> sent, full;
    std::vector<Running> refused;  // prefills the pool refused, back to the queue's front at the end
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (commands[i].empty()) continue;
      if (absl::Status s = send_message(workers_[i].fd, commands[i]); !s.ok()) return s;
      sent.push_back(int(i));
    }
    const double sent_t = now();
    for (int i : sent) {
      auto m = receive_message(workers_[i].fd);
      if (!m.ok()) return absl::InternalError(absl::StrCat(m.status().message(), "; worker log tail:\n", workers_[i].process->log_tail()));
      const double t = now();
      double prefilled_s = 0;  // the worker's prefills so far in this reply, run one after another
      for (absl::string_view line : absl::StrSplit(*m, '\n', absl::SkipEmpty())) {
        std::vector<std::string> f = absl::StrSplit(line, ' ');
        if (f[0] == "error") return absl::InternalError(absl::StrCat("serve worker ", i, ": ", line));
        if (f[0] == "prefill" && f.size() == 4) {
          uint64_t req = 0;
          double s = 0;
          (void)absl::SimpleAtoi(f[1], &req);
          (void)absl::SimpleAtod(f[3], &s);
          Running* r = find(req);
          if (r == nullptr) continue;
          prefilled_s += s;
          if (f[2] == "full") {
            ++result_.prefill_refusals;
            refused.push_back(*r);
            drop(req, false);
          } else if (!r->req.started) {
            r->req.started = true;
            r->req.generated = 1;
            r->req.first_token_t = r->req.last_token_t = t;
            // Closed loop: admission to first token. Open loop: arrival to the end of its prefill
            // (queueing, the steps it waited for, and the worker's earlier prefills included).
            ttft_.push_back(rate_ > 0 ? sent_t + prefilled_s - r->req.arrival_t : s);
            ++result_.tokens;
          }
        } else if (f[0] == "step" && f.size() == 3) {
          if (f[1] == "full") {
            full.push_back(i);
          } else if (f[1] == "ok") {
            double s = 0;
            (void)absl::SimpleAtod(f[2], &s);
            step_rpc_s_ += s;
            stepped->push_back(i);
            for (Running& r : running_) {
              if (r.worker != i) continue;
              ++step_decoded_;
              ++r.req.generated;
              ++r.req.decode_tokens;
              r.req.last_token_t = t;
              ++result_.tokens;
            }
          }
        } else if (f[0] == "done" && f.size() == 2) {
          uint64_t req = 0;
          (void)absl::SimpleAtoi(f[1], &req);
          if (Running* r = find(req)) record_tpot(r->req);
          ++result_.finished;
          drop(req, false);
        } else if (f[0] == "bucket" && f.size() == 5) {
          int b = 0;
          uint64_t n = 0, fp16 = 0, held = 0;
          (void)absl::SimpleAtoi(f[1], &b);
          (void)absl::SimpleAtoi(f[2], &n);
          (void)absl::SimpleAtoi(f[3], &fp16);
          (void)absl::SimpleAtoi(f[4], &held);
          if (b >= 0 && b < kBuckets) {
            result_.ratio_samples[b] += n;
            bucket_fp16_[b] += fp16;
            bucket_held_[b] += held;
          }
        }
      }
    }
    // In their admission order, ahead of everything that waits (several refusals in one step
    // would otherwise come back reversed).
    std::sort(refused.begin(), refused.end(), [](const Running& a, const Running& b) { return a.order > b.order; });
    for (const Running& r : refused) requeue_front(r.req);
    return full;
  }

  void record_tpot(const Request& r) {
    if (r.decode_tokens >= 1 && r.last_token_t > r.first_token_t) {
      tpot_.push_back((r.last_token_t - r.first_token_t) / r.decode_tokens);
    }
  }

  absl::StatusOr<RunResult> loop(int steps, double seconds) {
    result_.policy = policy_;
    result_.max_batch = max_batch_;
    result_.rate = rate_;
    const int sample_every = std::max(1, absl::GetFlag(FLAGS_serve_sample_every));
    start_ = Clock::now();
    auto last_report = start_;
    double decoding_sum = 0, kv_sum = 0, waiting_sum = 0;
    if (rate_ > 0) next_arrival_ = source_.next_arrival();
    while (result_.steps < steps && now() < seconds) {
      if (rate_ > 0) {
        arrive();
        if (running_.empty() && waiting_.empty()) {  // idle until the next arrival
          sleep_us(1e6 * std::max(0.0, std::min(next_arrival_, seconds) - now()));
          continue;
        }
      }
      auto st = client_->Stats();
      if (!st.ok()) return st.status();
      const double kv_mib = held_bytes(*st) / double(1 << 20);
      std::vector<std::string> commands(workers_.size());
      admit(commands, st->blocks_free, st->blocks_total);
      if (running_.empty() && !waiting_.empty()) {
        // Nothing runs, so the pool is as free as it gets: the request at the front never fits.
        const Request& r = waiting_.front();
        return absl::FailedPreconditionError(absl::StrFormat(
            "serve: request %d (%d prompt + %d generated tokens) does not fit the pool with nothing else running "
            "(%d of %d blocks free, 1%% kept as watermark); expected a larger --serve_pool_bytes or shorter "
            "--serve_prompt / --serve_output",
            r.id, r.prompt, r.generated, st->blocks_free, st->blocks_total));
      }
      const int batch = int(running_.size());
      const bool sample = result_.steps % sample_every == 0;
      for (size_t i = 0; i < workers_.size(); ++i) {
        absl::StrAppend(&commands[i], "step ", batch, " ", workers_[i].running > 0 ? 1 : 0, " ", sample ? 1 : 0, "\n");
      }
      std::vector<int> stepped;
      auto full = exchange(commands, &stepped);
      if (!full.ok()) return full.status();
      // Preempt the newest sequences until every refused worker's step goes through.
      while (!full->empty()) {
        std::vector<std::string> retry(workers_.size());
        auto victim = std::max_element(running_.begin(), running_.end(),
                                       [](const Running& a, const Running& b) { return a.order < b.order; });
        if (victim == running_.end()) return absl::InternalError("serve: Step refused with no sequence left to preempt");
        absl::StrAppend(&retry[victim->worker], "release ", victim->req.id, "\n");
        ++result_.preemptions;
        drop(victim->req.id, true);
        for (int i : *full) {
          absl::StrAppend(&retry[i], "step ", batch, " ", workers_[i].running > 0 ? 1 : 0, " 0\n");
        }
        full = exchange(retry, &stepped);
        if (!full.ok()) return full.status();
      }
      const int decoding = step_decoded_;
      step_decoded_ = 0;
      ++result_.steps;
      decoding_sum += decoding;
      kv_sum += kv_mib;
      waiting_sum += double(waiting_.size());
      result_.peak_kv_mib = std::max(result_.peak_kv_mib, kv_mib);
      result_.series.push_back({result_.steps, now(), decoding, int(waiting_.size()), st->blocks_used, kv_mib});
      if (seconds_since(last_report) >= 5) {
        last_report = Clock::now();
        progress(absl::StrFormat("serve %s max batch %d%s: step %d/%d (%.0f s), %d decoding, %d waiting, %.0f tok/s, "
                                 "%d preemptions, %.1f MiB K/V held",
                                 policy_, max_batch_, rate_ > 0 ? absl::StrFormat(" at %g req/s", rate_) : "",
                                 result_.steps, steps, now(), decoding, int(waiting_.size()), result_.tokens / now(),
                                 result_.preemptions, kv_mib));
      }
    }
    if (rate_ > 0) arrive();  // the last step's arrivals count too (as unserved)
    result_.seconds = now();
    // Requests still running, or preempted and waiting, count with the tokens they produced.
    for (const Running& r : running_) record_tpot(r.req);
    for (const Request& r : waiting_) {
      record_tpot(r);
      queued_s_ += result_.seconds - r.queued_t;
      if (r.started || rate_ <= 0) continue;
      // Open loop: a request still without a first token counts with its wait so far, a lower
      // bound, so an overloaded run's TTFT is not judged by the few requests it served.
      ++result_.unserved;
      ttft_.push_back(result_.seconds - r.arrival_t);
    }
    auto st = client_->Stats();
    if (!st.ok()) return st.status();
    for (const karakv::PolicyStats& p : st->policies) {
      result_.compaction_s += p.compaction_seconds;
      result_.compactions += p.compactions;
    }
    result_.mean_decoding = result_.steps ? decoding_sum / result_.steps : 0;
    result_.step_call_ms = result_.steps ? 1e3 * step_rpc_s_ / result_.steps : 0;
    result_.mean_kv_mib = result_.steps ? kv_sum / result_.steps : 0;
    result_.tpot_mean_ms = tpot_.empty() ? 0 : 1e3 * std::accumulate(tpot_.begin(), tpot_.end(), 0.0) / tpot_.size();
    result_.tpot_p99_ms = 1e3 * percentile(tpot_, 99);
    result_.ttft_mean_ms = ttft_.empty() ? 0 : 1e3 * std::accumulate(ttft_.begin(), ttft_.end(), 0.0) / ttft_.size();
    result_.ttft_p50_ms = 1e3 * percentile(ttft_, 50);
    result_.ttft_p99_ms = 1e3 * percentile(ttft_, 99);
    result_.mean_waiting = result_.steps ? waiting_sum / result_.steps : 0;
    result_.mean_queue = result_.seconds > 0 ? queued_s_ / result_.seconds : 0;
    for (int b = 0; b < kBuckets; ++b) {
      result_.ratio[b] = bucket_held_[b] ? double(bucket_fp16_[b]) / bucket_held_[b] : 0;
    }
    return result_;
  }

  const TempDir& dir_;
  std::string policy_;
  int max_batch_;
  size_t pool_bytes_;
  double rate_;  // open loop: requests per second; 0: closed loop
  RequestSource source_;
  double next_arrival_ = 0;
  std::optional<Daemon> daemon_;
  std::unique_ptr<karakv::Client> client_;
  std::vector<WorkerHandle> workers_;
  std::deque<Request> waiting_;
  std::vector<Running> running_;
  uint64_t order_ = 0;
  Clock::time_point start_;
  RunResult result_;
  std::vector<double> tpot_, ttft_;
  double step_rpc_s_ = 0;
  double queued_s_ = 0;  // request-seconds spent in the queue (mean_queue)
  int step_decoded_ = 0;  // sequences that decoded a token in the current engine step
  uint64_t bucket_fp16_[kBuckets] = {}, bucket_held_[kBuckets] = {};
};

std::vector<std::string> split_list(const std::string& s) {
  return absl::StrSplit(s, ',', absl::SkipEmpty());
}

std::string run_csv(const std::vector<RunResult>& runs) {
  std::string out =
      "policy,max_batch,seconds,steps,output_tokens,throughput_tok_s,tpot_mean_ms,tpot_p99_ms,ttft_mean_ms,"
      "mean_decoding,preemptions,prefill_refusals,admitted,finished,mean_kv_mib,peak_kv_mib,compactions,"
      "compaction_s,compaction_share,ratio_lt1k,ratio_1_4k,ratio_4_16k,ratio_ge16k,rate_req_s,arrived,unserved,"
      "ttft_p50_ms,ttft_p99_ms,mean_waiting,mean_queue\n";
  for (const RunResult& r : runs) {
    absl::StrAppend(&out, r.policy, ",", r.max_batch, ",", absl::StrFormat("%.3f", r.seconds), ",", r.steps, ",",
                    r.tokens, ",", absl::StrFormat("%.2f", r.throughput()), ",",
                    absl::StrFormat("%.3f,%.3f,%.3f,%.2f", r.tpot_mean_ms, r.tpot_p99_ms, r.ttft_mean_ms, r.mean_decoding),
                    ",", r.preemptions, ",", r.prefill_refusals, ",", r.admitted, ",", r.finished, ",",
                    absl::StrFormat("%.3f,%.3f", r.mean_kv_mib, r.peak_kv_mib), ",", r.compactions, ",",
                    absl::StrFormat("%.4f,%.5f", r.compaction_s, r.seconds > 0 ? r.compaction_s / r.seconds : 0));
    for (int b = 0; b < kBuckets; ++b) absl::StrAppend(&out, ",", absl::StrFormat("%.4f", r.ratio[b]));
    absl::StrAppend(&out, ",", absl::StrFormat("%g", r.rate), ",", r.arrived, ",", r.unserved, ",",
                    absl::StrFormat("%.3f,%.3f,%.2f,%.3f", r.ttft_p50_ms, r.ttft_p99_ms, r.mean_waiting, r.mean_queue),
                    "\n");
  }
  return out;
}

// The series, thinned to at most ~400 points per run (the step numbers say which were kept).
std::string series_csv(const std::vector<RunResult>& runs) {
  std::string out = "policy,max_batch,step,t_s,decoding,waiting,blocks_used,kv_mib,rate_req_s\n";
  for (const RunResult& r : runs) {
    const size_t every = std::max<size_t>(1, r.series.size() / 400);
    for (size_t i = 0; i < r.series.size(); ++i) {
      if (i % every != 0 && i + 1 != r.series.size()) continue;
      const SeriesPoint& p = r.series[i];
      absl::StrAppend(&out, r.policy, ",", r.max_batch, ",", p.step, ",", absl::StrFormat("%.3f", p.t), ",",
                      p.decoding, ",", p.waiting, ",", p.blocks_used, ",", absl::StrFormat("%.3f", p.kv_mib), ",",
                      absl::StrFormat("%g", r.rate), "\n");
    }
  }
  return out;
}

// With open-loop runs among them, the table adds the rate, TTFT's p50 and p99, the mean queue and
// the requests never served.
std::string run_table(const std::vector<RunResult>& runs) {
  const bool open = std::any_of(runs.begin(), runs.end(), [](const RunResult& r) { return r.rate > 0; });
  std::vector<std::vector<std::string>> cells = {{"policy", "max batch", "tok/s", "TPOT ms", "p99 TPOT", "TTFT ms",
                                                  "decoding", "preempt", "KV MiB", "peak MiB", "compact s",
                                                  "ratio <1k", "1-4k", "4-16k"}};
  if (open) {
    cells[0].insert(cells[0].begin() + 2, "req/s");
    cells[0].insert(cells[0].begin() + 7, {"p50 TTFT", "p99 TTFT", "waiting", "queue", "unserved"});
  }
  for (const RunResult& r : runs) {
    auto ratio = [&](int b) { return r.ratio_samples[b] ? absl::StrFormat("%.2fx", r.ratio[b]) : std::string("-"); };
    std::vector<std::string> line = {
        r.policy, absl::StrCat(r.max_batch), absl::StrFormat("%.0f", r.throughput()),
        absl::StrFormat("%.2f", r.tpot_mean_ms), absl::StrFormat("%.2f", r.tpot_p99_ms),
        absl::StrFormat("%.1f", r.ttft_mean_ms), absl::StrFormat("%.1f", r.mean_decoding),
        absl::StrCat(r.preemptions), absl::StrFormat("%.1f", r.mean_kv_mib), absl::StrFormat("%.1f", r.peak_kv_mib),
        absl::StrFormat("%.2f", r.compaction_s), ratio(0), ratio(1), ratio(2)};
    if (open) {
      line.insert(line.begin() + 2, r.rate > 0 ? absl::StrFormat("%g", r.rate) : std::string("closed"));
      line.insert(line.begin() + 7, {absl::StrFormat("%.1f", r.ttft_p50_ms), absl::StrFormat("%.1f", r.ttft_p99_ms),
                                     absl::StrFormat("%.1f", r.mean_waiting), absl::StrFormat("%.2f", r.mean_queue),
                                     absl::StrCat(r.unserved)});
    }
    cells.push_back(std::move(line));
  }
  std::vector<size_t> width(cells[0].size(), 0);
  for (const auto& line : cells)
    for (size_t i = 0; i < line.size(); ++i) width[i] = std::max(width[i], line[i].size());
  std::string out;
  for (const auto& line : cells) {
    for (size_t i = 0; i < line.size(); ++i) {
      const std::string pad(width[i] - line[i].size() + (i ? 2 : 0), ' ');
      absl::StrAppend(&out, i == 0 ? line[i] + pad : pad + line[i]);
    }
    absl::StrAppend(&out, "\n");
  }
  return out;
}

}  // namespace

absl::StatusOr<ServeResult> run_serve(const TempDir& dir, const std::string& out_dir) {
  const bool quick = absl::GetFlag(FLAGS_quick);
  const std::vector<std::string> policies = split_list(absl::GetFlag(FLAGS_serve_policies));
  std::vector<int> batches;
  for (const std::string& b : split_list(quick ? std::string("8,32") : absl::GetFlag(FLAGS_serve_batches))) {
    int v = 0;
    if (!absl::SimpleAtoi(b, &v) || v < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--serve_batches: '", b, "' is not a batch size >= 1"));
    }
    batches.push_back(v);
  }
  if (policies.empty() || batches.empty()) {
    return absl::InvalidArgumentError("--serve_policies and --serve_batches need at least one entry each");
  }
  const int steps = quick ? 150 : std::max(1, absl::GetFlag(FLAGS_serve_steps));
  const double seconds = quick ? 4.0 : absl::GetFlag(FLAGS_serve_seconds);
  auto prompt = parse_range("serve_prompt", absl::GetFlag(FLAGS_serve_prompt));
  if (!prompt.ok()) return prompt.status();
  auto output = parse_range("serve_output", quick ? std::string("64-512") : absl::GetFlag(FLAGS_serve_output));
  if (!output.ok()) return output.status();
  auto pool = parse_bytes_flag(quick ? std::string("8MiB") : absl::GetFlag(FLAGS_serve_pool_bytes));
  if (!pool.ok()) return pool.status();
  auto staging = parse_staging("serve_staging", absl::GetFlag(FLAGS_serve_staging));
  if (!staging.ok()) return staging.status();
  auto compute = parse_worker_compute("serve_worker_compute", absl::GetFlag(FLAGS_serve_worker_compute));
  if (!compute.ok()) return compute.status();
  if (absl::GetFlag(FLAGS_serve_stream_ordered) && *staging == karakv::Staging::kShm) {
    return absl::InvalidArgumentError(
        "--serve_stream_ordered orders device staging by CUDA events: it needs --serve_staging=device or device_fd");
  }
  if (*compute == WorkerCompute::kGemm && *staging == karakv::Staging::kShm) {
    // The products stand in for a model on the GPU, whose K/V/Q are on the device: shm staging
    // would model a CPU worker.
    return absl::InvalidArgumentError(
        "--serve_worker_compute=gemm runs the model's products on the GPU: it needs --serve_staging=device or "
        "device_fd (and karakvd on the GPU: --karakvd_flags=--backend=cuda), not shm");
  }
  if (const std::string d = absl::GetFlag(FLAGS_serve_dtype); d != "fp16" && d != "bf16" && d != "fp32") {
    return absl::InvalidArgumentError(absl::StrCat("--serve_dtype=", d, ": expected fp16, bf16 or fp32"));
  } else if (d == "fp32" && *compute == WorkerCompute::kGemm) {
    return absl::InvalidArgumentError(
        "--serve_worker_compute=gemm runs the model's products in the pool's 16-bit dtype: use --serve_dtype=fp16 or bf16");
  }
  if (auto kp = parse_policy_params("serve_kara_params", absl::GetFlag(FLAGS_serve_kara_params)); !kp.ok()) {
    return kp.status();
  }
  std::vector<double> rates;  // {0}: closed loop
  for (const std::string& text : split_list(absl::GetFlag(FLAGS_serve_rates))) {
    double v = 0;
    if (!absl::SimpleAtod(text, &v) || !(v > 0) || !std::isfinite(v)) {
      return absl::InvalidArgumentError(absl::StrCat("--serve_rates: '", text,
                                                     "' is not a rate; expected requests per second > 0, e.g. "
                                                     "--serve_rates=0.5,1,2"));
    }
    rates.push_back(v);
  }
  if (rates.empty()) rates.push_back(0);
  const bool open = rates[0] > 0;

  std::vector<RunResult> runs;
  const auto start = Clock::now();
  const size_t total = policies.size() * batches.size() * rates.size();
  for (double rate : rates) {
    const std::string at_rate = rate > 0 ? absl::StrFormat(" at %g req/s", rate) : "";
    for (int batch : batches) {
      for (const std::string& policy : policies) {
        progress(absl::StrFormat("serve run %d/%d: %s, max batch %d%s, %d steps (%.0f s so far)", int(runs.size()) + 1,
                                 int(total), policy, batch, at_rate, steps, seconds_since(start)));
        Scheduler s(dir, policy, batch, *pool, *prompt, *output, rate);
        auto r = s.run(steps, seconds);
        if (!r.ok()) {
          return absl::Status(r.status().code(), absl::StrCat("serve ", policy, " max batch ", batch, at_rate, ": ",
                                                              r.status().message()));
        }
        progress(absl::StrFormat("serve %s max batch %d%s: %.0f tok/s, %.1f decoding on average, %d preemptions, "
                                 "%.1f ms per step in Step calls (all workers)%s%s",
                                 policy, batch, at_rate, r->throughput(), r->mean_decoding, r->preemptions,
                                 r->step_call_ms,
                                 *compute == WorkerCompute::kGemm
                                     ? std::string(", the model's products on the GPU")
                                     : absl::StrFormat(" vs %.1f ms modeled model compute",
                                                       model_step_us(int(std::lround(r->mean_decoding))) / 1e3),
                                 rate > 0 ? absl::StrFormat("; TTFT p50 %.1f / p99 %.1f ms, %d of %d arrivals unserved",
                                                            r->ttft_p50_ms, r->ttft_p99_ms, r->unserved, r->arrived)
                                          : ""));
        runs.push_back(std::move(*r));
      }
    }
  }
  std::sort(runs.begin(), runs.end(), [&](const RunResult& a, const RunResult& b) {
    const auto pa = std::find(policies.begin(), policies.end(), a.policy) - policies.begin();
    const auto pb = std::find(policies.begin(), policies.end(), b.policy) - policies.begin();
    if (pa != pb) return pa < pb;
    return a.rate != b.rate ? a.rate < b.rate : a.max_batch < b.max_batch;
  });
  if (!out_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(out_dir, ec);
    for (auto [name, text] : {std::pair<std::string, std::string>{"serve_runs.csv", run_csv(runs)},
                              std::pair<std::string, std::string>{"serve_series.csv", series_csv(runs)}}) {
      std::ofstream f(out_dir + "/" + name);
      f << text;
      if (!f) return absl::InternalError(absl::StrCat("cannot write ", out_dir, "/", name));
    }
  }

  ServeResult result;
  const auto geometry = absl::StrFormat("%d layers, %d q heads, %d KV heads, head_dim %d, %s, block 16",
                                        absl::GetFlag(FLAGS_serve_layers), absl::GetFlag(FLAGS_serve_q_heads),
                                        absl::GetFlag(FLAGS_serve_kv_heads), absl::GetFlag(FLAGS_serve_head_dim),
                                        absl::GetFlag(FLAGS_serve_dtype));
  const std::string model =
      *compute == WorkerCompute::kGemm
          ? absl::StrFormat("model: its projections' and MLP's products on the GPU (cuBLAS, MLP %d)",
                            mlp_width(absl::GetFlag(FLAGS_serve_mlp),
                                      absl::GetFlag(FLAGS_serve_q_heads) * absl::GetFlag(FLAGS_serve_head_dim)))
          : absl::StrFormat("model %.0f + %.0f x batch us per step, prefill %.0f us/token (slept)",
                            absl::GetFlag(FLAGS_serve_model_base_us), absl::GetFlag(FLAGS_serve_model_per_seq_us),
                            absl::GetFlag(FLAGS_serve_prefill_us_per_token));
  result.how = absl::StrFormat(
      "serve %s; pool %s; prompts %d-%d, outputs %d-%d tokens (uniform); %d engine steps per run (at most %.0f s); "
      "%s; %d worker processes, %s staging; %s%s%s",
      geometry, quick ? "8MiB" : absl::GetFlag(FLAGS_serve_pool_bytes), prompt->lo, prompt->hi, output->lo,
      output->hi, steps, seconds, model, absl::GetFlag(FLAGS_serve_workers), staging_name(*staging),
      open ? absl::StrCat("open loop, Poisson arrivals at ", absl::StrJoin(rates, ", "), " req/s")
                   : std::string("closed loop"),
      absl::GetFlag(FLAGS_serve_recompute_windows) ? "; preempted Kara requests re-prefilled with prompt=window" : "",
      quick ? " (--quick)" : "");
  result.report = absl::StrCat(
      "serve: one run per (policy, max batch", open ? ", rate" : "", "); tok/s = output tokens / run seconds; ",
      "TPOT per request (first to last token of the run, preemption stalls included); ",
      open ? "TTFT = arrival to first token (queueing included; a request unserved at the end counts with its wait "
                     "so far, a lower bound), waiting = mean queue length per engine step, queue = mean queue length over "
                     "time (queued request-seconds / run seconds), unserved = arrivals without a first token at the "
                     "end; "
                   : "TTFT = admission to first token; ",
      "ratio = fp16 bytes of logical tokens / bytes held, by context length:\n", run_table(runs));
  // P4: at the largest max batch, kara against none and snapkv; kara's and snapkv's throughput
  // at the largest max batch against their best at any smaller one.
  const int largest = *std::max_element(batches.begin(), batches.end());
  // The run of policy p at max batch b and `rate` (0: the closed loop's).
  auto at = [&](const std::string& p, int b, double rate = 0) -> const RunResult* {
    for (const RunResult& r : runs)
      if (r.policy == p && r.max_batch == b && r.rate == rate) return &r;
    return nullptr;
  };
  if (open) {
    result.mode = "serve-open";
    // Open loop: at the largest max batch and each rate, kara's p99 TTFT against none's and
    // snapkv's (information: P4 is the closed loop's).
    for (double rate : rates) {
      const RunResult* kara = at("kara", largest, rate);
      for (const char* base : {"none", "snapkv"}) {
        if (const RunResult* b = at(base, largest, rate); kara != nullptr && b != nullptr) {
          result.comparisons.push_back({absl::StrFormat("p99 TTFT at %g req/s, max batch %d, kara", rate, largest),
                                        kara->ttft_p99_ms, base, b->ttft_p99_ms, "ms", 0});
        }
      }
    }
    return result;
  }
  auto best_below = [&](const std::string& p) -> const RunResult* {
    const RunResult* best = nullptr;
    for (const RunResult& r : runs)
      if (r.policy == p && r.max_batch < largest && (!best || r.throughput() > best->throughput())) best = &r;
    return best;
  };
  const RunResult* kara = at("kara", largest);
  if (kara != nullptr) {
    for (auto [base, target] : {std::pair<std::string, double>{"none", 1.5}, {"snapkv", 1.2}}) {
      if (const RunResult* b = at(base, largest)) {
        result.comparisons.push_back({absl::StrFormat("output tok/s at max batch %d, kara", largest), kara->throughput(),
                                      base, b->throughput(), "tok/s", target});
      }
    }
    if (const RunResult* b = best_below("kara")) {
      result.comparisons.push_back({absl::StrFormat("kara tok/s at max batch %d", largest), kara->throughput(),
                                    absl::StrFormat("kara at max batch %d (its best below)", b->max_batch),
                                    b->throughput(), "tok/s", 0.95});
    }
  }
  if (const RunResult* s = at("snapkv", largest); s != nullptr) {
    if (const RunResult* b = best_below("snapkv")) {
      result.comparisons.push_back({absl::StrFormat("snapkv tok/s at max batch %d", largest), s->throughput(),
                                    absl::StrFormat("snapkv at max batch %d (its best below)", b->max_batch),
                                    b->throughput(), "tok/s", 0});
    }
  }
  return result;
}

int serve_worker_main() {
  karakv::ClientOptions o;
  o.target = absl::GetFlag(FLAGS_serve_worker_target);
  o.worker_id = absl::StrCat("karakv-bench-serve-worker-", getpid());
  o.staging_bytes = 0;
  auto probe = karakv::Client::Attach(o);
  if (!probe.ok()) {
    std::fprintf(stderr, "serve-worker: %s\n", probe.status().ToString().c_str());
    return 1;
  }
  const int max_batch = std::max(1, absl::GetFlag(FLAGS_serve_worker_max_batch));
  auto staging = parse_staging("serve_staging", absl::GetFlag(FLAGS_serve_staging));
  if (!staging.ok()) {
    std::fprintf(stderr, "serve-worker: %s\n", staging.status().ToString().c_str());
    return 1;
  }
  auto compute = parse_worker_compute("serve_worker_compute", absl::GetFlag(FLAGS_serve_worker_compute));
  if (!compute.ok()) {
    std::fprintf(stderr, "serve-worker: %s\n", compute.status().ToString().c_str());
    return 1;
  }
  o.staging = *staging;
  o.stream_ordered = absl::GetFlag(FLAGS_serve_stream_ordered);
  o.staging_bytes = 2 * (*probe)->append_bytes(256) + 2 * (*probe)->step_kv_bytes(max_batch) +
                    2 * (*probe)->q_bytes(max_batch) + (1 << 16);
  probe->reset();
  auto client = karakv::Client::Attach(o);
  if (!client.ok()) {
    std::fprintf(stderr, "serve-worker: %s\n", client.status().ToString().c_str());
    return 1;
  }
  auto kara_params = parse_policy_params("serve_kara_params", absl::GetFlag(FLAGS_serve_kara_params));
  if (!kara_params.ok()) {
    std::fprintf(stderr, "serve-worker: %s\n", kara_params.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<GpuForward> forward;
  if (*compute == WorkerCompute::kGemm) {
    auto f = GpuForward::make((*client)->geometry(), absl::GetFlag(FLAGS_serve_mlp), std::max(max_batch, kPrefillChunk),
                              absl::GetFlag(FLAGS_serve_cublas));
    if (!f.ok()) {
      std::fprintf(stderr, "serve-worker: --serve_worker_compute=gemm: %s\n", f.status().ToString().c_str());
      return 1;
    }
    forward = std::move(*f);
    std::fprintf(stderr, "serve-worker: forward pass on the GPU: %s\n", forward->description().c_str());
  }
  std::unique_ptr<WorkerStream> own_stream;
  if (o.stream_ordered && forward == nullptr) {
    auto s = WorkerStream::create();
    if (!s.ok()) {
      std::fprintf(stderr, "serve-worker: --serve_stream_ordered: %s\n", s.status().ToString().c_str());
      return 1;
    }
    own_stream = std::move(*s);
  }
  Worker worker(std::move(*client), absl::GetFlag(FLAGS_serve_worker_policy), std::move(*kara_params),
                std::move(forward), std::move(own_stream));
  if (!send_message(3, "ready\n").ok()) return 1;
  bool quit = false;
  while (!quit) {
    auto m = receive_message(3);
    if (!m.ok()) {
      std::fprintf(stderr, "serve-worker: %s\n", m.status().ToString().c_str());
      return 1;
    }
    const std::string reply = worker.execute(*m, &quit);
    if (quit) break;
    if (absl::Status s = send_message(3, reply); !s.ok()) {
      std::fprintf(stderr, "serve-worker: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  worker.release_all();
  return 0;
}

}  // namespace karakv::bench
