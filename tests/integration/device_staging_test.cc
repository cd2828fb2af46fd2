// Device staging (Staging::kDevice, CUDA IPC) against real daemons: this test process is the
// worker, karakvd the other process. On a GPU: the same Append / Step / Attend / ReadKV through
// device staging and through shm staging of one daemon give the same outputs (fp32 storage, to
// 1e-6), a stale or missing generation is refused, and a detached region comes back to the same
// tenant only under a new generation. Without a GPU those print "no device" and skip. Everywhere:
// the SDK's device staging on a CPU daemon is refused with a message naming the fix. The VMM path
// (Staging::kDeviceFd: a cuMemCreate allocation whose file descriptor comes over karakvd's staging
// fd socket) runs the same script on a GPU, and so does a stream-ordered worker (CUDA events
// instead of host waits, ClientOptions::stream_ordered) whose input copies land late on purpose.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <random>
#include <string>
#include <vector>

#include "daemon.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "karakv/client.h"
#include "karakv/v1/karakv.grpc.pb.h"

#if KARAKV_DEVICE_TEST_CUDA
#include <cuda_runtime.h>
#endif

namespace karakv {
namespace {

using ::testing::HasSubstr;
using karakv::testing::Daemon;

std::vector<std::string> geometry_flags(const std::string& backend) {
  return {"--backend=" + backend, "--layers=2", "--q_heads=4", "--kv_heads=2", "--head_dim=64", "--dtype=fp32",
          "--block_size=16", "--pool_bytes=64MiB"};
}

// Each device staging kind, and what its refusal on a CPU daemon names besides --backend=cuda.
struct Kind {
  Staging staging;
  const char* name;
  const char* refusal_names;
};
class DeviceStagingKindTest : public ::testing::TestWithParam<Kind> {};

TEST_P(DeviceStagingKindTest, TheSdkOnACpuDaemonIsRefusedNamingTheFix) {
  Daemon d(geometry_flags("cpu"));
  ASSERT_TRUE(d.ready());
  ClientOptions o;
  o.target = d.target();
  o.staging_bytes = 1 << 20;
  o.staging = GetParam().staging;
  auto c = Client::Attach(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("--backend=cuda"));
  EXPECT_THAT(std::string(c.status().message()), HasSubstr(GetParam().refusal_names));
  // shm staging on the same daemon still works.
  o.staging = Staging::kShm;
  auto shm = Client::Attach(o);
  ASSERT_TRUE(shm.ok()) << shm.status();
  EXPECT_FALSE((*shm)->device_staging());
  EXPECT_EQ((*shm)->staging_generation(), 0u);
}

// Stream order is for device staging: asked for with shm staging, the SDK refuses before it calls.
TEST(DeviceStagingTest, StreamOrderWithShmStagingIsRefusedNamingTheFix) {
  ClientOptions o;
  o.target = "unix:/nonexistent/karakv.sock";
  o.staging = Staging::kShm;
  o.stream_ordered = true;
  auto c = Client::Attach(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("set staging to kDevice or kDeviceFd"));
}

// karakvd refuses a worker event with shm staging, naming the kinds it orders.
TEST(DeviceStagingTest, AWorkerEventWithShmStagingIsRefusedByTheDaemon) {
  Daemon d(geometry_flags("cpu"));
  ASSERT_TRUE(d.ready());
  auto stub = v1::KaraKV::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  v1::AttachRequest req;
  req.set_staging_bytes(1 << 20);
  req.set_worker_event_ipc_handle(std::string(64, '\1'));
  v1::AttachReply reply;
  grpc::ClientContext ctx;
  const grpc::Status s = stub->Attach(&ctx, req, &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("attach with staging_kind CUDA_IPC or CUDA_VMM_FD"));
}

#if KARAKV_DEVICE_TEST_CUDA

// Why device tests cannot run here, or empty.
std::string no_device_reason() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) return std::string("cudaGetDeviceCount: ") + cudaGetErrorName(err);
  if (n == 0) return "no CUDA device";
  return "";
}

