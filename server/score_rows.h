// ScoreRows: per-slot float rows (H2O's accumulated decode attention) kept in the backend's own
// memory, so that a decode step adds a layer's probabilities where they are computed (on a GPU, in
// device memory) instead of copying them to the host every layer. Only the rare events touch the
// host: growth past the capacity, a compaction's remap, and reading the scores for a plan.
//
// Layout: one allocation, [rows][capacity] fp32. Slots [0, length) of a row hold its sums; every
// slot at or past `length` is zero, so a decode step's new slot starts from zero without a write.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "karakv/kernels/backend.h"

namespace karakv::server {

struct CompactionPlan;

class ScoreRows {
 public:
  // No memory until the first grow().
  ScoreRows(kernels::Backend& backend, size_t rows) : backend_(&backend), rows_(rows) {}
  ~ScoreRows();
  ScoreRows(const ScoreRows&) = delete;
  ScoreRows& operator=(const ScoreRows&) = delete;

  // Rows cover at least `slots` slots (new slots are zero). Past the capacity the rows move to an
  // allocation of max(slots, 2 x capacity) slots, rounded up to kSlotGranule; on failure nothing
  // changes.
  absl::Status grow(int32_t slots);
  // Slots [0, slots) of every row, [rows][slots], copied to the host; slots <= length().
  absl::Status read(int32_t slots, std::vector<float>* out) const;
  // The plan was applied to a cache of `resident_before` slots: slots [0, begin) stay, then per row
  // its kept slots, then [end, resident_before) shift down; what is past the new length is zeroed.
  // A plan that does not fit is refused without a change; a failed copy still moves the length
  // (the cache has moved), with the sums lost.
  absl::Status remap(const CompactionPlan& plan, int32_t resident_before);
  // A copy in fresh backend memory (ForkSequence).
  absl::StatusOr<std::unique_ptr<ScoreRows>> clone() const;

  // Row r's first slot (backend memory), or null before the first grow().
  float* row(size_t r) const { return data_ == nullptr ? nullptr : data_ + r * size_t(capacity_); }
  size_t rows() const { return rows_; }
  int32_t length() const { return length_; }
  int32_t capacity() const { return capacity_; }
  // Backend memory held.
  size_t bytes() const { return rows_ * size_t(capacity_) * sizeof(float); }

  static constexpr int32_t kSlotGranule = 256;

 private:
  // The whole allocation ([rows][capacity]) on the host.
  absl::Status download(std::vector<float>* out) const;

  kernels::Backend* backend_;
  const size_t rows_;
  float* data_ = nullptr;
  int32_t capacity_ = 0;
  int32_t length_ = 0;
};

}  // namespace karakv::server
