// Which device staging allocation each session holds, and when one may be handed out again. Device
// staging memory is never freed while karakvd runs: a freed address can come back from the next
// allocation with byte-identical CUDA IPC handle bytes, and a worker that still had the old one
// open would be given its old mapping, aliasing someone else's memory. So allocations live in
// slots, and a slot goes to a new session only when no importer can still hold it. Bookkeeping
// only (no device calls), so it is unit-tested on any machine. Not thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace karakv::server {

class StagingSlots {
 public:
  struct Lease {
    int slot = -1;
    uint64_t generation = 0;  // unique for every lease this object hands out, never 0
    bool fresh = false;       // a new slot: the caller allocates its memory (or abandon()s it)
  };
  enum class SlotState { kLive, kFree, kQuarantined, kAbandoned };

  // A slot of exactly `bytes` for `tenant`: a free one that this tenant held last, else a new one.
  // Another tenant's free slot is never reused, so even a worker that broke the Detach contract
  // (kept its mapping) can only ever see its own tenant's data.
  Lease acquire(size_t bytes, const std::string& tenant);
  // A fresh lease whose memory could not be had: the slot is dropped for good.
  void abandon(const Lease& lease);
  // The session holding `generation` of `slot` ended. importer_closed: it detached, and the SDK
  // closes its mapping before it sends Detach, so the slot is free for the same tenant. Otherwise
  // (lease expiry: the worker may be alive and still mapping it) the slot is quarantined and never
  // handed out again. A release naming an old generation changes nothing and returns false.
  bool release(int slot, uint64_t generation, bool importer_closed);

  // OK when `generation` is the one `slot` is leased under now; FAILED_PRECONDITION naming both.
  absl::Status check(int slot, uint64_t generation) const;
  SlotState state(int slot) const { return slots_.at(slot).state; }
  uint64_t generation(int slot) const { return slots_.at(slot).generation; }

  // Bytes of every slot that holds memory (live, free and quarantined), and per state.
  size_t bytes_held() const;
  size_t bytes_in(SlotState state) const;
  size_t count_in(SlotState state) const;

 private:
  struct Slot {
    size_t bytes = 0;
    std::string tenant;
    uint64_t generation = 0;
    SlotState state = SlotState::kLive;
  };
  std::vector<Slot> slots_;
  uint64_t next_generation_ = 0;
};

}  // namespace karakv::server
