// The one thread that starts the CPU backend's OpenMP parallel regions.
//
// libgomp gives every thread that starts a parallel region a team of its own (num_threads - 1
// threads) and keeps it for that thread's lifetime. Kernels called straight from the daemon's
// threads (a ring thread per fast-path session, gRPC's handler threads) would each grow such a
// team: 16 ring threads at 8 kernel threads are 112 OpenMP threads, of which at most 7 ever work at
// once (the core's lock runs one kernel at a time). Instead the backend hands each call with a
// parallel region to this thread and waits for it, so the process has one team of the configured
// width whichever thread calls. With a width of 1 there is no team and no thread: calls run on the
// caller.
//
// Hand-over: the caller posts the call and wakes this thread; both sides spin for a few
// microseconds before sleeping on a condition variable, so the back-to-back kernels of one decode
// step do not pay a wake-up each.
#pragma once

#include <omp.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>

namespace karakv::kernels::cpu {

// Whether the calling thread is some backend's team thread.
bool on_a_team_thread();

class TeamThread {
 public:
  // `width`: the OpenMP team size the calls get (omp_set_num_threads on this thread).
  explicit TeamThread(int width) : width_(width) {}
  ~TeamThread();
  TeamThread(const TeamThread&) = delete;
  TeamThread& operator=(const TeamThread&) = delete;

  int width() const { return width_; }

  // Runs f() where the backend's parallel regions run and returns its result: on this thread, or
  // on the caller when the width is 1 or the caller is this thread (a kernel calling a kernel).
  // Callers from several threads take turns.
  template <class F>
  auto run(F&& f) -> std::invoke_result_t<F&> {
    if (on_team_thread()) return f();
    if (width_ <= 1) {
      omp_set_num_threads(1);  // regions that do not name a width: none on this thread either
      return f();
    }
    using R = std::invoke_result_t<F&>;
    if constexpr (std::is_void_v<R>) {
      post(&call<F>, static_cast<void*>(&f));
    } else {
      struct Job {
        std::remove_reference_t<F>* f;
        R result{};
      } job{&f};
      post(&call_result<Job>, &job);
      return std::move(job.result);
    }
  }

  // Starts the thread and its OpenMP team now (both start on the first run() otherwise).
  void start();

 private:
  template <class F>
  static void call(void* ctx) {
    (*static_cast<std::remove_reference_t<F>*>(ctx))();
  }
  template <class Job>
  static void call_result(void* ctx) {
    Job* job = static_cast<Job*>(ctx);
    job->result = (*job->f)();
  }

  bool on_team_thread() const;
  // Hands fn(ctx) to the thread and waits until it ran.
  void post(void (*fn)(void*), void* ctx);
  void loop();
  void start_locked();  // call_mu_ held

  const int width_;
  std::mutex call_mu_;  // one caller at a time; guards starting the thread
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  // Calls posted and finished; the thread runs call posted_ while finished_ < posted_.
  std::atomic<uint64_t> posted_{0};
  std::atomic<uint64_t> finished_{0};
  void (*fn_)(void*) = nullptr;
  void* ctx_ = nullptr;
  bool stop_ = false;  // mu_
};

}  // namespace karakv::kernels::cpu
