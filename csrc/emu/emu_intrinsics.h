// CUDA emulator: device math and bit intrinsics that are not host functions. Included by cuda_emu.h.
//
// The fast-math intrinsics (__expf, __sinf, __fdividef, ...) are computed at full precision: the emulator
// checks indexing and synchronisation, not the last ulp of the GPU's approximations. Rounding-mode suffixes
// other than _rn are not emulated (the host rounds to nearest) and are therefore not provided.
// glibc itself declares __expf, __logf, __sinf, ... (its internal aliases) and C23 adds rsqrt/rsqrtf, so
// those names are macros onto mk_emu_* functions rather than overloads that would clash with libm's.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// Device code calls the classification functions unqualified; CUDA's headers make that work on the host too.
using std::isfinite;
using std::isinf;
using std::isnan;
using std::signbit;

namespace mk_emu {
namespace detail {
__extension__ typedef __int128 i128;
__extension__ typedef unsigned __int128 u128;
template <class To, class From>
inline To bit_cast(From f) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast size");
  To t;
  std::memcpy(&t, &f, sizeof t);
  return t;
}
// Float -> integer conversions saturate and send NaN to 0, as cvt.*.f32 does on the GPU.
template <class I, class F>
inline I cvt_sat(F x) {
  if (std::isnan(x)) return 0;
  if (x <= F(std::numeric_limits<I>::min())) return std::numeric_limits<I>::min();
  if (x >= F(std::numeric_limits<I>::max())) return std::numeric_limits<I>::max();
  return static_cast<I>(x);
}
}  // namespace detail
}  // namespace mk_emu

// ---- names libm may also declare: macros onto our own functions ---------------------------------------------
inline float mk_emu_rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double mk_emu_rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float mk_emu_expf(float x) { return std::exp(x); }
inline float mk_emu_exp10f(float x) { return std::pow(10.0f, x); }
inline float mk_emu_logf(float x) { return std::log(x); }
inline float mk_emu_log2f(float x) { return std::log2(x); }
inline float mk_emu_log10f(float x) { return std::log10(x); }
inline float mk_emu_powf(float x, float y) { return std::pow(x, y); }
inline float mk_emu_sinf(float x) { return std::sin(x); }
inline float mk_emu_cosf(float x) { return std::cos(x); }
inline float mk_emu_tanf(float x) { return std::tan(x); }
inline void mk_emu_sincosf(float x, float* s, float* c) {
  *s = std::sin(x);
  *c = std::cos(x);
}
#define rsqrtf mk_emu_rsqrtf
#define rsqrt mk_emu_rsqrt
#define __expf mk_emu_expf
#define __exp10f mk_emu_exp10f
#define __logf mk_emu_logf
#define __log2f mk_emu_log2f
#define __log10f mk_emu_log10f
#define __powf mk_emu_powf
#define __sinf mk_emu_sinf
#define __cosf mk_emu_cosf
#define __tanf mk_emu_tanf
#define __sincosf mk_emu_sincosf

// ---- single / double precision ----------------------------------------------------------------------------
inline float rcbrtf(float x) { return 1.0f / std::cbrt(x); }
inline double rcbrt(double x) { return 1.0 / std::cbrt(x); }
inline float normcdff(float x) { return 0.5f * std::erfc(-x * 0.70710678118654752f); }
inline double normcdf(double x) { return 0.5 * std::erfc(-x * 0.70710678118654752); }
inline float fdividef(float a, float b) { return a / b; }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f; }  // NaN -> 0
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.0f / std::sqrt(x); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __drcp_rn(double x) { return 1.0 / x; }
inline double __dsqrt_rn(double x) { return std::sqrt(x); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }

// CUDA's host/device min/max overloads (crt/math_functions.hpp gives the host the same set).
#define MK_EMU_MINMAX(T)                           \
  inline T min(T a, T b) { return b < a ? b : a; } \
  inline T max(T a, T b) { return a < b ? b : a; }
