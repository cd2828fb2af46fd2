// A serve worker's own model work on the GPU (karakv-bench serve --serve_worker_compute=gemm): the
// matrix products of a decoder layer's projections and MLP, run with cuBLAS on the worker's stream
// where a real model would run them, so that the worker's GPU work and karakvd's attention share
// the GPU as they do in a deployment. Per layer: before attention the QKV projection
// (hidden -> hidden + 2 x KV width), after it the output projection (hidden -> hidden) and the
// gated MLP (hidden -> 2 x mlp, mlp -> hidden); activations and norms, whose cost is small, are left
// out. One layer's weights (in the pool's 16-bit dtype, fp32 accumulation) serve every layer: the
// same bytes and arithmetic per layer, a fraction of the memory (Llama-3.1-8B: 436 MB instead of 14 GB).
//
// cuBLAS is opened at run time (dlopen): it is not linked, so the bench needs it only when this mode
// runs, and a GPU machine's own copy (a CUDA toolkit's, or PyTorch's nvidia-cublas wheel on
// LD_LIBRARY_PATH) serves.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "karakv/kernels/types.h"

namespace karakv::bench {

enum class WorkerCompute {
  kSleep,  // the model's time modeled by sleeping (--serve_model_*_us)
  kGemm,   // the model's matrix products on the GPU (GpuForward)
};

// "sleep" or "gemm"; anything else is INVALID_ARGUMENT naming the flag and the choices.
absl::StatusOr<WorkerCompute> parse_worker_compute(std::string_view flag, std::string_view value);

// The MLP's intermediate width for `mlp` (0: 3.5 x hidden rounded to a multiple of 256, Llama-3.1-8B's
// 14336 for its hidden 4096).
int mlp_width(int mlp, int hidden);

class GpuForward {
 public:
  // hidden = num_q_heads x head_dim, KV width = num_kv_heads x head_dim; batches of up to
  // max_batch rows. `libraries`: colon-separated names or paths tried in order with dlopen.
  // Weights and activations hold random values (scaled by 1/sqrt(fan-in)), laid out [out][in] and
  // multiplied transposed as a serving engine's linear layers are. Errors name what failed (no CUDA
  // in this build, an fp32 pool, cuBLAS not found with the names tried, a missing entry point, a
  // CUDA or cuBLAS call).
  static absl::StatusOr<std::unique_ptr<GpuForward>> make(const kernels::Geometry& g, int mlp, int max_batch,
                                                          std::string_view libraries);
  virtual ~GpuForward() = default;

  // The products before a layer's attention (QKV) and after it (output projection and MLP) for
  // `rows` rows (decode: one per sequence; prefill: the chunk's tokens), finished when they return,
  // or only queued on stream() after set_queued(true) (a stream-ordered worker).
  virtual absl::Status before_attention(int rows) = 0;
  virtual absl::Status after_attention(int rows) = 0;
  // The worker's stream (a cudaStream_t) the products run on.
  virtual void* stream() const = 0;
  virtual void set_queued(bool queued) = 0;

  // "cuBLAS 13.0.0 (libcublas.so.13), one layer's weights 436 MB bf16, hidden 4096, MLP 14336".
  virtual std::string description() const = 0;
};

}  // namespace karakv::bench
