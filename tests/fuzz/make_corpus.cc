// Writes the seed corpora of the fuzz harnesses: small, valid programs that reach every handler
// (inline and staging-borne tensors, every policy, the prefix cache, a second tenant, lease
// expiry) and every ring command, so fuzzing starts from requests that get past validation.
//   fuzz_make_corpus <dir>   writes <dir>/service_fuzzer/seed-* and <dir>/ring_fuzzer/seed-*
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fuzz_input.h"
#include "karakv/v1/karakv.pb.h"
#include "karakv/v1/ring.h"

namespace karakv::fuzz {
namespace {

namespace v1 = ::karakv::v1;

// fuzz_geometry(): 2 layers, 4 query heads, 2 KV heads, head_dim 8.
constexpr int kLayers = 2, kQHeads = 4, kKvHeads = 2, kDim = 8;

std::string floats(size_t count, float seed) {
  std::vector<float> f(count);
  for (size_t i = 0; i < count; ++i) f[i] = seed + float(int(i % 13) - 6) / 16.0f;
  return std::string(reinterpret_cast<const char*>(f.data()), count * 4);
}

class Program {
 public:
  explicit Program(uint8_t options) { w_.u8(options); }
  Program& call(ServiceOp op, const google::protobuf::Message& m, uint8_t session = 0) {
    return raw(op, m.SerializeAsString(), session);
  }
  Program& raw(ServiceOp op, const std::string& body, uint8_t session = 0) {
    w_.u8(op).u8(session).u16(uint16_t(body.size())).raw(body.data(), body.size());
    return *this;
  }
  const std::string& str() const { return w_.str(); }

