// The paged GQA attention driver shared by the CPU attention variants (attention.cc: the build's
// baseline, AVX2 on x86-64; attention_avx512.cc: AVX-512). Each variant includes this in its own
// namespace with a policy `Isa` that supplies the vector loops:
//   Isa::score_run<D, G, HD>, Isa::accumulate_run<D, G, HD>, Isa::max_of, Isa::exp_shifted_sum.
// It allocates nothing and uses no library templates (the caller sizes the scratch), so a
// translation unit built for a wider ISA instantiates nothing that another unit could share: every
// function it emits has its own name, and an AVX2-only CPU never runs an AVX-512 instruction.
//
// The sequence's blocks go in chunks of about 512 tokens, each in two passes: scores from K (all
// query heads of a group per K row, so K is read from memory once), then V weighted by their
// softmax numerators (again once per group), folded into a running max, sum and output (the online
// softmax), so the scratch does not grow with the sequence. Each block's (layer, head) run is
// block_size * head_dim contiguous elements and stays in L1 while the group's heads use it.
// Include only from a .cc file, after defining KARAKV_ATTENTION_VARIANT to the variant's namespace.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "attention.h"
#include "simd.h"

namespace karakv::kernels::cpu::KARAKV_ATTENTION_VARIANT {

// Storage element per dtype (16-bit types stay raw bits until widened), as simd.h's storage_t.
template <DType D>
using element_t = std::conditional_t<D == DType::kFloat32, float, uint16_t>;

inline int min_int(int a, int b) { return a < b ? a : b; }

// How many regions ahead of the one being computed are prefetched (see attend_heads_typed). One is
// enough once prefetches are spread over the rows; more only competes for the miss buffers.
constexpr int kPrefetchRegions = 1;

// An asm statement on x86: GCC's IPA pass deems a function wrapping only __builtin_prefetch free of
// side effects and deletes the calls, which silently removed every prefetch. The hint is T2 (into
// L2, not L1): with T0 the prefetches stalled the loop once the core's L1 miss buffers were full,
// and T2 decodes from DRAM 1.5x faster per CPU-second on Zen 4 (docs/BENCHMARKS.md, P2).
inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht2 %0" : : "m"(*p));
#elif defined(__GNUC__)
  __builtin_prefetch(p, 0, 3);
#endif
}

// Prefetches a region a few lines at a time, spread over the rows of the block being computed:
// issuing a whole region at once fills the core's miss buffers and stalls the arithmetic behind
// it, while a trickle keeps both memory and FMA units busy.
struct PrefetchStream {
  const char* next = nullptr;
  const char* end = nullptr;
  int lines_per_step = 0;

  void step() {
    for (int i = 0; i < lines_per_step && next < end; ++i, next += 64) prefetch_line(next);
  }
  void finish() {
    for (; next < end; next += 64) prefetch_line(next);
  }
};

