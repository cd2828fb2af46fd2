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
#include "server/metrics.h"
#include "server/ring.h"
#include "server/service.h"
#include "karakv/v1/ring.h"
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
    return karakv::testing::heap_shared_memory(bytes, "handle-" + std::to_string(allocations_), out);
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


// Stream order without a GPU: the CPU backend plus heap "device staging" and events that only log
// what is done with them, so the order of waits, records, deferrals and host waits around a
// request is checked here; the CUDA events themselves run in tests/integration on a GPU.
class EventLogBackend final : public karakv::testing::DelegatingBackend {
 public:
  EventLogBackend() : DelegatingBackend(kn::make_cpu_backend(1)) {}
  ~EventLogBackend() override { EXPECT_EQ(live_events_, kept_events_) << "events not destroyed"; }
  bool shares_device_memory() const override { return true; }
  KernelStatus allocate_shared(size_t bytes, kn::SharedDeviceMemory* out) override {
    return karakv::testing::heap_shared_memory(bytes, "m", out);
  }
  void free_shared(const kn::SharedDeviceMemory& m) override { std::free(m.ptr); }

  void set_deferred(bool on) override { log.push_back(on ? "defer" : "undefer"); }
  KernelStatus synchronize() override {
    log.push_back("synchronize");
    return KernelStatus::ok();
  }
  KernelStatus create_shared_event(kn::SharedEvent* out) override {
    out->event = &daemon_;
    out->ipc_handle.assign(64, 'd');
    ++live_events_;
    return KernelStatus::ok();
  }
  KernelStatus open_shared_event(const std::string& handle, kn::SharedEvent* out) override {
    EXPECT_EQ(handle, std::string(64, 'w'));
    out->event = &worker_;
    ++live_events_;
    return KernelStatus::ok();
  }
  void destroy_shared_event(kn::SharedEvent* e) override {
    if (e->event == nullptr) return;
    log.push_back(e->event == &worker_ ? "destroy worker" : "destroy daemon");
    e->event = nullptr;
    --live_events_;
  }
  KernelStatus wait_event(const kn::SharedEvent& e) override {
    log.push_back(e.event == &worker_ ? "wait worker" : "wait ?");
    return KernelStatus::ok();
  }
  KernelStatus record_event(const kn::SharedEvent& e) override {
    log.push_back(e.event == &daemon_ ? "record daemon" : "record ?");
    if (fail_record_) return {KernelStatus::Code::kInternal, "cudaEventRecord: cudaErrorLaunchFailure (fake)"};
    return KernelStatus::ok();
  }
  KernelStatus write_step_kv(const PagedKV& kv, int layer, const int32_t* positions, const void* k,
                             const void* v) override {
    log.push_back("write_step_kv");
    return DelegatingBackend::write_step_kv(kv, layer, positions, k, v);
  }
  KernelStatus decode_attention(const PagedKV& kv, int layer, const float* q, float* out, float scale) override {
    log.push_back("decode_attention");
    return DelegatingBackend::decode_attention(kv, layer, q, out, scale);
  }

  std::vector<std::string> log;
  bool fail_record_ = false;
  int kept_events_ = 0;  // events the test expects to outlive their region (a lease expiry)

 private:
  int worker_ = 0, daemon_ = 0, live_events_ = 0;
};

TEST(StreamOrderTest, AHandleOfTheWrongSizeOrABackendWithoutEventsIsRefused) {
  EventLogBackend events;
  auto pool = DeviceStagingPool::create(events, 8 * kMiB2);
  auto r = pool->acquire(kMiB2, "t");
  ASSERT_TRUE(r.ok()) << r.status();
  absl::Status s = (*r)->order_by_events(std::string(10, 'w'));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("10 bytes; expected the 64 bytes of a cudaIpcEventHandle_t"));
  EXPECT_EQ((*r)->events(), nullptr);

  FakeDeviceBackend plain;  // device staging, but no events (Backend's defaults)
  auto plain_pool = DeviceStagingPool::create(plain, 8 * kMiB2);
  auto p = plain_pool->acquire(kMiB2, "t");
  ASSERT_TRUE(p.ok());
  s = (*p)->order_by_events(std::string(64, 'w'));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("fake-device backend has no device events"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("attach without one"));
  EXPECT_EQ((*p)->events(), nullptr);
}

