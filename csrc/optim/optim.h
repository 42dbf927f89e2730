// Optimizer family (multi-tensor AdamW, non-finite check, L2 norm): arguments, the per-element AdamW math and
// launcher declarations shared by the CPU kernels (adamw_cpu.cpp), the CUDA kernels (adamw_cuda.cu) and its CPU
// emulation (adamw_cuda_emu.cpp). Torch-free: tensor lists cross this boundary as host arrays of raw pointers.
//
// Multi-tensor apply: a list of tensors is cut into chunks of `chunk_size` elements (the last chunk of a tensor
// may be short); a chunk is the unit of work (one CUDA block, one at::parallel_for task). Chunks never straddle
// two tensors, so a worker needs only (tensor index, chunk index) to find its elements.
//
// AdamW follows torch.optim.AdamW's order of operations, with its scalars rounded to fp32 where torch rounds them
// (so an fp32 trajectory matches torch's to rounding noise):
//   t = step + 1;  bc1 = 1 - beta1^t;  bc2 = 1 - beta2^t                        (fp64, once per tensor)
//   p  = p * (1 - lr*wd)
//   m  = m + (1 - beta1) * (g - m)                                              (torch's lerp, weight < 0.5)
//   v  = v * beta2 + (1 - beta2) * g * g
//   p  = p + (-lr/bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
//      = p + (-lr*sqrt(bc2)/bc1) * m / (sqrt(v) + eps*sqrt(bc2))        (as computed: one division, not two)
// with g = grad / grad_scale when a scale is given. Precision: params and grads in `param_dtype`; moments in
// param_dtype, or fp32 with an fp32 master copy of the params (`master`, mixed precision) whose rounded value is
// written back to the 16-bit param in the same pass. In master mode the grads may be fp32 instead (`grad_f32`: fp32
// gradient buffers of 16-bit params, as a data-parallel trainer keeps them). All math in fp32.
#pragma once
#include <cmath>
#include <cstdint>

#include "../common/math.h"

