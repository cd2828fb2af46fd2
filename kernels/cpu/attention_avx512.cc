// The AVX-512 (F, BW, VL) variant of the CPU attention, run where the CPU has it (CpuIsa::kAvx512,
// chosen when the backend is made). Only this file is compiled with -mavx512*; it includes no
// header with inline code of the rest of the library (simd.h, half.h), and attention_impl.h uses
// no library templates, so nothing built here can be picked by the linker for an AVX2-only caller.
//
// What it does differently from the AVX2 loops (docs/BENCHMARKS.md, P2, has the profile):
//  - the group's queries stay in registers while K streams by (32 vector registers: 3 heads x 64
//    dims are 12 of them), instead of one load per FMA;
//  - V accumulates a whole head_dim 64 or 128 row per pass, 16 lanes at a time, and the prefetch
//    cursor is a local, so the accumulators stay in registers (the AVX2 loop stores all of them
//    every row, because it steps the cursor through a pointer);
//  - head dims that are not a multiple of 16 use masked loads instead of scalar tails.
// bf16 storage is widened by a shift, like AVX2; AVX512-BF16's vdpbf16ps would need the queries
// and softmax weights rounded to bf16 (8 significant bits), which costs accuracy, not time here.
#include <immintrin.h>

#include "attention.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "attention_avx512.cc needs -mavx512f -mavx512bw -mavx512vl (kernels/CMakeLists.txt sets them)"
#endif

#define KARAKV_ATTENTION_VARIANT avx512
#include "attention_impl.h"

