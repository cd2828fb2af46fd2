// karakv-bench soak: N worker processes (this binary, role soak-worker) do random Attach /
// CreateSequence / Append / Step / Compact / ForkSequence / ReleaseSequence / Detach against one
// karakvd on a Unix socket, and crash on purpose (SIGKILL or _exit mid-step); a crashed worker is
// replaced by a new process. The daemon runs with a short lease so that crashed workers' sessions
// come back. Meanwhile the driver checks the pool invariant (Stats with check_invariants) every
// second and samples the daemon's RSS; workers compare a sample of Step outputs with a float64
// attention over the cache as ReadKV returns it, and that cache with the K/V they appended.
//
// Counters live in a file mapped by every process (one slot per worker), so a worker that dies
// keeps everything it counted up to its last operation.
#include "soak.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/synthetic.h"
#include "karakv/client.h"
#include "karakv/kernels/half.h"

ABSL_FLAG(int32_t, workers, 8, "soak: worker processes (at most 14)");
ABSL_FLAG(double, minutes, 10, "soak: how long the workers run (0.5 = 30 seconds)");
ABSL_FLAG(uint64_t, seed, 1, "soak: seed of the workers' random choices and of the K/V/Q they send");
ABSL_FLAG(int32_t, soak_lease_seconds, 4, "soak: karakvd --lease_seconds (a crashed worker's session is freed after it)");
ABSL_FLAG(int32_t, soak_pool_blocks_per_worker, 40,
          "soak: pool blocks per worker (a worker may hold up to 288: the pool fills now and then)");
ABSL_FLAG(double, soak_check_fraction, 0.1, "soak: fraction of Step calls whose outputs are checked against the reference");
ABSL_FLAG(double, soak_crash_mean_s, 20, "soak: mean seconds between a worker's start and its deliberate crash (0: no crashes)");
ABSL_FLAG(double, soak_warmup_s, -1,
          "soak: seconds of warm-up before the RSS trend starts (-1: a fifth of the run, at most 120)");
ABSL_FLAG(double, soak_max_rss_growth_pct, 1.0,
          "soak: fail when the daemon's RSS grows more than this (percent) along its trend from the warm-up's end "
          "to the run's end");

// The worker role's own settings, passed by the driver on its command line.
ABSL_FLAG(std::string, soak_worker_target, "", "soak-worker (internal): karakvd address");
ABSL_FLAG(std::string, soak_worker_shared, "", "soak-worker (internal): the shared counters file");
ABSL_FLAG(int32_t, soak_worker_slot, 0, "soak-worker (internal): its slot");
ABSL_FLAG(int32_t, soak_worker_generation, 0, "soak-worker (internal): how many processes had the slot before");

