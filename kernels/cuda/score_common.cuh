// Device helpers of the scoring kernels (window_scores, snapkv_scores): softmax rows computed in
// two passes, first each query row's log-sum-exp over the keys it sees (row_lse_kernel), then per
// key the sum of exp(score - lse) over the rows that see it (score_columns_kernel). Each output is
// a sum in a fixed order, so results do not depend on scheduling.
#pragma once

#include "common.cuh"

namespace karakv::kernels::cuda {

constexpr int kScoreWarps = 4;

// log-sum-exp of q . k over keys [key_begin, key_begin + visible) of (seq, layer, head), one warp
// per row; q is scaled and lives in shared memory. Every lane returns the result.
template <typename T>
__device__ float warp_row_lse(const DeviceKV& kv, int seq, int layer, int head, const float* q, int key_begin,
                              int visible) {
  const int lane = threadIdx.x % 32;
  const T* pool = static_cast<const T*>(kv.pool);
  float m = -INFINITY, l = 0.0f;
  for (int i = lane; i < visible; i += 32) {
    const float s = dot_row(q, pool + kv.token_offset(seq, key_begin + i, layer, 0, head), kv.head_dim);
    const float m_new = fmaxf(m, s);
    l = l * expf(m - m_new) + expf(s - m_new);
    m = m_new;
  }
  for (int off = 16; off > 0; off /= 2) {
    const float m_o = __shfl_xor_sync(0xffffffffu, m, off);
    const float l_o = __shfl_xor_sync(0xffffffffu, l, off);
    const float m_new = fmaxf(m, m_o);
    if (m_new == -INFINITY) continue;
    l = (m == -INFINITY ? 0.0f : l * expf(m - m_new)) + (m_o == -INFINITY ? 0.0f : l_o * expf(m_o - m_new));
    m = m_new;
  }
  return m + logf(l);
}

// lse[qh][t] for query rows t < num_rows of every query head: row t of head qh is
// q[(t * num_q_heads + qh) * head_dim ...] and sees keys [key_begin, key_begin + visible_base + t + 1)
// when causal, else [key_begin, key_begin + visible_base). Grid (rows / kScoreWarps, num_q_heads).
template <typename T>
__global__ void row_lse_kernel(DeviceKV kv, int seq, int layer, const float* __restrict__ q, float scale,
                               int num_rows, int key_begin, int visible_base, bool causal, float* __restrict__ lse) {
  __shared__ float s_q[kScoreWarps][256];
  const int qh = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = blockIdx.x * kScoreWarps + warp;
  if (t >= num_rows) return;  // whole warps leave together
  const int hd = kv.head_dim;
  for (int d = lane; d < hd; d += 32) s_q[warp][d] = q[(size_t(t) * kv.num_q_heads + qh) * hd + d] * scale;
  __syncwarp();
  const int visible = causal ? visible_base + t + 1 : visible_base;
  const float v = warp_row_lse<T>(kv, seq, layer, qh / kv.group_size(), s_q[warp], key_begin, visible);
  if (lane == 0) lse[size_t(qh) * num_rows + t] = v;
}

// Which query rows a key's column sums (score_columns_kernel): every row; with Kara's
// later_keys_only, rows t < i (i the key's index among the scored keys); for SnapKV's observation
// rows, row t sees keys i <= prefix + t.
enum class ColumnRows : int { kAll = 0, kEarlierRows = 1, kCausalPrefix = 2 };

constexpr int kColumnKeys = 32;   // keys per CTA: one per lane
constexpr int kColumnWarps = 8;

// out[h * num_keys + i] = factor * sum over the group's query heads j and the rows t the key's
// column takes (ColumnRows) of exp(q[t][h * g + j] . k_i * scale - norm(t, j)), for keys
// [key_begin, key_begin + num_keys) of (seq, layer, KV head h); norm(t, j) is given[t][qh] where
// `given` is non-null and finite there, else lse[qh][t] (row_lse_kernel's). A CTA takes 32 keys of
// one KV head, loaded once into shared memory (padded a column: lane = key reads without bank
// conflicts); its warps take the (row, head) vectors in turn, one key per lane, and the warps'
// sums are added in a fixed order. Grid (ceil(num_keys / 32), num_kv_heads), kColumnWarps * 32
// threads, (32 * (head_dim + 1) + kColumnWarps * 32) floats of dynamic shared memory.
template <typename T>
__global__ void __launch_bounds__(kColumnWarps * 32)
    score_columns_kernel(DeviceKV kv, int seq, int layer, int key_begin, int num_keys, const float* __restrict__ q,
                         float scale, int num_rows, const float* __restrict__ lse, const float* __restrict__ given,
                         ColumnRows which, int prefix, float factor, float* __restrict__ out) {
  extern __shared__ float smem[];
  const int hd = kv.head_dim, hq = kv.num_q_heads, g = kv.group_size();
  float* k_s = smem;                                 // [kColumnKeys][hd + 1]
  float* part = smem + kColumnKeys * (hd + 1);       // [kColumnWarps][kColumnKeys]
  const int h = blockIdx.y, k0 = blockIdx.x * kColumnKeys;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const T* pool = static_cast<const T*>(kv.pool);
  for (int x = warp; x < kColumnKeys; x += kColumnWarps) {
    const int i = k0 + x;
    const T* k = i < num_keys ? pool + kv.token_offset(seq, key_begin + i, layer, 0, h) : nullptr;
    for (int d = lane; d < hd; d += 32) k_s[x * (hd + 1) + d] = k != nullptr ? to_float(k[d]) : 0.0f;
  }
  __syncthreads();
  const int i = k0 + lane;
  const float* kr = k_s + lane * (hd + 1);
  float acc = 0.0f;
  for (int v = warp; v < num_rows * g; v += kColumnWarps) {
    const int t = v / g, qh = h * g + v % g;
    const bool take = i < num_keys && (which == ColumnRows::kAll || (which == ColumnRows::kEarlierRows && t < i) ||
                                       (which == ColumnRows::kCausalPrefix && i <= prefix + t));
    if (!take) continue;  // per lane: no shuffles below
    const float* qrow = q + (size_t(t) * hq + qh) * hd;
    float s = 0.0f;
    for (int d = 0; d < hd; ++d) s = fmaf(__ldg(qrow + d) * scale, kr[d], s);
    const float g_norm = given != nullptr ? given[size_t(t) * hq + qh] : NAN;
    acc += expf(s - (isfinite(g_norm) ? g_norm : lse[size_t(qh) * num_rows + t]));
  }
  part[warp * kColumnKeys + lane] = acc;
  __syncthreads();
  if (warp == 0 && i < num_keys) {
    float sum = 0.0f;
    for (int w = 0; w < kColumnWarps; ++w) sum += part[w * kColumnKeys + lane];
    out[size_t(h) * num_keys + i] = sum * factor;
  }
}

// Launches score_columns_kernel for storage type T (the caller has checked head_dim <= 256).
template <typename T>
KernelStatus launch_score_columns(const DeviceKV& kv, int seq, int layer, int key_begin, int num_keys, const float* q,
                                  float scale, int num_rows, const float* lse, const float* given, ColumnRows which,
                                  int prefix, float factor, float* out, cudaStream_t stream, const char* name) {
  if (num_keys <= 0) return KernelStatus::ok();
  const size_t smem = (size_t(kColumnKeys) * (kv.head_dim + 1) + size_t(kColumnWarps) * kColumnKeys) * sizeof(float);
  score_columns_kernel<T><<<dim3(ceil_div(num_keys, kColumnKeys), kv.num_kv_heads), kColumnWarps * 32, smem, stream>>>(
      kv, seq, layer, key_begin, num_keys, q, scale, num_rows, lse, given, which, prefix, factor, out);
  KARAKV_CUDA_CHECK_LAUNCH(name);
  return KernelStatus::ok();
}

}  // namespace karakv::kernels::cuda
