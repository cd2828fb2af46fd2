// The decode fast path's shared-memory layout: a single-producer / single-consumer command ring
// (worker -> karakvd) and a completion ring (karakvd -> worker) at the end of a session's staging
// region, with futex doorbells. Both the SDK and the daemon include this header; neither trusts a
// value the other side wrote without checking it (see Consumer::pop and Producer::room).
#pragma once

#include <linux/futex.h>

#include <algorithm>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace karakv::ring {

inline constexpr uint32_t kMagic = 0x3152'4b4b;  // "KKR1"
inline constexpr uint32_t kVersion = 1;
inline constexpr uint32_t kSlots = 64;  // per ring, a power of two

enum class Op : uint32_t { kStep = 1, kAttend = 2, kAppend = 3, kReadKV = 4 };
// Header::ops, set by a daemon that takes more than Step and Attend (a daemon from before those
// ops left it zero, and closes a ring that sends one: the SDK checks the bit first).
inline constexpr uint32_t kOpsAppendReadKV = 1u << 0;
enum class State : uint32_t { kOpen = 0, kClosed = 1 };

struct Range {
  uint64_t offset;
  uint64_t length;
};

// One Append of a multi-sequence Append command: the AppendRequest's fields, every tensor in
// staging (k, v: [L][T][Hk][D] storage dtype; q: [L][Nq][Hq][D] fp32, length 0 when Nq is 0;
// token_ids: [T] int32, length 0 for none).
struct AppendEntry {
  uint64_t sequence_id;
  uint32_t num_tokens;
  uint32_t num_query_tokens;
  Range k, v, q, token_ids;
};
static_assert(sizeof(AppendEntry) == 80);

// One command, as the RPC would carry it with every tensor in staging.
//   Step:   count sequences in `ids`; k, v, q, out.
//   Attend: sequence_id, count = num_queries; q, out.
//   Append: count AppendEntry records (1..kMaxAppends) where `ids` is, run in order (append_entry).
//   ReadKV: sequence_id; k, v and out = positions, as ReadKVRequest's staging outputs.
struct Command {
  uint64_t tag;          // echoed in the completion
  uint32_t op;           // Op
  int32_t layer;
  float scale;
  uint32_t count;
  uint64_t sequence_id;
  Range k, v, q, out;
  static constexpr size_t kHeaderBytes = 96;
  static constexpr size_t kMaxIds = (4096 - kHeaderBytes) / 8;
  static constexpr size_t kMaxAppends = (4096 - kHeaderBytes) / sizeof(AppendEntry);
  uint64_t ids[kMaxIds];
};
static_assert(sizeof(Command) == 4096);

// The i-th Append of an Append command (copied, so a misaligned or rewritten slot cannot alias).
inline AppendEntry append_entry(const Command& c, size_t i) {
  AppendEntry e;
  std::memcpy(&e, reinterpret_cast<const uint8_t*>(c.ids) + i * sizeof(AppendEntry), sizeof e);
  return e;
}
inline void set_append_entry(Command& c, size_t i, const AppendEntry& e) {
  std::memcpy(reinterpret_cast<uint8_t*>(c.ids) + i * sizeof(AppendEntry), &e, sizeof e);
}

// The outcome: an absl::StatusCode and its message, and the reply's fields.
//   Step:   decode_step, compactions.
//   Append: compactions = entries applied (all of them when OK; a refused entry stops the command
//           and leaves no trace, the ones before it stay); decode_step = the last applied entry's
//           length; when OK, `message` holds each entry's length (uint32, append_length).
//   ReadKV: decode_step = tokens copied.
struct Completion {
  uint64_t tag;
  uint32_t code;
  uint32_t compactions;
  uint64_t decode_step;
  uint32_t message_bytes;
  uint32_t reserved;
  static constexpr size_t kMessageBytes = 512 - 32;
  char message[kMessageBytes];
};
static_assert(sizeof(Completion) == 512);
static_assert(Command::kMaxAppends * sizeof(uint32_t) <= Completion::kMessageBytes);

inline uint32_t append_length(const Completion& c, size_t i) {
  uint32_t n;
  std::memcpy(&n, c.message + i * sizeof n, sizeof n);
  return n;
}
inline void set_append_length(Completion& c, size_t i, uint32_t n) { std::memcpy(c.message + i * sizeof n, &n, sizeof n); }

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "the rings need lock-free atomics that work across processes");
static_assert(sizeof(std::atomic<uint32_t>) == 4, "futex words are 32-bit");