namespace karakv::bench {
namespace {

namespace kn = karakv::kernels;
using synthetic::Tensor;

constexpr int kMaxWorkers = kMaxChildren - 2;  // the daemon and a spare
constexpr int kMaxSeqs = 12;                   // live sequences per worker
constexpr int kMaxTokens = 384;                // logical tokens per sequence
constexpr int kMaxAppend = 48;                 // tokens per Append
constexpr int kMaxBatch = 4;                   // sequences per Step
constexpr int kCodes = 17;                     // absl::StatusCode 0..16
constexpr int kCrashExit = 86;                 // a deliberate _exit
constexpr double kTolerance = 1e-4;            // |Step out - float64 reference|, fp32 accumulation
constexpr uint64_t kStagingBytes = 512 << 10;

enum Op : int { kAttach, kCreate, kAppend, kStep, kCompact, kFork, kRelease, kDetach, kCrash, kProbe, kNumOps };
constexpr const char* kOpNames[kNumOps] = {"attach", "create", "append", "step", "compact",
                                           "fork", "release", "detach", "crash", "probe"};

kn::Geometry soak_geometry() {
  kn::Geometry g;
  g.num_layers = 2;
  g.num_q_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 32;
  g.dtype = kn::DType::kFloat16;
  g.block_size = 16;
  return g;
}

// One worker slot's counters, shared by every process that held the slot. Only the slot's live
// process writes it; the driver reads.
struct Slot {
  std::atomic<uint64_t> ops[kNumOps];
  std::atomic<uint64_t> errors[kNumOps][kCodes][2];  // [op][code][0: expected, 1: unexpected]
  std::atomic<uint64_t> step_checks, step_mismatches, checks_skipped, kv_checks, kv_mismatches;
  std::atomic<uint64_t> max_err_bits;  // a double
  std::atomic<uint64_t> next_key;      // keys of this slot's sequences' synthetic data
  std::atomic<uint32_t> crash_pending;  // set by a worker just before it crashes on purpose
  // Written by a worker just before it crashes, read by its successor: the sequences that must be
  // gone once two lease periods have passed.
  uint32_t crashed_count;
  int64_t crashed_at_ns;  // steady clock
  uint64_t crashed_ids[kMaxSeqs];
};

struct Shared {
  std::atomic<uint32_t> stop;
  Slot slots[kMaxWorkers];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "counters are shared between processes");

absl::StatusOr<Shared*> map_shared(const std::string& path, bool create) {
  const int fd = open(path.c_str(), create ? O_RDWR | O_CREAT | O_TRUNC : O_RDWR, 0600);
  if (fd < 0) return absl::InternalError(absl::StrCat("open ", path, ": ", std::strerror(errno)));
  if (create && ftruncate(fd, sizeof(Shared)) != 0) {
    close(fd);
    return absl::InternalError(absl::StrCat("ftruncate ", path, ": ", std::strerror(errno)));
  }
  void* p = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap ", path, ": ", std::strerror(errno)));
  return static_cast<Shared*>(p);  // a new file reads as zeros: every counter starts at 0
}

int64_t now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count(); }

// ---------------------------------------------------------------------------------------------
// The worker.

// The bits of `v` in storage dtype `d` (as synthetic::store writes them), in the low bytes.
uint32_t storage_bits(float v, kn::DType d) {
  switch (d) {
    case kn::DType::kFloat16: return kn::float_to_half(v);
    case kn::DType::kBFloat16: return kn::float_to_bf16(v);
    default: {
      uint32_t b;
      std::memcpy(&b, &v, 4);
      return b;
    }
  }
}

struct Seq {
  uint64_t id = 0;
  std::string policy;
  int64_t logical = 0;    // tokens appended or stepped (compaction does not change it)
  bool decoding = false;  // stepped at least once
  // Whose synthetic data each position holds: (first position, key); a fork starts a new key at
  // its parent's length.
  std::vector<std::pair<int64_t, uint64_t>> lineage;
  uint64_t key() const { return lineage.back().second; }
  uint64_t key_at(int64_t pos) const {
    uint64_t k = lineage.front().second;
    for (const auto& [from, key] : lineage) k = from <= pos ? key : k;
    return k;
  }
};

class Worker {
 public:
  Worker(Shared* shared, int slot, int generation)
      : shared_(shared), slot_(shared->slots[slot]), slot_index_(slot), generation_(generation),
        seed_(absl::GetFlag(FLAGS_seed)), g_(soak_geometry()),
        rng_(seed_ * 1000003 + uint64_t(slot) * 7919 + uint64_t(generation)) {
    const double mean = absl::GetFlag(FLAGS_soak_crash_mean_s);
    crash_at_ = mean > 0 ? Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                                              std::exponential_distribution<double>(1 / mean)(rng_)))
                         : Clock::time_point::max();
    // The predecessor's sequences, if it crashed: they must be gone two lease periods after.
    const int64_t lease_ns = int64_t(absl::GetFlag(FLAGS_soak_lease_seconds)) * 1000000000;
    for (uint32_t i = 0; i < slot_.crashed_count && i < kMaxSeqs; ++i) {
      probes_.push_back({slot_.crashed_ids[i], slot_.crashed_at_ns + 2 * lease_ns + 1000000000, "crashed"});
    }
    slot_.crashed_count = 0;
    const std::string log = std::filesystem::path(absl::GetFlag(FLAGS_soak_worker_shared)).parent_path() / "unexpected.log";
    unexpected_fd_ = open(log.c_str(), O_WRONLY | O_APPEND | O_CREAT, 0600);
  }

  int run() {
    while (shared_->stop.load() == 0) {
      if (Clock::now() >= crash_at_ && client_) crash();
      if (!client_) {
        attach();
        continue;
      }
      if (run_due_probe()) continue;
      const int r = std::uniform_int_distribution<int>(0, 99)(rng_);
      if (r < 10) create();
      else if (r < 30) append();
      else if (r < 78) step();
      else if (r < 84) compact();
      else if (r < 90) fork();
      else if (r < 99) release(-1);
      else detach();
    }
    // Stopped: give everything back and leave.
    while (client_ && !seqs_.empty()) release(0);
    if (client_) {
      count(kDetach, client_->Detach());
      client_.reset();
    }
    return 0;
  }

 private:
  struct Probe {
    uint64_t id;
    int64_t due_ns;
    const char* why;
  };

  template <typename T>
  T pick(const std::vector<T>& v) { return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng_)]; }
  int index() { return std::uniform_int_distribution<int>(0, int(seqs_.size()) - 1)(rng_); }

  static bool pool_full(const absl::Status& s) {
    return s.code() == absl::StatusCode::kResourceExhausted && absl::StrContains(s.message(), "KV pool full");
  }

  // Counts the operation and, when it failed, its error: expected (the pool full on a call that
  // takes blocks: Create, Append, Step, Fork, Compact; a freed sequence's NOT_FOUND) or not.
  // Returns s.ok().
  bool count(Op op, const absl::Status& s, bool expected = false) {
    slot_.ops[op].fetch_add(1);
    return record(op, s, expected);
  }
  // The same without counting an operation: a check's extra calls (ListSequences, ReadKV).
  bool record(Op op, const absl::Status& s, bool expected = false) {
    if (s.ok()) return true;
    const int code = std::clamp(int(s.code()), 0, kCodes - 1);
    slot_.errors[op][code][expected ? 0 : 1].fetch_add(1);
    if (!expected) unexpected(absl::StrCat(kOpNames[op], ": ", s.ToString()));
    return false;
  }
  bool count_pool(Op op, const absl::Status& s) { return count(op, s, pool_full(s)); }

  void unexpected(const std::string& what) {
    if (unexpected_fd_ < 0 || ++unexpected_lines_ > 200) return;
    const std::string line = absl::StrFormat("worker %d.%d: %s\n", slot_index_, generation_, what);
    ssize_t ignored = write(unexpected_fd_, line.data(), line.size());
    (void)ignored;
  }

  void attach() {
    karakv::ClientOptions o;
    o.target = absl::GetFlag(FLAGS_soak_worker_target);
    o.worker_id = absl::StrFormat("karakv-bench-soak-%d.%d", slot_index_, generation_);
    o.tenant = "soak";
    o.staging_bytes = kStagingBytes;
    o.geometry = g_;
    o.fast_path = (rng_() & 1) != 0;  // Step through the shared-memory ring half of the time
    auto c = karakv::Client::Attach(o);
    if (!count(kAttach, c.status())) {
      sleep_ms(100);
      return;
    }
    client_ = std::move(*c);
  }

  uint64_t new_key() { return (uint64_t(slot_index_) << 20) | (slot_.next_key.fetch_add(1) & 0xfffff); }

  void create() {
    if (seqs_.size() >= size_t(kMaxSeqs)) return release(-1);
    karakv::SequenceOptions o;
    switch (std::uniform_int_distribution<int>(0, 2)(rng_)) {
      case 0: o.policy = "none"; break;
      case 1: o.policy = "streaming", o.params = {{"c_max", 128}, {"c_target", 64}}; break;
      default: o.policy = "kara", o.params = {{"budget", 128}, {"recent", 64}}; break;
    }
    auto id = client_->CreateSequence(o);
    if (!count_pool(kCreate, id.status())) return;
    Seq s;
    s.id = *id;
    s.policy = o.policy;
    s.lineage = {{0, new_key()}};
    seqs_.push_back(std::move(s));
  }

  // Pool full: give a sequence back so that the pool drains.
  void on_error(const absl::Status& s) {
    if (pool_full(s) && !seqs_.empty()) release(-1);
  }

  void append() {
    std::vector<int> eligible;  // kara needs queries for tokens appended after decoding started
    for (size_t i = 0; i < seqs_.size(); ++i) {
      if (seqs_[i].logical < kMaxTokens && !(seqs_[i].decoding && seqs_[i].policy == "kara")) eligible.push_back(int(i));
    }
    if (eligible.empty()) return create();
    Seq& s = seqs_[pick(eligible)];
    const int n = std::min<int>(std::uniform_int_distribution<int>(1, kMaxAppend)(rng_), kMaxTokens - s.logical);
    client_->reset_staging();
    auto k = client_->alloc(client_->append_bytes(n)), v = client_->alloc(client_->append_bytes(n));
    if (!k.ok() || !v.ok()) return fatal(k.ok() ? v.status() : k.status());
    synthetic::fill_prompt(k->data(), g_, seed_, Tensor::kKey, s.key(), s.logical, n);
    synthetic::fill_prompt(v->data(), g_, seed_, Tensor::kValue, s.key(), s.logical, n);
    auto len = client_->Append(s.id, n, *k, *v);
    if (count_pool(kAppend, len.status())) {
      s.logical += n;
    } else {
      on_error(len.status());
    }
  }

  absl::StatusOr<karakv::SequenceInfo> info(uint64_t id) {
    auto list = client_->ListSequences();
    if (!list.ok()) return list.status();
    for (const karakv::SequenceInfo& i : *list) {
      if (i.id == id) return i;
    }
    return absl::NotFoundError(absl::StrCat("sequence ", id, " is not in ListSequences"));
  }

  // The cache as ReadKV returns it must hold, at each resident position, exactly the K/V this
  // worker appended there (or its fork ancestor did). Returns the resident token count.
  absl::StatusOr<int> read_and_verify(const Seq& s, karakv::Buffer* k, karakv::Buffer* v) {
    auto kb = client_->alloc(client_->append_bytes(kMaxTokens)), vb = client_->alloc(client_->append_bytes(kMaxTokens));
    auto pb = client_->alloc(size_t(g_.num_layers) * g_.num_kv_heads * kMaxTokens * 4);
    if (!kb.ok() || !vb.ok() || !pb.ok()) return absl::InternalError("staging too small for ReadKV");
    auto t = client_->ReadKV(s.id, *kb, *vb, *pb);
    if (!t.ok()) return t.status();
    const int T = *t, H = g_.num_kv_heads, D = g_.head_dim;
    const size_t es = kn::dtype_size(g_.dtype);
    const int32_t* pos = pb->as<int32_t>().data();
    slot_.kv_checks.fetch_add(1);
    std::string bad;
    if (T > s.logical) bad = absl::StrCat(T, " resident tokens, more than the ", s.logical, " appended");
    for (int l = 0; l < g_.num_layers && bad.empty(); ++l) {
      for (int h = 0; h < H && bad.empty(); ++h) {
        for (int t = 0; t < T && bad.empty(); ++t) {
          const int32_t p = pos[(size_t(l) * H + h) * T + t];
          if (p < 0 || p >= s.logical) {
            bad = absl::StrCat("position ", p, " outside [0, ", s.logical, ")");
            break;
          }
          const uint64_t key = s.key_at(p);
          for (int d = 0; d < D; ++d) {
            // One element in the storage dtype, bitwise.
            const uint32_t ek = storage_bits(synthetic::value(seed_, Tensor::kKey, key, l, p, h, d), g_.dtype);
            const uint32_t ev = storage_bits(synthetic::value(seed_, Tensor::kValue, key, l, p, h, d), g_.dtype);
            uint32_t gk = 0, gv = 0;
            const size_t i = ((size_t(l) * T + t) * H + h) * D + d;
            std::memcpy(&gk, kb->data() + i * es, es);
            std::memcpy(&gv, vb->data() + i * es, es);
            if (gk != ek || gv != ev) {
              bad = absl::StrFormat("layer %d head %d position %d dim %d: K/V %08x/%08x, appended %08x/%08x", l, h, p,
                                    d, gk, gv, ek, ev);
              break;
            }
          }
        }
      }
    }
    if (!bad.empty()) {
      slot_.kv_mismatches.fetch_add(1);
      unexpected(absl::StrFormat("ReadKV of sequence %d (%s) differs from what was appended: %s", s.id, s.policy, bad));
    }
    *k = *kb;
    *v = *vb;
    return T;
  }

  void step() {
    std::vector<int> eligible;
    for (size_t i = 0; i < seqs_.size(); ++i) {
      if (seqs_[i].logical >= 1 && seqs_[i].logical < kMaxTokens) eligible.push_back(int(i));
    }
    if (eligible.empty()) return append();
    std::shuffle(eligible.begin(), eligible.end(), rng_);
    eligible.resize(std::min<size_t>(eligible.size(), std::uniform_int_distribution<int>(1, kMaxBatch)(rng_)));
    const int n = int(eligible.size());
    std::vector<uint64_t> ids;
    for (int i : eligible) ids.push_back(seqs_[i].id);
    client_->reset_staging();
    const bool check = std::uniform_real_distribution<double>(0, 1)(rng_) < absl::GetFlag(FLAGS_soak_check_fraction);
    const int checked = check ? std::uniform_int_distribution<int>(0, n - 1)(rng_) : -1;
    karakv::Buffer ck, cv;
    int cache_tokens = 0;
    uint32_t compactions_before = 0;
    if (check) {
      const Seq& s = seqs_[eligible[checked]];
      auto before = info(s.id);
      if (!record(kStep, before.status())) return;
      compactions_before = before->compactions;
      auto t = read_and_verify(s, &ck, &cv);
      if (!record(kStep, t.status())) return;
      cache_tokens = *t;
    }
    auto k = client_->alloc(client_->step_kv_bytes(n)), v = client_->alloc(client_->step_kv_bytes(n));
    auto q = client_->alloc(client_->q_bytes(n)), out = client_->alloc(client_->q_bytes(n));
    if (!k.ok() || !v.ok() || !q.ok() || !out.ok()) return fatal(absl::InternalError("staging too small for Step"));
    const size_t kv_tok = g_.kv_token_elems() * kn::dtype_size(g_.dtype), q_tok = g_.q_token_elems();
    std::vector<double> errs;
    for (int l = 0; l < g_.num_layers; ++l) {
      for (int b = 0; b < n; ++b) {
        const Seq& s = seqs_[eligible[b]];
        synthetic::fill_token(k->data() + b * kv_tok, g_, seed_, Tensor::kKey, s.key(), l, s.logical);
        synthetic::fill_token(v->data() + b * kv_tok, g_, seed_, Tensor::kValue, s.key(), l, s.logical);
        synthetic::fill_query(q->as<float>().data() + b * q_tok, g_, seed_, s.key(), l, s.logical);
      }
      auto r = client_->Step(l, ids, *k, *v, *q, *out);
      if (!count_pool(kStep, r.status())) return on_error(r.status());
      if (check) {
        const std::vector<double> ref = synthetic::dense_attention_over_cache(
            g_, ck.data(), cv.data(), cache_tokens, l, k->data() + checked * kv_tok, v->data() + checked * kv_tok,
            q->as<float>().data() + checked * q_tok);
        const float* got = out->as<float>().data() + checked * q_tok;
        double err = 0;
        for (size_t i = 0; i < q_tok; ++i) err = std::max(err, std::abs(double(got[i]) - ref[i]));
        errs.push_back(err);
      }
    }
    for (int i : eligible) {
      ++seqs_[i].logical;
      seqs_[i].decoding = true;
    }
    if (!check) return;
    // Compared only when nothing compacted the sequence between ReadKV and this step's end (a
    // Kara tick of another worker's step, or this step's own threshold trigger).
    const Seq& s = seqs_[eligible[checked]];
    auto after = info(s.id);
    if (!record(kStep, after.status())) return;
    if (after->compactions != compactions_before || after->length != uint32_t(cache_tokens + 1)) {
      slot_.checks_skipped.fetch_add(1);
      return;
    }
    for (int l = 0; l < g_.num_layers; ++l) {
      slot_.step_checks.fetch_add(1);
      double prev_max;
      uint64_t bits = slot_.max_err_bits.load();
      std::memcpy(&prev_max, &bits, 8);
      if (errs[l] > prev_max) {
        std::memcpy(&bits, &errs[l], 8);
        slot_.max_err_bits.store(bits);
      }
      if (errs[l] > kTolerance) {
        slot_.step_mismatches.fetch_add(1);
        unexpected(absl::StrFormat("Step of sequence %d (%s) layer %d at position %d: max |out - reference| = %.3g",
                                   s.id, s.policy, l, s.logical - 1, errs[l]));
      }
    }
  }

  void compact() {
    if (seqs_.empty()) return create();
    const bool all = std::uniform_int_distribution<int>(0, 4)(rng_) == 0;
    const bool dry = std::uniform_int_distribution<int>(0, 2)(rng_) == 0;
    auto r = client_->Compact(all ? 0 : seqs_[index()].id, dry);
    if (!count_pool(kCompact, r.status())) on_error(r.status());  // a compaction may need fresh blocks
  }

  void fork() {
    if (seqs_.empty()) return create();
    if (seqs_.size() >= size_t(kMaxSeqs)) return release(-1);
    const Seq parent = seqs_[index()];
    auto id = client_->Fork(parent.id);
    if (!count_pool(kFork, id.status())) return on_error(id.status());
    Seq child = parent;
    child.id = *id;
    child.lineage.push_back({parent.logical, new_key()});
    seqs_.push_back(std::move(child));
  }

  // Releases seqs_[i] (-1: a random one).
  void release(int i) {
    if (seqs_.empty()) return;
    if (i < 0) i = index();
    auto r = client_->Release(seqs_[i].id);
    count(kRelease, r.status());
    seqs_.erase(seqs_.begin() + i);
  }

  // Detaches, then (on the next turn) attaches again; a few of the detached session's sequences
  // are probed from the new session: they must be gone at once.
  void detach() {
    count(kDetach, client_->Detach());
    for (size_t i = 0; i < seqs_.size() && i < 3; ++i) probes_.push_back({seqs_[i].id, 0, "detached"});
    seqs_.clear();
    client_.reset();
  }

  // A probe of a sequence that must no longer exist: ReadKV must say NOT_FOUND.
  bool run_due_probe() {
    const int64_t now = now_ns();
    auto it = std::find_if(probes_.begin(), probes_.end(), [&](const Probe& p) { return p.due_ns <= now; });
    if (it == probes_.end()) return false;
    const Probe p = *it;
    probes_.erase(it);
    client_->reset_staging();
    auto kb = client_->alloc(client_->append_bytes(kMaxTokens)), vb = client_->alloc(client_->append_bytes(kMaxTokens));
    auto pb = client_->alloc(size_t(g_.num_layers) * g_.num_kv_heads * kMaxTokens * 4);
    if (!kb.ok() || !vb.ok() || !pb.ok()) fatal(absl::InternalError("staging too small for ReadKV"));
    auto r = client_->ReadKV(p.id, *kb, *vb, *pb);
    if (r.ok()) {
      count(kProbe, absl::OkStatus());
      slot_.errors[kProbe][0][1].fetch_add(1);
      unexpected(absl::StrFormat("sequence %d of a %s session is still readable (%d tokens)%s", p.id, p.why, *r,
                                 p.due_ns > 0 ? " two lease periods after the crash" : " after Detach"));
    } else {
      count(kProbe, r.status(),
            r.status().code() == absl::StatusCode::kNotFound && absl::StrContains(r.status().message(), "unknown sequence"));
    }
    return true;
  }

  // Dies on purpose in the middle of work: after layer 0 of a step (a half-stepped token), or
  // between calls. The successor probes this process's sequences two lease periods later.
  [[noreturn]] void crash() {
    slot_.crashed_count = 0;
    for (const Seq& s : seqs_) slot_.crashed_ids[slot_.crashed_count++] = s.id;
    slot_.crashed_at_ns = now_ns();
    slot_.ops[kCrash].fetch_add(1);
    slot_.crash_pending.store(1);
    if (!seqs_.empty() && (rng_() & 1)) {
      const Seq& s = seqs_[index()];
      client_->reset_staging();
      auto k = client_->alloc(client_->step_kv_bytes(1)), v = client_->alloc(client_->step_kv_bytes(1));
      auto q = client_->alloc(client_->q_bytes(1)), out = client_->alloc(client_->q_bytes(1));
      if (k.ok() && v.ok() && q.ok() && out.ok()) {
        synthetic::fill_token(k->data(), g_, seed_, Tensor::kKey, s.key(), 0, s.logical);
        synthetic::fill_token(v->data(), g_, seed_, Tensor::kValue, s.key(), 0, s.logical);
        synthetic::fill_query(q->as<float>().data(), g_, seed_, s.key(), 0, s.logical);
        const uint64_t id = s.id;
        (void)client_->Step(0, std::span<const uint64_t>(&id, 1), *k, *v, *q, *out);
      }
    }
    if (rng_() & 1) raise(SIGKILL);
    _exit(kCrashExit);
  }

  // A failure of the worker itself (its staging too small): counted as unexpected, then exit.
  [[noreturn]] void fatal(const absl::Status& s) {
    unexpected(absl::StrCat("worker failure: ", s.ToString()));
    std::fprintf(stderr, "soak-worker: %s\n", s.ToString().c_str());
    _exit(2);
  }

  Shared* shared_;
  Slot& slot_;
  int slot_index_, generation_;
  uint64_t seed_;
  kn::Geometry g_;
  std::mt19937_64 rng_;
  Clock::time_point crash_at_;
  std::unique_ptr<karakv::Client> client_;
  std::vector<Seq> seqs_;
  std::vector<Probe> probes_;
  int unexpected_fd_ = -1;
  int unexpected_lines_ = 0;
};

