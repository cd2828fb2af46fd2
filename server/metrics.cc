// prometheus-cpp families with conventional names: karakv_ prefix, _total counters, _seconds and
// _bytes units, and only bounded labels (method and status code, policy, attached tenants; never
// ids). Label sets known at start-up (every RPC method and status code, every policy) are created
// at zero, so that rate() and increase() see the first event and queries never find no series.
#include "server/metrics.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <mutex>
#include <sstream>
#include <tuple>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "util/version.h"
#include "google/protobuf/descriptor.h"
#include "karakv/v1/karakv.pb.h"
#include "karakv/kernels/cpus.h"
#include "server/heap_usage.h"
#include "server/policy.h"

namespace karakv::server {

// The registry as the exposer sees it: runs the refresher, then collects.
class Metrics::Refreshing : public prometheus::Collectable {
 public:
  explicit Refreshing(std::shared_ptr<prometheus::Registry> registry) : core_(std::move(registry)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::function<void()> refresh;
    {
      std::lock_guard<std::mutex> lock(mu_);
      refresh = refresh_;
    }
    if (refresh) refresh();
    return core_->Collect();
  }
  void set(std::function<void()> f) {
    std::lock_guard<std::mutex> lock(mu_);
    refresh_ = std::move(f);
  }

 private:
  std::shared_ptr<prometheus::Registry> core_;
  mutable std::mutex mu_;
  std::function<void()> refresh_;
};

namespace {

// Latency buckets of every RPC: 25 us (a Ping, a Step over shared memory) to 60 s (an Attach that
// maps a large staging region, a Compact of long sequences, a slow client).
const prometheus::Histogram::BucketBoundaries& rpc_buckets() {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3,
      1.0, 2.5, 5.0, 10.0, 30.0, 60.0};
  return kBuckets;
}

const prometheus::Histogram::BucketBoundaries& compaction_buckets() {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0};
  return kBuckets;
}

