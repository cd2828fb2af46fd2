// DeviceStagingPool without a GPU: a stand-in backend hands out host memory as "shared device
// memory", so what the pool does with it (sizes, reuse after Detach, quarantine after a lease
// expiry, the limit, allocation failures) is checked here; CUDA's side runs in
// tests/integration/device_staging_test.cc on a GPU.
#include "server/device_staging.h"

#include <cstdlib>

#include <sys/mman.h>

#include <functional>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core.h"
#include "tests/server/delegating_backend.h"
#include "tests/server/test_geometry.h"

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

// The CPU backend, pretending that one host buffer is device memory: the core must then move
// bytes in and out of it through copy_in / copy_out (counted into *copies), never touch them
// itself. The buffer is PROT_NONE except while a backend call runs (its kernels read it directly,
// as the CUDA backend reads device staging), so a host access by the server crashes the test.
struct CopyCounts {
  int in = 0, out = 0;
};
class PretendDeviceBackend final : public karakv::testing::DelegatingBackend {
 public:
  PretendDeviceBackend(const uint8_t* begin, size_t bytes, CopyCounts* copies)
      : DelegatingBackend(kn::make_cpu_backend(1)), begin_(begin), end_(begin + bytes), copies_(copies) {}
  void enter() const override { mprotect(const_cast<uint8_t*>(begin_), end_ - begin_, PROT_READ | PROT_WRITE); }
  void leave() const override { mprotect(const_cast<uint8_t*>(begin_), end_ - begin_, PROT_NONE); }
  bool is_device_memory(const void* p) const override {
    auto* b = static_cast<const uint8_t*>(p);
    return b >= begin_ && b < end_;
  }
  KernelStatus copy_in(void* dst, const void* src, size_t bytes) override {
    copies_->in += is_device_memory(dst);
    return DelegatingBackend::copy_in(dst, src, bytes);
  }
  KernelStatus copy_out(void* dst, const void* src, size_t bytes) override {
    copies_->out += is_device_memory(src);
    return DelegatingBackend::copy_out(dst, src, bytes);
  }

 private:
  const uint8_t* begin_;
  const uint8_t* end_;
  CopyCounts* copies_;
};

// Everything one script of calls returns: Step and Attend outputs, ReadKV's K, V and positions.
struct CoreOutputs {
  std::vector<std::vector<uint8_t>> outputs;
  bool operator==(const CoreOutputs&) const = default;
};