 private:
  Writer w_;
};

void set_range(v1::StagingRange* r, uint64_t offset, uint64_t length) {
  r->set_offset(offset);
  r->set_length(length);
}

v1::CreateSequenceRequest create(const std::string& policy = "", const std::string& storage = "") {
  v1::CreateSequenceRequest c;
  c.set_policy(policy);
  c.set_storage(storage);
  return c;
}

// Appends T tokens inline (dtype_bytes per element), with queries of the last nq tokens.
v1::AppendRequest append_inline(uint64_t seq, int tokens, int dtype_bytes, int nq = 0, bool ids = false) {
  v1::AppendRequest a;
  a.set_sequence_id(seq);
  a.set_num_tokens(tokens);
  const size_t kv = size_t(kLayers) * tokens * kKvHeads * kDim * dtype_bytes;
  a.mutable_k()->set_data(floats(kv / 4, 0.1f).substr(0, kv));
  a.mutable_v()->set_data(floats(kv / 4, -0.2f).substr(0, kv));
  if (nq > 0) {
    a.set_num_query_tokens(nq);
    a.mutable_q()->set_data(floats(size_t(kLayers) * nq * kQHeads * kDim, 0.3f));
  }
  if (ids) {
    for (int i = 0; i < tokens; ++i) a.add_token_ids(100 + i);
  }
  return a;
}

v1::StepRequest step_inline(std::vector<uint64_t> seqs, int layer, int dtype_bytes) {
  v1::StepRequest s;
  s.set_layer(layer);
  for (uint64_t id : seqs) s.add_sequence_ids(id);
  const size_t kv = seqs.size() * kKvHeads * kDim * dtype_bytes;
  s.mutable_k()->set_data(std::string(kv, '\x11'));
  s.mutable_v()->set_data(std::string(kv, '\x22'));
  s.mutable_q()->set_data(floats(seqs.size() * kQHeads * kDim, 0.5f));
  return s;
}

v1::AttendRequest attend_inline(uint64_t seq, int layer, int nq) {
  v1::AttendRequest a;
  a.set_sequence_id(seq);
  a.set_layer(layer);
  a.set_num_queries(nq);
  a.mutable_q()->set_data(floats(size_t(nq) * kQHeads * kDim, 0.25f));
  return a;
}

template <typename M>
M with_seq(uint64_t id) {
  M m;
  m.set_sequence_id(id);
  return m;
}

// One full decode of sequence `seq` (both layers), then reads.
void decode_and_read(Program& p, uint64_t seq, int dtype_bytes) {
  p.call(kStep, step_inline({seq}, 0, dtype_bytes)).call(kStep, step_inline({seq}, 1, dtype_bytes));
  p.call(kAttend, attend_inline(seq, 0, 2)).call(kReadKV, with_seq<v1::ReadKVRequest>(seq));
  p.call(kInspect, with_seq<v1::InspectRequest>(seq));
}

std::vector<std::pair<std::string, std::string>> service_seeds() {
  std::vector<std::pair<std::string, std::string>> out;
  {
    Program p(0);
    v1::StatsRequest st;
    st.set_check_invariants(true);
    v1::LookupRequest lk;
    for (int i = 0; i < 8; ++i) lk.add_token_ids(100 + i);
    p.call(kStats, st).call(kPing, v1::PingRequest()).call(kListSequences, v1::ListSequencesRequest());
    p.call(kListSequences, v1::ListSequencesRequest(), kKeepSessionId);
    p.call(kHeartbeat, v1::HeartbeatRequest()).call(kLookup, lk).call(kDetach, v1::DetachRequest());
    p.call(kHeartbeat, v1::HeartbeatRequest()).call(kStats, st);
    out.emplace_back("seed-basics", p.str());
  }
  for (auto [name, options, dtype_bytes] : {std::tuple{"seed-inline-fp32", uint8_t(0), 4},
                                            std::tuple{"seed-inline-fp16", kOptFloat16, 2},
                                            std::tuple{"seed-inline-bf16-limits", uint8_t(kOptBFloat16 | kOptLimits), 2}}) {
    Program p(options);
    p.call(kCreateSequence, create()).call(kAppend, append_inline(1, 5, dtype_bytes));
    decode_and_read(p, 1, dtype_bytes);
    v1::CompactRequest dry = with_seq<v1::CompactRequest>(1);
    dry.set_dry_run(true);
    p.call(kCompact, dry).call(kForkSequence, with_seq<v1::ForkSequenceRequest>(1));
    p.call(kAppend, append_inline(2, 3, dtype_bytes)).call(kStep, step_inline({1, 2}, 0, dtype_bytes));
    p.call(kStep, step_inline({1, 2}, 1, dtype_bytes));
    p.call(kReleaseSequence, with_seq<v1::ReleaseSequenceRequest>(2)).call(kDetach, v1::DetachRequest());
    out.emplace_back(name, p.str());
  }
  {
    // A prefill batch: two sequences in one AppendBatch, then a batch stopped by an unknown one.
    Program p(0);
    p.call(kCreateSequence, create()).call(kCreateSequence, create());
    v1::AppendBatchRequest b;
    *b.add_entries() = append_inline(1, 5, 4);
    *b.add_entries() = append_inline(2, 3, 4);
    p.call(kAppendBatch, b);
    b.mutable_entries(1)->set_sequence_id(77);
    p.call(kAppendBatch, b);
    decode_and_read(p, 2, 4);
    out.emplace_back("seed-append-batch", p.str());
  }
  {
    // Every tensor in staging: the writes put floats there first.
    Program p(0);
    Writer stage;
    stage.u16(0);
    const std::string f = floats(4096, 0.0f);
    stage.raw(f.data(), f.size());
    p.raw(kWriteStaging, stage.str());
    p.call(kCreateSequence, create());
    v1::AppendRequest a;
    a.set_sequence_id(1);
    a.set_num_tokens(4);
    set_range(a.mutable_k()->mutable_staging(), 0, 512);
    set_range(a.mutable_v()->mutable_staging(), 512, 512);
    a.set_num_query_tokens(1);
    set_range(a.mutable_q()->mutable_staging(), 1024, 256);
    p.call(kAppend, a);
    for (int layer = 0; layer < 2; ++layer) {
      v1::StepRequest s;
      s.set_layer(layer);
      s.add_sequence_ids(1);
      set_range(s.mutable_k()->mutable_staging(), 2048, 64);
      set_range(s.mutable_v()->mutable_staging(), 2112, 64);
      set_range(s.mutable_q()->mutable_staging(), 2176, 128);
      set_range(s.mutable_out()->mutable_staging(), 8192, 128);
      p.call(kStep, s);
    }
    v1::AttendRequest at;
    at.set_sequence_id(1);
    at.set_num_queries(1);
    set_range(at.mutable_q()->mutable_staging(), 2176, 128);
    set_range(at.mutable_out()->mutable_staging(), 8192, 128);
    p.call(kAttend, at);
    v1::ReadKVRequest rk;
    rk.set_sequence_id(1);
    set_range(rk.mutable_k()->mutable_staging(), 16384, 4096);
    set_range(rk.mutable_v()->mutable_staging(), 20480, 4096);
    set_range(rk.mutable_positions()->mutable_staging(), 24576, 4096);
    p.call(kReadKV, rk);
    out.emplace_back("seed-staging", p.str());
  }
  {
    // The compression policies and quantized storage, with queries for the scoring policies.
    Program p(0);
    const std::vector<std::pair<std::string, std::string>> kinds = {
        {"kara", ""}, {"h2o", ""}, {"snapkv", ""}, {"streaming", ""}, {"chunkkv", ""}, {"none", "kivi4"}, {"kara", "tq3"}};
    uint64_t id = 0;
    for (const auto& [policy, storage] : kinds) {
      v1::CreateSequenceRequest c = create(policy, storage);
      if (!storage.empty()) (*c.mutable_params())["residual"] = 4;
      if (policy == "snapkv") c.set_prefill_policy("snapkv");
      p.call(kCreateSequence, c).call(kAppend, append_inline(++id, 12, 4, 2));
      p.call(kStep, step_inline({id}, 0, 4)).call(kStep, step_inline({id}, 1, 4));
      p.call(kCompact, with_seq<v1::CompactRequest>(id));
    }
    p.call(kCompact, v1::CompactRequest()).call(kListSequences, v1::ListSequencesRequest());
    out.emplace_back("seed-policies", p.str());
  }
  {
    // The prefix cache: a prompt published with its token ids, looked up and reused.
    Program p(0);
    p.call(kCreateSequence, create()).call(kAppend, append_inline(1, 9, 4, 0, true));
    v1::LookupRequest lk;
    v1::CreateSequenceRequest c = create();
    for (int i = 0; i < 9; ++i) {
      lk.add_token_ids(100 + i);
      c.add_prefix_token_ids(100 + i);
    }
    p.call(kLookup, lk).call(kCreateSequence, c).call(kAppend, append_inline(2, 1, 4));
    p.call(kReleaseSequence, with_seq<v1::ReleaseSequenceRequest>(1)).call(kStats, v1::StatsRequest());
    out.emplace_back("seed-prefix", p.str());
  }
  {
    // A second tenant's session (index 1) trying the first one's sequence; then leases end.
    Program p(kOptLimits | kOptSharedNamespaces);
    v1::AttachRequest at;
    at.set_tenant("t1");
    at.set_staging_bytes(4096);
    at.set_cache_namespace("shared");
    p.call(kAttach, at).call(kCreateSequence, create(), 0).call(kAppend, append_inline(1, 2, 4), 0);
    p.call(kAppend, append_inline(1, 2, 4), 1).call(kForkSequence, with_seq<v1::ForkSequenceRequest>(1), 1);
    p.call(kReadKV, with_seq<v1::ReadKVRequest>(1), 1).call(kListSequences, v1::ListSequencesRequest(), 1);
    p.raw(kExpireLeases, "").call(kStats, v1::StatsRequest());
    out.emplace_back("seed-tenants", p.str());
  }
  {
    Program p(kOptFastPathSession);
    v1::AttachRequest at;
    at.set_fast_path(true);
    at.set_staging_bytes(8192);
    p.call(kAttach, at).call(kAttach, v1::AttachRequest()).call(kDetach, v1::DetachRequest(), 1);
    out.emplace_back("seed-fast-path-attach", p.str());
  }
  return out;
}

class RingProgram {
 public:
  RingProgram& submit(const ring::Command& c, int ids) {
    w_.u8(kSubmit).u8(uint8_t(ids)).raw(&c, ring::Command::kHeaderBytes).raw(c.ids, size_t(ids) * 8);
    return *this;
  }
  RingProgram& poll() {
    w_.u8(kPoll);
    return *this;
  }
  RingProgram& scribble(uint8_t which, uint64_t value) {
    w_.u8(kScribble).u8(which).u64(value);
    return *this;
  }
  RingProgram& event(uint8_t e) {
    w_.u8(kSessionEvent).u8(e);
    return *this;
  }
  const std::string& str() const { return w_.str(); }

