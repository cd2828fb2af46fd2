#include "attention.cuh"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

namespace karakv::kernels::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// The lanes of the token group of TPT lanes that `lane` belongs to: the shuffles of a group name
// only its own lanes, so a group with no token left may skip a step while the other works.
template <int TPT>
__device__ __forceinline__ unsigned group_mask(int lane) {
  if constexpr (TPT == 32)
    return 0xffffffffu;
  else
    return ((1u << TPT) - 1u) << (lane / TPT * TPT);
}
// Query heads per CTA: a whole group of up to 4, larger groups in chunks of 4.
constexpr int kMaxG = 4;
// Shortest span of tokens worth a split of its own.
constexpr int kMinTokensPerSplit = 128;
// Waves of CTAs the split aims for: enough that the last, partial wave is a small part of the time.
constexpr int kTargetWaves = 4;

// Lane li of a token group of TPT lanes owns elements d = (i * TPT + li) * VEC + v, i < NI.
template <int VEC, int TPT, int NI>
__device__ __forceinline__ int elem_index(int li, int e) {
  return ((e / VEC) * TPT + li) * VEC + e % VEC;
}

// A lane's share of one K or V row as stored: one 16-byte vector when a row is a power-of-two
// number of them (kept raw, converted element by element as it is used), else E elements.
template <typename T, int VEC, int NI>
inline constexpr bool kVectorRow = NI == 1 && VEC * sizeof(T) == 16;
template <typename T, int E, bool kVector>
struct RawRow;
template <typename T, int E>
struct RawRow<T, E, true> {
  uint4 x;
  __device__ __forceinline__ float at(int e) const { return to_float(reinterpret_cast<const T*>(&x)[e]); }
};
template <typename T, int E>
struct RawRow<T, E, false> {
  T x[E];
  __device__ __forceinline__ float at(int e) const { return to_float(x[e]); }
};

template <typename T, int VEC, int TPT, int NI>
__device__ __forceinline__ void load_row(const T* __restrict__ row, int li, int hd,
                                         RawRow<T, VEC * NI, kVectorRow<T, VEC, NI>>& out) {
  if constexpr (kVectorRow<T, VEC, NI>) {
    out.x = *reinterpret_cast<const uint4*>(row + li * VEC);
  } else {
#pragma unroll
    for (int e = 0; e < VEC * NI; ++e) {
      const int d = elem_index<VEC, TPT, NI>(li, e);
      out.x[e] = d < hd ? row[d] : from_float<T>(0.0f);
    }
  }
}

