// Prefix cache: stable chained block keys, sharing a cached prompt between sessions with outputs
// bitwise equal to a full prefill, LRU eviction under pool pressure, isolation between tenants,
// and that compaction of a sharing sequence leaves the shared blocks alone.
#include "server/prefix_cache.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <set>

#include "common/synthetic.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core.h"
#include "tests/server/core_driver.h"
#include "tests/server/test_geometry.h"

namespace karakv::server {
namespace {

using ::testing::HasSubstr;
using synthetic::Tensor;

constexpr uint64_t kSeed = 11;

kernels::Geometry small_geometry() { return testing::small_test_geometry(kernels::DType::kFloat16); }

std::vector<int32_t> ids(int32_t first, int n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

TEST(SipHash, MatchesTheReferenceVectors) {
  // The SipHash paper's test key 00 01 .. 0f; messages of 0 and 15 bytes 00 01 .. (Appendix A
  // and the reference implementation's vectors.h).
  uint8_t key[16], msg[15];
  for (int i = 0; i < 16; ++i) key[i] = uint8_t(i);
  for (int i = 0; i < 15; ++i) msg[i] = uint8_t(i);
  EXPECT_EQ(siphash24(key, msg, 0), 0x726fdb47dd0e0e31ull);
  EXPECT_EQ(siphash24(key, msg, 15), 0xa129ca6149be45e5ull);
  EXPECT_EQ(siphash24(key, msg, 8), 0x93f5f5799a932462ull);
}

TEST(PrefixBlockKey, ChainsOverEarlierBlocksNamespaceAndGeometry) {
  const kernels::Geometry g = small_geometry();
  const std::vector<int32_t> a = ids(1, 4), b = ids(100, 4), c = ids(200, 4);
  const PrefixKey root;
  const PrefixKey ka = prefix_block_key(root, a, g, "tenant:x");
  const PrefixKey kb = prefix_block_key(root, b, g, "tenant:x");
  // Same block tokens after different earlier blocks: different keys.
  const PrefixKey after_a = prefix_block_key(ka, c, g, "tenant:x");
  const PrefixKey after_b = prefix_block_key(kb, c, g, "tenant:x");
  EXPECT_FALSE(after_a == after_b);
  // Deterministic: the same chain gives the same key.
  EXPECT_TRUE(prefix_block_key(ka, c, g, "tenant:x") == after_a);
  // Namespace and geometry (dtype included) are part of the key.
  EXPECT_FALSE(prefix_block_key(root, a, g, "tenant:y") == ka);
  kernels::Geometry g32 = g;
  g32.dtype = kernels::DType::kFloat32;
  EXPECT_FALSE(prefix_block_key(root, a, g32, "tenant:x") == ka);
  kernels::Geometry g_layers = g;
  g_layers.num_layers = 3;
  EXPECT_FALSE(prefix_block_key(root, a, g_layers, "tenant:x") == ka);
  // Order of tokens inside a block matters.
  const std::vector<int32_t> a_rev(a.rbegin(), a.rend());
  EXPECT_FALSE(prefix_block_key(root, a_rev, g, "tenant:x") == ka);
}

class PrefixRegistryTest : public ::testing::Test {
 protected:
  void make(int blocks, double max_fraction = 1.0, bool shared_namespaces = false,
            kernels::Geometry geometry = small_geometry()) {
    CoreConfig c;
    c.geometry = geometry;
    c.pool_bytes = int64_t(blocks) * c.geometry.block_bytes();
    c.prefix_cache_max_fraction = max_fraction;
    c.prefix_cache_shared_namespaces = shared_namespaces;
    auto r = Core::create(c, kernels::make_cpu_backend(1));
    ASSERT_TRUE(r.ok()) << r.status();
    reg_ = std::move(*r);
    a_ = attach("tenant-a");
    b_ = attach("tenant-a");
  }
  void TearDown() override {
    if (reg_) {
      EXPECT_TRUE(reg_->check_invariants().ok()) << reg_->check_invariants();
    }
  }

  std::string attach(const std::string& tenant, const std::string& ns = "") {
    auto s = reg_->attach("w", tenant, 0, kernels::Geometry{}, ns);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->session_id : "";
  }

  // K or V of positions [pos0, pos0 + n): position p takes its values from key_of(p).
  std::vector<uint8_t> kv(Tensor t, int64_t pos0, int n, const std::function<uint64_t(int64_t)>& key_of) {
    const auto& g = reg_->geometry();
    const size_t tok = g.kv_token_elems() * kernels::dtype_size(g.dtype);
    std::vector<uint8_t> out(reg_->append_bytes(n));
    for (int l = 0; l < g.num_layers; ++l) {
      for (int i = 0; i < n; ++i) {
        synthetic::fill_token(out.data() + (size_t(l) * n + i) * tok, g, kSeed, t, key_of(pos0 + i), l, pos0 + i);
      }
    }
    return out;
  }

  absl::StatusOr<int32_t> append(const std::string& session, uint64_t seq, int64_t pos0, int n,
                                 const std::function<uint64_t(int64_t)>& key_of, std::vector<int32_t> token_ids = {}) {
    auto k = kv(Tensor::kKey, pos0, n, key_of), v = kv(Tensor::kValue, pos0, n, key_of);
    return reg_->append(session, seq, n, k, v, {}, 0, token_ids);
  }

  // Attention of the last `n` positions' queries, every layer, as raw fp32 bits.
  std::vector<float> attend_all(const std::string& session, uint64_t seq, int n) {
    const auto& g = reg_->geometry();
    std::vector<float> all;
    for (int l = 0; l < g.num_layers; ++l) {
      std::vector<float> q(g.q_token_elems() * n), out(q.size());
      for (int i = 0; i < n; ++i) synthetic::fill_query(q.data() + i * g.q_token_elems(), g, kSeed, 99, l, i);
      absl::Status s = reg_->attend(session, seq, l, n, ConstBytes(reinterpret_cast<const uint8_t*>(q.data()), q.size() * 4),
                                    MutableBytes(reinterpret_cast<uint8_t*>(out.data()), out.size() * 4), 0.0f);
      EXPECT_TRUE(s.ok()) << s;
      all.insert(all.end(), out.begin(), out.end());
    }
    return all;
  }

  std::pair<std::vector<uint8_t>, std::vector<uint8_t>> read(const std::string& session, uint64_t seq) {
    std::vector<uint8_t> k;
    std::vector<uint8_t> v = testing::read_values(*reg_, session, seq, &k);
    return {std::move(k), std::move(v)};
  }

  // One decode step (every layer) of position `pos` for `seq`, values from key `key`.
  void step(const std::string& session, uint64_t seq, uint64_t key, int64_t pos, std::vector<float>* outs = nullptr) {
    const auto& g = reg_->geometry();
    const size_t kvb = g.kv_token_elems() * kernels::dtype_size(g.dtype);
    for (int l = 0; l < g.num_layers; ++l) {
      std::vector<uint8_t> k(kvb), v(kvb);
      std::vector<float> q(g.q_token_elems()), out(q.size());
      synthetic::fill_token(k.data(), g, kSeed, Tensor::kKey, key, l, pos);
      synthetic::fill_token(v.data(), g, kSeed, Tensor::kValue, key, l, pos);
      synthetic::fill_query(q.data(), g, kSeed, key, l, pos);
      const uint64_t id[] = {seq};
      auto r = reg_->step(session, l, id, k, v, ConstBytes(reinterpret_cast<const uint8_t*>(q.data()), q.size() * 4),
                          MutableBytes(reinterpret_cast<uint8_t*>(out.data()), out.size() * 4), 0.0f);
      ASSERT_TRUE(r.ok()) << r.status();
      if (outs) outs->insert(outs->end(), out.begin(), out.end());
    }
  }

  // A sequence of session `s` holding prompt token ids `prompt`, K/V from key `key`.
  uint64_t publish(const std::string& s, const std::vector<int32_t>& prompt, uint64_t key) {
    auto id = reg_->create_sequence(s, SequenceOptions{});
    EXPECT_TRUE(id.ok()) << id.status();
    auto len = append(s, *id, 0, int(prompt.size()), [key](int64_t) { return key; }, prompt);
    EXPECT_TRUE(len.ok()) << len.status();
    return *id;
  }

  // Kara with `params` on the cached `prompt`.
  static SequenceOptions kara_on(const std::vector<int32_t>& prompt, std::map<std::string, double> params) {
    SequenceOptions o;
    o.policy = "kara";
    o.params = std::move(params);
    o.prefix_token_ids = prompt;
    return o;
  }
  static std::map<std::string, double> kara_windows() {  // version 2's windows, W 8, every step
    return {{"window", 8}, {"rho", 0.5}, {"period", 1}, {"sinks", 0}, {"recent", 0}, {"budget", 0}};
  }

  std::pair<uint64_t, int32_t> from_prefix(const std::string& s, const std::vector<int32_t>& prompt,
                                           const std::string& policy = "none") {
    SequenceOptions o = kara_on(prompt, policy == "kara" ? kara_windows() : std::map<std::string, double>{});
    o.policy = policy;
    auto r = reg_->create_sequence_from_prefix(s, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return *r;
  }

  int32_t lookup(const std::string& s, const std::vector<int32_t>& prompt) {
    auto n = reg_->lookup_prefix(s, prompt);
    EXPECT_TRUE(n.ok()) << n.status();
    return n.ok() ? *n : -1;
  }

  std::unique_ptr<Core> reg_;
  std::string a_, b_;
};

TEST_F(PrefixRegistryTest, SecondSessionStartsFromCachedPromptBitwiseLikeFullPrefill) {
  make(64);
  // Session a: a 14-token prompt, 3 full blocks of 4 (the partial 4th is never cached).
  const std::vector<int32_t> prompt_a = ids(500, 14);
  publish(a_, prompt_a, 1);
  EXPECT_EQ(reg_->stats().prefix_cached_blocks, 3);
  // Session b's prompt shares the first 12 tokens and differs after them.
  std::vector<int32_t> prompt_b = ids(500, 12);
  for (int32_t t : ids(9000, 8)) prompt_b.push_back(t);
  EXPECT_EQ(lookup(b_, prompt_b), 12);
  auto [seq_b, cached] = from_prefix(b_, prompt_b);
  ASSERT_EQ(cached, 12);
  auto key_of = [](int64_t p) -> uint64_t { return p < 12 ? 1 : 2; };
  auto len = append(b_, seq_b, 12, 8, key_of, std::vector<int32_t>(prompt_b.begin() + 12, prompt_b.end()));
  ASSERT_TRUE(len.ok()) << len.status();
  EXPECT_EQ(*len, 20);
  // Reference: the same 20 tokens prefilled in full, without ids, in a third session.
  const std::string c = attach("tenant-a");
  auto seq_c = reg_->create_sequence(c, SequenceOptions{});
  ASSERT_TRUE(seq_c.ok());
  ASSERT_TRUE(append(c, *seq_c, 0, 20, key_of).ok());
  EXPECT_EQ(read(b_, seq_b), read(c, *seq_c));
  const std::vector<float> out_b = attend_all(b_, seq_b, 20), out_c = attend_all(c, *seq_c, 20);
  ASSERT_EQ(out_b.size(), out_c.size());
  EXPECT_EQ(std::memcmp(out_b.data(), out_c.data(), out_b.size() * 4), 0) << "outputs differ bitwise";
  // Decoding on: both sequences see the same cache.
  std::vector<float> step_b, step_c;
  step(b_, seq_b, 3, 20, &step_b);
  step(c, *seq_c, 3, 20, &step_c);
  EXPECT_EQ(std::memcmp(step_b.data(), step_c.data(), step_b.size() * 4), 0);
  // Shared blocks (reference count above one): the 3 from a, and the 2 b published itself (the
  // cache holds a reference on each).
  auto infos = reg_->list_sequences(b_);
  ASSERT_EQ(infos.size(), 1u);
  EXPECT_EQ(infos[0].shared_blocks, 5);
  const CoreStats st = reg_->stats();
  EXPECT_EQ(st.prefix_lookups, 2u);
  EXPECT_EQ(st.prefix_lookup_tokens, 40u);
  EXPECT_EQ(st.prefix_hit_tokens, 24u);
  // b published its own 5 full blocks: 3 were there, 2 are new (b's blocks 3 and 4).
  EXPECT_EQ(st.prefix_cached_blocks, 5);
}

TEST_F(PrefixRegistryTest, AnotherTenantMissesAndNamedNamespacesNeedTheFlag) {
  make(64);
  const std::vector<int32_t> prompt = ids(7, 16);
  publish(a_, prompt, 1);
  EXPECT_EQ(lookup(b_, prompt), 16);  // same tenant
  const std::string other = attach("tenant-b");
  EXPECT_EQ(lookup(other, prompt), 0);
  EXPECT_EQ(from_prefix(other, prompt).second, 0);
  auto named = reg_->attach("w", "tenant-b", 0, kernels::Geometry{}, "docs");
  ASSERT_FALSE(named.ok());
  EXPECT_EQ(named.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(named.status().message(), HasSubstr("--prefix_cache_shared_namespaces"));
}

TEST_F(PrefixRegistryTest, SharedNamespaceSharesAcrossTenantsButNotWithPrivateOnes) {
  make(64, 1.0, true);
  const std::vector<int32_t> prompt = ids(7, 8);
  const std::string x = attach("tenant-a", "docs"), y = attach("tenant-b", "docs");
  publish(x, prompt, 1);
  EXPECT_EQ(lookup(y, prompt), 8);
  EXPECT_EQ(lookup(a_, prompt), 0);  // tenant-a's private namespace
  // A namespace named like a tenant is still not that tenant's private one.
  EXPECT_EQ(lookup(attach("tenant-c", "tenant-a"), ids(1, 8)), 0);
  publish(a_, ids(1, 8), 5);
  EXPECT_EQ(lookup(attach("tenant-c", "tenant-a"), ids(1, 8)), 0);
}

TEST_F(PrefixRegistryTest, EvictsLeastRecentlyUsedFirstAndNeverWhatASequenceHolds) {
  make(8);
  const std::vector<int32_t> p1 = ids(100, 8), p2 = ids(200, 8), p3 = ids(300, 8);
  for (const auto& [p, key] : {std::pair{p1, 1}, {p2, 2}, {p3, 3}}) {
    const uint64_t id = publish(a_, p, key);
    ASSERT_TRUE(reg_->release_sequence(a_, id).ok());
  }
  CoreStats st = reg_->stats();
  EXPECT_EQ(st.prefix_cached_blocks, 6);
  EXPECT_EQ(st.prefix_unused_blocks, 6);
  EXPECT_EQ(st.blocks_free, 2);
  // Use p1 again: p2 is now the least recently used.
  {
    auto [id, cached] = from_prefix(a_, p1);
    EXPECT_EQ(cached, 8);
    ASSERT_TRUE(reg_->release_sequence(a_, id).ok());
  }
  // 16 tokens need 4 blocks, 2 are free: p2's two go.
  auto big = reg_->create_sequence(a_, SequenceOptions{});
  ASSERT_TRUE(big.ok());
  ASSERT_TRUE(append(a_, *big, 0, 16, [](int64_t) { return 9; }).ok());
  EXPECT_EQ(lookup(a_, p2), 0);
  EXPECT_EQ(lookup(a_, p3), 8);
  EXPECT_EQ(lookup(a_, p1), 8);
  EXPECT_EQ(reg_->stats().prefix_evictions, 2u);
  // A chain goes from its end: one more block takes p3's second block, and p3 still hits 4.
  ASSERT_TRUE(append(a_, *big, 16, 4, [](int64_t) { return 9; }).ok());
  EXPECT_EQ(lookup(a_, p3), 4);
  EXPECT_EQ(lookup(a_, p1), 8);
  // p1 held by a sequence cannot be evicted: with p3's last block the pool has 1 block to give,
  // so an append wanting 2 is refused and evicts nothing.
  auto [holder, cached] = from_prefix(a_, p1);
  ASSERT_EQ(cached, 8);
  auto refused = append(a_, *big, 20, 8, [](int64_t) { return 9; });
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(lookup(a_, p3), 4);
  EXPECT_EQ(lookup(a_, p1), 8);
  EXPECT_EQ(reg_->stats().prefix_evictions, 3u);
  // One block fits: p3's last block goes.
  ASSERT_TRUE(append(a_, *big, 20, 4, [](int64_t) { return 9; }).ok());
  EXPECT_EQ(lookup(a_, p3), 0);
  EXPECT_EQ(lookup(a_, p1), 8);
}

TEST_F(PrefixRegistryTest, WatermarkEvictsUnusedBlocksBeyondTheFraction) {
  make(16, 0.25);  // at most 4 unused cached blocks
  const uint64_t s1 = publish(a_, ids(100, 12), 1), s2 = publish(a_, ids(200, 12), 2);
  EXPECT_EQ(reg_->stats().prefix_cached_blocks, 6);  // held by their sequences: no limit applies
  ASSERT_TRUE(reg_->release_sequence(a_, s1).ok());
  EXPECT_EQ(reg_->stats().prefix_unused_blocks, 3);
  ASSERT_TRUE(reg_->release_sequence(a_, s2).ok());
  const CoreStats st = reg_->stats();
  EXPECT_EQ(st.prefix_unused_blocks, 4);
  EXPECT_EQ(st.prefix_evictions, 2u);
  EXPECT_EQ(lookup(a_, ids(100, 12)), 4);  // the older prompt lost its last two blocks
  EXPECT_EQ(lookup(a_, ids(200, 12)), 12);
}

TEST_F(PrefixRegistryTest, KaraCompactionOfASharingSequenceLeavesTheSharedPromptAlone) {
  make(128);
  const std::vector<int32_t> prompt = ids(40, 16);
  const uint64_t owner = publish(a_, prompt, 1);
  const auto kv_before = read(a_, owner);
  const std::vector<float> out_before = attend_all(a_, owner, 16);
  auto [sharer, cached] = from_prefix(b_, prompt, "kara");
  ASSERT_EQ(cached, 16);
  // Kara (window 8, keeps 4, every step) compresses b's generated tokens only.
  for (int64_t pos = 16; pos < 40; ++pos) step(b_, sharer, 2, pos);
  auto infos = reg_->list_sequences(b_);
  ASSERT_EQ(infos.size(), 1u);
  EXPECT_GT(infos[0].compactions, 0);
  EXPECT_LT(infos[0].length, infos[0].logical_length);
  EXPECT_EQ(infos[0].shared_blocks, 4);  // the prompt's blocks, still shared
  EXPECT_EQ(read(a_, owner), kv_before);
  const std::vector<float> out_after = attend_all(a_, owner, 16);
  EXPECT_EQ(std::memcmp(out_before.data(), out_after.data(), out_before.size() * 4), 0);
  // The cache still hands out the untouched prompt, and b's generated tokens were never published.
  EXPECT_EQ(reg_->stats().prefix_cached_blocks, 4);
  auto [fresh, again] = from_prefix(attach("tenant-a"), prompt);
  EXPECT_EQ(again, 16);
  (void)fresh;
}

// Kara's default prompt = auto keeps the blocks a sequence adopted from the prefix cache and windows
// the prompt tokens it appended itself; prompt = window compresses the shared blocks into copies.
TEST_F(PrefixRegistryTest, KaraPromptAutoKeepsTheAdoptedBlocksAndWindowsTheRest) {
  make(256);
  const std::vector<int32_t> prompt = ids(40, 16);
  const uint64_t owner = publish(a_, prompt, 1);
  const auto kv_before = read(a_, owner);
  for (int mode = 0; mode < 2; ++mode) {  // 0: auto (the default), 1: window
    SequenceOptions o = kara_on(prompt, kara_windows());
    if (mode == 1) o.params["prompt"] = 1;
    auto r = reg_->create_sequence_from_prefix(b_, o);
    ASSERT_TRUE(r.ok()) << r.status();
    const auto [sharer, cached] = *r;
    ASSERT_EQ(cached, 16);
    // 16 more prompt tokens of its own, then decoding: the first step finds 16 prompt tokens beyond
    // the cached ones to window (auto), or 32 from slot 0 (window).
    ASSERT_TRUE(append(b_, sharer, 16, 16, [](int64_t) { return 7; }).ok());
    step(b_, sharer, 2, 32);
    const SequenceInfo info = reg_->inspect(sharer)->first;
    const std::vector<std::vector<int32_t>> rows = reg_->inspect(sharer)->second;
    EXPECT_GT(info.compactions, 0) << mode;
    bool cached_whole = true, own_whole = true;
    for (const auto& row : rows) {
      for (int p = 0; p < 16; ++p) cached_whole = cached_whole && row[p] == p;
      std::set<int32_t> own(row.begin(), row.end());
      for (int p = 16; p < 32; ++p) own_whole = own_whole && own.count(p) == 1;
    }
    auto infos = reg_->list_sequences(b_);
    const auto it = std::find_if(infos.begin(), infos.end(), [&](const SequenceInfo& i) { return i.id == sharer; });
    ASSERT_NE(it, infos.end());
    if (mode == 0) {
      EXPECT_TRUE(cached_whole);
      EXPECT_FALSE(own_whole) << "its own prompt tokens are windowed";
      EXPECT_EQ(it->shared_blocks, 4);
    } else {
      EXPECT_FALSE(cached_whole);
      EXPECT_LT(it->shared_blocks, 4);
    }
    EXPECT_EQ(read(a_, owner), kv_before) << mode;
    ASSERT_TRUE(reg_->release_sequence(b_, sharer).ok());
  }
}

// The shared blocks prompt = auto keeps do not count against Kara's budget: a sequence on a cached
// prompt holds the prompt plus up to its budget of its own tokens (a turn may let in P = 1 more).
TEST_F(PrefixRegistryTest, KaraBudgetCountsOnlyTheTokensASequenceDoesNotShare) {
  make(256);
  const std::vector<int32_t> prompt = ids(40, 16);
  publish(a_, prompt, 1);
  // fit 1, prompt auto
  auto r = reg_->create_sequence_from_prefix(b_, kara_on(prompt, {{"budget", 32}, {"recent", 4}, {"period", 1}, {"sinks", 0}}));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->second, 16);
  int32_t most = 0;
  for (int64_t pos = 16; pos < 100; ++pos) {
    step(b_, r->first, 2, pos);
    const auto seen = reg_->inspect(r->first);
    ASSERT_TRUE(seen.ok()) << seen.status();
    most = std::max(most, seen->first.length);
    for (const auto& row : seen->second) {
      for (int p = 0; p < 16; ++p) ASSERT_EQ(row[p], p) << "the shared prompt is kept";
    }
  }
  EXPECT_LE(most, 16 + 32 + 1);
  EXPECT_GT(most, 16 + 32 - 4) << "the budget is the sequence's own tokens, not the shared prompt's too";
  EXPECT_GT(reg_->inspect(r->first)->first.compactions, 0);
}

// A prefill policy that rewrites the cached prompt makes its blocks the sequence's own: Kara's
// prompt = auto then windows them, from slot 0, as it would an unshared prompt.
TEST_F(PrefixRegistryTest, KaraPromptAutoWindowsACachedPromptAPrefillPolicyRewrote) {
  make(256);
  const std::vector<int32_t> prompt = ids(40, 16);
  publish(a_, prompt, 1);
  SequenceOptions o = kara_on(prompt, kara_windows());
  o.prefill_policy = "streaming";
  o.prefill_params = {{"c_max", 24}, {"c_target", 20}, {"sinks", 4}};
  auto r = reg_->create_sequence_from_prefix(b_, o);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->second, 16);
  ASSERT_TRUE(append(b_, r->first, 16, 16, [](int64_t) { return 7; }).ok());
  // The first step: streaming keeps 20 of 32 (4 sinks and the newest 16) in fresh blocks, then
  // Kara's first window, slots 0..7, keeps 4: 20 + 1 - 4.
  step(b_, r->first, 2, 32);
  EXPECT_EQ(reg_->inspect(r->first)->first.length, 17);
}

TEST_F(PrefixRegistryTest, ThresholdCompactionOfASharingSequenceWritesFreshBlocks) {
  make(128);
  const std::vector<int32_t> prompt = ids(40, 16);
  const uint64_t owner = publish(a_, prompt, 1);
  const auto kv_before = read(a_, owner);
  SequenceOptions o;
  o.policy = "streaming";
  o.params = {{"c_target", 8}, {"sinks", 4}};
  o.prefix_token_ids = prompt;
  auto r = reg_->create_sequence_from_prefix(b_, o);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->second, 16);
  auto compacted = reg_->compact(b_, r->first, false);
  ASSERT_TRUE(compacted.ok()) << compacted.status();
  ASSERT_EQ(compacted->size(), 1u);
  EXPECT_TRUE((*compacted)[0].skipped.empty()) << (*compacted)[0].skipped;
  EXPECT_EQ((*compacted)[0].tokens_after, 8);
  EXPECT_EQ(read(a_, owner), kv_before);
  EXPECT_EQ(lookup(a_, prompt), 16);
}

TEST_F(PrefixRegistryTest, OnlyPromptsWithIdsAndWithoutPrefillPolicyPublish) {
  make(64);
  // Wrong id count: refused, nothing appended.
  auto id = reg_->create_sequence(a_, SequenceOptions{});
  ASSERT_TRUE(id.ok());
  auto bad = append(a_, *id, 0, 8, [](int64_t) { return 1; }, ids(0, 7));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("token_ids has 7 entries, expected num_tokens = 8"));
  EXPECT_EQ(reg_->list_sequences(a_)[0].length, 0);
  // A prompt part without ids stops publishing for that sequence.
  ASSERT_TRUE(append(a_, *id, 0, 4, [](int64_t) { return 1; }, ids(0, 4)).ok());
  EXPECT_EQ(reg_->stats().prefix_cached_blocks, 1);
  ASSERT_TRUE(append(a_, *id, 4, 4, [](int64_t) { return 1; }).ok());
  ASSERT_TRUE(append(a_, *id, 8, 4, [](int64_t) { return 1; }, ids(8, 4)).ok());
  EXPECT_EQ(reg_->stats().prefix_cached_blocks, 1);
  // Tokens appended after decoding started are not the prompt.
  auto dec = reg_->create_sequence(a_, SequenceOptions{});
  ASSERT_TRUE(append(a_, *dec, 0, 2, [](int64_t) { return 2; }, ids(50, 2)).ok());
  step(a_, *dec, 2, 2);
  ASSERT_TRUE(append(a_, *dec, 3, 5, [](int64_t) { return 2; }, ids(53, 5)).ok());
  EXPECT_EQ(reg_->stats().prefix_cached_blocks, 1);
  // A prefill policy compresses the prompt: it does not publish.
  SequenceOptions o;
  o.prefill_policy = "streaming";
  o.prefill_params = {{"c_target", 8}, {"sinks", 4}};
  auto pre = reg_->create_sequence(a_, o);
  ASSERT_TRUE(pre.ok()) << pre.status();
  ASSERT_TRUE(append(a_, *pre, 0, 16, [](int64_t) { return 3; }, ids(70, 16)).ok());
  EXPECT_EQ(reg_->stats().prefix_cached_blocks, 1);
  EXPECT_EQ(lookup(b_, ids(70, 16)), 0);
}

TEST_F(PrefixRegistryTest, QuantizedSequenceSharesFullPrecisionPromptBlocks) {
  kernels::Geometry g = small_geometry();
  g.head_dim = 32;  // KIVI: a multiple of 32; block 16 holds 32 quantized tokens
  g.block_size = 16;
  make(32, 1.0, false, g);
  const std::vector<int32_t> prompt = ids(40, 32);
  const uint64_t owner = publish(a_, prompt, 1);
  const auto kv_before = read(a_, owner);
  SequenceOptions o;
  o.storage = "kivi4";
  o.params = {{"residual", 0}};
  o.prefix_token_ids = prompt;
  auto r = reg_->create_sequence_from_prefix(b_, o);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->second, 32);
  // Appending ages the shared prompt into b's own quantized blocks; the cached ones stay exact.
  ASSERT_TRUE(append(b_, r->first, 32, 32, [](int64_t) { return 1; }).ok());
  auto info = reg_->list_sequences(b_)[0];
  EXPECT_GT(info.quantized, 0);
  EXPECT_EQ(info.shared_blocks, 0);  // b no longer holds the full-precision prompt blocks
  EXPECT_EQ(read(a_, owner), kv_before);
  EXPECT_EQ(lookup(a_, prompt), 32);
}

}  // namespace
}  // namespace karakv::server
