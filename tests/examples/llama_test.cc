// The real-model worker's pieces against stories260K: loader errors, tokenizer round trips, and the
// forward pass with attention in a real karakvd matching the in-process dense reference.
// The model is data/stories260k.bin in the repository; a missing file fails every test, naming it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "llama/daemon_attention.h"
#include "llama/model.h"
#include "tests/integration/daemon.h"

namespace karakv::llama {
namespace {

using ::testing::HasSubstr;
using namespace std::string_literals;

std::vector<uint8_t> model_bytes() {
  std::ifstream in(KARAKV_LLAMA_MODEL, std::ios::binary);
  if (!in) return {};
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

#define REQUIRE_MODEL(bytes)                                          \
  const std::vector<uint8_t> bytes = model_bytes();                    \
  ASSERT_FALSE(bytes.empty()) << "cannot read the model file " KARAKV_LLAMA_MODEL \
                              " (the repository keeps it in data/; see data/README.md)"

std::vector<std::string> daemon_args(const std::string& dtype) {
  return {"--layers=5", "--q_heads=8", "--kv_heads=4", "--head_dim=8", "--dtype=" + dtype, "--pool_bytes=64MiB"};
}

TEST(LlamaLoaderTest, ReadsTheStories260kHeaderAndVocabulary) {
  REQUIRE_MODEL(bytes);
  auto m = parse_model(bytes);
  ASSERT_TRUE(m.ok()) << m.status();
  const Config& c = m->config;
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.ffn_dim, 172);
  EXPECT_EQ(c.max_seq_len, 512);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim(), 8);
  EXPECT_EQ(m->tokenizer.piece(1), "<s>");
  EXPECT_EQ(m->tokenizer.piece(3), "<0x00>");
}

TEST(LlamaLoaderTest, RefusesATruncatedFileSayingExpectedAndActualSize) {
  REQUIRE_MODEL(bytes);
  std::vector<uint8_t> cut(bytes.begin(), bytes.end() - 1000);
  auto m = parse_model(cut);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()),
              HasSubstr("wrong size: expected 1046785 bytes, got 1045785"));

  std::vector<uint8_t> in_vocab(bytes.begin(), bytes.begin() + 3000);
  m = parse_model(in_vocab);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("vocab entry"));
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("past the end of the file"));

  m = parse_model(std::span<const uint8_t>(bytes.data(), 100));
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("truncated header"));

  auto missing = load_model("/nonexistent/stories.bin");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

TEST(LlamaLoaderTest, RefusesACorruptedHeaderNamingTheField) {
  REQUIRE_MODEL(bytes);
  auto corrupt = [&](size_t at, uint8_t value) {
    std::vector<uint8_t> b = bytes;
    b[at] = value;
    auto m = parse_model(b);
    EXPECT_FALSE(m.ok());
    return std::string(m.status().message());
  };
  EXPECT_THAT(corrupt(0, 2), HasSubstr("bad version 2 (expected 1)"));
  EXPECT_THAT(corrupt(9, 'b'), HasSubstr("bad model type 'llamb'"));
  // Layers (the fifth i32 after the type, byte 26) 5 -> 6: the weights no longer fit the file.
  EXPECT_THAT(corrupt(26, 6), HasSubstr("wrong size: expected"));
  // KV heads (byte 34) 4 -> 3: 8 query heads are not a multiple.
  EXPECT_THAT(corrupt(34, 3), HasSubstr("not a multiple of 3 KV heads"));
  EXPECT_THAT(corrupt(38, 0), HasSubstr("shared_output_weight is 0"));
  // The first vocab entry's length (bytes 260..263) made huge.
  EXPECT_THAT(corrupt(263, 0x7f), HasSubstr("bad vocab entry 0"));
}