// Partial attention of one (row, KV head, head chunk, split). Writes per query head of the chunk
// the split's running max m, sum l and unnormalised accumulator acc[head_dim].
template <typename T, int VEC, int TPT, int NI, int G>
__global__ void __launch_bounds__(kThreads)
    partial_kernel(DeviceKV kv, int layer, int rows_seq, const int32_t* __restrict__ row_len,
                   const float* __restrict__ q, float scale, int head_chunks, int tokens_per_split, int num_splits,
                   float* __restrict__ part_ml, float* __restrict__ part_acc) {
  constexpr int TG = 32 / TPT;           // token groups per warp
  constexpr int E = VEC * NI;            // elements per lane
  constexpr int kGroups = kWarps * TG;   // token groups per CTA
  constexpr int kStep = kGroups * 2;     // tokens per CTA step: two per token group
  using Row = RawRow<T, E, kVectorRow<T, VEC, NI>>;
  __shared__ float s_m[kGroups][G];
  __shared__ float s_l[kGroups][G];
  extern __shared__ float s_acc[];       // [kGroups][G][head_dim]

  // Rows on grid.x (up to 2^31 - 1), splits on grid.z (<= 65535).
  const int r = blockIdx.x;
  const int hk = blockIdx.y / head_chunks;
  const int chunk = blockIdx.y % head_chunks;
  const int split = blockIdx.z;
  const int seq = rows_seq < 0 ? r : rows_seq;
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
  // A split past the row's end writes nothing: combine_kernel reads a row's splits only up to its
  // length (split 0 always, so an empty row still gets its -inf partial). Uniform in the CTA.
  if (split > 0 && t_begin >= len) return;

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

  // The sequence's table and this (layer, KV head)'s run inside a block, once: a token's row is
  // then one table load away.
  const T* pool = static_cast<const T*>(kv.pool);
  const int32_t* __restrict__ table = kv.block_table + (t_begin < t_end ? kv.table_offset[seq] : 0);
  const size_t k_run = kv.run_offset(0, layer, 0, hk), v_run = kv.run_offset(0, layer, 1, hk);
  auto row_of = [&](int t, size_t run) { return pool + kv.row_offset(table, t, run); };

  // Token group `group` takes tokens base + group and base + kGroups + group of each step; the loop
  // bound is uniform across the warp so every lane reaches the shuffles.
  for (int base = t_begin; base < t_end; base += kStep) {
    const int t0 = base + group, t1 = base + kGroups + group;
    const bool valid0 = t0 < t_end, valid1 = t1 < t_end;
    Row k0, v0, k1, v1;
    if (valid0) {
      load_row<T, VEC, TPT, NI>(row_of(t0, k_run), li, hd, k0);
      load_row<T, VEC, TPT, NI>(row_of(t0, v_run), li, hd, v0);
    }
    if (valid1) {
      load_row<T, VEC, TPT, NI>(row_of(t1, k_run), li, hd, k1);
      load_row<T, VEC, TPT, NI>(row_of(t1, v_run), li, hd, v1);
    }
    if (!valid0) continue;  // uniform in the token group; t1 > t0, so nothing valid either
#pragma unroll
    for (int j = 0; j < G; ++j) {
      float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        s0 = fmaf(qr[j][e], k0.at(e), s0);
        if (valid1) s1 = fmaf(qr[j][e], k1.at(e), s1);
      }
#pragma unroll
      for (int off = TPT / 2; off > 0; off /= 2) {
        s0 += __shfl_xor_sync(group_mask<TPT>(lane), s0, off, TPT);
        s1 += __shfl_xor_sync(group_mask<TPT>(lane), s1, off, TPT);
      }
      const float m_new = fmaxf(m[j], valid1 ? fmaxf(s0, s1) : s0);
      const float c = expf(m[j] - m_new);
      const float p0 = expf(s0 - m_new);
      const float p1 = valid1 ? expf(s1 - m_new) : 0.0f;
      l[j] = l[j] * c + p0 + p1;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        float a = fmaf(p0, v0.at(e), acc[j][e] * c);
        if (valid1) a = fmaf(p1, v1.at(e), a);
        acc[j][e] = a;
      }
      m[j] = m_new;
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
// Only the row's own splits (those starting before its length; split 0 for an empty row) were
// written.
__global__ void combine_kernel(int hq, int hd, int num_splits, int tokens_per_split, const int32_t* __restrict__ row_len,
                               const float* __restrict__ part_ml, const float* __restrict__ part_acc,
                               float* __restrict__ out, float* __restrict__ lse) {
  const int r = blockIdx.x, h = blockIdx.y;
  const size_t base = (size_t(r) * hq + h) * num_splits;
  const int len = row_len[r];
  num_splits = len <= 0 ? 1 : min(num_splits, (len + tokens_per_split - 1) / tokens_per_split);
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

// CTAs of `kernel` one SM holds at once with `threads` threads and `smem` bytes of dynamic shared
// memory (opted in above 48 KiB), asked of the runtime once per device, kernel and size: every
// layer of every step launches the same few.
KernelStatus ctas_per_sm(const void* kernel, int threads, size_t smem, int* out) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, size_t>, int> cache;
  // The dynamic shared memory each (device, kernel) is opted in to. Only ever raised: a cached
  // size's launches rely on the opt-in made when that size was first seen, and the attribute sets
  // the limit to exactly the size asked (a smaller size after a larger one would lower it).
  static std::map<std::pair<int, const void*>, size_t> opted_in;
  int device = 0;
  KARAKV_CUDA_RETURN_IF_ERROR_IN("attention", "cudaGetDevice", cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(device, kernel, smem);
  if (auto it = cache.find(key); it != cache.end()) {
    *out = it->second;
    return KernelStatus::ok();
  }
  // Hopper and Ampere give up to 227 / 163 KiB per CTA when asked.
  if (size_t& opted = opted_in[{device, kernel}]; smem > 48 * 1024 && smem > opted) {
    KARAKV_CUDA_RETURN_IF_ERROR_IN("attention", "cudaFuncSetAttribute of the dynamic shared memory",
                                   cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    opted = smem;
  }
  KARAKV_CUDA_RETURN_IF_ERROR_IN("attention", "cudaOccupancyMaxActiveBlocksPerMultiprocessor",
                                 cudaOccupancyMaxActiveBlocksPerMultiprocessor(out, kernel, threads, smem));
  cache[key] = *out;
  return KernelStatus::ok();
}

// How the rows are split along the sequence, and the scratch the splits write.
struct SplitPlan {
  int num_splits = 1, tokens_per_split = 1;
  float* part_ml = nullptr;
  float* part_acc = nullptr;
};

// Partials the splits may write at most: past it the splits grow longer (and fewer).
constexpr size_t kMaxSplitScratch = size_t(256) << 20;

// Splits of equal length spreading the work (the rows' total length over rows_per_cta, 1 for the
// row kernel and a tile for the tiled one, times KV heads and head chunks) over kTargetWaves waves
// of what the SMs hold at once (ctas_per_sm from the occupancy calculator): at least
// kMinTokensPerSplit keys and a multiple of `multiple`, at most 65535 splits, partials (all rows x
// query heads x splits) within kMaxSplitScratch; then the partials' scratch. A short row's later
// splits exit at once (combine_kernel reads a row's splits only up to its length), a long row gets
// as many as its length needs.
KernelStatus plan_splits(const DeviceKV& kv, const AttentionRows& rows, int rows_per_cta, int head_chunks,
                         int num_sms, int ctas_per_sm, int multiple, Arena& arena, SplitPlan* plan) {
  const long long work =
      (std::max<long long>(rows.total_len, 1) + rows_per_cta - 1) / rows_per_cta * kv.num_kv_heads * head_chunks;
  const long long slots = (long long)std::max(num_sms, 1) * std::max(ctas_per_sm, 1);
  const int max_len = std::max(rows.max_len, 1);
  const size_t per_split = size_t(rows.num_rows) * kv.num_q_heads * (size_t(kv.head_dim) + 2) * sizeof(float);
  long long tokens = (work + slots * kTargetWaves - 1) / (slots * kTargetWaves);
  tokens = std::max<long long>({tokens, kMinTokensPerSplit, (max_len + 65534) / 65535});
  while (true) {
    tokens = (tokens + multiple - 1) / multiple * multiple;
    const long long splits = (max_len + tokens - 1) / tokens;
    if (splits <= 1 || size_t(splits) * per_split <= kMaxSplitScratch) break;
    tokens *= 2;
  }
  plan->tokens_per_split = int(std::min<long long>(tokens, (max_len + multiple - 1) / multiple * multiple));
  plan->num_splits = ceil_div(max_len, plan->tokens_per_split);
  const size_t slots_out = size_t(rows.num_rows) * kv.num_q_heads * plan->num_splits;
  if (auto st = arena.take(slots_out * 2, &plan->part_ml); !st.is_ok()) return st;
  return arena.take(slots_out * kv.head_dim, &plan->part_acc);
}

template <typename T, int VEC, int TPT, int NI, int G>
KernelStatus launch_partial(const DeviceKV& kv, int layer, const AttentionRows& rows, const float* q, float scale,
                            int num_sms, Arena& arena, cudaStream_t stream, SplitPlan* plan) {
  constexpr int kGroups = kWarps * (32 / TPT);
  const int head_chunks = ceil_div(kv.group_size(), G);
  const size_t smem = size_t(kGroups) * G * kv.head_dim * sizeof(float);
  auto kernel = partial_kernel<T, VEC, TPT, NI, G>;
  int ctas = 0;
  if (auto st = ctas_per_sm(reinterpret_cast<const void*>(kernel), kThreads, smem, &ctas); !st.is_ok()) return st;
  if (auto st = plan_splits(kv, rows, 1, head_chunks, num_sms, ctas, 1, arena, plan); !st.is_ok()) return st;
  const dim3 grid(rows.num_rows, kv.num_kv_heads * head_chunks, plan->num_splits);
  kernel<<<grid, kThreads, smem, stream>>>(kv, layer, rows.seq, rows.row_len, q, scale, head_chunks,
                                           plan->tokens_per_split, plan->num_splits, plan->part_ml, plan->part_acc);
  KARAKV_CUDA_CHECK_LAUNCH("paged_attention partial");
  return KernelStatus::ok();
}

// Picks the lane layout for the head dim: 16-byte vectors when a row is a power-of-two number of
// them (head_dim 64 and 128), else one element per lane over a whole warp (head_dim <= 256).
template <typename T, int G>
KernelStatus launch_for_head_dim(const DeviceKV& kv, int layer, const AttentionRows& rows, const float* q,
                                 float scale, int num_sms, Arena& arena, cudaStream_t stream, SplitPlan* plan) {
  constexpr int VEC = 16 / sizeof(T);
  return common::dispatch_head_dim(kv.head_dim, [&](auto head_dim) {
    constexpr int HD = decltype(head_dim)::value;  // 64, 128, or 0 for any other
    if constexpr (HD == 0)
      return launch_partial<T, 1, 32, kMaxHeadDim / 32, G>(kv, layer, rows, q, scale, num_sms, arena, stream, plan);
    else
      return launch_partial<T, VEC, HD / VEC, 1, G>(kv, layer, rows, q, scale, num_sms, arena, stream, plan);
  });
}

// Calls f(std::integral_constant<int, G>{}) with the query heads per CTA as a compile-time
// constant: the whole group when it has up to kMaxG heads (a group of 3 pays for 3, not 4), else
// chunks of kMaxG.
template <typename F>
KernelStatus dispatch_group(int group_size, F&& f) {
  switch (std::min(group_size, kMaxG)) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, kMaxG>{});
  }
}

// ---- Causal attention over many query rows of one sequence (prefill through Attend): tiles of
// tile_rows(G) rows (32 query vectors: rows times the chunk's query heads) share each K/V tile,
// read once into shared memory, instead of every row streaming its whole prefix
// (FlashAttention-style). A CTA takes one tile of rows, one (KV head, head chunk)
// and one split of the keys, and writes the same partials as partial_kernel, so combine_kernel
// merges the splits.
// Query rows per CTA for G query heads per chunk: 32 query vectors (30 for G = 3), four per warp.
constexpr int tile_rows(int G) { return G >= 4 ? 8 : G == 3 ? 10 : 32 / G; }
// Rows from which causal attention takes the tiled kernel.
constexpr int kMinTiledRows = 16;
constexpr int kTileKeys = 32;    // keys per K/V tile: one per lane when scoring
constexpr int kTileWarps = 8;
constexpr int kTileThreads = kTileWarps * 32;

// Shared memory of tiled_causal_kernel: the tile's scaled queries [tile_rows(G) * G][hd], the keys
// [kTileKeys][hd + 1] (padded: lane = key reads a column without bank conflicts) and the values
// [kTileKeys][hd], all fp32.
inline size_t tiled_smem_bytes(int G, int hd) {
  return (size_t(tile_rows(G)) * G * hd + size_t(kTileKeys) * (hd + 1) + size_t(kTileKeys) * hd) * sizeof(float);
}

// Vector v = i * G + j of the tile is row tile * tile_rows(G) + i, query head j of the chunk; warp w
// owns vectors w, w + kTileWarps, ... (VPW of them); lane owns dims lane + 32 x, x < DPL.
template <typename T, int G, int DPL>
__global__ void __launch_bounds__(kTileThreads)
    tiled_causal_kernel(DeviceKV kv, int layer, int seq, const int32_t* __restrict__ row_len, int num_rows,
                        const float* __restrict__ q, float scale, int head_chunks, int tokens_per_split,
                        int num_splits, float* __restrict__ part_ml, float* __restrict__ part_acc) {
  constexpr int QT = tile_rows(G);
  constexpr int NV = QT * G;
  constexpr int VEC = 16 / int(sizeof(T));  // elements per 16-byte load of the K/V tile
  constexpr int VPW = (NV + kTileWarps - 1) / kTileWarps;
  extern __shared__ float smem[];
  const int hd = kv.head_dim, hq = kv.num_q_heads, g = kv.group_size();
  float* q_s = smem;                                   // [NV][hd]
  float* k_s = q_s + size_t(NV) * hd;                  // [kTileKeys][hd + 1]
  float* v_s = k_s + size_t(kTileKeys) * (hd + 1);     // [kTileKeys][hd]

  const int tile = blockIdx.x;
  const int hk = blockIdx.y / head_chunks, chunk = blockIdx.y % head_chunks;
  const int split = blockIdx.z;
  const int head0 = chunk * G;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int r0 = tile * QT;

  // The tile's longest row bounds the keys any of its rows sees.
  int tile_len = 0;
  for (int i = 0; i < QT && r0 + i < num_rows; ++i) tile_len = max(tile_len, row_len[r0 + i]);
  const int k_begin = split * tokens_per_split;
  const int k_end = min(tile_len, k_begin + tokens_per_split);
  // A split past the tile's rows has nothing to write: combine_kernel reads a row's splits only up
  // to its length (split 0 always, so an empty row still gets its -inf partial).
  if (split > 0 && k_begin >= tile_len) return;

  for (int idx = threadIdx.x; idx < NV * hd; idx += kTileThreads) {
    const int v = idx / hd, d = idx % hd;
    const int r = r0 + v / G, j = v % G;
    q_s[idx] = r < num_rows && head0 + j < g ? q[(size_t(r) * hq + hk * g + head0 + j) * hd + d] * scale : 0.0f;
  }

  float acc[VPW][DPL], m[VPW], l[VPW];
  int limit[VPW];  // keys [0, limit) are visible to the vector's row (0: not a row of this call)
#pragma unroll
  for (int x = 0; x < VPW; ++x) {
    const int v = warp + x * kTileWarps;
    const int r = r0 + v / G;
    limit[x] = v < NV && r < num_rows && head0 + v % G < g ? row_len[r] : 0;
    m[x] = -INFINITY;
    l[x] = 0.0f;
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[x][e] = 0.0f;
  }

  const T* pool = static_cast<const T*>(kv.pool);
  const int32_t* __restrict__ table = kv.block_table + (k_begin < k_end ? kv.table_offset[seq] : 0);
  const size_t k_run = kv.run_offset(0, layer, 0, hk), v_run = kv.run_offset(0, layer, 1, hk);
  for (int kt = k_begin; kt < k_end; kt += kTileKeys) {
    __syncthreads();  // the previous tile is no longer read (and, the first time, q_s is written)
    if (hd % VEC == 0) {
      // 16-byte chunks: chunk c is part c % cpr of key c / cpr (rows start at multiples of head_dim
      // elements, so every chunk is aligned); keys past k_end are zeros.
      const int cpr = hd / VEC;
      for (int c = threadIdx.x; c < kTileKeys * cpr; c += kTileThreads) {
        const int i = c / cpr, d0 = (c - i * cpr) * VEC;
        const int t = kt + i;
        uint4 kr = {0u, 0u, 0u, 0u}, vr = {0u, 0u, 0u, 0u};
        if (t < k_end) {
          kr = *reinterpret_cast<const uint4*>(pool + kv.row_offset(table, t, k_run) + d0);
          vr = *reinterpret_cast<const uint4*>(pool + kv.row_offset(table, t, v_run) + d0);
        }
        const T* ke = reinterpret_cast<const T*>(&kr);
        const T* ve = reinterpret_cast<const T*>(&vr);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          k_s[i * (hd + 1) + d0 + e] = t < k_end ? to_float(ke[e]) : 0.0f;
          v_s[i * hd + d0 + e] = t < k_end ? to_float(ve[e]) : 0.0f;
        }
      }
    } else {
      // Warp w loads keys w, w + 8, ...: one row per warp at a time, lanes along head_dim.
      for (int i = warp; i < kTileKeys; i += kTileWarps) {
        const int t = kt + i;
        const T* kr = t < k_end ? pool + kv.row_offset(table, t, k_run) : nullptr;
        const T* vr = t < k_end ? pool + kv.row_offset(table, t, v_run) : nullptr;
        for (int d = lane; d < hd; d += 32) {
          k_s[i * (hd + 1) + d] = kr != nullptr ? to_float(kr[d]) : 0.0f;
          v_s[i * hd + d] = vr != nullptr ? to_float(vr[d]) : 0.0f;
        }
      }
    }
    __syncthreads();
    const int key = kt + lane;
#pragma unroll
    for (int x = 0; x < VPW; ++x) {
      if (kt >= limit[x]) continue;  // uniform in the warp: the row sees none of this tile
      const int v = warp + x * kTileWarps;
      const float* qv = q_s + size_t(v) * hd;
      const float* kr = k_s + lane * (hd + 1);
      // Four independent sums: a chain of head_dim dependent FMAs would leave the pipes idle.
      float s4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      int d = 0;
      for (; d + 4 <= hd; d += 4) {
#pragma unroll
        for (int u = 0; u < 4; ++u) s4[u] = fmaf(qv[d + u], kr[d + u], s4[u]);
      }
      for (; d < hd; ++d) s4[0] = fmaf(qv[d], kr[d], s4[0]);
      float s = (s4[0] + s4[1]) + (s4[2] + s4[3]);
      if (key >= limit[x] || key >= k_end) s = -INFINITY;
      float mt = s;
      for (int off = 16; off > 0; off /= 2) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, off));
      const float m_new = fmaxf(m[x], mt);  // finite: key kt is visible to this row
      const float p = expf(s - m_new);
      float ps = p;
      for (int off = 16; off > 0; off /= 2) ps += __shfl_xor_sync(0xffffffffu, ps, off);
      const float c = expf(m[x] - m_new);
      l[x] = l[x] * c + ps;
#pragma unroll
      for (int e = 0; e < DPL; ++e) acc[x][e] *= c;
      for (int k = 0; k < kTileKeys; ++k) {
        const float pk = __shfl_sync(0xffffffffu, p, k);
#pragma unroll
        for (int e = 0; e < DPL; ++e) {
          const int d = lane + 32 * e;
          if (d < hd) acc[x][e] = fmaf(pk, v_s[k * hd + d], acc[x][e]);
        }
      }
      m[x] = m_new;
    }
  }

