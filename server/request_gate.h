// The door every request of every transport goes through: refuses work while draining, counts
// calls in flight, records per-call latency and error metrics, and (in debug mode) checks the pool
// invariant after mutating calls. Step and Attend have their one entry here, taking spans: the
// gRPC handlers (service.cc) and the shared-memory ring (ring.cc) each resolve their tensors and
// call it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/core.h"
#include "server/metrics.h"

namespace karakv::server {

// One Step: the batch's sequences at `layer`, tensors already resolved to bytes.
//   k, v: [B][Hk][D] storage dtype; q, out: [B][Hq][D] fp32
struct StepCall {
  std::string_view session_id;
  int64_t layer = 0;
  absl::Span<const uint64_t> sequence_ids;
  ConstBytes k, v, q;
  MutableBytes out;
  float scale = 0;
  bool stream_ordered = false;  // Core::step
};

// One Attend: the newest `num_queries` tokens of a sequence.  q, out: [N][Hq][D] fp32
struct AttendCall {
  std::string_view session_id;
  uint64_t sequence_id = 0;
  int64_t layer = 0;
  int64_t num_queries = 0;
  ConstBytes q;
  MutableBytes out;
  float scale = 0;
  bool stream_ordered = false;  // Core::attend
};

class RequestGate {
 public:
  // metrics may be null (tests): nothing is recorded then.
  RequestGate(Core* core, Metrics* metrics, bool check_invariants)
      : core_(core), metrics_(metrics), check_invariants_(check_invariants) {}

  // Runs `body` unless draining; records the call as `method`; checks invariants after it when
  // `mutates`.
  template <typename Body>
  absl::Status run(const char* method, bool mutates, Body&& body);

  // The Step and Attend entries. `resolution` is the transport's refusal while resolving the
  // tensors (a bad staging range), answered here like any other refusal so that it is counted.
  absl::StatusOr<Core::StepResult> step(const StepCall& call, const absl::Status& resolution = absl::OkStatus());
  absl::Status attend(const AttendCall& call, const absl::Status& resolution = absl::OkStatus());

  // UNAVAILABLE naming the backend's fault (Core::device_fault) for every method but Ping and
  // Stats (which need no device), else OK.
  absl::Status device_failed(const char* method) const;

  // After this, every new call is refused with UNAVAILABLE; calls already running finish.
  void start_draining() { draining_.store(true); }
  bool draining() const { return draining_.load(); }
  int in_flight() const { return in_flight_.load(); }

 private:
  void finish(const char* method, std::chrono::steady_clock::time_point start, const absl::Status& status,
              bool mutates);

  Core* const core_;
  Metrics* const metrics_;
  const bool check_invariants_;
  std::atomic<bool> draining_{false};
  std::atomic<int> in_flight_{0};
};

absl::Status draining_status();

template <typename Body>
absl::Status RequestGate::run(const char* method, bool mutates, Body&& body) {
  const auto start = std::chrono::steady_clock::now();
  ++in_flight_;
  absl::Status status = draining_.load() ? draining_status() : device_failed(method);
  if (status.ok()) status = body();
  --in_flight_;
  finish(method, start, status, mutates);
  return status;
}

}  // namespace karakv::server
