// CUDA emulator: a block's threads as fibers (user-space contexts) on the launching host thread. Included by
// emu_wait.h.
//
// Host threads handing every barrier and warp op to each other cost two context switches and often a futex
// system call per thread and barrier; on few CPUs that is most of an emulated test's time. Fibers switch in user
// space: each CUDA thread runs on its own stack until it waits (__syncthreads, a *_sync warp intrinsic,
// __nanosleep) or returns, then the next runnable thread of the block resumes, round robin. The block state and
// its synchronisation (emu_block.h) are the same for both; only waiting differs (wait_until yields instead of
// spinning or sleeping). A deadlock is then exact: every live thread checked its condition since the last change.
//
// A fiber serves thread i of block after block: it loops, so no frame is ever abandoned on its stack.
// Sanitizers are told of every switch: AddressSanitizer of the stack in use; ThreadSanitizer gets a fiber
// context per CUDA thread and switches without synchronisation, so the only happens-before edges between CUDA
// threads are the emulator's atomics, as with host threads (a missing __syncthreads is still a race). The
// scheduler's own bookkeeping is hidden from it (its writes are ignored): only one fiber runs at a time.
//
// Fibers are the default where the switch is implemented (x86-64 Linux); MEGAKERNELS_EMU_FIBERS=0 selects host
// threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

// -DMK_EMU_HAVE_FIBERS=0 builds the emulator without fibers (host threads only).
#if !defined(MK_EMU_HAVE_FIBERS) && defined(__x86_64__) && defined(__linux__)
#define MK_EMU_HAVE_FIBERS 1
#endif
#if MK_EMU_HAVE_FIBERS
#include <sys/mman.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
extern "C" void AnnotateIgnoreWritesBegin(const char* file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char* file, int line);
#endif
#else
#undef MK_EMU_HAVE_FIBERS
#define MK_EMU_HAVE_FIBERS 0
#endif

#if MK_EMU_HAVE_FIBERS
// mk_emu_fiber_switch(&save_sp, to_sp): pushes the callee-saved registers and the SSE/x87 control words on the
// current stack, stores the stack pointer in *save_sp, loads to_sp and pops the same frame from there. No signal
// mask is saved (swapcontext's sigprocmask call is a system call per switch). mk_emu_fiber_start is where a fresh
// fiber's frame returns to: it calls r13(r12). COMDAT sections: every translation unit may define them.
asm(R"(
  .pushsection .text.mk_emu_fiber_switch,"axG",@progbits,mk_emu_fiber_switch,comdat
  .globl mk_emu_fiber_switch
  .hidden mk_emu_fiber_switch
  .type mk_emu_fiber_switch,@function
mk_emu_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size mk_emu_fiber_switch, .-mk_emu_fiber_switch
  .popsection
  .pushsection .text.mk_emu_fiber_start,"axG",@progbits,mk_emu_fiber_start,comdat
  .globl mk_emu_fiber_start
  .hidden mk_emu_fiber_start
  .type mk_emu_fiber_start,@function
mk_emu_fiber_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size mk_emu_fiber_start, .-mk_emu_fiber_start
  .popsection
)");
extern "C" void mk_emu_fiber_switch(void** save_sp, void* to_sp);
extern "C" void mk_emu_fiber_start();
#endif

