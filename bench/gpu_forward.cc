#include "gpu_forward.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "karakv/kernels/half.h"

#if KARAKV_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

namespace karakv::bench {

absl::StatusOr<WorkerCompute> parse_worker_compute(std::string_view flag, std::string_view value) {
  if (value == "sleep") return WorkerCompute::kSleep;
  if (value == "gemm") return WorkerCompute::kGemm;
  return absl::InvalidArgumentError(absl::StrCat("--", std::string(flag), "=", std::string(value),
                                                 ": expected sleep (the model's time modeled) or gemm (its matrix "
                                                 "products on the GPU, with cuBLAS)"));
}

int mlp_width(int mlp, int hidden) { return mlp > 0 ? mlp : (hidden * 7 / 2 + 255) / 256 * 256; }

#if KARAKV_HAVE_CUDA
namespace {

// cuBLAS's entry points, resolved with dlsym (their types from its header; nothing is linked).
struct Cublas {
  void* lib = nullptr;
  std::string name;
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasGetVersion_v2) version = nullptr;
  // The C entry point (the header also declares a C++ overload taking a cudaDataType compute type).
  cublasStatus_t (*gemm)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*, const void*,
                         cudaDataType, int, const void*, cudaDataType, int, const void*, void*, cudaDataType, int,
                         cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
};

absl::StatusOr<Cublas> open_cublas(std::string_view libraries) {
  Cublas c;
  std::vector<std::string> tried;
  for (absl::string_view name : absl::StrSplit(std::string(libraries), ':', absl::SkipEmpty())) {
    c.lib = dlopen(std::string(name).c_str(), RTLD_NOW | RTLD_LOCAL);
    if (c.lib != nullptr) {
      c.name = std::string(name);
      break;
    }
    tried.push_back(absl::StrCat(name, " (", dlerror(), ")"));
  }
  if (c.lib == nullptr)
    return absl::NotFoundError(absl::StrCat("cuBLAS not found: tried ", absl::StrJoin(tried, "; "),
                                            "; put its directory on LD_LIBRARY_PATH or name it with --serve_cublas"));
  std::string missing;  // the first entry point not found, with the loader's word on it
  auto sym = [&](const char* s, auto* out) {
    if (!missing.empty()) return;
    dlerror();
    *out = reinterpret_cast<std::remove_reference_t<decltype(*out)>>(dlsym(c.lib, s));
    if (*out == nullptr) {
      const char* why = dlerror();
      missing = absl::StrCat(s, " (", why != nullptr ? why : "null", ")");
    }
  };
  sym("cublasCreate_v2", &c.create);
  sym("cublasDestroy_v2", &c.destroy);
  sym("cublasSetStream_v2", &c.set_stream);
  sym("cublasGetVersion_v2", &c.version);
  sym("cublasGemmEx", &c.gemm);
  if (!missing.empty()) {
    dlclose(c.lib);
    return absl::NotFoundError(absl::StrCat(c.name, " lacks a cuBLAS entry point this bench calls: ", missing));
  }
  return c;
}

absl::Status cuda_ok(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

absl::Status cublas_ok(cublasStatus_t st, const std::string& what) {
  if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": cuBLAS status ", int(st)));
}

class CublasForward final : public GpuForward {
 public:
  CublasForward(Cublas cublas, int hidden, int kv, int mlp, int max_batch, bool bf16)
      : c_(std::move(cublas)), hidden_(hidden), kv_(kv), mlp_(mlp), max_batch_(max_batch), bf16_(bf16) {}

  ~CublasForward() override {
    if (handle_ != nullptr) c_.destroy(handle_);
    for (void* p : {w_qkv_, w_o_, w_gu_, w_down_, x_, y_})
      if (p != nullptr) cudaFree(p);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    // The library stays loaded: cuBLAS may keep threads or callbacks of its own until exit.
  }

  absl::Status init() {
    if (absl::Status s = cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
        !s.ok())
      return s;
    if (absl::Status s = cublas_ok(c_.create(&handle_), "cublasCreate (is a GPU here?)"); !s.ok()) {
      handle_ = nullptr;
      return s;
    }
    if (absl::Status s = cublas_ok(c_.set_stream(handle_, stream_), "cublasSetStream"); !s.ok()) return s;
    const size_t e = 2;  // fp16 / bf16
    const size_t widest = size_t(std::max({hidden_ + 2 * kv_, 2 * mlp_, hidden_}));
    struct Alloc {
      void** p;
      size_t bytes;
      float scale;  // values uniform in [-scale, scale]
    };
    // Random values, as a model's: a GPU multiplies constant or zero data at less power (and so
    // faster) than real data. Weights scaled by 1/sqrt(fan-in) keep the activations O(1) and finite
    // through 32 layers without the nonlinearities.
    for (const Alloc& a : {Alloc{&w_qkv_, size_t(hidden_ + 2 * kv_) * hidden_ * e, 1.0f / std::sqrt(float(hidden_))},
                           Alloc{&w_o_, size_t(hidden_) * hidden_ * e, 1.0f / std::sqrt(float(hidden_))},
                           Alloc{&w_gu_, size_t(2 * mlp_) * hidden_ * e, 1.0f / std::sqrt(float(hidden_))},
                           Alloc{&w_down_, size_t(hidden_) * mlp_ * e, 1.0f / std::sqrt(float(mlp_))},
                           Alloc{&x_, widest * max_batch_ * e, 1.0f}, Alloc{&y_, widest * max_batch_ * e, 1.0f}}) {
      if (absl::Status s = cuda_ok(cudaMalloc(a.p, a.bytes), absl::StrCat("cudaMalloc of ", a.bytes, " bytes"));
          !s.ok())
        return s;
      if (absl::Status s = fill(*a.p, a.bytes / e, a.scale); !s.ok()) return s;
      weight_bytes_ += (a.p == &x_ || a.p == &y_) ? 0 : a.bytes;
    }
    return absl::OkStatus();
  }

