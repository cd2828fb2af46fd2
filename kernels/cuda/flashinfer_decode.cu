// FlashInferDecode (flashinfer_decode.h): which geometries FlashInfer covers, the workspaces, the
// plan cache, and the dispatch to the (dtype, head_dim) instantiations. No FlashInfer header here.
#include "flashinfer_decode.h"

#include <climits>
#include <type_traits>

namespace karakv::kernels::cuda {
namespace {

using flashinfer_detail::PlanArgs;
using flashinfer_detail::RunArgs;

template <typename T>
struct Type {
  using type = T;
};
template <int D>
using Dim = std::integral_constant<int, D>;

// f(Type<KV>, Dim<D>) for the geometry's pair; the caller has checked the gap.
template <typename F>
std::string with_instance(const Geometry& g, F&& f) {
  const bool bf16 = g.dtype == DType::kBFloat16;
  switch (g.head_dim) {
    case 64: return bf16 ? f(Type<nv_bfloat16>{}, Dim<64>{}) : f(Type<half>{}, Dim<64>{});
    case 128: return bf16 ? f(Type<nv_bfloat16>{}, Dim<128>{}) : f(Type<half>{}, Dim<128>{});
    case 256: return bf16 ? f(Type<nv_bfloat16>{}, Dim<256>{}) : f(Type<half>{}, Dim<256>{});
  }
  return "FlashInfer: head_dim " + std::to_string(g.head_dim) + " has no instantiation";
}

bool same_geometry(const Geometry& a, const Geometry& b) {
  return a.num_layers == b.num_layers && a.num_q_heads == b.num_q_heads && a.num_kv_heads == b.num_kv_heads &&
         a.head_dim == b.head_dim && a.block_size == b.block_size && a.dtype == b.dtype;
}

}  // namespace

std::string flashinfer_decode_gap(const Geometry& g) {
  if (g.dtype != DType::kFloat16 && g.dtype != DType::kBFloat16)
    return "FlashInfer's decode takes fp16 and bf16 pools, not fp32";
  if (g.head_dim != 64 && g.head_dim != 128 && g.head_dim != 256)
    return "FlashInfer's decode is built for head_dim 64, 128 and 256, not " + std::to_string(g.head_dim);
  if (g.num_kv_heads < 1 || g.num_q_heads % g.num_kv_heads != 0) return "the query heads are not whole GQA groups";
  switch (g.group_size()) {
    case 1: case 2: case 3: case 4: case 6: case 8: case 16: break;
    default:
      return "FlashInfer's decode takes GQA groups of 1, 2, 3, 4, 6, 8 or 16 query heads, not " +
             std::to_string(g.group_size());
  }
  // paged_kv_t keeps its strides in 32 bits.
  if (g.block_elems() > size_t(UINT32_MAX)) return "a block of " + std::to_string(g.block_elems()) +
                                                   " elements is beyond FlashInfer's 32-bit page stride";
  return "";
}

FlashInferDecode::~FlashInferDecode() {
  if (uploaded_ != nullptr) cudaEventDestroy(uploaded_);
  if (float_workspace_ != nullptr) cudaFree(float_workspace_);
  if (int_workspace_ != nullptr) cudaFree(int_workspace_);
  if (pinned_ != nullptr) cudaFreeHost(pinned_);
}

std::string FlashInferDecode::reserve(size_t float_bytes, size_t int_bytes, cudaStream_t stream) {
  // Kernels of calls that did not wait may still use the workspaces about to be replaced.
  if ((float_bytes > float_bytes_ && float_workspace_ != nullptr) || (int_bytes > int_bytes_ && int_workspace_ != nullptr))
    cudaStreamSynchronize(stream);
  // Grown to the next power of two past what is asked, so that a batch growing by a token does not
  // reallocate every step.
  auto round_up = [](size_t n) {
    size_t r = size_t(64) << 10;
    while (r < n) r *= 2;
    return r;
  };
  // *p = `bytes` of device memory (or pinned host memory), or the failure in words.
  auto allocate = [](void** p, size_t bytes, bool pinned, const char* what) -> std::string {
    const cudaError_t e = pinned ? cudaHostAlloc(p, bytes, cudaHostAllocDefault) : cudaMalloc(p, bytes);
    if (e == cudaSuccess) return "";
    cudaGetLastError();
    *p = nullptr;
    return std::string("FlashInfer: ") + (pinned ? "cudaHostAlloc" : "cudaMalloc") + " of a " +
           std::to_string(bytes) + "-byte " + what + ": " + cudaGetErrorName(e);
  };
  if (float_bytes > float_bytes_) {
    if (float_workspace_ != nullptr) cudaFree(float_workspace_);
    float_workspace_ = nullptr;
    float_bytes_ = 0;
    const size_t want = round_up(float_bytes);
    if (std::string err = allocate(&float_workspace_, want, false, "float workspace"); !err.empty()) return err;
    float_bytes_ = want;
  }
  if (int_bytes > int_bytes_) {
    if (int_workspace_ != nullptr) cudaFree(int_workspace_);
    if (pinned_ != nullptr) cudaFreeHost(pinned_);
    int_workspace_ = pinned_ = nullptr;
    int_bytes_ = 0;
    const size_t want = round_up(int_bytes);
    if (std::string err = allocate(&int_workspace_, want, false, "int workspace"); !err.empty()) return err;
    if (std::string err = allocate(&pinned_, want, true, "plan buffer"); !err.empty()) {
      cudaFree(int_workspace_);
      int_workspace_ = nullptr;
      return err;
    }
    int_bytes_ = want;
  }
  return "";
}

std::string FlashInferDecode::plan(const Geometry& g, const std::vector<int32_t>& indptr, cudaStream_t stream) {
  if (!planned_indptr_.empty() && same_geometry(g, planned_geometry_) && indptr == planned_indptr_) return "";
  planned_indptr_.clear();  // no plan until this one is made
  if (indptr.size() < 2) return "FlashInfer: a plan needs at least one non-empty sequence";
  std::vector<int32_t> pages = indptr;  // FlashInfer's planner takes a non-const pointer
  PlanArgs a{};
  a.indptr = pages.data();
  a.batch = uint32_t(indptr.size() - 1);
  a.num_q_heads = uint32_t(g.num_q_heads);
  a.num_kv_heads = uint32_t(g.num_kv_heads);
  a.page_size = uint32_t(g.block_size);
  a.stream = stream;
  size_t float_need = 0, int_need = 0;
  std::string err = with_instance(g, [&](auto kv, auto d) {
    return flashinfer_detail::plan<typename decltype(kv)::type, decltype(d)::value>(a, /*size_only=*/true,
                                                                                    &float_need, &int_need, nullptr);
  });
  if (err.empty()) err = reserve(float_need, int_need, stream);
  if (!err.empty()) return err;
  if (uploaded_ == nullptr) {
    if (const cudaError_t e = cudaEventCreateWithFlags(&uploaded_, cudaEventDisableTiming); e != cudaSuccess) {
      uploaded_ = nullptr;
      return std::string("FlashInfer: cudaEventCreateWithFlags: ") + cudaGetErrorName(e);
    }
  }
  // The planner rewrites the pinned buffer: the last plan's upload from it must have left.
  if (upload_pending_) {
    cudaEventSynchronize(uploaded_);
    upload_pending_ = false;
  }
  a.float_workspace = float_workspace_;
  a.float_bytes = float_bytes_;
  a.int_workspace = int_workspace_;
  a.pinned = pinned_;
  a.int_bytes = int_bytes_;
  err = with_instance(g, [&](auto kv, auto d) {
    return flashinfer_detail::plan<typename decltype(kv)::type, decltype(d)::value>(a, /*size_only=*/false,
                                                                                    nullptr, nullptr, &plan_info_);
  });
  if (!err.empty()) return err;
  if (const cudaError_t e = cudaEventRecord(uploaded_, stream); e != cudaSuccess) {
    // Without the mark the next plan could not tell when the buffer is free: wait here instead.
    cudaStreamSynchronize(stream);
  } else {
    upload_pending_ = true;
  }
  planned_geometry_ = g;
  planned_indptr_ = indptr;
  ++plans_;
  return "";
}

std::string FlashInferDecode::run(const Geometry& g, void* pool, int layer, const FlashInferPages& pages,
                                  const FlashInferRows& rows, cudaStream_t stream) {
  if (planned_indptr_.empty() || !same_geometry(g, planned_geometry_) || size_t(pages.batch) + 1 != planned_indptr_.size())
    return "FlashInfer: run without a plan for this batch";
  RunArgs a{&plan_info_, float_workspace_, int_workspace_, pool, layer, &g, pages, rows, stream};
  return with_instance(g, [&](auto kv, auto d) {
    return flashinfer_detail::run<typename decltype(kv)::type, decltype(d)::value>(a);
  });
}

}  // namespace karakv::kernels::cuda
