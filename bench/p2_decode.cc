// karakv-bench p2: decode attention bandwidth (GB/s of K/V read by the CPU backend, in process and
// through karakvd Step) vs this machine's streaming-read bandwidth (targets: >= 80% in-process, >= 70%
// through Step).
#include <emmintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench_common.h"
#include "karakv/kernels/cpus.h"
#include "common/synthetic.h"
#include "harness.h"
#include "karakv/client.h"
#include "karakv/kernels/backend.h"
#include "karakv/kernels/cpu_isa.h"
#include "karakv/kernels/half.h"

ABSL_FLAG(int32_t, p2_sequences, 32, "P2: sequences in the decode batch");
ABSL_FLAG(int32_t, p2_tokens, 4096, "P2: resident tokens per sequence");
ABSL_FLAG(int32_t, p2_reps, 3, "P2: passes over all layers (best pass vs best streaming read)");
ABSL_FLAG(int32_t, p2_block_size, 16,
          "P2: tokens per pool block, in-process and for the daemons (karakvd --block_size): each block's "
          "(layer, KV head) run is block_size x head_dim elements, so larger blocks read in longer runs");
ABSL_FLAG(bool, p2_daemon, true, "P2: also measure decode end to end through karakvd Step, by gRPC and by the ring");

namespace karakv::bench {
namespace {

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

// Seconds to sum `n` floats once with `threads` OpenMP threads. SSE2 with eight independent
// accumulators keeps the adds far ahead of memory, so this measures the memory.
double stream_pass_seconds(const float* data, size_t n, int threads) {
  static volatile float sink = 0;
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
  return el;
}

// Best-of-`reps` bandwidth of summing `n` floats with `threads` threads (a pass is 1 GiB: tens of
// milliseconds).
double stream_read_gbps(const float* data, size_t n, int threads, int reps) {
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    best = std::max(best, double(n) * sizeof(float) / stream_pass_seconds(data, n, threads) / 1e9);
  }
  return best;
}

// The bandwidth of summing `n` floats with `threads` threads pass after pass for at least
// `seconds`, all passes together: what a reader keeps up over as long as a decode pass runs. On a
// busy machine the best of a few short passes catches the moments the reader had a CPU to itself,
// which a decode pass of a few hundred milliseconds cannot.
double stream_read_sustained_gbps(const float* data, size_t n, int threads, double seconds) {
  double total = 0;
  int passes = 0;
  while (total < seconds || passes == 0) {
    total += stream_pass_seconds(data, n, threads);
    ++passes;
  }
  return double(n) * sizeof(float) * passes / total / 1e9;
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
  double single_thread_sustained() { return stream_read_sustained_gbps(data(), kFloats, 1, kSustainedSeconds); }
  static constexpr double kSustainedSeconds = 0.5;  // longer than a decode pass over every layer
  int threads() const { return threads_; }

 private:
  static constexpr size_t kFloats = size_t(1) << 28;  // 1 GiB
  explicit StreamBaseline(int threads) : buffer_(kFloats * sizeof(float)), threads_(threads) {}
  float* data() { return static_cast<float*>(buffer_.ptr); }
  HugeBuffer buffer_;
  const int threads_;
};

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
  Pair scattered;                // block tables are a random permutation of the pool
  std::optional<Pair> in_order;  // each sequence's blocks consecutive (when asked for)
  std::optional<Pair> layout_read;  // the same K/V regions read with no arithmetic (the layout's ceiling)
};

// GB/s of reading exactly the bytes one decode pass over every layer reads, in the kernel's order
// (per layer and sequence, each block's K region, then its V region: every KV head of a block is
// one contiguous run of block_size * head_dim elements per head), with the kernel's prefetch (the
// next region, a line per line read, into L2) but no arithmetic: what this pool layout allows a
// decode to read, the ceiling of the kernel on it. Sequences are split over `threads` OpenMP
// threads as the kernel's pool splits them.
double layout_read_gbps(const kn::PagedKV& kv, int threads, double bytes) {
  const kn::Geometry& g = kv.geometry;
  const size_t region_bytes = size_t(g.num_kv_heads) * g.block_size * g.head_dim * kn::dtype_size(g.dtype);
  const auto* pool = static_cast<const char*>(kv.pool);
  auto region = [&](int s, int l, int j) {
    // K regions of every block, then V regions (j counts both).
    const int blocks = (kv.seq_len[s] + g.block_size - 1) / g.block_size;
    const int kv_index = j < blocks ? 0 : 1;
    const int b = j - kv_index * blocks;
    return pool + kv.run_offset(kv.block_table[kv.table_offset[s] + b], l, kv_index, 0) * kn::dtype_size(g.dtype);
  };
  const auto start = Clock::now();
  float total = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(+ : total) collapse(2)
  for (int l = 0; l < g.num_layers; ++l) {
    for (int s = 0; s < kv.num_seqs; ++s) {
      const int regions = 2 * ((kv.seq_len[s] + g.block_size - 1) / g.block_size);
      __m128 acc[4];
      for (auto& a : acc) a = _mm_setzero_ps();
      for (int j = 0; j < regions; ++j) {
        const char* p = region(s, l, j);
        const char* next = j + 1 < regions ? region(s, l, j + 1) : nullptr;
        for (size_t off = 0; off < region_bytes; off += 64) {
          if (next != nullptr) _mm_prefetch(next + off, _MM_HINT_T2);
          for (int k = 0; k < 4; ++k) acc[k] = _mm_add_ps(acc[k], _mm_load_ps(reinterpret_cast<const float*>(p + off) + 4 * k));
        }
      }
      alignas(16) float lanes[4];
      _mm_store_ps(lanes, _mm_add_ps(_mm_add_ps(acc[0], acc[1]), _mm_add_ps(acc[2], acc[3])));
      total += lanes[0] + lanes[1] + lanes[2] + lanes[3];
    }
  }
  const double el = seconds_since(start);
  static volatile float sink = 0;
  sink = sink + total;
  return bytes / el / 1e9;
}

