// The karakv C++ SDK: attach to karakvd, write K/V/Q into the shared staging region, and drive
// Append / Step / Attend / ReadKV. Every call returns a status; nothing throws.
//
// Tensors are Buffers: a Buffer made by Client::alloc lives in the session's staging region and
// travels by offset (zero copy); one made by Client::alloc_heap lives in this process and travels
// inline in the RPC. Both give identical results. Layouts are documented in karakv.proto.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "karakv/kernels/types.h"

namespace karakv {

using kernels::DType;
using kernels::Geometry;

// What the client does when karakvd goes away (docs in README, "Daemon restarts"). A call that finds
// the daemon unreachable fails with UNAVAILABLE and the client probes it again on later calls, no
// sooner than the backoff allows: initial_backoff after the first failed probe, times multiplier
// after each further one, at most max_backoff, each wait scaled by a random factor in
// [1 - jitter, 1 + jitter]. When the daemon answering is a new instance (it restarted), the client
// attaches again with the same options (same staging size: the region is remapped at the same
// address with its bytes kept, so Buffers stay valid). Sequences of the old instance are lost:
// any call naming one fails with a status for which IsDaemonRestarted() is true; create them again
// and re-prefill. The lost sequence ids are never handed out again by this client.
struct ReattachOptions {
  bool enabled = true;
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(5);
  double multiplier = 2.0;
  double jitter = 0.2;
  // Failed probes after which the client stops trying (calls then fail with UNAVAILABLE saying so);
  // 0: no limit.
  int max_attempts = 0;
};

// The target an empty ClientOptions::target means: $KARAKV_TARGET when set and not empty, else
// "unix:/tmp/karakv.sock" (karakvd's default --socket).
std::string default_target();

// Where the staging region lives (ClientOptions::staging).
enum class Staging {
  kShm,     // POSIX shared memory, mapped into this process: Buffer::data() is host memory
  kDevice,  // the daemon's GPU memory, imported with cudaIpcOpenMemHandle: Buffer::data() is a
            // device pointer of this process (write it with CUDA, never dereference it on the host)
  kDeviceFd,  // the daemon's GPU memory as a VMM allocation (cuMemCreate) whose file descriptor
              // comes over karakvd's staging fd socket (SCM_RIGHTS), imported with
              // cuMemImportFromShareableHandle: for workers in another PID namespace (pods that do
              // not share one). Buffer::data() is a device pointer, as with kDevice
};

struct ClientOptions {
  // gRPC target: "unix:/path/to.sock" or "host:port". Empty: default_target(), which reads the
  // KARAKV_TARGET environment variable (the Helm chart sets it), as the karakv CLI does.
  std::string target;
  // TLS to a TCP target (karakvd --tls_cert): PEM files of the CA that signed the daemon's
  // certificate (empty: the system's roots) and, for mutual TLS (karakvd --tls_client_ca), this
  // client's certificate and key. Any of them set, or tls = true, makes the channel TLS.
  bool tls = false;
  std::string tls_ca_file, tls_cert_file, tls_key_file;
  std::string worker_id = "worker";
  std::string tenant = "default";
  // Prefix cache namespace: empty keeps cached prompts private to the tenant; a name shares them
  // across tenants (the daemon must run with --prefix_cache_shared_namespaces).
  std::string cache_namespace;
  // The model this worker runs (name and revision, or a weights hash; at most 256 printable
  // characters, no spaces). Cached prompts are shared only between sessions giving the same one,
  // and with karakvd --prefix_tier across nodes too. Empty: this session does not use the tier.
  std::string model_fingerprint;
  // Size of the staging region to ask for; 0 attaches without one (inline tensors only).
  uint64_t staging_bytes = 64ull << 20;
  // kDevice needs karakvd --backend=cuda, this SDK built with CUDA and a process that can see the
  // daemon's PID (same PID namespace). With fast_path, Step and Attend go through the ring (its
  // rings then live in a small shared-memory object of their own); Append and ReadKV use gRPC.
  // Ordering contract: synchronize the stream that wrote a call's inputs before making the call;
  // when a call returns OK its outputs are complete in device memory (karakvd synchronized its
  // stream before replying or posting the completion). Re-attaching after a daemon restart is not
  // possible with device staging (the client gives up, saying so).
  // kDeviceFd: as kDevice, but the worker need not see the daemon's PID; it needs the staging fd
  // socket (karakvd --staging_fd_socket, default "<socket>.fd") and the same GPU.
  Staging staging = Staging::kShm;
  // kDeviceFd: the daemon's staging fd socket; empty: "<path>.fd" of a "unix:<path>" target.
  std::string staging_fd_socket;
  // kDevice / kDeviceFd: order requests by CUDA interprocess events instead of host waits
  // (AttachRequest.worker_event_ipc_handle). Then, on the one stream that writes the staging
  // region: queue a request's input writes, call inputs_written(stream), send the request (no
  // synchronize), and call wait_outputs(stream) when it returns, before anything on that stream
  // reads its outputs or writes the region again. karakvd replies to Step and Attend as soon as
  // their kernels are queued (Append and ReadKV still finish first), so an OK reply does not say
  // the kernels succeeded: a fault fails a later call. Needs karakvd --stream_ordered_staging, the
  // current CUDA device at Attach set to karakvd's GPU (the event is made there), and a process
  // that sees karakvd's PID (IPC events, for kDeviceFd too). Drain the stream before Detach: the
  // region is unmapped then. Refused with shm staging.
  bool stream_ordered = false;
  // When set, Attach fails unless the daemon serves exactly this geometry.
  std::optional<Geometry> geometry;
  // Sends Heartbeat from a background thread so the lease never runs out while attached.
  bool heartbeat = true;
  absl::Duration rpc_timeout = absl::Seconds(60);
  // The fast path: Step, Attend, Append (without token ids), AppendBatch and ReadKV go through a
  // command ring in the staging region (one futex doorbell each way) instead of a gRPC round
  // trip, when every tensor of the call is in staging; other calls, and these with heap buffers,
  // use gRPC. Results, status codes and messages are the same on both paths. Needs
  // staging_bytes > 0.
  bool fast_path = false;
  // Fast path: how long to busy-wait for a completion before sleeping on the futex.
  absl::Duration ring_spin = absl::Microseconds(50);
  // Fast path: how long to wait for room in a full command ring before using gRPC instead.
  absl::Duration ring_full_wait = absl::Milliseconds(1);
  ReattachOptions reattach;
};

// True for the error of a call that named a sequence lost because karakvd restarted (status code
// ABORTED, message "... the daemon restarted; re-prefill ..."): the sequence's KV cache is gone;
// create a new sequence and append the prompt again. Such a call never returns data.
bool IsDaemonRestarted(const absl::Status& status);

// Bytes for one tensor, in staging or on the heap. Cheap to copy (heap bytes are shared).
class Buffer {
 public:
  Buffer() = default;
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool in_staging() const { return in_staging_; }
  uint64_t offset() const { return offset_; }
  template <typename T>
  std::span<T> as() const {
    return {reinterpret_cast<T*>(data_), size_ / sizeof(T)};
  }

