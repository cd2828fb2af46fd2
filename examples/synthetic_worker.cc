// A synthetic model worker: N concurrent sequences, each a P-token prompt (Append) followed by G
// decode steps (Step for every layer, batched over all sequences), with deterministic K/V/Q. It
// checks a sample of attention outputs against a dense float64 reference and reports throughput
// and pool usage. Exit status 0 only if every checked output matched.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "common/synthetic.h"
#include "karakv/client.h"
#include "karakv/tools/v1/output.pb.h"
#include "util/json.h"

ABSL_FLAG(std::string, target, "", "karakvd address (empty: $KARAKV_TARGET, else unix:/tmp/karakv.sock)");
ABSL_FLAG(int, sequences, 8, "Concurrent sequences (decode batch size)");
ABSL_FLAG(int, prompt, 256, "Prompt tokens per sequence (appended in one Append)");
ABSL_FLAG(int, generate, 64, "Decode steps per sequence");
ABSL_FLAG(int, check_every, 8, "Check attention outputs against the dense reference every N steps (0: never)");
ABSL_FLAG(bool, inline_tensors, false, "Send tensors inline in the RPCs instead of through shared memory");
ABSL_FLAG(bool, fast_path, false, "Send Step, Append and ReadKV through the shared-memory command ring instead of gRPC");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the synthetic K/V/Q");
ABSL_FLAG(bool, release, true, "Release the sequences at the end");
ABSL_FLAG(bool, json, false,
          "Print the summary as one line of JSON (karakv.tools.v1.SyntheticWorkerSummary, protobuf's JSON mapping)");
ABSL_FLAG(std::string, policy, "none",
          "Compression policy of every sequence, optionally with a storage format (kara, kara+kivi4, snapkv, ...)");
ABSL_FLAG(std::vector<std::string>, param, {}, "Policy parameters, name=value, comma separated (window=64,rho=0.25)");

