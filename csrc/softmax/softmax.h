// Softmax family (Megatron's fused attention softmaxes, without their sequence-length caps): softmax over the last
// dimension of x * scale, optionally with a boolean mask broadcast over batch/heads/queries, or with the causal
// mask. Arguments and launcher declarations shared by the CPU kernels (softmax_cpu.cpp), the CUDA kernels
// (softmax_cuda.cu) and their CPU emulation (softmax_cuda_emu.cpp). Torch-free; csrc/bindings/ checks everything.
//
// Semantics of one row (the plain-PyTorch reference in megakernels/ops/softmax.py is the same thing):
//   valid = the unmasked positions. No valid position -> the row is all zeros (and so is its gradient).
//   Otherwise y = softmax(z) with z_j = x_j * scale for valid j and z_j = -inf for masked j, exactly as
//   masked_fill(-inf) + torch.softmax: a NaN or +inf among the valid z, or valid z that are all -inf, make the
//   whole row NaN. Masked inputs are never used (the causal kernels do not even read them).
// Backward needs only y: dx = scale * y * (dy - sum_j dy_j * y_j).
//
// Precision: x/y/dy/dx are stored in `dtype`; the math is in A = double for fp64, float otherwise.
#pragma once
#include <cstdint>

#include "../common/math.h"

namespace megakernels {
namespace softmax {

enum class MaskKind : int { None = 0, Bool = 1, Causal = 2 };

struct FwdArgs {
  const void* x;              // [rows, sk], rows = prod(leading dims), contiguous
  const unsigned char* mask;  // MaskKind::Bool only: element (b, h, i, j) at mask[b*sb + h*sh + i*sq_stride + j]
  void* y;                    // [rows, sk]
  int64_t rows, sq, sk;       // row r is query i = r % sq of (b, h) = divmod(r / sq, heads)
  int64_t heads;              // MaskKind::Bool only
  int64_t mask_sb, mask_sh, mask_sq;  // mask strides in elements; 0 for a broadcast dimension
  double scale;
  DType dtype;
  MaskKind kind;
};

struct BwdArgs {
  const void* dy;  // [rows, sk]
  const void* y;   // [rows, sk], the forward output
  void* dx;        // [rows, sk]
  int64_t rows, sq, sk;
  double scale;
  DType dtype;
  bool causal;  // skip (and zero) the masked triangle
};

// Number of valid leading columns of causal row `i` (query i of sq, keys sk): element (i, j) is masked when
// j > i + (sk - sq), i.e. the diagonal is bottom-right aligned as in flash-attention. Can be 0 when sq > sk.
MK_MATH int64_t causal_valid(int64_t i, int64_t sq, int64_t sk) {
  const int64_t n = i + (sk - sq) + 1;
  return n < 0 ? 0 : (n > sk ? sk : n);
}

// exp(d) for d = z - max(z) <= 0 (or NaN, which must stay NaN). On the GPU, ex2.approx.ftz (math.h fast_exp:
// one MUFU, relative error ~2^-22 on this range, exp(-inf) = 0, denormals flushed). On the host (CPU kernels,
// emulator) mk_exp vectorises; it clamps its argument at -87, so the cut makes exp(-inf) exactly 0 (masked and -inf
// inputs) and flushes what would be an fp32 denormal.
#if defined(__CUDA_ARCH__)
MK_MATH float softmax_exp(float d) { return fast_exp(d); }
#else
MK_MATH float softmax_exp(float d) { return d < -87.0f ? 0.0f : mk_exp(d); }
#endif
MK_MATH double softmax_exp(double d) { return mk_exp(d); }

}  // namespace softmax

// The CPU kernels; threads come from the caller (at::parallel_for over rows).
// Declared for the baseline and for each ISA clone (csrc/common/cpu_isa.h), one declaration a line.
// clang-format off
MK_DECLARE_CPU_KERNELS(
void softmax_fwd_rows(const softmax::FwdArgs& a, int64_t row_begin, int64_t row_end);
void softmax_bwd_rows(const softmax::BwdArgs& a, int64_t row_begin, int64_t row_end);
)
// clang-format on

// The CUDA kernels, compiled by nvcc into namespace `cuda` and by g++ against csrc/emu into `cuda_emu`.
// Launchers return nullptr on success, else the CUDA error string; `stream` is a cudaStream_t.
#define MK_DECLARE_SOFTMAX_LAUNCHERS                                \
  const char* softmax_fwd(const softmax::FwdArgs& a, void* stream); \
  const char* softmax_bwd(const softmax::BwdArgs& a, void* stream);

namespace cuda {
MK_DECLARE_SOFTMAX_LAUNCHERS
}
namespace cuda_emu {
MK_DECLARE_SOFTMAX_LAUNCHERS
}

}  // namespace megakernels
