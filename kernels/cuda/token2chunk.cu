#include "token2chunk.cuh"

namespace karakv::kernels::cuda {
namespace {

constexpr int kThreads = 512;

__device__ __forceinline__ bool better(const float* s, int a, int b) {
  return s[a] > s[b] || (s[a] == s[b] && a < b);
}

// Scratch (device, n entries each): kept flags, candidate list, chunk left ends, chunk scores and
// chunk order.
__global__ void __launch_bounds__(kThreads)
    token2chunk_kernel(const float* __restrict__ scores, int n, int budget, int num_candidates, int max_gap,
                       uint8_t* kept, int32_t* cand, int32_t* chunk_left, int32_t* chunk_right, float* chunk_score,
                       int32_t* chunk_order, int32_t* out) {
  __shared__ int s_num_chunks, s_count;
  // 1. Candidates: rank < num_candidates.
  for (int i = threadIdx.x; i < n; i += kThreads) {
    int rank = 0;
    for (int j = 0; j < n && rank < num_candidates; ++j) rank += better(scores, j, i);
    kept[i] = rank < num_candidates;
  }
  __syncthreads();
  // 2. Candidate list ascending and the chunks between neighbours with 1..max_gap interior tokens.
  if (threadIdx.x == 0) {
    int c = 0;
    for (int i = 0; i < n; ++i)
      if (kept[i]) cand[c++] = i;
    int chunks = 0;
    for (int m = 0; m + 1 < c; ++m) {
      const int gap = cand[m + 1] - cand[m] - 1;
      if (gap >= 1 && gap <= max_gap) {
        chunk_left[chunks] = cand[m];
        chunk_right[chunks] = cand[m + 1];
        chunk_score[chunks] = fminf(scores[cand[m]], scores[cand[m + 1]]);
        ++chunks;
      }
    }
    s_num_chunks = chunks;
    s_count = c;
  }
  __syncthreads();
  // 3. Chunk order: score descending, ties to the lower left end (rank = position).
  const int chunks = s_num_chunks;
  for (int a = threadIdx.x; a < chunks; a += kThreads) {
    int rank = 0;
    for (int b = 0; b < chunks; ++b)
      rank += chunk_score[b] > chunk_score[a] || (chunk_score[b] == chunk_score[a] && chunk_left[b] < chunk_left[a]);
    chunk_order[rank] = a;
  }
  __syncthreads();
  // 4. Greedy: a chunk that does not fit is skipped, a later smaller one may still be taken.
  if (threadIdx.x == 0) {
    int count = s_count;
    for (int r = 0; r < chunks; ++r) {
      const int a = chunk_order[r];
      const int size = chunk_right[a] - chunk_left[a] - 1;
      if (count + size > budget) continue;
      for (int t = chunk_left[a] + 1; t < chunk_right[a]; ++t) kept[t] = 1;
      count += size;
    }
    s_count = count;
  }
  __syncthreads();
  // 5. Fill with the best tokens not yet kept. The choices go to `cand` (free since step 2), so
  // the ranks read only `kept`, which no thread writes in this step.
  const int fill = budget - s_count;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    bool take = false;
    if (fill > 0 && !kept[i]) {
      int rank = 0;
      for (int j = 0; j < n && rank < fill; ++j) rank += !kept[j] && better(scores, j, i);
      take = rank < fill;
    }
    cand[i] = take;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int w = 0;
    for (int i = 0; i < n; ++i)
      if (kept[i] || cand[i]) out[w++] = i;
  }
}

}  // namespace

KernelStatus launch_token2chunk(const float* scores, int n, int budget, int num_candidates, int max_gap, int32_t* out,
                                Arena& arena, cudaStream_t stream) {
  if (budget == 0 || n == 0) return KernelStatus::ok();
  uint8_t* kept = nullptr;
  int32_t *cand = nullptr, *left = nullptr, *right = nullptr, *order = nullptr;
  float* chunk_score = nullptr;
  if (auto st = arena.take(size_t(n), &kept); !st.is_ok()) return st;
  if (auto st = arena.take(size_t(n), &cand); !st.is_ok()) return st;
  if (auto st = arena.take(size_t(n), &left); !st.is_ok()) return st;
  if (auto st = arena.take(size_t(n), &right); !st.is_ok()) return st;
  if (auto st = arena.take(size_t(n), &order); !st.is_ok()) return st;
  if (auto st = arena.take(size_t(n), &chunk_score); !st.is_ok()) return st;
  token2chunk_kernel<<<1, kThreads, 0, stream>>>(scores, n, budget, num_candidates, max_gap, kept, cand, left, right,
                                                 chunk_score, order, out);
  KARAKV_CUDA_CHECK_LAUNCH("token2chunk");
  return KernelStatus::ok();
}

}  // namespace karakv::kernels::cuda
