// Norm family bindings: layer_norm / rms_norm (one op pair, norm_fwd/norm_bwd).
#include "../norms/norms.h"
#include "common.h"

namespace megakernels {
namespace bindings {
namespace norms_ops {  // named, not anonymous: csrc/bindings/all.cpp compiles every family in one unit

// The CUDA launchers of norms_cuda.cu, as built by nvcc or for the emulator.
struct NormKernels {
  const char* (*norm_fwd)(const norms::FwdArgs&, void*);
  int64_t (*norm_bwd_workspace_bytes)(int64_t, int64_t, DType);
  const char* (*norm_bwd)(const norms::BwdArgs&, void*);
};
#define MK_NORM_KERNELS(ns) \
  NormKernels { &ns::norm_fwd, &ns::norm_bwd_workspace_bytes, &ns::norm_bwd }

const NormKernels* kernels_for(const at::Tensor& x, bool emulate) {
  static const NormKernels* cuda_table = MK_IF_CUDA(new NormKernels(MK_NORM_KERNELS(cuda)));
  static const NormKernels* emu_table = MK_IF_EMU(new NormKernels(MK_NORM_KERNELS(cuda_emu)));
  return select_kernels(x, emulate, cuda_table, emu_table);
}

Activation to_activation(const char* op, int64_t a) {
  TORCH_CHECK_VALUE(a >= 0 && a <= 2, op, ": activation code ", a, " is not 0 (none), 1 (gelu) or 2 (gelu_tanh)");
  return static_cast<Activation>(a);
}

// ---------------------------------------------------------------------------------------------------------------
// LayerNorm / RMSNorm

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_fwd(const at::Tensor& x_in,
                                                        const c10::optional<at::Tensor>& weight_in,
                                                        const c10::optional<at::Tensor>& bias_in, double eps,
                                                        int64_t activation, bool rms, bool emulate) {
  const char* op = rms ? "rms_norm" : "layer_norm";
  check_float_input(op, "x", x_in);
  const int64_t H = hidden_of(op, x_in);
  check_backend(op, x_in, emulate);
  TORCH_CHECK_VALUE(eps >= 0.0 && std::isfinite(eps), op, ": eps must be a finite number >= 0, got ", eps);
  TORCH_CHECK_VALUE(!(rms && bias_in.has_value()), op, ": RMSNorm takes no bias");
  if (weight_in.has_value()) check_param(op, "weight", *weight_in, x_in, H);
  if (bias_in.has_value()) check_param(op, "bias", *bias_in, x_in, H);
  if (weight_in.has_value() && bias_in.has_value())
    TORCH_CHECK_TYPE(weight_in->scalar_type() == bias_in->scalar_type(), op, ": bias has dtype ",
                     bias_in->scalar_type(), " but weight has dtype ", weight_in->scalar_type());
  const Activation act = to_activation(op, activation);

  const at::Tensor x = x_in.contiguous();
  const auto weight = contiguous_opt(weight_in);
  const auto bias = contiguous_opt(bias_in);
  const int64_t rows = x.numel() / H;
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor y = at::empty_like(x);
  advise_huge_pages(y);
  at::Tensor mean = at::empty({rms ? 0 : rows}, x.options().dtype(acc));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(acc));
  if (rows == 0) return {y, mean, rstd};

