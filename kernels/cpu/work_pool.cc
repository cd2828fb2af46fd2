#include "work_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>

namespace karakv::kernels::cpu {
namespace {

thread_local bool in_loop = false;
thread_local WorkPool* current_pool = nullptr;

// How long a helper that finished a loop looks for the next one before it sleeps: longer than the
// gap between the kernels of one Step (validation and bookkeeping under the core's lock), much
// shorter than a scheduler tick. It yields while it looks, so on a machine with few cores it does
// not take the time the caller needs.
constexpr auto kSpin = std::chrono::microseconds(20);

struct InLoop {
  InLoop() { in_loop = true; }
  ~InLoop() { in_loop = false; }
};

void run_serial(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> body,
                absl::FunctionRef<void()> done) {
  if (n <= 0) return;
  const bool outer = !in_loop;
  if (outer) in_loop = true;  // loops inside this one run here too
  for (int64_t b = 0; b < n; b += grain) body(b, std::min(n, b + grain));
  done();
  if (outer) in_loop = false;
}

}  // namespace

struct WorkPool::Job {
  Job(int64_t n_, int64_t grain_, absl::FunctionRef<void(int64_t, int64_t)> body_, absl::FunctionRef<void()> done_)
      : n(n_), grain(grain_), body(body_), done(done_) {}
  const int64_t n, grain;
  // Valid while the caller is in parallel_for: a thread calls them only while it holds a chunk whose
  // indices are not yet counted in `finished`, and the caller returns once all are.
  const absl::FunctionRef<void(int64_t, int64_t)> body;
  const absl::FunctionRef<void()> done;
  std::atomic<int64_t> next{0};      // the first index not yet claimed
  std::atomic<int64_t> finished{0};  // indices whose chunk has run
};

bool in_parallel_loop() { return in_loop; }

WorkPool::~WorkPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  std::lock_guard<std::mutex> lock(start_mu_);
  for (std::thread& t : threads_) t.join();
}

void WorkPool::start() {
  if (width_ <= 1 || started_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(start_mu_);
  if (!threads_.empty()) return;
  for (int i = 1; i < width_; ++i) {
    threads_.emplace_back([this] { helper_loop(); });
    // Named here, not by the helper itself: a helper that is not scheduled yet (a busy machine)
    // must already show as one in /proc, top and the tests that count them.
    pthread_setname_np(threads_.back().native_handle(), "karakv-kernels");
  }
  started_.store(true, std::memory_order_release);
}

int WorkPool::helpers() const {
  std::lock_guard<std::mutex> lock(start_mu_);
  return static_cast<int>(threads_.size());
}

void WorkPool::work_on(Job& job, std::atomic<uint64_t>& chunks) {
  // Each chunk's indices are counted only once the next claim has been tried, so that done() runs
  // while this thread still holds uncounted indices (the caller cannot have returned).
  auto count = [&job](int64_t k) {
    if (job.finished.fetch_add(k, std::memory_order_acq_rel) + k == job.n) job.finished.notify_all();
  };
  int64_t ran = 0, held = 0;
  for (;;) {
    const int64_t b = job.next.fetch_add(job.grain, std::memory_order_relaxed);
    if (b >= job.n) break;
    if (held > 0) count(held);
    const int64_t e = std::min(job.n, b + job.grain);
    job.body(b, e);
    held = e - b;
    ++ran;
  }
  if (ran > 0) {
    job.done();
    chunks.fetch_add(uint64_t(ran), std::memory_order_relaxed);
    count(held);
  }
}

void WorkPool::parallel_for(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> body, bool parallel,
                            absl::FunctionRef<void()> done) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (!parallel || width_ <= 1 || n <= grain || in_loop) return run_serial(n, grain, body, done);
  std::unique_lock<std::mutex> caller(caller_mu_, std::try_to_lock);
  if (!caller.owns_lock()) return run_serial(n, grain, body, done);  // another caller has the helpers
  start();
  auto job = std::make_shared<Job>(n, grain, body, done);
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = job;
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  {
    InLoop mark;
    work_on(*job, by_callers_);
  }
  // Only chunks a helper claimed and is running are left; a helper that has not started has none.
  for (int64_t f = job->finished.load(std::memory_order_acquire); f != n;
       f = job->finished.load(std::memory_order_acquire)) {
    job->finished.wait(f, std::memory_order_acquire);
  }
  std::lock_guard<std::mutex> lock(mu_);
  job_.reset();  // a helper waking later finds nothing to do
}

void WorkPool::helper_loop() {
  uint64_t seen = 0;
  for (;;) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until) {
      sched_yield();
    }
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_.load(std::memory_order_relaxed) != seen; });
      if (stop_) return;
      seen = generation_.load(std::memory_order_relaxed);
      job = job_;
    }
    while (held_.load(std::memory_order_acquire)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
    }
    if (job == nullptr) continue;
    InLoop mark;
    work_on(*job, by_helpers_);
  }
}

ScopedPool::ScopedPool(WorkPool* pool) : previous_(current_pool) { current_pool = pool; }
ScopedPool::~ScopedPool() { current_pool = previous_; }

void parallel_for(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> body, bool parallel,
                  absl::FunctionRef<void()> done) {
  if (current_pool == nullptr) {
    if (n > 0) run_serial(n, std::max<int64_t>(1, grain), body, done);
    return;
  }
  current_pool->parallel_for(n, grain, body, parallel, done);
}

int pool_width() { return current_pool == nullptr ? 1 : current_pool->width(); }

}  // namespace karakv::kernels::cpu
