// Drives a Core with the synthetic K/V/Q of common/synthetic.h, as a model worker would:
// the server tests that need "append n tokens" or "step these sequences through every layer"
// without caring about the tensors' values.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
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

}  // namespace karakv::server::testing
