// The op set every kernel backend implements. The server talks only to this interface, so the CUDA
// backend slots in beside the CPU one without server changes.
//
// Memory: the pool (PagedKV::pool) is memory from allocate(). Tensors (q, out, k, v) are memory from
// allocate() or host memory; a backend with memory of its own (CUDA) copies host tensors in and
// out. Tables and index arrays (block_table, table_offset, seq_len, kept, dst_blocks, the scores
// given to top_k, token2chunk and cam_merge_values) are host memory. score_acc's accumulators are
// host memory or memory from allocate() (then added into where the backend computes, with no copy
// back). copy_in / copy_out move bytes between host memory and memory from allocate(), or between
// two places of memory from allocate().
#pragma once

#include <cstring>
#include <memory>
#include <string>
#include <string_view>

#include "karakv/kernels/cpu_isa.h"
#include "karakv/kernels/cuda_attention.h"
#include "karakv/kernels/types.h"

namespace karakv::kernels {

// Device memory another process maps (device staging): one allocation of its own, because legacy
// CUDA IPC maps whole allocations, exported as a CUDA IPC memory handle.
inline constexpr size_t kSharedMemoryAlignment = size_t(2) << 20;  // sizes round up to 2 MiB
struct SharedDeviceMemory {
  void* ptr = nullptr;     // this process's device pointer
  size_t bytes = 0;        // a multiple of kSharedMemoryAlignment
  int device = -1;         // the CUDA device ordinal
  std::string ipc_handle;  // cudaIpcMemHandle_t, 64 bytes
};

// An event another process can wait on or record (stream-ordered device staging): a CUDA
// interprocess event. Made or opened by the backend, destroyed by destroy_shared_event().
struct SharedEvent {
  void* event = nullptr;   // this process's cudaEvent_t
  std::string ipc_handle;  // cudaIpcEventHandle_t, 64 bytes (an event this process made; empty when opened)
};

enum class Op : uint8_t {
  kWriteKV,
  kDecodeAttention,
  kCausalAttention,
  kReadKV,
  kCopyBlock,
  kWindowScores,
  kSnapKVScores,
  kTopK,
  kToken2Chunk,
  kGatherTokens,
  kDecodeAttentionAccumulate,
  kQuantize,
  kDequantize,
  kQuantizedAttention,
  kCamMerge,
  kDecodeAttentionObserve,
  kWindowScoresObserved,
  // Optional (the daemon gathers into fresh blocks where a backend has not got it):
  kGatherTokensInPlace,
};
const char* op_name(Op op);

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string_view name() const = 0;
  // The name plus what it runs on, for logs (e.g. the GPU's model).
  virtual std::string description() const { return std::string(name()); }
  // Whether `op` runs on this backend for storage dtype `dtype`; the server refuses what is not.
  virtual bool supports(Op op, DType dtype) const = 0;

  // Makes what kernels called from this thread need, so a long-lived serving thread pays for it
  // when it starts instead of in its first request (the CPU backend: its pool's helper threads,
  // shared by every calling thread, if not started yet). Optional; kernels work without it.
  virtual void prepare_thread() {}

  // Memory for the block pool. Returned memory is zero-filled.
  virtual KernelStatus allocate(size_t bytes, void** out) = 0;
  virtual void free(void* ptr) = 0;
  // Host memory to / from memory from allocate(), or memory from allocate() to memory from
  // allocate() (plain memcpy on a host-memory backend).
  virtual KernelStatus copy_in(void* dst, const void* src, size_t bytes) {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return KernelStatus::ok();
  }
  virtual KernelStatus copy_out(void* dst, const void* src, size_t bytes) {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return KernelStatus::ok();
  }

