// The CPU backend's parallel loops: the calling thread and a few helper threads claim chunks of a
// loop from a shared counter, and the caller never waits for a helper that has not started.
//
// A sidecar shares its node: a helper may not be scheduled for milliseconds. A fork-join team
// (OpenMP's, which this replaced) makes every member reach the loop's end barrier, so one member
// that is not running stalls the whole call, and a 1 MiB copy once took 70x as long as a 64 KiB
// one on a busy machine. Here the caller posts the loop, wakes the helpers and starts claiming chunks
// itself; a helper that arrives late finds the work claimed and goes back to sleep. The caller waits
// only for chunks a helper has already claimed and is running. A busy machine costs parallelism,
// never progress.
//
// One pool per backend, shared by every thread that calls it (ring threads, gRPC handlers): its
// width - 1 helpers are the only threads it adds. A loop started while another caller's loop holds
// the helpers, or from inside a loop's body, runs on its caller alone.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"

namespace karakv::kernels::cpu {

class WorkPool {
 public:
  // `width`: the threads a loop may use, the caller included (width - 1 helpers, started on the
  // first loop that uses them).
  explicit WorkPool(int width) : width_(width < 1 ? 1 : width) {}
  ~WorkPool();
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  int width() const { return width_; }
  // Starts the helpers now (the first loop should not pay for it). Idempotent.
  void start();

  // Runs body(begin, end) over [0, n) in chunks of at most `grain` indices, on the caller and
  // whichever helpers arrive, and returns when every chunk has run. Each thread that ran a chunk
  // calls done() once after its last (per-thread clean-up); done may be null. Runs everything on the
  // caller when `parallel` is false, the width is 1, the helpers are busy with another caller's loop,
  // or the caller is inside a loop already.
  void parallel_for(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> body,
                    bool parallel = true, absl::FunctionRef<void()> done = [] {});

  // Counters for tests: chunks run by the callers and by the helpers since the pool was made.
  uint64_t chunks_by_callers() const { return by_callers_.load(std::memory_order_relaxed); }
  uint64_t chunks_by_helpers() const { return by_helpers_.load(std::memory_order_relaxed); }
  // Helper threads running now (0 before the first parallel loop).
  int helpers() const;
  // For tests: while held, a helper that wakes takes no work, as if it were not scheduled.
  void hold_helpers(bool held) { held_.store(held, std::memory_order_release); }

 private:
  struct Job;
  void helper_loop();
  // Claims and runs chunks of `job` until none are left, and adds how many it ran to `chunks`
  // before its last chunk counts as finished (so the caller's return sees the count).
  static void work_on(Job& job, std::atomic<uint64_t>& chunks);

  const int width_;
  mutable std::mutex start_mu_;
  std::atomic<bool> started_{false};
  std::vector<std::thread> threads_;
  std::mutex caller_mu_;  // one loop on the helpers at a time; others run on their callers

  std::mutex mu_;  // guards job_, generation_, stop_
  std::condition_variable wake_;
  std::shared_ptr<Job> job_;
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;

  std::atomic<uint64_t> by_callers_{0}, by_helpers_{0};
  std::atomic<bool> held_{false};
};

// Whether the calling thread is running a WorkPool loop's body (a helper's, or a caller's).
bool in_parallel_loop();

// The pool that cpu::parallel_for uses on this thread while a backend kernel runs: the backend sets
// it around each call, so the kernels in compress.cc, merge.cc and quant_storage.cc need no
// handle. Restores the previous one when it ends.
class ScopedPool {
 public:
  explicit ScopedPool(WorkPool* pool);
  ~ScopedPool();
  ScopedPool(const ScopedPool&) = delete;
  ScopedPool& operator=(const ScopedPool&) = delete;

 private:
  WorkPool* previous_;
};

// WorkPool::parallel_for on this thread's pool (ScopedPool); on the caller alone when there is none.
void parallel_for(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> body, bool parallel = true,
                  absl::FunctionRef<void()> done = [] {});
// The width of this thread's pool (1 when there is none): for sizing chunks.
int pool_width();

}  // namespace karakv::kernels::cpu
