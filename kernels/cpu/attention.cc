// Paged GQA attention on the CPU. The sequence's blocks go in chunks of about 512 tokens, each in
// two passes: scores from K (all query heads of a group per K row, so K is read from memory once),
// then V weighted by their softmax numerators (again once per group), folded into a running max,
// sum and output (the online softmax), so the scratch does not grow with the sequence. Each
// block's (layer, head) run is block_size * head_dim contiguous elements and stays in L1 while the
// group's heads use it.
// Decode is memory bound, so the loops aim at streaming K/V at full bandwidth: 16-bit storage is
// widened in registers (F16C, or a shift for bf16), accumulated in fp32 with FMA, and the next
// block is prefetched because the hardware prefetcher cannot guess where it is.
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "../common/dispatch.h"
#include "simd.h"

namespace karakv::kernels::cpu {
namespace {

// How many regions ahead of the one being computed are prefetched (see attend_heads_typed). One is
// enough once prefetches are spread over the rows; more only competes for the miss buffers.
constexpr int kPrefetchRegions = 1;

// An asm statement on x86: GCC's IPA pass deems a function wrapping only __builtin_prefetch free of
// side effects and deletes the calls, which silently removed every prefetch.
inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#elif defined(__GNUC__)
  __builtin_prefetch(p, 0, 3);
#endif
}

// Prefetches a region a few lines at a time, spread over the rows of the block being computed:
// issuing a whole region at once fills the core's miss buffers and stalls the arithmetic behind
// it, while a trickle keeps both memory and FMA units busy.
struct PrefetchStream {
  const char* next = nullptr;
  const char* end = nullptr;
  int lines_per_step = 0;

