// Bias-GeLU family bindings: bias_gelu_fwd / bias_gelu_bwd.
#include "../bias_gelu/bias_gelu.h"
#include "common.h"

namespace megakernels {
namespace bindings {
namespace bias_gelu_ops {  // named, not anonymous: csrc/bindings/all.cpp compiles every family in one unit

// The CUDA launchers of bias_gelu_cuda.cu, as built by nvcc or for the emulator.
struct BiasGeluKernels {
  const char* (*fwd)(const bias_gelu::Args&, void*);
  int64_t (*bwd_workspace_bytes)(int64_t, int64_t, DType);
  const char* (*bwd)(const bias_gelu::Args&, void*);
};
#define MK_BIAS_GELU_KERNELS(ns) \
  BiasGeluKernels { &ns::bias_gelu_fwd, &ns::bias_gelu_bwd_workspace_bytes, &ns::bias_gelu_bwd }

const BiasGeluKernels* kernels_for(const at::Tensor& x, bool emulate) {
  static const BiasGeluKernels* cuda_table = MK_IF_CUDA(new BiasGeluKernels(MK_BIAS_GELU_KERNELS(cuda)));
  static const BiasGeluKernels* emu_table = MK_IF_EMU(new BiasGeluKernels(MK_BIAS_GELU_KERNELS(cuda_emu)));
  return select_kernels(x, emulate, cuda_table, emu_table);
}

bias_gelu::Args bias_gelu_args(const char* op, const at::Tensor& x, const at::Tensor& bias, int64_t approximate,
                               bool emulate) {
  check_float_input(op, "x", x);
  const int64_t H = hidden_of(op, x);
  check_backend(op, x, emulate);
  check_param(op, "bias", bias, x, H);
  TORCH_CHECK_VALUE(approximate == 1 || approximate == 2, op, ": approximate code ", approximate,
                    " is not 1 (none) or 2 (tanh)");
  bias_gelu::Args a{};
  a.rows = x.numel() / H;
  a.hidden = H;
  a.x_dtype = to_dtype(x.scalar_type());
  a.w_dtype = to_dtype(bias.scalar_type());
  a.act = static_cast<Activation>(approximate);
  return a;
}

at::Tensor bias_gelu_fwd(const at::Tensor& x_in, const at::Tensor& bias_in, int64_t approximate, bool emulate) {
  const char* op = "bias_gelu";
  bias_gelu::Args a = bias_gelu_args(op, x_in, bias_in, approximate, emulate);
  const at::Tensor x = x_in.contiguous(), bias = bias_in.contiguous();
  at::Tensor y = at::empty_like(x);
  advise_huge_pages(y);
  if (a.rows == 0) return y;
  a.x = x.data_ptr();
  a.bias = bias.data_ptr();
  a.y = y.data_ptr();
  if (const BiasGeluKernels* k = kernels_for(x, emulate)) {
    LaunchScope scope(x);
    raise_if(op, k->fwd(a, scope.stream()));
  } else {
    at::parallel_for(0, a.rows, row_grain(a.hidden),
                     [&](int64_t b, int64_t e) { MK_CPU(bias_gelu_fwd_rows)(a, b, e); });
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_bwd(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                 const at::Tensor& bias_in, int64_t approximate, bool emulate) {
  const char* op = "bias_gelu_backward";
  bias_gelu::Args a = bias_gelu_args(op, x_in, bias_in, approximate, emulate);
  check_same(op, "grad_output", dy_in, "x", x_in);
  const at::Tensor x = x_in.contiguous(), bias = bias_in.contiguous(), dy = dy_in.contiguous();
  at::Tensor dx = at::empty_like(x);
  advise_huge_pages(dx);
  at::Tensor dbias = at::empty_like(bias);
  if (a.rows == 0) return {dx, dbias.zero_()};
  a.x = x.data_ptr();
  a.bias = bias.data_ptr();
  a.dy = dy.data_ptr();
  a.y = dx.data_ptr();
  a.dbias = dbias.data_ptr();
  at::Tensor ws;
  if (const BiasGeluKernels* k = kernels_for(x, emulate)) {
    LaunchScope scope(x);
    ws = at::empty({k->bwd_workspace_bytes(a.rows, a.hidden, a.x_dtype)}, x.options().dtype(at::kByte));
    a.workspace = ws.data_ptr();
    raise_if(op, k->bwd(a, scope.stream()));
  } else {
    ws = at::empty({MK_CPU(bias_gelu_bwd_workspace_bytes)(a.rows, a.hidden, a.x_dtype)}, x.options().dtype(at::kByte));
    a.workspace = ws.data_ptr();
    at::parallel_for(0, MK_CPU(bias_gelu_bwd_chunks)(a.rows, a.hidden), 1, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) MK_CPU(bias_gelu_bwd_chunk)(a, c);
    });
    at::parallel_for(0, a.hidden, 2048, [&](int64_t b, int64_t e) { MK_CPU(bias_gelu_bwd_finish_cols)(a, b, e); });
  }
  return {dx, dbias};
}

}  // namespace bias_gelu_ops
}  // namespace bindings
}  // namespace megakernels

TORCH_LIBRARY_FRAGMENT(megakernels, m) {
  m.def("bias_gelu_fwd(Tensor x, Tensor bias, int approximate, bool emulate) -> Tensor");
  m.def("bias_gelu_bwd(Tensor grad_output, Tensor x, Tensor bias, int approximate, bool emulate) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megakernels, CPU, m) {
  m.impl("bias_gelu_fwd", &megakernels::bindings::bias_gelu_ops::bias_gelu_fwd);
  m.impl("bias_gelu_bwd", &megakernels::bindings::bias_gelu_ops::bias_gelu_bwd);
}

#ifdef MEGAKERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(megakernels, CUDA, m) {
  m.impl("bias_gelu_fwd", &megakernels::bindings::bias_gelu_ops::bias_gelu_fwd);
  m.impl("bias_gelu_bwd", &megakernels::bindings::bias_gelu_ops::bias_gelu_bwd);
}
#endif
