// A Llama-architecture model on the CPU for karakv's real-model worker: the loaders for the
// stories260K file format (data/README.md) and for karakv's converted format (magic
// "KARAKVLM", written by convert_gguf.py from SmolLM2's GGUF), and the forward pass with attention
// behind an interface, so the same weights run against an in-process dense cache or against karakvd.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "llama/bpe_tokenizer.h"
#include "llama/tokenizer.h"

namespace karakv::llama {

struct Config {
  int dim = 0;         // hidden size
  int ffn_dim = 0;     // SwiGLU inner size
  int max_seq_len = 0;
  int vocab_size = 0;
  int n_layers = 0;
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;

  int head_dim() const { return dim / n_heads; }
  int kv_dim() const { return n_kv_heads * head_dim(); }
  int q_dim() const { return dim; }
};

// Float32 weights, row-major, out x in for every matrix.
struct Weights {
  std::vector<float> embedding;  // [vocab][dim]; also the output projection when `output` is empty
  std::vector<float> attn_norm;  // [L][dim]
  std::vector<float> wq;         // [L][dim][dim]
  std::vector<float> wk;         // [L][kv_dim][dim]
  std::vector<float> wv;         // [L][kv_dim][dim]
  std::vector<float> wo;         // [L][dim][dim]
  std::vector<float> ffn_norm;   // [L][dim]
  std::vector<float> w_gate;     // [L][ffn][dim]
  std::vector<float> w_up;       // [L][ffn][dim]
  std::vector<float> w_down;     // [L][dim][ffn]
  std::vector<float> final_norm; // [dim]
  std::vector<float> output;     // [vocab][dim], or empty (tied to the embedding)
};

struct Model {
  Config config;
  Weights weights;
  Tokenizer tokenizer;     // stories260K: sentencepiece-style
  BpeTokenizer bpe;        // converted (SmolLM2): byte-level BPE; empty for stories260K
  std::string chat_template;  // converted files only (Jinja, for reference)

  bool is_bpe() const { return !bpe.empty(); }
};

// Magic of the converted format (the first 8 bytes of the file).
inline constexpr char kConvertedMagic[] = "KARAKVLM";

// Parses a model file image: the converted format when it starts with kConvertedMagic, else
// stories260K. Every error names what was wrong and where: a bad version or model type, an
// impossible geometry, a vocabulary entry running past the end, or the wrong total size
// ("expected N bytes, got M").
absl::StatusOr<Model> parse_model(std::span<const uint8_t> bytes);
absl::StatusOr<Model> load_model(const std::string& path);

// Attention over each sequence's history, as the forward pass sees it. Keys arrive after RoPE;
// the implementation stores them (in-process, or in karakvd) and attends over what it holds.
class Attention {
 public:
  virtual ~Attention() = default;
  virtual absl::StatusOr<uint64_t> create_sequence() = 0;
  // The prompt's K/V, whose attention the forward pass computed itself (causal, dense).
  //   k, v: [L][T][Hk][D] fp32; q: [L][T][Hq][D] fp32, the prompt's queries (post-RoPE).
  virtual absl::Status prefill(uint64_t seq, int num_tokens, std::span<const float> k,
                               std::span<const float> v, std::span<const float> q) = 0;
  // One decode token per sequence at `layer`: store k/v, attend with q over the history including
  // this token. Layers come in order 0..L-1 for each token.
  //   k, v: [B][Hk][D]; q, out: [B][Hq][D]; all fp32.
  virtual absl::Status step(int layer, std::span<const uint64_t> seqs, std::span<const float> k,
                            std::span<const float> v, std::span<const float> q, std::span<float> out) = 0;
  virtual absl::Status release(uint64_t seq) = 0;
};

// The forward pass. Holds scratch buffers only; the KV history lives in the Attention.
class Transformer {
 public:
  Transformer(const Model& model, Attention& attention) : model_(model), attention_(attention) {}

