// Element access for the three storage dtypes: scalar loads everywhere, plus AVX2/FMA/F16C helpers
// (8-wide loads that widen to fp32, horizontal sum, exp) when the compiler targets them.
#pragma once

#include <algorithm>
#include <cmath>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "karakv/kernels/half.h"
#include "karakv/kernels/types.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KARAKV_CPU_AVX2 1
#include <immintrin.h>
#else
#define KARAKV_CPU_AVX2 0
#endif

namespace karakv::kernels::cpu {

// Storage element type per dtype; 16-bit types stay raw bits until widened.
template <DType D> struct Storage { using type = uint16_t; };
template <> struct Storage<DType::kFloat32> { using type = float; };
template <DType D> using storage_t = typename Storage<D>::type;

template <DType D>
inline float load1(const storage_t<D>* p) {
  if constexpr (D == DType::kFloat32) return *p;
  else if constexpr (D == DType::kFloat16) return half_to_float(*p);
  else return bf16_to_float(*p);
}

#if KARAKV_CPU_AVX2
// Loads 8 consecutive elements widened to fp32 (unaligned is fine: runs need not be 32 B aligned).
template <DType D>
inline __m256 load8(const storage_t<D>* p) {
  if constexpr (D == DType::kFloat32) {
    return _mm256_loadu_ps(p);
  } else if constexpr (D == DType::kFloat16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    // bf16 is the top half of an fp32: widen to 32 bits and shift into place.
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane i of the result is the horizontal sum of v[i], for eight vectors at once.
inline __m256 transpose_sum8(const __m256* v) {
  // After two rounds of hadd, the low 128 bits hold the low-half sums of v[0..3] (resp. v[4..7])
  // and the high 128 bits their high-half sums.
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (softmax arguments after subtracting the max), within ~2 ulp of std::exp.
// Cephes expf: x = n ln2 + r with |r| <= ln2/2, degree-6 polynomial for e^r, scale by 2^n.
// Arguments below -87.3 (where 2^n would leave the normal range) give exactly 0; NaN gives NaN, as
// std::exp does (a NaN logit must not become a weight near 0).
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 given = x;
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln2 split in a part exact in float and a correction, so r keeps full precision.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_blendv_ps(_mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(e))), given, nan);
}
#endif

// Splits a group's query heads into chunks of 1..4 heads that each get a specialised loop (the
// accumulators of one chunk fit in registers); chunks of 3 are preferred over a leftover of 1.
// Kernels keep each head's own accumulators, so a head's sums do not depend on its chunk.
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

// Replaces s[0, n) by exp(s - max) and returns their sum, accumulated in Sum (float, or double for
// a row long enough that float sums would lose digits); every s[i] <= max.
template <typename Sum>
inline Sum exp_shifted_sum_as(float* s, size_t n, float max) {
  Sum sum = 0;
  size_t i = 0;
#if KARAKV_CPU_AVX2
  const __m256 mv = _mm256_set1_ps(max);
  if constexpr (std::is_same_v<Sum, float>) {
    __m256 sv = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
      _mm256_storeu_ps(s + i, e);
      sv = _mm256_add_ps(sv, e);
    }
    sum = hsum(sv);
  } else {
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
      _mm256_storeu_ps(s + i, e);
      lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
      hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(lo, hi));
    sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - max);
    sum += s[i];
  }
  return sum;
}

inline float exp_shifted_sum(float* s, int n, float max) { return exp_shifted_sum_as<float>(s, size_t(n), max); }

inline float max_of(const float* s, int n) {
  int i = 0;
  float max = s[0];
#if KARAKV_CPU_AVX2
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(s);
    for (i = 8; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + i));
    max = hmax(m);
  }
#endif
  for (; i < n; ++i) max = std::max(max, s[i]);
  return max;
}

// Replaces s[0, n) by exp(s - max) and returns their sum (n >= 1).
inline float softmax_numerators(float* s, int n) { return exp_shifted_sum(s, n, max_of(s, n)); }

}  // namespace karakv::kernels::cpu
