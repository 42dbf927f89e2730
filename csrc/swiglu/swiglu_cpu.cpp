// CPU kernels of SwiGLU. Torch-free.
//
// Per row: the gate and up halves (fp32/fp64 in place, 16-bit converted once into scratch rows), one vectorised
// loop computing silu(g) * u (or its two gradients) with the branch-free exp of common/math.h, one conversion out.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "../common/cpu_types.h"
#include "swiglu.h"

namespace megakernels {
namespace cpu {
namespace {

using swiglu::Args;

// A row is walked in pieces of kPiece elements so that 16-bit rows' fp32 scratch (5 pieces in backward) stays in
// L1 instead of streaming whole 14336-element rows through L2.
constexpr int64_t kPiece = 1024;

// The element loops take __restrict pointers and stay out of line: inlined into the row loop, where an fp32 output
// row might alias the input as far as the compiler can tell, GCC vectorises them only behind a runtime overlap
// check and ran the scalar version (4x slower, measured).
template <typename A>
__attribute__((noinline)) void fwd_elems(const A* __restrict g, const A* __restrict u, A* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] = swiglu::fwd<A>(g[j], u[j]);
}

// Backward in two loops over a piece (n <= kPiece): sigmoid(g) first, then both gradients from it. Fused into one
// loop, GCC case-splits the exp's clamp into blended lanes whose unused values go denormal; the microcode assists
// made it ~7x slower than the two loops (measured: 90 ms vs 13 ms for 14.7M elements).
template <typename A>
__attribute__((noinline)) void bwd_elems(const A* __restrict g, const A* __restrict u, const A* __restrict dy,
                                         A* __restrict dg, A* __restrict du, int64_t n) {
  A s[kPiece];
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] = swiglu::sigmoid<A>(g[j]);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) swiglu::bwd_from_sigmoid<A>(g[j], u[j], dy[j], s[j], dg[j], du[j]);
}

template <typename T>
void fwd_rows(const Args& a, int64_t r0, int64_t r1) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t f = a.f;
  const size_t conv = std::is_same_v<T, A> ? 0 : size_t(std::min(f, kPiece));
  std::vector<A> gbuf(conv), ubuf(conv), obuf(conv);
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = static_cast<const T*>(a.x) + r * a.x_stride;
    T* yr = static_cast<T*>(a.y) + r * f;
    for (int64_t j = 0; j < f; j += kPiece) {
      const int64_t n = std::min(kPiece, f - j);
      const A* g = row_view(xr + j, gbuf.data(), n);
      const A* u = row_view(xr + f + j, ubuf.data(), n);
      A* o = out_view(yr + j, obuf.data());
      fwd_elems(g, u, o, n);
      finish_out(o, yr + j, n);
    }
  }
}

template <typename T>
void bwd_rows(const Args& a, int64_t r0, int64_t r1) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t f = a.f;
  const size_t conv = std::is_same_v<T, A> ? 0 : size_t(std::min(f, kPiece));
  std::vector<A> gbuf(conv), ubuf(conv), dbuf(conv), dgbuf(conv), dubuf(conv);
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = static_cast<const T*>(a.x) + r * a.x_stride;
    const T* dyr = static_cast<const T*>(a.dy) + r * a.dy_stride;
    T* dxr = static_cast<T*>(a.y) + r * 2 * f;
    for (int64_t j = 0; j < f; j += kPiece) {
      const int64_t n = std::min(kPiece, f - j);
      const A* g = row_view(xr + j, gbuf.data(), n);
      const A* u = row_view(xr + f + j, ubuf.data(), n);
      const A* dy = row_view(dyr + j, dbuf.data(), n);
      A* dg = out_view(dxr + j, dgbuf.data());
      A* du = out_view(dxr + f + j, dubuf.data());
      bwd_elems(g, u, dy, dg, du, n);
      finish_out(dg, dxr + j, n);
      finish_out(du, dxr + f + j, n);
    }
  }
}

}  // namespace

void swiglu_fwd_rows(const Args& a, int64_t r0, int64_t r1) {
  switch (a.dtype) {
    case DType::F32: return fwd_rows<float>(a, r0, r1);
    case DType::F64: return fwd_rows<double>(a, r0, r1);
    case DType::BF16: return fwd_rows<bf16>(a, r0, r1);
    case DType::F16: return fwd_rows<f16>(a, r0, r1);
  }
}

void swiglu_bwd_rows(const Args& a, int64_t r0, int64_t r1) {
  switch (a.dtype) {
    case DType::F32: return bwd_rows<float>(a, r0, r1);
    case DType::F64: return bwd_rows<double>(a, r0, r1);
    case DType::BF16: return bwd_rows<bf16>(a, r0, r1);
    case DType::F16: return bwd_rows<f16>(a, r0, r1);
  }
}

}  // namespace cpu
}  // namespace megakernels
