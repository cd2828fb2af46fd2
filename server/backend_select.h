// The kernel backend karakvd runs on, from --backend: cpu, cuda (a GPU or a refusal naming why),
// or auto (the GPU when one works, else the CPU, with the reason).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "karakv/kernels/backend.h"

namespace karakv::server {

struct SelectedBackend {
  std::unique_ptr<kernels::Backend> backend;
  std::string reason;  // why this one, for the log line
};

// requested: "auto" | "cpu" | "cuda". FAILED_PRECONDITION when cuda was asked for and cannot run.
absl::StatusOr<SelectedBackend> select_backend(const std::string& requested, int cuda_device, int kernel_threads);

}  // namespace karakv::server