  // Whether allocate_shared can work (the backend has device memory).
  virtual bool shares_device_memory() const { return false; }
  // Device staging: `bytes` (rounded up to kSharedMemoryAlignment) of zero-filled device memory
  // exported for another process. Backends without device memory refuse with kUnsupported.
  virtual KernelStatus allocate_shared(size_t bytes, SharedDeviceMemory* out) {
    return KernelStatus::unsupported(std::string(name()) + " backend has no device memory to share");
  }
  virtual void free_shared(const SharedDeviceMemory& memory) {}
  // Whether `p` is device memory of this backend (a device staging pointer): the server never
  // reads such bytes on the host, it moves them with copy_in / copy_out (which take device
  // memory on either side).
  virtual bool is_device_memory(const void* p) const { return false; }

  // Stream order. A backend whose ops run asynchronously on a device (CUDA) waits at the end of
  // every op until its work is done, unless the calling thread has deferred waits: then an op
  // whose outputs are all device memory returns once its work is queued (in order, on the
  // backend's one stream), and ops with host outputs still wait (for everything queued before
  // them too). A fault in a deferred op surfaces at the next wait, naming the ops queued without
  // one. Host-memory backends run every op to completion and ignore both calls.
  virtual void set_deferred(bool on) {}
  // Waits for every op queued so far (from any thread).
  virtual KernelStatus synchronize() { return KernelStatus::ok(); }
  // Why this backend can run nothing more until the process restarts (a CUDA kernel fault: the
  // context is lost, and every later call fails with it), or empty. Set by the call that first met
  // it, whose own error says the same.
  virtual std::string fault() const { return {}; }
  // Interprocess events (CUDA IPC events, stream-ordered device staging): make one to export, open
  // another process's, and order the backend's stream after the other process's last record
  // (wait_event) or record this process's point in it (record_event). Backends without a device
  // refuse with kUnsupported.
  virtual KernelStatus create_shared_event(SharedEvent* out) {
    return KernelStatus::unsupported(std::string(name()) + " backend has no device events");
  }
  virtual KernelStatus open_shared_event(const std::string& ipc_handle, SharedEvent* out) {
    return KernelStatus::unsupported(std::string(name()) + " backend has no device events");
  }
  virtual void destroy_shared_event(SharedEvent* event) {}
  virtual KernelStatus wait_event(const SharedEvent& event) {
    return KernelStatus::unsupported(std::string(name()) + " backend has no device events");
  }
  virtual KernelStatus record_event(const SharedEvent& event) {
    return KernelStatus::unsupported(std::string(name()) + " backend has no device events");
  }

  // Writes tokens [start_pos, start_pos + num_tokens) of sequence `seq` for layers
  // [layer_begin, layer_begin + num_layers). The blocks covering them must already be in the
  // sequence's table.
  //   k, v: [num_layers][num_tokens][num_kv_heads][head_dim] in kv.geometry.dtype
  virtual KernelStatus write_kv(const PagedKV& kv, int seq, int start_pos, int num_tokens,
                                int layer_begin, int num_layers, const void* k,
                                const void* v) = 0;

  // A decode step's writes: one token of every sequence s in [0, kv.num_seqs), at slot
  // positions[s] of `layer`, as write_kv(kv, s, positions[s], 1, layer, 1, ...) for each s in turn
  // (what this default does); a backend whose calls cost more than their copies (a device: one
  // table upload, launch and synchronize per call) does it in one call. Every position is checked
  // against its sequence's table before anything is written, and a refusal names the sequence;
  // this default leaves the pool-size check to write_kv (a block id past the pool is refused after
  // the earlier sequences were written), the CPU and CUDA backends make it up front too.
  //   positions: [num_seqs] host memory
  //   k, v: [num_seqs][num_kv_heads][head_dim] in kv.geometry.dtype
  virtual KernelStatus write_step_kv(const PagedKV& kv, int layer, const int32_t* positions, const void* k,
                                     const void* v);

  // One query per sequence over its first seq_len[s] tokens at `layer`, GQA (query head j reads
  // KV head j / group_size), fp32 accumulation, softmax(q.k * scale).
  //   q:   [num_seqs][num_q_heads][head_dim] fp32
  //   out: [num_seqs][num_q_heads][head_dim] fp32
  virtual KernelStatus decode_attention(const PagedKV& kv, int layer, const float* q, float* out,
                                        float scale) = 0;

