// MoE router CPU bindings: the forward's choices, weights and partial sums, and the backward
// (megakernels/ops/moe_router.py checks the arguments and holds the autograd and the CUDA path, which is Triton).
#include <vector>

#include "../moe/permute.h"
#include "../moe/router.h"
#include "common.h"

namespace megakernels {
namespace bindings {
namespace moe_ops {  // named, not anonymous: csrc/bindings/all.cpp compiles every family in one unit

void check_logits(const char* op, const at::Tensor& logits) {
  check_float_input(op, "logits", logits);
  TORCH_CHECK_VALUE(logits.device().is_cpu(), op, ": the CPU kernel takes CPU tensors");
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.size(1) > 0, op, ": logits must be [tokens, experts], got ",
                    logits.sizes());
  TORCH_CHECK_VALUE(logits.scalar_type() != at::kDouble, op, ": logits must be fp32, bf16 or fp16");
}

// (weights [T, k] fp32, experts [T, k] int64, lse [T] fp32, counts [E] fp32, aux [E] fp32)
std::vector<at::Tensor> moe_router_cpu(const at::Tensor& logits_in, const std::optional<at::Tensor>& bias_in, int64_t k,
                                       int64_t score, bool normalize, bool topk_softmax, double scale, int64_t n_group,
                                       int64_t topk_group) {
  const char* op = "moe_router";
  check_logits(op, logits_in);
  const at::Tensor logits = logits_in.contiguous();
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK_VALUE(score == 0 || score == 1, op, ": score must be 0 (softmax) or 1 (sigmoid)");
  TORCH_CHECK_VALUE(n_group >= 1 && E % n_group == 0, op, ": n_group ", n_group, " must divide the ", E, " experts");
  TORCH_CHECK_VALUE(topk_group >= 1 && topk_group <= n_group, op, ": topk_group ", topk_group, " outside [1, ", n_group,
                    "]");
  TORCH_CHECK_VALUE(k >= 1 && k <= topk_group * (E / n_group), op, ": top_k ", k, " outside [1, ",
                    topk_group * (E / n_group), "] (the experts of the eligible groups)");
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->contiguous();
    TORCH_CHECK_VALUE(bias.scalar_type() == at::kFloat && bias.dim() == 1 && bias.size(0) == E && bias.is_cpu(), op,
                      ": bias must be fp32 [", E, "] on the CPU");
  }
  const auto f32 = logits.options().dtype(at::kFloat);
  const int64_t blocks = (T + moe::kRouterBlock - 1) / moe::kRouterBlock;
  at::Tensor weights = at::empty({T, k}, f32), experts = at::empty({T, k}, logits.options().dtype(at::kLong));
  at::Tensor lse = at::empty({T}, f32), part_counts = at::empty({blocks, E}, f32),
             part_aux = at::empty({blocks, E}, f32);
  moe::RouterArgs a{};
  a.logits = logits.data_ptr();
  a.bias = bias.defined() ? bias.data_ptr<float>() : nullptr;
  a.weights = weights.data_ptr<float>();
  a.experts = experts.data_ptr<int64_t>();
  a.lse = lse.data_ptr<float>();
  a.counts = part_counts.data_ptr<float>();
  a.aux = part_aux.data_ptr<float>();
  a.rows = T, a.E = E, a.k = k, a.n_group = n_group, a.topk_group = topk_group;
  a.score = static_cast<int>(score);
  a.normalize = normalize, a.topk_softmax = topk_softmax;
  a.scale = static_cast<float>(scale);
  a.dtype = to_dtype(logits.scalar_type());
  at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) { MK_CPU(moe_router_blocks)(a, b, e); });
  // the blocks' partial sums, added in block order: the same bits for any thread count
  at::Tensor counts = at::zeros({E}, f32), aux = at::zeros({E}, f32);
  float *c = counts.data_ptr<float>(), *x = aux.data_ptr<float>();
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t i = 0; i < E; ++i) c[i] += a.counts[b * E + i], x[i] += a.aux[b * E + i];
  return {weights, experts, lse, counts, aux};
}

