// CUDA emulator: the device-side synchronisation API kernels call — block barriers, warp intrinsics,
// atomics, fences. Included by cuda_emu.h.
//
// Semantics chosen (and why):
// - Exited threads leave every barrier, as on Volta and later: __syncthreads counts live threads only, and a
//   *_sync intrinsic waits for the lanes of its mask that exist (the last warp of a block may be partial) and
//   have not returned.
// - Reading a lane that does not take part in a shuffle (not in the mask, absent, or exited) is undefined on
//   the GPU; here it returns all bits set (NaN for floats, -1 for integers) so the bug shows in the result.
// - __activemask() returns the live lanes of the warp. Threads here are never "converged", so code that
//   calls it inside a divergent branch and then syncs on the result waits for lanes that never come and is
//   reported as a deadlock (on a GPU that code relies on unspecified scheduling).
// - Atomics are sequentially consistent RMWs (stronger than the GPU's relaxed atomics): TSan then reasons
//   about the usual "write; __threadfence(); atomic flag" hand-off without false reports. Fences are RMWs on
//   one global word for the same reason (GCC's TSan ignores atomic_thread_fence). A plain read of a word that
//   other threads update with atomics (the first read of the classic atomicCAS loop) is still a data race to
//   TSan: read it with an atomic (atomicAdd(p, 0)) in code that must pass the TSan build.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

namespace mk_emu {
namespace detail {

template <class T>
inline uint64_t to_bits(T v) {
  // Not is_trivially_copyable: __half2/__nv_bfloat162 declare their own copy assignment, yet are plain bits.
  static_assert(sizeof(T) <= 8, "warp intrinsics move up to 8 bytes");
  uint64_t u = 0;
  std::memcpy(&u, static_cast<const void*>(&v), sizeof(T));
  return u;
}
template <class T>
inline T from_bits(uint64_t u) {
  T v;
  std::memcpy(static_cast<void*>(&v), &u, sizeof(T));
  return v;
}

inline int check_width(const char* name, int width) {
  if (width < 1 || width > 32 || (width & (width - 1))) {
    char msg[96];
    std::snprintf(msg, sizeof msg, "width %d is not a power of two in [1, 32]", width);
    warp_misuse(ctx(name), name, msg);
  }
  return width;
}

template <class T>
inline T shfl(const char* name, ShflMode m, unsigned mask, T v, int b, int width) {
  check_width(name, width);
  const int src = shfl_source(m, int(ctx(name).lane), b, width);
  return from_bits<T>(warp_meet(name, WarpOp::Shfl, mask, to_bits(v), src));
}

inline uint64_t& fence_word() {
  static uint64_t w = 0;
  return w;
}

}  // namespace detail
}  // namespace mk_emu

// ---- block barriers -----------------------------------------------------------------------------------------
inline void __syncthreads() { mk_emu::detail::block_barrier("__syncthreads()", false, 0); }
inline int __syncthreads_count(int pred) { return mk_emu::detail::block_barrier("__syncthreads_count()", true, pred); }
// "All live threads" = "no live thread with a zero predicate": counting the zeros needs no live-thread count.
inline int __syncthreads_and(int pred) {
  return mk_emu::detail::block_barrier("__syncthreads_and()", true, !pred) == 0;
}
inline int __syncthreads_or(int pred) { return mk_emu::detail::block_barrier("__syncthreads_or()", true, pred) != 0; }

// ---- warp-level -------------------------------------------------------------------------------------------
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  mk_emu::detail::warp_meet("__syncwarp()", mk_emu::detail::WarpOp::Sync, mask, 0, 0);
}

inline unsigned __activemask() {
  using namespace mk_emu::detail;
  ThreadCtx& c = ctx("__activemask()");
  Warp& w = c.blk->warps[c.warp];
  std::lock_guard<std::mutex> lk(w.mu);
  return w.exist & ~w.exited;
}

