// Opens an ISA clone of a CPU kernel source (csrc/common/cpu_isa.h): a wrapper unit defines MK_CPU_ISA (avx2 or
// avx512) and MK_CPU_ISA_LEVEL (1 or 2), includes this, then the kernel source, then cpu_isa_end.h. The C and C++
// standard headers the kernels use come first, compiled for the build's baseline target like everywhere else: their
// inline functions are shared with every other unit, so no clone may compile them. Everything after the pragma is the
// project's own code.
#pragma once
#if !defined(MK_CPU_ISA) || !defined(MK_CPU_ISA_LEVEL)
#error "define MK_CPU_ISA (avx2 or avx512) and MK_CPU_ISA_LEVEL (1 or 2) before including cpu_isa_begin.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#pragma GCC push_options
#if MK_CPU_ISA_LEVEL == 1
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,movbe")
#elif MK_CPU_ISA_LEVEL == 2
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,movbe,avx512f,avx512bw,avx512vl,avx512dq,avx512cd")
#else
#error "MK_CPU_ISA_LEVEL must be 1 (avx2) or 2 (avx512)"
#endif
#endif