MK_EMU_MINMAX(int)
MK_EMU_MINMAX(unsigned int)
MK_EMU_MINMAX(long)
MK_EMU_MINMAX(unsigned long)
MK_EMU_MINMAX(long long)
MK_EMU_MINMAX(unsigned long long)
#undef MK_EMU_MINMAX
inline unsigned int min(int a, unsigned int b) { return min(unsigned(a), b); }
inline unsigned int min(unsigned int a, int b) { return min(a, unsigned(b)); }
inline unsigned int max(int a, unsigned int b) { return max(unsigned(a), b); }
inline unsigned int max(unsigned int a, int b) { return max(a, unsigned(b)); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
inline double min(float a, double b) { return std::fmin(double(a), b); }
inline double min(double a, float b) { return std::fmin(a, double(b)); }
inline double max(float a, double b) { return std::fmax(double(a), b); }
inline double max(double a, float b) { return std::fmax(a, double(b)); }

// ---- reinterpretation and conversion ----------------------------------------------------------------------
inline int __float_as_int(float x) { return mk_emu::detail::bit_cast<int>(x); }
inline unsigned __float_as_uint(float x) { return mk_emu::detail::bit_cast<unsigned>(x); }
inline float __int_as_float(int x) { return mk_emu::detail::bit_cast<float>(x); }
inline float __uint_as_float(unsigned x) { return mk_emu::detail::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return mk_emu::detail::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return mk_emu::detail::bit_cast<double>(x); }
inline int __float2int_rn(float x) { return mk_emu::detail::cvt_sat<int>(std::nearbyint(x)); }
inline int __float2int_rz(float x) { return mk_emu::detail::cvt_sat<int>(std::trunc(x)); }
inline int __float2int_rd(float x) { return mk_emu::detail::cvt_sat<int>(std::floor(x)); }
inline int __float2int_ru(float x) { return mk_emu::detail::cvt_sat<int>(std::ceil(x)); }
inline unsigned __float2uint_rn(float x) { return mk_emu::detail::cvt_sat<unsigned>(std::nearbyint(x)); }
inline unsigned __float2uint_rz(float x) { return mk_emu::detail::cvt_sat<unsigned>(std::trunc(x)); }
inline long long __float2ll_rn(float x) { return mk_emu::detail::cvt_sat<long long>(std::nearbyint(x)); }
inline long long __float2ll_rz(float x) { return mk_emu::detail::cvt_sat<long long>(std::trunc(x)); }
inline int __double2int_rn(double x) { return mk_emu::detail::cvt_sat<int>(std::nearbyint(x)); }
inline int __double2int_rz(double x) { return mk_emu::detail::cvt_sat<int>(std::trunc(x)); }
inline float __int2float_rn(int x) { return float(x); }
inline float __uint2float_rn(unsigned x) { return float(x); }
inline float __ll2float_rn(long long x) { return float(x); }
inline float __double2float_rn(double x) { return float(x); }

// ---- integer / bit intrinsics -----------------------------------------------------------------------------
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz(unsigned(x)) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  return __builtin_bswap32(x);
}
inline unsigned long long __brevll(unsigned long long x) {
  return (static_cast<unsigned long long>(__brev(unsigned(x))) << 32) | __brev(unsigned(x >> 32));
}
// Byte i of the result is byte s[4i+2:4i] of the 8-byte value {y, x} (x = bytes 0-3).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long v = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= unsigned((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
inline int __mulhi(int a, int b) { return int((static_cast<long long>(a) * b) >> 32); }
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((static_cast<unsigned long long>(a) * b) >> 32); }
inline long long __mul64hi(long long a, long long b) {
  return (long long)((static_cast<mk_emu::detail::i128>(a) * b) >> 64);
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return (unsigned long long)((static_cast<mk_emu::detail::u128>(a) * b) >> 64);
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
  return unsigned((((static_cast<unsigned long long>(hi) << 32) | lo) << (s & 31)) >> 32);
}
inline unsigned __funnelshift_lc(unsigned lo, unsigned hi, unsigned s) {
  return unsigned((((static_cast<unsigned long long>(hi) << 32) | lo) << (s < 32 ? s : 32)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
  return unsigned((((static_cast<unsigned long long>(hi) << 32) | lo) >> (s & 31)));
}
inline unsigned __funnelshift_rc(unsigned lo, unsigned hi, unsigned s) {
  return unsigned((((static_cast<unsigned long long>(hi) << 32) | lo) >> (s < 32 ? s : 32)));
}

// ---- cache-hinted loads and stores: plain accesses on the host --------------------------------------------
template <class T>
inline T __ldg(const T* p) {
  return *p;
}
template <class T>
inline T __ldca(const T* p) {
  return *p;
}
template <class T>
inline T __ldcg(const T* p) {
  return *p;
}
template <class T>
inline T __ldcs(const T* p) {
  return *p;
}
template <class T>
inline T __ldlu(const T* p) {
  return *p;
}
template <class T>
inline T __ldcv(const T* p) {
  return *p;
}
template <class T>
inline void __stwb(T* p, T v) {
  *p = v;
}
template <class T>
inline void __stcg(T* p, T v) {
  *p = v;
}
template <class T>
inline void __stcs(T* p, T v) {
  *p = v;
}
template <class T>
inline void __stwt(T* p, T v) {
  *p = v;
}
