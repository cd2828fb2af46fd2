// The CUDA backend: the pool is one device allocation and every op runs as CUDA kernels on one
// stream of the chosen GPU.
//
// Memory contract (backend.h): the pool is device memory from allocate(). Tensors (q, out, k, v)
// may be device memory (e.g. a CUDA IPC staging region) or host memory; host tensors are copied
// through device scratch. Tables and index arrays (block_table, table_offset, seq_len, kept,
// dst_blocks, scores of top_k / token2chunk / cam_merge_values) are host memory, as the server
// keeps them; they are validated on the host with the checks every backend shares
// (common/validate.h) before anything is launched, so an invalid call changes nothing, then
// uploaded for the call. score_acc's accumulators are host memory (the probabilities come back and
// are added on the host) or this backend's allocations (added into on the device, nothing back).
//
// Host tensors and tables travel through pinned buffers, packed: one host-to-device copy before a
// call's first kernel and one device-to-host copy at its end, however many tensors the call has.
//
// Calls are serialised by a mutex (one stream, one scratch arena) and each returns after its
// stream has synchronized: when it returns OK its outputs are complete, and a kernel fault
// surfaces as kInternal naming the op and the CUDA error ("decode_attention: cudaStreamSynchronize
// ...: cudaErrorIllegalAddress (...)"). Every error an op returns starts with the op's name.
//
// Stream order (set_deferred, backend.h): on a thread that deferred waits, a call whose outputs are
// all device memory returns once its work is queued. What the host hands such a call is safe to
// change at once: tables and host inputs are packed into one of kUploadSlots pinned buffers, and a
// call waits only for the upload that last used the buffer it takes (an event), not for the
// kernels before it. Scratch memory is reused in stream order; memory the backend frees (arena
// chunks, FlashInfer's workspaces) is freed only after the stream has passed its users. A fault
// in a call that did not wait surfaces at the next wait, naming the calls queued without one.
//
// $KARAKV_CUDA_TEST_STREAM_DELAY_US (tests only; read when the backend is made): every launch first
// queues a host function that holds the stream that long, so uploads and kernels land well after
// the call returned, as on a loaded GPU: ordering mistakes then show as wrong outputs.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../common/allocations.h"
#include "../common/checks.h"
#include "../common/quant_layout.h"
#include "../common/validate.h"
#include "arena.h"
#include "attention.cuh"
#include "cam_merge.cuh"
#include "common.cuh"
#include "cuda_limits.h"
#if KARAKV_HAVE_FLASHINFER
#include "flashinfer_decode.h"
#include "flashinfer_pages.h"
#endif
#include "gather_tokens.cuh"
#include "karakv/kernels/backend.h"
#include "quant.cuh"
#include "read_kv.cuh"
#include "snapkv_scores.cuh"
#include "token2chunk.cuh"
#include "top_k.cuh"
#include "window_scores.cuh"
#include "write_kv.cuh"

namespace karakv::kernels {
namespace {

using cuda::Arena;
using cuda::DeviceKV;

// The scratch arena's chunks: cudaMalloc on the current device (the backend's: every call sets it).
class CudaScratchMemory final : public cuda::ArenaMemory {
 public:
  explicit CudaScratchMemory(const cudaStream_t* stream) : stream_(stream) {}
  KernelStatus allocate(size_t bytes, void** out) override {
    const cudaError_t err = cudaMalloc(out, bytes);
    if (err == cudaSuccess) return KernelStatus::ok();
    cudaGetLastError();  // clear the error state of a failed allocation
    *out = nullptr;
    return {KernelStatus::Code::kInternal,
            "cudaMalloc of " + std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(err)};
  }
  // Calls that did not wait may still have kernels using the chunk queued.
  void free(void* p) override {
    if (*stream_ != nullptr) cudaStreamSynchronize(*stream_);
    cudaFree(p);
  }

 private:
  const cudaStream_t* stream_;
};

// The backend whose waits the calling thread deferred (set_deferred), if any: one per thread.
thread_local const Backend* t_deferring = nullptr;

// $KARAKV_CUDA_TEST_STREAM_DELAY_US, and the host function that holds the stream for it.
int test_stream_delay_us() {
  const char* v = std::getenv("KARAKV_CUDA_TEST_STREAM_DELAY_US");
  return v != nullptr ? std::max(0, std::atoi(v)) : 0;
}
void CUDART_CB hold_stream(void* us) { std::this_thread::sleep_for(std::chrono::microseconds(*static_cast<int*>(us))); }

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, int num_sms, std::string device_name, CudaAttention attention, CudaQuantDecode quant)
      : device_(device),
        num_sms_(num_sms),
        device_name_(std::move(device_name)),
        attention_(attention),
        quant_(quant),
        test_delay_us_(test_stream_delay_us()) {}

