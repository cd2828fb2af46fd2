// llama_quality: what KV compression costs a real model whose cache lives in karakvd. For each
// policy and storage format, on a fresh karakvd per (task, policy) (so Kara's decode-step counter
// starts at 0 every time), two kinds of task:
//
//   perplexity: a prompt of P tokens goes in by Append (the worker computes its causal attention
//     itself and sends K/V plus the prompt's queries); the next F tokens are fed one at a time
//     through Step, so decode-time compression runs, and each is scored by the logits before it
//     (F predictions per stream, the first from the prompt's logits).
//   greedy agreement: each prompt's first tokens go in by Append, the rest (if any) through Step,
//     then up to G greedy tokens (a BPE model stops at a control token such as <|im_end|>);
//     compared with the uncompressed (`none`) run position by position, and by common prefix.
//   long-generation fidelity ("longgen"): a short prompt by Append, then `none` samples N tokens
//     (temperature 0.7, top-p 0.9, a fixed seed per prompt, control tokens never drawn so the answer
//     runs the whole length), keeping its next-token distribution at every position (its likeliest
//     --longgen_kept tokens and the rest's mass); every other policy teacher-forces that trajectory
//     through Step and is scored by KL(none || policy) and top-1 agreement with none, per bucket
//     of positions (the regime of a short prompt and a long output).
//
// Sources by model:
//   stories260K (context 512): perplexity on "stories" (the model's own temperature-1 samples:
//     cross-entropy on them = the full model's entropy + KL(full || compressed)) and "shakespeare"
//     (data/tinyshakespeare.txt), P=128, F=384; agreement on the stories, 128 by Append +
//     256 by Step, then 128 greedy tokens.
//   SmolLM2-135M-Instruct (a converted BPE model): perplexity on "shakespeare" and the --genres
//     texts ("code", "tech", "dialogue": data/README.md), P=512, F=2048;
//     agreement on GSM8K test questions (data/gsm8k_test.jsonl) in the chat template,
//     the whole prompt by Append, 256 greedy tokens; long generation on data/longgen_prompts.txt
//     (eight instructions in the chat template), N=2048 in buckets of 512.
//   (stories260K's long generation: 8 tokens of each story as the prompt, N=448 in buckets of 64.)
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "karakv/client.h"
#include "llama/daemon_attention.h"
#include "llama/model.h"

ABSL_FLAG(std::string, model, "data/stories260k.bin",
          "Model file: stories260K, or a converted SmolLM2 file (scripts/fetch_smollm2.sh)");
ABSL_FLAG(std::string, text, "data/tinyshakespeare.txt", "Natural text for perplexity (empty: skip)");
ABSL_FLAG(std::string, genres,
          "code=data/code_python_email.txt,tech=data/tech_sqlite_internals.txt,"
          "dialogue=data/dialogue_python_tutorial.txt",
          "BPE models: more perplexity tasks, NAME=PATH comma-separated (data/README.md: program source, "
          "technical prose, instructions with dialogue), each run as \"shakespeare\" is (empty: none)");
ABSL_FLAG(std::string, gsm8k, "data/gsm8k_test.jsonl", "GSM8K questions for BPE models' agreement");
ABSL_FLAG(std::string, longgen, "data/longgen_prompts.txt",
          "BPE models: instruction prompts, one per line, for the long-generation fidelity task (empty: skip)");
ABSL_FLAG(int, longgen_tokens, 0, "Long generation: tokens none samples per prompt; 0: 2048 for BPE, 448 for stories260K");
ABSL_FLAG(int, longgen_bucket, 0, "Long generation: positions per reported bucket; 0: 512 for BPE, 64 for stories260K");
ABSL_FLAG(double, longgen_temperature, 0.7, "Long generation: none's sampling temperature");
ABSL_FLAG(double, longgen_top_p, 0.9, "Long generation: none's nucleus (top-p)");
ABSL_FLAG(int, longgen_kept, 1024,
          "Long generation: none's likeliest tokens kept per position for the KL (the rest as one outcome: "
          "a lower bound of the full KL, reported with the mass it leaves out)");
ABSL_FLAG(std::string, longgen_texts, "",
          "Long generation: also write none's sampled continuations here, as text, one prompt after another "
          "(empty: don't)");
ABSL_FLAG(std::string, karakvd, KARAKVD_DEFAULT_PATH, "karakvd binary; one is started per task and policy");
ABSL_FLAG(std::string, dtype, "fp16", "Storage dtype of the daemons: fp32 | fp16 | bf16");
ABSL_FLAG(int, block_size, 0, "Tokens per pool block of the daemons (karakvd --block_size); 0: karakvd's default");
ABSL_FLAG(int, streams, 0, "Perplexity streams per source (decoded together); 0: 8 for stories260K, 2 for BPE");
ABSL_FLAG(int, prompt_tokens, 0, "Perplexity prompt P (by Append); 0: 128 for stories260K, 512 for BPE");
ABSL_FLAG(int, fed_tokens, 0, "Perplexity tokens F fed by Step and scored; 0: 384 for stories260K, 2048 for BPE");
ABSL_FLAG(int, prompts, 20, "GSM8K prompts for agreement (BPE models)");
ABSL_FLAG(int, gen_tokens, 0, "Greedy tokens per agreement prompt; 0: 128 for stories260K, 256 for BPE");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the self-generated stories");
ABSL_FLAG(bool, quick, false,
          "A few minutes: fewer streams, prompts and tokens, and only none, kara-0.50, kara-0.25, snapkv, kivi4");
ABSL_FLAG(bool, reference, true, "Also run the in-process dense reference on the perplexity sources");
ABSL_FLAG(std::string, csv, "quality.csv", "Where to write the results as CSV");
ABSL_FLAG(std::string, only, "", "Comma-separated policy labels to run (default: all; none always runs)");
ABSL_FLAG(std::string, tasks, "", "Comma-separated task names to run (default: all), e.g. shakespeare,gsm8k");
ABSL_FLAG(std::string, kara_points, "",
          "The ablation: instead of the standard comparison, none plus these Kara points, each followed by "
          "--baselines sized to its MEAN resident memory (docs/COMPRESSION.md section 4). Semicolon-separated "
          "LABEL=name:value,name:value over the task's window and period, e.g. "
          "\"r0=recent:0;r64=recent:64,observers:1\". A point labelled kara names its baselines plainly (snapkv), "
          "others as NAME@LABEL");
ABSL_FLAG(std::string, baselines, "snapkv,streaming,h2o", "With --kara_points: the baselines matched to each point");
ABSL_FLAG(std::string, diagnostics, "",
          "Perplexity tasks: also write, to this CSV, each compressing policy's per-token loss gap to none "
          "against steps since the sequence's last compaction, and its attention recall (the share of none's "
          "attention mass on the tokens it kept) beside a recency choice of the same size; empty: off");
ABSL_FLAG(bool, kara_cam, true, "With --kara_points: also run the point labelled kara with cam=1 (kara+cam)");
ABSL_FLAG(bool, ablation_none, true,
          "With --kara_points: run none first (false: a later stage of a staged ablation whose none ran already; "
          "the vs-none column is then empty)");

