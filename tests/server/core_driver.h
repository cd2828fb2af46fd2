// Drives a Core with the synthetic K/V/Q of common/synthetic.h, as a model worker would:
// the server tests that need "append n tokens" or "step these sequences through every layer"
// without caring about the tensors' values.
#pragma once

#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gtest/gtest.h"
#include "common/synthetic.h"
#include "server/core.h"

namespace karakv::server::testing {

// Appends n prompt tokens of `seq` at positions pos0.. (token ids `ids`, if any, for the prefix
// cache); returns what Core::append returns.
inline absl::StatusOr<int32_t> append_synthetic(Core& reg, uint64_t seed, const std::string& session,
                                                uint64_t seq, int n, int64_t pos0 = 0,
                                                absl::Span<const int32_t> ids = {}) {
  std::vector<uint8_t> k(reg.append_bytes(n)), v(k.size());
  synthetic::fill_prompt(k.data(), reg.geometry(), seed, synthetic::Tensor::kKey, seq, pos0, n);
  synthetic::fill_prompt(v.data(), reg.geometry(), seed, synthetic::Tensor::kValue, seq, pos0, n);
  return reg.append(session, seq, n, k, v, {}, 0, ids);
}

// One decode step at position `pos` for each of `ids`, layer by layer; the first refusal ends it.
inline absl::Status step_synthetic(Core& reg, uint64_t seed, const std::string& session,
                                   const std::vector<uint64_t>& ids, int64_t pos) {
  const auto& g = reg.geometry();
  const size_t kvb = g.kv_token_elems() * kernels::dtype_size(g.dtype);
  for (int l = 0; l < g.num_layers; ++l) {
    std::vector<uint8_t> k(kvb * ids.size()), v(k.size());
    std::vector<float> q(g.q_token_elems() * ids.size()), out(q.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      synthetic::fill_token(k.data() + i * kvb, g, seed, synthetic::Tensor::kKey, ids[i], l, pos);
      synthetic::fill_token(v.data() + i * kvb, g, seed, synthetic::Tensor::kValue, ids[i], l, pos);
      synthetic::fill_query(q.data() + i * g.q_token_elems(), g, seed, ids[i], l, pos);
    }
    auto r = reg.step(session, l, ids, k, v, ConstBytes(reinterpret_cast<const uint8_t*>(q.data()), q.size() * 4),
                      MutableBytes(reinterpret_cast<uint8_t*>(out.data()), out.size() * 4), 0.0f);
    if (!r.ok()) return r.status();
  }
  return absl::OkStatus();
}

// Reads a sequence back (ReadKV): V returned, K in *keys, both in Append's layout
// [layer][token][KV head][dim].
inline std::vector<uint8_t> read_values(Core& reg, const std::string& session, uint64_t seq,
                                        std::vector<uint8_t>* keys) {
  std::vector<uint8_t> k, v, p;
  auto r = reg.read_kv(session, seq, [&](int32_t t) -> absl::StatusOr<ReadKVTargets> {
    k.resize(reg.append_bytes(t));
    v.resize(k.size());
    p.resize(size_t(reg.geometry().num_layers) * reg.geometry().num_kv_heads * t * 4);
    return ReadKVTargets{MutableBytes(k), MutableBytes(v), MutableBytes(p)};
  });
  if (!r.ok()) ADD_FAILURE() << r.status();
  *keys = k;
  return v;
}

// How many K and V elements of a sequence of synthetic tokens (seed `seed`) differ from the
// synthetic value of the position the sequence reports for its slot, per (layer, KV head) row:
// 0 when every slot holds its own token. Any storage type (values compared as stored).
inline int kv_mismatches(Core& reg, const std::string& session, uint64_t seed, uint64_t seq) {
  const kernels::Geometry& g = reg.geometry();
  const auto inspected = reg.inspect(seq);
  if (!inspected.ok()) {
    ADD_FAILURE() << inspected.status();
    return -1;
  }
  const std::vector<std::vector<int32_t>>& pos = inspected->second;
  std::vector<uint8_t> keys;
  const std::vector<uint8_t> values = read_values(reg, session, seq, &keys);
  const size_t n = pos[0].size(), esize = kernels::dtype_size(g.dtype);
  if (keys.size() != size_t(g.num_layers) * n * g.kv_token_elems() * esize) {
    ADD_FAILURE() << "ReadKV returned " << keys.size() << " bytes of K for " << n << " tokens";
    return -1;
  }
  std::vector<uint8_t> want(esize);
  int mismatches = 0;
  for (int l = 0; l < g.num_layers; ++l) {
    for (size_t slot = 0; slot < n; ++slot) {
      for (int h = 0; h < g.num_kv_heads; ++h) {
        const int64_t p = pos[size_t(l) * g.num_kv_heads + h][slot];
        for (int dim = 0; dim < g.head_dim; ++dim) {
          const size_t i = ((size_t(l) * n + slot) * g.num_kv_heads + h) * g.head_dim + dim;
          for (auto [t, got] : {std::pair<synthetic::Tensor, const std::vector<uint8_t>*>{synthetic::Tensor::kKey, &keys},
                                std::pair<synthetic::Tensor, const std::vector<uint8_t>*>{synthetic::Tensor::kValue, &values}}) {
            synthetic::store(want.data(), 0, synthetic::value(seed, t, seq, l, p, h, dim), g.dtype);
            mismatches += std::memcmp(got->data() + i * esize, want.data(), esize) != 0;
          }
        }
      }
    }
  }
  return mismatches;
}

}  // namespace karakv::server::testing
