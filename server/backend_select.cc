#include "server/backend_select.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace karakv::server {

absl::StatusOr<SelectedBackend> select_backend(const std::string& requested, int cuda_device, int kernel_threads) {
  SelectedBackend out;
  if (requested == "cpu") {
    out.backend = kernels::make_cpu_backend(kernel_threads);
    out.reason = "requested --backend=cpu";
    return out;
  }
  if (requested != "auto" && requested != "cuda")
    return absl::InvalidArgumentError(absl::StrCat("--backend=", requested, ", expected auto, cpu or cuda"));
  std::string why;
  out.backend = kernels::make_cuda_backend(cuda_device, &why);
  if (out.backend != nullptr) {
    out.reason = absl::StrCat("requested --backend=", requested);
    return out;
  }
  if (requested == "cuda") {
    return absl::FailedPreconditionError(absl::StrCat("--backend=cuda cannot run: ", why,
                                                      "; use --backend=cpu or --backend=auto"));
  }
  out.backend = kernels::make_cpu_backend(kernel_threads);
  out.reason = absl::StrCat("--backend=auto: the CUDA backend is unavailable (", why, ")");
  return out;
}

}  // namespace karakv::server