TEST(StreamOrderTest, ARequestRunsBetweenTheWaitForTheWorkerAndTheDaemonsRecord) {
  EventLogBackend backend;
  auto pool = DeviceStagingPool::create(backend, 8 * kMiB2);
  {
    auto r = pool->acquire(kMiB2, "t");
    ASSERT_TRUE(r.ok());
    ASSERT_TRUE((*r)->order_by_events(std::string(64, 'w')).ok());
    EXPECT_EQ((*r)->event_ipc_handle(), std::string(64, 'd'));
    ASSERT_NE((*r)->events(), nullptr);
    auto got = in_stream_order(r->get(), [&](bool ordered) -> absl::StatusOr<int> {
      backend.log.push_back(ordered ? "request ordered" : "request plain");
      return 7;
    });
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(*got, 7);
    EXPECT_EQ(backend.log, (std::vector<std::string>{"wait worker", "request ordered", "record daemon"}));
    // A failed request is still followed by the record: the worker's stream waits on it either way.
    backend.log.clear();
    absl::Status failed = in_stream_order(r->get(), [&](bool) { return absl::InvalidArgumentError("refused"); });
    EXPECT_EQ(failed.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(backend.log, (std::vector<std::string>{"wait worker", "record daemon"}));
    // A record that fails waits for the request's work on the host and fails the request.
    backend.log.clear();
    backend.fail_record_ = true;
    failed = in_stream_order(r->get(), [&](bool) { return absl::OkStatus(); });
    backend.fail_record_ = false;
    EXPECT_EQ(failed.code(), absl::StatusCode::kInternal);
    EXPECT_THAT(std::string(failed.message()), HasSubstr("recording the daemon's event"));
    EXPECT_THAT(std::string(failed.message()), HasSubstr("waited for on the host"));
    EXPECT_EQ(backend.log, (std::vector<std::string>{"wait worker", "record daemon", "synchronize"}));
    backend.log.clear();
    (*r)->mark_importer_closed();  // what a Detach does
  }  // the region's last reference: its queued work finishes, then both events go
  EXPECT_EQ(backend.log, (std::vector<std::string>{"synchronize", "destroy worker", "destroy daemon"}));
  // After a lease expiry the worker may still hold the daemon's event: it stays until exit.
  backend.log.clear();
  {
    auto r = pool->acquire(kMiB2, "t");
    ASSERT_TRUE(r.ok());
    ASSERT_TRUE((*r)->order_by_events(std::string(64, 'w')).ok());
  }
  EXPECT_EQ(backend.log, (std::vector<std::string>{"synchronize", "destroy worker"}));
  backend.kept_events_ = 1;

  // A region without events, and a request with no tensor in staging, run as they are.
  backend.log.clear();
  auto plain = pool->acquire(kMiB2, "u");
  ASSERT_TRUE(plain.ok());
  for (const Staging* staging : {static_cast<const Staging*>(plain->get()), static_cast<const Staging*>(nullptr)}) {
    absl::Status s = in_stream_order(staging, [&](bool ordered) {
      backend.log.push_back(ordered ? "request ordered" : "request plain");
      return absl::OkStatus();
    });
    EXPECT_TRUE(s.ok());
  }
  EXPECT_EQ(backend.log, (std::vector<std::string>{"request plain", "request plain"}));
}

// A core over `backend` with device staging, stream order allowed or not (--stream_ordered_staging).
absl::StatusOr<std::unique_ptr<Core>> stream_order_core(std::unique_ptr<kn::Backend> backend, bool allowed,
                                                        kn::Geometry geometry) {
  CoreConfig c;
  c.geometry = geometry;
  c.pool_bytes = 64 * c.geometry.block_bytes();
  c.max_device_staging_bytes = 8 * kMiB2;
  c.stream_ordered_staging = allowed;
  return Core::create(c, std::move(backend));
}

// A Step's two kernels queue without a host wait between them; a plain Step waits once at its end,
// a stream-ordered one not at all; the outputs are the same.
TEST(StreamOrderTest, AStepWaitsOnceOrNotAtAllAndGivesTheSameOutputs) {
  auto backend_owner = std::make_unique<EventLogBackend>();
  EventLogBackend& backend = *backend_owner;
  auto core = stream_order_core(std::move(backend_owner), true,
                                karakv::server::testing::small_test_geometry(kn::DType::kFloat32, 32, 16));
  ASSERT_TRUE(core.ok()) << core.status();
  Core& k = **core;

  auto shm = k.attach("w", "t", 1 << 16, kn::Geometry{}, "", 0, StagingKind::kShm, "", std::string(64, 'w'));
  ASSERT_FALSE(shm.ok());
  EXPECT_EQ(shm.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(shm.status().message()), HasSubstr("attach with staging_kind CUDA_IPC or CUDA_VMM_FD"));

  auto a = k.attach("w", "t", kMiB2, kn::Geometry{}, "", 0, StagingKind::kCudaIpc, "", std::string(64, 'w'));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->staging_event_ipc_handle, std::string(64, 'd'));
  auto staging = k.staging(a->session_id);
  ASSERT_TRUE(staging.ok());
  ASSERT_NE((*staging)->events(), nullptr);

  const kn::Geometry& g = k.geometry();
  std::mt19937 rng(5);
  std::normal_distribution<float> dist;
  auto random_bytes = [&](size_t bytes) {
    std::vector<uint8_t> out(bytes);
    for (size_t i = 0; i + 4 <= bytes; i += 4) {
      const float f = dist(rng);
      std::memcpy(out.data() + i, &f, 4);
    }
    return out;
  };
  std::vector<std::vector<uint8_t>> outputs[2];
  for (int ordered = 0; ordered < 2; ++ordered) {
    rng.seed(5);
    auto id = k.create_sequence(a->session_id, SequenceOptions{});
    ASSERT_TRUE(id.ok());
    const auto pk = random_bytes(k.append_bytes(20)), pv = random_bytes(k.append_bytes(20));
    ASSERT_TRUE(k.append(a->session_id, *id, 20, ConstBytes(pk.data(), pk.size()), ConstBytes(pv.data(), pv.size()),
                         ConstBytes(), 0)
                    .ok());
    const uint64_t ids[] = {*id};
    for (int layer = 0; layer < g.num_layers; ++layer) {
      const auto sk = random_bytes(k.step_kv_bytes(1)), sv = random_bytes(k.step_kv_bytes(1)),
                 q = random_bytes(k.q_bytes(1));
      std::vector<uint8_t> out(k.q_bytes(1));
      backend.log.clear();
      auto r = k.step(a->session_id, layer, ids, ConstBytes(sk.data(), sk.size()), ConstBytes(sv.data(), sv.size()),
                      ConstBytes(q.data(), q.size()), MutableBytes(out.data(), out.size()), 0, ordered == 1);
      ASSERT_TRUE(r.ok()) << r.status();
      std::vector<std::string> want = {"defer", "write_step_kv", "decode_attention", "undefer"};
      if (!ordered) want.push_back("synchronize");
      EXPECT_EQ(backend.log, want) << "layer " << layer << (ordered ? ", stream-ordered" : "");
      outputs[ordered].push_back(out);
    }
    ASSERT_TRUE(k.release_sequence(a->session_id, *id).ok());
  }
  EXPECT_EQ(outputs[0], outputs[1]);
  backend.log.clear();
  ASSERT_TRUE(k.detach(a->session_id).ok());
  staging->reset();
  EXPECT_EQ(backend.log, (std::vector<std::string>{"synchronize", "destroy worker", "destroy daemon"}));
}

