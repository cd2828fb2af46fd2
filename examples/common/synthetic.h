// Deterministic synthetic K/V/Q for workers, tests and benchmarks, plus a dense float64 attention
// reference. Values depend only on (seed, sequence, layer, position, head, dim), so any process
// can regenerate any token without storing it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "karakv/kernels/half.h"
#include "karakv/kernels/types.h"

namespace karakv::synthetic {

enum class Tensor : uint64_t { kKey = 1, kValue = 2, kQuery = 3 };

// A value in [-1, 1) from a 64-bit mix (splitmix64) of its coordinates.
inline float value(uint64_t seed, Tensor t, uint64_t seq, int layer, int64_t pos, int head, int dim) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ull ^ (uint64_t(t) << 56) ^ (seq << 40) ^
               (uint64_t(layer) << 32) ^ (uint64_t(pos) << 12) ^ (uint64_t(head) << 7) ^ uint64_t(dim);
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return float(x >> 40) / float(1 << 23) - 1.0f;
}

// Rounds through the storage dtype, as the pool stores it.
inline double stored(float v, kernels::DType d) {
  switch (d) {
    case kernels::DType::kFloat16: return kernels::half_to_float(kernels::float_to_half(v));
    case kernels::DType::kBFloat16: return kernels::bf16_to_float(kernels::float_to_bf16(v));
    default: return v;
  }
}

// Writes one value in the storage dtype at element index i of `dst`.
inline void store(void* dst, size_t i, float v, kernels::DType d) {
  switch (d) {
    case kernels::DType::kFloat16: static_cast<uint16_t*>(dst)[i] = kernels::float_to_half(v); break;
    case kernels::DType::kBFloat16: static_cast<uint16_t*>(dst)[i] = kernels::float_to_bf16(v); break;
    default: static_cast<float*>(dst)[i] = v; break;
  }
}

// Fills K or V for tokens [pos0, pos0 + T) of all layers: [L][T][Hk][D] storage dtype.
inline void fill_prompt(void* dst, const kernels::Geometry& g, uint64_t seed, Tensor t, uint64_t seq,
                        int64_t pos0, int num_tokens) {
  size_t i = 0;
  for (int l = 0; l < g.num_layers; ++l)
    for (int p = 0; p < num_tokens; ++p)
      for (int h = 0; h < g.num_kv_heads; ++h)
        for (int d = 0; d < g.head_dim; ++d) store(dst, i++, value(seed, t, seq, l, pos0 + p, h, d), g.dtype);
}

// Fills one token's K or V ([Hk][D] storage dtype) for one layer.
inline void fill_token(void* dst, const kernels::Geometry& g, uint64_t seed, Tensor t, uint64_t seq, int layer,
                       int64_t pos) {
  size_t i = 0;
  for (int h = 0; h < g.num_kv_heads; ++h)
    for (int d = 0; d < g.head_dim; ++d) store(dst, i++, value(seed, t, seq, layer, pos, h, d), g.dtype);
}

// Fills one token's queries ([Hq][D] fp32) for one layer.
inline void fill_query(float* dst, const kernels::Geometry& g, uint64_t seed, uint64_t seq, int layer, int64_t pos) {
  size_t i = 0;
  for (int h = 0; h < g.num_q_heads; ++h)
    for (int d = 0; d < g.head_dim; ++d) dst[i++] = value(seed, Tensor::kQuery, seq, layer, pos, h, d);
}

// Dense float64 attention of the query of `pos` over positions 0..pos of one sequence and layer,
// every query head (GQA): returns [Hq][D].
inline std::vector<double> dense_attention(const kernels::Geometry& g, uint64_t seed, uint64_t seq, int layer,
                                           int64_t pos) {
  const int gs = g.group_size();
  const double scale = 1.0 / std::sqrt(double(g.head_dim));
  std::vector<double> out(size_t(g.num_q_heads) * g.head_dim, 0.0);
  std::vector<double> s(size_t(pos) + 1);
  for (int qh = 0; qh < g.num_q_heads; ++qh) {
    const int kh = qh / gs;
    double mx = -INFINITY;
    for (int64_t p = 0; p <= pos; ++p) {
      double dot = 0;
      for (int d = 0; d < g.head_dim; ++d) {
        dot += double(value(seed, Tensor::kQuery, seq, layer, pos, qh, d)) *
               stored(value(seed, Tensor::kKey, seq, layer, p, kh, d), g.dtype);
      }
      s[p] = dot * scale;
      mx = std::max(mx, s[p]);
    }
    double sum = 0;
    for (int64_t p = 0; p <= pos; ++p) sum += (s[p] = std::exp(s[p] - mx));
    for (int64_t p = 0; p <= pos; ++p) {
      for (int d = 0; d < g.head_dim; ++d) {
        out[size_t(qh) * g.head_dim + d] += s[p] / sum * stored(value(seed, Tensor::kValue, seq, layer, p, kh, d), g.dtype);
      }
    }
  }
  return out;
}

