// The CPU backend: the reference every other backend is tested against, and the production backend
// on machines without a GPU. Validation is cheap (O(blocks touched)) and happens before any write,
// so an invalid call changes nothing. Work is split over the backend's WorkPool (work_pool.h): the
// calling thread and whichever helpers are scheduled claim chunks, so a busy machine costs
// parallelism, never progress.
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "../common/allocations.h"
#include "../common/checks.h"
#include "../common/validate.h"
#include "attention.h"
#include "compress.h"
#include "karakv/kernels/backend.h"
#include "karakv/kernels/cpus.h"
#include "merge.h"
#include "quant_storage.h"
#include "simd.h"
#include "work_pool.h"

namespace karakv::kernels {
namespace {


// Pools of at least this size are aligned to it so the kernel can back them with huge pages:
// attention jumps between blocks hundreds of KiB apart and 4 KiB pages would miss the TLB on
// nearly every block.
constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kCacheLine = 64;
// Copies smaller than this run on the calling thread alone.
constexpr size_t kParallelCopyBytes = size_t(1) << 20;
// Attention reading less K/V than this runs on the calling thread alone: waking the helpers costs
// more than the work (a one-token Step over a short context).
constexpr size_t kParallelAttentionBytes = size_t(1) << 20;
// decode_attention gives each task a whole sequence once there are this many per thread (enough
// for dynamic scheduling to balance unequal lengths).
constexpr int kSeqsPerThreadForWholeSeqTasks = 4;


cpu::AttentionScratch& thread_scratch() {
  static thread_local cpu::AttentionScratch scratch;
  return scratch;
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(int num_threads, CpuIsa isa, CpuGemm gemm)
      : num_threads_(num_threads > 0 ? num_threads : usable_cpus().count), isa_(isa), gemm_(gemm) {}

  ~CpuBackend() override {
    allocations_.release_all([](void* p) { std::free(p); });
  }

  std::string_view name() const override { return "cpu"; }
  std::string description() const override {
    return "cpu (" + std::to_string(num_threads_) + " threads, " + std::string(cpu_isa_name(isa_)) + " attention, " +
           std::string(cpu_gemm_name(gemm_)) + " scorer)";
  }

  // The calling thread needs nothing of its own; this starts the pool's helpers if they are not
  // running yet.
  void prepare_thread() override { pool_.start(); }

  bool supports(Op op, DType dtype) const override {
    return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
  }

  KernelStatus allocate(size_t bytes, void** out) override {
    if (out == nullptr) return KernelStatus::invalid("allocate: out is null");
    if (bytes == 0) return KernelStatus::invalid("allocate: bytes must be > 0");
    const size_t align = bytes >= kHugePage ? kHugePage : kCacheLine;
    const size_t rounded = (bytes + align - 1) / align * align;  // aligned_alloc wants a multiple
    void* p = std::aligned_alloc(align, rounded);
    if (p == nullptr)
      return {KernelStatus::Code::kInternal, "allocate: out of host memory for " + std::to_string(bytes) + " bytes"};
#ifdef MADV_HUGEPAGE
    // A hint: transparent huge pages may be off, which only costs TLB misses.
    if (align == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);
#endif
    std::memset(p, 0, rounded);
    allocations_.add(p, bytes);
    *out = p;
    return KernelStatus::ok();
  }

  void free(void* ptr) override {
    if (ptr == nullptr) return;
    allocations_.remove(ptr);
    std::free(ptr);
  }

  KernelStatus write_kv(const PagedKV& kv, int seq, int start_pos, int num_tokens, int layer_begin,
                        int num_layers, const void* k, const void* v) override {
    KARAKV_RETURN_IF_ERROR(
        common::validate_write_kv(kv, seq, start_pos, num_tokens, layer_begin, num_layers, k, v, pool_blocks(kv)));
    if (num_tokens == 0 || num_layers == 0) return KernelStatus::ok();
    const Geometry& geo = kv.geometry;

    const size_t esize = dtype_size(geo.dtype);
    const size_t row_bytes = size_t(geo.head_dim) * esize;
    auto* pool = static_cast<char*>(kv.pool);
    const auto* ks = static_cast<const char*>(k);
    const auto* vs = static_cast<const char*>(v);
    // Split over (layer, token) rows: one layer of many tokens (a Step, or a single-layer model)
    // must still spread. Under 1 MiB the caller copies alone; above, measured side by side
    // (docs/BENCHMARKS.md, "Busy machine"), the pool doubles a quiet ring Append of 1 MiB, and on a
    // busy machine the caller copies on alone when no helper is scheduled.
    copy_rows(int64_t(num_layers) * num_tokens, [&](int64_t r) {
      const int l = int(r / num_tokens), i = int(r % num_tokens);
      const int pos = start_pos + i;
      const int32_t block = kv.block_of(seq, pos);
      const size_t slot = size_t(pos % geo.block_size) * geo.head_dim;
      for (int h = 0; h < geo.num_kv_heads; ++h) {
        const size_t src = ((size_t(l) * num_tokens + i) * geo.num_kv_heads + h) * row_bytes;
        std::memcpy(pool + (kv.run_offset(block, layer_begin + l, 0, h) + slot) * esize, ks + src, row_bytes);
        std::memcpy(pool + (kv.run_offset(block, layer_begin + l, 1, h) + slot) * esize, vs + src, row_bytes);
      }
    }, geo.num_kv_heads * row_bytes * 2);
    return KernelStatus::ok();
  }

  // The default's loop, checked against this pool's size first so that a refusal writes nothing.
  KernelStatus write_step_kv(const PagedKV& kv, int layer, const int32_t* positions, const void* k,
                             const void* v) override {
    KARAKV_RETURN_IF_ERROR(common::validate_write_step_kv(kv, layer, positions, k, v, pool_blocks(kv)));
    return write_step_kv_per_sequence(kv, layer, positions, k, v);
  }

  KernelStatus decode_attention(const PagedKV& kv, int layer, const float* q, float* out,
                                float scale) override {
    KARAKV_RETURN_IF_ERROR(common::validate_decode("decode_attention", kv, layer, q, out, pool_blocks(kv)));
    decode(kv, layer, q, out, scale, nullptr, nullptr);
    return KernelStatus::ok();
  }

  // Where decode() leaves each sequence's kept softmax numerators (cpu::LogitRows): query head j's
  // row of sequence s at rows + offset[s] + j * (len - first[s]), and the max of its chunk c at
  // maxes + max_offset[s] + j * chunks(len) + c.
  struct ObservedLogits {
    std::vector<int32_t> first;
    std::vector<size_t> offset, max_offset;
    float* rows = nullptr;
    float* maxes = nullptr;
    int chunk_tokens = 1;
    int chunks(int len) const { return (len + chunk_tokens - 1) / chunk_tokens; }
  };

  // decode_attention's work (validated); with lse non-null each sequence's query heads'
  // log-sum-exp ([num_seqs][num_q_heads]; an empty sequence's entries are not written), with
  // logits non-null the logits it names.
  void decode(const PagedKV& kv, int layer, const float* q, float* out, float scale, float* lse,
              const ObservedLogits* logits) {
    if (kv.num_seqs == 0) return;
    const Geometry& geo = kv.geometry;
    // A task is a sequence and a slice of its KV heads. Whole sequences read each block's K (then
    // V) for all heads as one contiguous region, which streams faster than per-head runs; with too
    // few sequences to keep every thread busy, tasks split by KV head instead.
    const int heads_per_task = kv.num_seqs >= kSeqsPerThreadForWholeSeqTasks * num_threads_ ? geo.num_kv_heads : 1;
    const int slices = (geo.num_kv_heads + heads_per_task - 1) / heads_per_task;
    const size_t group_elems = size_t(geo.group_size()) * geo.head_dim;
    const size_t seq_elems = geo.q_token_elems();
    const bool parallel = attention_is_large(kv);
    with_pool([&] {
      cpu::parallel_for(int64_t(kv.num_seqs) * slices, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int s = int(task / slices);
        const int h = int(task % slices) * heads_per_task;
        const int heads = std::min(heads_per_task, geo.num_kv_heads - h);
        const size_t off = size_t(s) * seq_elems + size_t(h) * group_elems;
        const size_t first_head = size_t(h) * geo.group_size();
        float* task_lse = lse != nullptr ? lse + size_t(s) * geo.num_q_heads + first_head : nullptr;
        cpu::LogitRows keep;
        if (logits != nullptr && logits->first[s] < kv.seq_len[s]) {
          keep.first = logits->first[s];
          keep.row_stride = size_t(kv.seq_len[s] - keep.first);
          keep.rows = logits->rows + logits->offset[s] + first_head * keep.row_stride;
          keep.max_stride = size_t(logits->chunks(kv.seq_len[s]));
          keep.maxes = logits->maxes + logits->max_offset[s] + first_head * keep.max_stride;
        }
        cpu::attend_heads(kv, s, layer, h, heads, kv.seq_len[s], q + off, out + off, scale, thread_scratch(), isa_,
                          task_lse, keep);
      }
      }, parallel);
    });
  }