// Events are opt-in for the daemon (--stream_ordered_staging), and an Attach whose events cannot be
// set up leaves its region free for the tenant's next session, not quarantined.
TEST(StreamOrderTest, AttachWithAnEventNeedsTheFlagAndAFailedOneLeavesNoQuarantine) {
  for (bool enabled : {false, true}) {
    auto owner = std::make_unique<FakeDeviceBackend>();  // device staging, no events
    FakeDeviceBackend& backend = *owner;
    auto core = stream_order_core(std::move(owner), enabled,
                                  karakv::server::testing::small_test_geometry(kn::DType::kFloat32, 32, 16));
    ASSERT_TRUE(core.ok()) << core.status();
    auto a = (*core)->attach("w", "t", kMiB2, kn::Geometry{}, "", 0, StagingKind::kCudaIpc, "", std::string(64, 'w'));
    ASSERT_FALSE(a.ok());
    EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(a.status().message()),
                HasSubstr(enabled ? "fake-device backend has no device events" : "--stream_ordered_staging"));
    auto plain = (*core)->attach("w", "t", kMiB2, kn::Geometry{}, "", 0, StagingKind::kCudaIpc);
    ASSERT_TRUE(plain.ok()) << plain.status();
    // Without the flag no region was made; with it, the failed Attach's region came back for reuse.
    EXPECT_EQ(backend.allocations_, 1);
  }
}


