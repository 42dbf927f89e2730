// CUDA emulator: the launch loop, and the two ways a block's threads run. Included by cuda_emu.h.
//
// Blocks run one after another (a GPU promises no order or concurrency between blocks, so this is one legal
// schedule). By default a block's threads are fibers on the launching thread (emu_fiber.h): they switch only
// where CUDA threads wait for each other, in user space. With MEGAKERNELS_EMU_FIBERS=0 they are real host
// threads running at the same time, from a persistent pool grown on demand up to 1024 (creating 256 threads
// per block would cost more than most kernels). A worker is not tied to a thread index; it claims the next
// free index of the current block from one atomic word, so any idle worker can serve any thread. Either way
// shared memory, barriers and races behave as on the GPU, and ThreadSanitizer sees every unsynchronised access.
#pragma once

#include <cstdint>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <mutex>
#include <new>
#include <thread>

#if defined(__linux__)
#include <pthread.h>
#include <unistd.h>
#endif

#include "emu_block.h"

namespace mk_emu {
namespace detail {

constexpr size_t kSmemAlign = 128;
constexpr unsigned char kSmemPoison = 0xFF;  // fresh dynamic smem reads as NaN / -1: uninitialised reads show

// ---- the worker pool ----------------------------------------------------------------------------------------
struct Pool {
  // Claim word: bits 0-15 next thread index, 16-31 threads in the block, 32-63 block sequence number. Idle
  // workers claim indices with a CAS, so which worker runs which CUDA thread does not matter.
  uint64_t claim = 0;
  Signal start;  // start.seq bumped when a block is published
  unsigned nworkers = 0;
  Block blk;
  // Fibers (emu_fiber.h): each CUDA thread's context, and the watchdog of blocks that stop making progress.
  struct FiberThread {
    ThreadCtx c;
    uint3 idx;
  } fthreads[kMaxThreadsPerBlock];
  void* fargs[kMaxThreadsPerBlock];
  bool watchdog = false;
  uint64_t block_seq = 0;  // bumped per block run as fibers; 0 while none runs
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
      fatal_begin();
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
  for (unsigned i = 0, nw = load_rlx(&b.nwarps); i < nw; ++i) s += uint64_t(load_rlx(&b.warps[i].epoch.seq)) << 40;
  return s;
}

// A thread of the block that is stuck outside a barrier (an endless loop, a spin on another block's flag):
// give up only after a whole timeout without any progress. Slack so that a thread stuck in a barrier reports
// first under host threads (its message says more).
[[noreturn]] inline void report_no_progress(Block& b, const char* name) {
  fatal_begin();
  std::fprintf(stderr,
               "[megakernels cuda_emu] deadlock: block (%u,%u,%u) of kernel %s made no progress for "
               "%.3g s (%u of %u threads finished). A thread is stuck outside a barrier: an endless "
               "loop, or spin-waiting for another block (blocks run one after another here)\n",
               load_rlx(&b.bidx[0]), load_rlx(&b.bidx[1]), load_rlx(&b.bidx[2]), name, timeout_seconds(),
               load_rlx(&b.fin.seq), load_rlx(&b.nthreads));
  fatal_stop();
}
inline int64_t no_progress_slack() { return timeout_ns() < 2000000000 ? timeout_ns() : 2000000000; }

// Under fibers the launching thread runs the block, so a thread that never waits keeps it: a watchdog thread
// polls the running block's progress a few times per timeout (no wake-up per launch) and reports a stall.
inline void watchdog_loop(Pool* p) {
  uint64_t seen_seq = 0, seen_pr = 0;
  int64_t since = now_ns();
  for (;;) {
    const int64_t period = timeout_ns() / 4 < 250000000 ? timeout_ns() / 4 : 250000000;
    std::this_thread::sleep_for(std::chrono::nanoseconds(period));
    const uint64_t seq = load_acq(&p->block_seq);
    const uint64_t pr = seq ? progress(p->blk) : 0;
    const int64_t t = now_ns();
    if (seq == 0 || seq != seen_seq || pr != seen_pr) {
      seen_seq = seq;
      seen_pr = pr;
      since = t;
    } else if (t - since > timeout_ns() + no_progress_slack()) {
      report_no_progress(p->blk, load_rlx(&p->blk.kernel_name));
    }
  }
}

inline void fiber_resume(Fiber* f) {
  auto* ft = static_cast<Pool::FiberThread*>(f->arg);
  t_ctx = ft ? &ft->c : nullptr;
  if (ft) t_thread_idx = ft->idx;
}

// One CUDA thread on its fiber. The acquire of the block's sequence number and the count of finished threads
// are the happens-before edges from and back to the launcher (ThreadSanitizer sees no other: fibers switch
// without synchronisation).
inline void fiber_thread(Fiber* f) {
  ThreadCtx& c = static_cast<Pool::FiberThread*>(f->arg)->c;
  (void)load_acq(&pool().block_seq);
  Block& b = *c.blk;
  b.tramp(b.args);
  thread_exit(c);
  __atomic_add_fetch(&b.fin.seq, 1u, __ATOMIC_SEQ_CST);
}

// One block as fibers on this thread (the block state is reset by the caller).
inline void run_block_fibers(Pool& p, Block& b, unsigned n) {
  if (!p.watchdog) {
    std::thread(watchdog_loop, &p).detach();
    p.watchdog = true;
  }
  {
    SchedWrites quiet;
    for (unsigned t = 0; t < n; ++t) {
      Pool::FiberThread& ft = p.fthreads[t];
      ft.c = ThreadCtx{&b, t, t & 31u, t >> 5};
      ft.idx = uint3{t % b.bdim[0], (t / b.bdim[0]) % b.bdim[1], t / (b.bdim[0] * b.bdim[1])};
      p.fargs[t] = &ft;
    }
  }
  t_block_idx = uint3{b.bidx[0], b.bidx[1], b.bidx[2]};
  store_rel(&p.block_seq, load_rlx(&p.block_seq) + 1);
  run_fibers(n, fiber_thread, fiber_resume, p.fargs);
  (void)load_acq(&b.fin.seq);
  store_rel(&p.block_seq, uint64_t(0));
}

// One block on the worker pool: publish it, then wait for its threads.
inline void run_block_threads(Pool& p, Block& b, unsigned n, const char* name) {
  const uint64_t seq = (load_rlx(&p.claim) >> 32) + 1;
  store_rel(&p.claim, (seq << 32) | (uint64_t(n) << 16));
  __atomic_fetch_add(&p.start.seq, 1u, __ATOMIC_SEQ_CST);
  signal_wake(p.start, int(n));
  uint64_t last = progress(b);
  int64_t deadline = now_ns() + timeout_ns() + no_progress_slack();
  for (int i = yield_budget(); i > 0 && load_acq(&b.fin.seq) != n; --i) std::this_thread::yield();
  for (;;) {
    const uint32_t d = __atomic_load_n(&b.fin.seq, __ATOMIC_SEQ_CST);
    if (d == n) break;
    int64_t t = now_ns();
    uint64_t pr = progress(b);
    if (pr != last) {
      last = pr;
      deadline = t + timeout_ns() + no_progress_slack();
    } else if (t > deadline) {
      report_no_progress(b, name);
    }
    __atomic_fetch_add(&b.fin.sleepers, 1u, __ATOMIC_SEQ_CST);
    os_wait(&b.fin.seq, d, 250000000);
    __atomic_fetch_sub(&b.fin.sleepers, 1u, __ATOMIC_SEQ_CST);
  }
}

// Runs every block of a validated launch. Caller holds launch_mutex().
inline void run_grid(const char* name, void (*tramp)(const void*), const void* args, dim3 grid, dim3 block,
                     size_t smem_bytes) {
  Pool& p = pool();
  Block& b = p.blk;
  const unsigned n = block.x * block.y * block.z;
  const bool fibers = fibers_enabled();
  if (!fibers) grow_pool(p, n);
  b.tramp = tramp;
  b.args = args;
  // Atomic stores: the fiber watchdog reads these from its own thread.
  store_rlx(&b.kernel_name, name);
  store_rlx(&b.nthreads, n);
  store_rlx(&b.nwarps, (n + 31) / 32);
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
        store_rlx(&b.bidx[0], x);
        store_rlx(&b.bidx[1], y);
        store_rlx(&b.bidx[2], z);
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
        if (fibers)
          run_block_fibers(p, b, n);
        else
          run_block_threads(p, b, n, name);
      }
  ::operator delete(b.smem, std::align_val_t(kSmemAlign));
  b.smem = nullptr;
}

}  // namespace detail
}  // namespace mk_emu