// ---------------------------------------------------------------------------------------------
// The driver.

std::string self_exe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "karakv-bench" : p.string();
}

struct Rss {
  double t = 0;  // seconds since the workers started
  uint64_t rss_kib = 0, anon_kib = 0, shmem_kib = 0;
  // The daemon's malloc (Stats): in use, and taken from the OS. Growth in RSS with these flat is not
  // the heap; growth in held with in use flat is fragmentation.
  uint64_t heap_in_use_kib = 0, heap_held_kib = 0;
  uint64_t threads = 0;  // the daemon's threads: each brings a stack, malloc caches, kernel scratch
  // What the daemon holds for its clients (Stats): its malloc in use follows these.
  uint64_t sequences = 0, blocks_used = 0, query_cache_kib = 0;
};

// Seconds kept to the millisecond, as soak.csv and soak_rss.csv write them, so that the trend can
// be refitted from the files over exactly the samples the soak used.
double to_ms(double seconds) { return std::round(seconds * 1000) / 1000; }

bool read_rss(pid_t pid, double t, Rss* out) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  Rss r;
  r.t = t;
  while (std::getline(in, line)) {
    auto field = [&](const char* name, uint64_t* v) {
      if (absl::StartsWith(line, name)) *v = std::strtoull(line.c_str() + std::strlen(name), nullptr, 10);
    };
    field("VmRSS:", &r.rss_kib);
    field("RssAnon:", &r.anon_kib);
    field("RssShmem:", &r.shmem_kib);
    field("Threads:", &r.threads);
  }
  *out = r;
  return r.rss_kib > 0;
}