// When this process started, in seconds since the epoch: /proc/self/stat's start time (clock ticks
// after boot) plus /proc/stat's boot time; now, where /proc cannot say.
double process_start_time_seconds() {
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::ifstream stat_file("/proc/self/stat");
  std::string stat((std::istreambuf_iterator<char>(stat_file)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (close == std::string::npos) return now;
  const std::vector<std::string> fields = absl::StrSplit(stat.substr(close + 2), ' ');
  // Fields after the name start at field 3 (state); start time is field 22.
  uint64_t start_ticks = 0;
  if (fields.size() < 20 || !absl::SimpleAtoi(fields[19], &start_ticks)) return now;
  std::ifstream boot("/proc/stat");
  std::string line;
  uint64_t btime = 0;
  while (std::getline(boot, line)) {
    if (line.rfind("btime ", 0) == 0 && absl::SimpleAtoi(line.substr(6), &btime)) break;
  }
  const long ticks = sysconf(_SC_CLK_TCK);
  if (btime == 0 || ticks <= 0) return now;
  return double(btime) + double(start_ticks) / double(ticks);
}

}  // namespace

void Metrics::set_refresher(std::function<void()> refresh) { collectable_->set(std::move(refresh)); }

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::create(const std::string& listen, const std::string& backend) {
  std::unique_ptr<Metrics> m(new Metrics());
  m->core_ = std::make_shared<prometheus::Registry>();
  m->collectable_ = std::make_shared<Refreshing>(m->core_);
  auto& reg = *m->core_;
  m->rpc_latency_ = &prometheus::BuildHistogram()
                         .Name("karakv_rpc_duration_seconds")
                         .Help("Time to serve one RPC, by method")
                         .Register(reg);
  m->rpc_errors_ = &prometheus::BuildCounter()
                        .Name("karakv_rpc_errors_total")
                        .Help("RPCs that returned a non-OK status, by method and code")
                        .Register(reg);
  auto gauge = [&](const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(reg).Add({});
  };
  auto counter = [&](const char* name, const char* help) {
    return &prometheus::BuildCounter().Name(name).Help(help).Register(reg).Add({});
  };
  // Every method of the service from the start, with the status codes the daemon's handlers return
  // and the ones the alerts watch (deploy/prometheus/alerts.yml); another code's series appears at
  // its first failure.
  static constexpr absl::StatusCode kPresetCodes[] = {
      absl::StatusCode::kInvalidArgument,    absl::StatusCode::kNotFound,    absl::StatusCode::kPermissionDenied,
      absl::StatusCode::kResourceExhausted,  absl::StatusCode::kFailedPrecondition,
      absl::StatusCode::kUnimplemented,      absl::StatusCode::kUnavailable, absl::StatusCode::kInternal,
      absl::StatusCode::kUnknown,            absl::StatusCode::kDataLoss};
  const google::protobuf::ServiceDescriptor* service =
      karakv::v1::StatsReply::descriptor()->file()->FindServiceByName("KaraKV");
  for (int i = 0; i < service->method_count(); ++i) {
    const std::string& method = service->method(i)->name();
    m->rpc_latency_->Add({{"method", method}}, rpc_buckets());
    for (absl::StatusCode code : kPresetCodes) {
      m->rpc_errors_->Add({{"method", method}, {"code", absl::StatusCodeToString(code)}});
    }
  }
  prometheus::BuildGauge()
      .Name("karakv_build_info")
      .Help("Always 1; the labels say what runs: the version, the git revision it was built from, the kernel backend")
      .Register(reg)
      .Add({{"version", karakv::version()}, {"revision", karakv::git_revision()}, {"backend", backend}})
      .Set(1);
  // The name every Prometheus client library gives it, so that dashboards' uptime panels find it.
  gauge("process_start_time_seconds", "Start time of the process since the Unix epoch, in seconds")
      ->Set(process_start_time_seconds());
  m->device_failed_ = gauge("karakv_device_failed",
                            "1 once the device failed (a CUDA kernel fault: the context is lost): every call but Ping "
                            "and Stats is refused until karakvd restarts; else 0");
  m->blocks_total_ = gauge("karakv_pool_blocks", "Blocks in the KV pool");
  m->blocks_used_ = gauge("karakv_pool_blocks_used", "Blocks held by at least one sequence");
  m->blocks_free_ = gauge("karakv_pool_blocks_free", "Blocks on the free list");
  m->kv_cache_usage_ = gauge("karakv_kv_cache_usage_perc",
                             "Fraction of the KV pool's blocks in use, 0 to 1 (used / total blocks; vLLM's "
                             "kv_cache_usage_perc)");
  m->tenant_blocks_ = &prometheus::BuildGauge()
                           .Name("karakv_tenant_blocks_in_use")
                           .Help("Block-table entries the sequences of a tenant hold, as --tenant_block_quota "
                                 "counts them; one series per tenant with an attached session")
                           .Register(reg);
  m->pool_bytes_ = gauge("karakv_pool_bytes", "Bytes of the KV pool");
  m->used_bytes_ = gauge("karakv_pool_used_bytes", "Bytes of the KV pool in used blocks");
  m->resident_tokens_ = gauge("karakv_resident_tokens", "Tokens resident over all sequences");
  m->sequences_ = gauge("karakv_sequences", "Live sequences");
  m->sessions_ = gauge("karakv_sessions", "Attached worker sessions");
  m->lease_expiries_ = counter("karakv_lease_expiries_total", "Sessions freed because their lease ran out");
  m->preemptions_ = counter("karakv_preemptions_total",
                             "Sequences preempted to free blocks for a higher-priority request (--preempt_on_pressure)");
  m->event_drops_ = counter("karakv_events_dropped_total",
                            "Events discarded because a WatchEvents reader fell behind its queue");
  m->kv_events_published_ = counter("karakv_kv_events_published_total",
                                    "KV-cache events (BlockStored, BlockRemoved, AllBlocksCleared) published on "
                                    "--kv_events_endpoint");
  m->kv_events_dropped_ = counter("karakv_kv_events_dropped_total",
                                  "KV-cache events dropped because more than the publisher's queue held waited "
                                  "for the next batch");
  m->kv_events_replays_ = counter("karakv_kv_events_replay_requests_total",
                                  "Replay requests served on --kv_events_replay_endpoint");
  m->tier_blocks_ = &prometheus::BuildCounter()
                         .Name("karakv_prefix_tier_blocks_total")
                         .Help("Prompt blocks asked of the prefix tier (--prefix_tier), by result: hit, miss, "
                               "corrupt (found but refused: header, geometry, key or checksum)")
                         .Register(reg);
  m->tier_writes_ = &prometheus::BuildCounter()
                         .Name("karakv_prefix_tier_writes_total")
                         .Help("Published prompt blocks for the prefix tier, by result: written, dropped (queue "
                               "full, tier paused after an error, evicted before the write, error reply)")
                         .Register(reg);
  m->tier_bytes_ = &prometheus::BuildCounter()
                        .Name("karakv_prefix_tier_bytes_total")
                        .Help("Bytes of block values moved to and from the prefix tier, by direction")
                        .Register(reg);
  // Every series exists from the start (at 0), with or without a tier: a rate() has its zero.
  for (const char* r : {"hit", "miss", "corrupt"}) m->tier_blocks_->Add({{"result", r}});
  for (const char* r : {"written", "dropped"}) m->tier_writes_->Add({{"result", r}});
  for (const char* d : {"read", "written"}) m->tier_bytes_->Add({{"direction", d}});
  m->tier_errors_ = counter("karakv_prefix_tier_errors_total",
                            "Prefix tier round trips that failed (connection, timeout, error reply); each pauses "
                            "the tier for a while");
  m->tier_skipped_ = counter("karakv_prefix_tier_skipped_total",
                             "Prefix tier lookups and write batches not sent while the tier paused after an error");
  m->tier_fetch_seconds_ = &prometheus::BuildHistogram()
                                .Name("karakv_prefix_tier_lookup_seconds")
                                .Help("One prefix tier lookup: a pipelined round trip for the rest of a prompt's chain")
                                .Register(reg)
                                .Add({}, prometheus::Histogram::BucketBoundaries{
                                             100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
                                             100e-3, 250e-3});
  m->decode_tokens_ = counter("karakv_decode_tokens_total", "Tokens produced by completed decode steps");
  m->decode_steps_ = counter("karakv_decode_steps_total", "Completed decode steps (last layer's Step)");
  m->decode_step_seconds_ = &prometheus::BuildHistogram()
                                 .Name("karakv_decode_step_duration_seconds")
                                 .Help("One decode step of a batch: from its layer-0 Step request to its last "
                                       "layer's Step reply (the worker's compute between layers included)")
                                 .Register(reg)
                                 .Add({}, prometheus::Histogram::BucketBoundaries{
                                              100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
                                              100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0});
  m->first_step_seconds_ = &prometheus::BuildHistogram()
                                .Name("karakv_time_to_first_token_seconds")
                                .Help("TTFT as the daemon sees it: from a sequence's first Append to the reply of "
                                      "its first completed decode step")
                                .Register(reg)
                                .Add({}, prometheus::Histogram::BucketBoundaries{
                                             1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0,
                                             2.5, 5.0, 10.0, 30.0});
  m->invariant_violations_ = counter("karakv_invariant_violations_total",
                                     "Pool invariant check failures (--check_invariants)");
  m->compactions_ = &prometheus::BuildCounter()
                         .Name("karakv_compactions_total")
                         .Help("Compactions run, by policy")
                         .Register(reg);
  m->compaction_failures_ = &prometheus::BuildCounter()
                                 .Name("karakv_compaction_failures_total")
                                 .Help("Compactions that failed (a kernel's error, no memory for a copy, a policy "
                                       "bug), by policy; each is also a compaction_failed event of its session")
                                 .Register(reg);
  m->tokens_removed_ = &prometheus::BuildCounter()
                            .Name("karakv_compaction_removed_tokens_total")
                            .Help("Tokens removed by compaction per (layer, KV head) row, by policy")
                            .Register(reg);
  m->compaction_seconds_ = &prometheus::BuildHistogram()
                                .Name("karakv_compaction_duration_seconds")
                                .Help("Time of one compaction (scoring, selection, gather), by policy")
                                .Register(reg);
  m->compression_factor_ = &prometheus::BuildGauge()
                                .Name("karakv_compression_factor")
                                .Help("How many times smaller the KV cache is than fp16 of every logical token: "
                                      "fp16 bytes of the logical tokens / bytes of the blocks held (4 = a quarter "
                                      "of the memory), by policy and kind (actual, or nominal for the storage "
                                      "format alone)")
                                .Register(reg);
  m->policy_kv_bytes_ = &prometheus::BuildGauge()
                             .Name("karakv_policy_kv_bytes")
                             .Help("Bytes of the blocks held by the sequences of a policy")
                             .Register(reg);
  m->logical_tokens_ = gauge("karakv_logical_tokens", "Tokens ever appended to live sequences");
  m->query_cache_bytes_ = gauge("karakv_query_cache_bytes", "Bytes of queries kept for scoring (Kara, SnapKV)");
  m->score_bytes_ = gauge("karakv_score_bytes", "Bytes of accumulated attention kept (H2O)");
  m->heap_in_use_bytes_ = gauge("karakv_heap_in_use_bytes", "Bytes the daemon's malloc has handed out and not got back");
  m->heap_held_bytes_ = gauge("karakv_heap_held_bytes",
                              "Bytes the daemon's malloc has taken from the OS (in use plus free chunks it keeps)");
  // The container's memory limit, read once: the dashboard sets the heap against it. No series
  // where there is no limit (a pod without limits.memory, a bare host).
  if (const kernels::MemoryLimit limit = kernels::memory_limit(); limit.bytes > 0) {
    gauge("karakv_memory_limit_bytes", "The cgroup memory limit of the daemon's container (the smallest over its "
                                       "cgroup's levels), in bytes; absent when unlimited")
        ->Set(double(limit.bytes));
  }
  m->prefix_lookups_ = counter("karakv_prefix_lookups_total", "Prefix cache lookups (Lookup, CreateSequence from a prefix)");
  m->prefix_lookup_tokens_ = counter("karakv_prefix_lookup_tokens_total", "Token ids the prefix lookups carried");
  m->prefix_hit_tokens_ = counter("karakv_prefix_hit_tokens_total", "Tokens the prefix lookups found cached");
  m->prefix_evictions_ = counter("karakv_prefix_evictions_total", "Cached prompt blocks evicted");
  m->prefix_cached_blocks_ = gauge("karakv_prefix_cached_blocks", "Blocks indexed by the prefix cache");
  m->prefix_unused_blocks_ = gauge("karakv_prefix_unused_blocks", "Cached blocks no sequence holds (reclaimable)");
  m->tier_pinned_blocks_ = gauge("karakv_prefix_tier_pinned_blocks",
                                 "Cached blocks the prefix tier's writer holds in the pool until they are written");
  for (const std::string& policy : policy_names()) {
    m->compactions_->Add({{"policy", policy}});
    m->compaction_failures_->Add({{"policy", policy}});
    m->tokens_removed_->Add({{"policy", policy}});
    m->compaction_seconds_->Add({{"policy", policy}}, compaction_buckets());
  }
  if (!listen.empty()) {
    try {
      m->exposer_ = std::make_unique<prometheus::Exposer>(listen);
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("cannot serve metrics on ", listen, ": ", e.what()));
    }
    m->exposer_->RegisterCollectable(m->collectable_);
  }
  return m;
}

