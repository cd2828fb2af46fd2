// KIVI and TurboQuant over one run, and CaM's merge (quant.h has the layouts and the math). The
// format's bit width becomes a compile-time constant in one dispatch helper, so code packing and
// the per-element loops are specialised per width. Codes are packed eight at a time (8 codes of b
// bits are exactly b bytes, for b = 2, 3 and 4 alike). With AVX2 (the x86 build) eight codes
// become the eight lanes of a vector (shifted, masked, converted or looked up among the centroids)
// and the attention kernels keep up to four query heads' sums in registers; the scalar paths
// (a byte table for 2 and 4 bits) serve other builds. Both give each head the same operations in
// the same order whatever the number of heads.
#include "quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common/checks.h"
#include "../common/dispatch.h"
#include "../common/quant_codebook.h"
#include "../common/quant_layout.h"
#include "karakv/kernels/half.h"
#include "simd.h"

namespace karakv::kernels::cpu {
namespace {

constexpr float kHalfMax = 65504.0f;   // largest finite fp16

// The layout every backend shares (common/quant_layout.h).
using common::is_kivi;
using common::kivi_key_group_bytes;
using common::kivi_value_token_bytes;
using common::kKiviGroup;
using common::tq_token_bytes;

// Lloyd-Max centroids of N(0, 1) and their decision thresholds (common/quant_codebook.h, shared
// with the CUDA backend so that a code means the same centroid on both).
using common::Codebook;
using common::Thresholds;

// The one place a format's bit width turns into a compile-time constant (common/dispatch.h).
template <typename Fn>
KernelStatus with_bits(QuantFormat f, Fn&& fn) {
  return common::dispatch_quant_bits(f, quant_bits(f), std::forward<Fn>(fn));
}

// codes[0, count) (each < 2^B) into count*B/8 bytes, LSB first; count a multiple of 8.
template <int B>
void pack_codes(const uint8_t* codes, int count, uint8_t* dst) {
  for (int i = 0; i < count; i += 8) {
    uint64_t word = 0;
    for (int k = 0; k < 8; ++k) word |= uint64_t(codes[i + k]) << (k * B);
    for (int byte = 0; byte < B; ++byte) *dst++ = uint8_t(word >> (8 * byte));
  }
}

// The value a code decodes to: the code itself (KIVI) or its centroid (TurboQuant).
template <int B, bool kCentroid>
constexpr float code_value(int code) {
  if constexpr (kCentroid) return Codebook<B>::centroid[code];
  return float(code);
}

// Every byte of 2- or 4-bit codes holds whole codes: one table lookup yields 8 / B floats.
template <int B, bool kCentroid>
struct ByteTable {
  static constexpr int kPerByte = 8 / B;
  float value[256][kPerByte];
  constexpr ByteTable() : value() {
    for (int byte = 0; byte < 256; ++byte)
      for (int k = 0; k < kPerByte; ++k) value[byte][k] = code_value<B, kCentroid>((byte >> (k * B)) & ((1 << B) - 1));
  }
};

#if KARAKV_CPU_AVX2
// Eight B-bit codes (B bytes, LSB first) as the eight 32-bit lanes of a vector: the word's bits
// shifted right by 0, B, ..., 7B and masked.
template <int B>
inline __m256i codes8(const uint8_t* src) {
  // Whole loads only: a B-byte memcpy into a zeroed word is a partial store and a wider reload,
  // which stalls on store forwarding for B = 3.
  uint32_t word;
  if constexpr (B == 4) {
    std::memcpy(&word, src, 4);
  } else {
    uint16_t low;
    std::memcpy(&low, src, 2);
    word = B == 2 ? uint32_t(low) : uint32_t(low) | uint32_t(src[2]) << 16;
  }
  const __m256i shifts = _mm256_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B);
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(word)), shifts), _mm256_set1_epi32((1 << B) - 1));
}

// The centroids of codes [0, 8) and [8, 16) (2 and 3 bits use the first row only).
template <int B>
struct CentroidRows {
  alignas(32) float row[2][8];
  constexpr CentroidRows() : row() {
    for (int k = 0; k < (1 << B); ++k) row[k / 8][k % 8] = Codebook<B>::centroid[k];
  }
};

// code_value of eight codes: a lane permute of the centroids (4 bits: two, blended on bit 3).
template <int B, bool kCentroid>
inline __m256 values8(__m256i codes) {
  if constexpr (!kCentroid) {
    return _mm256_cvtepi32_ps(codes);
  } else {
    static constexpr CentroidRows<B> kRows;
    const __m256 lo = _mm256_permutevar8x32_ps(_mm256_load_ps(kRows.row[0]), codes);
    if constexpr (B <= 3) return lo;
    const __m256 hi = _mm256_permutevar8x32_ps(_mm256_load_ps(kRows.row[1]), codes);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
  }
}
#endif

// out[i] = code_value(code i) for the codes [0, count) packed at src; count a multiple of 8.
template <int B, bool kCentroid>
void decode_codes(const uint8_t* src, int count, float* out) {
#if KARAKV_CPU_AVX2
  for (int i = 0; i < count; i += 8) _mm256_storeu_ps(out + i, values8<B, kCentroid>(codes8<B>(src + i / 8 * B)));
  return;
#endif
  if constexpr (B == 3) {
    for (int i = 0; i < count; i += 8) {
      const uint32_t word = uint32_t(src[0]) | uint32_t(src[1]) << 8 | uint32_t(src[2]) << 16;
      src += 3;
      for (int k = 0; k < 8; ++k) out[i + k] = code_value<B, kCentroid>((word >> (3 * k)) & 7u);
    }
  } else {
    static constexpr ByteTable<B, kCentroid> kTable;
    constexpr int kPerByte = ByteTable<B, kCentroid>::kPerByte;
    for (int i = 0; i < count / kPerByte; ++i) std::memcpy(out + i * kPerByte, kTable.value[src[i]], sizeof(kTable.value[0]));
  }
}

