// Prometheus metrics of karakvd. Built once at start-up; handlers update them through the typed
// methods below, never by name.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/registry.h"

namespace karakv::server {

class Metrics {
 public:
  // `listen` is "host:port"; empty keeps metrics in memory without serving /metrics.
  static absl::StatusOr<std::unique_ptr<Metrics>> create(const std::string& listen);

  // One finished RPC: its latency and, when it failed, its status code.
  void observe_rpc(const std::string& method, double seconds, absl::StatusCode code);
  // Pool, sequence and session gauges from a registry snapshot.
  void update_state(const RegistryStats& stats, size_t block_bytes, const kernels::Geometry& g);
  void lease_expired(int n);
  void decode_step(int tokens);
  void invariant_violation();
  // One compaction that ran: count, tokens removed per (layer, head) row, and its duration.
  void compaction(const std::string& policy, int tokens_removed, double seconds);
  // Prefix cache counters and gauges from a registry snapshot (called by update_state).
  void update_prefix_cache(const RegistryStats& stats);
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }
  // Called at every scrape, before the metrics are read: state gauges are refreshed then, not on
  // the request path.
  void set_refresher(std::function<void()> refresh);

 private:
  Metrics() = default;
  class Refreshing;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<Refreshing> collectable_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  prometheus::Family<prometheus::Histogram>* rpc_latency_ = nullptr;
  prometheus::Family<prometheus::Counter>* rpc_errors_ = nullptr;
  prometheus::Gauge* blocks_total_ = nullptr;
  prometheus::Gauge* blocks_used_ = nullptr;
  prometheus::Gauge* blocks_free_ = nullptr;
  prometheus::Gauge* pool_bytes_ = nullptr;
  prometheus::Gauge* used_bytes_ = nullptr;
  prometheus::Gauge* resident_tokens_ = nullptr;
  prometheus::Gauge* sequences_ = nullptr;
  prometheus::Gauge* sessions_ = nullptr;
  prometheus::Counter* lease_expiries_ = nullptr;
  prometheus::Counter* decode_tokens_ = nullptr;
  prometheus::Counter* decode_steps_ = nullptr;
  prometheus::Counter* invariant_violations_ = nullptr;
  prometheus::Family<prometheus::Counter>* compactions_ = nullptr;
  prometheus::Family<prometheus::Counter>* tokens_removed_ = nullptr;
  prometheus::Family<prometheus::Histogram>* compaction_seconds_ = nullptr;
  prometheus::Gauge* logical_tokens_ = nullptr;
  prometheus::Gauge* query_cache_bytes_ = nullptr;
  prometheus::Gauge* score_bytes_ = nullptr;
  prometheus::Family<prometheus::Gauge>* compression_ratio_ = nullptr;
  prometheus::Family<prometheus::Gauge>* policy_kv_bytes_ = nullptr;
  // Prefix cache (hit rate = hit tokens / lookup tokens).
  prometheus::Counter* prefix_lookups_ = nullptr;
  prometheus::Counter* prefix_lookup_tokens_ = nullptr;
  prometheus::Counter* prefix_hit_tokens_ = nullptr;
  prometheus::Counter* prefix_evictions_ = nullptr;
  prometheus::Gauge* prefix_cached_blocks_ = nullptr;
  prometheus::Gauge* prefix_unused_blocks_ = nullptr;
};

}  // namespace karakv::server
