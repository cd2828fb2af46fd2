// DeviceStagingPool without a GPU: a stand-in backend hands out host memory as "shared device
// memory", so what the pool does with it (sizes, reuse after Detach, quarantine after a lease
// expiry, the limit, allocation failures) is checked here; CUDA's side runs in
// tests/integration/device_staging_test.cc on a GPU.
#include "server/device_staging.h"

#include <cstdlib>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace karakv::server {
namespace {

using ::testing::HasSubstr;
namespace kn = karakv::kernels;

constexpr size_t kMiB2 = kn::kSharedMemoryAlignment;

// The CPU backend, plus allocate_shared from the heap with a handle that names the allocation.
class FakeDeviceBackend final : public kn::Backend {
 public:
  FakeDeviceBackend() : cpu_(kn::make_cpu_backend(1)) {}
  ~FakeDeviceBackend() override { EXPECT_EQ(live_, 0) << "shared allocations not freed"; }
  std::string_view name() const override { return "fake-device"; }
  bool supports(kn::Op op, kn::DType dtype) const override { return cpu_->supports(op, dtype); }
  kn::KernelStatus allocate(size_t bytes, void** out) override { return cpu_->allocate(bytes, out); }
  void free(void* p) override { cpu_->free(p); }
  kn::KernelStatus write_kv(const kn::PagedKV& kv, int seq, int start, int n, int l0, int nl, const void* k,
                            const void* v) override {
    return cpu_->write_kv(kv, seq, start, n, l0, nl, k, v);
  }
  kn::KernelStatus decode_attention(const kn::PagedKV& kv, int layer, const float* q, float* out,
                                    float scale) override {
    return cpu_->decode_attention(kv, layer, q, out, scale);
  }
  kn::KernelStatus causal_attention(const kn::PagedKV& kv, int seq, int layer, int n, const float* q, float* out,
                                    float scale) override {
    return cpu_->causal_attention(kv, seq, layer, n, q, out, scale);
  }
  kn::KernelStatus read_kv(const kn::PagedKV& kv, int seq, void* k, void* v) override {
    return cpu_->read_kv(kv, seq, k, v);
  }
  kn::KernelStatus copy_block(const kn::PagedKV& kv, int32_t src, int32_t dst) override {
    return cpu_->copy_block(kv, src, dst);
  }

  bool shares_device_memory() const override { return true; }
  kn::KernelStatus allocate_shared(size_t bytes, kn::SharedDeviceMemory* out) override {
    if (fail_next_) {
      fail_next_ = false;
      return {kn::KernelStatus::Code::kInternal, "allocate_shared: out of device memory (fake)"};
    }
    ++allocations_;
    ++live_;
    out->ptr = std::calloc(1, bytes);
    out->bytes = bytes;
    out->device = 0;
    out->ipc_handle = "handle-" + std::to_string(allocations_);
    out->ipc_handle.resize(64, '\0');
    return kn::KernelStatus::ok();
  }
  void free_shared(const kn::SharedDeviceMemory& m) override {
    --live_;
    std::free(m.ptr);
  }

  int allocations_ = 0, live_ = 0;
  bool fail_next_ = false;

 private:
  std::unique_ptr<kn::Backend> cpu_;
};

TEST(DeviceStagingPoolTest, SizesRoundUpAndADetachedRegionReturnsUnderANewGeneration) {
  FakeDeviceBackend backend;
  auto pool = DeviceStagingPool::create(backend, 64 * kMiB2);
  std::string handle;
  void* base = nullptr;
  uint64_t generation = 0;
  {
    auto r = pool->acquire(kMiB2 + 1, "t");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)->size(), 2 * kMiB2);
    EXPECT_TRUE((*r)->on_device());
    EXPECT_EQ((*r)->ipc_handle().size(), 64u);
    EXPECT_NE((*r)->generation(), 0u);
    handle = (*r)->ipc_handle();
    base = (*r)->base();
    generation = (*r)->generation();
    (*r)->mark_importer_closed();  // what SessionTable::end does on Detach
  }
  auto again = pool->acquire(2 * kMiB2, "t");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->ipc_handle(), handle);
  EXPECT_EQ((*again)->base(), base);
  EXPECT_GT((*again)->generation(), generation);
  EXPECT_EQ(backend.allocations_, 1);
  // Another tenant gets memory of its own.
  auto other = pool->acquire(2 * kMiB2, "u");
  ASSERT_TRUE(other.ok());
  EXPECT_NE((*other)->base(), base);
  EXPECT_EQ(backend.allocations_, 2);
}

TEST(DeviceStagingPoolTest, AnExpiredRegionIsQuarantinedAndCountsAgainstTheLimit) {
  FakeDeviceBackend backend;
  auto pool = DeviceStagingPool::create(backend, 3 * kMiB2);
  void* expired = nullptr;
  {
    auto r = pool->acquire(kMiB2, "t");
    ASSERT_TRUE(r.ok());
    expired = (*r)->base();
  }  // dropped without mark_importer_closed: a lease expiry
  EXPECT_EQ(pool->quarantined_bytes(), kMiB2);
  std::vector<std::shared_ptr<DeviceStaging>> held;
  for (int i = 0; i < 2; ++i) {
    auto r = pool->acquire(kMiB2, "t");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NE((*r)->base(), expired);
    held.push_back(*r);
  }
  EXPECT_EQ(pool->bytes_held(), 3 * kMiB2);
  auto over = pool->acquire(kMiB2, "t");
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(over.status().message()), HasSubstr("--max_device_staging_bytes"));
  EXPECT_THAT(std::string(over.status().message()), HasSubstr(std::to_string(kMiB2) + " of them quarantined"));
  EXPECT_EQ(backend.allocations_, 3);
}

TEST(DeviceStagingPoolTest, AFailedAllocationLeavesNothingBehind) {
  FakeDeviceBackend backend;
  auto pool = DeviceStagingPool::create(backend, 8 * kMiB2);
  backend.fail_next_ = true;
  auto r = pool->acquire(kMiB2, "t");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("out of device memory"));
  EXPECT_EQ(pool->bytes_held(), 0u);
  auto ok = pool->acquire(kMiB2, "t");
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST(DeviceStagingPoolTest, TheCpuBackendIsRefusedNamingTheFix) {
  auto cpu = kn::make_cpu_backend(1);
  auto pool = DeviceStagingPool::create(*cpu, 8 * kMiB2);
  auto r = pool->acquire(kMiB2, "t");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("cpu backend"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("--backend=cuda"));
}

}  // namespace
}  // namespace karakv::server