  // Several queries of sequence `seq` at `layer`: query i sits at position
  // seq_len[seq] - num_queries + i and attends to positions 0..that position (causal).
  //   q:   [num_queries][num_q_heads][head_dim] fp32
  //   out: [num_queries][num_q_heads][head_dim] fp32
  virtual KernelStatus causal_attention(const PagedKV& kv, int seq, int layer, int num_queries,
                                        const float* q, float* out, float scale) = 0;

  // decode_attention that also adds each key's attention probability, summed over the group's
  // query heads, into per-slot accumulators (H2O's heavy-hitter scores, Kara's decode observers).
  // For sequence s and KV head h, score_acc[s * num_kv_heads + h] is null (no accumulation) or
  // points to seq_len[s] floats, of which slots [acc_begin[s], seq_len[s]) get their probability
  // added (slot t into acc[t]). The accumulators of one sequence are all host memory or all memory
  // from allocate() (H2O keeps its sums there, so that on a GPU nothing is copied back per layer);
  // the probabilities are the softmax over all seq_len[s] keys whatever acc_begin says. acc_begin null: from slot 0. Older slots that a policy never reads
  // again (Kara's compressed prompt and windows) then cost neither the scoring pass nor, on a
  // device, the copy back.
  //   acc_begin: null or [num_seqs] int32, 0 <= acc_begin[s] <= seq_len[s]
  virtual KernelStatus decode_attention_accumulate(const PagedKV& kv, int layer, const float* q, float* out,
                                                   float scale, float* const* score_acc, const int32_t* acc_begin) {
    return KernelStatus::unsupported("decode_attention_accumulate");
  }

  // decode_attention_accumulate for Kara's decode-time observers (docs/COMPRESSION.md section 1):
  // score_acc and acc_begin as above (any score_acc entry may be null), and for sequence s with
  // lse[s] non-null, each query head's log-sum-exp of its scaled logits over the seq_len[s] keys
  // it attends (the softmax's normaliser: p_i = exp(q . k_i * scale - lse)).
  //   lse: [num_seqs] pointers, each null or to [num_q_heads] fp32
  virtual KernelStatus decode_attention_observe(const PagedKV& kv, int layer, const float* q, float* out,
                                                float scale, float* const* score_acc, const int32_t* acc_begin,
                                                float* const* lse) {
    return KernelStatus::unsupported("decode_attention_observe");
  }

  // Copies the first seq_len[seq] tokens of sequence `seq`, all layers, out of the pool.
  //   k, v: [num_layers][seq_len][num_kv_heads][head_dim] in kv.geometry.dtype
  virtual KernelStatus read_kv(const PagedKV& kv, int seq, void* k, void* v) = 0;

  // Copies one whole block (every layer and head) from block `src` to block `dst` (copy on write).
  virtual KernelStatus copy_block(const PagedKV& kv, int32_t src, int32_t dst) = 0;

  // ---- compression (docs/COMPRESSION.md). "Slot" is a token's index in the sequence's resident
  // cache (0..seq_len-1); scores and selections are per slot. A backend that does not implement an
  // op says so in supports(); the defaults below refuse.

  // Kara's bidirectional window score at `layer`, for every KV head h: with Qw_j the window
  // queries of query head j of h's group and Kw the keys at slots [slot_begin, slot_begin + window)
  // (window tokens only, no mask),
  //   out[h][i] = sum_j sum_t softmax_row(Qw_j . Kw^T * scale)[t][i]
  //   q:   [window][num_q_heads][head_dim] fp32
  //   out: [num_kv_heads][window] fp32
  virtual KernelStatus window_scores(const PagedKV& kv, int seq, int layer, int slot_begin, int window,
                                     const float* q, float scale, float* out) {
    return KernelStatus::unsupported("window_scores");
  }