namespace {

using karakv::llama::Config;
using karakv::llama::Model;
using karakv::llama::Transformer;
using Clock = std::chrono::steady_clock;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "llama_quality: %s\n", what.c_str());
  std::exit(1);
}
template <typename T>
T check(absl::StatusOr<T> v) {
  if (!v.ok()) die(std::string(v.status().ToString()));
  return *std::move(v);
}
void check(const absl::Status& s) {
  if (!s.ok()) die(std::string(s.ToString()));
}
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A karakvd for one run, on its own socket, stopped with SIGTERM.
class Daemon {
 public:
  Daemon(const std::string& binary, const Config& c, const std::string& dtype, size_t pool_mib) {
    socket_ = absl::StrCat("/tmp/karakv-quality-", getpid(), "-", counter_++, ".sock");
    std::vector<std::string> args = {binary,
                                     "--socket=" + socket_,
                                     absl::StrCat("--layers=", c.n_layers),
                                     absl::StrCat("--q_heads=", c.n_heads),
                                     absl::StrCat("--kv_heads=", c.n_kv_heads),
                                     absl::StrCat("--head_dim=", c.head_dim()),
                                     "--dtype=" + dtype,
                                     absl::StrCat("--pool_bytes=", pool_mib, "MiB"),
                                     "--log_level=warn",
                                     "--threads=1"};
    if (const int b = absl::GetFlag(FLAGS_block_size); b > 0) args.push_back(absl::StrCat("--block_size=", b));
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the harness
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    // Up to a minute: a daemon's pool of a few hundred MiB takes seconds to fault in on a busy
    // machine (transparent huge pages compacting memory), 10 s was seen to be too short.
    for (int i = 0; i < 1200; ++i) {
      if (access(socket_.c_str(), F_OK) == 0) {
        karakv::ClientOptions o = options();
        o.staging_bytes = 0;
        o.heartbeat = false;
        if (karakv::Client::Attach(o).ok()) return;
      }
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) die("karakvd exited at start: " + binary);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    die("karakvd did not come up on " + socket_);
  }
  ~Daemon() {
    kill(pid_, SIGTERM);
    int status;
    waitpid(pid_, &status, 0);
  }
  karakv::ClientOptions options() const {
    karakv::ClientOptions o;
    o.target = "unix:" + socket_;
    o.worker_id = "llama_quality";
    o.staging_bytes = 64 << 20;
    return o;
  }

 private:
  static inline int counter_ = 0;
  std::string socket_;
  pid_t pid_ = -1;
};

// ---- Tasks ----------------------------------------------------------------------------------

struct PplTask {
  std::string name;
  std::vector<std::vector<int>> streams;  // each prompt + fed tokens long
  int prompt = 0, fed = 0;
};

