// llama_quality: what KV compression costs a real model. For each policy, on a fresh karakvd per
// policy (so Kara's global tick counter starts at 0 every time):
//   perplexity: a 128-token prompt goes in by Append, then the next 384 held-out tokens are fed one
//     at a time through Step, each scored by the logits before it (384 predictions per stream);
//   agreement: 384 tokens of the same text as context (128 Append + 256 Step), then 128 greedy
//     tokens, compared position by position with the uncompressed run.
// Held-out text: "stories" are the model's own samples at temperature 1 (in-distribution for a
// TinyStories model; cross-entropy on them = the full model's entropy + KL(full || compressed), so
// the perplexity gap measures exactly how far compression moves the model), and "shakespeare"
// windows of ../shared/data/tinyshakespeare.txt (natural text the model never saw).
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "karakv/client.h"
#include "llama/daemon_attention.h"
#include "llama/model.h"

ABSL_FLAG(std::string, model, "../shared/data/stories260k.bin", "Model file (stories260K format)");
ABSL_FLAG(std::string, shakespeare, "../shared/data/tinyshakespeare.txt",
          "Natural text for a second perplexity source (empty: skip)");
ABSL_FLAG(std::string, karakvd, KARAKVD_DEFAULT_PATH, "karakvd binary; one is started per policy");
ABSL_FLAG(std::string, dtype, "fp32", "Storage dtype of the daemons: fp32 | fp16 | bf16");
ABSL_FLAG(int, streams, 8, "Held-out streams per text source (decoded together as one batch)");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the self-generated stories");
ABSL_FLAG(bool, quick, false, "2 streams per source, stories only");
ABSL_FLAG(std::string, csv, "quality.csv", "Where to write the results as CSV");
ABSL_FLAG(std::string, only, "", "Comma-separated policy labels to run (default: all)");

