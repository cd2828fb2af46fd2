// A kernel backend that passes every call to another one: tests override only what they change
// (e.g. pretending some host memory is device memory).
#pragma once

#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include "karakv/kernels/backend.h"

namespace karakv::testing {

// Device staging for a CPU-backed test backend: zeroed heap memory with a 64-byte handle of `tag`.
inline kernels::KernelStatus heap_shared_memory(size_t bytes, const std::string& tag,
                                                kernels::SharedDeviceMemory* out) {
  out->ptr = std::calloc(1, bytes);
  out->bytes = bytes;
  out->device = 0;
  out->ipc_handle = tag;
  out->ipc_handle.resize(64, tag.size() == 1 ? tag[0] : '\0');
  return kernels::KernelStatus::ok();
}

class DelegatingBackend : public kernels::Backend {
 public:
  using KernelStatus = kernels::KernelStatus;
  using PagedKV = kernels::PagedKV;
  using QuantizedKV = kernels::QuantizedKV;
  explicit DelegatingBackend(std::unique_ptr<kernels::Backend> inner) : inner_(std::move(inner)) {}

  std::string_view name() const override { Guard in_call(*this);
    return inner_->name(); }
  std::string description() const override { Guard in_call(*this);
    return inner_->description(); }
  bool supports(kernels::Op op, kernels::DType dtype) const override { Guard in_call(*this);
    return inner_->supports(op, dtype); }
  void prepare_thread() override { inner_->prepare_thread(); }
  KernelStatus allocate(size_t bytes, void** out) override { Guard in_call(*this);
    return inner_->allocate(bytes, out); }
  void free(void* ptr) override { inner_->free(ptr); }
  KernelStatus copy_in(void* dst, const void* src, size_t bytes) override { Guard in_call(*this);
    return inner_->copy_in(dst, src, bytes); }
  KernelStatus copy_out(void* dst, const void* src, size_t bytes) override {
    Guard in_call(*this);
    return inner_->copy_out(dst, src, bytes);
  }
  bool shares_device_memory() const override { Guard in_call(*this);
    return inner_->shares_device_memory(); }
  KernelStatus allocate_shared(size_t bytes, kernels::SharedDeviceMemory* out) override {
    Guard in_call(*this);
    return inner_->allocate_shared(bytes, out);
  }
  void free_shared(const kernels::SharedDeviceMemory& memory) override { inner_->free_shared(memory); }
  bool is_device_memory(const void* p) const override { Guard in_call(*this);
    return inner_->is_device_memory(p); }
  KernelStatus write_kv(const PagedKV& kv, int seq, int start_pos, int num_tokens, int layer_begin, int num_layers,
                        const void* k, const void* v) override {
    Guard in_call(*this);
    return inner_->write_kv(kv, seq, start_pos, num_tokens, layer_begin, num_layers, k, v);
  }
  KernelStatus write_step_kv(const PagedKV& kv, int layer, const int32_t* positions, const void* k,
                             const void* v) override {
    Guard in_call(*this);
    return inner_->write_step_kv(kv, layer, positions, k, v);
  }
  KernelStatus decode_attention(const PagedKV& kv, int layer, const float* q, float* out, float scale) override {
    Guard in_call(*this);
    return inner_->decode_attention(kv, layer, q, out, scale);
  }
  KernelStatus causal_attention(const PagedKV& kv, int seq, int layer, int num_queries, const float* q, float* out,
                                float scale) override {
    Guard in_call(*this);
    return inner_->causal_attention(kv, seq, layer, num_queries, q, out, scale);
  }
  KernelStatus decode_attention_accumulate(const PagedKV& kv, int layer, const float* q, float* out, float scale,
                                           float* const* score_acc, const int32_t* acc_begin) override {
    Guard in_call(*this);
    return inner_->decode_attention_accumulate(kv, layer, q, out, scale, score_acc, acc_begin);
  }
  KernelStatus decode_attention_observe(const PagedKV& kv, int layer, const float* q, float* out, float scale,
                                        float* const* score_acc, const int32_t* acc_begin,
                                        float* const* lse) override {
    Guard in_call(*this);
    return inner_->decode_attention_observe(kv, layer, q, out, scale, score_acc, acc_begin, lse);
  }
  KernelStatus read_kv(const PagedKV& kv, int seq, void* k, void* v) override { Guard in_call(*this);
    return inner_->read_kv(kv, seq, k, v); }
  KernelStatus copy_block(const PagedKV& kv, int32_t src, int32_t dst) override {
    Guard in_call(*this);
    return inner_->copy_block(kv, src, dst);
  }
  KernelStatus window_scores(const PagedKV& kv, int seq, int layer, int slot_begin, int window, const float* q,
                             float scale, float* out) override {
    Guard in_call(*this);
    return inner_->window_scores(kv, seq, layer, slot_begin, window, q, scale, out);
  }
  KernelStatus window_scores_observed(const PagedKV& kv, int seq, int layer, int slot_begin, int window,
                                      const float* q, float scale, const float* lse, bool later_keys_only,
                                      float* out) override {
    Guard in_call(*this);
    return inner_->window_scores_observed(kv, seq, layer, slot_begin, window, q, scale, lse, later_keys_only, out);
  }
  KernelStatus snapkv_scores(const PagedKV& kv, int seq, int layer, int num_obs, const float* q, float scale,
                             int pool, float* out) override {
    Guard in_call(*this);
    return inner_->snapkv_scores(kv, seq, layer, num_obs, q, scale, pool, out);
  }
  KernelStatus top_k(const float* scores, int rows, int n, int k, int32_t* out) override {
    Guard in_call(*this);
    return inner_->top_k(scores, rows, n, k, out);
  }
  KernelStatus token2chunk(const float* scores, int rows, int n, int budget, int num_candidates, int max_gap,
                           int32_t* out) override {
    Guard in_call(*this);
    return inner_->token2chunk(scores, rows, n, budget, num_candidates, max_gap, out);
  }
  KernelStatus cam_merge_values(const PagedKV& kv, int seq, int begin, int end, const int32_t* kept, int num_kept,
                                const float* scores, int merge_tokens, const int32_t* dst_blocks) override {
    Guard in_call(*this);
    return inner_->cam_merge_values(kv, seq, begin, end, kept, num_kept, scores, merge_tokens, dst_blocks);
  }
  int quantized_tokens_per_block(const kernels::Geometry& g, kernels::QuantFormat format) const override {
    Guard in_call(*this);
    return inner_->quantized_tokens_per_block(g, format);
  }
  KernelStatus quantize_tokens(const PagedKV& kv, int seq, int slot_begin, const QuantizedKV& q,
                               int32_t dst) override {
    Guard in_call(*this);
    return inner_->quantize_tokens(kv, seq, slot_begin, q, dst);
  }
  KernelStatus dequantize_block(const PagedKV& kv, const QuantizedKV& q, int32_t block, void* k, void* v) override {
    Guard in_call(*this);
    return inner_->dequantize_block(kv, q, block, k, v);
  }
  KernelStatus decode_attention_quantized(const PagedKV& kv, const QuantizedKV& qkv, int layer, const float* q,
                                          float* out, float scale, float* const* score_acc, const int32_t* acc_begin,
                                          float* const* lse) override {
    Guard in_call(*this);
    return inner_->decode_attention_quantized(kv, qkv, layer, q, out, scale, score_acc, acc_begin, lse);
  }
  KernelStatus causal_attention_quantized(const PagedKV& kv, const QuantizedKV& qkv, int seq, int layer,
                                          int num_queries, const float* q, float* out, float scale) override {
    Guard in_call(*this);
    return inner_->causal_attention_quantized(kv, qkv, seq, layer, num_queries, q, out, scale);
  }
  KernelStatus gather_tokens_in_place(const PagedKV& kv, int seq, int begin, const int32_t* kept,
                                      int num_kept) override {
    Guard in_call(*this);
    return inner_->gather_tokens_in_place(kv, seq, begin, kept, num_kept);
  }
  KernelStatus gather_tokens(const PagedKV& kv, int seq, const int32_t* kept, int num_kept,
                             const int32_t* dst_blocks) override {
    Guard in_call(*this);
    return inner_->gather_tokens(kv, seq, kept, num_kept, dst_blocks);
  }
  void set_deferred(bool on) override { inner_->set_deferred(on); }
  KernelStatus synchronize() override { return inner_->synchronize(); }
  std::string fault() const override { return inner_->fault(); }
  KernelStatus create_shared_event(kernels::SharedEvent* out) override { return inner_->create_shared_event(out); }
  KernelStatus open_shared_event(const std::string& handle, kernels::SharedEvent* out) override {
    return inner_->open_shared_event(handle, out);
  }
  void destroy_shared_event(kernels::SharedEvent* event) override { inner_->destroy_shared_event(event); }
  KernelStatus wait_event(const kernels::SharedEvent& event) override { return inner_->wait_event(event); }
  KernelStatus record_event(const kernels::SharedEvent& event) override { return inner_->record_event(event); }

 protected:
  // Called around every call passed on, e.g. to let the inner backend at memory the test otherwise
  // keeps out of reach. Calls do not nest: the inner backend does not call back through here.
  virtual void enter() const {}
  virtual void leave() const {}
  std::unique_ptr<kernels::Backend> inner_;

 private:
  struct Guard {
    explicit Guard(const DelegatingBackend& b) : backend(b) { backend.enter(); }
    ~Guard() { backend.leave(); }
    const DelegatingBackend& backend;
  };
};

// A backend that cannot move tokens in place: compactions gather into fresh blocks.
class NoInPlaceBackend : public DelegatingBackend {
 public:
  explicit NoInPlaceBackend(std::unique_ptr<kernels::Backend> inner) : DelegatingBackend(std::move(inner)) {}
  bool supports(kernels::Op op, kernels::DType dtype) const override {
    return op != kernels::Op::kGatherTokensInPlace && DelegatingBackend::supports(op, dtype);
  }
};

}  // namespace karakv::testing
