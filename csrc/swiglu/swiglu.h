// SwiGLU on a packed gate/up projection: y = silu(g) * u with x = [g | u] along the last dim. Arguments, the shared
// math and launcher declarations for the CPU kernel (swiglu_cpu.cpp), the CUDA kernel (swiglu_cuda.cu) and its CPU
// emulation (swiglu_cuda_emu.cpp). Torch-free.
//
//   forward:  y  = silu(g) * u,                silu(g) = g * sigmoid(g)
//   backward: dg = dy * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))),   du = dy * silu(g)
//
// Math in fp32 (fp64 for fp64 data), storage in the data's dtype.
#pragma once
#include <cstdint>
#include <type_traits>

#include "../common/math.h"

namespace megakernels {
namespace swiglu {

struct Args {
  const void* x;   // [rows, 2f], row stride x_stride (elements), last dim contiguous: gate [0, f), up [f, 2f)
  const void* dy;  // backward: [rows, f], row stride dy_stride
  void* y;         // forward: [rows, f] contiguous; backward: dx [rows, 2f] contiguous
  int64_t rows, f, x_stride, dy_stride;
  DType dtype;
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

template <typename A>
MK_MATH A fwd(A g, A u) {
  return g * sigmoid(g) * u;
}

// The gradients given s = sigmoid(g) (the CPU kernel computes s in a loop of its own).
template <typename A>
MK_MATH void bwd_from_sigmoid(A g, A u, A dy, A s, A& dg, A& du) {
  const A silu = g * s;
  du = dy * silu;
  dg = dy * u * (s + silu * (A(1) - s));
}

template <typename A>
MK_MATH void bwd(A g, A u, A dy, A& dg, A& du) {
  bwd_from_sigmoid(g, u, dy, sigmoid(g), dg, du);
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
