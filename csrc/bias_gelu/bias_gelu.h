// Bias-GeLU family (Megatron's bias_gelu: y = gelu(x + bias), bias broadcast over rows; backward dx and dbias =
// sum over rows of dx): arguments and launcher declarations shared by the CPU kernels (bias_gelu_cpu.cpp), the
// CUDA kernels (bias_gelu_cuda.cu) and their CPU emulation (bias_gelu_cuda_emu.cpp). Torch-free; csrc/bindings/
// checks everything.
//
// Precision: x/y/dy/dx in `x_dtype` (fp32, fp16, bf16 or fp64); bias and dbias in `w_dtype` (x_dtype, or fp32 for
// a 16-bit x); the math in A = double for fp64, float otherwise. GeLU is the erf form or Megatron's tanh form
// (math.h).
#pragma once
#include <cstdint>

#include "../common/math.h"

namespace megakernels {
namespace bias_gelu {

struct Args {
  const void* x;     // [rows, hidden]
  const void* bias;  // [hidden], x_dtype or fp32
  const void* dy;    // backward only
  void* y;           // forward: output; backward: dx
  void* dbias;       // backward only, [hidden] in bias dtype
  void* workspace;   // backward only, see *_bwd_workspace_bytes
  int64_t rows, hidden;
  DType x_dtype, w_dtype;
  Activation act;  // Gelu or GeluTanh
};

}  // namespace bias_gelu

// The CPU kernels; threads come from the caller (at::parallel_for).
// Declared for the baseline and for each ISA clone (csrc/common/cpu_isa.h), one declaration a line.
// clang-format off
MK_DECLARE_CPU_KERNELS(
void bias_gelu_fwd_rows(const bias_gelu::Args& a, int64_t row_begin, int64_t row_end);
// Backward: fixed row chunks (cpu_rows.h's row_chunks), one [hidden] partial dbias row each in the workspace, then
// an in-order column sum.
int64_t bias_gelu_bwd_chunks(int64_t rows, int64_t hidden);
int64_t bias_gelu_bwd_workspace_bytes(int64_t rows, int64_t hidden, DType x_dtype);
void bias_gelu_bwd_chunk(const bias_gelu::Args& a, int64_t chunk);
void bias_gelu_bwd_finish_cols(const bias_gelu::Args& a, int64_t col_begin, int64_t col_end);
)
// clang-format on

// The CUDA kernels, compiled by nvcc into namespace `cuda` and by g++ against csrc/emu into `cuda_emu`.
// Launchers return nullptr on success, else the CUDA error string; `stream` is a cudaStream_t.
#define MK_DECLARE_BIAS_GELU_LAUNCHERS                                                \
  int64_t bias_gelu_bwd_workspace_bytes(int64_t rows, int64_t hidden, DType x_dtype); \
  const char* bias_gelu_fwd(const bias_gelu::Args& a, void* stream);                  \
  const char* bias_gelu_bwd(const bias_gelu::Args& a, void* stream);

namespace cuda {
MK_DECLARE_BIAS_GELU_LAUNCHERS
}
namespace cuda_emu {
MK_DECLARE_BIAS_GELU_LAUNCHERS
}

}  // namespace megakernels