namespace mk_emu {
namespace detail {

// Whether launches run blocks as fibers: MEGAKERNELS_EMU_FIBERS (default 1 where available; 0 = host threads).
inline bool fibers_enabled() {
#if MK_EMU_HAVE_FIBERS
  static const bool on = [] {
    const char* e = std::getenv("MEGAKERNELS_EMU_FIBERS");
    return !(e && e[0] == '0');
  }();
  return on;
#else
  return false;
#endif
}

struct Fiber {
  void* sp = nullptr;
  unsigned char* stack = nullptr;  // lowest usable byte (a guard page lies below)
  size_t stack_size = 0;
  void* fake_stack = nullptr;  // AddressSanitizer's fake stack of this fiber while it is switched out
  void* tsan = nullptr;        // ThreadSanitizer's context of this fiber
  bool started = false;        // its stack holds a live frame
  void (*entry)(Fiber*) = nullptr;
  void (*on_resume)(Fiber*) = nullptr;  // restores the thread-locals of the context that resumes
  void* arg = nullptr;                  // what the entry runs (the CUDA thread's context); null for the launcher
  unsigned next = 0, prev = 0;
};

// Where a fiber's stack has room for the deepest emulated kernel plus printf and sanitizer frames. Only touched
// pages cost memory: the rest is reserved address space.
constexpr size_t kFiberStack = size_t(512) << 10;
constexpr size_t kGuardPage = 4096;
constexpr unsigned kMaxFibers = 1024;  // CUDA's limit of threads per block

// The fibers of one launching host thread and the block they run (one block at a time, under the launch
// mutex). Per host thread: a parked fiber never resumes on another thread, whose thread-locals its compiled code
// could not tell from the old thread's.
struct FiberSched {
  ~FiberSched();
  Fiber* fibers = nullptr;  // kMaxFibers of them
  unsigned capacity = 0;    // how many have a stack
  Fiber main;               // the launching thread's own context
  Fiber* cur = nullptr;
  Fiber* from = nullptr;  // the context the running one was switched from
  unsigned nlive = 0;
  unsigned idle = 0;  // wait yields in a row that found their condition false, with no change in between
};

inline thread_local Fiber* t_fiber = nullptr;  // the running fiber, or null outside fibers

inline FiberSched& fiber_sched() {
  static thread_local FiberSched s;
  return s;
}

// Scheduler writes are invisible to ThreadSanitizer (one fiber runs at a time; they are no CUDA-thread data).
struct SchedWrites {
#if MK_EMU_HAVE_FIBERS && defined(__SANITIZE_THREAD__)
  SchedWrites() { AnnotateIgnoreWritesBegin(__FILE__, __LINE__); }
  ~SchedWrites() { AnnotateIgnoreWritesEnd(__FILE__, __LINE__); }
#else
  SchedWrites() {}  // user-provided: no unused-variable warning where it does nothing
#endif
};

#if MK_EMU_HAVE_FIBERS
inline void fiber_landed() {
  FiberSched& s = fiber_sched();
#if defined(__SANITIZE_ADDRESS__)
  const void* bottom = nullptr;
  size_t size = 0;
  __sanitizer_finish_switch_fiber(s.cur->fake_stack, &bottom, &size);
  if (s.from == &s.main) {  // the launcher's stack, learnt on the way out of it
    s.main.stack = static_cast<unsigned char*>(const_cast<void*>(bottom));
    s.main.stack_size = size;
  }
#endif
  SchedWrites quiet;
  if (s.cur->on_resume) s.cur->on_resume(s.cur);
}

inline void fiber_switch(Fiber& to) {
  FiberSched& s = fiber_sched();
  Fiber& from = *s.cur;
  {
    SchedWrites quiet;
    s.from = &from;
    s.cur = &to;
    t_fiber = &to == &s.main ? nullptr : &to;
  }
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(&from.fake_stack, to.stack, to.stack_size);
#endif
#if defined(__SANITIZE_THREAD__)
  __tsan_switch_to_fiber(to.tsan, __tsan_switch_to_fiber_no_sync);
#endif
  mk_emu_fiber_switch(&from.sp, to.sp);
  fiber_landed();
}

// Takes the running fiber out of the block's ring and passes on to the next live one (or back to the
// launcher). Returns when the fiber is resumed for the next block.
inline void fiber_finish() {
  FiberSched& s = fiber_sched();
  Fiber* to = &s.main;
  {
    SchedWrites quiet;
    Fiber& f = *s.cur;
    s.idle = 0;
    if (--s.nlive) {
      s.fibers[f.prev].next = f.next;
      s.fibers[f.next].prev = f.prev;
      to = &s.fibers[f.next];
    }
  }
  fiber_switch(*to);
}

[[noreturn]] inline void fiber_main(Fiber* f) {
  fiber_landed();
  for (;;) {
    f->entry(f);
    fiber_finish();
  }
}

inline void ensure_fibers(unsigned n) {
  FiberSched& s = fiber_sched();
  if (n <= s.capacity) return;
  if (!s.fibers) s.fibers = new Fiber[kMaxFibers];  // never moves: a parked fiber's frame points at its Fiber
  Fiber* grown = s.fibers;
  for (unsigned i = s.capacity; i < n; ++i) {
    void* m = mmap(nullptr, kFiberStack + kGuardPage, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      std::fprintf(stderr, "[megakernels cuda_emu] cannot map a stack for emulated thread %u\n", i);
      std::abort();
    }
    mprotect(m, kGuardPage, PROT_NONE);  // a stack overflow faults instead of overwriting the next stack
    grown[i].stack = static_cast<unsigned char*>(m) + kGuardPage;
    grown[i].stack_size = kFiberStack;
#if defined(__SANITIZE_THREAD__)
    grown[i].tsan = __tsan_create_fiber(0);
#endif
  }
  s.capacity = n;
}

inline FiberSched::~FiberSched() {
  SchedWrites quiet;
  for (unsigned i = 0; i < capacity; ++i) {
    munmap(fibers[i].stack - kGuardPage, kFiberStack + kGuardPage);
#if defined(__SANITIZE_THREAD__)
    __tsan_destroy_fiber(fibers[i].tsan);
#endif
  }
  delete[] fibers;
}

// Runs entry(fiber i) for i < n, each on its own fiber, until all returned. on_resume(fiber) runs whenever a
// fiber (or the launcher, with arg null) gets the CPU back.
inline void run_fibers(unsigned n, void (*entry)(Fiber*), void (*on_resume)(Fiber*), void* const* args) {
  FiberSched& s = fiber_sched();
  {
    SchedWrites quiet;
    ensure_fibers(n);
    s.main.on_resume = on_resume;
    s.main.arg = nullptr;
#if defined(__SANITIZE_THREAD__)
    s.main.tsan = __tsan_get_current_fiber();  // the launching host thread (any may launch)
#endif
    for (unsigned i = 0; i < n; ++i) {
      Fiber& f = s.fibers[i];
      f.entry = entry;
      f.on_resume = on_resume;
      f.arg = args[i];
      f.next = i + 1 == n ? 0 : i + 1;
      f.prev = i == 0 ? n - 1 : i - 1;
      if (f.started) continue;  // parked in fiber_finish, resumes into its loop
      f.started = true;
      // A fresh frame as mk_emu_fiber_switch leaves it: control words, r15..rbp, then the return address.
      uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + f.stack_size) & ~uintptr_t(15);
      uint64_t* sp = reinterpret_cast<uint64_t*>(top - 80);
      uint32_t mxcsr;
      uint16_t fpucw;
      asm volatile("stmxcsr %0" : "=m"(mxcsr));
      asm volatile("fnstcw %0" : "=m"(fpucw));
      reinterpret_cast<uint32_t*>(sp)[0] = mxcsr;
      reinterpret_cast<uint32_t*>(sp)[1] = fpucw;
      sp[1] = 0;                                                // r15
      sp[2] = 0;                                                // r14
      sp[3] = reinterpret_cast<uint64_t>(&fiber_main);          // r13: what the start stub calls
      sp[4] = reinterpret_cast<uint64_t>(&f);                   // r12: its argument
      sp[5] = 0;                                                // rbx
      sp[6] = 0;                                                // rbp: ends frame-pointer backtraces
      sp[7] = reinterpret_cast<uint64_t>(&mk_emu_fiber_start);  // the return address
      f.sp = sp;
    }
    s.nlive = n;
    s.idle = 0;
    s.cur = &s.main;
  }
  fiber_switch(s.fibers[0]);
}

// Passes the CPU to the next live fiber. `waiting`: the caller found its wait condition false (first: for the
// first time in this wait, so it may have changed the block's state just before). Returns true when every live
// fiber has found its condition false since the last change: none can ever proceed.
inline bool fiber_yield(bool waiting, bool first) {
  FiberSched& s = fiber_sched();
  {
    SchedWrites quiet;
    if (!waiting)
      s.idle = 0;
    else if (first)
      s.idle = 1;
    else if (++s.idle > s.nlive)
      return true;
  }
  Fiber& to = s.fibers[s.cur->next];
  if (&to != s.cur) fiber_switch(to);
  return false;
}
#else
inline FiberSched::~FiberSched() { delete[] fibers; }
inline void run_fibers(unsigned, void (*)(Fiber*), void (*)(Fiber*), void* const*) { std::abort(); }
inline bool fiber_yield(bool, bool) { return false; }
#endif

}  // namespace detail
}  // namespace mk_emu
