// One command in flight at a time (the SDK serialises calls): submit, ring the doorbell only when
// the daemon's thread sleeps, then wait for the matching completion.
#include "ring_client.h"

#include <chrono>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"

namespace karakv {

namespace {
using Clock = std::chrono::steady_clock;
// How long a wait goes before the daemon's liveness is checked, and then how often.
constexpr int64_t kLivenessEveryNs = 250'000'000;
constexpr int64_t kSliceNs = 10'000'000;
}  // namespace

RingClient::RingClient(uint8_t* base, absl::Duration spin)
    : header_(ring::header(base)),
      sq_(ring::commands(base), &header_->sq_tail, &header_->sq_head),
      cq_(ring::completions(base), &header_->cq_head, &header_->cq_tail),
      spin_ns_(absl::ToInt64Nanoseconds(spin)) {}

absl::Status RingClient::closed_status() const {
  std::string msg(header_->close_message, strnlen(header_->close_message, sizeof(header_->close_message)));
  auto code = static_cast<absl::StatusCode>(header_->close_code);
  if (code == absl::StatusCode::kOk) code = absl::StatusCode::kFailedPrecondition;
  return absl::Status(code, msg.empty() ? "karakvd closed the fast-path ring" : msg);
}

void RingClient::ring_doorbell() {
  header_->sq_doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (header_->daemon_sleeping.load(std::memory_order_seq_cst) != 0) ring::futex_wake(&header_->sq_doorbell);
}

absl::StatusOr<std::optional<ring::Completion>> RingClient::call(ring::Command& cmd, absl::Time deadline,
                                                                 absl::Duration full_wait,
                                                                 absl::FunctionRef<absl::Status()> alive) {
  if (header_->state.load(std::memory_order_acquire) != uint32_t(ring::State::kOpen)) {
    usable_ = false;
    return closed_status();
  }
  // Room: the SDK keeps one command in flight, so a full ring means completions nobody took, or a
  // daemon thread that fell behind; wait a little, then let the caller use gRPC.
  const absl::Time full_until = std::min(deadline, absl::Now() + full_wait);
  for (;;) {
    const int64_t room = sq_.room();
    if (room < 0) {
      usable_ = false;
      return absl::InternalError("fast path: the command ring's head is impossible (shared memory corrupted)");
    }
    if (room > 0) break;
    if (absl::Now() >= full_until) return std::optional<ring::Completion>();
    std::this_thread::yield();
  }
  cmd.tag = next_tag_++;
  sq_.push(cmd);
  ++calls_;
  ring_doorbell();

  ring::Completion done;
  const auto start = Clock::now();
  int64_t next_liveness_ns = kLivenessEveryNs;
  for (;;) {
    const ring::PopResult r = cq_.pop(&done);
    if (r == ring::PopResult::kCorrupt) {
      usable_ = false;
      return absl::InternalError("fast path: the completion ring's tail is impossible (shared memory corrupted)");
    }
    if (r == ring::PopResult::kOk) {
      // The daemon may be waiting for room in the completion ring.
      if (header_->daemon_sleeping.load(std::memory_order_seq_cst) != 0) ring_doorbell();
      if (done.tag != cmd.tag) continue;  // a stale completion of an abandoned command
      return std::optional<ring::Completion>(done);
    }
    if (header_->state.load(std::memory_order_acquire) != uint32_t(ring::State::kOpen)) {
      usable_ = false;
      return closed_status();
    }
    const int64_t waited = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
    if (waited < spin_ns_ && spinning_.may_spin(ring::monotonic_ns())) {
      spinning_.spin_once();  // a slow one (busy CPUs): sleep on the futex for a while instead (ring.h)
      continue;
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      usable_ = false;  // the command may still run; its completion would be mistaken for the next
      return absl::DeadlineExceededError(
          "fast path: karakvd did not complete the command before the deadline (ClientOptions::rpc_timeout)");
    }
    if (waited >= next_liveness_ns) {
      next_liveness_ns = waited + kLivenessEveryNs;
      if (absl::Status s = alive(); !s.ok()) {
        usable_ = false;
        return s;
      }
    }
    const uint32_t bell = header_->cq_doorbell.load(std::memory_order_seq_cst);
    header_->worker_sleeping.store(1, std::memory_order_seq_cst);
    if (cq_.depth() == 0 && header_->state.load() == uint32_t(ring::State::kOpen)) {
      const int64_t left = absl::ToInt64Nanoseconds(deadline - now);
      ring::futex_wait(&header_->cq_doorbell, bell, std::max<int64_t>(1, std::min(kSliceNs, left)));
      ++sleeps_;
    }
    header_->worker_sleeping.store(0, std::memory_order_relaxed);
  }
}

}  // namespace karakv
