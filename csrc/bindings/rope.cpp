// Rotary position embedding bindings: one op, rope (q and k in one pass; `inverse` is the backward).
#include <cmath>

#include "../rope/rope.h"
#include "common.h"

namespace megakernels {
namespace bindings {
namespace rope_ops {  // named, not anonymous: csrc/bindings/all.cpp compiles every family in one unit

// The CUDA launcher of rope_cuda.cu, as built by nvcc or for the emulator.
struct RopeKernels {
  const char* (*rope)(const rope::Args&, void*);
};

const RopeKernels* kernels_for(const at::Tensor& x, bool emulate) {
  static const RopeKernels* cuda_table = MK_IF_CUDA(new RopeKernels{&cuda::rope});
  static const RopeKernels* emu_table = MK_IF_EMU(new RopeKernels{&cuda_emu::rope});
  return select_kernels(x, emulate, cuda_table, emu_table);
}

// Tokens per at::parallel_for grain: enough elements per task to amortise the task overhead.
int64_t token_grain(int64_t elems_per_token) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, elems_per_token));
}

// A head tensor [n0, n1, heads, d] with a contiguous last dim (a view with another last-dim stride is copied).
at::Tensor head_tensor(const char* op, const char* name, const at::Tensor& t) {
  check_float_input(op, name, t);
  TORCH_CHECK_VALUE(t.dim() == 4, op, ": ", name, " has shape ", t.sizes(),
                    "; expected 4 dims [batch, seq, heads, head_dim] (or [seq, batch, heads, head_dim])");
  return t.stride(-1) == 1 || t.size(-1) <= 1 ? t : t.contiguous();
}

void set_tensor(rope::Args& a, int u, const at::Tensor& x, const at::Tensor& y) {
  a.x[u] = x.data_ptr();
  a.y[u] = y.data_ptr();
  a.heads[u] = x.size(2);
  a.xs0[u] = x.stride(0), a.xs1[u] = x.stride(1), a.xsh[u] = x.stride(2);
  a.ys0[u] = y.stride(0), a.ys1[u] = y.stride(1), a.ysh[u] = y.stride(2);
}

std::tuple<at::Tensor, at::Tensor> rope_fwd(const at::Tensor& q_in, const at::Tensor& k_in,
                                            const c10::optional<at::Tensor>& positions_in,
                                            const c10::optional<at::Tensor>& cos_sin_in, double theta,
                                            int64_t position_offset, bool interleaved, int64_t seq_dim, bool inverse,
                                            bool emulate) {
  const char* op = inverse ? "fused_rope_backward" : "fused_rope";
  const at::Tensor q = head_tensor(op, "q", q_in), k = head_tensor(op, "k", k_in);
  check_backend(op, q, emulate);
  check_same_device(op, "k", k, "q", q);
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type(), op, ": k has dtype ", k.scalar_type(), " but q has dtype ",
                   q.scalar_type());
  TORCH_CHECK_VALUE(seq_dim == 0 || seq_dim == 1, op, ": seq_dim must be 0 ([seq, batch, heads, head_dim]) or 1 ",
                    "([batch, seq, heads, head_dim]), got ", seq_dim);
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(1) == q.size(1), op, ": k has shape ", k.sizes(),
                    " but q has shape ", q.sizes(), "; their first two dims (batch and seq) must match");
  const int64_t d = q.size(3);
  TORCH_CHECK_VALUE(d % 2 == 0 && d >= 2, op, ": head_dim (q's last dim) must be even and >= 2, got ", d);
  TORCH_CHECK_VALUE(k.size(3) == d, op, ": k has head_dim ", k.size(3), " but q has head_dim ", d);
  const int64_t seq = q.size(seq_dim), batch = q.size(1 - seq_dim);

  rope::Args a{};
  at::Tensor positions, cos_sin;  // keep converted copies alive
  if (positions_in.has_value()) {
    const at::Tensor& p = *positions_in;
    check_same_device(op, "positions", p, "q", q);
    TORCH_CHECK_TYPE(p.scalar_type() == at::kLong || p.scalar_type() == at::kInt, op, ": positions has dtype ",
                     p.scalar_type(), "; expected an integer tensor (int64 or int32)");
    const bool one_d = p.dim() == 1 && p.size(0) == seq;
    const bool two_d = p.dim() == 2 && p.size(0) == batch && p.size(1) == seq;
    TORCH_CHECK_VALUE(one_d || two_d, op, ": positions has shape ", p.sizes(), "; expected [", seq, "] (one per ",
                      "token of the sequence dim) or [", batch, ", ", seq, "] (per batch row)");
    positions = p.to(at::kLong);
    a.positions = positions.data_ptr<int64_t>();
    a.pos_sb = two_d ? positions.stride(0) : 0;
    a.pos_ss = positions.stride(-1);
  }
  if (cos_sin_in.has_value()) {
    const at::Tensor& t = *cos_sin_in;
    check_same_device(op, "cos_sin", t, "q", q);
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": cos_sin has dtype ", t.scalar_type(),
                     "; expected float32 (a table [max_positions, head_dim / 2, 2] of cos and sin)");
    TORCH_CHECK_VALUE(t.dim() == 3 && t.size(1) == d / 2 && t.size(2) == 2, op, ": cos_sin has shape ", t.sizes(),
                      "; expected [max_positions, ", d / 2, ", 2] (cos, sin per position and pair)");
    cos_sin = t.contiguous();
    a.cos_sin = cos_sin.data_ptr<float>();
    a.max_pos = t.size(0);
  } else {
    TORCH_CHECK_VALUE(std::isfinite(theta) && theta > 0.0, op, ": theta must be a finite number > 0, got ", theta);
  }

  at::Tensor qo = at::empty(q.sizes(), q.options()), ko = at::empty(k.sizes(), k.options());
  advise_huge_pages(qo);
  advise_huge_pages(ko);
  if (q.numel() + k.numel() == 0) return {qo, ko};
  set_tensor(a, 0, q, qo);
  set_tensor(a, 1, k, ko);
  a.n0 = q.size(0);
  a.n1 = q.size(1);
  a.d = d;
  a.seq_dim = int(seq_dim);
  a.position_offset = position_offset;
  a.log2_theta = std::log2(theta);
  a.interleaved = interleaved;
  a.inverse = inverse;
  a.dtype = to_dtype(q.scalar_type());
  if (const RopeKernels* kern = kernels_for(q, emulate)) {
    LaunchScope scope(q);
    raise_if(op, kern->rope(a, scope.stream()));
  } else {
    at::parallel_for(0, a.n0 * a.n1, token_grain((a.heads[0] + a.heads[1]) * d),
                     [&](int64_t b, int64_t e) { MK_CPU(rope_tokens)(a, b, e); });
  }
  return {qo, ko};
}

}  // namespace rope_ops
}  // namespace bindings
}  // namespace megakernels

TORCH_LIBRARY_FRAGMENT(megakernels, m) {
  m.def(
      "rope(Tensor q, Tensor k, Tensor? positions, Tensor? cos_sin, float theta, int position_offset,"
      " bool interleaved, int seq_dim, bool inverse, bool emulate) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megakernels, CPU, m) { m.impl("rope", &megakernels::bindings::rope_ops::rope_fwd); }

#ifdef MEGAKERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(megakernels, CUDA, m) { m.impl("rope", &megakernels::bindings::rope_ops::rope_fwd); }
#endif