inline unsigned __ballot_sync(unsigned mask, int pred) {
  return unsigned(mk_emu::detail::warp_meet("__ballot_sync()", mk_emu::detail::WarpOp::Vote, mask, pred != 0, 0));
}
inline int __any_sync(unsigned mask, int pred) {
  return uint32_t(mk_emu::detail::warp_meet("__any_sync()", mk_emu::detail::WarpOp::Vote, mask, pred != 0, 0)) != 0;
}
inline int __all_sync(unsigned mask, int pred) {
  uint64_t r = mk_emu::detail::warp_meet("__all_sync()", mk_emu::detail::WarpOp::Vote, mask, pred != 0, 0);
  return uint32_t(r) == uint32_t(r >> 32);  // ballot == participants
}

#define MK_EMU_SHFL_OVERLOADS(T)                                                                                \
  inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {                                      \
    return mk_emu::detail::shfl("__shfl_sync()", mk_emu::detail::ShflMode::Idx, mask, v, src_lane, width);      \
  }                                                                                                             \
  inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {                                 \
    return mk_emu::detail::shfl("__shfl_up_sync()", mk_emu::detail::ShflMode::Up, mask, v,                      \
                                delta > 64 ? 64 : int(delta), width);                                           \
  }                                                                                                             \
  inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {                               \
    return mk_emu::detail::shfl("__shfl_down_sync()", mk_emu::detail::ShflMode::Down, mask, v,                  \
                                delta > 64 ? 64 : int(delta), width);                                           \
  }                                                                                                             \
  inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {                                 \
    return mk_emu::detail::shfl("__shfl_xor_sync()", mk_emu::detail::ShflMode::Xor, mask, v, lane_mask, width); \
  }
MK_EMU_SHFL_OVERLOADS(int)
MK_EMU_SHFL_OVERLOADS(unsigned int)
MK_EMU_SHFL_OVERLOADS(long)
MK_EMU_SHFL_OVERLOADS(unsigned long)
MK_EMU_SHFL_OVERLOADS(long long)
MK_EMU_SHFL_OVERLOADS(unsigned long long)
MK_EMU_SHFL_OVERLOADS(float)
MK_EMU_SHFL_OVERLOADS(double)
MK_EMU_SHFL_OVERLOADS(__half)
MK_EMU_SHFL_OVERLOADS(__half2)
MK_EMU_SHFL_OVERLOADS(__nv_bfloat16)
MK_EMU_SHFL_OVERLOADS(__nv_bfloat162)
#undef MK_EMU_SHFL_OVERLOADS

#define MK_EMU_MATCH_OVERLOADS(T)                                                                        \
  inline unsigned __match_any_sync(unsigned mask, T v) {                                                 \
    return unsigned(mk_emu::detail::warp_meet("__match_any_sync()", mk_emu::detail::WarpOp::Match, mask, \
                                              mk_emu::detail::to_bits(v), 0));                           \
  }                                                                                                      \
  inline unsigned __match_all_sync(unsigned mask, T v, int* pred) {                                      \
    uint64_t r = mk_emu::detail::warp_meet("__match_all_sync()", mk_emu::detail::WarpOp::Match, mask,    \
                                           mk_emu::detail::to_bits(v), 0);                               \
    *pred = int(r >> 32);                                                                                \
    return *pred ? unsigned(r) : 0u;                                                                     \
  }
MK_EMU_MATCH_OVERLOADS(int)
MK_EMU_MATCH_OVERLOADS(unsigned int)
MK_EMU_MATCH_OVERLOADS(long)
MK_EMU_MATCH_OVERLOADS(unsigned long)
MK_EMU_MATCH_OVERLOADS(long long)
MK_EMU_MATCH_OVERLOADS(unsigned long long)
MK_EMU_MATCH_OVERLOADS(float)
MK_EMU_MATCH_OVERLOADS(double)
#undef MK_EMU_MATCH_OVERLOADS

