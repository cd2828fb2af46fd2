// The CUDA backend's choice of decode attention (karakv/kernels/cuda_attention.h). Built in every
// configuration, so the daemon can refuse a choice its build cannot run.
#include "karakv/kernels/cuda_attention.h"

#include <cstdio>

#include "common/choice.h"
#include "karakv/kernels/backend.h"

namespace karakv::kernels {

std::string_view cuda_attention_name(CudaAttention attention) {
  return attention == CudaAttention::kFlashInfer ? "flashinfer" : "own";
}

std::string cuda_attention_missing(CudaAttention attention) {
  if (attention == CudaAttention::kOwn) return "";
#if KARAKV_HAVE_FLASHINFER
  return "";
#elif KARAKV_HAVE_CUDA
  return "this build has no FlashInfer (run scripts/fetch_flashinfer.sh, then configure again)";
#else
  return "this build has no CUDA backend";
#endif
}

CudaAttention default_cuda_attention() { return CudaAttention::kOwn; }

KernelStatus parse_cuda_attention(std::string_view text, CudaAttention* out) {
  return common::parse_choice<CudaAttention>("CUDA attention", text, {"own", CudaAttention::kOwn},
                                             {"flashinfer", CudaAttention::kFlashInfer}, default_cuda_attention(),
                                             cuda_attention_missing, out);
}

KernelStatus cuda_attention_from_env(CudaAttention* out) {
  return common::choice_from_env(kCudaAttentionEnv, parse_cuda_attention, out);
}

std::string_view cuda_quant_decode_name(CudaQuantDecode quant) {
  return quant == CudaQuantDecode::kFused ? "fused" : "staged";
}

std::string cuda_quant_decode_missing(CudaQuantDecode quant) {
  // The default is never missing: a build without CUDA must still start with the variable unset.
  if (quant == CudaQuantDecode::kStaged) return "";
#if KARAKV_HAVE_CUDA
  return "";
#else
  return "this build has no CUDA backend";
#endif
}

CudaQuantDecode default_cuda_quant_decode() { return CudaQuantDecode::kStaged; }

KernelStatus parse_cuda_quant_decode(std::string_view text, CudaQuantDecode* out) {
  return common::parse_choice<CudaQuantDecode>("CUDA quantized decode", text, {"staged", CudaQuantDecode::kStaged},
                                               {"fused", CudaQuantDecode::kFused}, default_cuda_quant_decode(),
                                               cuda_quant_decode_missing, out);
}

KernelStatus cuda_quant_decode_from_env(CudaQuantDecode* out) {
  return common::choice_from_env(kCudaQuantDecodeEnv, parse_cuda_quant_decode, out);
}

}  // namespace karakv::kernels

namespace karakv::kernels {

namespace {

// The environment's choice, or the default with the reason on stderr when the value is refused.
template <typename T>
T env_choice_or_default(KernelStatus (*from_env)(T*), std::string_view (*name)(T), T fallback) {
  T value = fallback;
  if (KernelStatus st = from_env(&value); !st.is_ok()) {
    std::fprintf(stderr, "karakv: %s; using %s\n", st.message.c_str(), std::string(name(fallback)).c_str());
    value = fallback;
  }
  return value;
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device, std::string* error) {
  return make_cuda_backend(
      device, env_choice_or_default(cuda_attention_from_env, cuda_attention_name, default_cuda_attention()),
      env_choice_or_default(cuda_quant_decode_from_env, cuda_quant_decode_name, default_cuda_quant_decode()), error);
}

std::unique_ptr<Backend> make_cuda_backend(int device, CudaAttention attention, std::string* error) {
  return make_cuda_backend(device, attention, default_cuda_quant_decode(), error);
}

}  // namespace karakv::kernels
