// Quantized blocks in the pool (quant_storage.h). Each (layer, K/V, head) run of a quantized block
// sits where an unquantized block keeps that run, so one block layout serves both.
#include "quant_storage.h"

#include <algorithm>
#include <mutex>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "../common/checks.h"
#include "../common/validate.h"
#include "karakv/kernels/half.h"
#include "quant.h"
#include "scratch.h"
#include "simd.h"
#include "work_pool.h"

namespace karakv::kernels::cpu {
namespace {


uint8_t* run_bytes(const PagedKV& kv, int32_t block, int layer, int kvi, int head) {
  return static_cast<uint8_t*>(kv.pool) + kv.run_offset(block, layer, kvi, head) * dtype_size(kv.geometry.dtype);
}

// Element index of unquantized slot `slot` of (layer, kvi, head) of sequence `seq`.
size_t slot_index(const PagedKV& kv, int seq, int slot, int layer, int kvi, int head) {
  const Geometry& g = kv.geometry;
  return kv.run_offset(kv.block_of(seq, slot), layer, kvi, head) + size_t(slot % g.block_size) * g.head_dim;
}

KernelStatus check_qkv(std::string_view op, const PagedKV& kv, const QuantizedKV& q) {
  KARAKV_RETURN_IF_ERROR(common::check_geometry(op, kv));
  if (q.tokens_per_block < 1 || q.tokens_per_block != quantized_tokens_per_block(kv.geometry, q.format))
    return KernelStatus::invalid(std::string(op) + ": tokens_per_block " + std::to_string(q.tokens_per_block) +
                                 " does not match the format's " +
                                 std::to_string(quantized_tokens_per_block(kv.geometry, q.format)));
  return KernelStatus::ok();
}

// The unquantized tail of one (sequence, layer, KV head): rows[t] is the element offset of slot
// t's K row in the pool; its V row is `to_value` elements further (PagedKV::run_offset).
struct TailRows {
  const size_t* rows;
  int visible;
  size_t to_value;
};

// Each thread's offsets of slots [0, visible) of (layer, head) of seq, computed once for K and V.
TailRows tail_rows(const PagedKV& kv, int seq, int visible, int layer, int head) {
  static thread_local std::vector<size_t> rows;
  rows.resize(size_t(visible));
  for (int t = 0; t < visible; ++t) rows[t] = slot_index(kv, seq, t, layer, 0, head);
  const Geometry& g = kv.geometry;
  return {rows.data(), visible, size_t(g.num_kv_heads) * g.block_size * g.head_dim};
}

#if KARAKV_CPU_AVX2
// The tail for the query heads [0, H): each row is widened eight elements at a time straight from
// the pool and used by all H heads; every head keeps its own accumulators (simd.h,
// for_head_chunks).
//   logits: head h's t-th at logits[h * n + t] = scale * q_h . k_t
template <DType D, int H>
void tail_logits(const storage_t<D>* pool, TailRows tail, int d, const float* q, float scale, float* logits,
                 size_t n) {
  for (int t = 0; t < tail.visible; ++t) {
    const storage_t<D>* k = pool + tail.rows[t];
    __m256 acc[H];
    for (int h = 0; h < H; ++h) acc[h] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8) {
      const __m256 kc = load8<D>(k + c);
      for (int h = 0; h < H; ++h) acc[h] = _mm256_fmadd_ps(kc, _mm256_loadu_ps(q + size_t(h) * d + c), acc[h]);
    }
    for (int h = 0; h < H; ++h) logits[h * n + t] = hsum(acc[h]) * scale;
  }
}

//   out[h][c] += sum_t probs[h * n + t] * v_t[c], eight channels at a time summed in registers
template <DType D, int H>
void tail_values(const storage_t<D>* pool, TailRows tail, int d, const float* probs, size_t n, float* out) {
  const storage_t<D>* values = pool + tail.to_value;
  for (int c = 0; c < d; c += 8) {
    __m256 acc[H];
    for (int h = 0; h < H; ++h) acc[h] = _mm256_setzero_ps();
    for (int t = 0; t < tail.visible; ++t) {
      const __m256 vc = load8<D>(values + tail.rows[t] + c);
      for (int h = 0; h < H; ++h) acc[h] = _mm256_fmadd_ps(_mm256_set1_ps(probs[h * n + t]), vc, acc[h]);
    }
    for (int h = 0; h < H; ++h) {
      float* o = out + size_t(h) * d + c;
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[h]));
    }
  }
}

