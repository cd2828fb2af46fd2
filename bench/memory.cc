// karakv-bench memory: resident K/V bytes per sequence over decode steps under each compression
// policy (none, kara, snapkv, streaming), all in one Step batch of one karakvd.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench_common.h"
#include "harness.h"
#include "karakv/client.h"

ABSL_FLAG(int32_t, memory_sequences, 4, "memory: sequences per policy");
ABSL_FLAG(int32_t, memory_prompt, 256, "memory: prompt tokens per sequence (Append)");
ABSL_FLAG(int32_t, memory_steps, 3000, "memory: decode steps");
ABSL_FLAG(int32_t, memory_sample_every, 64, "memory: decode steps between samples (ListSequences)");
ABSL_FLAG(int32_t, memory_print_every, 256, "memory: steps between the printed table's rows (the CSV has all)");
ABSL_DECLARE_FLAG(std::string, out_dir);  // karakv_bench.cc

namespace karakv::bench {

// memory: resident KV bytes per sequence over decode steps, per policy. One daemon, one Step batch
// holding every policy's sequences, so the daemon's decode-step counter (Kara's ticks) advances
// once per step as in a real batch.
absl::StatusOr<std::vector<Row>> run_memory(const TempDir& dir) {
  const kn::Geometry g = smollm_geometry();
  const std::vector<std::string> policies = {"none", "kara", "snapkv", "streaming"};
  const int per = std::max(1, absl::GetFlag(FLAGS_memory_sequences));
  const int steps = std::max(1, absl::GetFlag(FLAGS_memory_steps));
  const int prompt = std::max(1, absl::GetFlag(FLAGS_memory_prompt));
  const int every = std::max(1, absl::GetFlag(FLAGS_memory_sample_every));
  const int batch = per * int(policies.size());
  auto daemon = start_karakvd(dir, "karakvd-memory", smollm_flags(decode_pool_bytes(g, batch, prompt + steps)));
  if (!daemon.ok()) return daemon.status();
  auto client = attach(*daemon, decode_staging_bytes(g, prompt, batch), "karakv-bench-memory");
  if (!client.ok()) return client.status();
  std::vector<std::string> of_seq;  // policy of each sequence, in batch order
  for (const std::string& p : policies) of_seq.insert(of_seq.end(), per, p);
  DecodeSet set;
  set.label = "memory";
  set.c = client->get();
  if (absl::Status s = prefill(set, g, of_seq, prompt); !s.ok()) return s;

  // bytes of one resident token: K and V of every layer and KV head.
  const double token_bytes = double(g.num_layers) * g.kv_token_elems() * 2 * kn::dtype_size(g.dtype);
  struct Sample {
    int step;
    std::string policy;
    double resident = 0, logical = 0, blocks = 0;  // means over the policy's sequences
  };
  std::vector<Sample> samples;
  auto sample = [&](int step) -> absl::Status {
    auto list = (*client)->ListSequences();
    if (!list.ok()) return list.status();
    for (const std::string& p : policies) {
      Sample s{step, p};
      int n = 0;
      for (const karakv::SequenceInfo& info : *list) {
        if (info.policy != p) continue;
        s.resident += info.length;
        s.logical += info.logical_length;
        s.blocks += info.blocks;
        ++n;
      }
      if (n != per) {
        return absl::InternalError(absl::StrCat("ListSequences reported ", n, " ", p, " sequences, expected ", per));
      }
      s.resident /= n, s.logical /= n, s.blocks /= n;
      samples.push_back(s);
    }
    return absl::OkStatus();
  };
  if (absl::Status s = sample(0); !s.ok()) return s;
  StepTensors tensors(g, batch);
  const auto start = Clock::now();
  auto last_report = start;
  for (int step = 1; step <= steps; ++step) {
    tensors.fill(prompt + step - 1);
    if (absl::Status s = set.step(tensors); !s.ok()) return s;
    if (step % every == 0 || step == steps) {
      if (absl::Status s = sample(step); !s.ok()) return s;
    }
    if (seconds_since(last_report) >= 5 || step == steps) {
      last_report = Clock::now();
      std::string now;
      for (size_t i = samples.size() - policies.size(); i < samples.size(); ++i) {
        absl::StrAppend(&now, now.empty() ? "" : ", ", samples[i].policy, " ", int(samples[i].resident));
      }
      progress(absl::StrFormat("memory step %d/%d (%.0f s); resident tokens/seq at step %d: %s", step, steps,
                               seconds_since(start), samples.back().step, now));
    }
  }
  auto stats = (*client)->Stats();
  if (!stats.ok()) return stats.status();
  set = DecodeSet{};
  client->reset();
  stop_or_warn(*daemon);

  auto mib = [&](double tokens) { return tokens * token_bytes / double(1 << 20); };
  // The series, one line per (step, policy).
  std::string csv = "step,policy,sequences,resident_tokens,logical_tokens,blocks,kv_mib,block_mib\n";
  for (const Sample& s : samples) {
    absl::StrAppend(&csv, s.step, ",", s.policy, ",", per, ",", absl::StrFormat("%.2f", s.resident), ",",
                    absl::StrFormat("%.2f", s.logical), ",", absl::StrFormat("%.2f", s.blocks), ",",
                    absl::StrFormat("%.4f", mib(s.resident)), ",",
                    absl::StrFormat("%.4f", s.blocks * g.block_bytes() / double(1 << 20)), "\n");
  }
  if (const std::string out = absl::GetFlag(FLAGS_out_dir); !out.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(out, ec);
    std::ofstream f(out + "/memory_series.csv");
    f << csv;
    if (!f) return absl::InternalError(absl::StrCat("cannot write ", out, "/memory_series.csv"));
  }
  // The table: step rows x policy columns, MiB of resident K/V per sequence.
  const int print_every = std::max(every, absl::GetFlag(FLAGS_memory_print_every));
  std::vector<std::vector<std::string>> cells = {{"step"}};
  for (const std::string& p : policies) cells[0].push_back(p);
  for (size_t i = 0; i < samples.size(); i += policies.size()) {
    const int step = samples[i].step;
    if (step % print_every != 0 && step != steps) continue;
    std::vector<std::string> line = {absl::StrCat(step)};
    for (size_t j = 0; j < policies.size(); ++j) line.push_back(absl::StrFormat("%.1f", mib(samples[i + j].resident)));
    cells.push_back(line);
  }
  std::string table = absl::StrFormat(
      "memory: resident K/V MiB per sequence (mean of %d; resident tokens x %d layers x %d KV heads x %d dims x 2 "
      "(K, V) x %d B), SmolLM2-135M geometry, prompt %d, every %d steps%s:\n",
      per, g.num_layers, g.num_kv_heads, g.head_dim, int(kn::dtype_size(g.dtype)), prompt, print_every,
      absl::GetFlag(FLAGS_out_dir).empty() ? "" : " (every sample in memory_series.csv)");
  for (const auto& line : cells) {
    std::string out;
    for (size_t i = 0; i < line.size(); ++i) {
      const size_t w = i == 0 ? 6 : std::max<size_t>(10, cells[0][i].size() + 1);
      out += std::string(w > line[i].size() ? w - line[i].size() : 0, ' ') + line[i];
    }
    absl::StrAppend(&table, out, "\n");
  }
  extra_reports().push_back(table);

  // Summary rows: each policy at the last step and its peak, against none.
  auto last = [&](const std::string& p) {
    for (auto it = samples.rbegin(); it != samples.rend(); ++it)
      if (it->policy == p) return *it;
    return Sample{};
  };
  auto peak = [&](const std::string& p) {
    double m = 0;
    for (const Sample& s : samples)
      if (s.policy == p) m = std::max(m, s.resident);
    return m;
  };
  const Sample none_last = last("none");
  std::vector<Row> rows;
  for (const std::string& p : policies) {
    if (p == "none") continue;
    rows.push_back({"memory", absl::StrFormat("resident KV/seq after %d steps, %s", steps, p), mib(last(p).resident),
                    "none", mib(none_last.resident), "MiB", true, std::nullopt});
    rows.push_back({"memory", absl::StrFormat("peak resident KV/seq, %s", p), mib(peak(p)), "none (peak)",
                    mib(peak("none")), "MiB", true, std::nullopt});
  }
  for (const karakv::PolicyStats& p : stats->policies) {
    if (p.policy == "none") continue;
    progress(absl::StrFormat("memory: %s %llu compactions, %llu tokens removed, %.3f s compacting, %llu failures",
                             p.policy, (unsigned long long)p.compactions, (unsigned long long)p.tokens_removed,
                             p.compaction_seconds, (unsigned long long)p.failures));
  }
  return rows;
}

std::string memory_how() {
  return absl::StrFormat("memory SmolLM2-135M geometry fp16, %d seqs per policy in one Step "
                         "batch, prompt %d, %d decode steps, default policy parameters",
                         absl::GetFlag(FLAGS_memory_sequences), absl::GetFlag(FLAGS_memory_prompt),
                         absl::GetFlag(FLAGS_memory_steps));
}

}  // namespace karakv::bench
