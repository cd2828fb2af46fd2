// ThreadSanitizer cannot see inside Debian's libabsl (it is not instrumented), so every
// absl::Mutex lock and unlock is invisible to it and each access the mutex orders is reported as
// a race. Preloaded into the TSan runs (scripts/test.sh), this library stands in for the
// Mutex/CondVar entry points, calls the real ones and tells TSan the happens-before edge each
// creates: an unlock releases the mutex's address, a lock acquires it. Lock-order checking is not
// restored, only the ordering.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

#include "absl/synchronization/mutex.h"

extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);

namespace {
template <typename Fn>
Fn real(const char* name) {
  void* f = dlsym(RTLD_NEXT, name);
  if (f == nullptr) {
    std::fprintf(stderr, "tsan_absl_mutex: %s not found in libabsl\n", name);
    std::abort();
  }
  return reinterpret_cast<Fn>(f);
}
#define REAL(fn, type, mangled)                        \
  static const auto fn = real<type>(mangled)
}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  REAL(f, void (*)(Mutex*), "_ZN4absl7debian35Mutex4LockEv");
  f(this);
  __tsan_acquire(this);
}
void Mutex::ReaderLock() {
  REAL(f, void (*)(Mutex*), "_ZN4absl7debian35Mutex10ReaderLockEv");
  f(this);
  __tsan_acquire(this);
}
bool Mutex::TryLock() {
  REAL(f, bool (*)(Mutex*), "_ZN4absl7debian35Mutex7TryLockEv");
  const bool ok = f(this);
  if (ok) __tsan_acquire(this);
  return ok;
}
bool Mutex::ReaderTryLock() {
  REAL(f, bool (*)(Mutex*), "_ZN4absl7debian35Mutex13ReaderTryLockEv");
  const bool ok = f(this);
  if (ok) __tsan_acquire(this);
  return ok;
}
void Mutex::LockWhen(const Condition& c) {
  REAL(f, void (*)(Mutex*, const Condition&), "_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE");
  f(this, c);
  __tsan_acquire(this);
}
void Mutex::Await(const Condition& c) {
  REAL(f, void (*)(Mutex*, const Condition&), "_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE");
  __tsan_release(this);
  f(this, c);
  __tsan_acquire(this);
}
void Mutex::Unlock() {
  REAL(f, void (*)(Mutex*), "_ZN4absl7debian35Mutex6UnlockEv");
  __tsan_release(this);
  f(this);
}
void Mutex::ReaderUnlock() {
  REAL(f, void (*)(Mutex*), "_ZN4absl7debian35Mutex12ReaderUnlockEv");
  __tsan_release(this);
  f(this);
}
void CondVar::Wait(Mutex* mu) {
  REAL(f, void (*)(CondVar*, Mutex*), "_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE");
  __tsan_release(mu);
  f(this, mu);
  __tsan_acquire(mu);
}
bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration timeout) {
  REAL(f, bool (*)(CondVar*, Mutex*, absl::Duration), "_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  __tsan_release(mu);
  const bool r = f(this, mu, timeout);
  __tsan_acquire(mu);
  return r;
}
bool CondVar::WaitWithDeadline(Mutex* mu, absl::Time deadline) {
  REAL(f, bool (*)(CondVar*, Mutex*, absl::Time), "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  __tsan_release(mu);
  const bool r = f(this, mu, deadline);
  __tsan_acquire(mu);
  return r;
}

ABSL_NAMESPACE_END
}  // namespace absl