namespace karakv::kernels::cpu::avx512 {
namespace {

// 16 consecutive elements widened to fp32.
template <DType D>
inline __m512 load16(const element_t<D>* p) {
  if constexpr (D == DType::kFloat32) {
    return _mm512_loadu_ps(p);
  } else if constexpr (D == DType::kFloat16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
}

// The elements of `m` widened, zeros elsewhere; masked-off elements are not read (no fault past a
// row's end).
template <DType D>
inline __m512 load16_masked(const element_t<D>* p, __mmask16 m) {
  if constexpr (D == DType::kFloat32) {
    return _mm512_maskz_loadu_ps(m, p);
  } else if constexpr (D == DType::kFloat16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  } else {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
}

inline __mmask16 first_lanes(int n) { return __mmask16((1u << n) - 1); }

// The low and high 256 bits added: 16 partial sums become 8.
inline __m256 fold(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// The query vectors of G heads: held in registers when the head dim is a compile-time constant
// and they fit (G * HD / 16 <= 16 of the 32 registers), else loaded where they are used.
template <int G, int HD, bool kInRegisters = (HD > 0 && HD % 16 == 0 && G * HD / 16 <= 16)>
struct Queries {
  const float* q;
  int hd;
  Queries(const float* q_, int hd_) : q(q_), hd(hd_) {}
  __m512 at(int h, int c) const { return _mm512_loadu_ps(q + h * hd + 16 * c); }
};
template <int G, int HD>
struct Queries<G, HD, true> {
  __m512 v[G][HD / 16];
  Queries(const float* q, int) {
    for (int h = 0; h < G; ++h)
      for (int c = 0; c < HD / 16; ++c) v[h][c] = _mm512_loadu_ps(q + h * HD + 16 * c);
  }
  __m512 at(int h, int c) const { return v[h][c]; }
};

// acc[h] = q[h] . row, 16 lanes of partial sums per head.
template <DType D, int G, int HD, typename Q>
inline void dot_row(const element_t<D>* row, int hd, const Q& qv, const float* q, __m512* acc) {
  const int full = HD > 0 ? HD / 16 : hd / 16;
  const int tail = HD > 0 ? HD % 16 : hd % 16;
  for (int h = 0; h < G; ++h) acc[h] = _mm512_setzero_ps();
  for (int c = 0; c < full; ++c) {
    const __m512 x = load16<D>(row + 16 * c);
    for (int h = 0; h < G; ++h) acc[h] = _mm512_fmadd_ps(x, qv.at(h, c), acc[h]);
  }
  if (tail > 0) {
    const __mmask16 m = first_lanes(tail);
    const __m512 x = load16_masked<D>(row + 16 * full, m);
    for (int h = 0; h < G; ++h) acc[h] = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(m, q + h * hd + 16 * full), acc[h]);
  }
}

// scores[h][t] = q[h] . k[t] for G heads over one contiguous run of K rows (see the baseline's
// score_run in attention.cc for the layout).
template <DType D, int G, int HD>
void score_run(const element_t<D>* k, int len, int head_dim, const float* q, float* scores, size_t stride,
               PrefetchStream& pf_in) {
  const int hd = HD > 0 ? HD : head_dim;
  PrefetchStream pf = pf_in;  // a local: stepping it must not look like a store that may alias
  const Queries<G, HD> qv(q, hd);
  int t = 0;
  // Eight rows at a time: each row's 16 partial sums are folded to 8, and the eight rows are reduced
  // together by horizontal adds as they come (rows 0-1, 2-3, then 0-3, ...), so only a few partial
  // vectors per head are live next to the queries and nothing goes through the stack.
  auto folded_row = [&](int row, __m256* out) {
    pf.step();
    __m512 acc[G];
    dot_row<D, G, HD>(k + size_t(row) * hd, hd, qv, q, acc);
    for (int h = 0; h < G; ++h) out[h] = fold(acc[h]);
  };
  auto four_rows = [&](int row, __m256* out) {  // out[h] lanes: (r0 r0 r1 r1 r2 r2 r3 r3) halves
    __m256 a[G], b[G];
    folded_row(row, a);
    folded_row(row + 1, b);
    for (int h = 0; h < G; ++h) a[h] = _mm256_hadd_ps(a[h], b[h]);
    folded_row(row + 2, b);
    __m256 c[G];
    folded_row(row + 3, c);
    for (int h = 0; h < G; ++h) out[h] = _mm256_hadd_ps(a[h], _mm256_hadd_ps(b[h], c[h]));
  };
  for (; t + 8 <= len; t += 8) {
    __m256 s0123[G], s4567[G];
    four_rows(t, s0123);
    four_rows(t + 4, s4567);
    for (int h = 0; h < G; ++h) {
      _mm256_storeu_ps(scores + h * stride + t,
                       _mm256_add_ps(_mm256_permute2f128_ps(s0123[h], s4567[h], 0x20),
                                     _mm256_permute2f128_ps(s0123[h], s4567[h], 0x31)));
    }
  }
  for (; t < len; ++t) {
    pf.step();
    __m512 acc[G];
    dot_row<D, G, HD>(k + size_t(t) * hd, hd, qv, q, acc);
    for (int h = 0; h < G; ++h) scores[h * stride + t] = _mm512_reduce_add_ps(acc[h]);
  }
  pf_in = pf;
}

// acc[h][d0, d0 + 16P) += sum_t w[h][t] * v[t][d0, d0 + 16P): P vectors per head held in registers
// for the whole run; with kTail the last vector covers only the lanes of `last` (a head dim's tail).
template <DType D, int G, int P, bool kTail>
inline void accumulate_piece(const element_t<D>* v, int len, int hd, int d0, const float* w, size_t stride,
                             float* acc, PrefetchStream* pf_in, __mmask16 last) {
  PrefetchStream pf;
  if (pf_in != nullptr) pf = *pf_in;
  auto load_acc = [&](const float* p, int c) {
    return kTail && c == P - 1 ? _mm512_maskz_loadu_ps(last, p) : _mm512_loadu_ps(p);
  };
  __m512 a[G][P];
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < P; ++c) a[h][c] = load_acc(acc + h * hd + d0 + 16 * c, c);
  for (int t = 0; t < len; ++t) {
    pf.step();
    const element_t<D>* row = v + size_t(t) * hd + d0;
    __m512 wt[G];
    for (int h = 0; h < G; ++h) wt[h] = _mm512_set1_ps(w[h * stride + t]);
    for (int c = 0; c < P; ++c) {
      const __m512 x = kTail && c == P - 1 ? load16_masked<D>(row + 16 * c, last) : load16<D>(row + 16 * c);
      for (int h = 0; h < G; ++h) a[h][c] = _mm512_fmadd_ps(x, wt[h], a[h][c]);
    }
  }
  for (int h = 0; h < G; ++h) {
    for (int c = 0; c < P; ++c) {
      float* p = acc + h * hd + d0 + 16 * c;
      if (kTail && c == P - 1) _mm512_mask_storeu_ps(p, last, a[h][c]);
      else _mm512_storeu_ps(p, a[h][c]);
    }
  }
  if (pf_in != nullptr) *pf_in = pf;
}

// acc[h] += sum_t w[h][t] * v[t] for G heads over one contiguous run of V rows.
template <DType D, int G, int HD>
void accumulate_run(const element_t<D>* v, int len, int head_dim, const float* w, size_t stride, float* acc,
                    PrefetchStream& pf) {
  const int hd = HD > 0 ? HD : head_dim;
  // G * P accumulators + G weights + one V vector within the 32 registers: a whole row of head dim
  // 64 (P = 4) or 128 (P = 8) per pass for up to 3 heads.
  constexpr int P = G <= 3 ? 8 : 4;
  const int full = HD > 0 ? HD / 16 : hd / 16;
  const int tail = HD > 0 ? HD % 16 : hd % 16;
  // The prefetch steps once per row: in the first pass only.
  int c0 = 0;
  for (; c0 + P <= full; c0 += P)
    accumulate_piece<D, G, P, false>(v, len, hd, 16 * c0, w, stride, acc, c0 == 0 ? &pf : nullptr, 0);
  if constexpr (P > 4) {
    if (c0 + 4 <= full) {
      accumulate_piece<D, G, 4, false>(v, len, hd, 16 * c0, w, stride, acc, c0 == 0 ? &pf : nullptr, 0);
      c0 += 4;
    }
  }
  // (Left out where the head dim is known to need no single vectors: GCC 12 warns about the dead loop.)
  if constexpr (HD == 0 || HD % 64 != 0) {
    for (; c0 < full; ++c0)
      accumulate_piece<D, G, 1, false>(v, len, hd, 16 * c0, w, stride, acc, c0 == 0 ? &pf : nullptr, 0);
    if (tail > 0)
      accumulate_piece<D, G, 1, true>(v, len, hd, 16 * c0, w, stride, acc, c0 == 0 ? &pf : nullptr, first_lanes(tail));
  }
}

// e^x for x <= 0, the AVX2 loop's Cephes polynomial (simd.h) on 16 lanes; below -87.3 gives 0,
// NaN gives NaN.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 given = x;
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mask_mov_ps(_mm512_maskz_mul_ps(normal, y, _mm512_castsi512_ps(e)), nan, given);
}

struct Isa {
  template <DType D, int G, int HD>
  static void score_run(const element_t<D>* k, int len, int head_dim, const float* q, float* scores, size_t stride,
                        PrefetchStream& pf) {
    avx512::score_run<D, G, HD>(k, len, head_dim, q, scores, stride, pf);
  }
  template <DType D, int G, int HD>
  static void accumulate_run(const element_t<D>* v, int len, int head_dim, const float* w, size_t stride, float* acc,
                             PrefetchStream& pf) {
    avx512::accumulate_run<D, G, HD>(v, len, head_dim, w, stride, acc, pf);
  }
  // n >= 1.
  static float max_of(const float* s, int n) {
    __m512 m = _mm512_set1_ps(s[0]);
    int i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + i));
    if (i < n) {
      const __mmask16 k = first_lanes(n - i);
      m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, s + i));
    }
    return _mm512_reduce_max_ps(m);
  }
  // Replaces s[0, n) by exp(s - max) and returns their sum; every s[i] <= max.
  static float exp_shifted_sum(float* s, int n, float max) {
    const __m512 mv = _mm512_set1_ps(max);
    __m512 sum = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv));
      _mm512_storeu_ps(s + i, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (i < n) {
      const __mmask16 k = first_lanes(n - i);
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv));
      _mm512_mask_storeu_ps(s + i, k, e);
      sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
  }
};