at::Tensor moe_router_grad_cpu(const at::Tensor& logits_in, const at::Tensor& lse, const at::Tensor& experts,
                               const at::Tensor& weights, const at::Tensor& dweights, const at::Tensor& daux,
                               const at::Tensor& dlse, int64_t score, bool normalize, bool topk_softmax, double scale) {
  const char* op = "moe_router_backward";
  check_logits(op, logits_in);
  const at::Tensor logits = logits_in.contiguous();
  const int64_t T = logits.size(0), E = logits.size(1);
  const int64_t k = experts.dim() == 2 ? experts.size(1) : 0;
  TORCH_CHECK_VALUE(experts.scalar_type() == at::kLong && experts.dim() == 2 && experts.size(0) == T && k >= 1, op,
                    ": experts must be int64 [tokens, k]");
  const at::Tensor lse_c = lse.contiguous().to(at::kFloat), ex = experts.contiguous(),
                   w = weights.contiguous().to(at::kFloat), dw = dweights.contiguous().to(at::kFloat),
                   da = daux.contiguous().to(at::kFloat), dl = dlse.contiguous().to(at::kFloat);
  TORCH_CHECK_VALUE(
      lse_c.numel() == T && w.numel() == T * k && dw.numel() == T * k && da.numel() == E && dl.numel() == T, op,
      ": lse, weights, grad_weights, grad_aux and grad_lse must match the logits' [tokens, experts]");
  at::Tensor dlogits = at::empty_like(logits);
  moe::RouterGradArgs a{};
  a.logits = logits.data_ptr();
  a.lse = lse_c.data_ptr<float>();
  a.experts = ex.data_ptr<int64_t>();
  a.weights = w.data_ptr<float>();
  a.dweights = dw.data_ptr<float>();
  a.daux = da.data_ptr<float>();
  a.dlse = dl.data_ptr<float>();
  a.dlogits = dlogits.data_ptr();
  a.rows = T, a.E = E, a.k = k;
  a.score = static_cast<int>(score);
  a.normalize = normalize, a.topk_softmax = topk_softmax;
  a.scale = static_cast<float>(scale);
  a.dtype = to_dtype(logits.scalar_type());
  at::parallel_for(0, T, row_grain(E), [&](int64_t b, int64_t e) { MK_CPU(moe_router_grad_rows)(a, b, e); });
  return dlogits;
}

// (dest [T * k] int64, sizes [E] int64, kept [E] int64): the counting pass of permute.h
std::vector<at::Tensor> moe_permute_index_cpu(const at::Tensor& experts_in, int64_t num_experts, int64_t capacity,
                                              int64_t pad_multiple) {
  const char* op = "moe_permute";
  TORCH_CHECK_VALUE(experts_in.scalar_type() == at::kLong && experts_in.dim() == 2 && experts_in.is_cpu(), op,
                    ": experts must be an int64 [tokens, k] CPU tensor");
  TORCH_CHECK_VALUE(num_experts >= 1 && pad_multiple >= 1, op, ": num_experts and pad_multiple must be >= 1");
  const at::Tensor experts = experts_in.contiguous();
  const int64_t n = experts.numel();
  const int64_t* ex = experts.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_VALUE(ex[i] >= 0 && ex[i] < num_experts, op, ": experts holds ", ex[i], ", outside [0, ", num_experts,
                      ")");
  const auto i64 = experts.options();
  at::Tensor dest = at::empty({n}, i64), sizes = at::empty({num_experts}, i64), kept = at::empty({num_experts}, i64);
  moe::PermuteIndexArgs a{ex,
                          dest.data_ptr<int64_t>(),
                          sizes.data_ptr<int64_t>(),
                          kept.data_ptr<int64_t>(),
                          n,
                          num_experts,
                          capacity,
                          pad_multiple};
  MK_CPU(moe_permute_index)(a);
  return {dest, sizes, kept};
}

void check_unpermute(const char* op, const at::Tensor& rows, const at::Tensor& dest, const at::Tensor& weights) {
  check_float_input(op, "rows", rows);
  TORCH_CHECK_VALUE(rows.is_cpu() && rows.dim() == 2 && rows.scalar_type() != at::kDouble, op,
                    ": rows must be a [rows, hidden] fp32/bf16/fp16 CPU tensor");
  TORCH_CHECK_VALUE(weights.scalar_type() == at::kFloat && weights.dim() == 2, op,
                    ": weights must be fp32 [tokens, k]");
  TORCH_CHECK_VALUE(dest.scalar_type() == at::kLong && dest.numel() == weights.numel(), op,
                    ": dest must be int64 with one entry per assignment");
  const int64_t* d = dest.data_ptr<int64_t>();
  for (int64_t i = 0; i < dest.numel(); ++i)
    TORCH_CHECK_VALUE(d[i] >= -1 && d[i] < rows.size(0), op, ": dest holds ", d[i], ", outside [-1, ", rows.size(0),
                      ")");
}

