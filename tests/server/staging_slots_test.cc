// StagingSlots (device staging's slot and generation bookkeeping) and check_generation, without a
// GPU: reuse only after a Detach and only for the same tenant, never after a lease expiry, and a
// stale generation refused naming both.
#include "server/staging_slots.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/staging.h"

namespace karakv::server {
namespace {

using ::testing::HasSubstr;
using SlotState = StagingSlots::SlotState;

constexpr size_t kMiB2 = size_t(2) << 20;

TEST(StagingSlotsTest, DetachedSlotGoesToTheSameTenantUnderANewGeneration) {
  StagingSlots slots;
  const StagingSlots::Lease a = slots.acquire(kMiB2, "t");
  EXPECT_TRUE(a.fresh);
  EXPECT_NE(a.generation, 0u);
  EXPECT_TRUE(slots.check(a.slot, a.generation).ok());
  ASSERT_TRUE(slots.release(a.slot, a.generation, /*importer_closed=*/true));
  EXPECT_EQ(slots.state(a.slot), SlotState::kFree);
  // Released: its generation no longer passes.
  EXPECT_EQ(slots.check(a.slot, a.generation).code(), absl::StatusCode::kFailedPrecondition);

  const StagingSlots::Lease b = slots.acquire(kMiB2, "t");
  EXPECT_FALSE(b.fresh);
  EXPECT_EQ(b.slot, a.slot);
  EXPECT_GT(b.generation, a.generation);
  EXPECT_TRUE(slots.check(b.slot, b.generation).ok());
  const absl::Status stale = slots.check(a.slot, a.generation);
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(stale.message(), HasSubstr(absl::StrCat("generation ", a.generation)));
  EXPECT_THAT(stale.message(), HasSubstr(absl::StrCat("at generation ", b.generation)));
  // A release naming the old generation does not free the new lease.
  EXPECT_FALSE(slots.release(a.slot, a.generation, true));
  EXPECT_EQ(slots.state(b.slot), SlotState::kLive);
  EXPECT_TRUE(slots.check(b.slot, b.generation).ok());
}

TEST(StagingSlotsTest, NoSlotIsReusedWhileItsImporterMayHoldIt) {
  StagingSlots slots;
  const StagingSlots::Lease live = slots.acquire(kMiB2, "t");
  // Live: a second session of the same tenant gets a slot of its own.
  const StagingSlots::Lease second = slots.acquire(kMiB2, "t");
  EXPECT_TRUE(second.fresh);
  EXPECT_NE(second.slot, live.slot);
  // Lease expiry (importer_closed false): quarantined, never handed out again.
  ASSERT_TRUE(slots.release(live.slot, live.generation, false));
  EXPECT_EQ(slots.state(live.slot), SlotState::kQuarantined);
  for (int i = 0; i < 4; ++i) {
    const StagingSlots::Lease next = slots.acquire(kMiB2, "t");
    EXPECT_NE(next.slot, live.slot);
    EXPECT_TRUE(slots.release(next.slot, next.generation, true));
  }
  EXPECT_EQ(slots.state(live.slot), SlotState::kQuarantined);
  EXPECT_EQ(slots.bytes_in(SlotState::kQuarantined), kMiB2);
  EXPECT_EQ(slots.count_in(SlotState::kQuarantined), 1u);
  // Quarantined memory stays held (never freed, so its address cannot come back elsewhere).
  EXPECT_EQ(slots.bytes_held(), slots.count_in(SlotState::kLive) * kMiB2 + slots.count_in(SlotState::kFree) * kMiB2 +
                                    kMiB2);
}

TEST(StagingSlotsTest, AnotherTenantNeverGetsAFreedSlot) {
  StagingSlots slots;
  const StagingSlots::Lease a = slots.acquire(kMiB2, "tenant-a");
  ASSERT_TRUE(slots.release(a.slot, a.generation, true));
  const StagingSlots::Lease b = slots.acquire(kMiB2, "tenant-b");
  EXPECT_TRUE(b.fresh);
  EXPECT_NE(b.slot, a.slot);
  // Nor does the same tenant asking for another size.
  const StagingSlots::Lease c = slots.acquire(2 * kMiB2, "tenant-a");
  EXPECT_TRUE(c.fresh);
  EXPECT_NE(c.slot, a.slot);
}

TEST(StagingSlotsTest, GenerationsAreUniqueAcrossSlotsAndAbandonedSlotsHoldNothing) {
  StagingSlots slots;
  std::set<uint64_t> seen;
  for (int i = 0; i < 50; ++i) {
    const StagingSlots::Lease l = slots.acquire(kMiB2 * (1 + i % 3), i % 2 ? "a" : "b");
    EXPECT_TRUE(seen.insert(l.generation).second) << "generation " << l.generation << " handed out twice";
    if (i % 5 == 0) {
      slots.abandon(l);
      EXPECT_EQ(slots.state(l.slot), SlotState::kAbandoned);
    } else {
      slots.release(l.slot, l.generation, i % 7 != 0);
    }
  }
  EXPECT_EQ(slots.count_in(SlotState::kLive), 0u);
  EXPECT_EQ(slots.bytes_in(SlotState::kAbandoned), 0u);
  EXPECT_EQ(slots.bytes_held(), slots.bytes_in(SlotState::kFree) + slots.bytes_in(SlotState::kQuarantined));
}

// A stand-in for a device region (no GPU needed to check the generation rule).
class FakeDeviceStaging final : public Staging {
 public:
  explicit FakeDeviceStaging(uint64_t generation) : generation_(generation) {}
  StagingKind kind() const override { return StagingKind::kCudaIpc; }
  size_t size() const override { return kMiB2; }
  uint8_t* base() const override { return nullptr; }
  uint64_t generation() const override { return generation_; }

 private:
  uint64_t generation_;
};

TEST(StagingGenerationTest, DeviceStagingNeedsTheCurrentGeneration) {
  FakeDeviceStaging device(7);
  EXPECT_TRUE(check_generation(device, 7).ok());
  const absl::Status stale = check_generation(device, 6);
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(stale.message(), HasSubstr("generation 6"));
  EXPECT_THAT(stale.message(), HasSubstr("generation 7"));
  EXPECT_THAT(stale.message(), HasSubstr("cuda_ipc"));
  const absl::Status missing = check_generation(device, 0);
  EXPECT_EQ(missing.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(missing.message(), HasSubstr("staging_generation is missing"));
  EXPECT_THAT(missing.message(), HasSubstr("generation 7"));
}

TEST(StagingGenerationTest, ShmStagingAcceptsNoGenerationButRefusesAWrongOne) {
  auto shm = StagingRegion::create(4096);
  ASSERT_TRUE(shm.ok()) << shm.status();
  EXPECT_EQ((*shm)->generation(), 0u);
  EXPECT_FALSE((*shm)->on_device());
  EXPECT_TRUE(check_generation(**shm, 0).ok());
  const absl::Status wrong = check_generation(**shm, 3);
  EXPECT_EQ(wrong.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(wrong.message(), HasSubstr("generation 3"));
  EXPECT_THAT(wrong.message(), HasSubstr("shm staging region is generation 0"));
}

}  // namespace
}  // namespace karakv::server
