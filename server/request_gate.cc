// The request gate: metrics, draining and invariant checks around every call; the Step and Attend
// entries both transports share.
#include "server/request_gate.h"

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace karakv::server {

absl::Status draining_status() {
  return absl::UnavailableError("karakvd is draining for shutdown; retry on another daemon or after restart");
}

void RequestGate::finish(const char* method, std::chrono::steady_clock::time_point start, const absl::Status& status,
                         bool mutates) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (metrics_ != nullptr) metrics_->observe_rpc(method, seconds, status.code());
  if (!status.ok() && spdlog::should_log(spdlog::level::debug)) {
    spdlog::debug("{} refused: {}: {}", method, absl::StatusCodeToString(status.code()), std::string(status.message()));
  }
  if (mutates && check_invariants_) {
    if (absl::Status inv = core_->check_invariants(); !inv.ok()) {
      spdlog::critical("pool invariant broken after {}: {}", method, std::string(inv.message()));
      if (metrics_ != nullptr) metrics_->invariant_violation();
    }
  }
}

absl::StatusOr<Core::StepResult> RequestGate::step(const StepCall& call, const absl::Status& resolution) {
  Core::StepResult result;
  // Gauges only move when a step allocates (layer 0); later layers skip the invariant check.
  absl::Status s = run("Step", call.layer == 0, [&]() -> absl::Status {
    if (!resolution.ok()) return resolution;
    auto r = core_->step(std::string(call.session_id), call.layer, call.sequence_ids, call.k, call.v, call.q, call.out,
                         call.scale, call.stream_ordered);
    if (!r.ok()) return r.status();
    result = std::move(*r);
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  if (metrics_ != nullptr && call.layer + 1 == core_->geometry().num_layers) {
    metrics_->decode_step(static_cast<int>(call.sequence_ids.size()), result.step_seconds, result.first_step_seconds);
  }
  return result;
}

absl::Status RequestGate::attend(const AttendCall& call, const absl::Status& resolution) {
  return run("Attend", false, [&]() -> absl::Status {
    if (!resolution.ok()) return resolution;
    return core_->attend(std::string(call.session_id), call.sequence_id, call.layer, call.num_queries, call.q,
                         call.out, call.scale, call.stream_ordered);
  });
}

}  // namespace karakv::server