// The median of each field over the samples in [from, to] (the nearest sample when none is).
Rss median_rss(const std::vector<Rss>& samples, double from, double to) {
  std::vector<Rss> in;
  for (const Rss& r : samples) {
    if (r.t >= from && r.t <= to) in.push_back(r);
  }
  if (in.empty() && !samples.empty()) {
    in.push_back(*std::min_element(samples.begin(), samples.end(), [&](const Rss& a, const Rss& b) {
      return std::abs(a.t - from) < std::abs(b.t - from);
    }));
  }
  if (in.empty()) return {};
  auto med = [&](uint64_t Rss::*f) {
    std::vector<double> v;
    for (const Rss& r : in) v.push_back(double(r.*f));
    return uint64_t(percentile(v, 50));
  };
  Rss out;
  out.t = (from + to) / 2;
  out.rss_kib = med(&Rss::rss_kib);
  out.anon_kib = med(&Rss::anon_kib);
  out.shmem_kib = med(&Rss::shmem_kib);
  out.heap_in_use_kib = med(&Rss::heap_in_use_kib);
  out.heap_held_kib = med(&Rss::heap_held_kib);
  out.threads = med(&Rss::threads);
  return out;
}

std::string code_name(int code) {
  return code == 0 ? "OK" : absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

}  // namespace

