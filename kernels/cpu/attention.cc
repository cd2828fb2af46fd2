// The CPU attention entry point, and its baseline variant: the vector loops of the build's target
// (AVX2 + FMA + F16C on x86-64 by default, scalar elsewhere). attend_heads sizes the scratch and
// runs the variant the backend chose (this one, or AVX-512 from attention_avx512.cc).
// Decode is memory bound only if the arithmetic per byte keeps up: 16-bit storage is widened in
// registers (F16C, or a shift for bf16), accumulated in fp32 with FMA, and the next block is
// prefetched because the hardware prefetcher cannot guess where it is.
#include "attention.h"

#include <algorithm>

#include "../common/dispatch.h"
#include "simd.h"

#define KARAKV_ATTENTION_VARIANT baseline
#include "attention_impl.h"

namespace karakv::kernels::cpu {
namespace baseline {
namespace {

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


// The policy attention_impl.h runs with.
struct Isa {
  template <DType D, int G, int HD>
  static void score_run(const storage_t<D>* k, int len, int head_dim, const float* q, float* scores, size_t stride,
                        PrefetchStream& pf) {
    baseline::score_run<D, G, HD>(k, len, head_dim, q, scores, stride, pf);
  }
  template <DType D, int G, int HD>
  static void accumulate_run(const storage_t<D>* v, int len, int head_dim, const float* w, size_t stride, float* acc,
                             PrefetchStream& pf) {
    baseline::accumulate_run<D, G, HD>(v, len, head_dim, w, stride, acc, pf);
  }
  static float max_of(const float* s, int n) { return cpu::max_of(s, n); }
  static float exp_shifted_sum(float* s, int n, float max) { return cpu::exp_shifted_sum(s, n, max); }
};

}  // namespace

void attend_heads(const PagedKV& kv, int seq, int layer, int kv_head_begin, int num_kv_heads, int num_tokens,
                  const float* q, float* out, float scale, const AttentionBuffers& scratch) {
  // The caller validated the geometry (common::check_geometry), so the dtype is one the dispatch
  // knows and its status is always OK.
  common::dispatch_dtype(kv.geometry.dtype, [&](auto dtype) {
    constexpr DType D = decltype(dtype)::value;
    // Common head dims get fully unrolled loops; any other (HD 0) runs the same code with runtime bounds.
    common::dispatch_head_dim(kv.geometry.head_dim, [&](auto head_dim) {
      constexpr int HD = decltype(head_dim)::value;
      attend_heads_typed<Isa, D, HD>(kv, seq, layer, kv_head_begin, num_kv_heads, num_tokens, q, out, scale, scratch);
    });
  });
}

}  // namespace baseline

void attend_heads(const PagedKV& kv, int seq, int layer, int kv_head_begin, int num_kv_heads, int num_tokens,
                  const float* q, float* out, float scale, AttentionScratch& scratch, CpuIsa isa, float* lse,
                  LogitRows logits) {
  const Geometry& geo = kv.geometry;
  const size_t q_elems = size_t(num_kv_heads) * geo.group_size() * geo.head_dim;
  const size_t num_q_heads = size_t(num_kv_heads) * geo.group_size();
  const size_t stride = size_t(std::max(1, std::min(attention_chunk_tokens(geo.block_size), num_tokens)));
  scratch.scores.resize(num_q_heads * stride);
  scratch.query.resize(q_elems);
  scratch.acc.resize(q_elems);
  scratch.max.resize(num_q_heads);
  scratch.sum.resize(num_q_heads);
  const AttentionBuffers buffers{scratch.scores.data(), scratch.query.data(), scratch.acc.data(),
                                 scratch.max.data(),    scratch.sum.data(),   stride,
                                 logits};
#if KARAKV_HAVE_AVX512_ATTENTION
  if (isa == CpuIsa::kAvx512) {
    avx512::attend_heads(kv, seq, layer, kv_head_begin, num_kv_heads, num_tokens, q, out, scale, buffers);
  } else
#endif
  {
    baseline::attend_heads(kv, seq, layer, kv_head_begin, num_kv_heads, num_tokens, q, out, scale, buffers);
  }
  // The online softmax leaves each head's max (of the pre-scaled logits) and sum in the scratch.
  if (lse != nullptr && num_tokens > 0) {
    for (size_t h = 0; h < num_q_heads; ++h) lse[h] = buffers.max[h] + std::log(buffers.sum[h]);
  }
}

}  // namespace karakv::kernels::cpu
