#include "attention.cuh"

#include <algorithm>
#include <cmath>

namespace karakv::kernels::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Query heads per CTA: a whole group of up to 4 (or one), larger groups in chunks of 4.
constexpr int kMaxG = 4;
// Shortest span of tokens worth a split of its own.
constexpr int kMinTokensPerSplit = 128;

// Lane li of a token group of TPT lanes owns elements d = (i * TPT + li) * VEC + v, i < NI.
template <int VEC, int TPT, int NI>
__device__ __forceinline__ int elem_index(int li, int e) {
  return ((e / VEC) * TPT + li) * VEC + e % VEC;
}

template <typename T, int VEC, int TPT, int NI>
__device__ __forceinline__ void load_row(const T* __restrict__ row, int li, int hd, float (&out)[VEC * NI]) {
  if constexpr (NI == 1 && VEC * sizeof(T) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(row + li * VEC);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int v = 0; v < VEC; ++v) out[v] = to_float(e[v]);
  } else {
#pragma unroll
    for (int e = 0; e < VEC * NI; ++e) {
      const int d = elem_index<VEC, TPT, NI>(li, e);
      out[e] = d < hd ? to_float(row[d]) : 0.0f;
    }
  }
}

// Partial attention of one (row, KV head, head chunk, split). Writes per query head of the chunk
// the split's running max m, sum l and unnormalised accumulator acc[head_dim].
template <typename T, int VEC, int TPT, int NI, int G>
__global__ void __launch_bounds__(kThreads)
    partial_kernel(DeviceKV kv, int layer, const int32_t* __restrict__ row_seq, const int32_t* __restrict__ row_len,
                   const float* __restrict__ q, float scale, int head_chunks, int tokens_per_split, int num_splits,
                   float* __restrict__ part_ml, float* __restrict__ part_acc) {
  constexpr int TG = 32 / TPT;           // token groups per warp
  constexpr int E = VEC * NI;            // elements per lane
  constexpr int kGroups = kWarps * TG;   // token groups per CTA
  __shared__ float s_m[kGroups][G];
  __shared__ float s_l[kGroups][G];
  extern __shared__ float s_acc[];       // [kGroups][G][head_dim]

  // Rows on grid.x (up to 2^31 - 1), splits on grid.z (<= 65535 of >= 128 tokens each).
  const int r = blockIdx.x;
  const int hk = blockIdx.y / head_chunks;
  const int chunk = blockIdx.y % head_chunks;
  const int split = blockIdx.z;
  const int seq = row_seq[r];
  const int len = row_len[r];
  const int g = kv.group_size();
  const int hd = kv.head_dim;
  const int hq = kv.num_q_heads;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int gi = lane / TPT, li = lane % TPT;
  const int group = warp * TG + gi;
  const int t_begin = split * tokens_per_split;
  const int t_end = min(len, t_begin + tokens_per_split);
  const int head0 = chunk * G;  // first query head of the chunk inside the group

  float qr[G][E], acc[G][E], m[G], l[G];
#pragma unroll
  for (int j = 0; j < G; ++j) {
    const bool valid = head0 + j < g;
    const float* qrow = q + (size_t(r) * hq + hk * g + head0 + j) * hd;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int d = elem_index<VEC, TPT, NI>(li, e);
      qr[j][e] = valid && d < hd ? qrow[d] * scale : 0.0f;
      acc[j][e] = 0.0f;
    }
    m[j] = -INFINITY;
    l[j] = 0.0f;
  }

  const T* pool = static_cast<const T*>(kv.pool);
  // The loop bound is uniform across the warp so every lane reaches the shuffles.
  for (int base = t_begin + warp * TG; base < t_end; base += kWarps * TG) {
    const int t = base + gi;
    const bool valid = t < t_end;
    float kf[E], vf[E];
    if (valid) {
      load_row<T, VEC, TPT, NI>(pool + kv.token_offset(seq, t, layer, 0, hk), li, hd, kf);
      load_row<T, VEC, TPT, NI>(pool + kv.token_offset(seq, t, layer, 1, hk), li, hd, vf);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) kf[e] = vf[e] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < G; ++j) {
      float s = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) s = fmaf(qr[j][e], kf[e], s);
#pragma unroll
      for (int off = TPT / 2; off > 0; off /= 2) s += __shfl_xor_sync(kFullMask, s, off);
      if (valid) {
        const float m_new = fmaxf(m[j], s);
        const float c = expf(m[j] - m_new);
        const float p = expf(s - m_new);
        l[j] = l[j] * c + p;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[j][e] = fmaf(p, vf[e], acc[j][e] * c);
        m[j] = m_new;
      }
    }
  }

  // Merge the token groups of the CTA.