#define MK_EMU_REDUCE(fn, T, op)                                                                               \
  inline T fn(unsigned mask, T v) {                                                                            \
    return T(uint32_t(mk_emu::detail::warp_meet(#fn "()", mk_emu::detail::WarpOp::op, mask, uint32_t(v), 0))); \
  }
MK_EMU_REDUCE(__reduce_add_sync, unsigned, ReduceAdd)
MK_EMU_REDUCE(__reduce_add_sync, int, ReduceAdd)
MK_EMU_REDUCE(__reduce_min_sync, unsigned, ReduceMinU)
MK_EMU_REDUCE(__reduce_min_sync, int, ReduceMinS)
MK_EMU_REDUCE(__reduce_max_sync, unsigned, ReduceMaxU)
MK_EMU_REDUCE(__reduce_max_sync, int, ReduceMaxS)
MK_EMU_REDUCE(__reduce_and_sync, unsigned, ReduceAnd)
MK_EMU_REDUCE(__reduce_or_sync, unsigned, ReduceOr)
MK_EMU_REDUCE(__reduce_xor_sync, unsigned, ReduceXor)
#undef MK_EMU_REDUCE

// ---- fences -----------------------------------------------------------------------------------------------
inline void __threadfence() { __atomic_fetch_add(&mk_emu::detail::fence_word(), 0, __ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __threadfence(); }
inline void __threadfence_system() { __threadfence(); }

// ---- atomics (return the old value, like the GPU) ---------------------------------------------------------
namespace mk_emu {
namespace detail {
template <class T, class F>
inline T atomic_update(T* p, F f) {
  T old;
  __atomic_load(p, &old, __ATOMIC_SEQ_CST);
  T want;
  do {
    want = f(old);
  } while (!__atomic_compare_exchange(p, &old, &want, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
  return old;
}
}  // namespace detail
}  // namespace mk_emu

// The overload sets are CUDA's own (e.g. no atomicSub on 64-bit), so code that nvcc rejects fails here too.
#define MK_EMU_ATOMIC_RMW(T, name, builtin) \
  inline T name(T* p, T v) { return builtin(p, v, __ATOMIC_SEQ_CST); }
#define MK_EMU_ATOMIC_MINMAX(T)                                                  \
  inline T atomicMax(T* p, T v) {                                                \
    return mk_emu::detail::atomic_update(p, [v](T o) { return o < v ? v : o; }); \
  }                                                                              \
  inline T atomicMin(T* p, T v) {                                                \
    return mk_emu::detail::atomic_update(p, [v](T o) { return v < o ? v : o; }); \
  }
#define MK_EMU_ATOMIC_CAS(T)                                                            \
  inline T atomicCAS(T* p, T cmp, T v) {                                                \
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
    return cmp;                                                                         \
  }
#define MK_EMU_ATOMIC_BITS(T)                         \
  MK_EMU_ATOMIC_RMW(T, atomicAnd, __atomic_fetch_and) \
  MK_EMU_ATOMIC_RMW(T, atomicOr, __atomic_fetch_or)   \
  MK_EMU_ATOMIC_RMW(T, atomicXor, __atomic_fetch_xor)
MK_EMU_ATOMIC_RMW(int, atomicAdd, __atomic_fetch_add)
MK_EMU_ATOMIC_RMW(unsigned int, atomicAdd, __atomic_fetch_add)
MK_EMU_ATOMIC_RMW(unsigned long long, atomicAdd, __atomic_fetch_add)
MK_EMU_ATOMIC_RMW(int, atomicSub, __atomic_fetch_sub)
MK_EMU_ATOMIC_RMW(unsigned int, atomicSub, __atomic_fetch_sub)
MK_EMU_ATOMIC_RMW(int, atomicExch, __atomic_exchange_n)
MK_EMU_ATOMIC_RMW(unsigned int, atomicExch, __atomic_exchange_n)
MK_EMU_ATOMIC_RMW(unsigned long long, atomicExch, __atomic_exchange_n)
MK_EMU_ATOMIC_MINMAX(int)
MK_EMU_ATOMIC_MINMAX(unsigned int)
MK_EMU_ATOMIC_MINMAX(long long)
MK_EMU_ATOMIC_MINMAX(unsigned long long)
MK_EMU_ATOMIC_CAS(int)
MK_EMU_ATOMIC_CAS(unsigned int)
MK_EMU_ATOMIC_CAS(unsigned long long)
MK_EMU_ATOMIC_CAS(unsigned short)
MK_EMU_ATOMIC_BITS(int)
MK_EMU_ATOMIC_BITS(unsigned int)
MK_EMU_ATOMIC_BITS(unsigned long long)
#undef MK_EMU_ATOMIC_RMW
#undef MK_EMU_ATOMIC_MINMAX
#undef MK_EMU_ATOMIC_CAS
#undef MK_EMU_ATOMIC_BITS

inline unsigned atomicInc(unsigned* p, unsigned limit) {
  return mk_emu::detail::atomic_update(p, [limit](unsigned o) { return o >= limit ? 0u : o + 1; });
}
inline unsigned atomicDec(unsigned* p, unsigned limit) {
  return mk_emu::detail::atomic_update(p, [limit](unsigned o) { return (o == 0 || o > limit) ? limit : o - 1; });
}
inline float atomicAdd(float* p, float v) {
  return mk_emu::detail::atomic_update(p, [v](float o) { return o + v; });
}
inline double atomicAdd(double* p, double v) {
  return mk_emu::detail::atomic_update(p, [v](double o) { return o + v; });
}
inline float atomicExch(float* p, float v) {
  float old;
  __atomic_exchange(p, &v, &old, __ATOMIC_SEQ_CST);
  return old;
}
inline __half atomicAdd(__half* p, __half v) {
  return mk_emu::detail::atomic_update(p, [v](__half o) { return __hadd(o, v); });
}
inline __half2 atomicAdd(__half2* p, __half2 v) {
  return mk_emu::detail::atomic_update(p, [v](__half2 o) { return __hadd2(o, v); });
}
inline __nv_bfloat16 atomicAdd(__nv_bfloat16* p, __nv_bfloat16 v) {
  return mk_emu::detail::atomic_update(p, [v](__nv_bfloat16 o) { return __hadd(o, v); });
}
inline __nv_bfloat162 atomicAdd(__nv_bfloat162* p, __nv_bfloat162 v) {
  return mk_emu::detail::atomic_update(p, [v](__nv_bfloat162 o) { return __hadd2(o, v); });
}

// Scope variants: one device, one coherent host memory, so the scope changes nothing here.
#define MK_EMU_SCOPED(name)                                            \
  template <class T, class... A>                                       \
  inline auto name##_block(T* p, A... a) -> decltype(name(p, a...)) {  \
    return name(p, a...);                                              \
  }                                                                    \
  template <class T, class... A>                                       \
  inline auto name##_system(T* p, A... a) -> decltype(name(p, a...)) { \
    return name(p, a...);                                              \
  }
MK_EMU_SCOPED(atomicAdd)
MK_EMU_SCOPED(atomicSub)
MK_EMU_SCOPED(atomicExch)
MK_EMU_SCOPED(atomicMax)
MK_EMU_SCOPED(atomicMin)
MK_EMU_SCOPED(atomicCAS)
MK_EMU_SCOPED(atomicAnd)
MK_EMU_SCOPED(atomicOr)
MK_EMU_SCOPED(atomicXor)
MK_EMU_SCOPED(atomicInc)
MK_EMU_SCOPED(atomicDec)
#undef MK_EMU_SCOPED

// ---- misc device functions ----------------------------------------------------------------------------------
[[noreturn]] inline void __trap() {
  using namespace mk_emu::detail;
  ThreadCtx& c = ctx("__trap()");
  fatal_begin();
  char me[128];
  describe_thread(me, sizeof me, *c.blk, c.tid);
  std::fprintf(stderr, "[megakernels cuda_emu] __trap() in kernel %s, block (%u,%u,%u), %s\n", c.blk->kernel_name,
               c.blk->bidx[0], c.blk->bidx[1], c.blk->bidx[2], me);
  fatal_stop();
}
inline long long clock64() { return static_cast<long long>(mk_emu::detail::now_ns()); }
// Under fibers a sleeping thread lets the others of its block run (a spin-wait on another thread's flag).
inline void __nanosleep(unsigned ns) {
  if (mk_emu::detail::t_fiber)
    mk_emu::detail::fiber_yield(false, false);
  else
    std::this_thread::sleep_for(std::chrono::nanoseconds(ns));
}