 private:
  Writer w_;
};

ring::Command step_cmd(int layer, std::vector<uint64_t> ids) {
  ring::Command c{};
  c.tag = 7;
  c.op = uint32_t(ring::Op::kStep);
  c.layer = layer;
  c.count = uint32_t(ids.size());
  const uint64_t b = ids.size();
  c.k = {0, b * kKvHeads * kDim * 4};
  c.v = {4096, b * kKvHeads * kDim * 4};
  c.q = {8192, b * kQHeads * kDim * 4};
  c.out = {12288, b * kQHeads * kDim * 4};
  for (size_t i = 0; i < ids.size(); ++i) c.ids[i] = ids[i];
  return c;
}

ring::Command attend_cmd(uint64_t seq, int layer, uint32_t nq) {
  ring::Command c{};
  c.tag = 9;
  c.op = uint32_t(ring::Op::kAttend);
  c.layer = layer;
  c.count = nq;
  c.sequence_id = seq;
  c.q = {8192, uint64_t(nq) * kQHeads * kDim * 4};
  c.out = {12288, uint64_t(nq) * kQHeads * kDim * 4};
  return c;
}

std::vector<std::pair<std::string, std::string>> ring_seeds() {
  std::vector<std::pair<std::string, std::string>> out;
  out.emplace_back("seed-step", RingProgram().submit(step_cmd(0, {1}), 1).poll().submit(step_cmd(1, {1}), 1).poll().str());
  out.emplace_back("seed-batch",
                   RingProgram().submit(step_cmd(0, {1, 2}), 2).submit(step_cmd(1, {1, 2}), 2).poll().str());
  out.emplace_back("seed-attend", RingProgram().submit(attend_cmd(2, 1, 2), 0).poll().str());
  ring::Command garbage{};
  garbage.op = 7;
  out.emplace_back("seed-garbage-op", RingProgram().submit(garbage, 0).poll().str());
  out.emplace_back("seed-corrupt-indices",
                   RingProgram().submit(step_cmd(0, {1}), 1).poll().scribble(1, 1000).submit(step_cmd(1, {1}), 1).poll().str());
  out.emplace_back("seed-session-ends", RingProgram().submit(step_cmd(0, {1}), 1).event(3).event(0).poll().str());
  out.emplace_back("seed-lease", RingProgram().event(2).event(1).submit(attend_cmd(1, 0, 1), 0).poll().str());
  return out;
}

int write_all(const std::filesystem::path& dir, const std::vector<std::pair<std::string, std::string>>& seeds) {
  std::filesystem::create_directories(dir);
  for (const auto& [name, bytes] : seeds) {
    std::ofstream f(dir / name, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), std::streamsize(bytes.size()));
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", (dir / name).c_str());
      return 1;
    }
  }
  std::printf("%zu seeds in %s\n", seeds.size(), dir.c_str());
  return 0;
}

}  // namespace
}  // namespace karakv::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>: writes <dir>/service_fuzzer and <dir>/ring_fuzzer\n", argv[0]);
    return 2;
  }
  const std::filesystem::path dir(argv[1]);
  return karakv::fuzz::write_all(dir / "service_fuzzer", karakv::fuzz::service_seeds()) |
         karakv::fuzz::write_all(dir / "ring_fuzzer", karakv::fuzz::ring_seeds());
}
