// karakv-bench serve: a continuous-batching serving benchmark (request queue, max decode batch,
// fixed KV pool, admission and preemption by recompute) driven by worker processes through the
// SDK and a real karakvd, swept over max batch and compression policy.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "harness.h"

namespace karakv::bench {

// One karakv-vs-baseline number of the serve sweep (the P4 targets, and context rows).
struct ServeComparison {
  std::string metric;
  double value = 0;
  std::string baseline_name;
  double baseline = 0;
  std::string unit;
  double at_least = 0;  // the target ratio value / baseline; 0: context, no target
};

struct ServeResult {
  std::string mode = "P4";  // the summary rows' mode: "P4" (closed loop) or "serve-open" (--serve_rates)
  std::vector<ServeComparison> comparisons;
  std::string report;  // the per-run table, printed after the summary
  std::string how;     // one line: the exact workload
};

// Runs the sweep (--serve_* flags, or --quick); writes serve_runs.csv and serve_series.csv into
// `out_dir` when it is not empty.
absl::StatusOr<ServeResult> run_serve(const TempDir& dir, const std::string& out_dir);

// The worker role (`karakv-bench serve-worker`, started by run_serve): executes the scheduler's
// commands arriving on file descriptor 3. Returns the process exit status.
int serve_worker_main();

}  // namespace karakv::bench
