// Norm family (LayerNorm [+ GeLU epilogue], RMSNorm): arguments and launcher declarations shared by
// the CPU kernels (norms_cpu.cpp), the CUDA kernels (norms_cuda.cu) and its CPU emulation (norms_cuda_emu.cpp).
// Torch-free: tensors cross this boundary as raw pointers plus a DType tag; csrc/bindings/ does every check.
//
// Precision contract: x/y/dy/dx are stored in `x_dtype` (fp32, fp16, bf16 or fp64); weight/bias (and their
// grads) in `w_dtype`, which is x_dtype or fp32 (apex's "mixed" LayerNorm); all math and the saved mean/rstd are
// in the accumulate type A = double for fp64, float otherwise.
#pragma once
#include <cstdint>

#include "../common/math.h"

namespace megakernels {
namespace norms {

struct FwdArgs {
  const void* x;  // [rows, hidden]
  const void* w;  // [hidden] or nullptr (no affine scale)
  const void* b;  // [hidden] or nullptr (no shift; always nullptr for RMSNorm)
  void* y;        // [rows, hidden]
  void* mean;     // [rows] accumulate type; unused for RMSNorm
  void* rstd;     // [rows] accumulate type
  int64_t rows, hidden;
  double eps;
  DType x_dtype, w_dtype;
  Activation act;  // applied to w*xhat+b before the store
  bool rms;        // RMSNorm: xhat = x * rstd with rstd = 1/sqrt(mean(x^2) + eps)
};

struct BwdArgs {
  const void* dy;  // [rows, hidden]  gradient of the (activated) output
  const void* x;   // [rows, hidden]
  const void* w;   // [hidden] or nullptr
  const void* b;   // [hidden] or nullptr
  const void* mean;
  const void* rstd;
  void* dx;         // [rows, hidden]
  void* dw;         // [hidden] w_dtype, or nullptr when w is nullptr
  void* db;         // [hidden] w_dtype, or nullptr when b is nullptr
  void* workspace;  // see *_bwd_workspace_bytes
  int64_t rows, hidden;
  DType x_dtype, w_dtype;
  Activation act;
  bool rms;
};

}  // namespace norms

// The CPU kernels. Parallelism comes from the caller (torch's intra-op pool via at::parallel_for), so this code
// brings no threading runtime of its own: each function handles a range of rows or of row chunks.
// Declared for the baseline and for each ISA clone (csrc/common/cpu_isa.h), one declaration a line.
// clang-format off
MK_DECLARE_CPU_KERNELS(
void norm_fwd_rows(const norms::FwdArgs& a, int64_t row_begin, int64_t row_end);
// Backward: rows are split into `norm_bwd_chunks` fixed chunks (independent of the thread count, so results are
// bit-identical for any number of threads); chunk c writes its partial dw/db sums into the workspace; then
// `norm_bwd_finish_cols` reduces the chunks in order for a range of columns.
int64_t norm_bwd_chunks(int64_t rows, int64_t hidden);
int64_t norm_bwd_workspace_bytes(int64_t rows, int64_t hidden, DType x_dtype);
void norm_bwd_chunk(const norms::BwdArgs& a, int64_t chunk);
void norm_bwd_finish_cols(const norms::BwdArgs& a, int64_t col_begin, int64_t col_end);
)
// clang-format on

// The CUDA kernels, compiled twice from norms_cuda.cu: by nvcc into namespace `cuda`, and by g++ against the
// emulation layer (csrc/emu) into namespace `cuda_emu`. Launchers return nullptr on success, else the CUDA
// error string. `stream` is a cudaStream_t (nullptr for the emulator).
#define MK_DECLARE_NORM_LAUNCHERS                                                \
  int64_t norm_bwd_workspace_bytes(int64_t rows, int64_t hidden, DType x_dtype); \
  const char* norm_fwd(const norms::FwdArgs& a, void* stream);                   \
  const char* norm_bwd(const norms::BwdArgs& a, void* stream);

namespace cuda {
MK_DECLARE_NORM_LAUNCHERS
}
namespace cuda_emu {
MK_DECLARE_NORM_LAUNCHERS
}

}  // namespace megakernels
