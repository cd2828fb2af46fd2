#include "llama/daemon_attention.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "karakv/kernels/half.h"

namespace karakv::llama {

absl::Status DaemonAttention::check_geometry(const Client& client, const Config& c) {
  const Geometry& g = client.geometry();
  if (g.num_layers != c.n_layers || g.num_q_heads != c.n_heads || g.num_kv_heads != c.n_kv_heads ||
      g.head_dim != c.head_dim()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "karakvd serves layers=", g.num_layers, " q_heads=", g.num_q_heads, " kv_heads=", g.num_kv_heads,
        " head_dim=", g.head_dim, " but the model needs --layers=", c.n_layers, " --q_heads=", c.n_heads,
        " --kv_heads=", c.n_kv_heads, " --head_dim=", c.head_dim()));
  }
  return absl::OkStatus();
}

Buffer DaemonAttention::buffer(size_t bytes) {
  if (auto b = client_.alloc(bytes); b.ok()) return *b;
  return Client::alloc_heap(bytes);
}

void DaemonAttention::store(const float* src, size_t n, Buffer& dst) const {
  switch (client_.geometry().dtype) {
    case DType::kFloat32: std::memcpy(dst.data(), src, n * 4); break;
    case DType::kFloat16: {
      auto* d = reinterpret_cast<uint16_t*>(dst.data());
      for (size_t i = 0; i < n; ++i) d[i] = kernels::float_to_half(src[i]);
      break;
    }
    case DType::kBFloat16: {
      auto* d = reinterpret_cast<uint16_t*>(dst.data());
      for (size_t i = 0; i < n; ++i) d[i] = kernels::float_to_bf16(src[i]);
      break;
    }
  }
}

absl::StatusOr<uint64_t> DaemonAttention::create_sequence() { return client_.CreateSequence(options_); }

absl::Status DaemonAttention::prefill(uint64_t seq, int num_tokens, std::span<const float> k,
                                      std::span<const float> v, std::span<const float> q) {
  // All prompt queries travel along: the daemon keeps only what the sequence's policies score with
  // (a snapkv prefill needs the newest w_obs, Kara none of the prompt's).
  client_.reset_staging();
  Buffer kb = buffer(client_.append_bytes(num_tokens)), vb = buffer(client_.append_bytes(num_tokens));
  Buffer qb = buffer(q.size() * 4);
  store(k.data(), k.size(), kb);
  store(v.data(), v.size(), vb);
  std::memcpy(qb.data(), q.data(), q.size() * 4);
  auto len = client_.Append(seq, num_tokens, kb, vb, qb, num_tokens);
  return len.status();
}

absl::Status DaemonAttention::step(int layer, std::span<const uint64_t> seqs, std::span<const float> k,
                                   std::span<const float> v, std::span<const float> q, std::span<float> out) {
  const int B = int(seqs.size());
  client_.reset_staging();
  Buffer kb = buffer(client_.step_kv_bytes(B)), vb = buffer(client_.step_kv_bytes(B));
  Buffer qb = buffer(client_.q_bytes(B)), ob = buffer(client_.q_bytes(B));
  store(k.data(), k.size(), kb);
  store(v.data(), v.size(), vb);
  std::memcpy(qb.data(), q.data(), q.size() * 4);
  auto r = client_.Step(layer, seqs, kb, vb, qb, ob);
  if (!r.ok()) return r.status();
  std::memcpy(out.data(), ob.data(), out.size() * 4);
  return absl::OkStatus();
}

absl::Status DaemonAttention::release(uint64_t seq) { return client_.Release(seq).status(); }

}  // namespace karakv::llama
