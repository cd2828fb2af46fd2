// What every backend must agree on about quantized storage (docs/COMPRESSION.md section 3; the
// records themselves are described in cpu/quant.h, "Byte layouts"): each format's bits and token
// granularity, the size of its key and value records, the head_dims it accepts, and how many
// tokens one quantized block of the pool holds. Plain C++17 that nvcc includes: the record sizes
// and format facts are host and device functions, the run and block sizes host ones (constexpr,
// callable from device code only with --expt-relaxed-constexpr), so neither backend reaches into
// the other for the layout.
#pragma once

#include <cstddef>
#include <numeric>

#include "karakv/kernels/types.h"

#if defined(__CUDACC__)
#define KARAKV_HOST_DEVICE __host__ __device__
#else
#define KARAKV_HOST_DEVICE
#endif

namespace karakv::kernels::common {

constexpr int kKiviGroup = 32;           // KIVI: tokens per key group, channels per value group
constexpr int kMaxQuantHeadDim = 4096;   // the largest head_dim any format accepts

KARAKV_HOST_DEVICE constexpr bool is_kivi(QuantFormat f) {
  return f == QuantFormat::kKivi2 || f == QuantFormat::kKivi4;
}

// 2, 3 or 4; 0 for a value that is not a format.
KARAKV_HOST_DEVICE constexpr int quant_bits(QuantFormat f) {
  switch (f) {
    case QuantFormat::kKivi2: case QuantFormat::kTq2: return 2;
    case QuantFormat::kTq3: return 3;
    case QuantFormat::kKivi4: case QuantFormat::kTq4: return 4;
  }
  return 0;
}

// Granularity in tokens in which runs are quantized: 32 for KIVI (key groups), 1 for TurboQuant;
// 0 for an unknown format.
KARAKV_HOST_DEVICE constexpr int token_multiple(QuantFormat f) {
  return quant_bits(f) == 0 ? 0 : is_kivi(f) ? kKiviGroup : 1;
}

// KIVI: a multiple of 32 channels; TurboQuant: a power of two >= 8 (the Walsh-Hadamard rotation).
KARAKV_HOST_DEVICE constexpr bool quant_head_dim_ok(QuantFormat f, int d) {
  if (d < 1 || d > kMaxQuantHeadDim) return false;
  if (is_kivi(f)) return d % kKiviGroup == 0;
  return d >= 8 && (d & (d - 1)) == 0;
}

// Record sizes in bytes: a KIVI key group of 32 tokens, a KIVI value token, a TurboQuant token.
KARAKV_HOST_DEVICE constexpr size_t kivi_key_group_bytes(int bits, int d) {
  return 4 * size_t(d) + size_t(4) * bits * d;
}
KARAKV_HOST_DEVICE constexpr size_t kivi_value_token_bytes(int bits, int d) {
  return 4 * size_t(d / kKiviGroup) + size_t(d) * bits / 8;
}
KARAKV_HOST_DEVICE constexpr size_t tq_token_bytes(int bits, int d) { return 2 + size_t(d) * bits / 8; }

// Bytes of the key (value) run of n tokens of one (layer, KV head); 0 when (f, n, d) is not a valid
// run: an unknown format, n < 0, keys of n not a multiple of token_multiple(f), or d not allowed.
constexpr size_t key_run_bytes(QuantFormat f, int n, int d) {
  if (quant_bits(f) == 0 || n < 0 || !quant_head_dim_ok(f, d)) return 0;
  if (is_kivi(f)) return n % kKiviGroup != 0 ? 0 : size_t(n / kKiviGroup) * kivi_key_group_bytes(quant_bits(f), d);
  return size_t(n) * tq_token_bytes(quant_bits(f), d);
}
constexpr size_t value_run_bytes(QuantFormat f, int n, int d) {
  if (quant_bits(f) == 0 || n < 0 || !quant_head_dim_ok(f, d)) return 0;
  return size_t(n) * (is_kivi(f) ? kivi_value_token_bytes(quant_bits(f), d) : tq_token_bytes(quant_bits(f), d));
}

// Tokens one quantized block holds: the most tokens, a multiple of both token_multiple(format) and
// block_size, whose key run and value run each fit where the block keeps one (layer, K/V, head) run
// of block_size unquantized tokens (so a quantized block has the layout of any other). 0 when the
// format cannot store this geometry.
inline int quantized_tokens_per_block(const Geometry& g, QuantFormat format) {
  if (g.block_size < 1 || token_multiple(format) == 0) return 0;
  const size_t run = size_t(g.block_size) * g.head_dim * dtype_size(g.dtype);
  const int multiple = std::lcm(token_multiple(format), g.block_size);
  int best = 0;
  for (int n = multiple; n <= 1 << 16; n += multiple) {
    const size_t kb = key_run_bytes(format, n, g.head_dim), vb = value_run_bytes(format, n, g.head_dim);
    if (kb == 0 || vb == 0 || kb > run || vb > run) break;
    best = n;
  }
  return best;
}

}  // namespace karakv::kernels::common
