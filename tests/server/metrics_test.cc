// karakvd's /metrics as dashboards read it: build info and start time, the 0-1 KV usage gauge,
// per-tenant blocks bounded by the attached tenants, label sets that exist at zero before the first
// event, RPC latency buckets past a second, and the compression factor's name.
#include "server/metrics.h"

#include <chrono>
#include <map>
#include <string>

#include "util/version.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/policy.h"
#include "server/service.h"
#include "spdlog/spdlog.h"
#include "test_geometry.h"

namespace karakv::server {
namespace {

using Labels = std::map<std::string, std::string>;

const prometheus::ClientMetric* find(const std::vector<prometheus::MetricFamily>& families, const std::string& name,
                                     const Labels& labels, prometheus::MetricType* type = nullptr) {
  for (const auto& f : families) {
    if (f.name != name) continue;
    for (const auto& m : f.metric) {
      Labels got;
      for (const auto& l : m.label) got[l.name] = l.value;
      if (got != labels) continue;
      if (type != nullptr) *type = f.type;
      return &m;
    }
  }
  return nullptr;
}

// The series' value (a histogram's sample count); -1 when there is no such series.
double value(Metrics& m, const std::string& name, const Labels& labels) {
  prometheus::MetricType type;
  const std::vector<prometheus::MetricFamily> families = m.registry()->Collect();  // outlives `metric`
  const auto* metric = find(families, name, labels, &type);
  if (metric == nullptr) return -1;
  if (type == prometheus::MetricType::Histogram) return double(metric->histogram.sample_count);
  return type == prometheus::MetricType::Gauge ? metric->gauge.value : metric->counter.value;
}

// Label sets of a family, sorted.
std::vector<Labels> series(Metrics& m, const std::string& name) {
  std::vector<Labels> out;
  for (const auto& f : m.registry()->Collect()) {
    if (f.name != name) continue;
    for (const auto& metric : f.metric) {
      Labels got;
      for (const auto& l : metric.label) got[l.name] = l.value;
      out.push_back(got);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

class MetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::err);
    CoreConfig rc;
    rc.geometry = testing::small_test_geometry(kernels::DType::kFloat32);  // L2 Hq4 Hk2 D8, block 4
    rc.pool_bytes = 32 * rc.geometry.block_bytes();
    core_ = *Core::create(rc, kernels::make_cpu_backend(1));
    metrics_ = *Metrics::create("", "cpu");
    service_ = std::make_unique<KaraKVService>(core_.get(), metrics_.get(), true);
  }
  void refresh() { metrics_->update_state(core_->stats(), core_->geometry().block_bytes(), core_->geometry()); }
  std::string attach(const std::string& tenant) {
    v1::AttachRequest req;
    req.set_staging_bytes(1 << 16);
    req.set_tenant(tenant);
    v1::AttachReply reply;
    EXPECT_TRUE(service_->Handle(req, &reply).ok());
    return reply.session_id();
  }
  void detach(const std::string& session) {
    v1::DetachRequest req;
    req.set_session_id(session);
    v1::DetachReply reply;
    EXPECT_TRUE(service_->Handle(req, &reply).ok());
  }
  // A sequence of `tokens` tokens (blocks of 4) appended inline.
  uint64_t sequence(const std::string& session, int tokens) {
    v1::CreateSequenceRequest c;
    c.set_session_id(session);
    v1::CreateSequenceReply cr;
    EXPECT_TRUE(service_->Handle(c, &cr).ok());
    v1::AppendRequest a;
    a.set_session_id(session);
    a.set_sequence_id(cr.sequence_id());
    a.set_num_tokens(tokens);
    a.mutable_k()->set_data(std::string(core_->append_bytes(tokens), '\0'));
    a.mutable_v()->set_data(std::string(core_->append_bytes(tokens), '\0'));
    v1::AppendReply ar;
    EXPECT_TRUE(service_->Handle(a, &ar).ok());
    return cr.sequence_id();
  }

  std::unique_ptr<Core> core_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<KaraKVService> service_;
};

TEST_F(MetricsTest, BuildInfoNamesVersionRevisionAndBackend) {
  const auto build = series(*metrics_, "karakv_build_info");
  ASSERT_EQ(build.size(), 1u);
  EXPECT_EQ(build[0].at("version"), KARAKV_EXPECTED_VERSION);
  EXPECT_EQ(build[0].at("backend"), "cpu");
  EXPECT_EQ(build[0].at("revision"), karakv::git_revision());
  EXPECT_THAT(build[0].at("revision"), ::testing::MatchesRegex("[0-9a-f]{7,40}|unknown"));
  EXPECT_EQ(value(*metrics_, "karakv_build_info", build[0]), 1);
}

TEST_F(MetricsTest, ProcessStartTimeIsThisProcesssStartInEpochSeconds) {
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  const double start = value(*metrics_, "process_start_time_seconds", {});
  // This test binary started moments ago (clock ticks are 10 ms; allow a slow machine).
  EXPECT_LE(start, now + 0.01);
  EXPECT_GT(start, now - 600);
}

TEST_F(MetricsTest, KvCacheUsageIsTheFractionOfBlocksInUse) {
  refresh();
  EXPECT_EQ(value(*metrics_, "karakv_kv_cache_usage_perc", {}), 0);
  const std::string s = attach("a");
  sequence(s, 32);  // 8 blocks of the 32
  refresh();
  EXPECT_EQ(value(*metrics_, "karakv_pool_blocks_used", {}), 8);
  EXPECT_DOUBLE_EQ(value(*metrics_, "karakv_kv_cache_usage_perc", {}), 0.25);
}

TEST_F(MetricsTest, TenantBlocksFollowTheAttachedTenantsOnly) {
  refresh();
  EXPECT_TRUE(series(*metrics_, "karakv_tenant_blocks_in_use").empty());
  const std::string a = attach("alpha");
  const std::string b = attach("beta");
  sequence(a, 12);  // 3 blocks
  sequence(a, 5);   // 2 blocks
  refresh();
  EXPECT_EQ(series(*metrics_, "karakv_tenant_blocks_in_use"),
            (std::vector<Labels>{{{"tenant", "alpha"}}, {{"tenant", "beta"}}}));
  EXPECT_EQ(value(*metrics_, "karakv_tenant_blocks_in_use", {{"tenant", "alpha"}}), 5);
  EXPECT_EQ(value(*metrics_, "karakv_tenant_blocks_in_use", {{"tenant", "beta"}}), 0);
  detach(a);
  refresh();
  EXPECT_EQ(series(*metrics_, "karakv_tenant_blocks_in_use"), (std::vector<Labels>{{{"tenant", "beta"}}}));
}

TEST_F(MetricsTest, KnownLabelSetsExistAtZeroBeforeTheFirstEvent) {
  for (const char* method : {"Attach", "Append", "Step", "Attend", "Stats", "WatchEvents", "Ping"}) {
    EXPECT_EQ(value(*metrics_, "karakv_rpc_duration_seconds", {{"method", method}}), 0) << method;
    for (const char* code : {"INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "INTERNAL", "UNAVAILABLE"}) {
      EXPECT_EQ(value(*metrics_, "karakv_rpc_errors_total", {{"method", method}, {"code", code}}), 0)
          << method << " " << code;
    }
  }
  for (const std::string& policy : policy_names()) {
    EXPECT_EQ(value(*metrics_, "karakv_compactions_total", {{"policy", policy}}), 0) << policy;
    EXPECT_EQ(value(*metrics_, "karakv_compaction_failures_total", {{"policy", policy}}), 0) << policy;
    EXPECT_EQ(value(*metrics_, "karakv_compaction_removed_tokens_total", {{"policy", policy}}), 0) << policy;
    EXPECT_EQ(value(*metrics_, "karakv_compaction_duration_seconds", {{"policy", policy}}), 0) << policy;
  }
  // The zeros are not failures: Stats lists only what happened.
  EXPECT_TRUE(metrics_->rpc_errors().empty());
  metrics_->observe_rpc("Append", 0.001, absl::StatusCode::kNotFound);
  const auto errors = metrics_->rpc_errors();
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].method, "Append");
  EXPECT_EQ(errors[0].code, "NOT_FOUND");
  EXPECT_EQ(errors[0].count, 1u);
}

TEST_F(MetricsTest, RpcLatencyBucketsReachPastOneSecond) {
  metrics_->observe_rpc("Compact", 3.0, absl::StatusCode::kOk);
  const auto families = metrics_->registry()->Collect();
  const auto* m = find(families, "karakv_rpc_duration_seconds", {{"method", "Compact"}});
  ASSERT_NE(m, nullptr);
  std::vector<double> bounds;
  uint64_t at_or_below_5s = 0, at_or_below_1s = 0;
  for (const auto& b : m->histogram.bucket) {
    bounds.push_back(b.upper_bound);
    if (b.upper_bound == 1.0) at_or_below_1s = b.cumulative_count;
    if (b.upper_bound == 5.0) at_or_below_5s = b.cumulative_count;
  }
  EXPECT_THAT(bounds, ::testing::IsSupersetOf({1.0, 2.5, 5.0, 10.0, 30.0, 60.0}));
  EXPECT_EQ(at_or_below_1s, 0u);
  EXPECT_EQ(at_or_below_5s, 1u);  // a 3 s call lands in a finite bucket, not only in +Inf
}

TEST_F(MetricsTest, CompressionIsAFactorNotARatio) {
  CoreStats s;
  s.blocks_total = 32;
  PolicyStats p;
  p.sequences = 1;
  p.fp16_bytes = 4000;
  p.kv_bytes = 1000;
  p.nominal_ratio = 2;
  s.policies["streaming"] = p;
  metrics_->update_state(s, core_->geometry().block_bytes(), core_->geometry());
  EXPECT_EQ(value(*metrics_, "karakv_compression_factor", {{"policy", "streaming"}, {"kind", "actual"}}), 4);
  EXPECT_EQ(value(*metrics_, "karakv_compression_factor", {{"policy", "streaming"}, {"kind", "nominal"}}), 2);
  EXPECT_TRUE(series(*metrics_, "karakv_compression_ratio").empty());
  s.policies.clear();
  metrics_->update_state(s, core_->geometry().block_bytes(), core_->geometry());
  EXPECT_TRUE(series(*metrics_, "karakv_compression_factor").empty());  // no stale gauge
}

}  // namespace
}  // namespace karakv::server