  absl::Status before_attention(int rows) override {
    if (absl::Status s = check_rows(rows); !s.ok()) return s;
    if (absl::Status s = gemm(w_qkv_, hidden_ + 2 * kv_, hidden_, x_, y_, rows, "QKV projection"); !s.ok()) return s;
    if (queued_) return absl::OkStatus();
    return cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize after the QKV projection");
  }

  absl::Status after_attention(int rows) override {
    if (absl::Status s = check_rows(rows); !s.ok()) return s;
    if (absl::Status s = gemm(w_o_, hidden_, hidden_, x_, y_, rows, "output projection"); !s.ok()) return s;
    if (absl::Status s = gemm(w_gu_, 2 * mlp_, hidden_, y_, x_, rows, "MLP gate and up"); !s.ok()) return s;
    if (absl::Status s = gemm(w_down_, hidden_, mlp_, x_, y_, rows, "MLP down"); !s.ok()) return s;
    if (queued_) return absl::OkStatus();
    return cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize after the MLP");
  }

  void* stream() const override { return stream_; }
  void set_queued(bool queued) override { queued_ = queued; }

  std::string description() const override {
    int v = 0;
    c_.version(handle_, &v);
    return absl::StrFormat("cuBLAS %d.%d.%d (%s), one layer's weights %.0f MB %s, hidden %d, KV width %d, MLP %d",
                           v / 10000, v / 100 % 100, v % 100, c_.name, weight_bytes_ / 1e6, bf16_ ? "bf16" : "fp16",
                           hidden_, kv_, mlp_);
  }

 private:
  // `elems` 16-bit values at `p`: a host tile of up to 1M random values, copied over and over.
  absl::Status fill(void* p, size_t elems, float scale) {
    std::vector<uint16_t> tile(std::min<size_t>(elems, size_t(1) << 20));
    std::mt19937 rng{uint32_t(elems)};
    std::uniform_real_distribution<float> u(-scale, scale);
    for (uint16_t& v : tile) v = bf16_ ? kernels::float_to_bf16(u(rng)) : kernels::float_to_half(u(rng));
    for (size_t at = 0; at < elems; at += tile.size()) {
      const size_t n = std::min(tile.size(), elems - at);
      if (absl::Status s = cuda_ok(cudaMemcpy(static_cast<uint16_t*>(p) + at, tile.data(), n * 2, cudaMemcpyHostToDevice),
                                   "cudaMemcpy of the weights' values");
          !s.ok())
        return s;
    }
    return absl::OkStatus();
  }

  absl::Status check_rows(int rows) const {
    if (rows >= 1 && rows <= max_batch_) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("gpu forward: ", rows, " rows, expected 1 to ", max_batch_));
  }

  // out[rows][m] = in[rows][k] W^T with W stored [m][k] (a linear layer's [out][in], as PyTorch
  // keeps it); column-major that is C (m x rows) = op_T(W: k x m) * X (k x rows), the TN product a
  // serving engine's linear layers run.
  absl::Status gemm(const void* w, int m, int k, const void* in, void* out, int rows, const char* what) {
    const float one = 1.0f, zero = 0.0f;
    const cudaDataType t = bf16_ ? CUDA_R_16BF : CUDA_R_16F;
    return cublas_ok(c_.gemm(handle_, CUBLAS_OP_T, CUBLAS_OP_N, m, rows, k, &one, w, t, k, in, t, k, &zero, out, t, m,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                     absl::StrCat("cublasGemmEx, ", what, " (", m, " x ", k, ", ", rows, " rows)"));
  }

  Cublas c_;
  const int hidden_, kv_, mlp_, max_batch_;
  const bool bf16_;
  cudaStream_t stream_ = nullptr;
  bool queued_ = false;
  cublasHandle_t handle_ = nullptr;
  void *w_qkv_ = nullptr, *w_o_ = nullptr, *w_gu_ = nullptr, *w_down_ = nullptr, *x_ = nullptr, *y_ = nullptr;
  double weight_bytes_ = 0;
};

}  // namespace
#endif

absl::StatusOr<std::unique_ptr<GpuForward>> GpuForward::make(const kernels::Geometry& g, int mlp, int max_batch,
                                                             std::string_view libraries) {
  const int hidden = g.num_q_heads * g.head_dim, kv = g.num_kv_heads * g.head_dim;
  if (g.dtype != kernels::DType::kFloat16 && g.dtype != kernels::DType::kBFloat16)
    return absl::InvalidArgumentError(
        "gpu forward: the pool's dtype is fp32; the model's products run in its 16-bit dtype: use fp16 or bf16");
  if (hidden < 1 || kv < 1 || max_batch < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("gpu forward: hidden ", hidden, ", KV width ", kv, ", max batch ", max_batch, ": expected >= 1"));
#if KARAKV_HAVE_CUDA
  auto cublas = open_cublas(libraries);
  if (!cublas.ok()) return cublas.status();
  auto f = std::make_unique<CublasForward>(std::move(*cublas), hidden, kv, mlp_width(mlp, hidden), max_batch,
                                           g.dtype == kernels::DType::kBFloat16);
  if (absl::Status s = f->init(); !s.ok()) return s;
  return std::unique_ptr<GpuForward>(std::move(f));
#else
  (void)libraries;
  (void)mlp;
  return absl::FailedPreconditionError(
      "--serve_worker_compute=gemm needs a build with CUDA (nvcc was not found at configure time)");
#endif
}

}  // namespace karakv::bench
