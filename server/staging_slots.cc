#include "server/staging_slots.h"

#include "absl/strings/str_cat.h"

namespace karakv::server {

StagingSlots::Lease StagingSlots::acquire(size_t bytes, const std::string& tenant) {
  Lease lease;
  lease.generation = ++next_generation_;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    if (s.state == SlotState::kFree && s.bytes == bytes && s.tenant == tenant) {
      s.state = SlotState::kLive;
      s.generation = lease.generation;
      lease.slot = static_cast<int>(i);
      return lease;
    }
  }
  slots_.push_back(Slot{bytes, tenant, lease.generation, SlotState::kLive});
  lease.slot = static_cast<int>(slots_.size() - 1);
  lease.fresh = true;
  return lease;
}

void StagingSlots::abandon(const Lease& lease) {
  Slot& s = slots_.at(lease.slot);
  if (s.generation == lease.generation) {
    s.state = SlotState::kAbandoned;
    s.bytes = 0;
  }
}

bool StagingSlots::release(int slot, uint64_t generation, bool importer_closed) {
  Slot& s = slots_.at(slot);
  if (s.generation != generation || s.state != SlotState::kLive) return false;
  s.state = importer_closed ? SlotState::kFree : SlotState::kQuarantined;
  return true;
}

absl::Status StagingSlots::check(int slot, uint64_t generation) const {
  if (slot < 0 || static_cast<size_t>(slot) >= slots_.size()) {
    return absl::FailedPreconditionError(absl::StrCat("unknown device staging slot ", slot));
  }
  const Slot& s = slots_[slot];
  if (s.state == SlotState::kLive && s.generation == generation) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "stale device staging generation ", generation, ": slot ", slot, " is ",
      s.state == SlotState::kLive ? absl::StrCat("at generation ", s.generation) : "not leased",
      " now; use the generation of the session's own AttachReply"));
}

size_t StagingSlots::bytes_held() const {
  size_t n = 0;
  for (const Slot& s : slots_) n += s.bytes;
  return n;
}

size_t StagingSlots::bytes_in(SlotState state) const {
  size_t n = 0;
  for (const Slot& s : slots_)
    if (s.state == state) n += s.bytes;
  return n;
}

size_t StagingSlots::count_in(SlotState state) const {
  size_t n = 0;
  for (const Slot& s : slots_) n += s.state == state;
  return n;
}

}  // namespace karakv::server