// Decode passes on a CPU backend whose attention runs with `isa` (its own pool: a backend reads
// only pools it allocated).
absl::StatusOr<DirectDecode> decode_direct_gbps(const kn::Geometry& g, int seqs, int tokens, int reps,
                                                StreamBaseline& stream, kn::CpuIsa isa, bool with_in_order) {
  std::string why;
  auto backend = kn::make_cpu_backend(0, isa, &why);
  if (backend == nullptr) return absl::FailedPreconditionError(why);
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

  auto paged = [&](const std::vector<int32_t>& table) {
    kn::PagedKV kv;
    kv.pool = pool;
    kv.geometry = g;
    kv.block_table = table.data();
    kv.table_offset = offsets.data();
    kv.seq_len = lengths.data();
    kv.num_seqs = seqs;
    return kv;
  };
  // The best of `reps` passes (after one warm-up) of decode over every layer with this table, and
  // the best of the streaming reads sampled just before each of them.
  auto passes = [&](const std::vector<int32_t>& table, const char* label) -> absl::StatusOr<Pair> {
    const kn::PagedKV kv = paged(table);
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
      progress(absl::StrFormat("P2 direct, %s attention, %s, pass %d/%d: %.3f s = %.2f GB/s%s (streaming read just "
                               "before: %.2f GB/s)",
                               std::string(kn::cpu_isa_name(isa)), label, r, reps, el, bytes / el / 1e9,
                               r == 0 ? " (warm-up)" : "", stream_gbps));
    }
    return best_of_each(measured);
  };

  // The measured table is a shuffled permutation of the pool, so a sequence's blocks are scattered
  // the way a long-running daemon's would be; blocks in order show what scattering costs.
  std::vector<int32_t> table(num_blocks);
  std::iota(table.begin(), table.end(), 0);
  DirectDecode result;
  if (with_in_order) {
    auto in_order = passes(table, "blocks in order");
    if (!in_order.ok()) return in_order.status();
    result.in_order = *in_order;
  }
  std::shuffle(table.begin(), table.end(), std::mt19937(42));
  auto scattered = passes(table, "scattered blocks");
  if (!scattered.ok()) return scattered.status();
  result.scattered = *scattered;
  if (with_in_order) {
    // The layout's ceiling, on the same scattered table, best of as many passes, each against the
    // streaming read sampled just before it.
    const kn::PagedKV kv = paged(table);
    std::vector<Pair> measured;
    for (int r = 0; r <= reps; ++r) {
      const double stream_gbps = stream.sample();
      const double gbps = layout_read_gbps(kv, stream.threads(), bytes);
      if (r > 0) measured.push_back({gbps, stream_gbps});
      progress(absl::StrFormat("P2 reading the decode's K/V regions alone, pass %d/%d: %.2f GB/s%s (streaming read "
                               "just before: %.2f GB/s)", r, reps, gbps, r == 0 ? " (warm-up)" : "", stream_gbps));
    }
    result.layout_read = best_of_each(measured);
  }
  return result;
}