#pragma unroll
  for (int x = 0; x < VPW; ++x) {
    const int v = warp + x * kTileWarps;
    const int r = r0 + v / G, j = v % G;
    if (v >= NV || r >= num_rows || head0 + j >= g) continue;
    const size_t slot = (size_t(r) * hq + hk * g + head0 + j) * num_splits + split;
#pragma unroll
    for (int e = 0; e < DPL; ++e) {
      const int d = lane + 32 * e;
      if (d < hd) part_acc[slot * hd + d] = acc[x][e];
    }
    if (lane == 0) {
      part_ml[slot * 2] = m[x];
      part_ml[slot * 2 + 1] = l[x];
    }
  }
}

template <typename T, int G, int DPL>
KernelStatus launch_tiled_as(const DeviceKV& kv, int layer, const AttentionRows& rows, const float* q, float scale,
                             int num_sms, Arena& arena, cudaStream_t stream, SplitPlan* plan) {
  const int head_chunks = ceil_div(kv.group_size(), G);
  const size_t smem = tiled_smem_bytes(G, kv.head_dim);
  auto kernel = tiled_causal_kernel<T, G, DPL>;
  int ctas = 0;
  if (auto st = ctas_per_sm(reinterpret_cast<const void*>(kernel), kTileThreads, smem, &ctas); !st.is_ok()) return st;
  // Split lengths in whole K/V tiles.
  if (auto st = plan_splits(kv, rows, tile_rows(G), head_chunks, num_sms, ctas, kTileKeys, arena, plan);
      !st.is_ok())
    return st;
  const dim3 grid(ceil_div(rows.num_rows, tile_rows(G)), kv.num_kv_heads * head_chunks, plan->num_splits);
  kernel<<<grid, kTileThreads, smem, stream>>>(kv, layer, rows.seq, rows.row_len, rows.num_rows, q, scale,
                                               head_chunks, plan->tokens_per_split, plan->num_splits, plan->part_ml,
                                               plan->part_acc);
  KARAKV_CUDA_CHECK_LAUNCH("causal attention tiled");
  return KernelStatus::ok();
}

