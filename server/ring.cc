// The fast path's consumer threads: take a command, resolve its staging ranges, run it through the
// request gate's Step or Attend entry (the one the gRPC handlers call), post the status.
#include "server/ring.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "server/core.h"
#include "server/request_gate.h"
#include "server/validation.h"
#include "spdlog/spdlog.h"

namespace karakv::server {

namespace {

using Clock = std::chrono::steady_clock;

// A command's tensor in the session's staging region, checked as the RPC's staging ranges are.
absl::Status resolve(const Staging& staging, const ring::Range& r, const char* what, absl::Span<uint8_t>* out) {
  auto p = staging.resolve(r.offset, r.length, 4, what);
  if (!p.ok()) return p.status();
  *out = absl::Span<uint8_t>(*p, r.length);
  return absl::OkStatus();
}

void set_status(const absl::Status& s, ring::Completion* c) {
  c->code = static_cast<uint32_t>(s.code());
  // An OK status's message is an empty view whose data() is null: memcpy must not see it.
  const size_t n = std::min(s.message().size(), ring::Completion::kMessageBytes);
  if (n > 0) std::memcpy(c->message, s.message().data(), n);  // an OK status's message may have null data()
  c->message_bytes = static_cast<uint32_t>(n);
}

}  // namespace

RingServer::RingServer(RequestGate* gate, Core* core, Metrics* metrics, RingConfig config)
    : gate_(gate), core_(core), config_(config) {
  // Tests may run without metrics: the families then live in a registry of their own.
  auto reg = metrics != nullptr ? metrics->registry() : std::make_shared<prometheus::Registry>();
  commands_ = &prometheus::BuildCounter()
                   .Name("karakv_decode_commands_total")
                   .Help("Step and Attend calls, by method and path (grpc or the shared-memory ring)")
                   .Register(*reg);
  wakeups_ = &prometheus::BuildCounter()
                  .Name("karakv_ring_wakeups_total")
                  .Help("Times a ring thread left FUTEX_WAIT because the worker rang the doorbell")
                  .Register(*reg)
                  .Add({});
  slow_yields_ = &prometheus::BuildCounter()
                      .Name("karakv_ring_slow_yields_total")
                      .Help("Idle spins a ring thread cut short to sleep on its doorbell because a yield lost the "
                            "CPU to another task for a time slice (a busy node)")
                      .Register(*reg)
                      .Add({});
  corrupt_ = &prometheus::BuildCounter()
                  .Name("karakv_ring_corrupt_total")
                  .Help("Sessions closed because their ring held impossible indices or a garbage command")
                  .Register(*reg)
                  .Add({});
  depth_ = &prometheus::BuildHistogram()
                .Name("karakv_ring_depth")
                .Help("Commands waiting in a ring when its thread takes one")
                .Register(*reg)
                .Add({}, prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16, 32, 64});
  active_ = &prometheus::BuildGauge()
                 .Name("karakv_rings_active")
                 .Help("Sessions with a fast-path ring thread")
                 .Register(*reg)
                 .Add({});
  threads_alive_ = &prometheus::BuildGauge()
                        .Name("karakv_ring_threads")
                        .Help("Fast-path ring threads alive: serving a session or waiting for the next")
                        .Register(*reg)
                        .Add({});
  threads_started_ = &prometheus::BuildCounter()
                          .Name("karakv_ring_threads_started_total")
                          .Help("Fast-path ring threads started (a session reuses a waiting one when it can)")
                          .Register(*reg)
                          .Add({});
  {
    // Both paths of both methods from the start, at zero: a path's first command shows in rate().
    absl::MutexLock lock(&counters_mu_);
    for (const char* method : {"Step", "Attend"}) {
      for (const char* path : {"grpc", "ring"}) {
        command_counters_[absl::StrCat(method, "/", path)] = &commands_->Add({{"method", method}, {"path", path}});
      }
    }
  }
  keepalive_ = reg;
  if (!config_.threads) return;
  absl::MutexLock lock(&mu_);
  for (int i = 0; i < config_.start_threads; ++i) {
    ++idle_;  // counted as waiting from the start, so start() hands it the first sessions
    spawn(nullptr);
  }
}

RingServer::~RingServer() { stop_all(); }

void RingServer::count(const char* method, const char* path) {
  const std::string key = absl::StrCat(method, "/", path);
  prometheus::Counter* c;
  {
    absl::MutexLock lock(&counters_mu_);
    auto [it, inserted] = command_counters_.try_emplace(key, nullptr);
    if (inserted) it->second = &commands_->Add({{"method", method}, {"path", path}});
    c = it->second;
  }
  c->Increment();
}

