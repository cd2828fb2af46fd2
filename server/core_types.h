// The values the daemon's core hands out: events, sequence options and info, compaction results,
// stats. Plain structs shared by the core's owners (sessions, sequence store, compactor) and the
// transports above them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "server/sequence.h"

namespace karakv::server {

// What the event stream (WatchEvents) tells a session about its own sequences. Emitted under the
// core's lock: observers must not block or call back into the core.
struct CoreEvent {
  enum class Kind { kPreempted, kCompaction, kSessionEnded, kCompactionFailed, kDeviceFailed };
  Kind kind = Kind::kCompaction;
  std::string session_id;
  uint64_t sequence_id = 0;
  // kPreempted: why (wanted vs free blocks, the request, the priority rule); kSessionEnded: why;
  // kCompactionFailed: the error (its code, then the message; a kernel's names its op);
  // kDeviceFailed: the backend's fault (Backend::fault), to every session.
  std::string message;
  int32_t priority = 0;       // kPreempted: the victim's
  int32_t blocks_freed = 0;   // kPreempted: blocks that went back to the pool
  int32_t tokens = 0;         // kPreempted: resident tokens lost
  // kCompaction, kCompactionFailed
  std::string policy;
  int32_t tokens_before = 0, tokens_after = 0;
  // kSessionEnded
  int32_t sequences_released = 0;
  bool lease_expired = false;
};

struct SequenceOptions {
  // "kara", or a policy with a storage format: "kara+kivi4". Formats: kivi2, kivi4, tq2, tq3, tq4.
  std::string policy = "none";
  // The storage format alone (same as the "+format" suffix); params["residual"] sets its
  // full-precision window (default 128 tokens).
  std::string storage;
  std::map<std::string, double> params;
  std::string prefill_policy;
  std::map<std::string, double> prefill_params;
  int32_t priority = 0;
  // Start from the longest cached prefix of these prompt token ids (whole blocks only).
  std::vector<int32_t> prefix_token_ids;
};

// One compaction, as the scheduler or the Compact RPC ran it (or would, for a dry run).
struct CompactionResult {
  uint64_t sequence_id = 0;
  std::string policy;
  int32_t tokens_before = 0, tokens_after = 0;
  std::string skipped;                       // non-empty: nothing was done, and why
  std::map<std::string, double> params;      // the policy's resolved parameters
  std::vector<std::vector<int32_t>> kept;    // dry run: [L * Hk] resident positions after
  double seconds = 0;
};

struct PolicyStats {
  int32_t sequences = 0;
  uint64_t resident_tokens = 0, logical_tokens = 0;
  uint64_t kv_bytes = 0, fp16_bytes = 0;  // actual compression ratio = fp16_bytes / kv_bytes
  double nominal_ratio = 1.0;
  uint64_t compactions = 0, tokens_removed = 0, failures = 0;
  double seconds = 0;
};

struct AttachResult {
  std::string session_id;
  std::string cache_namespace;
  std::string staging_name;
  uint64_t staging_bytes = 0;
  // Device staging: the region's CUDA IPC handle bytes, device ordinal and generation.
  std::string staging_ipc_handle;
  int staging_device = -1;
  uint64_t staging_generation = 0;
  // Stream-ordered device staging: the daemon's interprocess event handle (64 bytes), else empty.
  std::string staging_event_ipc_handle;
};

struct SequenceInfo {
  uint64_t id = 0;
  std::string session_id;
  std::string tenant;
  std::string policy;
  std::string prefill_policy;
  int32_t length = 0;          // resident
  int32_t logical_length = 0;  // ever appended
  std::string storage;         // "" (the daemon's dtype) or a quantized format
  int32_t quantized = 0;       // resident tokens held in quantized blocks
  int32_t quantized_blocks = 0;
  // docs/COMPRESSION.md section 4: bytes of the blocks the sequence holds (codes, scales, norms,
  // the full-precision window, partly filled blocks) and what its logical tokens take in fp16.
  uint64_t kv_bytes = 0, fp16_bytes = 0;
  double nominal_ratio = 1.0;  // of the storage format alone: 16 / bits
  int32_t prompt_length = 0;
  int32_t compactions = 0;
  int32_t blocks = 0;
  int32_t shared_blocks = 0;
  int32_t priority = 0;
  int32_t pending_layer = -1;
  // The policy's and the prefill policy's parameters as resolved (defaults filled in).
  std::map<std::string, double> params, prefill_params;
};

struct CoreStats {
  int32_t blocks_total = 0;
  int32_t blocks_used = 0;
  int32_t blocks_free = 0;
  uint64_t resident_tokens = 0;
  int32_t sequences = 0;
  int32_t sessions = 0;
  uint64_t decode_steps = 0;
  uint64_t tokens_appended = 0;
  uint64_t decode_tokens = 0;  // tokens added by completed decode steps (one per sequence per step)
  uint64_t lease_expiries = 0;
  uint64_t preemptions = 0;    // sequences preempted on pool pressure (--preempt_on_pressure)
  uint64_t logical_tokens = 0;
  uint64_t query_cache_bytes = 0;
  uint64_t score_bytes = 0;
  std::map<std::string, PolicyStats> policies;
  // Prefix cache: lookups (Lookup calls and CreateSequence from a prefix), the tokens they asked
  // about and found, blocks indexed (of which no sequence holds `unused`), evictions.
  uint64_t prefix_lookups = 0, prefix_lookup_tokens = 0, prefix_hit_tokens = 0;
  int32_t prefix_cached_blocks = 0, prefix_unused_blocks = 0;
  int32_t tier_pinned_blocks = 0;  // blocks the prefix tier's writer holds until written
  uint64_t prefix_evictions = 0, prefix_published_blocks = 0;
  // Per tenant with at least one attached session: block-table entries its sequences hold (as
  // --tenant_block_quota counts them: a block shared by two of them counts twice); 0 when none.
  std::map<std::string, int64_t> tenant_blocks;
};

// Where ReadKV writes, chosen by the caller once the token count is known.
struct ReadKVTargets {
  MutableBytes k, v, positions;
};

}  // namespace karakv::server
