// Cross-entropy CPU bindings: the per-row statistics of the forward and the gradient of the backward
// (megakernels/ops/cross_entropy.py checks the arguments and holds the autograd and the CUDA path, which is Triton).
#include <cmath>

#include "../cross_entropy/cross_entropy.h"
#include "common.h"

namespace megakernels {
namespace bindings {
namespace cross_entropy_ops {  // named, not anonymous: csrc/bindings/all.cpp compiles every family in one unit

void check_rows(const char* op, const at::Tensor& logits, const at::Tensor& target, int64_t n_valid) {
  check_float_input(op, "logits", logits);
  TORCH_CHECK_VALUE(logits.device().is_cpu() && target.device().is_cpu(), op, ": the CPU kernel takes CPU tensors");
  TORCH_CHECK_VALUE(logits.dim() == 2, op, ": logits must be [rows, vocab], got ", logits.sizes());
  TORCH_CHECK_VALUE(logits.scalar_type() != at::kDouble, op, ": logits must be fp32, bf16 or fp16");
  TORCH_CHECK_VALUE(target.scalar_type() == at::kLong && target.dim() == 1 && target.size(0) == logits.size(0), op,
                    ": target must be int64 [rows], got ", target.scalar_type(), " ", target.sizes());
  TORCH_CHECK_VALUE(n_valid >= 0 && n_valid <= logits.size(1), op, ": n_valid ", n_valid, " outside [0, ",
                    logits.size(1), "]");
}

at::Tensor ce_stats_cpu(const at::Tensor& logits_in, const at::Tensor& target_in, int64_t vocab_start, int64_t n_valid,
                        double softcap) {
  const char* op = "cross_entropy";
  check_rows(op, logits_in, target_in, n_valid);
  TORCH_CHECK_VALUE(softcap >= 0.0 && std::isfinite(softcap), op, ": softcap must be finite and >= 0, got ", softcap);
  const at::Tensor logits = logits_in.contiguous(), target = target_in.contiguous();
  at::Tensor stats = at::empty({logits.size(0), 4}, logits.options().dtype(at::kFloat));
  cross_entropy::StatsArgs a{};
  a.logits = logits.data_ptr();
  a.target = target.data_ptr<int64_t>();
  a.stats = stats.data_ptr<float>();
  a.rows = logits.size(0);
  a.cols = logits.size(1);
  a.n_valid = n_valid;
  a.vocab_start = vocab_start;
  a.softcap = static_cast<float>(softcap);
  a.dtype = to_dtype(logits.scalar_type());
  at::parallel_for(0, a.rows, row_grain(std::max<int64_t>(1, n_valid)),
                   [&](int64_t b, int64_t e) { MK_CPU(cross_entropy_stats_rows)(a, b, e); });
  return stats;
}

// Writes the gradient into `out` ([rows, vocab] like logits, contiguous; may be logits itself).
void ce_grad_cpu(const at::Tensor& logits, const at::Tensor& target_in, const at::Tensor& lse_in,
                 const at::Tensor& dloss_in, int64_t vocab_start, int64_t n_valid, int64_t ignore_index,
                 double smooth_target, double smooth_other, double softcap, const at::Tensor& out) {
  const char* op = "cross_entropy_backward";
  check_rows(op, logits, target_in, n_valid);
  TORCH_CHECK_VALUE(logits.is_contiguous() && out.is_contiguous() && out.sizes() == logits.sizes() &&
                        out.scalar_type() == logits.scalar_type(),
                    op, ": logits and out must be contiguous and alike");
  TORCH_CHECK_VALUE(softcap >= 0.0 && std::isfinite(softcap), op, ": softcap must be finite and >= 0, got ", softcap);
  const at::Tensor target = target_in.contiguous(), lse = lse_in.contiguous().to(at::kFloat),
                   dloss = dloss_in.contiguous().to(at::kFloat);
  TORCH_CHECK_VALUE(lse.numel() == logits.size(0) && dloss.numel() == logits.size(0), op,
                    ": lse and grad_output must have one entry per row");
  cross_entropy::GradArgs a{};
  a.logits = logits.data_ptr();
  a.target = target.data_ptr<int64_t>();
  a.lse = lse.data_ptr<float>();
  a.dloss = dloss.data_ptr<float>();
  a.out = out.data_ptr();
  a.rows = logits.size(0);
  a.cols = logits.size(1);
  a.n_valid = n_valid;
  a.vocab_start = vocab_start;
  a.ignore_index = ignore_index;
  a.smooth_target = static_cast<float>(smooth_target);
  a.smooth_other = static_cast<float>(smooth_other);
  a.softcap = static_cast<float>(softcap);
  a.dtype = to_dtype(logits.scalar_type());
  at::parallel_for(0, a.rows, row_grain(a.cols),
                   [&](int64_t b, int64_t e) { MK_CPU(cross_entropy_grad_rows)(a, b, e); });
}

}  // namespace cross_entropy_ops
}  // namespace bindings
}  // namespace megakernels

TORCH_LIBRARY_FRAGMENT(megakernels, m) {
  m.def("ce_stats_cpu(Tensor logits, Tensor target, int vocab_start, int n_valid, float softcap=0.0) -> Tensor");
  m.def(
      "ce_grad_cpu(Tensor logits, Tensor target, Tensor lse, Tensor dloss, int vocab_start, int n_valid, "
      "int ignore_index, float smooth_target, float smooth_other, float softcap, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(megakernels, CPU, m) {
  m.impl("ce_stats_cpu", &megakernels::bindings::cross_entropy_ops::ce_stats_cpu);
  m.impl("ce_grad_cpu", &megakernels::bindings::cross_entropy_ops::ce_grad_cpu);
}
