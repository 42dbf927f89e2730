// Gated activations on a packed gate/up projection, x = [g | u] along the last dim: SwiGLU y = silu(g) * u, the
// clamped SwiGLU of gpt-oss and GeGLU (the tanh-GeLU gated product of Gemma). Arguments, the shared math and
// launcher declarations for the CPU kernel (swiglu_cpu.cpp), the CUDA kernel (swiglu_cuda.cu) and its CPU emulation
// (swiglu_cuda_emu.cpp). Torch-free.
//
// Every activation is y = g' * sigmoid(a(g')) * u' with one sigmoid:
//   SiLU:        g' = g, u' = u, a(g) = g
//   ClampedSiLU: g' = min(g, limit), u' = clamp(u, -limit, limit) + 1, a(g) = alpha * g
//   GeluTanh:    g' = g, u' = u, a(g) = 2 * sqrt(2 / pi) * (g + 0.044715 g^3)   (0.5 (1 + tanh(z)) = sigmoid(2 z))
// backward, s = sigmoid(a(g')):  dg = dy * u' * (s + g' * s * (1 - s) * a'(g')) * [g inside the clamp]
//                                du = dy * g' * s * [u inside the clamp]
// (a clamp passes the gradient strictly inside its bounds and none at a bound, as torch.clamp does).
//
// Math in fp32 (fp64 for fp64 data), storage in the data's dtype.
#pragma once
#include <cstdint>
#include <type_traits>

#include "../common/math.h"

namespace megakernels {
namespace swiglu {

// The activation, a compile-time parameter of every kernel (one body, three instantiations).
enum class Act : int32_t { SiLU = 0, ClampedSiLU = 1, GeluTanh = 2 };

struct Args {
  const void* x;   // [rows, 2f], row stride x_stride (elements), last dim contiguous: gate [0, f), up [f, 2f)
  const void* dy;  // backward: [rows, f], row stride dy_stride
  void* y;         // forward: [rows, f] contiguous; backward: dx [rows, 2f] contiguous
  int64_t rows, f, x_stride, dy_stride;
  DType dtype;
  Act act;              // which gated activation (the launchers dispatch on it)
  double limit, alpha;  // ClampedSiLU only: the clamp bound (> 0) and the sigmoid's slope (rounded to the math type)
};

// sigmoid through one exp: on the host mk_exp (the vectorisable fp32 exp); on the GPU, for fp32, the MUFU ex2 and
// reciprocal (__expf, __fdividef: ~2 ulp, relative error < 1e-6 for |g| < 100, far inside the fp32 tolerance)
// instead of expf and an IEEE division, whose range checks and slow-path branches cost ~3x the instructions of
// the whole element. Saturates cleanly: g -> -inf gives 0, g -> +inf gives 1; NaN stays NaN.
template <typename A>
MK_MATH A sigmoid(A g) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<A, float>) return __fdividef(1.0f, 1.0f + __expf(-g));
#endif
  return A(1) / (A(1) + mk_exp(-g));
}

// The clamp bound and slope as the math's type; ignored unless K == Act::ClampedSiLU.
template <typename A>
struct Gate {
  A limit, alpha;
};

template <Act K, typename A>
MK_MATH A gate_in(A g, Gate<A> p) {
  if constexpr (K == Act::ClampedSiLU) return g > p.limit ? p.limit : g;  // NaN stays NaN
  return g;
}

template <Act K, typename A>
MK_MATH A up_in(A u, Gate<A> p) {
  if constexpr (K == Act::ClampedSiLU) return (u > p.limit ? p.limit : (u < -p.limit ? -p.limit : u)) + A(1);
  return u;
}

// The sigmoid's argument a(g') and its derivative a'(g') (the tanh-GeLU constants of common/math.h).

template <Act K, typename A>
MK_MATH A sig_arg(A g, Gate<A> p) {
  if constexpr (K == Act::ClampedSiLU) return p.alpha * g;
  if constexpr (K == Act::GeluTanh) return A(2 * kSqrt2OverPi) * (g + A(kGeluCubic) * g * g * g);
  return g;
}

template <Act K, typename A>
MK_MATH A sig_arg_slope(A g, Gate<A> p) {
  if constexpr (K == Act::ClampedSiLU) return p.alpha;
  if constexpr (K == Act::GeluTanh) return A(2 * kSqrt2OverPi) * (A(1) + A(3 * kGeluCubic) * g * g);
  return A(1);
}

// sigmoid(a(g')) from the raw gate g.
template <Act K, typename A>
MK_MATH A gate_sigmoid(A g, Gate<A> p) {
  return sigmoid(sig_arg<K>(gate_in<K>(g, p), p));
}

template <Act K, typename A>
MK_MATH A fwd(A g, A u, Gate<A> p) {
  const A gc = gate_in<K>(g, p);
  return gc * sigmoid(sig_arg<K>(gc, p)) * up_in<K>(u, p);
}

// The gradients given s = gate_sigmoid(g) (the CPU kernel computes s in a loop of its own).
template <Act K, typename A>
MK_MATH void bwd_from_sigmoid(A g, A u, A dy, A s, Gate<A> p, A& dg, A& du) {
  const A gc = gate_in<K>(g, p);
  const A glu = gc * s;
  du = dy * glu;
  if constexpr (K == Act::SiLU) {
    dg = dy * u * (s + glu * (A(1) - s));
  } else {
    dg = dy * up_in<K>(u, p) * (s + glu * (A(1) - s) * sig_arg_slope<K>(gc, p));
  }
  if constexpr (K == Act::ClampedSiLU) {
    dg = g < p.limit ? dg : A(0);
    du = (u < p.limit && u > -p.limit) ? du : A(0);
  }
}

template <Act K, typename A>
MK_MATH void bwd(A g, A u, A dy, Gate<A> p, A& dg, A& du) {
  bwd_from_sigmoid<K>(g, u, dy, gate_sigmoid<K>(g, p), p, dg, du);
}

}  // namespace swiglu

// The CPU kernels: rows [row_begin, row_end); parallelism comes from the caller (at::parallel_for over rows).
// Declared for the baseline and for each ISA clone (csrc/common/cpu_isa.h), one declaration a line.
// clang-format off
MK_DECLARE_CPU_KERNELS(
void swiglu_fwd_rows(const swiglu::Args& a, int64_t row_begin, int64_t row_end);
void swiglu_bwd_rows(const swiglu::Args& a, int64_t row_begin, int64_t row_end);
)
// clang-format on

// The CUDA kernels, compiled by nvcc (namespace cuda) and for the emulator (namespace cuda_emu). Return nullptr on
// success, else the CUDA error string. `stream` is a cudaStream_t (nullptr for the emulator).
#define MK_DECLARE_SWIGLU_LAUNCHERS                            \
  const char* swiglu_fwd(const swiglu::Args& a, void* stream); \
  const char* swiglu_bwd(const swiglu::Args& a, void* stream);
namespace cuda {
MK_DECLARE_SWIGLU_LAUNCHERS
}
namespace cuda_emu {
MK_DECLARE_SWIGLU_LAUNCHERS
}

}  // namespace megakernels
