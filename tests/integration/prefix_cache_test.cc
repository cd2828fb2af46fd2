// Prefix caching across worker processes: one process appends a prompt with its token ids and
// exits; a second process looks the prompt up, starts from the cached blocks, prefills only the
// rest, and gets attention outputs bitwise equal to a full prefill; a third, of another tenant,
// misses. The workers are this binary re-executed (a fresh process, its own gRPC channel).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "common/synthetic.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "karakv/client.h"
#include "tests/integration/daemon.h"
#include "tests/integration/redis_server.h"

namespace karakv {
namespace {

using ::testing::HasSubstr;
using synthetic::Tensor;
using testing::Daemon;
using testing::http_get;

constexpr uint64_t kSeed = 5;
constexpr int kShared = 40;  // tokens both prompts share: 2 whole blocks of 16 (and 8 more)
constexpr int kPromptB = 70;

std::vector<std::string> daemon_flags() {
  return {"--layers=3", "--q_heads=6", "--kv_heads=2", "--head_dim=32", "--block_size=16", "--dtype=fp16",
          "--pool_bytes=16MiB"};
}

std::vector<int32_t> prompt_a() {
  std::vector<int32_t> p(kShared + 5);
  std::iota(p.begin(), p.end(), 1000);
  return p;
}
// Shares the first kShared tokens with prompt_a and differs after them.
std::vector<int32_t> prompt_b() {
  std::vector<int32_t> p(kPromptB);
  std::iota(p.begin(), p.begin() + kShared, 1000);
  std::iota(p.begin() + kShared, p.end(), 50000);
  return p;
}
// The K/V of a prompt token depends on its id and position only, as in a real model's prefill.
uint64_t key_of(int32_t id) { return 7000 + uint64_t(id); }

// K or V of prompt tokens [from, to): [L][T][Hk][D].
std::vector<uint8_t> prompt_kv(const Geometry& g, Tensor t, const std::vector<int32_t>& prompt, int from, int to) {
  const size_t tok = g.kv_token_elems() * kernels::dtype_size(g.dtype);
  const int n = to - from;
  std::vector<uint8_t> out(size_t(g.num_layers) * n * tok);
  for (int l = 0; l < g.num_layers; ++l) {
    for (int i = 0; i < n; ++i) {
      synthetic::fill_token(out.data() + (size_t(l) * n + i) * tok, g, kSeed, t, key_of(prompt[from + i]), l, from + i);
    }
  }
  return out;
}

absl::StatusOr<int> append(Client& c, uint64_t seq, const std::vector<int32_t>& prompt, int from, int to,
                           bool with_ids) {
  const Geometry& g = c.geometry();
  c.reset_staging();
  auto k = c.alloc(c.append_bytes(to - from)), v = c.alloc(c.append_bytes(to - from));
  if (!k.ok()) return k.status();
  if (!v.ok()) return v.status();
  const auto kb = prompt_kv(g, Tensor::kKey, prompt, from, to), vb = prompt_kv(g, Tensor::kValue, prompt, from, to);
  std::memcpy(k->data(), kb.data(), kb.size());
  std::memcpy(v->data(), vb.data(), vb.size());
  if (!with_ids) return c.Append(seq, to - from, *k, *v);
  return c.Append(seq, std::span<const int32_t>(prompt.data() + from, to - from), *k, *v);
}

// Attend of the last n positions on every layer, then one decode step; all outputs.
absl::StatusOr<std::vector<float>> outputs(Client& c, uint64_t seq, int n, int64_t next_pos) {
  const Geometry& g = c.geometry();
  std::vector<float> all;
  for (int l = 0; l < g.num_layers; ++l) {
    Buffer q = Client::alloc_heap(c.q_bytes(n)), out = Client::alloc_heap(c.q_bytes(n));
    for (int i = 0; i < n; ++i) synthetic::fill_query(q.as<float>().data() + i * g.q_token_elems(), g, kSeed, 1, l, i);
    if (auto s = c.Attend(seq, l, n, q, out); !s.ok()) return s;
    all.insert(all.end(), out.as<float>().begin(), out.as<float>().end());
  }
  const uint64_t ids[] = {seq};
  for (int l = 0; l < g.num_layers; ++l) {
    Buffer k = Client::alloc_heap(c.step_kv_bytes(1)), v = Client::alloc_heap(c.step_kv_bytes(1));
    Buffer q = Client::alloc_heap(c.q_bytes(1)), out = Client::alloc_heap(c.q_bytes(1));
    synthetic::fill_token(k.data(), g, kSeed, Tensor::kKey, 3, l, next_pos);
    synthetic::fill_token(v.data(), g, kSeed, Tensor::kValue, 3, l, next_pos);
    synthetic::fill_query(q.as<float>().data(), g, kSeed, 3, l, next_pos);
    if (auto s = c.Step(l, ids, k, v, q, out); !s.ok()) return s.status();
    all.insert(all.end(), out.as<float>().begin(), out.as<float>().end());
  }
  return all;
}

// ---- worker processes: exit code 0 on success, a message on stderr otherwise ----

int fail(const std::string& what) {
  std::fprintf(stderr, "prefix worker: %s\n", what.c_str());
  return 1;
}

ClientOptions worker_options(const char* tenant) {
  ClientOptions o;
  o.target = std::getenv("KARAKV_TEST_TARGET");
  o.tenant = tenant;
  o.worker_id = tenant;
  o.staging_bytes = 8 << 20;
  o.rpc_timeout = absl::Seconds(20);
  return o;
}

int publish_worker() {
  auto c = Client::Attach(worker_options("tenant-a"));
  if (!c.ok()) return fail(std::string(c.status().message()));
  auto seq = (*c)->CreateSequence();
  if (!seq.ok()) return fail(std::string(seq.status().message()));
  const std::vector<int32_t> p = prompt_a();
  auto len = append(**c, *seq, p, 0, int(p.size()), true);
  if (!len.ok()) return fail(std::string(len.status().message()));
  return 0;  // detaches on exit: the sequence goes, its cached prompt blocks stay
}

int reuse_worker() {
  auto c = Client::Attach(worker_options("tenant-a"));
  if (!c.ok()) return fail(std::string(c.status().message()));
  const std::vector<int32_t> p = prompt_b();
  auto hit = (*c)->Lookup(p);
  if (!hit.ok()) return fail(std::string(hit.status().message()));
  if (*hit != 32) return fail("Lookup found " + std::to_string(*hit) + " cached tokens, expected 32");
  auto created = (*c)->CreateFromPrefix(SequenceOptions{}, p);
  if (!created.ok()) return fail(std::string(created.status().message()));
  if (created->cached_tokens != 32) return fail("CreateFromPrefix started with " + std::to_string(created->cached_tokens));
  auto len = append(**c, created->id, p, created->cached_tokens, kPromptB, true);
  if (!len.ok()) return fail(std::string(len.status().message()));
  // The reference: the whole prompt prefilled by this worker, no cache involved.
  auto full = (*c)->CreateSequence();
  if (!full.ok()) return fail(std::string(full.status().message()));
  if (auto l = append(**c, *full, p, 0, kPromptB, false); !l.ok()) return fail(std::string(l.status().message()));
  auto cached_out = outputs(**c, created->id, kPromptB, kPromptB);
  auto full_out = outputs(**c, *full, kPromptB, kPromptB);
  if (!cached_out.ok()) return fail(std::string(cached_out.status().message()));
  if (!full_out.ok()) return fail(std::string(full_out.status().message()));
  if (cached_out->size() != full_out->size() ||
      std::memcmp(cached_out->data(), full_out->data(), cached_out->size() * 4) != 0) {
    return fail("outputs from the cached prefix differ from a full prefill");
  }
  return 0;
}

int other_tenant_worker() {
  auto c = Client::Attach(worker_options("tenant-b"));
  if (!c.ok()) return fail(std::string(c.status().message()));
  auto hit = (*c)->Lookup(prompt_b());
  if (!hit.ok()) return fail(std::string(hit.status().message()));
  if (*hit != 0) return fail("another tenant's lookup hit " + std::to_string(*hit) + " tokens");
  return 0;
}

// Runs this binary as a worker process and returns its exit code.
int run_worker(const std::string& role, const Daemon& d) {
  const pid_t pid = fork();
  if (pid == 0) {
    setenv("KARAKV_PREFIX_WORKER", role.c_str(), 1);
    setenv("KARAKV_TEST_TARGET", d.target().c_str(), 1);
    execl("/proc/self/exe", "prefix_integration_test", static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string run(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  pclose(p);
  return out;
}


TEST(PrefixCacheAcrossWorkers, SecondProcessStartsFromTheFirstsPromptAndMatchesAFullPrefill) {
  int port = 0;
  auto started = testing::start_with_metrics(daemon_flags(), &port);
  Daemon& d = *started;
  ASSERT_TRUE(d.ready());
  ASSERT_EQ(run_worker("publish", d), 0);
  ASSERT_EQ(run_worker("reuse", d), 0);
  ASSERT_EQ(run_worker("other-tenant", d), 0);
  ClientOptions o = d.options(0);
  o.heartbeat = false;
  auto c = Client::Attach(o);
  ASSERT_TRUE(c.ok()) << c.status();
  auto st = (*c)->Stats(true);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->invariant_error.empty()) << st->invariant_error;
  EXPECT_TRUE(st->prefix_cache_enabled);
  // Lookups: reuse's Lookup and CreateFromPrefix, the other tenant's Lookup.
  EXPECT_EQ(st->prefix_lookups, 3u);
  EXPECT_EQ(st->prefix_lookup_tokens, 3u * kPromptB);
  EXPECT_EQ(st->prefix_hit_tokens, 64u);
  // a's 2 blocks, b's blocks 3 and 4 (b's 70 tokens hold 4 whole blocks); every worker detached.
  EXPECT_EQ(st->prefix_cached_blocks, 4u);
  EXPECT_EQ(st->prefix_unused_blocks, 4u);
  const std::string text = run(std::string(KARAKV_CLI_PATH) + " --target=" + d.target() + " stats");
  EXPECT_THAT(text, HasSubstr("prefix cache     on: 3 lookups, 64 of 210 tokens hit (30.5%), 4 blocks cached"));
  const std::string json = run(std::string(KARAKV_CLI_PATH) + " --target=" + d.target() + " --json stats");
  EXPECT_THAT(json, HasSubstr("\"prefix_hit_tokens\":\"64\""));
  const std::string m = http_get(port, "/metrics");
  EXPECT_THAT(m, HasSubstr("karakv_prefix_lookups_total 3\n"));
  EXPECT_THAT(m, HasSubstr("karakv_prefix_lookup_tokens_total 210\n"));
  EXPECT_THAT(m, HasSubstr("karakv_prefix_hit_tokens_total 64\n"));
  EXPECT_THAT(m, HasSubstr("karakv_prefix_cached_blocks 4\n"));
  EXPECT_THAT(m, HasSubstr("karakv_prefix_unused_blocks 4\n"));
  EXPECT_THAT(m, HasSubstr("karakv_prefix_evictions_total 0\n"));
}

TEST(PrefixCacheAcrossWorkers, OffFlagDisablesSharingAndNamedNamespacesAreRefused) {
  std::vector<std::string> flags = daemon_flags();
  flags.push_back("--prefix_cache=off");
  Daemon d(flags);
  ASSERT_TRUE(d.ready());
  ASSERT_EQ(run_worker("publish", d), 0);
  auto c = Client::Attach(d.options(0));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*(*c)->Lookup(prompt_b()), 0);
  EXPECT_EQ((*c)->Stats()->prefix_cached_blocks, 0u);
  ClientOptions named = d.options(0);
  named.cache_namespace = "shared-docs";
  auto refused = Client::Attach(named);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
}

// ---- the prefix tier: two daemons (two "nodes") sharing one Redis ----

std::vector<int32_t> tier_prompt(int variant) {
  std::vector<int32_t> p(5 * 16 + 7);  // 5 whole blocks and a partial one
  std::iota(p.begin(), p.end(), 200000 + variant * 1000);
  return p;
}

ClientOptions node_options(const Daemon& d, const std::string& fingerprint, const char* worker) {
  ClientOptions o = d.options(0);
  o.worker_id = worker;
  o.model_fingerprint = fingerprint;
  o.staging_bytes = 8 << 20;
  o.rpc_timeout = absl::Seconds(20);
  return o;
}

// Appends `prompt` with its ids as a new sequence; the sequence stays (its blocks stay cached).
absl::Status prefill(Client& c, const std::vector<int32_t>& prompt) {
  auto seq = c.CreateSequence();
  if (!seq.ok()) return seq.status();
  return append(c, *seq, prompt, 0, int(prompt.size()), true).status();
}

// Polls `c`'s Lookup of `prompt` until it finds `want` tokens (the tier's write is asynchronous).
int lookup_until(Client& c, const std::vector<int32_t>& prompt, int want, absl::Duration patience) {
  const absl::Time deadline = absl::Now() + patience;
  int hit = 0;
  while (absl::Now() < deadline) {
    auto h = c.Lookup(prompt);
    EXPECT_TRUE(h.ok()) << h.status();
    hit = h.ok() ? *h : -1;
    if (hit == want) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return hit;
}

TEST(PrefixTierAcrossNodes, APromptPrefilledOnOneDaemonIsAHitOnAnotherWithTheSameBytes) {
  testing::RedisServer redis;
  ASSERT_TRUE(redis.ready()) << "redis-server did not start (apt install redis-server)";
  int metrics_port = 0;
  std::vector<std::string> flags = daemon_flags();
  flags.push_back("--prefix_tier=redis://" + redis.address());
  flags.push_back("--prefix_tier_timeout_ms=2000");  // a loaded CI machine
  Daemon a(flags);
  auto started_b = testing::start_with_metrics(flags, &metrics_port);
  Daemon& b = *started_b;
  ASSERT_TRUE(a.ready() && b.ready());
  auto ca = Client::Attach(node_options(a, "smol-135m@r1", "node-a"));
  auto cb = Client::Attach(node_options(b, "smol-135m@r1", "node-b"));
  auto cb_other_model = Client::Attach(node_options(b, "smol-360m@r1", "node-b-other"));
  auto cb_no_fingerprint = Client::Attach(node_options(b, "", "node-b-none"));
  ASSERT_TRUE(ca.ok() && cb.ok() && cb_other_model.ok() && cb_no_fingerprint.ok());
  const std::vector<int32_t> p = tier_prompt(0);
  ASSERT_TRUE(prefill(**ca, p).ok());
  ASSERT_EQ(lookup_until(**cb, p, 80, absl::Seconds(20)), 80) << "daemon B never found A's prompt in the tier";
  // Another model (same geometry) and a session without a fingerprint share nothing.
  EXPECT_EQ(*(*cb_other_model)->Lookup(p), 0);
  EXPECT_EQ(*(*cb_no_fingerprint)->Lookup(p), 0);

  // B starts a sequence from the tier's blocks: the K/V is what A was given, byte for byte.
  auto created = (*cb)->CreateFromPrefix(SequenceOptions{}, p);
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_EQ(created->cached_tokens, 80);
  const Geometry& g = (*cb)->geometry();
  Buffer k = Client::alloc_heap((*cb)->append_bytes(80)), v = Client::alloc_heap((*cb)->append_bytes(80));
  Buffer pos = Client::alloc_heap(size_t(g.num_layers) * g.num_kv_heads * 80 * 4);
  auto n = (*cb)->ReadKV(created->id, k, v, pos);
  ASSERT_TRUE(n.ok()) << n.status();
  ASSERT_EQ(*n, 80);
  const auto want_k = prompt_kv(g, Tensor::kKey, p, 0, 80), want_v = prompt_kv(g, Tensor::kValue, p, 0, 80);
  EXPECT_EQ(std::memcmp(k.data(), want_k.data(), want_k.size()), 0);
  EXPECT_EQ(std::memcmp(v.data(), want_v.data(), want_v.size()), 0);
  // ... and attends exactly as a full prefill on B does.
  ASSERT_TRUE(append(**cb, created->id, p, 80, int(p.size()), true).ok());
  auto full = (*cb)->CreateSequence();
  ASSERT_TRUE(full.ok());
  ASSERT_TRUE(append(**cb, *full, p, 0, int(p.size()), false).ok());
  auto from_tier = outputs(**cb, created->id, int(p.size()), int(p.size()));
  auto from_prefill = outputs(**cb, *full, int(p.size()), int(p.size()));
  ASSERT_TRUE(from_tier.ok() && from_prefill.ok());
  EXPECT_EQ(*from_tier, *from_prefill);
  std::string m = http_get(metrics_port, "/metrics");
  EXPECT_THAT(m, HasSubstr("karakv_prefix_tier_blocks_total{result=\"hit\"} 5\n"));
  EXPECT_THAT(m, HasSubstr("karakv_prefix_tier_errors_total 0\n"));
  // A prompt prefilled on B is written too, and the writer gives every pin back.
  ASSERT_TRUE(prefill(**cb, tier_prompt(7)).ok());
  for (int i = 0; i < 100 && (m.find("karakv_prefix_tier_pinned_blocks 0\n") == std::string::npos ||
                              m.find("karakv_prefix_tier_writes_total{result=\"written\"} 5\n") == std::string::npos);
       ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    m = http_get(metrics_port, "/metrics");
  }
  EXPECT_THAT(m, HasSubstr("karakv_prefix_tier_pinned_blocks 0\n"));
  EXPECT_THAT(m, HasSubstr("karakv_prefix_tier_writes_total{result=\"written\"} 5\n"));
  auto st = (*cb)->Stats(true);
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(st->invariant_error.empty()) << st->invariant_error;
}

TEST(PrefixTierAcrossNodes, ARedisKilledMidRunFailsNoRequestAndHitsResumeWhenItReturns) {
  auto redis = std::make_unique<testing::RedisServer>();
  ASSERT_TRUE(redis->ready());
  const int redis_port = redis->port();
  std::vector<std::string> flags = daemon_flags();
  flags.push_back("--prefix_tier=redis://" + redis->address());
  flags.push_back("--prefix_tier_timeout_ms=2000");
  Daemon a(flags), b(flags);
  ASSERT_TRUE(a.ready() && b.ready());
  auto ca = Client::Attach(node_options(a, "m@1", "node-a"));
  auto cb = Client::Attach(node_options(b, "m@1", "node-b"));
  ASSERT_TRUE(ca.ok() && cb.ok());
  ASSERT_TRUE(prefill(**ca, tier_prompt(1)).ok());
  ASSERT_EQ(lookup_until(**cb, tier_prompt(1), 80, absl::Seconds(20)), 80);

  redis->kill_now();
  // Every request of both daemons goes on: prefills (whose writes fail), decode steps, lookups
  // and creations from a prefix that now miss.
  for (int i = 2; i < 6; ++i) {
    ASSERT_TRUE(prefill(**ca, tier_prompt(i)).ok()) << "prefill " << i;
    auto hit = (*cb)->Lookup(tier_prompt(i));
    ASSERT_TRUE(hit.ok()) << hit.status();
    EXPECT_EQ(*hit, 0);
    auto created = (*cb)->CreateFromPrefix(SequenceOptions{}, tier_prompt(i));
    ASSERT_TRUE(created.ok()) << created.status();
    EXPECT_EQ(created->cached_tokens, 0);
    const std::vector<int32_t> p = tier_prompt(i);
    ASSERT_TRUE(append(**cb, created->id, p, 0, int(p.size()), true).ok());
    auto steps = outputs(**cb, created->id, 4, int(p.size()));
    ASSERT_TRUE(steps.ok()) << steps.status();
  }
  EXPECT_EQ(*(*cb)->Lookup(tier_prompt(1)), 80);  // what B filled before stays in its own cache

  redis = std::make_unique<testing::RedisServer>(std::vector<std::string>{}, redis_port);
  ASSERT_TRUE(redis->ready());
  // Fresh prompts prefilled on A are hits on B again once the daemons' pause after the errors
  // ends (a write made while A still paused is dropped: each round publishes a new prompt).
  bool hit = false;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  for (int variant = 100; !hit && absl::Now() < deadline; ++variant) {
    ASSERT_TRUE(prefill(**ca, tier_prompt(variant)).ok());
    for (int i = 0; i < 5 && !hit; ++i) {
      absl::SleepFor(absl::Milliseconds(100));
      auto h = (*cb)->Lookup(tier_prompt(variant));
      ASSERT_TRUE(h.ok()) << h.status();
      hit = *h == 80;
    }
  }
  EXPECT_TRUE(hit) << "no tier hit after Redis came back";
}

}  // namespace
}  // namespace karakv

int main(int argc, char** argv) {
  if (const char* role = std::getenv("KARAKV_PREFIX_WORKER")) {
    const std::string r = role;
    if (r == "publish") return karakv::publish_worker();
    if (r == "reuse") return karakv::reuse_worker();
    if (r == "other-tenant") return karakv::other_tenant_worker();
    return 2;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