absl::Status RingServer::start(const std::string& session_id, std::shared_ptr<Staging> data,
                               std::shared_ptr<StagingRegion> rings) {
  if (data == nullptr || rings == nullptr || rings->reserved_size() < ring::kRingBytes) {
    return absl::InternalError("fast path: the session's staging region has no room reserved for the rings");
  }
  reap();
  uint8_t* base = rings->reserved();
  ring::initialize(base);
  auto w = std::make_unique<Worker>();
  w->session_id = session_id;
  if (data->kind() != StagingKind::kShm) ring::header(base)->ops = 0;  // Step and Attend only
  w->header = ring::header(base);
  w->sq.emplace(ring::commands(base), &w->header->sq_head, &w->header->sq_tail);
  w->cq.emplace(ring::completions(base), &w->header->cq_tail, &w->header->cq_head);
  w->staging = std::move(data);
  w->rings = std::move(rings);
  Worker* raw = w.get();
  active_->Increment();
  absl::MutexLock lock(&mu_);
  workers_.push_back(std::move(w));
  if (!config_.threads) return absl::OkStatus();
  if (idle_ > 0) {  // a thread whose session ended takes this one
    --idle_;
    handover_.push_back(raw);
    return absl::OkStatus();
  }
  spawn(raw);
  return absl::OkStatus();
}

void RingServer::spawn(Worker* first) {
  // Started under the lock, so reap() never sees the Thread before its std::thread is set.
  auto t = std::make_unique<Thread>();
  Thread* self = t.get();
  threads_.push_back(std::move(t));
  threads_started_->Increment();
  threads_alive_->Increment();
  self->thread = std::thread([this, self, first] { serve(self, first); });
  // Named by the creator, so it shows as a ring thread (top -H, /proc/PID/task/*/comm) even before
  // a busy machine first schedules it.
  pthread_setname_np(self->thread.native_handle(), "karakv-ring");
}

absl::StatusOr<int> RingServer::poll(const std::string& session_id) {
  if (config_.threads) return absl::FailedPreconditionError("poll: the rings have threads of their own");
  Worker* w = nullptr;
  {
    absl::MutexLock lock(&mu_);
    for (auto& x : workers_) {
      if (x->session_id == session_id && !x->done.load()) w = x.get();
    }
  }
  if (w == nullptr) return absl::NotFoundError(absl::StrCat("no open ring for session '", session_id, "'"));
  int ran = 0;
  for (;;) {
    const Turn t = turn(w);
    if (t == Turn::kIdle) return ran;
    if (t == Turn::kClosed) {
      finish(w);
      return ran;
    }
    ++ran;
  }
}

void RingServer::reap() {
  std::vector<std::unique_ptr<Thread>> ended;
  absl::MutexLock lock(&mu_);
  // A ring is done once finish() stored `done`, its thread's last touch of it.
  workers_.erase(std::remove_if(workers_.begin(), workers_.end(), [](const auto& w) { return w->done.load(); }),
                 workers_.end());
  auto it = std::partition(threads_.begin(), threads_.end(), [](const auto& t) { return !t->ended.load(); });
  for (auto j = it; j != threads_.end(); ++j) ended.push_back(std::move(*j));
  threads_.erase(it, threads_.end());
  // `ended` is the thread's last store; joining here waits for its return only.
  for (auto& t : ended) t->thread.join();
}

void RingServer::stop_all() {
  std::vector<std::unique_ptr<Worker>> all;
  std::vector<std::unique_ptr<Thread>> threads;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;  // waiting threads wake, run what was handed to them (it stops at once) and end
    all.swap(workers_);
    threads.swap(threads_);
  }
  for (auto& w : all) w->stop.store(true);
  for (auto& w : all) {
    if (!config_.threads) {
      if (!w->done.load()) finish(w.get());  // a ring without a thread
      continue;
    }
    // A thread that already ended may have unmapped the ring: FUTEX_WAKE then fails with EFAULT.
    if (!w->done.load()) ring::futex_wake(&w->header->sq_doorbell);
  }
  for (auto& t : threads) t->thread.join();
}

int RingServer::threads() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(std::count_if(threads_.begin(), threads_.end(), [](const auto& t) { return !t->ended.load(); }));
}

