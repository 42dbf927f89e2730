// CPU kernel of rotary position embedding. Torch-free.
//
// Work unit: a token. Its d/2 angles are turned into (cos, sin) once (a vectorised loop: the branch-free
// sincos_angle of rope.h), then every head of q and of k is rotated with them: sin/cos cost amortises over all
// heads (40 for Llama-8B's 32 q + 8 kv heads), and each head row is one unit-stride loop the compiler vectorises.
// 16-bit rows go through an fp32 scratch row (one vector conversion in, one out), fp32/fp64 rows are rotated in
// place of the output.
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../common/cpu_types.h"
#include "rope.h"

namespace megakernels {
namespace MK_CPU_NS {  // cpu, or the ISA clone's (csrc/common/cpu_isa.h)
namespace {

using rope::Args;

// (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) for every pair of a head row (s already negated for the inverse).
// Out of line so that the __restrict promises hold: inlined into the token loop, GCC guards the vector loop with a
// runtime overlap check between the fp32 input and output rows.
template <typename A, bool INTERLEAVED>
__attribute__((noinline)) void rotate_row(const A* __restrict x, A* __restrict y, const A* __restrict c,
                                          const A* __restrict s, int64_t half) {
  if constexpr (INTERLEAVED) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const A x1 = x[2 * i], x2 = x[2 * i + 1];
      y[2 * i] = x1 * c[i] - x2 * s[i];
      y[2 * i + 1] = x2 * c[i] + x1 * s[i];
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const A x1 = x[i], x2 = x[i + half];
      y[i] = x1 * c[i] - x2 * s[i];
      y[i + half] = x2 * c[i] + x1 * s[i];
    }
  }
}

template <typename T, bool INTERLEAVED>
void tokens(const Args& a, int64_t t0, int64_t t1) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  constexpr bool kConvert = !std::is_same_v<T, A>;
  const int64_t d = a.d, half = d / 2;
  std::vector<float> inv(a.cos_sin ? 0 : size_t(half));
  for (int64_t i = 0; i < int64_t(inv.size()); ++i) inv[size_t(i)] = rope::inv_freq(i, d, a.log2_theta);
  std::vector<A> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
  std::vector<A> xin(kConvert ? size_t(d) : 0), yout(kConvert ? size_t(d) : 0);
  A *cp = c.data(), *sp = s.data();
  const A sign = a.inverse ? A(-1) : A(1);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i0 = t / a.n1, i1 = t % a.n1;
    const int64_t pos = rope::position_of(a, i0, i1);
    if (a.cos_sin) {
      if (pos < 0 || pos >= a.max_pos) {  // the bindings refuse this; never read outside the table
        std::fill(cp, cp + half, std::numeric_limits<A>::quiet_NaN());
        std::fill(sp, sp + half, std::numeric_limits<A>::quiet_NaN());
      } else {
        const float* row = a.cos_sin + pos * d;  // [d/2, 2]
        for (int64_t i = 0; i < half; ++i) cp[i] = A(row[2 * i]), sp[i] = sign * A(row[2 * i + 1]);
      }
    } else {
      const float pf = float(pos);
      const float* ip = inv.data();
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        A si, ci;
        rope::sincos_angle(pf * ip[i], si, ci);
        cp[i] = ci;
        sp[i] = sign * si;
      }
    }
    for (int u = 0; u < 2; ++u) {
      const T* xb = static_cast<const T*>(a.x[u]) + i0 * a.xs0[u] + i1 * a.xs1[u];
      T* yb = static_cast<T*>(a.y[u]) + i0 * a.ys0[u] + i1 * a.ys1[u];
      for (int64_t h = 0; h < a.heads[u]; ++h) {
        const T* xr = xb + h * a.xsh[u];
        T* yr = yb + h * a.ysh[u];
        const A* xv = row_view(xr, xin.data(), d);
        A* yv = out_view(yr, yout.data());
        rotate_row<A, INTERLEAVED>(xv, yv, cp, sp, half);
        finish_out(yv, yr, d);
      }
    }
  }
}

template <typename T>
void dispatch_layout(const Args& a, int64_t t0, int64_t t1) {
  if (a.interleaved)
    tokens<T, true>(a, t0, t1);
  else
    tokens<T, false>(a, t0, t1);
}

}  // namespace

void rope_tokens(const Args& a, int64_t t0, int64_t t1) {
  switch (a.dtype) {
    case DType::F32: return dispatch_layout<float>(a, t0, t1);
    case DType::F64: return dispatch_layout<double>(a, t0, t1);
    case DType::BF16: return dispatch_layout<bf16>(a, t0, t1);
    case DType::F16: return dispatch_layout<f16>(a, t0, t1);
  }
}

}  // namespace MK_CPU_NS
}  // namespace megakernels
