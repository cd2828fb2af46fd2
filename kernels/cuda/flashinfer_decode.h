// FlashInfer's batch decode over the paged pool: the CUDA backend's decode attention on fp16 and
// bf16 pools where the build has FlashInfer's headers (KARAKV_HAVE_FLASHINFER; scripts/
// fetch_flashinfer.sh) and $KARAKV_CUDA_ATTENTION asks for it (karakv/kernels/cuda_attention.h).
//
// The pool's block [block][layer][K/V][kv head][slot][dim] is FlashInfer's HND page with custom
// strides: for one layer, K starts at the layer's run of the block, V num_kv_heads * block_size *
// head_dim elements after it, and a page is a whole block apart (docs/ARCHITECTURE.md, "CUDA
// attention"). Queries are read as fp32 (the backend's interface); FlashInfer writes its output
// in the pool's dtype (its merge of split partials has no fp32-output form for every head_dim), and
// a small kernel widens it into the caller's fp32 rows and turns FlashInfer's base-2 log-sum-exp
// into the natural one the observers use.
//
// Nothing here includes FlashInfer: flashinfer_decode_impl.cuh does, included only by the one
// generated file per (dtype, head_dim) that instantiates its kernels (kernels/CMakeLists.txt).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "karakv/kernels/types.h"

namespace karakv::kernels::cuda {

// Empty when FlashInfer's decode covers geometry g (fp16 or bf16 storage, head_dim 64, 128 or 256,
// a GQA group of 1, 2, 3, 4, 6, 8 or 16 query heads per KV head, strides within 32 bits), else why
// not. The backend runs its own kernels where it is not empty.
std::string flashinfer_decode_gap(const Geometry& g);

// One call's pages, FlashInfer's CSR form of the block tables, in device memory, for the batch's
// non-empty sequences only (FlashInfer's batch b): batch b holds pages indices[indptr[b] ..
// indptr[b + 1]) (block ids), at least one, the last filled to last_page_len[b] in [1, block_size].
struct FlashInferPages {
  const int32_t* indptr = nullptr;
  const int32_t* indices = nullptr;
  const int32_t* last_page_len = nullptr;
  int batch = 0;
};

// One layer's rows. The caller's rows are its sequences, empty ones included: row_map[r] is row r's
// batch index, or -1 for an empty sequence (whose output is 0 and log-sum-exp -inf, as the
// project's kernels give); null when every row is non-empty (row r is batch r).
struct FlashInferRows {
  int rows = 0;
  const int32_t* row_map = nullptr;  // device, [rows], or null
  const float* q = nullptr;          // device, [rows][num_q_heads][head_dim] fp32
  float* out = nullptr;              // device, the same shape
  float* lse = nullptr;              // device, [rows][num_q_heads] natural log-sum-exp, or null
  float scale = 1.0f;
  // Device scratch of the batch: o16 [batch][num_q_heads][head_dim] in the pool's dtype; lse2
  // [batch][num_q_heads] fp32 (with lse); q_batch like q for the batch (with row_map).
  void* o16 = nullptr;
  float* lse2 = nullptr;
  float* q_batch = nullptr;
};

// The planner's state and workspaces: plan() once per batch shape (the pages per sequence), then
// run() per layer. Not thread-safe (the backend serialises its calls). The pinned buffer the plan is
// uploaded from is rewritten by the next plan() only after the stream has passed the last upload
// (an event), and workspaces are freed to grow only after the stream has passed their users, so
// calls need not synchronize between plans (the backend's deferred waits).
class FlashInferDecode {
 public:
  FlashInferDecode() = default;
  ~FlashInferDecode();
  FlashInferDecode(const FlashInferDecode&) = delete;
  FlashInferDecode& operator=(const FlashInferDecode&) = delete;

  // Plans the split of a batch whose sequence s has indptr[s + 1] - indptr[s] pages (host
  // memory), on `stream`; keeps the plan it has when geometry and pages are those of the last one.
  // Errors say what failed (a CUDA call, an allocation) and start with "FlashInfer".
  std::string plan(const Geometry& g, const std::vector<int32_t>& indptr, cudaStream_t stream);

  // Decode of one layer for the planned batch (pages) into the caller's rows.
  std::string run(const Geometry& g, void* pool, int layer, const FlashInferPages& pages, const FlashInferRows& rows,
                  cudaStream_t stream);

  // Plans made (not reused) since construction, for tests and benchmarks.
  long long plans() const { return plans_; }

 private:
  std::string reserve(size_t float_bytes, size_t int_bytes, cudaStream_t stream);

  void* float_workspace_ = nullptr;
  size_t float_bytes_ = 0;
  void* int_workspace_ = nullptr;
  size_t int_bytes_ = 0;
  void* pinned_ = nullptr;  // page-locked mirror of the int workspace, the plan's upload source
  cudaEvent_t uploaded_ = nullptr;  // recorded after the last plan's upload from pinned_
  bool upload_pending_ = false;
  std::vector<int64_t> plan_info_;
  // The last plan's batch (empty: no plan; a plan has at least one sequence, so two entries).
  Geometry planned_geometry_{};
  std::vector<int32_t> planned_indptr_;
  long long plans_ = 0;
};

namespace flashinfer_detail {

// The per-(dtype, head_dim) entry points; each generated file instantiates one pair. Returns empty
// on success, else what failed.
struct PlanArgs {
  void* float_workspace;
  size_t float_bytes;
  void* int_workspace;
  void* pinned;
  size_t int_bytes;
  int32_t* indptr;  // host
  uint32_t batch, num_q_heads, num_kv_heads, page_size;
  cudaStream_t stream;
};
// size_only: the workspace bytes the plan needs into *float_need and *int_need; else the plan into
// *plan_info (FlashInfer's DecodePlanInfo as its ten numbers).
template <typename KV, int D>
std::string plan(const PlanArgs& a, bool size_only, size_t* float_need, size_t* int_need,
                 std::vector<int64_t>* plan_info);

struct RunArgs {
  const std::vector<int64_t>* plan_info;
  void* float_workspace;
  void* int_workspace;
  void* pool;
  int layer;
  const Geometry* geometry;
  FlashInferPages pages;
  FlashInferRows rows;
  cudaStream_t stream;
};
template <typename KV, int D>
std::string run(const RunArgs& a);

}  // namespace flashinfer_detail

}  // namespace karakv::kernels::cuda
