// CPU kernels of the gated activations (swiglu.h). Torch-free.
//
// Per row, in pieces of kPiece elements: one vectorised loop computing the gated product (backward: a sigmoid loop,
// then one loop for both gradients) with the branch-free exp of common/math.h. fp32, fp64 and bf16 elements are read
// and written in the loop itself (bf16's conversions are a shift and a rounding add, which vectorise inline); fp16 rows
// go through F16C conversions into L1-resident fp32 pieces, which the same loops then read.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "../common/cpu_types.h"
#include "swiglu.h"

namespace megakernels {
namespace MK_CPU_NS {  // cpu, or the ISA clone's (csrc/common/cpu_isa.h)
namespace {

using swiglu::Act;
using swiglu::Args;
using swiglu::Gate;

constexpr int64_t kPiece = 1024;

template <typename T>
using AccOf = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Loops read T directly unless its scalar conversion does not vectorise (fp16 without a row conversion).
template <typename T>
constexpr bool kDirect = !std::is_same_v<T, f16>;

template <typename A, typename T>
inline A in(T v) {
  return A(to_float(v));
}
template <typename T, typename A>
inline T out(A v) {
  if constexpr (std::is_same_v<T, A>)
    return v;
  else
    return from_float<T>(float(v));
}

// The element loops take __restrict pointers and stay out of line: inlined into the row loop, where an fp32 output
// row might alias the input as far as the compiler can tell, GCC vectorises them only behind a runtime overlap
// check and ran the scalar version (4x slower, measured).
template <Act K, typename T, typename A>
__attribute__((noinline)) void fwd_elems(const T* __restrict g, const T* __restrict u, T* __restrict y, int64_t n,
                                         Gate<A> p) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] = out<T>(swiglu::fwd<K, A>(in<A>(g[j]), in<A>(u[j]), p));
}

// Backward in two loops over a piece (n <= kPiece): sigmoid(g) first, then both gradients from it. Fused into one
// loop, GCC case-splits the exp's clamp into blended lanes whose unused values go denormal; the microcode assists
// made it ~7x slower than the two loops (measured: 90 ms vs 13 ms for 14.7M elements).
template <Act K, typename T, typename A>
__attribute__((noinline)) void bwd_elems(const T* __restrict g, const T* __restrict u, const T* __restrict dy,
                                         T* __restrict dg, T* __restrict du, int64_t n, Gate<A> p) {
  A s[kPiece];
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] = swiglu::gate_sigmoid<K, A>(in<A>(g[j]), p);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    A dgj, duj;
    swiglu::bwd_from_sigmoid<K, A>(in<A>(g[j]), in<A>(u[j]), in<A>(dy[j]), s[j], p, dgj, duj);
    dg[j] = out<T>(dgj);
    du[j] = out<T>(duj);
  }
}

template <Act K, typename T>
void fwd_rows(const Args& a, int64_t r0, int64_t r1) {
  using A = AccOf<T>;
  const Gate<A> p{A(a.limit), A(a.alpha)};
  const int64_t f = a.f;
  std::vector<A> buf(kDirect<T> ? 0 : size_t(3 * kPiece));
  A *gs = buf.data(), *us = gs + kPiece, *ys = us + kPiece;
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = static_cast<const T*>(a.x) + r * a.x_stride;
    T* yr = static_cast<T*>(a.y) + r * f;
    for (int64_t j = 0; j < f; j += kPiece) {
      const int64_t n = std::min(kPiece, f - j);
      if constexpr (kDirect<T>) {
        fwd_elems<K, T, A>(xr + j, xr + f + j, yr + j, n, p);
      } else {
        load_row(xr + j, gs, n);
        load_row(xr + f + j, us, n);
        fwd_elems<K, A, A>(gs, us, ys, n, p);
        store_row(ys, yr + j, n);
      }
    }
  }
}

template <Act K, typename T>
void bwd_rows(const Args& a, int64_t r0, int64_t r1) {
  using A = AccOf<T>;
  const Gate<A> p{A(a.limit), A(a.alpha)};
  const int64_t f = a.f;
  std::vector<A> buf(kDirect<T> ? 0 : size_t(5 * kPiece));
  A *gs = buf.data(), *us = gs + kPiece, *ds = us + kPiece, *dgs = ds + kPiece, *dus = dgs + kPiece;
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = static_cast<const T*>(a.x) + r * a.x_stride;
    const T* dyr = static_cast<const T*>(a.dy) + r * a.dy_stride;
    T* dxr = static_cast<T*>(a.y) + r * 2 * f;
    for (int64_t j = 0; j < f; j += kPiece) {
      const int64_t n = std::min(kPiece, f - j);
      if constexpr (kDirect<T>) {
        bwd_elems<K, T, A>(xr + j, xr + f + j, dyr + j, dxr + j, dxr + f + j, n, p);
      } else {
        load_row(xr + j, gs, n);
        load_row(xr + f + j, us, n);
        load_row(dyr + j, ds, n);
        bwd_elems<K, A, A>(gs, us, ds, dgs, dus, n, p);
        store_row(dgs, dxr + j, n);
        store_row(dus, dxr + f + j, n);
      }
    }
  }
}

template <Act K, typename T>
struct FwdRows {
  static void run(const Args& a, int64_t r0, int64_t r1) { fwd_rows<K, T>(a, r0, r1); }
};
template <Act K, typename T>
struct BwdRows {
  static void run(const Args& a, int64_t r0, int64_t r1) { bwd_rows<K, T>(a, r0, r1); }
};

template <template <Act, typename> class Rows, Act K>
void dispatch_dtype(const Args& a, int64_t r0, int64_t r1) {
  switch (a.dtype) {
    case DType::F32: return Rows<K, float>::run(a, r0, r1);
    case DType::F64: return Rows<K, double>::run(a, r0, r1);
    case DType::BF16: return Rows<K, bf16>::run(a, r0, r1);
    case DType::F16: return Rows<K, f16>::run(a, r0, r1);
  }
}

template <template <Act, typename> class Rows>
void dispatch(const Args& a, int64_t r0, int64_t r1) {
  switch (a.act) {
    case Act::SiLU: return dispatch_dtype<Rows, Act::SiLU>(a, r0, r1);
    case Act::ClampedSiLU: return dispatch_dtype<Rows, Act::ClampedSiLU>(a, r0, r1);
    case Act::GeluTanh: return dispatch_dtype<Rows, Act::GeluTanh>(a, r0, r1);
  }
}

}  // namespace

void swiglu_fwd_rows(const Args& a, int64_t r0, int64_t r1) { dispatch<FwdRows>(a, r0, r1); }
void swiglu_bwd_rows(const Args& a, int64_t r0, int64_t r1) { dispatch<BwdRows>(a, r0, r1); }

}  // namespace MK_CPU_NS
}  // namespace megakernels