TEST(LlamaTokenizerTest, RoundTripsTextExactly) {
  REQUIRE_MODEL(bytes);
  auto m = parse_model(bytes);
  ASSERT_TRUE(m.ok()) << m.status();
  const Tokenizer& tok = m->tokenizer;

  // The model's own words merge into whole pieces.
  std::vector<int> ids = tok.encode("Once upon a time", true, false);
  std::vector<std::string> pieces;
  for (int id : ids) pieces.push_back(tok.piece(id));
  EXPECT_THAT(pieces, ::testing::ElementsAre("<s>", "\xe2\x96\x81Once", "\xe2\x96\x81upon", "\xe2\x96\x81" "a",
                                             "\xe2\x96\x81time"));

  // Every byte string round-trips exactly (characters without a piece go through <0xXX>), except
  // U+2581 itself, which is the tokenizer's space.
  const std::vector<std::string> texts = {
      "Once upon a time, there was a little girl named Lily.",
      "Hello, world! (yes?) [x] {y} #$%&*+/<=>@^_`|~ \"quoted\" 'single' 3.14",
      " leading, trailing and  double  spaces ",
      "tabs\tand\nnewlines\r\n\n",
      "na\xc3\xafve caf\xc3\xa9 \xe2\x80\x94 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x99\x82",  // naïve café — 日本語 🙂
      "bytes \xff\xfe\x80 and a NUL \0 inside"s,
      "",
  };
  for (const std::string& t : texts) {
    const std::vector<int> enc = tok.encode(t, true, false);
    EXPECT_EQ(tok.decode(enc), t) << "text: " << t;
  }
  // Characters with no piece become their UTF-8 bytes: 日 is E6 97 A5 -> <0xE6> <0x97> <0xA5>.
  std::vector<int> cjk = tok.encode("\xe6\x97\xa5", false, false);
  ASSERT_EQ(cjk.size(), 4u);  // dummy-prefix space, then three bytes
  EXPECT_EQ(tok.piece(cjk[1]), "<0xE6>");
  EXPECT_EQ(tok.piece(cjk[3]), "<0xA5>");
  EXPECT_EQ(tok.decode(tok.encode("a\xe2\x96\x81" "b", true, false)), "a b");  // the one exception
}

// Runs `prompt` then `steps` greedy tokens for each prompt of a batch with `att`; returns every
// step's logits ([step][b][vocab]) and the tokens.
struct Trace {
  std::vector<std::vector<float>> logits;
  std::vector<std::vector<int>> tokens;
};
Trace greedy(const Model& m, Attention& att, const std::vector<std::vector<int>>& prompts, int steps) {
  Transformer tf(m, att);
  const int B = int(prompts.size()), V = m.config.vocab_size;
  Trace tr;
  tr.tokens.resize(B);
  std::vector<uint64_t> seqs;
  std::vector<int> next(B), pos(B);
  std::vector<float> first(size_t(B) * V);
  for (int b = 0; b < B; ++b) {
    seqs.push_back(*att.create_sequence());
    auto l = tf.prefill(seqs[b], prompts[b]);
    EXPECT_TRUE(l.ok()) << l.status();
    std::copy(l->begin(), l->end(), first.begin() + size_t(b) * V);
    next[b] = sample(*l, 0, nullptr);
    pos[b] = int(prompts[b].size());
  }
  tr.logits.push_back(first);
  std::vector<float> logits(size_t(B) * V);
  for (int s = 0; s < steps; ++s) {
    for (int b = 0; b < B; ++b) tr.tokens[b].push_back(next[b]);
    absl::Status st = tf.decode(seqs, next, pos, logits);
    EXPECT_TRUE(st.ok()) << st;
    tr.logits.push_back(logits);
    for (int b = 0; b < B; ++b) {
      next[b] = sample({&logits[size_t(b) * V], size_t(V)}, 0, nullptr);
      ++pos[b];
    }
  }
  return tr;
}