double soak_seconds() { return absl::GetFlag(FLAGS_minutes) * 60; }

int soak_worker_main() {
  const int slot = absl::GetFlag(FLAGS_soak_worker_slot);
  if (slot < 0 || slot >= kMaxWorkers) {
    std::fprintf(stderr, "soak-worker: --soak_worker_slot=%d outside [0, %d)\n", slot, kMaxWorkers);
    return 2;
  }
  auto shared = map_shared(absl::GetFlag(FLAGS_soak_worker_shared), false);
  if (!shared.ok()) {
    std::fprintf(stderr, "soak-worker: %s\n", shared.status().ToString().c_str());
    return 2;
  }
  Worker w(*shared, slot, absl::GetFlag(FLAGS_soak_worker_generation));
  return w.run();
}

int run_soak(const TempDir& dir, const std::string& out_dir) {
  const int workers = absl::GetFlag(FLAGS_workers);
  const double seconds = soak_seconds();
  const int lease = absl::GetFlag(FLAGS_soak_lease_seconds);
  if (workers < 1 || workers > kMaxWorkers || seconds <= 0 || lease < 1) {
    std::fprintf(stderr, "karakv-bench soak: --workers must be in [1, %d] (got %d), --minutes above 0 (got %g), "
                 "--soak_lease_seconds at least 1 (got %d)\n", kMaxWorkers, workers, seconds / 60, lease);
    return 2;
  }
  const kn::Geometry g = soak_geometry();
  const int64_t pool_blocks = int64_t(absl::GetFlag(FLAGS_soak_pool_blocks_per_worker)) * workers;
  const std::vector<std::string> flags = {
      absl::StrCat("--layers=", g.num_layers), absl::StrCat("--q_heads=", g.num_q_heads),
      absl::StrCat("--kv_heads=", g.num_kv_heads), absl::StrCat("--head_dim=", g.head_dim), "--dtype=fp16",
      absl::StrCat("--block_size=", g.block_size), absl::StrCat("--pool_bytes=", pool_blocks * g.block_bytes()),
      absl::StrCat("--lease_seconds=", lease)};
  auto daemon = start_karakvd(dir, "karakvd-soak", flags);
  if (!daemon.ok()) {
    std::fprintf(stderr, "karakv-bench soak: %s\n", daemon.status().ToString().c_str());
    return 1;
  }
  const pid_t daemon_pid = daemon->process->pid();
  auto monitor = attach(*daemon, 0, "karakv-bench-soak-monitor");
  const std::string shared_path = dir.file("soak-counters");
  register_cleanup_path(shared_path);
  auto shared_or = map_shared(shared_path, true);
  if (!monitor.ok() || !shared_or.ok()) {
    std::fprintf(stderr, "karakv-bench soak: %s\n",
                 (monitor.ok() ? shared_or.status() : monitor.status()).ToString().c_str());
    return 1;
  }
  register_cleanup_path(dir.file("unexpected.log"));
  Shared* shared = *shared_or;
  std::vector<std::string> failures;  // what makes the run fail, besides the counted errors

  std::vector<std::unique_ptr<ChildProcess>> procs(workers);
  std::vector<int> generation(workers, 0);
  int restarts = 0, unexpected_exits = 0, crashes_seen = 0;
  auto start_worker = [&](int i) -> absl::Status {
    std::vector<std::string> argv = {self_exe(), "soak-worker", "--soak_worker_target=" + daemon->target,
                                     "--soak_worker_shared=" + shared_path, absl::StrCat("--soak_worker_slot=", i),
                                     absl::StrCat("--soak_worker_generation=", generation[i]),
                                     absl::StrCat("--seed=", absl::GetFlag(FLAGS_seed)),
                                     absl::StrCat("--soak_lease_seconds=", lease),
                                     absl::StrCat("--soak_check_fraction=", absl::GetFlag(FLAGS_soak_check_fraction)),
                                     absl::StrCat("--soak_crash_mean_s=", absl::GetFlag(FLAGS_soak_crash_mean_s))};
    auto p = ChildProcess::start(absl::StrCat("soak-worker-", i), argv, dir.file(absl::StrCat("soak-worker-", i, ".log")));
    if (!p.ok()) return p.status();
    procs[i] = std::move(*p);
    return absl::OkStatus();
  };
  // A worker that ended: a deliberate crash, or a failure (its log tail goes to the report).
  auto reap = [&](int i, const std::string& how) {
    Slot& s = shared->slots[i];
    if (s.crash_pending.exchange(0) != 0 && (how == absl::StrCat("exit ", kCrashExit) || how == "signal 9")) {
      ++crashes_seen;
    } else if (how != "exit 0") {
      ++unexpected_exits;
      failures.push_back(absl::StrFormat("worker %d.%d ended with %s; log tail:\n%s", i, generation[i], how,
                                         procs[i]->log_tail(1500)));
    }
  };

  progress(absl::StrFormat("soak: %d workers for %.0f s, seed %d, lease %d s, pool %d blocks", workers, seconds,
                           absl::GetFlag(FLAGS_seed), lease, pool_blocks));
  for (int i = 0; i < workers; ++i) {
    if (absl::Status s = start_worker(i); !s.ok()) {
      std::fprintf(stderr, "karakv-bench soak: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  const auto t0 = Clock::now();
  uint64_t invariant_checks = 0, invariant_failures = 0, monitor_errors = 0, peak_blocks = 0;
  std::vector<Rss> rss;
  karakv::DaemonStats last_stats;  // the daemon's own figures, sampled beside its RSS
  auto check_invariant = [&](const char* when) {
    auto st = (*monitor)->Stats(true);
    if (!st.ok()) {
      ++monitor_errors;
      failures.push_back(absl::StrCat("Stats (", when, "): ", st.status().ToString()));
      return;
    }
    last_stats = *st;
    ++invariant_checks;
    peak_blocks = std::max(peak_blocks, st->blocks_used);
    if (!st->invariants_checked || !st->invariant_error.empty()) {
      ++invariant_failures;
      failures.push_back(absl::StrCat("pool invariant (", when, "): ",
                                      st->invariants_checked ? st->invariant_error : "not checked"));
    }
  };
  double last_progress = 0;
  while (true) {
    const double t = seconds_since(t0);
    if (t >= seconds) break;
    if (!daemon->process->running()) {
      failures.push_back(absl::StrCat("karakvd died during the run; log tail:\n", daemon->process->log_tail(6000)));
      break;
    }
    check_invariant("during the run");
    if (Rss r; read_rss(daemon_pid, to_ms(t), &r)) {
      r.heap_in_use_kib = last_stats.heap_in_use_bytes / 1024;
      r.heap_held_kib = last_stats.heap_held_bytes / 1024;
      r.sequences = last_stats.sequences;
      r.blocks_used = last_stats.blocks_used;
      r.query_cache_kib = last_stats.query_cache_bytes / 1024;
      rss.push_back(r);
    }
    for (int i = 0; i < workers; ++i) {
      if (procs[i]->running()) continue;
      reap(i, procs[i]->stop());
      ++generation[i];
      ++restarts;
      if (absl::Status s = start_worker(i); !s.ok()) {
        failures.push_back(absl::StrCat("restarting worker ", i, ": ", s.ToString()));
        break;
      }
    }
    if (t - last_progress >= 30) {
      last_progress = t;
      uint64_t ops = 0;
      for (int i = 0; i < workers; ++i) {
        for (int o = 0; o < kNumOps; ++o) ops += shared->slots[i].ops[o].load();
      }
      progress(absl::StrFormat("soak: %.0f s, %d ops, %d crashes, %d invariant checks, RSS %d KiB", t, ops,
                               crashes_seen, invariant_checks, rss.empty() ? 0 : rss.back().rss_kib));
    }
    sleep_ms(1000);
  }
  const double run_s = seconds_since(t0);

  // Stop: every worker releases what it holds, detaches and exits 0.
  shared->stop.store(1);
  for (int i = 0; i < workers; ++i) {
    for (int w = 0; w < 1500 && procs[i]->running(); ++w) sleep_ms(10);
    reap(i, procs[i]->stop());
  }
  // Every session but the monitor's must be gone within two lease periods (the last crashed
  // workers' leases), and with them every block.
  const auto t_drain = Clock::now();
  double drain_s = -1;
  karakv::DaemonStats last;
  while (seconds_since(t_drain) < 2 * lease + 5) {
    auto st = (*monitor)->Stats(false);
    if (st.ok()) {
      last = *st;
      if (st->sessions == 1 && st->sequences == 0 && st->blocks_used == 0) {
        drain_s = seconds_since(t_drain);
        break;
      }
    }
    sleep_ms(100);
  }
  if (drain_s < 0) {
    failures.push_back(absl::StrFormat("after the workers ended, %d sessions (1 is the monitor's), %d sequences and "
                                       "%d blocks remained %d s later; expected 1, 0 and 0 within two lease periods",
                                       last.sessions, last.sequences, last.blocks_used, 2 * lease + 5));
  }
  check_invariant("after the workers ended");
  const uint64_t lease_expiries = last.lease_expiries;
  monitor->reset();
  if (absl::Status s = daemon->stop(); !s.ok()) failures.push_back(std::string(s.message()));

  // Totals.
  uint64_t ops[kNumOps] = {}, errors[kCodes][2] = {}, ops_total = 0;
  std::map<int, std::map<std::string, uint64_t>> error_ops;  // code -> op -> count
  uint64_t step_checks = 0, step_mismatches = 0, skipped = 0, kv_checks = 0, kv_mismatches = 0;
  double max_err = 0;
  for (int i = 0; i < workers; ++i) {
    Slot& s = shared->slots[i];
    for (int o = 0; o < kNumOps; ++o) {
      ops[o] += s.ops[o].load();
      ops_total += s.ops[o].load();
      for (int c = 0; c < kCodes; ++c) {
        for (int e = 0; e < 2; ++e) {
          const uint64_t n = s.errors[o][c][e].load();
          errors[c][e] += n;
          if (n > 0) error_ops[c][kOpNames[o]] += n;
        }
      }
    }
    step_checks += s.step_checks.load();
    step_mismatches += s.step_mismatches.load();
    skipped += s.checks_skipped.load();
    kv_checks += s.kv_checks.load();
    kv_mismatches += s.kv_mismatches.load();
    double e;
    const uint64_t bits = s.max_err_bits.load();
    std::memcpy(&e, &bits, 8);
    max_err = std::max(max_err, e);
  }
  uint64_t unexpected_errors = 0, expected_errors = 0;
  for (int c = 0; c < kCodes; ++c) {
    expected_errors += errors[c][0];
    unexpected_errors += errors[c][1];
  }
  const double warmup = to_ms(absl::GetFlag(FLAGS_soak_warmup_s) >= 0 ? absl::GetFlag(FLAGS_soak_warmup_s)
                                                                      : std::min(120.0, seconds / 5));
  const double window = std::max(1.0, std::min(30.0, seconds / 10));
  const Rss rss_start = median_rss(rss, warmup, warmup + window);
  const Rss rss_end = median_rss(rss, run_s - window, run_s);
  uint64_t rss_max = 0;
  uint64_t threads_max = 0;
  for (const Rss& r : rss) {
    rss_max = std::max(rss_max, r.rss_kib);
    threads_max = std::max(threads_max, r.threads);
  }
  const double window_growth =
      rss_start.rss_kib > 0 ? 100.0 * (double(rss_end.rss_kib) - rss_start.rss_kib) / rss_start.rss_kib : 0;
  // The growth judged: RSS's trend from the end of the warm-up to the end of the run, a Theil-Sen
  // line through every sample in between. The daemon's RSS swings by over a MiB from one second to
  // the next (the workers' staging segments are mapped in and out with their sessions), so two short
  // windows at the ends measure the swing of the moment as much as growth; the line uses them all.
  // At most kTrendPoints samples, every k-th, keep the fit's pairs bounded on long runs.
  constexpr size_t kTrendPoints = 3000;
  std::vector<const Rss*> after_warmup;
  for (const Rss& r : rss) {
    if (r.t >= warmup) after_warmup.push_back(&r);
  }
  const size_t stride = std::max<size_t>(1, (after_warmup.size() + kTrendPoints - 1) / kTrendPoints);
  std::vector<double> trend_t, trend_rss, trend_anon;
  for (size_t i = 0; i < after_warmup.size(); i += stride) {
    trend_t.push_back(after_warmup[i]->t);
    trend_rss.push_back(double(after_warmup[i]->rss_kib));
    trend_anon.push_back(double(after_warmup[i]->anon_kib));
  }
  const Line rss_line = theil_sen(trend_t, trend_rss), anon_line = theil_sen(trend_t, trend_anon);
  const double end_s = to_ms(run_s);
  auto trend_growth = [&](const Line& l) {
    return l.at(warmup) > 0 ? 100.0 * (l.at(end_s) - l.at(warmup)) / l.at(warmup) : 0;
  };
  const double growth = trend_growth(rss_line), anon_growth = trend_growth(anon_line);
  const double max_growth = absl::GetFlag(FLAGS_soak_max_rss_growth_pct);
  if (rss_start.rss_kib == 0 || trend_t.size() < 2) {
    failures.push_back(absl::StrFormat("the daemon's RSS could not be read (%d samples after the %.0f s warm-up)",
                                       trend_t.size(), warmup));
  }
  if (growth > max_growth) {
    failures.push_back(absl::StrFormat(
        "the daemon's RSS grew %.2f%% along its trend (%.0f -> %.0f KiB from %.0f s to the end), above "
        "--soak_max_rss_growth_pct=%g",
        growth, rss_line.at(warmup), rss_line.at(end_s), warmup, max_growth));
  }
  // Each deliberate crash leaves one session to its lease; any other expiry is a live worker's.
  if (lease_expiries != uint64_t(crashes_seen)) {
    failures.push_back(absl::StrFormat("%d lease expiries but %d crashes: a live worker lost its session",
                                       lease_expiries, crashes_seen));
  }
  if (unexpected_errors > 0) failures.push_back(absl::StrFormat("%d unexpected errors", unexpected_errors));
  if (step_mismatches > 0) failures.push_back(absl::StrFormat("%d Step outputs differ from the reference", step_mismatches));
  if (kv_mismatches > 0) failures.push_back(absl::StrFormat("%d ReadKV caches differ from what was appended", kv_mismatches));
  const bool pass = failures.empty() && unexpected_exits == 0;

  // Report.
  std::string report = absl::StrFormat(
      "karakv-bench soak: %d workers x %.1f s (seed %d), one karakvd on a Unix socket, lease %d s, pool %d blocks "
      "of %d tokens; geometry %d layers, %d/%d heads, dim %d, fp16\n\n",
      workers, run_s, absl::GetFlag(FLAGS_seed), lease, pool_blocks, g.block_size, g.num_layers, g.num_q_heads,
      g.num_kv_heads, g.head_dim);
  absl::StrAppendFormat(&report, "%-10s %12s %10s\n", "operation", "count", "per s");
  for (int o = 0; o < kNumOps; ++o) absl::StrAppendFormat(&report, "%-10s %12d %10.1f\n", kOpNames[o], ops[o], ops[o] / run_s);
  absl::StrAppendFormat(&report, "%-10s %12d %10.1f\n\n", "all", ops_total, ops_total / run_s);
  absl::StrAppendFormat(&report, "%-20s %10s %10s  %s\n", "error code", "expected", "unexpected", "operations");
  for (int c = 0; c < kCodes; ++c) {
    if (errors[c][0] + errors[c][1] == 0) continue;
    std::vector<std::string> where;
    for (const auto& [op, n] : error_ops[c]) where.push_back(absl::StrCat(op, " ", n));
    absl::StrAppendFormat(&report, "%-20s %10d %10d  %s\n", c == 0 ? "OK (probe)" : code_name(c), errors[c][0],
                          errors[c][1], absl::StrJoin(where, ", "));
  }
  if (expected_errors + unexpected_errors == 0) absl::StrAppend(&report, "(none)\n");
  absl::StrAppendFormat(&report,
                        "\ninvariant checks      %d (failures %d)\n"
                        "Step outputs checked  %d layer outputs vs float64 reference (mismatches %d, max |err| %.3g, "
                        "%d samples skipped: compacted mid-check)\n"
                        "ReadKV caches checked %d against the appended K/V (mismatches %d)\n"
                        "pool use              peak %d of %d blocks (sampled each second)\n"
                        "worker crashes        %d (restarts %d, unexpected exits %d); daemon lease expiries %d\n"
                        "resources returned    %s\n"
                        "daemon RSS            trend %.0f -> %.0f KiB from %.0f s to the end (Theil-Sen line through %d "
                        "samples), growth %+.2f%% (limit %g%%); RssAnon's trend %+.2f%%\n"
                        "                      start %d KiB (median over %.0f-%.0f s), end %d KiB (median over the last "
                        "%.0f s): %+.2f%%; max %d KiB\n"
                        "                      anon %d -> %d KiB, shmem %d -> %d KiB; malloc in use %d -> %d KiB, "
                        "held %d -> %d KiB; threads %d -> %d (max %d)\n",
                        invariant_checks, invariant_failures, step_checks, step_mismatches, max_err, skipped,
                        kv_checks, kv_mismatches, peak_blocks, pool_blocks, crashes_seen, restarts, unexpected_exits, lease_expiries,
                        drain_s >= 0 ? absl::StrFormat("all, %.1f s after the workers ended", drain_s) : "NO",
                        rss_line.at(warmup), rss_line.at(end_s), warmup, trend_t.size(), growth, max_growth, anon_growth,
                        rss_start.rss_kib, warmup, warmup + window, rss_end.rss_kib, window, window_growth, rss_max,
                        rss_start.anon_kib, rss_end.anon_kib, rss_start.shmem_kib, rss_end.shmem_kib,
                        rss_start.heap_in_use_kib, rss_end.heap_in_use_kib, rss_start.heap_held_kib,
                        rss_end.heap_held_kib, rss_start.threads, rss_end.threads, threads_max);
  // The trend apart from the second-to-second swings (the workers' staging mapped in comes and
  // goes with their sessions): medians of each whole minute.
  if (run_s >= 120) {
    std::vector<std::string> rss_by_minute, anon_by_minute;
    for (int m = 0; (m + 1) * 60 <= run_s + 1; ++m) {
      const Rss r = median_rss(rss, m * 60, m * 60 + 59.999);
      rss_by_minute.push_back(absl::StrCat(r.rss_kib));
      anon_by_minute.push_back(absl::StrCat(r.anon_kib));
    }
    absl::StrAppend(&report, "RSS by minute (KiB)   ", absl::StrJoin(rss_by_minute, " "), "\n",
                    "RssAnon by minute     ", absl::StrJoin(anon_by_minute, " "), "\n");
  }
  absl::StrAppend(&report, "\nresult: ", pass ? "PASS" : "FAIL", "\n");
  for (const std::string& f : failures) absl::StrAppend(&report, "  ", f, "\n");
  {
    std::ifstream in(dir.file("unexpected.log"));
    std::string line;
    int shown = 0;
    while (std::getline(in, line) && shown < 20) {
      if (shown++ == 0) absl::StrAppend(&report, "first unexpected errors:\n");
      absl::StrAppend(&report, "  ", line, "\n");
    }
  }
  std::printf("%s", report.c_str());

  // CSV: section,key,value.
  std::string csv = "section,key,value\n";
  auto row = [&](const std::string& section, const std::string& key, const std::string& value) {
    absl::StrAppend(&csv, section, ",", key, ",", value, "\n");
  };
  row("run", "workers", absl::StrCat(workers));
  row("run", "seconds", absl::StrFormat("%.1f", run_s));
  row("run", "seed", absl::StrCat(absl::GetFlag(FLAGS_seed)));
  row("run", "lease_seconds", absl::StrCat(lease));
  row("run", "warmup_s", absl::StrFormat("%.3f", warmup));
  row("run", "end_s", absl::StrFormat("%.3f", end_s));
  row("run", "pool_blocks", absl::StrCat(pool_blocks));
  for (int o = 0; o < kNumOps; ++o) row("ops", kOpNames[o], absl::StrCat(ops[o]));
  row("ops", "total", absl::StrCat(ops_total));
  row("ops", "per_s", absl::StrFormat("%.1f", ops_total / run_s));
  for (int c = 0; c < kCodes; ++c) {
    if (errors[c][0] > 0) row("errors_expected", code_name(c), absl::StrCat(errors[c][0]));
    if (errors[c][1] > 0) row("errors_unexpected", code_name(c), absl::StrCat(errors[c][1]));
  }
  row("errors", "expected", absl::StrCat(expected_errors));
  row("errors", "unexpected", absl::StrCat(unexpected_errors));
  row("checks", "invariant_checks", absl::StrCat(invariant_checks));
  row("checks", "invariant_failures", absl::StrCat(invariant_failures));
  row("checks", "step_outputs_checked", absl::StrCat(step_checks));
  row("checks", "step_mismatches", absl::StrCat(step_mismatches));
  row("checks", "step_checks_skipped", absl::StrCat(skipped));
  row("checks", "max_abs_err", absl::StrFormat("%.3g", max_err));
  row("checks", "readkv_checked", absl::StrCat(kv_checks));
  row("checks", "readkv_mismatches", absl::StrCat(kv_mismatches));
  row("daemon", "peak_blocks_used", absl::StrCat(peak_blocks));
  row("workers", "crashes", absl::StrCat(crashes_seen));
  row("workers", "restarts", absl::StrCat(restarts));
  row("workers", "unexpected_exits", absl::StrCat(unexpected_exits));
  row("daemon", "lease_expiries", absl::StrCat(lease_expiries));
  row("daemon", "drain_s", absl::StrFormat("%.1f", drain_s));
  row("rss", "start_kib", absl::StrCat(rss_start.rss_kib));
  row("rss", "end_kib", absl::StrCat(rss_end.rss_kib));
  row("rss", "window_growth_pct", absl::StrFormat("%.2f", window_growth));
  row("rss", "trend_points", absl::StrCat(trend_t.size()));
  row("rss", "trend_stride", absl::StrCat(stride));
  row("rss", "trend_start_kib", absl::StrFormat("%.3f", rss_line.at(warmup)));
  row("rss", "trend_end_kib", absl::StrFormat("%.3f", rss_line.at(end_s)));
  row("rss", "growth_pct", absl::StrFormat("%.4f", growth));
  row("rss", "anon_growth_pct", absl::StrFormat("%.4f", anon_growth));
  row("rss", "max_kib", absl::StrCat(rss_max));
  row("rss", "start_anon_kib", absl::StrCat(rss_start.anon_kib));
  row("rss", "end_anon_kib", absl::StrCat(rss_end.anon_kib));
  row("rss", "start_shmem_kib", absl::StrCat(rss_start.shmem_kib));
  row("rss", "end_shmem_kib", absl::StrCat(rss_end.shmem_kib));
  row("rss", "start_heap_in_use_kib", absl::StrCat(rss_start.heap_in_use_kib));
  row("rss", "end_heap_in_use_kib", absl::StrCat(rss_end.heap_in_use_kib));
  row("rss", "start_heap_held_kib", absl::StrCat(rss_start.heap_held_kib));
  row("rss", "end_heap_held_kib", absl::StrCat(rss_end.heap_held_kib));
  row("rss", "start_threads", absl::StrCat(rss_start.threads));
  row("rss", "end_threads", absl::StrCat(rss_end.threads));
  row("rss", "max_threads", absl::StrCat(threads_max));
  row("result", "verdict", pass ? "PASS" : "FAIL");
  if (!out_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(out_dir, ec);
    std::ofstream f(out_dir + "/soak.csv");
    f << csv;
    if (!f) {
      std::fprintf(stderr, "karakv-bench soak: cannot write %s/soak.csv\n", out_dir.c_str());
      return 1;
    }
    std::ofstream series(out_dir + "/soak_rss.csv");
    series << "t_s,rss_kib,anon_kib,shmem_kib,heap_in_use_kib,heap_held_kib,threads,sequences,blocks_used,query_cache_kib\n";
    for (const Rss& r : rss) {
      series << absl::StrFormat("%.3f,%d,%d,%d,%d,%d,%d,%d,%d,%d\n", r.t, r.rss_kib, r.anon_kib, r.shmem_kib,
                                r.heap_in_use_kib, r.heap_held_kib, r.threads, r.sequences, r.blocks_used,
                                r.query_cache_kib);
    }
    progress("soak: wrote " + out_dir + "/soak.csv and soak_rss.csv (the daemon's RSS each second)");
  }
  return pass ? 0 : 1;
}

}  // namespace karakv::bench
