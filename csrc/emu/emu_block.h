// CUDA emulator: the state of the running block and its synchronisation — __syncthreads (a block barrier that
// exited threads leave), warp rendezvous for every *_sync intrinsic, thread exit. Included by cuda_emu.h.
#pragma once

#include <cstdint>
#include <cstdio>
#include <mutex>

#include "emu_wait.h"

namespace mk_emu {
namespace detail {

constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxWarps = kMaxThreadsPerBlock / 32;

// ---- per-block state ----------------------------------------------------------------------------------------
enum class WarpOp : uint8_t {
  Sync,
  Shfl,
  Vote,
  Match,
  ReduceAdd,
  ReduceMinS,
  ReduceMinU,
  ReduceMaxS,
  ReduceMaxU,
  ReduceAnd,
  ReduceOr,
  ReduceXor
};

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
  alignas(64) Signal bar;     // bar.seq: barrier generation, bumped when a barrier completes
  uint32_t pred[2] = {0, 0};  // __syncthreads_count/and/or accumulator, double-buffered by generation parity
  alignas(64) Signal fin;     // fin.seq: threads of the block that finished
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
    fatal_begin();
    std::fprintf(stderr, "[megakernels cuda_emu] %s called outside an emulated kernel\n", what);
    fatal_stop();
  }
  return *c;
}

inline void describe_thread(char* buf, size_t n, const Block& b, unsigned tid) {
  unsigned bx = b.bdim[0], by = b.bdim[1];
  std::snprintf(buf, n, "thread (%u,%u,%u) [linear %u, warp %u, lane %u]", tid % bx, (tid / bx) % by, tid / (bx * by),
                tid, tid / 32, tid % 32);
}

[[noreturn]] inline void report_deadlock(const ThreadCtx& c, const char* what, const char* detail) {
  fatal_begin();
  const Block& b = *c.blk;
  char me[128];
  describe_thread(me, sizeof me, b, c.tid);
  if (t_fiber)  // fibers: every live thread of the block waits, so none can ever proceed
    std::fprintf(stderr, "[megakernels cuda_emu] deadlock: %s can never complete: every live thread waits\n", what);
  else
    std::fprintf(stderr,
                 "[megakernels cuda_emu] deadlock: %s not completed within %.3g s (MEGAKERNELS_EMU_TIMEOUT_S)\n", what,
                 timeout_seconds());
  std::fprintf(stderr, "  kernel %s, block (%u,%u,%u), waiting: %s\n  %s\n", b.kernel_name, b.bidx[0], b.bidx[1],
               b.bidx[2], me, detail);
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
    case ShflMode::Up:
      j = lane - b;
      ok = j >= max_lane;
      break;
    case ShflMode::Down:
      j = lane + b;
      ok = j <= max_lane;
      break;
    case ShflMode::Xor:
      j = lane ^ b;
      ok = j <= max_lane && j >= 0;
      break;
    case ShflMode::Idx:
      j = min_lane | (b & ~segmask & 31);
      ok = true;
      break;
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
  fatal_begin();
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
      std::snprintf(msg, sizeof msg,
                    "mask 0x%08x disagrees with mask 0x%08x of lanes 0x%08x (in %s) that wait "
                    "for this lane: a certain deadlock",
                    mask, o.mask, o.arrived, o.name);
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
  complete_ready(w);                           // may remove *r
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
  if (uint32_t(w) != 0 && uint32_t(w) == uint32_t(w >> 32))  // the others wait only for this thread
    complete_block_barrier(b, w, load_acq(&b.bar.seq), uint32_t(w));
  Warp& wp = b.warps[c.warp];
  bool woke;
  {
    std::lock_guard<std::mutex> lk(wp.mu);
    wp.exited |= 1u << c.lane;
    woke = complete_ready(wp);
  }
  if (woke) signal_bump(wp.epoch);
}

}  // namespace detail
}  // namespace mk_emu