void expect_daemon_matches_dense(const std::string& dtype, float tolerance) {
  auto m = load_model(KARAKV_LLAMA_MODEL);
  ASSERT_TRUE(m.ok()) << m.status();
  testing::Daemon d(daemon_args(dtype));
  ASSERT_TRUE(d.ready());
  auto client = Client::Attach(d.options(16 << 20));
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE(DaemonAttention::check_geometry(**client, m->config).ok());
  DaemonAttention served(**client, SequenceOptions{});
  DenseAttention dense(m->config, dtype);
  // A batch of two sequences of different lengths, so positions and histories differ per row.
  const std::vector<std::vector<int>> prompts = {m->tokenizer.encode("Once upon a time", true, false),
                                                 m->tokenizer.encode("Tom and Sue went to the park. They saw", true, false)};
  const Trace got = greedy(*m, served, prompts, 20);
  const Trace want = greedy(*m, dense, prompts, 20);
  EXPECT_EQ(got.tokens, want.tokens);
  double max_err = 0;
  for (size_t s = 0; s < got.logits.size(); ++s) {
    for (size_t i = 0; i < got.logits[s].size(); ++i) {
      max_err = std::max(max_err, double(std::abs(got.logits[s][i] - want.logits[s][i])));
    }
  }
  EXPECT_LE(max_err, tolerance) << "max |logit difference| over 21 steps x 2 sequences x 512";
  std::printf("%s storage: max |logit - reference| = %.3g (tolerance %.0e)\n", dtype.c_str(), max_err, tolerance);
  // The text is the model's, not noise: greedy from "Once upon a time" tells of Lily.
  EXPECT_THAT(m->tokenizer.decode(got.tokens[0]), HasSubstr("Lily"));
}

TEST(LlamaDaemonTest, Fp32LogitsAndGreedyTokensMatchTheDenseReference) {
  REQUIRE_MODEL(bytes);
  expect_daemon_matches_dense("fp32", 1e-4f);
}

// With fp16 storage both sides round K/V to fp16, but their attention sums differ in the last fp32
// bits (different order); a K/V value next to an fp16 rounding boundary then rounds the other way
// (a 2^-11 relative step) and that step propagates through the later layers. So the bound is a few
// fp16 steps of the logits (|logits| < 20 here), not fp32 noise; the greedy tokens must still agree.
TEST(LlamaDaemonTest, Fp16LogitsMatchTheDenseReferenceWithFp16Storage) {
  REQUIRE_MODEL(bytes);
  expect_daemon_matches_dense("fp16", 1e-2f);
}

// Per-token log-probabilities of stream[prompt..] with the prompt appended and the rest stepped.
std::vector<double> score(const Model& m, Attention& att, const std::vector<int>& stream, int prompt) {
  Transformer tf(m, att);
  const uint64_t seq = *att.create_sequence();
  auto first = tf.prefill(seq, std::span<const int>(stream.data(), prompt));
  EXPECT_TRUE(first.ok()) << first.status();
  std::vector<double> lp = {log_prob(*first, stream[prompt])};
  std::vector<float> logits(m.config.vocab_size);
  for (int t = prompt; t + 1 < int(stream.size()); ++t) {
    const uint64_t seqs[1] = {seq};
    const int tok[1] = {stream[t]}, pos[1] = {t};
    EXPECT_TRUE(tf.decode(seqs, tok, pos, logits).ok());
    lp.push_back(log_prob(logits, stream[t + 1]));
  }
  return lp;
}

