// Kernel benchmark on one backend (cpu or cuda), through the same Backend interface the daemon
// uses, so host-side costs (validation, table uploads, synchronisation) are in the numbers.
//
//   decode   paged decode attention over a batch, every layer: time per layer, K/V bytes read per
//            second, and (cuda) that bandwidth as a fraction of a device-to-device copy measured in
//            the same run.
//   kara     one Kara tick for one sequence (window scores for every layer, Token2Chunk over every
//            (layer, KV head) row in one call, as Kara's plan makes it, gather of the kept tokens) vs
//            one decode step (every layer) of the batch.
//   quant    (--quant=kivi2,tq4,...) decode attention straight from quantized blocks: each sequence's
//            first tokens (all but the newest 128, in whole quantized blocks) quantized with
//            quantize_tokens, the rest left in the fp16 blocks, as the daemon's quantize_aged lays it
//            out; time per layer against the fp16 decode above, bytes read per second, and the mean
//            relative L2 error of the outputs against the fp16 decode's.
//
// Prints one table row per measurement ("name value unit"), parsed by scripts/gpu-check.sh.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "karakv/kernels/backend.h"
#include "karakv/kernels/half.h"

#if KARAKV_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using namespace karakv::kernels;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string backend = "cpu";
  std::string model = "smollm2";
  int seqs = 64;
  int tokens = 8192;
  int iters = 10;
  int threads = 0;           // CPU backend: 0 = the CPUs this process may use
  std::string isa = "auto";  // CPU backend: attention ISA (karakv/kernels/cpu_isa.h)
  std::string attention;     // CUDA backend: own or flashinfer (karakv/kernels/cuda_attention.h); empty: the environment's
  std::string quant_decode;  // CUDA backend: staged or fused (the same header); empty: the environment's
  std::vector<std::pair<std::string, QuantFormat>> quant;  // --quant: formats to time
};

constexpr int kResidual = 128;  // the daemon's default residual window (docs/COMPRESSION.md)

bool parse_quant(const std::string& list, Options* o) {
  static const std::pair<const char*, QuantFormat> kFormats[] = {{"kivi2", QuantFormat::kKivi2},
                                                                 {"kivi4", QuantFormat::kKivi4},
                                                                 {"tq2", QuantFormat::kTq2},
                                                                 {"tq3", QuantFormat::kTq3},
                                                                 {"tq4", QuantFormat::kTq4}};
  size_t start = 0;
  while (start <= list.size() && !list.empty()) {
    const size_t end = std::min(list.find(',', start), list.size());
    const std::string name = list.substr(start, end - start);
    bool found = false;
    for (const auto& [n, f] : kFormats) {
      if (name == n) o->quant.emplace_back(n, f), found = true;
    }
    if (!found) {
      std::fprintf(stderr, "--quant: unknown format '%s'; expected a comma-separated list of kivi2, kivi4, tq2, tq3, tq4\n",
                   name.c_str());
      return false;
    }
    start = end + 1;
  }
  return true;
}

bool parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* name) -> const char* {
      const std::string prefix = std::string("--") + name + "=";
      return a.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    if (const char* v = value("backend")) o->backend = v;
    else if (const char* v = value("model")) o->model = v;
    else if (const char* v = value("seqs")) o->seqs = std::atoi(v);
    else if (const char* v = value("tokens")) o->tokens = std::atoi(v);
    else if (const char* v = value("iters")) o->iters = std::atoi(v);
    else if (const char* v = value("threads")) o->threads = std::atoi(v);
    else if (const char* v = value("isa")) o->isa = v;
    else if (const char* v = value("attention")) o->attention = v;
    else if (const char* v = value("quant_decode")) o->quant_decode = v;
    else if (const char* v = value("quant")) {
      if (!parse_quant(v, o)) return false;
    } else {
      std::fprintf(stderr,
                   "unknown argument '%s'\nusage: kernels_bench [--backend=cpu|cuda] [--model=smollm2|llama8b] "
                   "[--seqs=64] [--tokens=8192] [--iters=10] [--threads=0] [--isa=auto|avx2|avx512]\n"
                   "                     [--quant=kivi2,kivi4,tq2,tq3,tq4] [--attention=auto|own|flashinfer]\n"
                   "                     [--quant_decode=auto|staged|fused]\n",
                   argv[i]);
      return false;
    }
  }
  if (o->seqs < 1 || o->tokens < 128 || o->iters < 1) {
    std::fprintf(stderr, "--seqs >= 1, --tokens >= 128 and --iters >= 1 expected\n");
    return false;
  }
  return true;
}