template <DType D>
void attend_heads_dtype(const PagedKV& kv, int seq, int layer, int kv_head_begin, int num_kv_heads, int num_tokens,
                        const float* q, float* out, float scale, const AttentionBuffers& scratch) {
  switch (kv.geometry.head_dim) {
    case 64:
      attend_heads_typed<Isa, D, 64>(kv, seq, layer, kv_head_begin, num_kv_heads, num_tokens, q, out, scale, scratch);
      break;
    case 128:
      attend_heads_typed<Isa, D, 128>(kv, seq, layer, kv_head_begin, num_kv_heads, num_tokens, q, out, scale, scratch);
      break;
    default:
      attend_heads_typed<Isa, D, 0>(kv, seq, layer, kv_head_begin, num_kv_heads, num_tokens, q, out, scale, scratch);
  }
}

}  // namespace

// The dtype and head dim switches are written out rather than taken from common/dispatch.h,
// whose KernelStatus results would instantiate std::string code in this file.
void attend_heads(const PagedKV& kv, int seq, int layer, int kv_head_begin, int num_kv_heads, int num_tokens,
                  const float* q, float* out, float scale, const AttentionBuffers& scratch) {
  switch (kv.geometry.dtype) {
    case DType::kFloat32:
      attend_heads_dtype<DType::kFloat32>(kv, seq, layer, kv_head_begin, num_kv_heads, num_tokens, q, out, scale,
                                          scratch);
      break;
    case DType::kFloat16:
      attend_heads_dtype<DType::kFloat16>(kv, seq, layer, kv_head_begin, num_kv_heads, num_tokens, q, out, scale,
                                          scratch);
      break;
    case DType::kBFloat16:
      attend_heads_dtype<DType::kBFloat16>(kv, seq, layer, kv_head_begin, num_kv_heads, num_tokens, q, out, scale,
                                           scratch);
      break;
  }
}

}  // namespace karakv::kernels::cpu::avx512
