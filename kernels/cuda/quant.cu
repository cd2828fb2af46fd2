#include <algorithm>
#include <climits>
#include <cmath>

#include "../common/quant_codebook.h"
#include "../common/quant_layout.h"
#include "karakv/kernels/half.h"
#include "quant.cuh"
#include "quant_fused_layout.h"

namespace karakv::kernels::cuda {
namespace {

using common::is_kivi;
using common::kivi_key_group_bytes;
using common::kivi_value_token_bytes;
using common::kKiviGroup;  // tokens per key group, channels per value group
using common::tq_token_bytes;
constexpr float kHalfMax = 65504.0f;  // largest finite fp16
constexpr int kThreads = 256;
constexpr int kTileElems = 1024;      // TurboQuant: tokens per CTA = kTileElems / head_dim (>= 1)
constexpr int kScoreThreads = 128;    // slots per CTA of the logits kernel
constexpr int kSlotsPerSplit = 256;   // slots per CTA of the value kernel
// Logits per chunk of attention rows (rows x query heads x slots): bounds the scratch of a long
// causal call; a single row larger than this is one chunk of its own.
constexpr long long kChunkLogits = 16LL << 20;


// The codebook as a kernel argument (indexed at run time from the parameter space).
struct Codebook {
  float centroid[16];
  float threshold[15];
};
template <int B>
Codebook codebook() {
  Codebook c{};
  constexpr common::Thresholds<B> kThresholds;
  for (int k = 0; k < (1 << B); ++k) c.centroid[k] = common::Codebook<B>::centroid[k];
  for (int k = 0; k + 1 < (1 << B); ++k) c.threshold[k] = kThresholds.value[k];
  return c;
}

// fp16 fields are read and written a byte at a time: TurboQuant records may be of odd length. The
// bits stored come from half.h's integer float_to_half, never from an fp16 register (half.h: CUDA
// 13.0's ptxas miscompiles a byte store of one).
__device__ __forceinline__ float load_half(const uint8_t* p) {
  return __half2float(__ushort_as_half(uint16_t(p[0] | (uint16_t(p[1]) << 8))));
}
__device__ __forceinline__ void store_half(uint8_t* p, uint16_t h) {
  p[0] = uint8_t(h);
  p[1] = uint8_t(h >> 8);
}

// Code i of a stream of B-bit codes packed LSB first (3-bit codes may straddle two bytes).
template <int B>
__device__ __forceinline__ int code_at(const uint8_t* stream, int i) {
  const int bit = i * B, byte = bit >> 3, shift = bit & 7;
  unsigned w = stream[byte];
  if (shift + B > 8) w |= unsigned(stream[byte + 1]) << 8;
  return int((w >> shift) & ((1u << B) - 1));
}
// Eight codes into B bytes, LSB first.
template <int B>
__device__ __forceinline__ void pack8(const int (&codes)[8], uint8_t* dst) {
  uint32_t w = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) w |= uint32_t(codes[k]) << (k * B);
#pragma unroll
  for (int byte = 0; byte < B; ++byte) dst[byte] = uint8_t(w >> (8 * byte));
}

// Sign i of the rotation of `seed` (cpu/quant.h): -1 iff the top bit of splitmix64 output i + 1 is set.
__device__ __forceinline__ float rotation_sign(uint64_t seed, int i) {
  uint64_t z = seed + uint64_t(i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (z >> 63) ? -1.0f : 1.0f;
}

// In-place unnormalised Walsh-Hadamard transform of `rows` rows of d floats in shared memory: the
// reference's butterflies (x[j], x[j + h]) <- (x[j] + x[j + h], x[j] - x[j + h]) for h = 1, 2, ..,
// d / 2, stage by stage, so every value is rounded exactly as there. All threads of the CTA call it.
__device__ void fwht_rows(float* s, int rows, int d) {
  const int half = d / 2;
  for (int h = 1; h < d; h <<= 1) {
    __syncthreads();
    for (int p = threadIdx.x; p < rows * half; p += blockDim.x) {
      const int row = p / half, k = p % half;
      const int j = (k / h) * 2 * h + k % h;
      float* x = s + size_t(row) * d;
      const float a = x[j], b = x[j + h];
      x[j] = __fadd_rn(a, b);
      x[j + h] = __fsub_rn(a, b);
    }
  }
  __syncthreads();
}

__device__ __forceinline__ uint8_t* run_at(const DeviceKV& kv, size_t elem_size, int32_t block, int layer, int kvi,
                                           int head) {
  return static_cast<uint8_t*>(kv.pool) + kv.run_offset(block, layer, kvi, head) * elem_size;
}

// ---- quantize ----------------------------------------------------------------------------------

// One thread per (run, token): whether the reference accepts the token (KIVI: every value within
// the fp16 range; TurboQuant: the norm, fp32 from an fp64 sum in channel order, at most 65504),
// and TurboQuant's norm for the quantize kernel. Runs are (layer * 2 + kv) * heads + head.
template <typename T>
__global__ void quant_check_kernel(DeviceKV kv, int seq, int slot_begin, int n, bool kivi, float* __restrict__ norms,
                                   int32_t* __restrict__ first_bad) {
  const int hk = kv.num_kv_heads, d = kv.head_dim;
  const long long total = (long long)kv.num_layers * 2 * hk * n;
  const T* pool = static_cast<const T*>(kv.pool);
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const int r = int(i / n), t = int(i % n);
    const int layer = r / (2 * hk), kvi = (r / hk) % 2, head = r % hk;
    const T* x = pool + kv.token_offset(seq, slot_begin + t, layer, kvi, head);
    bool bad = false;
    if (kivi) {
      for (int c = 0; c < d; ++c) bad |= !(fabsf(to_float(x[c])) <= kHalfMax);
    } else {
      double sum = 0.0;
      for (int c = 0; c < d; ++c) {
        const double v = double(to_float(x[c]));
        sum = __dadd_rn(sum, __dmul_rn(v, v));  // the product is exact; added in channel order
      }
      const float norm = float(sqrt(sum));
      norms[i] = norm;
      bad = !(norm <= kHalfMax);
    }
    if (bad) atomicMin(first_bad + r, t);
  }
}

// KIVI keys: one thread per (layer, head, group of 32 tokens, channel); the group's per-channel
// scale and zero and its 32 codes.
template <typename T, int B>
__global__ void kivi_quantize_keys_kernel(DeviceKV kv, int seq, int slot_begin, int n, int32_t dst,
                                          const int32_t* __restrict__ first_bad) {
  constexpr float kLevels = float((1 << B) - 1);
  const int hk = kv.num_kv_heads, d = kv.head_dim, groups = n / kKiviGroup;
  const long long total = (long long)kv.num_layers * hk * groups * d;
  const T* pool = static_cast<const T*>(kv.pool);
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const int c = int(i % d), g = int((i / d) % groups), lh = int(i / ((long long)d * groups));
    const int layer = lh / hk, head = lh % hk;
    if (first_bad[(layer * 2) * hk + head] != kNoBadToken) continue;
    float x[kKiviGroup];
#pragma unroll
    for (int t = 0; t < kKiviGroup; ++t)
      x[t] = to_float(pool[kv.token_offset(seq, slot_begin + g * kKiviGroup + t, layer, 0, head) + c]);
    float lo = x[0], hi = x[0];
#pragma unroll
    for (int t = 1; t < kKiviGroup; ++t) {
      lo = x[t] < lo ? x[t] : lo;  // std::min(lo, x), std::max(hi, x)
      hi = hi < x[t] ? x[t] : hi;
    }
    const uint16_t scale_bits = float_to_half(__fdiv_rn(__fsub_rn(hi, lo), kLevels)), zero_bits = float_to_half(lo);
    const float scale = __half2float(__ushort_as_half(scale_bits)), zero = __half2float(__ushort_as_half(zero_bits));
    uint8_t* rec = run_at(kv, sizeof(T), dst, layer, 0, head) + g * kivi_key_group_bytes(B, d);
    store_half(rec + 2 * c, scale_bits);
    store_half(rec + 2 * (d + c), zero_bits);
    uint8_t* codes = rec + 4 * size_t(d) + size_t(c) * (kKiviGroup * B / 8);
#pragma unroll
    for (int t8 = 0; t8 < kKiviGroup; t8 += 8) {
      int code[8];
#pragma unroll
      for (int k = 0; k < 8; ++k)
        code[k] = scale == 0.0f ? 0 : int(fminf(fmaxf(rintf(__fdiv_rn(__fsub_rn(x[t8 + k], zero), scale)), 0.0f), kLevels));
      pack8<B>(code, codes + t8 / 8 * B);
    }
  }
}

