// Core: sequences, forks with copy on write, leases, step ordering, and that every refused
// request leaves the state exactly as it was.
#include "server/core.h"

#include <cstring>
#include <sstream>

#include "common/synthetic.h"
#include "gmock/gmock.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "gtest/gtest.h"
#include "tests/server/test_geometry.h"

namespace karakv::server {
namespace {

using ::testing::HasSubstr;
using synthetic::Tensor;

constexpr uint64_t kSeed = 7;

kernels::Geometry small_geometry(kernels::DType dtype = kernels::DType::kFloat32) {
  return testing::small_test_geometry(dtype);
}

// A comparable picture of everything a request could change.
struct Snapshot {
  int32_t used, free;
  uint64_t tokens;
  std::vector<std::tuple<uint64_t, int32_t, int32_t, int32_t, int32_t>> seqs;
  bool operator==(const Snapshot&) const = default;
};

class RegistryTest : public ::testing::Test {
 protected:
  void SetUp() override { make(64); }

  void make(int blocks, kernels::DType dtype = kernels::DType::kFloat32) {
    CoreConfig c;
    c.geometry = small_geometry(dtype);
    c.pool_bytes = int64_t(blocks) * c.geometry.block_bytes();
    c.lease = absl::Seconds(5);
    auto r = Core::create(c, kernels::make_cpu_backend(1));
    ASSERT_TRUE(r.ok()) << r.status();
    reg_ = std::move(*r);
    auto a = reg_->attach("w", "tenant-a", 0, kernels::Geometry{});
    ASSERT_TRUE(a.ok());
    session_ = a->session_id;
  }

  Snapshot snapshot() {
    Snapshot s;
    CoreStats st = reg_->stats();
    s.used = st.blocks_used;
    s.free = st.blocks_free;
    s.tokens = st.resident_tokens;
    for (const auto& i : reg_->list_sequences("")) {
      s.seqs.emplace_back(i.id, i.length, i.blocks, i.shared_blocks, i.pending_layer);
    }
    EXPECT_TRUE(reg_->check_invariants().ok()) << reg_->check_invariants();
    return s;
  }

  std::vector<uint8_t> prompt_bytes(Tensor t, uint64_t key, int64_t pos0, int n) {
    std::vector<uint8_t> b(reg_->append_bytes(n));
    synthetic::fill_prompt(b.data(), reg_->geometry(), kSeed, t, key, pos0, n);
    return b;
  }

  absl::StatusOr<int32_t> append(uint64_t seq, uint64_t key, int64_t pos0, int n) {
    auto k = prompt_bytes(Tensor::kKey, key, pos0, n);
    auto v = prompt_bytes(Tensor::kValue, key, pos0, n);
    return reg_->append(session_, seq, n, k, v);
  }

