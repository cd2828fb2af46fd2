#include "token2chunk.cuh"

namespace karakv::kernels::cuda {
namespace {

constexpr int kThreads = 512;

__device__ __forceinline__ bool better(const float* s, int a, int b) {
  return s[a] > s[b] || (s[a] == s[b] && a < b);
}

// One CTA per row (blockIdx.x). Scratch (device, n entries per row each): kept flags, candidate
// list, chunk left ends, chunk scores and chunk order.
__global__ void __launch_bounds__(kThreads)
    token2chunk_kernel(const float* __restrict__ all_scores, int n, int budget, int num_candidates, int max_gap,
                       uint8_t* all_kept, int32_t* all_cand, int32_t* all_left, int32_t* all_right,
                       float* all_chunk_score, int32_t* all_order, int32_t* all_out) {
  __shared__ int s_num_chunks, s_count;
  const size_t row = blockIdx.x;
  const float* __restrict__ scores = all_scores + row * n;
  uint8_t* kept = all_kept + row * n;
  int32_t* cand = all_cand + row * n;
  int32_t* chunk_left = all_left + row * n;
  int32_t* chunk_right = all_right + row * n;
  float* chunk_score = all_chunk_score + row * n;
  int32_t* chunk_order = all_order + row * n;
  int32_t* out = all_out + row * budget;
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

KernelStatus launch_token2chunk(const float* scores, int rows, int n, int budget, int num_candidates, int max_gap,
                                int32_t* out, Arena& arena, cudaStream_t stream) {
  if (budget == 0 || n == 0 || rows == 0) return KernelStatus::ok();
  const size_t scratch = size_t(rows) * n;
  uint8_t* kept = nullptr;
  int32_t *cand = nullptr, *left = nullptr, *right = nullptr, *order = nullptr;
  float* chunk_score = nullptr;
  if (auto st = arena.take(scratch, &kept); !st.is_ok()) return st;
  if (auto st = arena.take(scratch, &cand); !st.is_ok()) return st;
  if (auto st = arena.take(scratch, &left); !st.is_ok()) return st;
  if (auto st = arena.take(scratch, &right); !st.is_ok()) return st;
  if (auto st = arena.take(scratch, &order); !st.is_ok()) return st;
  if (auto st = arena.take(scratch, &chunk_score); !st.is_ok()) return st;
  token2chunk_kernel<<<rows, kThreads, 0, stream>>>(scores, n, budget, num_candidates, max_gap, kept, cand, left, right,
                                                 chunk_score, order, out);
  KARAKV_CUDA_CHECK_LAUNCH("token2chunk");
  return KernelStatus::ok();
}

}  // namespace karakv::kernels::cuda
