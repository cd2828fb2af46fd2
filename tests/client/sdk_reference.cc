// Runs one deterministic workload through the C++ SDK and dumps every output, so the Python SDK's
// test (client/python/tests/test_against_cpp.py) can run the same workload and compare bytes.
//   sdk_reference TARGET INPUTS OUTPUTS PROMPT STEPS W_OBS
// INPUTS holds the input tensors back to back, in the order read below; OUTPUTS gets the outputs
// in the order written below. The Python test writes the inputs and mirrors this order exactly.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "karakv/client.h"

namespace {

[[noreturn]] void die(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "sdk_reference: %s: %s\n", what.c_str(), std::string(s.ToString()).c_str());
  std::exit(1);
}

template <typename T>
T check(absl::StatusOr<T> r, const char* what) {
  if (!r.ok()) die(what, r.status());
  return *std::move(r);
}

class Inputs {
 public:
  explicit Inputs(const char* path) : in_(path, std::ios::binary) {
    if (!in_) die(path, absl::NotFoundError("cannot read inputs"));
  }
  // Reads the next `b.size()` bytes into the buffer.
  void next(const karakv::Buffer& b) {
    if (!in_.read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(b.size()))) {
      die("inputs", absl::OutOfRangeError("input file ended early"));
    }
  }

 private:
  std::ifstream in_;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: sdk_reference TARGET INPUTS OUTPUTS PROMPT STEPS W_OBS\n");
    return 2;
  }
  const int prompt = std::atoi(argv[4]), steps = std::atoi(argv[5]), w_obs = std::atoi(argv[6]);
  karakv::ClientOptions o;
  o.target = argv[1];
  o.staging_bytes = 16 << 20;
  o.rpc_timeout = absl::Seconds(20);
  auto client = check(karakv::Client::Attach(o), "Attach");
  karakv::Client& c = *client;
  const karakv::Geometry& g = c.geometry();
  Inputs in(argv[2]);
  std::ofstream out(argv[3], std::ios::binary);
  auto put = [&](const void* p, size_t n) { out.write(static_cast<const char*>(p), static_cast<std::streamsize>(n)); };
  auto put_i32 = [&](int32_t v) { put(&v, 4); };
  auto buf = [&](size_t n) { return check(c.alloc(n), "alloc"); };

  // Sequences: plain, Kara (small window so it compresses within the run), and a SnapKV prefill.
  const uint64_t plain = check(c.CreateSequence("none"), "CreateSequence none");
  karakv::SequenceOptions kara;
  kara.policy = "kara";
  kara.params = {{"window", 16}, {"rho", 0.25}, {"period", 2}, {"sinks", 2}, {"recent", 0}, {"budget", 0}};
  const uint64_t karaseq = check(c.CreateSequence(kara), "CreateSequence kara");
  karakv::SequenceOptions snap;
  snap.prefill_policy = "snapkv";
  snap.prefill_params = {{"c_max", 32}, {"c_target", 16}, {"w_obs", double(w_obs)}, {"sinks", 2}};
  const uint64_t snapseq = check(c.CreateSequence(snap), "CreateSequence snapkv prefill");

  // Prompts, one per sequence; the SnapKV one with the queries of its last w_obs tokens.
  std::vector<std::pair<karakv::Buffer, karakv::Buffer>> prompts;
  for (int s = 0; s < 3; ++s) {
    karakv::Buffer k = buf(c.append_bytes(prompt)), v = buf(c.append_bytes(prompt));
    in.next(k);
    in.next(v);
    prompts.emplace_back(k, v);
  }
  karakv::Buffer q_obs = buf(size_t(g.num_layers) * c.q_bytes(w_obs));
  in.next(q_obs);
  put_i32(check(c.Append(plain, prompt, prompts[0].first, prompts[0].second), "Append plain"));
  put_i32(check(c.Append(karaseq, prompt, prompts[1].first, prompts[1].second), "Append kara"));
  put_i32(check(c.Append(snapseq, prompt, prompts[2].first, prompts[2].second, q_obs, w_obs), "Append snapkv"));
  const uint64_t forked = check(c.Fork(plain), "Fork");

  // Decode: every step, every layer, the whole batch.
  const uint64_t batch[] = {plain, karaseq, snapseq, forked};
  const int b = 4;
  karakv::Buffer k = buf(c.step_kv_bytes(b)), v = buf(c.step_kv_bytes(b)), q = buf(c.q_bytes(b));
  karakv::Buffer o_step = buf(c.q_bytes(b));
  for (int t = 0; t < steps; ++t) {
    for (int l = 0; l < g.num_layers; ++l) {
      in.next(k);
      in.next(v);
      in.next(q);
      check(c.Step(l, batch, k, v, q, o_step), "Step");
      put(o_step.data(), o_step.size());
    }
  }

  // Attend over the plain sequence (layer last) and its fork (layer 0).
  for (auto [seq, layer, n] : {std::tuple{plain, g.num_layers - 1, 4}, std::tuple{forked, 0, 3}}) {
    karakv::Buffer aq = buf(c.q_bytes(n)), ao = buf(c.q_bytes(n));
    in.next(aq);
    if (auto s = c.Attend(seq, layer, n, aq, ao); !s.ok()) die("Attend", s);
    put(ao.data(), ao.size());
  }

  // The resident caches.
  c.reset_staging();
  const size_t cap = size_t(prompt + steps);
  karakv::Buffer rk = buf(c.append_bytes(int(cap))), rv = buf(c.append_bytes(int(cap)));
  karakv::Buffer rp = buf(size_t(g.num_layers) * g.num_kv_heads * cap * 4);
  for (uint64_t seq : {plain, karaseq, snapseq, forked}) {
    const int n = check(c.ReadKV(seq, rk, rv, rp), "ReadKV");
    put_i32(n);
    put(rk.data(), c.append_bytes(n));
    put(rv.data(), c.append_bytes(n));
    put(rp.data(), size_t(g.num_layers) * g.num_kv_heads * n * 4);
  }

  for (uint64_t seq : {forked, plain, karaseq, snapseq}) put_i32(check(c.Release(seq), "Release"));
  if (!out) die(argv[3], absl::InternalError("write failed"));
  return 0;
}
