// Run-time ISA dispatch of the CPU kernels. The extension is built for a portable baseline (x86-64-v2) and each
// csrc/<family>/<name>_cpu.cpp is compiled twice more, for AVX2 (x86-64-v3: AVX2, FMA, F16C, BMI) and for AVX-512
// (x86-64-v4: F, BW, VL, DQ, CD), by the wrapper units <name>_cpu_avx2.cpp and <name>_cpu_avx512.cpp: they include
// the system headers, switch the target (csrc/common/cpu_isa_begin.h) and include the kernel source with
// MK_CPU_ISA set. The bindings call the kernels of the ISA chosen once per process (megakernels::bindings::
// cpu_isa(): the CPU's, or MEGAKERNELS_CPU_ISA=baseline|avx2|avx512) through MK_CPU(fn).
//
// The same source compiled for three targets must not share a symbol: the linker would keep one copy of an inline
// function (an AVX-512 one, say) for every caller. So a clone's entry points live in their own namespace
// (MK_CPU_NS: cpu, cpu_avx2, cpu_avx512), and the project's inline helpers outside it sit in MK_ISA_BEGIN ...
// MK_ISA_END, an inline namespace named after the ISA in a clone and nothing elsewhere. Types shared with the
// bindings (the kernels' Args structs, DType) stay outside both.
#pragma once

#if defined(MK_CPU_ISA)
#define MK_CPU_NS_CAT2(a, b) a##_##b
#define MK_CPU_NS_CAT(a, b) MK_CPU_NS_CAT2(a, b)
#define MK_CPU_NS MK_CPU_NS_CAT(cpu, MK_CPU_ISA)
#define MK_ISA_BEGIN inline namespace MK_CPU_ISA {
#define MK_ISA_END }
#else
#define MK_CPU_NS cpu
#define MK_ISA_BEGIN
#define MK_ISA_END
#endif

// What the code being compiled may use: the clone's ISA (MK_CPU_ISA_LEVEL: 1 AVX2 with FMA and F16C, 2 AVX-512),
// else the build's target. (A `#pragma GCC target` does not set __AVX2__ and friends for C++, whose preprocessor
// runs before the pragma takes effect, so the kernels test these instead.)
#if defined(MK_CPU_ISA_LEVEL)
#if MK_CPU_ISA_LEVEL >= 1
#define MK_TARGET_FMA 1
#define MK_TARGET_F16C 1
#endif
#if MK_CPU_ISA_LEVEL >= 2
#define MK_TARGET_AVX512 1
#endif
#else
#if defined(__FMA__)
#define MK_TARGET_FMA 1
#endif
#if defined(__F16C__)
#define MK_TARGET_F16C 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define MK_TARGET_AVX512 1
#endif
#endif

// Declares a family's CPU entry points (the declarations, `;`-terminated) in the namespace of every clone.
#define MK_DECLARE_CPU_KERNELS(...) \
  namespace cpu {                   \
  __VA_ARGS__                       \
  }                                 \
  namespace cpu_avx2 {              \
  __VA_ARGS__                       \
  }                                 \
  namespace cpu_avx512 {            \
  __VA_ARGS__                       \
  }
