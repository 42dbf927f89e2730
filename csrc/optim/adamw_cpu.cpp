// CPU kernels of the optimizer family: multi-tensor AdamW, non-finite check, sum of squares. Torch-free.
//
// AdamW is memory-bound: each element is read once (param, grad, both moments [, master]) and written once, in
// one unit-stride loop that -O3 vectorises (`omp simd` needs only -fopenmp-simd; the sqrt and the divisions
// vectorise because the build sets -fno-math-errno). 16-bit params are converted element by element inside the
// same loop rather than through scratch rows: a chunk is touched exactly once, so there is nothing to cache.
//
// Rounding: every operation is rounded on its own, as torch's AdamW rounds its sequence of tensor ops, so fp32
// trajectories match torch's bit for bit rather than drift apart by an ulp per step. That needs the compiler's
// FMA contraction off in this file (GCC contracts a*b+c across statements by default under -march=native).
#pragma GCC optimize("fp-contract=off")
#include <cmath>
#include <type_traits>

#include "../common/cpu_types.h"
#include "optim.h"

namespace megakernels {
namespace MK_CPU_NS {  // cpu, or the ISA clone's (csrc/common/cpu_isa.h)
namespace {

using optim::AdamWArgs;
using optim::AdamWCoeffs;
using optim::ListArgs;

template <typename T>
inline float ld(const T& v) {
  return to_float(v);
}
template <typename T>
inline T st(float v) {
  return from_float<T>(v);
}

// P: param storage; G: grad storage (P, or float with fp32 grads in master mode); S: moment storage (P, or float in
// master mode). SCALE: grads are divided by *grad_scale.
template <typename P, typename G, typename S, bool MASTER, bool SCALE>
void adamw_kernel(const AdamWArgs& a, const optim::AdamWTensor& t, int64_t begin, int64_t end) {
  const AdamWCoeffs c = optim::adamw_coeffs(a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, *t.step);
  const float scale = SCALE ? *a.grad_scale : 1.0f;
  P* __restrict p = static_cast<P*>(t.param);
  const G* __restrict g = static_cast<const G*>(t.grad);
  S* __restrict m = static_cast<S*>(t.exp_avg);
  S* __restrict v = static_cast<S*>(t.exp_avg_sq);
  float* __restrict w = t.master;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    float pv = MASTER ? w[i] : ld(p[i]);
    float gv = ld(g[i]);
    if (SCALE) gv = gv / scale;
    float mv = ld(m[i]), vv = ld(v[i]);
    optim::adamw_update(pv, gv, mv, vv, c);
    m[i] = st<S>(mv);
    v[i] = st<S>(vv);
    if (MASTER) w[i] = pv;
    p[i] = st<P>(pv);
  }
}

template <typename P, typename G, typename S, bool MASTER>
void adamw_scale(const AdamWArgs& a, const optim::AdamWTensor& t, int64_t b, int64_t e) {
  if (a.grad_scale)
    adamw_kernel<P, G, S, MASTER, true>(a, t, b, e);
  else
    adamw_kernel<P, G, S, MASTER, false>(a, t, b, e);
}

template <typename P>
void adamw_dispatch(const AdamWArgs& a, const optim::AdamWTensor& t, int64_t b, int64_t e) {
  if (a.master && a.grad_f32)
    adamw_scale<P, float, float, true>(a, t, b, e);
  else if (a.master)
    adamw_scale<P, P, float, true>(a, t, b, e);
  else
    adamw_scale<P, P, P, false>(a, t, b, e);
}

// inf * 0 and NaN * 0 are NaN, finite * 0 is 0: the sum stays 0 exactly when every element is finite, and the
// loop is a plain vectorisable reduction (no early exit, no classification per element).
template <typename T, bool SCALE>
bool nonfinite_kernel(const T* x, float scale, int64_t b, int64_t e) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = b; i < e; ++i) {
    float v = ld(x[i]);
    if (SCALE) v = v / scale;
    acc += v * 0.0f;
  }
  return acc != 0.0f;  // NaN != 0 is true
}

// Sixteen independent partial sums in a fixed layout: vectorises without any reassociation licence beyond the
// explicit lanes, so the result is the same for every run and thread count.
template <typename T>
float sumsq_kernel(const T* x, int64_t b, int64_t e) {
  constexpr int L = 16;
  float lanes[L] = {};
  int64_t i = b;
  for (; i + L <= e; i += L) {
#pragma omp simd
    for (int k = 0; k < L; ++k) {
      const float v = ld(x[i + k]);
      lanes[k] += v * v;
    }
  }
  for (int k = 0; i < e; ++i, ++k) {
    const float v = ld(x[i]);
    lanes[k] += v * v;
  }
  float s = 0.0f;
  for (int k = 0; k < L; ++k) s += lanes[k];
  return s;
}

}  // namespace

void adamw_range(const AdamWArgs& a, int64_t t, int64_t b, int64_t e) {
  const optim::AdamWTensor& tt = a.tensors[t];
  switch (a.param_dtype) {
    case DType::F32: return adamw_dispatch<float>(a, tt, b, e);
    case DType::BF16: return adamw_dispatch<bf16>(a, tt, b, e);
    case DType::F16: return adamw_dispatch<f16>(a, tt, b, e);
    case DType::F64: return;  // rejected by the bindings
  }
}

bool nonfinite_range(const ListArgs& a, const float* grad_scale, int64_t t, int64_t b, int64_t e) {
  const void* x = a.tensors[t];
  const float s = grad_scale ? *grad_scale : 1.0f;
  switch (a.dtype) {
    case DType::F32:
      return grad_scale ? nonfinite_kernel<float, true>(static_cast<const float*>(x), s, b, e)
                        : nonfinite_kernel<float, false>(static_cast<const float*>(x), s, b, e);
    case DType::BF16:
      return grad_scale ? nonfinite_kernel<bf16, true>(static_cast<const bf16*>(x), s, b, e)
                        : nonfinite_kernel<bf16, false>(static_cast<const bf16*>(x), s, b, e);
    case DType::F16:
      return grad_scale ? nonfinite_kernel<f16, true>(static_cast<const f16*>(x), s, b, e)
                        : nonfinite_kernel<f16, false>(static_cast<const f16*>(x), s, b, e);
    case DType::F64: return false;
  }
  return false;
}

float sumsq_range(const ListArgs& a, int64_t t, int64_t b, int64_t e) {
  const void* x = a.tensors[t];
  switch (a.dtype) {
    case DType::F32: return sumsq_kernel(static_cast<const float*>(x), b, e);
    case DType::BF16: return sumsq_kernel(static_cast<const bf16*>(x), b, e);
    case DType::F16: return sumsq_kernel(static_cast<const f16*>(x), b, e);
    case DType::F64: return 0.0f;
  }
  return 0.0f;
}

}  // namespace MK_CPU_NS
}  // namespace megakernels
