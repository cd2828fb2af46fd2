// Prometheus metrics of karakvd. Built once at start-up; handlers update them through the typed
// methods below, never by name.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/core.h"
#include "server/prefix_tier.h"

namespace karakv::server {

struct RpcErrorCount {
  std::string method, code;
  uint64_t count = 0;
};

class Metrics {
 public:
  // `listen` is "host:port"; empty keeps metrics in memory without serving /metrics. `backend` is
  // the kernel backend's name (karakv_build_info's backend label).
  static absl::StatusOr<std::unique_ptr<Metrics>> create(const std::string& listen, const std::string& backend = "");

  // One finished RPC: its latency and, when it failed, its status code.
  void observe_rpc(const std::string& method, double seconds, absl::StatusCode code);
  // Pool, sequence and session gauges from a core snapshot.
  void update_state(const CoreStats& stats, size_t block_bytes, const kernels::Geometry& g);
  void lease_expired(int n);
  void preempted();
  // Events the WatchEvents streams have dropped so far (the counter follows this total).
  void set_events_dropped(uint64_t total);
  // KV-cache events for routers (server/kv_events.h): events published, dropped before a batch,
  // and replay requests served.
  void kv_events_published(size_t n);
  void kv_events_dropped(uint64_t n);
  void kv_events_replay_request();
  // The prefix tier (server/prefix_tier.h): one lookup round trip's duration, and its counters'
  // totals (the counters advance by what happened since the last call).
  void prefix_tier_fetch(double seconds);
  void update_prefix_tier(const PrefixTierStats& totals);
  // A completed decode step (the last layer's Step) of `tokens` sequences: its duration from the
  // batch's first-layer Step, and the time to first step of the sequences it was the first for.
  void decode_step(int tokens, double step_seconds, const std::vector<double>& first_step_seconds);
  void invariant_violation();
  // The device failed (Backend::fault): karakv_device_failed goes to 1 until the restart.
  void device_failed();
  // Failed RPCs so far by method and code, read back from the counters (for the Stats RPC).
  std::vector<RpcErrorCount> rpc_errors() const;
  // One compaction that ran: count, tokens removed per (layer, head) row, and its duration.
  void compaction(const std::string& policy, int tokens_removed, double seconds);
  // One that failed (each is also a compaction_failed event of the sequence's session).
  void compaction_failed(const std::string& policy);
  // Prefix cache counters and gauges from a core snapshot (called by update_state).
  void update_prefix_cache(const CoreStats& stats);
  std::shared_ptr<prometheus::Registry> registry() const { return core_; }
  // Called at every scrape, before the metrics are read: state gauges are refreshed then, not on
  // the request path.
  void set_refresher(std::function<void()> refresh);

 private:
  Metrics() = default;
  class Refreshing;
  std::shared_ptr<prometheus::Registry> core_;
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
  prometheus::Counter* preemptions_ = nullptr;
  prometheus::Counter* event_drops_ = nullptr;
  prometheus::Counter* decode_tokens_ = nullptr;
  prometheus::Counter* decode_steps_ = nullptr;
  prometheus::Histogram* decode_step_seconds_ = nullptr;
  prometheus::Histogram* first_step_seconds_ = nullptr;
  prometheus::Counter* invariant_violations_ = nullptr;
  prometheus::Gauge* device_failed_ = nullptr;
  prometheus::Family<prometheus::Counter>* compactions_ = nullptr;
  prometheus::Family<prometheus::Counter>* compaction_failures_ = nullptr;
  prometheus::Family<prometheus::Counter>* tokens_removed_ = nullptr;
  prometheus::Family<prometheus::Histogram>* compaction_seconds_ = nullptr;
  prometheus::Gauge* logical_tokens_ = nullptr;
  prometheus::Gauge* query_cache_bytes_ = nullptr;
  prometheus::Gauge* score_bytes_ = nullptr;
  prometheus::Gauge* heap_in_use_bytes_ = nullptr;
  prometheus::Counter* kv_events_published_ = nullptr;
  prometheus::Counter* kv_events_dropped_ = nullptr;
  prometheus::Counter* kv_events_replays_ = nullptr;
  prometheus::Family<prometheus::Counter>* tier_blocks_ = nullptr;
  prometheus::Family<prometheus::Counter>* tier_writes_ = nullptr;
  prometheus::Family<prometheus::Counter>* tier_bytes_ = nullptr;
  prometheus::Counter* tier_errors_ = nullptr;
  prometheus::Counter* tier_skipped_ = nullptr;
  prometheus::Histogram* tier_fetch_seconds_ = nullptr;
  prometheus::Gauge* heap_held_bytes_ = nullptr;
  prometheus::Gauge* kv_cache_usage_ = nullptr;
  prometheus::Family<prometheus::Gauge>* compression_factor_ = nullptr;
  prometheus::Family<prometheus::Gauge>* tenant_blocks_ = nullptr;
  std::set<std::string> exported_tenants_;     // tenants whose gauge is exported now (under policy_mu_)
  prometheus::Family<prometheus::Gauge>* policy_kv_bytes_ = nullptr;
  std::mutex policy_mu_;                       // scrapes may refresh concurrently
  std::set<std::string> exported_policies_;    // policies whose gauges are exported now
  // Prefix cache (hit rate = hit tokens / lookup tokens).
  prometheus::Counter* prefix_lookups_ = nullptr;
  prometheus::Counter* prefix_lookup_tokens_ = nullptr;
  prometheus::Counter* prefix_hit_tokens_ = nullptr;
  prometheus::Counter* prefix_evictions_ = nullptr;
  prometheus::Gauge* prefix_cached_blocks_ = nullptr;
  prometheus::Gauge* prefix_unused_blocks_ = nullptr;
  prometheus::Gauge* tier_pinned_blocks_ = nullptr;
};

}  // namespace karakv::server
