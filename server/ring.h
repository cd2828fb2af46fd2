// The daemon's end of the decode fast path: one consumer thread per session that attached with
// fast_path. It takes Step, Attend, Append (one sequence or several) and ReadKV commands from the
// session's command ring (karakv/v1/ring.h), resolves their staging ranges and calls the request
// gate's entries that the gRPC handlers call too (same validation, core calls, status codes,
// metrics), and posts the outcome to the completion ring.
//
// Threads, not a poller pool: a decode step is a chain of dependent Steps (layer l + 1 needs layer
// l's output), so a ring has at most a few commands in flight and its thread is either running one
// or waiting; a thread per ring gives each session its own futex and no head-of-line blocking.
// A thread whose session ended waits for the next session (up to `idle_threads` wait), so workers
// that attach and detach all the time reuse threads instead of making and ending one per session
// (which also grew the heap's arenas). karakvd starts that many threads with the daemon
// (`start_threads`), so the set of threads is fixed unless more sessions than that are open at
// once. Ring threads have no kernel threads of their own: the CPU backend's loops run on the caller
// and its one pool of helpers (kernels/cpu/work_pool.h), so N ring threads add N threads, not N
// teams.
// Waiting: spin for `spin` after the last command, then FUTEX_WAIT on the doorbell in slices of
// `poll`, checking between slices that the session still exists (detach, lease expiry): the thread
// ends within one slice of its session. A ring with impossible indices or a command with an unknown op
// closes the session (its blocks return to the pool); the daemon carries on.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "karakv/v1/ring.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "server/metrics.h"
#include "server/core.h"
#include "server/staging.h"

namespace karakv::server {

class RequestGate;

struct RingConfig {
  absl::Duration spin = absl::Microseconds(50);  // busy-wait after a command before sleeping
  absl::Duration poll = absl::Milliseconds(20);  // futex slice between session checks
  // false: start() lays out the rings but starts no thread; poll() then runs a session's waiting
  // commands on the caller's thread, exactly as the thread would (tests, fuzzers).
  bool threads = true;
  // Threads kept waiting for the next session once theirs ended; more end.
  int idle_threads = 16;
  // Threads started with the server, each waiting for a session once it has made its kernel
  // state (Core::prepare_kernel_thread). karakvd starts idle_threads of them, so its thread
  // count (and the memory each thread brings) is fixed from the start instead of following the
  // most fast-path sessions ever open at once; more start only when more sessions than that are
  // open together.
  int start_threads = 0;
};

class RingServer {
 public:
  // `metrics` may be null (tests); the ring's families are registered on its registry.
  RingServer(RequestGate* gate, Core* core, Metrics* metrics, RingConfig config);
  ~RingServer();
  RingServer(const RingServer&) = delete;
  RingServer& operator=(const RingServer&) = delete;

  // Lays out the rings in `rings`' reserved tail and starts the session's consumer thread; the
  // commands' tensors are in `data` (the same region for shm staging). With device staging the
  // ring takes Step and Attend only (Header::ops 0): Append's token ids and ReadKV's positions are
  // host-side data, so those calls go through gRPC.
  absl::Status start(const std::string& session_id, std::shared_ptr<Staging> data,
                     std::shared_ptr<StagingRegion> rings);
  // Forgets the rings whose sessions ended and joins the threads that ended.
  void reap();
  // Without threads (RingConfig::threads == false): runs the session's ring until it has no
  // command waiting (or no room for a completion) or closes. Returns the commands run, or
  // NOT_FOUND when the session has no open ring.
  absl::StatusOr<int> poll(const std::string& session_id);
  // Stops every thread (shutdown). Commands still queued are not run.
  void stop_all();
  int active() const;
  // Threads alive: running a session's ring or waiting for the next session.
  int threads() const;
  // Of those, the ones waiting for a session and not yet handed one.
  int waiting() const;

  // karakv_decode_commands_total{method, path}: the gRPC handlers count their calls here too.
  void count(const char* method, const char* path);

 private:
  struct Worker {
    std::string session_id;
    // Dropped by the thread when it ends: where the tensors are, and where the rings are.
    std::shared_ptr<Staging> staging;
    std::shared_ptr<StagingRegion> rings;
    ring::Header* header = nullptr;
    // The daemon's ends of the two rings (their indices are private to this side).
    std::optional<ring::Consumer<ring::Command>> sq;
    std::optional<ring::Producer<ring::Completion>> cq;
    std::unique_ptr<ring::Command> cmd = std::make_unique<ring::Command>();
    ring::Completion done_slot;
    std::atomic<bool> stop{false};
    std::atomic<bool> done{false};
  };
  struct Thread {
    std::thread thread;
    std::atomic<bool> ended{false};
  };
  enum class Turn { kWorked, kIdle, kClosed };
  void run(Worker* w);
  // A pool thread's life: its kernel state, then rings one after another, `first` (null: a thread
  // started with the server, counted as waiting already) then whatever start() hands over while
  // it waits, until there are `idle_threads` waiting already or the server stops.
  void serve(Thread* self, Worker* first);
  // Starts a thread for `first` (see serve()).
  void spawn(Worker* first) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One command taken from the ring, run and answered; or nothing to do; or the ring closed
  // (garbage in it, or the session ended).
  Turn turn(Worker* w);
  // The end of a worker's life: tells the worker when the daemon stops, lets go of the staging.
  void finish(Worker* w);
  // Executes one command; false when the command is garbage (an unknown op, too many ids or entries).
  bool execute(const Worker& w, const ring::Command& cmd, ring::Completion* done);
  // The Append command (one entry or several) and ReadKV, as service.cc's handlers run them.
  void append(const Worker& w, const ring::Command& cmd, ring::Completion* done);
  void read_kv(const Worker& w, const ring::Command& cmd, ring::Completion* done);
  // Garbage in the ring: tells the worker why, then ends the session.
  void close(Worker* w, const std::string& why);
  // Tells the worker (state and reason in the ring header) that this ring takes no more commands.
  void mark_closed(Worker* w, const absl::Status& why);
  bool session_alive(const std::string& session_id);
  bool handover_or_stop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !handover_.empty() || stopping_; }

  RequestGate* const gate_;
  Core* const core_;
  const RingConfig config_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Worker>> workers_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Thread>> threads_ ABSL_GUARDED_BY(mu_);
  std::vector<Worker*> handover_ ABSL_GUARDED_BY(mu_);  // rings given to waiting threads, not yet taken
  int idle_ ABSL_GUARDED_BY(mu_) = 0;                    // waiting threads not promised a ring
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;

  std::shared_ptr<prometheus::Registry> keepalive_;  // owns the families below when metrics is null
  prometheus::Family<prometheus::Counter>* commands_ = nullptr;
  prometheus::Counter* wakeups_ = nullptr;
  prometheus::Counter* slow_yields_ = nullptr;
  prometheus::Counter* corrupt_ = nullptr;
  prometheus::Histogram* depth_ = nullptr;
  prometheus::Gauge* active_ = nullptr;
  prometheus::Gauge* threads_alive_ = nullptr;
  prometheus::Counter* threads_started_ = nullptr;
  absl::Mutex counters_mu_;
  absl::flat_hash_map<std::string, prometheus::Counter*> command_counters_ ABSL_GUARDED_BY(counters_mu_);
};

}  // namespace karakv::server