// Dense float64 attention of the query of `pos` at `layer` over exactly the given resident
// positions of each KV head (a compacted cache): heads[h] lists the positions, returns [Hq][D].
inline std::vector<double> dense_attention_over(const kernels::Geometry& g, uint64_t seed, uint64_t seq, int layer,
                                                int64_t pos, const std::vector<std::vector<int32_t>>& heads) {
  const int gs = g.group_size();
  const double scale = 1.0 / std::sqrt(double(g.head_dim));
  std::vector<double> out(size_t(g.num_q_heads) * g.head_dim, 0.0);
  for (int qh = 0; qh < g.num_q_heads; ++qh) {
    const int kh = qh / gs;
    const std::vector<int32_t>& keep = heads[kh];
    std::vector<double> s(keep.size());
    double mx = -INFINITY;
    for (size_t i = 0; i < keep.size(); ++i) {
      double dot = 0;
      for (int d = 0; d < g.head_dim; ++d) {
        dot += double(value(seed, Tensor::kQuery, seq, layer, pos, qh, d)) *
               stored(value(seed, Tensor::kKey, seq, layer, keep[i], kh, d), g.dtype);
      }
      s[i] = dot * scale;
      mx = std::max(mx, s[i]);
    }
    double sum = 0;
    for (double& x : s) sum += (x = std::exp(x - mx));
    for (size_t i = 0; i < keep.size(); ++i) {
      for (int d = 0; d < g.head_dim; ++d) {
        out[size_t(qh) * g.head_dim + d] += s[i] / sum * stored(value(seed, Tensor::kValue, seq, layer, keep[i], kh, d), g.dtype);
      }
    }
  }
  return out;
}

// Reads element i of a tensor in the storage dtype.
inline double load(const void* src, size_t i, kernels::DType d) {
  switch (d) {
    case kernels::DType::kFloat16: return kernels::half_to_float(static_cast<const uint16_t*>(src)[i]);
    case kernels::DType::kBFloat16: return kernels::bf16_to_float(static_cast<const uint16_t*>(src)[i]);
    default: return static_cast<const float*>(src)[i];
  }
}

// Dense float64 attention of one token's queries at `layer` over a cache as ReadKV returns it
// (T resident tokens, whatever compression or quantization made of them) plus the token's own
// K/V: what the daemon's Step must compute. Returns [Hq][D].
//   cache_k, cache_v: [L][T][Hk][D] storage dtype; new_k, new_v: [Hk][D] storage dtype; q: [Hq][D]
inline std::vector<double> dense_attention_over_cache(const kernels::Geometry& g, const void* cache_k,
                                                      const void* cache_v, int num_tokens, int layer,
                                                      const void* new_k, const void* new_v, const float* q) {
  const int gs = g.group_size(), d = g.head_dim, hk = g.num_kv_heads;
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<double> out(size_t(g.num_q_heads) * d, 0.0), s(size_t(num_tokens) + 1);
  auto at = [&](const void* cache, const void* fresh, int t, int h, int c) {
    return t < num_tokens ? load(cache, ((size_t(layer) * num_tokens + t) * hk + h) * d + c, g.dtype)
                          : load(fresh, size_t(h) * d + c, g.dtype);
  };
  for (int qh = 0; qh < g.num_q_heads; ++qh) {
    const int h = qh / gs;
    double mx = -INFINITY, sum = 0;
    for (int t = 0; t <= num_tokens; ++t) {
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += double(q[qh * d + c]) * at(cache_k, new_k, t, h, c);
      s[t] = dot * scale;
      mx = std::max(mx, s[t]);
    }
    for (double& x : s) sum += (x = std::exp(x - mx));
    for (int t = 0; t <= num_tokens; ++t)
      for (int c = 0; c < d; ++c) out[size_t(qh) * d + c] += s[t] / sum * at(cache_v, new_v, t, h, c);
  }
  return out;
}

}  // namespace karakv::synthetic
