// The fast path's consumer threads: take a command, rebuild the request the RPC would have carried
// (every tensor in staging), run it through the service's own handler, post the status.
#include "server/ring.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "karakv/v1/karakv.pb.h"
#include "server/service.h"
#include "spdlog/spdlog.h"

namespace karakv::server {

namespace {

using Clock = std::chrono::steady_clock;

void set_range(const ring::Range& r, v1::StagingRange* out) {
  out->set_offset(r.offset);
  out->set_length(r.length);
}

void set_status(const absl::Status& s, ring::Completion* c) {
  c->code = static_cast<uint32_t>(s.code());
  const size_t n = std::min(s.message().size(), ring::Completion::kMessageBytes);
  std::memcpy(c->message, s.message().data(), n);
  c->message_bytes = static_cast<uint32_t>(n);
}

}  // namespace

RingServer::RingServer(KaraKVService* service, Registry* registry, Metrics* metrics, RingConfig config)
    : service_(service), registry_(registry), config_(config) {
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
  keepalive_ = reg;
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

absl::Status RingServer::start(const std::string& session_id, std::shared_ptr<StagingRegion> staging) {
  if (staging == nullptr || staging->reserved_size() < ring::kRingBytes) {
    return absl::InternalError("fast path: the session's staging region has no room reserved for the rings");
  }
  reap();
  ring::initialize(staging->reserved());
  auto w = std::make_unique<Worker>();
  w->session_id = session_id;
  w->header = ring::header(staging->reserved());
  w->staging = std::move(staging);
  Worker* raw = w.get();
  {
    absl::MutexLock lock(&mu_);
    workers_.push_back(std::move(w));
  }
  raw->thread = std::thread([this, raw] { run(raw); });
  active_->Increment();
  return absl::OkStatus();
}

void RingServer::reap() {
  std::vector<std::unique_ptr<Worker>> finished;
  {
    absl::MutexLock lock(&mu_);
    auto it = std::partition(workers_.begin(), workers_.end(), [](const auto& w) { return !w->done.load(); });
    for (auto j = it; j != workers_.end(); ++j) finished.push_back(std::move(*j));
    workers_.erase(it, workers_.end());
  }
  for (auto& w : finished) {
    if (w->thread.joinable()) w->thread.join();
  }
}

void RingServer::stop_all() {
  std::vector<std::unique_ptr<Worker>> all;
  {
    absl::MutexLock lock(&mu_);
    all.swap(workers_);
  }
  for (auto& w : all) {
    w->stop.store(true);
    // A thread that already ended may have unmapped the ring: FUTEX_WAKE then fails with EFAULT.
    if (!w->done.load()) ring::futex_wake(&w->header->sq_doorbell);
  }
  for (auto& w : all) {
    if (w->thread.joinable()) w->thread.join();
  }
}

int RingServer::active() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(std::count_if(workers_.begin(), workers_.end(), [](const auto& w) { return !w->done.load(); }));
}

bool RingServer::session_alive(const std::string& session_id) { return registry_->staging(session_id).ok(); }

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
  registry_->detach(w->session_id).IgnoreError();
}

bool RingServer::execute(const Worker& w, const ring::Command& cmd, ring::Completion* done) {
  done->tag = cmd.tag;
  if (cmd.op == uint32_t(ring::Op::kStep)) {
    if (cmd.count > ring::Command::kMaxIds) return false;
    count("Step", "ring");
    v1::StepRequest req;
    req.set_session_id(w.session_id);
    req.set_layer(cmd.layer);
    req.mutable_sequence_ids()->Add(cmd.ids, cmd.ids + cmd.count);
    set_range(cmd.k, req.mutable_k()->mutable_staging());
    set_range(cmd.v, req.mutable_v()->mutable_staging());
    set_range(cmd.q, req.mutable_q()->mutable_staging());
    set_range(cmd.out, req.mutable_out()->mutable_staging());
    req.set_scale(cmd.scale);
    v1::StepReply reply;
    set_status(service_->RunStep(req, &reply), done);
    done->decode_step = reply.decode_step();
    done->compactions = reply.compactions();
    return true;
  }
  if (cmd.op == uint32_t(ring::Op::kAttend)) {
    count("Attend", "ring");
    v1::AttendRequest req;
    req.set_session_id(w.session_id);
    req.set_sequence_id(cmd.sequence_id);
    req.set_layer(cmd.layer);
    req.set_num_queries(cmd.count);
    set_range(cmd.q, req.mutable_q()->mutable_staging());
    set_range(cmd.out, req.mutable_out()->mutable_staging());
    req.set_scale(cmd.scale);
    v1::AttendReply reply;
    set_status(service_->RunAttend(req, &reply), done);
    return true;
  }
  return false;
}