namespace {

using Clock = std::chrono::steady_clock;
using karakv::synthetic::Tensor;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

int die(const absl::Status& s) {
  std::fprintf(stderr, "synthetic_worker: %s\n", std::string(s.ToString()).c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("synthetic_worker: drive a synthetic decode workload through karakvd");
  absl::ParseCommandLine(argc, argv);
  const int n = absl::GetFlag(FLAGS_sequences);
  const int prompt = absl::GetFlag(FLAGS_prompt);
  const int gen = absl::GetFlag(FLAGS_generate);
  const int check_every = absl::GetFlag(FLAGS_check_every);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const bool use_inline = absl::GetFlag(FLAGS_inline_tensors);
  if (n < 1 || prompt < 1 || gen < 0) {
    std::fprintf(stderr, "synthetic_worker: need --sequences >= 1, --prompt >= 1, --generate >= 0\n");
    return 2;
  }

  // Attach once without staging to learn the geometry, then size the region for this workload.
  karakv::ClientOptions opts;
  opts.target = absl::GetFlag(FLAGS_target);
  opts.worker_id = "synthetic_worker";
  opts.staging_bytes = 0;
  auto probe = karakv::Client::Attach(opts);
  if (!probe.ok()) return die(probe.status());
  const karakv::Geometry g = (*probe)->geometry();
  const size_t append_bytes = (*probe)->append_bytes(prompt);
  const size_t step_bytes = 2 * (*probe)->step_kv_bytes(n) + 2 * (*probe)->q_bytes(n);
  probe->reset();
  opts.staging_bytes = use_inline ? 0 : std::max(2 * append_bytes, step_bytes) + 4096;
  opts.fast_path = absl::GetFlag(FLAGS_fast_path) && !use_inline;
  auto attached = karakv::Client::Attach(opts);
  if (!attached.ok()) return die(attached.status());
  karakv::Client& client = **attached;
  auto buffer = [&](size_t bytes) -> karakv::Buffer {
    if (use_inline) return karakv::Client::alloc_heap(bytes);
    return *client.alloc(bytes);  // sized above, cannot run out
  };
  // --json: stdout carries the summary line only.
  if (!absl::GetFlag(FLAGS_json)) {
    std::printf("karakv synthetic worker: %d sequences x (%d prompt + %d generated) tokens, %s tensors, Step via %s\n",
                n, prompt, gen, use_inline ? "inline" : "shared-memory", client.fast_path() ? "the ring" : "gRPC");
    std::printf("geometry: layers=%d q_heads=%d kv_heads=%d head_dim=%d dtype=%s block_size=%d\n", g.num_layers,
                g.num_q_heads, g.num_kv_heads, g.head_dim, karakv::kernels::dtype_name(g.dtype), g.block_size);
  }

  karakv::SequenceOptions options;
  options.policy = absl::GetFlag(FLAGS_policy);
  for (const std::string& p : absl::GetFlag(FLAGS_param)) {
    const size_t eq = p.find('=');
    double value = 0;
    if (eq == std::string::npos || !absl::SimpleAtod(p.substr(eq + 1), &value)) {
      std::fprintf(stderr, "synthetic_worker: --param expects name=number, got '%s'\n", p.c_str());
      return 2;
    }
    options.params[p.substr(0, eq)] = value;
  }

  // Prefill: one Append per sequence.
  std::vector<uint64_t> seqs;
  const auto t_append = Clock::now();
  for (int s = 0; s < n; ++s) {
    auto id = client.CreateSequence(options);
    if (!id.ok()) return die(id.status());
    seqs.push_back(*id);
    client.reset_staging();
    karakv::Buffer k = buffer(append_bytes), v = buffer(append_bytes);
    karakv::synthetic::fill_prompt(k.data(), g, seed, Tensor::kKey, *id, 0, prompt);
    karakv::synthetic::fill_prompt(v.data(), g, seed, Tensor::kValue, *id, 0, prompt);
    auto len = client.Append(*id, prompt, k, v);
    if (!len.ok()) return die(len.status());
  }
  const double append_s = seconds_since(t_append);

  // Decode: G steps, each a Step per layer over the whole batch.
  client.reset_staging();
  karakv::Buffer k = buffer(client.step_kv_bytes(n)), v = buffer(client.step_kv_bytes(n));
  karakv::Buffer q = buffer(client.q_bytes(n)), out = buffer(client.q_bytes(n));
  const size_t kv_tok = g.kv_token_elems() * karakv::kernels::dtype_size(g.dtype);
  const size_t q_tok = g.q_token_elems();
  int checks = 0, failures = 0;
  double max_err = 0.0;
  double step_rpc_s = 0.0, fill_s = 0.0;
  const auto t_decode = Clock::now();
  auto last_progress = Clock::now();
  for (int t = 0; t < gen; ++t) {
    const int64_t pos = prompt + t;
    const bool check_now = check_every > 0 && (t % check_every == 0 || t == gen - 1);
    // The reference is computed over the cache exactly as the daemon holds it before this step
    // (ReadKV: resident tokens after any compaction, dequantized), plus this step's token.
    std::vector<int> sample = n == 1 ? std::vector<int>{0} : std::vector<int>{0, n - 1};
    std::vector<karakv::Buffer> cache_k, cache_v;
    std::vector<int> cache_len;
    if (check_now) {
      for (int s : sample) {
        auto info = client.ListSequences();
        if (!info.ok()) return die(info.status());
        uint32_t resident = 0;
        for (const auto& i : *info) resident = i.id == seqs[s] ? i.length : resident;
        karakv::Buffer ck = karakv::Client::alloc_heap(client.append_bytes(resident));
        karakv::Buffer cv = karakv::Client::alloc_heap(ck.size());
        karakv::Buffer cp = karakv::Client::alloc_heap(size_t(g.num_layers) * g.num_kv_heads * resident * 4);
        auto got = client.ReadKV(seqs[s], ck, cv, cp);
        if (!got.ok()) return die(got.status());
        cache_k.push_back(ck);
        cache_v.push_back(cv);
        cache_len.push_back(*got);
      }
    }
    for (int l = 0; l < g.num_layers; ++l) {
      const auto t_fill = Clock::now();
      for (int s = 0; s < n; ++s) {
        karakv::synthetic::fill_token(k.data() + s * kv_tok, g, seed, Tensor::kKey, seqs[s], l, pos);
        karakv::synthetic::fill_token(v.data() + s * kv_tok, g, seed, Tensor::kValue, seqs[s], l, pos);
        karakv::synthetic::fill_query(q.as<float>().data() + s * q_tok, g, seed, seqs[s], l, pos);
      }
      const auto t_rpc = Clock::now();
      fill_s += std::chrono::duration<double>(t_rpc - t_fill).count();
      auto step = client.Step(l, seqs, k, v, q, out);
      step_rpc_s += seconds_since(t_rpc);
      if (!step.ok()) return die(step.status());
      if (check_now) {
        // Sample: the first and the last sequence of the batch at this layer.
        for (size_t j = 0; j < sample.size(); ++j) {
          const int s = sample[j];
          const std::vector<double> ref = karakv::synthetic::dense_attention_over_cache(
              g, cache_k[j].data(), cache_v[j].data(), cache_len[j], l, k.data() + s * kv_tok, v.data() + s * kv_tok,
              q.as<float>().data() + s * q_tok);
          const float* got = out.as<float>().data() + s * q_tok;
          double err = 0;
          for (size_t i = 0; i < q_tok; ++i) err = std::max(err, std::abs(double(got[i]) - ref[i]));
          max_err = std::max(max_err, err);
          ++checks;
          if (err > 1e-4) {
            ++failures;
            std::fprintf(stderr, "\nMISMATCH sequence %llu layer %d position %lld: max |err| = %.3g\n",
                         (unsigned long long)seqs[s], l, (long long)pos, err);
          }
        }
      }
    }
    if (seconds_since(last_progress) >= 1.0 || t == gen - 1) {
      last_progress = Clock::now();
      const double el = seconds_since(t_decode);
      std::fprintf(stderr, "\rdecode step %d/%d  %.0f tokens/s  checks %d ok %d", t + 1, gen,
                   (t + 1) * double(n) / el, checks, checks - failures);
      if (t == gen - 1) std::fprintf(stderr, "\n");
    }
  }
  const double decode_s = seconds_since(t_decode);

  auto stats = client.Stats(true);
  if (!stats.ok()) return die(stats.status());
  const double kv_gb = double(append_bytes) * 2 * n / 1e9;
  const double tok_s = gen > 0 ? double(gen) * n / decode_s : 0.0;
  const double step_us = gen > 0 ? step_rpc_s / (double(gen) * g.num_layers) * 1e6 : 0.0;
  const double used_pct = 100.0 * stats->blocks_used / std::max<uint64_t>(1, stats->blocks_total);
  if (absl::GetFlag(FLAGS_json)) {
    karakv::tools::v1::SyntheticWorkerSummary summary;
    summary.set_sequences(n);
    summary.set_prompt(prompt);
    summary.set_generate(gen);
    summary.set_append_seconds(append_s);
    summary.set_append_gb_per_s(kv_gb / append_s);
    summary.set_decode_seconds(decode_s);
    summary.set_decode_tokens_per_s(tok_s);
    summary.set_step_rpc_us(step_us);
    summary.set_blocks_used(stats->blocks_used);
    summary.set_blocks_total(stats->blocks_total);
    summary.set_resident_tokens(stats->resident_tokens);
    summary.set_checks(checks);
    summary.set_failures(failures);
    summary.set_max_abs_err(max_err);
    summary.set_invariants_ok(stats->invariant_error.empty());
    std::printf("%s\n", karakv::to_json(summary).c_str());
  } else {
    std::printf("prefill : %d x %d tokens appended in %.3f s (%.2f GB/s of K/V into the pool)\n", n, prompt,
                append_s, kv_gb / append_s);
    std::printf("decode  : %d tokens in %.3f s = %.1f tokens/s (%d-sequence batch; %.1f us per Step RPC over %d layers; worker fill %.3f s)\n",
                gen * n, decode_s, tok_s, n, step_us, g.num_layers, fill_s);
    std::printf("pool    : %llu / %llu blocks used (%.1f%%), %llu tokens resident, %.1f MiB of %.1f MiB; invariants %s\n",
                (unsigned long long)stats->blocks_used, (unsigned long long)stats->blocks_total, used_pct,
                (unsigned long long)stats->resident_tokens, stats->blocks_used * stats->block_bytes / 1048576.0,
                stats->pool_bytes / 1048576.0, stats->invariant_error.empty() ? "ok" : stats->invariant_error.c_str());
    for (const auto& p : stats->policies) {
      if (p.sequences == 0) continue;
      std::printf("compress: %s: %llu resident of %llu logical tokens, %d compactions, actual ratio %.2fx (nominal %.2fx), %.1f MiB of KV\n",
                  p.policy.c_str(), (unsigned long long)p.resident_tokens, (unsigned long long)p.logical_tokens,
                  int(p.compactions), p.actual_ratio, p.nominal_ratio, p.kv_bytes / 1048576.0);
    }
    std::printf("check   : %d attention outputs vs dense float64 attention over the daemon's cache: %s (max |err| %.2e, tolerance 1e-4)\n",
                checks, failures == 0 ? "ALL MATCHED" : "MISMATCHES", max_err);
  }
  if (absl::GetFlag(FLAGS_release)) {
    for (uint64_t id : seqs) {
      if (auto r = client.Release(id); !r.ok()) return die(r.status());
    }
  }
  return failures == 0 && stats->invariant_error.empty() ? 0 : 1;
}