struct GreedyTask {
  std::string name;
  std::vector<std::vector<int>> prompts;
  std::vector<int> appended;  // tokens of each prompt given by Append; the rest go through Step
  int gen = 0;
  bool stop_at_control = false;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) die("cannot open " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The model's own text: temperature-1 samples from BOS with the dense reference, crossing story
// boundaries (BOS) as the TinyStories training stream does.
std::vector<std::vector<int>> sample_stories(const Model& m, int n, int length, uint64_t seed) {
  karakv::llama::DenseAttention dense(m.config);
  Transformer tf(m, dense);
  std::vector<std::vector<int>> streams(n);
  std::vector<uint64_t> seqs(n), rng(n);
  std::vector<int> next(n), pos(n, 1);
  for (int b = 0; b < n; ++b) {
    seqs[b] = check(dense.create_sequence());
    rng[b] = seed * 1000003 + b;
    streams[b] = {karakv::llama::Tokenizer::kBos};
    next[b] = karakv::llama::sample(check(tf.prefill(seqs[b], streams[b])), 1.0f, &rng[b]);
  }
  std::vector<float> logits(size_t(n) * m.config.vocab_size);
  for (int t = 1; t < length; ++t) {
    for (int b = 0; b < n; ++b) streams[b].push_back(next[b]);
    if (t == length - 1) break;
    check(tf.decode(seqs, next, pos, logits));
    for (int b = 0; b < n; ++b) {
      ++pos[b];
      next[b] = karakv::llama::sample({&logits[size_t(b) * m.config.vocab_size], size_t(m.config.vocab_size)}, 1.0f,
                                      &rng[b]);
    }
  }
  return streams;
}

std::vector<int> encode(const Model& m, const std::string& text) {
  return m.is_bpe() ? m.bpe.encode(text) : m.tokenizer.encode(text, /*bos=*/true, false);
}

// n windows spread evenly over the text, each starting at a paragraph, `length` tokens each.
std::vector<std::vector<int>> text_windows(const Model& m, const std::string& path, int n, int length) {
  const std::string text = read_file(path);
  std::vector<std::vector<int>> out;
  for (int i = 0; i < n; ++i) {
    size_t at = text.find("\n\n", text.size() / n * i);
    if (at == std::string::npos) die("text too short: " + path);
    // ~3 characters per token for either tokenizer; take generously and cut.
    std::vector<int> toks = encode(m, text.substr(at + 2, size_t(length) * 8));
    if (toks.size() < size_t(length)) die(absl::StrFormat("a window of %s has fewer than %d tokens", path, length));
    toks.resize(length);
    out.push_back(std::move(toks));
  }
  return out;
}

// The first n questions of a GSM8K JSONL file, each parsed with protobuf's JSON reader.
std::vector<std::string> gsm8k_questions(const std::string& path, int n) {
  std::vector<std::string> out;
  for (absl::string_view line : absl::StrSplit(read_file(path), '\n', absl::SkipWhitespace())) {
    if (int(out.size()) == n) break;
    google::protobuf::Struct row;
    auto s = google::protobuf::util::JsonStringToMessage(std::string(line), &row);
    if (!s.ok() || !row.fields().count("question")) {
      die(absl::StrFormat("%s line %d: not a {\"question\": ...} JSON object", path, int(out.size()) + 1));
    }
    out.push_back(row.fields().at("question").string_value());
  }
  if (int(out.size()) < n) die(absl::StrFormat("%s has %d questions; %d wanted", path, int(out.size()), n));
  return out;
}

// ---- Runs -----------------------------------------------------------------------------------

// Per-sequence residency of this client's sequences (means over sequences), and the parameters
// their policy ran with as the daemon resolved them (the first sequence's: one spec per run).
struct Residency {
  double resident = 0, logical = 0, kv_bytes = 0, fp16_bytes = 0;
  bool listed = false;  // a sequence was listed: `params` is what its policy ran with
  std::vector<std::pair<std::string, double>> params;  // in name order
};
Residency residency(karakv::Client* client) {
  Residency r;
  if (!client) return r;
  auto list = check(client->ListSequences());
  if (!list.empty()) {
    r.listed = true;
    r.params.assign(list.front().params.begin(), list.front().params.end());
  }
  for (const auto& s : list) {
    r.resident += s.length;
    r.logical += s.logical_length;
    r.kv_bytes += double(s.kv_bytes);
    r.fp16_bytes += double(s.fp16_bytes);
  }
  const double n = std::max<size_t>(1, list.size());
  r.resident /= n;
  r.logical /= n;
  r.kv_bytes /= n;
  r.fp16_bytes /= n;
  return r;
}

struct PplResult {
  double nll = 0;  // summed over every scored token
  int scored = 0;
  Residency end;
  double resident_mean = 0;                // over the decode steps
  std::vector<std::vector<double>> logp;   // per stream, per scored token
  double seconds = 0;
};

// Progress on stderr: redrawn in place on a terminal, a line per tenth of the work otherwise.
void progress(const std::string& what, int done, int total, Clock::time_point t0) {
  static const bool tty = isatty(STDERR_FILENO);
  if (tty) {
    std::fprintf(stderr, "\r  %-40s %5d/%d  %6.0f s%s", what.c_str(), done, total, seconds_since(t0),
                 done == total ? "\n" : "");
  } else if (done == total || done * 10 / total != (done - 32) * 10 / total) {
    std::fprintf(stderr, "  %-40s %5d/%d  %6.0f s\n", what.c_str(), done, total, seconds_since(t0));
  }
  std::fflush(stderr);
}

// ---- Diagnostics (--diagnostics) -----------------------------------------------------------
// The none run of a perplexity task records full attention's inputs (every key, and the queries of
// the steps recall samples); each compressing run is then compared with it step by step.

constexpr int kSampleEvery = 8;  // steps i with i % 8 == 7 are sampled (as the mean residency)

struct FullCache {
  // keys[b][l]: [T][Hk][D] fp32, every position stream b ever had at layer l
  std::vector<std::vector<std::vector<float>>> keys;
  // queries[b][i]: [L][Hq][D] fp32 of decode step i, for i % 8 == 0 (the step after a sample)
  std::vector<std::map<int, std::vector<float>>> queries;
  std::vector<std::vector<double>> logp;  // per stream, per scored token
};

// Hooks the perplexity loop calls around each decode step.
class StepObserver {
 public:
  virtual ~StepObserver() = default;
  virtual void before(int step) {}
  virtual void after(int step, const std::vector<uint64_t>& seqs) {}
};

// An Attention that passes everything to `inner` and keeps, in `record`, the K of every position
// and the queries of the steps after each sample (the none run).
class RecordingAttention : public karakv::llama::Attention, public StepObserver {
 public:
  RecordingAttention(karakv::llama::Attention& inner, const karakv::llama::Config& c, FullCache& record)
      : inner_(inner), c_(c), record_(record) {}
  absl::StatusOr<uint64_t> create_sequence() override {
    auto id = inner_.create_sequence();
    if (id.ok()) {
      index_[*id] = record_.keys.size();
      record_.keys.emplace_back(c_.n_layers);
      record_.queries.emplace_back();
    }
    return id;
  }
  absl::Status prefill(uint64_t seq, int num_tokens, std::span<const float> k, std::span<const float> v,
                       std::span<const float> q) override {
    auto& keys = record_.keys[index_.at(seq)];
    const size_t per_layer = size_t(num_tokens) * c_.kv_dim();
    for (int l = 0; l < c_.n_layers; ++l) keys[l].insert(keys[l].end(), &k[l * per_layer], &k[l * per_layer] + per_layer);
    return inner_.prefill(seq, num_tokens, k, v, q);
  }
  absl::Status step(int layer, std::span<const uint64_t> seqs, std::span<const float> k, std::span<const float> v,
                    std::span<const float> q, std::span<float> out) override {
    const size_t kd = c_.kv_dim(), qd = size_t(c_.n_heads) * c_.head_dim();
    for (size_t b = 0; b < seqs.size(); ++b) {
      const size_t idx = index_.at(seqs[b]);
      auto& keys = record_.keys[idx][layer];
      keys.insert(keys.end(), &k[b * kd], &k[b * kd] + kd);
      if (recording_ >= 0) {
        auto& qs = record_.queries[idx][recording_];
        qs.resize(size_t(c_.n_layers) * qd);
        std::copy_n(&q[b * qd], qd, qs.begin() + layer * qd);
      }
    }
    return inner_.step(layer, seqs, k, v, q, out);
  }
  absl::Status release(uint64_t seq) override { return inner_.release(seq); }
  void before(int step) override { recording_ = step > 0 && step % kSampleEvery == 0 ? step : -1; }

 private:
  karakv::llama::Attention& inner_;
  const karakv::llama::Config& c_;
  FullCache& record_;
  std::map<uint64_t, size_t> index_;
  int recording_ = -1;
};

// Mean of a measure by steps since the sequence's last compaction, in buckets of 16 steps.
struct ByAge {
  static constexpr int kWidth = 16, kBuckets = 9;  // 1-16, ..., 113-128, 129+
  std::array<double, kBuckets> sum{};
  std::array<long, kBuckets> count{};
  void add(int age, double x) {
    const int b = std::min(kBuckets - 1, (age - 1) / kWidth);
    sum[b] += x;
    ++count[b];
  }
  static std::string label(int b) {
    return b == kBuckets - 1 ? absl::StrCat(b * kWidth + 1, "+") : absl::StrCat(b * kWidth + 1, "-", (b + 1) * kWidth);
  }
};

// A compressing run against the none run's record: after each step, each stream's steps since its
// last compaction (ListSequences' count); at each sample, the resident positions (ReadKV) and the
// share of full attention's mass that the next step's query puts on them, per (layer, KV head)
// averaged, beside the same number of newest positions.
class PolicyProbe : public StepObserver {
 public:
  PolicyProbe(const karakv::llama::Config& c, const FullCache& full, karakv::Client& client, int prompt,
              size_t streams)
      : c_(c), full_(full), client_(client), prompt_(prompt), last_(streams, -1), age_(streams) {}

  void after(int step, const std::vector<uint64_t>& seqs) override {
    std::map<uint64_t, karakv::SequenceInfo> info;
    for (auto& s : check(client_.ListSequences())) info[s.id] = s;
    for (size_t b = 0; b < seqs.size(); ++b) {
      const karakv::SequenceInfo& s = info.at(seqs[b]);
      if (compactions_.size() <= b) compactions_.resize(b + 1, 0);
      if (s.compactions > compactions_[b]) last_[b] = step;
      compactions_[b] = s.compactions;
      age_[b].push_back(last_[b] < 0 ? -1 : step - last_[b]);  // as seen by this step's successor
      if (step % kSampleEvery == kSampleEvery - 1 && last_[b] >= 0) sample(b, seqs[b], step, int(s.length));
    }
  }

  // Loss gap (nats) of each scored token predicted by decode step i (logp index i + 1), by the age
  // of the cache that step attended.
  ByAge loss_gap(const std::vector<std::vector<double>>& logp) const {
    ByAge out;
    for (size_t b = 0; b < logp.size(); ++b) {
      for (size_t i = 1; i < age_[b].size(); ++i) {
        const int age = age_[b][i - 1] < 0 ? -1 : age_[b][i - 1] + 1;
        if (age > 0 && i + 1 < logp[b].size()) out.add(age, full_.logp[b][i + 1] - logp[b][i + 1]);
      }
    }
    return out;
  }
  const ByAge& recall() const { return recall_; }
  const ByAge& recency() const { return recency_; }

 private:
  void sample(size_t b, uint64_t id, int step, int length) {
    auto q = full_.queries[b].find(step + 1);
    if (q == full_.queries[b].end()) return;
    const karakv::Geometry& g = client_.geometry();
    const int L = c_.n_layers, Hk = c_.n_kv_heads, Hq = c_.n_heads, D = c_.head_dim(), G = Hq / Hk;
    client_.reset_staging();
    const size_t kv_bytes = size_t(L) * length * Hk * D * karakv::kernels::dtype_size(g.dtype);
    auto kb = check(client_.alloc(kv_bytes)), vb = check(client_.alloc(kv_bytes));
    auto pb = check(client_.alloc(size_t(L) * Hk * length * 4));
    const int T = check(client_.ReadKV(id, kb, vb, pb));
    const auto positions = pb.as<int32_t>();
    const int pos = prompt_ + step + 1;  // the next query's position; its own key is always resident
    const float scale = 1.0f / std::sqrt(float(D));
    std::vector<double> p(pos + 1);
    std::vector<char> kept(pos + 1);
    double recall = 0, recent = 0;
    for (int l = 0; l < L; ++l) {
      const std::vector<float>& keys = full_.keys[b][l];
      for (int h = 0; h < Hk; ++h) {
        std::fill(kept.begin(), kept.end(), 0);
        kept[pos] = 1;
        int budget = 1;
        for (int t = 0; t < T; ++t) {
          const int x = positions[(size_t(l) * Hk + h) * T + t];
          if (x >= 0 && x < pos && !kept[x]) {
            kept[x] = 1;
            ++budget;
          }
        }
        for (int j = 0; j < G; ++j) {
          const float* qv = q->second.data() + (size_t(l) * Hq + h * G + j) * D;
          double mx = -INFINITY;
          for (int x = 0; x <= pos; ++x) {
            const float* kv = keys.data() + (size_t(x) * Hk + h) * D;
            double dot = 0;
            for (int d = 0; d < D; ++d) dot += double(qv[d]) * kv[d];
            p[x] = dot * scale;
            mx = std::max(mx, p[x]);
          }
          double z = 0, in_kept = 0, in_recent = 0;
          for (int x = 0; x <= pos; ++x) {
            p[x] = std::exp(p[x] - mx);
            z += p[x];
            if (kept[x]) in_kept += p[x];
            if (x > pos - budget) in_recent += p[x];
          }
          recall += in_kept / z;
          recent += in_recent / z;
        }
      }
    }
    const int age = step + 1 - last_[b];
    recall_.add(age, recall / (L * Hq));
    recency_.add(age, recent / (L * Hq));
  }

  const karakv::llama::Config& c_;
  const FullCache& full_;
  karakv::Client& client_;
  const int prompt_;
  std::vector<uint32_t> compactions_;
  std::vector<int> last_;                // step after which the last compaction was seen, -1: none yet
  std::vector<std::vector<int>> age_;    // per stream, per step: steps since that compaction, -1: none
  ByAge recall_, recency_;
};

PplResult perplexity(const Model& m, karakv::llama::Attention& att, karakv::Client* client, const PplTask& task,
                     const std::string& label, StepObserver* observer = nullptr) {
  const int n = int(task.streams.size());
  const int V = m.config.vocab_size;
  const auto t0 = Clock::now();
  Transformer tf(m, att);
  PplResult res;
  res.logp.resize(n);
  std::vector<uint64_t> seqs(n);
  std::vector<float> logits(size_t(n) * V);
  for (int b = 0; b < n; ++b) {
    seqs[b] = check(att.create_sequence());
    const std::vector<int>& s = task.streams[b];
    auto first = check(tf.prefill(seqs[b], std::span<const int>(s.data(), task.prompt)));
    res.logp[b].push_back(karakv::llama::log_prob(first, s[task.prompt]));
  }
  double resident_sum = 0;
  int samples = 0;
  std::vector<int> tok(n), pos(n);
  const int steps = task.fed - 1;
  for (int i = 0; i < steps; ++i) {
    const int t = task.prompt + i;
    for (int b = 0; b < n; ++b) {
      tok[b] = task.streams[b][t];
      pos[b] = t;
    }
    if (observer) observer->before(i);
    check(tf.decode(seqs, tok, pos, logits));
    if (observer) observer->after(i, seqs);
    for (int b = 0; b < n; ++b) {
      res.logp[b].push_back(karakv::llama::log_prob({&logits[size_t(b) * V], size_t(V)}, task.streams[b][t + 1]));
    }
    if (client && (i % 8 == 7 || i == steps - 1)) {
      resident_sum += residency(client).resident;
      ++samples;
    }
    if (i % 32 == 31 || i == steps - 1) progress(task.name + " ppl, " + label, i + 1, steps, t0);
  }
  for (const auto& lp : res.logp) {
    for (double x : lp) {
      res.nll -= x;
      ++res.scored;
    }
  }
  res.end = residency(client);
  res.resident_mean = samples ? resident_sum / samples : 0;
  for (uint64_t id : seqs) check(att.release(id));
  res.seconds = seconds_since(t0);
  return res;
}

struct GreedyResult {
  std::vector<std::vector<int>> outputs;  // per prompt
  Residency end;                          // before release
  double resident_mean = NAN;             // over every 8th step, the sequences still decoding
  double seconds = 0;
};

// All prompts together: every step feeds each unfinished sequence its next prompt token or its last
// greedy token; a sequence leaves the batch when it has `gen` tokens or (stop_at_control) emitted a
// control token.
GreedyResult greedy(const Model& m, karakv::llama::Attention& att, karakv::Client* client, const GreedyTask& task,
                    const std::string& label) {
  const int n = int(task.prompts.size());
  const int V = m.config.vocab_size;
  const auto t0 = Clock::now();
  Transformer tf(m, att);
  GreedyResult res;
  res.outputs.assign(n, {});
  std::vector<uint64_t> ids(n);
  std::vector<int> cursor(n), len(n);  // next prompt token to feed; tokens in the cache
  for (int b = 0; b < n; ++b) {
    ids[b] = check(att.create_sequence());
    const auto& p = task.prompts[b];
    auto logits = check(tf.prefill(ids[b], std::span<const int>(p.data(), task.appended[b])));
    cursor[b] = len[b] = task.appended[b];
    if (cursor[b] == int(p.size())) res.outputs[b].push_back(karakv::llama::sample(logits, 0, nullptr));
  }
  auto finished = [&](int b) {
    const auto& o = res.outputs[b];
    if (cursor[b] < int(task.prompts[b].size()) || o.empty()) return false;
    return int(o.size()) >= task.gen || (task.stop_at_control && m.bpe.is_control(o.back()));
  };
  double resident_sum = 0;
  int samples = 0;
  for (int step = 1;; ++step) {
    std::vector<uint64_t> seqs;
    std::vector<int> tok, pos, who;
    for (int b = 0; b < n; ++b) {
      if (finished(b)) continue;
      const bool feeding = cursor[b] < int(task.prompts[b].size());
      tok.push_back(feeding ? task.prompts[b][cursor[b]++] : res.outputs[b].back());
      pos.push_back(len[b]++);
      seqs.push_back(ids[b]);
      who.push_back(b);
    }
    if (seqs.empty()) break;
    std::vector<float> logits(seqs.size() * V);
    check(tf.decode(seqs, tok, pos, logits));
    for (size_t i = 0; i < who.size(); ++i) {
      const int b = who[i];
      // Logits after the last prompt token give the first greedy token; earlier ones are unused.
      if (cursor[b] == int(task.prompts[b].size())) {
        res.outputs[b].push_back(karakv::llama::sample({&logits[i * V], size_t(V)}, 0, nullptr));
      }
    }
    // Mean resident memory: every 8th step, the sequences that took part in it (a finished
    // sequence would be released by a server; here it waits for the end of the batch).
    if (client && step % 8 == 0) {
      std::map<uint64_t, uint32_t> length;
      for (const auto& s : check(client->ListSequences())) length[s.id] = s.length;
      for (uint64_t id : seqs) {
        resident_sum += length[id];
        ++samples;
      }
    }
    if (step % 32 == 0) {
      std::fprintf(stderr, "%s  %-40s step %4d, %2zu of %d decoding  %6.0f s%s", isatty(STDERR_FILENO) ? "\r" : "",
                   (task.name + " greedy, " + label).c_str(), step, seqs.size(), n, seconds_since(t0),
                   isatty(STDERR_FILENO) ? "" : "\n");
      std::fflush(stderr);
    }
  }
  if (isatty(STDERR_FILENO)) std::fprintf(stderr, "\n");
  res.end = residency(client);
  if (samples) res.resident_mean = resident_sum / samples;
  for (uint64_t id : ids) check(att.release(id));
  res.seconds = seconds_since(t0);
  return res;
}

// Long generation: `none` samples each prompt's continuation and keeps its distributions; every
// other policy teacher-forces those tokens and is compared with them.
struct LongGenTask {
  std::string name;
  std::vector<std::vector<int>> prompts;  // each by Append
  int gen = 0, bucket = 0;
  std::vector<int> banned;  // never sampled by none (control tokens); still scored
};

struct FidelityResult {
  std::vector<std::vector<int>> tokens;                              // per prompt: the trajectory
  std::vector<std::vector<karakv::llama::TopTokens>> dists;          // none only: per prompt, per position
  std::vector<double> kl, nll;                                       // per bucket: sums
  std::vector<long> top1, count;                                     // per bucket
  double none_rest_mass = 0;  // none only: mean mass outside its kept tokens
  Residency end;
  double resident_mean = 0;
  double seconds = 0;
};

// How much of a sampled continuation repeats itself: per bucket, the share of positions whose
// token ends an 8-token run that already occurred earlier in the same continuation (0 for text
// that never repeats a phrase of 8 tokens; near 1 for a loop).
std::vector<double> repeated_share(const std::vector<std::vector<int>>& outputs, int bucket) {
  constexpr int kRun = 8;
  std::vector<double> hits, count;
  for (const std::vector<int>& o : outputs) {
    std::set<std::vector<int>> seen;
    for (size_t i = 0; i < o.size(); ++i) {
      const size_t b = i / bucket;
      if (hits.size() <= b) hits.resize(b + 1, 0), count.resize(b + 1, 0);
      ++count[b];
      if (i + 1 < kRun) continue;
      std::vector<int> run(o.begin() + (i + 1 - kRun), o.begin() + (i + 1));
      if (!seen.insert(std::move(run)).second) ++hits[b];
    }
  }
  for (size_t b = 0; b < hits.size(); ++b) hits[b] = count[b] > 0 ? hits[b] / count[b] : 0;
  return hits;
}

// `none` == nullptr: generate (the none run). Position i of a prompt's output is predicted by the
// logits after the prompt and its first i output tokens.
FidelityResult fidelity(const Model& m, karakv::llama::Attention& att, karakv::Client* client, const LongGenTask& task,
                        const std::string& label, const FidelityResult* none) {
  const int n = int(task.prompts.size());
  const int V = m.config.vocab_size;
  const int buckets = (task.gen + task.bucket - 1) / task.bucket;
  const auto t0 = Clock::now();
  Transformer tf(m, att);
  FidelityResult res;
  res.tokens.assign(n, {});
  if (!none) res.dists.assign(n, {});
  res.kl.assign(buckets, 0);
  res.nll.assign(buckets, 0);
  res.top1.assign(buckets, 0);
  res.count.assign(buckets, 0);
  std::vector<uint64_t> seqs(n), rng(n);
  std::vector<float> logits(size_t(n) * V);
  for (int b = 0; b < n; ++b) {
    seqs[b] = check(att.create_sequence());
    rng[b] = absl::GetFlag(FLAGS_seed) * 1000003 + b;
    auto first = check(tf.prefill(seqs[b], task.prompts[b]));
    std::copy(first.begin(), first.end(), logits.begin() + size_t(b) * V);
  }
  const float temperature = float(absl::GetFlag(FLAGS_longgen_temperature));
  const float top_p = float(absl::GetFlag(FLAGS_longgen_top_p));
  const int kept = absl::GetFlag(FLAGS_longgen_kept);
  double resident_sum = 0, rest_mass = 0;
  int samples = 0;
  std::vector<int> tok(n), pos(n);
  for (int i = 0; i < task.gen; ++i) {
    const int bucket = i / task.bucket;
    for (int b = 0; b < n; ++b) {
      const std::span<const float> l(&logits[size_t(b) * V], size_t(V));
      if (!none) {
        res.dists[b].push_back(karakv::llama::top_tokens(l, kept));
        rest_mass += std::exp(res.dists[b].back().rest_logp);
        tok[b] = karakv::llama::sample_top_p(l, temperature, top_p, task.banned, &rng[b]);
      } else {
        const karakv::llama::TopTokens& p = none->dists[b][i];
        tok[b] = none->tokens[b][i];
        res.kl[bucket] += karakv::llama::kl_divergence(p, l);
        res.top1[bucket] += karakv::llama::sample(l, 0, nullptr) == p.ids[0];
      }
      if (!none) ++res.top1[bucket];  // none agrees with itself; its KL is 0
      res.nll[bucket] -= karakv::llama::log_prob(l, tok[b]);
      ++res.count[bucket];
      res.tokens[b].push_back(tok[b]);
      pos[b] = int(task.prompts[b].size()) + i;
    }
    if (i == task.gen - 1) break;
    check(tf.decode(seqs, tok, pos, logits));
    if (client && (i % 8 == 7 || i == task.gen - 2)) {
      resident_sum += residency(client).resident;
      ++samples;
    }
    if (i % 32 == 31 || i == task.gen - 2) progress(task.name + " " + label, i + 1, task.gen - 1, t0);
  }
  res.none_rest_mass = none ? 0 : rest_mass / (double(n) * task.gen);
  res.end = residency(client);
  res.resident_mean = samples ? resident_sum / samples : 0;
  for (uint64_t id : seqs) check(att.release(id));
  res.seconds = seconds_since(t0);
  return res;
}

// ---- Policies -------------------------------------------------------------------------------

struct PolicySpec {
  std::string label;
  karakv::SequenceOptions options;
  bool matched = false;    // a threshold baseline sized from a Kara run's memory
  std::string sized_from = "kara-0.25";  // that run's label
};

// The shape of one sequence of a task, for sizing a threshold baseline to a mean memory: its
// prompt, its decode steps, and whether the harness also samples its last step.
struct Shape {
  int prompt = 0, steps = 0;
  bool sample_last = false;
};

// The resident length a threshold policy's sequence has after each decode step: P tokens of prompt,
// one more per step, back to c_target whenever a step brings it to c_max. Its mean over the steps
// the harness samples (every 8th, and the last where the shape says so), over every sequence.
double threshold_mean_resident(const std::vector<Shape>& shapes, int c_max, int c_target) {
  double sum = 0;
  int samples = 0;
  for (const Shape& sh : shapes) {
    int length = sh.prompt;
    for (int i = 0; i < sh.steps; ++i) {
      if (++length >= c_max) length = c_target;
      if (i % 8 == 7 || (sh.sample_last && i == sh.steps - 1)) {
        sum += length;
        ++samples;
      }
    }
  }
  return samples ? sum / samples : 0;
}

// c_target and c_max (c_max = c_target + 2 * max(8, c_target / 32), as the end-matched sizing)
// whose mean resident length over `shapes` is closest to `mean` (section 4: within one block).
std::pair<int, int> match_mean(double mean, const std::vector<Shape>& shapes) {
  auto gap = [](int target) { return 2 * std::max(8, int(std::lround(target / 32.0))); };
  int longest = 16;
  for (const Shape& sh : shapes) longest = std::max(longest, sh.prompt + sh.steps);
  int best = 16;
  double best_err = INFINITY;
  for (int target = 16; target <= longest; ++target) {
    const double err = std::abs(threshold_mean_resident(shapes, target + gap(target), target) - mean);
    if (err < best_err) {
      best_err = err;
      best = target;
    }
  }
  return {best + gap(best), best};
}

// --kara_points: none, then each Kara point followed by the baselines sized to its memory.
std::vector<PolicySpec> ablation_policies(int window, int period) {
  std::vector<PolicySpec> out;
  if (absl::GetFlag(FLAGS_ablation_none)) out.push_back(PolicySpec{"none", {}});
  std::vector<std::string> baselines = absl::StrSplit(absl::GetFlag(FLAGS_baselines), ',', absl::SkipEmpty());
  for (absl::string_view point : absl::StrSplit(absl::GetFlag(FLAGS_kara_points), ';', absl::SkipEmpty())) {
    const std::vector<std::string> parts = absl::StrSplit(point, absl::MaxSplits('=', 1));
    if (parts.size() != 2 || parts[0].empty()) die("--kara_points: expected LABEL=name:value,..., got " + std::string(point));
    PolicySpec kara{parts[0], {}};
    kara.options.policy = "kara";
    kara.options.params = {{"window", window}, {"period", period}};
    for (absl::string_view kv : absl::StrSplit(parts[1], ',', absl::SkipEmpty())) {
      const std::vector<std::string> nv = absl::StrSplit(kv, ':');
      double value = 0;
      if (nv.size() != 2 || !absl::SimpleAtod(nv[1], &value)) {
        die("--kara_points: expected name:value in point " + parts[0] + ", got " + std::string(kv));
      }
      kara.options.params[nv[0]] = value;
    }
    out.push_back(kara);
    for (const std::string& name : baselines) {
      PolicySpec b{parts[0] == "kara" ? name : name + "@" + parts[0], {}, true, parts[0]};
      b.options.policy = name;
      out.push_back(b);
    }
    if (parts[0] == "kara" && absl::GetFlag(FLAGS_kara_cam)) {
      PolicySpec cam = kara;
      cam.label = "kara+cam";
      cam.options.params["cam"] = 1;
      out.push_back(cam);
    }
  }
  return out;
}

// "name=value ..." then "storage=...", or "-".
template <typename Params>
std::string params_text(const Params& params, const std::string& storage) {
  std::vector<std::string> parts;
  for (const auto& [k, v] : params) parts.push_back(absl::StrFormat("%s=%g", k, v));
  if (!storage.empty()) parts.push_back("storage=" + storage);
  return parts.empty() ? "-" : absl::StrJoin(parts, " ");
}

// The CSV's params: as the daemon resolved them where the run saw a sequence (every default filled
// in, so a row of the defaults says which defaults), else as given.
std::string params_text(const karakv::SequenceOptions& o, const Residency& end) {
  return end.listed ? params_text(end.params, o.storage) : params_text(o.params, o.storage);
}

// Every policy and format of the comparison, in run order: none first (the baseline of agreement),
// then Kara (rho=0.25 sizes the matched baselines), then the rest.
std::vector<PolicySpec> all_policies(int window, int period) {
  auto kara = [&](double rho, const std::string& storage = "", bool cam = false) {
    karakv::SequenceOptions o;
    o.policy = "kara";
    o.storage = storage;
    // Version 2's windows with the prompt kept, as these rows always ran, labelled by the share of
    // each window they keep (the default budget would make rho moot, and prompt = auto would window
    // the prompt; --kara_points compares the defaults).
    o.params = {{"window", window}, {"period", period}, {"rho", rho}, {"budget", 0}, {"prompt", 0}};
    if (cam) o.params["cam"] = 1;
    std::string label = absl::StrFormat("kara-%.2f", rho);
    if (!storage.empty()) label += "+" + storage;
    if (cam) label += "+cam";
    return PolicySpec{label, o};
  };
  auto threshold = [](const std::string& name, bool cam = false) {
    PolicySpec s{name + (cam ? "+cam" : ""), {}, true};
    s.options.policy = name;
    if (cam) s.options.params["cam"] = 1;
    return s;
  };
  auto format = [](const std::string& storage) {
    PolicySpec s{storage, {}};
    s.options.storage = storage;
    return s;
  };
  // The goals first (Kara vs the eviction baselines, KIVI-4 and TurboQuant-4), so that a run cut
  // short still answers them.
  return {PolicySpec{"none", {}}, kara(0.5),          kara(0.25),         threshold("snapkv"),
          threshold("streaming"), threshold("h2o"),   format("kivi4"),    format("tq4"),
          threshold("chunkkv"),   kara(0.25, "kivi4"), format("kivi2"),   format("tq2"),
          format("tq3"),          kara(0.25, "", true), threshold("snapkv", true)};
}

struct Row {
  std::string task, kind, label, params;
  int sequences = 0, scored = 0;
  double ppl = NAN, vs_none = NAN, dlogp = NAN;
  Residency end;
  double resident_mean = NAN;
  double agree = NAN, prefix = NAN;
  double seconds = 0;
  std::string positions = "all";  // long generation: a bucket's positions, e.g. 512-1023
  double kl = NAN;
};

double ratio_vs_fp16(const Residency& r) { return r.kv_bytes > 0 ? r.fp16_bytes / r.kv_bytes : NAN; }

void write_row(std::FILE* csv, const Row& r) {
  auto num = [](double x, const char* fmt) { return std::isnan(x) ? std::string() : absl::StrFormat(fmt, x); };
  std::fprintf(csv, "%s,%s,%s,%s,%d,%d,%s,%s,%.1f,%s,%.1f,%.4f,%s,%s,%s,%s,%.1f,%s,%s\n", r.task.c_str(),
               r.kind.c_str(), r.label.c_str(), r.params.c_str(), r.sequences, r.scored, num(r.ppl, "%.6f").c_str(),
               num(r.vs_none, "%.4f").c_str(), r.end.resident, num(r.resident_mean, "%.2f").c_str(), r.end.logical,
               r.end.kv_bytes / (1 << 20), num(ratio_vs_fp16(r.end), "%.3f").c_str(), num(r.agree, "%.4f").c_str(),
               num(r.prefix, "%.2f").c_str(), num(r.dlogp, "%.3g").c_str(), r.seconds, r.positions.c_str(),
               num(r.kl, "%.6g").c_str());
  std::fflush(csv);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "llama_quality: perplexity and greedy agreement of a real model under each KV policy and format, "
      "with its cache in karakvd");
  absl::ParseCommandLine(argc, argv);
  const bool quick = absl::GetFlag(FLAGS_quick);
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (absl::GetFlag(FLAGS_block_size) < 0) {
    die(absl::StrFormat("--block_size=%d: expected tokens per block >= 1, or 0 for karakvd's default",
                        absl::GetFlag(FLAGS_block_size)));
  }
  const Model model = check(karakv::llama::load_model(absl::GetFlag(FLAGS_model)));
  const Config& c = model.config;
  const bool bpe = model.is_bpe();
  auto pick = [&](int flag, int stories, int bpe_default, int quick_value) {
    if (flag > 0) return flag;
    if (quick) return quick_value;
    return bpe ? bpe_default : stories;
  };
  const int streams = pick(absl::GetFlag(FLAGS_streams), 8, 2, bpe ? 1 : 2);
  const int P = pick(absl::GetFlag(FLAGS_prompt_tokens), 128, 512, bpe ? 256 : 128);
  const int F = pick(absl::GetFlag(FLAGS_fed_tokens), 384, 2048, bpe ? 384 : 384);
  const int G = pick(absl::GetFlag(FLAGS_gen_tokens), 128, 256, bpe ? 96 : 128);
  const int n_prompts = quick ? 4 : absl::GetFlag(FLAGS_prompts);
  if (P + F > c.max_seq_len) die(absl::StrFormat("prompt %d + fed %d exceeds the model's context %d", P, F, c.max_seq_len));
  std::set<std::string> only, tasks;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_only), ',', absl::SkipEmpty())) only.insert(std::string(s));
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_tasks), ',', absl::SkipEmpty())) tasks.insert(std::string(s));
  if (quick && only.empty()) only = {"none", "kara-0.50", "kara-0.25", "snapkv", "kivi4"};
  auto wanted_task = [&](const std::string& name) { return tasks.empty() || tasks.count(name); };

  // Kara's window by task length: the defaults (W=128, P=16) for the 2048-token run; W=64, P=8 for
  // the few hundred decoded tokens of the other tasks (a 128-window would compress once or twice).
  const bool long_run = F >= 1024;

  std::vector<PplTask> ppl_tasks;
  std::optional<GreedyTask> greedy_task;
  std::optional<LongGenTask> longgen_task;
  const int N = pick(absl::GetFlag(FLAGS_longgen_tokens), 448, 2048, bpe ? 512 : 384);
  const int bucket = pick(absl::GetFlag(FLAGS_longgen_bucket), 64, 512, bpe ? 128 : 64);
  const auto prep0 = Clock::now();
  if (!bpe) {
    std::vector<std::vector<int>> stories = sample_stories(model, streams, P + F, absl::GetFlag(FLAGS_seed));
    if (wanted_task("stories")) ppl_tasks.push_back({"stories", stories, P, F});
    if (!quick && !absl::GetFlag(FLAGS_text).empty() && wanted_task("shakespeare")) {
      ppl_tasks.push_back({"shakespeare", text_windows(model, absl::GetFlag(FLAGS_text), streams, P + F), P, F});
    }
    if (wanted_task("stories-greedy")) {
      GreedyTask g{"stories-greedy", {}, {}, G, false};
      const int context = std::min(P + 256, P + F);
      for (const auto& s : stories) {
        g.prompts.emplace_back(s.begin(), s.begin() + context);
        g.appended.push_back(P);
      }
      greedy_task = std::move(g);
    }
    if (wanted_task("longgen")) {
      LongGenTask g{"longgen", {}, N, bucket, {}};
      for (const auto& s : stories) g.prompts.emplace_back(s.begin(), s.begin() + std::min<size_t>(8, s.size()));
      longgen_task = std::move(g);
    }
  } else {
    if (!absl::GetFlag(FLAGS_text).empty() && wanted_task("shakespeare")) {
      ppl_tasks.push_back({"shakespeare", text_windows(model, absl::GetFlag(FLAGS_text), streams, P + F), P, F});
    }
    for (absl::string_view genre : absl::StrSplit(absl::GetFlag(FLAGS_genres), ',', absl::SkipEmpty())) {
      const std::pair<std::string, std::string> name_path = absl::StrSplit(genre, absl::MaxSplits('=', 1));
      if (name_path.first.empty() || name_path.second.empty()) {
        die(absl::StrCat("--genres: '", genre, "' is not NAME=PATH"));
      }
      if (wanted_task(name_path.first)) {
        ppl_tasks.push_back({name_path.first, text_windows(model, name_path.second, streams, P + F), P, F});
      }
    }
    if (!absl::GetFlag(FLAGS_gsm8k).empty() && wanted_task("gsm8k")) {
      GreedyTask g{"gsm8k", {}, {}, G, true};
      for (const std::string& q : gsm8k_questions(absl::GetFlag(FLAGS_gsm8k), n_prompts)) {
        g.prompts.push_back(model.bpe.encode(karakv::llama::chat_prompt(karakv::llama::kSmolLM2System, q)));
        g.appended.push_back(int(g.prompts.back().size()));
      }
      greedy_task = std::move(g);
    }
    if (!absl::GetFlag(FLAGS_longgen).empty() && wanted_task("longgen")) {
      LongGenTask g{"longgen", {}, N, bucket, {}};
      for (absl::string_view line : absl::StrSplit(read_file(absl::GetFlag(FLAGS_longgen)), '\n', absl::SkipWhitespace())) {
        g.prompts.push_back(
            model.bpe.encode(karakv::llama::chat_prompt(karakv::llama::kSmolLM2System, std::string(line))));
        if (quick && g.prompts.size() == 2) break;
      }
      if (g.prompts.empty()) die(absl::GetFlag(FLAGS_longgen) + ": no prompts (one per line)");
      for (int id = 0; id < c.vocab_size; ++id) {
        if (model.bpe.is_control(id)) g.banned.push_back(id);
      }
      longgen_task = std::move(g);
    }
  }
  if (longgen_task) {
    size_t longest = 0;
    for (const auto& p : longgen_task->prompts) longest = std::max(longest, p.size());
    if (int(longest) + N > c.max_seq_len) {
      die(absl::StrFormat("long generation: prompt %zu + %d tokens exceeds the model's context %d", longest, N,
                          c.max_seq_len));
    }
    if (bucket < 1) die("--longgen_bucket must be at least 1");
  }
  std::fprintf(stderr, "prepared the tasks in %.1f s\n", seconds_since(prep0));

  std::FILE* csv = std::fopen(absl::GetFlag(FLAGS_csv).c_str(), "w");
  if (!csv) die("cannot write " + absl::GetFlag(FLAGS_csv));
  std::fprintf(csv,
               "task,kind,policy,params,sequences,scored_tokens,perplexity,ppl_vs_none_pct,resident_final,"
               "resident_mean,logical_final,kv_mib_final,ratio_vs_fp16,greedy_agreement,mean_common_prefix,"
               "max_abs_dlogp_vs_dense,seconds,positions,kl_vs_none\n");
  std::printf("llama_quality: %s (%d layers, %d/%d heads, head dim %d), dtype %s\n", absl::GetFlag(FLAGS_model).c_str(),
              c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim(), dtype.c_str());

  // Pool: room for every sequence of a task uncompressed at the storage dtype, twice over.
  const size_t dtype_bytes = dtype == "fp32" ? 4 : 2;
  const size_t token_bytes = size_t(c.n_layers) * c.kv_dim() * 2 * dtype_bytes;
  auto pool_mib = [&](size_t sequences, size_t tokens) {
    return std::max<size_t>(64, 2 * sequences * (tokens + 64) * token_bytes / (1 << 20) + 16);
  };

  // One task over every policy, each on a fresh daemon: `run_task(attention, client, label)` runs
  // it, `report(spec, result)` prints and records it and returns the final resident length.
  // One task over every policy, each on a fresh daemon: `run_task(attention, client, label)` runs
  // it, `report(spec, result)` prints and records it and returns the final and the mean resident
  // length (NaN where the task does not sample it). A matched baseline is sized from its Kara run:
  // to the same mean memory when the task has it (`prompt`, `steps`: the task's shape), else to the
  // same end memory.
  auto sweep = [&](int window, int period, size_t pool, auto&& shapes, auto&& run_task, auto&& report) {
    const bool ablation = !absl::GetFlag(FLAGS_kara_points).empty();
    std::vector<PolicySpec> specs = ablation ? ablation_policies(window, period) : all_policies(window, period);
    std::map<std::string, std::pair<double, double>> memory;  // label -> (final, mean) resident
    for (PolicySpec spec : specs) {
      if (!ablation && !only.empty() && !only.count(spec.label) && spec.label != "none") continue;
      if (spec.matched) {
        auto it = memory.find(spec.sized_from);
        if (it == memory.end()) {
          std::fprintf(stderr, "  %s: skipped (sized from %s, which did not run)\n", spec.label.c_str(),
                       spec.sized_from.c_str());
          continue;
        }
        const auto [final_resident, mean_resident] = it->second;
        if (!std::isnan(mean_resident)) {
          const auto [c_max, c_target] = match_mean(mean_resident, shapes());
          spec.options.params["c_target"] = c_target;
          spec.options.params["c_max"] = c_max;
        } else {
          // Between compactions a threshold policy holds c_target..c_max tokens: centred on the
          // Kara run's resident length R at the end of the run, the same memory.
          const double R = std::round(final_resident);
          const double half = std::max(8.0, std::round(R / 32));
          spec.options.params["c_target"] = R - half;
          spec.options.params["c_max"] = R + half;
        }
      }
      Daemon daemon(absl::GetFlag(FLAGS_karakvd), c, dtype, pool);
      auto client = check(karakv::Client::Attach(daemon.options()));
      check(karakv::llama::DaemonAttention::check_geometry(*client, c));
      karakv::llama::DaemonAttention att(*client, spec.options);
      // A format the model's geometry cannot hold (KIVI needs head_dim % 32 == 0) is reported
      // and skipped, not run.
      if (auto probe = att.create_sequence(); !probe.ok()) {
        std::printf("%-16s skipped: %s\n", spec.label.c_str(), std::string(probe.status().message()).c_str());
        continue;
      } else {
        check(att.release(*probe));
      }
      memory[spec.label] = report(spec, run_task(att, client.get(), spec.label));
    }
  };

  // --diagnostics: the none run's record, and the file each compressing run's rows go to.
  FullCache full;
  std::FILE* diag = nullptr;
  if (const std::string path = absl::GetFlag(FLAGS_diagnostics); !path.empty()) {
    diag = std::fopen(path.c_str(), "w");
    if (!diag) die("cannot write " + path);
    std::fprintf(diag, "task,policy,measure,steps_since_compaction,count,mean\n");
  }
  for (const PplTask& task : ppl_tasks) {
    std::printf("\n[%s] perplexity: %zu streams, prompt %d by Append + %d tokens by Step, all %d scored\n",
                task.name.c_str(), task.streams.size(), task.prompt, task.fed - 1, task.fed);
    std::printf("%-16s %-36s %10s %8s %9s %9s %8s %8s %7s\n", "policy", "params", "perplexity", "vs none", "resident",
                "mean res", "logical", "KV MiB", "ratio");
    std::optional<PplResult> ref;
    if (absl::GetFlag(FLAGS_reference)) {
      karakv::llama::DenseAttention dense(c, dtype);
      ref = perplexity(model, dense, nullptr, task, "dense reference");
      std::printf("%-16s %-36s %10.4f   (in process, no daemon)\n", "dense-ref", "-", std::exp(ref->nll / ref->scored));
    }
    double none_ppl = 0;
    const int window = long_run ? 128 : 64, period = long_run ? 16 : 8;
    sweep(
        window, period, pool_mib(task.streams.size(), task.prompt + task.fed),
        [&] { return std::vector<Shape>(task.streams.size(), Shape{task.prompt, task.fed - 1, true}); },
        [&](karakv::llama::Attention& att, karakv::Client* client, const std::string& label) {
          if (!diag) return perplexity(model, att, client, task, label);
          if (label == "none") {
            full = FullCache{};
            RecordingAttention recorder(att, c, full);
            PplResult r = perplexity(model, recorder, client, task, label, &recorder);
            full.logp = r.logp;
            return r;
          }
          if (full.keys.empty()) return perplexity(model, att, client, task, label);  // none did not run
          PolicyProbe probe(c, full, *client, task.prompt, task.streams.size());
          PplResult r = perplexity(model, att, client, task, label, &probe);
          const ByAge gap = probe.loss_gap(r.logp);
          for (const auto& [measure, by] : {std::pair<const char*, const ByAge*>{"loss_gap_nats", &gap},
                                            {"attention_recall", &probe.recall()},
                                            {"attention_recall_recency", &probe.recency()}}) {
            for (int a = 0; a < ByAge::kBuckets; ++a) {
              if (by->count[a] == 0) continue;
              std::fprintf(diag, "%s,%s,%s,%s,%ld,%.6f\n", task.name.c_str(), label.c_str(), measure,
                           ByAge::label(a).c_str(), by->count[a], by->sum[a] / by->count[a]);
            }
          }
          std::fflush(diag);
          return r;
        },
        [&](const PolicySpec& spec, const PplResult& r) {
          Row row{task.name, "perplexity", spec.label, params_text(spec.options, r.end), int(task.streams.size()),
                  r.scored, NAN, NAN, NAN, {}};
          row.ppl = std::exp(r.nll / r.scored);
          if (spec.label == "none") none_ppl = row.ppl;
          row.vs_none = none_ppl > 0 ? 100.0 * (row.ppl / none_ppl - 1) : NAN;
          row.end = r.end;
          row.resident_mean = r.resident_mean;
          row.seconds = r.seconds;
          if (ref) {
            row.dlogp = 0;
            for (size_t b = 0; b < r.logp.size(); ++b)
              for (size_t i = 0; i < r.logp[b].size(); ++i)
                row.dlogp = std::max(row.dlogp, std::abs(r.logp[b][i] - ref->logp[b][i]));
          }
          std::printf("%-16s %-36s %10.4f %+7.2f%% %9.1f %9.1f %8.1f %8.2f %6.2fx\n", spec.label.c_str(),
                      row.params.c_str(), row.ppl, row.vs_none, r.end.resident, r.resident_mean, r.end.logical,
                      r.end.kv_bytes / (1 << 20), ratio_vs_fp16(r.end));
          std::fflush(stdout);
          write_row(csv, row);
          return std::make_pair(r.end.resident, r.resident_mean);
        });
  }

  if (greedy_task) {
    const GreedyTask& task = *greedy_task;
    size_t longest = 0;
    for (const auto& p : task.prompts) longest = std::max(longest, p.size());
    std::printf("\n[%s] greedy agreement with none: %zu prompts, up to %d greedy tokens%s\n", task.name.c_str(),
                task.prompts.size(), task.gen, task.stop_at_control ? " (stopping at <|im_end|>)" : "");
    std::printf("%-16s %-36s %9s %9s %8s %8s %8s %7s\n", "policy", "params", "agreement", "prefix", "resident",
                "mean res", "logical", "ratio");
    std::vector<std::vector<int>> base;
    sweep(
        64, 8, pool_mib(task.prompts.size(), longest + task.gen),
        [&] {  // each prompt's appended length and the steps it took in the none run (the rest of
               // its prompt, then one step per greedy token after the first)
          std::vector<Shape> out;
          for (size_t b = 0; b < base.size(); ++b) {
            const int fed = int(task.prompts[b].size()) - task.appended[b];
            out.push_back(Shape{task.appended[b], fed + std::max(0, int(base[b].size()) - 1), false});
          }
          return out;
        },
        [&](karakv::llama::Attention& att, karakv::Client* client, const std::string& label) {
          return greedy(model, att, client, task, label);
        },
        [&](const PolicySpec& spec, const GreedyResult& r) {
          if (spec.label == "none") base = r.outputs;
          if (base.size() != r.outputs.size()) die("greedy agreement needs the none run first (--ablation_none)");
          Row row{task.name, "greedy", spec.label, params_text(spec.options, r.end), int(task.prompts.size()), 0,
                  NAN, NAN, NAN, {}};
          double agree = 0, prefix = 0;
          for (size_t b = 0; b < r.outputs.size(); ++b) {
            const auto &x = r.outputs[b], &y = base[b];
            const size_t common = std::min(x.size(), y.size());
            size_t same = 0, pre = 0;
            bool diverged = false;
            for (size_t i = 0; i < common; ++i) {
              same += x[i] == y[i];
              diverged = diverged || x[i] != y[i];
              pre += !diverged;
            }
            agree += double(same) / std::max<size_t>(1, std::max(x.size(), y.size()));
            prefix += double(pre);
            row.scored += int(x.size());
          }
          row.agree = agree / r.outputs.size();
          row.prefix = prefix / r.outputs.size();
          row.end = r.end;
          row.seconds = r.seconds;
          std::printf("%-16s %-36s %8.1f%% %9.1f %8.1f %8.1f %8.1f %6.2fx\n", spec.label.c_str(), row.params.c_str(),
                      100 * row.agree, row.prefix, r.end.resident, r.resident_mean, r.end.logical, ratio_vs_fp16(r.end));
          std::fflush(stdout);
          row.resident_mean = r.resident_mean;
          write_row(csv, row);
          return std::make_pair(r.end.resident, r.resident_mean);
        });
  }
  if (longgen_task) {
    const LongGenTask& task = *longgen_task;
    size_t longest = 0;
    for (const auto& p : task.prompts) longest = std::max(longest, p.size());
    const int buckets = (task.gen + task.bucket - 1) / task.bucket;
    auto bucket_label = [&](int k) {
      return absl::StrCat(k * task.bucket, "-", std::min(task.gen, (k + 1) * task.bucket) - 1);
    };
    std::printf("\n[%s] long-generation fidelity: %zu prompts, none samples %d tokens each (temperature %g, "
                "top-p %g), every policy teacher-forces them; KL(none || policy) in nats and top-1 agreement per "
                "position\n",
                task.name.c_str(), task.prompts.size(), task.gen, absl::GetFlag(FLAGS_longgen_temperature),
                absl::GetFlag(FLAGS_longgen_top_p));
    std::printf("%-16s %-36s %9s %7s %8s %9s", "policy", "params", "KL", "top-1", "ppl", "mean res");
    for (int k = 0; k < buckets; ++k) std::printf(" %14s", ("KL " + bucket_label(k)).c_str());
    std::printf("\n");
    std::optional<FidelityResult> base;
    const int window = task.gen >= 1024 ? 128 : 64, period = task.gen >= 1024 ? 16 : 8;
    sweep(
        window, period, pool_mib(task.prompts.size(), longest + task.gen),
        [&] {
          std::vector<Shape> out;
          for (const auto& p : task.prompts) out.push_back(Shape{int(p.size()), task.gen - 1, true});
          return out;
        },
        [&](karakv::llama::Attention& att, karakv::Client* client, const std::string& label) {
          if (label != "none" && !base) die("long generation needs the none run first (--ablation_none)");
          return fidelity(model, att, client, task, label, label == "none" ? nullptr : &*base);
        },
        [&](const PolicySpec& spec, FidelityResult&& r) {
          if (spec.label == "none") {
            base = std::move(r);
            std::printf("  (none's %d likeliest tokens hold all but %.2e of its mass on average)\n",
                        absl::GetFlag(FLAGS_longgen_kept), base->none_rest_mass);
            std::printf("  (none's continuations repeat an earlier 8-token run at");
            const std::vector<double> rep = repeated_share(base->tokens, task.bucket);
            for (size_t k = 0; k < rep.size(); ++k) {
              std::printf("%s %.0f%% of positions %s", k ? "," : "", 100 * rep[k], bucket_label(int(k)).c_str());
            }
            std::printf(")\n");
            if (const std::string path = absl::GetFlag(FLAGS_longgen_texts); !path.empty()) {
              std::ofstream out(path);
              for (size_t b = 0; b < base->tokens.size(); ++b) {
                out << "===== prompt " << b + 1 << " =====\n"
                    << (bpe ? model.bpe.decode(base->tokens[b]) : model.tokenizer.decode(base->tokens[b])) << "\n";
              }
              if (!out) die("cannot write " + path);
            }
          }
          const FidelityResult& x = spec.label == "none" ? *base : r;
          auto row_for = [&](const std::string& positions, double kl, double nll, long top1, long count) {
            Row row{task.name, "fidelity", spec.label, params_text(spec.options, r.end), int(task.prompts.size()),
                    int(count),
                    std::exp(nll / count), NAN, NAN, {}};
            row.positions = positions;
            row.kl = kl / count;
            row.agree = double(top1) / count;
            row.end = x.end;
            row.resident_mean = x.resident_mean;
            row.seconds = x.seconds;
            return row;
          };
          double kl = 0, nll = 0;
          long top1 = 0, count = 0;
          for (int k = 0; k < buckets; ++k) {
            kl += x.kl[k];
            nll += x.nll[k];
            top1 += x.top1[k];
            count += x.count[k];
          }
          Row all = row_for("all", kl, nll, top1, count);
          std::printf("%-16s %-36s %9.5f %6.2f%% %8.4f %9.1f", spec.label.c_str(), all.params.c_str(), all.kl,
                      100 * all.agree, all.ppl, x.resident_mean);
          write_row(csv, all);
          for (int k = 0; k < buckets; ++k) {
            Row b = row_for(bucket_label(k), x.kl[k], x.nll[k], x.top1[k], x.count[k]);
            std::printf(" %8.5f %4.1f%%", b.kl, 100 * b.agree);
            write_row(csv, b);
          }
          std::printf("\n");
          std::fflush(stdout);
          return std::make_pair(x.end.resident, x.resident_mean);
        });
  }
  std::fclose(csv);
  std::printf("\nwrote %s\n", absl::GetFlag(FLAGS_csv).c_str());
  if (diag) {
    std::fclose(diag);
    std::printf("wrote %s\n", absl::GetFlag(FLAGS_diagnostics).c_str());
  }
  return 0;
}