#define SKIP_WITHOUT_DEVICE()                                              \
  do {                                                                     \
    if (const std::string why = no_device_reason(); !why.empty()) {        \
      std::printf("no device: %s\n", why.c_str());                         \
      GTEST_SKIP() << "no device: " << why;                                \
    }                                                                      \
  } while (0)

// One worker's buffers, wherever its staging lives: host data goes in with put() (device staging:
// cudaMemcpy, then cudaDeviceSynchronize, the worker's half of the ordering contract) and comes out
// with get(). Stream-ordered (stream set): put() queues the copy on the worker's stream behind a
// host function that holds the stream for 2 ms, from pinned memory, and returns at once, so the
// inputs land well after the request is sent: a daemon that did not wait on the worker's event
// would read the previous bytes. before() and after() go around every request.
struct Worker {
  std::unique_ptr<Client> client;
  bool device = false;
  cudaStream_t stream = nullptr;
  std::vector<std::shared_ptr<void>> pinned;  // the in-flight copies' host sides
  std::shared_ptr<CUstream_st> stream_owner;  // finishes and destroys `stream` first (then pinned, client)
  Buffer alloc(size_t bytes) {
    auto b = client->alloc(bytes);
    EXPECT_TRUE(b.ok()) << b.status();
    return *b;
  }
  void before() {
    if (stream != nullptr) {
      EXPECT_TRUE(client->inputs_written(stream).ok());
    }
  }
  void after() {
    if (stream != nullptr) {
      EXPECT_TRUE(client->wait_outputs(stream).ok());
    }
  }
  void* pinned_copy(const void* p, size_t bytes) {
    void* h = nullptr;
    EXPECT_EQ(cudaMallocHost(&h, std::max<size_t>(bytes, 4)), cudaSuccess);
    if (bytes > 0) std::memcpy(h, p, bytes);
    pinned.emplace_back(h, [](void* q) { cudaFreeHost(q); });
    return h;
  }
  Buffer put(const std::vector<float>& host) {
    Buffer b = alloc(host.size() * 4);
    if (stream != nullptr) {
      EXPECT_EQ(cudaLaunchHostFunc(
                    stream, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(2)); }, nullptr),
                cudaSuccess);
      EXPECT_EQ(cudaMemcpyAsync(b.data(), pinned_copy(host.data(), host.size() * 4), host.size() * 4,
                                cudaMemcpyHostToDevice, stream),
                cudaSuccess);
    } else if (device) {
      EXPECT_EQ(cudaMemcpy(b.data(), host.data(), host.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    } else {
      std::memcpy(b.data(), host.data(), host.size() * 4);
    }
    return b;
  }
  std::vector<float> get(const Buffer& b) {
    std::vector<float> host(b.size() / 4);
    if (stream != nullptr) {
      void* h = nullptr;
      EXPECT_EQ(cudaMallocHost(&h, std::max<size_t>(b.size(), 4)), cudaSuccess);
      EXPECT_EQ(cudaMemcpyAsync(h, b.data(), b.size(), cudaMemcpyDeviceToHost, stream), cudaSuccess);
      EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      std::memcpy(host.data(), h, b.size());
      cudaFreeHost(h);
    } else if (device) {
      EXPECT_EQ(cudaMemcpy(host.data(), b.data(), b.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    } else {
      std::memcpy(host.data(), b.data(), b.size());
    }
    return host;
  }
};

Worker attach_kind(const Daemon& d, Staging staging, const std::string& tenant = "default",
                   bool fast_path = false, bool stream_ordered = false) {
  const bool device = staging != Staging::kShm;
  ClientOptions o;
  o.fast_path = fast_path;
  o.stream_ordered = stream_ordered;
  o.target = d.target();
  o.tenant = tenant;
  o.staging_bytes = 8 << 20;
  o.staging = staging;
  auto c = Client::Attach(o);
  EXPECT_TRUE(c.ok()) << c.status();
  Worker w;
  if (!c.ok()) return w;
  w.client = std::move(*c);
  w.device = device;
  EXPECT_EQ(w.client->device_staging(), device);
  EXPECT_EQ(w.client->stream_ordered(), stream_ordered);
  if (stream_ordered) {
    EXPECT_EQ(cudaStreamCreateWithFlags(&w.stream, cudaStreamNonBlocking), cudaSuccess);
    w.stream_owner.reset(w.stream, [](cudaStream_t s) {
      cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
    });
  }
  return w;
}

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

void expect_near(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-6f * (1.f + std::fabs(want[i]))) << what << " element " << i;
  }
}

