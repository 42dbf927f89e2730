// CUDA emulator: the worker pool and the launch loop. Included by cuda_emu.h.
//
// A block's threads are real host threads running at the same time, so shared memory, barriers and races
// behave as on the GPU and ThreadSanitizer sees every unsynchronised access. Blocks run one after another (a
// GPU promises no order or concurrency between blocks, so this is one legal schedule). Threads come from a
// persistent pool, grown on demand up to 1024: creating 256 threads per block would cost more than most
// kernels. A worker is not tied to a thread index; it claims the next free index of the current block from
// one atomic word, so any idle worker can serve any thread.
#pragma once

#include <cstdint>
#include <cstdio>
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
        // Slack so that a thread stuck in a barrier reports first (its message says more).
        const int64_t slack = timeout_ns() < 2000000000 ? timeout_ns() : 2000000000;
        int64_t deadline = now_ns() + timeout_ns() + slack;
        for (int i = yield_budget(); i > 0 && load_acq(&b.fin.seq) != n; --i) std::this_thread::yield();
        for (;;) {
          const uint32_t d = __atomic_load_n(&b.fin.seq, __ATOMIC_SEQ_CST);
          if (d == n) break;
          int64_t t = now_ns();
          uint64_t pr = progress(b);
          if (pr != last) {
            last = pr;
            deadline = t + timeout_ns() + slack;
          } else if (t > deadline) {
            fatal_begin();
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