 private:
  friend class Client;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool in_staging_ = false;
  uint64_t offset_ = 0;
  std::shared_ptr<std::vector<uint8_t>> heap_;
};

// How a sequence is compressed (docs/COMPRESSION.md): the policy, parameter overrides by name,
// and an optional one-time prefill policy for the prompt.
struct SequenceOptions {
  std::string policy = "none";  // or with a storage format: "kara+kivi4"
  std::string storage;          // kivi2, kivi4, tq2, tq3, tq4; params["residual"] sets its window
  std::map<std::string, double> params;
  std::string prefill_policy;
  std::map<std::string, double> prefill_params;
  int priority = 0;
};

// One sequence's part of a multi-sequence Append (Client::AppendBatch).
struct AppendEntry {
  uint64_t sequence_id = 0;
  int num_tokens = 0;
  Buffer k, v;               // [L][T][Hk][D] storage dtype
  Buffer q;                  // optional: [L][Nq][Hq][D] fp32, the queries of the last Nq tokens
  int num_query_tokens = 0;  // Nq
  Buffer token_ids;          // optional: [T] int32, as Append's token_ids
};

// A sequence created from the prefix cache: it already holds cached_tokens tokens (whole blocks).
struct CreatedSequence {
  uint64_t id = 0;
  int cached_tokens = 0;
};

struct PolicyStats {
  std::string policy;
  uint32_t sequences = 0;
  uint64_t resident_tokens = 0, logical_tokens = 0, compactions = 0, tokens_removed = 0, failures = 0;
  double compaction_seconds = 0;
  uint64_t kv_bytes = 0, fp16_bytes = 0;
  double nominal_ratio = 1, actual_ratio = 0;  // actual = fp16 bytes of the logical tokens / kv bytes
};

// One sequence's compaction (or, for a dry run, what it would be).
struct Compaction {
  uint64_t sequence_id = 0;
  std::string policy;
  uint32_t tokens_before = 0, tokens_after = 0;
  std::string skipped;  // why nothing was done, when nothing was
  // dry run: resident positions after compaction, [layer * num_kv_heads + head] rows
  std::vector<std::vector<int32_t>> kept;
};

struct DaemonStats {
  Geometry geometry;
  std::string backend;
  uint64_t blocks_total = 0, blocks_used = 0, blocks_free = 0, block_bytes = 0, pool_bytes = 0;
  uint64_t resident_tokens = 0, decode_steps = 0, tokens_appended = 0, lease_expiries = 0;
  uint64_t decode_tokens = 0;  // one per sequence per completed decode step
  uint64_t preemptions = 0;    // sequences preempted on pool pressure (karakvd --preempt_on_pressure)
  uint32_t sequences = 0, sessions = 0;
  uint64_t logical_tokens = 0, query_cache_bytes = 0, score_bytes = 0;
  std::vector<PolicyStats> policies;
  // Prefix cache; hit rate = prefix_hit_tokens / prefix_lookup_tokens.
  bool prefix_cache_enabled = false;
  uint64_t prefix_lookups = 0, prefix_lookup_tokens = 0, prefix_hit_tokens = 0;
  uint64_t prefix_cached_blocks = 0, prefix_unused_blocks = 0, prefix_evictions = 0, prefix_published_blocks = 0;
  bool invariants_checked = false;
  std::string invariant_error;
  // The daemon's malloc: bytes in use and bytes taken from the OS (0 under a non-glibc allocator).
  uint64_t heap_in_use_bytes = 0, heap_held_bytes = 0;
};

struct SequenceInfo {
  uint64_t id = 0;
  std::string session_id, tenant, policy, prefill_policy;
  uint32_t length = 0, blocks = 0, shared_blocks = 0;
  uint32_t logical_length = 0, prompt_length = 0, compactions = 0;
  std::string storage;
  uint32_t quantized_tokens = 0;
  uint64_t kv_bytes = 0, fp16_bytes = 0;
  double nominal_ratio = 1;
  int32_t priority = 0, pending_layer = -1;
  // Every parameter of its policy (and prefill policy) as the daemon resolved them: the defaults
  // filled in, so a record of a run says what ran, not only what was asked.
  std::map<std::string, double> params, prefill_params;
};

// One event of this session's stream (WatchEvents; karakv.proto's Event).
struct Event {
  enum class Kind { kPreempted, kCompaction, kSessionEnded, kDropped, kCompactionFailed, kDeviceFailed };
  Kind kind = Kind::kCompaction;
  uint64_t number = 0;     // 1, 2, ... per stream; 0 for kDropped
  double time_unix = 0;
  uint64_t sequence_id = 0;  // kPreempted, kCompaction, kCompactionFailed
  // kPreempted: why (the request, wanted vs free blocks, the priority rule); kSessionEnded: why;
  // kCompactionFailed: the error's code and message (a kernel's names its op); kDeviceFailed: the
  // failing call's error (karakvd's device can serve nothing more until it restarts: every
  // sequence held there is lost).
  std::string reason;
  int32_t priority = 0;
  uint32_t blocks_freed = 0, tokens_lost = 0;              // kPreempted
  std::string policy;                                      // kCompaction, kCompactionFailed
  uint32_t tokens_before = 0, tokens_after = 0;            // kCompaction
  bool lease_expired = false;                              // kSessionEnded
  uint32_t sequences_released = 0;                         // kSessionEnded
  uint64_t dropped = 0;  // kDropped: events lost because this reader fell behind
};

// A session's event stream. Next blocks until an event arrives or the stream ends.
class EventStream {
 public:
  virtual ~EventStream() = default;
  // False when the stream has ended; Finish() then says how (OK after kSessionEnded, UNAVAILABLE
  // when the daemon drains, CANCELLED after Cancel()).
  virtual bool Next(Event* event) = 0;
  virtual absl::Status Finish() = 0;
  // Ends the stream from any thread; a blocked Next returns false.
  virtual void Cancel() = 0;
};

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Attach(const ClientOptions& options);
  // Detaches (best effort) and unmaps the staging region.
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Frees everything the session owns in the daemon. Later calls fail with NOT_FOUND.
  absl::Status Detach();