// Indices count up forever (uint64 never wraps in practice); slot = index % kSlots. Each index has
// one writer, on its own cache line so the two sides do not false-share.
struct Header {
  uint32_t magic;
  uint32_t version;
  uint32_t slots;
  uint32_t command_bytes;
  uint32_t completion_bytes;
  uint32_t ops;  // kOps* bits of the ops beyond Step and Attend that this daemon takes
  alignas(64) std::atomic<uint64_t> sq_tail;      // written by the worker
  alignas(64) std::atomic<uint64_t> sq_head;      // written by karakvd
  alignas(64) std::atomic<uint32_t> sq_doorbell;  // worker bumps it after each submit
  std::atomic<uint32_t> daemon_sleeping;          // karakvd is (about to be) in FUTEX_WAIT
  alignas(64) std::atomic<uint64_t> cq_tail;      // written by karakvd
  alignas(64) std::atomic<uint64_t> cq_head;      // written by the worker
  alignas(64) std::atomic<uint32_t> cq_doorbell;  // karakvd bumps it after each completion
  std::atomic<uint32_t> worker_sleeping;
  alignas(64) std::atomic<uint32_t> state;        // State; set by karakvd when it closes the ring
  uint32_t close_code;                            // absl::StatusCode of the reason
  char close_message[256];
};
static_assert(sizeof(Header) <= 4096);

inline constexpr size_t kCommandsOffset = 4096;
inline constexpr size_t kCompletionsOffset = kCommandsOffset + size_t(kSlots) * sizeof(Command);
inline constexpr size_t kRingBytes = kCompletionsOffset + size_t(kSlots) * sizeof(Completion);

inline Header* header(uint8_t* base) { return reinterpret_cast<Header*>(base); }
inline Command* commands(uint8_t* base) { return reinterpret_cast<Command*>(base + kCommandsOffset); }
inline Completion* completions(uint8_t* base) { return reinterpret_cast<Completion*>(base + kCompletionsOffset); }

// Called by karakvd on a zeroed region before the worker learns of it.
inline void initialize(uint8_t* base) {
  std::memset(base, 0, sizeof(Header));
  Header* h = header(base);
  h->magic = kMagic;
  h->version = kVersion;
  h->slots = kSlots;
  h->command_bytes = sizeof(Command);
  h->completion_bytes = sizeof(Completion);
  h->ops = kOpsAppendReadKV;
  h->state.store(uint32_t(State::kOpen), std::memory_order_release);
}

// The worker's check of what it mapped.
inline bool layout_matches(const uint8_t* base) {
  const Header* h = reinterpret_cast<const Header*>(base);
  return h->magic == kMagic && h->version == kVersion && h->slots == kSlots &&
         h->command_bytes == sizeof(Command) && h->completion_bytes == sizeof(Completion);
}

// Futexes on words of a MAP_SHARED mapping: no FUTEX_PRIVATE_FLAG, so they work across processes.
// Returns 0 when woken (or the word already differed), ETIMEDOUT, or EINTR.
inline int futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts{static_cast<time_t>(timeout_ns / 1'000'000'000), static_cast<long>(timeout_ns % 1'000'000'000)};
  const long r = syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
  if (r == 0) return 0;
  return errno == EAGAIN ? 0 : errno;
}
inline void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

inline int64_t monotonic_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

// How a waiting side spins before it sleeps on a futex. Each turn yields the CPU rather than
// pausing in place: the peer (and, in the daemon, the kernels' pool helpers) must run for the spin
// to end, and on a machine with few cores a spinner that does not yield steals exactly the time it
// is waiting for.
//
// But on a busy machine (other runnable tasks on every CPU) a yield hands the CPU to such a task
// for a whole time slice (0.75 ms and up; the peer's own turns, a command or a kernel helper's
// chunk, are far shorter), and a side that spins after each command loses a slice per command:
// ring Appends fell 50-400x under a CPU burner. A yield that took longer than kSlowYieldNs opens
// a window in which the side does not spin but sleeps on the futex at once; a woken sleeper runs
// ahead of a task that has been running (the scheduler's wake-up preemption), a yielder does not.
// Spinning saves ~10 us a command over a futex wake, a slow yield costs ~1-4 ms, so it pays only
// where slow yields are rarer than about one in a few hundred. Measured on the 2-CPU VM: quiet,
// 6 slow in 600,000 yields of a ring thread; with a burner per CPU, 184 in 500 (the rest quick).
// So windows double with each slow yield (to kMaxWindowNs: a busy machine loses about one slice
// per 100 ms) and fall back to kMinWindowNs only after kQuickYieldsToReset quick yields in a row
// (an odd slow yield on a quiet machine costs a millisecond of sleeping waits).
class SpinPolicy {
 public:
  static constexpr int64_t kSlowYieldNs = 250'000;
  static constexpr int64_t kMinWindowNs = 1'000'000;
  static constexpr int64_t kMaxWindowNs = 100'000'000;
  static constexpr int kQuickYieldsToReset = 1000;

