// llama_worker: generates text with a real model (stories260K, or SmolLM2-135M-Instruct converted
// by scripts/fetch_smollm2.sh; told apart by the file's magic) whose attention runs in karakvd. The prompt's attention is computed in this process and its K/V (with queries) sent in
// one Append; every generated token then costs one Step per layer, batched over --sequences.
// Streams the first sequence's text, then prints throughput and the daemon's resident vs logical
// tokens. --dense runs the same thing with in-process attention (no daemon) for comparison.
// --chat wraps the prompt in SmolLM2's chat template; a BPE model stops at a control token
// (<|im_end|>, <|endoftext|>).
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <set>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "karakv/client.h"
#include "llama/daemon_attention.h"
#include "llama/model.h"

ABSL_FLAG(std::string, model, "data/stories260k.bin",
          "Model file: stories260K format, or a converted SmolLM2 file (scripts/fetch_smollm2.sh)");
ABSL_FLAG(std::string, target, "", "karakvd address (empty: $KARAKV_TARGET, else unix:/tmp/karakv.sock)");
ABSL_FLAG(std::string, prompt, "Once upon a time", "Prompt text");
ABSL_FLAG(int, tokens, 200, "Tokens to generate per sequence (capped by the model's context)");
ABSL_FLAG(std::string, policy, "none", "Compression policy of the sequences (docs/COMPRESSION.md)");
ABSL_FLAG(std::vector<std::string>, param, {}, "Policy parameter name=value; repeatable, or comma-separated");
ABSL_FLAG(std::string, prefill_policy, "", "One-time prefill policy for the prompt (e.g. snapkv)");
ABSL_FLAG(std::vector<std::string>, prefill_param, {}, "Prefill policy parameter name=value; repeatable");
ABSL_FLAG(int, sequences, 1, "Sequences generated together (decode batch size)");
ABSL_FLAG(double, temperature, 0.0, "Sampling temperature; 0 is greedy");
ABSL_FLAG(uint64_t, seed, 1, "Sampling seed (sequence b uses seed + b)");
ABSL_FLAG(bool, chat, false, "Apply the chat template (converted SmolLM2 models): the prompt is the user's turn");
ABSL_FLAG(std::string, system, karakv::llama::kSmolLM2System,
          "With --chat: the system turn (the template's default); empty leaves it out");
ABSL_FLAG(bool, dense, false, "Attend in this process instead of in karakvd (reference, no daemon)");