  // window_scores with Kara version 2's options. Query t's probabilities are
  //   p_t[i] = exp(Qw_t . Kw_i * scale - lse[t][j])   where lse[t][j] is finite (norm = full: the
  //            normaliser of the query's own decode step, decode_attention_observe), else
  //   p_t[i] = softmax_row(Qw_t . Kw^T * scale)[i]    over the window's keys (norm = window),
  // and with later_keys_only only keys after the query count (i > t: the part of the window no
  // decode step saw, observers = both); otherwise every (t, i).
  //   lse: null (every row: window softmax) or [window][num_q_heads] fp32
  virtual KernelStatus window_scores_observed(const PagedKV& kv, int seq, int layer, int slot_begin, int window,
                                              const float* q, float scale, const float* lse, bool later_keys_only,
                                              float* out) {
    return KernelStatus::unsupported("window_scores_observed");
  }

  // SnapKV scores at `layer`, n = seq_len[seq]: the queries of the last `num_obs` slots attend to
  // the keys of all n slots, causally inside the observation window (query i, at slot
  // n - num_obs + i, sees slots 0..n - num_obs + i). Per key and KV head: the mean of the
  // attention over the num_obs queries and the group's query heads. Then the prefix slots
  // [0, n - num_obs) are smoothed by an average pool of width `pool` (zero padding, divisor
  // `pool`, as avg_pool1d with count_include_pad); window slots keep their raw mean.
  //   q:   [num_obs][num_q_heads][head_dim] fp32
  //   out: [num_kv_heads][n] fp32
  virtual KernelStatus snapkv_scores(const PagedKV& kv, int seq, int layer, int num_obs, const float* q,
                                     float scale, int pool, float* out) {
    return KernelStatus::unsupported("snapkv_scores");
  }

  // The selections run on `rows` independent rows of n scores at once (a policy's every
  // (layer, KV head) row in one call: on a device one upload, one launch and one synchronize per
  // compaction instead of one per row). Row r reads scores[r * n, (r + 1) * n) and writes its
  // indices, 0..n-1 within the row, to its own part of out.

  // The `k` largest of each row, ties broken by the lower index; indices written ascending.
  //   scores: [rows][n] fp32; out: [rows][k] int32; rows >= 1
  virtual KernelStatus top_k(const float* scores, int rows, int n, int k, int32_t* out) {
    return KernelStatus::unsupported("top_k");
  }

  // Kara's Token2Chunk selection over each row (one window of n scores): the `num_candidates` top
  // tokens (top_k rule), chunks between consecutive candidates with 1..max_gap interior tokens
  // scored by the smaller end score and taken greedily in descending score (ties: lower position)
  // while they fit, then a fill with the best remaining tokens: exactly `budget` indices per row,
  // ascending.
  //   scores: [rows][n] fp32; out: [rows][budget] int32; rows >= 1
  virtual KernelStatus token2chunk(const float* scores, int rows, int n, int budget, int num_candidates, int max_gap,
                                   int32_t* out) {
    return KernelStatus::unsupported("token2chunk");
  }

  // CaM version 2, the convex normalised merge (docs/COMPRESSION.md section 3), after gather_tokens
  // wrote the kept tokens of slots [begin, end) to dst_blocks. Per (layer, KV head) row, with a the
  // row's scores and M = merge_tokens, each evicted slot e of the range (not in the row's kept list)
  // merges its value into its targets T(e): the next M kept tokens after it in the row (fewer where
  // fewer follow); when no kept token follows e, the row's last min(M, num_kept) kept tokens (the
  // nearest before it). With the gate p_e = min(1, a_e / mean(a_k for k in T(e))) and the equal
  // share 1 / |T(e)|, c_e = p_e * a_e / |T(e)| and each kept value becomes the weighted mean
  //   V'_k = (a_k V_k + sum_{e: k in T(e)} c_e V_e) / (a_k + sum_{e: k in T(e)} c_e),
  // a convex combination, so ||V'_k|| never exceeds the largest norm among its inputs. Keys are not
  // changed. Edge cases: negative and non-finite scores are read as 0 (never refused); when
  // mean(a_k over T(e)) is 0, p_e = 1 if a_e > 0 (the targets carry no mass, the evicted token
  // does), else 0; a kept token that absorbs no weight (including a zero denominator) keeps V_k
  // exactly; num_kept = 0 writes nothing. V_e is read from the sequence's (still intact) blocks.
  // Sums are formed in double in ascending slot order (cpu/quant.h's cam_merge has the exact
  // arithmetic), and each kept value is rounded to fp32 and written once. Deterministic.
  //   kept:   [num_layers][num_kv_heads][num_kept] source slots, ascending per row
  //   scores: [num_layers][num_kv_heads][end - begin] the policy's score of every slot of the range
  //           (kept slots' own a_k included)
  virtual KernelStatus cam_merge_values(const PagedKV& kv, int seq, int begin, int end, const int32_t* kept,
                                        int num_kept, const float* scores, int merge_tokens,
                                        const int32_t* dst_blocks) {
    return KernelStatus::unsupported("cam_merge_values");
  }

