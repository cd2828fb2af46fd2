// karakv-bench: measures karakv's performance targets, each side by side with its baseline in one
// run, and prints the numbers, their ratio, the target and PASS/MISS. It starts (and stops) its own
// karakvd and redis-server on Unix sockets in a private temporary directory.
//
//   p1  Append throughput (GB/s of K/V into the pool) vs Redis SET of the same payload   >= 3x
//   p2  decode attention bandwidth vs the streaming-read bandwidth  >= 80% (>= 70% through Step)
//   p3  Step round-trip p50 vs an empty unary gRPC call (Ping) on the same server        <= 2x
//   p5  Kara's compaction time as a share of decode time (32 seqs x 2048 steps)          <= 5%
//       (with decode tokens/s of kara vs none, decoded side by side)
//   memory  resident KV bytes per sequence over 3000 decode steps: none, kara, snapkv, streaming
//   quant   quantized storage (kivi2/4, tq2/3/4, kara+kivi4): actual vs nominal compression ratio at
//           1k/4k/16k tokens, attention error vs fp16, quantized attention time vs fp16
//   prefix  2-8 workers sharing a system prompt: TTFT and prefill avoided with vs without prefix cache
//   ring    decode fast path: Step round trip via the shared-memory ring vs gRPC vs Ping
//   serve   a continuous-batching serving sweep (serve.cc): output throughput vs max batch per policy (P4)
//   soak    N worker processes doing random operations and crashes against one karakvd for T minutes
//           (soak.cc): errors by code, pool invariant, sampled outputs vs a reference, daemon RSS
//
// Each mode has its own file (p1_append.cc, p2_decode.cc, p3_step.cc, p5_compaction.cc, memory.cc,
// quant.cc, prefix.cc, ring.cc, serve.cc, soak.cc; shared pieces in bench_common.h, processes in
// harness.h). This file holds the flags every mode shares, the summary table and its CSV, and main.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench_common.h"
#include "harness.h"
#include "serve.h"
#include "soak.h"

ABSL_FLAG(std::string, karakvd, "", "karakvd binary (default: ../server/karakvd next to this binary)");
ABSL_FLAG(std::vector<std::string>, karakvd_flags, {},
          "Extra flags for every karakvd it starts, comma-separated (e.g. --backend=cuda; they come last, so they "
          "override the mode's own)");
ABSL_FLAG(std::string, out_dir, "",
          "Write one CSV per mode (p1.csv, p2.csv, p3.csv, p5.csv, memory.csv, quant.csv, prefix.csv; memory also "
          "memory_series.csv, quant also quant_ratio.csv and quant_formats.csv) "
          "into this directory");
ABSL_FLAG(bool, csv, false, "Also print the results as CSV on stdout");
ABSL_FLAG(int32_t, timeout_s, 2400, "Abort (and stop the child processes) after this many seconds");
ABSL_FLAG(bool, busy, false,
          "Run every mode with one CPU-burning process per hardware thread beside it (baselines included): "
          "the numbers of a busy node");
ABSL_FLAG(bool, strict, false, "Exit with status 3 when any target is missed");