#pragma unroll
  for (int j = 0; j < G; ++j) {
    if (li == 0) {
      s_m[group][j] = m[j];
      s_l[group][j] = l[j];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int d = elem_index<VEC, TPT, NI>(li, e);
      if (d < hd) s_acc[(size_t(group) * G + j) * hd + d] = acc[j][e];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * hd; idx += kThreads) {
    const int j = idx / hd, d = idx % hd;
    if (head0 + j >= g) continue;
    float mx = -INFINITY;
    for (int x = 0; x < kGroups; ++x) mx = fmaxf(mx, s_m[x][j]);
    float lsum = 0.0f, a = 0.0f;
    if (mx != -INFINITY) {
      for (int x = 0; x < kGroups; ++x) {
        if (s_m[x][j] == -INFINITY) continue;
        const float c = expf(s_m[x][j] - mx);
        lsum += s_l[x][j] * c;
        a += s_acc[(size_t(x) * G + j) * hd + d] * c;
      }
    }
    const size_t slot = (size_t(r) * hq + hk * g + head0 + j) * num_splits + split;
    part_acc[slot * hd + d] = a;
    if (d == 0) {
      part_ml[slot * 2] = mx;
      part_ml[slot * 2 + 1] = lsum;
    }
  }
}

// Merges the splits of one (row, query head): out = sum acc_i e^(m_i - M) / sum l_i e^(m_i - M).
__global__ void combine_kernel(int hq, int hd, int num_splits, const float* __restrict__ part_ml,
                               const float* __restrict__ part_acc, float* __restrict__ out, float* __restrict__ lse) {
  const int r = blockIdx.x, h = blockIdx.y;
  const size_t base = (size_t(r) * hq + h) * num_splits;
  float mx = -INFINITY;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, part_ml[(base + s) * 2]);
  float lsum = 0.0f;
  if (mx != -INFINITY)
    for (int s = 0; s < num_splits; ++s) {
      const float m = part_ml[(base + s) * 2];
      if (m != -INFINITY) lsum += part_ml[(base + s) * 2 + 1] * expf(m - mx);
    }
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float a = 0.0f;
    if (mx != -INFINITY)
      for (int s = 0; s < num_splits; ++s) {
        const float m = part_ml[(base + s) * 2];
        if (m != -INFINITY) a += part_acc[(base + s) * hd + d] * expf(m - mx);
      }
    out[(size_t(r) * hq + h) * hd + d] = lsum > 0.0f ? a / lsum : 0.0f;
  }
  if (lse != nullptr && threadIdx.x == 0) lse[size_t(r) * hq + h] = mx == -INFINITY ? -INFINITY : mx + logf(lsum);
}

template <typename T, int VEC, int TPT, int NI, int G>
KernelStatus launch_partial(const DeviceKV& kv, int layer, const AttentionRows& rows, const float* q, float scale,
                            int head_chunks, int tokens_per_split, int num_splits, float* part_ml, float* part_acc,
                            cudaStream_t stream) {
  constexpr int kGroups = kWarps * (32 / TPT);
  const size_t smem = size_t(kGroups) * G * kv.head_dim * sizeof(float);
  const dim3 grid(rows.num_rows, kv.num_kv_heads * head_chunks, num_splits);
  partial_kernel<T, VEC, TPT, NI, G><<<grid, kThreads, smem, stream>>>(
      kv, layer, rows.row_seq, rows.row_len, q, scale, head_chunks, tokens_per_split, num_splits, part_ml, part_acc);
  KARAKV_CUDA_CHECK_LAUNCH("paged_attention partial");
  return KernelStatus::ok();
}

// Picks the lane layout for the head dim: 16-byte vectors when a row is a power-of-two number of
// them (head_dim 64 and 128), else one element per lane over a whole warp (head_dim <= 256).
template <typename T, int G>
KernelStatus launch_for_head_dim(const DeviceKV& kv, int layer, const AttentionRows& rows, const float* q,
                                 float scale, int head_chunks, int tokens_per_split, int num_splits, float* part_ml,
                                 float* part_acc, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  return common::dispatch_head_dim(kv.head_dim, [&](auto head_dim) {
    constexpr int HD = decltype(head_dim)::value;  // 64, 128, or 0 for any other
    if constexpr (HD == 0)
      return launch_partial<T, 1, 32, kMaxHeadDim / 32, G>(kv, layer, rows, q, scale, head_chunks, tokens_per_split,
                                                           num_splits, part_ml, part_acc, stream);
    else
      return launch_partial<T, VEC, HD / VEC, 1, G>(kv, layer, rows, q, scale, head_chunks, tokens_per_split,
                                                    num_splits, part_ml, part_acc, stream);
  });
}

