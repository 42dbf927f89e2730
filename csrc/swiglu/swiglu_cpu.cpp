// CPU kernels of SwiGLU. Torch-free.
//
// Per row: the gate and up halves (fp32/fp64 in place, 16-bit converted once into scratch rows), one vectorised
// loop computing silu(g) * u (or its two gradients) with the branch-free exp of common/math.h, one conversion out.
#include <type_traits>
#include <vector>

#include "../common/cpu_types.h"
#include "swiglu.h"

namespace megakernels {
namespace cpu {
namespace {

using swiglu::Args;

template <typename T>
void fwd_rows(const Args& a, int64_t r0, int64_t r1) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t f = a.f;
  const size_t conv = std::is_same_v<T, A> ? 0 : size_t(f);
  std::vector<A> gbuf(conv), ubuf(conv), obuf(conv);
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = static_cast<const T*>(a.x) + r * a.x_stride;
    T* yr = static_cast<T*>(a.y) + r * f;
    const A* g = row_view(xr, gbuf.data(), f);
    const A* u = row_view(xr + f, ubuf.data(), f);
    A* o = out_view(yr, obuf.data());
#pragma omp simd
    for (int64_t j = 0; j < f; ++j) o[j] = swiglu::fwd<A>(g[j], u[j]);
    finish_out(o, yr, f);
  }
}

template <typename T>
void bwd_rows(const Args& a, int64_t r0, int64_t r1) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t f = a.f;
  const size_t conv = std::is_same_v<T, A> ? 0 : size_t(f);
  std::vector<A> gbuf(conv), ubuf(conv), dbuf(conv), dgbuf(conv), dubuf(conv);
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = static_cast<const T*>(a.x) + r * a.x_stride;
    T* dxr = static_cast<T*>(a.y) + r * 2 * f;
    const A* g = row_view(xr, gbuf.data(), f);
    const A* u = row_view(xr + f, ubuf.data(), f);
    const A* dy = row_view(static_cast<const T*>(a.dy) + r * a.dy_stride, dbuf.data(), f);
    A* dg = out_view(dxr, dgbuf.data());
    A* du = out_view(dxr + f, dubuf.data());
#pragma omp simd
    for (int64_t j = 0; j < f; ++j) swiglu::bwd<A>(g[j], u[j], dy[j], dg[j], du[j]);
    finish_out(dg, dxr, f);
    finish_out(du, dxr + f, f);
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