// KIVI values: one thread per (layer, head, token, group of 32 channels).
template <typename T, int B>
__global__ void kivi_quantize_values_kernel(DeviceKV kv, int seq, int slot_begin, int n, int32_t dst,
                                            const int32_t* __restrict__ first_bad) {
  constexpr float kLevels = float((1 << B) - 1);
  const int hk = kv.num_kv_heads, d = kv.head_dim, groups = d / kKiviGroup;
  const long long total = (long long)kv.num_layers * hk * n * groups;
  const T* pool = static_cast<const T*>(kv.pool);
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const int g = int(i % groups), t = int((i / groups) % n), lh = int(i / ((long long)groups * n));
    const int layer = lh / hk, head = lh % hk;
    if (first_bad[(layer * 2 + 1) * hk + head] != kNoBadToken) continue;
    const T* row = pool + kv.token_offset(seq, slot_begin + t, layer, 1, head) + g * kKiviGroup;
    float x[kKiviGroup];
#pragma unroll
    for (int c = 0; c < kKiviGroup; ++c) x[c] = to_float(row[c]);
    float lo = x[0], hi = x[0];
#pragma unroll
    for (int c = 1; c < kKiviGroup; ++c) {
      lo = x[c] < lo ? x[c] : lo;
      hi = hi < x[c] ? x[c] : hi;
    }
    const uint16_t scale_bits = float_to_half(__fdiv_rn(__fsub_rn(hi, lo), kLevels)), zero_bits = float_to_half(lo);
    const float scale = __half2float(__ushort_as_half(scale_bits)), zero = __half2float(__ushort_as_half(zero_bits));
    uint8_t* rec = run_at(kv, sizeof(T), dst, layer, 1, head) + size_t(t) * kivi_value_token_bytes(B, d);
    store_half(rec + 2 * g, scale_bits);
    store_half(rec + 2 * (groups + g), zero_bits);
    uint8_t* codes = rec + 4 * size_t(groups) + size_t(g) * (kKiviGroup * B / 8);
#pragma unroll
    for (int c8 = 0; c8 < kKiviGroup; c8 += 8) {
      int code[8];
#pragma unroll
      for (int k = 0; k < 8; ++k)
        code[k] = scale == 0.0f ? 0 : int(fminf(fmaxf(rintf(__fdiv_rn(__fsub_rn(x[c8 + k], zero), scale)), 0.0f), kLevels));
      pack8<B>(code, codes + c8 / 8 * B);
    }
  }
}

// TurboQuant: a CTA per (tile of tokens, run). v = H (D x) in shared memory; code = the number of
// thresholds v / norm exceeds (u * sqrt(d) = H D x / ||x||: the rotation's 1/sqrt(d) cancels).
template <typename T, int B>
__global__ void tq_quantize_kernel(DeviceKV kv, int seq, int slot_begin, int n, int tile, int32_t dst,
                                   const uint64_t* __restrict__ head_seeds, const float* __restrict__ norms,
                                   const int32_t* __restrict__ first_bad, Codebook book) {
  extern __shared__ float s_v[];  // [tile][d]
  const int hk = kv.num_kv_heads, d = kv.head_dim;
  const int r = blockIdx.x, layer = r / (2 * hk), kvi = (r / hk) % 2, head = r % hk;
  if (first_bad[r] != kNoBadToken) return;
  const int t0 = blockIdx.y * tile, rows = min(tile, n - t0);
  const uint64_t seed = head_seeds[layer * hk + head];
  const T* pool = static_cast<const T*>(kv.pool);
  for (int e = threadIdx.x; e < rows * d; e += blockDim.x) {
    const int tt = e / d, c = e % d;
    s_v[e] = __fmul_rn(to_float(pool[kv.token_offset(seq, slot_begin + t0 + tt, layer, kvi, head) + c]),
                       rotation_sign(seed, c));
  }
  fwht_rows(s_v, rows, d);
  const size_t record = tq_token_bytes(B, d);
  uint8_t* run = run_at(kv, sizeof(T), dst, layer, kvi, head);
  const int octets = d / 8;
  for (int e = threadIdx.x; e < rows * octets; e += blockDim.x) {
    const int tt = e / octets, o = e % octets, t = t0 + tt;
    const float norm = norms[size_t(r) * n + t];
    uint8_t* rec = run + size_t(t) * record;
    if (o == 0) store_half(rec, float_to_half(norm));
    int code[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      code[k] = 0;
      if (norm != 0.0f) {
        const float u = __fdiv_rn(s_v[tt * d + o * 8 + k], norm);
#pragma unroll
        for (int j = 0; j + 1 < (1 << B); ++j) code[k] += u > book.threshold[j];
      }
    }
    pack8<B>(code, rec + 2 + o * B);
  }
}

// ---- dequantize --------------------------------------------------------------------------------

// KIVI: one thread per element of the dense output, K and V alike; x' = code * scale + zero (the
// product of a code < 16 and an fp16 scale is exact in fp32, so only the add rounds).
template <typename T, int B>
__global__ void kivi_dequantize_kernel(DeviceKV kv, int n, int32_t block, T* __restrict__ k, T* __restrict__ v) {
  const int hk = kv.num_kv_heads, d = kv.head_dim, groups = d / kKiviGroup;
  const long long total = (long long)kv.num_layers * n * hk * d;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    const DenseTokenIndex x = split_dense_index(i, n, hk, d);
    const int c = x.dim, t = x.token;
    {  // key: group t / 32, per-channel scale and zero, channel c's codes of the group's tokens
      const uint8_t* rec = run_at(kv, sizeof(T), block, x.layer, 0, x.head) + (t / kKiviGroup) * kivi_key_group_bytes(B, d);
      const float scale = load_half(rec + 2 * c), zero = load_half(rec + 2 * (d + c));
      const int code = code_at<B>(rec + 4 * size_t(d) + size_t(c) * (kKiviGroup * B / 8), t % kKiviGroup);
      k[i] = from_float<T>(__fadd_rn(__fmul_rn(float(code), scale), zero));
    }
    {  // value: token t's record, channel group c / 32
      const uint8_t* rec = run_at(kv, sizeof(T), block, x.layer, 1, x.head) + size_t(t) * kivi_value_token_bytes(B, d);
      const int g = c / kKiviGroup;
      const float scale = load_half(rec + 2 * g), zero = load_half(rec + 2 * (groups + g));
      const int code = code_at<B>(rec + 4 * size_t(groups), c);
      v[i] = from_float<T>(__fadd_rn(__fmul_rn(float(code), scale), zero));
    }
  }
}

// TurboQuant: a CTA per (tile of tokens, run); x' = D H (norm * centroid) / d.
template <typename T, int B>
__global__ void tq_dequantize_kernel(DeviceKV kv, int n, int tile, int32_t block, const uint64_t* __restrict__ head_seeds,
                                     Codebook book, T* __restrict__ k, T* __restrict__ v) {
  extern __shared__ float s_x[];  // [tile][d]
  const int hk = kv.num_kv_heads, d = kv.head_dim;
  const int r = blockIdx.x, layer = r / (2 * hk), kvi = (r / hk) % 2, head = r % hk;
  const int t0 = blockIdx.y * tile, rows = min(tile, n - t0);
  const size_t record = tq_token_bytes(B, d);
  const uint8_t* run = run_at(kv, sizeof(T), block, layer, kvi, head);
  for (int e = threadIdx.x; e < rows * d; e += blockDim.x) {
    const int tt = e / d, c = e % d;
    const uint8_t* rec = run + size_t(t0 + tt) * record;
    s_x[e] = __fmul_rn(book.centroid[code_at<B>(rec + 2, c)], load_half(rec));
  }
  fwht_rows(s_x, rows, d);
  const uint64_t seed = head_seeds[layer * hk + head];
  const float inv_d = 1.0f / float(d);
  T* out = kvi == 0 ? k : v;
  for (int e = threadIdx.x; e < rows * d; e += blockDim.x) {
    const int tt = e / d, c = e % d;
    out[((size_t(layer) * n + t0 + tt) * hk + head) * d + c] = from_float<T>(__fmul_rn(s_x[e], rotation_sign(seed, c) * inv_d));
  }
}

// ---- attention ---------------------------------------------------------------------------------

