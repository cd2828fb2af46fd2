// make_cuda_backend in a build without the CUDA backend (nvcc was not found at configure time, or
// KARAKV_CUDA=OFF): it says so instead of failing to link.
#include "karakv/kernels/backend.h"

namespace karakv::kernels {

std::unique_ptr<Backend> make_cuda_backend(int device, CudaAttention attention, CudaQuantDecode, std::string* error) {
  // As the CUDA build: a decode attention this build lacks is named first.
  if (std::string missing = cuda_attention_missing(attention); !missing.empty()) {
    if (error != nullptr) *error = "CUDA attention " + std::string(cuda_attention_name(attention)) + ": " + missing;
    return nullptr;
  }
  if (error != nullptr)
    *error = "this build has no CUDA backend (nvcc was not found when it was configured; reconfigure with "
             "-DKARAKV_CUDA=ON where the CUDA toolkit is installed)";
  return nullptr;
}

bool cuda_backend_built() { return false; }

}  // namespace karakv::kernels
