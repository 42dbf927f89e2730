// 16-bit float storage types for the torch-free CPU kernels, and whole-row conversions to/from fp32.
// Kernels convert a row once into an fp32 scratch buffer, do all math there in loops the compiler vectorises,
// and convert back once: the conversions are the only dtype-specific code.
#pragma once
#include "cpu_isa.h"
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(MK_TARGET_F16C)
#include <immintrin.h>
#endif

namespace megakernels {
namespace MK_CPU_NS {  // cpu, or the ISA clone's (cpu_isa.h)

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline float to_float(float v) { return v; }
inline double to_float(double v) { return v; }
inline float to_float(bf16 v) {
  uint32_t u = uint32_t(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(f16 v) {
  // IEEE half -> single, including subnormals, inf and NaN.
  uint32_t h = v.bits;
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: value = man * 2^-24, exactly representable in fp32
    float f = float(man) * 5.9604644775390625e-08f;
    std::memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) {
  return v;
}
template <>
inline bf16 from_float<bf16>(float v) {
  // Round to nearest even, as torch and CUDA's __float2bfloat16 do; NaN stays a (quiet) NaN.
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}
template <>
inline f16 from_float<f16>(float v) {
  // Round to nearest even with overflow to inf and gradual underflow, as the hardware conversion does.
  uint32_t u;
  std::memcpy(&u, &v, 4);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16{uint16_t(sign | 0x7e00u)};
  if (a >= 0x477ff000u) return f16{uint16_t(sign | 0x7c00u)};  // rounds to >= 65520: inf
  if (a < 0x38800000u) {                                       // below 2^-14: subnormal or zero
    float f;
    std::memcpy(&f, &a, 4);
    // Adding 0.5 (2^-1) aligns the half-subnormal quantum 2^-24 with the fp32 ulp of 0.5, so the FPU's own
    // round-to-nearest-even does the rounding.
    f += 0.5f;
    uint32_t r;
    std::memcpy(&r, &f, 4);
    return f16{uint16_t(sign | uint16_t(r - 0x3f000000u))};
  }
  uint32_t mant_odd = (a >> 13) & 1u;
  a += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
  return f16{uint16_t(sign | uint16_t(a >> 13))};
}
template <>
inline double from_float<double>(float v) {
  return v;
}

// Row conversions. Written as plain loops so that -O3 vectorises them; fp16 uses F16C when compiled for it.
template <typename T, typename A>
inline void load_row(const T* src, A* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = A(to_float(src[i]));
}
template <typename T, typename A>
inline void store_row(const A* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(float(src[i]));
}
template <>
inline void store_row<double, double>(const double* src, double* dst, int64_t n) {
  std::memcpy(dst, src, size_t(n) * sizeof(double));
}
#if defined(MK_TARGET_F16C)
template <>
inline void load_row<f16, float>(const f16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}
template <>
inline void store_row<f16, float>(const float* src, f16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) dst[i] = from_float<f16>(src[i]);
}
#endif

// A row in the accumulate type A: fp32/fp64 rows are used in place, 16-bit rows are converted into `scratch`.
template <typename T, typename A>
inline const A* row_view(const T* src, A* scratch, int64_t n) {
  if constexpr (std::is_same_v<T, A>) {
    return src;
  } else {
    load_row(src, scratch, n);
    return scratch;
  }
}
// Where a row of results is computed: straight in the output for fp32/fp64, else in `scratch`, which
// finish_out then converts into the output.
template <typename T, typename A>
inline A* out_view(T* dst, A* scratch) {
  if constexpr (std::is_same_v<T, A>)
    return dst;
  else
    return scratch;
}
template <typename T, typename A>
inline void finish_out(const A* scratch, T* dst, int64_t n) {
  if constexpr (!std::is_same_v<T, A>) store_row(scratch, dst, n);
}

// Reductions over a row that vectorise: GCC compiles `#pragma omp simd reduction(...)` loops over floats to scalar
// code here, so these keep kLanes partial results, updated by an elementwise loop over a lane array (which it
// vectorises), and combine them at the end. f(j) is the j-th term; the order of the sum differs from a sequential
// one (the lanes), as a vectorised reduction's would.
constexpr int kLanes = 16;

template <typename A, typename F>
inline A lane_sum(int64_t n, F f) {
  A acc[kLanes] = {};
  const int64_t body = n / kLanes * kLanes;
  for (int64_t j = 0; j < body; j += kLanes) {
#pragma omp simd
    for (int k = 0; k < kLanes; ++k) acc[k] += f(j + k);
  }
  A s = 0;
  for (int k = 0; k < kLanes; ++k) s += acc[k];
  for (int64_t j = body; j < n; ++j) s += f(j);
  return s;
}

// max over f(j) (NaN terms may be dropped, as std::max drops them: callers that care check a sum for NaN); `init`
// for an empty row.
template <typename A, typename F>
inline A lane_max(int64_t n, A init, F f) {
  A acc[kLanes];
  for (int k = 0; k < kLanes; ++k) acc[k] = init;
  const int64_t body = n / kLanes * kLanes;
  for (int64_t j = 0; j < body; j += kLanes) {
#pragma omp simd
    for (int k = 0; k < kLanes; ++k) acc[k] = std::max(acc[k], f(j + k));
  }
  A m = init;
  for (int k = 0; k < kLanes; ++k) m = std::max(m, acc[k]);
  for (int64_t j = body; j < n; ++j) m = std::max(m, f(j));
  return m;
}

}  // namespace MK_CPU_NS
}  // namespace megakernels