uint16_t load_half_bits(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}
// F16C where the build has it: the same value as half_to_float for every non-NaN half.
float load_half(const uint8_t* p) {
#if KARAKV_CPU_AVX2
  return _cvtsh_ss(load_half_bits(p));
#else
  return half_to_float(load_half_bits(p));
#endif
}
void store_half(uint8_t* p, uint16_t h) { std::memcpy(p, &h, 2); }

// ---- sizes and validation --------------------------------------------------------------------

KernelStatus invalid(std::string_view op, const std::string& msg) {
  return KernelStatus::invalid(std::string(op) + ": " + msg);
}

// Format, n and d of a key (is_key) or value run.
KernelStatus check_run(std::string_view op, QuantFormat f, int n, int d, bool is_key) {
  if (quant_bits(f) == 0)
    return invalid(op, "format " + std::to_string(int(f)) + " is not one of kivi2, kivi4, tq2, tq3, tq4");
  if (n < 0) return invalid(op, "n " + std::to_string(n) + " must be >= 0");
  if (is_kivi(f) && is_key && n % kKiviGroup != 0)
    return invalid(op, std::string("n ") + std::to_string(n) + " must be a multiple of " + std::to_string(kKiviGroup) +
                           " for " + quant_format_name(f) + " keys");
  if (!common::quant_head_dim_ok(f, d)) {
    if (is_kivi(f))
      return invalid(op, "head_dim " + std::to_string(d) + " must be a multiple of 32 in [32, " +
                             std::to_string(kMaxQuantHeadDim) + "] for " + quant_format_name(f));
    return invalid(op, "head_dim " + std::to_string(d) + " must be a power of two in [8, " +
                           std::to_string(kMaxQuantHeadDim) + "] for " + quant_format_name(f));
  }
  return KernelStatus::ok();
}

KernelStatus check_non_null(std::string_view op, std::initializer_list<std::pair<const char*, const void*>> pointers) {
  for (const auto& [name, p] : pointers)
    if (p == nullptr) return invalid(op, std::string(name) + " is null");
  return KernelStatus::ok();
}

// heads >= 1 rows of n values, stride >= n apart (a single head's stride is not read).
KernelStatus check_heads(std::string_view op, int heads, int n, size_t stride) {
  if (heads < 1) return invalid(op, "heads " + std::to_string(heads) + " must be >= 1");
  if (heads > 1 && stride < size_t(n))
    return invalid(op, "stride " + std::to_string(stride) + " must be >= n " + std::to_string(n) +
                           " when heads > 1 (rows would overlap)");
  return KernelStatus::ok();
}

// ---- the rotation ----------------------------------------------------------------------------