  const Geometry& geometry() const;
  // The current session; it changes when the client re-attaches after a daemon restart.
  const std::string& session_id() const;
  // The daemon instance this client is attached to (random per karakvd start).
  const std::string& instance_id() const;
  // How many times this client attached again after a daemon restart, and how many probes of an
  // unreachable daemon it made in all.
  uint64_t reattaches() const;
  uint64_t reattach_probes() const;
  uint64_t staging_bytes() const;
  // Staging::kDevice: whether the region is device memory, and its generation (sent with every
  // request that addresses it; karakvd refuses a stale one).
  bool device_staging() const;
  uint64_t staging_generation() const;
  // ClientOptions::stream_ordered: whether this session is ordered by events, and the two calls
  // around each request (stream: a cudaStream_t; see ClientOptions::stream_ordered).
  // FAILED_PRECONDITION on a client that is not.
  bool stream_ordered() const;
  absl::Status inputs_written(void* stream);
  absl::Status wait_outputs(void* stream);
  // Whether Step/Attend currently go through the fast path's ring (attached with fast_path, and
  // the ring was not closed). The rings follow the staging region: they start at offset
  // staging_bytes() of the same mapping.
  bool fast_path() const;
  // Commands this client sent through the ring so far, and the times it slept in FUTEX_WAIT for a
  // completion (its spin, ClientOptions::ring_spin, ended first).
  uint64_t ring_calls() const;
  uint64_t ring_sleeps() const;