TEST(LlamaDaemonTest, PerplexityWithPolicyNoneEqualsTheReference) {
  REQUIRE_MODEL(bytes);
  auto m = load_model(KARAKV_LLAMA_MODEL);
  ASSERT_TRUE(m.ok()) << m.status();
  testing::Daemon d(daemon_args("fp32"));
  ASSERT_TRUE(d.ready());
  auto client = Client::Attach(d.options(16 << 20));
  ASSERT_TRUE(client.ok()) << client.status();
  DaemonAttention served(**client, SequenceOptions{});
  DenseAttention dense(m->config);
  const std::vector<int> stream = m->tokenizer.encode(
      "Once upon a time, there was a little dog named Max. Max liked to run in the big green park with his "
      "friend Sam. One day, Sam found a red ball under a tree. \"Look, Max!\" said Sam. Max wagged his tail "
      "and ran to get the ball. They played all day until the sun went down. Then they went home, happy and "
      "tired, and Max slept by the warm fire.",
      true, false);
  ASSERT_GT(stream.size(), 80u);
  const std::vector<double> got = score(*m, served, stream, 32);
  const std::vector<double> want = score(*m, dense, stream, 32);
  ASSERT_EQ(got.size(), want.size());
  double nll_got = 0, nll_want = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 1e-4) << "token " << i;
    nll_got -= got[i];
    nll_want -= want[i];
  }
  const double ppl_got = std::exp(nll_got / got.size()), ppl_want = std::exp(nll_want / want.size());
  EXPECT_NEAR(ppl_got, ppl_want, 1e-4 * ppl_want);
  EXPECT_LT(ppl_want, 20.0) << "in-distribution text should be predictable for the model";
}

// The forward pass reads each weight row once for a whole batch (B sequences, or a prompt's tokens)
// and must sum every dot product in the same order whatever the batch: a prompt prefilled at once
// gives bitwise the logits of the same tokens fed one at a time, and sequences decoded in a batch of
// five (four entries share each row load, the fifth goes alone) give bitwise the logits of each
// decoded on its own.
TEST(LlamaForwardTest, BatchingDoesNotChangeAnyLogit) {
  REQUIRE_MODEL(bytes);
  auto m = load_model(KARAKV_LLAMA_MODEL);
  ASSERT_TRUE(m.ok()) << m.status();
  const int V = m->config.vocab_size;
  const std::vector<int> text = m->tokenizer.encode("Once upon a time, there was a little dog named Max.", true, false);
  ASSERT_GT(text.size(), 8u);

  DenseAttention whole(m->config), incremental(m->config);
  Transformer tw(*m, whole), ti(*m, incremental);
  auto at_once = tw.prefill(*whole.create_sequence(), text);
  ASSERT_TRUE(at_once.ok()) << at_once.status();
  const uint64_t seq = *incremental.create_sequence();
  auto one = ti.prefill(seq, std::span<const int>(text.data(), 1));
  ASSERT_TRUE(one.ok());
  std::vector<float> logits(V);
  for (size_t t = 1; t < text.size(); ++t) {
    const uint64_t seqs[1] = {seq};
    const int tok[1] = {text[t]}, pos[1] = {int(t)};
    ASSERT_TRUE(ti.decode(seqs, tok, pos, logits).ok());
  }
  EXPECT_EQ(*at_once, logits) << "prefilling at once vs one token at a time";

  const int B = 5;
  DenseAttention batched(m->config), alone(m->config);
  Transformer tb(*m, batched), ta(*m, alone);
  std::vector<uint64_t> bseqs(B), aseqs(B);
  std::vector<int> tok(B), pos(B);
  for (int b = 0; b < B; ++b) {
    const std::span<const int> prompt(text.data(), 2 + b);
    bseqs[b] = *batched.create_sequence();
    aseqs[b] = *alone.create_sequence();
    ASSERT_TRUE(tb.prefill(bseqs[b], prompt).ok());
    ASSERT_TRUE(ta.prefill(aseqs[b], prompt).ok());
    tok[b] = text[2 + b];
    pos[b] = 2 + b;
  }
  std::vector<float> all(size_t(B) * V);
  ASSERT_TRUE(tb.decode(bseqs, tok, pos, all).ok());
  for (int b = 0; b < B; ++b) {
    ASSERT_TRUE(ta.decode(std::span<const uint64_t>(&aseqs[b], 1), std::span<const int>(&tok[b], 1),
                          std::span<const int>(&pos[b], 1), logits)
                    .ok());
    EXPECT_TRUE(std::equal(logits.begin(), logits.end(), all.begin() + size_t(b) * V)) << "sequence " << b;
  }
}