// Output i+1 of splitmix64 seeded with `seed`: the top bit is sign i of the rotation.
uint64_t splitmix64_at(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Per-thread buffers reused across calls; the signs of the last (seed, d) are kept, since a
// decode step calls with the same head's seed many times in a row.
struct QuantScratch {
  uint64_t seed = 0;
  int d = 0;
  std::vector<float> signs;    // [d] +-1
  std::vector<float> vec;      // [d]
  std::vector<float> acc;      // [d]
  std::vector<uint8_t> codes;  // [max(d, 32) * 32]
  std::vector<float> decoded;  // [max(d, 32)]
  std::vector<float> heads;    // per-head accumulators of the multi-head scorers
};

// scratch.heads with at least n floats.
float* heads_buffer(QuantScratch& scratch, size_t n) {
  if (scratch.heads.size() < n) scratch.heads.resize(n);
  return scratch.heads.data();
}

QuantScratch& scratch_for(int d) {
  static thread_local QuantScratch scratch;
  if (scratch.vec.size() < size_t(d)) {
    scratch.vec.resize(d);
    scratch.acc.resize(d);
  }
  const size_t codes = size_t(std::max(d, kKiviGroup)) * kKiviGroup;
  if (scratch.codes.size() < codes) scratch.codes.resize(codes);
  if (scratch.decoded.size() < size_t(std::max(d, kKiviGroup))) scratch.decoded.resize(std::max(d, kKiviGroup));
  return scratch;
}

const float* signs_for(QuantScratch& scratch, uint64_t seed, int d) {
  if (scratch.d != d || scratch.seed != seed || scratch.signs.size() != size_t(d)) {
    scratch.signs.resize(d);
    for (int i = 0; i < d; ++i) scratch.signs[i] = (splitmix64_at(seed, uint64_t(i)) >> 63) ? -1.0f : 1.0f;
    scratch.seed = seed;
    scratch.d = d;
  }
  return scratch.signs.data();
}

// In-place unnormalised Walsh-Hadamard transform (x <- H x), d a power of two.
void fwht(float* x, int d) {
#if KARAKV_CPU_AVX2
  if (d >= 8) {
    // The same butterflies in the same order, eight lanes at a time: strides 1, 2 and 4 inside each
    // vector (the partner lanes permuted in; a + b on the low lane of a pair, a - b on the high
    // one), then whole vectors.
    for (int i = 0; i < d; i += 8) {
      __m256 v = _mm256_loadu_ps(x + i);
      __m256 t = _mm256_permute_ps(v, 0xB1);  // lanes 1 0 3 2 ...
      v = _mm256_blend_ps(_mm256_add_ps(v, t), _mm256_sub_ps(t, v), 0xAA);
      t = _mm256_permute_ps(v, 0x4E);  // lanes 2 3 0 1 ...
      v = _mm256_blend_ps(_mm256_add_ps(v, t), _mm256_sub_ps(t, v), 0xCC);
      t = _mm256_permute2f128_ps(v, v, 0x01);  // halves swapped
      v = _mm256_blend_ps(_mm256_add_ps(v, t), _mm256_sub_ps(t, v), 0xF0);
      _mm256_storeu_ps(x + i, v);
    }
    for (int h = 8; h < d; h <<= 1)
      for (int i = 0; i < d; i += 2 * h)
        for (int j = i; j < i + h; j += 8) {
          const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + h);
          _mm256_storeu_ps(x + j, _mm256_add_ps(a, b));
          _mm256_storeu_ps(x + j + h, _mm256_sub_ps(a, b));
        }
    return;
  }
#endif
  for (int h = 1; h < d; h <<= 1)
    for (int i = 0; i < d; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j];
        const float b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

// ---- KIVI ------------------------------------------------------------------------------------

struct KiviParams {
  uint16_t scale_bits;
  uint16_t zero_bits;
  float scale;
  float zero;
};

template <int B>
KiviParams kivi_params(float lo, float hi) {
  constexpr float kLevels = float((1 << B) - 1);
  KiviParams p;
  p.scale_bits = float_to_half((hi - lo) / kLevels);
  p.zero_bits = float_to_half(lo);
  p.scale = half_to_float(p.scale_bits);
  p.zero = half_to_float(p.zero_bits);
  return p;
}

template <int B>
uint8_t kivi_code(float x, float scale, float zero) {
  constexpr float kLevels = float((1 << B) - 1);
  if (scale == 0.0f) return 0;
  const float r = std::nearbyint((x - zero) / scale);
  return uint8_t(std::clamp(r, 0.0f, kLevels));
}

KernelStatus check_half_range(std::string_view op, const float* x, int n, int d) {
  for (size_t i = 0; i < size_t(n) * d; ++i)
    if (!(std::fabs(x[i]) <= kHalfMax))
      return invalid(op, "x[" + std::to_string(i / d) + "][" + std::to_string(i % d) + "] = " + std::to_string(x[i]) +
                             " is outside the fp16 range [-65504, 65504]");
  return KernelStatus::ok();
}

//   x: [n][d]; run: n / 32 group records
template <int B>
void kivi_quantize_keys(const float* x, int n, int d, uint8_t* run) {
  QuantScratch& scratch = scratch_for(d);
  float* lo = scratch.vec.data();
  float* hi = scratch.acc.data();
  uint8_t* codes = scratch.codes.data();  // [d][32]
  std::vector<KiviParams> params(d);
  const size_t record = kivi_key_group_bytes(B, d);
  for (int g = 0; g < n / kKiviGroup; ++g) {
    const float* xg = x + size_t(g) * kKiviGroup * d;
    uint8_t* rec = run + g * record;
    std::copy(xg, xg + d, lo);
    std::copy(xg, xg + d, hi);
    for (int t = 1; t < kKiviGroup; ++t)
      for (int c = 0; c < d; ++c) {
        lo[c] = std::min(lo[c], xg[size_t(t) * d + c]);
        hi[c] = std::max(hi[c], xg[size_t(t) * d + c]);
      }
    for (int c = 0; c < d; ++c) {
      params[c] = kivi_params<B>(lo[c], hi[c]);
      store_half(rec + 2 * c, params[c].scale_bits);
      store_half(rec + 2 * (d + c), params[c].zero_bits);
    }
    for (int t = 0; t < kKiviGroup; ++t)
      for (int c = 0; c < d; ++c) codes[c * kKiviGroup + t] = kivi_code<B>(xg[size_t(t) * d + c], params[c].scale, params[c].zero);
    uint8_t* packed = rec + 4 * d;
    for (int c = 0; c < d; ++c) pack_codes<B>(codes + c * kKiviGroup, kKiviGroup, packed + c * (kKiviGroup * B / 8));
  }
}

//   x: [n][d]; run: n token records
template <int B>
void kivi_quantize_values(const float* x, int n, int d, uint8_t* run) {
  QuantScratch& scratch = scratch_for(d);
  uint8_t* codes = scratch.codes.data();  // [d]
  const int groups = d / kKiviGroup;
  const size_t record = kivi_value_token_bytes(B, d);
  for (int t = 0; t < n; ++t) {
    const float* xt = x + size_t(t) * d;
    uint8_t* rec = run + t * record;
    for (int g = 0; g < groups; ++g) {
      const float* xg = xt + g * kKiviGroup;
      float lo = xg[0], hi = xg[0];
      for (int c = 1; c < kKiviGroup; ++c) {
        lo = std::min(lo, xg[c]);
        hi = std::max(hi, xg[c]);
      }
      const KiviParams p = kivi_params<B>(lo, hi);
      store_half(rec + 2 * g, p.scale_bits);
      store_half(rec + 2 * (groups + g), p.zero_bits);
      for (int c = 0; c < kKiviGroup; ++c) codes[g * kKiviGroup + c] = kivi_code<B>(xg[c], p.scale, p.zero);
    }
    pack_codes<B>(codes, d, rec + 4 * groups);
  }
}

template <int B>
void kivi_dequantize_keys(const uint8_t* run, int n, int d, float* x) {
  float* codes = scratch_for(d).decoded.data();  // [32]: one channel of the group
  const size_t record = kivi_key_group_bytes(B, d);
  constexpr int kChannelBytes = kKiviGroup * B / 8;
  for (int g = 0; g < n / kKiviGroup; ++g) {
    const uint8_t* rec = run + g * record;
    float* xg = x + size_t(g) * kKiviGroup * d;
    for (int c = 0; c < d; ++c) {
      const float scale = load_half(rec + 2 * c);
      const float zero = load_half(rec + 2 * (d + c));
      decode_codes<B, false>(rec + 4 * d + c * kChannelBytes, kKiviGroup, codes);
      for (int t = 0; t < kKiviGroup; ++t) xg[size_t(t) * d + c] = codes[t] * scale + zero;
    }
  }
}

template <int B>
void kivi_dequantize_values(const uint8_t* run, int n, int d, float* x) {
  float* codes = scratch_for(d).decoded.data();  // [d]
  const int groups = d / kKiviGroup;
  const size_t record = kivi_value_token_bytes(B, d);
  for (int t = 0; t < n; ++t) {
    const uint8_t* rec = run + t * record;
    decode_codes<B, false>(rec + 4 * groups, d, codes);
    for (int g = 0; g < groups; ++g) {
      const float scale = load_half(rec + 2 * g);
      const float zero = load_half(rec + 2 * (groups + g));
      for (int c = g * kKiviGroup; c < (g + 1) * kKiviGroup; ++c) x[size_t(t) * d + c] = codes[c] * scale + zero;
    }
  }
}

// Per group and head m: acc[t] = sum_c (q_mc s_c) code_tc, bias = sum_c q_mc z_c,
// scores[m][t] = scale * (acc + bias). Each channel's codes are decoded once for all heads.
//   q: [heads][d]; scores: head m's at scores + m * stride
#if KARAKV_CPU_AVX2
// The heads [0, H) of one key group: scores[h * stride + t] = scale * (sum_c qs[h][c] code_tc +
// bias[h]) for the group's 32 tokens, eight tokens (one vector of codes of a channel) at a time.
//   codes: the group's [d][32 * B / 8] codes; qs: [H][d] at qs + h * d; bias: [H]
template <int B, int H>
void kivi_key_tile(const uint8_t* codes, int d, const float* qs, const float* bias, float scale, float* scores,
                   size_t stride) {
  constexpr int kChannelBytes = kKiviGroup * B / 8;
  for (int t8 = 0; t8 < kKiviGroup / 8; ++t8) {
    __m256 acc[H];
    for (int h = 0; h < H; ++h) acc[h] = _mm256_setzero_ps();
    const uint8_t* src = codes + t8 * B;
    for (int c = 0; c < d; ++c, src += kChannelBytes) {
      const __m256 v = values8<B, false>(codes8<B>(src));
      for (int h = 0; h < H; ++h) acc[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(qs + size_t(h) * d + c), v, acc[h]);
    }
    for (int h = 0; h < H; ++h)
      _mm256_storeu_ps(scores + h * stride + t8 * 8,
                       _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_add_ps(acc[h], _mm256_set1_ps(bias[h]))));
  }
}
#endif