template <typename Isa, DType D, int HD>
void attend_heads_typed(const PagedKV& kv, int seq, int layer, int kv_head_begin, int num_kv_heads,
                        int num_tokens, const float* q, float* out, float scale, const AttentionBuffers& scratch) {
  const Geometry& geo = kv.geometry;
  const int g = geo.group_size();
  const int hd = geo.head_dim;
  const int bs = geo.block_size;
  const int num_q_heads = num_kv_heads * g;
  const size_t q_elems = size_t(num_q_heads) * hd;
  if (num_tokens <= 0) {
    for (size_t i = 0; i < q_elems; ++i) out[i] = 0.0f;
    return;
  }
  const auto* pool = static_cast<const element_t<D>*>(kv.pool);
  // Tokens go in chunks of whole blocks; each chunk's scores are folded into a running max, sum and
  // output (the online softmax), so the scratch is [query heads][chunk] whatever the length.
  const int chunk_tokens = attention_chunk_tokens(bs);
  const int chunk_blocks = chunk_tokens / bs;
  const size_t stride = scratch.stride;

  float* scores = scratch.scores;
  float* query = scratch.query;
  float* acc = scratch.acc;
  float* max = scratch.max;
  float* sum = scratch.sum;
  for (size_t i = 0; i < q_elems; ++i) acc[i] = 0.0f;
  for (int h = 0; h < num_q_heads; ++h) sum[h] = 0.0f;
  // Scaling q once is cheaper than scaling every score.
  for (size_t i = 0; i < q_elems; ++i) query[i] = q[i] * scale;

  // In each block the runs of consecutive KV heads are adjacent, so the task's heads form one
  // contiguous region per (block, K or V). Regions are read chunk by chunk: the chunk's K regions,
  // then its V regions. Consecutive blocks are far apart in the pool (a block holds every layer),
  // so the hardware prefetcher stops at each region's end; prefetching kPrefetchRegions ahead (into
  // the next chunk at a chunk's end) keeps misses in flight instead of paying DRAM latency per region.
  const int num_blocks = (num_tokens + bs - 1) / bs;
  const size_t run_elems = size_t(bs) * hd;
  const size_t region_bytes = num_kv_heads * run_elems * sizeof(element_t<D>);
  auto region = [&](int r) {
    // Every chunk before the last is full, so r's chunk is r / (2 * chunk_blocks).
    const int first = r / (2 * chunk_blocks) * chunk_blocks;
    const int blocks = min_int(chunk_blocks, num_blocks - first);
    const int in_chunk = r - 2 * first;
    const int k_or_v = in_chunk < blocks ? 0 : 1;
    const int b = first + in_chunk - k_or_v * blocks;
    return pool + kv.run_offset(kv.block_of(seq, b * bs), layer, k_or_v, kv_head_begin);
  };
  // Each block's rows prefetch region r + kPrefetchRegions, one step per row of each head.
  const int lines_per_step = int((region_bytes / 64 + size_t(bs) * num_kv_heads - 1) / (size_t(bs) * num_kv_heads));
  auto prefetch_stream = [&](int r) {
    PrefetchStream pf;
    if (r < 2 * num_blocks) {
      pf.next = reinterpret_cast<const char*>(region(r));
      pf.end = pf.next + region_bytes;
      pf.lines_per_step = lines_per_step;
    }
    return pf;
  };
  for (int r = 0; r < kPrefetchRegions; ++r) prefetch_stream(r).finish();

  int r = 0;  // the region being read
  // One pass over a chunk's K or V regions, block by block, each prefetching ahead as it goes:
  // run(data, qh, heads, len, t0, pf) for each chunk of query heads of each KV head, where data is
  // that KV head's run in the block, qh the chunk's first query head, heads its size (a constant),
  // len the block's tokens and t0 the block's first token in the chunk.
  auto pass = [&](int chunk_len, auto&& run) {
    for (int t0 = 0; t0 < chunk_len; t0 += bs, ++r) {
      PrefetchStream pf = prefetch_stream(r + kPrefetchRegions);
      const int len = min_int(bs, chunk_len - t0);
      const element_t<D>* data = region(r);
      for (int i = 0; i < num_kv_heads; ++i) {
        for_head_chunks(g, [&](int h0, auto heads) { run(data + i * run_elems, i * g + h0, heads, len, t0, pf); });
      }
      pf.finish();
    }
  };
  for (int c0 = 0; c0 < num_tokens; c0 += chunk_tokens) {
    const int chunk_len = min_int(chunk_tokens, num_tokens - c0);
    pass(chunk_len, [&](const element_t<D>* k, int qh, auto heads, int len, int t0, PrefetchStream& pf) {
      Isa::template score_run<D, decltype(heads)::value, HD>(k, len, hd, query + size_t(qh) * hd,
                                                             scores + size_t(qh) * stride + t0, stride, pf);
    });
    // Fold the chunk in: a larger max rescales what was accumulated under the old one. The first
    // chunk (sum still 0) takes its own max, so a single chunk is the plain two-pass softmax.
    for (int h = 0; h < num_q_heads; ++h) {
      float* row = scores + size_t(h) * stride;
      const float chunk_max = Isa::max_of(row, chunk_len);
      if (c0 == 0) {
        max[h] = chunk_max;
      } else if (chunk_max > max[h]) {
        const float factor = __builtin_expf(max[h] - chunk_max);
        for (int d = 0; d < hd; ++d) acc[size_t(h) * hd + d] *= factor;
        sum[h] *= factor;
        max[h] = chunk_max;
      }
      sum[h] += Isa::exp_shifted_sum(row, chunk_len, max[h]);
    }
    // The numerators the caller keeps (LogitRows), with the max they are relative to.
    if (const LogitRows& keep = scratch.logits; keep.rows != nullptr && c0 + chunk_len > keep.first) {
      const int from = keep.first > c0 ? keep.first : c0;
      for (int h = 0; h < num_q_heads; ++h) {
        const float* src = scores + size_t(h) * stride + (from - c0);
        float* dst = keep.rows + size_t(h) * keep.row_stride + (from - keep.first);
        for (int t = 0; t < c0 + chunk_len - from; ++t) dst[t] = src[t];
        keep.maxes[size_t(h) * keep.max_stride + size_t(c0 / chunk_tokens)] = max[h];
      }
    }

    pass(chunk_len, [&](const element_t<D>* v, int qh, auto heads, int len, int t0, PrefetchStream& pf) {
      Isa::template accumulate_run<D, decltype(heads)::value, HD>(v, len, hd, scores + size_t(qh) * stride + t0,
                                                                  stride, acc + size_t(qh) * hd, pf);
    });
  }

  for (int h = 0; h < num_q_heads; ++h) {
    const float inv = 1.0f / sum[h];
    for (int d = 0; d < hd; ++d) out[size_t(h) * hd + d] = acc[size_t(h) * hd + d] * inv;
  }
}

}  // namespace karakv::kernels::cpu::KARAKV_ATTENTION_VARIANT