// The same script on a core over `backend`, with every tensor in `staging` (the "device" buffer
// for the pretend backend, plain host memory for the reference): a kara sequence (it keeps its
// step queries: the query cache reads them) and a kivi4 one with a small residual window (its
// aged tokens are quantized, so a Step over both splits into groups).
// worker(true) opens the staging memory to this process (the worker's writes and reads),
// worker(false) closes it again before each call into the core.
CoreOutputs run_core_script(std::unique_ptr<kn::Backend> backend, absl::Span<uint8_t> staging,
                            const std::function<void(bool)>& worker) {
  CoreOutputs got;
  CoreConfig c;
  c.geometry = karakv::server::testing::small_test_geometry(kn::DType::kFloat32, 32, 16);  // what KIVI can hold
  c.pool_bytes = 256 * c.geometry.block_bytes();
  auto core = Core::create(c, std::move(backend));
  EXPECT_TRUE(core.ok()) << core.status();
  if (!core.ok()) return got;
  Core& k = **core;
  auto a = k.attach("w", "t", 0, kn::Geometry{});
  EXPECT_TRUE(a.ok());
  const std::string session = a->session_id;
  SequenceOptions kara;
  kara.policy = "kara";
  SequenceOptions quant;
  quant.policy = "none";
  quant.storage = "kivi4";
  quant.params["residual"] = 8;
  auto s1 = k.create_sequence(session, kara), s2 = k.create_sequence(session, quant);
  EXPECT_TRUE(s1.ok() && s2.ok()) << s1.status() << s2.status();
  if (!s1.ok() || !s2.ok()) return got;
  const uint64_t ids[] = {*s1, *s2};
  std::mt19937 rng(3);
  std::normal_distribution<float> dist;
  auto fill = [&](size_t offset, size_t bytes) {
    worker(true);
    for (size_t i = 0; i < bytes / 4; ++i) {
      const float f = dist(rng);
      std::memcpy(staging.data() + offset + i * 4, &f, 4);
    }
    worker(false);
    return ConstBytes(staging.data() + offset, bytes);
  };
  const int prompt = 40, queries = 2;
  for (uint64_t id : ids) {
    ConstBytes kb = fill(0, k.append_bytes(prompt)), vb = fill(1 << 16, k.append_bytes(prompt));
    ConstBytes qb = fill(1 << 17, size_t(c.geometry.num_layers) * k.q_bytes(queries));
    auto r = k.append(session, id, prompt, kb, vb, qb, queries);
    EXPECT_TRUE(r.ok()) << r.status();
  }
  const size_t out_at = 3 << 16;
  for (int step = 0; step < 3; ++step) {
    for (int layer = 0; layer < c.geometry.num_layers; ++layer) {
      ConstBytes kb = fill(0, k.step_kv_bytes(2)), vb = fill(1 << 16, k.step_kv_bytes(2));
      ConstBytes qb = fill(1 << 17, k.q_bytes(2));
      MutableBytes out(staging.data() + out_at, k.q_bytes(2));
      auto r = k.step(session, layer, ids, kb, vb, qb, out, 0);
      EXPECT_TRUE(r.ok()) << r.status();
      worker(true);
      got.outputs.emplace_back(out.begin(), out.end());
      worker(false);
    }
  }
  {
    ConstBytes qb = fill(1 << 17, k.q_bytes(queries));
    MutableBytes out(staging.data() + out_at, k.q_bytes(queries));
    EXPECT_TRUE(k.attend(session, *s1, 1, queries, qb, out, 0).ok());
    worker(true);
    got.outputs.emplace_back(out.begin(), out.end());
    worker(false);
  }
  for (uint64_t id : ids) {
    auto n = k.read_kv(session, id, [&](int32_t tokens) -> absl::StatusOr<ReadKVTargets> {
      const size_t kv = k.append_bytes(tokens);
      const size_t positions = size_t(c.geometry.num_layers) * c.geometry.num_kv_heads * tokens * 4;
      return ReadKVTargets{MutableBytes(staging.data(), kv), MutableBytes(staging.data() + (1 << 16), kv),
                           MutableBytes(staging.data() + out_at, positions)};
    });
    EXPECT_TRUE(n.ok()) << n.status();
    const size_t kv = k.append_bytes(*n);
    worker(true);
    got.outputs.emplace_back(staging.begin(), staging.begin() + kv);
    got.outputs.emplace_back(staging.begin() + (1 << 16), staging.begin() + (1 << 16) + kv);
    worker(false);
  }
  EXPECT_TRUE(k.check_invariants().ok());
  return got;
}

// Device staging's host-side paths on the CPU: the query cache, a Step split into quantized groups
// and ReadKV's assembly go through the backend's copies when the tensors are "device" memory, and
// every output equals the same script's on plain host memory, bit for bit.
TEST(DeviceStagingCoreTest, DeviceTensorsGoThroughTheBackendAndGiveTheHostResults) {
  constexpr size_t kBytes = 1 << 20;
  std::vector<uint8_t> host(kBytes);
  const CoreOutputs want = run_core_script(kn::make_cpu_backend(1), absl::MakeSpan(host), [](bool) {});
  void* mapped = mmap(nullptr, kBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  auto* device = static_cast<uint8_t*>(mapped);
  CopyCounts copies;
  const CoreOutputs got =
      run_core_script(std::make_unique<PretendDeviceBackend>(device, kBytes, &copies), absl::MakeSpan(device, kBytes),
                      [&](bool open) { mprotect(device, kBytes, open ? PROT_READ | PROT_WRITE : PROT_NONE); });
  munmap(mapped, kBytes);
  // Read out of "device" memory: the queries the kara sequence keeps (Append and every Step) and a
  // split Step's q; written into it: a split Step's out and ReadKV's three tensors per sequence.
  EXPECT_GT(copies.out, 0);
  EXPECT_GT(copies.in, 0);
  ASSERT_EQ(got.outputs.size(), want.outputs.size());
  for (size_t i = 0; i < want.outputs.size(); ++i) EXPECT_EQ(got.outputs[i], want.outputs[i]) << "output " << i;
}

}  // namespace
}  // namespace karakv::server
