// karakv-bench prefix: time to first token and prefill avoided with the prefix cache vs without,
// for 2-8 concurrent workers whose requests share a system prompt.
//
// W workers serve requests that share a system prompt and differ after it, against a
// daemon with the prefix cache and one without, in one run. A request's time to first token is
// everything the worker asks of the daemon before the first generated token exists: start the
// sequence (from the cached prefix when there is one), Append the K/V of every token it had to
// prefill, Attend those tokens' queries on every layer (their prefill attention over the whole
// prompt, cached part included), then the first decode Step on every layer. The worker's own
// projections and MLP are not modelled; they scale with the prefill tokens, counted separately.
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench_common.h"
#include "common/synthetic.h"
#include "harness.h"
#include "karakv/client.h"

ABSL_FLAG(int32_t, prefix_system_tokens, 1000, "prefix: tokens of the system prompt every request shares");
ABSL_FLAG(int32_t, prefix_own_tokens, 64, "prefix: tokens of each request after the system prompt");
ABSL_FLAG(int32_t, prefix_requests, 4, "prefix: requests per worker (after one cold request)");
ABSL_FLAG(std::string, prefix_workers, "2,4,8", "prefix: worker counts (one session each, concurrent)");

namespace karakv::bench {

std::vector<int32_t> prefix_prompt(int system_tokens, int own_tokens, int request) {
  std::vector<int32_t> ids(system_tokens + own_tokens);
  std::iota(ids.begin(), ids.begin() + system_tokens, 1);
  std::iota(ids.begin() + system_tokens, ids.end(), 1000000 + request * own_tokens);
  return ids;
}

void fill_prompt_kv(const kn::Geometry& g, const std::vector<int32_t>& prompt, int first, uint8_t* k, uint8_t* v) {
  const int todo = int(prompt.size()) - first;
  const size_t tok = g.kv_token_elems() * kn::dtype_size(g.dtype);
  for (int l = 0; l < g.num_layers; ++l) {
    for (int i = 0; i < todo; ++i) {
      const int p = first + i;
      karakv::synthetic::fill_token(k + (size_t(l) * todo + i) * tok, g, 1, Tensor::kKey, prompt[p], l, p);
      karakv::synthetic::fill_token(v + (size_t(l) * todo + i) * tok, g, 1, Tensor::kValue, prompt[p], l, p);
    }
  }
}

absl::StatusOr<PrefixRequestResult> prefix_request(karakv::Client& c, const kn::Geometry& g,
                                                   const std::vector<int32_t>& prompt) {
  const int n = int(prompt.size());
  const auto start = Clock::now();
  auto created = c.CreateFromPrefix(karakv::SequenceOptions{}, prompt);
  if (!created.ok()) return created.status();
  const int cached = created->cached_tokens, todo = n - cached;
  // K/V of token i depends on its id and position (as a model's would, given the same prefix).
  c.reset_staging();
  auto k = c.alloc(c.append_bytes(todo)), v = c.alloc(c.append_bytes(todo));
  auto q = c.alloc(c.q_bytes(todo)), out = c.alloc(c.q_bytes(todo));
  for (auto* b : {&k, &v, &q, &out}) {
    if (!b->ok()) return b->status();
  }
  fill_prompt_kv(g, prompt, cached, k->data(), v->data());
  auto len = c.Append(created->id, std::span<const int32_t>(prompt.data() + cached, todo), *k, *v);
  if (!len.ok()) return len.status();
  for (int l = 0; l < g.num_layers; ++l) {
    for (int i = 0; i < todo; ++i) {
      karakv::synthetic::fill_query(q->as<float>().data() + size_t(i) * g.q_token_elems(), g, 1, prompt[cached + i], l,
                                    cached + i);
    }
    if (auto s = c.Attend(created->id, l, todo, *q, *out); !s.ok()) return s;
  }
  auto sk = c.alloc(c.step_kv_bytes(1)), sv = c.alloc(c.step_kv_bytes(1));
  auto sq = c.alloc(c.q_bytes(1)), so = c.alloc(c.q_bytes(1));
  for (auto* b : {&sk, &sv, &sq, &so}) {
    if (!b->ok()) return b->status();
  }
  const uint64_t ids[] = {created->id};
  for (int l = 0; l < g.num_layers; ++l) {
    karakv::synthetic::fill_token(sk->data(), g, 1, Tensor::kKey, 7, l, n);
    karakv::synthetic::fill_token(sv->data(), g, 1, Tensor::kValue, 7, l, n);
    karakv::synthetic::fill_query(sq->as<float>().data(), g, 1, 7, l, n);
    if (auto r = c.Step(l, ids, *sk, *sv, *sq, *so); !r.ok()) return r.status();
  }
  PrefixRequestResult r;
  r.ttft_s = seconds_since(start);
  r.prefilled = todo;
  r.cached = cached;
  if (auto s = c.Release(created->id); !s.ok()) return s.status();
  return r;
}

absl::StatusOr<std::vector<Row>> run_prefix(const TempDir& dir) {
  const kn::Geometry g = smollm_geometry();
  const int system = std::max(1, absl::GetFlag(FLAGS_prefix_system_tokens));
  const int own = std::max(1, absl::GetFlag(FLAGS_prefix_own_tokens));
  const int requests = std::max(1, absl::GetFlag(FLAGS_prefix_requests));
  const std::vector<int> workers_list = parse_lengths(absl::GetFlag(FLAGS_prefix_workers));
  const int n = system + own;
  std::vector<Row> rows;
  std::string table = absl::StrFormat(
      "prefix: %d-token system prompt + %d own tokens per request, %d requests per worker (TTFT in ms)\n"
      "%8s %6s %10s %10s %10s %12s %12s %9s\n",
      system, own, requests, "workers", "cache", "TTFT p50", "TTFT mean", "TTFT p90", "prefilled", "cached", "hit rate");
  for (int workers : workers_list) {
    std::map<std::string, std::vector<double>> ttft;
    std::map<std::string, uint64_t> prefilled, cached;
    double hit_rate = 0;
    uint64_t hit_tokens = 0, lookup_tokens = 0;
    for (const std::string cache : {"on", "off"}) {
      // Every worker's live sequence, the cached prompt, and slack.
      const size_t blocks = size_t(workers + 1) * ((n + g.block_size - 1) / g.block_size + 2) + 64;
      std::vector<std::string> flags = smollm_flags(blocks * g.block_bytes());
      flags.push_back("--prefix_cache=" + cache);
      auto d = start_karakvd(dir, absl::StrCat("karakvd-prefix-", workers, "-", cache), flags);
      if (!d.ok()) return d.status();
      const uint64_t staging = 2 * append_tensor_bytes(g, n) + 2 * size_t(n) * g.q_token_elems() * 4 + (4 << 20);
      std::vector<std::unique_ptr<karakv::Client>> clients;
      for (int w = 0; w < workers; ++w) {
        auto c = attach(*d, staging, absl::StrCat("karakv-bench-prefix-", w));
        if (!c.ok()) return c.status();
        clients.push_back(std::move(*c));
      }
      // The first request of the system prompt (a cold cache); then every worker at once.
      auto first = prefix_request(*clients[0], g, prefix_prompt(system, own, 0));
      if (!first.ok()) return first.status();
      auto before = clients[0]->Stats();
      if (!before.ok()) return before.status();
      std::vector<std::vector<PrefixRequestResult>> results(workers);
      std::vector<absl::Status> errors(workers);
      std::vector<std::thread> threads;
      for (int w = 0; w < workers; ++w) {
        threads.emplace_back([&, w] {
          for (int r = 0; r < requests; ++r) {
            auto res = prefix_request(*clients[w], g, prefix_prompt(system, own, 1 + w * requests + r));
            if (!res.ok()) {
              errors[w] = res.status();
              return;
            }
            results[w].push_back(*res);
          }
        });
      }
      for (auto& t : threads) t.join();
      for (const absl::Status& e : errors) {
        if (!e.ok()) return e;
      }
      auto after = clients[0]->Stats(true);
      if (!after.ok()) return after.status();
      if (!after->invariant_error.empty()) return absl::InternalError(after->invariant_error);
      for (const auto& per : results) {
        for (const PrefixRequestResult& r : per) {
          ttft[cache].push_back(r.ttft_s * 1e3);
          prefilled[cache] += r.prefilled;
          cached[cache] += r.cached;
        }
      }
      if (cache == "on") {
        lookup_tokens = after->prefix_lookup_tokens - before->prefix_lookup_tokens;
        hit_tokens = after->prefix_hit_tokens - before->prefix_hit_tokens;
        hit_rate = lookup_tokens > 0 ? double(hit_tokens) / double(lookup_tokens) : 0;
      }
      clients.clear();
      stop_or_warn(*d);
    }
    for (const std::string cache : {"on", "off"}) {
      const std::vector<double>& t = ttft[cache];
      const double mean = std::accumulate(t.begin(), t.end(), 0.0) / double(t.size());
      absl::StrAppend(&table, absl::StrFormat("%8d %6s %10.1f %10.1f %10.1f %12llu %12llu %8.1f%%\n", workers, cache,
                                              percentile(t, 50), mean, percentile(t, 90),
                                              (unsigned long long)prefilled[cache], (unsigned long long)cached[cache],
                                              cache == "on" ? 100 * hit_rate : 0.0));
    }
    Row ttft_row;
    ttft_row.mode = "prefix";
    ttft_row.metric = absl::StrFormat("TTFT p50, %d workers", workers);
    ttft_row.karakv = percentile(ttft["on"], 50);
    ttft_row.baseline_name = "no prefix cache";
    ttft_row.baseline = percentile(ttft["off"], 50);
    ttft_row.unit = "ms";
    rows.push_back(ttft_row);
    Row avoided;
    avoided.mode = "prefix";
    avoided.metric = absl::StrFormat("prefill tokens avoided, %d workers", workers);
    avoided.karakv = double(prefilled["off"] - prefilled["on"]);
    avoided.baseline_name = "prefilled without cache";
    avoided.baseline = double(prefilled["off"]);
    avoided.unit = "tokens";
    avoided.percent = true;
    rows.push_back(avoided);
    Row hits;
    hits.mode = "prefix";
    hits.metric = absl::StrFormat("hit rate, %d workers", workers);
    hits.karakv = double(hit_tokens);
    hits.baseline_name = "looked-up tokens";
    hits.baseline = double(lookup_tokens);
    hits.unit = "tokens";
    hits.percent = true;
    rows.push_back(hits);
  }
  extra_reports().push_back(table);
  return rows;
}

std::string prefix_how() {
  return absl::StrFormat("prefix SmolLM2-135M geometry fp16, %d-token system prompt + %d own "
                         "tokens, %d requests per worker after one cold request, workers %s; "
                         "cache on and off in two daemons", absl::GetFlag(FLAGS_prefix_system_tokens),
                         absl::GetFlag(FLAGS_prefix_own_tokens), absl::GetFlag(FLAGS_prefix_requests),
                         absl::GetFlag(FLAGS_prefix_workers));
}

}  // namespace karakv::bench
