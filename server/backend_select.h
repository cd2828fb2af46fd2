// The kernel backend karakvd runs on, from --backend: cpu, cuda (a GPU or a refusal naming why),
// or auto (the GPU when one works, else the CPU, with the reason).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "karakv/kernels/backend.h"
#include "karakv/kernels/types.h"

namespace karakv::server {

struct SelectedBackend {
  std::unique_ptr<kernels::Backend> backend;
  std::string reason;  // why this one, for the log line
};

// requested: "auto" | "cpu" | "cuda". FAILED_PRECONDITION when cuda was asked for and cannot run.
// `geometry` is the daemon's: one the CUDA backend's kernels cannot take (head_dim over its limit,
// kernels/cuda/cuda_limits.h) is refused here, at start-up, for --backend=cuda (FAILED_PRECONDITION
// naming head_dim, its value and the limit), and sends --backend=auto to the CPU with that reason,
// instead of every call failing later.
absl::StatusOr<SelectedBackend> select_backend(const std::string& requested, int cuda_device, int kernel_threads,
                                               const kernels::Geometry& geometry);
// The same without the geometry check: a geometry the CUDA backend cannot take is then refused on
// each call. Prefer the overload above.
absl::StatusOr<SelectedBackend> select_backend(const std::string& requested, int cuda_device, int kernel_threads);

}  // namespace karakv::server
