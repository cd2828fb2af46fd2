// Names of the kernel ops, for logs and error messages.
#include "karakv/kernels/backend.h"
#include "karakv/kernels/types.h"

namespace karakv::kernels {

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
  }
  return "unknown";
}

}  // namespace karakv::kernels
