// Gated-activation bindings: swiglu_fwd / swiglu_bwd on a packed [..., 2f] gate/up tensor; `act` picks SwiGLU (0),
// gpt-oss's clamped SwiGLU (1, with `limit` and `alpha`) or GeGLU (2), swiglu::Act.
#include <cmath>

#include "../swiglu/swiglu.h"
#include "common.h"

namespace megakernels {
namespace bindings {
namespace swiglu_ops {  // named, not anonymous: csrc/bindings/all.cpp compiles every family in one unit

// The CUDA launchers of swiglu_cuda.cu, as built by nvcc or for the emulator.
struct SwigluKernels {
  const char* (*fwd)(const swiglu::Args&, void*);
  const char* (*bwd)(const swiglu::Args&, void*);
};

const SwigluKernels* kernels_for(const at::Tensor& x, bool emulate) {
  static const SwigluKernels* cuda_table = MK_IF_CUDA(new SwigluKernels{&cuda::swiglu_fwd, &cuda::swiglu_bwd});
  static const SwigluKernels* emu_table = MK_IF_EMU(new SwigluKernels{&cuda_emu::swiglu_fwd, &cuda_emu::swiglu_bwd});
  return select_kernels(x, emulate, cuda_table, emu_table);
}

int64_t row_grain(int64_t f) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, f)); }

// x as [rows, 2f] with a unit last stride (a view when the leading dims allow, else one copy); returns f.
int64_t packed_rows(const char* op, const at::Tensor& x_in, at::Tensor& rows_out) {
  check_float_input(op, "x", x_in);
  TORCH_CHECK_VALUE(x_in.dim() >= 1, op, ": x must have at least 1 dimension ([..., 2 * f]); got a scalar");
  const int64_t two_f = x_in.size(-1);
  TORCH_CHECK_VALUE(two_f % 2 == 0, op, ": x's last dim is ", two_f,
                    "; expected an even size 2 * f (the gate half, then the up half)");
  at::Tensor x = x_in.stride(-1) == 1 ? x_in : x_in.contiguous();
  x = x.reshape({-1, two_f});
  rows_out = x.stride(-1) == 1 ? x : x.contiguous();
  return two_f / 2;
}

swiglu::Args make_args(const char* op, const at::Tensor& x, int64_t f, int64_t act, double limit, double alpha) {
  TORCH_CHECK_VALUE(act >= 0 && act <= 2, op, ": act is ", act,
                    "; expected 0 (SwiGLU), 1 (clamped SwiGLU) or 2 (GeGLU)");
  if (act == int64_t(swiglu::Act::ClampedSiLU)) {
    TORCH_CHECK_VALUE(limit > 0, op, ": limit is ", limit, "; expected a positive clamp bound");
    TORCH_CHECK_VALUE(std::isfinite(alpha), op, ": alpha is ", alpha, "; expected a finite number");
  }
  swiglu::Args a{};
  a.act = swiglu::Act(act);
  a.limit = limit;
  a.alpha = alpha;
  a.x = x.data_ptr();
  a.rows = x.size(0);
  a.f = f;
  a.x_stride = x.stride(0);
  a.dtype = to_dtype(x.scalar_type());
  return a;
}

at::Tensor swiglu_fwd(const at::Tensor& x_in, bool emulate, int64_t act, double limit, double alpha) {
  const char* op = "swiglu";
  at::Tensor x;
  const int64_t f = packed_rows(op, x_in, x);
  check_backend(op, x_in, emulate);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = f;
  at::Tensor y = at::empty(shape, x_in.options());
  swiglu::Args a = make_args(op, x, f, act, limit, alpha);
  advise_huge_pages(y);
  if (y.numel() == 0) return y;
  a.y = y.data_ptr();
  if (const SwigluKernels* k = kernels_for(x, emulate)) {
    LaunchScope scope(x);
    raise_if(op, k->fwd(a, scope.stream()));
  } else {
    at::parallel_for(0, a.rows, row_grain(f), [&](int64_t b, int64_t e) { MK_CPU(swiglu_fwd_rows)(a, b, e); });
  }
  return y;
}

at::Tensor swiglu_bwd(const at::Tensor& dy_in, const at::Tensor& x_in, bool emulate, int64_t act, double limit,
                      double alpha) {
  const char* op = "swiglu_backward";
  at::Tensor x;
  const int64_t f = packed_rows(op, x_in, x);
  check_backend(op, x_in, emulate);
  check_same_device(op, "grad_output", dy_in, "x", x_in);
  TORCH_CHECK_TYPE(dy_in.scalar_type() == x_in.scalar_type(), op, ": grad_output has dtype ", dy_in.scalar_type(),
                   ", expected x's dtype ", x_in.scalar_type());
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = f;
  TORCH_CHECK_VALUE(dy_in.sizes() == at::IntArrayRef(shape), op, ": grad_output has shape ", dy_in.sizes(),
                    ", expected ", at::IntArrayRef(shape), " (x's shape with the last dim halved)");
  at::Tensor dx = at::empty(x_in.sizes(), x_in.options());
  swiglu::Args a = make_args(op, x, f, act, limit, alpha);
  advise_huge_pages(dx);
  if (dx.numel() == 0) return dx;
  at::Tensor dy = (dy_in.stride(-1) == 1 ? dy_in : dy_in.contiguous()).reshape({-1, f});
  if (dy.stride(-1) != 1) dy = dy.contiguous();
  a.dy = dy.data_ptr();
  a.dy_stride = dy.stride(0);
  a.y = dx.data_ptr();
  if (const SwigluKernels* k = kernels_for(x, emulate)) {
    LaunchScope scope(x);
    raise_if(op, k->bwd(a, scope.stream()));
  } else {
    at::parallel_for(0, a.rows, row_grain(f), [&](int64_t b, int64_t e) { MK_CPU(swiglu_bwd_rows)(a, b, e); });
  }
  return dx;
}

}  // namespace swiglu_ops
}  // namespace bindings
}  // namespace megakernels

TORCH_LIBRARY_FRAGMENT(megakernels, m) {
  m.def("swiglu_fwd(Tensor x, bool emulate, int act=0, float limit=0., float alpha=1.) -> Tensor");
  m.def("swiglu_bwd(Tensor grad_output, Tensor x, bool emulate, int act=0, float limit=0., float alpha=1.) -> Tensor");
}

TORCH_LIBRARY_IMPL(megakernels, CPU, m) {
  m.impl("swiglu_fwd", &megakernels::bindings::swiglu_ops::swiglu_fwd);
  m.impl("swiglu_bwd", &megakernels::bindings::swiglu_ops::swiglu_bwd);
}

#ifdef MEGAKERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(megakernels, CUDA, m) {
  m.impl("swiglu_fwd", &megakernels::bindings::swiglu_ops::swiglu_fwd);
  m.impl("swiglu_bwd", &megakernels::bindings::swiglu_ops::swiglu_bwd);
}
#endif