template <typename T, int G>
KernelStatus launch_tiled_for_head_dim(const DeviceKV& kv, int layer, const AttentionRows& rows, const float* q,
                                       float scale, int num_sms, Arena& arena, cudaStream_t stream, SplitPlan* plan) {
  if (kv.head_dim <= 64) return launch_tiled_as<T, G, 2>(kv, layer, rows, q, scale, num_sms, arena, stream, plan);
  if (kv.head_dim <= 128) return launch_tiled_as<T, G, 4>(kv, layer, rows, q, scale, num_sms, arena, stream, plan);
  return launch_tiled_as<T, G, kMaxHeadDim / 32>(kv, layer, rows, q, scale, num_sms, arena, stream, plan);
}

// Probabilities for H2O and Kara's decode observers: one CTA per (sequence, KV head), one thread
// per accumulated slot; the group's queries sit in shared memory.
template <typename T>
__global__ void probabilities_kernel(DeviceKV kv, int layer, const float* __restrict__ q, float scale,
                                     const float* __restrict__ lse, const int32_t* __restrict__ first,
                                     const int64_t* __restrict__ prob_offset, float* __restrict__ probs,
                                     float* const* __restrict__ acc) {
  extern __shared__ float s_q[];  // [group][head_dim], scaled
  const int s = blockIdx.x, hk = blockIdx.y;
  const int g = kv.group_size(), hd = kv.head_dim, hq = kv.num_q_heads;
  const int begin = first[s];
  const int n = kv.seq_len[s] - begin;
  float* const dst = acc != nullptr ? acc[size_t(s) * kv.num_kv_heads + hk] : nullptr;
  const int64_t offset = prob_offset[s];
  // The whole CTA: nothing of this (sequence, head) is added or goes back.
  if (n <= 0 || (dst == nullptr && offset < 0)) return;
  for (int i = threadIdx.x; i < g * hd; i += blockDim.x)
    s_q[i] = q[(size_t(s) * hq + hk * g) * hd + i] * scale;
  __syncthreads();
  const T* pool = static_cast<const T*>(kv.pool);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const T* k = pool + kv.token_offset(s, begin + i, layer, 0, hk);
    float p = 0.0f;
    for (int j = 0; j < g; ++j) p += expf(dot_row(s_q + j * hd, k, hd) - lse[size_t(s) * hq + hk * g + j]);
    if (dst != nullptr) {
      dst[begin + i] += p;  // one CTA per (sequence, head): no other thread adds to this slot
    } else {
      probs[offset + size_t(hk) * n + i] = p;
    }
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
  SplitPlan plan;
  // Many rows of one sequence (causal attention, prefill): tiles of rows share their K/V reads.
  const bool tiled = rows.seq >= 0 && rows.num_rows >= kMinTiledRows;
  KernelStatus st = common::dispatch_dtype(dtype, [&](auto tag) {
    using T = storage_t<decltype(tag)::value>;
    return dispatch_group(kv.group_size(), [&](auto group) {
      constexpr int G = decltype(group)::value;
      return tiled ? launch_tiled_for_head_dim<T, G>(kv, layer, rows, q, scale, num_sms, arena, stream, &plan)
                   : launch_for_head_dim<T, G>(kv, layer, rows, q, scale, num_sms, arena, stream, &plan);
    });
  });
  if (!st.is_ok()) return st;
  const dim3 grid(rows.num_rows, kv.num_q_heads);
  combine_kernel<<<grid, std::min(kv.head_dim, 256), 0, stream>>>(kv.num_q_heads, kv.head_dim, plan.num_splits,
                                                                   plan.tokens_per_split, rows.row_len, plan.part_ml,
                                                                   plan.part_acc, out, lse);
  KARAKV_CUDA_CHECK_LAUNCH("paged_attention combine");
  return KernelStatus::ok();
}

KernelStatus launch_attention_probabilities(const DeviceKV& kv, DType dtype, int layer, const float* q, float scale,
                                            const float* lse, const int32_t* first, const int64_t* prob_offset,
                                            float* probs, float* const* acc, cudaStream_t stream) {
  if (kv.num_seqs == 0) return KernelStatus::ok();
  const dim3 grid(kv.num_seqs, kv.num_kv_heads);
  const size_t smem = size_t(kv.group_size()) * kv.head_dim * sizeof(float);
  return common::dispatch_dtype(dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    if (smem > 48 * 1024)  // a large group's queries: opt in to more shared memory (Hopper: up to 227 KB)
      KARAKV_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(probabilities_kernel<storage_t<D>>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    probabilities_kernel<storage_t<D>><<<grid, 256, smem, stream>>>(kv, layer, q, scale, lse, first, prob_offset,
                                                                        probs, acc);
    KARAKV_CUDA_CHECK_LAUNCH("attention probabilities");
    return KernelStatus::ok();
  });
}

}  // namespace karakv::kernels::cuda
