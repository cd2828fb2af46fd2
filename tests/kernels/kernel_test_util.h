// Helpers shared by the kernel tests: storage encoding per dtype, backend-allocated buffers, and a
// paged cache whose sequences own shuffled, non-contiguous blocks.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "karakv/kernels/backend.h"
#include "karakv/kernels/half.h"

namespace karakv::kernels::test {

// Restores the environment variable kVar whatever the test does.
template <const char* kVar>
class EnvVarTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const char* v = getenv(kVar)) saved_ = v;
  }
  void TearDown() override {
    if (saved_) setenv(kVar, saved_->c_str(), 1);
    else unsetenv(kVar);
  }
  std::optional<std::string> saved_;
};

// Threads of this process named `name` (/proc/self/task/*/comm): the kernels' pool helpers are
// karakv-kernels, the fast path's ring threads karakv-ring. Counted by name, so the runtime's own
// threads (TSan's, an OpenMP runtime's in the clang tree) do not count.
inline int threads_named(const std::string& name) {
  int n = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) ++n;
  }
  return n;
}

inline const char* name_of(DType t) {
  return t == DType::kFloat32 ? "fp32" : t == DType::kFloat16 ? "fp16" : "bf16";
}

// Storage bytes for `values` in dtype `t` (rounded to nearest even for 16-bit types).
inline std::vector<uint8_t> encode(DType t, const std::vector<float>& values) {
  std::vector<uint8_t> out(values.size() * dtype_size(t));
  for (size_t i = 0; i < values.size(); ++i) {
    if (t == DType::kFloat32) {
      std::memcpy(out.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t h = t == DType::kFloat16 ? float_to_half(values[i]) : float_to_bf16(values[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

// Element i of storage `data` in dtype `t`, widened exactly.
inline float decode_at(DType t, const void* data, size_t i) {
  const auto* p = static_cast<const uint8_t*>(data);
  if (t == DType::kFloat32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return t == DType::kFloat16 ? half_to_float(h) : bf16_to_float(h);
}

inline std::vector<float> random_values(size_t n, float lo, float hi, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Memory from Backend::allocate, freed on destruction, filled and read through the backend's
// copy_in / copy_out: every tensor a kernel sees lives in the memory of the backend under test.
class BackendBuffer {
 public:
  BackendBuffer(Backend& backend, size_t bytes) : backend_(&backend) {
    const KernelStatus st = backend.allocate(std::max<size_t>(bytes, 1), &ptr_);
    if (!st.is_ok()) ADD_FAILURE() << "allocate(" << bytes << "): " << st.message;
    bytes_ = bytes;
  }
  BackendBuffer(const BackendBuffer&) = delete;
  BackendBuffer& operator=(const BackendBuffer&) = delete;
  ~BackendBuffer() {
    if (ptr_ != nullptr) backend_->free(ptr_);
  }
  template <typename T = void>
  T* get() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }
  // (memcpy of zero bytes still needs valid pointers; an empty vector's data() may be null.)
  void upload(const void* src, size_t bytes) {
    const KernelStatus st = backend_->copy_in(ptr_, src, bytes);
    if (!st.is_ok()) ADD_FAILURE() << "copy_in(" << bytes << "): " << st.message;
  }
  template <typename T>
  void upload(const std::vector<T>& v) { upload(v.data(), v.size() * sizeof(T)); }
  template <typename T>
  std::vector<T> download(size_t count) const {
    std::vector<T> v(count);
    const KernelStatus st = backend_->copy_out(v.data(), ptr_, count * sizeof(T));
    if (!st.is_ok()) ADD_FAILURE() << "copy_out(" << count * sizeof(T) << "): " << st.message;
    return v;
  }

 private:
  Backend* backend_;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A pool plus block tables for sequences of the given capacities (tokens). Block ids are a random
// permutation of the pool, so consecutive blocks of a sequence are never adjacent by accident;
// `spare_blocks` unused blocks are mixed in.
class PagedCache {
 public:
  PagedCache(Backend& backend, const Geometry& geo, const std::vector<int>& capacities,
             std::mt19937& rng, int spare_blocks = 3)
      : geo_(geo) {
    int total = spare_blocks;
    for (int c : capacities) total += (c + geo.block_size - 1) / geo.block_size;
    num_blocks_ = total;
    std::vector<int32_t> ids(total);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    table_offset_.push_back(0);
    size_t next = 0;
    for (int c : capacities) {
      const int blocks = (c + geo.block_size - 1) / geo.block_size;
      for (int b = 0; b < blocks; ++b) block_table_.push_back(ids[next++]);
      table_offset_.push_back(int32_t(block_table_.size()));
    }
    seq_len_.assign(capacities.size(), 0);
    pool_ = std::make_unique<BackendBuffer>(backend, size_t(total) * geo.block_bytes());
  }

  void set_seq_len(int seq, int len) { seq_len_[seq] = len; }
  // The pool in backend memory; the tables in host memory, as backend.h specifies.
  PagedKV view() const {
    PagedKV kv;
    kv.pool = pool_->get();
    kv.geometry = geo_;
    kv.block_table = block_table_.data();
    kv.table_offset = table_offset_.data();
    kv.seq_len = seq_len_.data();
    kv.num_seqs = int(seq_len_.size());
    return kv;
  }
  const Geometry& geometry() const { return geo_; }
  int num_blocks() const { return num_blocks_; }
  const std::vector<int32_t>& block_table() const { return block_table_; }
  const std::vector<int32_t>& table_offset() const { return table_offset_; }
  int seq_len(int seq) const { return seq_len_[seq]; }
  std::vector<uint8_t> pool_bytes() const { return pool_->download<uint8_t>(pool_->bytes()); }

 private:
  Geometry geo_;
  int num_blocks_ = 0;
  std::vector<int32_t> block_table_, table_offset_, seq_len_;
  std::unique_ptr<BackendBuffer> pool_;
};

// One sequence's K and V as dense arrays [num_layers][len][num_kv_heads][head_dim]: storage bytes
// and the exact values they decode to, so references and kernels see identical inputs.
struct DenseKV {
  int len = 0;
  std::vector<uint8_t> k_bytes, v_bytes;
  std::vector<float> k, v;

  size_t index(const Geometry& g, int layer, int token, int head, int d) const {
    return ((size_t(layer) * len + token) * g.num_kv_heads + head) * g.head_dim + d;
  }
};

// K and V given as [layers][len][kv heads][head_dim] floats, rounded to the geometry's dtype.
inline DenseKV dense_kv(const Geometry& g, int len, const std::vector<float>& k, const std::vector<float>& v) {
  DenseKV kv;
  kv.len = len;
  const size_t n = size_t(g.num_layers) * len * g.kv_token_elems();
  kv.k_bytes = encode(g.dtype, k);
  kv.v_bytes = encode(g.dtype, v);
  kv.k.resize(n);
  kv.v.resize(n);
  for (size_t i = 0; i < n; ++i) {
    kv.k[i] = decode_at(g.dtype, kv.k_bytes.data(), i);
    kv.v[i] = decode_at(g.dtype, kv.v_bytes.data(), i);
  }
  return kv;
}

inline DenseKV random_dense_kv(const Geometry& g, int len, std::mt19937& rng) {
  const size_t n = size_t(g.num_layers) * len * g.kv_token_elems();
  std::vector<float> k = random_values(n, -1.0f, 1.0f, rng);
  return dense_kv(g, len, k, random_values(n, -1.0f, 1.0f, rng));
}

// Writes `dense` into sequence `seq` the way a server does: a prefill chunk, then smaller appends,
// with the layers split over two calls, then sets seq_len. Chunk boundaries fall inside blocks.
inline void write_sequence(Backend& backend, PagedCache& cache, int seq, const DenseKV& dense) {
  const Geometry& g = cache.geometry();
  const size_t esize = dtype_size(g.dtype);
  const size_t token_bytes = g.kv_token_elems() * esize;
  const int layer_split = g.num_layers / 2;
  int pos = 0;
  while (pos < dense.len) {
    const int chunk = pos == 0 ? std::min(dense.len, 2 * g.block_size + 3) : std::min(dense.len - pos, 7);
    for (auto [lb, nl] : {std::pair{0, layer_split}, std::pair{layer_split, g.num_layers - layer_split}}) {
      if (nl == 0) continue;
      const size_t bytes = size_t(nl) * chunk * token_bytes;
      std::vector<uint8_t> hk(bytes), hv(bytes);
      for (int l = 0; l < nl; ++l) {
        const size_t src = (size_t(lb + l) * dense.len + pos) * token_bytes;
        const size_t dst = size_t(l) * chunk * token_bytes;
        std::memcpy(hk.data() + dst, dense.k_bytes.data() + src, chunk * token_bytes);
        std::memcpy(hv.data() + dst, dense.v_bytes.data() + src, chunk * token_bytes);
      }
      BackendBuffer k(backend, bytes), v(backend, bytes);
      k.upload(hk);
      v.upload(hv);
      const KernelStatus st = backend.write_kv(cache.view(), seq, pos, chunk, lb, nl, k.get(), v.get());
      ASSERT_TRUE(st.is_ok()) << st.message;
    }
    pos += chunk;
  }
  cache.set_seq_len(seq, dense.len);
}

}  // namespace karakv::kernels::test
