// The byte format the fuzz harnesses read, and its writer (the seed corpus generator uses it).
// A reader never fails: past the end every value reads as zero and every byte string as empty, so
// any input is a valid program for a harness.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace karakv::fuzz {

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : p_(data), left_(size) {}
  bool empty() const { return left_ == 0; }
  uint8_t u8() {
    if (left_ == 0) return 0;
    --left_;
    return *p_++;
  }
  uint16_t u16() { return uint16_t(u8() | (uint16_t(u8()) << 8)); }
  uint64_t u64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t(u8()) << (8 * i);
    return v;
  }
  // Up to n bytes (fewer at the end of the input).
  std::string bytes(size_t n) {
    n = std::min(n, left_);
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    left_ -= n;
    return s;
  }
  // Copies up to n bytes into dst, zero-filling what the input lacks.
  void fill(void* dst, size_t n) {
    const size_t k = std::min(n, left_);
    std::memcpy(dst, p_, k);
    std::memset(static_cast<uint8_t*>(dst) + k, 0, n - k);
    p_ += k;
    left_ -= k;
  }

 private:
  const uint8_t* p_;
  size_t left_;
};

class Writer {
 public:
  Writer& u8(uint8_t v) {
    out_.push_back(char(v));
    return *this;
  }
  Writer& u16(uint16_t v) { return u8(uint8_t(v)).u8(uint8_t(v >> 8)); }
  Writer& u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) u8(uint8_t(v >> (8 * i)));
    return *this;
  }
  Writer& raw(const void* p, size_t n) {
    out_.append(static_cast<const char*>(p), n);
    return *this;
  }
  const std::string& str() const { return out_; }

 private:
  std::string out_;
};

// service_fuzzer: one byte of daemon options, then records of
//   op (u8, modulo kNumOps), session (u8), length (u16), body (length bytes)
// where body is the serialized request of method `op`. Session bytes below kKeepSessionId pick
// session (byte % live sessions) of those attached so far (the harness attaches one with staging
// before the first record); from kKeepSessionId up the body's session_id stays as it is.
enum ServiceOp : uint8_t {
  kAttach, kDetach, kHeartbeat, kCreateSequence, kForkSequence, kReleaseSequence, kAppend, kStep,
  kAttend, kReadKV, kStats, kListSequences, kCompact, kInspect, kLookup, kPing,
  kExpireLeases,   // body ignored: every lease ends (as an hour had passed)
  kWriteStaging,   // body: u16 offset, then bytes written to the session's staging there
  kAppendBatch,
  kNumOps
};
inline constexpr uint8_t kKeepSessionId = 0xc0;
// Daemon option bits (the first byte).
inline constexpr uint8_t kOptFloat16 = 1, kOptBFloat16 = 2, kOptNoPrefixCache = 4, kOptLimits = 8,
                         kOptSharedNamespaces = 16, kOptFastPathSession = 32;

// ring_fuzzer: one fast-path session with two sequences of 5 tokens each (ids 1 and 2; all of
// staging holds small floats), then records of op (u8, modulo kNumRingOps) and its operands:
enum RingOp : uint8_t {
  kSubmit,        // u8 id count n (modulo 9), Command::kHeaderBytes header bytes, n * 8 id bytes
  kPoll,          // the daemon runs what is waiting; the worker reads the completions
  kScribble,      // u8 which (sq_tail, cq_head, sq_head, cq_tail), u64 value: a hostile worker
  kSessionEvent,  // u8: detach, expire leases, heartbeat, release sequence 1
  kNumRingOps
};

}  // namespace karakv::fuzz
