// Muon CPU bindings: the Newton-Schulz iteration on a batch of fp32 matrices (megakernels/ops/muon.py checks the
// arguments and holds the CUDA path, which is Triton).
#include "../muon/muon.h"
#include "common.h"

namespace megakernels {
namespace bindings {
namespace muon_ops {  // named, not anonymous: csrc/bindings/all.cpp compiles every family in one unit

at::Tensor newton_schulz_cpu(const at::Tensor& x_in, int64_t steps, double a, double b, double c, double eps) {
  const char* op = "newton_schulz";
  TORCH_CHECK_VALUE(x_in.layout() == at::kStrided, op, ": x must be a dense tensor");
  TORCH_CHECK_VALUE(x_in.device().is_cpu(), op, ": the CPU kernel takes CPU tensors, x is on ", x_in.device());
  TORCH_CHECK_TYPE(x_in.scalar_type() == at::kFloat, op, ": the CPU kernel takes float32, x is ", x_in.scalar_type());
  TORCH_CHECK_VALUE(x_in.dim() == 3, op, ": x must be a batch of matrices [batch, rows, cols], got ", x_in.sizes());
  TORCH_CHECK_VALUE(steps >= 0, op, ": steps must be >= 0, got ", steps);
  TORCH_CHECK_VALUE(eps > 0.0 && std::isfinite(eps), op, ": eps must be a finite number > 0, got ", eps);
  TORCH_CHECK_VALUE(std::isfinite(a) && std::isfinite(b) && std::isfinite(c), op,
                    ": the coefficients must be finite, got (", a, ", ", b, ", ", c, ")");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  muon::NSArgs args{};
  args.x = x.data_ptr<float>();
  args.out = out.data_ptr<float>();
  args.batch = x.size(0);
  args.rows = x.size(1);
  args.cols = x.size(2);
  args.steps = steps;
  args.a = float(a);
  args.b = float(b);
  args.c = float(c);
  args.eps = float(eps);
  // zeros: the buffers' padding must be zero, and the products keep it so
  at::Tensor work = at::zeros({MK_CPU(ns_workspace_floats)(args)}, x.options());
  args.work = work.data_ptr<float>();
  auto run = [&](int phase, int64_t iteration) {
    at::parallel_for(0, MK_CPU(ns_items)(args, phase), 1,
                     [&](int64_t begin, int64_t end) { MK_CPU(ns_run)(args, phase, iteration, begin, end); });
  };
  run(muon::kPrepare, 0);
  for (int64_t it = 0; it < steps; ++it)
    for (int phase = muon::kTranspose; phase <= muon::kUpdate; ++phase) run(phase, it);
  run(muon::kFinish, steps);
  return out;
}

}  // namespace muon_ops
}  // namespace bindings
}  // namespace megakernels

TORCH_LIBRARY_FRAGMENT(megakernels, m) {
  m.def("newton_schulz_cpu(Tensor x, int steps, float a, float b, float c, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(megakernels, CPU, m) {
  m.impl("newton_schulz_cpu", &megakernels::bindings::muon_ops::newton_schulz_cpu);
}