  KernelStatus init() {
    KARAKV_CUDA_RETURN_IF_ERROR_IN("init", "cudaSetDevice", cudaSetDevice(device_));
    KARAKV_CUDA_RETURN_IF_ERROR_IN("init", "cudaStreamCreateWithFlags",
                                   cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (cudaEvent_t& e : upload_done_)
      KARAKV_CUDA_RETURN_IF_ERROR_IN("init", "cudaEventCreateWithFlags",
                                     cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return KernelStatus::ok();
  }

  ~CudaBackend() override {
    if (t_deferring == this) t_deferring = nullptr;
    cudaSetDevice(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);  // nothing queued may outlive what it uses
    allocations_.release_all([](void* p) { cudaFree(p); });
    for (PinnedStaging& pinned : pinned_up_)
      if (pinned.host != nullptr) cudaFreeHost(pinned.host);
    if (pinned_down_.host != nullptr) cudaFreeHost(pinned_down_.host);
    for (cudaEvent_t e : upload_done_)
      if (e != nullptr) cudaEventDestroy(e);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = nullptr;  // the arena's chunks go after this: nothing left to wait for
  }

  std::string_view name() const override { return "cuda"; }
  std::string description() const override {
    return "cuda device " + std::to_string(device_) + " (" + device_name_ + ", " + std::to_string(num_sms_) +
           " SMs, " + std::string(cuda_attention_name(attention_)) + " decode attention, " +
           std::string(cuda_quant_decode_name(quant_)) + " quantized decode)";
  }

  // Every op, quantized storage (KIVI, TurboQuant) included, for every storage dtype.
  bool supports(Op op, DType dtype) const override {
    // An in-place gather would need an order across threads (a slot may be read by one and written
    // by another): compactions here gather into fresh blocks.
    if (op == Op::kGatherTokensInPlace) return false;
    return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
  }

  KernelStatus allocate(size_t bytes, void** out) override {
    if (out == nullptr) return KernelStatus::invalid("allocate: out is null");
    if (bytes == 0) return KernelStatus::invalid("allocate: bytes must be > 0");
    std::lock_guard<std::mutex> lock(mu_);
    KARAKV_CUDA_RETURN_IF_ERROR_IN("allocate", "cudaSetDevice", cudaSetDevice(device_));
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      return {KernelStatus::Code::kInternal, "allocate: cudaMalloc of " + std::to_string(bytes) + " bytes on " +
                                                 description() + " failed: " + cudaGetErrorString(err) + " (" +
                                                 std::to_string(free_bytes) + " of " + std::to_string(total_bytes) +
                                                 " bytes free)"};
    }
    // On the backend's stream (non-blocking: it does not order with the legacy default stream),
    // complete before the memory is handed out.
    if (const cudaError_t e = cudaMemsetAsync(p, 0, bytes, stream_); e != cudaSuccess) {
      cudaFree(p);
      return cuda::cuda_status(e, "allocate: cudaMemsetAsync");
    }
    if (KernelStatus st = wait_stream("allocate"); !st.is_ok()) {
      cudaFree(p);
      return st;
    }
    allocations_.add(p, bytes);
    *out = p;
    return KernelStatus::ok();
  }

  void free(void* ptr) override {
    if (ptr == nullptr) return;
    allocations_.remove(ptr);
    std::lock_guard<std::mutex> lock(mu_);
    cudaSetDevice(device_);
    const KernelStatus waited = wait_stream("free");  // calls that did not wait may still use it
    (void)waited;  // a fault stays in the context: the next call reports it
    cudaFree(ptr);
  }

  // A plain cudaMalloc of its own (cudaIpcGetMemHandle exports whole allocations; cudaMalloc of
  // 2 MiB multiples is 2 MiB-aligned), zeroed, complete before it is handed out.
  bool shares_device_memory() const override { return true; }
  KernelStatus allocate_shared(size_t bytes, SharedDeviceMemory* out) override {
    if (out == nullptr) return KernelStatus::invalid("allocate_shared: out is null");
    if (bytes == 0) return KernelStatus::invalid("allocate_shared: bytes must be > 0");
    const size_t rounded = (bytes + kSharedMemoryAlignment - 1) / kSharedMemoryAlignment * kSharedMemoryAlignment;
    std::lock_guard<std::mutex> lock(mu_);
    KARAKV_CUDA_RETURN_IF_ERROR_IN("allocate_shared", "cudaSetDevice", cudaSetDevice(device_));
    void* p = nullptr;
    if (const cudaError_t err = cudaMalloc(&p, rounded); err != cudaSuccess) {
      cudaGetLastError();
      size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      return {KernelStatus::Code::kInternal,
              "allocate_shared: cudaMalloc of " + std::to_string(rounded) + " bytes of device staging on " +
                  description() + " failed: " + cudaGetErrorString(err) + " (" + std::to_string(free_bytes) +
                  " of " + std::to_string(total_bytes) + " bytes free)"};
    }
    cudaIpcMemHandle_t handle;
    const char* what = "cudaMemsetAsync";
    cudaError_t e = cudaMemsetAsync(p, 0, rounded, stream_);
    if (e == cudaSuccess) {
      if (KernelStatus st = wait_stream("allocate_shared"); !st.is_ok()) {
        cudaFree(p);
        return st;
      }
      what = "cudaIpcGetMemHandle";
      e = cudaIpcGetMemHandle(&handle, p);
    }
    if (e != cudaSuccess) {
      cudaFree(p);
      return cuda::cuda_status(e, std::string("allocate_shared: ") + what);
    }
    shared_allocations_.add(p, rounded);
    out->ptr = p;
    out->bytes = rounded;
    out->device = device_;
    out->ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
    return KernelStatus::ok();
  }

  void free_shared(const SharedDeviceMemory& memory) override {
    if (memory.ptr == nullptr) return;
    shared_allocations_.remove(memory.ptr);
    std::lock_guard<std::mutex> lock(mu_);
    cudaSetDevice(device_);
    const KernelStatus waited = wait_stream("free_shared");
    (void)waited;
    cudaFree(memory.ptr);
  }

  std::string fault() const override {
    if (!faulted_.load(std::memory_order_acquire)) return {};  // every request asks: no lock
    std::lock_guard<std::mutex> lock(fault_mu_);
    return fault_;
  }

  void set_deferred(bool on) override {
    if (on) {
      t_deferring = this;
    } else if (t_deferring == this) {
      t_deferring = nullptr;
    }
  }

  KernelStatus synchronize() override {
    std::lock_guard<std::mutex> lock(mu_);
    KARAKV_CUDA_RETURN_IF_ERROR_IN("synchronize", "cudaSetDevice", cudaSetDevice(device_));
    return wait_stream("synchronize");
  }

  KernelStatus create_shared_event(SharedEvent* out) override {
    if (out == nullptr) return KernelStatus::invalid("create_shared_event: out is null");
    std::lock_guard<std::mutex> lock(mu_);
    KARAKV_CUDA_RETURN_IF_ERROR_IN("create_shared_event", "cudaSetDevice", cudaSetDevice(device_));
    cudaEvent_t e = nullptr;
    KARAKV_CUDA_RETURN_IF_ERROR_IN("create_shared_event", "cudaEventCreateWithFlags",
                                   cudaEventCreateWithFlags(&e, cudaEventInterprocess | cudaEventDisableTiming));
    cudaIpcEventHandle_t handle;
    if (const cudaError_t err = cudaIpcGetEventHandle(&handle, e); err != cudaSuccess) {
      cudaEventDestroy(e);
      return cuda::cuda_status(err, "create_shared_event: cudaIpcGetEventHandle");
    }
    out->event = e;
    out->ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
    return KernelStatus::ok();
  }

  KernelStatus open_shared_event(const std::string& ipc_handle, SharedEvent* out) override {
    if (out == nullptr) return KernelStatus::invalid("open_shared_event: out is null");
    if (ipc_handle.size() != sizeof(cudaIpcEventHandle_t))
      return KernelStatus::invalid("open_shared_event: an event handle of " + std::to_string(ipc_handle.size()) +
                                   " bytes; expected a cudaIpcEventHandle_t of " +
                                   std::to_string(sizeof(cudaIpcEventHandle_t)));
    cudaIpcEventHandle_t handle;
    std::memcpy(&handle, ipc_handle.data(), sizeof(handle));
    std::lock_guard<std::mutex> lock(mu_);
    KARAKV_CUDA_RETURN_IF_ERROR_IN("open_shared_event", "cudaSetDevice", cudaSetDevice(device_));
    cudaEvent_t e = nullptr;
    KARAKV_CUDA_RETURN_IF_ERROR_IN("open_shared_event", "cudaIpcOpenEventHandle", cudaIpcOpenEventHandle(&e, handle));
    out->event = e;
    out->ipc_handle.clear();
    return KernelStatus::ok();
  }

  void destroy_shared_event(SharedEvent* event) override {
    if (event == nullptr || event->event == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    cudaSetDevice(device_);
    cudaEventDestroy(static_cast<cudaEvent_t>(event->event));
    event->event = nullptr;
    event->ipc_handle.clear();
  }

  KernelStatus wait_event(const SharedEvent& event) override {
    if (event.event == nullptr) return KernelStatus::invalid("wait_event: no event");
    std::lock_guard<std::mutex> lock(mu_);
    KARAKV_CUDA_RETURN_IF_ERROR_IN("wait_event", "cudaSetDevice", cudaSetDevice(device_));
    KARAKV_CUDA_RETURN_IF_ERROR_IN("wait_event", "cudaStreamWaitEvent",
                                   cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(event.event), 0));
    return KernelStatus::ok();
  }

  KernelStatus record_event(const SharedEvent& event) override {
    if (event.event == nullptr) return KernelStatus::invalid("record_event: no event");
    std::lock_guard<std::mutex> lock(mu_);
    KARAKV_CUDA_RETURN_IF_ERROR_IN("record_event", "cudaSetDevice", cudaSetDevice(device_));
    KARAKV_CUDA_RETURN_IF_ERROR_IN("record_event", "cudaEventRecord",
                                   cudaEventRecord(static_cast<cudaEvent_t>(event.event), stream_));
    return KernelStatus::ok();
  }

  // The backend's own allocations (the pool, device staging, buffers) without asking the driver;
  // anything else as the driver says.
  bool is_device_memory(const void* p) const override {
    return allocations_.contains(p) || shared_allocations_.contains(p) || Call::is_device(p);
  }

  // On the backend's stream and complete on return (a plain cudaMemcpy from pageable memory may
  // return before the device copy lands, and the legacy stream does not order with stream_).
  KernelStatus copy_in(void* dst, const void* src, size_t bytes) override {
    return copy(dst, src, bytes, "copy_in");
  }
  KernelStatus copy_out(void* dst, const void* src, size_t bytes) override {
    return copy(dst, src, bytes, "copy_out");
  }

  KernelStatus write_kv(const PagedKV& kv, int seq, int start_pos, int num_tokens, int layer_begin, int num_layers,
                        const void* k, const void* v) override {
    KARAKV_RETURN_IF_ERROR(
        common::validate_write_kv(kv, seq, start_pos, num_tokens, layer_begin, num_layers, k, v, pool_blocks(kv)));
    if (num_tokens == 0 || num_layers == 0) return KernelStatus::ok();
    const Geometry& geo = kv.geometry;
    Call call(*this, "write_kv");
    DeviceKV dkv;
    KARAKV_RETURN_IF_ERROR(call.tables(kv, &dkv));
    const size_t bytes = size_t(num_layers) * num_tokens * geo.kv_token_elems() * dtype_size(geo.dtype);
    const void *dk = nullptr, *dv = nullptr;
    KARAKV_RETURN_IF_ERROR(call.input(k, bytes, &dk));
    KARAKV_RETURN_IF_ERROR(call.input(v, bytes, &dv));
    KARAKV_RETURN_IF_ERROR(call.launch([&](cudaStream_t stream) {
      return cuda::launch_write_kv(dkv, dtype_size(geo.dtype), seq, start_pos, num_tokens, layer_begin, num_layers, dk,
                                   dv, stream);
    }));
    return call.finish();
  }

  // One upload of the tables and the positions, one launch and one synchronize for the whole
  // step, where write_kv per sequence paid each of them per sequence.
  KernelStatus write_step_kv(const PagedKV& kv, int layer, const int32_t* positions, const void* k,
                             const void* v) override {
    KARAKV_RETURN_IF_ERROR(common::validate_write_step_kv(kv, layer, positions, k, v, pool_blocks(kv)));
    if (kv.num_seqs == 0) return KernelStatus::ok();
    const Geometry& geo = kv.geometry;
    Call call(*this, "write_step_kv");
    DeviceKV dkv;
    KARAKV_RETURN_IF_ERROR(call.tables(kv, &dkv));
    const size_t bytes = size_t(kv.num_seqs) * geo.kv_token_elems() * dtype_size(geo.dtype);
    const void *dk = nullptr, *dv = nullptr;
    const int32_t* dpos = nullptr;
    KARAKV_RETURN_IF_ERROR(call.input(positions, size_t(kv.num_seqs) * sizeof(int32_t), &dpos));
    KARAKV_RETURN_IF_ERROR(call.input(k, bytes, &dk));
    KARAKV_RETURN_IF_ERROR(call.input(v, bytes, &dv));
    KARAKV_RETURN_IF_ERROR(call.launch([&](cudaStream_t stream) {
      return cuda::launch_write_step_kv(dkv, dtype_size(geo.dtype), layer, dpos, dk, dv, stream);
    }));
    return call.finish();
  }

  KernelStatus decode_attention(const PagedKV& kv, int layer, const float* q, float* out, float scale) override {
    return decode(kv, layer, q, out, scale, nullptr, nullptr, nullptr, "decode_attention");
  }

  KernelStatus decode_attention_accumulate(const PagedKV& kv, int layer, const float* q, float* out, float scale,
                                           float* const* score_acc, const int32_t* acc_begin) override {
    return decode(kv, layer, q, out, scale, score_acc, acc_begin, nullptr, "decode_attention_accumulate");
  }

  KernelStatus decode_attention_observe(const PagedKV& kv, int layer, const float* q, float* out, float scale,
                                        float* const* score_acc, const int32_t* acc_begin,
                                        float* const* lse) override {
    return decode(kv, layer, q, out, scale, score_acc, acc_begin, lse, "decode_attention_observe");
  }

  KernelStatus causal_attention(const PagedKV& kv, int seq, int layer, int num_queries, const float* q, float* out,
                                float scale) override {
    KARAKV_RETURN_IF_ERROR(common::validate_causal(kv, seq, layer, num_queries, q, out, pool_blocks(kv)));
    KARAKV_RETURN_IF_ERROR(check_geometry("causal_attention", kv));
    if (num_queries == 0) return KernelStatus::ok();
    const int len = kv.seq_len[seq];
    Call call(*this, "causal_attention");
    DeviceKV dkv;
    KARAKV_RETURN_IF_ERROR(call.tables(kv, &dkv));
    std::vector<int32_t> row_len(num_queries);
    for (int i = 0; i < num_queries; ++i) row_len[i] = len - num_queries + i + 1;
    cuda::AttentionRows rows;
    rows.seq = seq;
    KARAKV_RETURN_IF_ERROR(call.upload(row_len, &rows.row_len));
    rows.num_rows = num_queries;
    rows.max_len = len;
    for (int32_t l : row_len) rows.total_len += l;
    const size_t bytes = size_t(num_queries) * kv.geometry.q_token_elems() * sizeof(float);
    const float* dq = nullptr;
    float* dout = nullptr;
    KARAKV_RETURN_IF_ERROR(call.input(q, bytes, &dq));
    KARAKV_RETURN_IF_ERROR(call.output(out, bytes, &dout));
    KARAKV_RETURN_IF_ERROR(call.launch([&](cudaStream_t stream) {
      return cuda::launch_paged_attention(dkv, kv.geometry.dtype, layer, rows, dq, dout, scale, nullptr, num_sms_,
                                          arena_, stream);
    }));
    return call.finish();
  }

  KernelStatus read_kv(const PagedKV& kv, int seq, void* k, void* v) override {
    KARAKV_RETURN_IF_ERROR(common::validate_read_kv(kv, seq, k, v, pool_blocks(kv)));
    const int len = kv.seq_len[seq];
    if (len == 0) return KernelStatus::ok();
    Call call(*this, "read_kv");
    DeviceKV dkv;
    KARAKV_RETURN_IF_ERROR(call.tables(kv, &dkv));
    const Geometry& geo = kv.geometry;
    const size_t bytes = size_t(geo.num_layers) * len * geo.kv_token_elems() * dtype_size(geo.dtype);
    void *dk = nullptr, *dv = nullptr;
    KARAKV_RETURN_IF_ERROR(call.output(k, bytes, &dk));
    KARAKV_RETURN_IF_ERROR(call.output(v, bytes, &dv));
    KARAKV_RETURN_IF_ERROR(call.launch([&](cudaStream_t stream) {
      return cuda::launch_read_kv(dkv, dtype_size(geo.dtype), seq, len, dk, dv, stream);
    }));
    return call.finish();
  }

  KernelStatus copy_block(const PagedKV& kv, int32_t src, int32_t dst) override {
    KARAKV_RETURN_IF_ERROR(common::validate_copy_block(kv, src, dst, pool_blocks(kv)));
    if (src == dst) return KernelStatus::ok();
    Call call(*this, "copy_block");
    const size_t bytes = kv.geometry.block_bytes();
    auto* pool = static_cast<char*>(kv.pool);
    KARAKV_RETURN_IF_ERROR(call.check(cudaMemcpyAsync(pool + size_t(dst) * bytes, pool + size_t(src) * bytes, bytes,
                                                      cudaMemcpyDeviceToDevice, stream_),
                                      "cudaMemcpyAsync of the block"));
    return call.finish();
  }

  KernelStatus window_scores(const PagedKV& kv, int seq, int layer, int slot_begin, int window, const float* q,
                             float scale, float* out) override {
    KARAKV_RETURN_IF_ERROR(
        common::validate_window_scores(kv, seq, layer, slot_begin, window, q, scale, out, pool_blocks(kv)));
    KARAKV_RETURN_IF_ERROR(check_geometry("window_scores", kv));
    Call call(*this, "window_scores");
    DeviceKV dkv;
    KARAKV_RETURN_IF_ERROR(call.tables(kv, &dkv));
    const float* dq = nullptr;
    float* dout = nullptr;
    KARAKV_RETURN_IF_ERROR(call.input(q, size_t(window) * kv.geometry.q_token_elems() * sizeof(float), &dq));
    KARAKV_RETURN_IF_ERROR(call.output(out, size_t(kv.geometry.num_kv_heads) * window * sizeof(float), &dout));
    KARAKV_RETURN_IF_ERROR(call.launch([&](cudaStream_t stream) {
      return cuda::launch_window_scores(dkv, kv.geometry.dtype, seq, layer, slot_begin, window, dq, scale, dout, arena_,
                                        stream);
    }));
    return call.finish();
  }

  KernelStatus window_scores_observed(const PagedKV& kv, int seq, int layer, int slot_begin, int window,
                                      const float* q, float scale, const float* lse, bool later_keys_only,
                                      float* out) override {
    KARAKV_RETURN_IF_ERROR(
        common::validate_window_scores(kv, seq, layer, slot_begin, window, q, scale, out, pool_blocks(kv)));
    KARAKV_RETURN_IF_ERROR(check_geometry("window_scores_observed", kv));
    Call call(*this, "window_scores_observed");
    DeviceKV dkv;
    KARAKV_RETURN_IF_ERROR(call.tables(kv, &dkv));
    const size_t rows = size_t(window) * kv.geometry.num_q_heads;
    const float *dq = nullptr, *dlse = nullptr;
    float* dout = nullptr;
    KARAKV_RETURN_IF_ERROR(call.input(q, rows * kv.geometry.head_dim * sizeof(float), &dq));
    if (lse != nullptr) KARAKV_RETURN_IF_ERROR(call.input(lse, rows * sizeof(float), &dlse));
    KARAKV_RETURN_IF_ERROR(call.output(out, size_t(kv.geometry.num_kv_heads) * window * sizeof(float), &dout));
    KARAKV_RETURN_IF_ERROR(call.launch([&](cudaStream_t stream) {
      return cuda::launch_window_scores_observed(dkv, kv.geometry.dtype, seq, layer, slot_begin, window, dq, scale,
                                                 dlse, later_keys_only, dout, arena_, stream);
    }));
    return call.finish();
  }

  KernelStatus snapkv_scores(const PagedKV& kv, int seq, int layer, int num_obs, const float* q, float scale, int pool,
                             float* out) override {
    KARAKV_RETURN_IF_ERROR(
        common::validate_snapkv_scores(kv, seq, layer, num_obs, q, scale, pool, out, pool_blocks(kv)));
    KARAKV_RETURN_IF_ERROR(check_geometry("snapkv_scores", kv));
    const int n = kv.seq_len[seq];
    Call call(*this, "snapkv_scores");
    DeviceKV dkv;
    KARAKV_RETURN_IF_ERROR(call.tables(kv, &dkv));
    const float* dq = nullptr;
    float* dout = nullptr;
    KARAKV_RETURN_IF_ERROR(call.input(q, size_t(num_obs) * kv.geometry.q_token_elems() * sizeof(float), &dq));
    KARAKV_RETURN_IF_ERROR(call.output(out, size_t(kv.geometry.num_kv_heads) * n * sizeof(float), &dout));
    KARAKV_RETURN_IF_ERROR(call.launch([&](cudaStream_t stream) {
      return cuda::launch_snapkv_scores(dkv, kv.geometry.dtype, seq, layer, n, num_obs, dq, scale, pool, dout, arena_,
                                        stream);
    }));
    return call.finish();
  }

  KernelStatus top_k(const float* scores, int rows, int n, int k, int32_t* out) override {
    KARAKV_RETURN_IF_ERROR(common::validate_top_k(scores, rows, n, k, out));
    if (k == 0) return KernelStatus::ok();
    Call call(*this, "top_k");
    const float* ds = nullptr;
    int32_t* dout = nullptr;
    KARAKV_RETURN_IF_ERROR(call.input(scores, size_t(rows) * n * sizeof(float), &ds));
    KARAKV_RETURN_IF_ERROR(call.output(out, size_t(rows) * k * sizeof(int32_t), &dout));
    KARAKV_RETURN_IF_ERROR(call.launch([&](cudaStream_t stream) {
      return cuda::launch_top_k(ds, rows, n, k, dout, arena_, stream);
    }));
    return call.finish();
  }

  KernelStatus token2chunk(const float* scores, int rows, int n, int budget, int num_candidates, int max_gap,
                           int32_t* out) override {
    KARAKV_RETURN_IF_ERROR(common::validate_token2chunk(scores, rows, n, budget, num_candidates, max_gap, out));
    if (budget == 0) return KernelStatus::ok();
    Call call(*this, "token2chunk");
    const float* ds = nullptr;
    int32_t* dout = nullptr;
    KARAKV_RETURN_IF_ERROR(call.input(scores, size_t(rows) * n * sizeof(float), &ds));
    KARAKV_RETURN_IF_ERROR(call.output(out, size_t(rows) * budget * sizeof(int32_t), &dout));
    KARAKV_RETURN_IF_ERROR(call.launch([&](cudaStream_t stream) {
      return cuda::launch_token2chunk(ds, rows, n, budget, num_candidates, max_gap, dout, arena_, stream);
    }));
    return call.finish();
  }

  KernelStatus gather_tokens(const PagedKV& kv, int seq, const int32_t* kept, int num_kept,
                             const int32_t* dst_blocks) override {
    KARAKV_RETURN_IF_ERROR(common::validate_gather_tokens(kv, seq, kept, num_kept, dst_blocks, pool_blocks(kv)));
    if (num_kept == 0) return KernelStatus::ok();
    const Geometry& geo = kv.geometry;
    const int rows = geo.num_layers * geo.num_kv_heads;
    const int num_dst = (num_kept + geo.block_size - 1) / geo.block_size;
    Call call(*this, "gather_tokens");
    DeviceKV dkv;
    KARAKV_RETURN_IF_ERROR(call.tables(kv, &dkv));
    const int32_t *dkept = nullptr, *ddst = nullptr;
    KARAKV_RETURN_IF_ERROR(call.input(kept, size_t(rows) * num_kept * sizeof(int32_t), &dkept));
    KARAKV_RETURN_IF_ERROR(call.input(dst_blocks, size_t(num_dst) * sizeof(int32_t), &ddst));
    KARAKV_RETURN_IF_ERROR(call.launch([&](cudaStream_t stream) {
      return cuda::launch_gather_tokens(dkv, dtype_size(geo.dtype), seq, dkept, num_kept, ddst, stream);
    }));
    return call.finish();
  }

  KernelStatus cam_merge_values(const PagedKV& kv, int seq, int begin, int end, const int32_t* kept, int num_kept,
                                const float* scores, int merge_tokens, const int32_t* dst_blocks) override {
    KARAKV_RETURN_IF_ERROR(common::validate_cam_merge(kv, seq, begin, end, kept, num_kept, scores, merge_tokens,
                                                   dst_blocks, pool_blocks(kv)));
    const Geometry& g = kv.geometry;
    const int rows = g.num_layers * g.num_kv_heads, n = end - begin;
    const int num_dst = (num_kept + g.block_size - 1) / g.block_size;
    if (num_kept == 0 || n == 0) return KernelStatus::ok();
    Call call(*this, "cam_merge_values");
    DeviceKV dkv;
    KARAKV_RETURN_IF_ERROR(call.tables(kv, &dkv));
    const int32_t *dkept = nullptr, *ddst = nullptr;
    const float* dscores = nullptr;
    KARAKV_RETURN_IF_ERROR(call.input(kept, size_t(rows) * num_kept * sizeof(int32_t), &dkept));
    KARAKV_RETURN_IF_ERROR(call.input(scores, size_t(rows) * n * sizeof(float), &dscores));
    KARAKV_RETURN_IF_ERROR(call.input(dst_blocks, size_t(num_dst) * sizeof(int32_t), &ddst));
    KARAKV_RETURN_IF_ERROR(call.launch([&](cudaStream_t stream) {
      return cuda::launch_cam_merge(dkv, g.dtype, seq, begin, end, dkept, num_kept, dscores, merge_tokens, ddst, arena_,
                                    stream);
    }));
    return call.finish();
  }

  // ---- quantized storage (kernels/cuda/quant.cuh): the reference's byte layouts, so the sizes are
  // the reference's too.
  int quantized_tokens_per_block(const Geometry& g, QuantFormat format) const override {
    if (!cuda::check_geometry(g).is_ok()) return 0;
    return common::quantized_tokens_per_block(g, format);
  }

  KernelStatus quantize_tokens(const PagedKV& kv, int seq, int slot_begin, const QuantizedKV& q,
                               int32_t dst) override {
    constexpr std::string_view op = "quantize_tokens";
    KARAKV_RETURN_IF_ERROR(check_quantized(op, kv, q));
    KARAKV_RETURN_IF_ERROR(common::check_tables(op, kv));
    KARAKV_RETURN_IF_ERROR(common::check_seq_index(op, kv, seq));
    const int n = q.tokens_per_block;
    if (slot_begin < 0 || (long long)slot_begin + n > kv.seq_len[seq])
      return KernelStatus::invalid(std::string(op) + ": slots [" + std::to_string(slot_begin) + ", " +
                                   std::to_string((long long)slot_begin + n) + ") not within seq_len " +
                                   std::to_string(kv.seq_len[seq]));
    const long long blocks = pool_blocks(kv);
    KARAKV_RETURN_IF_ERROR(common::check_covered(op, kv, seq, slot_begin, (long long)slot_begin + n, blocks));
    if (dst < 0 || (blocks >= 0 && dst >= blocks))
      return KernelStatus::invalid(common::out_of_range(op, "dst block", dst, 0, blocks >= 0 ? blocks : INT32_MAX));
    const Geometry& g = kv.geometry;
    Call call(*this, op);
    DeviceKV dkv;
    KARAKV_RETURN_IF_ERROR(call.tables(kv, &dkv));
    const std::vector<uint64_t> seeds = head_seeds(g, q.seed);
    cuda::DeviceQuant dq;
    dq.format = q.format;
    dq.tokens_per_block = n;
    KARAKV_RETURN_IF_ERROR(call.upload(seeds, &dq.head_seeds));
    // The first token of each (layer, K/V, head) run the reference would refuse; such runs stay unwritten.
    std::vector<int32_t> first_bad(size_t(g.num_layers) * 2 * g.num_kv_heads);
    int32_t* dbad = nullptr;
    KARAKV_RETURN_IF_ERROR(call.output(first_bad.data(), first_bad.size() * sizeof(int32_t), &dbad));
    KARAKV_RETURN_IF_ERROR(call.launch([&](cudaStream_t stream) {
      return cuda::launch_quantize_tokens(dkv, g.dtype, dq, seq, slot_begin, dst, dbad, arena_, stream);
    }));
    KARAKV_RETURN_IF_ERROR(call.finish());
    const bool kivi = common::is_kivi(q.format);
    for (size_t r = 0; r < first_bad.size(); ++r) {
      if (first_bad[r] == cuda::kNoBadToken) continue;
      const int hk = g.num_kv_heads;
      return KernelStatus::invalid(
          std::string(op) + ": layer " + std::to_string(r / (2 * hk)) + " KV head " + std::to_string(r % hk) +
          ((r / hk) % 2 == 0 ? " keys" : " values") + ": slot " + std::to_string(slot_begin + first_bad[r]) +
          (kivi ? " has a value outside the fp16 range [-65504, 65504]"
                : " has a norm that is not finite in fp16 (must be <= 65504)") +
          "; that run was not written");
    }
    return KernelStatus::ok();
  }

  KernelStatus dequantize_block(const PagedKV& kv, const QuantizedKV& q, int32_t block, void* k, void* v) override {
    constexpr std::string_view op = "dequantize_block";
    KARAKV_RETURN_IF_ERROR(check_quantized(op, kv, q));
    const long long blocks = pool_blocks(kv);
    if (block < 0 || (blocks >= 0 && block >= blocks))
      return KernelStatus::invalid(common::out_of_range(op, "block", block, 0, blocks >= 0 ? blocks : INT32_MAX));
    if (k == nullptr || v == nullptr) return KernelStatus::invalid(std::string(op) + ": k and v must be non-null");
    const Geometry& g = kv.geometry;
    Call call(*this, op);
    // Only the pool is read: the sequences' tables play no part.
    PagedKV pool_only = kv;
    pool_only.num_seqs = 0;
    DeviceKV dkv;
    KARAKV_RETURN_IF_ERROR(call.tables(pool_only, &dkv));
    cuda::DeviceQuant dq;
    dq.format = q.format;
    dq.tokens_per_block = q.tokens_per_block;
    const std::vector<uint64_t> seeds = head_seeds(g, q.seed);
    KARAKV_RETURN_IF_ERROR(call.upload(seeds, &dq.head_seeds));
    const size_t bytes = size_t(g.num_layers) * q.tokens_per_block * g.kv_token_elems() * dtype_size(g.dtype);
    void *dk = nullptr, *dv = nullptr;
    KARAKV_RETURN_IF_ERROR(call.output(k, bytes, &dk));
    KARAKV_RETURN_IF_ERROR(call.output(v, bytes, &dv));
    KARAKV_RETURN_IF_ERROR(call.launch([&](cudaStream_t stream) {
      return cuda::launch_dequantize_block(dkv, g.dtype, dq, block, dk, dv, stream);
    }));
    return call.finish();
  }

  KernelStatus decode_attention_quantized(const PagedKV& kv, const QuantizedKV& qkv, int layer, const float* q,
                                          float* out, float scale, float* const* score_acc, const int32_t* acc_begin,
                                          float* const* lse) override {
    constexpr std::string_view op = "decode_attention_quantized";
    KARAKV_RETURN_IF_ERROR(check_quantized(op, kv, qkv));
    KARAKV_RETURN_IF_ERROR(common::check_tables(op, kv));
    KARAKV_RETURN_IF_ERROR(common::check_layer(op, kv, layer));
    if (q == nullptr || out == nullptr) return KernelStatus::invalid(std::string(op) + ": q and out must be non-null");
    const long long blocks = pool_blocks(kv);
    for (int s = 0; s < kv.num_seqs; ++s) {
      if (kv.seq_len[s] < 0)
        return KernelStatus::invalid(std::string(op) + ": seq_len[" + std::to_string(s) + "] " +
                                     std::to_string(kv.seq_len[s]) + " must be >= 0");
      KARAKV_RETURN_IF_ERROR(common::check_covered(op, kv, s, 0, kv.seq_len[s], blocks));
    }
    KARAKV_RETURN_IF_ERROR(check_quantized_tables(op, kv, qkv, 0, kv.num_seqs, blocks));
    if (score_acc != nullptr) KARAKV_RETURN_IF_ERROR(common::validate_accumulators(op, kv, score_acc, acc_begin, &qkv));
    if (kv.num_seqs == 0) return KernelStatus::ok();
    std::vector<int32_t> row_seq(kv.num_seqs), row_quantized(kv.num_seqs), row_fp(kv.seq_len, kv.seq_len + kv.num_seqs);
    for (int s = 0; s < kv.num_seqs; ++s) {
      row_seq[s] = s;
      row_quantized[s] = qkv.quantized(s);
    }
    std::vector<int32_t> first;
    if (score_acc != nullptr) first = common::first_observed_slots(kv, score_acc, acc_begin, &qkv);
    return quantized_attention(op, kv, qkv, layer, row_seq, row_quantized, row_fp, first, q, out, scale, score_acc,
                               lse);
  }

  KernelStatus causal_attention_quantized(const PagedKV& kv, const QuantizedKV& qkv, int seq, int layer,
                                          int num_queries, const float* q, float* out, float scale) override {
    constexpr std::string_view op = "causal_attention_quantized";
    KARAKV_RETURN_IF_ERROR(check_quantized(op, kv, qkv));
    const long long blocks = pool_blocks(kv);
    KARAKV_RETURN_IF_ERROR(common::validate_causal_quantized_rows(kv, seq, layer, num_queries, blocks));
    if (q == nullptr || out == nullptr) return KernelStatus::invalid(std::string(op) + ": q and out must be non-null");
    const int len = kv.seq_len[seq];
    KARAKV_RETURN_IF_ERROR(check_quantized_tables(op, kv, qkv, seq, seq + 1, blocks));
    std::vector<int32_t> row_seq(num_queries, seq), row_quantized(num_queries, qkv.quantized(seq)), row_fp(num_queries);
    for (int i = 0; i < num_queries; ++i) row_fp[i] = len - num_queries + i + 1;
    return quantized_attention(op, kv, qkv, layer, row_seq, row_quantized, row_fp, {}, q, out, scale, nullptr, nullptr);
  }

 private:
  // The rotation seed of every (layer, KV head): [num_layers * num_kv_heads].
  static std::vector<uint64_t> head_seeds(const Geometry& g, uint64_t seed) {
    std::vector<uint64_t> seeds(size_t(g.num_layers) * g.num_kv_heads);
    for (int l = 0; l < g.num_layers; ++l)
      for (int h = 0; h < g.num_kv_heads; ++h) seeds[size_t(l) * g.num_kv_heads + h] = head_seed(seed, l, h);
    return seeds;
  }

  // The reference's checks of a quantized call (common::check_geometry, and tokens_per_block the format's:
  // common/quant_layout.h), then the CUDA kernels' limits.
  static KernelStatus check_quantized(std::string_view op, const PagedKV& kv, const QuantizedKV& q) {
    KARAKV_RETURN_IF_ERROR(common::check_geometry(op, kv));
    const int want = common::quantized_tokens_per_block(kv.geometry, q.format);
    if (q.tokens_per_block < 1 || q.tokens_per_block != want)
      return KernelStatus::invalid(std::string(op) + ": tokens_per_block " + std::to_string(q.tokens_per_block) +
                                   " does not match the format's " + std::to_string(want));
    return check_geometry(op, kv);
  }

  // The quantized tables of sequences [begin, end): offsets ascending from 0, block ids inside the
  // pool (a bad id would fault the device; the reference trusts them).
  static KernelStatus check_quantized_tables(std::string_view op, const PagedKV& kv, const QuantizedKV& q, int begin,
                                             int end, long long pool_blocks) {
    if (begin >= end) return KernelStatus::ok();
    if (q.table_offset == nullptr)
      return KernelStatus::invalid(std::string(op) + ": the quantized table_offset must be non-null");
    for (int s = begin; s < end; ++s) {
      const int32_t first = q.table_offset[s], last = q.table_offset[s + 1];
      if (first < 0 || last < first)
        return KernelStatus::invalid(std::string(op) + ": quantized table_offset[" + std::to_string(s) + ", " +
                                     std::to_string(s + 1) + "] = " + std::to_string(first) + ", " +
                                     std::to_string(last) + " is not ascending from 0");
      if (last > first && q.block_table == nullptr)
        return KernelStatus::invalid(std::string(op) + ": the quantized block_table must be non-null");
      for (int32_t i = first; i < last; ++i)
        if (q.block_table[i] < 0 || (pool_blocks >= 0 && q.block_table[i] >= pool_blocks))
          return KernelStatus::invalid(common::out_of_range(op, "quantized block", q.block_table[i], 0,
                                                            pool_blocks >= 0 ? pool_blocks : INT32_MAX));
    }
    return KernelStatus::ok();
  }

  // Rows of quantized attention (launch_quantized_attention, arguments validated); with score_acc,
  // the probabilities of slots [first[r], slots) summed over each KV head's query heads and added
  // into row r's sequence's accumulators, device or host (first empty: from 0); with lse_out, each
  // sequence's per-query-head log-sum-exp. first is indexed by row and lse_out by sequence: both are
  // meant for decode, where row r is sequence r (the causal path passes neither).
  KernelStatus quantized_attention(std::string_view op, const PagedKV& kv, const QuantizedKV& qkv, int layer,
                                   const std::vector<int32_t>& row_seq, const std::vector<int32_t>& row_quantized,
                                   const std::vector<int32_t>& row_fp, const std::vector<int32_t>& first,
                                   const float* q, float* out, float scale, float* const* score_acc,
                                   float* const* lse_out) {
    const Geometry& g = kv.geometry;
    const int rows = int(row_seq.size());
    if (!first.empty() && first.size() != row_seq.size())
      return KernelStatus::invalid(std::string(op) + ": " + std::to_string(first.size()) +
                                   " first observed slots for " + std::to_string(rows) + " rows (one per row)");
    Call call(*this, op);
    DeviceKV dkv;
    KARAKV_RETURN_IF_ERROR(call.tables(kv, &dkv));
    int32_t entries = 0;
    for (int32_t s : row_seq) entries = std::max(entries, qkv.table_offset[s + 1]);
    cuda::DeviceQuant dq;
    dq.format = qkv.format;
    dq.tokens_per_block = qkv.tokens_per_block;
    KARAKV_RETURN_IF_ERROR(call.input(qkv.block_table, size_t(entries) * sizeof(int32_t), &dq.block_table));
    KARAKV_RETURN_IF_ERROR(call.input(qkv.table_offset, size_t(kv.num_seqs + 1) * sizeof(int32_t), &dq.table_offset));
    const std::vector<uint64_t> seeds = head_seeds(g, qkv.seed);
    KARAKV_RETURN_IF_ERROR(call.upload(seeds, &dq.head_seeds));
    const size_t bytes = size_t(rows) * g.q_token_elems() * sizeof(float);
    const float* dq_in = nullptr;
    float* dout = nullptr;
    KARAKV_RETURN_IF_ERROR(call.input(q, bytes, &dq_in));
    KARAKV_RETURN_IF_ERROR(call.output(out, bytes, &dout));
    auto first_of = [&](int r) { return first.empty() ? 0 : first[r]; };
    // Rows whose sequence accumulates in device memory are added into on the device; the others'
    // probabilities come back. With score_acc, row r is sequence r (decode).
    DeviceAccumulators device;
    if (score_acc != nullptr) {
      for (int r = 0; r < rows; ++r)
        if (row_seq[r] != r)
          return KernelStatus::invalid(std::string(op) + ": accumulating rows must be the sequences in order");
      KARAKV_RETURN_IF_ERROR(device_accumulators(op, kv, &qkv, score_acc, &device));
    }
    std::vector<float> probs;
    float* dprobs = nullptr;
    float* const* dacc = nullptr;
    if (score_acc != nullptr) {
      size_t total = 0;
      for (int r = 0; r < rows; ++r)
        if (!device.on_device(r)) total += (size_t(row_quantized[r]) + row_fp[r] - first_of(r)) * g.num_kv_heads;
      probs.resize(std::max<size_t>(total, 1));
      if (total > 0) KARAKV_RETURN_IF_ERROR(call.output(probs.data(), total * sizeof(float), &dprobs));
      if (!device.rows.empty()) KARAKV_RETURN_IF_ERROR(call.upload(device.rows, &dacc));
    }
    std::vector<float> lse_host;
    float* dlse = nullptr;
    if (lse_out != nullptr) {
      lse_host.resize(size_t(rows) * g.num_q_heads);
      KARAKV_RETURN_IF_ERROR(call.output(lse_host.data(), lse_host.size() * sizeof(float), &dlse));
    }
    KARAKV_RETURN_IF_ERROR(call.launch([&](cudaStream_t stream) {
      return cuda::launch_quantized_attention(dkv, g.dtype, dq, layer, row_seq, row_quantized, row_fp, first, dq_in,
                                              dout, scale, dprobs, device.row_on_device, dacc, dlse,
                                              quant_ == CudaQuantDecode::kFused, arena_, stream);
    }));
    KARAKV_RETURN_IF_ERROR(call.finish());
    for (int r = 0; lse_out != nullptr && r < rows; ++r) {
      // As the CPU backend: a sequence without a slot keeps its normaliser.
      if (lse_out[row_seq[r]] != nullptr && row_quantized[r] + row_fp[r] > 0)
        std::copy_n(lse_host.data() + size_t(r) * g.num_q_heads, g.num_q_heads, lse_out[row_seq[r]]);
    }
    if (score_acc == nullptr) return KernelStatus::ok();
    size_t offset = 0;
    for (int r = 0; r < rows; ++r) {
      if (device.on_device(r)) continue;
      const int32_t f = first_of(r);
      const size_t n = size_t(row_quantized[r]) + row_fp[r] - f;
      for (int h = 0; h < g.num_kv_heads; ++h) {
        float* acc = score_acc[size_t(row_seq[r]) * g.num_kv_heads + h];
        const float* p = probs.data() + offset + size_t(h) * n;
        if (acc != nullptr)
          for (size_t i = 0; i < n; ++i) acc[f + i] += p[i];
      }
      offset += n * g.num_kv_heads;
    }
    return KernelStatus::ok();
  }

  // op: "copy_in" or "copy_out", for the messages.
  KernelStatus copy(void* dst, const void* src, size_t bytes, const char* op) {
    if (bytes == 0) return KernelStatus::ok();
    std::lock_guard<std::mutex> lock(mu_);
    KARAKV_CUDA_RETURN_IF_ERROR_IN(op, "cudaSetDevice", cudaSetDevice(device_));
    KARAKV_CUDA_RETURN_IF_ERROR_IN(op, "cudaMemcpyAsync of " + std::to_string(bytes) + " bytes",
                                   cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    return wait_stream(op);
  }

  // Waits for everything queued on the stream (mu_ held). A fault names `op` and, when calls
  // returned without waiting since the last wait, those calls: one of them may have caused it.
  KernelStatus wait_stream(std::string_view op) {
    const cudaError_t err = cudaStreamSynchronize(stream_);
    const uint64_t queued = deferred_calls_;
    deferred_calls_ = 0;
    for (bool& pending : upload_pending_) pending = false;
    if (err == cudaSuccess) return KernelStatus::ok();
    KernelStatus st = cuda::cuda_status(err, std::string(op) + ": cudaStreamSynchronize");
    // A kernel fault is sticky (the context is lost): the stream still reports it when asked again.
    const cudaError_t again = cudaStreamQuery(stream_);
    const bool sticky = again != cudaSuccess && again != cudaErrorNotReady;
    if (queued > 0) {
      st.message += " (" + std::to_string(queued) + " call(s) queued before it without a wait, the last:";
      const uint64_t named = std::min<uint64_t>(queued, kDeferredNames);
      for (uint64_t i = queued - named; i < queued; ++i) st.message += " " + std::string(deferred_names_[i % kDeferredNames]);
      st.message += ")";
    }
    if (sticky) {
      std::lock_guard<std::mutex> lock(fault_mu_);
      if (fault_.empty()) fault_ = st.message;
      faulted_.store(true, std::memory_order_release);
    }
    return st;
  }

  // Pinned host memory through which a call's host tensors travel: inputs packed into one
  // host-to-device copy, outputs into one device-to-host copy (copies from pageable memory go
  // through the driver's own staging one by one). `wanted` is what the last calls needed; the
  // buffer grows to it at the start of the next call, up to kMaxPinnedStaging (larger tensors
  // are copied one by one, as they would be anyway).
  struct PinnedStaging {
    char* host = nullptr;
    size_t size = 0;
    size_t wanted = size_t(256) << 10;
    size_t refused = SIZE_MAX;  // the smallest size cudaHostAlloc refused: not asked for again
  };
  static constexpr size_t kMaxPinnedStaging = size_t(16) << 20;

  // Grows `pinned` to what calls asked for. A failed cudaHostAlloc leaves it smaller (calls then
  // copy what does not fit one tensor at a time) and that size is not asked for again.
  static void grow(PinnedStaging& pinned) {
    const size_t want = std::min(pinned.wanted, kMaxPinnedStaging);
    if (want <= pinned.size) return;
    size_t size = size_t(64) << 10;
    while (size < want) size *= 2;
    if (size >= pinned.refused) return;
    void* p = nullptr;
    if (cudaHostAlloc(&p, size, cudaHostAllocDefault) != cudaSuccess) {
      cudaGetLastError();
      pinned.refused = size;
      return;
    }
    if (pinned.host != nullptr) cudaFreeHost(pinned.host);
    pinned.host = static_cast<char*>(p);
    pinned.size = size;
  }

  // One op's device session: holds the lock, rewinds the scratch arena, stages inputs and
  // outputs, and on finish() copies host outputs back and synchronizes the stream (or, waits
  // deferred and nothing coming back, returns with its work queued). `op` names the
  // op in every error the session returns or passes on (named()), so a fault that surfaces at the
  // synchronize says which op was running.
  //
  // Host inputs are packed into the pinned upload buffer as they are staged and reach the device
  // in one copy that launch() queues before it runs a launcher. Host outputs are packed likewise and come back in one copy at
  // finish(). The upload buffer (one of kUploadSlots) is rewritten by a later call only after this
  // call's upload from it ran (its event); the download buffer only by calls that synchronize.
  class Call {
   public:
    Call(CudaBackend& b, std::string_view op) : b_(b), op_(op), lock_(b.mu_), slot_(b.upload_next_) {
      cudaSetDevice(b_.device_);
      b_.upload_next_ = (slot_ + 1) % kUploadSlots;
      // The last upload from this slot's pinned buffer must have left it before it is rewritten
      // (or freed by grow); the kernels queued after that upload need not have run.
      if (b_.upload_pending_[slot_]) {
        cudaEventSynchronize(b_.upload_done_[slot_]);
        b_.upload_pending_[slot_] = false;
      }
      b_.arena_.reset();
      grow(b_.pinned_up_[slot_]);
      grow(b_.pinned_down_);
    }
    ~Call() {
      // An early return after launches must not leave work running into the next call's scratch.
      if (!finished_) {
        const KernelStatus ignored = b_.wait_stream(op_);  // the op already failed with its own error
        (void)ignored;
      }
    }

    // st, with the op's name in front when it failed (a launcher's or the arena's error).
    KernelStatus named(KernelStatus st) const {
      if (!st.is_ok()) st.message = std::string(op_) + ": " + st.message;
      return st;
    }
    // A CUDA call's result: OK, or kInternal "op: what: cudaErrorX (...)".
    KernelStatus check(cudaError_t err, std::string_view what) const {
      if (err == cudaSuccess) return KernelStatus::ok();
      return cuda::cuda_status(err, std::string(op_) + ": " + std::string(what));
    }

    // Runs `launcher(stream)` (a kernel launcher of kernels/cuda/) on the backend's stream once
    // every input staged so far is queued for upload on it, and names its error; a failed upload
    // launches nothing.
    template <typename Launcher>
    KernelStatus launch(Launcher&& launcher) {
      if (b_.test_delay_us_ > 0)
        KARAKV_RETURN_IF_ERROR(check(cudaLaunchHostFunc(b_.stream_, hold_stream, &b_.test_delay_us_),
                                     "cudaLaunchHostFunc ($KARAKV_CUDA_TEST_STREAM_DELAY_US)"));
      if (up_.used > up_.flushed) {
        KARAKV_RETURN_IF_ERROR(check(cudaMemcpyAsync(up_.device + up_.flushed, up_pinned().host + up_.flushed,
                                                     up_.used - up_.flushed, cudaMemcpyHostToDevice, b_.stream_),
                                     "cudaMemcpyAsync of the inputs to the device"));
        up_.flushed = up_.used;
        // The slot's buffer is free again once this upload has run, whatever the kernels after it do.
        KARAKV_RETURN_IF_ERROR(check(cudaEventRecord(b_.upload_done_[slot_], b_.stream_),
                                     "cudaEventRecord after the upload"));
        b_.upload_pending_[slot_] = true;
      }
      return named(launcher(b_.stream_));
    }

    template <typename T>
    KernelStatus upload(const std::vector<T>& host, const T** out) {
      return input(host.data(), host.size() * sizeof(T), out);
    }
    // A device view of `bytes` at p: p itself when it is device memory, else a scratch copy
    // (packed, or alone when the pinned buffer has no room).
    template <typename T>
    KernelStatus input(const T* p, size_t bytes, const T** out) {
      if (bytes == 0 || b_.is_device_memory(p)) {
        *out = p;
        return KernelStatus::ok();
      }
      size_t offset = 0;
      KARAKV_RETURN_IF_ERROR(pack(up_pinned(), up_, bytes, &offset));
      if (offset != kNoRoom) {
        std::memcpy(up_pinned().host + offset, p, bytes);
        *out = reinterpret_cast<const T*>(up_.device + offset);
        return KernelStatus::ok();
      }
      void* d = nullptr;
      KARAKV_RETURN_IF_ERROR(named(b_.arena_.take(bytes, &d)));
      KARAKV_RETURN_IF_ERROR(check(cudaMemcpyAsync(d, p, bytes, cudaMemcpyHostToDevice, b_.stream_),
                                   "cudaMemcpyAsync of an input to the device"));
      *out = static_cast<const T*>(d);
      return KernelStatus::ok();
    }
    template <typename T>
    KernelStatus output(T* p, size_t bytes, T** out) {
      if (bytes == 0 || b_.is_device_memory(p)) {
        *out = p;
        return KernelStatus::ok();
      }
      size_t offset = 0;
      KARAKV_RETURN_IF_ERROR(pack(b_.pinned_down_, down_, bytes, &offset));
      if (offset != kNoRoom) {
        copies_.push_back({p, down_.device + offset, bytes, offset});
        *out = reinterpret_cast<T*>(down_.device + offset);
        return KernelStatus::ok();
      }
      void* d = nullptr;
      KARAKV_RETURN_IF_ERROR(named(b_.arena_.take(bytes, &d)));
      copies_.push_back({p, d, bytes, kNoRoom});
      *out = static_cast<T*>(d);
      return KernelStatus::ok();
    }
    // Device copies of the tables: block ids up to the largest offset any sequence uses.
    KernelStatus tables(const PagedKV& kv, DeviceKV* out) {
      const Geometry& g = kv.geometry;
      out->pool = kv.pool;
      out->num_layers = g.num_layers;
      out->num_q_heads = g.num_q_heads;
      out->num_kv_heads = g.num_kv_heads;
      out->head_dim = g.head_dim;
      out->block_size = g.block_size;
      out->num_seqs = kv.num_seqs;
      if (kv.num_seqs == 0) return KernelStatus::ok();
      // The concatenated table ends at table_offset[num_seqs]; no sequence's slice may start past it.
      const int32_t entries = kv.table_offset[kv.num_seqs];
      for (int s = 0; s < kv.num_seqs; ++s)
        if (kv.table_offset[s] < 0 || kv.table_offset[s] > entries)
          return KernelStatus::invalid(std::string(op_) + ": table_offset[" + std::to_string(s) + "] " +
                                       std::to_string(kv.table_offset[s]) + " outside [0, table_offset[num_seqs] " +
                                       std::to_string(entries) + "]");
      KARAKV_RETURN_IF_ERROR(input(kv.block_table, size_t(entries) * sizeof(int32_t), &out->block_table));
      KARAKV_RETURN_IF_ERROR(input(kv.table_offset, size_t(kv.num_seqs + 1) * sizeof(int32_t), &out->table_offset));
      KARAKV_RETURN_IF_ERROR(input(kv.seq_len, size_t(kv.num_seqs) * sizeof(int32_t), &out->seq_len));
      return KernelStatus::ok();
    }
    // A kernel fault of this op (or, the context being broken for good after one, of an earlier op)
    // surfaces here, at the copies back or the synchronize.
    KernelStatus finish() {
      if (down_.used > 0)
        KARAKV_RETURN_IF_ERROR(check(cudaMemcpyAsync(b_.pinned_down_.host, down_.device, down_.used,
                                                     cudaMemcpyDeviceToHost, b_.stream_),
                                     "cudaMemcpyAsync of the outputs to the host"));
      for (const Copy& c : copies_)
        if (c.pinned_offset == kNoRoom)
          KARAKV_RETURN_IF_ERROR(check(cudaMemcpyAsync(c.host, c.device, c.bytes, cudaMemcpyDeviceToHost, b_.stream_),
                                       "cudaMemcpyAsync of an output to the host"));
      finished_ = true;
      if (t_deferring == &b_ && down_.used == 0 && copies_.empty()) {
        // Nothing comes back to the host: queued is done (launch() marked the upload).
        b_.deferred_names_[b_.deferred_calls_ % kDeferredNames] = op_;
        ++b_.deferred_calls_;
        return KernelStatus::ok();
      }
      KARAKV_RETURN_IF_ERROR(b_.wait_stream(op_));
      for (const Copy& c : copies_)
        if (c.pinned_offset != kNoRoom) std::memcpy(c.host, b_.pinned_down_.host + c.pinned_offset, c.bytes);
      return KernelStatus::ok();
    }

    static bool is_device(const void* p) {
      cudaPointerAttributes attr{};
      if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
        cudaGetLastError();
        return false;
      }
      return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
    }

   private:
    static constexpr size_t kNoRoom = SIZE_MAX;
    PinnedStaging& up_pinned() { return b_.pinned_up_[slot_]; }
    // This call's packed region of one direction: `capacity` bytes of scratch mirroring the pinned
    // buffer, `used` of them packed, the first `flushed` already queued for upload.
    struct Packed {
      char* device = nullptr;
      size_t capacity = 0, used = 0, flushed = 0;
      bool taken = false;
    };
    // An offset for `bytes` in the packed region (taken from the arena at the first use), or
    // kNoRoom; what the call wanted is remembered so the next call's pinned buffer fits it.
    KernelStatus pack(PinnedStaging& pinned, Packed& packed, size_t bytes, size_t* offset) {
      *offset = kNoRoom;
      const size_t need = (bytes + 255) / 256 * 256;
      pinned.wanted = std::max(pinned.wanted, packed.used + need);
      if (!packed.taken) {
        packed.taken = true;
        if (pinned.size > 0) {
          void* d = nullptr;
          KARAKV_RETURN_IF_ERROR(named(b_.arena_.take(pinned.size, &d)));
          packed.device = static_cast<char*>(d);
          packed.capacity = pinned.size;
        }
      }
      if (packed.used + need > packed.capacity) return KernelStatus::ok();
      *offset = packed.used;
      packed.used += need;
      return KernelStatus::ok();
    }

    struct Copy {
      void* host;
      const void* device;
      size_t bytes;
      size_t pinned_offset;  // where it lands in the pinned download buffer, or kNoRoom (copied alone)
    };
    CudaBackend& b_;
    const std::string_view op_;
    std::lock_guard<std::mutex> lock_;
    const int slot_;  // the pinned upload buffer of this call
    Packed up_, down_;
    std::vector<Copy> copies_;
    bool finished_ = false;
  };

  // The attention and scoring kernels keep a query row per lane group in registers or shared memory
  // (cuda_limits.h; the daemon checks its geometry against the same limits when it starts).
  static KernelStatus check_geometry(std::string_view op, const PagedKV& kv) {
    KernelStatus st = cuda::check_geometry(kv.geometry);
    if (!st.is_ok()) st.message = std::string(op) + ": " + st.message + " (use --backend=cpu)";
    return st;
  }

  // The score_acc entries in this backend's memory (allocate(): H2O's accumulators), which the
  // probability kernels add into on the device; the others are host memory, added into on the host
  // after the copy back. rows: [num_rows * num_kv_heads], the device entries (null elsewhere), or
  // empty when there is none.
  struct DeviceAccumulators {
    std::vector<float*> rows;
    std::vector<char> row_on_device;
    bool on_device(int r) const { return !row_on_device.empty() && row_on_device[r]; }
  };
  // Every non-null accumulator of one sequence must be on the same side, and one in device memory
  // must be an allocation of this backend holding the sequence's slots (quantized ones included
  // with qkv): a device staging region or a row cut short would be written out of place.
  KernelStatus device_accumulators(std::string_view op, const PagedKV& kv, const QuantizedKV* qkv,
                                   float* const* score_acc, DeviceAccumulators* out) const {
    out->rows.clear();
    out->row_on_device.clear();
    if (score_acc == nullptr) return KernelStatus::ok();
    const int num_rows = kv.num_seqs, kv_heads = kv.geometry.num_kv_heads;
    const size_t entries = size_t(num_rows) * kv_heads;
    // One lock per table for the whole call, not one per pointer: this runs every decode layer.
    std::vector<size_t> own(entries), shared(entries);
    allocations_.bytes_from(reinterpret_cast<const void* const*>(score_acc), entries, own.data());
    shared_allocations_.bytes_from(reinterpret_cast<const void* const*>(score_acc), entries, shared.data());
    for (int r = 0; r < num_rows; ++r) {
      int on_device = 0, on_host = 0;
      const size_t need = (size_t(kv.seq_len[r]) + (qkv != nullptr ? qkv->quantized(r) : 0)) * sizeof(float);
      for (int h = 0; h < kv_heads; ++h) {
        if (score_acc[size_t(r) * kv_heads + h] == nullptr) continue;
        const size_t room = own[size_t(r) * kv_heads + h];
        if (room == 0 && shared[size_t(r) * kv_heads + h] > 0)
          return KernelStatus::invalid(std::string(op) + ": score_acc[" + std::to_string(size_t(r) * kv_heads + h) +
                                       "] points into device staging; expected host memory or memory from allocate()");
        if (room > 0 && room < need)
          return KernelStatus::invalid(std::string(op) + ": score_acc[" + std::to_string(size_t(r) * kv_heads + h) +
                                       "] has " + std::to_string(room / sizeof(float)) +
                                       " floats left in its allocation; expected at least the sequence's " +
                                       std::to_string(need / sizeof(float)) + " slots");
        (room > 0 ? on_device : on_host) += 1;
      }
      if (on_device > 0 && on_host > 0)
        return KernelStatus::invalid(std::string(op) + ": score_acc of sequence " + std::to_string(r) + " has " +
                                     std::to_string(on_device) + " KV heads in device memory and " +
                                     std::to_string(on_host) + " in host memory; expected one kind per sequence");
      if (on_device == 0) continue;
      if (out->rows.empty()) {
        out->rows.assign(size_t(num_rows) * kv_heads, nullptr);
        out->row_on_device.assign(num_rows, 0);
      }
      out->row_on_device[r] = 1;
      std::copy_n(score_acc + size_t(r) * kv_heads, kv_heads, out->rows.begin() + size_t(r) * kv_heads);
    }
    return KernelStatus::ok();
  }

  // Decode attention; with score_acc (from slot acc_begin[s] on), H2O's and Kara's accumulated
  // probabilities, added into the accumulators (device or host); with lse_out, each sequence's
  // per-query-head log-sum-exp (Kara's norm = full). op "decode_attention" passes neither.
  KernelStatus decode(const PagedKV& kv, int layer, const float* q, float* out, float scale, float* const* score_acc,
                      const int32_t* acc_begin, float* const* lse_out, std::string_view op) {
    KARAKV_RETURN_IF_ERROR(common::validate_decode(op, kv, layer, q, out, pool_blocks(kv)));
    const bool observing = op != "decode_attention";
    if (observing) KARAKV_RETURN_IF_ERROR(common::validate_accumulators(op, kv, score_acc, acc_begin));
    KARAKV_RETURN_IF_ERROR(check_geometry(op, kv));
    if (kv.num_seqs == 0) return KernelStatus::ok();
    const Geometry& geo = kv.geometry;
    // Per sequence, the slots whose probabilities are added: [first[s], seq_len[s]); into device
    // accumulators on the device, into host ones after the copy back of probs[offset[s]...].
    std::vector<int32_t> first(kv.num_seqs);
    DeviceAccumulators device;
    if (observing) {
      first = common::first_observed_slots(kv, score_acc, acc_begin);
      KARAKV_RETURN_IF_ERROR(device_accumulators(op, kv, nullptr, score_acc, &device));
    }
    std::vector<int64_t> offset(kv.num_seqs, -1);
    int64_t total = 0;
    for (int s = 0; observing && s < kv.num_seqs; ++s) {
      if (device.on_device(s)) continue;
      offset[s] = total;
      total += int64_t(kv.seq_len[s] - first[s]) * geo.num_kv_heads;
    }
    const bool scoring = total > 0 || !device.rows.empty();
    // FlashInfer's route uploads its own page arrays: the whole tables go up only for the own
    // kernels or the observers' probability kernel.
    const bool flashinfer = flashinfer_covers(kv);
    Call call(*this, op);
    DeviceKV dkv;
    if (!flashinfer || scoring) KARAKV_RETURN_IF_ERROR(call.tables(kv, &dkv));
    cuda::AttentionRows rows;  // row s is sequence s
    rows.row_len = dkv.seq_len;
    rows.num_rows = kv.num_seqs;
    for (int s = 0; s < kv.num_seqs; ++s) {
      rows.max_len = std::max(rows.max_len, kv.seq_len[s]);
      rows.total_len += kv.seq_len[s];
    }
    const size_t bytes = size_t(kv.num_seqs) * geo.q_token_elems() * sizeof(float);
    const float* dq = nullptr;
    float* dout = nullptr;
    KARAKV_RETURN_IF_ERROR(call.input(q, bytes, &dq));
    KARAKV_RETURN_IF_ERROR(call.output(out, bytes, &dout));
    float* lse = nullptr;
    std::vector<float> lse_host;
    if (lse_out != nullptr) {
      lse_host.resize(size_t(kv.num_seqs) * geo.num_q_heads);
      KARAKV_RETURN_IF_ERROR(call.output(lse_host.data(), lse_host.size() * sizeof(float), &lse));
    } else if (scoring) {
      KARAKV_RETURN_IF_ERROR(call.named(arena_.take(size_t(kv.num_seqs) * geo.num_q_heads, &lse)));
    }
    if (flashinfer) {
      KARAKV_RETURN_IF_ERROR(flashinfer_decode(call, kv, layer, dq, dout, scale, lse));
    } else {
      KARAKV_RETURN_IF_ERROR(call.launch([&](cudaStream_t stream) {
        return cuda::launch_paged_attention(dkv, geo.dtype, layer, rows, dq, dout, scale, lse, num_sms_, arena_, stream);
      }));
    }
    if (!observing) return call.finish();

    // Per-(sequence, KV head) probabilities of the accumulated slots on the device: added there into
    // device accumulators, copied back for host ones.
    std::vector<float> probs;
    if (scoring) {
      const int64_t* doffset = nullptr;
      const int32_t* dfirst = nullptr;
      float* const* dacc = nullptr;
      KARAKV_RETURN_IF_ERROR(call.upload(offset, &doffset));
      KARAKV_RETURN_IF_ERROR(call.upload(first, &dfirst));
      if (!device.rows.empty()) KARAKV_RETURN_IF_ERROR(call.upload(device.rows, &dacc));
      probs.resize(size_t(total));
      float* dprobs = nullptr;
      if (total > 0) KARAKV_RETURN_IF_ERROR(call.output(probs.data(), size_t(total) * sizeof(float), &dprobs));
      KARAKV_RETURN_IF_ERROR(call.launch([&](cudaStream_t stream) {
        return cuda::launch_attention_probabilities(dkv, geo.dtype, layer, dq, scale, lse, dfirst, doffset, dprobs,
                                                    dacc, stream);
      }));
    }
    KARAKV_RETURN_IF_ERROR(call.finish());
    for (int s = 0; s < kv.num_seqs; ++s) {
      // As the CPU backend: an empty sequence's normaliser is left as it was.
      if (lse_out != nullptr && lse_out[s] != nullptr && kv.seq_len[s] > 0)
        std::copy_n(lse_host.data() + size_t(s) * geo.num_q_heads, geo.num_q_heads, lse_out[s]);
      const int32_t n = device.on_device(s) ? 0 : kv.seq_len[s] - first[s];
      for (int h = 0; h < geo.num_kv_heads && n > 0; ++h) {
        float* acc = score_acc[size_t(s) * geo.num_kv_heads + h];
        if (acc == nullptr) continue;
        const float* p = probs.data() + offset[s] + size_t(h) * n;
        for (int32_t i = 0; i < n; ++i) acc[first[s] + i] += p[i];
      }
    }
    return KernelStatus::ok();
  }

  // Whether this decode call runs FlashInfer's batch decode: asked for, built, a geometry it covers
  // (flashinfer_decode_gap) and a sequence with a token.
  bool flashinfer_covers(const PagedKV& kv) const {
#if KARAKV_HAVE_FLASHINFER
    if (attention_ != CudaAttention::kFlashInfer || !cuda::flashinfer_decode_gap(kv.geometry).empty()) return false;
    for (int s = 0; s < kv.num_seqs; ++s)
      if (kv.seq_len[s] > 0) return true;
#else
    (void)kv;
#endif
    return false;
  }

  // One layer of decode through FlashInfer (arguments validated, flashinfer_covers): the non-empty
  // sequences' tables as its pages (each one's first ceil(seq_len / block_size) block ids), a plan
  // that the call's other layers and the next calls of the same shape reuse, then its kernel and the
  // widening of its output into dout (0 for an empty sequence) and, when given, lse (natural; -inf
  // for an empty sequence).
  KernelStatus flashinfer_decode(Call& call, const PagedKV& kv, int layer, const float* dq, float* dout, float scale,
                                 float* lse) {
#if KARAKV_HAVE_FLASHINFER
    const Geometry& g = kv.geometry;
    const cuda::FlashInferHostPages host = cuda::flashinfer_pages(kv);
    const int batch = host.batch();
    cuda::FlashInferPages pages;
    pages.batch = batch;
    KARAKV_RETURN_IF_ERROR(call.upload(host.indptr, &pages.indptr));
    KARAKV_RETURN_IF_ERROR(call.upload(host.indices, &pages.indices));
    KARAKV_RETURN_IF_ERROR(call.upload(host.last_page_len, &pages.last_page_len));
    cuda::FlashInferRows rows;
    rows.rows = kv.num_seqs;
    rows.q = dq;
    rows.out = dout;
    rows.lse = lse;
    rows.scale = scale;
    // FlashInfer loads the queries 16 bytes at a time: a caller's device q that is not 16-byte
    // aligned is gathered into scratch (which is), as when a row is left out.
    if (!host.every_row || reinterpret_cast<uintptr_t>(dq) % 16 != 0) {
      KARAKV_RETURN_IF_ERROR(call.upload(host.row_map, &rows.row_map));
      KARAKV_RETURN_IF_ERROR(call.named(arena_.take(size_t(batch) * g.q_token_elems(), &rows.q_batch)));
    }
    KARAKV_RETURN_IF_ERROR(call.named(arena_.take(size_t(batch) * g.q_token_elems() * dtype_size(g.dtype), &rows.o16)));
    if (lse != nullptr) KARAKV_RETURN_IF_ERROR(call.named(arena_.take(size_t(batch) * g.num_q_heads, &rows.lse2)));
    // The plan's upload is queued on the stream before the call's inputs; launch() queues those
    // before the kernels, so both are in place when they run.
    // A failure names FlashInfer and says how to run without it.
    auto failed = [](const std::string& err) -> KernelStatus {
      return {KernelStatus::Code::kInternal,
              err + " (KARAKV_CUDA_ATTENTION=own runs the project's decode kernels instead)"};
    };
    if (std::string err = flashinfer_.plan(g, host.indptr, stream_); !err.empty()) return call.named(failed(err));
    return call.launch([&](cudaStream_t stream) -> KernelStatus {
      std::string err = flashinfer_.run(g, kv.pool, layer, pages, rows, stream);
      return err.empty() ? KernelStatus::ok() : failed(err);
    });
#else
    (void)call, (void)kv, (void)layer, (void)dq, (void)dout, (void)scale, (void)lse;
    return {KernelStatus::Code::kInternal, "FlashInfer is not in this build"};
#endif
  }

  long long pool_blocks(const PagedKV& kv) const { return allocations_.pool_blocks(kv); }

  const int device_;
  const int num_sms_;
  const std::string device_name_;
  cudaStream_t stream_ = nullptr;
  mutable std::mutex mu_;
  common::Allocations allocations_;
  common::Allocations shared_allocations_;  // allocate_shared's device staging
  CudaScratchMemory scratch_memory_{&stream_};
  Arena arena_{scratch_memory_};
  // Uploads rotate over kUploadSlots pinned buffers, each with the event of its last upload, so a
  // call that did not wait leaves its buffer to the stream while the next calls pack theirs.
  static constexpr int kUploadSlots = 4;
  PinnedStaging pinned_up_[kUploadSlots];
  cudaEvent_t upload_done_[kUploadSlots] = {};
  bool upload_pending_[kUploadSlots] = {};
  int upload_next_ = 0;
  PinnedStaging pinned_down_;
  // Calls that returned without waiting since the last wait: how many, and the names of the last
  // kDeferredNames (op names are string literals).
  static constexpr int kDeferredNames = 8;
  uint64_t deferred_calls_ = 0;
  std::string_view deferred_names_[kDeferredNames];
  mutable std::mutex fault_mu_;  // fault_ is read without mu_ (a call may hold it, stuck)
  std::string fault_;            // the first sticky error a wait met (fault())
  std::atomic<bool> faulted_{false};
  const CudaAttention attention_;
  const CudaQuantDecode quant_;
  int test_delay_us_;  // $KARAKV_CUDA_TEST_STREAM_DELAY_US (cudaLaunchHostFunc takes a non-const pointer)
#if KARAKV_HAVE_FLASHINFER
  cuda::FlashInferDecode flashinfer_;  // its workspaces and the last plan
#endif
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device, CudaAttention attention, CudaQuantDecode quant,
                                           std::string* error) {
  auto fail = [&](const std::string& why) -> std::unique_ptr<Backend> {
    if (error != nullptr) *error = why;
    return nullptr;
  };
  if (std::string missing = cuda_attention_missing(attention); !missing.empty())
    return fail("CUDA attention " + std::string(cuda_attention_name(attention)) + ": " + missing);
  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    cudaGetLastError();
    return fail(std::string("no usable CUDA driver or device: cudaGetDeviceCount: ") + cudaGetErrorName(err) + " (" +
                cudaGetErrorString(err) + ")");
  }
  if (count == 0) return fail("no CUDA device found (cudaGetDeviceCount returned 0)");
  if (device < 0 || device >= count)
    return fail("CUDA device " + std::to_string(device) + " out of range [0, " + std::to_string(count) + ")");
  cudaDeviceProp prop{};
  if (const cudaError_t err = cudaGetDeviceProperties(&prop, device); err != cudaSuccess)
    return fail(std::string("cudaGetDeviceProperties: ") + cudaGetErrorString(err));
  auto backend = std::make_unique<CudaBackend>(device, prop.multiProcessorCount, prop.name, attention, quant);
  if (KernelStatus st = backend->init(); !st.is_ok()) return fail(st.message);
  // A device whose context cannot be created, or that is out of memory, fails here rather than on
  // the first request.
  void* probe = nullptr;
  if (KernelStatus st = backend->allocate(256, &probe); !st.is_ok()) return fail(st.message);
  backend->free(probe);
  return backend;
}

bool cuda_backend_built() { return true; }

}  // namespace karakv::kernels
