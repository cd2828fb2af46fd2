// Names of the kernel ops, for logs and error messages; the Backend defaults that are built from
// other ops.
#include "karakv/kernels/backend.h"
#include "karakv/kernels/types.h"
#include "common/checks.h"
#include "common/validate.h"

namespace karakv::kernels {

KernelStatus Backend::write_step_kv(const PagedKV& kv, int layer, const int32_t* positions, const void* k,
                                    const void* v) {
  // Checked whole first, so a refusal writes nothing (the pool's size is write_kv's to check).
  KARAKV_RETURN_IF_ERROR(common::validate_write_step_kv(kv, layer, positions, k, v, -1));
  return write_step_kv_per_sequence(kv, layer, positions, k, v);
}

KernelStatus Backend::write_step_kv_per_sequence(const PagedKV& kv, int layer, const int32_t* positions,
                                                 const void* k, const void* v) {
  const size_t stride = kv.geometry.kv_token_elems() * dtype_size(kv.geometry.dtype);
  for (int s = 0; s < kv.num_seqs; ++s)
    KARAKV_RETURN_IF_ERROR(write_kv(kv, s, positions[s], 1, layer, 1, static_cast<const char*>(k) + s * stride,
                                    static_cast<const char*>(v) + s * stride));
  return KernelStatus::ok();
}

const char* op_name(Op op) {
  switch (op) {
    case Op::kWriteKV: return "write_kv";
    case Op::kDecodeAttention: return "decode_attention";
    case Op::kCausalAttention: return "causal_attention";
    case Op::kReadKV: return "read_kv";
    case Op::kCopyBlock: return "copy_block";
    case Op::kWindowScores: return "window_scores";
    case Op::kSnapKVScores: return "snapkv_scores";
    case Op::kTopK: return "top_k";
    case Op::kToken2Chunk: return "token2chunk";
    case Op::kGatherTokens: return "gather_tokens";
    case Op::kDecodeAttentionAccumulate: return "decode_attention_accumulate";
    case Op::kQuantize: return "quantize_tokens";
    case Op::kDequantize: return "dequantize_block";
    case Op::kQuantizedAttention: return "decode_attention_quantized";
    case Op::kCamMerge: return "cam_merge_values";
    case Op::kDecodeAttentionObserve: return "decode_attention_observe";
    case Op::kWindowScoresObserved: return "window_scores_observed";
    case Op::kGatherTokensInPlace: return "gather_tokens_in_place";
  }
  return "unknown";
}

}  // namespace karakv::kernels
