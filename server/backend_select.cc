#include "server/backend_select.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_limits.h"

namespace karakv::server {
namespace {

// geometry: null when the caller did not give one (not checked).
absl::StatusOr<SelectedBackend> select(const std::string& requested, int cuda_device, int kernel_threads,
                                       const kernels::Geometry* geometry) {
  SelectedBackend out;
  if (requested == "cpu") {
    out.backend = kernels::make_cpu_backend(kernel_threads);
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
  if (why.empty()) {
    out.backend = kernels::make_cuda_backend(cuda_device, &why);
    if (out.backend != nullptr) {
      out.reason = absl::StrCat("requested --backend=", requested);
      return out;
    }
  }
  if (requested == "cuda") {
    return absl::FailedPreconditionError(absl::StrCat("--backend=cuda cannot run: ", why,
                                                      "; use --backend=cpu or --backend=auto"));
  }
  out.backend = kernels::make_cpu_backend(kernel_threads);
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
