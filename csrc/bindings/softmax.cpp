// Softmax family bindings: one op pair, softmax_fwd / softmax_bwd, serving scaled_softmax (no mask),
// scaled_masked_softmax (boolean mask, broadcast through strides) and scaled_causal_softmax.
#include <cmath>

#include "../softmax/softmax.h"
#include "common.h"

namespace megakernels {
namespace bindings {
namespace softmax_ops {  // named, not anonymous: csrc/bindings/all.cpp compiles every family in one unit

// The CUDA launchers of softmax_cuda.cu, as built by nvcc or for the emulator.
struct SoftmaxKernels {
  const char* (*softmax_fwd)(const softmax::FwdArgs&, void*);
  const char* (*softmax_bwd)(const softmax::BwdArgs&, void*);
};
#define MK_SOFTMAX_KERNELS(ns) \
  SoftmaxKernels { &ns::softmax_fwd, &ns::softmax_bwd }

const SoftmaxKernels* kernels_for(const at::Tensor& x, bool emulate) {
  static const SoftmaxKernels* cuda_table = MK_IF_CUDA(new SoftmaxKernels(MK_SOFTMAX_KERNELS(cuda)));
  static const SoftmaxKernels* emu_table = MK_IF_EMU(new SoftmaxKernels(MK_SOFTMAX_KERNELS(cuda_emu)));
  return select_kernels(x, emulate, cuda_table, emu_table);
}

void check_scale(const char* op, double scale) {
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be a finite number, got ", scale);
}

// mask: bool, 2..4 dims, right-aligned against x's [b, heads, sq, sk]; each of its leading three dims is x's size
// or 1 (broadcast), the last is sk. Fills the mask strides of `a` (0 for a broadcast dim) without copying.
at::Tensor check_mask(const char* op, const at::Tensor& mask_in, const at::Tensor& x, softmax::FwdArgs& a) {
  TORCH_CHECK_TYPE(mask_in.scalar_type() == at::kBool, op, ": mask has dtype ", mask_in.scalar_type(),
                   "; expected torch.bool (True = masked out)");
  check_same_device(op, "mask", mask_in, "x", x);
  TORCH_CHECK_VALUE(mask_in.dim() >= 2 && mask_in.dim() <= 4, op, ": mask has shape ", mask_in.sizes(),
                    "; expected 2 to 4 dims broadcastable to x's [b, heads, sq, sk] = ", x.sizes());
  const int64_t pad = 4 - mask_in.dim();
  for (int64_t d = 0; d < mask_in.dim(); ++d) {
    const int64_t want = x.size(d + pad), got = mask_in.size(d);
    const bool last = d == mask_in.dim() - 1;
    TORCH_CHECK_VALUE(got == want || (!last && got == 1), op, ": mask has shape ", mask_in.sizes(),
                      ", not broadcastable to x's ", x.sizes(), " (each dim must equal x's or be 1; the last, sk, ",
                      "must equal x's)");
  }
  // The kernels read a mask row with unit stride; other strides are arbitrary (an expanded mask stays expanded).
  at::Tensor mask = mask_in.stride(-1) == 1 || mask_in.size(-1) == 1 ? mask_in : mask_in.contiguous();
  int64_t strides[4] = {0, 0, 0, 0};
  for (int64_t d = 0; d < mask.dim(); ++d) strides[d + pad] = mask.size(d) == 1 ? 0 : mask.stride(d);
  a.mask = reinterpret_cast<const unsigned char*>(mask.data_ptr<bool>());
  a.mask_sb = strides[0];
  a.mask_sh = strides[1];
  a.mask_sq = strides[2];
  a.heads = x.size(1);
  return mask;
}

at::Tensor softmax_fwd(const at::Tensor& x_in, const c10::optional<at::Tensor>& mask_in, double scale, bool causal,
                       bool emulate) {
  const char* op =
      mask_in.has_value() ? "scaled_masked_softmax" : (causal ? "scaled_causal_softmax" : "scaled_softmax");
  check_float_input(op, "x", x_in);
  TORCH_CHECK_VALUE(x_in.dim() >= 1, op, ": x must have at least 1 dimension; got a scalar");
  TORCH_CHECK_VALUE(!(causal && mask_in.has_value()), op, ": pass either a mask or causal=True, not both");
  if (mask_in.has_value())
    TORCH_CHECK_VALUE(x_in.dim() == 4, op, ": x has shape ", x_in.sizes(), "; expected 4 dims [b, heads, sq, sk]");
  if (causal)
    TORCH_CHECK_VALUE(x_in.dim() >= 2, op, ": x has shape ", x_in.sizes(), "; expected at least 2 dims [..., sq, sk]");
  check_backend(op, x_in, emulate);
  check_scale(op, scale);

  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x);
  advise_huge_pages(y);
  softmax::FwdArgs a{};
  at::Tensor mask;  // keeps a contiguous copy alive, if one was needed
  if (mask_in.has_value()) mask = check_mask(op, *mask_in, x, a);
  const int64_t sk = x.size(-1);
  if (x.numel() == 0) return y;
  a.x = x.data_ptr();
  a.y = y.data_ptr();
  a.sk = sk;
  a.rows = x.numel() / sk;
  a.sq = x.dim() >= 2 ? x.size(-2) : 1;
  a.scale = scale;
  a.dtype = to_dtype(x.scalar_type());
  a.kind =
      mask_in.has_value() ? softmax::MaskKind::Bool : (causal ? softmax::MaskKind::Causal : softmax::MaskKind::None);
  if (const SoftmaxKernels* k = kernels_for(x, emulate)) {
    LaunchScope scope(x);
    raise_if(op, k->softmax_fwd(a, scope.stream()));
  } else {
    at::parallel_for(0, a.rows, row_grain(sk), [&](int64_t b, int64_t e) { MK_CPU(softmax_fwd_rows)(a, b, e); });
  }
  return y;
}

at::Tensor softmax_bwd(const at::Tensor& dy_in, const at::Tensor& y_in, double scale, bool causal, bool emulate) {
  const char* op = causal ? "scaled_causal_softmax_backward" : "scaled_softmax_backward";
  check_float_input(op, "y", y_in);
  TORCH_CHECK_VALUE(y_in.dim() >= (causal ? 2 : 1), op, ": y has shape ", y_in.sizes(), "; too few dims");
  check_backend(op, y_in, emulate);
  check_same(op, "grad_output", dy_in, "y", y_in);
  check_scale(op, scale);
  const at::Tensor y = y_in.contiguous(), dy = dy_in.contiguous();
  at::Tensor dx = at::empty_like(y);
  advise_huge_pages(dx);
  if (y.numel() == 0) return dx;
  softmax::BwdArgs a{};
  a.dy = dy.data_ptr();
  a.y = y.data_ptr();
  a.dx = dx.data_ptr();
  a.sk = y.size(-1);
  a.rows = y.numel() / a.sk;
  a.sq = y.dim() >= 2 ? y.size(-2) : 1;
  a.scale = scale;
  a.dtype = to_dtype(y.scalar_type());
  a.causal = causal;
  if (const SoftmaxKernels* k = kernels_for(y, emulate)) {
    LaunchScope scope(y);
    raise_if(op, k->softmax_bwd(a, scope.stream()));
  } else {
    at::parallel_for(0, a.rows, row_grain(a.sk), [&](int64_t b, int64_t e) { MK_CPU(softmax_bwd_rows)(a, b, e); });
  }
  return dx;
}

}  // namespace softmax_ops
}  // namespace bindings
}  // namespace megakernels

TORCH_LIBRARY_FRAGMENT(megakernels, m) {
  m.def("softmax_fwd(Tensor x, Tensor? mask, float scale, bool causal, bool emulate) -> Tensor");
  m.def("softmax_bwd(Tensor grad_output, Tensor y, float scale, bool causal, bool emulate) -> Tensor");
}

TORCH_LIBRARY_IMPL(megakernels, CPU, m) {
  m.impl("softmax_fwd", &megakernels::bindings::softmax_ops::softmax_fwd);
  m.impl("softmax_bwd", &megakernels::bindings::softmax_ops::softmax_bwd);
}

#ifdef MEGAKERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(megakernels, CUDA, m) {
  m.impl("softmax_fwd", &megakernels::bindings::softmax_ops::softmax_fwd);
  m.impl("softmax_bwd", &megakernels::bindings::softmax_ops::softmax_bwd);
}
#endif