namespace {

using karakv::llama::Config;
using karakv::llama::Model;
using karakv::llama::Transformer;
using Clock = std::chrono::steady_clock;

constexpr int kContext = 512;
constexpr int kPrompt = 128;        // appended with Append
constexpr int kAgreeContext = 384;  // context before the greedy continuation
constexpr int kGreedy = 128;

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

// A karakvd for one policy, on its own socket, stopped with SIGTERM.
class Daemon {
 public:
  Daemon(const std::string& binary, const Config& c, const std::string& dtype) {
    socket_ = absl::StrCat("/tmp/karakv-quality-", getpid(), "-", counter_++, ".sock");
    std::vector<std::string> args = {binary,
                                     "--socket=" + socket_,
                                     absl::StrCat("--layers=", c.n_layers),
                                     absl::StrCat("--q_heads=", c.n_heads),
                                     absl::StrCat("--kv_heads=", c.n_kv_heads),
                                     absl::StrCat("--head_dim=", c.head_dim()),
                                     "--dtype=" + dtype,
                                     "--pool_bytes=256MiB",
                                     "--log_level=warn",
                                     "--threads=1"};
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the harness
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    for (int i = 0; i < 200; ++i) {
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
    o.staging_bytes = 16 << 20;
    return o;
  }

 private:
  static inline int counter_ = 0;
  std::string socket_;
  pid_t pid_ = -1;
};

struct Source {
  std::string name;
  std::vector<std::vector<int>> streams;  // each kContext tokens, starting with BOS
};

// The model's own text: temperature-1 samples from BOS with the dense reference, crossing story
// boundaries (BOS) as the TinyStories training stream does.
Source sample_stories(const Model& m, int n, uint64_t seed) {
  karakv::llama::DenseAttention dense(m.config);
  Transformer tf(m, dense);
  Source src{"stories", std::vector<std::vector<int>>(n)};
  std::vector<uint64_t> seqs(n), rng(n);
  std::vector<int> next(n), pos(n, 1);
  for (int b = 0; b < n; ++b) {
    seqs[b] = check(dense.create_sequence());
    rng[b] = seed * 1000003 + b;
    src.streams[b] = {karakv::llama::Tokenizer::kBos};
    next[b] = karakv::llama::sample(check(tf.prefill(seqs[b], src.streams[b])), 1.0f, &rng[b]);
  }
  std::vector<float> logits(size_t(n) * m.config.vocab_size);
  for (int t = 1; t < kContext; ++t) {
    for (int b = 0; b < n; ++b) src.streams[b].push_back(next[b]);
    if (t == kContext - 1) break;
    check(tf.decode(seqs, next, pos, logits));
    for (int b = 0; b < n; ++b) {
      ++pos[b];
      next[b] = karakv::llama::sample({&logits[size_t(b) * m.config.vocab_size], size_t(m.config.vocab_size)}, 1.0f,
                                      &rng[b]);
    }
  }
  return src;
}

// n windows spread evenly over the file, each starting at a paragraph, tokenized with BOS.
Source shakespeare(const Model& m, const std::string& path, int n) {
  std::ifstream in(path, std::ios::binary);
  if (!in) die("cannot open " + path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Source src{"shakespeare", {}};
  for (int i = 0; i < n; ++i) {
    size_t at = text.find("\n\n", text.size() / n * i);
    if (at == std::string::npos) die("text too short: " + path);
    std::vector<int> toks = m.tokenizer.encode(text.substr(at + 2, 8000), true, false);
    if (toks.size() < size_t(kContext)) die("a window of " + path + " has fewer than 512 tokens");
    toks.resize(kContext);
    src.streams.push_back(std::move(toks));
  }
  return src;
}

struct RunResult {
  double nll = 0;  // summed over every scored token
  int scored = 0;
  double resident_mean = 0, resident_final = 0, logical_final = 0;  // per sequence
  std::vector<std::vector<int>> greedy;                            // per stream
  std::vector<std::vector<double>> logp;                           // per stream, per scored token
};

// Resident and logical tokens per sequence of this client (mean over its sequences).
std::pair<double, double> residency(karakv::Client* client) {
  if (!client) return {0, 0};
  auto list = check(client->ListSequences());
  double r = 0, l = 0;
  for (const auto& s : list) {
    r += s.length;
    l += s.logical_length;
  }
  return {r / std::max<size_t>(1, list.size()), l / std::max<size_t>(1, list.size())};
}

// The perplexity pass and the greedy pass over every stream of `src`, batched.
RunResult run(const Model& m, karakv::llama::Attention& att, karakv::Client* client, const Source& src) {
  const int n = int(src.streams.size());
  const int V = m.config.vocab_size;
  Transformer tf(m, att);
  RunResult res;
  res.logp.resize(n);
  std::vector<uint64_t> seqs(n);
  std::vector<float> logits(size_t(n) * V);

  // Perplexity: tokens kPrompt..kContext-1 are predicted, 384 per stream.
  double resident_sum = 0;
  int samples = 0;
  for (int b = 0; b < n; ++b) {
    seqs[b] = check(att.create_sequence());
    const std::vector<int>& s = src.streams[b];
    auto first = check(tf.prefill(seqs[b], std::span<const int>(s.data(), kPrompt)));
    res.logp[b].push_back(karakv::llama::log_prob(first, s[kPrompt]));
  }
  std::vector<int> tok(n), pos(n);
  for (int t = kPrompt; t < kContext - 1; ++t) {
    for (int b = 0; b < n; ++b) {
      tok[b] = src.streams[b][t];
      pos[b] = t;
    }
    check(tf.decode(seqs, tok, pos, logits));
    for (int b = 0; b < n; ++b) {
      res.logp[b].push_back(
          karakv::llama::log_prob({&logits[size_t(b) * V], size_t(V)}, src.streams[b][t + 1]));
    }
    if (client) {
      resident_sum += residency(client).first;
      ++samples;
    }
  }
  for (auto& lp : res.logp) {
    for (double x : lp) {
      res.nll -= x;
      ++res.scored;
    }
  }
  std::tie(res.resident_final, res.logical_final) = residency(client);
  res.resident_mean = samples ? resident_sum / samples : 0;
  for (uint64_t id : seqs) check(att.release(id));

  // Agreement: kAgreeContext tokens of context, then kGreedy greedy tokens.
  res.greedy.assign(n, {});
  std::vector<int> next(n);
  for (int b = 0; b < n; ++b) {
    seqs[b] = check(att.create_sequence());
    auto first = check(tf.prefill(seqs[b], std::span<const int>(src.streams[b].data(), kPrompt)));
    (void)first;
  }
  for (int t = kPrompt; t < kAgreeContext; ++t) {
    for (int b = 0; b < n; ++b) {
      tok[b] = src.streams[b][t];
      pos[b] = t;
    }
    check(tf.decode(seqs, tok, pos, logits));
  }
  for (int b = 0; b < n; ++b) next[b] = karakv::llama::sample({&logits[size_t(b) * V], size_t(V)}, 0, nullptr);
  for (int g = 0; g < kGreedy; ++g) {
    for (int b = 0; b < n; ++b) res.greedy[b].push_back(next[b]);
    if (g == kGreedy - 1) break;
    for (int b = 0; b < n; ++b) pos[b] = kAgreeContext + g;
    check(tf.decode(seqs, next, pos, logits));
    for (int b = 0; b < n; ++b) next[b] = karakv::llama::sample({&logits[size_t(b) * V], size_t(V)}, 0, nullptr);
  }
  for (uint64_t id : seqs) check(att.release(id));
  return res;
}

struct PolicySpec {
  std::string label;
  karakv::SequenceOptions options;
};

std::string params_text(const karakv::SequenceOptions& o) {
  std::vector<std::string> parts;
  for (const auto& [k, v] : o.params) parts.push_back(absl::StrFormat("%s=%g", k, v));
  return absl::StrJoin(parts, " ");
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("llama_quality: perplexity and greedy agreement of stories260K under each KV policy");
  absl::ParseCommandLine(argc, argv);
  const bool quick = absl::GetFlag(FLAGS_quick);
  const int n = quick ? 2 : absl::GetFlag(FLAGS_streams);
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  const Model model = check(karakv::llama::load_model(absl::GetFlag(FLAGS_model)));
  const Config& c = model.config;
  if (c.max_seq_len < kContext) die("the model's context is below 512");

  std::vector<Source> sources = {sample_stories(model, n, absl::GetFlag(FLAGS_seed))};
  if (!quick && !absl::GetFlag(FLAGS_shakespeare).empty()) {
    sources.push_back(shakespeare(model, absl::GetFlag(FLAGS_shakespeare), n));
  }

  // Kara with a window sized for a 512-token context: W=64 (B = rho*W = 16 or 32 tokens, whole
  // blocks), tick every P=8 steps, so ~5 windows compress during the 384 fed tokens.
  auto kara = [](double rho) {
    karakv::SequenceOptions o;
    o.policy = "kara";
    o.params = {{"window", 64}, {"period", 8}, {"rho", rho}};
    return PolicySpec{absl::StrFormat("kara-%.2f", rho), o};
  };
  std::vector<PolicySpec> fixed = {{"none", {}}, kara(0.5), kara(0.25)};
  std::set<std::string> only;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_only), ',', absl::SkipEmpty())) only.insert(std::string(s));