void RingServer::run(Worker* w) {
  uint8_t* base = w->staging->reserved();
  ring::Header* h = ring::header(base);
  ring::Consumer<ring::Command> sq(ring::commands(base), &h->sq_head, &h->sq_tail);
  ring::Producer<ring::Completion> cq(ring::completions(base), &h->cq_tail, &h->cq_head);
  auto cmd = std::make_unique<ring::Command>();
  ring::Completion done;
  const auto spin = std::chrono::nanoseconds(absl::ToInt64Nanoseconds(config_.spin));
  const int64_t poll_ns = absl::ToInt64Nanoseconds(config_.poll);
  auto last_work = Clock::now();
  while (!w->stop.load(std::memory_order_relaxed)) {
    const int64_t room = cq.room();
    if (room < 0) {
      close(w, absl::StrCat("completion ring head ", h->cq_head.load(), " is impossible for tail ", cq.index(),
                            " (expected at most ", ring::kSlots, " behind)"));
      break;
    }
    if (room > 0) {
      const int64_t depth = sq.depth();
      const ring::PopResult r = sq.pop(cmd.get());
      if (r == ring::PopResult::kCorrupt) {
        close(w, absl::StrCat("command ring tail ", h->sq_tail.load(), " is impossible for head ", sq.index(),
                              " (expected between head and head + ", ring::kSlots, ")"));
        break;
      }
      if (r == ring::PopResult::kOk) {
        depth_->Observe(double(depth));
        std::memset(&done, 0, sizeof(done));
        if (!execute(*w, *cmd, &done)) {
          close(w, absl::StrCat("command ", sq.index() - 1, " has op ", cmd->op, " and count ", cmd->count,
                                ", expected op 1 (Step) with at most ", ring::Command::kMaxIds,
                                " sequence ids or op 2 (Attend)"));
          break;
        }
        cq.push(done);
        h->cq_doorbell.fetch_add(1, std::memory_order_seq_cst);
        if (h->worker_sleeping.load(std::memory_order_seq_cst) != 0) ring::futex_wake(&h->cq_doorbell);
        if (done.code == uint32_t(absl::StatusCode::kNotFound) && !session_alive(w->session_id)) {
          mark_closed(w, absl::NotFoundError(absl::StrCat("unknown session '", w->session_id,
                                                          "' (detached, or its lease expired)")));
          break;
        }
        last_work = Clock::now();
        continue;
      }
    }
    // Nothing to do (or no room to answer): spin a little, then sleep on the doorbell.
    if (Clock::now() - last_work < spin) {
      ring::spin_once();
      continue;
    }
    const uint32_t bell = h->sq_doorbell.load(std::memory_order_seq_cst);
    h->daemon_sleeping.store(1, std::memory_order_seq_cst);
    int rc = ETIMEDOUT;
    if (sq.depth() == 0 || cq.room() == 0) rc = ring::futex_wait(&h->sq_doorbell, bell, poll_ns);
    h->daemon_sleeping.store(0, std::memory_order_relaxed);
    if (rc == 0) {
      wakeups_->Increment();
      last_work = Clock::now();
    } else if (rc == ETIMEDOUT && !session_alive(w->session_id)) {
      // Detached or lease expired: the registry already freed its blocks.
      mark_closed(w, absl::NotFoundError(absl::StrCat("unknown session '", w->session_id,
                                                      "' (detached, or its lease expired)")));
      break;
    }
  }
  if (w->stop.load()) mark_closed(w, absl::UnavailableError("karakvd is shutting down"));
  w->staging.reset();  // the region unmaps once the registry let go of it too
  active_->Decrement();
  w->done.store(true);
}

}  // namespace karakv::server