template <int B>
void kivi_key_scores(const uint8_t* run, int n, int d, const float* q, int heads, float scale, float* scores,
                     size_t stride) {
  QuantScratch& scratch = scratch_for(d);
#if KARAKV_CPU_AVX2
  {
    // Per group: qs[m][c] = q_mc * s_c and bias[m] = sum_c q_mc z_c (scalar, in channel order), then
    // the codes in register tiles of heads.
    float* qs = heads_buffer(scratch, size_t(heads) * (d + 1));
    float* bias = qs + size_t(heads) * d;
    const size_t record = kivi_key_group_bytes(B, d);
    for (int g = 0; g < n / kKiviGroup; ++g) {
      const uint8_t* rec = run + g * record;
      for (int m = 0; m < heads; ++m) bias[m] = 0.0f;
      for (int c = 0; c < d; ++c) {
        const float sc = load_half(rec + 2 * c), z = load_half(rec + 2 * (d + c));
        for (int m = 0; m < heads; ++m) {
          const float qc = q[size_t(m) * d + c];
          qs[size_t(m) * d + c] = qc * sc;
          bias[m] += qc * z;
        }
      }
      for_head_chunks(heads, [&](int h0, auto tile) {
        kivi_key_tile<B, decltype(tile)::value>(rec + 4 * d, d, qs + size_t(h0) * d, bias + h0, scale,
                                                scores + h0 * stride + g * kKiviGroup, stride);
      });
    }
    return;
  }
#endif
  float* codes = scratch.decoded.data();  // [32]: one channel of the group
  float* acc = heads_buffer(scratch, size_t(heads) * (kKiviGroup + 1));  // [heads][32], then bias [heads]
  float* bias = acc + size_t(heads) * kKiviGroup;
  const size_t record = kivi_key_group_bytes(B, d);
  constexpr int kChannelBytes = kKiviGroup * B / 8;
  for (int g = 0; g < n / kKiviGroup; ++g) {
    const uint8_t* rec = run + g * record;
    std::fill(acc, acc + size_t(heads) * (kKiviGroup + 1), 0.0f);
    for (int c = 0; c < d; ++c) {
      const float s = load_half(rec + 2 * c), z = load_half(rec + 2 * (d + c));
      decode_codes<B, false>(rec + 4 * d + c * kChannelBytes, kKiviGroup, codes);
      for (int m = 0; m < heads; ++m) {
        const float qc = q[size_t(m) * d + c], qs = qc * s;
        bias[m] += qc * z;
        float* am = acc + size_t(m) * kKiviGroup;
        for (int t = 0; t < kKiviGroup; ++t) am[t] += qs * codes[t];
      }
    }
    for (int m = 0; m < heads; ++m)
      for (int t = 0; t < kKiviGroup; ++t)
        scores[m * stride + g * kKiviGroup + t] = scale * (acc[size_t(m) * kKiviGroup + t] + bias[m]);
  }
}

#if KARAKV_CPU_AVX2
// The value kernels' inner loop, for the heads [0, H) and eight codes of every token of a run:
// acc[h] = sum_t w[h * n + t] * code_value(code_t), summed in registers over the tokens.
//   codes: token 0's eight codes, tokens `record` bytes apart; w: [H][n] at w + h * n
template <int B, bool kCentroid, int H>
void weighted_codes8(const uint8_t* codes, size_t record, int n, const float* w, __m256* acc) {
  for (int h = 0; h < H; ++h) acc[h] = _mm256_setzero_ps();
  for (int t = 0; t < n; ++t) {
    const __m256 v = values8<B, kCentroid>(codes8<B>(codes + t * record));
    for (int h = 0; h < H; ++h) acc[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + size_t(h) * n + t), v, acc[h]);
  }
}
#endif