  // ---- quantized storage (docs/COMPRESSION.md section 3) ----

  // Bytes of the quantized run of n tokens of one (layer, K/V, head) in `format`, and the most
  // tokens (a multiple of block_size and of the format's group) whose K and V runs both fit in
  // one block's run; 0 when the format cannot hold the geometry (e.g. KIVI needs head_dim % 32 == 0).
  virtual int quantized_tokens_per_block(const Geometry& g, QuantFormat format) const { return 0; }

  // Quantizes unquantized slots [slot_begin, slot_begin + q.tokens_per_block) of sequence `seq`
  // (kv's blocks) into block `dst`, every layer and KV head.
  virtual KernelStatus quantize_tokens(const PagedKV& kv, int seq, int slot_begin, const QuantizedKV& q,
                                       int32_t dst) {
    return KernelStatus::unsupported("quantize_tokens");
  }

  // Dequantizes quantized block `block` into dense K and V in the storage dtype.
  //   k, v: [num_layers][tokens_per_block][num_kv_heads][head_dim]
  virtual KernelStatus dequantize_block(const PagedKV& kv, const QuantizedKV& q, int32_t block, void* k, void* v) {
    return KernelStatus::unsupported("dequantize_block");
  }

  // decode_attention over each sequence's quantized tokens followed by its kv.seq_len[s]
  // unquantized ones, straight from the codes; with score_acc, acc_begin and lse as
  // decode_attention_observe, slots counted over the whole sequence (quantized ones first).
  //   q, out: [num_seqs][num_q_heads][head_dim] fp32
  //   score_acc: null, or [num_seqs * num_kv_heads] pointers, each null or to
  //              qkv.quantized(s) + seq_len[s] floats
  //   acc_begin: null (from slot 0) or [num_seqs], 0 <= acc_begin[s] <= qkv.quantized(s) + seq_len[s]
  //   lse: null, or [num_seqs] pointers, each null or to [num_q_heads] fp32 (Kara's norm = full)
  virtual KernelStatus decode_attention_quantized(const PagedKV& kv, const QuantizedKV& qkv, int layer,
                                                  const float* q, float* out, float scale,
                                                  float* const* score_acc, const int32_t* acc_begin,
                                                  float* const* lse) {
    return KernelStatus::unsupported("decode_attention_quantized");
  }

  // causal_attention over a sequence with a quantized prefix: query i sees every quantized token
  // and unquantized slots 0..seq_len - num_queries + i.
  virtual KernelStatus causal_attention_quantized(const PagedKV& kv, const QuantizedKV& qkv, int seq, int layer,
                                                  int num_queries, const float* q, float* out, float scale) {
    return KernelStatus::unsupported("causal_attention_quantized");
  }