namespace {

using namespace karakv::bench;  // the harness (harness.h), the rows and the modes (bench_common.h)

std::string number(double v) {
  if (v >= 100) return absl::StrFormat("%.0f", v);
  if (v >= 10) return absl::StrFormat("%.1f", v);
  return absl::StrFormat("%.2f", v);
}

void print_table(const std::vector<Row>& rows) {
  std::vector<std::vector<std::string>> cells = {
      {"mode", "metric", "karakv", "baseline", "baseline value", "ratio", "target", "result"}};
  for (const Row& r : rows) {
    cells.push_back({r.mode, r.metric, number(r.karakv) + " " + r.unit, r.baseline_name,
                     number(r.baseline) + " " + r.unit, r.ratio_text(), r.target_text(), r.verdict()});
  }
  std::vector<size_t> width(cells[0].size(), 0);
  for (const auto& line : cells)
    for (size_t i = 0; i < line.size(); ++i) width[i] = std::max(width[i], line[i].size());
  for (size_t n = 0; n < cells.size(); ++n) {
    std::string out;
    for (size_t i = 0; i < cells[n].size(); ++i) {
      out += cells[n][i];
      if (i + 1 < cells[n].size()) out += std::string(width[i] - cells[n][i].size() + 2, ' ');
    }
    std::printf("%s\n", out.c_str());
    if (n == 0) {
      size_t total = 0;
      for (size_t w : width) total += w + 2;
      std::printf("%s\n", std::string(total - 2, '-').c_str());
    }
  }
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

std::string to_csv(const std::vector<Row>& rows) {
  std::string out = "mode,metric,karakv,baseline_name,baseline,unit,ratio,target,result,ratio_text\n";
  for (const Row& r : rows) {
    out += absl::StrCat(csv_field(r.mode), ",", csv_field(r.metric), ",", absl::StrFormat("%.6g", r.karakv), ",",
                        csv_field(r.baseline_name), ",", absl::StrFormat("%.6g", r.baseline), ",",
                        csv_field(r.unit), ",", absl::StrFormat("%.6g", r.ratio()), ",",
                        csv_field(r.target_text()), ",", r.verdict(), ",", r.ratio_text(), "\n");
  }
  return out;
}

// Fraction of all CPUs busy over `window` (from /proc/stat), taken while this benchmark is idle:
// what other processes are using. -1 when /proc/stat cannot be read.
double busy_fraction(absl::Duration window) {
  auto read = [](uint64_t* idle, uint64_t* total) {
    std::ifstream in("/proc/stat");
    std::string cpu;
    in >> cpu;
    uint64_t v = 0, i = 0;
    *idle = *total = 0;
    while (in >> v) {
      *total += v;
      if (i == 3 || i == 4) *idle += v;  // idle, iowait
      if (++i == 8) break;                 // user..steal; guest time is already in user
    }
    return cpu == "cpu" && i == 8;
  };
  uint64_t idle0, total0, idle1, total1;
  if (!read(&idle0, &total0)) return -1;
  absl::SleepFor(window);
  if (!read(&idle1, &total1) || total1 <= total0) return -1;
  return 1.0 - double(idle1 - idle0) / double(total1 - total0);
}

// serve: the P4 comparisons as rows (the per-run table goes to the extra reports).
std::string& serve_how() {
  static std::string how;
  return how;
}

absl::StatusOr<std::vector<Row>> run_serve_rows(const TempDir& dir) {
  auto result = run_serve(dir, absl::GetFlag(FLAGS_out_dir));
  if (!result.ok()) return result.status();
  std::vector<Row> rows;
  for (const ServeComparison& c : result->comparisons) {
    std::optional<Target> target;
    if (c.at_least > 0) target = Target{Target::Kind::kAtLeast, c.at_least};
    rows.push_back({result->mode, c.metric, c.value, c.baseline_name, c.baseline, c.unit, false, target});
  }
  extra_reports().push_back(result->report);
  serve_how() = result->how;
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "karakv-bench p1|p2|p3|p5|memory|quant|prefix|ring|serve|soak|cluster|shared|all [--karakvd=PATH] [--karakvd_flags=F,...] [--redis_server=PATH] [--out_dir=DIR] [--csv]\n"
      "  p1      Append throughput vs Redis SET (target >= 3x)\n"
      "  p2      decode attention bandwidth vs streaming-read bandwidth (target >= 80%; >= 70% through Step)\n"
      "  p3      Step round-trip p50 vs empty gRPC Ping p50 (target <= 2x)\n"
      "  p5      Kara compaction time / decode time (target <= 5%), decode tokens/s kara vs none\n"
      "  memory  resident KV per sequence over decode steps: none, kara, snapkv, streaming\n"
      "  quant   quantized storage: actual vs nominal compression ratio, attention error and time vs fp16\n"
      "  prefix  2-8 workers sharing a 1000-token system prompt: TTFT and prefill avoided with vs without prefix cache\n"
      "  shared  pool memory of sequences sharing a cached system prompt, per configuration (Kara's prompt kept,\n"
      "          windowed or auto, with or without a budget; not part of 'all')\n"
      "  serve   continuous-batching serving sweep: output throughput vs max batch per policy (P4), TPOT,\n"
      "          TTFT, preemptions, KV held, compression by context length (not part of 'all': ~25 min;\n"
      "          --quick: ~1 min); --serve_rates=R,...: open loop, Poisson arrivals, TTFT from arrival\n"
      "  ring    decode fast path: Step round trip via the shared-memory ring vs gRPC vs Ping (target <= 0.1x\n"
      "          of Ping), synthetic-worker decode tokens/s with and without the ring\n"
      "  soak    --workers=N worker processes doing random Attach/Create/Append/Step/Compact/Fork/Release/\n"
      "          Detach and crashes for --minutes=T against one karakvd (--seed): ops/s, errors by code,\n"
      "          pool invariant, sampled Step outputs vs a float64 reference, daemon RSS growth; exits 1 on\n"
      "          anything unexpected (runs alone, not part of 'all')\n"
      "  cluster two karakvd nodes sharing one redis-server as --prefix_tier (and one daemon without): TTFT of a\n"
      "          tier hit vs a cold prefill (target <= 0.3x), a tier miss's cost, prefill avoided, and Append\n"
      "          throughput with ids when the tier never hits (target >= 0.98x; not part of 'all')\n"
      "  Several modes may be given: karakv-bench p5 memory");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() == 2 && std::string(args[1]) == "serve-worker") return serve_worker_main();
  if (args.size() == 2 && std::string(args[1]) == "soak-worker") return soak_worker_main();
  if (args.size() < 2) {
    std::fprintf(stderr, "usage: karakv-bench p1|p2|p3|p5|memory|quant|prefix|ring|serve|soak|cluster|shared|all... [flags]  (--help for the flags)\n");
    return 2;
  }
  const bool soak = std::any_of(args.begin() + 1, args.end(), [](const char* a) { return std::string(a) == "soak"; });
  if (soak && args.size() != 2) {
    std::fprintf(stderr, "karakv-bench: soak runs alone (it has its own table and exit status)\n");
    return 2;
  }
  const std::vector<std::string> known = {"p1", "p2", "p3", "p5", "memory", "quant", "prefix", "ring"};
  std::vector<std::string> modes;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string m = args[i];
    if (m == "all") {
      modes.insert(modes.end(), known.begin(), known.end());
    } else if (m == "serve" || m == "soak" || m == "cluster" || m == "shared" || std::find(known.begin(), known.end(), m) != known.end()) {
      modes.push_back(m);
    } else {
      std::fprintf(stderr, "karakv-bench: unknown mode '%s'; expected p1, p2, p3, p5, memory, quant, prefix, ring, serve, soak, cluster, shared or all\n", m.c_str());
      return 2;
    }
  }
  const std::string mode = absl::StrJoin(std::vector<char*>(args.begin() + 1, args.end()), " ");

  struct sigaction sa{};
  sa.sa_handler = on_fatal_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGALRM, SIGHUP}) sigaction(sig, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
  // A soak longer than --timeout_s gets its length plus five minutes to stop and report.
  const double limit = std::max<double>(1, absl::GetFlag(FLAGS_timeout_s));
  alarm(static_cast<unsigned>(soak ? std::max(limit, soak_seconds() + 300) : limit));

  auto dir = TempDir::make();
  if (!dir.ok()) {
    std::fprintf(stderr, "karakv-bench: %s\n", dir.status().ToString().c_str());
    return 1;
  }
  if (soak) return run_soak(*dir, absl::GetFlag(FLAGS_out_dir));
  std::unique_ptr<Burners> burners;
  if (absl::GetFlag(FLAGS_busy)) {
    burners = std::make_unique<Burners>(int(std::max(1u, std::thread::hardware_concurrency())));
    progress(absl::StrFormat("--busy: %d burner processes keep every CPU busy until the end", burners->count()));
  }
  std::vector<Row> all;
  std::vector<std::string> busy;  // other processes' CPU use just before each mode
  for (const std::string& m : modes) {
    const double b = busy_fraction(absl::Seconds(1));
    busy.push_back(b < 0 ? m + " ?" : absl::StrFormat("%s %.0f%%", m, 100 * b));
    const auto start = Clock::now();
    absl::StatusOr<std::vector<Row>> rows = m == "p1"     ? run_p1(*dir)
                                            : m == "p2"     ? run_p2(*dir)
                                            : m == "p3"     ? run_p3(*dir)
                                            : m == "p5"     ? run_p5(*dir)
                                            : m == "quant"  ? run_quant(*dir)
                                            : m == "prefix" ? run_prefix(*dir)
                                            : m == "serve"  ? run_serve_rows(*dir)
                                            : m == "ring"   ? run_ring(*dir)
                                            : m == "cluster" ? run_cluster(*dir)
                                            : m == "shared" ? run_shared(*dir)
                                                            : run_memory(*dir);
    if (!rows.ok()) {
      std::fprintf(stderr, "karakv-bench: %s failed: %s\n", m.c_str(), rows.status().ToString().c_str());
      return 1;
    }
    progress(absl::StrFormat("%s done in %.1f s", m, seconds_since(start)));
    if (const std::string out = absl::GetFlag(FLAGS_out_dir); !out.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(out, ec);
      std::ofstream f(out + "/" + m + ".csv");
      f << to_csv(*rows);
      if (!f) {
        std::fprintf(stderr, "karakv-bench: cannot write %s/%s.csv\n", out.c_str(), m.c_str());
        return 1;
      }
    }
    all.insert(all.end(), rows->begin(), rows->end());
  }

  std::vector<std::string> how;
  for (const std::string& m : modes) {
    if (m == "p1") how.push_back(p1_how());
    if (m == "p2") how.push_back(p2_how());
    if (m == "p3") how.push_back(p3_how());
    if (m == "p5") how.push_back(p5_how());
    if (m == "memory") how.push_back(memory_how());
    if (m == "ring") how.push_back(ring_how());
    if (m == "quant") how.push_back(quant_how());
    if (m == "serve") how.push_back(serve_how());
  }
  for (const std::string& m : modes) {
    if (m == "prefix") how.push_back(prefix_how());
    if (m == "cluster") how.push_back(cluster_how());
    if (m == "shared") how.push_back(shared_how());
  }
  const std::string busy_note =
      burners ? absl::StrFormat("; --busy: %d burner processes on every CPU (karakv and its baselines under the "
                                "same load)", burners->count())
              : "";
  std::printf("\nkarakv-bench %s on %d hardware threads%s; CPU busy with other work in the second before each "
              "mode: %s (%s)\n%s\n\n",
              mode.c_str(), int(std::thread::hardware_concurrency()), busy_note.c_str(),
              absl::StrJoin(busy, ", ").c_str(),
              burners ? "the burners' share, by design" : "above a few % the ratios are unreliable",
              absl::StrJoin(how, "\n").c_str());
  print_table(all);
  for (const std::string& r : extra_reports()) std::printf("\n%s", r.c_str());
  if (absl::GetFlag(FLAGS_csv)) std::printf("\n%s", to_csv(all).c_str());
  const bool missed = std::any_of(all.begin(), all.end(), [](const Row& r) { return r.verdict() == "MISS"; });
  return missed && absl::GetFlag(FLAGS_strict) ? 3 : 0;
}