int RingServer::waiting() const {
  absl::MutexLock lock(&mu_);
  return idle_;
}

int RingServer::active() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(std::count_if(workers_.begin(), workers_.end(), [](const auto& w) { return !w->done.load(); }));
}

bool RingServer::session_alive(const std::string& session_id) { return core_->staging(session_id).ok(); }

void RingServer::mark_closed(Worker* w, const absl::Status& why) {
  ring::Header* h = w->header;
  const size_t n = std::min(why.message().size(), sizeof(h->close_message) - 1);
  std::memcpy(h->close_message, why.message().data(), n);
  h->close_message[n] = '\0';
  h->close_code = static_cast<uint32_t>(why.code());
  h->state.store(uint32_t(ring::State::kClosed), std::memory_order_seq_cst);
  h->cq_doorbell.fetch_add(1);
  ring::futex_wake(&h->cq_doorbell);
}

void RingServer::close(Worker* w, const std::string& why) {
  spdlog::warn("session {}: closing its fast-path ring and the session: {}", w->session_id, why);
  corrupt_->Increment();
  mark_closed(w, absl::FailedPreconditionError(
                     absl::StrCat("karakvd closed the fast-path ring and the session: ", why)));
  core_->detach(w->session_id).IgnoreError();
}

bool RingServer::execute(const Worker& w, const ring::Command& cmd, ring::Completion* done) {
  done->tag = cmd.tag;
  const Staging& staging = *w.staging;
  if (cmd.op == uint32_t(ring::Op::kStep)) {
    if (cmd.count > ring::Command::kMaxIds) return false;
    count("Step", "ring");
    absl::Span<uint8_t> k, v, q, out;
    // In the order and with the checks of the gRPC handler's resolution (service.cc).
    absl::Status resolution = check_batch(cmd.count);
    if (resolution.ok()) resolution = resolve(staging, cmd.k, "k", &k);
    if (resolution.ok()) resolution = resolve(staging, cmd.v, "v", &v);
    if (resolution.ok()) resolution = resolve(staging, cmd.q, "q", &q);
    if (resolution.ok()) resolution = check_output_range("out", cmd.out.length, core_->q_bytes(cmd.count), true);
    if (resolution.ok()) resolution = resolve(staging, cmd.out, "out", &out);
    StepCall call;
    call.session_id = w.session_id;
    call.layer = cmd.layer;
    call.sequence_ids = absl::MakeConstSpan(cmd.ids, cmd.count);
    call.k = k;
    call.v = v;
    call.q = q;
    call.out = out;
    call.scale = cmd.scale;
    auto r = in_stream_order(resolution.ok() ? &staging : nullptr, [&](bool ordered) {
      call.stream_ordered = ordered;
      return gate_->step(call, resolution);
    });
    set_status(r.status(), done);
    if (r.ok()) {
      done->decode_step = r->decode_step;
      done->compactions = static_cast<uint32_t>(r->compactions);
    }
    return true;
  }
  if (cmd.op == uint32_t(ring::Op::kAttend)) {
    count("Attend", "ring");
    absl::Span<uint8_t> q, out;
    absl::Status resolution = resolve(staging, cmd.q, "q", &q);
    if (resolution.ok()) resolution = check_output_range("out", cmd.out.length, core_->q_bytes(cmd.count), true);
    if (resolution.ok()) resolution = resolve(staging, cmd.out, "out", &out);
    AttendCall call;
    call.session_id = w.session_id;
    call.sequence_id = cmd.sequence_id;
    call.layer = cmd.layer;
    call.num_queries = cmd.count;
    call.q = q;
    call.out = out;
    call.scale = cmd.scale;
    set_status(in_stream_order(resolution.ok() ? &staging : nullptr, [&](bool ordered) {
                 call.stream_ordered = ordered;
                 return gate_->attend(call, resolution);
               }),
               done);
    return true;
  }
  // The ops beyond Step and Attend, taken with shm staging only (an SDK checks Header::ops first; the
  // header is the worker's to overwrite, so the daemon asks its own staging).
  if (staging.kind() != StagingKind::kShm) return false;
  if (cmd.op == uint32_t(ring::Op::kAppend)) {
    if (cmd.count > ring::Command::kMaxAppends) return false;
    append(w, cmd, done);
    return true;
  }
  if (cmd.op == uint32_t(ring::Op::kReadKV)) {
    read_kv(w, cmd, done);
    return true;
  }
  return false;
}