void Metrics::observe_rpc(const std::string& method, double seconds, absl::StatusCode code) {
  rpc_latency_->Add({{"method", method}}, rpc_buckets()).Observe(seconds);
  if (code != absl::StatusCode::kOk) {
    rpc_errors_->Add({{"method", method}, {"code", absl::StatusCodeToString(code)}}).Increment();
  }
}

void Metrics::update_state(const CoreStats& s, size_t block_bytes, const kernels::Geometry&) {
  blocks_total_->Set(s.blocks_total);
  blocks_used_->Set(s.blocks_used);
  blocks_free_->Set(s.blocks_free);
  kv_cache_usage_->Set(s.blocks_total > 0 ? double(s.blocks_used) / double(s.blocks_total) : 0.0);
  pool_bytes_->Set(double(s.blocks_total) * double(block_bytes));
  used_bytes_->Set(double(s.blocks_used) * double(block_bytes));
  resident_tokens_->Set(double(s.resident_tokens));
  sequences_->Set(s.sequences);
  sessions_->Set(s.sessions);
  logical_tokens_->Set(double(s.logical_tokens));
  query_cache_bytes_->Set(double(s.query_cache_bytes));
  score_bytes_->Set(double(s.score_bytes));
  const HeapUsage heap = read_heap_usage();
  heap_in_use_bytes_->Set(double(heap.in_use_bytes));
  heap_held_bytes_->Set(double(heap.held_bytes));
  // A policy's gauges exist while it has live sequences; a stale ratio would outlive them otherwise.
  // A tenant's exists while it has an attached session.
  std::lock_guard<std::mutex> lock(policy_mu_);
  std::set<std::string> tenants;
  for (const auto& [tenant, blocks] : s.tenant_blocks) {
    tenants.insert(tenant);
    tenant_blocks_->Add({{"tenant", tenant}}).Set(double(blocks));
  }
  for (const std::string& tenant : exported_tenants_) {
    if (!tenants.count(tenant)) tenant_blocks_->Remove(&tenant_blocks_->Add({{"tenant", tenant}}));
  }
  exported_tenants_ = std::move(tenants);
  std::set<std::string> live;
  for (const auto& [policy, p] : s.policies) {
    if (p.sequences == 0) continue;
    live.insert(policy);
    compression_factor_->Add({{"policy", policy}, {"kind", "actual"}})
        .Set(p.kv_bytes ? double(p.fp16_bytes) / double(p.kv_bytes) : 0.0);
    compression_factor_->Add({{"policy", policy}, {"kind", "nominal"}}).Set(p.nominal_ratio);
    policy_kv_bytes_->Add({{"policy", policy}}).Set(double(p.kv_bytes));
  }
  for (const std::string& policy : exported_policies_) {
    if (live.count(policy)) continue;
    compression_factor_->Remove(&compression_factor_->Add({{"policy", policy}, {"kind", "actual"}}));
    compression_factor_->Remove(&compression_factor_->Add({{"policy", policy}, {"kind", "nominal"}}));
    policy_kv_bytes_->Remove(&policy_kv_bytes_->Add({{"policy", policy}}));
  }
  exported_policies_ = std::move(live);
  update_prefix_cache(s);
}

