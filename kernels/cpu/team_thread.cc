#include "team_thread.h"

#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <chrono>

namespace karakv::kernels::cpu {
namespace {

// The team thread the calling thread is, if any.
thread_local const TeamThread* current_team = nullptr;

// How long each side spins before sleeping: longer than the gap between the kernels of one Step
// (validation and bookkeeping under the core's lock), much shorter than a scheduler tick.
constexpr auto kSpin = std::chrono::microseconds(20);

// Spins until pred() or kSpin has passed; returns pred(). Each turn yields the CPU rather than
// pausing in place: the other side (and its OpenMP team) must run for the spin to end, and on a
// machine with few cores a spinner that does not yield steals exactly the time it waits for.
template <class Pred>
bool spin_until(Pred pred) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    if (pred()) return true;
    sched_yield();
    if (std::chrono::steady_clock::now() >= until) return pred();
  }
}

}  // namespace

TeamThread::~TeamThread() {
  std::lock_guard<std::mutex> call(call_mu_);
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

bool on_a_team_thread() { return current_team != nullptr; }

bool TeamThread::on_team_thread() const { return current_team == this; }

void TeamThread::start() {
  if (width_ <= 1) return;
  std::lock_guard<std::mutex> call(call_mu_);
  start_locked();
}

void TeamThread::start_locked() {
  if (thread_.joinable()) return;
  thread_ = std::thread([this] { loop(); });
}

void TeamThread::post(void (*fn)(void*), void* ctx) {
  std::lock_guard<std::mutex> call(call_mu_);
  start_locked();
  fn_ = fn;
  ctx_ = ctx;
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ticket = posted_.load(std::memory_order_relaxed) + 1;
    posted_.store(ticket, std::memory_order_release);
  }
  cv_.notify_all();
  auto finished = [&] { return finished_.load(std::memory_order_acquire) >= ticket; };
  if (spin_until(finished)) return;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, finished);
}

void TeamThread::loop() {
  pthread_setname_np(pthread_self(), "karakv-kernels");  // its OpenMP team inherits the name
  current_team = this;
  omp_set_num_threads(width_);  // for regions that do not name a width
  // Make the team now: the first call should not pay for starting it.
#pragma omp parallel num_threads(width_)
  { [[maybe_unused]] volatile int touched = omp_get_thread_num(); }
  uint64_t done = 0;
  for (;;) {
    auto posted = [&] { return posted_.load(std::memory_order_acquire) > done; };
    if (!spin_until(posted)) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || posted(); });
      if (!posted()) return;  // stopping, nothing left to run
    }
    done = posted_.load(std::memory_order_acquire);
    fn_(ctx_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      finished_.store(done, std::memory_order_release);
    }
    cv_.notify_all();
  }
}

}  // namespace karakv::kernels::cpu