Geometry geometry_of(const std::string& model) {
  Geometry g;
  g.block_size = 16;
  g.dtype = DType::kFloat16;
  if (model == "llama8b") {  // Llama-3.1-8B
    g.num_layers = 32, g.num_q_heads = 32, g.num_kv_heads = 8, g.head_dim = 128;
  } else {  // SmolLM2-135M
    g.num_layers = 30, g.num_q_heads = 9, g.num_kv_heads = 3, g.head_dim = 64;
  }
  return g;
}

void check(const KernelStatus& st, const char* what) {
  if (!st.is_ok()) {
    std::fprintf(stderr, "%s failed: %s\n", what, st.message.c_str());
    std::exit(1);
  }
}

double process_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

template <typename F>
double seconds_per_call(int iters, F&& f) {
  f();  // warm-up (scratch allocation, first-touch)
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) f();
  return std::chrono::duration<double>(Clock::now() - t0).count() / iters;
}

struct Buffer {
  Backend* backend = nullptr;
  void* ptr = nullptr;
  Buffer(Backend& b, size_t bytes) : backend(&b) { check(b.allocate(std::max<size_t>(bytes, 1), &ptr), "allocate"); }
  ~Buffer() { backend->free(ptr); }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, &o)) return 2;
  std::unique_ptr<Backend> backend;
  if (o.backend == "cuda") {
    CudaAttention attention;
    const KernelStatus st =
        o.attention.empty() ? cuda_attention_from_env(&attention) : parse_cuda_attention(o.attention, &attention);
    if (!st.is_ok()) {
      std::fprintf(stderr, "%s%s\n", o.attention.empty() ? "" : "--attention: ", st.message.c_str());
      return 2;
    }
    CudaQuantDecode quant;
    const KernelStatus qst = o.quant_decode.empty() ? cuda_quant_decode_from_env(&quant)
                                                    : parse_cuda_quant_decode(o.quant_decode, &quant);
    if (!qst.is_ok()) {
      std::fprintf(stderr, "%s%s\n", o.quant_decode.empty() ? "" : "--quant_decode: ", qst.message.c_str());
      return 2;
    }
    std::string why;
    backend = make_cuda_backend(0, attention, quant, &why);
    if (!backend) {
      std::printf("no device: %s\n", why.c_str());
      return 3;
    }
  } else {
    CpuIsa isa;
    if (KernelStatus st = parse_cpu_isa(o.isa, &isa); !st.is_ok()) {
      std::fprintf(stderr, "--isa: %s\n", st.message.c_str());
      return 2;
    }
    std::string why;
    backend = make_cpu_backend(o.threads, isa, &why);
    if (!backend) {
      std::fprintf(stderr, "%s\n", why.c_str());
      return 2;
    }
  }
  const Geometry g = geometry_of(o.model);
  const int blocks_per_seq = (o.tokens + g.block_size - 1) / g.block_size;
  // Quantized blocks (--quant) after the fp16 ones and a gather's destination, enough for the format
  // with the fewest tokens per block; every format reuses them.
  auto quantized_tokens = [&](int tpb) { return tpb > 0 ? std::max(0, o.tokens - kResidual) / tpb * tpb : 0; };
  int quant_blocks_per_seq = 0;
  for (const auto& [name, f] : o.quant) {
    const int tpb = backend->quantized_tokens_per_block(g, f);
    if (tpb > 0) quant_blocks_per_seq = std::max(quant_blocks_per_seq, quantized_tokens(tpb) / tpb);
  }
  const int quant_base = o.seqs * blocks_per_seq + 64;
  const int total_blocks = quant_base + o.seqs * quant_blocks_per_seq;
  std::printf("# backend %s | model %s: %d layers, %d/%d heads, head_dim %d, fp16 | %d sequences x %d tokens | pool %.2f GiB\n",
              backend->description().c_str(), o.model.c_str(), g.num_layers, g.num_q_heads, g.num_kv_heads,
              g.head_dim, o.seqs, o.tokens, double(total_blocks) * g.block_bytes() / (1 << 30));

  Buffer pool(*backend, size_t(total_blocks) * g.block_bytes());
  std::vector<int32_t> table(size_t(o.seqs) * blocks_per_seq), offset(o.seqs + 1), len(o.seqs, o.tokens);
  std::iota(table.begin(), table.end(), 0);
  std::mt19937 rng(1);
  std::shuffle(table.begin(), table.end(), rng);  // scattered blocks, as a long-running pool has
  for (int s = 0; s <= o.seqs; ++s) offset[s] = s * blocks_per_seq;
  PagedKV kv;
  kv.pool = pool.ptr;
  kv.geometry = g;
  kv.block_table = table.data();
  kv.table_offset = offset.data();
  kv.seq_len = len.data();
  kv.num_seqs = o.seqs;

  // One sequence's random K/V, written into every sequence (device to device on a GPU backend).
  const size_t seq_elems = size_t(g.num_layers) * o.tokens * g.kv_token_elems();
  {
    std::vector<uint16_t> host(seq_elems);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (auto& h : host) h = float_to_half(dist(rng));
    Buffer k(*backend, seq_elems * 2), v(*backend, seq_elems * 2);
    check(backend->copy_in(k.ptr, host.data(), seq_elems * 2), "copy_in");
    for (auto& h : host) h = float_to_half(dist(rng));
    check(backend->copy_in(v.ptr, host.data(), seq_elems * 2), "copy_in");
    for (int s = 0; s < o.seqs; ++s)
      check(backend->write_kv(kv, s, 0, o.tokens, 0, g.num_layers, k.ptr, v.ptr), "write_kv");
  }

  // Decode: one query per sequence, device-resident like a worker's staging on the GPU.
  const size_t q_elems = size_t(o.seqs) * g.q_token_elems();
  std::vector<float> qh(q_elems);
  std::uniform_real_distribution<float> qd(-1.0f, 1.0f);
  for (float& x : qh) x = qd(rng);
  Buffer q(*backend, q_elems * 4), out(*backend, q_elems * 4);
  check(backend->copy_in(q.ptr, qh.data(), q_elems * 4), "copy_in");
  const float scale = 1.0f / std::sqrt(float(g.head_dim));
  int layer = 0;
  const double cpu_start = process_cpu_seconds();
  const double t_layer = seconds_per_call(o.iters * g.num_layers, [&] {
    check(backend->decode_attention(kv, layer, q.as<float>(), out.as<float>(), scale), "decode_attention");
    layer = (layer + 1) % g.num_layers;
  });
  const double kv_bytes = double(o.seqs) * o.tokens * g.kv_token_elems() * 2 /*K,V*/ * 2 /*fp16*/;
  std::printf("decode_layer_us %.1f us\n", t_layer * 1e6);
  std::printf("decode_step_ms %.3f ms\n", t_layer * g.num_layers * 1e3);
  std::printf("decode_bandwidth %.1f GB/s\n", kv_bytes / t_layer / 1e9);
  // Per second of this process's CPU time (warm-up included): on a shared machine this moves less
  // than wall time when other work takes the cores (with --threads=1, no idle team counts).
  const double cpu_seconds = process_cpu_seconds() - cpu_start;
  std::printf("decode_bandwidth_per_cpu_second %.1f GB/s\n",
              kv_bytes * (o.iters * g.num_layers + 1) / cpu_seconds / 1e9);

