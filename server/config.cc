// Flags of karakvd (every default shows in --help) and the config-file loader.
#include "server/config.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <tuple>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "server/kv_events.h"
#include "server/prefix_tier.h"
#include "server/peer_gate.h"

ABSL_FLAG(std::string, config, "", "Config file of flag=value lines, applied before the command line");
ABSL_FLAG(std::string, socket, "/tmp/karakv.sock", "Unix domain socket to serve gRPC on (empty: none)");
ABSL_FLAG(std::string, listen_tcp, "", "Also serve gRPC on this host:port (empty: Unix socket only)");
ABSL_FLAG(std::string, metrics_listen, "", "Serve Prometheus /metrics on this host:port (empty: off)");
ABSL_FLAG(int32_t, layers, 30, "Model layers (default: SmolLM2-135M geometry)");
ABSL_FLAG(int32_t, q_heads, 9, "Query heads per layer");
ABSL_FLAG(int32_t, kv_heads, 3, "KV heads per layer (query heads must be a multiple)");
ABSL_FLAG(int32_t, head_dim, 64, "Head dimension");
ABSL_FLAG(std::string, dtype, "fp16", "Storage dtype of K/V in the pool: fp16 | bf16 | fp32");
ABSL_FLAG(int32_t, block_size, 16, "Tokens per pool block");
ABSL_FLAG(std::string, pool_bytes, "512MiB", "Size of the KV block pool (suffixes KiB, MiB, GiB)");
ABSL_FLAG(int32_t, lease_seconds, 30, "Session lease: a worker silent this long loses its session");
ABSL_FLAG(std::string, max_staging_bytes, "1GiB", "Largest staging region one session may ask for");
ABSL_FLAG(std::string, max_device_staging_bytes, "8GiB",
          "GPU memory all device staging regions together may hold (Attach staging_kind CUDA_IPC, --backend=cuda), "
          "counting regions kept for the same tenant's reuse and those quarantined after a lease expiry");
ABSL_FLAG(bool, stream_ordered_staging, false,
          "Let device staging sessions order their requests by CUDA IPC events instead of host waits (Attach "
          "worker_event_ipc_handle). For trusted workers only: the daemon's one stream waits on each such worker's "
          "event, so a slow, stuck or dead worker stalls every session's GPU work");
ABSL_FLAG(int32_t, max_sessions, 0, "Most sessions attached at once; Attach beyond it is refused (0: no limit)");
ABSL_FLAG(int32_t, max_sequences_per_session, 0,
          "Most sequences one session holds at once; CreateSequence and Fork beyond it are refused (0: no limit)");
ABSL_FLAG(int64_t, tenant_block_quota, 0,
          "Most pool blocks the sequences of one tenant hold (a block shared by two of them counts twice); "
          "requests that would take more are refused (0: no quota)");
ABSL_FLAG(bool, preempt_on_pressure, false,
          "When an Append or Step needs more pool blocks than are free, preempt sequences of lower priority "
          "(CreateSequence.priority; lowest first, least recently used among equals) and tell their owners "
          "through WatchEvents, instead of refusing with RESOURCE_EXHAUSTED");
ABSL_FLAG(std::string, max_message_bytes, "1GiB",
          "Largest gRPC message the daemon receives or sends (tensors sent inline, not through staging)");
ABSL_FLAG(std::string, allowed_uids, "",
          "Unix socket: admit only processes of these uids (comma list), checked with SO_PEERCRED; with "
          "--allowed_gids a peer on either list is admitted (both empty: every local peer)");
ABSL_FLAG(std::string, allowed_gids, "", "Unix socket: admit only processes of these primary gids (comma list)");
ABSL_FLAG(std::string, tls_cert, "",
          "TCP listener: PEM certificate (chain) of the daemon; with --tls_key the TCP port speaks only TLS "
          "(empty: plaintext TCP). The Unix socket never uses TLS");
ABSL_FLAG(std::string, tls_key, "", "TCP listener: PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "TCP listener: PEM CA bundle; when set (with --tls_cert/--tls_key), mutual TLS: every client must "
          "present a certificate signed by one of these CAs");
ABSL_FLAG(std::string, backend, "auto",
          "Kernel backend: auto | cpu | cuda. auto runs on the GPU when this build has the CUDA backend and a "
          "GPU works, else on the CPU, and logs which it chose and why; cuda refuses to start without a GPU");
