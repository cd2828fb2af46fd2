// Which kernels the CUDA backend's decode attention runs over fp16 and bf16 pools: the project's
// own (kernels/cuda/attention.cu) or FlashInfer's batch decode (kernels/cuda/flashinfer_decode.h),
// where the build has FlashInfer's headers. FlashInfer runs only where it covers the call (fp16 or
// bf16, head_dim 64/128/256, GQA groups 1-4, 6, 8, 16, a sequence with a token; empty ones get
// the own kernels' result); everything else, and every other op, runs the project's kernels,
// which stay the reference.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "karakv/kernels/types.h"

namespace karakv::kernels {

enum class CudaAttention : uint8_t {
  kOwn,         // the project's paged decode kernels
  kFlashInfer,  // FlashInfer's batch decode where it covers the call
};

// "own" and "flashinfer".
std::string_view cuda_attention_name(CudaAttention attention);

// Empty when this build can run `attention`, else what is missing ("this build has no FlashInfer
// ...").
std::string cuda_attention_missing(CudaAttention attention);

// What "auto" means: the project's own kernels until FlashInfer's route has passed the device
// check on a GPU (scripts/gpu-check.sh runs the decode op tests under both; docs/BENCHMARKS.md, "GPU").
CudaAttention default_cuda_attention();

// "auto" (or empty): default_cuda_attention(); "own" or "flashinfer": that one, if this build has
// it. Anything else is kInvalidArgument saying what was wrong and what is expected.
KernelStatus parse_cuda_attention(std::string_view text, CudaAttention* out);

// The environment variable that picks the CUDA backend's decode attention.
inline constexpr char kCudaAttentionEnv[] = "KARAKV_CUDA_ATTENTION";

// parse_cuda_attention of $KARAKV_CUDA_ATTENTION; unset is "auto". Errors name the variable.
KernelStatus cuda_attention_from_env(CudaAttention* out);

// Which kernels attend over quantized storage (KIVI, TurboQuant; kernels/cuda/quant.cuh): the
// staged ones (logits of every slot written to device memory, a softmax, the values) or the fused
// ones (each KV head's codes read once per split of 256 slots for all its query heads, the split's
// softmax in shared memory, the splits merged by their log-sum-exps).
enum class CudaQuantDecode : uint8_t {
  kStaged,
  kFused,
};

// "staged" and "fused".
std::string_view cuda_quant_decode_name(CudaQuantDecode quant);

// Empty when this build can run `quant`: staged always (it is the default, and means nothing without
// a CUDA backend), fused where the CUDA backend is built; else what is missing.
std::string cuda_quant_decode_missing(CudaQuantDecode quant);

// What "auto" means: staged until the fused kernels have passed the device check on a GPU
// (scripts/gpu-check.sh runs the quantized op tests and the quant benchmark under both).
CudaQuantDecode default_cuda_quant_decode();

// "auto" (or empty), "staged" or "fused"; anything else is kInvalidArgument naming what is expected.
KernelStatus parse_cuda_quant_decode(std::string_view text, CudaQuantDecode* out);

// The environment variable that picks them.
inline constexpr char kCudaQuantDecodeEnv[] = "KARAKV_CUDA_QUANT_DECODE";

// parse_cuda_quant_decode of $KARAKV_CUDA_QUANT_DECODE; unset is "auto". Errors name the variable.
KernelStatus cuda_quant_decode_from_env(CudaQuantDecode* out);

}  // namespace karakv::kernels
