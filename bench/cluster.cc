// karakv-bench cluster: two karakvd "nodes" sharing one real redis-server as their prefix tier
// (--prefix_tier), and a third daemon without a tier, in one run.
//
// Time to first token, timed as prefix.cc times a request (start from the cached prefix, Append
// what is left, Attend it on every layer, one decode Step on every layer), for four kinds of
// request on node B: cold (a system prompt nobody has seen: a tier miss, then a full prefill),
// cold on the daemon without a tier (what the miss costs), a tier hit (the system prompt was
// prefilled on node A: B fills its pool from Redis and prefills only the request's own tokens),
// and a local hit (B has the blocks already). Then the tier's cost when it never hits: Append
// throughput with token ids (every Append publishes its blocks, which the tier writes to Redis)
// on a daemon with the tier against one without, rounds alternating.
#include <hiredis/hiredis.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench_common.h"
#include "harness.h"
#include "karakv/client.h"

ABSL_DECLARE_FLAG(std::string, redis_server);
ABSL_FLAG(int32_t, cluster_system_tokens, 1000, "cluster: tokens of each system prompt");
ABSL_FLAG(int32_t, cluster_own_tokens, 64, "cluster: tokens of each request after its system prompt");
ABSL_FLAG(int32_t, cluster_prompts, 6, "cluster: system prompts measured (each: cold, tier hit, local hit)");
ABSL_FLAG(int32_t, cluster_append_tokens, 512, "cluster: tokens per Append in the never-hit cost run");
ABSL_FLAG(int32_t, cluster_append_rounds, 12, "cluster: rounds of the never-hit cost run (each: 8 Appends per daemon)");

