#include "server/score_rows.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/policy.h"
#include "server/validation.h"

namespace karakv::server {

ScoreRows::~ScoreRows() {
  if (data_ != nullptr) backend_->free(data_);
}

absl::Status ScoreRows::download(std::vector<float>* out) const {
  out->assign(rows_ * size_t(capacity_), 0.0f);
  if (data_ == nullptr) return absl::OkStatus();
  return to_status(backend_->copy_out(out->data(), data_, bytes()));
}

absl::Status ScoreRows::grow(int32_t slots) {
  if (slots < 0) return absl::InternalError(absl::StrCat("score rows: grow to ", slots, " slots"));
  if (slots <= capacity_ || rows_ == 0) {
    length_ = std::max(length_, slots);
    return absl::OkStatus();
  }
  const int64_t wanted = std::max<int64_t>(slots, int64_t(capacity_) * 2);
  const int64_t capacity = (wanted + kSlotGranule - 1) / kSlotGranule * kSlotGranule;
  if (capacity > INT32_MAX) return absl::InternalError(absl::StrCat("score rows: ", capacity, " slots overflow int32"));
  void* fresh = nullptr;
  const size_t fresh_bytes = rows_ * size_t(capacity) * sizeof(float);
  if (absl::Status s = to_status(backend_->allocate(fresh_bytes, &fresh)); !s.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("accumulated attention of ", rows_, " rows x ", capacity, " slots (", fresh_bytes,
                     " bytes) does not fit in backend memory: ", s.message()));
  }
  // Zero-filled by allocate(); the old sums go to the start of each new row.
  if (data_ != nullptr && length_ > 0) {
    std::vector<float> old;
    absl::Status s = download(&old);
    std::vector<float> moved;
    if (s.ok()) {
      moved.assign(rows_ * size_t(capacity), 0.0f);
      for (size_t r = 0; r < rows_; ++r)
        std::copy_n(old.data() + r * size_t(capacity_), length_, moved.data() + r * size_t(capacity));
      s = to_status(backend_->copy_in(fresh, moved.data(), fresh_bytes));
    }
    if (!s.ok()) {
      backend_->free(fresh);
      return s;
    }
  }
  if (data_ != nullptr) backend_->free(data_);
  data_ = static_cast<float*>(fresh);
  capacity_ = int32_t(capacity);
  length_ = slots;
  return absl::OkStatus();
}

absl::Status ScoreRows::read(int32_t slots, std::vector<float>* out) const {
  if (slots < 0 || slots > length_)
    return absl::InternalError(absl::StrCat("score rows: read ", slots, " slots of rows of ", length_));
  std::vector<float> all;
  if (absl::Status s = download(&all); !s.ok()) return s;
  out->resize(rows_ * size_t(slots));
  for (size_t r = 0; r < rows_; ++r)
    std::copy_n(all.data() + r * size_t(capacity_), slots, out->data() + r * size_t(slots));
  return absl::OkStatus();
}

absl::Status ScoreRows::remap(const CompactionPlan& plan, int32_t resident_before) {
  if (plan.begin < 0 || plan.end < plan.begin || resident_before < plan.end || resident_before > length_ ||
      plan.kept.size() != rows_ * size_t(plan.num_kept)) {
    return absl::InternalError(absl::StrCat("score rows: plan [", plan.begin, ", ", plan.end, ") keeping ",
                                            plan.num_kept, " does not fit ", rows_, " rows of ", length_, " slots"));
  }
  const int32_t after = plan.begin + plan.num_kept + (resident_before - plan.end);
  std::vector<float> all;
  const absl::Status read = download(&all);
  std::vector<float> next(rows_ * size_t(capacity_), 0.0f);
  for (size_t r = 0; read.ok() && r < rows_; ++r) {
    const float* from = all.data() + r * size_t(capacity_);
    float* to = next.data() + r * size_t(capacity_);
    to = std::copy_n(from, plan.begin, to);
    for (int32_t i = 0; i < plan.num_kept; ++i) *to++ = from[plan.kept[r * size_t(plan.num_kept) + i]];
    std::copy(from + plan.end, from + resident_before, to);
  }
  // The cache is compacted already, so the rows follow it even when the sums cannot: a failed read
  // leaves them zero (lost), never misaligned with the slots.
  const absl::Status write =
      data_ != nullptr ? to_status(backend_->copy_in(data_, next.data(), bytes())) : absl::OkStatus();
  length_ = after;
  return !read.ok() ? read : write;
}

absl::StatusOr<std::unique_ptr<ScoreRows>> ScoreRows::clone() const {
  auto copy = std::make_unique<ScoreRows>(*backend_, rows_);
  if (data_ == nullptr) return copy;
  void* fresh = nullptr;
  if (absl::Status s = to_status(backend_->allocate(bytes(), &fresh)); !s.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("copying ", bytes(),
                                                     " bytes of accumulated attention for the fork: ", s.message()));
  }
  copy->data_ = static_cast<float*>(fresh);
  copy->capacity_ = capacity_;
  copy->length_ = length_;
  // Backend memory on both sides (a device-to-device copy on a GPU).
  if (absl::Status s = to_status(backend_->copy_in(fresh, data_, bytes())); !s.ok()) return s;
  return copy;
}

}  // namespace karakv::server