  std::FILE* csv = std::fopen(absl::GetFlag(FLAGS_csv).c_str(), "w");
  if (!csv) die("cannot write " + absl::GetFlag(FLAGS_csv));
  std::fprintf(csv,
               "source,policy,params,streams,scored_tokens,perplexity,ppl_vs_none_pct,resident_final,resident_mean,"
               "logical_final,greedy_agreement,mean_common_prefix,max_abs_dlogp_vs_dense\n");
  std::printf("llama_quality: %s, dtype %s, %d streams per source; prompt %d (Append) + %d scored (Step); "
              "agreement: %d context + %d greedy\n",
              absl::GetFlag(FLAGS_model).c_str(), dtype.c_str(), n, kPrompt, kContext - kPrompt, kAgreeContext,
              kGreedy);

  for (const Source& src : sources) {
    // The in-process dense reference, with the daemon's storage rounding.
    karakv::llama::DenseAttention dense(c, dtype);
    const RunResult ref = run(model, dense, nullptr, src);
    const double ref_ppl = std::exp(ref.nll / ref.scored);
    std::printf("\n[%s] dense in-process reference: perplexity %.4f over %d tokens\n", src.name.c_str(), ref_ppl,
                ref.scored);
    std::printf("%-14s %-34s %10s %8s %10s %10s %8s %8s %9s\n", "policy", "params", "perplexity", "vs none",
                "resident", "mean res.", "logical", "agree", "prefix");

    std::vector<PolicySpec> specs = fixed;
    double none_ppl = 0;
    const RunResult* none_run = nullptr;
    RunResult none_holder;
    auto run_one = [&](const PolicySpec& spec) -> RunResult {
      Daemon daemon(absl::GetFlag(FLAGS_karakvd), c, dtype);
      auto client = check(karakv::Client::Attach(daemon.options()));
      check(karakv::llama::DaemonAttention::check_geometry(*client, c));
      karakv::llama::DaemonAttention att(*client, spec.options);
      return run(model, att, client.get(), src);
    };
    auto report = [&](const PolicySpec& spec, const RunResult& r) {
      const double ppl = std::exp(r.nll / r.scored);
      if (spec.label == "none") none_ppl = ppl;
      double agree = 0, prefix = 0, dlogp = 0;
      const auto& base = none_run ? none_run->greedy : r.greedy;
      for (size_t b = 0; b < r.greedy.size(); ++b) {
        int same = 0, pre = 0;
        bool diverged = false;
        for (size_t i = 0; i < r.greedy[b].size(); ++i) {
          const bool eq = r.greedy[b][i] == base[b][i];
          same += eq;
          if (!eq) diverged = true;
          if (!diverged) ++pre;
        }
        agree += double(same) / r.greedy[b].size();
        prefix += pre;
        for (size_t i = 0; i < r.logp[b].size(); ++i) dlogp = std::max(dlogp, std::abs(r.logp[b][i] - ref.logp[b][i]));
      }
      agree /= r.greedy.size();
      prefix /= r.greedy.size();
      const double vs_none = none_ppl > 0 ? 100.0 * (ppl / none_ppl - 1) : 0.0;
      const std::string params = spec.options.params.empty() ? "-" : params_text(spec.options);
      std::printf("%-14s %-34s %10.4f %+7.2f%% %10.1f %10.1f %8.1f %7.1f%% %9.1f\n", spec.label.c_str(),
                  params.c_str(), ppl, vs_none, r.resident_final, r.resident_mean, r.logical_final, 100 * agree,
                  prefix);
      std::fflush(stdout);
      std::fprintf(csv, "%s,%s,%s,%d,%d,%.6f,%.4f,%.1f,%.2f,%.1f,%.4f,%.2f,%.3g\n", src.name.c_str(),
                   spec.label.c_str(), params.c_str(), int(r.greedy.size()), r.scored, ppl, vs_none,
                   r.resident_final, r.resident_mean, r.logical_final, agree, prefix, dlogp);
    };

    // none first (the baseline of agreement), then Kara; the threshold baselines are sized from
    // Kara rho=0.25's final resident length R: c_target = R - 16, c_max = R + 16, so between
    // compactions they hold R tokens on average, the same memory as Kara at the end of the run.
    double kara25_final = 0;
    for (const PolicySpec& spec : specs) {
      if (!only.empty() && !only.count(spec.label) && spec.label != "none") continue;
      RunResult r = run_one(spec);
      if (spec.label == "none") {
        none_holder = std::move(r);
        none_run = &none_holder;
        report(spec, *none_run);
        continue;
      }
      if (spec.label == "kara-0.25") kara25_final = r.resident_final;
      report(spec, r);
    }
    if (kara25_final == 0) kara25_final = 272;  // when --only skipped it: the value a full run measures
    const double R = std::round(kara25_final);
    for (const char* name : {"snapkv", "streaming", "h2o", "chunkkv"}) {
      PolicySpec spec{name, {}};
      spec.options.policy = name;
      spec.options.params = {{"c_target", R - 16}, {"c_max", R + 16}};
      if (!only.empty() && !only.count(name)) continue;
      report(spec, run_one(spec));
    }
  }
  std::fclose(csv);
  std::printf("\nwrote %s\n", absl::GetFlag(FLAGS_csv).c_str());
  return 0;
}