  // A buffer in the staging region (64-byte aligned, bump-allocated); RESOURCE_EXHAUSTED when the
  // region is full or absent. reset_staging() makes the whole region available again.
  absl::StatusOr<Buffer> alloc(size_t bytes);
  void reset_staging();
  // A buffer in this process's memory, sent inline.
  static Buffer alloc_heap(size_t bytes);

  // Byte sizes of the tensors of each call for this geometry.
  size_t append_bytes(int num_tokens) const;  // Append.k / Append.v
  size_t step_kv_bytes(int batch) const;      // Step.k / Step.v
  size_t q_bytes(int rows) const;             // Step.q / Step.out / Attend.q / Attend.out

  absl::StatusOr<uint64_t> CreateSequence(const std::string& policy = "none", int priority = 0);
  absl::StatusOr<uint64_t> CreateSequence(const SequenceOptions& options);
  // Starts from the longest cached prefix of `prompt_token_ids` (whole blocks, this session's cache
  // namespace); append the rest, from token cached_tokens on, with their ids.
  absl::StatusOr<CreatedSequence> CreateFromPrefix(const SequenceOptions& options,
                                                   std::span<const int32_t> prompt_token_ids);
  // How many leading tokens of a prompt the daemon has cached for this session (whole blocks).
  absl::StatusOr<int> Lookup(std::span<const int32_t> prompt_token_ids);
  absl::StatusOr<uint64_t> Fork(uint64_t sequence_id);
  // Returns how many blocks went back to the pool.
  absl::StatusOr<int> Release(uint64_t sequence_id);
  //   k, v: [L][T][Hk][D] storage dtype. Returns the sequence length after the append.
  absl::StatusOr<int> Append(uint64_t sequence_id, int num_tokens, const Buffer& k, const Buffer& v);
  // The same, with the queries of the last num_query_tokens tokens, q: [L][Nq][Hq][D] fp32 (needed
  // by a snapkv prefill policy, and by kara for tokens appended after decoding started).
  absl::StatusOr<int> Append(uint64_t sequence_id, int num_tokens, const Buffer& k, const Buffer& v,
                             const Buffer& q, int num_query_tokens);
  // The same, with the appended tokens' ids ([T] int32): full prompt blocks become shareable
  // through the prefix cache (docs/PREFIX_CACHE.md). q may be an empty Buffer (num_query_tokens 0).
  // With the fast path, ids that lie in the staging region (written into a Buffer from alloc())
  // keep the Append on the ring; ids anywhere else send it through gRPC.
  absl::StatusOr<int> Append(uint64_t sequence_id, std::span<const int32_t> token_ids, const Buffer& k,
                             const Buffer& v, const Buffer& q = Buffer(), int num_query_tokens = 0);
  // Several sequences' Appends in one call (a prefill batch), in order, each as its own Append;
  // returns each entry's sequence length after it. The first refused entry stops the batch and
  // leaves no trace; the entries before it stay applied (the error names the entry). With the
  // fast path and every buffer in staging (at most ring::Command::kMaxAppends = 50 entries) it is
  // one ring command, else one AppendBatch RPC.
  absl::StatusOr<std::vector<int>> AppendBatch(std::span<const AppendEntry> entries);
  //   k, v: [B][Hk][D] storage dtype; q: [B][Hq][D] fp32; out: [B][Hq][D] fp32.
  // Returns the daemon's decode-step counter.
  absl::StatusOr<uint64_t> Step(int layer, std::span<const uint64_t> sequence_ids, const Buffer& k,
                                const Buffer& v, const Buffer& q, const Buffer& out, float scale = 0);
  //   q, out: [N][Hq][D] fp32; query i sits at position length - N + i (causal).
  absl::Status Attend(uint64_t sequence_id, int layer, int num_queries, const Buffer& q,
                      const Buffer& out, float scale = 0);
  // Runs the policy of `sequence_id` (0: every sequence of this session) now; dry_run changes
  // nothing and returns the positions that would stay.
  absl::StatusOr<std::vector<Compaction>> Compact(uint64_t sequence_id, bool dry_run = false);
  // Copies the sequence's resident K/V ([L][T][Hk][D]) and positions ([L][Hk][T] int32) into the given
  // buffers, which must be large enough; returns T.
  absl::StatusOr<int> ReadKV(uint64_t sequence_id, const Buffer& k, const Buffer& v,
                             const Buffer& positions);
  absl::StatusOr<DaemonStats> Stats(bool check_invariants = false);
  // Sequences of this session.
  absl::StatusOr<std::vector<SequenceInfo>> ListSequences();
  absl::Status Heartbeat();
  absl::Status Ping();
  // This session's events from now on: preempted sequences (karakvd --preempt_on_pressure),
  // compactions, the session's end. Returns once the daemon has subscribed the stream (or refused
  // it: then Next returns false and Finish says why).
  absl::StatusOr<std::unique_ptr<EventStream>> WatchEvents();

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  absl::StatusOr<int> AppendWithIds(uint64_t sequence_id, int num_tokens, const Buffer& k, const Buffer& v,
                                    const Buffer& q, int num_query_tokens, std::span<const int32_t> token_ids);
  std::unique_ptr<Impl> impl_;
};

}  // namespace karakv