// The rows of one chunk, in device memory.
struct Rows {
  const int32_t* seq;        // [rows] sequence of the row
  const int32_t* quantized;  // [rows] its quantized tokens (slots [0, quantized))
  const int32_t* fp;         // [rows] unquantized slots it sees (slots [quantized, quantized + fp))
  const long long* offset;   // [rows] start of the row's logits: [num_q_heads][slots]
};

__device__ __forceinline__ int slots_of(const Rows& rows, int r) { return rows.quantized[r] + rows.fp[r]; }

// TurboQuant: each query rotated into the keys' space once, H D q (the 1/sqrt(d)s go into the logit).
__global__ void rotate_queries_kernel(int hq, int hk, int d, int layer, const uint64_t* __restrict__ head_seeds,
                                      const float* __restrict__ q, float* __restrict__ qrot) {
  extern __shared__ float s_q[];  // [d]
  const int r = blockIdx.x, j = blockIdx.y, g = hq / hk;
  const uint64_t seed = head_seeds[layer * hk + j / g];
  const size_t base = (size_t(r) * hq + j) * d;
  for (int c = threadIdx.x; c < d; c += blockDim.x) s_q[c] = q[base + c] * rotation_sign(seed, c);
  fwht_rows(s_q, 1, d);
  for (int c = threadIdx.x; c < d; c += blockDim.x) qrot[base + c] = s_q[c];
}

// Query heads a CTA of the logits and values kernels serves at once: the heads of one KV head (its
// group) share every code read; a larger group takes several passes (grid.y = hk x passes).
constexpr int kHeadsPerPass = 4;
__host__ __device__ inline int head_passes(int group) { return (group + kHeadsPerPass - 1) / kHeadsPerPass; }

// The KV head and the query heads [j0, j0 + nh) of pass blockIdx.y.
struct HeadPass {
  int head, j0, nh;
};
__device__ __forceinline__ HeadPass head_pass(const DeviceKV& kv) {
  const int g = kv.group_size(), passes = head_passes(g);
  const int head = blockIdx.y / passes, first = (blockIdx.y % passes) * kHeadsPerPass;
  return {head, head * g + first, min(kHeadsPerPass, g - first)};
}

// The scaled logits of slot `slot` of sequence `seq` (nq of its slots quantized) for the nh queries
// q[h * d ..] of KV head `head`, into logit[h]; TurboQuant's quantized slots read the rotated queries
// qrot instead. Each head's sum runs in channel order as for a head alone.
template <typename T, int B, bool kKivi>
__device__ __forceinline__ void slot_logits(const DeviceKV& kv, const DeviceQuant& qd, int layer, int seq, int nq,
                                            int head, int slot, const float* q, const float* qrot, int nh, float scale,
                                            const float* centroid, float (&logit)[kHeadsPerPass]) {
  const int d = kv.head_dim;
  float acc[kHeadsPerPass] = {}, bias[kHeadsPerPass] = {};
  if (slot >= nq) {
    const T* k = static_cast<const T*>(kv.pool) + kv.token_offset(seq, slot - nq, layer, 0, head);
    for (int c = 0; c < d; ++c) {
      const float kc = to_float(k[c]);
#pragma unroll
      for (int h = 0; h < kHeadsPerPass; ++h)
        if (h < nh) acc[h] = fmaf(q[h * d + c], kc, acc[h]);
    }
#pragma unroll
    for (int h = 0; h < kHeadsPerPass; ++h) logit[h] = acc[h] * scale;
    return;
  }
  const int tpb = qd.tokens_per_block, i = slot % tpb;
  const int32_t block = qd.block_table[qd.table_offset[seq] + slot / tpb];
  const uint8_t* run = run_at(kv, sizeof(T), block, layer, 0, head);
  if constexpr (kKivi) {
    // sum_c q_c (code_c s_c + z_c) = sum_c (q_c s_c) code_c + sum_c q_c z_c
    const uint8_t* rec = run + (i / kKiviGroup) * kivi_key_group_bytes(B, d);
    const uint8_t* codes = rec + 4 * size_t(d);
    const int tt = i % kKiviGroup;
    for (int c = 0; c < d; ++c) {
      const float sc = load_half(rec + 2 * c), zc = load_half(rec + 2 * (d + c));
      const float code = float(code_at<B>(codes + size_t(c) * (kKiviGroup * B / 8), tt));
#pragma unroll
      for (int h = 0; h < kHeadsPerPass; ++h)
        if (h < nh) {
          acc[h] = fmaf(q[h * d + c] * sc, code, acc[h]);
          bias[h] = fmaf(q[h * d + c], zc, bias[h]);
        }
    }
#pragma unroll
    for (int h = 0; h < kHeadsPerPass; ++h) logit[h] = scale * (acc[h] + bias[h]);
  } else {
    // q . R^T (norm c) = norm * (H D q) . centroid / d
    const uint8_t* rec = run + size_t(i) * tq_token_bytes(B, d);
    for (int c = 0; c < d; ++c) {
      const float cent = centroid[code_at<B>(rec + 2, c)];
#pragma unroll
      for (int h = 0; h < kHeadsPerPass; ++h)
        if (h < nh) acc[h] = fmaf(qrot[h * d + c], cent, acc[h]);
    }
    const float norm = load_half(rec);
#pragma unroll
    for (int h = 0; h < kHeadsPerPass; ++h) logit[h] = scale / float(d) * norm * acc[h];
  }
}

// Scaled logits of every slot of (row, the query heads of one pass): one thread per slot.
template <typename T, int B, bool kKivi>
__global__ void __launch_bounds__(kScoreThreads)
    quant_logits_kernel(DeviceKV kv, DeviceQuant qd, int layer, Rows rows, const float* __restrict__ q,
                        const float* __restrict__ qrot, float scale, Codebook book, float* __restrict__ logits) {
  extern __shared__ float s_q[];  // [kHeadsPerPass][d] the queries, then (TurboQuant) their rotations
  __shared__ float s_centroid[16];
  const int r = blockIdx.x;
  const int hq = kv.num_q_heads, d = kv.head_dim;
  const HeadPass pass = head_pass(kv);
  for (int e = threadIdx.x; e < pass.nh * d; e += blockDim.x) {
    const size_t at = (size_t(r) * hq + pass.j0) * d + e;
    s_q[e] = q[at];
    if constexpr (!kKivi) s_q[kHeadsPerPass * d + e] = qrot[at];
  }
  if (threadIdx.x < 16) s_centroid[threadIdx.x] = book.centroid[threadIdx.x];
  __syncthreads();
  const int nq = rows.quantized[r], n = nq + rows.fp[r], seq = rows.seq[r];
  float* out = logits + rows.offset[r] + size_t(pass.j0) * n;
  for (int slot = blockIdx.z * kScoreThreads + threadIdx.x; slot < n; slot += gridDim.z * kScoreThreads) {
    float logit[kHeadsPerPass];
    slot_logits<T, B, kKivi>(kv, qd, layer, seq, nq, pass.head, slot, s_q, s_q + kHeadsPerPass * d, pass.nh, scale,
                             s_centroid, logit);
#pragma unroll
    for (int h = 0; h < kHeadsPerPass; ++h)
      if (h < pass.nh) out[size_t(h) * n + slot] = logit[h];
  }
}

// Softmax of one (row, query head) in place: p = exp(l - max) / sum, the sum in fp64; with lse
// ([rows][hq], null: none), the row's log-sum-exp max + log(sum).
__global__ void quant_softmax_kernel(int hq, Rows rows, float* __restrict__ logits, float* __restrict__ lse) {
  __shared__ float s_max[kThreads / 32];
  __shared__ double s_sum[kThreads / 32];
  const int r = blockIdx.x, j = blockIdx.y;
  const int n = slots_of(rows, r);
  float* p = logits + rows.offset[r] + size_t(j) * n;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float mx = -INFINITY;
  for (int t = threadIdx.x; t < n; t += blockDim.x) mx = fmaxf(mx, p[t]);
  for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) s_max[warp] = mx;
  __syncthreads();
  mx = -INFINITY;
  for (int w = 0; w < kThreads / 32; ++w) mx = fmaxf(mx, s_max[w]);
  double sum = 0.0;
  for (int t = threadIdx.x; t < n; t += blockDim.x) sum += (p[t] = expf(p[t] - mx));
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) s_sum[warp] = sum;
  __syncthreads();
  sum = 0.0;
  for (int w = 0; w < kThreads / 32; ++w) sum += s_sum[w];
  const float inv = sum > 0.0 ? float(1.0 / sum) : 0.0f;
  for (int t = threadIdx.x; t < n; t += blockDim.x) p[t] *= inv;
  if (lse != nullptr && n > 0 && threadIdx.x == 0) lse[size_t(r) * hq + j] = mx + float(log(sum));
}

