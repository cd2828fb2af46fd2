// karakv-bench's pieces that several modes share: the result row, the per-mode reports, the
// SmolLM2-135M geometry and decode through karakvd under compression policies; and the modes.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/synthetic.h"
#include "harness.h"
#include "karakv/client.h"
#include "karakv/kernels/backend.h"

namespace karakv::bench {

namespace kn = karakv::kernels;
using karakv::synthetic::Tensor;

// ---------------------------------------------------------------------------------------------
// Results.

struct Target {
  enum class Kind { kAtLeast, kAtMost } kind;
  double ratio;
};

struct Row {
  std::string mode;
  std::string metric;
  double karakv = 0;
  std::string baseline_name;
  double baseline = 0;
  std::string unit;
  bool percent = false;  // print the ratio as a percentage
  std::optional<Target> target;

  double ratio() const { return baseline > 0 ? karakv / baseline : 0; }
  std::string ratio_text() const {
    return percent ? absl::StrFormat("%.1f%%", 100 * ratio()) : absl::StrFormat("%.2fx", ratio());
  }
  std::string target_text() const {
    if (!target) return "-";
    const char* op = target->kind == Target::Kind::kAtLeast ? ">=" : "<=";
    return percent ? absl::StrFormat("%s %.0f%%", op, 100 * target->ratio) : absl::StrFormat("%s %gx", op, target->ratio);
  }
  std::string verdict() const {
    if (!target) return "info";
    const bool ok = target->kind == Target::Kind::kAtLeast ? ratio() >= target->ratio : ratio() <= target->ratio;
    return ok ? "PASS" : "MISS";
  }
};

// One karakv measurement and the baseline measured right next to it.
struct Pair {
  double karakv = 0, baseline = 0;
  double ratio() const { return baseline > 0 ? karakv / baseline : 0; }
};

// Per-mode text (tables) printed after the summary table.
std::vector<std::string>& extra_reports();

// A comma-separated list of integers ("1024,4096"); empty entries are skipped, values below 1 become 1.
std::vector<int> parse_lengths(const std::string& s);

// ---------------------------------------------------------------------------------------------
// The SmolLM2-135M geometry, and decode workloads through karakvd with compression policies
// (P5, memory, quant; prefix uses the geometry).

kn::Geometry smollm_geometry();

// karakvd's geometry flags for smollm_geometry(), with this pool (and another block size, where a
// mode measures one).
std::vector<std::string> smollm_flags(size_t pool_bytes, int block_size = 16);
// smollm_geometry() with `block_size` tokens per block, the value of the mode's flag `flag`
// (e.g. "--p2_block_size"); refused outside 1..1024, naming the flag.
absl::StatusOr<kn::Geometry> smollm_geometry_with_block(std::string_view flag, int block_size);

// Bytes of K (or V) that Append of `tokens` tokens carries; the daemon's geometry equals `g`.
size_t append_tensor_bytes(const kn::Geometry& g, int tokens);

// CPU seconds (user + system) the process has used so far, from /proc/PID/stat; -1 if unreadable.
double cpu_seconds(pid_t pid);

// K/V/Q of one decode step for every layer and sequence, generated once and copied into each
// client's staging buffers, so every policy decodes exactly the same tokens.
struct StepTensors {
  const kn::Geometry g;
  const int seqs;
  std::vector<uint8_t> k, v;  // [L][B][Hk][D] storage dtype
  std::vector<float> q;       // [L][B][Hq][D]
  StepTensors(const kn::Geometry& geometry, int batch)
      : g(geometry),
        seqs(batch),
        k(size_t(g.num_layers) * batch * g.kv_token_elems() * kn::dtype_size(g.dtype)),
        v(k.size()),
        q(size_t(g.num_layers) * batch * g.q_token_elems()) {}
  size_t kv_layer_bytes() const { return size_t(seqs) * g.kv_token_elems() * kn::dtype_size(g.dtype); }
  size_t q_layer_elems() const { return size_t(seqs) * g.q_token_elems(); }
  // Sequence s (0-based index, also its synthetic id) gets position `pos`'s token.
  void fill(int64_t pos) {
    const size_t kv_tok = g.kv_token_elems() * kn::dtype_size(g.dtype);
    for (int l = 0; l < g.num_layers; ++l) {
      for (int s = 0; s < seqs; ++s) {
        const size_t i = size_t(l) * seqs + s;
        karakv::synthetic::fill_token(k.data() + i * kv_tok, g, 1, Tensor::kKey, s, l, pos);
        karakv::synthetic::fill_token(v.data() + i * kv_tok, g, 1, Tensor::kValue, s, l, pos);
        karakv::synthetic::fill_query(q.data() + i * g.q_token_elems(), g, 1, s, l, pos);
      }
    }
  }
};

// One client's sequences (prefilled with the same synthetic prompt per index) and its Step buffers.
struct DecodeSet {
  std::string label;
  karakv::Client* c = nullptr;
  std::vector<uint64_t> ids;
  karakv::Buffer sk, sv, q, out;
  std::vector<double> step_s;  // wall time of the Step calls of each decode step
  double decode_s = 0;