// Everything a worker reads back from one fixed script of calls.
struct Outputs {
  std::vector<std::vector<float>> steps, attend;
  std::vector<float> k, v;
  std::vector<int32_t> positions;
};

Outputs run_script(Worker& w) {
  Outputs o;
  Client& c = *w.client;
  const int prompt = 37, batched = 5, steps = 3, queries = 4;
  auto seq = c.CreateSequence();
  EXPECT_TRUE(seq.ok()) << seq.status();
  // The prompt in two calls: an Append, then its last tokens as an AppendBatch entry (by gRPC on
  // device staging, which must name the region's generation as Append does).
  Buffer k = w.put(random_floats(c.append_bytes(prompt - batched) / 4, 1));
  Buffer v = w.put(random_floats(c.append_bytes(prompt - batched) / 4, 2));
  w.before();
  auto appended = c.Append(*seq, prompt - batched, k, v);
  w.after();
  EXPECT_TRUE(appended.ok()) << appended.status();
  AppendEntry entry;
  entry.sequence_id = *seq;
  entry.num_tokens = batched;
  entry.k = w.put(random_floats(c.append_bytes(batched) / 4, 3));
  entry.v = w.put(random_floats(c.append_bytes(batched) / 4, 4));
  w.before();
  auto batch = c.AppendBatch({&entry, 1});
  w.after();
  EXPECT_TRUE(batch.ok()) << batch.status();
  const uint64_t ids[] = {*seq};
  for (int s = 0; s < steps; ++s) {
    for (int layer = 0; layer < c.geometry().num_layers; ++layer) {
      c.reset_staging();
      const uint32_t seed = 100 + s * 10 + layer;
      Buffer sk = w.put(random_floats(c.step_kv_bytes(1) / 4, seed));
      Buffer sv = w.put(random_floats(c.step_kv_bytes(1) / 4, seed + 1000));
      Buffer q = w.put(random_floats(c.q_bytes(1) / 4, seed + 2000));
      Buffer out = w.alloc(c.q_bytes(1));
      w.before();
      auto r = c.Step(layer, ids, sk, sv, q, out);
      w.after();
      EXPECT_TRUE(r.ok()) << r.status();
      o.steps.push_back(w.get(out));
    }
  }
  for (int layer = 0; layer < c.geometry().num_layers; ++layer) {
    c.reset_staging();
    Buffer q = w.put(random_floats(c.q_bytes(queries) / 4, 500 + layer));
    Buffer out = w.alloc(c.q_bytes(queries));
    w.before();
    EXPECT_TRUE(c.Attend(*seq, layer, queries, q, out).ok());
    w.after();
    o.attend.push_back(w.get(out));
  }
  c.reset_staging();
  const int total = prompt + steps;
  Buffer rk = w.alloc(c.append_bytes(total)), rv = w.alloc(c.append_bytes(total));
  Buffer rp = w.alloc(size_t(c.geometry().num_layers) * c.geometry().num_kv_heads * total * 4);
  w.before();
  auto n = c.ReadKV(*seq, rk, rv, rp);
  w.after();
  EXPECT_TRUE(n.ok()) << n.status();
  o.k = w.get(rk);
  o.v = w.get(rv);
  const std::vector<float> p = w.get(rp);
  o.positions.resize(p.size());
  std::memcpy(o.positions.data(), p.data(), p.size() * 4);
  return o;
}

// Every output of run_script within fp32 rounding of the shm path's; positions exactly.
void expect_same_outputs(const Outputs& got, const Outputs& want) {
  ASSERT_EQ(got.steps.size(), want.steps.size());
  for (size_t i = 0; i < want.steps.size(); ++i) expect_near(got.steps[i], want.steps[i], "Step.out");
  for (size_t i = 0; i < want.attend.size(); ++i) expect_near(got.attend[i], want.attend[i], "Attend.out");
  expect_near(got.k, want.k, "ReadKV.k");
  expect_near(got.v, want.v, "ReadKV.v");
  EXPECT_EQ(got.positions, want.positions);
}