// Values over slots [split * slots_per_split, ...) of (row, the query heads of one pass): one thread
// per channel, each code read once for the pass's heads; the quantized part (TurboQuant: in the
// rotated space, norm folded into the weight) and the unquantized part apart, into
// part[row][head][split][2][d].
template <typename T, int B, bool kKivi>
__global__ void quant_values_kernel(DeviceKV kv, DeviceQuant qd, int layer, Rows rows, const float* __restrict__ probs,
                                    int num_splits, int slots_per_split, Codebook book, float* __restrict__ part) {
  const int r = blockIdx.x, split = blockIdx.z, c = threadIdx.x;
  const int hq = kv.num_q_heads, d = kv.head_dim;
  const HeadPass pass = head_pass(kv);
  const int nq = rows.quantized[r], n = nq + rows.fp[r], seq = rows.seq[r];
  const float* p = probs + rows.offset[r] + size_t(pass.j0) * n;  // head h's at p[h * n + slot]
  const int tpb = qd.tokens_per_block, groups = d / kKiviGroup;
  const int begin = min(n, split * slots_per_split), end = min(n, begin + slots_per_split);
  float acc_q[kHeadsPerPass] = {}, acc_f[kHeadsPerPass] = {};
  if (c >= d) return;
  for (int slot = begin; slot < end; ++slot) {
    float w[kHeadsPerPass];
    bool any = false;
#pragma unroll
    for (int h = 0; h < kHeadsPerPass; ++h) {
      w[h] = h < pass.nh ? p[size_t(h) * n + slot] : 0.0f;
      any |= w[h] != 0.0f;
    }
    if (!any) continue;
    if (slot < nq) {
      const int i = slot % tpb;
      const int32_t block = qd.block_table[qd.table_offset[seq] + slot / tpb];
      const uint8_t* run = run_at(kv, sizeof(T), block, layer, 1, pass.head);
      if constexpr (kKivi) {
        const uint8_t* rec = run + size_t(i) * kivi_value_token_bytes(B, d);
        const int g = c / kKiviGroup;
        const float sc = load_half(rec + 2 * g), zc = load_half(rec + 2 * (groups + g));
        const float code = float(code_at<B>(rec + 4 * size_t(groups), c));
#pragma unroll
        for (int h = 0; h < kHeadsPerPass; ++h)
          if (w[h] != 0.0f) acc_q[h] += fmaf(w[h] * sc, code, w[h] * zc);
      } else {
        const uint8_t* rec = run + size_t(i) * tq_token_bytes(B, d);
        const float norm = load_half(rec), cent = book.centroid[code_at<B>(rec + 2, c)];
#pragma unroll
        for (int h = 0; h < kHeadsPerPass; ++h)
          if (w[h] != 0.0f) acc_q[h] = fmaf(w[h] * norm, cent, acc_q[h]);
      }
    } else {
      const T* v = static_cast<const T*>(kv.pool) + kv.token_offset(seq, slot - nq, layer, 1, pass.head);
      const float vc = to_float(v[c]);
#pragma unroll
      for (int h = 0; h < kHeadsPerPass; ++h)
        if (w[h] != 0.0f) acc_f[h] = fmaf(w[h], vc, acc_f[h]);
    }
  }
#pragma unroll
  for (int h = 0; h < kHeadsPerPass; ++h)
    if (h < pass.nh) {
      float* out = part + ((size_t(r) * hq + pass.j0 + h) * num_splits + split) * 2 * d;
      out[c] = acc_q[h];
      out[d + c] = acc_f[h];
    }
}

// Sums the splits; TurboQuant de-rotates the quantized part once (D H acc / d). One thread per
// channel (blockDim.x >= d).
template <bool kKivi>
__global__ void quant_combine_kernel(int hq, int hk, int d, int layer, int num_splits,
                                     const uint64_t* __restrict__ head_seeds, const float* __restrict__ part,
                                     float* __restrict__ out) {
  extern __shared__ float s_acc[];  // [d]
  const int r = blockIdx.x, j = blockIdx.y, c = threadIdx.x;
  const float* base = part + (size_t(r) * hq + j) * num_splits * 2 * d;
  float fp = 0.0f;
  if (c < d) {
    float quantized = 0.0f;
    for (int s = 0; s < num_splits; ++s) {
      quantized += base[size_t(s) * 2 * d + c];
      fp += base[size_t(s) * 2 * d + d + c];
    }
    s_acc[c] = quantized;
  }
  if constexpr (!kKivi) fwht_rows(s_acc, 1, d);
  if (c >= d) return;
  float quantized = s_acc[c];
  if constexpr (!kKivi) quantized *= rotation_sign(head_seeds[layer * hk + j / (hq / hk)], c) * (1.0f / float(d));
  out[(size_t(r) * hq + j) * d + c] = quantized + fp;
}

// For score_acc: per (row, KV head, slot t >= first[r]) the probabilities summed over the group's
// query heads.
// Rows with a device accumulator (acc non-null, entry non-null) add into it instead; rows with
// neither (group_offset -1: a device row's head without an accumulator) are skipped.
// probs: the staged softmax's probabilities; or, after the fused kernels (ml non-null), each
// observed slot's exp(logit - m_s) kept by its split, scaled here by exp(m_s - lse) (m_s: the
// split's max in ml[row][q head][split][2], lse: [rows][hq]).
__global__ void quant_group_probs_kernel(int hq, int hk, Rows rows, const float* __restrict__ probs,
                                         const float* __restrict__ ml, const float* __restrict__ lse, int num_splits,
                                         const int32_t* __restrict__ first, const long long* __restrict__ group_offset,
                                         float* __restrict__ group_probs, float* const* __restrict__ acc) {
  const int r = blockIdx.x, h = blockIdx.y, g = hq / hk;
  const int n = slots_of(rows, r), f = first[r], m = n - f;
  float* const dst = acc != nullptr ? acc[size_t(r) * hk + h] : nullptr;
  if (dst == nullptr && group_offset[r] < 0) return;
  const float* p = probs + rows.offset[r];
  for (int i = blockIdx.z * blockDim.x + threadIdx.x; i < m; i += gridDim.z * blockDim.x) {
    float sum = 0.0f;
    for (int j = h * g; j < h * g + g; ++j) {
      float pj = p[size_t(j) * n + f + i];
      if (ml != nullptr) {
        const float l = lse[size_t(r) * hq + j];
        const float m_s = ml[((size_t(r) * hq + j) * num_splits + (f + i) / kFusedSplit) * 2];
        // A NaN lse (NaN logits in the row): 0 at finite slots and NaN at NaN ones, as the staged
        // softmax's zero normaliser gives.
        pj = isnan(l) ? (isnan(pj) ? pj : 0.0f) : pj * expf(m_s - l);
      }
      sum += pj;
    }
    if (dst != nullptr) {
      dst[f + i] += sum;  // each (row, head, slot) has one thread: rows are distinct sequences
    } else {
      group_probs[group_offset[r] + size_t(h) * m + i] = sum;
    }
  }
}

// ---- fused attention (KARAKV_CUDA_QUANT_DECODE=fused) ------------------------------------------
//
// One kernel reads each KV head's codes once for all the query heads of its group and never writes
// a logit to device memory: a CTA per (row, KV head and up to kFusedHeads of its query heads, split
// of kFusedSplit slots) stages its records in shared memory with 4-byte loads, computes the split's
// logits there, its local softmax (max m, sum l), and the values weighted by exp(logit - m); a
// combine merges the splits (weights exp(m_s - M) / L), de-rotates TurboQuant's part once and
// writes the log-sum-exp M + log L. With observers, the fused kernel also keeps exp(logit - m_s) of
// the observed slots, and a third kernel scales them by exp(m_s - lse): no key is read twice.

static_assert(kMaxHeadDim / kFusedChannels <= kFusedThreads, "the values need at least one token group of d / 4 threads");