//   p: head m's weights at p + m * stride; out: [heads][d]
template <int B>
void kivi_value_accumulate(const uint8_t* run, int n, int d, const float* p, int heads, size_t stride, float* out) {
  const int groups = d / kKiviGroup;
  const size_t record = kivi_value_token_bytes(B, d);
#if KARAKV_CPU_AVX2
  {
    // Per group: the weights w[m][t] = p_mt s_tg and bias[m] = sum_t p_mt z_tg (scalar, in token
    // order) once, then eight channels at a time in register chunks of heads.
    QuantScratch& scratch = scratch_for(d);
    float* w = heads_buffer(scratch, size_t(heads) * n + n + heads);
    float* zero = w + size_t(heads) * n;
    float* bias = zero + n;
    for (int g = 0; g < groups; ++g) {
      for (int t = 0; t < n; ++t) {
        const float sc = load_half(run + t * record + 2 * g);
        zero[t] = load_half(run + t * record + 2 * (groups + g));
        for (int m = 0; m < heads; ++m) w[size_t(m) * n + t] = p[m * stride + t] * sc;
      }
      for (int m = 0; m < heads; ++m) {
        float b = 0.0f;
        for (int t = 0; t < n; ++t) b += p[m * stride + t] * zero[t];
        bias[m] = b;
      }
      for (int c8 = g * kKiviGroup / 8; c8 < (g + 1) * kKiviGroup / 8; ++c8) {
        for_head_chunks(heads, [&](int h0, auto tile) {
          constexpr int H = decltype(tile)::value;
          __m256 acc[H];
          weighted_codes8<B, false, H>(run + 4 * groups + c8 * B, record, n, w + size_t(h0) * n, acc);
          for (int h = 0; h < H; ++h) {
            float* o = out + size_t(h0 + h) * d + c8 * 8;
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_add_ps(acc[h], _mm256_set1_ps(bias[h0 + h]))));
          }
        });
      }
    }
    return;
  }
#endif
  float* codes = scratch_for(d).decoded.data();  // [d]
  for (int t = 0; t < n; ++t) {
    bool any = false;
    for (int m = 0; m < heads; ++m) any |= p[m * stride + t] != 0.0f;
    if (!any) continue;
    const uint8_t* rec = run + t * record;
    decode_codes<B, false>(rec + 4 * groups, d, codes);
    for (int m = 0; m < heads; ++m) {
      const float w = p[m * stride + t];
      if (w == 0.0f) continue;
      float* om = out + size_t(m) * d;
      for (int g = 0; g < groups; ++g) {
        const float ps = w * load_half(rec + 2 * g);
        const float pz = w * load_half(rec + 2 * (groups + g));
        for (int c = g * kKiviGroup; c < (g + 1) * kKiviGroup; ++c) om[c] += ps * codes[c] + pz;
      }
    }
  }
}

// ---- TurboQuant ------------------------------------------------------------------------------

// ||x|| as fp32 from an fp64 sum, so the stored norm does not depend on summation order.
float norm_of(const float* x, int d) {
  double sum = 0;
  for (int c = 0; c < d; ++c) sum += double(x[c]) * double(x[c]);
  return float(std::sqrt(sum));
}

KernelStatus check_norms(std::string_view op, const float* x, int n, int d) {
  for (int t = 0; t < n; ++t) {
    const float norm = norm_of(x + size_t(t) * d, d);
    if (!(norm <= kHalfMax) || (float_to_half(norm) & 0x7c00u) == 0x7c00u)
      return invalid(op, "||x[" + std::to_string(t) + "]|| = " + std::to_string(norm) +
                             " is not finite in fp16 (must be <= 65504)");
  }
  return KernelStatus::ok();
}

// Since u * sqrt(d) = H D x / ||x||, the unit scaling of R cancels: v = fwht(D x) / norm is
// compared with the N(0, 1) thresholds directly.
//   x: [n][d]; run: n token records
template <int B>
void tq_quantize(const float* x, int n, int d, uint64_t seed, uint8_t* run) {
  static constexpr Thresholds<B> kThresholds;
  QuantScratch& scratch = scratch_for(d);
  const float* signs = signs_for(scratch, seed, d);
  float* v = scratch.vec.data();
  uint8_t* codes = scratch.codes.data();
  const size_t record = tq_token_bytes(B, d);
  for (int t = 0; t < n; ++t) {
    const float* xt = x + size_t(t) * d;
    uint8_t* rec = run + t * record;
    const float norm = norm_of(xt, d);
    store_half(rec, float_to_half(norm));
    if (norm == 0.0f) {
      std::memset(rec + 2, 0, size_t(d) * B / 8);
      continue;
    }
    for (int c = 0; c < d; ++c) v[c] = xt[c] * signs[c];
    fwht(v, d);
    for (int c = 0; c < d; ++c) {
      const float u = v[c] / norm;
      int code = 0;
      for (float threshold : kThresholds.value) code += u > threshold;
      codes[c] = uint8_t(code);
    }
    pack_codes<B>(codes, d, rec + 2);
  }
}

// x' = norm * R^T c = D H (norm * centroid) / d: the centroids are in units of 1/sqrt(d) and R^T
// carries another 1/sqrt(d).
template <int B>
void tq_dequantize(const uint8_t* run, int n, int d, uint64_t seed, float* x) {
  QuantScratch& scratch = scratch_for(d);
  const float* signs = signs_for(scratch, seed, d);
  const size_t record = tq_token_bytes(B, d);
  const float inv_d = 1.0f / float(d);
  for (int t = 0; t < n; ++t) {
    const uint8_t* rec = run + t * record;
    float* xt = x + size_t(t) * d;
    const float norm = load_half(rec);
    decode_codes<B, true>(rec + 2, d, xt);
    for (int c = 0; c < d; ++c) xt[c] *= norm;
    fwht(xt, d);
    for (int c = 0; c < d; ++c) xt[c] *= signs[c] * inv_d;
  }
}