// A device region made for an Attach that is then refused (here at --max_sessions) was never seen
// by its worker: it goes back for the tenant's reuse, not to quarantine.
TEST(StreamOrderTest, ARegionOfARefusedAttachIsReusedNotQuarantined) {
  auto owner = std::make_unique<FakeDeviceBackend>();
  FakeDeviceBackend& backend = *owner;
  CoreConfig c;
  c.geometry = karakv::server::testing::small_test_geometry(kn::DType::kFloat32);
  c.pool_bytes = 64 * c.geometry.block_bytes();
  c.max_device_staging_bytes = 8 * kMiB2;
  c.max_sessions = 1;
  auto core = Core::create(c, std::move(owner));
  ASSERT_TRUE(core.ok());
  auto attach = [&] { return (*core)->attach("w", "t", kMiB2, kn::Geometry{}, "", 0, StagingKind::kCudaIpc); };
  auto first = attach();
  ASSERT_TRUE(first.ok());
  auto refused = attach();  // a second region is made, then the session refused
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE((*core)->detach(first->session_id).ok());
  auto third = attach();  // one of the two free regions
  ASSERT_TRUE(third.ok());
  auto fourth = attach();  // refused again, on the other free region: nothing new made
  ASSERT_FALSE(fourth.ok());
  EXPECT_EQ(backend.allocations_, 2) << "the refused Attach's region was quarantined";
}

