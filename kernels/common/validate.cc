// The argument checks of every op (validate.h), run by every backend before it touches memory.
#include "validate.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "checks.h"

namespace karakv::kernels::common {
namespace {

KernelStatus invalid(std::string_view op, const std::string& msg) {
  return KernelStatus::invalid(std::string(op) + ": " + msg);
}

// Geometry, tables and `seq`; on success *len is seq_len[seq].
KernelStatus check_cache(std::string_view op, const PagedKV& kv, int seq, int* len) {
  KARAKV_RETURN_IF_ERROR(check_tables(op, kv));
  if (kv.num_seqs == 0 || kv.block_table == nullptr || kv.table_offset == nullptr || kv.seq_len == nullptr)
    return invalid(op, "block_table, table_offset and seq_len must be non-null");
  KARAKV_RETURN_IF_ERROR(check_seq_index(op, kv, seq));
  *len = kv.seq_len[seq];
  if (*len < 0) return invalid(op, "seq_len[" + std::to_string(seq) + "] " + std::to_string(*len) + " must be >= 0");
  return KernelStatus::ok();
}

// `rows` rows of n scores each, none NaN.
KernelStatus check_score_rows(std::string_view op, const float* scores, int rows, int n) {
  if (rows < 1) return invalid(op, "rows " + std::to_string(rows) + " must be >= 1");
  if (n < 0) return invalid(op, "n " + std::to_string(n) + " must be >= 0");
  if (n > 0 && scores == nullptr) return invalid(op, "scores is null");
  const size_t total = size_t(rows) * size_t(n);
  for (size_t i = 0; i < total; ++i) {
    if (std::isnan(scores[i])) {
      return invalid(op, "scores[" + std::to_string(i / n) + "][" + std::to_string(i % n) + "] (row, slot) is NaN");
    }
  }
  return KernelStatus::ok();
}

// Each row of kept strictly ascending inside [lo, hi).
KernelStatus check_kept_rows(std::string_view op, const PagedKV& kv, const int32_t* kept, int num_kept, int lo,
                             int hi) {
  const int hk = kv.geometry.num_kv_heads;
  for (int r = 0; r < kv.geometry.num_layers * hk; ++r) {
    const int32_t* row = kept + size_t(r) * num_kept;
    for (int i = 0; i < num_kept; ++i) {
      if (row[i] < lo || row[i] >= hi)
        return invalid(op, "kept[layer " + std::to_string(r / hk) + "][head " + std::to_string(r % hk) + "][" +
                               std::to_string(i) + "] = " + std::to_string(row[i]) + " out of range [" +
                               std::to_string(lo) + ", " + std::to_string(hi) + ")");
      if (i > 0 && row[i] <= row[i - 1])
        return invalid(op, "kept[layer " + std::to_string(r / hk) + "][head " + std::to_string(r % hk) +
                               "] is not strictly ascending at index " + std::to_string(i) + " (" +
                               std::to_string(row[i - 1]) + " then " + std::to_string(row[i]) + ")");
    }
  }
  return KernelStatus::ok();
}

// Destination blocks of a compaction of num_kept tokens: ids in the pool, none twice.
KernelStatus check_dst_blocks(std::string_view op, const PagedKV& kv, const int32_t* dst_blocks, int num_kept,
                              long long pool_blocks, std::vector<int32_t>* sorted) {
  const int num_dst = (num_kept + kv.geometry.block_size - 1) / kv.geometry.block_size;
  sorted->assign(dst_blocks, dst_blocks + num_dst);
  std::sort(sorted->begin(), sorted->end());
  if (sorted->front() < 0) return invalid(op, "destination block id " + std::to_string(sorted->front()) + " must be >= 0");
  if (pool_blocks >= 0 && sorted->back() >= pool_blocks)
    return KernelStatus::invalid(out_of_range(op, "dst block", sorted->back(), 0, pool_blocks));
  for (size_t i = 1; i < sorted->size(); ++i)
    if ((*sorted)[i] == (*sorted)[i - 1])
      return invalid(op, "destination block " + std::to_string((*sorted)[i]) + " is listed twice");
  return KernelStatus::ok();
}

}  // namespace

KernelStatus validate_write_kv(const PagedKV& kv, int seq, int start_pos, int num_tokens, int layer_begin,
                               int num_layers, const void* k, const void* v, long long pool_blocks) {
  constexpr std::string_view op = "write_kv";
  KARAKV_RETURN_IF_ERROR(check_tables(op, kv));
  KARAKV_RETURN_IF_ERROR(check_seq_index(op, kv, seq));
  const Geometry& geo = kv.geometry;
  if (num_layers < 0 || layer_begin < 0 || layer_begin + static_cast<long long>(num_layers) > geo.num_layers)
    return invalid(op, "layers [" + std::to_string(layer_begin) + ", " +
                           std::to_string(static_cast<long long>(layer_begin) + num_layers) + ") not inside [0, " +
                           std::to_string(geo.num_layers) + ")");
  if (start_pos < 0) return invalid(op, "start_pos " + std::to_string(start_pos) + " must be >= 0");
  if (num_tokens < 0) return invalid(op, "num_tokens " + std::to_string(num_tokens) + " must be >= 0");
  if (num_tokens == 0 || num_layers == 0) return KernelStatus::ok();
  if (k == nullptr || v == nullptr) return invalid(op, "k and v must be non-null");
  return check_covered(op, kv, seq, start_pos, static_cast<long long>(start_pos) + num_tokens, pool_blocks);
}

KernelStatus validate_write_step_kv(const PagedKV& kv, int layer, const int32_t* positions, const void* k,
                                    const void* v, long long pool_blocks) {
  constexpr std::string_view op = "write_step_kv";
  KARAKV_RETURN_IF_ERROR(check_tables(op, kv));
  KARAKV_RETURN_IF_ERROR(check_layer(op, kv, layer));
  if (kv.num_seqs == 0) return KernelStatus::ok();
  if (positions == nullptr || k == nullptr || v == nullptr) return invalid(op, "positions, k and v must be non-null");
  for (int s = 0; s < kv.num_seqs; ++s) {
    if (positions[s] < 0)
      return invalid(op, "positions[" + std::to_string(s) + "] " + std::to_string(positions[s]) + " must be >= 0");
    if (KernelStatus st = check_covered(op, kv, s, positions[s], static_cast<long long>(positions[s]) + 1, pool_blocks);
        !st.is_ok()) {
      st.message += " (positions[" + std::to_string(s) + "] " + std::to_string(positions[s]) + ")";
      return st;
    }
  }
  return KernelStatus::ok();
}

KernelStatus validate_decode(std::string_view op, const PagedKV& kv, int layer, const float* q, const float* out,
                             long long pool_blocks) {
  KARAKV_RETURN_IF_ERROR(check_tables(op, kv));
  KARAKV_RETURN_IF_ERROR(check_layer(op, kv, layer));
  if (kv.num_seqs == 0) return KernelStatus::ok();
  if (q == nullptr || out == nullptr) return invalid(op, "q and out must be non-null");
  for (int s = 0; s < kv.num_seqs; ++s) {
    if (kv.seq_len[s] < 0)
      return invalid(op, "seq_len[" + std::to_string(s) + "] " + std::to_string(kv.seq_len[s]) + " must be >= 0");
    KARAKV_RETURN_IF_ERROR(check_covered(op, kv, s, 0, kv.seq_len[s], pool_blocks));
  }
  return KernelStatus::ok();
}

KernelStatus validate_accumulators(std::string_view op, const PagedKV& kv, float* const* score_acc,
                                   const int32_t* acc_begin, const QuantizedKV* qkv) {
  if (score_acc == nullptr) return invalid(op, "score_acc must be non-null");
  if (acc_begin == nullptr) return KernelStatus::ok();
  for (int s = 0; s < kv.num_seqs; ++s) {
    const int32_t slots = kv.seq_len[s] + (qkv != nullptr ? qkv->quantized(s) : 0);
    if (acc_begin[s] < 0 || acc_begin[s] > slots)
      return invalid(op, "acc_begin[" + std::to_string(s) + "] " + std::to_string(acc_begin[s]) + " outside [0, " +
                             (qkv != nullptr ? "quantized + seq_len " : "seq_len ") + std::to_string(slots) + "]");
  }
  return KernelStatus::ok();
}

std::vector<int32_t> first_observed_slots(const PagedKV& kv, float* const* score_acc, const int32_t* acc_begin,
                                          const QuantizedKV* qkv) {
  const int hk = kv.geometry.num_kv_heads;
  std::vector<int32_t> first(kv.num_seqs);
  for (int s = 0; s < kv.num_seqs; ++s) {
    bool any = false;
    for (int h = 0; h < hk; ++h) any |= score_acc[size_t(s) * hk + h] != nullptr;
    const int32_t slots = kv.seq_len[s] + (qkv != nullptr ? qkv->quantized(s) : 0);
    first[s] = !any ? slots : acc_begin != nullptr ? acc_begin[s] : 0;
  }
  return first;
}

KernelStatus validate_causal(const PagedKV& kv, int seq, int layer, int num_queries, const float* q,
                             const float* out, long long pool_blocks) {
  constexpr std::string_view op = "causal_attention";
  KARAKV_RETURN_IF_ERROR(check_tables(op, kv));
  KARAKV_RETURN_IF_ERROR(check_seq_index(op, kv, seq));
  KARAKV_RETURN_IF_ERROR(check_layer(op, kv, layer));
  const int len = kv.seq_len[seq];
  if (len < 0) return invalid(op, "seq_len[" + std::to_string(seq) + "] " + std::to_string(len) + " must be >= 0");
  if (num_queries < 0 || num_queries > len)
    return invalid(op, "num_queries " + std::to_string(num_queries) + " out of range [0, seq_len " +
                           std::to_string(len) + "]");
  if (num_queries == 0) return KernelStatus::ok();
  if (q == nullptr || out == nullptr) return invalid(op, "q and out must be non-null");
  return check_covered(op, kv, seq, 0, len, pool_blocks);
}

KernelStatus validate_causal_quantized_rows(const PagedKV& kv, int seq, int layer, int num_queries,
                                            long long pool_blocks) {
  constexpr std::string_view op = "causal_attention_quantized";
  KARAKV_RETURN_IF_ERROR(check_tables(op, kv));
  KARAKV_RETURN_IF_ERROR(check_seq_index(op, kv, seq));
  KARAKV_RETURN_IF_ERROR(check_layer(op, kv, layer));
  const int len = kv.seq_len[seq];
  if (num_queries < 1 || num_queries > len)
    return KernelStatus::invalid(out_of_range(op, "num_queries", num_queries, 1, (long long)len + 1));
  return check_covered(op, kv, seq, 0, len, pool_blocks);
}

KernelStatus validate_read_kv(const PagedKV& kv, int seq, const void* k, const void* v, long long pool_blocks) {
  constexpr std::string_view op = "read_kv";
  KARAKV_RETURN_IF_ERROR(check_tables(op, kv));
  KARAKV_RETURN_IF_ERROR(check_seq_index(op, kv, seq));
  const int len = kv.seq_len[seq];
  if (len < 0) return invalid(op, "seq_len[" + std::to_string(seq) + "] " + std::to_string(len) + " must be >= 0");
  if (len == 0) return KernelStatus::ok();
  if (k == nullptr || v == nullptr) return invalid(op, "k and v must be non-null");
  return check_covered(op, kv, seq, 0, len, pool_blocks);
}

KernelStatus validate_copy_block(const PagedKV& kv, int32_t src, int32_t dst, long long pool_blocks) {
  constexpr std::string_view op = "copy_block";
  KARAKV_RETURN_IF_ERROR(check_geometry(op, kv));
  const long long hi = pool_blocks >= 0 ? pool_blocks : INT32_MAX;
  if (src < 0 || src >= hi) return KernelStatus::invalid(out_of_range(op, "src block", src, 0, hi));
  if (dst < 0 || dst >= hi) return KernelStatus::invalid(out_of_range(op, "dst block", dst, 0, hi));
  return KernelStatus::ok();
}

KernelStatus validate_window_scores(const PagedKV& kv, int seq, int layer, int slot_begin, int window, const float* q,
                                    float scale, const float* out, long long pool_blocks) {
  constexpr std::string_view op = "window_scores";
  int len = 0;
  KARAKV_RETURN_IF_ERROR(check_cache(op, kv, seq, &len));
  KARAKV_RETURN_IF_ERROR(check_layer(op, kv, layer));
  if (window < 1 || window > len) return KernelStatus::invalid(out_of_range(op, "window", window, 1, (long long)len + 1));
  if (slot_begin < 0 || slot_begin > len - window)
    return invalid(op, "slot_begin " + std::to_string(slot_begin) + " out of range [0, " +
                           std::to_string(len - window) + "]: window " + std::to_string(window) +
                           " must end within seq_len " + std::to_string(len));
  if (q == nullptr || out == nullptr) return invalid(op, "q and out must be non-null");
  if (!std::isfinite(scale)) return invalid(op, "scale " + std::to_string(scale) + " must be finite");
  return check_covered(op, kv, seq, slot_begin, (long long)slot_begin + window, pool_blocks);
}

KernelStatus validate_snapkv_scores(const PagedKV& kv, int seq, int layer, int num_obs, const float* q, float scale,
                                    int pool, const float* out, long long pool_blocks) {
  constexpr std::string_view op = "snapkv_scores";
  int n = 0;
  KARAKV_RETURN_IF_ERROR(check_cache(op, kv, seq, &n));
  KARAKV_RETURN_IF_ERROR(check_layer(op, kv, layer));
  if (n < 1) return invalid(op, "sequence " + std::to_string(seq) + " is empty (seq_len 0)");
  if (num_obs < 1 || num_obs > n) return KernelStatus::invalid(out_of_range(op, "num_obs", num_obs, 1, (long long)n + 1));
  if (pool < 1 || pool % 2 == 0) return invalid(op, "pool " + std::to_string(pool) + " must be odd and >= 1");
  if (q == nullptr || out == nullptr) return invalid(op, "q and out must be non-null");
  if (!std::isfinite(scale)) return invalid(op, "scale " + std::to_string(scale) + " must be finite");
  return check_covered(op, kv, seq, 0, n, pool_blocks);
}

KernelStatus validate_top_k(const float* scores, int rows, int n, int k, const int32_t* out) {
  constexpr std::string_view op = "top_k";
  KARAKV_RETURN_IF_ERROR(check_score_rows(op, scores, rows, n));
  if (k < 0 || k > n) return invalid(op, "k " + std::to_string(k) + " out of range [0, " + std::to_string(n) + "]");
  if (k > 0 && out == nullptr) return invalid(op, "out is null");
  return KernelStatus::ok();
}

KernelStatus validate_token2chunk(const float* scores, int rows, int n, int budget, int num_candidates, int max_gap,
                                  const int32_t* out) {
  constexpr std::string_view op = "token2chunk";
  KARAKV_RETURN_IF_ERROR(check_score_rows(op, scores, rows, n));
  if (budget < 0 || budget > n)
    return invalid(op, "budget " + std::to_string(budget) + " out of range [0, " + std::to_string(n) + "]");
  if (num_candidates < 0 || num_candidates > budget)
    return invalid(op, "num_candidates " + std::to_string(num_candidates) + " out of range [0, " +
                           std::to_string(budget) + "] (must not exceed budget)");
  if (max_gap < 0) return invalid(op, "max_gap " + std::to_string(max_gap) + " must be >= 0");
  if (budget > 0 && out == nullptr) return invalid(op, "out is null");
  return KernelStatus::ok();
}

KernelStatus validate_gather_tokens(const PagedKV& kv, int seq, const int32_t* kept, int num_kept,
                                    const int32_t* dst_blocks, long long pool_blocks) {
  constexpr std::string_view op = "gather_tokens";
  int len = 0;
  KARAKV_RETURN_IF_ERROR(check_cache(op, kv, seq, &len));
  if (num_kept < 0 || num_kept > len)
    return invalid(op, "num_kept " + std::to_string(num_kept) + " out of range [0, " + std::to_string(len) +
                           "] (seq_len of sequence " + std::to_string(seq) + ")");
  if (num_kept == 0) return KernelStatus::ok();
  if (kept == nullptr || dst_blocks == nullptr) return invalid(op, "kept and dst_blocks must be non-null");
  KARAKV_RETURN_IF_ERROR(check_covered(op, kv, seq, 0, len, pool_blocks));
  KARAKV_RETURN_IF_ERROR(check_kept_rows(op, kv, kept, num_kept, 0, len));
  std::vector<int32_t> dst;
  KARAKV_RETURN_IF_ERROR(check_dst_blocks(op, kv, dst_blocks, num_kept, pool_blocks, &dst));
  const int bs = kv.geometry.block_size;
  const int32_t* table = kv.block_table + kv.table_offset[seq];
  for (int b = 0; b < (len + bs - 1) / bs; ++b)
    if (std::binary_search(dst.begin(), dst.end(), table[b]))
      return invalid(op, "destination block " + std::to_string(table[b]) + " is block " + std::to_string(b) +
                             " of sequence " + std::to_string(seq) + " (a source)");
  return KernelStatus::ok();
}

KernelStatus validate_gather_tokens_in_place(const PagedKV& kv, int seq, int begin, const int32_t* kept,
                                             int num_kept, long long pool_blocks) {
  constexpr std::string_view op = "gather_tokens_in_place";
  int len = 0;
  KARAKV_RETURN_IF_ERROR(check_cache(op, kv, seq, &len));
  if (begin < 0 || begin > len)
    return invalid(op, "begin " + std::to_string(begin) + " out of range [0, " + std::to_string(len) +
                           "] (seq_len of sequence " + std::to_string(seq) + ")");
  if (num_kept < 0 || num_kept > len - begin)
    return invalid(op, "num_kept " + std::to_string(num_kept) + " out of range [0, " + std::to_string(len - begin) +
                           "] (the slots from begin " + std::to_string(begin) + " to seq_len " + std::to_string(len) +
                           ")");
  if (num_kept == 0) return KernelStatus::ok();
  if (kept == nullptr) return invalid(op, "kept must be non-null");
  KARAKV_RETURN_IF_ERROR(check_covered(op, kv, seq, 0, len, pool_blocks));
  return check_kept_rows(op, kv, kept, num_kept, begin, len);
}

KernelStatus validate_cam_merge(const PagedKV& kv, int seq, int begin, int end, const int32_t* kept, int num_kept,
                                const float* scores, int merge_tokens, const int32_t* dst_blocks,
                                long long pool_blocks) {
  constexpr std::string_view op = "cam_merge_values";
  KARAKV_RETURN_IF_ERROR(check_tables(op, kv));
  KARAKV_RETURN_IF_ERROR(check_seq_index(op, kv, seq));
  if (begin < 0 || end > kv.seq_len[seq] || begin > end)
    return invalid(op, "range [" + std::to_string(begin) + ", " + std::to_string(end) + ") not within seq_len " +
                           std::to_string(kv.seq_len[seq]));
  if (num_kept < 0 || num_kept > end - begin)
    return KernelStatus::invalid(out_of_range(op, "num_kept", num_kept, 0, (long long)end - begin + 1));
  if (merge_tokens < 1) return KernelStatus::invalid(out_of_range(op, "merge_tokens", merge_tokens, 1, INT32_MAX));
  if (kept == nullptr || scores == nullptr || dst_blocks == nullptr)
    return invalid(op, "kept, scores and dst_blocks must be non-null");
  KARAKV_RETURN_IF_ERROR(check_covered(op, kv, seq, begin, end, pool_blocks));
  KARAKV_RETURN_IF_ERROR(check_kept_rows(op, kv, kept, num_kept, begin, end));
  if (num_kept > 0) {
    std::vector<int32_t> dst;
    KARAKV_RETURN_IF_ERROR(check_dst_blocks(op, kv, dst_blocks, num_kept, pool_blocks, &dst));
  }
  // Scores are not checked: CaM reads negative and non-finite ones as 0 (backend.h).
  return KernelStatus::ok();
}

}  // namespace karakv::kernels::common