ABSL_FLAG(std::string, staging_fd_socket, "",
          "Unix socket that hands VMM device staging regions (staging_kind CUDA_VMM_FD) to workers as file "
          "descriptors (SCM_RIGHTS), opened on the CUDA backend only; empty: <--socket>.fd; 'none': off");
ABSL_FLAG(int32_t, cuda_device, 0, "GPU index for --backend=cuda or auto");
ABSL_FLAG(int32_t, threads, 0,
          "CPU backend: kernel threads, one team whichever thread calls (0: the CPUs this process may use, its "
          "affinity mask capped by its cgroup CPU quota, rounded up)");
ABSL_FLAG(std::string, log_format, "text", "Log format: text | json");
ABSL_FLAG(std::string, log_level, "info", "Log level: trace | debug | info | warn | error");
ABSL_FLAG(std::string, heartbeat_file, "",
          "Liveness: the maintenance loop (lease expiry, under the core's lock) sets this file's mtime every "
          "second; `karakv liveness` fails when it is older than its --max_age, i.e. the daemon is wedged, "
          "whatever its gRPC threads are doing. Empty: <--socket>.alive; 'none': off");
ABSL_FLAG(std::string, kv_events_endpoint, "",
          "Publish the prefix cache's blocks as KV-cache events for cluster routers, in vLLM's format (ZeroMQ "
          "PUB, msgpack; docs/CLUSTER.md) on this endpoint, e.g. tcp://*:5557 or ipc:///run/karakv/kv-events "
          "(empty: off)");
ABSL_FLAG(std::string, kv_events_replay_endpoint, "",
          "ZeroMQ ROUTER endpoint that replays buffered event batches from a sequence number, e.g. tcp://*:5558 "
          "(empty: no replay; needs --kv_events_endpoint)");
ABSL_FLAG(std::string, kv_events_topic, "", "The topic frame of every KV-cache event message");
ABSL_FLAG(std::string, kv_events_encoding, "array",
          "KV-cache events as msgpack arrays tagged by their first element (array) or maps with a \"type\" key "
          "(map); routers accept both");
ABSL_FLAG(int32_t, kv_events_buffer_batches, 10000, "Event batches kept for replay");
ABSL_FLAG(std::string, prefix_tier, "",
          "A prefix tier shared across nodes: redis://HOST:PORT, or several HOST:PORT of one Redis Cluster "
          "separated by commas. Published prompt blocks of sessions with a model_fingerprint are written to it, "
          "and prefix lookups that miss locally fill the pool from it (docs/CLUSTER.md). Empty: off");
ABSL_FLAG(std::string, prefix_tier_password_file, "",
          "File whose first line is the prefix tier's password, or 'USER PASSWORD' for a Redis ACL user");
ABSL_FLAG(int32_t, prefix_tier_timeout_ms, 50,
          "Prefix tier: connect and round-trip timeout; a slower answer is a local miss");
ABSL_FLAG(int32_t, prefix_tier_queue_blocks, 256,
          "Prefix tier: published blocks waiting to be written, each held in the pool (not evictable) until "
          "then; beyond this they are not written, and counted");
ABSL_FLAG(int32_t, drain_seconds, 10, "On SIGTERM, how long in-flight calls may take to finish");
ABSL_FLAG(int32_t, max_sequences_per_tick, 0,
          "Kara: at most this many sequences compress per tick, longest tail first (0: no limit)");
ABSL_FLAG(bool, check_invariants, false, "Debug: check the pool invariant after every mutating RPC");
ABSL_FLAG(bool, mutex_deadlock_detection, false,
          "Debug: Abseil's lock-order checking on every absl::Mutex the daemon and gRPC take (a global "
          "graph, a stack trace per lock held while taking another). Debian's libabsl leaves it on; "
          "off unless asked, it costs throughput and memory that grows with the graph");
ABSL_FLAG(std::string, prefix_cache, "on",
          "Prefix cache: on | off. On, full prompt blocks appended with token ids are shared with later "
          "sequences of the same cache namespace (CreateSequence.prefix_token_ids, Lookup)");
ABSL_FLAG(double, prefix_cache_max_fraction, 1.0,
          "Most of the pool (0..1) that cached blocks no sequence holds may keep; beyond it the least "
          "recently used go at once. Below it they stay until an allocation needs the space");