// sum_i x[i] * y[i] over [0, d), d a multiple of 8, in 8 partial sums so the loop vectorises
// without reassociating a single chain.
float dot8(const float* x, const float* y, int d) {
  float partial[8] = {};
  for (int i = 0; i < d; i += 8)
    for (int k = 0; k < 8; ++k) partial[k] += x[i + k] * y[i + k];
  return ((partial[0] + partial[4]) + (partial[1] + partial[5])) + ((partial[2] + partial[6]) + (partial[3] + partial[7]));
}

#if KARAKV_CPU_AVX2
// The heads [0, H) against every token of a run: scores[h * stride + t] = factor * norm_t *
// (hq[h] . centroids_t), a token's codes decoded eight at a time once for all H heads.
//   hq: [H][d] rotated queries
template <int B, int H>
void tq_key_tile(const uint8_t* run, size_t record, int n, int d, const float* hq, float factor, float* scores,
                 size_t stride) {
  for (int t = 0; t < n; ++t) {
    const uint8_t* rec = run + t * record;
    __m256 acc[H];
    for (int h = 0; h < H; ++h) acc[h] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8) {
      const __m256 v = values8<B, true>(codes8<B>(rec + 2 + c / 8 * B));
      for (int h = 0; h < H; ++h) acc[h] = _mm256_fmadd_ps(v, _mm256_loadu_ps(hq + size_t(h) * d + c), acc[h]);
    }
    const float norm = load_half(rec);
    for (int h = 0; h < H; ++h) scores[h * stride + t] = factor * norm * hsum(acc[h]);
  }
}

// The heads [0, H) of eight rotated coordinates c: acc[h][c] = sum_t (p_ht norm_t) centroid_tc.
//   codes: token 0's codes of the eight coordinates, tokens `record` bytes apart; norms: [n]
template <int B, int H>
void tq_value_tile(const uint8_t* codes, size_t record, int n, const float* p, size_t stride, const float* norms,
                   float* acc_out, int d) {
  __m256 acc[H];
  for (int h = 0; h < H; ++h) acc[h] = _mm256_setzero_ps();
  for (int t = 0; t < n; ++t) {
    const __m256 v = values8<B, true>(codes8<B>(codes + t * record));
    for (int h = 0; h < H; ++h) acc[h] = _mm256_fmadd_ps(_mm256_set1_ps(p[h * stride + t] * norms[t]), v, acc[h]);
  }
  for (int h = 0; h < H; ++h) _mm256_storeu_ps(acc_out + size_t(h) * d, acc[h]);
}
#endif

// q . R^T (norm c) = norm * (H D q) . centroid / d. Each head's query is rotated once, each
// token's centroids decoded once for all heads.
//   q: [heads][d]; scores: head m's at scores + m * stride
template <int B>
void tq_key_scores(const uint8_t* run, int n, int d, uint64_t seed, const float* q, int heads, float scale,
                   float* scores, size_t stride) {
  QuantScratch& scratch = scratch_for(d);
  const float* signs = signs_for(scratch, seed, d);
  float* values = scratch.vec.data();
  float* hq = heads_buffer(scratch, size_t(heads) * d);
  for (int m = 0; m < heads; ++m) {
    for (int c = 0; c < d; ++c) hq[size_t(m) * d + c] = q[size_t(m) * d + c] * signs[c];
    fwht(hq + size_t(m) * d, d);
  }
  const float factor = scale / float(d);
  const size_t record = tq_token_bytes(B, d);
#if KARAKV_CPU_AVX2
  for_head_chunks(heads, [&](int h0, auto tile) {
    tq_key_tile<B, decltype(tile)::value>(run, record, n, d, hq + size_t(h0) * d, factor, scores + h0 * stride,
                                          stride);
  });
  return;
#endif
  for (int t = 0; t < n; ++t) {
    const uint8_t* rec = run + t * record;
    const float norm = load_half(rec);
    decode_codes<B, true>(rec + 2, d, values);
    for (int m = 0; m < heads; ++m) scores[m * stride + t] = factor * norm * dot8(values, hq + size_t(m) * d, d);
  }
}

//   p: head m's weights at p + m * stride; out: [heads][d]
template <int B>
void tq_value_accumulate(const uint8_t* run, int n, int d, uint64_t seed, const float* p, int heads, size_t stride,
                         float* out) {
  QuantScratch& scratch = scratch_for(d);
  const float* signs = signs_for(scratch, seed, d);
  float* acc = heads_buffer(scratch, size_t(heads) * (d + n));  // [heads][d], in the rotated space
  const size_t record = tq_token_bytes(B, d);
#if KARAKV_CPU_AVX2
  // The weights w[m][t] = p_mt norm_t once, then eight coordinates at a time in register chunks
  // of heads.
  float* w = acc + size_t(heads) * d;
  for (int t = 0; t < n; ++t) {
    const float norm = load_half(run + t * record);
    for (int m = 0; m < heads; ++m) w[size_t(m) * n + t] = p[m * stride + t] * norm;
  }
  for (int c = 0; c < d; c += 8) {
    for_head_chunks(heads, [&](int h0, auto tile) {
      constexpr int H = decltype(tile)::value;
      __m256 sums[H];
      weighted_codes8<B, true, H>(run + 2 + c / 8 * B, record, n, w + size_t(h0) * n, sums);
      for (int h = 0; h < H; ++h) _mm256_storeu_ps(acc + size_t(h0 + h) * d + c, sums[h]);
    });
  }
#else
  float* values = scratch.vec.data();
  std::fill(acc, acc + size_t(heads) * d, 0.0f);
  for (int t = 0; t < n; ++t) {
    bool any = false;
    for (int m = 0; m < heads; ++m) any |= p[m * stride + t] != 0.0f;
    if (!any) continue;
    const uint8_t* rec = run + t * record;
    const float norm = load_half(rec);
    decode_codes<B, true>(rec + 2, d, values);
    for (int m = 0; m < heads; ++m) {
      const float weight = p[m * stride + t] * norm;
      if (weight == 0.0f) continue;
      float* am = acc + size_t(m) * d;
      for (int c = 0; c < d; ++c) am[c] += weight * values[c];
    }
  }
#endif
  const float inv_d = 1.0f / float(d);
  for (int m = 0; m < heads; ++m) {
    float* am = acc + size_t(m) * d;
    fwht(am, d);
    for (int c = 0; c < d; ++c) out[size_t(m) * d + c] += am[c] * signs[c] * inv_d;
  }
}

