// CPU compression kernels (docs/COMPRESSION.md). The scorers share one core: a query head's keys
// are widened once to fp32, score rows are computed as a matrix product of the pre-scaled queries
// and the keys, then each softmax row is added into per-key sums. The product is libxsmm's JIT
// kernel over blocks of up to 64 queries (CpuGemm::kLibxsmm, keys stored head_dim-major) or the
// project's register tile, two queries at a time (kTile, keys in tiles of 8 keys x head_dim; also
// the path for one decode query, where it beats the libraries). Work is split over query heads and
// the per-head sums are reduced in a fixed order, so results do not depend on the thread count.
#include "compress.h"
#include "work_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "../common/checks.h"
#include "../common/dispatch.h"
#include "../common/validate.h"
#include "scratch.h"
#include "simd.h"

#if KARAKV_HAVE_LIBXSMM
#include <libxsmm.h>

#include <mutex>
#endif

#include <atomic>

namespace karakv::kernels::cpu {
namespace {

std::atomic<uint64_t> g_libxsmm_products{0};

// Below this many bytes a gather is not worth waking the helpers for.
constexpr size_t kParallelGatherBytes = size_t(1) << 20;

// Keys are stored for scoring in tiles of kKeyTile keys, [tiles][head_dim][kKeyTile] fp32 with the
// last tile zero padded: one tile row is one vector, and a run of tiles is read sequentially.
constexpr int kKeyTile = 8;

int padded_keys(int num_keys) { return (num_keys + kKeyTile - 1) / kKeyTile * kKeyTile; }

// Queries scored per product with libxsmm (the rows of one JIT kernel call), and the keys per
// call: the benchmark's shapes (docs/BENCHMARKS.md), where its kernels ran 1.6-2.1x the tile.
constexpr int kGemmRows = 64;
constexpr int kGemmKeys = 128;
// The score rows of one product are kept under this many bytes (rows_per_block).
constexpr size_t kGemmRowsBytes = size_t(128) << 10;
// Fewer queries than this per head use the tile even where libxsmm was asked for: for a
// matrix-vector product the libraries' dispatch and packing cost more than they save.
constexpr int kGemmMinRows = 4;

// The row length, in floats, of the scorers' rows of num_keys floats (score rows, and key columns for
// libxsmm): padded_keys and one cache line more, so that rows of a power-of-two length (4,096
// keys) do not all map to the same few L1 sets; without it libxsmm's products over SnapKV's 4,096
// keys ran no faster than the tile (docs/BENCHMARKS.md).
size_t padded_stride(int num_keys) { return size_t(padded_keys(num_keys)) + 16; }

// Where the widened keys are: dimension d of key i at
// keys[(i / kKeyTile) * tile_stride + d * dim_stride + i % kKeyTile].
//   tiles:   [padded_keys / kKeyTile][head_dim][kKeyTile] (tile_stride head_dim * 8, dim_stride 8)
//   columns: [head_dim][padded_stride]                    (tile_stride 8, dim_stride padded_stride),
//            a column-major padded_keys x head_dim matrix for libxsmm
struct KeyLayout {
  size_t tile_stride = 0;
  size_t dim_stride = 0;
  bool columns = false;
};

// Per-thread buffers reused across calls (scratch.h).
struct ScoreScratch {
  std::vector<float> keys;   // padded_keys x head_dim fp32 in `layout`
  KeyLayout layout;
  std::vector<float> query;  // [rows per product][head_dim], pre-scaled
  std::vector<float> rows;   // [rows per product][padded_keys]
};

// Whether a call scoring `rows_per_head` queries per head uses libxsmm (the keys then go in columns).
bool use_gemm(CpuGemm gemm, int rows_per_head) {
#if KARAKV_HAVE_LIBXSMM
  return gemm == CpuGemm::kLibxsmm && rows_per_head >= kGemmMinRows;
#else
  (void)gemm;
  (void)rows_per_head;
  return false;
#endif
}

// At the end of each thread's share of a parallel loop.
void release_large_scratch(ScoreScratch& scratch) {
  release_if_large(scratch.keys);
  release_if_large(scratch.rows);
}

ScoreScratch& thread_scratch() {
  static thread_local ScoreScratch scratch;
  return scratch;
}

#if KARAKV_CPU_AVX2
// r[e][c] <- r[c][e]: eight rows of eight floats transposed in registers.
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
#endif

// The keys of slots [slot_begin, slot_begin + num_keys) of (layer, head) of `seq`, widened to fp32
// into scratch.keys in tiles or in columns (KeyLayout); the padding keys up to padded_keys are
// zeros. With AVX2 eight keys are widened eight dimensions at a time (F16C for fp16) and transposed
// in registers: the scalar path (software half widening, one strided store per element) took most
// of a decode step's time once Kara's decode observers score every key at every step.
template <DType D>
void load_key_tiles(const PagedKV& kv, int seq, int layer, int head, int slot_begin, int num_keys, bool columns,
                    ScoreScratch& scratch) {
  const Geometry& g = kv.geometry;
  const int hd = g.head_dim;
  const int bs = g.block_size;
  scratch.layout = columns ? KeyLayout{kKeyTile, padded_stride(num_keys), true}
                           : KeyLayout{size_t(hd) * kKeyTile, kKeyTile, false};
  const size_t size = columns ? size_t(hd) * scratch.layout.dim_stride : size_t(padded_keys(num_keys)) * hd;
  const KeyLayout layout = scratch.layout;
  const auto* pool = static_cast<const storage_t<D>*>(kv.pool);
  auto key = [&](int i) {
    const int slot = slot_begin + i;
    return pool + kv.run_offset(kv.block_of(seq, slot), layer, 0, head) + size_t(slot % bs) * hd;
  };
#if KARAKV_CPU_AVX2
  static_assert(kKeyTile == 8, "one tile row is one AVX2 vector");
  if (hd % 8 == 0) {
    scratch.keys.resize(size);  // every element but the columns' padding is written below
    float* keys = scratch.keys.data();
    for (int t0 = 0; t0 < num_keys; t0 += kKeyTile) {
      const int n = std::min(kKeyTile, num_keys - t0);
      const storage_t<D>* src[kKeyTile];
      for (int c = 0; c < n; ++c) src[c] = key(t0 + c);
      float* tile = keys + size_t(t0 / kKeyTile) * layout.tile_stride;
      for (int d = 0; d < hd; d += 8) {
        __m256 r[8];
        for (int c = 0; c < 8; ++c) r[c] = c < n ? load8<D>(src[c] + d) : _mm256_setzero_ps();
        transpose8(r);
        for (int e = 0; e < 8; ++e) _mm256_storeu_ps(tile + size_t(d + e) * layout.dim_stride, r[e]);
      }
    }
    return;
  }
#endif
  scratch.keys.assign(size, 0.0f);
  float* keys = scratch.keys.data();
  for (int i = 0; i < num_keys; ++i) {
    const storage_t<D>* k = key(i);
    float* tile = keys + size_t(i / kKeyTile) * layout.tile_stride + i % kKeyTile;
    for (int d = 0; d < hd; ++d) tile[size_t(d) * layout.dim_stride] = load1<D>(k + d);
  }
}

// rows[r][s] = query[r] . key[s] for R query rows and keys s in [0, padded_keys(num_keys)).
// Four tiles (32 keys) at a time keep 4R accumulators in registers over the whole head dim, so
// each key vector loaded serves all R rows.
//   query: [R][head_dim] fp32; keys: in `layout`; rows: [R][row_stride]
template <int R>
void score_rows(const float* query, int head_dim, const float* keys, KeyLayout layout, int num_keys, float* rows,
                size_t row_stride) {
  const int tiles = padded_keys(num_keys) / kKeyTile;
  const size_t ts = layout.tile_stride, ds = layout.dim_stride;
  int t = 0;
#if KARAKV_CPU_AVX2
  static_assert(kKeyTile == 8, "one tile row is one AVX2 vector");
  for (; t + 4 <= tiles; t += 4) {
    const float* k = keys + size_t(t) * ts;
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; ++d) {
      __m256 kd[4];
      for (int c = 0; c < 4; ++c) kd[c] = _mm256_loadu_ps(k + c * ts + d * ds);
      for (int r = 0; r < R; ++r) {
        const __m256 qd = _mm256_broadcast_ss(query + r * head_dim + d);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_fmadd_ps(kd[c], qd, acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(rows + r * row_stride + (t + c) * kKeyTile, acc[r][c]);
  }
  for (; t < tiles; ++t) {
    const float* k = keys + size_t(t) * ts;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; ++d) {
      const __m256 kd = _mm256_loadu_ps(k + d * ds);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(kd, _mm256_broadcast_ss(query + r * head_dim + d), acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(rows + r * row_stride + t * kKeyTile, acc[r]);
  }
#else
  for (; t < tiles; ++t) {
    const float* k = keys + size_t(t) * ts;
    for (int r = 0; r < R; ++r) {
      float acc[kKeyTile] = {};
      for (int d = 0; d < head_dim; ++d)
        for (int j = 0; j < kKeyTile; ++j) acc[j] += k[d * ds + j] * query[r * head_dim + d];
      for (int j = 0; j < kKeyTile; ++j) rows[r * row_stride + t * kKeyTile + j] = acc[j];
    }
  }
#endif
}

#if KARAKV_HAVE_LIBXSMM
// rows = keys . query^T with libxsmm, keys in columns: column-major, rows^T (keys x num_rows, ld
// row_stride) = keys (keys x head_dim, ld padded_keys) . query^T (head_dim x num_rows, ld head_dim),
// in blocks of kGemmKeys keys. False, with nothing written, where libxsmm has no kernel (its JIT
// refused the shape or the CPU): the caller then uses the tile.
bool gemm_rows(const float* query, int num_rows, int head_dim, const float* keys, KeyLayout layout, int num_keys,
               float* rows, size_t row_stride) {
  static std::once_flag init;
  std::call_once(init, [] { libxsmm_init(); });
  const int n = padded_keys(num_keys);
  const libxsmm_blasint lda = libxsmm_blasint(layout.dim_stride), ldb = head_dim, ldc = libxsmm_blasint(row_stride);
  const float alpha = 1.0f, beta = 0.0f;  // beta must be given: libxsmm's default is 1 (C += A B)
  // The last few kernels this thread used, so that steady work skips libxsmm's registry (a hash
  // and a lock per lookup, measurable next to a 128 x 64 x 64 product when both threads dispatch).
  struct Cached {
    int m = -1, n = -1, k = -1;
    libxsmm_blasint lda = 0, ldc = 0;
    libxsmm_smmfunction f = nullptr;
  };
  static thread_local Cached cache[8];
  static thread_local unsigned next = 0;
  auto kernel = [&](int m) {
    for (const Cached& c : cache)
      if (c.m == m && c.n == num_rows && c.k == head_dim && c.lda == lda && c.ldc == ldc) return c.f;
    const libxsmm_smmfunction f =
        libxsmm_smmdispatch(m, num_rows, head_dim, &lda, &ldb, &ldc, &alpha, &beta, nullptr, nullptr);
    if (f != nullptr) cache[next++ % 8] = Cached{m, num_rows, head_dim, lda, ldc, f};
    return f;
  };
  const int full = n / kGemmKeys, rest = n % kGemmKeys;
  const libxsmm_smmfunction block = full > 0 ? kernel(kGemmKeys) : nullptr;
  const libxsmm_smmfunction tail = rest > 0 ? kernel(rest) : nullptr;
  if ((full > 0 && block == nullptr) || (rest > 0 && tail == nullptr)) return false;
  for (int b = 0; b < full; ++b) block(keys + size_t(b) * kGemmKeys, query, rows + size_t(b) * kGemmKeys);
  if (rest > 0) tail(keys + size_t(full) * kGemmKeys, query, rows + size_t(full) * kGemmKeys);
  g_libxsmm_products.fetch_add(uint64_t(full) + (rest > 0), std::memory_order_relaxed);
  return true;
}
#endif

// rows[r][s] = query[r] . key[s] for r in [0, num_rows), s in [0, padded_keys(num_keys)): libxsmm
// where the keys are in columns, else the tile two rows at a time.
//   query: [num_rows][head_dim] fp32; keys: in `layout`; rows: [num_rows][row_stride]
void score_block(const float* query, int num_rows, int head_dim, const float* keys, KeyLayout layout, int num_keys,
                 float* rows, size_t row_stride) {
#if KARAKV_HAVE_LIBXSMM
  if (layout.columns && gemm_rows(query, num_rows, head_dim, keys, layout, num_keys, rows, row_stride)) return;
#endif
  int r = 0;
  for (; r + 2 <= num_rows; r += 2) {
    score_rows<2>(query + size_t(r) * head_dim, head_dim, keys, layout, num_keys, rows + r * row_stride, row_stride);
  }
  if (r < num_rows) {
    score_rows<1>(query + size_t(r) * head_dim, head_dim, keys, layout, num_keys, rows + r * row_stride, row_stride);
  }
}

// The queries per score_block call: a tile pair, or for libxsmm up to kGemmRows, fewer where their
// score rows (num_keys each) would not stay in the L2 cache until the softmax reads them back.
int rows_per_block(const ScoreScratch& scratch, int num_keys) {
  if (!scratch.layout.columns) return 2;
  const size_t fit = kGemmRowsBytes / (sizeof(float) * padded_stride(num_keys));
  return int(std::clamp<size_t>(fit, kGemmMinRows, kGemmRows));
}

// out[r][d] = q[(first + r) * q_stride + d] * scale for r < count: a block of queries, pre-scaled
// (scaling a query once is cheaper than scaling its scores), contiguous for the product.
void scale_rows(const float* q, size_t q_stride, int first, int count, int head_dim, float scale, float* out) {
  for (int r = 0; r < count; ++r) {
    const float* row = q + size_t(first + r) * q_stride;
    for (int d = 0; d < head_dim; ++d) out[size_t(r) * head_dim + d] = row[d] * scale;
  }
}

// col_sums[s] = sum_r softmax(q_r . K^T * scale)[s] for query rows r in [0, num_rows), row r seeing
// keys [0, visible(r)) (1 <= visible(r) <= num_keys, non-decreasing in r), keys in scratch.keys.
//   q:        rows of head_dim fp32, row r at q + r * q_stride
//   col_sums: [num_keys] fp32
template <typename Visible>
void softmax_column_sums(const float* q, size_t q_stride, int num_rows, float scale, int num_keys, int head_dim,
                         Visible visible, ScoreScratch& scratch, float* col_sums) {
  const size_t stride = padded_stride(num_keys);
  const int block = std::min(rows_per_block(scratch, num_keys), num_rows);
  scratch.query.resize(size_t(block) * head_dim);
  scratch.rows.resize(size_t(block) * stride);
  float* query = scratch.query.data();
  std::fill(col_sums, col_sums + num_keys, 0.0f);
  // Rows in blocks: the block shares every key load; the earlier rows' extra keys are discarded.
  for (int r0 = 0; r0 < num_rows; r0 += block) {
    const int count = std::min(block, num_rows - r0);
    scale_rows(q, q_stride, r0, count, head_dim, scale, query);
    score_block(query, count, head_dim, scratch.keys.data(), scratch.layout, visible(r0 + count - 1),
                scratch.rows.data(), stride);
    for (int r = 0; r < count; ++r) {
      float* row = scratch.rows.data() + r * stride;
      const int len = visible(r0 + r);
      const float row_max = max_of(row, len);
      const float sum = exp_shifted_sum(row, len, row_max);
      const float inv = 1.0f / sum;
      for (int s = 0; s < len; ++s) col_sums[s] += row[s] * inv;
    }
  }
}

// out[h][i] = sum over the query heads j of KV head h of partial[j][i], in order of j (so the
// result does not depend on which thread scored which head).
//   partial: [num_q_heads][n]; out: [num_kv_heads][n]
void sum_over_groups(const float* partial, const Geometry& geo, int n, float* out) {
  const int g = geo.group_size();
  for (int h = 0; h < geo.num_kv_heads; ++h) {
    float* o = out + size_t(h) * n;
    std::copy_n(partial + size_t(h) * g * n, n, o);
    for (int j = 1; j < g; ++j) {
      const float* p = partial + size_t(h * g + j) * n;
      for (int i = 0; i < n; ++i) o[i] += p[i];
    }
  }
}

}  // namespace

uint64_t libxsmm_products() { return g_libxsmm_products.load(std::memory_order_relaxed); }

void tile_product(const float* query, int num_rows, int head_dim, const float* key_tiles, int num_keys, float* rows,
                  size_t row_stride) {
  score_block(query, num_rows, head_dim, key_tiles, KeyLayout{size_t(head_dim) * kKeyTile, kKeyTile, false},
              num_keys, rows, row_stride);
}

KernelStatus window_scores(const PagedKV& kv, int seq, int layer, int slot_begin, int window, const float* q,
                           float scale, float* out, long long pool_blocks, CpuGemm gemm) {
  KARAKV_RETURN_IF_ERROR(
      common::validate_window_scores(kv, seq, layer, slot_begin, window, q, scale, out, pool_blocks));

  const Geometry& geo = kv.geometry;
  const int g = geo.group_size();
  const int hq = geo.num_q_heads;
  const int hd = geo.head_dim;
  // Per query head column sums, reduced over each group in order below.
  std::vector<float> partial(size_t(hq) * window);
  const KernelStatus dispatched = common::dispatch_dtype(geo.dtype, [&](auto dtype) {
    constexpr DType D = decltype(dtype)::value;
    parallel_for(hq, 1, [&](int64_t begin, int64_t end) {
      for (int qh = int(begin); qh < int(end); ++qh) {
        ScoreScratch& scratch = thread_scratch();
        load_key_tiles<D>(kv, seq, layer, qh / g, slot_begin, window, use_gemm(gemm, window), scratch);
        softmax_column_sums(q + size_t(qh) * hd, size_t(hq) * hd, window, scale, window, hd,
                            [window](int) { return window; }, scratch, partial.data() + size_t(qh) * window);
      }
    }, true, [] { release_large_scratch(thread_scratch()); });
  });
  if (!dispatched.is_ok()) return dispatched;
  sum_over_groups(partial.data(), geo, window, out);
  return KernelStatus::ok();
}

KernelStatus window_scores_observed(const PagedKV& kv, int seq, int layer, int slot_begin, int window,
                                    const float* q, float scale, const float* lse, bool later_keys_only, float* out,
                                    long long pool_blocks, CpuGemm gemm) {
  KARAKV_RETURN_IF_ERROR(
      common::validate_window_scores(kv, seq, layer, slot_begin, window, q, scale, out, pool_blocks));
  const Geometry& geo = kv.geometry;
  const int g = geo.group_size();
  const int hq = geo.num_q_heads;
  const int hd = geo.head_dim;
  std::vector<float> partial(size_t(hq) * window, 0.0f);
  const KernelStatus dispatched = common::dispatch_dtype(geo.dtype, [&](auto dtype) {
    constexpr DType D = decltype(dtype)::value;
    parallel_for(hq, 1, [&](int64_t begin, int64_t end) {
      for (int qh = int(begin); qh < int(end); ++qh) {
        ScoreScratch& scratch = thread_scratch();
        load_key_tiles<D>(kv, seq, layer, qh / g, slot_begin, window, use_gemm(gemm, window), scratch);
        const size_t stride = padded_stride(window);
        const int block = std::min(rows_per_block(scratch, window), window);
        scratch.query.resize(size_t(block) * hd);
        scratch.rows.resize(size_t(block) * stride);
        float* sums = partial.data() + size_t(qh) * window;
        for (int t0 = 0; t0 < window; t0 += block) {
          const int count = std::min(block, window - t0);
          scale_rows(q + size_t(qh) * hd, size_t(hq) * hd, t0, count, hd, scale, scratch.query.data());
          score_block(scratch.query.data(), count, hd, scratch.keys.data(), scratch.layout, window,
                      scratch.rows.data(), stride);
          for (int r = 0; r < count; ++r) {
            const int t = t0 + r;
            float* row = scratch.rows.data() + r * stride;
            const float norm = lse != nullptr ? lse[size_t(t) * hq + qh] : NAN;
            const int first = later_keys_only ? t + 1 : 0;
            if (std::isfinite(norm)) {
              for (int i = first; i < window; ++i) sums[i] += std::exp(row[i] - norm);
            } else {
              const float inv = 1.0f / softmax_numerators(row, window);
              for (int i = first; i < window; ++i) sums[i] += row[i] * inv;
            }
          }
        }
      }
    }, true, [] { release_large_scratch(thread_scratch()); });
  });
  if (!dispatched.is_ok()) return dispatched;
  sum_over_groups(partial.data(), geo, window, out);
  return KernelStatus::ok();
}

KernelStatus snapkv_scores(const PagedKV& kv, int seq, int layer, int num_obs, const float* q, float scale,
                           int pool, float* out, long long pool_blocks, CpuGemm gemm) {
  KARAKV_RETURN_IF_ERROR(common::validate_snapkv_scores(kv, seq, layer, num_obs, q, scale, pool, out, pool_blocks));
  const int n = kv.seq_len[seq];

  const Geometry& geo = kv.geometry;
  const int g = geo.group_size();
  const int hq = geo.num_q_heads;
  const int hd = geo.head_dim;
  const int prefix = n - num_obs;
  std::vector<float> partial(size_t(hq) * n);
  const KernelStatus dispatched = common::dispatch_dtype(geo.dtype, [&](auto dtype) {
    constexpr DType D = decltype(dtype)::value;
    parallel_for(hq, 1, [&](int64_t begin, int64_t end) {
      for (int qh = int(begin); qh < int(end); ++qh) {
        ScoreScratch& scratch = thread_scratch();
        load_key_tiles<D>(kv, seq, layer, qh / g, 0, n, use_gemm(gemm, num_obs), scratch);
        softmax_column_sums(q + size_t(qh) * hd, size_t(hq) * hd, num_obs, scale, n, hd,
                            [prefix](int i) { return prefix + i + 1; }, scratch, partial.data() + size_t(qh) * n);
      }
    }, true, [] { release_large_scratch(thread_scratch()); });
  });
  if (!dispatched.is_ok()) return dispatched;
  // Every query counts in the mean, including those that cannot see a slot.
  const float inv_count = 1.0f / float(size_t(num_obs) * g);
  const int half = pool / 2;
  std::vector<float> sums(size_t(geo.num_kv_heads) * n);
  sum_over_groups(partial.data(), geo, n, sums.data());
  for (int h = 0; h < geo.num_kv_heads; ++h) {
    float* mean = sums.data() + size_t(h) * n;
    for (int s = 0; s < n; ++s) mean[s] *= inv_count;
    float* o = out + size_t(h) * n;
    for (int s = 0; s < prefix; ++s) {
      float sum = 0.0f;
      for (int u = std::max(0, s - half); u <= std::min(prefix - 1, s + half); ++u) sum += mean[u];
      o[s] = sum / float(pool);
    }
    std::copy(mean + prefix, mean + n, o + prefix);
  }
  return KernelStatus::ok();
}

namespace {

// The selection rule of every top-k in COMPRESSION.md: score descending, ties to the lower index.
// The selections compare 64-bit keys, not scores through their indices: a key is the score's
// order-preserving code above the index's complement, so a larger key is the better index and
// nth_element compares two integers instead of two loads and two float compares. The kept tokens
// are marked in a byte map and written in slot order by one scan, not sorted. -0.0 codes as +0.0
// (they tie, as the rule says); NaN is refused before.
inline uint64_t rank_key(float score, int32_t i) {
  if (score == 0.0f) score = 0.0f;
  uint32_t u;
  std::memcpy(&u, &score, sizeof u);
  u = (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
  return (uint64_t(u) << 32) | uint32_t(~uint32_t(i));
}
inline int32_t key_index(uint64_t key) { return int32_t(~uint32_t(key)); }

// Moves the k largest keys to keys[0, k), in no particular order.
void partition_largest(std::vector<uint64_t>& keys, int k) {
  if (k <= 0 || k >= int(keys.size())) return;
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint64_t>());
}

// A thread's buffers for the selections, kept across rows and calls: 9 bytes per score of a row
// and 12 per candidate; scratch.h's bound gives back a buffer past 256 KiB (rows of over 32k
// slots) after its row.
struct SelectScratch {
  std::vector<uint64_t> keys, chunks;
  std::vector<uint8_t> kept;
  std::vector<int32_t> cand;
  void release_large() {
    release_if_large(keys);
    release_if_large(chunks);
    release_if_large(kept);
    release_if_large(cand);
  }
};
SelectScratch& select_scratch() {
  thread_local SelectScratch scratch;
  return scratch;
}

// The `count` marked slots of kept, ascending (without a branch per slot: out[w] is written at
// every slot and kept only where marked; the loop ends with the last marked one).
void write_kept(const std::vector<uint8_t>& kept, int count, int32_t* out) {
  for (int i = 0, w = 0; w < count; ++i) {
    out[w] = i;
    w += kept[i];
  }
}

// Marks the k best of a row's n scores in x.kept; x.keys holds every slot's key, the k best first.
void mark_best(SelectScratch& x, const float* scores, int n, int k) {
  x.keys.resize(n);
  for (int i = 0; i < n; ++i) x.keys[i] = rank_key(scores[i], i);
  partition_largest(x.keys, k);
  x.kept.assign(n, 0);
  for (int i = 0; i < k; ++i) x.kept[key_index(x.keys[i])] = 1;
}

void top_k_row(const float* scores, int n, int k, int32_t* out) {
  SelectScratch& x = select_scratch();
  mark_best(x, scores, n, k);
  write_kept(x.kept, k, out);
  x.release_large();
}

void token2chunk_row(const float* scores, int n, int budget, int num_candidates, int max_gap, int32_t* out) {
  SelectScratch& x = select_scratch();
  mark_best(x, scores, n, num_candidates);
  std::vector<uint8_t>& kept = x.kept;
  x.cand.resize(num_candidates);
  write_kept(kept, num_candidates, x.cand.data());
  const std::vector<int32_t>& cand = x.cand;
  int count = num_candidates;

  // Each gap of 1..max_gap slots between consecutive candidates is a chunk, ranked by the lower of
  // its two candidates' scores, ties to the lower position: the key of that score above the
  // complement of the left candidate's rank m (m rises with the position).
  x.chunks.clear();
  int all = 0;  // the chunks' tokens in all
  for (size_t m = 0; m + 1 < cand.size(); ++m) {
    const int gap = cand[m + 1] - cand[m] - 1;
    if (gap >= 1 && gap <= max_gap) {
      x.chunks.push_back(rank_key(std::min(scores[cand[m]], scores[cand[m + 1]]), int32_t(m)));
      all += gap;
    }
  }
  // Taken best first while they fit. When all of them fit, the order does not matter and the sort
  // is skipped; once the budget is full no later chunk fits.
  if (count + all > budget) std::sort(x.chunks.begin(), x.chunks.end(), std::greater<uint64_t>());
  for (const uint64_t c : x.chunks) {
    if (count == budget) break;
    const int32_t m = key_index(c);
    const int32_t left = cand[m], right = cand[m + 1];
    const int size = right - left - 1;
    if (count + size > budget) continue;
    for (int32_t t = left + 1; t < right; ++t) kept[t] = 1;
    count += size;
  }

  if (count < budget) {
    // The best of the rest: every key not kept, from keys[num_candidates, n) (the candidates are
    // keys[0, num_candidates)), less those the chunks took.
    const int fill = budget - count;
    size_t w = 0;
    for (size_t i = size_t(num_candidates); i < x.keys.size(); ++i)
      if (!kept[key_index(x.keys[i])]) x.keys[w++] = x.keys[i];
    x.keys.resize(w);
    partition_largest(x.keys, fill);
    for (int i = 0; i < fill; ++i) kept[key_index(x.keys[i])] = 1;
  }
  write_kept(kept, budget, out);
  x.release_large();
}

// row(r) for r in [0, rows), on the pool when the rows are large enough. Rows are independent and
// cannot fail (the arguments were validated), so the order they run in does not matter.
template <typename Row>
void for_each_row(int rows, int n, const Row& row) {
  parallel_for(rows, 1, [&](int64_t begin, int64_t end) {
    for (int r = int(begin); r < int(end); ++r) row(r);
  }, selection_is_parallel(rows, n));
}

}  // namespace

KernelStatus top_k(const float* scores, int rows, int n, int k, int32_t* out) {
  KARAKV_RETURN_IF_ERROR(common::validate_top_k(scores, rows, n, k, out));
  for_each_row(rows, n, [&](int r) { top_k_row(scores + size_t(r) * n, n, k, out + size_t(r) * k); });
  return KernelStatus::ok();
}

KernelStatus token2chunk(const float* scores, int rows, int n, int budget, int num_candidates, int max_gap,
                         int32_t* out) {
  KARAKV_RETURN_IF_ERROR(common::validate_token2chunk(scores, rows, n, budget, num_candidates, max_gap, out));
  for_each_row(rows, n, [&](int r) {
    token2chunk_row(scores + size_t(r) * n, n, budget, num_candidates, max_gap, out + size_t(r) * budget);
  });
  return KernelStatus::ok();
}

namespace {

// For every (layer, KV head) row of `seq`, K and V of source slot kept[row][i] are copied to
// pool byte offset dst(l, kv_index, h, i), in ascending i; a row's i below first_moved[row] is
// skipped. `moved` (bytes) decides whether the rows run on the kernels' pool.
template <typename Dst>
void copy_rows(const PagedKV& kv, int seq, const int32_t* kept, int num_kept, const std::vector<int>& first_moved,
               size_t moved, const Dst& dst) {
  const Geometry& geo = kv.geometry;
  const int bs = geo.block_size;
  const size_t esize = dtype_size(geo.dtype);
  const size_t row_bytes = size_t(geo.head_dim) * esize;
  auto* pool = static_cast<char*>(kv.pool);
  const int rows = geo.num_layers * geo.num_kv_heads;
  // One task per (layer, KV head) row, a few per thread.
  const int64_t grain = std::max<int64_t>(1, rows / (4 * int64_t(pool_width())));
  parallel_for(rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int l = int(task / geo.num_kv_heads), h = int(task % geo.num_kv_heads);
      const int32_t* row = kept + size_t(task) * num_kept;
      for (int kv_index = 0; kv_index < 2; ++kv_index) {
        for (int i = first_moved[task]; i < num_kept; ++i) {
          const int32_t src_slot = row[i];
          const size_t src = (kv.run_offset(kv.block_of(seq, src_slot), l, kv_index, h) +
                              size_t(src_slot % bs) * geo.head_dim) * esize;
          std::memcpy(pool + dst(l, kv_index, h, i), pool + src, row_bytes);
        }
      }
    }
  }, moved >= kParallelGatherBytes);
}

}  // namespace

KernelStatus gather_tokens(const PagedKV& kv, int seq, const int32_t* kept, int num_kept, const int32_t* dst_blocks,
                           long long pool_blocks) {
  KARAKV_RETURN_IF_ERROR(common::validate_gather_tokens(kv, seq, kept, num_kept, dst_blocks, pool_blocks));
  if (num_kept == 0) return KernelStatus::ok();
  const Geometry& geo = kv.geometry;
  const int bs = geo.block_size;
  const int rows = geo.num_layers * geo.num_kv_heads;
  const size_t esize = dtype_size(geo.dtype);
  const size_t total = size_t(rows) * num_kept * geo.head_dim * esize * 2;
  copy_rows(kv, seq, kept, num_kept, std::vector<int>(rows, 0), total, [&](int l, int kv_index, int h, int i) {
    return (kv.run_offset(dst_blocks[i / bs], l, kv_index, h) + size_t(i % bs) * geo.head_dim) * esize;
  });
  return KernelStatus::ok();
}

KernelStatus gather_tokens_in_place(const PagedKV& kv, int seq, int begin, const int32_t* kept, int num_kept,
                                    long long pool_blocks) {
  KARAKV_RETURN_IF_ERROR(common::validate_gather_tokens_in_place(kv, seq, begin, kept, num_kept, pool_blocks));
  if (num_kept == 0) return KernelStatus::ok();
  const Geometry& geo = kv.geometry;
  const int bs = geo.block_size;
  const int rows = geo.num_layers * geo.num_kv_heads;
  const size_t esize = dtype_size(geo.dtype);
  // Each row moves from its first slot out of place on (a re-rank that drops the newest tokens of
  // its range moves almost nothing); before that every kept token is where it goes. After it, a
  // kept slot (>= begin + i) is never one an earlier i wrote (begin + j, j < i), and distinct slots
  // never overlap.
  std::vector<int> first_moved(rows);
  size_t moved = 0;
  for (int r = 0; r < rows; ++r) {
    const int32_t* row = kept + size_t(r) * num_kept;
    int i = 0;
    while (i < num_kept && row[i] == begin + i) ++i;
    first_moved[r] = i;
    moved += size_t(num_kept - i) * geo.head_dim * esize * 2;
  }
  if (moved == 0) return KernelStatus::ok();
  copy_rows(kv, seq, kept, num_kept, first_moved, moved, [&](int l, int kv_index, int h, int i) {
    const int32_t slot = begin + i;
    return (kv.run_offset(kv.block_of(seq, slot), l, kv_index, h) + size_t(slot % bs) * geo.head_dim) * esize;
  });
  return KernelStatus::ok();
}

}  // namespace karakv::kernels::cpu
