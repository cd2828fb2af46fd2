// The real-model worker's pieces against SmolLM2-135M-Instruct as converted by
// scripts/fetch_smollm2.sh: the byte-level BPE tokenizer, the converted-format loader, and the
// forward pass with attention in a real karakvd matching the in-process dense reference.
// Skipped (never passed) when the converted file is not there.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "llama/daemon_attention.h"
#include "llama/model.h"
#include "tests/integration/daemon.h"

namespace karakv::llama {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using namespace std::string_literals;

// Where scripts/fetch_smollm2.sh puts it.
std::string model_path() {
  const char* dir = std::getenv("KARAKV_MODEL_DIR");
  const char* home = std::getenv("HOME");
  const std::string base = dir && *dir ? dir : std::string(home ? home : "") + "/.cache/karakv";
  return base + "/smollm2-135m-instruct.karakv";
}

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// One load for the whole suite: the file is 514 MiB of float32.
class SmolLM2Test : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    bytes_ = new std::vector<uint8_t>(read_bytes(model_path()));
    if (bytes_->empty()) return;
    auto m = parse_model(*bytes_);
    if (m.ok()) {
      model_ = new Model(std::move(*m));
    } else {
      load_error_ = new std::string(m.status().ToString());
    }
  }
  static void TearDownTestSuite() {
    delete bytes_;
    delete model_;
    delete load_error_;
    bytes_ = nullptr;
    model_ = nullptr;
    load_error_ = nullptr;
  }
  void SetUp() override {
    if (bytes_->empty()) GTEST_SKIP() << "model not fetched: run scripts/fetch_smollm2.sh (" << model_path() << ")";
    ASSERT_EQ(load_error_, nullptr) << *load_error_;
  }

  static std::vector<uint8_t>* bytes_;
  static Model* model_;
  static std::string* load_error_;
};
std::vector<uint8_t>* SmolLM2Test::bytes_ = nullptr;
Model* SmolLM2Test::model_ = nullptr;
std::string* SmolLM2Test::load_error_ = nullptr;

TEST_F(SmolLM2Test, ReadsTheGeometryAndTokenizer) {
  const Config& c = model_->config;
  EXPECT_EQ(c.n_layers, 30);
  EXPECT_EQ(c.dim, 576);
  EXPECT_EQ(c.ffn_dim, 1536);
  EXPECT_EQ(c.n_heads, 9);
  EXPECT_EQ(c.n_kv_heads, 3);
  EXPECT_EQ(c.head_dim(), 64);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_EQ(c.max_seq_len, 8192);
  EXPECT_FLOAT_EQ(c.rope_theta, 100000.0f);
  EXPECT_NEAR(c.norm_eps, 1e-5f, 1e-9f);
  EXPECT_TRUE(model_->weights.output.empty());  // tied
  ASSERT_TRUE(model_->is_bpe());
  EXPECT_EQ(model_->bpe.token(1), "<|im_start|>");
  EXPECT_EQ(model_->bpe.eos(), 2);
  EXPECT_THAT(model_->chat_template, HasSubstr("<|im_start|>"));
}

TEST_F(SmolLM2Test, PreTokenizerSplitsLikeGpt2WithSingleDigits) {
  EXPECT_THAT(BpeTokenizer::split("Hello world, it's 2024!\n\n  ok"),
              ElementsAre("Hello", " world", ",", " it", "'s", " ", "2", "0", "2", "4", "!", "\n\n ", " ok"));
  EXPECT_THAT(BpeTokenizer::split("a\tb  c "), ElementsAre("a", "\t", "b", " ", " c", " "));
}

TEST_F(SmolLM2Test, TokenizerRoundTripsTextExactly) {
  const BpeTokenizer& tok = model_->bpe;
  std::vector<std::string> pieces;
  for (int id : tok.encode("Hello world")) pieces.push_back(tok.token(id));
  EXPECT_THAT(pieces, ElementsAre("Hello", "\xc4\xa0world"));  // "Ġworld": Ġ is GPT-2's space
  EXPECT_EQ(tok.encode("1234").size(), 4u);                      // digits stay single
  // Control tokens written in the text are single ids.
  EXPECT_THAT(tok.encode("<|im_start|>user\nhi<|im_end|>"), ::testing::Contains(1));
  EXPECT_EQ(tok.encode("<|im_start|>").size(), 1u);

  const std::vector<std::string> texts = {
      "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning.",
      "Hello, world! (yes?) [x] {y} #$%&*+/<=>@^_`|~ \"quoted\" 'single' 3.14 -42 1,000,000",
      " leading, trailing and  double  spaces ",
      "tabs\tand\nnewlines\r\n\n\n   indented\n",
      "na\xc3\xafve caf\xc3\xa9 \xe2\x80\x94 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x99\x82 \xd0\x9f\xd1\x80\xd0\xb8",
      "I'm sure they'll say we've done what you'd do. DON'T",
      "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
      "a NUL \0 inside"s,
      "",
  };
  for (const std::string& t : texts) {
    EXPECT_EQ(tok.decode(tok.encode(t)), t) << "text: " << t;
  }
}