  // Runs the prompt (positions 0..T-1) of a new history: computes every layer's causal attention
  // over the prompt in-process, hands the K/V and queries to Attention::prefill, and returns the
  // logits after the last prompt token ([vocab]).
  absl::StatusOr<std::vector<float>> prefill(uint64_t seq, std::span<const int> tokens);

  // One token per sequence: tokens[b] sits at position positions[b] of sequence seqs[b].
  //   logits: [B][vocab]
  absl::Status decode(std::span<const uint64_t> seqs, std::span<const int> tokens,
                      std::span<const int> positions, std::span<float> logits);

  const Model& model() const { return model_; }

 private:
  const Model& model_;
  Attention& attention_;
};

// Dense reference attention with its own per-sequence cache. Rounds stored K/V through `dtype`
// (fp32 | fp16 | bf16) so it sees exactly what a daemon with that storage dtype sees.
class DenseAttention : public Attention {
 public:
  DenseAttention(const Config& config, std::string dtype = "fp32");
  absl::StatusOr<uint64_t> create_sequence() override;
  absl::Status prefill(uint64_t seq, int num_tokens, std::span<const float> k, std::span<const float> v,
                       std::span<const float> q) override;
  absl::Status step(int layer, std::span<const uint64_t> seqs, std::span<const float> k,
                    std::span<const float> v, std::span<const float> q, std::span<float> out) override;
  absl::Status release(uint64_t seq) override;

 private:
  struct History {
    int length = 0;
    std::vector<std::vector<float>> k, v;  // per layer: [T][Hk][D]
  };
  float round_stored(float x) const;
  History* find(uint64_t seq);

  Config config_;
  std::string dtype_;
  uint64_t next_id_ = 1;
  std::vector<std::pair<uint64_t, History>> histories_;
};

// Causal softmax attention of one query token over `len` cached tokens, GQA.
//   q, out: [Hq][D]; k, v: [len][Hk][D] with row stride `kv_stride` floats between tokens.
void attend(const Config& c, const float* q, const float* k, const float* v, int len, size_t kv_stride,
            float* out);

// SmolLM2's chat template (tokenizer.chat_template in the GGUF) for one user turn, with the
// assistant's turn opened for generation; an empty `system` leaves the system turn out.
inline constexpr char kSmolLM2System[] = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";
std::string chat_prompt(const std::string& system, const std::string& user);

// Sampling: greedy when temperature <= 0, else softmax(logits / temperature) with `rng` state.
int sample(std::span<const float> logits, float temperature, uint64_t* rng);
// Natural-log probability of `token` under softmax(logits).
double log_prob(std::span<const float> logits, int token);

// Nucleus sampling: softmax(logits / temperature) cut to the fewest likeliest tokens whose
// probability reaches `top_p` (ties by lower id), renormalized, one draw from `rng`'s state.
// `banned` tokens are never drawn (a generation that must go on past end-of-turn); the rest of the
// distribution is unchanged. top_p >= 1 keeps every token; temperature <= 0 is greedy.
int sample_top_p(std::span<const float> logits, float temperature, float top_p, std::span<const int> banned,
                 uint64_t* rng);

// A next-token distribution kept compactly: the natural-log probabilities (of softmax(logits), no
// temperature) of its k likeliest tokens, likeliest first (ties by lower id), and of all the rest
// together. `ids[0]` is the greedy token.
struct TopTokens {
  std::vector<int> ids;
  std::vector<float> logp;
  double rest_logp = -INFINITY;  // log of the mass outside `ids`; -inf when there is none
};
TopTokens top_tokens(std::span<const float> logits, int k);

// KL(p || q) in nats, with q = softmax(q_logits) and p known only as `p`: each kept token's term,
// plus one term for the rest taken as a single outcome. That coarsening can only lower the
// divergence (the log-sum inequality), so the result is a lower bound of the full KL, equal to it
// when p keeps every token, and never negative.
double kl_divergence(const TopTokens& p, std::span<const float> q_logits);

}  // namespace karakv::llama
