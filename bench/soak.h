// karakv-bench soak: worker processes do random Attach / CreateSequence / Append / Step / Compact /
// ForkSequence / ReleaseSequence / Detach and crash on purpose against one karakvd for a set time,
// while the pool invariant is checked, a sample of Step outputs is compared with a float64
// reference, and the daemon's memory is watched.
#pragma once

#include <string>

#include "harness.h"

namespace karakv::bench {

// Runs the soak (--workers, --minutes, --seed, --soak_* flags), prints its table and writes
// soak.csv into `out_dir` (when not empty). Returns the exit status: 0 when nothing unexpected
// happened, 1 otherwise (unexpected errors or worker exits, an invariant failure, a reference
// mismatch, resources not returned, RSS growth over --soak_max_rss_growth_pct).
int run_soak(const TempDir& dir, const std::string& out_dir);

// How long the soak's workers run (--minutes), in seconds.
double soak_seconds();

// The worker role (`karakv-bench soak-worker`, started by run_soak). Returns the exit status.
int soak_worker_main();

}  // namespace karakv::bench
