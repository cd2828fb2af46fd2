// karakv-bench p5: Kara's compaction time as a share of decode time (target <= 5%), and decode
// tokens/s with Kara vs none, decoded side by side through two karakvd.
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench_common.h"
#include "harness.h"
#include "karakv/client.h"

ABSL_FLAG(int32_t, p5_sequences, 32, "P5: sequences in the decode batch (each policy)");
ABSL_FLAG(int32_t, p5_prompt, 128, "P5: prompt tokens per sequence (Append)");
ABSL_FLAG(int32_t, p5_steps, 2048, "P5: decode steps (each a Step per layer over the batch)");
ABSL_FLAG(int32_t, p5_block_size, 16, "P5: tokens per pool block of both daemons (karakvd --block_size)");
ABSL_FLAG(std::string, p5_kara_params, "",
          "P5: Kara parameters over its defaults, name=value,... (e.g. observers=0 for version 1's window "
          "scorer, whose decode records nothing)");

namespace karakv::bench {
namespace {

absl::StatusOr<karakv::PolicyStats> policy_stats(karakv::Client& c, const std::string& policy) {
  auto st = c.Stats();
  if (!st.ok()) return st.status();
  for (const karakv::PolicyStats& p : st->policies) {
    if (p.policy == policy) return p;
  }
  karakv::PolicyStats empty;
  empty.policy = policy;
  return empty;
}

}  // namespace

// P5: Kara's compaction time as a share of decode time, and decode throughput with Kara vs none.
// Two daemons (one per policy, so each has its own decode-step counter and Kara's ticks fall every
// 16 of its own steps); their steps alternate, so both see the machine as it is at that moment.
absl::StatusOr<std::vector<Row>> run_p5(const TempDir& dir) {
  auto geometry = smollm_geometry_with_block("--p5_block_size", absl::GetFlag(FLAGS_p5_block_size));
  if (!geometry.ok()) return geometry.status();
  const kn::Geometry g = *geometry;
  const int seqs = std::max(1, absl::GetFlag(FLAGS_p5_sequences));
  const int steps = std::max(1, absl::GetFlag(FLAGS_p5_steps));
  const int prompt = std::max(1, absl::GetFlag(FLAGS_p5_prompt));
  const size_t pool = decode_pool_bytes(g, seqs, prompt + steps);
  struct Side {
    std::string policy;
    std::optional<Daemon> daemon;
    std::unique_ptr<karakv::Client> client;
    DecodeSet set;
  };
  auto kara_params = parse_policy_params("p5_kara_params", absl::GetFlag(FLAGS_p5_kara_params));
  if (!kara_params.ok()) return kara_params.status();
  std::vector<Side> sides(2);
  sides[0].policy = "kara";
  sides[1].policy = "none";
  for (Side& s : sides) {
    auto d = start_karakvd(dir, "karakvd-p5-" + s.policy, smollm_flags(pool, g.block_size));
    if (!d.ok()) return d.status();
    s.daemon = std::move(*d);
    auto c = attach(*s.daemon, decode_staging_bytes(g, prompt, seqs), "karakv-bench-p5-" + s.policy);
    if (!c.ok()) return c.status();
    s.client = std::move(*c);
    s.set.label = s.policy;
    s.set.c = s.client.get();
    const auto t = Clock::now();
    if (absl::Status st = prefill(s.set, g, std::vector<std::string>(seqs, s.policy), prompt,
                                      s.policy == "kara" ? *kara_params : std::map<std::string, double>{}); !st.ok()) return st;
    progress(absl::StrFormat("P5 %s: %d sequences x %d prompt tokens appended in %.2f s (pool %.2f GB)", s.policy,
                             seqs, prompt, seconds_since(t), pool / 1e9));
  }
  StepTensors tensors(g, seqs);
  const auto start = Clock::now();
  auto last_report = start;
  for (int step = 0; step < steps; ++step) {
    tensors.fill(prompt + step);
    for (int j = 0; j < 2; ++j) {
      Side& s = sides[(j + step) % 2];  // alternate which policy goes first
      if (absl::Status st = s.set.step(tensors); !st.ok()) return st;
    }
    if (seconds_since(last_report) >= 5 || step + 1 == steps) {
      last_report = Clock::now();
      auto ks = policy_stats(*sides[0].client, "kara");
      if (!ks.ok()) return ks.status();
      const int done = step + 1;
      progress(absl::StrFormat(
          "P5 step %d/%d (%.0f s): kara %.1f s in Step (%.0f tok/s, %d resident tokens/seq, compaction %.2f s = %.1f%%), "
          "none %.1f s in Step (%.0f tok/s)",
          done, steps, seconds_since(start), sides[0].set.decode_s, double(seqs) * done / sides[0].set.decode_s,
          int(ks->resident_tokens / std::max<uint32_t>(1, ks->sequences)), ks->compaction_seconds,
          100 * ks->compaction_seconds / sides[0].set.decode_s, sides[1].set.decode_s,
          double(seqs) * done / sides[1].set.decode_s));
    }
  }
  auto ks = policy_stats(*sides[0].client, "kara");
  if (!ks.ok()) return ks.status();
  auto ns = policy_stats(*sides[1].client, "none");
  if (!ns.ok()) return ns.status();
  const double kara_s = sides[0].set.decode_s, none_s = sides[1].set.decode_s;
  const double tokens = double(seqs) * steps;
  auto ms = [](std::vector<double> v, double p) {
    for (double& x : v) x *= 1e3;
    return percentile(std::move(v), p);
  };
  const double kara_p50 = ms(sides[0].set.step_s, 50), kara_p99 = ms(sides[0].set.step_s, 99);
  const double none_p50 = ms(sides[1].set.step_s, 50), none_p99 = ms(sides[1].set.step_s, 99);
  for (Side& s : sides) {
    s.set = DecodeSet{};
    s.client.reset();
    stop_or_warn(*s.daemon);
  }
  const std::string what = absl::StrFormat(", %d seqs, prompt %d + %d steps", seqs, prompt, steps);
  std::vector<Row> rows;
  rows.push_back({"P5", "Kara compaction time / decode time" + what, ks->compaction_seconds,
                  "time in Step, kara", kara_s, "s", true, Target{Target::Kind::kAtMost, 0.05}});
  rows.push_back({"P5", "decode tokens/s, kara", tokens / kara_s, "decode tokens/s, none", tokens / none_s,
                  "tok/s", false, std::nullopt});
  rows.push_back({"P5", "resident tokens/seq at the end, kara", double(ks->resident_tokens) / seqs,
                  "resident tokens/seq, none", double(ns->resident_tokens) / seqs, "tokens", true, std::nullopt});
  rows.push_back({"P5", absl::StrFormat("Kara compactions (%llu) mean time", (unsigned long long)ks->compactions),
                  ks->compactions ? 1e3 * ks->compaction_seconds / ks->compactions : 0, "decode step p50, kara",
                  kara_p50, "ms", false, std::nullopt});
  rows.push_back({"P5", "decode step p50 (all 30 layers), kara", kara_p50,
                  "decode step p50, none", none_p50, "ms", false, std::nullopt});
  rows.push_back({"P5", "decode step p99, kara", kara_p99, "decode step p99, none",
                  none_p99, "ms", false, std::nullopt});
  return rows;
}

std::string p5_how() {
  return absl::StrFormat("P5 SmolLM2-135M geometry fp16, block %d, %d seqs, prompt %d, %d decode steps; "
                         "kara and none in two daemons, steps alternating; time in Step calls",
                         absl::GetFlag(FLAGS_p5_block_size), absl::GetFlag(FLAGS_p5_sequences),
                         absl::GetFlag(FLAGS_p5_prompt), absl::GetFlag(FLAGS_p5_steps));
}

}  // namespace karakv::bench