  // Gathers kept tokens of sequence `seq` into fresh blocks, every layer and KV head in one call:
  // for (l, h), source slot kept[l][h][i] goes to slot i of the destination, i < num_kept.
  // Destination blocks must not be any of the sequence's source blocks.
  //   kept:       [num_layers][num_kv_heads][num_kept] int32, each row ascending
  //   dst_blocks: [ceil(num_kept / block_size)] int32 block ids
  virtual KernelStatus gather_tokens(const PagedKV& kv, int seq, const int32_t* kept, int num_kept,
                                     const int32_t* dst_blocks) {
    return KernelStatus::unsupported("gather_tokens");
  }
  // gather_tokens into the sequence's own blocks: for (l, h), source slot kept[l][h][i] goes to
  // slot begin + i, i < num_kept. Each row strictly ascending within [begin, seq_len), so
  // kept[i] >= begin + i and every slot is read before anything is written to it. Slots before
  // begin and from begin + num_kept on are not written; a slot already in place is not copied.
  // The caller makes sure no other sequence shares the blocks written. Optional: the daemon
  // gathers into fresh blocks on a backend without it (supports(kGatherTokensInPlace) false).
  //   kept: [num_layers][num_kv_heads][num_kept] int32
  virtual KernelStatus gather_tokens_in_place(const PagedKV& kv, int seq, int begin, const int32_t* kept,
                                              int num_kept) {
    return KernelStatus::unsupported("gather_tokens_in_place");
  }

 protected:
  // write_step_kv's writes, write_kv per sequence in turn, for an override that checked the step
  // whole already (each write_kv still checks its own token).
  KernelStatus write_step_kv_per_sequence(const PagedKV& kv, int layer, const int32_t* positions, const void* k,
                                          const void* v);
};

// The reference backend: host memory, multi-threaded over sequences and heads. num_threads <= 0
// uses the CPUs this process may use (usable_cpus() in karakv/kernels/cpus.h: the affinity mask
// capped by the cgroup CPU quota). Kernels run on the calling thread, and their parallel loops
// share chunks with the backend's one pool of num_threads - 1 helpers (kernels/cpu/work_pool.h),
// whichever threads call; a helper that is not scheduled never holds a call up.
// Attention runs with $KARAKV_CPU_ISA (auto, avx2, avx512; karakv/kernels/cpu_isa.h) and the
// scorers' products with $KARAKV_CPU_GEMM (auto, tile, libxsmm), unset meaning the best this CPU and
// build have; a value that is invalid or cannot run here is reported on stderr and the best is used
// (karakvd refuses to start instead).
std::unique_ptr<Backend> make_cpu_backend(int num_threads = 0);
// The same with the attention's ISA (and the scorers' products: best_cpu_gemm() when not given);
// null, with the reason in *error when error is non-null, when this build or CPU cannot run them
// (cpu_isa_missing, cpu_gemm_missing).
std::unique_ptr<Backend> make_cpu_backend(int num_threads, CpuIsa isa, std::string* error);
std::unique_ptr<Backend> make_cpu_backend(int num_threads, CpuIsa isa, CpuGemm gemm, std::string* error);

// The CUDA backend on GPU `device` (kernels/cuda). Returns null, with the reason in *error when
// error is non-null, when this build has no CUDA backend, no driver or device works, or `device`
// is out of range; it never aborts. Its decode attention is $KARAKV_CUDA_ATTENTION's and its
// quantized decode $KARAKV_CUDA_QUANT_DECODE's (karakv/kernels/cuda_attention.h); a value that is invalid or that this build cannot run is
// reported on stderr and the default is used (karakvd refuses to start instead).
std::unique_ptr<Backend> make_cuda_backend(int device, std::string* error);
// The same with the decode attention given (null with the reason when this build lacks it), and
// the default quantized decode; or with both given ($KARAKV_CUDA_QUANT_DECODE reads the second).
std::unique_ptr<Backend> make_cuda_backend(int device, CudaAttention attention, std::string* error);
std::unique_ptr<Backend> make_cuda_backend(int device, CudaAttention attention, CudaQuantDecode quant,
                                           std::string* error);
// Whether this build contains the CUDA backend (nvcc was found when it was configured).
bool cuda_backend_built();

}  // namespace karakv::kernels