ABSL_FLAG(bool, prefix_cache_shared_namespaces, false,
          "Let Attach name a cache namespace shared across tenants (default: each tenant's own)");
ABSL_FLAG(bool, fast_path, true,
          "Let workers attach with fast_path: Step, Attend, Append and ReadKV through a shared-memory ring, one "
          "thread per session");
ABSL_FLAG(int32_t, ring_idle_threads, 16,
          "Fast path: ring threads started with the daemon (sharing the kernels' one thread team) and kept "
          "waiting for sessions; more start while more sessions than this are open at once, and end with them");
ABSL_FLAG(int32_t, malloc_arenas, 2,
          "Most glibc malloc arenas (M_ARENA_MAX; 0: glibc's default, 8 per core, or MALLOC_ARENA_MAX). "
          "Each thread that allocates gets an arena up to this many; fewer keep RSS from creeping as "
          "threads come and go");
ABSL_FLAG(int32_t, malloc_tcache_max, 256,
          "Largest chunk (bytes) glibc's per-thread malloc caches keep (glibc.malloc.tcache_max; -1: glibc's "
          "default, 1032). karakvd re-executes itself once with GLIBC_TUNABLES extended; a tcache_max "
          "already in GLIBC_TUNABLES wins. Smaller keeps RSS from creeping as each thread's cache fills");
ABSL_FLAG(int32_t, malloc_mmap_threshold, 256 << 10,
          "Bytes from which glibc's malloc gives each chunk a mapping of its own, returned to the OS on free "
          "(M_MMAP_THRESHOLD; 0: glibc's dynamic threshold, which rises to the largest chunk freed so far). "
          "Fixed, large short-lived buffers never grow the arenas that long-lived chunks then pin");
ABSL_FLAG(int32_t, ring_spin_us, 50, "Fast path: microseconds a ring thread busy-waits after a command before it sleeps");

namespace karakv::server {

absl::StatusOr<int64_t> parse_bytes(std::string_view text_in) {
  const absl::string_view text(text_in.data(), text_in.size());
  absl::string_view t = absl::StripAsciiWhitespace(text);
  int64_t mult = 1;
  struct Suffix { const char* s; int64_t m; };
  for (Suffix suf : {Suffix{"KiB", 1ll << 10}, Suffix{"MiB", 1ll << 20}, Suffix{"GiB", 1ll << 30},
                     Suffix{"KB", 1000}, Suffix{"MB", 1000000}, Suffix{"GB", 1000000000}}) {
    if (absl::ConsumeSuffix(&t, suf.s)) {
      mult = suf.m;
      break;
    }
  }
  int64_t v = 0;
  if (!absl::SimpleAtoi(t, &v) || v < 0 || v > (int64_t(1) << 50) / mult) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is not a byte size; expected e.g. 1048576, 512MiB or 2GiB"));
  }
  return v * mult;
}

absl::Status apply_config_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read config file ", path));
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    absl::string_view l = line;
    if (auto hash = l.find('#'); hash != absl::string_view::npos) l = l.substr(0, hash);
    l = absl::StripAsciiWhitespace(l);
    if (l.empty()) continue;
    absl::ConsumePrefix(&l, "--");
    const size_t eq = l.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", lineno, ": expected name=value"));
    }
    std::string name(absl::StripAsciiWhitespace(l.substr(0, eq)));
    std::string value(absl::StripAsciiWhitespace(l.substr(eq + 1)));
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr || name == "config") {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", lineno, ": unknown setting '", name,
                                                     "' (see karakvd --help)"));
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", lineno, ": ", name, ": ", error));
    }
  }
  return absl::OkStatus();
}

namespace {

// The PEM text of a TLS flag's file, refused with the flag's name when unreadable or not PEM.
absl::StatusOr<std::string> read_pem(const char* flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, ": cannot read it (", std::strerror(errno), ")"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (text.str().find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, " does not hold PEM data (no '-----BEGIN ' line)"));
  }
  return text.str();
}

