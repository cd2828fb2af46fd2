// karakvd: builds the config, the backend, the core and the gRPC server, then serves until
// SIGTERM/SIGINT, when it drains (new calls get UNAVAILABLE, running calls finish) and exits 0.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "util/flags.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "karakv/kernels/backend.h"
#include "karakv/kernels/cpus.h"
#include "server/backend_select.h"
#include "server/config.h"
#include "server/heap_usage.h"
#include "server/kv_events.h"
#include "server/prefix_tier.h"
#include "server/logging.h"
#include "server/metrics.h"
#include "server/peer_gate.h"
#include "server/staging_fd_server.h"
#include "server/core.h"
#include "server/ring.h"
#include "server/service.h"
#include "spdlog/spdlog.h"

namespace {

int fail(const absl::Status& s) {
  spdlog::error("{}", std::string(s.message()));
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  // --help lists the daemon's own flags (defined in server/config.cc), with their defaults.
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) { return absl::StrContains(file, "server/config"); };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetProgramUsageMessage(
      "the karakv KV-cache daemon.\n"
      "  karakvd [--config=FILE] [--socket=PATH] [--layers=N ...]\n"
      "Serves the karakv.v1 gRPC API on a Unix socket (and optionally TCP).");
  // The config file supplies defaults; the command line, parsed after it, overrides them.
  for (int i = 1; i < argc; ++i) {
    absl::string_view a = argv[i];
    std::string path;
    if (absl::StartsWith(a, "--config=")) path = std::string(a.substr(9));
    else if (a == "--config" && i + 1 < argc) path = argv[i + 1];
    if (!path.empty()) {
      if (absl::Status s = karakv::server::apply_config_file(path); !s.ok()) {
        std::fprintf(stderr, "karakvd: %s\n", std::string(s.message()).c_str());
        return 2;
      }
    }
  }
  karakv::parse_command_line(argc, argv, "karakvd", usage);
  auto config = karakv::server::config_from_flags();
  if (!config.ok()) {
    std::fprintf(stderr, "karakvd: %s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  // The kernels' OpenMP workers sleep as soon as a region ends instead of spinning: libgomp spins
  // for a long while when its team fits the CPUs it sees, and it sees the host's CPUs, not the
  // cgroup quota; on a machine shared with other work the spinning worker took the CPU the ring and
  // gRPC threads needed (decode at batch 64 fell to an eighth). libgomp reads it when it loads, so
  // it applies from the re-execution below. Set OMP_WAIT_POLICY (or GOMP_SPINCOUNT) to choose.
  if (std::getenv("GOMP_SPINCOUNT") == nullptr) setenv("OMP_WAIT_POLICY", "passive", /*overwrite=*/0);
  // Before any thread of the daemon's starts (gRPC's, the kernels', the rings'). The tcache cap
  // re-executes karakvd (same pid and arguments) the first time through; on failure it runs on.
  const absl::Status tcache_status = karakv::server::apply_tcache_max(config->malloc_tcache_max, argv);
  // The mallopt settings, each refused only where malloc is not glibc's (warned about below).
  const struct {
    const char* flag;
    int value;
    bool applied;
  } mallopts[] = {
      {"malloc_arenas", config->malloc_arenas, karakv::server::limit_malloc_arenas(config->malloc_arenas)},
      {"malloc_mmap_threshold", config->malloc_mmap_threshold,
       karakv::server::fix_malloc_mmap_threshold(config->malloc_mmap_threshold)},
  };
  // A libabsl built without NDEBUG (Debian's) checks the lock order of every Mutex acquisition
  // against a process-wide graph; that is a debugging aid, not something to run in production.
  absl::SetMutexDeadlockDetectionMode(config->mutex_deadlock_detection ? absl::OnDeadlockCycle::kAbort
                                                                       : absl::OnDeadlockCycle::kIgnore);
  if (absl::Status s = karakv::server::setup_logging(config->log_format, config->log_level); !s.ok()) {
    std::fprintf(stderr, "karakvd: %s\n", std::string(s.message()).c_str());
    return 2;
  }

  // Signals are taken synchronously by sigwait below; block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // Kernel threads: --threads, else the CPUs this process may use (affinity capped by the cgroup
  // CPU quota; a container limited to 1 CPU gets 1 thread, not one per host CPU).
  const karakv::kernels::UsableCpus usable = karakv::kernels::usable_cpus();
  const int kernel_threads = config->kernel_threads > 0 ? config->kernel_threads : usable.count;
  auto selected =
      karakv::server::select_backend(config->backend, config->cuda_device, kernel_threads, config->core.geometry);
  if (!selected.ok()) return fail(selected.status());
  spdlog::info("backend: {} ({})", selected->backend->description(), selected->reason);
  const std::string backend_name(selected->backend->name());
  if (backend_name == "cpu") {
    if (config->kernel_threads > 0) {
      spdlog::info("kernel threads: {} (--threads; usable CPUs {}: {})", kernel_threads, usable.count, usable.reason());
      if (kernel_threads > usable.count) {
        spdlog::warn("--threads={} is more than the {} CPU(s) this process may use ({}): the kernels' threads will "
                     "wait for each other",
                     kernel_threads, usable.count, usable.reason());
      }
    } else {
      spdlog::info("kernel threads: {} ({})", kernel_threads, usable.reason());
    }
  }
  // The pool is allocated and zeroed here: with transparent huge pages on `madvise` each huge-page
  // fault may compact memory first, so a pool of hundreds of MiB can take seconds on a busy node;
  // the time is logged so that a slow start is not a mystery.
  const auto pool_start = std::chrono::steady_clock::now();
  auto core = karakv::server::Core::create(config->core, std::move(selected->backend));
  if (!core.ok()) return fail(core.status());
  const double pool_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - pool_start).count();
  auto metrics = karakv::server::Metrics::create(config->metrics_listen, backend_name);
  if (!metrics.ok()) return fail(metrics.status());
  karakv::server::Metrics* metrics_ptr = metrics->get();
  (*core)->set_compaction_observer([metrics_ptr](const karakv::server::CompactionResult& r) {
    metrics_ptr->compaction(r.policy, r.tokens_before - r.tokens_after, r.seconds);
  });
  karakv::server::KaraKVService service(core->get(), metrics->get(), config->check_invariants);
  karakv::server::EventHub* events = &service.events();
  (*core)->set_event_observer([metrics_ptr, events](const karakv::server::CoreEvent& e) {
    if (e.kind == karakv::server::CoreEvent::Kind::kPreempted) {
      spdlog::warn("preempted: {} ({} blocks freed, {} tokens lost)", e.message, e.blocks_freed, e.tokens);
      metrics_ptr->preempted();
    }
    if (e.kind == karakv::server::CoreEvent::Kind::kCompactionFailed) {
      metrics_ptr->compaction_failed(e.policy);
      // Logged at the 1st, 2nd, 4th, 8th, ... failure: a broken kernel fails every tick. (Called
      // under the core's lock: no other thread touches the count.)
      static uint64_t failures = 0;
      const uint64_t n = ++failures;
      if ((n & (n - 1)) == 0)
        spdlog::warn("compaction of sequence {} ({}) failed: {} ({} failures so far)", e.sequence_id, e.policy,
                     e.message, failures);
    }
    events->publish(e);
  });
  karakv::server::RingConfig ring_config;
  ring_config.spin = config->ring_spin;
  ring_config.idle_threads = config->ring_idle_threads;
  if (config->fast_path) ring_config.start_threads = config->ring_idle_threads;
  karakv::server::RingServer rings(&service.gate(), core->get(), metrics->get(), ring_config);
  if (config->fast_path) service.set_rings(&rings);
  karakv::server::Core* core_ptr = core->get();
  // What a scrape refreshes first; with the prefix tier's counters while it runs.
  auto refresher = [metrics_ptr, core_ptr, events](karakv::server::PrefixTier* tier) {
    return [metrics_ptr, core_ptr, events, tier] {
      metrics_ptr->update_state(core_ptr->stats(), core_ptr->geometry().block_bytes(), core_ptr->geometry());
      metrics_ptr->set_events_dropped(events->dropped_total());
      if (tier != nullptr) metrics_ptr->update_prefix_tier(tier->stats());
    };
  };
  metrics_ptr->set_refresher(refresher(nullptr));

  // KV-cache events for cluster routers: the prefix cache's blocks, as vLLM publishes them.
  std::unique_ptr<karakv::server::KvEventPublisher> kv_events;
  if (!config->kv_events_endpoint.empty()) {
    karakv::server::KvEventsConfig ec;
    ec.endpoint = config->kv_events_endpoint;
    ec.replay_endpoint = config->kv_events_replay_endpoint;
    ec.topic = config->kv_events_topic;
    ec.encoding = config->kv_events_encoding;
    ec.buffer_batches = config->kv_events_buffer_batches;
    ec.medium = backend_name == "cuda" ? "GPU" : "CPU";
    auto p = karakv::server::KvEventPublisher::start(ec, (*core)->geometry().block_size, metrics_ptr);
    if (!p.ok()) return fail(p.status());
    kv_events = std::move(*p);
    (*core)->set_prefix_event_sink(kv_events.get());
    spdlog::info("kv events on {}{} ({} encoding, medium {})", ec.endpoint,
                 ec.replay_endpoint.empty() ? "" : ", replay on " + ec.replay_endpoint, ec.encoding, ec.medium);
  }

  // The prefix tier shared across nodes: a Redis (or Redis Cluster) that other karakvd daemons share.
  std::unique_ptr<karakv::server::PrefixTier> tier;
  if (!config->prefix_tier.empty()) {
    auto tc = karakv::server::parse_prefix_tier(config->prefix_tier, config->prefix_tier_password_file);
    if (!tc.ok()) return fail(tc.status());
    tc->timeout = absl::Milliseconds(config->prefix_tier_timeout_ms);
    tc->max_queued_blocks = size_t(config->prefix_tier_queue_blocks);
    tier = karakv::server::PrefixTier::start(*tc, (*core)->geometry(), core_ptr->tier_block_source(), metrics_ptr);
    (*core)->set_prefix_tier(tier.get());
    metrics_ptr->set_refresher(refresher(tier.get()));
    spdlog::info("prefix tier on {} (timeout {} ms; used by sessions that give a model_fingerprint)",
                 config->prefix_tier, config->prefix_tier_timeout_ms);
  }

  // The liveness heartbeat (`karakv liveness`): the loop below sets its mtime after each pass,
  // which takes the core's lock, so it goes stale only when the daemon is wedged or stopped.
  int heartbeat_fd = -1;
  if (!config->heartbeat_file.empty()) {
    heartbeat_fd = open(config->heartbeat_file.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (heartbeat_fd < 0) {
      return fail(absl::FailedPreconditionError(absl::StrCat(
          "--heartbeat_file=", config->heartbeat_file, ": cannot create it (", std::strerror(errno),
          "); give a writable path, or 'none' to run without the liveness heartbeat")));
    }
    futimens(heartbeat_fd, nullptr);
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(config->max_message_bytes);
  builder.SetMaxSendMessageSize(config->max_message_bytes);
  // Inline tensors: a new HTTP/2 stream starts with a 64 KiB window and 16 KiB frames, so a 1 MiB
  // inline Append waited for about 16 window updates. Large windows and frames let a message go
  // in one flight (docs/BENCHMARKS.md, P1 inline); the client sets the same.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16 << 20);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, (16 << 20) - 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 8 << 20);
  // With an allow list the daemon accepts Unix connections itself and checks SO_PEERCRED first.
  std::unique_ptr<karakv::server::PeerGate> gate;
  if (!config->allowed_uids.empty() || !config->allowed_gids.empty()) {
    karakv::server::PeerAllowList allow;
    allow.uids.assign(config->allowed_uids.begin(), config->allowed_uids.end());
    allow.gids.assign(config->allowed_gids.begin(), config->allowed_gids.end());
    auto g = karakv::server::PeerGate::listen(config->socket_path, std::move(allow));
    if (!g.ok()) return fail(g.status());
    gate = std::move(*g);
  } else if (!config->socket_path.empty()) {
    unlink(config->socket_path.c_str());  // a stale socket from a crashed daemon
    builder.AddListeningPort("unix:" + config->socket_path, grpc::InsecureServerCredentials());
  }
  if (!config->tcp_address.empty()) {
    std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
    if (config->tls()) {
      grpc::SslServerCredentialsOptions tls(config->tls_client_ca_pem.empty()
                                                ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                                : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
      tls.pem_root_certs = config->tls_client_ca_pem;
      tls.pem_key_cert_pairs.push_back({config->tls_key_pem, config->tls_cert_pem});
      credentials = grpc::SslServerCredentials(tls);
    }
    builder.AddListeningPort(config->tcp_address, credentials);
  }
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) {
    return fail(absl::UnavailableError("cannot start the gRPC server on " +
                                       (config->socket_path.empty() ? config->tcp_address : config->socket_path) +
                                       (config->tls() ? " (in use, no permission, or --tls_cert / --tls_key not a "
                                                        "matching certificate and private key?)"
                                                      : " (in use, or no permission?)")));
  }
  if (gate) {
    gate->serve(server.get());
    spdlog::info("unix socket admits uids [{}] gids [{}] (SO_PEERCRED)", absl::StrJoin(config->allowed_uids, ","),
                 absl::StrJoin(config->allowed_gids, ","));
  }
  // VMM device staging hands regions out as file descriptors beside the gRPC socket; without it
  // CUDA_VMM_FD sessions attach but their workers cannot import (a warning, not a failed start).
  // Only the CUDA backend has device staging, so only it opens the socket.
  std::unique_ptr<karakv::server::StagingFdServer> fd_server;
  if (!config->staging_fd_socket.empty() && backend_name == "cuda") {
    karakv::server::PeerAllowList allow;
    allow.uids.assign(config->allowed_uids.begin(), config->allowed_uids.end());
    allow.gids.assign(config->allowed_gids.begin(), config->allowed_gids.end());
    auto fds = karakv::server::StagingFdServer::listen(
        config->staging_fd_socket, std::move(allow),
        [core_ptr](const std::string& session, uint64_t generation)
            -> absl::StatusOr<karakv::server::StagingFdGrant> {
          auto staging = core_ptr->vmm_staging(session, generation);
          if (!staging.ok()) return staging.status();
          auto fd = (*staging)->export_fd();
          if (!fd.ok()) return fd.status();
          return karakv::server::StagingFdGrant{*fd, (*staging)->size(), (*staging)->device()};
        });
    if (fds.ok()) {
      fd_server = std::move(*fds);
      spdlog::info("staging fd socket (CUDA_VMM_FD device staging) on {}", config->staging_fd_socket);
    } else {
      spdlog::warn("{}; CUDA_VMM_FD workers cannot import their regions", std::string(fds.status().message()));
    }
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  const auto& g = (*core)->geometry();
  const auto st = (*core)->stats();
  if (!tcache_status.ok()) spdlog::warn("{}", std::string(tcache_status.message()));
  for (const auto& m : mallopts) {
    if (!m.applied) {
      spdlog::warn("--{}={} not applied: malloc is not glibc's (a sanitizer's or a preloaded one)", m.flag, m.value);
    }
  }
  spdlog::info("serving on {}{}{}: layers={} q_heads={} kv_heads={} head_dim={} dtype={} block_size={}; pool {} blocks x {} bytes "
               "(allocated and zeroed in {:.2f} s)",
               config->socket_path.empty() ? "" : "unix:" + config->socket_path,
               config->tcp_address.empty() ? "" : (config->tls() ? (config->tls_client_ca_pem.empty() ? " tcp+tls:" : " tcp+mtls:") : " tcp:"),
               config->tcp_address, g.num_layers,
               g.num_q_heads, g.num_kv_heads, g.head_dim, karakv::kernels::dtype_name(g.dtype),
               g.block_size, st.blocks_total, g.block_bytes(), pool_seconds);
  if (!config->metrics_listen.empty()) spdlog::info("metrics on http://{}/metrics", config->metrics_listen);

  // Lease reaper: frees the sessions of workers that stopped sending heartbeats.
  absl::Notification stop;
  bool device_failed = false;  // the reaper's own
  std::thread reaper([&] {
    const absl::Duration period = std::min(absl::Seconds(1), config->core.lease / 4);
    while (!stop.WaitForNotificationWithTimeout(period)) {
      const int n = (*core)->expire_leases(absl::Now());
      if (n > 0) {
        spdlog::warn("lease expired for {} session(s); their sequences and staging were freed", n);
        (*metrics)->lease_expired(n);
      }
      rings.reap();
      // A device fault (a lost CUDA context) does not heal: unhealthy for the readiness probe, and
      // no more heartbeats, so the liveness probe has the daemon restarted.
      if (!device_failed) {
        if (const std::string fault = (*core)->device_fault(); !fault.empty()) {
          device_failed = true;
          (*core)->announce_device_fault();
          (*metrics)->device_failed();
          server->GetHealthCheckService()->SetServingStatus(false);
          spdlog::critical("the device failed; refusing every call until a restart (health NOT_SERVING, liveness "
                           "heartbeat stopped): {}",
                           fault);
        }
      }
      if (heartbeat_fd >= 0 && !device_failed) futimens(heartbeat_fd, nullptr);
    }
  });

  int sig = 0;
  sigwait(&signals, &sig);
  spdlog::info("signal {}: draining (new calls get UNAVAILABLE, {} in flight)", sig, service.in_flight());
  if (gate) gate->stop();  // no new connections
  fd_server.reset();
  service.start_draining();
  server->GetHealthCheckService()->SetServingStatus(false);
  // The calls in flight finish while new ones get the service's UNAVAILABLE ("draining"); only then
  // does gRPC shut down (during its Shutdown a new call would see CANCELLED instead).
  const absl::Time drain_deadline = absl::Now() + config->drain_timeout;
  while (service.in_flight() > 0 && absl::Now() < drain_deadline) absl::SleepFor(absl::Milliseconds(2));
  spdlog::info("drained: {} call(s) still in flight; shutting down the server", service.in_flight());
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(absl::ToInt64Milliseconds(std::max(absl::ZeroDuration(),
                                                                                drain_deadline - absl::Now()))));
  stop.Notify();
  reaper.join();
  if (kv_events) {
    (*core)->set_prefix_event_sink(nullptr);
    kv_events.reset();  // publishes what is queued
  }
  rings.stop_all();
  if (tier) {
    (*core)->set_prefix_tier(nullptr);
    metrics_ptr->set_refresher(refresher(nullptr));
    tier.reset();  // writes still queued are dropped: the tier is a cache
  }
  if (!config->socket_path.empty()) unlink(config->socket_path.c_str());
  if (heartbeat_fd >= 0) {
    close(heartbeat_fd);
    unlink(config->heartbeat_file.c_str());
  }
  spdlog::info("stopped");
  return 0;
}