// Copies records [a, b) of a quantized run (records of `rec` bytes, `per_block` of them in each
// quantized block: tokens, or KIVI's key groups) into `dst` (4-byte aligned) with 4-byte loads by
// threads [thread, thread + threads) of the caller's group. A piece ends at each block boundary and
// is copied from its aligned start (the pool is a whole number of 4-byte words, so the words around
// a piece stay inside it). Returns where record `mine` lies in `dst` (null if outside [a, b)); with
// `offsets`, also writes each record's offset in `dst` at offsets[i - a].
template <typename T>
__device__ __forceinline__ const uint8_t* stage_records(const DeviceKV& kv, const DeviceQuant& qd, int seq, int layer,
                                                        int kvi, int head, int rec, int per_block, int a, int b,
                                                        int mine, uint8_t* dst, int* offsets, int thread,
                                                        int threads) {
  const int32_t* table = qd.block_table + qd.table_offset[seq];
  const uint8_t* found = nullptr;
  int at = 0;  // bytes of dst used
  for (const int first = a; a < b;) {
    const int end = min(b, (a / per_block + 1) * per_block);
    const uint8_t* src = run_at(kv, sizeof(T), table[a / per_block], layer, kvi, head) + size_t(a % per_block) * rec;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(reinterpret_cast<uintptr_t>(src) & ~uintptr_t(3));
    const int shift = int(reinterpret_cast<uintptr_t>(src) & 3);
    const int count = (shift + (end - a) * rec + 3) / 4;
    for (int w = thread; w < count; w += threads) reinterpret_cast<uint32_t*>(dst + at)[w] = __ldg(words + w);
    if (mine >= a && mine < end) found = dst + at + shift + size_t(mine - a) * rec;
    if (offsets != nullptr)
      for (int i = a + thread; i < end; i += threads) offsets[i - first] = at + shift + (i - a) * rec;
    at += count * 4;
    a = end;
  }
  return found;
}

__device__ __forceinline__ float smem_half(const uint8_t* p) {  // p is 2-byte aligned
  return __half2float(*reinterpret_cast<const __half*>(p));
}