KernelStatus check_rotation(std::string_view op, const char* in_name, const float* in, int d, const char* out_name,
                            const float* out) {
  KARAKV_RETURN_IF_ERROR(check_non_null(op, {{in_name, in}, {out_name, out}}));
  if (d < 1 || d > kMaxQuantHeadDim || (d & (d - 1)) != 0)
    return invalid(op, "d " + std::to_string(d) + " must be a power of two in [1, " + std::to_string(kMaxQuantHeadDim) +
                           "]");
  return KernelStatus::ok();
}

}  // namespace

const char* quant_format_name(QuantFormat f) {
  switch (f) {
    case QuantFormat::kKivi2: return "kivi2";
    case QuantFormat::kKivi4: return "kivi4";
    case QuantFormat::kTq2: return "tq2";
    case QuantFormat::kTq3: return "tq3";
    case QuantFormat::kTq4: return "tq4";
  }
  return "unknown";
}

namespace {

// quantize_keys and quantize_values: the same checks, then the format's key or value layout.
KernelStatus quantize_run(std::string_view op, bool is_key, QuantFormat f, const float* x, int n, int d,
                          uint64_t seed, uint8_t* run) {
  KARAKV_RETURN_IF_ERROR(check_run(op, f, n, d, is_key));
  if (n == 0) return KernelStatus::ok();
  KARAKV_RETURN_IF_ERROR(check_non_null(op, {{"x", x}, {"run", run}}));
  if (is_kivi(f)) {
    KARAKV_RETURN_IF_ERROR(check_half_range(op, x, n, d));
    return with_bits(f, [&](auto bits) {
      constexpr int B = decltype(bits)::value;
      if (is_key) kivi_quantize_keys<B>(x, n, d, run);
      else kivi_quantize_values<B>(x, n, d, run);
      return KernelStatus::ok();
    });
  }
  KARAKV_RETURN_IF_ERROR(check_norms(op, x, n, d));
  return with_bits(f, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    tq_quantize<B>(x, n, d, seed, run);
    return KernelStatus::ok();
  });
}

KernelStatus dequantize_run(std::string_view op, bool is_key, QuantFormat f, const uint8_t* run, int n, int d,
                            uint64_t seed, float* x) {
  KARAKV_RETURN_IF_ERROR(check_run(op, f, n, d, is_key));
  if (n == 0) return KernelStatus::ok();
  KARAKV_RETURN_IF_ERROR(check_non_null(op, {{"run", run}, {"x", x}}));
  return with_bits(f, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    if (is_kivi(f)) {
      if constexpr (B != 3) {
        if (is_key) kivi_dequantize_keys<B>(run, n, d, x);
        else kivi_dequantize_values<B>(run, n, d, x);
      }
    } else {
      tq_dequantize<B>(run, n, d, seed, x);
    }
    return KernelStatus::ok();
  });
}

}  // namespace

KernelStatus quantize_keys(QuantFormat f, const float* x, int n, int d, uint64_t seed, uint8_t* run) {
  return quantize_run("quantize_keys", true, f, x, n, d, seed, run);
}
KernelStatus quantize_values(QuantFormat f, const float* x, int n, int d, uint64_t seed, uint8_t* run) {
  return quantize_run("quantize_values", false, f, x, n, d, seed, run);
}
KernelStatus dequantize_keys(QuantFormat f, const uint8_t* run, int n, int d, uint64_t seed, float* x) {
  return dequantize_run("dequantize_keys", true, f, run, n, d, seed, x);
}
KernelStatus dequantize_values(QuantFormat f, const uint8_t* run, int n, int d, uint64_t seed, float* x) {
  return dequantize_run("dequantize_values", false, f, run, n, d, seed, x);
}

KernelStatus quantized_key_scores(QuantFormat f, const uint8_t* run, int n, int d, uint64_t seed, const float* q,
                                  float scale, float* scores) {
  return quantized_key_scores_heads(f, run, n, d, seed, q, 1, scale, scores, size_t(n));
}

KernelStatus quantized_key_scores_heads(QuantFormat f, const uint8_t* run, int n, int d, uint64_t seed,
                                        const float* q, int heads, float scale, float* scores, size_t stride) {
  constexpr std::string_view kOp = "quantized_key_scores";
  KARAKV_RETURN_IF_ERROR(check_run(kOp, f, n, d, /*is_key=*/true));
  if (!std::isfinite(scale)) return invalid(kOp, "scale " + std::to_string(scale) + " must be finite");
  KARAKV_RETURN_IF_ERROR(check_heads(kOp, heads, n, stride));
  if (n == 0) return KernelStatus::ok();
  KARAKV_RETURN_IF_ERROR(check_non_null(kOp, {{"run", run}, {"q", q}, {"scores", scores}}));
  return with_bits(f, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    if (is_kivi(f)) {
      if constexpr (B != 3) kivi_key_scores<B>(run, n, d, q, heads, scale, scores, stride);
    } else {
      tq_key_scores<B>(run, n, d, seed, q, heads, scale, scores, stride);
    }
    return KernelStatus::ok();
  });
}

KernelStatus quantized_value_accumulate(QuantFormat f, const uint8_t* run, int n, int d, uint64_t seed, const float* p,
                                        float* out) {
  return quantized_value_accumulate_heads(f, run, n, d, seed, p, 1, size_t(n), out);
}