namespace {
// Counters that follow a total kept elsewhere advance by what happened since the last snapshot.
void advance(prometheus::Counter* c, uint64_t total) {
  if (double(total) > c->Value()) c->Increment(double(total) - c->Value());
}
}  // namespace

void Metrics::update_prefix_cache(const CoreStats& s) {
  advance(prefix_lookups_, s.prefix_lookups);
  advance(prefix_lookup_tokens_, s.prefix_lookup_tokens);
  advance(prefix_hit_tokens_, s.prefix_hit_tokens);
  advance(prefix_evictions_, s.prefix_evictions);
  prefix_cached_blocks_->Set(s.prefix_cached_blocks);
  prefix_unused_blocks_->Set(s.prefix_unused_blocks);
  tier_pinned_blocks_->Set(s.tier_pinned_blocks);
}

void Metrics::compaction_failed(const std::string& policy) { compaction_failures_->Add({{"policy", policy}}).Increment(); }

void Metrics::compaction(const std::string& policy, int tokens_removed, double seconds) {
  compactions_->Add({{"policy", policy}}).Increment();
  tokens_removed_->Add({{"policy", policy}}).Increment(tokens_removed);
  compaction_seconds_->Add({{"policy", policy}}, compaction_buckets()).Observe(seconds);
}