// The split [s0, s1) of row r for query heads [j0, j0 + nh) of KV head `head`: unnormalised values
// into part[row][head][split][2][d] (quantized part first; TurboQuant's in the rotated space) and
// the split's (max, sum) into ml[row][head][split][2]; a split past the row's end writes -inf, 0.
template <typename T, int B, bool kKivi>
__global__ void __launch_bounds__(kFusedThreads)
    quant_fused_kernel(DeviceKV kv, DeviceQuant qd, int layer, Rows rows, const float* __restrict__ q,
                       const float* __restrict__ qrot, float scale, Codebook book, int num_splits,
                       float* __restrict__ part, float* __restrict__ ml, const int32_t* __restrict__ first,
                       float* __restrict__ observed) {
  extern __shared__ __align__(16) float s_fused[];
  __shared__ float s_centroid[16];
  __shared__ float s_m[kFusedHeads], s_l[kFusedHeads];
  __shared__ int s_offset[kFusedTile];  // the values' records in the staging
  const int r = blockIdx.x, split = blockIdx.z, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int hq = kv.num_q_heads, d = kv.head_dim, g = kv.group_size(), passes = fused_passes(g);
  const int head = blockIdx.y / passes, j0 = head * g + (blockIdx.y % passes) * kFusedHeads;
  const int nh = min(kFusedHeads, head * g + g - j0);
  const int nq = rows.quantized[r], n = nq + rows.fp[r], seq = rows.seq[r];
  const int s0 = split * kFusedSplit, s1 = min(n, s0 + kFusedSplit);
  float* s_q = s_fused;                                            // [kFusedHeads][d]
  float* s_qr = s_q + kFusedHeads * d;                             // TurboQuant: [kFusedHeads][d]
  float* s_p = s_qr + (kKivi ? 0 : kFusedHeads * d);               // [kFusedHeads][kFusedSplit]
  uint8_t* s_stage = reinterpret_cast<uint8_t*>(s_p + kFusedHeads * kFusedSplit);
  const int key_stage = fused_key_stage(kKivi, B, d);

  if (s0 >= s1) {  // nothing of this row here
    for (int h = 0; h < nh; ++h) {
      const size_t at = (size_t(r) * hq + j0 + h) * num_splits + split;
      for (int c = tid; c < 2 * d; c += kFusedThreads) part[at * 2 * d + c] = 0.0f;
      if (tid == 0) {
        ml[at * 2] = -INFINITY;
        ml[at * 2 + 1] = 0.0f;
      }
    }
    return;
  }
  for (int e = tid; e < nh * d; e += kFusedThreads) {
    const size_t at = (size_t(r) * hq + j0) * d + e;
    s_q[e] = q[at];
    if constexpr (!kKivi) s_qr[e] = qrot[at];
  }
  if (tid < 16) s_centroid[tid] = book.centroid[tid];
  __syncthreads();

  // ---- logits of the split's quantized slots: a warp per tile of 32 tokens, a lane per token
  const int q_end = min(s1, nq);
  uint8_t* my_stage = s_stage + size_t(warp) * key_stage;
  for (int t0 = s0 + warp * kFusedTile; t0 < q_end; t0 += kFusedWarps * kFusedTile) {
    const int t1 = min(q_end, t0 + kFusedTile), t = t0 + lane;
    float acc[kFusedHeads] = {};
    if constexpr (kKivi) {
      // One key group (t0 is a multiple of 32): scales[d], zeros[d] (fp16), then per channel the
      // group's 32 codes. sum_c q_c (code s_c + z_c) = sum_c (q_c s_c) code + sum_c q_c z_c.
      const int gbytes = int(kivi_key_group_bytes(B, d));
      const int group = t0 / kKiviGroup;
      const uint8_t* rec = stage_records<T>(kv, qd, seq, layer, 0, head, gbytes, qd.tokens_per_block / kKiviGroup,
                                            group, group + 1, group, my_stage, nullptr, lane, 32);
      __syncwarp();
      const uint8_t* codes = rec + 4 * size_t(d);
      float bias[kFusedHeads] = {};
      for (int c = lane; c < d; c += 32) {  // the bias, a channel per lane, then summed over the warp
        const float zc = smem_half(rec + 2 * (d + c));
#pragma unroll
        for (int h = 0; h < kFusedHeads; ++h)
          if (h < nh) bias[h] = fmaf(s_q[h * d + c], zc, bias[h]);
      }
#pragma unroll
      for (int h = 0; h < kFusedHeads; ++h)
        for (int off = 16; off > 0; off /= 2) bias[h] += __shfl_xor_sync(0xffffffffu, bias[h], off);
      for (int c = 0; c < d; c += 4) {  // four channels a step: the scales and each head's q as one load
        const uint2 raw = *reinterpret_cast<const uint2*>(rec + 2 * c);  // rec is 16-byte aligned
        const float2 s01 = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
        const float2 s23 = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
        float code[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) code[k] = float(code_at<B>(codes + size_t(c + k) * (kKiviGroup * B / 8), lane));
#pragma unroll
        for (int h = 0; h < kFusedHeads; ++h)
          if (h < nh) {
            const float4 qv = *reinterpret_cast<const float4*>(s_q + h * d + c);
            acc[h] = fmaf(qv.x * s01.x, code[0], acc[h]);
            acc[h] = fmaf(qv.y * s01.y, code[1], acc[h]);
            acc[h] = fmaf(qv.z * s23.x, code[2], acc[h]);
            acc[h] = fmaf(qv.w * s23.y, code[3], acc[h]);
          }
      }
#pragma unroll
      for (int h = 0; h < kFusedHeads; ++h) acc[h] = scale * (acc[h] + bias[h]);
    } else {
      // TurboQuant: q . R^T (norm c) = norm * (H D q) . centroid / d
      const int rec_bytes = int(tq_token_bytes(B, d));
      const uint8_t* rec = stage_records<T>(kv, qd, seq, layer, 0, head, rec_bytes, qd.tokens_per_block, t0, t1, t,
                                            my_stage, nullptr, lane, 32);
      __syncwarp();
      if (t < t1) {
        for (int c = 0; c < d; c += 4) {  // d >= 8: four channels a step, each head's rotation as one load
          float cent[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) cent[k] = s_centroid[code_at<B>(rec + 2, c + k)];
#pragma unroll
          for (int h = 0; h < kFusedHeads; ++h)
            if (h < nh) {
              const float4 qv = *reinterpret_cast<const float4*>(s_qr + h * d + c);
              acc[h] = fmaf(qv.x, cent[0], acc[h]);
              acc[h] = fmaf(qv.y, cent[1], acc[h]);
              acc[h] = fmaf(qv.z, cent[2], acc[h]);
              acc[h] = fmaf(qv.w, cent[3], acc[h]);
            }
        }
        const float norm = load_half(rec);  // TurboQuant records may be of odd length
#pragma unroll
        for (int h = 0; h < kFusedHeads; ++h) acc[h] = scale / float(d) * norm * acc[h];
      }
    }
    if (t < t1) {
#pragma unroll
      for (int h = 0; h < kFusedHeads; ++h)
        if (h < nh) s_p[h * kFusedSplit + (t - s0)] = acc[h];
    }
    __syncwarp();  // the next tile overwrites the staging
  }
  // ---- logits of its unquantized slots: a warp per token, a lane per channel
  for (int t = max(s0, nq) + warp; t < s1; t += kFusedWarps) {
    const T* k = static_cast<const T*>(kv.pool) + kv.token_offset(seq, t - nq, layer, 0, head);
    float acc[kFusedHeads] = {};
    for (int c = lane; c < d; c += 32) {
      const float kc = to_float(k[c]);
#pragma unroll
      for (int h = 0; h < kFusedHeads; ++h)
        if (h < nh) acc[h] = fmaf(s_q[h * d + c], kc, acc[h]);
    }
#pragma unroll
    for (int h = 0; h < kFusedHeads; ++h) {
      for (int off = 16; off > 0; off /= 2) acc[h] += __shfl_xor_sync(0xffffffffu, acc[h], off);
      if (lane == 0 && h < nh) s_p[h * kFusedSplit + (t - s0)] = acc[h] * scale;
    }
  }
  __syncthreads();

  // ---- the split's softmax, a warp per head: p = exp(logit - m), l = sum p
  const int m_slots = s1 - s0;
  for (int h = warp; h < nh; h += kFusedWarps) {
    float* p = s_p + h * kFusedSplit;
    float mx = -INFINITY;
    for (int i = lane; i < m_slots; i += 32) mx = fmaxf(mx, p[i]);
    for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    // A split whose logits are all -inf weighs nothing (exp(-inf) = 0, sum 0: the combine skips it)
    // instead of exp(-inf - -inf) = NaN, which would poison the row where the staged softmax gives 0.
    const float base = mx == -INFINITY ? 0.0f : mx;
    float sum = 0.0f;
    for (int i = lane; i < m_slots; i += 32) sum += (p[i] = expf(p[i] - base));
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) {
      s_m[h] = mx;
      s_l[h] = sum;
    }
  }
  __syncthreads();
  if (observed != nullptr) {  // observers: exp(logit - m) of the observed slots, [q head][slot] at the row's offset
    const int o0 = max(s0, first[r]);
    for (int e = tid; e < nh * (s1 - o0); e += kFusedThreads) {
      const int h = e / (s1 - o0), t = o0 + e % (s1 - o0);
      observed[rows.offset[r] + size_t(j0 + h) * n + t] = s_p[h * kFusedSplit + (t - s0)];
    }
  }

  // ---- values: token groups of d / 4 threads, a thread per 4 consecutive channels (one KIVI value
  // group's scale and zero, adjacent codes), the groups taking every groups-th token; every head of
  // the pass from one read. The groups' sums then meet in shared memory, group by group in order.
  const int per_group = d / kFusedChannels, groups_n = kFusedThreads / per_group;
  const int grp = tid / per_group, c0 = (tid % per_group) * kFusedChannels;
  const bool active = grp < groups_n;  // head_dim 96: 5 groups of 24, 8 threads idle
  float acc_q[kFusedChannels][kFusedHeads] = {}, acc_f[kFusedChannels][kFusedHeads] = {};
  const int vgroups = d / kKiviGroup;
  const int v_rec = int(kKivi ? kivi_value_token_bytes(B, d) : tq_token_bytes(B, d));
  for (int t0 = s0; t0 < q_end; t0 += kFusedTile) {
    const int t1 = min(q_end, t0 + kFusedTile);
    __syncthreads();  // the previous tile's reads (or the key phase's staging) are done
    stage_records<T>(kv, qd, seq, layer, 1, head, v_rec, qd.tokens_per_block, t0, t1, -1, s_stage, s_offset, tid,
                     kFusedThreads);
    __syncthreads();
    for (int t = t0 + grp; active && t < t1; t += groups_n) {
      float w[kFusedHeads];
      bool any = false;
#pragma unroll
      for (int h = 0; h < kFusedHeads; ++h) {
        w[h] = h < nh ? s_p[h * kFusedSplit + (t - s0)] : 0.0f;
        any |= w[h] != 0.0f;
      }
      if (!any) continue;
      const uint8_t* rec = s_stage + s_offset[t - t0];
      if constexpr (kKivi) {
        const int gc = c0 / kKiviGroup;  // the four channels share it (c0 % 4 == 0, groups of 32)
        const float sc = smem_half(rec + 2 * gc), zc = smem_half(rec + 2 * (vgroups + gc));
#pragma unroll
        for (int k = 0; k < kFusedChannels; ++k) {
          const float code = float(code_at<B>(rec + 4 * size_t(vgroups), c0 + k));
#pragma unroll
          for (int h = 0; h < kFusedHeads; ++h)  // as staged: a zero weight adds nothing, inf or NaN included
            if (h < nh && w[h] != 0.0f) acc_q[k][h] += fmaf(w[h] * sc, code, w[h] * zc);
        }
      } else {
        const float norm = load_half(rec);
#pragma unroll
        for (int k = 0; k < kFusedChannels; ++k) {
          const float cent = s_centroid[code_at<B>(rec + 2, c0 + k)];
#pragma unroll
          for (int h = 0; h < kFusedHeads; ++h)
            if (h < nh && w[h] != 0.0f) acc_q[k][h] = fmaf(w[h] * norm, cent, acc_q[k][h]);
        }
      }
    }
  }
  for (int t = max(s0, nq) + grp; active && t < s1; t += groups_n) {
    const T* v = static_cast<const T*>(kv.pool) + kv.token_offset(seq, t - nq, layer, 1, head) + c0;
#pragma unroll
    for (int k = 0; k < kFusedChannels; ++k) {
      const float vc = to_float(v[k]);
#pragma unroll
      for (int h = 0; h < kFusedHeads; ++h) {
        const float w = h < nh ? s_p[h * kFusedSplit + (t - s0)] : 0.0f;
        if (w != 0.0f) acc_f[k][h] = fmaf(w, vc, acc_f[k][h]);  // as staged: a zero weight adds nothing, inf included
      }
    }
  }
  // The groups' sums, [head][quantized, unquantized][d], in the staging (free now).
  float* red = reinterpret_cast<float*>(s_stage);
  for (int round = 0; round < groups_n; ++round) {
    __syncthreads();
    if (active && grp == round) {
#pragma unroll
      for (int h = 0; h < kFusedHeads; ++h) {
        if (h >= nh) break;
        // One 16-byte read-modify-write per part (c0 and d are multiples of 4).
        float4* q4 = reinterpret_cast<float4*>(red + size_t(h) * 2 * d + c0);
        float4* f4 = reinterpret_cast<float4*>(red + size_t(h) * 2 * d + d + c0);
        const float4 q_old = round == 0 ? make_float4(0, 0, 0, 0) : *q4;
        const float4 f_old = round == 0 ? make_float4(0, 0, 0, 0) : *f4;
        *q4 = make_float4(q_old.x + acc_q[0][h], q_old.y + acc_q[1][h], q_old.z + acc_q[2][h], q_old.w + acc_q[3][h]);
        *f4 = make_float4(f_old.x + acc_f[0][h], f_old.y + acc_f[1][h], f_old.z + acc_f[2][h], f_old.w + acc_f[3][h]);
      }
    }
  }
  __syncthreads();
  for (int e = tid; e < nh * 2 * d; e += kFusedThreads) {
    const size_t at = (size_t(r) * hq + j0 + e / (2 * d)) * num_splits + split;
    part[at * 2 * d + e % (2 * d)] = red[e];
  }
  if (tid < nh) {
    const size_t at = (size_t(r) * hq + j0 + tid) * num_splits + split;
    ml[at * 2] = s_m[tid];
    ml[at * 2 + 1] = s_l[tid];
  }
}