  KernelStatus causal_attention(const PagedKV& kv, int seq, int layer, int num_queries,
                                const float* q, float* out, float scale) override {
    KARAKV_RETURN_IF_ERROR(common::validate_causal(kv, seq, layer, num_queries, q, out, pool_blocks(kv)));
    if (num_queries == 0) return KernelStatus::ok();
    const int len = kv.seq_len[seq];

    const Geometry& geo = kv.geometry;
    const int num_kv_heads = geo.num_kv_heads;
    const size_t group_elems = size_t(geo.group_size()) * geo.head_dim;
    const size_t query_elems = geo.q_token_elems();
    const int first_pos = len - num_queries;
    // Each query reads at most the whole sequence.
    const bool parallel =
        size_t(num_queries) * size_t(len) * geo.kv_token_elems() * dtype_size(geo.dtype) * 2 >= kParallelAttentionBytes;
    with_pool([&] {
      cpu::parallel_for(int64_t(num_queries) * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
          const int i = int(task / num_kv_heads), h = int(task % num_kv_heads);
          const size_t off = size_t(i) * query_elems + size_t(h) * group_elems;
          cpu::attend_heads(kv, seq, layer, h, 1, first_pos + i + 1, q + off, out + off, scale, thread_scratch(), isa_);
        }
      }, parallel);
    });
    return KernelStatus::ok();
  }

  KernelStatus read_kv(const PagedKV& kv, int seq, void* k, void* v) override {
    KARAKV_RETURN_IF_ERROR(common::validate_read_kv(kv, seq, k, v, pool_blocks(kv)));
    const int len = kv.seq_len[seq];
    if (len == 0) return KernelStatus::ok();

    const Geometry& geo = kv.geometry;
    const size_t esize = dtype_size(geo.dtype);
    const size_t row_bytes = size_t(geo.head_dim) * esize;
    const auto* pool = static_cast<const char*>(kv.pool);
    auto* kd = static_cast<char*>(k);
    auto* vd = static_cast<char*>(v);
    copy_rows(int64_t(geo.num_layers) * len, [&](int64_t r) {
      const int l = int(r / len), t = int(r % len);
      const int32_t block = kv.block_of(seq, t);
      const size_t slot = size_t(t % geo.block_size) * geo.head_dim;
      for (int h = 0; h < geo.num_kv_heads; ++h) {
        const size_t dst = ((size_t(l) * len + t) * geo.num_kv_heads + h) * row_bytes;
        std::memcpy(kd + dst, pool + (kv.run_offset(block, l, 0, h) + slot) * esize, row_bytes);
        std::memcpy(vd + dst, pool + (kv.run_offset(block, l, 1, h) + slot) * esize, row_bytes);
      }
    }, geo.num_kv_heads * row_bytes * 2);
    return KernelStatus::ok();
  }

  KernelStatus copy_block(const PagedKV& kv, int32_t src, int32_t dst) override {
    KARAKV_RETURN_IF_ERROR(common::validate_copy_block(kv, src, dst, pool_blocks(kv)));
    if (src == dst) return KernelStatus::ok();
    const size_t bytes = kv.geometry.block_bytes();
    auto* pool = static_cast<char*>(kv.pool);
    std::memcpy(pool + size_t(dst) * bytes, pool + size_t(src) * bytes, bytes);
    return KernelStatus::ok();
  }

  // Compression kernels live in compress.cc; their loops run on this backend's pool (with_pool).
  KernelStatus window_scores(const PagedKV& kv, int seq, int layer, int slot_begin, int window, const float* q,
                             float scale, float* out) override {
    return with_pool(
        [&] { return cpu::window_scores(kv, seq, layer, slot_begin, window, q, scale, out, pool_blocks(kv), gemm_); });
  }
  KernelStatus window_scores_observed(const PagedKV& kv, int seq, int layer, int slot_begin, int window,
                                      const float* q, float scale, const float* lse, bool later_keys_only,
                                      float* out) override {
    return with_pool([&] {
      return cpu::window_scores_observed(kv, seq, layer, slot_begin, window, q, scale, lse, later_keys_only, out,
                                         pool_blocks(kv), gemm_);
    });
  }
  KernelStatus snapkv_scores(const PagedKV& kv, int seq, int layer, int num_obs, const float* q, float scale,
                             int pool, float* out) override {
    return with_pool([&] {
      return cpu::snapkv_scores(kv, seq, layer, num_obs, q, scale, pool, out, pool_blocks(kv), gemm_);
    });
  }
  KernelStatus top_k(const float* scores, int rows, int n, int k, int32_t* out) override {
    return with_pool([&] { return cpu::top_k(scores, rows, n, k, out); });
  }
  KernelStatus token2chunk(const float* scores, int rows, int n, int budget, int num_candidates, int max_gap,
                           int32_t* out) override {
    return with_pool(
                       [&] { return cpu::token2chunk(scores, rows, n, budget, num_candidates, max_gap, out); });
  }
  KernelStatus gather_tokens(const PagedKV& kv, int seq, const int32_t* kept, int num_kept,
                             const int32_t* dst_blocks) override {
    return with_pool([&] { return cpu::gather_tokens(kv, seq, kept, num_kept, dst_blocks, pool_blocks(kv)); });
  }
  KernelStatus gather_tokens_in_place(const PagedKV& kv, int seq, int begin, const int32_t* kept,
                                      int num_kept) override {
    return with_pool([&] { return cpu::gather_tokens_in_place(kv, seq, begin, kept, num_kept, pool_blocks(kv)); });
  }
  KernelStatus cam_merge_values(const PagedKV& kv, int seq, int begin, int end, const int32_t* kept, int num_kept,
                                const float* scores, int merge_tokens, const int32_t* dst_blocks) override {
    return with_pool([&] {
      return cpu::cam_merge_values(kv, seq, begin, end, kept, num_kept, scores, merge_tokens, dst_blocks,
                                   pool_blocks(kv));
    });
  }
  int quantized_tokens_per_block(const Geometry& g, QuantFormat format) const override {
    return cpu::quantized_tokens_per_block(g, format);
  }
  KernelStatus quantize_tokens(const PagedKV& kv, int seq, int slot_begin, const QuantizedKV& q,
                               int32_t dst) override {
    return with_pool([&] { return cpu::quantize_tokens(kv, seq, slot_begin, q, dst); });
  }
  KernelStatus dequantize_block(const PagedKV& kv, const QuantizedKV& q, int32_t block, void* k, void* v) override {
    return cpu::dequantize_block(kv, q, block, k, v);
  }
  KernelStatus decode_attention_quantized(const PagedKV& kv, const QuantizedKV& qkv, int layer, const float* q,
                                          float* out, float scale, float* const* score_acc, const int32_t* acc_begin,
                                          float* const* lse) override {
    return with_pool(
        [&] { return cpu::decode_attention_quantized(kv, qkv, layer, q, out, scale, score_acc, acc_begin, lse); });
  }
  KernelStatus causal_attention_quantized(const PagedKV& kv, const QuantizedKV& qkv, int seq, int layer,
                                          int num_queries, const float* q, float* out, float scale) override {
    return with_pool([&] { return cpu::causal_attention_quantized(kv, qkv, seq, layer, num_queries, q, out, scale); });
  }
  KernelStatus decode_attention_accumulate(const PagedKV& kv, int layer, const float* q, float* out, float scale,
                                           float* const* score_acc, const int32_t* acc_begin) override {
    return observe("decode_attention_accumulate", kv, layer, q, out, scale, score_acc, acc_begin, nullptr);
  }
  KernelStatus decode_attention_observe(const PagedKV& kv, int layer, const float* q, float* out, float scale,
                                        float* const* score_acc, const int32_t* acc_begin,
                                        float* const* lse) override {
    return observe("decode_attention_observe", kv, layer, q, out, scale, score_acc, acc_begin, lse);
  }

 private:
  long long pool_blocks(const PagedKV& kv) const { return allocations_.pool_blocks(kv); }

  // The decode attention, which also leaves each query head's log-sum-exp and the softmax
  // numerators of the accumulated slots (their keys are read once, their exponentials taken once),
  // then each slot's probability, numerator * exp(its chunk's max - lse), summed over the group
  // into its accumulator; lse_out gets the normalisers too.
  KernelStatus observe(std::string_view op, const PagedKV& kv, int layer, const float* q, float* out, float scale,
                       float* const* score_acc, const int32_t* acc_begin, float* const* lse_out) {
    KARAKV_RETURN_IF_ERROR(common::validate_decode(op, kv, layer, q, out, pool_blocks(kv)));
    KARAKV_RETURN_IF_ERROR(common::validate_accumulators(op, kv, score_acc, acc_begin));
    const Geometry& geo = kv.geometry;
    const int hk = geo.num_kv_heads, g = geo.group_size();
    ObservedLogits logits;
    logits.first = common::first_observed_slots(kv, score_acc, acc_begin);
    logits.chunk_tokens = cpu::attention_chunk_tokens(geo.block_size);
    logits.offset.resize(kv.num_seqs);
    logits.max_offset.resize(kv.num_seqs);
    size_t total = 0, total_maxes = 0;
    for (int s = 0; s < kv.num_seqs; ++s) {
      logits.offset[s] = total;
      logits.max_offset[s] = total_maxes;
      total += size_t(geo.num_q_heads) * size_t(kv.seq_len[s] - logits.first[s]);
      total_maxes += size_t(geo.num_q_heads) * size_t(logits.chunks(kv.seq_len[s]));
    }
    // The calling thread's, kept between calls (a decode step calls this once per layer); the
    // loops below run on the pool's threads too, so they see them through these references.
    static thread_local std::vector<float> thread_rows, thread_maxes, thread_lse;
    std::vector<float>& rows = thread_rows;
    std::vector<float>& maxes = thread_maxes;
    std::vector<float>& lse = thread_lse;
    rows.resize(total);
    maxes.resize(total_maxes);
    lse.resize(size_t(kv.num_seqs) * geo.num_q_heads);
    logits.rows = rows.data();
    logits.maxes = maxes.data();
    const bool parallel = attention_is_large(kv);
    with_pool([&] {
      decode(kv, layer, q, out, scale, lse.data(), &logits);
      cpu::parallel_for(int64_t(kv.num_seqs) * hk, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
          const int s = int(task / hk), h = int(task % hk);
          float* acc = score_acc[size_t(s) * hk + h];
          const int len = kv.seq_len[s], first = logits.first[s], n = len - first;
          if (acc == nullptr || n <= 0) continue;
          const int ct = logits.chunk_tokens, chunks = logits.chunks(len);
          for (int j = h * g; j < (h + 1) * g; ++j) {
            const float* row = rows.data() + logits.offset[s] + size_t(j) * n;  // slot first at 0
            const float* chunk_max = logits.maxes + logits.max_offset[s] + size_t(j) * chunks;
            const float head_lse = lse[size_t(s) * geo.num_q_heads + j];
            for (int c = first / ct; c < chunks; ++c) {
              // exp(m - lse) >= 1 only by a rounding error (lse >= every chunk's max).
              const float f = std::exp(chunk_max[c] - head_lse);
              for (int i = std::max(first, c * ct), e = std::min(len, (c + 1) * ct); i < e; ++i) {
                acc[i] += row[i - first] * f;
              }
            }
          }
        }
      }, parallel);
    });
    for (int s = 0; s < kv.num_seqs && lse_out != nullptr; ++s) {
      // An empty sequence's normaliser is left as it was.
      if (lse_out[s] != nullptr && kv.seq_len[s] > 0)
        std::copy_n(lse.data() + size_t(s) * geo.num_q_heads, geo.num_q_heads, lse_out[s]);
    }
    if (rows.capacity() > (size_t(64) << 20) / sizeof(float)) std::vector<float>().swap(rows);  // H2O's long caches
    return KernelStatus::ok();
  }

  // Runs f on the calling thread with this backend's pool for its loops (cpu::parallel_for).
  template <class F>
  auto with_pool(F&& f) -> std::invoke_result_t<F&> {
    cpu::ScopedPool scope(&pool_);
    return f();
  }
  // row(r) for every (layer, token) row r of a copy of `rows` rows of `row_bytes` each, a few chunks
  // per thread; under kParallelCopyBytes in all the caller copies alone.
  template <class Row>
  void copy_rows(int64_t rows, const Row& row, size_t row_bytes) {
    with_pool([&] {
      cpu::parallel_for(rows, std::max<int64_t>(1, rows / (4 * int64_t(num_threads_))), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) row(r);
      }, size_t(rows) * row_bytes >= kParallelCopyBytes);
    });
  }
  // Whether decode attention over `kv` reads enough K/V to be worth the helpers.
  static bool attention_is_large(const PagedKV& kv) {
    size_t tokens = 0;
    for (int s = 0; s < kv.num_seqs; ++s) tokens += size_t(kv.seq_len[s]);
    return tokens * kv.geometry.kv_token_elems() * dtype_size(kv.geometry.dtype) * 2 >= kParallelAttentionBytes;
  }

  const int num_threads_;
  const CpuIsa isa_;
  const CpuGemm gemm_;
  cpu::WorkPool pool_{num_threads_};
  common::Allocations allocations_;
};

}  // namespace

