// The FlashInfer side of flashinfer_decode.h: its planner and batch decode kernel for one (dtype,
// head_dim), included only by the generated instantiation files (kernels/CMakeLists.txt), which
// define KARAKV_FLASHINFER_KV (half or nv_bfloat16) and KARAKV_FLASHINFER_HEAD_DIM.
//
// FlashInfer's parameters: fp32 queries, the pool's dtype as K/V and output, int32 indices, no
// positional encoding, the default variant (softmax, no mask, no sliding window, no soft cap).
#pragma once

#include <flashinfer/attention/decode.cuh>
#include <flashinfer/attention/default_decode_params.cuh>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/attention/variants.cuh>

#include <algorithm>
#include <cmath>
#include <exception>
#include <string>
#include <vector>

#include "flashinfer_decode.h"

namespace karakv::kernels::cuda::flashinfer_detail {

template <typename KV>
using Params = flashinfer::BatchDecodeParams<float, KV, KV, int32_t>;
using Variant = flashinfer::DefaultAttention</*custom_mask=*/false, /*sliding_window=*/false,
                                             /*logits_soft_cap=*/false, /*alibi=*/false>;
constexpr flashinfer::PosEncodingMode kNoPositions = flashinfer::PosEncodingMode::kNone;

// Helpers of this file, one copy per instantiation file.
namespace {

// A failed CUDA call of FlashInfer's (it returns the code and leaves it as the runtime's last error,
// which the next op's launch check would take for its own) in words, the last error cleared.
std::string cuda_failure(const char* what, cudaError_t e) {
  cudaGetLastError();
  return std::string("FlashInfer ") + what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

// Grid-stride over n elements.
#define KARAKV_GRID_STRIDE(i, n) \
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += size_t(gridDim.x) * blockDim.x)

// q_batch[row_map[r]] = q[r] for the non-empty rows (elems floats per row).
__global__ void gather_batch_queries(const float* __restrict__ q, const int32_t* __restrict__ row_map, int rows,
                                     size_t elems, float* __restrict__ q_batch) {
  KARAKV_GRID_STRIDE(i, size_t(rows) * elems) {
    const int32_t b = row_map[i / elems];
    if (b >= 0) q_batch[size_t(b) * elems + i % elems] = q[i];
  }
}

// The caller's rows from the batch's: out[r] = float(o16[b]) and lse[r] = lse2[b] * ln 2 (FlashInfer's
// log-sum-exp is base 2: the maximum plus log2 of the sum, logits pre-scaled by log2 e), b the row's
// batch index; an empty row gets 0 and -inf.
template <typename KV>
__global__ void widen_output(const KV* __restrict__ o16, const float* __restrict__ lse2,
                             const int32_t* __restrict__ row_map, int rows, int heads, int dim,
                             float* __restrict__ out, float* __restrict__ lse) {
  const size_t row_elems = size_t(heads) * dim, n = size_t(rows) * row_elems;
  const size_t m = lse != nullptr ? size_t(rows) * heads : 0;
  KARAKV_GRID_STRIDE(i, n + m) {
    if (i < n) {
      const size_t r = i / row_elems;
      const int32_t b = row_map != nullptr ? row_map[r] : int32_t(r);
      out[i] = b < 0 ? 0.0f : static_cast<float>(o16[size_t(b) * row_elems + i % row_elems]);
    } else {
      const size_t j = i - n, r = j / heads;
      const int32_t b = row_map != nullptr ? row_map[r] : int32_t(r);
      lse[j] = b < 0 ? -INFINITY : lse2[size_t(b) * heads + j % heads] * 0.69314718055994530942f;
    }
  }
}

int grid_for(size_t n, int threads) { return int(std::min<size_t>((n + threads - 1) / threads, 4096)); }

}  // namespace

template <typename KV, int D>
std::string plan(const PlanArgs& a, bool size_only, size_t* float_need, size_t* int_need,
                 std::vector<int64_t>* plan_info) {
  using P = Params<KV>;
  try {
    cudaError_t e = cudaErrorInvalidValue;
    DISPATCH_GQA_GROUP_SIZE(a.num_q_heads / a.num_kv_heads, GROUP, {
      auto estimate =
          flashinfer::BatchDecodeWithPagedKVCacheWorkEstimationDispatched<GROUP, D, kNoPositions, Variant, P>;
      if (size_only) {
        e = flashinfer::DecodePlanWorkspaceSize<D, kNoPositions, Variant, P>(
            *float_need, *int_need, a.indptr, a.batch, a.num_q_heads, a.page_size, /*enable_cuda_graph=*/false,
            a.stream, estimate);
      } else {
        flashinfer::DecodePlanInfo info;
        e = flashinfer::DecodePlan<D, kNoPositions, Variant, P>(a.float_workspace, a.float_bytes, a.int_workspace,
                                                                a.pinned, a.int_bytes, info, a.indptr, a.batch,
                                                                a.num_q_heads, a.page_size,
                                                                /*enable_cuda_graph=*/false, a.stream, estimate);
        *plan_info = info.ToVector();
      }
    });
    if (e != cudaSuccess) return cuda_failure(size_only ? "DecodePlanWorkspaceSize" : "DecodePlan", e);
    return "";
  } catch (const std::exception& ex) {
    return std::string("FlashInfer's decode plan: ") + ex.what();
  }
}

template <typename KV, int D>
std::string run(const RunArgs& a) {
  using P = Params<KV>;
  const Geometry& g = *a.geometry;
  const FlashInferRows& rows = a.rows;
  constexpr int kThreads = 256;
  try {
    const size_t q_elems = size_t(g.num_q_heads) * D;
    const float* q = rows.q;
    if (rows.row_map != nullptr) {
      gather_batch_queries<<<grid_for(size_t(rows.rows) * q_elems, kThreads), kThreads, 0, a.stream>>>(
          rows.q, rows.row_map, rows.rows, q_elems, rows.q_batch);
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cuda_failure("gathering the batch's queries", e);
      q = rows.q_batch;
    }
    flashinfer::DecodePlanInfo info;
    info.FromVector(*a.plan_info);
    // One layer of the pool as HND pages: [block] a block apart, [kv head] block_size * D apart,
    // [slot] D apart; V one K run of every head after K.
    const size_t head_run = size_t(g.block_size) * D;
    const int64_t strides[3] = {int64_t(g.block_elems()), int64_t(head_run), int64_t(D)};
    KV* k = static_cast<KV*>(a.pool) + size_t(a.layer) * 2 * g.num_kv_heads * head_run;
    KV* v = k + size_t(g.num_kv_heads) * head_run;
    flashinfer::paged_kv_t<KV, int32_t> kv(g.num_kv_heads, g.block_size, D, a.pages.batch,
                                            flashinfer::QKVLayout::kHND, k, v, strides,
                                            const_cast<int32_t*>(a.pages.indices), const_cast<int32_t*>(a.pages.indptr),
                                            const_cast<int32_t*>(a.pages.last_page_len));
    P p;
    p.q = const_cast<float*>(q);
    p.paged_kv = kv;
    p.o = static_cast<KV*>(rows.o16);
    p.lse = rows.lse != nullptr ? rows.lse2 : nullptr;
    p.num_qo_heads = g.num_q_heads;
    p.q_stride_n = int32_t(q_elems);
    p.q_stride_h = D;
    p.window_left = -1;
    p.logits_soft_cap = 0.0f;
    p.sm_scale = rows.scale;
    p.rope_rcp_scale = 1.0f;
    p.rope_rcp_theta = 1.0f;
    p.request_indices = flashinfer::GetPtrFromBaseOffset<int32_t>(a.int_workspace, info.request_indices_offset);
    p.kv_tile_indices = flashinfer::GetPtrFromBaseOffset<int32_t>(a.int_workspace, info.kv_tile_indices_offset);
    p.o_indptr = flashinfer::GetPtrFromBaseOffset<int32_t>(a.int_workspace, info.o_indptr_offset);
    p.kv_chunk_size_ptr = flashinfer::GetPtrFromBaseOffset<int32_t>(a.int_workspace, info.kv_chunk_size_ptr_offset);
    p.padded_batch_size = uint32_t(info.padded_batch_size);
    KV* tmp_v = nullptr;
    float* tmp_s = nullptr;
    if (info.split_kv) {
      tmp_v = flashinfer::GetPtrFromBaseOffset<KV>(a.float_workspace, info.v_offset);
      tmp_s = flashinfer::GetPtrFromBaseOffset<float>(a.float_workspace, info.s_offset);
    }
    cudaError_t e = flashinfer::BatchDecodeWithPagedKVCacheDispatched<D, kNoPositions, Variant, P>(
        p, tmp_v, tmp_s, /*enable_pdl=*/false, a.stream);
    if (e != cudaSuccess) return cuda_failure("BatchDecodeWithPagedKVCache", e);
    const size_t total = size_t(rows.rows) * q_elems + (rows.lse != nullptr ? size_t(rows.rows) * g.num_q_heads : 0);
    widen_output<KV><<<grid_for(total, kThreads), kThreads, 0, a.stream>>>(
        static_cast<const KV*>(rows.o16), rows.lse2, rows.row_map, rows.rows, g.num_q_heads, D, rows.out, rows.lse);
    if ((e = cudaGetLastError()) != cudaSuccess) return cuda_failure("widening its output", e);
    return "";
  } catch (const std::exception& ex) {
    return std::string("FlashInfer's batch decode: ") + ex.what();
  }
}

}  // namespace karakv::kernels::cuda::flashinfer_detail

// One (dtype, head_dim) pair's instantiation, for the generated files.
#if defined(KARAKV_FLASHINFER_KV) && defined(KARAKV_FLASHINFER_HEAD_DIM)
namespace karakv::kernels::cuda::flashinfer_detail {
template std::string plan<KARAKV_FLASHINFER_KV, KARAKV_FLASHINFER_HEAD_DIM>(const PlanArgs&, bool, size_t*, size_t*,
                                                                            std::vector<int64_t>*);
template std::string run<KARAKV_FLASHINFER_KV, KARAKV_FLASHINFER_HEAD_DIM>(const RunArgs&);
}  // namespace karakv::kernels::cuda::flashinfer_detail
#endif