void RingServer::append(const Worker& w, const ring::Command& cmd, ring::Completion* done) {
  // One entry is a plain Append (the gRPC Append); more are an AppendBatch, entry by entry in the
  // order and with the checks of service.cc's DoAppend.
  const size_t n = cmd.count;
  const Staging& staging = *w.staging;
  uint32_t applied = 0;
  int32_t length = 0;
  int32_t lengths[ring::Command::kMaxAppends];
  const absl::Status status = gate_->run(n == 1 ? "Append" : "AppendBatch", true, [&]() -> absl::Status {
    if (absl::Status s = check_append_batch(n); !s.ok()) return s;
    for (size_t i = 0; i < n; ++i) {
      const ring::AppendEntry e = ring::append_entry(cmd, i);
      absl::Span<uint8_t> k, v, q, ids;
      absl::Status s = resolve(staging, e.k, "k", &k);
      if (s.ok()) s = resolve(staging, e.v, "v", &v);
      if (s.ok() && (e.num_query_tokens > 0 || e.q.length > 0)) s = resolve(staging, e.q, "q", &q);
      if (s.ok() && e.token_ids.length > 0) {
        s = resolve(staging, e.token_ids, "token_ids", &ids);
        if (s.ok() && ids.size() % sizeof(int32_t) != 0) {
          s = absl::InvalidArgumentError(absl::StrCat("token_ids staging range has ", ids.size(),
                                                      " bytes, expected a multiple of 4 ([T] int32)"));
        }
      }
      absl::StatusOr<int32_t> r = 0;
      if (!s.ok()) {
        r = s;
      } else {
        r = core_->append(w.session_id, e.sequence_id, int64_t{e.num_tokens}, k, v, q,
                          int64_t{e.num_query_tokens},
                          absl::MakeConstSpan(reinterpret_cast<const int32_t*>(ids.data()), ids.size() / 4));
      }
      if (!r.ok()) return append_entry_status(r.status(), i, n, e.sequence_id);
      lengths[i] = length = *r;
      ++applied;
    }
    return absl::OkStatus();
  });
  set_status(status, done);
  done->compactions = applied;
  done->decode_step = static_cast<uint64_t>(length);
  if (status.ok()) {
    for (size_t i = 0; i < n; ++i) ring::set_append_length(*done, i, static_cast<uint32_t>(lengths[i]));
  }
}

void RingServer::read_kv(const Worker& w, const ring::Command& cmd, ring::Completion* done) {
  // The outputs as service.cc's DoReadKV resolves staging outputs: at least the bytes T tokens need.
  const Staging& staging = *w.staging;
  int32_t tokens = 0;
  auto output = [&](const ring::Range& r, size_t want, const char* what) -> absl::StatusOr<MutableBytes> {
    if (absl::Status s = check_output_range(what, r.length, want, false); !s.ok()) return s;
    auto p = staging.resolve(r.offset, r.length, 4, what);
    if (!p.ok()) return p.status();
    return MutableBytes(*p, want);
  };
  auto targets = [&](int32_t num_tokens) -> absl::StatusOr<ReadKVTargets> {
    ReadKVTargets t;
    const size_t kv_bytes = core_->append_bytes(num_tokens);
    auto k = output(cmd.k, kv_bytes, "k");
    if (!k.ok()) return k.status();
    auto v = output(cmd.v, kv_bytes, "v");
    if (!v.ok()) return v.status();
    const size_t rows = size_t(core_->geometry().num_layers) * core_->geometry().num_kv_heads;
    auto p = output(cmd.out, rows * num_tokens * 4, "positions");
    if (!p.ok()) return p.status();
    t.k = *k;
    t.v = *v;
    t.positions = *p;
    return t;
  };
  const absl::Status status = gate_->run("ReadKV", false, [&]() -> absl::Status {
    auto r = core_->read_kv(w.session_id, cmd.sequence_id, targets);
    if (!r.ok()) return r.status();
    tokens = *r;
    return absl::OkStatus();
  });
  set_status(status, done);
  if (status.ok()) done->decode_step = static_cast<uint64_t>(tokens);
}