namespace megakernels {
namespace optim {

constexpr int64_t kDefaultChunk = 65536;

// One parameter of a multi-tensor AdamW launch. Every pointer is on the launch's device.
struct AdamWTensor {
  void* param;        // numel, param_dtype
  const void* grad;   // numel, param_dtype, or fp32 with AdamWArgs::grad_f32
  void* exp_avg;      // numel, param_dtype, or fp32 in master mode
  void* exp_avg_sq;   // numel, same dtype as exp_avg
  float* master;      // numel fp32 master weights, or nullptr (then param is updated in place)
  const float* step;  // scalar: optimizer steps taken so far (torch's state["step"]); read, not written
  int64_t numel;
};

struct AdamWArgs {
  const AdamWTensor* tensors;  // host array of n_tensors
  int64_t n_tensors;
  DType param_dtype;  // F32, F16 or BF16
  bool master;        // every tensor has a master copy; moments are fp32
  bool grad_f32;      // master mode only: the grads are fp32 rather than param_dtype
  double lr, beta1, beta2, eps, weight_decay;
  const float* grad_scale;  // scalar on the device, or nullptr: grads are divided by it
  const float* found_inf;   // scalar on the device, or nullptr: when != 0 the launch changes nothing
  int64_t chunk_size;       // elements per chunk, > 0
};

// Lists of one tensor kind for the non-finite check and the L2 norm.
struct ListArgs {
  const void* const* tensors;  // host array of n_tensors pointers
  const int64_t* numels;       // host array
  int64_t n_tensors;
  DType dtype;  // F32, F16 or BF16
  int64_t chunk_size;
};

// fp32 coefficients of one AdamW step of a tensor, computed in fp64 and rounded once, as torch passes them.
struct AdamWCoeffs {
  float decay;      // 1 - lr * weight_decay
  float w1;         // 1 - beta1 (the lerp weight)
  float beta2, w2;  // beta2, 1 - beta2
  float neg_step;   // -lr * sqrt(bc2) / bc1
  float eps;        // eps * sqrt(bc2)
};

MK_MATH AdamWCoeffs adamw_coeffs(double lr, double beta1, double beta2, double eps, double wd, float step) {
  const double t = double(step) + 1.0;
  const double bc1 = 1.0 - std::pow(beta1, t);
  const double bc2 = 1.0 - std::pow(beta2, t);
  AdamWCoeffs c;
  c.decay = float(1.0 - lr * wd);
  c.w1 = float(1.0 - beta1);
  c.beta2 = float(beta2);
  c.w2 = float(1.0 - beta2);
  c.neg_step = float(-(lr * std::sqrt(bc2) / bc1));
  c.eps = float(eps * std::sqrt(bc2));
  return c;
}

// a*b + c rounded once where the hardware has FMA (the GPU; x86 with -march=native), as torch's CPU lerp and
// addcmul kernels compute it; two roundings otherwise (portable builds), one ulp apart at most.
MK_MATH float fmadd(float a, float b, float c) {
#if defined(__CUDA_ARCH__) || defined(MK_TARGET_FMA)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// One element: p (the fp32 value of the param or its master), g (unscaled grad), m, v updated in place. The
// first three lines round like the torch ops they mirror (mul_; lerp_, an fma; mul_ then addcmul_, an fma of
// (w2*g)*g). The last folds torch's division by sqrt(bc2) into the scalars: one division per element instead of
// two (which matters only where the update is not memory-bound, e.g. tensors resident in cache); it moves a
// result by an ulp at most.
MK_MATH void adamw_update(float& p, float g, float& m, float& v, const AdamWCoeffs& c) {
  p = p * c.decay;
  m = fmadd(c.w1, g - m, m);
  v = fmadd(c.w2 * g, g, v * c.beta2);
  p = p + c.neg_step * m / (std::sqrt(v) + c.eps);
}

// Chunks of a list: chunks(n) = ceil(n / chunk_size), 0 for an empty tensor.
MK_MATH int64_t chunks_of(int64_t numel, int64_t chunk_size) { return (numel + chunk_size - 1) / chunk_size; }

}  // namespace optim

// The CPU kernels. Parallelism comes from the caller (at::parallel_for over chunks); each function handles
// elements [begin, end) of one tensor of the list.
// Declared for the baseline and for each ISA clone (csrc/common/cpu_isa.h), one declaration a line.
// clang-format off
MK_DECLARE_CPU_KERNELS(
// AdamW on elements [begin, end) of tensor `t`. Reads *a.grad_scale; ignores found_inf (the caller skips).
void adamw_range(const optim::AdamWArgs& a, int64_t t, int64_t begin, int64_t end);
// Whether any of elements [begin, end) of tensor `t`, divided by *grad_scale when given, is inf or NaN.
bool nonfinite_range(const optim::ListArgs& a, const float* grad_scale, int64_t t, int64_t begin, int64_t end);
// Sum of squares of elements [begin, end) of tensor `t`, accumulated in fp32 in a fixed order.
float sumsq_range(const optim::ListArgs& a, int64_t t, int64_t begin, int64_t end);
)
// clang-format on

// The CUDA kernels, compiled twice from adamw_cuda.cu: by nvcc into namespace `cuda`, and by g++ against the
// emulation layer (csrc/emu) into namespace `cuda_emu`. Launchers return nullptr on success, else the CUDA error
// string; `stream` is a cudaStream_t (nullptr for the emulator). None of them synchronises with the host.
//   adamw:          the update of every tensor (skipped on the device when *found_inf != 0), then step += 1 for
//                   every tensor unless *found_inf != 0.
//   nonfinite_check: *found_inf = 1 when any element of the list divided by *grad_scale (if given) is not finite;
//                   otherwise *found_inf is left as it was.
//   l2norm:         *out = sqrt(sum of squares) in fp32; `partials` is a device workspace of
//                   l2norm_workspace_floats(a) floats. Deterministic: fixed chunk partials, fixed-order sum.
#define MK_DECLARE_OPTIM_LAUNCHERS                                                                                \
  const char* adamw(const optim::AdamWArgs& a, void* stream);                                                     \
  const char* nonfinite_check(const optim::ListArgs& a, const float* grad_scale, float* found_inf, void* stream); \
  int64_t l2norm_workspace_floats(const optim::ListArgs& a);                                                      \
  const char* l2norm(const optim::ListArgs& a, float* partials, float* out, void* stream);

namespace cuda {
MK_DECLARE_OPTIM_LAUNCHERS
}
namespace cuda_emu {
MK_DECLARE_OPTIM_LAUNCHERS
}

}  // namespace megakernels