std::vector<RpcErrorCount> Metrics::rpc_errors() const {
  std::vector<RpcErrorCount> out;
  for (const prometheus::MetricFamily& family : rpc_errors_->Collect()) {
    for (const prometheus::ClientMetric& m : family.metric) {
      RpcErrorCount e;
      for (const prometheus::ClientMetric::Label& l : m.label) {
        if (l.name == "method") e.method = l.value;
        if (l.name == "code") e.code = l.value;
      }
      e.count = static_cast<uint64_t>(m.counter.value);
      if (e.count > 0) out.push_back(std::move(e));  // the label sets made at zero are not failures
    }
  }
  std::sort(out.begin(), out.end(), [](const RpcErrorCount& a, const RpcErrorCount& b) {
    return std::tie(a.method, a.code) < std::tie(b.method, b.code);
  });
  return out;
}

void Metrics::invariant_violation() { invariant_violations_->Increment(); }
void Metrics::device_failed() { device_failed_->Set(1); }

void Metrics::lease_expired(int n) { lease_expiries_->Increment(n); }

void Metrics::preempted() { preemptions_->Increment(); }

void Metrics::set_events_dropped(uint64_t total) { advance(event_drops_, total); }

void Metrics::prefix_tier_fetch(double seconds) { tier_fetch_seconds_->Observe(seconds); }

void Metrics::update_prefix_tier(const PrefixTierStats& t) {
  advance(&tier_blocks_->Add({{"result", "hit"}}), t.hits);
  advance(&tier_blocks_->Add({{"result", "miss"}}), t.misses);
  advance(&tier_blocks_->Add({{"result", "corrupt"}}), t.corrupt);
  advance(&tier_writes_->Add({{"result", "written"}}), t.writes);
  advance(&tier_writes_->Add({{"result", "dropped"}}), t.write_dropped);
  advance(&tier_bytes_->Add({{"direction", "read"}}), t.bytes_read);
  advance(&tier_bytes_->Add({{"direction", "written"}}), t.bytes_written);
  advance(tier_errors_, t.errors);
  advance(tier_skipped_, t.skipped);
}

void Metrics::kv_events_published(size_t n) { kv_events_published_->Increment(double(n)); }
void Metrics::kv_events_dropped(uint64_t n) { kv_events_dropped_->Increment(double(n)); }
void Metrics::kv_events_replay_request() { kv_events_replays_->Increment(); }

void Metrics::decode_step(int tokens, double step_seconds, const std::vector<double>& first_step_seconds) {
  decode_steps_->Increment();
  decode_tokens_->Increment(tokens);
  decode_step_seconds_->Observe(step_seconds);
  for (double s : first_step_seconds) first_step_seconds_->Observe(s);
}

}  // namespace karakv::server
