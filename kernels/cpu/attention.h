// The CPU attention core: some KV heads and the query heads that share them (GQA groups) over a
// sequence's paged K/V. decode_attention and causal_attention are loops of this over sequences or
// queries (and KV heads).
#pragma once

#include <vector>

#include "karakv/kernels/cpu_isa.h"
#include "karakv/kernels/types.h"

namespace karakv::kernels::cpu {

// Tokens per chunk of the online softmax: attend_heads scores at most this many tokens (rounded
// down to whole blocks, at least one block) before folding them into the running result, so its
// scratch holds query heads x chunk floats whatever the sequence's length.
constexpr int kAttentionChunkTokens = 512;

// The chunk attend_heads uses for this block size: whole blocks, at least one.
inline int attention_chunk_tokens(int block_size) {
  return block_size >= kAttentionChunkTokens ? block_size : kAttentionChunkTokens / block_size * block_size;
}

// Per-thread buffers reused across calls so the hot path never allocates once warm. Their size
// depends on the heads of a call and the block size, never on the number of tokens.
struct AttentionScratch {
  std::vector<float> scores;   // [query heads][chunk tokens]
  std::vector<float> query;    // [query heads][head_dim], pre-scaled
  std::vector<float> acc;      // [query heads][head_dim]
  std::vector<float> max;      // [query heads] running max of the scores seen
  std::vector<float> sum;      // [query heads] running sum of exp(score - max)
};

// Where attend_heads also leaves the softmax numerators of tokens [first, num_tokens), as the
// online softmax makes them: exp(logit - m) with logit = q . k * scale and m the running max of
// query head h when the token's chunk (of attention_chunk_tokens) was folded in, which it leaves
// at maxes[h * max_stride + c] for chunk c (every chunk holding a token from `first` on). Row h is
// at rows + h * row_stride, token t at t - first. The probability of a token is its numerator
// times exp(m - lse): the decode observers take it so once the normaliser is known, with their
// keys read once and no second exponential per token.
struct LogitRows {
  float* rows = nullptr;  // null: none wanted
  int first = 0;
  size_t row_stride = 0;
  float* maxes = nullptr;  // [query heads][max_stride], with rows
  size_t max_stride = 0;
};

// The scratch as the attention variants see it: attend_heads sizes it, the variants only use it.
struct AttentionBuffers {
  float* scores;   // [query heads][stride]
  float* query;    // [query heads][head_dim]
  float* acc;      // [query heads][head_dim]
  float* max;      // [query heads]
  float* sum;      // [query heads]
  size_t stride;   // min(chunk tokens, num_tokens), at least 1
  LogitRows logits;
};

// softmax(q . k * scale) . v for the query heads of KV heads [kv_head_begin, kv_head_begin +
// num_kv_heads) (each KV head's group of group_size query heads), over tokens [0, num_tokens) of
// sequence `seq` at `layer`. Reads every K and V element once for all query heads that use it.
// num_tokens == 0 writes zeros. Arguments are assumed validated by the caller, `isa` included
// (cpu_isa_missing(isa) is empty: the backend checks it once when it is made).
// With lse non-null and num_tokens > 0, lse[j] = query head j's log-sum-exp of its scaled logits
// (the softmax's normaliser, from the online softmax's own max and sum); with logits.rows
// non-null, the softmax numerators of tokens [logits.first, num_tokens) and their chunks' maxes
// (LogitRows).
//   q:   [num_kv_heads * group_size][head_dim] fp32
//   out: [num_kv_heads * group_size][head_dim] fp32
//   lse: null or [num_kv_heads * group_size] fp32
void attend_heads(const PagedKV& kv, int seq, int layer, int kv_head_begin, int num_kv_heads,
                  int num_tokens, const float* q, float* out, float scale,
                  AttentionScratch& scratch, CpuIsa isa, float* lse = nullptr, LogitRows logits = {});

// The variants behind attend_heads, with the scratch already sized: the build's baseline
// (attention.cc) and, where this build has it, AVX-512 (attention_avx512.cc).
namespace baseline {
void attend_heads(const PagedKV& kv, int seq, int layer, int kv_head_begin, int num_kv_heads, int num_tokens,
                  const float* q, float* out, float scale, const AttentionBuffers& scratch);
}  // namespace baseline
#if KARAKV_HAVE_AVX512_ATTENTION
namespace avx512 {
void attend_heads(const PagedKV& kv, int seq, int layer, int kv_head_begin, int num_kv_heads, int num_tokens,
                  const float* q, float* out, float scale, const AttentionBuffers& scratch);
}  // namespace avx512
#endif

}  // namespace karakv::kernels::cpu