// Merges the splits of (row, query head): M = max m_s, L = sum exp(m_s - M) l_s, the values
// sum exp(m_s - M) part_s / L; TurboQuant de-rotates its part once; lse (null: none) = M + log L
// for rows with a slot. One thread per channel (blockDim.x >= d).
template <bool kKivi>
__global__ void quant_fused_combine_kernel(int hq, int hk, int d, int layer, int num_splits, Rows rows,
                                           const uint64_t* __restrict__ head_seeds, const float* __restrict__ part,
                                           const float* __restrict__ ml, float* __restrict__ out,
                                           float* __restrict__ lse) {
  extern __shared__ float s_acc[];  // [d]
  const int r = blockIdx.x, j = blockIdx.y, c = threadIdx.x;
  const size_t base = (size_t(r) * hq + j) * num_splits;
  float mx = -INFINITY;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, ml[(base + s) * 2]);
  float total = 0.0f, quantized = 0.0f, fp = 0.0f;
  bool any = false;  // a slot anywhere: the lse is written (NaN where the logits were), as staged
  for (int s = 0; s < num_splits; ++s) {
    const float l = ml[(base + s) * 2 + 1];
    if (l == 0.0f) continue;  // an empty split (a NaN sum goes on, so NaN stays NaN)
    any = true;
    const float f = expf(ml[(base + s) * 2] - mx);
    total = fmaf(f, l, total);
    if (c < d) {
      quantized = fmaf(f, part[(base + s) * 2 * d + c], quantized);
      fp = fmaf(f, part[(base + s) * 2 * d + d + c], fp);
    }
  }
  // A row with slots whose logits are all -inf: NaN, as the staged softmax (exp(-inf - -inf)).
  const bool nan_row = !any && slots_of(rows, r) > 0;
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  if (c < d) s_acc[c] = quantized * inv;
  if constexpr (!kKivi) fwht_rows(s_acc, 1, d);
  if (c >= d) return;
  float qpart = s_acc[c];
  if constexpr (!kKivi) qpart *= rotation_sign(head_seeds[layer * hk + j / (hq / hk)], c) * (1.0f / float(d));
  out[(size_t(r) * hq + j) * d + c] = nan_row ? NAN : qpart + fp * inv;
  if (lse != nullptr && c == 0 && (any || nan_row)) lse[size_t(r) * hq + j] = nan_row ? NAN : mx + logf(total);
}

// Slots per CTA of the value kernel for rows of up to `slots` slots: at least kSlotsPerSplit, and
// few enough splits for grid.z.
int split_slots(int slots) { return std::max(kSlotsPerSplit, ceil_div(slots, 65535)); }

template <typename T>
KernelStatus upload(const std::vector<T>& host, const T** out, Arena& arena, cudaStream_t stream) {
  T* d = nullptr;
  if (auto st = arena.take(std::max<size_t>(host.size(), 1), &d); !st.is_ok()) return st;
  if (!host.empty())
    KARAKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
  *out = d;
  return KernelStatus::ok();
}

// Calls f(storage type tag, bits tag, is_kivi tag) for the call's dtype and format.
template <typename F>
KernelStatus dispatch_quant(DType dtype, QuantFormat format, F&& f) {
  return common::dispatch_dtype(dtype, [&](auto dtag) {
    return common::dispatch_quant_bits(format, common::quant_bits(format), [&](auto btag) -> KernelStatus {
      constexpr int B = decltype(btag)::value;
      if (is_kivi(format)) {
        if constexpr (B == 3) return KernelStatus::invalid("kivi has no 3-bit format");
        else return f(dtag, btag, std::true_type{});
      }
      return f(dtag, btag, std::false_type{});
    });
  });
}

}  // namespace

KernelStatus launch_quantize_tokens(const DeviceKV& kv, DType dtype, const DeviceQuant& q, int seq, int slot_begin,
                                    int32_t dst, int32_t* first_bad, Arena& arena, cudaStream_t stream) {
  const int n = q.tokens_per_block, hk = kv.num_kv_heads, d = kv.head_dim;
  const int runs = kv.num_layers * 2 * hk;
  const bool kivi = is_kivi(q.format);
  KARAKV_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(first_bad, 0x7f, size_t(runs) * sizeof(int32_t), stream));
  float* norms = nullptr;
  if (!kivi)
    if (auto st = arena.take(size_t(runs) * n, &norms); !st.is_ok()) return st;
  return dispatch_quant(dtype, q.format, [&](auto dtag, auto btag, auto kivi_tag) -> KernelStatus {
    using T = storage_t<decltype(dtag)::value>;
    constexpr int B = decltype(btag)::value;
    quant_check_kernel<T><<<copy_grid((long long)runs * n), kCopyThreads, 0, stream>>>(kv, seq, slot_begin, n, kivi,
                                                                                     norms, first_bad);
    KARAKV_CUDA_CHECK_LAUNCH("quantize_tokens check");
    if constexpr (decltype(kivi_tag)::value) {
      const long long keys = (long long)kv.num_layers * hk * (n / kKiviGroup) * d;
      kivi_quantize_keys_kernel<T, B><<<copy_grid(keys), kCopyThreads, 0, stream>>>(kv, seq, slot_begin, n, dst,
                                                                                    first_bad);
      KARAKV_CUDA_CHECK_LAUNCH("kivi quantize keys");
      const long long values = (long long)kv.num_layers * hk * n * (d / kKiviGroup);
      kivi_quantize_values_kernel<T, B><<<copy_grid(values), kCopyThreads, 0, stream>>>(kv, seq, slot_begin, n, dst,
                                                                                        first_bad);
      KARAKV_CUDA_CHECK_LAUNCH("kivi quantize values");
    } else {
      const int tile = std::max(1, kTileElems / d);
      const dim3 grid(runs, ceil_div(n, tile));
      tq_quantize_kernel<T, B><<<grid, kThreads, size_t(tile) * d * sizeof(float), stream>>>(
          kv, seq, slot_begin, n, tile, dst, q.head_seeds, norms, first_bad, codebook<B>());
      KARAKV_CUDA_CHECK_LAUNCH("turboquant quantize");
    }
    return KernelStatus::ok();
  });
}

KernelStatus launch_dequantize_block(const DeviceKV& kv, DType dtype, const DeviceQuant& q, int32_t block, void* k,
                                     void* v, cudaStream_t stream) {
  const int n = q.tokens_per_block, hk = kv.num_kv_heads, d = kv.head_dim;
  return dispatch_quant(dtype, q.format, [&](auto dtag, auto btag, auto kivi_tag) -> KernelStatus {
    using T = storage_t<decltype(dtag)::value>;
    constexpr int B = decltype(btag)::value;
    if constexpr (decltype(kivi_tag)::value) {
      const long long total = (long long)kv.num_layers * n * hk * d;
      kivi_dequantize_kernel<T, B><<<copy_grid(total), kCopyThreads, 0, stream>>>(kv, n, block, static_cast<T*>(k),
                                                                                   static_cast<T*>(v));
      KARAKV_CUDA_CHECK_LAUNCH("kivi dequantize");
    } else {
      const int tile = std::max(1, kTileElems / d);
      const dim3 grid(kv.num_layers * 2 * hk, ceil_div(n, tile));
      tq_dequantize_kernel<T, B><<<grid, kThreads, size_t(tile) * d * sizeof(float), stream>>>(
          kv, n, tile, block, q.head_seeds, codebook<B>(), static_cast<T*>(k), static_cast<T*>(v));
      KARAKV_CUDA_CHECK_LAUNCH("turboquant dequantize");
    }
    return KernelStatus::ok();
  });
}