TEST_F(SmolLM2Test, LoaderRefusesTruncatedAndCorruptFiles) {
  const std::vector<uint8_t>& bytes = *bytes_;
  std::vector<uint8_t> cut(bytes.begin(), bytes.end() - 1000);
  auto m = parse_model(cut);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()),
              HasSubstr(absl::StrCat("wrong size: expected ", bytes.size(), " bytes, got ", cut.size())));

  m = parse_model(std::span<const uint8_t>(bytes.data(), 200000));  // inside the vocabulary
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("past the end of the file"));

  m = parse_model(std::span<const uint8_t>(bytes.data(), 20));
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("truncated header"));

  std::vector<uint8_t> head(bytes.begin(), bytes.begin() + 1000000);
  head[8] = 9;  // version
  EXPECT_THAT(std::string(parse_model(head).status().message()), HasSubstr("bad converted-format version 9"));
  head[8] = 1;
  head[12 + 4 * 4] = 4;  // KV heads 3 -> 4
  EXPECT_THAT(std::string(parse_model(head).status().message()), HasSubstr("not a multiple of 4 KV heads"));
}

// Greedy decoding of `prompt` for `steps` tokens; every step's logits and the tokens.
struct Trace {
  std::vector<std::vector<float>> logits;
  std::vector<int> tokens;
};
Trace greedy(const Model& m, Attention& att, const std::vector<int>& prompt, int steps) {
  Transformer tf(m, att);
  Trace tr;
  const uint64_t seq = *att.create_sequence();
  auto first = tf.prefill(seq, prompt);
  EXPECT_TRUE(first.ok()) << first.status();
  tr.logits.push_back(*first);
  int next = sample(*first, 0, nullptr), pos = int(prompt.size());
  std::vector<float> logits(m.config.vocab_size);
  for (int s = 0; s < steps; ++s) {
    tr.tokens.push_back(next);
    const uint64_t seqs[1] = {seq};
    const int tok[1] = {next}, at[1] = {pos++};
    absl::Status st = tf.decode(seqs, tok, at, logits);
    EXPECT_TRUE(st.ok()) << st;
    tr.logits.push_back(logits);
    next = sample(logits, 0, nullptr);
  }
  return tr;
}

TEST_F(SmolLM2Test, DaemonLogitsAndGreedyTokensMatchTheDenseReference) {
  const Model& m = *model_;
  testing::Daemon d({"--layers=30", "--q_heads=9", "--kv_heads=3", "--head_dim=64", "--dtype=fp32",
                     "--pool_bytes=64MiB"});
  ASSERT_TRUE(d.ready());
  auto client = Client::Attach(d.options(16 << 20));
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE(DaemonAttention::check_geometry(**client, m.config).ok());
  DaemonAttention served(**client, SequenceOptions{});
  DenseAttention dense(m.config);
  const std::vector<int> prompt =
      m.bpe.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n");
  const Trace got = greedy(m, served, prompt, 8);
  const Trace want = greedy(m, dense, prompt, 8);
  EXPECT_EQ(got.tokens, want.tokens);
  double max_err = 0, max_abs = 0;
  for (size_t s = 0; s < got.logits.size(); ++s) {
    for (size_t i = 0; i < got.logits[s].size(); ++i) {
      max_err = std::max(max_err, double(std::abs(got.logits[s][i] - want.logits[s][i])));
      max_abs = std::max(max_abs, double(std::abs(want.logits[s][i])));
    }
  }
  EXPECT_LE(max_err, 1e-3) << "max |logit difference| over 9 steps x 49152 (largest |logit| " << max_abs << ")";
  std::printf("fp32 storage: max |logit - reference| = %.3g (largest |logit| %.3g)\n", max_err, max_abs);
  // The text is the model's, not noise.
  EXPECT_THAT(m.bpe.decode(got.tokens), HasSubstr("Paris"));
}

}  // namespace
}  // namespace karakv::llama
