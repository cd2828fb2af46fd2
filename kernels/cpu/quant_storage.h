// Quantized blocks in the paged pool on the CPU: quantizing aged-out tokens into a block,
// dequantizing a block, and attention over a sequence whose oldest tokens are quantized. Built on
// the per-run kernels of quant.h; each function matches the Backend method of the same name.
#pragma once

#include <cstdint>

#include "../common/quant_layout.h"
#include "karakv/kernels/types.h"

namespace karakv::kernels::cpu {

using common::quantized_tokens_per_block;  // common/quant_layout.h

KernelStatus quantize_tokens(const PagedKV& kv, int seq, int slot_begin, const QuantizedKV& q, int32_t dst);

//   k, v: [num_layers][tokens_per_block][num_kv_heads][head_dim] storage dtype
KernelStatus dequantize_block(const PagedKV& kv, const QuantizedKV& q, int32_t block, void* k, void* v);

// Attention of each sequence's query (or of `num_queries` causal queries of one sequence) over
// its quantized tokens, then its unquantized ones. visible_fp(s, i) unquantized slots are seen.
//   q, out: [num_seqs or num_queries][num_q_heads][head_dim] fp32
KernelStatus decode_attention_quantized(const PagedKV& kv, const QuantizedKV& qkv, int layer, const float* q,
                                        float* out, float scale, float* const* score_acc, const int32_t* acc_begin,
                                        float* const* lse);
KernelStatus causal_attention_quantized(const PagedKV& kv, const QuantizedKV& qkv, int seq, int layer,
                                        int num_queries, const float* q, float* out, float scale);

}  // namespace karakv::kernels::cpu