absl::Status tls_from_flags(DaemonConfig& c) {
  const std::string cert = absl::GetFlag(FLAGS_tls_cert), key = absl::GetFlag(FLAGS_tls_key),
                    ca = absl::GetFlag(FLAGS_tls_client_ca);
  if (cert.empty() && key.empty() && ca.empty()) return absl::OkStatus();
  if (c.tcp_address.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert / --tls_key / --tls_client_ca secure the TCP listener, but --listen_tcp is empty; the Unix "
        "socket does not use TLS (its file mode and --allowed_uids / --allowed_gids guard it)");
  }
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_cert and --tls_key go together: got only ", cert.empty() ? "--tls_key=" + key : "--tls_cert=" + cert,
        "; give both (or neither, for plaintext TCP)"));
  }
  if (cert.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_client_ca=", ca, " needs --tls_cert and --tls_key: mutual TLS is TLS with client certificates"));
  }
  for (auto [flag, path, out] : {std::tuple{"tls_cert", cert, &c.tls_cert_pem},
                                 std::tuple{"tls_key", key, &c.tls_key_pem},
                                 std::tuple{"tls_client_ca", ca, &c.tls_client_ca_pem}}) {
    if (path.empty()) continue;
    auto pem = read_pem(flag, path);
    if (!pem.ok()) return pem.status();
    *out = std::move(*pem);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DaemonConfig> config_from_flags() {
  DaemonConfig c;
  kernels::Geometry& g = c.core.geometry;
  g.num_layers = absl::GetFlag(FLAGS_layers);
  g.num_q_heads = absl::GetFlag(FLAGS_q_heads);
  g.num_kv_heads = absl::GetFlag(FLAGS_kv_heads);
  g.head_dim = absl::GetFlag(FLAGS_head_dim);
  g.block_size = absl::GetFlag(FLAGS_block_size);
  if (!kernels::parse_dtype(absl::GetFlag(FLAGS_dtype), &g.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype=", absl::GetFlag(FLAGS_dtype), " unknown; expected fp16, bf16 or fp32"));
  }
  if (absl::Status s = validate_geometry(g); !s.ok()) return s;
  auto pool = parse_bytes(absl::GetFlag(FLAGS_pool_bytes));
  if (!pool.ok()) return absl::InvalidArgumentError(absl::StrCat("--pool_bytes: ", pool.status().message()));
  c.core.pool_bytes = *pool;
  auto staging = parse_bytes(absl::GetFlag(FLAGS_max_staging_bytes));
  if (!staging.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--max_staging_bytes: ", staging.status().message()));
  }
  c.core.max_staging_bytes = static_cast<uint64_t>(*staging);
  auto device_staging = parse_bytes(absl::GetFlag(FLAGS_max_device_staging_bytes));
  if (!device_staging.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_device_staging_bytes: ", device_staging.status().message()));
  }
  c.core.max_device_staging_bytes = static_cast<uint64_t>(*device_staging);
  c.core.stream_ordered_staging = absl::GetFlag(FLAGS_stream_ordered_staging);
  c.core.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  if (c.core.max_sessions < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--max_sessions=", c.core.max_sessions,
                                                   ", expected >= 0 (0: no limit)"));
  }
  c.core.max_sequences_per_session = absl::GetFlag(FLAGS_max_sequences_per_session);
  if (c.core.max_sequences_per_session < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--max_sequences_per_session=",
                                                   c.core.max_sequences_per_session, ", expected >= 0 (0: no limit)"));
  }
  c.core.tenant_block_quota = absl::GetFlag(FLAGS_tenant_block_quota);
  if (c.core.tenant_block_quota < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--tenant_block_quota=", c.core.tenant_block_quota,
                                                   ", expected >= 0 (0: no quota)"));
  }
  auto message = parse_bytes(absl::GetFlag(FLAGS_max_message_bytes));
  if (!message.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--max_message_bytes: ", message.status().message()));
  }
  if (*message < 4096 || *message > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--max_message_bytes=", absl::GetFlag(FLAGS_max_message_bytes),
                                                   " out of range: expected 4KiB .. 2147483647 bytes"));
  }
  c.max_message_bytes = static_cast<int>(*message);
  const int lease = absl::GetFlag(FLAGS_lease_seconds);
  if (lease < 1) return absl::InvalidArgumentError(absl::StrCat("--lease_seconds=", lease, ", expected >= 1"));
  c.core.lease = absl::Seconds(lease);
  c.core.max_sequences_per_tick = absl::GetFlag(FLAGS_max_sequences_per_tick);
  if (c.core.max_sequences_per_tick < 0) {
    return absl::InvalidArgumentError("--max_sequences_per_tick must be >= 0");
  }
  const std::string prefix = absl::GetFlag(FLAGS_prefix_cache);
  if (prefix != "on" && prefix != "off") {
    return absl::InvalidArgumentError(absl::StrCat("--prefix_cache=", prefix, ", expected on or off"));
  }
  c.core.prefix_cache = prefix == "on";
  c.core.prefix_cache_max_fraction = absl::GetFlag(FLAGS_prefix_cache_max_fraction);
  if (!(c.core.prefix_cache_max_fraction >= 0.0 && c.core.prefix_cache_max_fraction <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("--prefix_cache_max_fraction=",
                                                   c.core.prefix_cache_max_fraction, ", expected 0..1"));
  }
  c.core.prefix_cache_shared_namespaces = absl::GetFlag(FLAGS_prefix_cache_shared_namespaces);
  c.core.preempt_on_pressure = absl::GetFlag(FLAGS_preempt_on_pressure);
  c.socket_path = absl::GetFlag(FLAGS_socket);
  c.tcp_address = absl::GetFlag(FLAGS_listen_tcp);
  if (c.socket_path.empty() && c.tcp_address.empty()) {
    return absl::InvalidArgumentError("both --socket and --listen_tcp are empty: nothing to serve on");
  }
  for (auto [flag, text, out] : {std::tuple{"allowed_uids", absl::GetFlag(FLAGS_allowed_uids), &c.allowed_uids},
                                 std::tuple{"allowed_gids", absl::GetFlag(FLAGS_allowed_gids), &c.allowed_gids}}) {
    auto ids = parse_id_list(text, flag);
    if (!ids.ok()) return ids.status();
    *out = std::move(*ids);
  }
  if (!c.allowed_uids.empty() || !c.allowed_gids.empty()) {
    if (c.socket_path.empty()) {
      return absl::InvalidArgumentError("--allowed_uids / --allowed_gids need a Unix socket (--socket)");
    }
    if (!c.tcp_address.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--allowed_uids / --allowed_gids restrict the Unix socket, but --listen_tcp=", c.tcp_address,
          " would admit anyone who reaches it (TCP has no peer credentials); drop one of them"));
    }
  }
  if (absl::Status s = tls_from_flags(c); !s.ok()) return s;
  c.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  c.heartbeat_file = absl::GetFlag(FLAGS_heartbeat_file);
  c.kv_events_endpoint = absl::GetFlag(FLAGS_kv_events_endpoint);
  c.kv_events_replay_endpoint = absl::GetFlag(FLAGS_kv_events_replay_endpoint);
  c.kv_events_topic = absl::GetFlag(FLAGS_kv_events_topic);
  c.kv_events_encoding = absl::GetFlag(FLAGS_kv_events_encoding);
  c.kv_events_buffer_batches = absl::GetFlag(FLAGS_kv_events_buffer_batches);
  if (absl::Status s = check_kv_events_options(c.kv_events_encoding, c.kv_events_buffer_batches); !s.ok()) return s;
  if (c.kv_events_endpoint.empty() && !c.kv_events_replay_endpoint.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_events_replay_endpoint=", c.kv_events_replay_endpoint,
                                                   " replays the events of --kv_events_endpoint, which is empty"));
  }
  c.prefix_tier = absl::GetFlag(FLAGS_prefix_tier);
  c.prefix_tier_password_file = absl::GetFlag(FLAGS_prefix_tier_password_file);
  c.prefix_tier_timeout_ms = absl::GetFlag(FLAGS_prefix_tier_timeout_ms);
  c.prefix_tier_queue_blocks = absl::GetFlag(FLAGS_prefix_tier_queue_blocks);
  if (!c.prefix_tier.empty()) {
    if (auto t = parse_prefix_tier(c.prefix_tier, c.prefix_tier_password_file); !t.ok()) return t.status();
    if (!c.core.prefix_cache) {
      return absl::InvalidArgumentError(absl::StrCat("--prefix_tier=", c.prefix_tier,
                                                     " shares the prefix cache's blocks, but --prefix_cache=off; "
                                                     "turn the prefix cache on or drop --prefix_tier"));
    }
  } else if (!c.prefix_tier_password_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--prefix_tier_password_file=", c.prefix_tier_password_file,
                                                   " is the password of --prefix_tier, which is empty"));
  }
  if (c.prefix_tier_timeout_ms < 1 || c.prefix_tier_timeout_ms > 60000) {
    return absl::InvalidArgumentError(absl::StrCat("--prefix_tier_timeout_ms=", c.prefix_tier_timeout_ms,
                                                   " is out of range; expected 1 to 60000"));
  }
  if (c.prefix_tier_queue_blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--prefix_tier_queue_blocks=", c.prefix_tier_queue_blocks,
                                                   " must be at least 1"));
  }
  if (c.heartbeat_file.empty() && !c.socket_path.empty()) c.heartbeat_file = c.socket_path + ".alive";
  if (c.heartbeat_file == "none") c.heartbeat_file.clear();
  c.backend = absl::GetFlag(FLAGS_backend);
  if (c.backend != "auto" && c.backend != "cpu" && c.backend != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat("--backend=", c.backend, ", expected auto, cpu or cuda"));
  }
  c.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  c.core.cuda_device = c.cuda_device;
  c.staging_fd_socket = absl::GetFlag(FLAGS_staging_fd_socket);
  if (c.staging_fd_socket.empty() && !c.socket_path.empty()) c.staging_fd_socket = c.socket_path + ".fd";
  if (c.staging_fd_socket == "none") c.staging_fd_socket.clear();
  if (c.cuda_device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--cuda_device=", c.cuda_device, ", expected a GPU index >= 0"));
  }
  c.kernel_threads = absl::GetFlag(FLAGS_threads);
  if (c.kernel_threads < 0 || c.kernel_threads > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("--threads=", c.kernel_threads,
                                                   ", expected 0 (the CPUs this process may use) or 1..4096 threads"));
  }
  c.log_format = absl::GetFlag(FLAGS_log_format);
  if (c.log_format != "text" && c.log_format != "json") {
    return absl::InvalidArgumentError(absl::StrCat("--log_format=", c.log_format, ", expected text or json"));
  }
  c.log_level = absl::GetFlag(FLAGS_log_level);
  c.drain_timeout = absl::Seconds(absl::GetFlag(FLAGS_drain_seconds));
  c.check_invariants = absl::GetFlag(FLAGS_check_invariants);
  c.mutex_deadlock_detection = absl::GetFlag(FLAGS_mutex_deadlock_detection);
  c.fast_path = absl::GetFlag(FLAGS_fast_path);
  const int spin = absl::GetFlag(FLAGS_ring_spin_us);
  if (spin < 0 || spin > 1'000'000) {
    return absl::InvalidArgumentError(absl::StrCat("--ring_spin_us=", spin, ", expected 0..1000000"));
  }
  c.ring_spin = absl::Microseconds(spin);
  c.malloc_arenas = absl::GetFlag(FLAGS_malloc_arenas);
  if (c.malloc_arenas < 0 || c.malloc_arenas > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("--malloc_arenas=", c.malloc_arenas, ", expected 0 (glibc's default) or 1..1024"));
  }
  c.malloc_tcache_max = absl::GetFlag(FLAGS_malloc_tcache_max);
  if (c.malloc_tcache_max < -1 || c.malloc_tcache_max > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("--malloc_tcache_max=", c.malloc_tcache_max,
                                                   ", expected -1 (glibc's default) or 0..4096 bytes"));
  }
  c.malloc_mmap_threshold = absl::GetFlag(FLAGS_malloc_mmap_threshold);
  if (c.malloc_mmap_threshold != 0 && (c.malloc_mmap_threshold < 4096 || c.malloc_mmap_threshold > (32 << 20))) {
    return absl::InvalidArgumentError(absl::StrCat("--malloc_mmap_threshold=", c.malloc_mmap_threshold,
                                                   ", expected 0 (glibc's dynamic threshold) or 4096..33554432 bytes"));
  }
  c.ring_idle_threads = absl::GetFlag(FLAGS_ring_idle_threads);
  if (c.ring_idle_threads < 0 || c.ring_idle_threads > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("--ring_idle_threads=", c.ring_idle_threads, ", expected 0..4096 waiting threads"));
  }
  return c;
}

}  // namespace karakv::server