TEST(LlamaDaemonTest, KaraCompressesWhileDecodingAndStaysFinite) {
  REQUIRE_MODEL(bytes);
  auto m = load_model(KARAKV_LLAMA_MODEL);
  ASSERT_TRUE(m.ok()) << m.status();
  testing::Daemon d(daemon_args("fp32"));
  ASSERT_TRUE(d.ready());
  auto client = Client::Attach(d.options(16 << 20));
  ASSERT_TRUE(client.ok()) << client.status();
  SequenceOptions kara;
  kara.policy = "kara";
  kara.params = {{"window", 32}, {"period", 4}, {"rho", 0.5}, {"recent", 16}, {"budget", 0}};
  DaemonAttention served(**client, kara);
  const Trace tr = greedy(*m, served, {m->tokenizer.encode("Once upon a time", true, false)}, 120);
  for (const auto& step : tr.logits) {
    for (float x : step) ASSERT_TRUE(std::isfinite(x));
  }
  auto list = (*client)->ListSequences();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].logical_length, 5u + 120u);
  EXPECT_LT((*list)[0].length, (*list)[0].logical_length);
  EXPECT_GT((*list)[0].compactions, 0u);
}


// ---- Sampling and distribution summaries (the long-generation fidelity task) --------------

std::vector<float> random_logits(int n, uint32_t seed, float spread) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0, spread);
  std::vector<float> l(n);
  for (float& x : l) x = d(gen);
  return l;
}

// softmax in float64, the naive way.
std::vector<double> softmax64(const std::vector<float>& l, double temperature = 1) {
  double mx = -INFINITY, z = 0;
  for (float x : l) mx = std::max(mx, double(x));
  std::vector<double> p(l.size());
  for (size_t i = 0; i < l.size(); ++i) z += (p[i] = std::exp((double(l[i]) - mx) / temperature));
  for (double& x : p) x /= z;
  return p;
}

