// karakvd's configuration: one immutable object built from flags and an optional config file at
// start-up, then handed to each component. Nothing below main() reads flags.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core.h"

namespace karakv::server {

struct DaemonConfig {
  CoreConfig core;  // core.preempt_on_pressure: --preempt_on_pressure
  std::string socket_path;   // Unix domain socket; empty disables it
  std::string tcp_address;   // host:port; empty disables TCP
  std::string metrics_listen;
  std::string heartbeat_file;  // mtime set each second by the maintenance loop (karakv liveness); empty: none
  // KV-cache events for cluster routers (server/kv_events.h); endpoint empty: off.
  std::string kv_events_endpoint, kv_events_replay_endpoint, kv_events_topic, kv_events_encoding;
  int kv_events_buffer_batches = 10000;
  // The prefix tier shared across nodes (server/prefix_tier.h); empty: off.
  std::string prefix_tier, prefix_tier_password_file;
  int prefix_tier_timeout_ms = 50;
  int prefix_tier_queue_blocks = 256;
  std::string backend;       // auto | cpu | cuda
  int cuda_device = 0;
  std::string staging_fd_socket;  // VMM device staging fd socket (staging_fd_server.h); empty: none
  int kernel_threads = 0;    // --threads; 0: the CPUs this process may use (kernels/cpus.h)
  std::string log_format;    // text | json
  std::string log_level;
  absl::Duration drain_timeout;
  bool check_invariants = false;  // debug: verify the pool invariant after every mutating RPC
  bool mutex_deadlock_detection = false;  // debug: absl::Mutex lock-order graph (SetMutexDeadlockDetectionMode)
  bool fast_path = true;          // accept Attach with fast_path (server/ring.h)
  absl::Duration ring_spin;
  int malloc_arenas = 2;          // glibc M_ARENA_MAX (0: glibc's default)
  int malloc_tcache_max = 256;    // glibc.malloc.tcache_max, bytes (-1: glibc's default)
  int malloc_mmap_threshold = 256 << 10;  // glibc M_MMAP_THRESHOLD, bytes (0: glibc's dynamic one)
  int ring_idle_threads = 16;     // ring threads kept for the next session (RingConfig::idle_threads)
  int max_message_bytes = 1 << 30;  // gRPC receive and send limit
  // Unix socket peers admitted by SO_PEERCRED (server/peer_gate.h); both empty admits all.
  std::vector<uint32_t> allowed_uids, allowed_gids;
  // TLS on the TCP listener (PEM contents, read at start-up): the daemon's certificate chain and
  // key; with client_ca, mutual TLS (client certificates signed by it required). Empty: plaintext.
  std::string tls_cert_pem, tls_key_pem, tls_client_ca_pem;
  bool tls() const { return !tls_cert_pem.empty(); }
};

// Reads `--name=value` or `name = value` lines ('#' starts a comment) from `path` into the
// matching flags, so the file supplies defaults that the command line then overrides.
absl::Status apply_config_file(const std::string& path);

// Builds the config from the parsed flags; refuses inconsistent values with a message naming them.
absl::StatusOr<DaemonConfig> config_from_flags();

// Parses "512MiB", "2GiB", "1048576", "64KiB", "1GB" into bytes.
absl::StatusOr<int64_t> parse_bytes(std::string_view text);

}  // namespace karakv::server
