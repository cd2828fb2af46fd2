// Argument checks of the paged cache shared by every backend (checks.h).
#include "checks.h"

#include <cstdint>

namespace karakv::kernels::common {

std::string out_of_range(std::string_view op, std::string_view what, long long value, long long lo,
                         long long hi) {
  return std::string(op) + ": " + std::string(what) + " " + std::to_string(value) +
         " out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + ")";
}

KernelStatus check_geometry(std::string_view op, const PagedKV& kv) {
  const Geometry& g = kv.geometry;
  const std::string p = std::string(op) + ": ";
  if (kv.pool == nullptr) return KernelStatus::invalid(p + "pool is null");
  if (g.num_layers < 1) return KernelStatus::invalid(p + "num_layers " + std::to_string(g.num_layers) + " must be >= 1");
  if (g.num_kv_heads < 1) return KernelStatus::invalid(p + "num_kv_heads " + std::to_string(g.num_kv_heads) + " must be >= 1");
  if (g.num_q_heads < 1 || g.num_q_heads % g.num_kv_heads != 0)
    return KernelStatus::invalid(p + "num_q_heads " + std::to_string(g.num_q_heads) +
                                 " must be a positive multiple of num_kv_heads " + std::to_string(g.num_kv_heads));
  if (g.head_dim < 1) return KernelStatus::invalid(p + "head_dim " + std::to_string(g.head_dim) + " must be >= 1");
  if (g.block_size < 1) return KernelStatus::invalid(p + "block_size " + std::to_string(g.block_size) + " must be >= 1");
  if (g.dtype != DType::kFloat32 && g.dtype != DType::kFloat16 && g.dtype != DType::kBFloat16)
    return KernelStatus::invalid(p + "dtype " + std::to_string(int(g.dtype)) + " is not fp32, fp16 or bf16");
  return KernelStatus::ok();
}

KernelStatus check_tables(std::string_view op, const PagedKV& kv) {
  KernelStatus st = check_geometry(op, kv);
  if (!st.is_ok()) return st;
  const std::string p = std::string(op) + ": ";
  if (kv.num_seqs < 0) return KernelStatus::invalid(p + "num_seqs " + std::to_string(kv.num_seqs) + " must be >= 0");
  if (kv.num_seqs > 0 && (kv.block_table == nullptr || kv.table_offset == nullptr || kv.seq_len == nullptr))
    return KernelStatus::invalid(p + "block_table, table_offset and seq_len must be non-null");
  return KernelStatus::ok();
}

KernelStatus check_seq_index(std::string_view op, const PagedKV& kv, int seq) {
  if (seq < 0 || seq >= kv.num_seqs) return KernelStatus::invalid(out_of_range(op, "seq", seq, 0, kv.num_seqs));
  return KernelStatus::ok();
}

KernelStatus check_layer(std::string_view op, const PagedKV& kv, int layer) {
  if (layer < 0 || layer >= kv.geometry.num_layers)
    return KernelStatus::invalid(out_of_range(op, "layer", layer, 0, kv.geometry.num_layers));
  return KernelStatus::ok();
}

// Tokens [begin, end) of `seq` must be covered by its block table, with block ids inside the pool
// (pool_blocks < 0: pool size unknown, only the lower bound is checked).
KernelStatus check_covered(std::string_view op, const PagedKV& kv, int seq, long long begin, long long end,
                           long long pool_blocks) {
  if (end <= begin) return KernelStatus::ok();
  const int bs = kv.geometry.block_size;
  const long long first = kv.table_offset[seq];
  const long long have = kv.table_offset[seq + 1] - first;
  const long long need = (end + bs - 1) / bs;
  if (have < need)
    return KernelStatus::invalid(std::string(op) + ": sequence " + std::to_string(seq) + " has " +
                                 std::to_string(have) + " blocks in its table but tokens up to " +
                                 std::to_string(end) + " need " + std::to_string(need) +
                                 " (block_size " + std::to_string(bs) + ")");
  for (long long b = begin / bs; b < need; ++b) {
    const int32_t id = kv.block_table[first + b];
    if (id < 0 || (pool_blocks >= 0 && id >= pool_blocks))
      return KernelStatus::invalid(out_of_range(op, "block id", id, 0, pool_blocks >= 0 ? pool_blocks : INT32_MAX));
  }
  return KernelStatus::ok();
}

}  // namespace karakv::kernels::common