  norms::FwdArgs a{};
  a.x = x.data_ptr();
  a.w = data_or_null(weight);
  a.b = data_or_null(bias);
  a.y = y.data_ptr();
  a.mean = rms ? nullptr : mean.data_ptr();
  a.rstd = rstd.data_ptr();
  a.rows = rows;
  a.hidden = H;
  a.eps = eps;
  a.x_dtype = to_dtype(x.scalar_type());
  a.w_dtype = weight.has_value() ? to_dtype(weight->scalar_type())
                                 : (bias.has_value() ? to_dtype(bias->scalar_type()) : a.x_dtype);
  a.act = act;
  a.rms = rms;
  if (const NormKernels* k = kernels_for(x, emulate)) {
    LaunchScope scope(x);
    raise_if(op, k->norm_fwd(a, scope.stream()));
  } else {
    at::parallel_for(0, rows, row_grain(H), [&](int64_t b, int64_t e) { MK_CPU(norm_fwd_rows)(a, b, e); });
  }
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                        const c10::optional<at::Tensor>& weight_in,
                                                        const c10::optional<at::Tensor>& bias_in,
                                                        const at::Tensor& mean_in, const at::Tensor& rstd_in,
                                                        int64_t activation, bool rms, bool emulate) {
  const char* op = rms ? "rms_norm_backward" : "layer_norm_backward";
  check_float_input(op, "x", x_in);
  const int64_t H = hidden_of(op, x_in);
  check_backend(op, x_in, emulate);
  check_same(op, "grad_output", dy_in, "x", x_in);
  if (weight_in.has_value()) check_param(op, "weight", *weight_in, x_in, H);
  if (bias_in.has_value()) check_param(op, "bias", *bias_in, x_in, H);
  const Activation act = to_activation(op, activation);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor dy = dy_in.contiguous();
  const auto weight = contiguous_opt(weight_in);
  const auto bias = contiguous_opt(bias_in);
  const int64_t rows = x.numel() / H;
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK_VALUE(rstd_in.numel() == rows && rstd_in.scalar_type() == acc && (rms || mean_in.numel() == rows), op,
                    ": saved mean/rstd do not match x (", rows, " rows)");
  const at::Tensor mean = mean_in.contiguous(), rstd = rstd_in.contiguous();

  at::Tensor dx = at::empty_like(x);
  advise_huge_pages(dx);
  at::Tensor dw = weight.has_value() ? at::empty_like(*weight) : at::empty({0}, x.options());
  at::Tensor db = bias.has_value() ? at::empty_like(*bias) : at::empty({0}, x.options());
  if (rows == 0) {
    dw.zero_();
    db.zero_();
    return {dx, dw, db};
  }
  norms::BwdArgs a{};
  a.dy = dy.data_ptr();
  a.x = x.data_ptr();
  a.w = data_or_null(weight);
  a.b = data_or_null(bias);
  a.mean = rms ? nullptr : mean.data_ptr();
  a.rstd = rstd.data_ptr();
  a.dx = dx.data_ptr();
  a.dw = weight.has_value() ? dw.data_ptr() : nullptr;
  a.db = bias.has_value() ? db.data_ptr() : nullptr;
  a.rows = rows;
  a.hidden = H;
  a.x_dtype = to_dtype(x.scalar_type());
  a.w_dtype = weight.has_value() ? to_dtype(weight->scalar_type())
                                 : (bias.has_value() ? to_dtype(bias->scalar_type()) : a.x_dtype);
  a.act = act;
  a.rms = rms;
  at::Tensor ws;
  if (const NormKernels* k = kernels_for(x, emulate)) {
    LaunchScope scope(x);
    ws = at::empty({k->norm_bwd_workspace_bytes(rows, H, a.x_dtype)}, x.options().dtype(at::kByte));
    a.workspace = ws.data_ptr();
    raise_if(op, k->norm_bwd(a, scope.stream()));
  } else {
    ws = at::empty({MK_CPU(norm_bwd_workspace_bytes)(rows, H, a.x_dtype)}, x.options().dtype(at::kByte));
    a.workspace = ws.data_ptr();
    at::parallel_for(0, MK_CPU(norm_bwd_chunks)(rows, H), 1, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) MK_CPU(norm_bwd_chunk)(a, c);
    });
    if (a.dw || a.db)
      at::parallel_for(0, H, 2048, [&](int64_t b, int64_t e) { MK_CPU(norm_bwd_finish_cols)(a, b, e); });
  }
  return {dx, dw, db};
}

}  // namespace norms_ops
}  // namespace bindings
}  // namespace megakernels

TORCH_LIBRARY_FRAGMENT(megakernels, m) {
  m.def(
      "norm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps, int activation, bool rms, bool emulate)"
      " -> (Tensor, Tensor, Tensor)");
  m.def(
      "norm_bwd(Tensor grad_output, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd,"
      " int activation, bool rms, bool emulate) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megakernels, CPU, m) {
  m.impl("norm_fwd", &megakernels::bindings::norms_ops::norm_fwd);
  m.impl("norm_bwd", &megakernels::bindings::norms_ops::norm_bwd);
}

#ifdef MEGAKERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(megakernels, CUDA, m) {
  m.impl("norm_fwd", &megakernels::bindings::norms_ops::norm_fwd);
  m.impl("norm_bwd", &megakernels::bindings::norms_ops::norm_bwd);
}
#endif