// CUDA IPC (the handle in the AttachReply) or VMM (the worker imports its region from the file
// descriptor the staging fd socket sends, as a pod in another PID namespace would): the shm path's
// outputs, and after Detach the tenant's next session reuses the region under a new generation.
TEST_P(DeviceStagingKindTest, TwoProcessOutputsEqualTheShmPath) {
  SKIP_WITHOUT_DEVICE();
  Daemon d(geometry_flags("cuda"));
  ASSERT_TRUE(d.ready()) << "karakvd --backend=cuda did not start on a machine with a CUDA device";
  Worker shm = attach_kind(d, Staging::kShm);
  Worker dev = attach_kind(d, GetParam().staging);
  ASSERT_TRUE(shm.client && dev.client);
  EXPECT_NE(dev.client->staging_generation(), 0u);
  const Outputs want = run_script(shm);
  expect_same_outputs(run_script(dev), want);
  const uint64_t old_generation = dev.client->staging_generation();
  ASSERT_TRUE(dev.client->Detach().ok());
  Worker again = attach_kind(d, GetParam().staging);
  ASSERT_TRUE(again.client);
  EXPECT_GT(again.client->staging_generation(), old_generation);
}

// The fast path with device staging: Step and Attend through the ring (its rings in a shared-memory
// object of their own), Append and ReadKV by gRPC; every output equals the shm path's.
TEST_P(DeviceStagingKindTest, FastPathOutputsEqualTheShmPath) {
  SKIP_WITHOUT_DEVICE();
  Daemon d(geometry_flags("cuda"));
  ASSERT_TRUE(d.ready()) << "karakvd --backend=cuda did not start on a machine with a CUDA device";
  Worker shm = attach_kind(d, Staging::kShm);
  Worker dev = attach_kind(d, GetParam().staging, "default", /*fast_path=*/true);
  ASSERT_TRUE(shm.client && dev.client);
  ASSERT_TRUE(dev.client->fast_path());
  const Outputs want = run_script(shm);
  expect_same_outputs(run_script(dev), want);
  // Every Step and Attend of the script went through the ring; Append and ReadKV did not.
  const uint64_t layers = uint64_t(dev.client->geometry().num_layers);
  EXPECT_EQ(dev.client->ring_calls(), 3 * layers + layers);
}

// Stream-ordered by CUDA events, by gRPC and through the ring: the worker never synchronizes before
// a request and its inputs land late (Worker::put), karakvd's kernels run late too, yet every
// output equals the shm path's.
TEST_P(DeviceStagingKindTest, StreamOrderedOutputsEqualTheShmPath) {
  SKIP_WITHOUT_DEVICE();
  std::vector<std::string> flags = geometry_flags("cuda");
  flags.push_back("--stream_ordered_staging");
  // karakvd's stream held 1 ms before each of its launches: its kernels finish well after it
  // replied, so a worker that read before the daemon's event (or a record before the kernels) would
  // read the previous outputs.
  setenv("KARAKV_CUDA_TEST_STREAM_DELAY_US", "1000", 1);
  Daemon d(flags);
  unsetenv("KARAKV_CUDA_TEST_STREAM_DELAY_US");
  ASSERT_TRUE(d.ready()) << "karakvd --backend=cuda did not start on a machine with a CUDA device";
  Worker shm = attach_kind(d, Staging::kShm);
  ASSERT_TRUE(shm.client);
  const Outputs want = run_script(shm);
  for (bool fast_path : {false, true}) {
    SCOPED_TRACE(fast_path ? "fast path" : "gRPC");
    Worker dev = attach_kind(d, GetParam().staging, "default", fast_path, /*stream_ordered=*/true);
    ASSERT_TRUE(dev.client);
    expect_same_outputs(run_script(dev), want);
  }
}