// attend_group's unquantized part in AVX2 (attend_tail below says what it computes).
template <DType D>
void attend_tail(const PagedKV& kv, TailRows tail, const float* q, int heads, float scale, float* p, size_t n,
                 bool values, float* out) {
  const int d = kv.geometry.head_dim;
  const storage_t<D>* pool = static_cast<const storage_t<D>*>(kv.pool);
  for_head_chunks(heads, [&](int h0, auto tile) {
    constexpr int H = decltype(tile)::value;
    if (values) tail_values<D, H>(pool, tail, d, p + h0 * n, n, out + size_t(h0) * d);
    else tail_logits<D, H>(pool, tail, d, q + size_t(h0) * d, scale, p + h0 * n, n);
  });
}

#else
float dot(const float* a, const float* b, int d) {
  float sum = 0.0f;
  for (int c = 0; c < d; ++c) sum += a[c] * b[c];
  return sum;
}

// attend_group's unquantized part without AVX2: each row widened once for every head.
template <DType D>
void attend_tail(const PagedKV& kv, TailRows tail, const float* q, int heads, float scale, float* p, size_t n,
                 bool values, float* out) {
  const int d = kv.geometry.head_dim;
  const storage_t<D>* pool = static_cast<const storage_t<D>*>(kv.pool) + (values ? tail.to_value : 0);
  static thread_local std::vector<float> row;
  row.resize(size_t(d));
  for (int t = 0; t < tail.visible; ++t) {
    for (int c = 0; c < d; ++c) row[c] = load1<D>(pool + tail.rows[t] + c);
    for (int m = 0; m < heads; ++m) {
      if (!values) {
        p[m * n + t] = dot(q + size_t(m) * d, row.data(), d) * scale;
        continue;
      }
      const float w = p[m * n + t];
      float* om = out + size_t(m) * d;
      for (int c = 0; c < d; ++c) om[c] += w * row[c];
    }
  }
}
#endif

// The tail's slots for the `heads` query heads of q: their scaled logits into p (head m's t-th at
// p[m * n + t]), or with `values` out += those probabilities times the values.
void attend_tail(const PagedKV& kv, TailRows tail, const float* q, int heads, float scale, float* p, size_t n,
                 bool values, float* out) {
  switch (kv.geometry.dtype) {
    case DType::kFloat16: return attend_tail<DType::kFloat16>(kv, tail, q, heads, scale, p, n, values, out);
    case DType::kBFloat16: return attend_tail<DType::kBFloat16>(kv, tail, q, heads, scale, p, n, values, out);
    default: return attend_tail<DType::kFloat32>(kv, tail, q, heads, scale, p, n, values, out);
  }
}

// The `heads` query heads of KV head `head` (rows of q and out, [heads][d]) over the quantized and
// the first `visible` unquantized slots: every code and every unquantized row is read once for all
// of them. acc (null or one float per slot) gets the probabilities summed over the heads, from slot
// acc_from on; lse (null or [heads]) each head's log-sum-exp of its scaled logits.
// p: scratch, [heads][quantized + visible] on return.
void attend_group(const PagedKV& kv, const QuantizedKV& qkv, int seq, int layer, int head, const float* q, int heads,
                  int visible, float scale, float* out, float* acc, int acc_from, float* lse, std::vector<float>& p) {
  const Geometry& g = kv.geometry;
  const int d = g.head_dim, tq = qkv.tokens_per_block;
  const int nq = qkv.quantized(seq);
  const size_t n = size_t(nq) + visible;
  const QuantFormat f = qkv.format;
  const uint64_t seed = head_seed(qkv.seed, layer, head);
  p.resize(size_t(heads) * n);
  const int32_t* qblocks = qkv.block_table + qkv.table_offset[seq];
  for (int b = 0; b < nq / tq; ++b) {
    quantized_key_scores_heads(f, run_bytes(kv, qblocks[b], layer, 0, head), tq, d, seed, q, heads, scale,
                               p.data() + size_t(b) * tq, n);
  }
  const TailRows tail = tail_rows(kv, seq, visible, layer, head);
  attend_tail(kv, tail, q, heads, scale, p.data() + nq, n, /*values=*/false, nullptr);
  for (int m = 0; m < heads; ++m) {
    float* pm = p.data() + m * n;
    const float mx = n > 0 ? max_of(pm, int(n)) : -INFINITY;
    // float64: the log-sum-exp Kara's norm = full divides by comes from rows up to 20k slots long.
    const double sum = n > 0 ? exp_shifted_sum_as<double>(pm, n, mx) : 0.0;
    const float inv = sum > 0 ? float(1.0 / sum) : 0.0f;
    for (size_t i = 0; i < n; ++i) pm[i] *= inv;
    if (lse != nullptr && n > 0) lse[m] = mx + float(std::log(sum));
  }
  std::fill(out, out + size_t(heads) * d, 0.0f);
  for (int b = 0; b < nq / tq; ++b) {
    quantized_value_accumulate_heads(f, run_bytes(kv, qblocks[b], layer, 1, head), tq, d, seed,
                                     p.data() + size_t(b) * tq, heads, n, out);
  }
  attend_tail(kv, tail, q, heads, scale, p.data() + nq, n, /*values=*/true, out);
  if (acc != nullptr) {
    for (int m = 0; m < heads; ++m)
      for (size_t i = size_t(acc_from); i < n; ++i) acc[i] += p[m * n + i];
  }
}