  void step() {
    for (int i = 0; i < lines_per_step && next < end; ++i, next += 64) prefetch_line(next);
  }
  void finish() {
    for (; next < end; next += 64) prefetch_line(next);
  }
};

// Splits a group's query heads into chunks of 1..4 heads that each get a specialised loop (the
// accumulators of one chunk fit in registers); chunks of 3 are preferred over a leftover of 1.
template <typename F>
void for_head_chunks(int group_size, F&& f) {
  for (int h0 = 0; h0 < group_size;) {
    const int left = group_size - h0;
    const int chunk = left <= 4 ? left : (left % 4 == 0 ? 4 : 3);
    switch (chunk) {
      case 1: f(h0, std::integral_constant<int, 1>{}); break;
      case 2: f(h0, std::integral_constant<int, 2>{}); break;
      case 3: f(h0, std::integral_constant<int, 3>{}); break;
      default: f(h0, std::integral_constant<int, 4>{}); break;
    }
    h0 += chunk;
  }
}

// scores[h][t] = q[h] . k[t] for G heads over one contiguous run of K rows. HD > 0 is the head
// dim as a compile-time constant (loops unroll fully); HD == 0 reads it from head_dim.
//   k:      [len][head_dim] storage
//   q:      [G][head_dim] fp32, already scaled
//   scores: [G][stride] fp32, written at columns [0, len)
template <DType D, int G, int HD>
void score_run(const storage_t<D>* k, int len, int head_dim, const float* q, float* scores,
               size_t stride, PrefetchStream& pf) {
  const int hd = HD > 0 ? HD : head_dim;
  int t = 0;
#if KARAKV_CPU_AVX2
  const int hd8 = hd & ~7;
  if (hd8 == hd) {
    // Eight rows at a time: their per-row partial sums are reduced together by one transpose-add
    // instead of eight horizontal sums.
    for (; t + 8 <= len; t += 8) {
      __m256 part[G][8];
      for (int u = 0; u < 8; ++u) {
        pf.step();
        const storage_t<D>* row = k + size_t(t + u) * hd;
        __m256 acc[G];
        for (int h = 0; h < G; ++h) acc[h] = _mm256_setzero_ps();
        for (int d = 0; d < hd8; d += 8) {
          const __m256 x = load8<D>(row + d);
          for (int h = 0; h < G; ++h) acc[h] = _mm256_fmadd_ps(x, _mm256_loadu_ps(q + h * hd + d), acc[h]);
        }
        for (int h = 0; h < G; ++h) part[h][u] = acc[h];
      }
      for (int h = 0; h < G; ++h) _mm256_storeu_ps(scores + h * stride + t, transpose_sum8(part[h]));
    }
  }
  for (; t < len; ++t) {
    pf.step();
    const storage_t<D>* row = k + size_t(t) * hd;
    __m256 acc[G];
    for (int h = 0; h < G; ++h) acc[h] = _mm256_setzero_ps();
    for (int d = 0; d < hd8; d += 8) {
      const __m256 x = load8<D>(row + d);
      for (int h = 0; h < G; ++h) acc[h] = _mm256_fmadd_ps(x, _mm256_loadu_ps(q + h * hd + d), acc[h]);
    }
    for (int h = 0; h < G; ++h) {
      float s = hsum(acc[h]);
      for (int d = hd8; d < hd; ++d) s += load1<D>(row + d) * q[h * hd + d];
      scores[h * stride + t] = s;
    }
  }
#else
  for (; t < len; ++t) {
    pf.step();
    const storage_t<D>* row = k + size_t(t) * hd;
    float acc[G] = {};
    for (int d = 0; d < hd; ++d) {
      const float x = load1<D>(row + d);
      for (int h = 0; h < G; ++h) acc[h] += x * q[h * hd + d];
    }
    for (int h = 0; h < G; ++h) scores[h * stride + t] = acc[h];
  }
#endif
}

#if KARAKV_CPU_AVX2
// acc[h][d0, d0 + 8P) += sum_t w[h][t] * v[t][d0, d0 + 8P): P vectors per head held in registers
// for the whole run.
template <DType D, int G, int P>
inline void accumulate_piece(const storage_t<D>* v, int len, int hd, int d0, const float* w,
                             size_t stride, float* acc, PrefetchStream* pf) {
  __m256 a[G][P];
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < P; ++c) a[h][c] = _mm256_loadu_ps(acc + h * hd + d0 + 8 * c);
  for (int t = 0; t < len; ++t) {
    if (pf != nullptr) pf->step();
    const storage_t<D>* row = v + size_t(t) * hd + d0;
    __m256 wt[G];
    for (int h = 0; h < G; ++h) wt[h] = _mm256_broadcast_ss(w + h * stride + t);
    for (int c = 0; c < P; ++c) {
      const __m256 x = load8<D>(row + 8 * c);
      for (int h = 0; h < G; ++h) a[h][c] = _mm256_fmadd_ps(x, wt[h], a[h][c]);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < P; ++c) _mm256_storeu_ps(acc + h * hd + d0 + 8 * c, a[h][c]);
}
#endif

// acc[h] += sum_t w[h][t] * v[t] for G heads over one contiguous run of V rows (HD as above).
//   v:   [len][head_dim] storage
//   w:   [G][stride] fp32 softmax numerators, columns [0, len)
//   acc: [G][head_dim] fp32
template <DType D, int G, int HD>
void accumulate_run(const storage_t<D>* v, int len, int head_dim, const float* w, size_t stride,
                    float* acc, PrefetchStream& pf) {
  const int hd = HD > 0 ? HD : head_dim;
  int d0 = 0;
#if KARAKV_CPU_AVX2
  // G * P accumulators + G weights + one V vector must fit the 16 ymm registers.
  constexpr int P = G <= 3 ? 4 : 2;
  const int hd8 = hd & ~7;
  // Prefetch steps once per row: in the first piece only.
  for (; d0 + 8 * P <= hd8; d0 += 8 * P)
    accumulate_piece<D, G, P>(v, len, hd, d0, w, stride, acc, d0 == 0 ? &pf : nullptr);
  for (; d0 < hd8; d0 += 8) accumulate_piece<D, G, 1>(v, len, hd, d0, w, stride, acc, d0 == 0 ? &pf : nullptr);
#endif
  if (d0 == 0) pf.finish();  // no vector piece ran
  for (; d0 < hd; ++d0) {
    for (int h = 0; h < G; ++h) {
      float s = acc[h * hd + d0];
      for (int t = 0; t < len; ++t) s += w[h * stride + t] * load1<D>(v + size_t(t) * hd + d0);
      acc[h * hd + d0] = s;
    }
  }
}

template <DType D, int HD>
void attend_heads_typed(const PagedKV& kv, int seq, int layer, int kv_head_begin, int num_kv_heads,
                        int num_tokens, const float* q, float* out, float scale,
                        AttentionScratch& scratch) {
  const Geometry& geo = kv.geometry;
  const int g = geo.group_size();
  const int hd = geo.head_dim;
  const int bs = geo.block_size;
  const int num_q_heads = num_kv_heads * g;
  const size_t q_elems = size_t(num_q_heads) * hd;
  if (num_tokens <= 0) {
    std::fill(out, out + q_elems, 0.0f);
    return;
  }
  const auto* pool = static_cast<const storage_t<D>*>(kv.pool);
  // Tokens go in chunks of whole blocks; each chunk's scores are folded into a running max, sum and
  // output (the online softmax), so the scratch is [query heads][chunk] whatever the length.
  const int chunk_tokens = attention_chunk_tokens(bs);
  const int chunk_blocks = chunk_tokens / bs;
  const size_t stride = size_t(std::min(chunk_tokens, num_tokens));

  scratch.scores.resize(size_t(num_q_heads) * stride);
  scratch.query.resize(q_elems);
  scratch.acc.assign(q_elems, 0.0f);
  scratch.max.assign(num_q_heads, 0.0f);
  scratch.sum.assign(num_q_heads, 0.0f);
  float* scores = scratch.scores.data();
  float* query = scratch.query.data();
  float* acc = scratch.acc.data();
  float* max = scratch.max.data();
  float* sum = scratch.sum.data();
  // Scaling q once is cheaper than scaling every score.
  for (size_t i = 0; i < q_elems; ++i) query[i] = q[i] * scale;

  // In each block the runs of consecutive KV heads are adjacent, so the task's heads form one
  // contiguous region per (block, K or V). Regions are read chunk by chunk: the chunk's K regions,
  // then its V regions. Consecutive blocks are far apart in the pool (a block holds every layer),
  // so the hardware prefetcher stops at each region's end; prefetching kPrefetchRegions ahead (into
  // the next chunk at a chunk's end) keeps misses in flight instead of paying DRAM latency per region.
  const int num_blocks = (num_tokens + bs - 1) / bs;
  const size_t run_elems = size_t(bs) * hd;
  const size_t region_bytes = num_kv_heads * run_elems * sizeof(storage_t<D>);
  auto region = [&](int r) {
    // Every chunk before the last is full, so r's chunk is r / (2 * chunk_blocks).
    const int first = r / (2 * chunk_blocks) * chunk_blocks;
    const int blocks = std::min(chunk_blocks, num_blocks - first);
    const int in_chunk = r - 2 * first;
    const int k_or_v = in_chunk < blocks ? 0 : 1;
    const int b = first + in_chunk - k_or_v * blocks;
    return pool + kv.run_offset(kv.block_of(seq, b * bs), layer, k_or_v, kv_head_begin);
  };
  // Each block's rows prefetch region r + kPrefetchRegions, one step per row of each head.
  const int lines_per_step = int((region_bytes / 64 + size_t(bs) * num_kv_heads - 1) / (size_t(bs) * num_kv_heads));
  auto prefetch_stream = [&](int r) {
    PrefetchStream pf;
    if (r < 2 * num_blocks) {
      pf.next = reinterpret_cast<const char*>(region(r));
      pf.end = pf.next + region_bytes;
      pf.lines_per_step = lines_per_step;
    }
    return pf;
  };
  for (int r = 0; r < kPrefetchRegions; ++r) prefetch_stream(r).finish();

  int r = 0;  // the region being read
  for (int c0 = 0; c0 < num_tokens; c0 += chunk_tokens) {
    const int chunk_len = std::min(chunk_tokens, num_tokens - c0);
    for (int t0 = 0; t0 < chunk_len; t0 += bs, ++r) {
      PrefetchStream pf = prefetch_stream(r + kPrefetchRegions);
      const int len = std::min(bs, chunk_len - t0);
      const storage_t<D>* k = region(r);
      for (int i = 0; i < num_kv_heads; ++i) {
        for_head_chunks(g, [&](int h0, auto heads) {
          const int qh = i * g + h0;
          score_run<D, decltype(heads)::value, HD>(k + i * run_elems, len, hd, query + size_t(qh) * hd,
                                                   scores + size_t(qh) * stride + t0, stride, pf);
        });
      }
      pf.finish();
    }

    // Fold the chunk in: a larger max rescales what was accumulated under the old one. The first
    // chunk (sum still 0) takes its own max, so a single chunk is the plain two-pass softmax.
    for (int h = 0; h < num_q_heads; ++h) {
      float* row = scores + size_t(h) * stride;
      const float chunk_max = max_of(row, chunk_len);
      if (c0 == 0) {
        max[h] = chunk_max;
      } else if (chunk_max > max[h]) {
        const float factor = std::exp(max[h] - chunk_max);
        for (int d = 0; d < hd; ++d) acc[size_t(h) * hd + d] *= factor;
        sum[h] *= factor;
        max[h] = chunk_max;
      }
      sum[h] += exp_shifted_sum(row, chunk_len, max[h]);
    }

    for (int t0 = 0; t0 < chunk_len; t0 += bs, ++r) {
      PrefetchStream pf = prefetch_stream(r + kPrefetchRegions);
      const int len = std::min(bs, chunk_len - t0);
      const storage_t<D>* v = region(r);
      for (int i = 0; i < num_kv_heads; ++i) {
        for_head_chunks(g, [&](int h0, auto heads) {
          const int qh = i * g + h0;
          accumulate_run<D, decltype(heads)::value, HD>(v + i * run_elems, len, hd, scores + size_t(qh) * stride + t0,
                                                        stride, acc + size_t(qh) * hd, pf);
        });
      }
      pf.finish();
    }
  }

  for (int h = 0; h < num_q_heads; ++h) {
    const float inv = 1.0f / sum[h];
    for (int d = 0; d < hd; ++d) out[size_t(h) * hd + d] = acc[size_t(h) * hd + d] * inv;
  }
}

}  // namespace

void attend_heads(const PagedKV& kv, int seq, int layer, int kv_head_begin, int num_kv_heads,
                  int num_tokens, const float* q, float* out, float scale,
                  AttentionScratch& scratch) {
  // The caller validated the geometry (common::check_geometry), so the dtype is one the dispatch
  // knows and its status is always OK.
  common::dispatch_dtype(kv.geometry.dtype, [&](auto dtype) {
    constexpr DType D = decltype(dtype)::value;
    // Common head dims get fully unrolled loops; any other (HD 0) runs the same code with runtime bounds.
    common::dispatch_head_dim(kv.geometry.head_dim, [&](auto head_dim) {
      constexpr int HD = decltype(head_dim)::value;
      attend_heads_typed<D, HD>(kv, seq, layer, kv_head_begin, num_kv_heads, num_tokens, q, out, scale, scratch);
    });
  });
}

}  // namespace karakv::kernels::cpu