TEST(DeviceStagingTest, AStaleOrMissingGenerationIsRefusedAndNeverAliased) {
  SKIP_WITHOUT_DEVICE();
  Daemon d(geometry_flags("cuda"));
  ASSERT_TRUE(d.ready());
  auto stub = v1::KaraKV::NewStub(grpc::CreateChannel(d.target(), grpc::InsecureChannelCredentials()));
  auto attach_raw = [&](v1::AttachReply* reply) {
    v1::AttachRequest req;
    req.set_tenant("t");
    req.set_staging_bytes(1 << 20);
    req.set_staging_kind(v1::STAGING_KIND_CUDA_IPC);
    grpc::ClientContext ctx;
    return stub->Attach(&ctx, req, reply);
  };
  v1::AttachReply first;
  ASSERT_TRUE(attach_raw(&first).ok());
  EXPECT_EQ(first.staging_ipc_handle().size(), 64u);
  EXPECT_EQ(first.staging_bytes() % (2u << 20), 0u);
  const uint64_t old_generation = first.staging_generation();
  ASSERT_NE(old_generation, 0u);
  // This process never opened the handle, so Detach honours the contract; the tenant's next
  // session gets the same allocation (identical handle bytes) under a new generation.
  {
    v1::DetachRequest req;
    req.set_session_id(first.session_id());
    v1::DetachReply reply;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Detach(&ctx, req, &reply).ok());
  }
  v1::AttachReply second;
  ASSERT_TRUE(attach_raw(&second).ok());
  EXPECT_EQ(second.staging_ipc_handle(), first.staging_ipc_handle());
  EXPECT_GT(second.staging_generation(), old_generation);

  v1::CreateSequenceRequest creq;
  creq.set_session_id(second.session_id());
  v1::CreateSequenceReply crep;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->CreateSequence(&ctx, creq, &crep).ok());
  }
  auto attend = [&](uint64_t generation) {
    v1::AttendRequest req;
    req.set_session_id(second.session_id());
    req.set_sequence_id(crep.sequence_id());
    req.set_num_queries(1);
    req.mutable_q()->mutable_staging()->set_offset(0);
    req.mutable_q()->mutable_staging()->set_length(4 * 64 * 4);
    req.mutable_out()->mutable_staging()->set_offset(4096);
    req.mutable_out()->mutable_staging()->set_length(4 * 64 * 4);
    req.set_staging_generation(generation);
    v1::AttendReply reply;
    grpc::ClientContext ctx;
    return stub->Attend(&ctx, req, &reply);
  };
  const grpc::Status stale = attend(old_generation);
  EXPECT_EQ(stale.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << stale.error_message();
  EXPECT_THAT(stale.error_message(), HasSubstr("generation " + std::to_string(old_generation)));
  EXPECT_THAT(stale.error_message(), HasSubstr("generation " + std::to_string(second.staging_generation())));
  const grpc::Status missing = attend(0);
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(missing.error_message(), HasSubstr("staging_generation is missing"));
  // The current generation gets past the staging checks (the sequence is empty: INVALID_ARGUMENT
  // about num_queries, not about staging).
  const grpc::Status current = attend(second.staging_generation());
  EXPECT_EQ(current.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << current.error_message();
  EXPECT_THAT(current.error_message(), HasSubstr("num_queries"));

  // Another tenant never gets that allocation.
  v1::AttachRequest other;
  other.set_tenant("u");
  other.set_staging_bytes(1 << 20);
  other.set_staging_kind(v1::STAGING_KIND_CUDA_IPC);
  v1::AttachReply third;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub->Attach(&ctx, other, &third).ok());
  EXPECT_NE(third.staging_ipc_handle(), first.staging_ipc_handle());
}

#endif  // KARAKV_DEVICE_TEST_CUDA

INSTANTIATE_TEST_SUITE_P(Kinds, DeviceStagingKindTest,
                         ::testing::Values(Kind{Staging::kDevice, "CudaIpc", "staging_kind SHM"},
                                           Kind{Staging::kDeviceFd, "VmmFd", "CUDA_VMM_FD"}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace karakv
