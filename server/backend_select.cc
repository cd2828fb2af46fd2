#include "server/backend_select.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_limits.h"

namespace karakv::server {
namespace {

// The CPU backend with the attention ISA of $KARAKV_CPU_ISA and the scorers' products of
// $KARAKV_CPU_GEMM (unset: the best this CPU and build have). A value that is unknown or cannot run
// here refuses the start (INVALID_ARGUMENT naming the variable, the value and what is expected)
// rather than falling back as the library does.
absl::StatusOr<std::unique_ptr<kernels::Backend>> make_cpu(int kernel_threads) {
  kernels::CpuIsa isa;
  if (kernels::KernelStatus st = kernels::cpu_isa_from_env(&isa); !st.is_ok()) {
    return absl::InvalidArgumentError(st.message);
  }
  kernels::CpuGemm gemm;
  if (kernels::KernelStatus st = kernels::cpu_gemm_from_env(&gemm); !st.is_ok()) {
    return absl::InvalidArgumentError(st.message);
  }
  std::string why;
  auto backend = kernels::make_cpu_backend(kernel_threads, isa, gemm, &why);
  if (backend == nullptr) return absl::InvalidArgumentError(why);
  return backend;
}

// geometry: null when the caller did not give one (not checked).
absl::StatusOr<SelectedBackend> select(const std::string& requested, int cuda_device, int kernel_threads,
                                       const kernels::Geometry* geometry) {
  SelectedBackend out;
  if (requested == "cpu") {
    auto cpu = make_cpu(kernel_threads);
    if (!cpu.ok()) return cpu.status();
    out.backend = std::move(*cpu);
    out.reason = "requested --backend=cpu";
    return out;
  }
  if (requested != "auto" && requested != "cuda")
    return absl::InvalidArgumentError(absl::StrCat("--backend=", requested, ", expected auto, cpu or cuda"));
  // The geometry first: it does not depend on this machine, and the GPU need not be touched.
  std::string why;
  if (geometry != nullptr) {
    if (kernels::KernelStatus st = kernels::cuda::check_geometry(*geometry); !st.is_ok()) why = st.message;
  }
  // $KARAKV_CUDA_ATTENTION picks the CUDA decode attention; a value that is unknown or that this
  // build cannot run refuses the start, as the CPU backend's variables do, whether or not a GPU is
  // here (the setting is wrong either way).
  kernels::CudaAttention attention;
  if (kernels::KernelStatus st = kernels::cuda_attention_from_env(&attention); !st.is_ok()) {
    return absl::InvalidArgumentError(st.message);
  }
  kernels::CudaQuantDecode quant;  // $KARAKV_CUDA_QUANT_DECODE, likewise
  if (kernels::KernelStatus st = kernels::cuda_quant_decode_from_env(&quant); !st.is_ok()) {
    return absl::InvalidArgumentError(st.message);
  }
  if (why.empty()) {
    out.backend = kernels::make_cuda_backend(cuda_device, attention, quant, &why);
    if (out.backend != nullptr) {
      out.reason = absl::StrCat("requested --backend=", requested);
      return out;
    }
  }
  if (requested == "cuda") {
    return absl::FailedPreconditionError(absl::StrCat("--backend=cuda cannot run: ", why,
                                                      "; use --backend=cpu or --backend=auto"));
  }
  auto cpu = make_cpu(kernel_threads);
  if (!cpu.ok()) return cpu.status();
  out.backend = std::move(*cpu);
  out.reason = absl::StrCat("--backend=auto: the CUDA backend is unavailable (", why, ")");
  return out;
}

}  // namespace

absl::StatusOr<SelectedBackend> select_backend(const std::string& requested, int cuda_device, int kernel_threads,
                                               const kernels::Geometry& geometry) {
  return select(requested, cuda_device, kernel_threads, &geometry);
}

absl::StatusOr<SelectedBackend> select_backend(const std::string& requested, int cuda_device, int kernel_threads) {
  return select(requested, cuda_device, kernel_threads, nullptr);
}

}  // namespace karakv::server