namespace {

using Clock = std::chrono::steady_clock;

int die(const std::string& what) {
  std::fprintf(stderr, "llama_worker: %s\n", what.c_str());
  return 1;
}
int die(const absl::Status& s) { return die(std::string(s.ToString())); }

// absl keeps only the last occurrence of a flag; collect every --name=v / --name v ourselves.
std::vector<std::string> take_repeated(int& argc, char** argv, const std::string& name) {
  std::vector<std::string> out;
  const std::string eq = "--" + name + "=", bare = "--" + name;
  int w = 1;
  for (int r = 1; r < argc; ++r) {
    std::string a = argv[r];
    if (a.rfind(eq, 0) == 0) {
      out.push_back(a.substr(eq.size()));
    } else if (a == bare && r + 1 < argc) {
      out.push_back(argv[++r]);
    } else {
      argv[w++] = argv[r];
    }
  }
  argc = w;
  return out;
}

absl::StatusOr<std::map<std::string, double>> parse_params(const std::vector<std::string>& raw) {
  std::map<std::string, double> out;
  for (const std::string& item : raw) {
    for (absl::string_view kv : absl::StrSplit(item, ',', absl::SkipEmpty())) {
      std::vector<std::string> parts = absl::StrSplit(kv, absl::MaxSplits('=', 1));
      double value = 0;
      if (parts.size() != 2 || !absl::SimpleAtod(parts[1], &value)) {
        return absl::InvalidArgumentError("bad parameter '" + std::string(kv) + "', expected name=value");
      }
      out[parts[0]] = value;
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("llama_worker: generate text with a Llama-architecture model whose KV cache lives in karakvd");
  std::vector<std::string> raw_params = take_repeated(argc, argv, "param");
  std::vector<std::string> raw_prefill = take_repeated(argc, argv, "prefill_param");
  absl::ParseCommandLine(argc, argv);
  auto params = parse_params(raw_params);
  auto prefill_params = parse_params(raw_prefill);
  if (!params.ok()) return die(params.status());
  if (!prefill_params.ok()) return die(prefill_params.status());

  auto model = karakv::llama::load_model(absl::GetFlag(FLAGS_model));
  if (!model.ok()) return die(model.status());
  const karakv::llama::Config& c = model->config;
  const int B = absl::GetFlag(FLAGS_sequences);
  if (B < 1) return die("--sequences must be >= 1");
  const bool bpe = model->is_bpe();
  if (absl::GetFlag(FLAGS_chat) && !bpe) return die("--chat needs a converted SmolLM2 model (scripts/fetch_smollm2.sh)");
  const std::string prompt_text = absl::GetFlag(FLAGS_chat)
                                      ? karakv::llama::chat_prompt(absl::GetFlag(FLAGS_system), absl::GetFlag(FLAGS_prompt))
                                      : absl::GetFlag(FLAGS_prompt);
  const std::vector<int> prompt =
      bpe ? model->bpe.encode(prompt_text) : model->tokenizer.encode(prompt_text, /*bos=*/true, false);
  if (prompt.empty()) return die("empty prompt");
  if (int(prompt.size()) >= c.max_seq_len) return die("prompt longer than the model's context");
  int gen = absl::GetFlag(FLAGS_tokens);
  if (int(prompt.size()) + gen > c.max_seq_len) {
    gen = c.max_seq_len - int(prompt.size());
    std::fprintf(stderr, "llama_worker: --tokens capped at %d (context %d)\n", gen, c.max_seq_len);
  }

  std::unique_ptr<karakv::Client> client;
  std::unique_ptr<karakv::llama::Attention> attention;
  if (absl::GetFlag(FLAGS_dense)) {
    attention = std::make_unique<karakv::llama::DenseAttention>(c);
  } else {
    karakv::ClientOptions opts;
    opts.target = absl::GetFlag(FLAGS_target);
    opts.worker_id = "llama_worker";
    opts.staging_bytes = 16 << 20;
    auto attached = karakv::Client::Attach(opts);
    if (!attached.ok()) return die(attached.status());
    client = std::move(*attached);
    if (auto s = karakv::llama::DaemonAttention::check_geometry(*client, c); !s.ok()) return die(s);
    karakv::SequenceOptions so;
    so.policy = absl::GetFlag(FLAGS_policy);
    so.params = *params;
    so.prefill_policy = absl::GetFlag(FLAGS_prefill_policy);
    so.prefill_params = *prefill_params;
    attention = std::make_unique<karakv::llama::DaemonAttention>(*client, so);
  }
  karakv::llama::Transformer model_run(*model, *attention);

  // Prefill every sequence; all share the prompt, each has its own sampling stream.
  const float temperature = float(absl::GetFlag(FLAGS_temperature));
  std::vector<uint64_t> seqs(B), rng(B);
  std::vector<int> next(B), pos(B, int(prompt.size()));
  std::vector<std::vector<int>> generated(B);
  const auto t0 = Clock::now();
  for (int b = 0; b < B; ++b) {
    auto id = attention->create_sequence();
    if (!id.ok()) return die(id.status());
    seqs[b] = *id;
    rng[b] = absl::GetFlag(FLAGS_seed) + uint64_t(b) * 0x9E3779B97F4A7C15ull;
    auto logits = model_run.prefill(seqs[b], prompt);
    if (!logits.ok()) return die(logits.status());
    next[b] = karakv::llama::sample(*logits, temperature, &rng[b]);
  }
  const double prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();

  std::printf("%s", prompt_text.c_str());
  std::fflush(stdout);
  std::vector<float> logits(size_t(B) * c.vocab_size);
  const auto t1 = Clock::now();
  int prev0 = prompt.back();
  // A BPE model's sequence ends at a control token; the batch stops when every sequence has.
  std::vector<bool> ended(B, false);
  int steps = 0;
  for (int t = 0; t < gen; ++t) {
    bool all_ended = true;
    for (int b = 0; b < B; ++b) {
      if (ended[b]) continue;
      generated[b].push_back(next[b]);
      ended[b] = bpe && model->bpe.is_control(next[b]);
      all_ended = all_ended && ended[b];
    }
    // Stream sequence 0; in stories260K a BOS starts a new story, shown as a blank line.
    if (generated[0].size() == size_t(t) + 1) {
      std::printf("%s", bpe ? model->bpe.decode(next[0]).c_str()
                            : next[0] == karakv::llama::Tokenizer::kBos ? "\n\n"
                                                                         : model->tokenizer.decode(prev0, next[0]).c_str());
      std::fflush(stdout);
    }
    prev0 = next[0];
    if (t == gen - 1 || all_ended) break;  // the last sampled token needs no forward pass
    ++steps;
    if (auto s = model_run.decode(seqs, next, pos, logits); !s.ok()) return die(s);
    for (int b = 0; b < B; ++b) {
      ++pos[b];
      next[b] = karakv::llama::sample(std::span<const float>(&logits[size_t(b) * c.vocab_size], c.vocab_size),
                                      temperature, &rng[b]);
    }
  }
  const double decode_s = std::chrono::duration<double>(Clock::now() - t1).count();
  std::printf("\n");
  for (int b = 1; b < B; ++b) {
    std::printf("--- sequence %d ---\n%s%s\n", b, prompt_text.c_str(),
                bpe ? model->bpe.decode(generated[b]).c_str() : model->tokenizer.decode(generated[b]).c_str());
  }
  std::printf("\nprompt %zu tokens x %d sequences, prefill %.3f s; decode %d steps x %d sequences in %.3f s = %.1f tokens/s\n",
              prompt.size(), B, prefill_s, steps, B, decode_s, decode_s > 0 ? steps * double(B) / decode_s : 0.0);
  // A loop shows as a number: the share of the generated text's 4-grams (of tokens) that are
  // distinct; prose stays near 1, "1999, 1999, 1999, ..." falls towards 0.
  for (int b = 0; b < B; ++b) {
    const auto& g = generated[b];
    std::set<std::vector<int>> distinct;
    for (size_t i = 0; i + 4 <= g.size(); ++i) distinct.insert(std::vector<int>(g.begin() + i, g.begin() + i + 4));
    const size_t total = g.size() >= 4 ? g.size() - 3 : 0;
    std::printf("sequence %d: distinct 4-grams %.3f (%zu of %zu)\n", b, total ? double(distinct.size()) / total : 1.0,
                distinct.size(), total);
  }
  if (client) {
    auto list = client->ListSequences();
    if (!list.ok()) return die(list.status());
    uint64_t resident = 0, logical = 0;
    for (const auto& s : *list) {
      resident += s.length;
      logical += s.logical_length;
    }
    auto stats = client->Stats();
    if (!stats.ok()) return die(stats.status());
    std::printf("karakvd (%s, %s): policy %s: %llu tokens resident of %llu logical (%.1f%%); daemon-wide %llu resident, %llu blocks used\n",
                stats->backend.c_str(), karakv::kernels::dtype_name(stats->geometry.dtype),
                absl::GetFlag(FLAGS_policy).c_str(), (unsigned long long)resident, (unsigned long long)logical,
                logical ? 100.0 * resident / logical : 0.0, (unsigned long long)stats->resident_tokens,
                (unsigned long long)stats->blocks_used);
    for (uint64_t id : seqs) {
      if (auto s = attention->release(id); !s.ok()) return die(s);
    }
  }
  return 0;
}
