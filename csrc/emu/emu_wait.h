// CUDA emulator: waiting without hanging — atomics helpers, futex sleep, the deadlock timeout, fatal reports.
// Included by cuda_emu.h.
//
// All cross-thread hand-offs are GCC __atomic operations (ThreadSanitizer models them exactly; no std::barrier
// or std::atomic_ref, which C++17 lacks). Sleeping uses the Linux futex on the same words (elsewhere a
// condvar fallback); the futex is only a sleep, never the synchronisation, so TSan needs no knowledge of it.
// Every wait has a deadline (MEGAKERNELS_EMU_TIMEOUT_S, default 60 s): a deadlock prints what was waiting for
// whom and aborts instead of hanging a test run.
#pragma once

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <condition_variable>
#include <mutex>
#endif

#include "emu_fiber.h"

namespace mk_emu {
namespace detail {

// ---- atomics (GCC builtins: understood by ThreadSanitizer, no std::atomic_ref needed) -----------------------
template <class T>
inline T load_acq(const T* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
template <class T>
inline T load_rlx(const T* p) {
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
template <class T>
inline void store_rel(T* p, T v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
template <class T>
inline void store_rlx(T* p, T v) {
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// ---- sleeping on a 32-bit word ------------------------------------------------------------------------------
#if defined(__linux__)
inline void os_wait(uint32_t* word, uint32_t expected, int64_t ns) {
  timespec ts{};
  timespec* tp = nullptr;
  if (ns >= 0) {
    ts.tv_sec = static_cast<time_t>(ns / 1000000000);
    ts.tv_nsec = static_cast<long>(ns % 1000000000);
    tp = &ts;
  }
  syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, expected, tp, nullptr, 0);
}
inline void os_wake(uint32_t* word, int count) {
  syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
}
#else
struct Parking {
  std::mutex mu;
  std::condition_variable cv;
};
inline Parking& parking() {
  static Parking p;
  return p;
}
inline void os_wait(uint32_t* word, uint32_t expected, int64_t ns) {
  std::unique_lock<std::mutex> lk(parking().mu);
  if (load_acq(word) != expected) return;
  int64_t t = ns < 0 || ns > 10000000 ? 10000000 : ns;
  parking().cv.wait_for(lk, std::chrono::nanoseconds(t));
}
inline void os_wake(uint32_t*, int) {
  {
    std::lock_guard<std::mutex> lk(parking().mu);
  }
  parking().cv.notify_all();
}
#endif

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A futex word plus a count of threads asleep on it, so the common case (every waiter still spinning or
// yielding) completes a barrier without a wake-up system call.
struct Signal {
  uint32_t seq = 0;
  uint32_t sleepers = 0;
};
inline void signal_wake(Signal& s, int count = INT32_MAX) {
  if (__atomic_load_n(&s.sleepers, __ATOMIC_SEQ_CST)) os_wake(&s.seq, count);
}
inline void signal_bump(Signal& s) {
  __atomic_fetch_add(&s.seq, 1u, __ATOMIC_SEQ_CST);
  signal_wake(s);
}

// ---- configuration ------------------------------------------------------------------------------------------
// Deadlock timeout in ns (0 = not read yet): MEGAKERNELS_EMU_TIMEOUT_S in seconds, default 60, or
// mk_emu::set_timeout_seconds().
inline int64_t g_timeout_ns = 0;
inline int64_t timeout_ns() {
  int64_t t = __atomic_load_n(&g_timeout_ns, __ATOMIC_RELAXED);
  if (t > 0) return t;
  const char* e = std::getenv("MEGAKERNELS_EMU_TIMEOUT_S");
  double s = e ? std::atof(e) : 60.0;
  t = static_cast<int64_t>((s > 0 ? s : 60.0) * 1e9);
  int64_t zero = 0;
  __atomic_compare_exchange_n(&g_timeout_ns, &zero, t, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return __atomic_load_n(&g_timeout_ns, __ATOMIC_RELAXED);
}
inline double timeout_seconds() { return double(timeout_ns()) * 1e-9; }

// ---- fatal errors: the first thread to fail reports and aborts; any other one just waits for the end ------
inline void fatal_begin() {
  static int reported = 0;
  if (__atomic_exchange_n(&reported, 1, __ATOMIC_ACQ_REL))
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}
[[noreturn]] inline void fatal_stop() {
  std::fflush(stdout);
  std::fflush(stderr);
  std::abort();
}

// How often a waiter yields its CPU before it sleeps (MEGAKERNELS_EMU_YIELDS, default 50; a tuning knob only).
inline int yield_budget() {
  static const int n = [] {
    const char* e = std::getenv("MEGAKERNELS_EMU_YIELDS");
    return e ? std::atoi(e) : 50;
  }();
  return n;
}

// CPUs this process may run on (its affinity mask, e.g. under taskset or a container), not the machine's.
inline unsigned usable_cpus() {
  static const unsigned n = [] {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return unsigned(CPU_COUNT(&set));
#endif
    unsigned h = std::thread::hardware_concurrency();
    return h ? h : 1u;
  }();
  return n;
}

// Waits until done() holds; `s.seq` moves whenever done() may have become true. When the block's threads fit
// on the CPUs a short busy spin is cheapest. When they do not (256 threads on a laptop), the waiter yields
// its CPU instead: the threads that still have to arrive get to run, and once the barrier opens each waiter
// is back within one pass of the run queue — about one context switch per thread and barrier, against two
// plus a wake-up system call for a futex sleep. (Measured on 2 CPUs: 256 threads x 20 barriers ~5 ms
// yielding vs ~15 ms sleeping.) A waiter still waiting after its yields sleeps on the futex.
// Under fibers the waiter passes the CPU to the next thread of the block instead, until done() holds or every
// live thread waits in vain (on_timeout then reports the deadlock at once).
template <class Done, class OnTimeout>
inline void wait_until(Signal& s, unsigned nthreads, Done done, OnTimeout on_timeout) {
  if (t_fiber) {
    for (bool first = true; !done(); first = false)
      if (fiber_yield(true, first)) on_timeout();
    return;
  }
  if (nthreads <= usable_cpus()) {
    for (int i = 0; i < 4000; ++i) {
      if (done()) return;
      cpu_relax();
    }
  } else {
    for (int i = yield_budget(); i > 0; --i) {
      if (done()) return;
      std::this_thread::yield();
    }
  }
  const int64_t deadline = now_ns() + timeout_ns();
  for (;;) {
    const uint32_t seen = __atomic_load_n(&s.seq, __ATOMIC_SEQ_CST);
    if (done()) return;
    const int64_t left = deadline - now_ns();
    if (left <= 0) on_timeout();
    __atomic_fetch_add(&s.sleepers, 1u, __ATOMIC_SEQ_CST);
    os_wait(&s.seq, seen, left);
    __atomic_fetch_sub(&s.sleepers, 1u, __ATOMIC_SEQ_CST);
  }
}

}  // namespace detail
}  // namespace mk_emu