RingServer::Turn RingServer::turn(Worker* w) {
  ring::Header* h = w->header;
  ring::Consumer<ring::Command>& sq = *w->sq;
  ring::Producer<ring::Completion>& cq = *w->cq;
  const int64_t room = cq.room();
  if (room < 0) {
    close(w, absl::StrCat("completion ring head ", h->cq_head.load(), " is impossible for tail ", cq.index(),
                          " (expected at most ", ring::kSlots, " behind)"));
    return Turn::kClosed;
  }
  if (room == 0) return Turn::kIdle;
  const int64_t depth = sq.depth();
  const ring::PopResult r = sq.pop(w->cmd.get());
  if (r == ring::PopResult::kCorrupt) {
    close(w, absl::StrCat("command ring tail ", h->sq_tail.load(), " is impossible for head ", sq.index(),
                          " (expected between head and head + ", ring::kSlots, ")"));
    return Turn::kClosed;
  }
  if (r == ring::PopResult::kEmpty) return Turn::kIdle;
  depth_->Observe(double(depth));
  ring::Completion& done = w->done_slot;
  std::memset(&done, 0, sizeof(done));
  if (!execute(*w, *w->cmd, &done)) {
    close(w, absl::StrCat("command ", sq.index() - 1, " has op ", w->cmd->op, " and count ", w->cmd->count,
                          ", expected op 1 (Step) with at most ", ring::Command::kMaxIds,
                          " sequence ids, op 2 (Attend), op 3 (Append) with at most ", ring::Command::kMaxAppends,
                          " entries or op 4 (ReadKV)"));
    return Turn::kClosed;
  }
  cq.push(done);
  h->cq_doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (h->worker_sleeping.load(std::memory_order_seq_cst) != 0) ring::futex_wake(&h->cq_doorbell);
  if (done.code == uint32_t(absl::StatusCode::kNotFound) && !session_alive(w->session_id)) {
    mark_closed(w, absl::NotFoundError(absl::StrCat("unknown session '", w->session_id,
                                                    "' (detached, or its lease expired)")));
    return Turn::kClosed;
  }
  return Turn::kWorked;
}

void RingServer::finish(Worker* w) {
  if (w->stop.load()) mark_closed(w, absl::UnavailableError("karakvd is shutting down"));
  w->staging.reset();  // the regions unmap once the core let go of them too
  w->rings.reset();
  active_->Decrement();
  w->done.store(true);
}

void RingServer::serve(Thread* self, Worker* first) {
  core_->prepare_kernel_thread();
  Worker* w = first;
  for (;;) {
    if (w != nullptr) run(w);
    absl::MutexLock lock(&mu_);
    if (w != nullptr) {  // a thread started with the server was counted as waiting already
      if (stopping_ || idle_ >= config_.idle_threads) break;
      ++idle_;
    }
    mu_.Await(absl::Condition(this, &RingServer::handover_or_stop));
    if (handover_.empty()) {  // stopping, and nothing was handed over
      --idle_;
      break;
    }
    w = handover_.back();
    handover_.pop_back();
  }
  threads_alive_->Decrement();
  self->ended.store(true);
}

void RingServer::run(Worker* w) {
  ring::Header* h = w->header;
  const auto spin = std::chrono::nanoseconds(absl::ToInt64Nanoseconds(config_.spin));
  const int64_t poll_ns = absl::ToInt64Nanoseconds(config_.poll);
  auto last_work = Clock::now();
  ring::SpinPolicy spinning;
  while (!w->stop.load(std::memory_order_relaxed)) {
    const Turn t = turn(w);
    if (t == Turn::kClosed) break;
    if (t == Turn::kWorked) {
      last_work = Clock::now();
      continue;
    }
    // Nothing to do (or no room to answer): spin a little, then sleep on the doorbell.
    if (Clock::now() - last_work < spin && spinning.may_spin(ring::monotonic_ns())) {
      if (!spinning.spin_once()) slow_yields_->Increment();
      continue;
    }
    const uint32_t bell = h->sq_doorbell.load(std::memory_order_seq_cst);
    h->daemon_sleeping.store(1, std::memory_order_seq_cst);
    int rc = ETIMEDOUT;
    if (w->sq->depth() == 0 || w->cq->room() == 0) rc = ring::futex_wait(&h->sq_doorbell, bell, poll_ns);
    h->daemon_sleeping.store(0, std::memory_order_relaxed);
    if (rc == 0) {
      wakeups_->Increment();
      last_work = Clock::now();
    } else if (rc == ETIMEDOUT && !session_alive(w->session_id)) {
      // Detached or lease expired: the core already freed its blocks.
      mark_closed(w, absl::NotFoundError(absl::StrCat("unknown session '", w->session_id,
                                                      "' (detached, or its lease expired)")));
      break;
    }
  }
  finish(w);
}

}  // namespace karakv::server
