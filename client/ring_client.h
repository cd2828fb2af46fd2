// The worker's end of the decode fast path (karakv/v1/ring.h): submits one command, then waits for
// its completion by spinning briefly (not at all for a while after a yield was slow: a busy
// machine) and then sleeping on the completion doorbell, every wait bounded by a deadline and
// interrupted by a liveness check of the daemon.
#pragma once

#include <cstdint>
#include <optional>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "karakv/v1/ring.h"

namespace karakv {

class RingClient {
 public:
  // `base` is the start of the ring area (already checked with ring::layout_matches).
  RingClient(uint8_t* base, absl::Duration spin);

  // Submits `cmd` and waits for its completion until `deadline`. Returns nullopt when the command
  // ring stayed full for `full_wait` (nothing was submitted: the caller may use gRPC instead).
  // `alive` is asked whenever the wait has lasted a while; a non-OK answer ends the wait with it.
  // Any error other than the command's own status leaves the ring unusable (usable() == false).
  absl::StatusOr<std::optional<ring::Completion>> call(ring::Command& cmd, absl::Time deadline,
                                                       absl::Duration full_wait,
                                                       absl::FunctionRef<absl::Status()> alive);
  bool usable() const { return usable_; }
  // Whether the daemon takes the ops of `bit` (ring::kOps*) on this ring.
  bool supports(uint32_t bit) const { return (header_->ops & bit) == bit; }
  uint64_t calls() const { return calls_; }
  uint64_t sleeps() const { return sleeps_; }

 private:
  absl::Status closed_status() const;
  void ring_doorbell();

  ring::Header* header_;
  ring::Producer<ring::Command> sq_;
  ring::Consumer<ring::Completion> cq_;
  const int64_t spin_ns_;
  ring::SpinPolicy spinning_;  // whether a wait spins first (not while yields are slow)
  uint64_t next_tag_ = 1;
  bool usable_ = true;
  uint64_t calls_ = 0, sleeps_ = 0;
};

}  // namespace karakv