// Probabilities for H2O: one CTA per (sequence, KV head), one thread per token; the group's
// queries sit in shared memory.
template <typename T>
__global__ void probabilities_kernel(DeviceKV kv, int layer, const float* __restrict__ q, float scale,
                                     const float* __restrict__ lse, const int64_t* __restrict__ prob_offset,
                                     float* __restrict__ probs) {
  extern __shared__ float s_q[];  // [group][head_dim], scaled
  const int s = blockIdx.x, hk = blockIdx.y;
  const int g = kv.group_size(), hd = kv.head_dim, hq = kv.num_q_heads;
  const int len = kv.seq_len[s];
  for (int i = threadIdx.x; i < g * hd; i += blockDim.x)
    s_q[i] = q[(size_t(s) * hq + hk * g) * hd + i] * scale;
  __syncthreads();
  const T* pool = static_cast<const T*>(kv.pool);
  for (int t = threadIdx.x; t < len; t += blockDim.x) {
    const T* k = pool + kv.token_offset(s, t, layer, 0, hk);
    float p = 0.0f;
    for (int j = 0; j < g; ++j) p += expf(dot_row(s_q + j * hd, k, hd) - lse[size_t(s) * hq + hk * g + j]);
    probs[prob_offset[s] + size_t(hk) * len + t] = p;
  }
}

}  // namespace

KernelStatus launch_paged_attention(const DeviceKV& kv, DType dtype, int layer, const AttentionRows& rows,
                                    const float* q, float* out, float scale, float* lse, int num_sms, Arena& arena,
                                    cudaStream_t stream) {
  if (rows.num_rows == 0) return KernelStatus::ok();
  if (kv.head_dim > kMaxHeadDim)
    return KernelStatus::invalid("cuda attention: head_dim " + std::to_string(kv.head_dim) + " exceeds " +
                                 std::to_string(kMaxHeadDim));
  const int g = kv.group_size();
  const int G = g == 1 ? 1 : kMaxG;
  const int head_chunks = ceil_div(g, G);
  // Enough CTAs for a few waves over the SMs, but no split shorter than kMinTokensPerSplit.
  const long long base_ctas = (long long)rows.num_rows * kv.num_kv_heads * head_chunks;
  const int max_splits = std::max(1, ceil_div(std::max(rows.max_len, 1), kMinTokensPerSplit));
  const int want = int(std::max<long long>(1, (4LL * num_sms + base_ctas - 1) / base_ctas));
  const int num_splits = std::min({max_splits, want, 65535});
  const int tokens_per_split = std::max(1, ceil_div(std::max(rows.max_len, 1), num_splits));

  const size_t slots = size_t(rows.num_rows) * kv.num_q_heads * num_splits;
  float *part_ml = nullptr, *part_acc = nullptr;
  if (auto st = arena.take(slots * 2, &part_ml); !st.is_ok()) return st;
  if (auto st = arena.take(slots * kv.head_dim, &part_acc); !st.is_ok()) return st;

  KernelStatus st = common::dispatch_dtype(dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    using T = storage_t<D>;
    return G == 1 ? launch_for_head_dim<T, 1>(kv, layer, rows, q, scale, head_chunks, tokens_per_split, num_splits,
                                              part_ml, part_acc, stream)
                  : launch_for_head_dim<T, kMaxG>(kv, layer, rows, q, scale, head_chunks, tokens_per_split,
                                                  num_splits, part_ml, part_acc, stream);
  });
  if (!st.is_ok()) return st;
  const dim3 grid(rows.num_rows, kv.num_q_heads);
  combine_kernel<<<grid, std::min(kv.head_dim, 256), 0, stream>>>(kv.num_q_heads, kv.head_dim, num_splits, part_ml,
                                                                   part_acc, out, lse);
  KARAKV_CUDA_CHECK_LAUNCH("paged_attention combine");
  return KernelStatus::ok();
}

KernelStatus launch_attention_probabilities(const DeviceKV& kv, DType dtype, int layer, const float* q, float scale,
                                            const float* lse, const int64_t* prob_offset, float* probs,
                                            cudaStream_t stream) {
  if (kv.num_seqs == 0) return KernelStatus::ok();
  const dim3 grid(kv.num_seqs, kv.num_kv_heads);
  const size_t smem = size_t(kv.group_size()) * kv.head_dim * sizeof(float);
  return common::dispatch_dtype(dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    if (smem > 48 * 1024)  // a large group's queries: opt in to more shared memory (Hopper: up to 227 KB)
      KARAKV_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(probabilities_kernel<storage_t<D>>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    probabilities_kernel<storage_t<D>><<<grid, 256, smem, stream>>>(kv, layer, q, scale, lse, prob_offset, probs);
    KARAKV_CUDA_CHECK_LAUNCH("attention probabilities");
    return KernelStatus::ok();
  });
}

}  // namespace karakv::kernels::cuda
