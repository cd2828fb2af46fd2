// The CPU quantization and merging kernels of docs/COMPRESSION.md section 3: KIVI and TurboQuant
// over one run (the quantized K or V of n tokens of one (layer, KV head)), and CaM's value merge.
// Kernels validate their arguments before writing anything, are single-threaded (callers
// parallelise over runs) and deterministic: same inputs and seed, same bytes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../common/quant_layout.h"
#include "karakv/kernels/types.h"

namespace karakv::kernels::cpu {

using kernels::QuantFormat;  // types.h: the formats the daemon stores

const char* quant_format_name(QuantFormat f);  // "kivi2", ..., "tq4"; "unknown" otherwise

// The layout both backends share (common/quant_layout.h): bits (2, 3 or 4; 0 for an unknown
// format), the largest head_dim any format accepts, run sizes and token granularity below.
using common::kMaxQuantHeadDim;
using common::quant_bits;

// ---------------------------------------------------------------------------------------------
// Byte layouts. A run is a concatenation of self-contained records, so the run of tokens
// [0, a + b) is the run of [0, a) followed by the run of [a, a + b) (a a multiple of
// token_multiple): the daemon can append records as tokens age out of the full-precision window.
// All fp16 fields are IEEE binary16 (half.h, round to nearest even), little-endian, and are read
// with memcpy, so runs need no alignment. Codes are packed LSB first: code i of a stream of b-bit
// codes occupies bits [i*b, (i+1)*b) of the stream, stream bit j being bit (j % 8) of byte j / 8
// (3-bit codes straddle bytes).
//
// KIVI keys (b = 2 or 4; n a multiple of 32; d a multiple of 32): n / 32 group records, group g
// holding tokens [32g, 32g + 32), each record 4*d + 4*b*d bytes:
//   scale: [d] fp16            per channel
//   zero:  [d] fp16            per channel
//   codes: [d][32 * b / 8]     channel c's codes of the group's 32 tokens, token t is code t
// KIVI values (d a multiple of 32): n token records of 4*(d/32) + d*b/8 bytes:
//   scale: [d/32] fp16         per group of 32 channels
//   zero:  [d/32] fp16
//   codes: [d * b / 8]         channel c is code c
// TurboQuant keys and values (b = 2, 3 or 4; d a power of two >= 8): n token records of
// 2 + d*b/8 bytes:
//   norm:  fp16                ||x||
//   codes: [d * b / 8]         rotated coordinate c is code c: the index of its centroid in
//                              ascending order (code 0 is the most negative centroid)
//
// Bytes of the run of n tokens; 0 when (f, n, d) is not a valid run (n < 0, n not a multiple of
// token_multiple(f) for keys, or d not allowed for f).
// Granularity in tokens in which runs are quantized (token_multiple): 32 for KIVI (key groups), 1
// for TurboQuant, 0 for an unknown format.
using common::key_run_bytes;
using common::token_multiple;
using common::value_run_bytes;

// ---------------------------------------------------------------------------------------------
// KIVI (asymmetric min-max). For a group with fp32 minimum m and maximum M and L = 2^b - 1:
//   s = fp16((M - m) / L), z = fp16(m), code = clamp(round((x - z) / s), 0, L) (all 0 if s == 0),
//   x' = code * s + z in fp32.
// Error bound, per element against its group's stored s and z:
//   |x - x'| <= s/2 + |m - z| + L*|s - (M - m)/L| + fp32 rounding.
// Why: for x in [z, z + L*s] rounding to the nearest multiple of s errs by at most s/2. Below z
// (only when z > m) the code clamps to 0 and the error is z - x <= |m - z|. Above z + L*s the code
// clamps to L and the error is x - z - L*s <= (M - m) - L*s + (m - z) <= L*|s - (M-m)/L| + |m - z|.
// Since fp16 rounds to nearest, |m - z| <= 2^-11 |m| (2^-25 below 2^-14) and
// L*|s - (M-m)/L| <= 2^-11 (M - m) (+ one fp32 rounding of the division), so the fp16 slack is
// about 2^-11 * (|m| + M - m): negligible against s/2 unless the group sits far from 0 relative
// to its spread. The fp32 rounding of (x - z)/s and of code*s + z adds a few 2^-24 * (|z| + L*s).
// Inputs must be finite and within the fp16 range [-65504, 65504] so that s and z are finite.
//
// TurboQuant. R = H * D / sqrt(d): D the diagonal of random signs of `seed`, H the d x d
// Walsh-Hadamard matrix (Sylvester order), so R is orthogonal and R^T = D * H / sqrt(d).
// Sign i is -1 iff the top bit of splitmix64 output i+1 seeded with `seed` is set, i.e. of
//   z = seed + (i + 1) * 0x9E3779B97F4A7C15; z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9;
//   z = (z ^ z >> 27) * 0x94D049BB133111EB; z ^= z >> 31.
// Sign i depends on (seed, i) only. The seed names the rotation of one (layer, KV head); quantize
// and dequantize must be given the same seed. Per token: norm = ||x|| (fp32 from an fp64 sum,
// stored fp16, must be finite in fp16), u = R x / ||x||, each u_c * sqrt(d) mapped to the nearest
// Lloyd-Max centroid for N(0, 1) (ties to the lower one); x' = norm * R^T c with c the centroids /
// sqrt(d). A zero vector stores norm 0 and all-zero codes and dequantizes to 0. The expected
// relative error E||x - x'||^2 / ||x||^2 is the Lloyd-Max distortion of N(0, 1): about 0.1175,
// 0.03454 and 0.009497 for 2, 3 and 4 bits (coordinates of u are close to N(0, 1/d)).
// ---------------------------------------------------------------------------------------------

// Quantizes n tokens into a run of key_run_bytes / value_run_bytes bytes (seed is ignored by
// KIVI). On an error nothing has been written.
//   x:   [n][d] fp32
//   run: [key_run_bytes(f, n, d)] or [value_run_bytes(f, n, d)]
KernelStatus quantize_keys(QuantFormat f, const float* x, int n, int d, uint64_t seed, uint8_t* run);
KernelStatus quantize_values(QuantFormat f, const float* x, int n, int d, uint64_t seed, uint8_t* run);

// The inverse: x'[t] as defined above.
//   run: as written by quantize_keys / quantize_values
//   x:   [n][d] fp32
KernelStatus dequantize_keys(QuantFormat f, const uint8_t* run, int n, int d, uint64_t seed, float* x);
KernelStatus dequantize_values(QuantFormat f, const uint8_t* run, int n, int d, uint64_t seed, float* x);

// scores[t] = scale * q . k'_t over the dequantized keys k', without materialising them. KIVI:
// per group, q_c * s_c is formed once and sum_c q_c * z_c is added per token. TurboQuant: q is
// rotated once (q . R^T c = (R q) . c) and scores[t] = scale * norm_t * sum_c (Rq)_c * c_tc.
//   run:    a key run of n tokens
//   q:      [d] fp32
//   scores: [n] fp32
KernelStatus quantized_key_scores(QuantFormat f, const uint8_t* run, int n, int d, uint64_t seed, const float* q,
                                  float scale, float* scores);

// out += sum_t p[t] * v'_t over the dequantized values v'. TurboQuant accumulates in the rotated
// space and de-rotates once at the end.
//   run: a value run of n tokens
//   p:   [n] fp32
//   out: [d] fp32, accumulated into
KernelStatus quantized_value_accumulate(QuantFormat f, const uint8_t* run, int n, int d, uint64_t seed, const float* p,
                                        float* out);

// The two above for the `heads` query heads that share the run's KV head (GQA), each code decoded
// once for all of them; head m gives exactly what the one-head call with its own row would.
//   q:      [heads][d] fp32;  scores: head m's [n] at scores + m * stride
//   p:      head m's [n] at p + m * stride;  out: [heads][d] fp32, accumulated into
// Requires heads >= 1 and, for heads > 1, stride >= n.
KernelStatus quantized_key_scores_heads(QuantFormat f, const uint8_t* run, int n, int d, uint64_t seed,
                                        const float* q, int heads, float scale, float* scores, size_t stride);
KernelStatus quantized_value_accumulate_heads(QuantFormat f, const uint8_t* run, int n, int d, uint64_t seed,
                                              const float* p, int heads, size_t stride, float* out);

// y = R x and its inverse x = R^T y (R as above; d a power of two <= kMaxQuantHeadDim). x and y
// may be the same array.
//   x, y: [d] fp32
KernelStatus hadamard_rotate(const float* x, int d, uint64_t seed, float* y);
KernelStatus hadamard_unrotate(const float* y, int d, uint64_t seed, float* x);

// ---------------------------------------------------------------------------------------------
// CaM version 2, the convex normalised merge, over one (layer, KV head) row of a compaction of the
// n slots [0, n) (Backend::cam_merge_values runs it per row). With a the policy's score of every
// slot (kept ones too) and M = merge_tokens:
//   targets T(e) of an evicted slot e: the next M kept slots after e, fewer where fewer follow
//     (kept indices [j, min(j + M, num_kept)), j the first kept index with kept[j] > e); when no
//     kept slot follows e, the last min(M, num_kept) kept slots of the row (the nearest before e).
//   gate p_e = min(1, a_e / mean(a_k for k in T(e))); when that mean is 0, p_e = 1 if a_e > 0 (the
//     targets carry no mass, the evicted token does) and 0 otherwise.
//   share w_e = 1 / |T(e)|, so the weight e lends each target is c_e = p_e * a_e / |T(e)|.
//   V'_k = (a_k V_k + sum_{e: k in T(e)} c_e V_e) / (a_k + sum_{e: k in T(e)} c_e)
// Scores that are negative or not finite (NaN, +-inf) are read as 0. A kept slot that absorbs no
// weight (every c_e = 0, which includes a denominator of 0) keeps V_k unchanged, bit for bit; so
// does every kept slot of a row with nothing evicted. V'_k is a convex combination of its inputs,
// so ||V'_k|| <= max(||V_k||, ||V_e||). With num_kept = 0 there is nothing to write.
// Arithmetic (the CUDA kernel repeats it operation for operation, so the two agree to the last
// bit of fp32 before the store): scores widened to double; sum(a_k over T(e)) added in double in
// ascending kept order, mean = sum / |T(e)|, p_e = min(1, a_e / mean), c_e = (p_e * a_e) / |T(e)|;
// per kept k the numerator starts at a_k * V_k (exact in double) and takes
// fma(c_e, V_e, numerator) over the evicted e in ascending slot order, the absorbed weight adds
// the c_e in the same order, and V'_k = float(numerator / (a_k + absorbed)): one rounding to fp32.
// Deterministic. Keys are not this function's concern (CaM never changes them).
//   scores:   [n] fp32, a of every slot of the range
//   kept:     [num_kept] int32, ascending, distinct, in [0, n)
//   values:   [n][d] fp32, the value of every slot (kept and evicted), row-major
//   kept_out: [num_kept][d] fp32, V'_k of kept[i] in row i (must not overlap values)
// Requires 1 <= merge_tokens, 0 <= num_kept <= n, d >= 1.
// kCamMergeTokens: a default merge width M (the daemon passes its policy's configured `merge`).
constexpr int kCamMergeTokens = 4;
KernelStatus cam_merge(const float* scores, int n, const int32_t* kept, int num_kept, int merge_tokens,
                       const float* values, int d, float* kept_out);

}  // namespace karakv::kernels::cpu
