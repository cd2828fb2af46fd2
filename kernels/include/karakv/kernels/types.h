// Plain data types shared by every kernel backend: storage dtypes, the paged-cache descriptor and
// the status kernels return. No gRPC, protobuf or server headers may be included from kernels/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace karakv::kernels {

enum class DType : uint8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

constexpr size_t dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }
inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "fp32";
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
  }
  return "unknown";
}
// Parses "fp32" | "fp16" | "bf16"; returns false on anything else.
inline bool parse_dtype(std::string_view name, DType* out) {
  for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    if (name == dtype_name(t)) {
      *out = t;
      return true;
    }
  }
  return false;
}

// Result of a kernel call. Kernels never throw; the layer above maps codes to its own errors.
struct KernelStatus {
  enum class Code : uint8_t { kOk = 0, kInvalidArgument, kUnsupported, kInternal };
  Code code = Code::kOk;
  std::string message;

  static KernelStatus ok() { return {}; }
  static KernelStatus invalid(std::string msg) { return {Code::kInvalidArgument, std::move(msg)}; }
  static KernelStatus unsupported(std::string msg) { return {Code::kUnsupported, std::move(msg)}; }
  bool is_ok() const { return code == Code::kOk; }
};

// Model geometry the pool is laid out for.
struct Geometry {
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 16;  // tokens per block
  DType dtype = DType::kFloat16;

  int group_size() const { return num_q_heads / num_kv_heads; }
  // Elements of one token's K (or V) for one layer: [num_kv_heads, head_dim].
  size_t kv_token_elems() const { return size_t(num_kv_heads) * head_dim; }
  size_t q_token_elems() const { return size_t(num_q_heads) * head_dim; }
  // One block holds block_size tokens of K and V for every layer and KV head, laid out as
  // [num_layers][2 (K, V)][num_kv_heads][block_size][head_dim] so that one (layer, head) run of a
  // block is contiguous for attention.
  size_t block_elems() const { return size_t(num_layers) * 2 * num_kv_heads * block_size * head_dim; }
  size_t block_bytes() const { return block_elems() * dtype_size(dtype); }
};

// The paged cache as kernels see it: the pool base pointer plus, per sequence, its slice of a
// concatenated block table and its resident length. Block ids index the pool in units of
// geometry.block_bytes().
struct PagedKV {
  void* pool = nullptr;          // [num_blocks][layers][2][kv_heads][block_size][head_dim]
  Geometry geometry;
  const int32_t* block_table = nullptr;  // concatenated block ids of all sequences
  const int32_t* table_offset = nullptr; // [num_seqs + 1] slice of block_table for sequence s
  const int32_t* seq_len = nullptr;      // [num_seqs] resident tokens used by attention
  int num_seqs = 0;

  // Element offset of (block, layer, kv=0 for K / 1 for V, head, slot 0) inside the pool.
  size_t run_offset(int32_t block, int layer, int kv, int head) const {
    const Geometry& g = geometry;
    return size_t(block) * g.block_elems() +
           ((size_t(layer) * 2 + kv) * g.num_kv_heads + head) * size_t(g.block_size) * g.head_dim;
  }
  int32_t block_of(int seq, int token) const {
    return block_table[table_offset[seq] + token / geometry.block_size];
  }
};

// Quantized storage formats (docs/COMPRESSION.md section 3).
enum class QuantFormat : uint8_t { kKivi2, kKivi4, kTq2, kTq3, kTq4 };

// The quantized region of each sequence of a PagedKV batch: whole blocks, each holding
// tokens_per_block tokens of every (layer, K/V, KV head) as a quantized run at the same run
// offset an unquantized block uses (PagedKV::run_offset, in bytes of the storage dtype). A
// sequence's quantized tokens come before its unquantized ones: slot t < quantized(s) lives in
// block block_table[table_offset[s] + t / tokens_per_block]; later slots are the PagedKV's.
struct QuantizedKV {
  QuantFormat format = QuantFormat::kKivi4;
  int tokens_per_block = 0;
  uint64_t seed = 0;                      // TurboQuant rotations: head_seed(seed, layer, head)
  const int32_t* block_table = nullptr;   // concatenated quantized block ids
  const int32_t* table_offset = nullptr;  // [num_seqs + 1]

  int quantized(int seq) const { return (table_offset[seq + 1] - table_offset[seq]) * tokens_per_block; }
};

// The rotation seed of one (layer, KV head): a splitmix64 step over the sequence-wide seed.
inline uint64_t head_seed(uint64_t seed, int layer, int head) {
  uint64_t z = seed ^ (uint64_t(layer) << 32 | uint64_t(uint32_t(head)));
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace karakv::kernels