// Decode through the daemon: `seqs` sequences prefilled to `tokens`, then batched Steps over all
// layers. Returns the best step's GB/s of K/V read (the Step that appends a token also attends
// over it), timed over the Step calls alone (the bench's own writing of each layer's synthetic
// K/V/Q between them stands for the model's forward pass, which is not the daemon's time; the
// progress line gives the wall time with it too), and the best of the streaming reads sampled
// just before each step.
absl::StatusOr<Pair> decode_daemon_gbps(const TempDir& dir, const kn::Geometry& g, int seqs, int tokens,
                                          int reps, StreamBaseline& stream, bool fast_path) {
  const char* path = fast_path ? "ring" : "gRPC";
  const int steps = reps + 1;
  const size_t blocks = size_t(seqs) * ((tokens + steps + g.block_size - 1) / g.block_size);
  const size_t pool_bytes = (blocks + 16) * g.block_bytes();
  auto daemon = start_karakvd(dir, fast_path ? "karakvd-p2-ring" : "karakvd-p2-grpc",
                              smollm_flags(pool_bytes, g.block_size));
  if (!daemon.ok()) return daemon.status();
  // Prefill a block at a time, round robin over the sequences, so each sequence's blocks lie
  // `seqs` blocks apart as a busy daemon's do, not in order (which reads a few percent faster; the
  // in-process rows show both). A shorter tail gets its own buffers.
  const int chunk = std::min(g.block_size, tokens), tail = tokens % chunk;
  auto client = attach(*daemon, 2 * (append_tensor_bytes(g, chunk) + append_tensor_bytes(g, tail)) + (4 << 20),
                       "karakv-bench-p2", karakv::Staging::kShm, fast_path);
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
  }
  for (int done = 0; done < tokens; done += chunk) {
    const bool full = tokens - done >= chunk;
    for (uint64_t id : ids) {
      auto len = full ? c.Append(id, chunk, *k, *v) : c.Append(id, tail, *tk, *tv);
      if (!len.ok()) return len.status();
    }
  }
  const double prefill_s = seconds_since(t_prefill);
  progress(absl::StrFormat("P2 daemon (%s) prefill: %d x %d tokens in %.2f s (%.2f GB/s)", path, seqs, tokens, prefill_s,
                           decode_bytes(g, std::vector<int32_t>(seqs, tokens)) / prefill_s / 1e9));
  const size_t kv_tok = g.kv_token_elems() * kn::dtype_size(g.dtype);
  std::vector<Pair> measured;
  for (int step = 0; step < steps; ++step) {  // step 0 warms up
    const double stream_gbps = stream.sample();
    const auto start = Clock::now();
    double in_step = 0;
    for (int l = 0; l < g.num_layers; ++l) {
      for (int s = 0; s < seqs; ++s) {
        karakv::synthetic::fill_token(sk->data() + s * kv_tok, g, 1, Tensor::kKey, ids[s], l, tokens + step);
        karakv::synthetic::fill_token(sv->data() + s * kv_tok, g, 1, Tensor::kValue, ids[s], l, tokens + step);
        karakv::synthetic::fill_query(q->as<float>().data() + s * g.q_token_elems(), g, 1, ids[s], l, tokens + step);
      }
      const auto call = Clock::now();
      auto r = c.Step(l, ids, *sk, *sv, *q, *out);
      in_step += seconds_since(call);
      if (!r.ok()) return r.status();
    }
    const double wall = seconds_since(start);
    const double bytes = decode_bytes(g, std::vector<int32_t>(seqs, tokens + step + 1));
    if (step > 0) measured.push_back({bytes / in_step / 1e9, stream_gbps});
    progress(absl::StrFormat("P2 daemon (%s) step %d/%d: %.3f s in Step calls = %.2f GB/s%s; %.3f s with the "
                             "bench's K/V/Q writes = %.2f GB/s (streaming read just before: %.2f GB/s)",
                             path, step, reps, in_step, bytes / in_step / 1e9, step == 0 ? " (warm-up)" : "", wall,
                             bytes / wall / 1e9, stream_gbps));
  }
  client->reset();
  stop_or_warn(*daemon);
  return best_of_each(measured);
}

}  // namespace

