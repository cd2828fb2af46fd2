// Attention served by karakvd through the SDK: the prompt's K/V (and queries) go in with one
// Append, each decode token's K/V/Q with one Step per layer, batched over sequences. K/V are
// converted to the daemon's storage dtype here; Q and the attention output stay fp32.
#pragma once

#include "karakv/client.h"
#include "llama/model.h"

namespace karakv::llama {

class DaemonAttention : public Attention {
 public:
  // `client` must outlive this object and serve the model's geometry (checked by check_geometry).
  DaemonAttention(Client& client, SequenceOptions options) : client_(client), options_(std::move(options)) {}

  // FAILED_PRECONDITION naming both geometries when the daemon was started for another model.
  static absl::Status check_geometry(const Client& client, const Config& config);

  absl::StatusOr<uint64_t> create_sequence() override;
  absl::Status prefill(uint64_t seq, int num_tokens, std::span<const float> k, std::span<const float> v,
                       std::span<const float> q) override;
  absl::Status step(int layer, std::span<const uint64_t> seqs, std::span<const float> k,
                    std::span<const float> v, std::span<const float> q, std::span<float> out) override;
  absl::Status release(uint64_t seq) override;

 private:
  // A buffer in staging when it fits, else on the heap (sent inline).
  Buffer buffer(size_t bytes);
  // fp32 -> storage dtype, n elements.
  void store(const float* src, size_t n, Buffer& dst) const;

  Client& client_;
  SequenceOptions options_;
};

}  // namespace karakv::llama