at::Tensor moe_unpermute_cpu(const at::Tensor& rows_in, const at::Tensor& dest_in, const at::Tensor& weights_in) {
  const char* op = "moe_unpermute";
  const at::Tensor rows = rows_in.contiguous(), dest = dest_in.contiguous(), w = weights_in.contiguous();
  check_unpermute(op, rows, dest, w);
  const int64_t T = w.size(0), k = w.size(1), h = rows.size(1);
  at::Tensor out = at::empty({T, h}, rows.options());
  moe::UnpermuteArgs a{rows.data_ptr(),
                       dest.data_ptr<int64_t>(),
                       w.data_ptr<float>(),
                       out.data_ptr(),
                       T,
                       k,
                       h,
                       to_dtype(rows.scalar_type())};
  at::parallel_for(0, T, row_grain(k * h), [&](int64_t b, int64_t e) { MK_CPU(moe_unpermute_rows)(a, b, e); });
  return out;
}

std::vector<at::Tensor> moe_unpermute_grad_cpu(const at::Tensor& rows_in, const at::Tensor& dest_in,
                                               const at::Tensor& weights_in, const at::Tensor& dout_in) {
  const char* op = "moe_unpermute_backward";
  const at::Tensor rows = rows_in.contiguous(), dest = dest_in.contiguous(), w = weights_in.contiguous(),
                   dout = dout_in.contiguous();
  check_unpermute(op, rows, dest, w);
  const int64_t T = w.size(0), k = w.size(1), h = rows.size(1);
  TORCH_CHECK_VALUE(dout.sizes() == at::IntArrayRef({T, h}) && dout.scalar_type() == rows.scalar_type(), op,
                    ": grad_output must be [tokens, hidden] in the rows' dtype");
  at::Tensor drows = at::zeros(rows.sizes(), rows.options()), dw = at::empty_like(w);
  moe::UnpermuteGradArgs a{rows.data_ptr(),
                           dest.data_ptr<int64_t>(),
                           w.data_ptr<float>(),
                           dout.data_ptr(),
                           drows.data_ptr(),
                           dw.data_ptr<float>(),
                           T,
                           k,
                           h,
                           to_dtype(rows.scalar_type())};
  at::parallel_for(0, T, row_grain(k * h), [&](int64_t b, int64_t e) { MK_CPU(moe_unpermute_grad_rows)(a, b, e); });
  return {drows, dw};
}

}  // namespace moe_ops
}  // namespace bindings
}  // namespace megakernels

TORCH_LIBRARY_FRAGMENT(megakernels, m) {
  m.def(
      "moe_router_cpu(Tensor logits, Tensor? bias, int k, int score, bool normalize, bool topk_softmax, float scale, "
      "int n_group, int topk_group) -> Tensor[]");
  m.def(
      "moe_router_grad_cpu(Tensor logits, Tensor lse, Tensor experts, Tensor weights, Tensor dweights, Tensor daux, "
      "Tensor dlse, int score, bool normalize, bool topk_softmax, float scale) -> Tensor");
}

TORCH_LIBRARY_FRAGMENT(megakernels, m) {
  m.def("moe_permute_index_cpu(Tensor experts, int num_experts, int capacity, int pad_multiple) -> Tensor[]");
  m.def("moe_unpermute_cpu(Tensor rows, Tensor dest, Tensor weights) -> Tensor");
  m.def("moe_unpermute_grad_cpu(Tensor rows, Tensor dest, Tensor weights, Tensor dout) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(megakernels, CPU, m) {
  m.impl("moe_permute_index_cpu", &megakernels::bindings::moe_ops::moe_permute_index_cpu);
  m.impl("moe_unpermute_cpu", &megakernels::bindings::moe_ops::moe_unpermute_cpu);
  m.impl("moe_unpermute_grad_cpu", &megakernels::bindings::moe_ops::moe_unpermute_grad_cpu);
  m.impl("moe_router_cpu", &megakernels::bindings::moe_ops::moe_router_cpu);
  m.impl("moe_router_grad_cpu", &megakernels::bindings::moe_ops::moe_router_grad_cpu);
}