absl::StatusOr<std::vector<Row>> run_p2(const TempDir& dir) {
  auto geometry = smollm_geometry_with_block("--p2_block_size", absl::GetFlag(FLAGS_p2_block_size));
  if (!geometry.ok()) return geometry.status();
  const kn::Geometry g = *geometry;
  const int seqs = absl::GetFlag(FLAGS_p2_sequences), tokens = absl::GetFlag(FLAGS_p2_tokens);
  if (seqs < 1 || tokens < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--p2_sequences=%d --p2_tokens=%d: P2 needs at least one sequence of at least one token", seqs, tokens));
  }
  const int reps = std::max(1, absl::GetFlag(FLAGS_p2_reps));
  // Every CPU this process may use (affinity and cgroup quota, as the CPU backend's default and
  // karakvd's --threads), whatever OpenMP's defaults have become: a mode run before this one in the
  // same process can leave omp_get_max_threads() at 1 (the backend sets it on the threads it uses).
  const kn::UsableCpus usable = kn::usable_cpus();
  const int threads = usable.count;
  progress(absl::StrFormat("P2: %d threads for the decode and its streaming-read baseline (%s)", threads,
                           usable.reason()));

  auto stream = StreamBaseline::make(threads);
  if (!stream.ok()) return stream.status();
  const Pair one_thread{(*stream)->single_thread(), (*stream)->sample()};
  const Pair one_thread_sustained{(*stream)->single_thread_sustained(), (*stream)->sample()};
  // The target row runs the ISA the daemon would (KARAKV_CPU_ISA, else the best this CPU has); the
  // other ISA, where it runs here, gets an info row from the same run for comparison.
  kn::CpuIsa isa;
  if (kn::KernelStatus st = kn::cpu_isa_from_env(&isa); !st.is_ok()) return absl::InvalidArgumentError(st.message);
  auto direct = decode_direct_gbps(g, seqs, tokens, reps, **stream, isa, true);
  if (!direct.ok()) return direct.status();
  const kn::CpuIsa other = isa == kn::CpuIsa::kAvx512 ? kn::CpuIsa::kBaseline : kn::CpuIsa::kAvx512;
  std::optional<Pair> other_direct;
  if (const std::string missing = kn::cpu_isa_missing(other); missing.empty()) {
    auto d = decode_direct_gbps(g, seqs, tokens, reps, **stream, other, false);
    if (!d.ok()) return d.status();
    other_direct = d->scattered;
  } else {
    progress(absl::StrCat("P2: no ", std::string(kn::cpu_isa_name(other)), " row: ", missing));
  }
  // Through karakvd's Step: by gRPC (each of the 30 calls a step is a gRPC round trip) and by the
  // ring (the fast path a co-located worker attaches with), each on a daemon of its own.
  std::optional<Pair> via_daemon, via_ring;
  if (absl::GetFlag(FLAGS_p2_daemon)) {
    auto d = decode_daemon_gbps(dir, g, seqs, tokens, reps, **stream, false);
    if (!d.ok()) return d.status();
    via_daemon = *d;
    auto r = decode_daemon_gbps(dir, g, seqs, tokens, reps, **stream, true);
    if (!r.ok()) return r.status();
    via_ring = *r;
  }
  const std::string base = absl::StrFormat("streaming read, %d threads", threads);
  const std::string what = absl::StrFormat(", %d seqs x %d tokens, %d threads", seqs, tokens, threads);
  std::vector<Row> rows;
  const std::string isa_name(kn::cpu_isa_name(isa));
  rows.push_back({"P2", absl::StrCat("decode_attention (CPU backend, ", isa_name, " attention)", what),
                  direct->scattered.karakv, base, direct->scattered.baseline, "GB/s", true,
                  Target{Target::Kind::kAtLeast, 0.80}});
  rows.push_back({"P2", absl::StrCat("decode_attention, blocks in order, ", threads, " threads"), direct->in_order->karakv, base,
                  direct->in_order->baseline, "GB/s", true, std::nullopt});
  rows.push_back({"P2", absl::StrCat("reading the decode's K/V regions alone (the layout's ceiling), ", threads,
                                     " threads"),
                  direct->layout_read->karakv, base, direct->layout_read->baseline, "GB/s", true, std::nullopt});
  if (other_direct) {
    rows.push_back({"P2", absl::StrCat("decode_attention, ", std::string(kn::cpu_isa_name(other)), " attention, ",
                                       threads, " threads"),
                    other_direct->karakv, base, other_direct->baseline, "GB/s", true, std::nullopt});
  }
  if (via_daemon) {
    rows.push_back({"P2", absl::StrCat("decode through karakvd Step by gRPC, 30 layers, ", threads, " threads"),
                    via_daemon->karakv, base, via_daemon->baseline, "GB/s", true, Target{Target::Kind::kAtLeast, 0.70}});
    rows.push_back({"P2", absl::StrCat("decode through karakvd Step by the ring, 30 layers, ", threads, " threads"),
                    via_ring->karakv, base, via_ring->baseline, "GB/s", true, Target{Target::Kind::kAtLeast, 0.70}});
  }
  rows.push_back({"P2", "streaming read, 1 thread", one_thread.karakv, base, one_thread.baseline, "GB/s", true,
                  std::nullopt});
  rows.push_back({"P2", absl::StrFormat("streaming read, 1 thread, sustained over %.1f s", StreamBaseline::kSustainedSeconds),
                  one_thread_sustained.karakv, base, one_thread_sustained.baseline, "GB/s", true, std::nullopt});
  return rows;
}

std::string p2_how() {
  return absl::StrFormat("P2 SmolLM2-135M geometry fp16, block %d, best of %d passes vs best of the streaming "
                         "reads sampled just before each", absl::GetFlag(FLAGS_p2_block_size),
                         absl::GetFlag(FLAGS_p2_reps));
}

}  // namespace karakv::bench
