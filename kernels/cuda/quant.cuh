// Quantized storage on the GPU (Backend::quantize_tokens, dequantize_block, decode_ and
// causal_attention_quantized): KIVI (2, 4 bits) and TurboQuant (2, 3, 4 bits) in the byte layouts
// of the CPU reference (cpu/quant.h), so a block quantized by either backend reads the same on both.
//
// quantize_tokens: a check kernel (one thread per token of every run: KIVI's fp16 range, TurboQuant's
// norm, from an fp64 sum in channel order as the reference forms it) flags runs the reference would
// refuse; the other runs are then quantized and flagged ones left unwritten. KIVI: one thread per
// (key group, channel) or (token, value group), min and max in the reference's order; TurboQuant:
// a CTA per tile of tokens, sign flip and the Walsh-Hadamard butterflies in shared memory stage by
// stage as the reference does them. Every step is the reference's operation with IEEE rounding
// (division, rint, round-to-nearest-even fp16), so the codes, scales, zeros and norms are the
// reference's bytes exactly.
//
// dequantize_block: KIVI one thread per element (code * scale is exact in fp32, then one rounded
// add, as the reference); TurboQuant a CTA per tile of tokens (centroid * norm, butterflies, then
// the signs / d, each rounded as the reference rounds it, no contraction): bit-identical too.
//
// Attention over a quantized prefix then the unquantized slots, per row (a decode sequence, or one
// causal query): logits of every slot (one thread per (row, query head, slot); TurboQuant rotates the
// query once), a softmax per (row, query head), then the values in splits of the slots (TurboQuant
// accumulates in the rotated space) and a combine that de-rotates once. fp32 throughout with a
// different summation order and expf from the reference: agrees within 1e-4 on O(1) outputs.
// With `fused` (KARAKV_CUDA_QUANT_DECODE=fused), one kernel per (row, KV head and up to 8 of its query
// heads, split of 256 slots) does logits, softmax and values in shared memory, reading each code
// once for the group; a combine merges the splits by their log-sum-exps (quant.cu, "fused attention").
#pragma once

#include <vector>

#include "arena.h"
#include "common.cuh"
#include "cuda_limits.h"

namespace karakv::kernels::cuda {

// The quantized region of the call's sequences, in device memory.
struct DeviceQuant {
  QuantFormat format = QuantFormat::kKivi4;
  int tokens_per_block = 0;
  const int32_t* block_table = nullptr;   // concatenated quantized block ids
  const int32_t* table_offset = nullptr;  // [num_seqs + 1]
  const uint64_t* head_seeds = nullptr;   // [num_layers * num_kv_heads]: head_seed(seed, layer, head)
};

// Quantizes unquantized slots [slot_begin, slot_begin + tokens_per_block) of `seq` into block
// `dst`, every (layer, K/V, head) run. first_bad: device [num_layers * 2 * num_kv_heads], run
// (layer * 2 + kv) * num_kv_heads + head; the launcher fills it with kNoBadToken and the check
// kernel leaves there the first token of each run the reference refuses (a value outside the fp16
// range for KIVI, a norm above 65504 for TurboQuant, NaN for both); such runs are not written.
constexpr int32_t kNoBadToken = 0x7f7f7f7f;
KernelStatus launch_quantize_tokens(const DeviceKV& kv, DType dtype, const DeviceQuant& q, int seq, int slot_begin,
                                    int32_t dst, int32_t* first_bad, Arena& arena, cudaStream_t stream);

// Dequantizes block `block` into k, v: device [num_layers][tokens_per_block][num_kv_heads][head_dim]
// in the storage dtype.
KernelStatus launch_dequantize_block(const DeviceKV& kv, DType dtype, const DeviceQuant& q, int32_t block, void* k,
                                     void* v, cudaStream_t stream);

// Attention rows over quantized storage: row r is a query of sequence row_seq[r] over its quantized
// tokens (q.table_offset) then its first row_fp[r] unquantized slots. Host arrays; the launcher
// uploads them and works through the rows in chunks so that its scratch stays bounded.
//   q, out:      device [rows][num_q_heads][head_dim] fp32
//   row_first:   empty (every slot) or host [rows]: the first slot whose probability group_probs gets
//   group_probs: null, or device receiving for row r and KV head h the attention probabilities of
//                its slots t >= first(r) summed over the group's query heads, at
//                group_offset(r) + h * (slots(r) - first(r)) + t - first(r),
//                group_offset(r) = sum over rows r' < r not on the device of
//                                  (slots(r') - first(r')) * num_kv_heads
//   row_on_device: empty or host [rows]: rows whose sums are added on the device into
//   row_acc:     device [rows * num_kv_heads] pointers (entry r * num_kv_heads + h: acc[t] += sum
//                for t >= first(r), where non-null), or null; such rows take no room in group_probs
//   lse:         null, or device [rows][num_q_heads]: each query head's log-sum-exp of its scaled
//                logits (rows without a slot are not written)
//   fused:       the fused kernels (KARAKV_CUDA_QUANT_DECODE=fused): one pass over the codes per KV
//                head and split, logits only in shared memory (the observed slots' exp(logit - m)
//                kept in device memory and scaled by the log-sum-exp). Else the staged kernels.
KernelStatus launch_quantized_attention(const DeviceKV& kv, DType dtype, const DeviceQuant& q, int layer,
                                        const std::vector<int32_t>& row_seq, const std::vector<int32_t>& row_quantized,
                                        const std::vector<int32_t>& row_fp, const std::vector<int32_t>& row_first,
                                        const float* query, float* out, float scale, float* group_probs,
                                        const std::vector<char>& row_on_device, float* const* row_acc, float* lse,
                                        bool fused, Arena& arena, cudaStream_t stream);

}  // namespace karakv::kernels::cuda