// The transports' glue: Step, Attend, Append and ReadKV through the gRPC handlers, and Step and
// Attend through the ring, each between the wait for the worker's event and the daemon's record,
// Step and Attend with no host wait; a request with no tensor in staging orders nothing.
TEST(StreamOrderTest, TheHandlersAndTheRingRunRequestsInStreamOrder) {
  auto owner = std::make_unique<EventLogBackend>();
  EventLogBackend& backend = *owner;
  auto core = stream_order_core(std::move(owner), true, karakv::server::testing::small_test_geometry(kn::DType::kFloat32));
  ASSERT_TRUE(core.ok()) << core.status();
  Core& k = **core;
  auto metrics = Metrics::create("");
  ASSERT_TRUE(metrics.ok());
  KaraKVService service(&k, metrics->get(), true);
  RingConfig rc;
  rc.threads = false;
  RingServer rings(&service.gate(), &k, metrics->get(), rc);
  service.set_rings(&rings);

  v1::AttachRequest ar;
  ar.set_staging_bytes(kMiB2);
  ar.set_staging_kind(v1::STAGING_KIND_CUDA_IPC);
  ar.set_worker_event_ipc_handle(std::string(64, 'w'));
  ar.set_fast_path(true);
  v1::AttachReply reply;
  ASSERT_TRUE(service.Handle(ar, &reply).ok());
  EXPECT_EQ(reply.staging_event_ipc_handle(), std::string(64, 'd'));
  const std::string s = reply.session_id();
  const uint64_t gen = reply.staging_generation();
  v1::CreateSequenceRequest cr;
  cr.set_session_id(s);
  v1::CreateSequenceReply crr;
  ASSERT_TRUE(service.Handle(cr, &crr).ok());
  const uint64_t id = crr.sequence_id();
  auto ref = [](v1::TensorRef* t, uint64_t offset, uint64_t length) {
    t->mutable_staging()->set_offset(offset);
    t->mutable_staging()->set_length(length);
  };
  const std::vector<std::string> ordered = {"wait worker", "record daemon"};
  auto expect_ordered = [&](const char* what, std::vector<std::string> inner) {
    std::vector<std::string> want = {"wait worker"};
    want.insert(want.end(), inner.begin(), inner.end());
    want.push_back("record daemon");
    EXPECT_EQ(backend.log, want) << what;
    backend.log.clear();
  };

  backend.log.clear();
  v1::AppendRequest a;
  a.set_session_id(s);
  a.set_sequence_id(id);
  a.set_num_tokens(6);
  a.set_staging_generation(gen);
  ref(a.mutable_k(), 0, k.append_bytes(6));
  ref(a.mutable_v(), 1 << 16, k.append_bytes(6));
  v1::AppendReply arep;
  ASSERT_TRUE(service.Handle(a, &arep).ok());
  EXPECT_EQ(backend.log.front(), "wait worker");
  EXPECT_EQ(backend.log.back(), "record daemon");
  backend.log.clear();

  v1::StepRequest st;
  st.set_session_id(s);
  st.add_sequence_ids(id);
  st.set_layer(0);
  st.set_staging_generation(gen);
  ref(st.mutable_k(), 0, k.step_kv_bytes(1));
  ref(st.mutable_v(), 1 << 16, k.step_kv_bytes(1));
  ref(st.mutable_q(), 2 << 16, k.q_bytes(1));
  st.mutable_out()->mutable_staging()->set_offset(3 << 16);
  st.mutable_out()->mutable_staging()->set_length(k.q_bytes(1));
  v1::StepReply srep;
  ASSERT_TRUE(service.Handle(st, &srep).ok());
  expect_ordered("Step by gRPC", {"defer", "write_step_kv", "decode_attention", "undefer"});

  v1::AttendRequest at;
  at.set_session_id(s);
  at.set_sequence_id(id);
  at.set_layer(1);
  at.set_num_queries(1);
  at.set_staging_generation(gen);
  ref(at.mutable_q(), 2 << 16, k.q_bytes(1));
  at.mutable_out()->mutable_staging()->set_offset(3 << 16);
  at.mutable_out()->mutable_staging()->set_length(k.q_bytes(1));
  v1::AttendReply atrep;
  // Layer 1 of the step is still pending: refused by the core, still between wait and record.
  EXPECT_FALSE(service.Handle(at, &atrep).ok());
  expect_ordered("a refused Attend", {});

  // The step's layer 1 through the ring.
  auto regions = k.ring_regions(s);
  ASSERT_TRUE(regions.ok() && regions->rings != nullptr);
  ring::Header* h = ring::header(regions->rings->reserved());
  ring::Command cmd{};
  cmd.tag = 7;
  cmd.op = uint32_t(ring::Op::kStep);
  cmd.layer = 1;
  cmd.count = 1;
  cmd.ids[0] = id;
  cmd.k = {0, k.step_kv_bytes(1)};
  cmd.v = {1 << 16, k.step_kv_bytes(1)};
  cmd.q = {2 << 16, k.q_bytes(1)};
  cmd.out = {3 << 16, k.q_bytes(1)};
  std::memcpy(&ring::commands(regions->rings->reserved())[0], &cmd, sizeof cmd);
  h->sq_tail.store(1);
  auto ran = rings.poll(s);
  ASSERT_TRUE(ran.ok()) << ran.status();
  ASSERT_EQ(*ran, 1);
  EXPECT_EQ(ring::completions(regions->rings->reserved())[0].code, 0u);
  expect_ordered("Step by the ring", {"defer", "write_step_kv", "decode_attention", "undefer"});

  // An inline Attend (nothing in staging) is not ordered: no wait, no record.
  at.set_layer(0);
  at.clear_staging_generation();
  at.mutable_q()->set_data(std::string(k.q_bytes(1), '\0'));
  at.mutable_out()->Clear();
  ASSERT_TRUE(service.Handle(at, &atrep).ok());
  EXPECT_EQ(backend.log, (std::vector<std::string>{"defer", "undefer", "synchronize"}));
  backend.log.clear();

  v1::ReadKVRequest rk;
  rk.set_session_id(s);
  rk.set_sequence_id(id);
  rk.set_staging_generation(gen);
  for (auto [out, offset] : {std::pair{rk.mutable_k(), 0}, {rk.mutable_v(), 1 << 18}, {rk.mutable_positions(), 1 << 19}}) {
    out->mutable_staging()->set_offset(offset);
    out->mutable_staging()->set_length(1 << 18);
  }
  v1::ReadKVReply rkrep;
  absl::Status read = service.Handle(rk, &rkrep);
  ASSERT_TRUE(read.ok()) << read;
  EXPECT_EQ(backend.log.front(), "wait worker");
  EXPECT_EQ(backend.log.back(), "record daemon");
  rings.stop_all();
  v1::DetachRequest dr;
  dr.set_session_id(s);
  v1::DetachReply drep;
  EXPECT_TRUE(service.Handle(dr, &drep).ok());
}
}  // namespace
}  // namespace karakv::server