  // Whether to spin now (false: inside a window, sleep instead).
  bool may_spin(int64_t now_ns) const { return now_ns >= no_spin_until_ns_; }
  // One turn: yields; returns false when the yield was slow (a window is open from now).
  bool spin_once() {
    const int64_t before = monotonic_ns();
    sched_yield();
    const int64_t after = monotonic_ns();
    return record(after - before, after);
  }
  // The bookkeeping of spin_once for a yield of `yield_ns` that ended at `now_ns`.
  bool record(int64_t yield_ns, int64_t now_ns) {
    if (yield_ns < kSlowYieldNs) {
      if (++quick_in_a_row_ >= kQuickYieldsToReset) window_ns_ = kMinWindowNs;
      return true;
    }
    quick_in_a_row_ = 0;
    no_spin_until_ns_ = now_ns + window_ns_;
    window_ns_ = std::min(kMaxWindowNs, window_ns_ * 2);
    return false;
  }

 private:
  int64_t no_spin_until_ns_ = 0;
  int64_t window_ns_ = kMinWindowNs;
  int quick_in_a_row_ = 0;
};

// The writing end of one ring. It keeps its own index: the shared copy is only published, never
// read back, so a peer that scribbles on it cannot move this side.
template <typename Entry>
class Producer {
 public:
  Producer(Entry* slots, std::atomic<uint64_t>* tail, std::atomic<uint64_t>* peer_head)
      : slots_(slots), tail_(tail), peer_head_(peer_head), next_(tail->load(std::memory_order_relaxed)) {}
  // Free slots, or -1 when the peer's head is impossible (ahead of our tail, or more than a ring
  // behind it): the ring is corrupt.
  int64_t room() const {
    const uint64_t used = next_ - peer_head_->load(std::memory_order_acquire);
    return used > kSlots ? -1 : int64_t(kSlots - used);
  }
  // Call only when room() > 0.
  void push(const Entry& e) {
    std::memcpy(&slots_[next_ % kSlots], &e, sizeof(Entry));
    ++next_;
    tail_->store(next_, std::memory_order_seq_cst);
  }
  uint64_t index() const { return next_; }

 private:
  Entry* slots_;
  std::atomic<uint64_t>* tail_;
  std::atomic<uint64_t>* peer_head_;
  uint64_t next_;
};

enum class PopResult { kEmpty, kOk, kCorrupt };

// The reading end. Entries are copied out before use, so a peer that rewrites a slot while it is
// being read can only make that one copy garbage, which the caller validates.
template <typename Entry>
class Consumer {
 public:
  Consumer(Entry* slots, std::atomic<uint64_t>* head, std::atomic<uint64_t>* peer_tail)
      : slots_(slots), head_(head), peer_tail_(peer_tail), next_(head->load(std::memory_order_relaxed)) {}
  // Entries waiting, or -1 when the peer's tail is impossible.
  int64_t depth() const {
    const uint64_t avail = peer_tail_->load(std::memory_order_acquire) - next_;
    return avail > kSlots ? -1 : int64_t(avail);
  }
  PopResult pop(Entry* out) {
    const int64_t d = depth();
    if (d < 0) return PopResult::kCorrupt;
    if (d == 0) return PopResult::kEmpty;
    std::memcpy(out, &slots_[next_ % kSlots], sizeof(Entry));
    ++next_;
    head_->store(next_, std::memory_order_seq_cst);
    return PopResult::kOk;
  }
  uint64_t index() const { return next_; }

 private:
  Entry* slots_;
  std::atomic<uint64_t>* head_;
  std::atomic<uint64_t>* peer_tail_;
  uint64_t next_;
};

}  // namespace karakv::ring