#if KARAKV_HAVE_CUDA
  if (o.backend == "cuda") {
    // Device copy bandwidth in the same run: bytes read + written per second by cudaMemcpy.
    const size_t bytes = size_t(1) << 30;
    Buffer a(*backend, bytes), b(*backend, bytes);
    const double t_copy = seconds_per_call(o.iters, [&] {
      cudaMemcpy(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice);
      cudaDeviceSynchronize();
    });
    const double copy_bw = 2.0 * bytes / t_copy / 1e9;
    std::printf("copy_bandwidth %.1f GB/s\n", copy_bw);
    std::printf("decode_vs_copy %.3f ratio\n", kv_bytes / t_layer / 1e9 / copy_bw);
  }
#endif

  // Quantized decode: the same queries, the same tokens, the first ones read from quantized blocks.
  if (!o.quant.empty()) {
    std::vector<float> ref(size_t(g.num_layers) * q_elems), got(ref.size());
    for (int l = 0; l < g.num_layers; ++l) {
      check(backend->decode_attention(kv, l, q.as<float>(), out.as<float>(), scale), "decode_attention");
      check(backend->copy_out(ref.data() + l * q_elems, out.ptr, q_elems * 4), "copy_out");
    }
    for (const auto& [name, format] : o.quant) {
      const int tpb = backend->quantized_tokens_per_block(g, format);
      const int nq = quantized_tokens(tpb);
      if (tpb <= 0 || nq == 0) {
        std::printf("# quant %s: nothing to quantize (%d tokens per block, %d tokens, residual %d)\n", name.c_str(),
                    tpb, o.tokens, kResidual);
        continue;
      }
      std::vector<int32_t> qtable, qoffset(1, 0), ttable, toffset(1, 0), tlen(o.seqs, o.tokens - nq);
      for (int s = 0; s < o.seqs; ++s) {
        for (int i = 0; i < nq / tpb; ++i) qtable.push_back(quant_base + s * quant_blocks_per_seq + i);
        qoffset.push_back(int32_t(qtable.size()));
        ttable.insert(ttable.end(), table.begin() + size_t(s) * blocks_per_seq + nq / g.block_size,
                      table.begin() + size_t(s + 1) * blocks_per_seq);
        toffset.push_back(int32_t(ttable.size()));
      }
      QuantizedKV qkv;
      qkv.format = format;
      qkv.tokens_per_block = tpb;
      qkv.seed = 0x6b617261ull;
      qkv.block_table = qtable.data();
      qkv.table_offset = qoffset.data();
      const auto tq = Clock::now();
      for (int s = 0; s < o.seqs; ++s) {
        for (int i = 0; i < nq / tpb; ++i) {
          check(backend->quantize_tokens(kv, s, i * tpb, qkv, qtable[qoffset[s] + i]), "quantize_tokens");
        }
      }
      const double quantize_s = std::chrono::duration<double>(Clock::now() - tq).count();
      PagedKV tail = kv;
      tail.block_table = ttable.data();
      tail.table_offset = toffset.data();
      tail.seq_len = tlen.data();
      for (int l = 0; l < g.num_layers; ++l) {
        check(backend->decode_attention_quantized(tail, qkv, l, q.as<float>(), out.as<float>(), scale, nullptr,
                                                  nullptr, nullptr),
              "decode_attention_quantized");
        check(backend->copy_out(got.data() + l * q_elems, out.ptr, q_elems * 4), "copy_out");
      }
      double err = 0;
      size_t rows_counted = 0;
      for (size_t r = 0; r < ref.size() / g.head_dim; ++r) {
        double num = 0, den = 0;
        for (int c = 0; c < g.head_dim; ++c) {
          const double x = ref[r * g.head_dim + c], d = got[r * g.head_dim + c] - x;
          num += d * d, den += x * x;
        }
        if (den > 0) err += std::sqrt(num / den), ++rows_counted;
      }
      int ql = 0;
      const double t_quant = seconds_per_call(o.iters * g.num_layers, [&] {
        check(backend->decode_attention_quantized(tail, qkv, ql, q.as<float>(), out.as<float>(), scale, nullptr,
                                                  nullptr, nullptr),
              "decode_attention_quantized");
        ql = (ql + 1) % g.num_layers;
      });
      // Bytes of the blocks one layer's attention reads: the quantized blocks' share of this layer
      // (whole runs, codes and scales) plus the fp16 tail.
      const double resident = double(o.seqs) * (double(nq / tpb) * g.block_bytes() / g.num_layers +
                                                 double(o.tokens - nq) * g.kv_token_elems() * 2 * 2);
      std::printf("# quant %s: %d tokens per block, %d of %d tokens quantized per sequence, quantize %.2f s\n",
                  name.c_str(), tpb, nq, o.tokens, quantize_s);
      std::printf("quant_%s_layer_us %.1f us\n", name.c_str(), t_quant * 1e6);
      std::printf("quant_%s_vs_fp16 %.3f ratio\n", name.c_str(), t_quant / t_layer);
      std::printf("quant_%s_bandwidth %.1f GB/s\n", name.c_str(), resident / t_quant / 1e9);
      std::printf("quant_%s_rel_err %.4f mean\n", name.c_str(), rows_counted ? err / rows_counted : 0.0);
    }
  }

  // One Kara tick for sequence 0: the window is its last W tokens.
  const int W = 128, B = 32, k_cand = 16, max_gap = 8;
  const int rows = g.num_layers * g.num_kv_heads;
  std::vector<float> wq(size_t(W) * g.q_token_elems());
  for (float& x : wq) x = qd(rng);
  Buffer wqb(*backend, wq.size() * 4), wout(*backend, size_t(g.num_kv_heads) * W * 4);
  check(backend->copy_in(wqb.ptr, wq.data(), wq.size() * 4), "copy_in");
  std::vector<float> scores(size_t(rows) * W);  // [layer][KV head][W], as Kara's plan collects them
  std::vector<int32_t> kept(size_t(rows) * B), dst(B / g.block_size);
  for (int i = 0; i < int(dst.size()); ++i) dst[i] = o.seqs * blocks_per_seq + i;
  const double t_tick = seconds_per_call(o.iters, [&] {
    for (int l = 0; l < g.num_layers; ++l) {
      check(backend->window_scores(kv, 0, l, o.tokens - W, W, wqb.as<float>(), scale, wout.as<float>()), "window_scores");
      check(backend->copy_out(scores.data() + size_t(l) * g.num_kv_heads * W, wout.ptr, size_t(g.num_kv_heads) * W * 4),
            "copy_out");
    }
    check(backend->token2chunk(scores.data(), rows, W, B, k_cand, max_gap, kept.data()), "token2chunk");
    for (int32_t& slot : kept) slot += o.tokens - W;
    check(backend->gather_tokens(kv, 0, kept.data(), B, dst.data()), "gather_tokens");
  });
  std::printf("kara_tick_ms %.3f ms\n", t_tick * 1e3);
  std::printf("kara_tick_vs_decode_step %.3f ratio\n", t_tick / (t_layer * g.num_layers));

  // The selections alone, every (layer, KV head) row in one call, at the shapes Kara's defaults make
  // them: a window (W 128 -> B 32, 16 candidates) and a budget re-rank (fit 1, budget 768, R 256:
  // the 528 tokens older than the recent region down to 512, 256 candidates), with the same row
  // by top_k as H2O-like policies cut it. Scores are lognormal, as accumulated attention is: a few
  // large, most small, ties rare. The scores are host memory, as Kara's plans pass them: on the
  // CUDA backend the times include their upload, the copy back and a wait.
  std::lognormal_distribution<float> attention_like(-6.0f, 1.5f);
  struct Select { const char* name; int n, keep, candidates; };
  for (const Select s : {Select{"window", W, B, k_cand}, Select{"rerank", 528, 512, 256}}) {
    std::vector<float> sel(size_t(rows) * s.n);
    for (float& x : sel) x = attention_like(rng);
    std::vector<int32_t> picked(size_t(rows) * s.keep);
    const int reps = std::max(20, o.iters * 20);
    const double t_t2c = seconds_per_call(reps, [&] {
      check(backend->token2chunk(sel.data(), rows, s.n, s.keep, s.candidates, max_gap, picked.data()), "token2chunk");
    });
    const double t_topk = seconds_per_call(reps, [&] {
      check(backend->top_k(sel.data(), rows, s.n, s.keep, picked.data()), "top_k");
    });
    std::printf("# select %s: %d rows of %d scores, keep %d (%d candidates, max_gap %d)\n", s.name, rows, s.n, s.keep,
                s.candidates, max_gap);
    std::printf("select_%s_token2chunk_us %.1f us\n", s.name, t_t2c * 1e6);
    std::printf("select_%s_top_k_us %.1f us\n", s.name, t_topk * 1e6);
  }
  return 0;
}
