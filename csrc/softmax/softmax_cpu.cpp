// CPU kernels of the softmax family. Torch-free.
//
// Per row, three unit-stride passes over one scratch row that stays in L1/L2 (the output row itself for
// fp32/fp64, an fp32 buffer for 16-bit storage): (1) z = x * scale with masked positions at -inf, and max(z);
// (2) e = exp(z - max) and sum(e); (3) y = e / sum. x is read once and exp is evaluated once per element; every
// loop is `omp simd` (-fopenmp-simd: no OpenMP runtime here) and uses mk_exp, a polynomial exp that vectorises
// where libm's expf would not. The causal kernel runs the three passes over the valid prefix of each row only
// and writes the masked tail without reading x there.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../common/cpu_types.h"
#include "softmax.h"

namespace megakernels {
namespace MK_CPU_NS {  // cpu, or the ISA clone's (csrc/common/cpu_isa.h)
namespace {

using softmax::BwdArgs;
using softmax::FwdArgs;
using softmax::MaskKind;

// Passes (2) and (3) on z[0, n), in place; z[n, sk) gets the masked positions' value.
template <typename A>
inline void normalise(A* z, int64_t n, int64_t sk, A m) {
  const A sum = lane_sum<A>(n, [z, m](int64_t j) {
    const A e = softmax::softmax_exp(z[j] - m);
    z[j] = e;
    return e;
  });
  // A NaN/+inf among the inputs, or valid inputs that are all -inf, make `sum` NaN, hence the whole row NaN (as
  // torch.softmax); masked positions get 0 * inv, which is 0 unless the row is NaN.
  const A inv = A(1) / sum;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) z[j] *= inv;
  const A fill = A(0) * inv;
  for (int64_t j = n; j < sk; ++j) z[j] = fill;
}

template <typename T, typename A, MaskKind K>
void fwd_rows(const FwdArgs& a, int64_t r0, int64_t r1) {
  const int64_t sk = a.sk;
  const A scale = A(a.scale);
  const A ninf = -std::numeric_limits<A>::infinity();
  std::vector<A> buf(std::is_same_v<T, A> ? 0 : static_cast<size_t>(sk));
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = static_cast<const T*>(a.x) + r * sk;
    T* yr = static_cast<T*>(a.y) + r * sk;
    A* z = out_view(yr, buf.data());
    const int64_t i = r % a.sq;
    const int64_t n = K == MaskKind::Causal ? softmax::causal_valid(i, a.sq, sk) : sk;
    // Pass (1): z = x * scale, -inf where masked (a select, not arithmetic: a NaN under the mask is dropped),
    // with max(z) and the number of masked positions as reductions of the same loop.
    const A* v = row_view(xr, z, n);  // x itself for fp32/fp64; for 16-bit, converted into z and updated in place
    A m = ninf;
    int64_t masked = 0;
    if constexpr (K == MaskKind::Bool) {
      const int64_t bh = r / a.sq;
      const unsigned char* mr = a.mask + (bh / a.heads) * a.mask_sb + (bh % a.heads) * a.mask_sh + i * a.mask_sq;
#pragma omp simd reduction(max : m) reduction(+ : masked)
      for (int64_t j = 0; j < n; ++j) {
        // x is read unconditionally, then selected: written as `mj ? -inf : x * scale`, gcc turns the read into
        // a masked (fault-suppressing) vector load, which made this loop 3x slower than the unmasked one.
        const A xs = v[j] * scale;
        const bool mj = mr[j] != 0;
        const A zj = mj ? ninf : xs;
        z[j] = zj;
        m = std::max(m, zj);
        masked += mj;
      }
    } else {
      m = lane_max<A>(n, ninf, [v, z, scale](int64_t j) {
        const A zj = v[j] * scale;
        z[j] = zj;
        return zj;
      });
    }
    const int64_t valid = n - masked;
    if (valid == 0) {
      std::fill(z, z + sk, A(0));
    } else {
      normalise(z, n, sk, m);
    }
    finish_out(z, yr, sk);
  }
}

// dx = scale * y * (dy - sum(dy * y)); the causal kernel reads only the valid prefix (y is 0 past it).
template <typename T, typename A, bool CAUSAL>
void bwd_rows(const BwdArgs& a, int64_t r0, int64_t r1) {
  const int64_t sk = a.sk;
  const A scale = A(a.scale);
  const size_t conv = std::is_same_v<T, A> ? 0 : static_cast<size_t>(sk);
  std::vector<A> ybuf(conv), gbuf(conv), obuf(conv);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t n = CAUSAL ? softmax::causal_valid(r % a.sq, a.sq, sk) : sk;
    const T* yr = static_cast<const T*>(a.y) + r * sk;
    const T* gr = static_cast<const T*>(a.dy) + r * sk;
    T* dxr = static_cast<T*>(a.dx) + r * sk;
    const A* yv = row_view(yr, ybuf.data(), n);
    const A* gv = row_view(gr, gbuf.data(), n);
    const A s = lane_sum<A>(n, [yv, gv](int64_t j) { return yv[j] * gv[j]; });
    A* o = out_view(dxr, obuf.data());
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) o[j] = scale * yv[j] * (gv[j] - s);
    std::fill(o + n, o + sk, A(0));
    finish_out(o, dxr, sk);
  }
}

template <template <typename, typename> class F, typename... Args>
void dispatch(DType dt, Args&&... args) {
  switch (dt) {
    case DType::F32: return F<float, float>::run(args...);
    case DType::F64: return F<double, double>::run(args...);
    case DType::BF16: return F<bf16, float>::run(args...);
    case DType::F16: return F<f16, float>::run(args...);
  }
}

template <typename T, typename A>
struct FwdOp {
  static void run(const FwdArgs& a, int64_t r0, int64_t r1) {
    switch (a.kind) {
      case MaskKind::None: return fwd_rows<T, A, MaskKind::None>(a, r0, r1);
      case MaskKind::Bool: return fwd_rows<T, A, MaskKind::Bool>(a, r0, r1);
      case MaskKind::Causal: return fwd_rows<T, A, MaskKind::Causal>(a, r0, r1);
    }
  }
};
template <typename T, typename A>
struct BwdOp {
  static void run(const BwdArgs& a, int64_t r0, int64_t r1) {
    if (a.causal)
      bwd_rows<T, A, true>(a, r0, r1);
    else
      bwd_rows<T, A, false>(a, r0, r1);
  }
};

}  // namespace

void softmax_fwd_rows(const FwdArgs& a, int64_t r0, int64_t r1) { dispatch<FwdOp>(a.dtype, a, r0, r1); }
void softmax_bwd_rows(const BwdArgs& a, int64_t r0, int64_t r1) { dispatch<BwdOp>(a.dtype, a, r0, r1); }

}  // namespace MK_CPU_NS
}  // namespace megakernels
