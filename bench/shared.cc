// karakv-bench shared: the pool memory of N sequences that start from one cached system prompt,
// per compression configuration. With Kara's prompt kept (prompt=0, or the default prompt=auto for
// the blocks a sequence adopted from the cache), the prompt's blocks stay shared (one copy for
// every sequence and the cache); a configuration that compresses the prompt (prompt=1, a threshold
// baseline) gathers what it keeps into each sequence's own blocks. So a
// per-sequence saving can cost memory in total where many sequences share a prompt; this mode
// measures both, side by side, with the workload otherwise the same.
//
// For each configuration: one karakvd with the prefix cache; a first request publishes the system
// prompt (by ids) and is released, so the cache holds it; then N sequences are created from the
// prefix (system prompt + their own tokens; only their own are appended) and decode together for
// --shared_steps steps. Sampled every 64 steps: the pool's blocks in use, of which cached blocks no
// sequence reads (evictable), and the sequences' mean resident tokens.
#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench_common.h"
#include "harness.h"
#include "karakv/client.h"

ABSL_FLAG(int32_t, shared_sequences, 8, "shared: sequences that start from the cached system prompt");
ABSL_FLAG(int32_t, shared_system_tokens, 1000, "shared: tokens of the system prompt they share");
ABSL_FLAG(int32_t, shared_own_tokens, 64, "shared: tokens of each sequence's own prompt after it");
ABSL_FLAG(int32_t, shared_steps, 1024, "shared: decode steps");
ABSL_FLAG(std::string, shared_configs, "none;kara;kara:prompt=1;kara:prompt=1,fit=1,budget=700",
          "shared: configurations, ';'-separated POLICY[:name=value,...]");

