// CUDA emulator, part 1: the execution engine (worker pool, block barrier, warp rendezvous, launch loop).
// Included by cuda_emu.h; not meant to be included on its own.
//
// Why it is built this way:
// - A block's threads are real host threads running at the same time, so shared memory, barriers and races
//   behave as on the GPU and ThreadSanitizer sees every unsynchronised access. Blocks run one after another
//   (a GPU gives no order or concurrency guarantee between blocks, so this is one legal schedule).
// - Threads come from a persistent pool (grown on demand, at most 1024): creating 256 threads per block
//   would cost more than the kernel. A pool worker is not tied to a thread index; it claims the next free
//   index of the current block from one atomic word.
// - All cross-thread hand-offs are GCC __atomic operations with acquire/release order (ThreadSanitizer models
//   them exactly). Sleeping uses the Linux futex on the same words (elsewhere a condvar fallback); the futex is
//   only a sleep, never the synchronisation, so TSan needs no knowledge of it.
// - Every wait has a deadline (MEGAKERNELS_EMU_TIMEOUT_S, default 60 s): a deadlock prints what was waiting
//   for whom and aborts instead of hanging a test run.
#pragma once

#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <condition_variable>
#endif

namespace mk_emu {
namespace detail {

constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxWarps = kMaxThreadsPerBlock / 32;
constexpr size_t kSmemAlign = 128;
constexpr unsigned char kSmemPoison = 0xFF;  // fresh dynamic smem reads as NaN / -1: uninitialised reads show

// ---- atomics (GCC builtins: understood by ThreadSanitizer, no std::atomic_ref needed) -----------------------
template <class T>
inline T load_acq(const T* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
template <class T>
inline T load_rlx(const T* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
template <class T>
inline void store_rel(T* p, T v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
template <class T>
inline void store_rlx(T* p, T v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// ---- sleeping on a 32-bit word ------------------------------------------------------------------------------
#if defined(__linux__)
inline void os_wait(uint32_t* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts{};
  timespec* tp = nullptr;
  if (timeout_ns >= 0) {
    ts.tv_sec = static_cast<time_t>(timeout_ns / 1000000000);
    ts.tv_nsec = static_cast<long>(timeout_ns % 1000000000);
    tp = &ts;
  }
  syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, expected, tp, nullptr, 0);
}
inline void os_wake(uint32_t* word, int count) { syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0); }
#else
struct Parking {
  std::mutex mu;
  std::condition_variable cv;
};
inline Parking& parking() {
  static Parking p;
  return p;
}
inline void os_wait(uint32_t* word, uint32_t expected, int64_t timeout_ns) {
  std::unique_lock<std::mutex> lk(parking().mu);
  if (load_acq(word) != expected) return;
  int64_t t = timeout_ns < 0 || timeout_ns > 10000000 ? 10000000 : timeout_ns;
  parking().cv.wait_for(lk, std::chrono::nanoseconds(t));
}
inline void os_wake(uint32_t*, int) {
  { std::lock_guard<std::mutex> lk(parking().mu); }
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
inline double timeout_seconds() {
  static const double t = [] {
    const char* e = std::getenv("MEGAKERNELS_EMU_TIMEOUT_S");
    double v = e ? std::atof(e) : 60.0;
    return v > 0 ? v : 60.0;
  }();
  return t;
}
inline int64_t timeout_ns() { return static_cast<int64_t>(timeout_seconds() * 1e9); }

// ---- fatal errors: print once, then abort (never hang) ------------------------------------------------------
[[noreturn]] inline void fatal_stop() {
  static int reported = 0;
  if (__atomic_exchange_n(&reported, 1, __ATOMIC_ACQ_REL)) {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // another thread is already aborting
  }
  std::fflush(stdout);
  std::fflush(stderr);
  std::abort();
}

// ---- per-block state ----------------------------------------------------------------------------------------
enum class WarpOp : uint8_t { Sync, Shfl, Vote, Match, ReduceAdd, ReduceMinS, ReduceMinU, ReduceMaxS, ReduceMaxU,
                              ReduceAnd, ReduceOr, ReduceXor };

// Where each thread is, for deadlock reports only.
enum ThreadState : uint8_t { kRunning = 0, kAtSyncthreads = 1, kAtWarpOp = 2, kExited = 3 };

// One pending warp-level rendezvous: the lanes that called a *_sync intrinsic with the same mask.
struct Rendezvous {
  uint32_t mask;
  uint32_t arrived;
  WarpOp op;
  const char* name;
};

// Warp-level ops meet under a small mutex (at most 32 contenders); the completing lane computes every
// participant's result into its private `out` slot, so one meeting per shuffle suffices (no second barrier
// to protect an exchange buffer from being overwritten by the next shuffle).
struct alignas(64) Warp {
  std::mutex mu;
  uint32_t exist = 0;   // lanes that exist (the last warp of a block may be partial)
  uint32_t exited = 0;  // lanes whose thread returned from the kernel
  int npending = 0;
  Rendezvous pending[32];
  uint64_t in[32];
  int src[32];
  uint64_t out[32];
  uint32_t done_seq[32] = {};  // bumped (release) when a lane's rendezvous completes
  Signal epoch;                // epoch.seq bumped after each completion
};

struct Block {
  // Launch-wide (written by the launcher before any worker claims an index).
  void (*tramp)(const void*) = nullptr;
  const void* args = nullptr;
  const char* kernel_name = "";
  unsigned nthreads = 0, nwarps = 0;
  unsigned bdim[3] = {1, 1, 1};
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
  unsigned bidx[3] = {0, 0, 0};
  // __syncthreads: one 64-bit word, low half = threads arrived, high half = live (not exited) threads, so an
  // arrival and an exit can both decide atomically whether they completed the barrier.
  uint64_t bar_word = 0;
  Signal bar;            // bar.seq: barrier generation, bumped when a barrier completes
  uint32_t pred[2] = {0, 0};  // __syncthreads_count/and/or accumulator, double-buffered by generation parity
  Signal fin;            // fin.seq: threads of the block that finished
  uint8_t state[kMaxThreadsPerBlock];
  const char* op_name[kMaxThreadsPerBlock];
  Warp warps[kMaxWarps];
};

struct ThreadCtx {
  Block* blk;
  unsigned tid, lane, warp;
};

inline thread_local ThreadCtx* t_ctx = nullptr;
inline thread_local uint3 t_thread_idx{0, 0, 0};
inline thread_local uint3 t_block_idx{0, 0, 0};
inline dim3 g_block_dim{1, 1, 1};
inline dim3 g_grid_dim{1, 1, 1};

inline ThreadCtx& ctx(const char* what) {
  ThreadCtx* c = t_ctx;
  if (!c) {
    std::fprintf(stderr, "[megakernels cuda_emu] %s called outside an emulated kernel\n", what);
    fatal_stop();
  }
  return *c;
}

inline void describe_thread(char* buf, size_t n, const Block& b, unsigned tid) {
  unsigned bx = b.bdim[0], by = b.bdim[1];
  std::snprintf(buf, n, "thread (%u,%u,%u) [linear %u, warp %u, lane %u]", tid % bx, (tid / bx) % by,
                tid / (bx * by), tid, tid / 32, tid % 32);
}

[[noreturn]] inline void report_deadlock(const ThreadCtx& c, const char* what, const char* detail) {
  const Block& b = *c.blk;
  char me[128];
  describe_thread(me, sizeof me, b, c.tid);
  std::fprintf(stderr,
               "[megakernels cuda_emu] deadlock: %s not completed within %.3g s (MEGAKERNELS_EMU_TIMEOUT_S)\n"
               "  kernel %s, block (%u,%u,%u), waiting: %s\n  %s\n",
               what, timeout_seconds(), b.kernel_name, b.bidx[0], b.bidx[1], b.bidx[2], me, detail);
  unsigned shown = 0;
  for (unsigned t = 0; t < b.nthreads && shown < 16; ++t) {
    uint8_t s = load_rlx(&b.state[t]);
    if (t == c.tid || s == kExited) continue;
    char who[128];
    describe_thread(who, sizeof who, b, t);
    const char* where = s == kAtSyncthreads ? "waits in __syncthreads" : s == kAtWarpOp ? "waits in" : "is running";
    std::fprintf(stderr, "  %s %s%s%s\n", who, where, s == kAtWarpOp ? " " : "",
                 s == kAtWarpOp ? load_rlx(&b.op_name[t]) : "");
    ++shown;
  }
  fatal_stop();
}

inline int yield_budget() {
  static const int n = [] {
    const char* e = std::getenv("MEGAKERNELS_EMU_YIELDS");
    return e ? std::atoi(e) : 50;
  }();
  return n;
}

// Waits until done() holds; `s.seq` moves whenever done() may have become true. When the block's threads fit
// on the CPUs a short busy spin is cheapest. When they do not (256 threads on a laptop), the waiter yields
// its core instead: the threads that still have to arrive get to run, and once the barrier opens each waiter
// is back within one pass of the run queue, which costs far less than a futex sleep and wake per thread.
// Only after that does it sleep on the futex.
template <class Done, class OnTimeout>
inline void wait_until(Signal& s, unsigned nthreads, Done done, OnTimeout on_timeout) {
  static const unsigned ncpu = std::thread::hardware_concurrency();
  if (nthreads <= ncpu) {
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

// ---- __syncthreads ------------------------------------------------------------------------------------------
// `waiters`: threads asleep on this barrier (all arrivals but the completer's own, if it arrived).
inline void complete_block_barrier(Block& b, uint64_t word, uint32_t gen, uint32_t waiters) {
  // Every live thread has arrived and waits: nobody else touches the barrier until bar.seq moves.
  store_rlx(&b.bar_word, word & ~uint64_t(0xffffffff));
  store_rlx(&b.pred[(gen + 1) & 1], 0u);
  __atomic_store_n(&b.bar.seq, gen + 1, __ATOMIC_SEQ_CST);
  if (waiters) signal_wake(b.bar);
}

// Returns the number of live threads whose `pred` was non-zero (meaningful only if count_pred).
inline int block_barrier(const char* what, bool count_pred, int pred) {
  ThreadCtx& c = ctx(what);
  Block& b = *c.blk;
  const uint32_t gen = load_acq(&b.bar.seq);
  if (count_pred && pred) __atomic_fetch_add(&b.pred[gen & 1], 1u, __ATOMIC_RELAXED);
  store_rlx(&b.state[c.tid], uint8_t(kAtSyncthreads));
  const uint64_t w = __atomic_add_fetch(&b.bar_word, 1, __ATOMIC_ACQ_REL);
  if (uint32_t(w) == uint32_t(w >> 32)) {
    complete_block_barrier(b, w, gen, uint32_t(w) - 1);
  } else {
    wait_until(
        b.bar, b.nthreads, [&] { return load_acq(&b.bar.seq) != gen; },
        [&] {
          uint64_t now = load_acq(&b.bar_word);
          char d[128];
          std::snprintf(d, sizeof d, "%u of %u live threads arrived", uint32_t(now), uint32_t(now >> 32));
          report_deadlock(c, what, d);
        });
  }
  store_rlx(&b.state[c.tid], uint8_t(kRunning));
  return count_pred ? int(load_rlx(&b.pred[gen & 1])) : 0;
}

// ---- warp rendezvous ----------------------------------------------------------------------------------------
enum class ShflMode : uint8_t { Idx, Up, Down, Xor };

// Source lane of a shuffle, as the PTX ISA defines shfl.sync: a lane outside its width-segment reads itself
// (up/down/xor), and xor may reach *earlier* segments (the documented quirk of __shfl_xor_sync).
inline int shfl_source(ShflMode m, int lane, int b, int width) {
  const int segmask = 32 - width;
  const int cval = m == ShflMode::Up ? 0 : 31;
  const int max_lane = (lane & segmask) | (cval & ~segmask);
  const int min_lane = lane & segmask;
  int j = lane;
  bool ok = false;
  switch (m) {
    case ShflMode::Up: j = lane - b; ok = j >= max_lane; break;
    case ShflMode::Down: j = lane + b; ok = j <= max_lane; break;
    case ShflMode::Xor: j = lane ^ b; ok = j <= max_lane && j >= 0; break;
    case ShflMode::Idx: j = min_lane | (b & ~segmask & 31); ok = true; break;
  }
  return ok ? j : lane;
}

constexpr uint64_t kShflPoison = ~uint64_t(0);  // read from a lane that does not take part: all bits set

inline void compute_results(Warp& w, const Rendezvous& r) {
  const uint32_t p = r.arrived;
  switch (r.op) {
    case WarpOp::Sync: break;
    case WarpOp::Shfl:
      for (uint32_t m = p; m; m &= m - 1) {
        int l = __builtin_ctz(m);
        int s = w.src[l];
        w.out[l] = (p >> s) & 1u ? w.in[s] : kShflPoison;
      }
      break;
    case WarpOp::Vote: {
      uint64_t ballot = 0;
      for (uint32_t m = p; m; m &= m - 1) ballot |= uint64_t(w.in[__builtin_ctz(m)] != 0) << __builtin_ctz(m);
      for (uint32_t m = p; m; m &= m - 1) w.out[__builtin_ctz(m)] = ballot | (uint64_t(p) << 32);
      break;
    }
    case WarpOp::Match: {
      bool all = true;
      for (uint32_t m = p; m; m &= m - 1) {
        int l = __builtin_ctz(m);
        uint32_t same = 0;
        for (uint32_t k = p; k; k &= k - 1) same |= uint32_t(w.in[__builtin_ctz(k)] == w.in[l]) << __builtin_ctz(k);
        w.out[l] = same;
        all = all && same == p;
      }
      if (all)
        for (uint32_t m = p; m; m &= m - 1) w.out[__builtin_ctz(m)] |= uint64_t(1) << 32;
      break;
    }
    default: {
      uint64_t acc = w.in[__builtin_ctz(p)];
      for (uint32_t m = p & (p - 1); m; m &= m - 1) {
        uint64_t v = w.in[__builtin_ctz(m)];
        switch (r.op) {
          case WarpOp::ReduceAdd: acc = uint32_t(acc + v); break;
          case WarpOp::ReduceMinS: acc = int32_t(v) < int32_t(acc) ? v : acc; break;
          case WarpOp::ReduceMinU: acc = uint32_t(v) < uint32_t(acc) ? v : acc; break;
          case WarpOp::ReduceMaxS: acc = int32_t(v) > int32_t(acc) ? v : acc; break;
          case WarpOp::ReduceMaxU: acc = uint32_t(v) > uint32_t(acc) ? v : acc; break;
          case WarpOp::ReduceAnd: acc &= v; break;
          case WarpOp::ReduceOr: acc |= v; break;
          case WarpOp::ReduceXor: acc ^= v; break;
          default: break;
        }
      }
      for (uint32_t m = p; m; m &= m - 1) w.out[__builtin_ctz(m)] = acc;
    }
  }
}

// Completes every pending rendezvous whose live participants have all arrived. Caller holds w.mu.
inline bool complete_ready(Warp& w) {
  bool any = false;
  const uint32_t live = w.exist & ~w.exited;
  for (int i = 0; i < w.npending;) {
    Rendezvous& r = w.pending[i];
    const uint32_t need = r.mask & live;
    if (r.arrived == need && need) {
      compute_results(w, r);
      for (uint32_t m = r.arrived; m; m &= m - 1) {
        uint32_t* seq = &w.done_seq[__builtin_ctz(m)];
        store_rel(seq, load_rlx(seq) + 1);
      }
      w.pending[i] = w.pending[--w.npending];
      any = true;
    } else {
      ++i;
    }
  }
  return any;
}

[[noreturn]] inline void warp_misuse(const ThreadCtx& c, const char* name, const char* msg) {
  char me[128];
  describe_thread(me, sizeof me, *c.blk, c.tid);
  std::fprintf(stderr, "[megakernels cuda_emu] %s: %s\n  kernel %s, block (%u,%u,%u), %s\n", name, msg,
               c.blk->kernel_name, c.blk->bidx[0], c.blk->bidx[1], c.blk->bidx[2], me);
  fatal_stop();
}

// The calling lane joins the rendezvous of `mask`; returns its result once every live lane of the mask joined.
inline uint64_t warp_meet(const char* name, WarpOp op, uint32_t mask, uint64_t value, int src) {
  ThreadCtx& c = ctx(name);
  Block& b = *c.blk;
  Warp& w = b.warps[c.warp];
  const uint32_t bit = 1u << c.lane;
  char msg[192];
  if (!(mask & bit)) {
    std::snprintf(msg, sizeof msg, "the calling lane %u is not in mask 0x%08x", c.lane, mask);
    warp_misuse(c, name, msg);
  }
  std::unique_lock<std::mutex> lk(w.mu);
  w.in[c.lane] = value;
  w.src[c.lane] = src;
  const uint32_t seq = load_rlx(&w.done_seq[c.lane]);
  Rendezvous* r = nullptr;
  for (int i = 0; i < w.npending; ++i) {
    Rendezvous& o = w.pending[i];
    if (o.mask == mask) {
      r = &o;
    } else if ((o.mask & bit) && (o.arrived & mask)) {
      // Lanes of `o` wait for this lane while this lane would wait for them: the masks do not agree.
      std::snprintf(msg, sizeof msg, "mask 0x%08x disagrees with mask 0x%08x of lanes 0x%08x (in %s) that wait "
                    "for this lane: a certain deadlock", mask, o.mask, o.arrived, o.name);
      warp_misuse(c, name, msg);
    }
  }
  if (r && r->op != op) {
    std::snprintf(msg, sizeof msg, "lanes 0x%08x of the same mask 0x%08x wait in a different warp intrinsic (%s)",
                  r->arrived, mask, r->name);
    warp_misuse(c, name, msg);
  }
  if (!r) {
    r = &w.pending[w.npending++];
    *r = Rendezvous{mask, 0, op, name};
  }
  const bool others_waiting = r->arrived != 0;
  r->arrived |= bit;
  complete_ready(w);                               // may remove *r
  if (load_rlx(&w.done_seq[c.lane]) != seq) {  // this lane completed the rendezvous
    lk.unlock();
    if (others_waiting) signal_bump(w.epoch);
  } else {
    lk.unlock();
    store_rlx(&b.op_name[c.tid], name);
    store_rlx(&b.state[c.tid], uint8_t(kAtWarpOp));
    wait_until(
        w.epoch, b.nthreads, [&] { return load_acq(&w.done_seq[c.lane]) != seq; },
        [&] {
          std::lock_guard<std::mutex> g(w.mu);
          uint32_t arrived = 0;
          for (int i = 0; i < w.npending; ++i)
            if (w.pending[i].mask == mask) arrived = w.pending[i].arrived;
          char d[160];
          std::snprintf(d, sizeof d, "mask 0x%08x: lanes arrived 0x%08x, live lanes 0x%08x", mask, arrived,
                        w.exist & ~w.exited);
          report_deadlock(c, name, d);
        });
    store_rlx(&b.state[c.tid], uint8_t(kRunning));
  }
  return w.out[c.lane];
}

// ---- thread exit: an exited thread no longer holds up __syncthreads or *_sync of its warp ------------------
inline void thread_exit(ThreadCtx& c) {
  Block& b = *c.blk;
  store_rlx(&b.state[c.tid], uint8_t(kExited));
  const uint64_t w = __atomic_sub_fetch(&b.bar_word, uint64_t(1) << 32, __ATOMIC_ACQ_REL);
  if (uint32_t(w) != 0 && uint32_t(w) == uint32_t(w >> 32)) complete_block_barrier(b, w, load_acq(&b.bar.seq), uint32_t(w));
  Warp& wp = b.warps[c.warp];
  bool woke;
  {
    std::lock_guard<std::mutex> lk(wp.mu);
    wp.exited |= 1u << c.lane;
    woke = complete_ready(wp);
  }
  if (woke) signal_bump(wp.epoch);
}

// ---- the worker pool ----------------------------------------------------------------------------------------
struct Pool {
  // Claim word: bits 0-15 next thread index, 16-31 threads in the block, 32-63 block sequence number. Idle
  // workers claim indices with a CAS, so which worker runs which CUDA thread does not matter.
  uint64_t claim = 0;
  Signal start;  // start.seq bumped when a block is published
  unsigned nworkers = 0;
  Block blk;
#if defined(__linux__)
  pid_t pid = getpid();
#endif
};

inline void run_claimed(Block& b, unsigned tid) {
  const unsigned n = b.nthreads;
  ThreadCtx c{&b, tid, tid & 31u, tid >> 5};
  t_ctx = &c;
  t_thread_idx = uint3{tid % b.bdim[0], (tid / b.bdim[0]) % b.bdim[1], tid / (b.bdim[0] * b.bdim[1])};
  t_block_idx = uint3{b.bidx[0], b.bidx[1], b.bidx[2]};
  b.tramp(b.args);
  thread_exit(c);
  t_ctx = nullptr;
  if (__atomic_add_fetch(&b.fin.seq, 1u, __ATOMIC_SEQ_CST) == n) signal_wake(b.fin);
}

inline void worker_loop(Pool* p) {
  for (;;) {
    const uint32_t e = __atomic_load_n(&p->start.seq, __ATOMIC_SEQ_CST);
    uint64_t c = load_acq(&p->claim);
    for (;;) {
      const unsigned next = unsigned(c & 0xffff), n = unsigned((c >> 16) & 0xffff);
      if (next >= n) break;
      if (__atomic_compare_exchange_n(&p->claim, &c, c + 1, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        run_claimed(p->blk, next);
        c = load_acq(&p->claim);
      }
    }
    // Idle workers sleep at once: staying runnable would steal the CPU from the block that runs.
    __atomic_fetch_add(&p->start.sleepers, 1u, __ATOMIC_SEQ_CST);
    os_wait(&p->start.seq, e, -1);
    __atomic_fetch_sub(&p->start.sleepers, 1u, __ATOMIC_SEQ_CST);
  }
}

#if defined(__linux__)
inline void* worker_main(void* p) {
  worker_loop(static_cast<Pool*>(p));
  return nullptr;
}
#endif

inline void grow_pool(Pool& p, unsigned n) {
  while (p.nworkers < n) {
#if defined(__linux__)
    // Small explicit stacks: 1024 workers x the 8 MiB default would reserve 8 GiB of address space.
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, size_t(4) << 20);
    pthread_t th;
    int rc = pthread_create(&th, &attr, worker_main, &p);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
      std::fprintf(stderr, "[megakernels cuda_emu] cannot start worker thread %u (error %d)\n", p.nworkers, rc);
      fatal_stop();
    }
    pthread_detach(th);
#else
    std::thread(worker_loop, &p).detach();
#endif
    ++p.nworkers;
  }
}

// The pool lives for the whole process (workers sleep between launches; nothing to tear down at exit). After
// fork() the child has none of the parent's workers, so a pool created by another process is replaced.
inline Pool& pool() {
  static Pool* p = nullptr;
#if defined(__linux__)
  if (p && p->pid != getpid()) p = nullptr;  // leaked on purpose: its memory belongs to the parent's threads
#endif
  if (!p) p = new Pool();
  return *p;
}

inline std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

inline uint64_t progress(Block& b) {
  uint64_t s = load_rlx(&b.fin.seq) + (uint64_t(load_rlx(&b.bar.seq)) << 20);
  for (unsigned i = 0; i < b.nwarps; ++i) s += uint64_t(load_rlx(&b.warps[i].epoch.seq)) << 40;
  return s;
}

// Runs every block of a validated launch. Caller holds launch_mutex().
inline void run_grid(const char* name, void (*tramp)(const void*), const void* args, dim3 grid, dim3 block,
                     size_t smem_bytes) {
  Pool& p = pool();
  Block& b = p.blk;
  const unsigned n = block.x * block.y * block.z;
  grow_pool(p, n);
  b.tramp = tramp;
  b.args = args;
  b.kernel_name = name;
  b.nthreads = n;
  b.nwarps = (n + 31) / 32;
  b.bdim[0] = block.x;
  b.bdim[1] = block.y;
  b.bdim[2] = block.z;
  b.smem_bytes = smem_bytes;
  // Exactly the requested size (AddressSanitizer flags any overrun), 128-byte aligned like the GPU's window.
  b.smem = static_cast<unsigned char*>(::operator new(smem_bytes ? smem_bytes : 1, std::align_val_t(kSmemAlign)));
  g_block_dim = block;
  g_grid_dim = grid;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        b.bidx[0] = x;
        b.bidx[1] = y;
        b.bidx[2] = z;
        std::memset(b.smem, kSmemPoison, smem_bytes);  // GPU shared memory starts undefined, not zero
        store_rlx(&b.bar_word, uint64_t(n) << 32);
        store_rlx(&b.pred[0], 0u);
        store_rlx(&b.pred[1], 0u);
        store_rlx(&b.fin.seq, 0u);
        std::memset(b.state, kRunning, n);
        for (unsigned t = 0; t < n; ++t) b.op_name[t] = "a warp intrinsic";
        for (unsigned wi = 0; wi < b.nwarps; ++wi) {
          Warp& w = b.warps[wi];
          unsigned lanes = n - wi * 32 >= 32 ? 32 : n - wi * 32;
          w.exist = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
          w.exited = 0;
          w.npending = 0;
        }
        const uint64_t seq = (load_rlx(&p.claim) >> 32) + 1;
        store_rel(&p.claim, (seq << 32) | (uint64_t(n) << 16));
        __atomic_fetch_add(&p.start.seq, 1u, __ATOMIC_SEQ_CST);
        signal_wake(p.start, int(n));
        // Wait for the block; give up only after a whole timeout without any progress (a thread spinning on
        // another block's flag can never finish here: blocks run one after another).
        uint64_t last = progress(b);
        int64_t deadline = now_ns() + timeout_ns() + 2000000000;
        for (int i = yield_budget(); i > 0 && load_acq(&b.fin.seq) != n; --i) std::this_thread::yield();
        for (;;) {
          const uint32_t d = __atomic_load_n(&b.fin.seq, __ATOMIC_SEQ_CST);
          if (d == n) break;
          int64_t t = now_ns();
          uint64_t pr = progress(b);
          if (pr != last) {
            last = pr;
            deadline = t + timeout_ns() + 2000000000;
          } else if (t > deadline) {
            std::fprintf(stderr,
                         "[megakernels cuda_emu] deadlock: block (%u,%u,%u) of kernel %s made no progress for "
                         "%.3g s (%u of %u threads finished). A thread is stuck outside a barrier: an endless "
                         "loop, or spin-waiting for another block (blocks run one after another here)\n",
                         x, y, z, name, timeout_seconds(), d, n);
            fatal_stop();
          }
          __atomic_fetch_add(&b.fin.sleepers, 1u, __ATOMIC_SEQ_CST);
          os_wait(&b.fin.seq, d, 250000000);
          __atomic_fetch_sub(&b.fin.sleepers, 1u, __ATOMIC_SEQ_CST);
        }
      }
  ::operator delete(b.smem, std::align_val_t(kSmemAlign));
  b.smem = nullptr;
}

}  // namespace detail
}  // namespace mk_emu