TEST(LlamaSamplingTest, KlOverEveryTokenEqualsTheFullDivergence) {
  for (uint32_t seed = 1; seed <= 5; ++seed) {
    const auto lp = random_logits(512, seed, 3), lq = random_logits(512, seed + 100, 3);
    const auto p = softmax64(lp), q = softmax64(lq);
    double full = 0;
    for (size_t i = 0; i < p.size(); ++i) full += p[i] * std::log(p[i] / q[i]);
    EXPECT_NEAR(kl_divergence(top_tokens(lp, 512), lq), full, 1e-5 * full) << seed;
    EXPECT_NEAR(kl_divergence(top_tokens(lp, 512), lp), 0, 1e-6);  // log-probabilities kept as float
    // Kept short, the rest lumped as one outcome: the coarse divergence, exactly, below the full one.
    const TopTokens t = top_tokens(lp, 16);
    std::vector<int> order(p.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = int(i);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
    double coarse = 0, p_rest = 1, q_rest = 1;
    for (int i = 0; i < 16; ++i) {
      ASSERT_EQ(t.ids[i], order[i]);
      EXPECT_NEAR(t.logp[i], std::log(p[order[i]]), 1e-5);
      coarse += p[order[i]] * std::log(p[order[i]] / q[order[i]]);
      p_rest -= p[order[i]];
      q_rest -= q[order[i]];
    }
    coarse += p_rest * std::log(p_rest / q_rest);
    EXPECT_NEAR(std::exp(t.rest_logp), p_rest, 1e-9);
    EXPECT_NEAR(kl_divergence(t, lq), coarse, 1e-6 * coarse + 1e-12);
    EXPECT_LE(kl_divergence(t, lq), full + 1e-12);
  }
}

TEST(LlamaSamplingTest, TopPDrawsOnlyFromTheNucleusInProportion) {
  // Twelve tokens with known probabilities at temperature 0.5: the likeliest ones reaching 0.9.
  const std::vector<float> l = {0.1f, 1.2f, -0.5f, 0.9f, 2.0f, 0.3f, -1.0f, 1.5f, 0.0f, 0.6f, -2.0f, 1.0f};
  const double temperature = 0.5, top_p = 0.9;
  const auto p = softmax64(l, temperature);
  std::vector<int> order(l.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int(i);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
  std::map<int, double> nucleus;
  double acc = 0;
  for (int id : order) {
    nucleus[id] = p[id];
    if ((acc += p[id]) >= top_p) break;
  }
  ASSERT_GT(nucleus.size(), 1u);
  ASSERT_LT(nucleus.size(), l.size());
  const int banned = order[0];  // and with the likeliest token banned, the nucleus of the rest
  std::map<int, int> seen, seen_banned;
  uint64_t rng = 42, rng2 = 43;
  const int draws = 20000;
  for (int i = 0; i < draws; ++i) {
    ++seen[sample_top_p(l, float(temperature), float(top_p), {}, &rng)];
    ++seen_banned[sample_top_p(l, float(temperature), float(top_p), std::span<const int>(&banned, 1), &rng2)];
  }
  for (const auto& [id, n] : seen) {
    ASSERT_TRUE(nucleus.count(id)) << "token " << id << " is outside the nucleus";
    EXPECT_NEAR(double(n) / draws, nucleus[id] / acc, 0.015) << "token " << id;
  }
  EXPECT_EQ(seen.size(), nucleus.size());
  EXPECT_EQ(seen_banned.count(banned), 0u);
  double rest = 0, acc2 = 0;
  std::map<int, double> nucleus2;
  for (int id : order) rest += id == banned ? 0 : p[id];
  for (int id : order) {
    if (id == banned) continue;
    nucleus2[id] = p[id];
    if ((acc2 += p[id]) >= top_p * rest) break;
  }
  for (const auto& [id, n] : seen_banned) {
    ASSERT_TRUE(nucleus2.count(id)) << "token " << id << " is outside the nucleus without the banned one";
    EXPECT_NEAR(double(n) / draws, nucleus2[id] / acc2, 0.015) << "token " << id;
  }
  // A wide nucleus (about 900 of 1,000 nearly equal tokens): found past the first partial sorts,
  // and nothing outside it drawn.
  {
    const auto flat = random_logits(1000, 9, 0.1f);
    const auto q = softmax64(flat);
    std::vector<int> by(flat.size());
    for (size_t i = 0; i < by.size(); ++i) by[i] = int(i);
    std::sort(by.begin(), by.end(), [&](int a, int b) { return flat[a] > flat[b] || (flat[a] == flat[b] && a < b); });
    std::vector<int> rank(flat.size());
    size_t size = 0;
    double mass = 0;
    for (size_t i = 0; i < by.size(); ++i) rank[by[i]] = int(i);
    while (mass < top_p) mass += q[by[size++]];
    ASSERT_GT(size, 800u);
    int deepest = 0;
    uint64_t r = 11;
    for (int i = 0; i < 5000; ++i) {
      const int t = sample_top_p(flat, 1.0f, float(top_p), {}, &r);
      ASSERT_LT(size_t(rank[t]), size) << "token " << t << " of rank " << rank[t] << " is outside the nucleus";
      deepest = std::max(deepest, rank[t]);
    }
    EXPECT_GT(deepest, 256);
  }
  // Greedy: the argmax; a whole nucleus (top_p 1): every token in time.
  EXPECT_EQ(sample_top_p(l, 0, float(top_p), {}, &rng), order[0]);
  std::map<int, int> all;
  for (int i = 0; i < draws; ++i) ++all[sample_top_p(l, float(temperature), 1.0f, {}, &rng)];
  EXPECT_EQ(all.size(), l.size());
}

}  // namespace
}  // namespace karakv::llama