namespace karakv::bench {
namespace {

constexpr char kFingerprint[] = "karakv-bench-smollm2-135m";

// A redis-server on a loopback TCP port (the tier is reached over TCP, as across nodes).
struct TierRedis {
  std::unique_ptr<ChildProcess> process;
  int port = 0;
  redisContext* ctx = nullptr;
  ~TierRedis() {
    if (ctx != nullptr) redisFree(ctx);
  }
  long long dbsize() {
    auto* r = static_cast<redisReply*>(redisCommand(ctx, "DBSIZE"));
    const long long n = r != nullptr && r->type == REDIS_REPLY_INTEGER ? r->integer : -1;
    if (r != nullptr) freeReplyObject(r);
    return n;
  }
};

absl::StatusOr<std::unique_ptr<TierRedis>> start_tier_redis(const TempDir& dir) {
  auto t = std::make_unique<TierRedis>();
  for (int attempt = 0; attempt < 20 && t->ctx == nullptr; ++attempt) {
    t->port = 20000 + int((getpid() * 7919 + attempt * 104729) % 30000);
    std::vector<std::string> argv = {absl::GetFlag(FLAGS_redis_server), "--port", std::to_string(t->port), "--bind",
                                     "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir.file(""),
                                     "--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lru", "--daemonize", "no"};
    progress(absl::StrCat("starting ", absl::StrJoin(argv, " ")));
    auto child = ChildProcess::start("redis-tier", argv, dir.file("redis-tier.log"));
    if (!child.ok()) return child.status();
    t->process = std::move(*child);
    const auto start = Clock::now();
    while (t->process->running() && seconds_since(start) < 15) {
      timeval tv{1, 0};
      redisContext* c = redisConnectWithTimeout("127.0.0.1", t->port, tv);
      if (c != nullptr && c->err == 0) {
        t->ctx = c;
        break;
      }
      if (c != nullptr) redisFree(c);
      sleep_ms(50);
    }
    if (t->ctx == nullptr && t->process->running()) return absl::DeadlineExceededError("redis-server did not answer");
  }
  if (t->ctx == nullptr) {
    return absl::FailedPreconditionError("redis-server did not start on a free port (install it: apt-get install "
                                         "redis-server, or pass --redis_server)");
  }
  return t;
}

absl::StatusOr<std::unique_ptr<karakv::Client>> attach_node(const Daemon& d, uint64_t staging, const std::string& worker,
                                                            bool fingerprint) {
  karakv::ClientOptions o;
  o.target = d.target;
  o.staging_bytes = staging;
  o.worker_id = worker;
  if (fingerprint) o.model_fingerprint = kFingerprint;
  return karakv::Client::Attach(o);
}

// Request ids: system prompt `s` (ids from 1 + s * 100000), then tokens of its own.
std::vector<int32_t> prompt_of(int system_tokens, int own_tokens, int s, int own) {
  std::vector<int32_t> ids(size_t(system_tokens + own_tokens));
  std::iota(ids.begin(), ids.begin() + system_tokens, 1 + s * 100000);
  std::iota(ids.begin() + system_tokens, ids.end(), 50000000 + s * 1000 + own * own_tokens);
  return ids;
}

// Appends of fresh prompts with token ids (each publishes its blocks, none is ever looked up):
// tokens per second over `count` Appends.
absl::StatusOr<double> append_rate(karakv::Client& c, const kn::Geometry& g, int tokens, int count, int* next_id) {
  c.reset_staging();
  auto k = c.alloc(c.append_bytes(tokens)), v = c.alloc(c.append_bytes(tokens));
  auto ids = c.alloc(size_t(tokens) * 4);
  for (auto* b : {&k, &v, &ids}) {
    if (!b->ok()) return b->status();
  }
  std::memset(k->data(), 0x3c, k->size());
  std::memset(v->data(), 0x3a, v->size());
  const auto start = Clock::now();
  for (int i = 0; i < count; ++i) {
    auto seq = c.CreateSequence();
    if (!seq.ok()) return seq.status();
    int32_t* id = ids->as<int32_t>().data();
    for (int t = 0; t < tokens; ++t) id[t] = (*next_id)++;
    auto len = c.Append(*seq, std::span<const int32_t>(id, size_t(tokens)), *k, *v);
    if (!len.ok()) return len.status();
    if (auto s = c.Release(*seq); !s.ok()) return s.status();
  }
  (void)g;
  return double(tokens) * count / seconds_since(start);
}

}  // namespace

absl::StatusOr<std::vector<Row>> run_cluster(const TempDir& dir) {
  const kn::Geometry g = smollm_geometry();
  const int system = std::max(16, absl::GetFlag(FLAGS_cluster_system_tokens));
  const int own = std::max(1, absl::GetFlag(FLAGS_cluster_own_tokens));
  const int prompts = std::max(1, absl::GetFlag(FLAGS_cluster_prompts));
  const int append_tokens = std::max(16, absl::GetFlag(FLAGS_cluster_append_tokens));
  const int rounds = std::max(1, absl::GetFlag(FLAGS_cluster_append_rounds));
  const int n = system + own;
  auto redis = start_tier_redis(dir);
  if (!redis.ok()) return redis.status();
  const std::string tier = absl::StrCat("--prefix_tier=redis://127.0.0.1:", (*redis)->port);
  // Room for a few prompts' blocks; older cached prompts are evicted as in any busy node.
  const size_t blocks = size_t(8) * ((std::max(n, append_tokens) + g.block_size - 1) / g.block_size) + 64;
  std::vector<std::string> flags = smollm_flags(blocks * g.block_bytes());
  std::vector<std::string> tier_flags = flags;
  tier_flags.push_back(tier);
  tier_flags.push_back("--prefix_tier_timeout_ms=1000");  // a loaded machine; no request here should miss by time
  auto a = start_karakvd(dir, "karakvd-node-a", tier_flags);
  if (!a.ok()) return a.status();
  auto b = start_karakvd(dir, "karakvd-node-b", tier_flags);
  if (!b.ok()) return b.status();
  auto plain = start_karakvd(dir, "karakvd-no-tier", flags);
  if (!plain.ok()) return plain.status();
  const uint64_t staging = 2 * append_tensor_bytes(g, std::max(n, append_tokens)) + 2 * size_t(n) * g.q_token_elems() * 4 +
                           size_t(append_tokens) * 4 + (4 << 20);
  auto ca = attach_node(*a, staging, "node-a", true);
  auto cb = attach_node(*b, staging, "node-b", true);
  auto cp = attach_node(*plain, staging, "no-tier", true);
  for (auto* c : {&ca, &cb, &cp}) {
    if (!c->ok()) return c->status();
  }

  std::vector<double> cold, cold_plain, tier_hit, local_hit;
  uint64_t tier_cached = 0, tier_prefilled = 0, cold_prefilled = 0;
  long long expected_keys = 0;
  const int blocks_per_request = n / g.block_size;
  for (int s = 0; s < prompts; ++s) {
    progress(absl::StrFormat("cluster: system prompt %d of %d", s + 1, prompts));
    // Cold on B: a system prompt nobody has seen (ids far from every other prompt's).
    auto c1 = prefix_request(**cb, g, prompt_of(system, own, 1000 + s, 0));
    if (!c1.ok()) return c1.status();
    cold.push_back(c1->ttft_s * 1e3);
    cold_prefilled += c1->prefilled;
    expected_keys += blocks_per_request;
    auto c2 = prefix_request(**cp, g, prompt_of(system, own, 2000 + s, 0));
    if (!c2.ok()) return c2.status();
    cold_plain.push_back(c2->ttft_s * 1e3);
    // Node A prefills system prompt s; B then starts from it through the tier.
    auto pa = prefix_request(**ca, g, prompt_of(system, own, s, 0));
    if (!pa.ok()) return pa.status();
    expected_keys += blocks_per_request;
    const auto wait = Clock::now();
    while ((*redis)->dbsize() < expected_keys) {
      if (seconds_since(wait) > 30) {
        return absl::DeadlineExceededError(absl::StrFormat(
            "the tier holds %lld keys after 30 s, expected %lld: node A's writes did not arrive (see its log)",
            (*redis)->dbsize(), expected_keys));
      }
      sleep_ms(5);
    }
    auto hit = prefix_request(**cb, g, prompt_of(system, own, s, 1));
    if (!hit.ok()) return hit.status();
    if (hit->cached < (system / g.block_size) * g.block_size) {
      return absl::InternalError(absl::StrFormat("node B started from %d cached tokens of system prompt %d, expected %d",
                                                 hit->cached, s, (system / g.block_size) * g.block_size));
    }
    tier_hit.push_back(hit->ttft_s * 1e3);
    tier_cached += hit->cached;
    tier_prefilled += hit->prefilled;
    expected_keys += (n - hit->cached) / g.block_size;
    auto local = prefix_request(**cb, g, prompt_of(system, own, s, 2));
    if (!local.ok()) return local.status();
    local_hit.push_back(local->ttft_s * 1e3);
    expected_keys += (n - local->cached) / g.block_size;
  }

  // The tier's cost when it never hits: Append with ids on B (tier) and on the daemon without,
  // alternating, fresh ids every time.
  std::vector<double> with_tier, without_tier;
  int next_id = 900000000;
  // Both pools touched all through first (a pool's first pass takes its page faults).
  for (karakv::Client* c : {cb->get(), cp->get()}) {
    auto warm = append_rate(*c, g, append_tokens, int(blocks * g.block_size / append_tokens) + 8, &next_id);
    if (!warm.ok()) return warm.status();
  }
  // Where the CPU goes: the daemons' and redis-server's CPU seconds over the never-hit run.
  const double cpu_b0 = cpu_seconds(b->process->pid()), cpu_plain0 = cpu_seconds(plain->process->pid());
  const double cpu_redis0 = cpu_seconds((*redis)->process->pid());
  const long long keys0 = (*redis)->dbsize();
  for (int r = 0; r < rounds; ++r) {
    progress(absl::StrFormat("cluster: never-hit Append round %d of %d", r + 1, rounds));
    for (int order = 0; order < 2; ++order) {
      const bool tier_first = (r % 2 == 0);
      const bool use_tier = (order == 0) == tier_first;
      auto rate = append_rate(use_tier ? **cb : **cp, g, append_tokens, 8, &next_id);
      if (!rate.ok()) return rate.status();
      (use_tier ? with_tier : without_tier).push_back(*rate);
    }
  }
  const double cpu_b = cpu_seconds(b->process->pid()) - cpu_b0;
  const double cpu_plain = cpu_seconds(plain->process->pid()) - cpu_plain0;
  const double cpu_redis = cpu_seconds((*redis)->process->pid()) - cpu_redis0;
  // The writer's backlog drains after the run: the keys it added, against the blocks published.
  long long keys_written = (*redis)->dbsize() - keys0;
  for (int still = 0; still < 10; sleep_ms(50)) {
    const long long k = (*redis)->dbsize() - keys0;
    still = k == keys_written ? still + 1 : 0;
    keys_written = k;
  }
  const long long published = (long long)rounds * 8 * (append_tokens / g.block_size);
  auto stats_b = (*cb)->Stats(true);
  if (!stats_b.ok()) return stats_b.status();
  if (!stats_b->invariant_error.empty()) return absl::InternalError(stats_b->invariant_error);
  const long long keys = (*redis)->dbsize();
  ca->reset();
  cb->reset();
  cp->reset();
  stop_or_warn(*a);
  stop_or_warn(*b);
  stop_or_warn(*plain);

  const double mb_per_token = double(append_tensor_bytes(g, 1)) * 2 / 1e6;
  std::string table = absl::StrFormat(
      "cluster: 2 nodes + 1 redis-server (TCP loopback), %d-token system prompts + %d own tokens, %d prompts "
      "(TTFT in ms)\n%-34s %10s %10s %10s\n",
      system, own, prompts, "request on node B", "TTFT p50", "TTFT mean", "TTFT max");
  auto line = [&](const std::string& name, const std::vector<double>& t) {
    absl::StrAppend(&table, absl::StrFormat("%-34s %10.1f %10.1f %10.1f\n", name, percentile(t, 50),
                                            std::accumulate(t.begin(), t.end(), 0.0) / double(t.size()),
                                            *std::max_element(t.begin(), t.end())));
  };
  line("cold (tier miss, full prefill)", cold);
  line("cold, daemon without a tier", cold_plain);
  line("tier hit (prefilled on node A)", tier_hit);
  line("local hit", local_hit);
  absl::StrAppend(&table,
                  absl::StrFormat("tier hits: %llu tokens started from the tier, %llu prefilled; cold: %llu prefilled; "
                                  "redis keys at the end: %lld\n",
                                  (unsigned long long)tier_cached, (unsigned long long)tier_prefilled,
                                  (unsigned long long)cold_prefilled, keys));
  absl::StrAppend(&table, absl::StrFormat("never-hit Append (%d tokens with ids, %.1f MB each), %d rounds: with tier "
                                          "%.0f tok/s (%.2f GB/s), without %.0f tok/s (%.2f GB/s) (medians)\n",
                                          append_tokens, append_tokens * mb_per_token, rounds,
                                          percentile(with_tier, 50), percentile(with_tier, 50) * mb_per_token / 1e3,
                                          percentile(without_tier, 50),
                                          percentile(without_tier, 50) * mb_per_token / 1e3));
  absl::StrAppend(&table, absl::StrFormat("  CPU seconds over that run (the same number of Appends each): daemon with the "
                                          "tier %.2f, daemon without %.2f, redis-server %.2f; blocks written to the "
                                          "tier %lld of %lld published (the rest: writer queue full)\n",
                                          cpu_b, cpu_plain, cpu_redis, keys_written, published));
  extra_reports().push_back(table);

  std::vector<Row> rows;
  auto row = [&](std::string metric, double value, std::string baseline_name, double baseline, std::string unit,
                 std::optional<Target> target, bool percent = false) {
    rows.push_back({"cluster", std::move(metric), value, std::move(baseline_name), baseline, std::move(unit), percent,
                    target});
  };
  row("TTFT p50, tier hit on another node", percentile(tier_hit, 50), "cold prefill", percentile(cold, 50), "ms",
      Target{Target::Kind::kAtMost, 0.3});
  row("TTFT p50, cold with a tier miss", percentile(cold, 50), "cold, no tier", percentile(cold_plain, 50), "ms",
      std::nullopt);
  row("prefill tokens avoided by the tier", double(tier_cached), "prompt tokens of tier-hit requests",
      double(tier_cached + tier_prefilled), "tokens", std::nullopt, /*percent=*/true);
  row(absl::StrFormat("Append %d tokens with ids, tier never hits", append_tokens), percentile(with_tier, 50),
      "no tier", percentile(without_tier, 50), "tok/s", Target{Target::Kind::kAtLeast, 0.98});
  return rows;
}

std::string cluster_how() {
  return absl::StrFormat(
      "cluster SmolLM2-135M geometry fp16, nodes A and B with --prefix_tier on one redis-server (TCP "
      "loopback, allkeys-lru), a third daemon without; %d-token system prompts + %d own tokens, %d prompts; "
      "never-hit cost: %d rounds of 8 Appends of %d tokens with ids per daemon, alternating",
      absl::GetFlag(FLAGS_cluster_system_tokens), absl::GetFlag(FLAGS_cluster_own_tokens),
      absl::GetFlag(FLAGS_cluster_prompts), absl::GetFlag(FLAGS_cluster_append_rounds),
      absl::GetFlag(FLAGS_cluster_append_tokens));
}

}  // namespace karakv::bench
