// Device helpers of the scoring kernels (window_scores, snapkv_scores): softmax rows computed in
// two passes, first each query row's log-sum-exp over the keys it sees, then per key the sum of
// exp(score - lse) over the rows that see it. Each output is a plain sum in a fixed order, so
// results do not depend on scheduling.
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

}  // namespace karakv::kernels::cuda
