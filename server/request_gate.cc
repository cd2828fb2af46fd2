// The request gate: metrics, draining and invariant checks around every call; the Step and Attend
// entries both transports share.
#include "server/request_gate.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace karakv::server {

absl::Status draining_status() {
  return absl::UnavailableError("karakvd is draining for shutdown; retry on another daemon or after restart");
}

absl::Status RequestGate::device_failed(const char* method) const {
  const std::string fault = core_->device_fault();
  if (fault.empty()) return absl::OkStatus();
  if (std::strcmp(method, "Ping") == 0 || std::strcmp(method, "Stats") == 0) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "karakvd's device failed and it cannot serve until it restarts (its health check reports NOT_SERVING and its "
      "liveness heartbeat stopped): ",
      fault, "; every sequence held here is lost: retry on another daemon or after the restart"));
}

void RequestGate::finish(const char* method, std::chrono::steady_clock::time_point start, const absl::Status& status,
                         bool mutates) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (metrics_ != nullptr) metrics_->observe_rpc(method, seconds, status.code());
  // A kernel fault comes back as INTERNAL from the call that met it: from then on every session
  // hears of it on its event stream.
  if (status.code() == absl::StatusCode::kInternal) core_->announce_device_fault();
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