// Each thread's attention probabilities over the visible tokens, reused across calls (scratch.h).
std::vector<float>& thread_probs() {
  static thread_local std::vector<float> p;
  return p;
}

}  // namespace

KernelStatus quantize_tokens(const PagedKV& kv, int seq, int slot_begin, const QuantizedKV& q, int32_t dst) {
  constexpr std::string_view op = "quantize_tokens";
  KARAKV_RETURN_IF_ERROR(check_qkv(op, kv, q));
  KARAKV_RETURN_IF_ERROR(common::check_tables(op, kv));
  KARAKV_RETURN_IF_ERROR(common::check_seq_index(op, kv, seq));
  const int n = q.tokens_per_block;
  if (slot_begin < 0 || slot_begin + n > kv.seq_len[seq])
    return KernelStatus::invalid(std::string(op) + ": slots [" + std::to_string(slot_begin) + ", " +
                                 std::to_string(slot_begin + n) + ") not within seq_len " +
                                 std::to_string(kv.seq_len[seq]));
  KARAKV_RETURN_IF_ERROR(common::check_covered(op, kv, seq, slot_begin, slot_begin + n));
  if (dst < 0) return KernelStatus::invalid(common::out_of_range(op, "dst block", dst, 0, INT32_MAX));
  const Geometry& g = kv.geometry;
  const QuantFormat f = q.format;
  const int rows = g.num_layers * g.num_kv_heads;
  KernelStatus failed = KernelStatus::ok();
  std::mutex failed_mu;
  parallel_for(rows, 1, [&](int64_t row_begin, int64_t row_end) {
  for (int r = int(row_begin); r < int(row_end); ++r) {
    const int l = r / g.num_kv_heads, h = r % g.num_kv_heads;
    std::vector<float> x(size_t(n) * g.head_dim);
    for (int kvi = 0; kvi < 2; ++kvi) {
      for (int t = 0; t < n; ++t) {
        const size_t base = slot_index(kv, seq, slot_begin + t, l, kvi, h);
        for (int c = 0; c < g.head_dim; ++c) x[size_t(t) * g.head_dim + c] = load_element(kv.pool, base + c, g.dtype);
      }
      uint8_t* run = run_bytes(kv, dst, l, kvi, h);
      const uint64_t seed = head_seed(q.seed, l, h);
      KernelStatus st = kvi == 0 ? quantize_keys(f, x.data(), n, g.head_dim, seed, run)
                                 : quantize_values(f, x.data(), n, g.head_dim, seed, run);
      if (!st.is_ok()) {
        std::lock_guard<std::mutex> lock(failed_mu);
        failed = st;
      }
    }
  }
  });
  return failed;
}