  // One whole decode step (every layer) of token `pos` for sequences `ids`, values keyed by `keys`.
  // check: compare outputs with the dense reference (only meaningful when every cached token was
  // generated with the sequence's own key).
  absl::Status step_all_layers(const std::vector<uint64_t>& ids, const std::vector<uint64_t>& keys, int64_t pos,
                               bool check = true) {
    const auto& g = reg_->geometry();
    for (int l = 0; l < g.num_layers; ++l) {
      absl::Status s = step_layer(ids, keys, pos, l, check);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  absl::Status step_layer(const std::vector<uint64_t>& ids, const std::vector<uint64_t>& keys, int64_t pos, int l,
                          bool check = true) {
    const auto& g = reg_->geometry();
    const size_t kvb = g.kv_token_elems() * kernels::dtype_size(g.dtype);
    std::vector<uint8_t> k(kvb * ids.size()), v(kvb * ids.size());
    std::vector<float> q(g.q_token_elems() * ids.size()), out(q.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      synthetic::fill_token(k.data() + i * kvb, g, kSeed, Tensor::kKey, keys[i], l, pos);
      synthetic::fill_token(v.data() + i * kvb, g, kSeed, Tensor::kValue, keys[i], l, pos);
      synthetic::fill_query(q.data() + i * g.q_token_elems(), g, kSeed, keys[i], l, pos);
    }
    auto r = reg_->step(session_, l, ids, k, v,
                        ConstBytes(reinterpret_cast<const uint8_t*>(q.data()), q.size() * 4),
                        MutableBytes(reinterpret_cast<uint8_t*>(out.data()), out.size() * 4), 0.0f);
    if (!r.ok()) return r.status();
    for (size_t i = 0; check && i < ids.size(); ++i) {
      auto ref = synthetic::dense_attention(g, kSeed, keys[i], l, pos);
      for (size_t j = 0; j < ref.size(); ++j) {
        EXPECT_NEAR(out[i * g.q_token_elems() + j], ref[j], 1e-5) << "seq " << ids[i] << " layer " << l;
      }
    }
    return absl::OkStatus();
  }

  // Reads the sequence back and compares every value with what `key` generated at each position.
  void expect_contents(uint64_t seq, uint64_t key, int n) {
    const auto& g = reg_->geometry();
    const size_t rows = size_t(g.num_layers) * g.num_kv_heads;
    std::vector<uint8_t> k(reg_->append_bytes(n)), v(k.size()), pos(4 * n * rows);
    auto got = reg_->read_kv(session_, seq, [&](int32_t t) -> absl::StatusOr<ReadKVTargets> {
      EXPECT_EQ(t, n);
      return ReadKVTargets{MutableBytes(k), MutableBytes(v), MutableBytes(pos)};
    });
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(*got, n);
    std::vector<uint8_t> want_k = prompt_bytes(Tensor::kKey, key, 0, n);
    std::vector<uint8_t> want_v = prompt_bytes(Tensor::kValue, key, 0, n);
    EXPECT_EQ(k, want_k);
    EXPECT_EQ(v, want_v);
    for (size_t r = 0; r < rows; ++r) {
      for (int t = 0; t < n; ++t) {
        int32_t p;
        std::memcpy(&p, pos.data() + 4 * (r * n + t), 4);
        EXPECT_EQ(p, t);
      }
    }
  }

  std::unique_ptr<Core> reg_;
  std::string session_;
};

TEST_F(RegistryTest, AppendThenReadBackExactly) {
  auto seq = reg_->create_sequence(session_, SequenceOptions{});
  ASSERT_TRUE(seq.ok());
  ASSERT_EQ(*append(*seq, *seq, 0, 6), 6);
  ASSERT_EQ(*append(*seq, *seq, 6, 5), 11);
  expect_contents(*seq, *seq, 11);
  EXPECT_EQ(snapshot().used, 3);  // 11 tokens in blocks of 4
}

TEST_F(RegistryTest, StepAppendsOneTokenAcrossLayersAndMatchesDenseReference) {
  auto a = *reg_->create_sequence(session_, SequenceOptions{});
  auto b = *reg_->create_sequence(session_, SequenceOptions{});
  ASSERT_TRUE(append(a, a, 0, 3).ok());
  ASSERT_TRUE(append(b, b, 0, 4).ok());
  for (int t = 0; t < 6; ++t) {
    // Sequences of different lengths in one batch; token positions differ per sequence.
    ASSERT_TRUE(step_layer({a}, {a}, 3 + t, 0).ok());
    ASSERT_TRUE(step_layer({a}, {a}, 3 + t, 1).ok());
    ASSERT_TRUE(step_all_layers({b}, {b}, 4 + t).ok());
  }
  expect_contents(a, a, 9);
  expect_contents(b, b, 10);
  EXPECT_EQ(reg_->stats().decode_steps, 12u);
}

TEST_F(RegistryTest, StepLayersMustComeInOrderAndLayerZeroRestarts) {
  auto a = *reg_->create_sequence(session_, SequenceOptions{});
  ASSERT_TRUE(append(a, a, 0, 2).ok());
  Snapshot before = snapshot();
  absl::Status s = step_layer({a}, {a}, 2, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("starts at layer 0"));
  EXPECT_EQ(snapshot(), before);
  ASSERT_TRUE(step_layer({a}, {a}, 2, 0).ok());
  EXPECT_EQ(reg_->list_sequences("")[0].pending_layer, 1);
  // Half-stepped: Append, Fork, Attend are refused; a fresh layer 0 restarts the token.
  EXPECT_EQ(append(a, a, 2, 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(reg_->fork_sequence(session_, a).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(step_layer({a}, {a}, 2, 0).ok());
  ASSERT_TRUE(step_layer({a}, {a}, 2, 1).ok());
  expect_contents(a, a, 3);
}

TEST_F(RegistryTest, ForkSharesBlocksAndCopiesOnFirstDivergentWrite) {
  auto parent = *reg_->create_sequence(session_, SequenceOptions{});
  ASSERT_TRUE(append(parent, 100, 0, 6).ok());  // blocks: [4 full][2 of 4]
  auto child = reg_->fork_sequence(session_, parent);
  ASSERT_TRUE(child.ok());
  Snapshot s = snapshot();
  EXPECT_EQ(s.used, 2);
  EXPECT_EQ(std::get<3>(s.seqs[1]), 2);  // both blocks shared
  // Parent and child now write different tokens at position 6: the shared partial block splits.
  ASSERT_TRUE(step_all_layers({parent}, {100}, 6).ok());
  EXPECT_EQ(snapshot().used, 3);
  ASSERT_TRUE(step_all_layers({*child}, {200}, 6, /*check=*/false).ok());
  EXPECT_EQ(snapshot().used, 3);  // the child is the last holder of the old block: no copy needed
  // Each sees the shared prefix plus its own token 6.
  const auto& g = reg_->geometry();
  for (auto [seq, key] : {std::pair{parent, uint64_t(100)}, std::pair{*child, uint64_t(200)}}) {
    std::vector<uint8_t> k(reg_->append_bytes(7)), v(k.size()), pos(28 * g.num_layers * g.num_kv_heads);
    ASSERT_TRUE(reg_->read_kv(session_, seq, [&](int32_t) -> absl::StatusOr<ReadKVTargets> {
                      return ReadKVTargets{MutableBytes(k), MutableBytes(v), MutableBytes(pos)};
                    }).ok());
    const size_t tok = g.kv_token_elems() * 4;
    for (int l = 0; l < g.num_layers; ++l) {
      // Positions 0..5 of every layer come from the parent's prompt.
      for (int t = 0; t < 6; ++t) {
        std::vector<uint8_t> tokb(tok);
        synthetic::fill_token(tokb.data(), g, kSeed, Tensor::kKey, 100, l, t);
        EXPECT_EQ(0, std::memcmp(k.data() + (size_t(l) * 7 + t) * tok, tokb.data(), tok)) << "layer " << l << " t " << t;
      }
      std::vector<uint8_t> tokb(tok);
      synthetic::fill_token(tokb.data(), g, kSeed, Tensor::kKey, key, l, 6);
      EXPECT_EQ(0, std::memcmp(k.data() + (size_t(l) * 7 + 6) * tok, tokb.data(), tok)) << "seq " << seq;
    }
  }
  ASSERT_TRUE(reg_->release_sequence(session_, parent).ok());
  ASSERT_TRUE(reg_->release_sequence(session_, *child).ok());
  EXPECT_EQ(snapshot().used, 0);
}

TEST_F(RegistryTest, ForkAtBlockBoundaryNeedsNoCopy) {
  auto parent = *reg_->create_sequence(session_, SequenceOptions{});
  ASSERT_TRUE(append(parent, parent, 0, 8).ok());
  auto child = *reg_->fork_sequence(session_, parent);
  ASSERT_TRUE(append(child, 5, 8, 1).ok());
  EXPECT_EQ(snapshot().used, 3);  // two shared + one new for the child
  expect_contents(parent, parent, 8);
}

TEST_F(RegistryTest, LeaseExpiryFreesEverythingTheSessionOwned) {
  auto seq = *reg_->create_sequence(session_, SequenceOptions{});
  ASSERT_TRUE(append(seq, seq, 0, 9).ok());
  auto other = reg_->attach("w2", "tenant-a", 0, kernels::Geometry{});
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(reg_->expire_leases(absl::Now()), 0);
  ASSERT_TRUE(reg_->heartbeat(other->session_id).ok());
  // Only the first session's lease is allowed to lapse.
  EXPECT_EQ(reg_->expire_leases(absl::Now() + absl::Seconds(6)), 2);
  CoreStats st = reg_->stats();
  EXPECT_EQ(st.blocks_used, 0);
  EXPECT_EQ(st.sessions, 0);
  EXPECT_EQ(st.lease_expiries, 2u);
  EXPECT_EQ(reg_->heartbeat(session_).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(reg_->check_invariants().ok());
}

TEST_F(RegistryTest, MalformedRequestsGetPreciseCodesAndLeaveNoTrace) {
  auto seq = *reg_->create_sequence(session_, SequenceOptions{});
  ASSERT_TRUE(append(seq, seq, 0, 5).ok());
  const Snapshot before = snapshot();
  auto k = prompt_bytes(Tensor::kKey, seq, 5, 2);
  auto v = prompt_bytes(Tensor::kValue, seq, 5, 2);
  auto code = [](const absl::Status& s) { return s.code(); };
  EXPECT_EQ(code(reg_->append("nope", seq, 2, k, v).status()), absl::StatusCode::kNotFound);
  EXPECT_EQ(code(reg_->append(session_, 999, 2, k, v).status()), absl::StatusCode::kNotFound);
  EXPECT_EQ(code(reg_->append(session_, seq, 0, {}, {}).status()), absl::StatusCode::kInvalidArgument);
  absl::Status wrong = reg_->append(session_, seq, 3, k, v).status();
  EXPECT_EQ(code(wrong), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong.message()), HasSubstr("expected"));
  EXPECT_EQ(code(reg_->append(session_, seq, 2, k, ConstBytes(v.data(), v.size() - 1)).status()),
            absl::StatusCode::kInvalidArgument);
  SequenceOptions magic;
  magic.policy = "magic";
  EXPECT_EQ(code(reg_->create_sequence(session_, magic).status()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(reg_->fork_sequence(session_, 12345).status()), absl::StatusCode::kNotFound);
  EXPECT_EQ(code(reg_->release_sequence(session_, 12345).status()), absl::StatusCode::kNotFound);
  // Step: out-of-range layer, duplicate ids, unknown id in an otherwise good batch.
  EXPECT_EQ(code(step_layer({seq}, {seq}, 5, 2)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(step_layer({seq, seq}, {seq, seq}, 5, 0)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(step_layer({seq, 777}, {seq, 777}, 5, 0)), absl::StatusCode::kNotFound);
  // Attend: more queries than tokens.
  std::vector<float> q(reg_->geometry().q_token_elems() * 6), out(q.size());
  EXPECT_EQ(code(reg_->attend(session_, seq, 0, 6, ConstBytes(reinterpret_cast<uint8_t*>(q.data()), q.size() * 4),
                              MutableBytes(reinterpret_cast<uint8_t*>(out.data()), out.size() * 4), 0)),
            absl::StatusCode::kInvalidArgument);
  // Another tenant's sequence.
  auto intruder = reg_->attach("x", "tenant-b", 0, kernels::Geometry{});
  ASSERT_TRUE(intruder.ok());
  EXPECT_EQ(code(reg_->append(intruder->session_id, seq, 2, k, v).status()), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(code(reg_->release_sequence(intruder->session_id, seq).status()), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(snapshot(), before);
}

TEST_F(RegistryTest, WrongGeometryIsRefusedAtAttach) {
  kernels::Geometry g = small_geometry();
  g.head_dim = 16;
  auto r = reg_->attach("w", "t", 0, g);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("head_dim=16"));
  EXPECT_TRUE(reg_->attach("w", "t", 0, small_geometry()).ok());
}

TEST_F(RegistryTest, PoolExhaustionSaysWantedVsFreeAndKeepsServing) {
  make(4);
  auto a = *reg_->create_sequence(session_, SequenceOptions{});
  ASSERT_TRUE(append(a, a, 0, 10).ok());  // 3 blocks
  const Snapshot before = snapshot();
  auto b = *reg_->create_sequence(session_, SequenceOptions{});
  auto r = append(b, b, 0, 9);  // wants 3, 1 free
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("wanted 3 blocks, 1 free of 4"));
  // A batched step that needs more blocks than are free is refused whole.
  ASSERT_TRUE(append(b, b, 0, 4).ok());  // takes the last block
  auto c = *reg_->create_sequence(session_, SequenceOptions{});
  const Snapshot full = snapshot();
  EXPECT_EQ(step_layer({a, b}, {a, b}, 10, 0).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(snapshot(), full);
  ASSERT_TRUE(reg_->release_sequence(session_, b).ok());
  ASSERT_TRUE(reg_->release_sequence(session_, c).ok());
  EXPECT_EQ(snapshot(), before);
  ASSERT_TRUE(append(a, a, 10, 2).ok());
  expect_contents(a, a, 12);
}

}  // namespace
// CaM has not helped Kara anywhere measured (docs/QUALITY.md): cam=1 on kara says so in the log,
// once per daemon run; other policies with cam=1, and kara without it, say nothing.
TEST_F(RegistryTest, CamWithKaraWarnsOnceInTheLog) {
  std::ostringstream log;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(log);
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("capture", sink));
  SequenceOptions snapkv;
  snapkv.policy = "snapkv";
  snapkv.params = {{"cam", 1}};
  SequenceOptions kara_plain;
  kara_plain.policy = "kara";
  SequenceOptions kara_cam = kara_plain;
  kara_cam.params = {{"cam", 1}};
  ASSERT_TRUE(reg_->create_sequence(session_, snapkv).ok());
  ASSERT_TRUE(reg_->create_sequence(session_, kara_plain).ok());
  const std::string before = log.str();
  ASSERT_TRUE(reg_->create_sequence(session_, kara_cam).ok());
  ASSERT_TRUE(reg_->create_sequence(session_, kara_cam).ok());
  spdlog::set_default_logger(previous);
  EXPECT_THAT(before, ::testing::Not(::testing::HasSubstr("not recommended")));
  const std::string text = log.str();
  const size_t first = text.find("cam=1 with kara is not recommended");
  ASSERT_NE(first, std::string::npos) << text;
  EXPECT_EQ(text.find("cam=1 with kara is not recommended", first + 1), std::string::npos) << "warned twice: " << text;
  EXPECT_THAT(text, ::testing::HasSubstr("38.19"));
}

}  // namespace karakv::server