KernelStatus quantized_value_accumulate_heads(QuantFormat f, const uint8_t* run, int n, int d, uint64_t seed,
                                              const float* p, int heads, size_t stride, float* out) {
  constexpr std::string_view kOp = "quantized_value_accumulate";
  KARAKV_RETURN_IF_ERROR(check_run(kOp, f, n, d, /*is_key=*/false));
  KARAKV_RETURN_IF_ERROR(check_heads(kOp, heads, n, stride));
  if (n == 0) return KernelStatus::ok();
  KARAKV_RETURN_IF_ERROR(check_non_null(kOp, {{"run", run}, {"p", p}, {"out", out}}));
  return with_bits(f, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    if (is_kivi(f)) {
      if constexpr (B != 3) kivi_value_accumulate<B>(run, n, d, p, heads, stride, out);
    } else {
      tq_value_accumulate<B>(run, n, d, seed, p, heads, stride, out);
    }
    return KernelStatus::ok();
  });
}

KernelStatus hadamard_rotate(const float* x, int d, uint64_t seed, float* y) {
  KARAKV_RETURN_IF_ERROR(check_rotation("hadamard_rotate", "x", x, d, "y", y));
  QuantScratch& scratch = scratch_for(d);
  const float* signs = signs_for(scratch, seed, d);
  for (int c = 0; c < d; ++c) y[c] = x[c] * signs[c];
  fwht(y, d);
  const float inv_sqrt_d = 1.0f / std::sqrt(float(d));
  for (int c = 0; c < d; ++c) y[c] *= inv_sqrt_d;
  return KernelStatus::ok();
}

KernelStatus hadamard_unrotate(const float* y, int d, uint64_t seed, float* x) {
  KARAKV_RETURN_IF_ERROR(check_rotation("hadamard_unrotate", "y", y, d, "x", x));
  QuantScratch& scratch = scratch_for(d);
  const float* signs = signs_for(scratch, seed, d);
  if (x != y) std::copy(y, y + d, x);
  fwht(x, d);
  const float inv_sqrt_d = 1.0f / std::sqrt(float(d));
  for (int c = 0; c < d; ++c) x[c] *= signs[c] * inv_sqrt_d;
  return KernelStatus::ok();
}

// CaM version 2 (quant.h). The merge is normalised per kept token, so evicted tokens cannot be
// applied one at a time: each evicted e adds c_e * V_e to the numerators and c_e to the absorbed
// weights of its targets (in ascending slot order), and every kept token divides once at the end.
KernelStatus cam_merge(const float* scores, int n, const int32_t* kept, int num_kept, int merge_tokens,
                       const float* values, int d, float* kept_out) {
  constexpr std::string_view kOp = "cam_merge";
  if (merge_tokens < 1) return invalid(kOp, "merge_tokens " + std::to_string(merge_tokens) + " must be >= 1");
  if (n < 0) return invalid(kOp, "n " + std::to_string(n) + " must be >= 0");
  if (num_kept < 0 || num_kept > n)
    return invalid(kOp, "num_kept " + std::to_string(num_kept) + " out of range [0, " + std::to_string(n) + "]");
  if (d < 1) return invalid(kOp, "d " + std::to_string(d) + " must be >= 1");
  if (num_kept == 0) return KernelStatus::ok();
  KARAKV_RETURN_IF_ERROR(
      check_non_null(kOp, {{"scores", scores}, {"kept", kept}, {"values", values}, {"kept_out", kept_out}}));
  for (int i = 0; i < num_kept; ++i)
    if (kept[i] < 0 || kept[i] >= n || (i > 0 && kept[i] <= kept[i - 1]))
      return invalid(kOp, "kept[" + std::to_string(i) + "] = " + std::to_string(kept[i]) +
                              " is not ascending and distinct in [0, " + std::to_string(n) + ")");
  // a: negative and non-finite scores read as 0.
  auto a = [&](int slot) -> double {
    const float x = scores[slot];
    return std::isfinite(x) && x > 0.0f ? double(x) : 0.0;
  };
  std::vector<double> num(size_t(num_kept) * d), absorbed(num_kept, 0.0);
  for (int i = 0; i < num_kept; ++i) {
    const double a_k = a(kept[i]);
    const float* v = values + size_t(kept[i]) * d;
    for (int c = 0; c < d; ++c) num[size_t(i) * d + c] = a_k * double(v[c]);
  }
  const int width = std::min(merge_tokens, num_kept);  // |T(e)| when no kept token follows e
  int next = 0;                                        // first kept index with kept[next] > e
  for (int e = 0; e < n; ++e) {
    while (next < num_kept && kept[next] <= e) ++next;
    if (next > 0 && kept[next - 1] == e) continue;  // kept, not evicted
    const int first = next < num_kept ? next : num_kept - width;
    const int count = next < num_kept ? std::min(merge_tokens, num_kept - next) : width;
    double sum = 0;
    for (int j = first; j < first + count; ++j) sum += a(kept[j]);
    const double mean = sum / count, a_e = a(e);
    const double p = mean > 0.0 ? std::min(1.0, a_e / mean) : (a_e > 0.0 ? 1.0 : 0.0);
    const double weight = (p * a_e) / count;
    if (weight == 0.0) continue;
    const float* v = values + size_t(e) * d;
    for (int j = first; j < first + count; ++j) {
      absorbed[j] += weight;
      double* acc = num.data() + size_t(j) * d;
      for (int c = 0; c < d; ++c) acc[c] = std::fma(weight, double(v[c]), acc[c]);
    }
  }
  for (int i = 0; i < num_kept; ++i) {
    const float* v = values + size_t(kept[i]) * d;
    float* out = kept_out + size_t(i) * d;
    if (absorbed[i] == 0.0) {  // nothing absorbed (also a zero denominator): V_k as it was
      std::copy(v, v + d, out);
      continue;
    }
    const double den = a(kept[i]) + absorbed[i];
    for (int c = 0; c < d; ++c) out[c] = float(num[size_t(i) * d + c] / den);
  }
  return KernelStatus::ok();
}

}  // namespace karakv::kernels::cpu
