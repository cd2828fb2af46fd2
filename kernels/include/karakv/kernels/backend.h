// The op set every kernel backend implements. The server talks only to this interface, so a CUDA
// backend slots in beside the CPU one without server changes. All pointers are in the backend's
// memory space (host memory for the CPU backend).
#pragma once

#include <memory>
#include <string_view>

#include "karakv/kernels/types.h"

namespace karakv::kernels {

enum class Op : uint8_t {
  kWriteKV,
  kDecodeAttention,
  kCausalAttention,
  kReadKV,
  kCopyBlock,
};
const char* op_name(Op op);

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string_view name() const = 0;
  // Whether `op` runs on this backend for storage dtype `dtype`; the server refuses what is not.
  virtual bool supports(Op op, DType dtype) const = 0;

  // Memory for the block pool. Returned memory is zero-filled.
  virtual KernelStatus allocate(size_t bytes, void** out) = 0;
  virtual void free(void* ptr) = 0;

  // Writes tokens [start_pos, start_pos + num_tokens) of sequence `seq` for layers
  // [layer_begin, layer_begin + num_layers). The blocks covering them must already be in the
  // sequence's table.
  //   k, v: [num_layers][num_tokens][num_kv_heads][head_dim] in kv.geometry.dtype
  virtual KernelStatus write_kv(const PagedKV& kv, int seq, int start_pos, int num_tokens,
                                int layer_begin, int num_layers, const void* k,
                                const void* v) = 0;

  // One query per sequence over its first seq_len[s] tokens at `layer`, GQA (query head j reads
  // KV head j / group_size), fp32 accumulation, softmax(q.k * scale).
  //   q:   [num_seqs][num_q_heads][head_dim] fp32
  //   out: [num_seqs][num_q_heads][head_dim] fp32
  virtual KernelStatus decode_attention(const PagedKV& kv, int layer, const float* q, float* out,
                                        float scale) = 0;

  // Several queries of sequence `seq` at `layer`: query i sits at position
  // seq_len[seq] - num_queries + i and attends to positions 0..that position (causal).
  //   q:   [num_queries][num_q_heads][head_dim] fp32
  //   out: [num_queries][num_q_heads][head_dim] fp32
  virtual KernelStatus causal_attention(const PagedKV& kv, int seq, int layer, int num_queries,
                                        const float* q, float* out, float scale) = 0;

  // Copies the first seq_len[seq] tokens of sequence `seq`, all layers, out of the pool.
  //   k, v: [num_layers][seq_len][num_kv_heads][head_dim] in kv.geometry.dtype
  virtual KernelStatus read_kv(const PagedKV& kv, int seq, void* k, void* v) = 0;

  // Copies one whole block (every layer and head) from block `src` to block `dst` (copy on write).
  virtual KernelStatus copy_block(const PagedKV& kv, int32_t src, int32_t dst) = 0;
};

// The reference backend: host memory, multi-threaded over sequences and heads.
// num_threads <= 0 uses every hardware thread.
std::unique_ptr<Backend> make_cpu_backend(int num_threads = 0);

}  // namespace karakv::kernels