  // One decode step: Step for every layer, timing only the calls.
  absl::Status step(const StepTensors& t) {
    double el = 0;
    for (int l = 0; l < t.g.num_layers; ++l) {
      std::memcpy(sk.data(), t.k.data() + l * t.kv_layer_bytes(), t.kv_layer_bytes());
      std::memcpy(sv.data(), t.v.data() + l * t.kv_layer_bytes(), t.kv_layer_bytes());
      std::memcpy(q.data(), t.q.data() + l * t.q_layer_elems(), t.q_layer_elems() * sizeof(float));
      const auto start = Clock::now();
      auto r = c->Step(l, ids, sk, sv, q, out);
      el += seconds_since(start);
      if (!r.ok()) return absl::Status(r.status().code(), absl::StrCat(label, ": ", r.status().message()));
    }
    step_s.push_back(el);
    decode_s += el;
    return absl::OkStatus();
  }
};

// Staging for prompts of `prompt` tokens (appended in chunks of up to 256) and Steps of `batch`.
uint64_t decode_staging_bytes(const kn::Geometry& g, int prompt, int batch);

// Creates one sequence per entry of `policies` in client `c`, appends the synthetic prompt of
// index i (in chunks of up to 256 tokens) and allocates the Step buffers.
// `params`: policy parameters given to every sequence created (empty: the policy's defaults).
absl::Status prefill(DecodeSet& set, const kn::Geometry& g, const std::vector<std::string>& policies, int prompt,
                     const std::map<std::string, double>& params = {});

// Pool for `seqs` uncompressed sequences of `tokens` tokens each, plus slack for compaction.
size_t decode_pool_bytes(const kn::Geometry& g, int seqs, int tokens);

// ---------------------------------------------------------------------------------------------
// The modes, one file each. run_<mode> measures and returns the mode's rows (and may add to
// extra_reports()); <mode>_how is its line in the header above the table: the exact workload.

absl::StatusOr<std::vector<Row>> run_p1(const TempDir& dir);      // p1_append.cc
absl::StatusOr<std::vector<Row>> run_p2(const TempDir& dir);      // p2_decode.cc
absl::StatusOr<std::vector<Row>> run_p3(const TempDir& dir);      // p3_step.cc
absl::StatusOr<std::vector<Row>> run_p5(const TempDir& dir);      // p5_compaction.cc
absl::StatusOr<std::vector<Row>> run_memory(const TempDir& dir);  // memory.cc
absl::StatusOr<std::vector<Row>> run_quant(const TempDir& dir);   // quant.cc
absl::StatusOr<std::vector<Row>> run_prefix(const TempDir& dir);  // prefix.cc
absl::StatusOr<std::vector<Row>> run_ring(const TempDir& dir);    // ring.cc
absl::StatusOr<std::vector<Row>> run_cluster(const TempDir& dir); // cluster.cc
absl::StatusOr<std::vector<Row>> run_shared(const TempDir& dir);  // shared.cc
std::string p1_how();
std::string p2_how();
std::string p3_how();
std::string p5_how();
std::string memory_how();
std::string quant_how();
std::string prefix_how();
std::string shared_how();
std::string ring_how();
std::string cluster_how();

// One request as prefix.cc times it (prefix.cc): start the sequence from the cached prefix, Append
// the K/V of the tokens left (with their ids), Attend their queries on every layer, one decode Step
// on every layer, Release. Its time to first token, tokens prefilled and tokens cached.
struct PrefixRequestResult {
  double ttft_s = 0;
  int prefilled = 0, cached = 0;
};
absl::StatusOr<PrefixRequestResult> prefix_request(karakv::Client& c, const kn::Geometry& g,
                                                   const std::vector<int32_t>& prompt);
// Token ids of request `request`: a shared system prompt (ids 1..), then tokens of its own.
std::vector<int32_t> prefix_prompt(int system_tokens, int own_tokens, int request);
// The Append tensors ([L][T][Hk][D]) of prompt tokens [first, end): K/V of a token depend on its id
// and position, as a model's would.
void fill_prompt_kv(const kn::Geometry& g, const std::vector<int32_t>& prompt, int first, uint8_t* k, uint8_t* v);

}  // namespace karakv::bench