KernelStatus launch_quantized_attention(const DeviceKV& kv, DType dtype, const DeviceQuant& q, int layer,
                                        const std::vector<int32_t>& row_seq, const std::vector<int32_t>& row_quantized,
                                        const std::vector<int32_t>& row_fp, const std::vector<int32_t>& row_first,
                                        const float* query, float* out, float scale, float* group_probs,
                                        const std::vector<char>& row_on_device, float* const* row_acc, float* lse,
                                        bool fused, Arena& arena, cudaStream_t stream) {
  const int num_rows = int(row_seq.size());
  if (num_rows == 0) return KernelStatus::ok();
  const int hq = kv.num_q_heads, hk = kv.num_kv_heads, d = kv.head_dim;
  if (d > kMaxHeadDim)
    return KernelStatus::invalid("cuda quantized attention: head_dim " + std::to_string(d) + " exceeds " +
                                 std::to_string(kMaxHeadDim));
  const bool kivi = is_kivi(q.format);

  // Chunks of rows whose logits fit kChunkLogits; each row's logits offset is relative to its chunk.
  std::vector<int> chunk_begin{0}, chunk_max;
  std::vector<long long> offset(num_rows), group_offset(num_rows);
  std::vector<int32_t> first = row_first;
  if (first.empty()) first.assign(num_rows, 0);
  if (int(first.size()) != num_rows)
    return KernelStatus::invalid("cuda quantized attention: " + std::to_string(first.size()) + " first slots for " +
                                 std::to_string(num_rows) + " rows");
  long long used = 0, group_total = 0, largest = 0;
  int max_slots = 0;
  for (int r = 0; r < num_rows; ++r) {
    const long long slots = (long long)row_quantized[r] + row_fp[r];
    if (r > chunk_begin.back() && used + slots * hq > kChunkLogits) {
      chunk_max.push_back(max_slots);
      chunk_begin.push_back(r);
      used = 0;
      max_slots = 0;
    }
    offset[r] = used;
    used += slots * hq;
    largest = std::max(largest, used);
    max_slots = std::max<int>(max_slots, int(slots));
    const bool on_device = !row_on_device.empty() && row_on_device[r];
    group_offset[r] = on_device ? -1 : group_total;
    if (!on_device) group_total += (slots - first[r]) * hk;
  }
  chunk_max.push_back(max_slots);
  chunk_begin.push_back(num_rows);

  const int32_t *dseq = nullptr, *dquant = nullptr, *dfp = nullptr;
  const long long *doffset = nullptr, *dgroup = nullptr;
  const int32_t* dfirst = nullptr;
  if (auto st = upload(row_seq, &dseq, arena, stream); !st.is_ok()) return st;
  if (auto st = upload(row_quantized, &dquant, arena, stream); !st.is_ok()) return st;
  if (auto st = upload(row_fp, &dfp, arena, stream); !st.is_ok()) return st;
  if (auto st = upload(offset, &doffset, arena, stream); !st.is_ok()) return st;
  const bool scoring = group_probs != nullptr || row_acc != nullptr;
  if (scoring) {
    if (auto st = upload(group_offset, &dgroup, arena, stream); !st.is_ok()) return st;
    if (auto st = upload(first, &dfirst, arena, stream); !st.is_ok()) return st;
  }

  // The fused kernels split every row in kFusedSplit slots (grid.z): rows too long for that take
  // the staged path, as does a pool not 16-byte aligned (its KIVI scales are read 8 bytes at a time
  // from records staged at their pool offsets mod 4; cudaMalloc and IPC pools are 256-aligned).
  fused = fused && reinterpret_cast<uintptr_t>(kv.pool) % 16 == 0 &&
          std::all_of(chunk_max.begin(), chunk_max.end(), [](int m) { return ceil_div(m, kFusedSplit) <= 65535; });
  size_t max_chunk_rows = 0, max_part = 0, max_splits = 0;
  for (size_t i = 0; i + 1 < chunk_begin.size(); ++i) {
    const size_t rows = size_t(chunk_begin[i + 1] - chunk_begin[i]);
    const size_t splits = std::max(1, fused ? ceil_div(chunk_max[i], kFusedSplit)
                                            : ceil_div(chunk_max[i], split_slots(chunk_max[i])));
    max_chunk_rows = std::max(max_chunk_rows, rows);
    max_part = std::max(max_part, rows * hq * splits * 2 * d);
    max_splits = std::max(max_splits, rows * hq * splits);
  }
  float *logits = nullptr, *qrot = nullptr, *part = nullptr, *ml = nullptr, *lse_scratch = nullptr;
  if (fused) {  // the splits' (max, sum); for observers an lse, and their slots' exp(logit - m_s)
    if (auto st = arena.take(max_splits * 2, &ml); !st.is_ok()) return st;
    if (scoring && lse == nullptr)
      if (auto st = arena.take(max_chunk_rows * hq, &lse_scratch); !st.is_ok()) return st;
  }
  if (!fused || scoring)  // the staged kernels' logits, or (fused) the observed slots' in the same layout
    if (auto st = arena.take(size_t(std::max<long long>(largest, 1)), &logits); !st.is_ok()) return st;
  if (auto st = arena.take(max_part, &part); !st.is_ok()) return st;
  if (!kivi)
    if (auto st = arena.take(max_chunk_rows * hq * d, &qrot); !st.is_ok()) return st;

  return dispatch_quant(dtype, q.format, [&](auto dtag, auto btag, auto kivi_tag) -> KernelStatus {
    using T = storage_t<decltype(dtag)::value>;
    constexpr int B = decltype(btag)::value;
    constexpr bool kKivi = decltype(kivi_tag)::value;
    const Codebook book = codebook<B>();
    for (size_t i = 0; i + 1 < chunk_begin.size(); ++i) {
      const int r0 = chunk_begin[i], rows = chunk_begin[i + 1] - r0, slots = chunk_max[i];
      const Rows chunk{dseq + r0, dquant + r0, dfp + r0, doffset + r0};
      const float* cq = query + size_t(r0) * hq * d;
      float* cout = out + size_t(r0) * hq * d;
      if (slots == 0) {  // nothing to attend: zeros, as the reference
        KARAKV_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(cout, 0, size_t(rows) * hq * d * sizeof(float), stream));
        continue;
      }
      if constexpr (!kKivi) {
        rotate_queries_kernel<<<dim3(rows, hq), std::min(d, kThreads), d * sizeof(float), stream>>>(
            hq, hk, d, layer, q.head_seeds, cq, qrot);
        KARAKV_CUDA_CHECK_LAUNCH("quantized attention rotate");
      }
      const int threads = (d + 31) / 32 * 32;
      int fused_splits = 0;         // fused: its splits, for the observers' rescaling
      float* clse = nullptr;        // fused: the log-sum-exps the observers rescale by
      if (fused) {
        const int splits = ceil_div(slots, kFusedSplit);
        quant_fused_kernel<T, B, kKivi><<<dim3(rows, hk * fused_passes(hq / hk), splits), kFusedThreads,
                                          fused_shared_bytes(kKivi, B, d), stream>>>(
            kv, q, layer, chunk, cq, qrot, scale, book, splits, part, ml, scoring ? dfirst + r0 : nullptr,
            scoring ? logits : nullptr);
        KARAKV_CUDA_CHECK_LAUNCH("quantized attention fused");
        fused_splits = splits;
        clse = lse != nullptr ? lse + size_t(r0) * hq : lse_scratch;
        quant_fused_combine_kernel<kKivi><<<dim3(rows, hq), threads, d * sizeof(float), stream>>>(
            hq, hk, d, layer, splits, chunk, q.head_seeds, part, ml, cout, clse);
        KARAKV_CUDA_CHECK_LAUNCH("quantized attention fused combine");
      } else {
        const int passes = hk * head_passes(hq / hk);
        quant_logits_kernel<T, B, kKivi><<<dim3(rows, passes, std::min(ceil_div(slots, kScoreThreads), 65535)),
                                           kScoreThreads, (kKivi ? 1 : 2) * kHeadsPerPass * d * sizeof(float),
                                           stream>>>(kv, q, layer, chunk, cq, qrot, scale, book, logits);
        KARAKV_CUDA_CHECK_LAUNCH("quantized attention logits");
        quant_softmax_kernel<<<dim3(rows, hq), kThreads, 0, stream>>>(hq, chunk, logits,
                                                                     lse != nullptr ? lse + size_t(r0) * hq : nullptr);
        KARAKV_CUDA_CHECK_LAUNCH("quantized attention softmax");
        const int per_split = split_slots(slots), splits = std::max(1, ceil_div(slots, per_split));
        quant_values_kernel<T, B, kKivi><<<dim3(rows, passes, splits), threads, 0, stream>>>(
            kv, q, layer, chunk, logits, splits, per_split, book, part);
        KARAKV_CUDA_CHECK_LAUNCH("quantized attention values");
        quant_combine_kernel<kKivi><<<dim3(rows, hq), threads, d * sizeof(float), stream>>>(
            hq, hk, d, layer, splits, q.head_seeds, part, cout);
        KARAKV_CUDA_CHECK_LAUNCH("quantized attention combine");
      }
      if (scoring) {  // staged: the softmax's probabilities; fused: what its splits kept, rescaled
        const dim3 grid(rows, hk, std::min(ceil_div(slots, kThreads), 65535));
        quant_group_probs_kernel<<<grid, kThreads, 0, stream>>>(
            hq, hk, chunk, logits, fused ? ml : nullptr, clse, fused_splits, dfirst + r0, dgroup + r0, group_probs,
            row_acc != nullptr ? row_acc + size_t(r0) * hk : nullptr);
        KARAKV_CUDA_CHECK_LAUNCH("quantized attention probabilities");
      }
    }
    return KernelStatus::ok();
  });
}

}  // namespace karakv::kernels::cuda