KernelStatus dequantize_block(const PagedKV& kv, const QuantizedKV& q, int32_t block, void* k, void* v) {
  constexpr std::string_view op = "dequantize_block";
  KARAKV_RETURN_IF_ERROR(check_qkv(op, kv, q));
  if (block < 0) return KernelStatus::invalid(common::out_of_range(op, "block", block, 0, INT32_MAX));
  if (k == nullptr || v == nullptr) return KernelStatus::invalid(std::string(op) + ": k and v must be non-null");
  const Geometry& g = kv.geometry;
  const QuantFormat f = q.format;
  const int n = q.tokens_per_block, d = g.head_dim;
  std::vector<float> x(size_t(n) * d);
  for (int l = 0; l < g.num_layers; ++l) {
    for (int h = 0; h < g.num_kv_heads; ++h) {
      const uint64_t seed = head_seed(q.seed, l, h);
      for (int kvi = 0; kvi < 2; ++kvi) {
        const uint8_t* run = run_bytes(kv, block, l, kvi, h);
        KARAKV_RETURN_IF_ERROR(kvi == 0 ? dequantize_keys(f, run, n, d, seed, x.data())
                                        : dequantize_values(f, run, n, d, seed, x.data()));
        void* dst = kvi == 0 ? k : v;
        for (int t = 0; t < n; ++t)
          for (int c = 0; c < d; ++c)
            store_element(dst, ((size_t(l) * n + t) * g.num_kv_heads + h) * d + c, x[size_t(t) * d + c], g.dtype);
      }
    }
  }
  return KernelStatus::ok();
}

KernelStatus decode_attention_quantized(const PagedKV& kv, const QuantizedKV& qkv, int layer, const float* q,
                                        float* out, float scale, float* const* score_acc, const int32_t* acc_begin,
                                        float* const* lse) {
  constexpr std::string_view op = "decode_attention_quantized";
  KARAKV_RETURN_IF_ERROR(check_qkv(op, kv, qkv));
  KARAKV_RETURN_IF_ERROR(common::check_tables(op, kv));
  KARAKV_RETURN_IF_ERROR(common::check_layer(op, kv, layer));
  if (q == nullptr || out == nullptr) return KernelStatus::invalid(std::string(op) + ": q and out must be non-null");
  for (int s = 0; s < kv.num_seqs; ++s) KARAKV_RETURN_IF_ERROR(common::check_covered(op, kv, s, 0, kv.seq_len[s]));
  if (score_acc != nullptr) KARAKV_RETURN_IF_ERROR(common::validate_accumulators(op, kv, score_acc, acc_begin, &qkv));
  const Geometry& g = kv.geometry;
  const int gs = g.group_size(), d = g.head_dim;
  // One work item per (sequence, KV head): it alone adds into that head's accumulator.
  parallel_for(int64_t(kv.num_seqs) * g.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float>& p = thread_probs();
    for (int64_t task = begin; task < end; ++task) {
      const int s = int(task / g.num_kv_heads), h = int(task % g.num_kv_heads);
      {
        float* acc = score_acc ? score_acc[size_t(s) * g.num_kv_heads + h] : nullptr;
        const int acc_from = acc_begin != nullptr ? acc_begin[s] : 0;
        float* head_lse = lse != nullptr && lse[s] != nullptr ? lse[s] + size_t(h) * gs : nullptr;
        const size_t first = size_t(s) * g.num_q_heads + size_t(h) * gs;
        attend_group(kv, qkv, s, layer, h, q + first * d, gs, kv.seq_len[s], scale, out + first * d, acc, acc_from,
                     head_lse, p);
      }
    }
  }, true, [] { release_if_large(thread_probs()); });
  return KernelStatus::ok();
}

KernelStatus causal_attention_quantized(const PagedKV& kv, const QuantizedKV& qkv, int seq, int layer,
                                        int num_queries, const float* q, float* out, float scale) {
  constexpr std::string_view op = "causal_attention_quantized";
  KARAKV_RETURN_IF_ERROR(check_qkv(op, kv, qkv));
  KARAKV_RETURN_IF_ERROR(common::validate_causal_quantized_rows(kv, seq, layer, num_queries, -1));
  const int len = kv.seq_len[seq];
  const Geometry& g = kv.geometry;
  const int gs = g.group_size(), d = g.head_dim;
  parallel_for(int64_t(num_queries) * g.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float>& p = thread_probs();
    for (int64_t task = begin; task < end; ++task) {
      const int i = int(task / g.num_kv_heads), h = int(task % g.num_kv_heads);
      {
        const size_t first = size_t(i) * g.num_q_heads + size_t(h) * gs;
        attend_group(kv, qkv, seq, layer, h, q + first * d, gs, len - num_queries + i + 1, scale, out + first * d,
                     nullptr, 0, nullptr, p);
      }
    }
  }, true, [] { release_if_large(thread_probs()); });
  return KernelStatus::ok();
}

}  // namespace karakv::kernels::cpu