// A forced choice that is invalid or cannot run here is reported once on stderr, and auto is used.
template <typename T>
T from_env_or_best(KernelStatus (*from_env)(T*), T best) {
  T value;
  if (KernelStatus st = from_env(&value); !st.is_ok()) {
    static std::once_flag warned;
    std::call_once(warned, [&] { std::fprintf(stderr, "karakv: %s; using auto\n", st.message.c_str()); });
    return best;
  }
  return value;
}

std::unique_ptr<Backend> make_cpu_backend(int num_threads) {
  return std::make_unique<CpuBackend>(num_threads, from_env_or_best(cpu_isa_from_env, best_cpu_isa()),
                                      from_env_or_best(cpu_gemm_from_env, best_cpu_gemm()));
}

std::unique_ptr<Backend> make_cpu_backend(int num_threads, CpuIsa isa, std::string* error) {
  return make_cpu_backend(num_threads, isa, best_cpu_gemm(), error);
}

std::unique_ptr<Backend> make_cpu_backend(int num_threads, CpuIsa isa, CpuGemm gemm, std::string* error) {
  std::string missing = cpu_isa_missing(isa);
  if (!missing.empty()) missing = "CPU ISA " + std::string(cpu_isa_name(isa)) + " cannot run here: " + missing;
  else if (std::string why = cpu_gemm_missing(gemm); !why.empty())
    missing = "CPU GEMM " + std::string(cpu_gemm_name(gemm)) + " cannot run here: " + why;
  if (!missing.empty()) {
    if (error != nullptr) *error = missing;
    return nullptr;
  }
  return std::make_unique<CpuBackend>(num_threads, isa, gemm);
}

}  // namespace karakv::kernels