namespace karakv::bench {
namespace {

struct Config {
  std::string label;
  karakv::SequenceOptions options;
};

absl::StatusOr<std::vector<Config>> parse_configs(const std::string& text) {
  std::vector<Config> out;
  for (absl::string_view item : absl::StrSplit(text, ';', absl::SkipEmpty())) {
    const std::vector<std::string> parts = absl::StrSplit(item, absl::MaxSplits(':', 1));
    Config c;
    c.label = std::string(item);
    c.options.policy = parts[0];
    if (parts.size() == 2) {
      auto params = parse_policy_params("shared_configs", parts[1]);
      if (!params.ok()) return params.status();
      c.options.params = *params;
    }
    out.push_back(std::move(c));
  }
  if (out.empty()) return absl::InvalidArgumentError("--shared_configs: expected at least one configuration");
  return out;
}

struct Sample {
  int step = 0;
  uint64_t blocks_used = 0, unused_cached = 0;
  double resident = 0;  // mean per sequence
};

// Creates one sequence from the prefix of `prompt` and appends the rest, with its ids.
absl::StatusOr<uint64_t> start_from_prefix(karakv::Client& c, const kn::Geometry& g,
                                           const karakv::SequenceOptions& options, const std::vector<int32_t>& prompt) {
  auto created = c.CreateFromPrefix(options, prompt);
  if (!created.ok()) return created.status();
  const int cached = created->cached_tokens, todo = int(prompt.size()) - cached;
  if (todo == 0) return created->id;
  c.reset_staging();
  auto k = c.alloc(c.append_bytes(todo)), v = c.alloc(c.append_bytes(todo));
  if (!k.ok()) return k.status();
  if (!v.ok()) return v.status();
  fill_prompt_kv(g, prompt, cached, k->data(), v->data());
  auto len = c.Append(created->id, std::span<const int32_t>(prompt.data() + cached, todo), *k, *v);
  if (!len.ok()) return len.status();
  return created->id;
}

absl::StatusOr<std::vector<Sample>> run_config(const TempDir& dir, const kn::Geometry& g, const Config& config, int n,
                                               int system, int own, int steps, int* cached_tokens) {
  const int tokens = system + own + steps;
  const size_t blocks = size_t(n + 1) * ((tokens + g.block_size - 1) / g.block_size + 4) + 64;
  std::vector<std::string> flags = smollm_flags(blocks * g.block_bytes());
  flags.push_back("--prefix_cache=on");
  auto d = start_karakvd(dir, "karakvd-shared", flags);
  if (!d.ok()) return d.status();
  const uint64_t staging = 2 * append_tensor_bytes(g, system + own) + (8 << 20);
  auto client = attach(*d, staging, "karakv-bench-shared");
  if (!client.ok()) return client.status();
  karakv::Client& c = **client;
  // The publisher: the system prompt alone, then released; the cache keeps its blocks.
  std::vector<int32_t> sys_ids = prefix_prompt(system, 0, 0);
  auto first = start_from_prefix(c, g, karakv::SequenceOptions{}, sys_ids);
  if (!first.ok()) return first.status();
  if (auto s = c.Release(*first); !s.ok()) return s.status();
  DecodeSet set;
  set.label = config.label;
  set.c = &c;
  for (int i = 0; i < n; ++i) {
    auto id = start_from_prefix(c, g, config.options, prefix_prompt(system, own, 1 + i));
    if (!id.ok()) return absl::Status(id.status().code(), absl::StrCat(config.label, ": ", id.status().message()));
    set.ids.push_back(*id);
  }
  auto listed = c.ListSequences();
  if (!listed.ok()) return listed.status();
  *cached_tokens = 0;
  for (const karakv::SequenceInfo& info : *listed) *cached_tokens += int(info.shared_blocks) * g.block_size;
  *cached_tokens /= n;
  c.reset_staging();
  auto sk = c.alloc(c.step_kv_bytes(n)), sv = c.alloc(c.step_kv_bytes(n));
  auto q = c.alloc(c.q_bytes(n)), out = c.alloc(c.q_bytes(n));
  for (auto* b : {&sk, &sv, &q, &out}) {
    if (!b->ok()) return b->status();
  }
  set.sk = *sk, set.sv = *sv, set.q = *q, set.out = *out;
  std::vector<Sample> samples;
  auto sample = [&](int step) -> absl::Status {
    auto stats = c.Stats();
    if (!stats.ok()) return stats.status();
    auto list = c.ListSequences();
    if (!list.ok()) return list.status();
    Sample s{step, stats->blocks_used, stats->prefix_unused_blocks};
    for (const karakv::SequenceInfo& info : *list) s.resident += info.length;
    s.resident /= std::max<size_t>(1, list->size());
    samples.push_back(s);
    return absl::OkStatus();
  };
  if (auto s = sample(0); !s.ok()) return s;
  StepTensors tensors(g, n);
  const auto start = Clock::now();
  auto last_report = start;
  for (int step = 1; step <= steps; ++step) {
    tensors.fill(system + own + step - 1);
    if (auto s = set.step(tensors); !s.ok()) return s;
    if (step % 64 == 0 || step == steps) {
      if (auto s = sample(step); !s.ok()) return s;
    }
    if (seconds_since(last_report) >= 5 || step == steps) {
      last_report = Clock::now();
      progress(absl::StrFormat("shared %s: step %d/%d (%.0f s), %llu blocks in use", config.label, step, steps,
                               seconds_since(start), (unsigned long long)samples.back().blocks_used));
    }
  }
  set = DecodeSet{};
  client->reset();
  stop_or_warn(*d);
  return samples;
}

}  // namespace

absl::StatusOr<std::vector<Row>> run_shared(const TempDir& dir) {
  const kn::Geometry g = smollm_geometry();
  const int n = std::max(1, absl::GetFlag(FLAGS_shared_sequences));
  const int system = std::max(g.block_size, absl::GetFlag(FLAGS_shared_system_tokens));
  const int own = std::max(1, absl::GetFlag(FLAGS_shared_own_tokens));
  const int steps = std::max(1, absl::GetFlag(FLAGS_shared_steps));
  auto configs = parse_configs(absl::GetFlag(FLAGS_shared_configs));
  if (!configs.ok()) return configs.status();
  const double block_mib = double(g.block_bytes()) / double(1 << 20);
  std::string table = absl::StrFormat(
      "shared: %d sequences from one cached %d-token system prompt (+%d own tokens each), %d decode steps, "
      "SmolLM2-135M geometry fp16; pool MiB in use (evictable cached blocks no sequence reads), and mean resident "
      "tokens per sequence, over the run and at its end\n%-44s %14s %14s %12s %12s %10s %10s\n",
      n, system, own, steps, "configuration", "shared/seq", "MiB mean", "MiB end", "evictable", "tok mean", "tok end");
  std::vector<Row> rows;
  double none_mean = 0;
  for (const Config& config : *configs) {
    int shared_tokens = 0;
    auto samples = run_config(dir, g, config, n, system, own, steps, &shared_tokens);
    if (!samples.ok()) return samples.status();
    double used = 0, resident = 0;
    for (const Sample& s : *samples) used += double(s.blocks_used), resident += s.resident;
    used /= double(samples->size()), resident /= double(samples->size());
    const Sample& end = samples->back();
    absl::StrAppendFormat(&table, "%-44s %14d %14.1f %12.1f %12.1f %10.0f %10.0f\n", config.label, shared_tokens,
                          used * block_mib, double(end.blocks_used) * block_mib, double(end.unused_cached) * block_mib,
                          resident, end.resident);
    if (config.options.policy == "none" && config.options.params.empty()) none_mean = used * block_mib;
    rows.push_back({"shared", absl::StrFormat("pool MiB in use, mean, %s", config.label), used * block_mib,
                    none_mean > 0 ? "none" : "-", none_mean, "MiB", false, std::nullopt});
  }
  extra_reports().push_back(table);
  return rows;
}

std::string shared_how() {
  return absl::StrFormat("shared SmolLM2-135M geometry fp16, prefix cache on, %d sequences from one cached %d-token "
                         "system prompt + %d own tokens, %d decode steps, configurations %s",
                         absl::GetFlag(FLAGS_shared_sequences), absl::GetFlag(FLAGS_shared_system_tokens),
                         absl::GetFlag(FLAGS_shared_own_tokens), absl::GetFlag(FLAGS_shared_steps),
                         absl::GetFlag(FLAGS_shared_configs));
}

}  // namespace karakv::bench
