// FlashAttention CPU bindings (csrc/flash_attention/flash_attention.h): forward and backward (causal or not, sliding
// window with its shift, packed documents, dropout, attention sinks; fp32/bf16/fp16; head dims <= 256, v's may differ
// from q/k's).
// megakernels/ops/attention.py routes its CPU calls here when they are covered and holds the autograd; everything
// else runs megakernels/ops/_attention_cpu.py.
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty_strided.h>

#include <vector>

#include "../flash_attention/flash_attention.h"
#include "common.h"

namespace megakernels {
namespace bindings {
namespace flash_attention_ops {  // named, not anonymous: csrc/bindings/all.cpp compiles every family in one unit

namespace fa = megakernels::flash_attention;

void check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_float_input(op, "q", q);
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), op, ": the CPU kernel takes CPU tensors, got ", t->device());
    TORCH_CHECK_VALUE(t->dim() == 4, op, ": q, k, v must be 4-D [batch, seqlen, heads, head_dim], got ", t->sizes());
    TORCH_CHECK_VALUE(t->scalar_type() == q.scalar_type(), op, ": q, k, v must share a dtype, got ", q.scalar_type(),
                      " and ", t->scalar_type());
  }
  TORCH_CHECK_VALUE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
                    op, ": the CPU kernel takes fp32, bf16 or fp16, got ", q.scalar_type());
  TORCH_CHECK_VALUE(k.size(0) == v.size(0) && k.size(1) == v.size(1) && k.size(2) == v.size(2), op,
                    ": v must have k's batch, seqlen and heads (its head_dim may differ), got k ", k.sizes(), " and v ",
                    v.sizes());
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(3) == q.size(3), op,
                    ": k must match q's batch and head_dim, got q ", q.sizes(), " and k ", k.sizes());
  TORCH_CHECK_VALUE(k.size(2) > 0 && q.size(2) % k.size(2) == 0, op, ": q's ", q.size(2),
                    " heads are not a multiple of k/v's ", k.size(2));
  TORCH_CHECK_VALUE(q.size(3) >= 1 && q.size(3) <= fa::kMaxHeadDim, op, ": head_dim ", q.size(3), " outside [1, ",
                    fa::kMaxHeadDim, "]");
  TORCH_CHECK_VALUE(v.size(3) >= 1 && v.size(3) <= fa::kMaxHeadDim, op, ": v's head_dim ", v.size(3), " outside [1, ",
                    fa::kMaxHeadDim, "]");
  TORCH_CHECK_VALUE(q.size(1) >= 1 && k.size(1) >= 1, op, ": empty sequences are not for the kernel (sq ", q.size(1),
                    ", sk ", k.size(1), ")");
}

// The packed documents' key spans of the queries ([b, sq, 2] int32, megakernels.ops.attention.document_ranges),
// checked; an undefined tensor (no documents) stays undefined.
at::Tensor checked_q_keys(const char* op, const c10::optional<at::Tensor>& q_keys, const at::Tensor& q,
                          const at::Tensor& k) {
  if (!q_keys.has_value() || !q_keys->defined()) return at::Tensor();
  const at::Tensor& t = *q_keys;
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == 3 && t.size(0) == q.size(0) &&
                        t.size(1) == q.size(1) && t.size(2) == 2,
                    op, ": q_keys must be a CPU int32 [batch, sq, 2] tensor of key spans, got ", t.scalar_type(), " ",
                    t.sizes());
  const at::Tensor c = t.contiguous();
  TORCH_CHECK_VALUE(c.numel() == 0 || (c.min().item<int32_t>() >= 0 && c.max().item<int32_t>() <= k.size(1)), op,
                    ": q_keys spans must lie in [0, sk = ", k.size(1), "]");
  return c;
}

// The attention sinks (fp32 [heads] on the CPU, one per query head), checked; undefined (no sinks) stays undefined.
at::Tensor checked_sinks(const char* op, const c10::optional<at::Tensor>& sinks, const at::Tensor& q) {
  if (!sinks.has_value() || !sinks->defined()) return at::Tensor();
  const at::Tensor& t = *sinks;
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == q.size(2), op,
                    ": sinks must be a CPU float32 [heads] = [", q.size(2), "] tensor, got ", t.scalar_type(), " ",
                    t.sizes(), " on ", t.device());
  return t.contiguous();
}

fa::Args make_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                   int64_t window, int64_t shift, const at::Tensor& q_keys, double dropout_p, int64_t seed) {
  TORCH_CHECK_VALUE(window >= 0, "flash_attention: window must be >= 0, got ", window);
  TORCH_CHECK_VALUE(shift == 0 || window > 0, "flash_attention: shift=", shift, " needs window > 0");
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p < 1.0, "flash_attention: dropout_p must be in [0, 1), got ",
                    dropout_p);
  fa::Args a{};
  // the threshold and scale of megakernels/triton/_common.py (dropout_threshold: round(p * 2^24))
  a.threshold = static_cast<int32_t>(std::nearbyint(dropout_p * double(1 << 24)));
  a.keep_scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  a.seed_lo = static_cast<uint32_t>(static_cast<uint64_t>(seed) & 0xFFFFFFFFu);
  a.seed_hi = static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32);
  a.window = window;
  a.shift = shift;
  a.q_keys = q_keys.defined() ? q_keys.data_ptr<int32_t>() : nullptr;
  a.b = q.size(0);
  a.sq = q.size(1);
  a.h = q.size(2);
  a.d = q.size(3);
  a.d_v = v.size(3);
  a.sk = k.size(1);
  a.hk = k.size(2);
  a.dp = (std::max(a.d, a.d_v) + 15) / 16 * 16;
  a.nqb = (a.sq + fa::kBlockM - 1) / fa::kBlockM;
  a.nkb = (a.sk + fa::kBlockN - 1) / fa::kBlockN;
  a.scale = static_cast<float>(scale);
  a.causal = causal;
  a.dtype = to_dtype(q.scalar_type());
  return a;
}

// bf16 on a CPU with AVX512-BF16 multiplies bf16 panels (MEGAKERNELS_CPU_BF16_DOT=0 keeps the fp32 ones), when the
// kernels run AVX-512 (not where MEGAKERNELS_CPU_ISA chose a narrower ISA).
bool bf16_dot(const fa::Args& a) {
  const char* env = std::getenv("MEGAKERNELS_CPU_BF16_DOT");
  const CpuIsa isa = cpu_isa();
  return a.dtype == DType::BF16 && (isa == CpuIsa::kAvx512 || isa == CpuIsa::kNative) && MK_CPU(has_bf16_dot)() &&
         !(env && std::string(env) == "0");
}

// One packed K or V buffer (flash_attention.h's panels): fp32, or bf16 for the bf16 products (`dot`).
at::Tensor packed(const fa::Args& a, const at::Tensor& q, bool dot = false) {
  return at::empty({a.b * a.hk * a.nkb * fa::kBlockN * a.dp}, q.options().dtype(dot ? at::kBFloat16 : at::kFloat));
}

uint16_t* bf16_bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// The kernel reads and writes any batch, token and head strides; only head_dim must be contiguous.
at::Tensor inner_contiguous(const at::Tensor& t) { return t.stride(3) == 1 || t.size(3) == 1 ? t : t.contiguous(); }
fa::Layout layout(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// The forward's output [b, sq, h, dv] in q's memory order (empty_like(q) when dv is q's head dim; megakernels/ops/
// attention.py's empty_out gives the custom op's fake output the same strides).
at::Tensor empty_out(const at::Tensor& q, int64_t dv) {
  if (dv == q.size(3)) return at::empty_like(q);               // q's memory order (token-major q, token-major out)
  const at::Tensor order = at::empty_like(q.narrow(3, 0, 1));  // q's order of batch, token and head, made dense
  return at::empty_strided({q.size(0), q.size(1), q.size(2), dv},
                           {order.stride(0) * dv, order.stride(1) * dv, order.stride(2) * dv, 1}, q.options());
}

std::tuple<at::Tensor, at::Tensor> flash_attn_fwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                                      const at::Tensor& v_in, bool causal, double scale, int64_t window,
                                                      int64_t shift, const c10::optional<at::Tensor>& q_keys_in,
                                                      double dropout_p, int64_t seed,
                                                      const c10::optional<at::Tensor>& sinks_in) {
  const char* op = "flash_attention";
  check_qkv(op, q_in, k_in, v_in);
  const at::Tensor q = inner_contiguous(q_in), k = inner_contiguous(k_in), v = inner_contiguous(v_in);
  const at::Tensor q_keys = checked_q_keys(op, q_keys_in, q, k);
  const at::Tensor sinks = checked_sinks(op, sinks_in, q);
  fa::Args a = make_args(q, k, v, causal, scale, window, shift, q_keys, dropout_p, seed);
  a.sinks = sinks.defined() ? sinks.data_ptr<float>() : nullptr;
  at::Tensor out = empty_out(q, a.d_v);
  a.lq = layout(q), a.lk = layout(k), a.lv = layout(v), a.lo = layout(out);
  at::Tensor lse = at::empty({a.b, a.h, a.sq}, q.options().dtype(at::kFloat));
  const bool dot = bf16_dot(a);
  const at::Tensor kt = packed(a, q, dot), vp = packed(a, q, dot);
  if (dot)
    a.ktb = bf16_bits(kt), a.vpb = bf16_bits(vp);
  else
    a.kt = kt.data_ptr<float>(), a.vp = vp.data_ptr<float>();
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.o = out.data_ptr();
  a.lse = lse.data_ptr<float>();
  at::parallel_for(0, a.b * a.hk * a.nkb, 1, [&](int64_t b, int64_t e) { MK_CPU(flash_attn_pack)(a, b, e); });
  at::parallel_for(0, a.b * a.h * a.nqb, 1, [&](int64_t b, int64_t e) { MK_CPU(flash_attn_fwd)(a, b, e); });
  return {out, lse};
}

// The gradients written into dq, dk, dv (shaped as q, k, v, any batch/token/head strides, head_dim contiguous), and
// with sinks the sinks' gradient into dsinks (fp32 [heads]).
void flash_attn_bwd_cpu_into(const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
                             const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in, bool causal,
                             double scale, int64_t window, int64_t shift, const c10::optional<at::Tensor>& q_keys_in,
                             double dropout_p, int64_t seed, const at::Tensor& dq, const at::Tensor& dk,
                             const at::Tensor& dv, const c10::optional<at::Tensor>& sinks_in,
                             const c10::optional<at::Tensor>& dsinks) {
  const char* op = "flash_attention_backward";
  check_qkv(op, q_in, k_in, v_in);
  const at::Tensor sinks = checked_sinks(op, sinks_in, q_in);
  const bool has_dsinks = dsinks.has_value() && dsinks->defined();
  TORCH_CHECK_VALUE(sinks.defined() == has_dsinks, op, ": sinks and dsinks go together (both or neither)");
  if (has_dsinks)
    TORCH_CHECK_VALUE(dsinks->device().is_cpu() && dsinks->scalar_type() == at::kFloat && dsinks->dim() == 1 &&
                          dsinks->size(0) == q_in.size(2),
                      op, ": dsinks must be a CPU float32 [heads] = [", q_in.size(2), "] tensor, got ",
                      dsinks->scalar_type(), " ", dsinks->sizes());
  const std::vector<int64_t> out_shape = {q_in.size(0), q_in.size(1), q_in.size(2), v_in.size(3)};
  TORCH_CHECK_VALUE(dout_in.sizes() == at::IntArrayRef(out_shape) && out_in.sizes() == at::IntArrayRef(out_shape) &&
                        dout_in.scalar_type() == q_in.scalar_type() && out_in.scalar_type() == q_in.scalar_type() &&
                        dout_in.device().is_cpu() && out_in.device().is_cpu(),
                    op,
                    ": grad_out and out must be CPU tensors of q's dtype and shape [batch, sq, heads, v's head_dim] ",
                    at::IntArrayRef(out_shape), ", got ", dout_in.sizes(), " and ", out_in.sizes());
  TORCH_CHECK_VALUE(lse_in.device().is_cpu() && lse_in.dim() == 3 && lse_in.size(0) == q_in.size(0) &&
                        lse_in.size(1) == q_in.size(2) && lse_in.size(2) == q_in.size(1),
                    op, ": lse must be [batch, heads, sq] on the CPU, got ", lse_in.sizes());
  const std::pair<const char*, const at::Tensor*> grads[] = {{"dq", &q_in}, {"dk", &k_in}, {"dv", &v_in}};
  const at::Tensor* outs[] = {&dq, &dk, &dv};
  for (int i = 0; i < 3; ++i) {
    const at::Tensor& g = *outs[i];
    const at::Tensor& like = *grads[i].second;
    TORCH_CHECK_VALUE(g.device().is_cpu() && g.scalar_type() == like.scalar_type() && g.sizes() == like.sizes() &&
                          (g.stride(3) == 1 || g.size(3) == 1),
                      op, ": ", grads[i].first, " must be a CPU ", like.scalar_type(), " tensor of shape ",
                      like.sizes(), " with a contiguous head_dim, got ", g.scalar_type(), " ", g.sizes(), " strides ",
                      g.strides());
    TORCH_CHECK_VALUE(at::has_internal_overlap(g) != at::MemOverlap::Yes, op, ": ", grads[i].first,
                      " has elements that share memory (strides ", g.strides(), ")");
    // a gradient written over an input the kernel still reads (or over another gradient) would be a wrong answer
    const std::pair<const char*, const at::Tensor*> others[] = {
        {"q", &q_in},           {"k", &k_in}, {"v", &v_in}, {"out", &out_in},
        {"grad_out", &dout_in}, {"dq", &dq},  {"dk", &dk},  {"dv", &dv}};
    for (const auto& [name, t] : others) {
      if (t == outs[i]) continue;
      const at::MemOverlapStatus st = at::get_overlap_status(g, *t);
      TORCH_CHECK_VALUE(st != at::MemOverlapStatus::Full && st != at::MemOverlapStatus::Partial, op, ": ",
                        grads[i].first, " shares memory with ", name);
    }
  }
  const at::Tensor q = inner_contiguous(q_in), k = inner_contiguous(k_in), v = inner_contiguous(v_in);
  const at::Tensor dout = inner_contiguous(dout_in), out = inner_contiguous(out_in);
  const at::Tensor lse = lse_in.to(at::kFloat).contiguous();
  const at::Tensor q_keys = checked_q_keys(op, q_keys_in, q, k);
  fa::Args a = make_args(q, k, v, causal, scale, window, shift, q_keys, dropout_p, seed);
  a.sinks = sinks.defined() ? sinks.data_ptr<float>() : nullptr;
  at::Tensor dsinks_part = sinks.defined() ? at::empty({a.b, a.h, a.nqb}, q.options().dtype(at::kFloat)) : at::Tensor();
  a.dsinks_part = sinks.defined() ? dsinks_part.data_ptr<float>() : nullptr;
  // Chunks of key blocks, one dq partial sum each: enough work items for the threads (16 with the kv heads), fixed
  // by the shapes so that the bits are the same on any machine; more than 4 only while the partial sums stay under
  // 256 MiB.
  const int64_t part_bytes = a.b * a.h * a.nqb * fa::kBlockM * a.dp * int64_t(sizeof(float));
  const int64_t most = std::max<int64_t>(4, (int64_t(256) << 20) / part_bytes);
  a.chunks = std::clamp<int64_t>((16 + a.b * a.hk - 1) / (a.b * a.hk), 1, std::min(a.nkb, most));
  a.lq = layout(q), a.lk = layout(k), a.lv = layout(v), a.lout = layout(out), a.ldout = layout(dout);
  a.ldq = layout(dq), a.ldk = layout(dk), a.ldv = layout(dv);
  const bool dot = bf16_dot(a);
  const at::Tensor kt = packed(a, q, dot), kp = packed(a, q, dot), vt = packed(a, q, dot);
  if (dot)
    a.ktb = bf16_bits(kt), a.kpb = bf16_bits(kp), a.vtb = bf16_bits(vt);
  else
    a.kt = kt.data_ptr<float>(), a.kp = kp.data_ptr<float>(), a.vt = vt.data_ptr<float>();
  at::Tensor delta = at::empty({a.b, a.h, a.sq}, q.options().dtype(at::kFloat));
  // q and dO packed once for every key block that reads them (flash_attention.h: qs_pk ...), padding rows included
  const int64_t q_panels = a.b * a.h * a.nqb * fa::kBlockM * a.dp;
  at::Tensor q_packed =
      at::empty({dot ? 4 * q_panels : 2 * q_panels}, q.options().dtype(dot ? at::kBFloat16 : at::kFloat));
  if (dot) {
    uint16_t* base = bf16_bits(q_packed);
    a.q16_pk = base, a.do16_pk = base + q_panels, a.qpb_pk = base + 2 * q_panels, a.dopb_pk = base + 3 * q_panels;
  } else {
    a.qs_pk = q_packed.data_ptr<float>(), a.dos_pk = a.qs_pk + q_panels;
  }
  at::Tensor dq_part = at::zeros({a.chunks, a.b, a.h, a.nqb * fa::kBlockM, a.dp}, q.options().dtype(at::kFloat));
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.out = out.data_ptr();
  a.dout = dout.data_ptr();
  a.lse = const_cast<float*>(lse.data_ptr<float>());
  a.dq = dq.data_ptr();
  a.dk = dk.data_ptr();
  a.dv = dv.data_ptr();
  a.delta = delta.data_ptr<float>();
  a.dq_part = dq_part.data_ptr<float>();
  const int64_t rows = a.b * a.sq * a.h;
  at::parallel_for(0, a.b * a.hk * a.nkb, 1, [&](int64_t b, int64_t e) { MK_CPU(flash_attn_pack)(a, b, e); });
  at::parallel_for(0, a.b * a.h * a.nqb, 1, [&](int64_t b, int64_t e) { MK_CPU(flash_attn_bwd_prep)(a, b, e); });
  at::parallel_for(0, a.b * a.hk * a.chunks, 1, [&](int64_t b, int64_t e) { MK_CPU(flash_attn_bwd_kv)(a, b, e); });
  at::parallel_for(0, rows, row_grain(a.d), [&](int64_t b, int64_t e) { MK_CPU(flash_attn_bwd_dq)(a, b, e); });
  if (has_dsinks) dsinks->copy_(dsinks_part.sum(at::IntArrayRef{0, 2}));  // a fixed order: the same bits every run
}

// The gradients in q, k and v's own memory orders (empty_like of a strided view keeps its order of strides), and the
// sinks' (fp32 [heads]; an empty fp32 tensor without sinks).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attn_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, bool causal, double scale, int64_t window, int64_t shift,
    const c10::optional<at::Tensor>& q_keys, double dropout_p, int64_t seed, const c10::optional<at::Tensor>& sinks) {
  check_qkv("flash_attention_backward", q, k, v);
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  const bool has_sinks = sinks.has_value() && sinks->defined();
  at::Tensor dsinks = at::empty({has_sinks ? q.size(2) : 0}, q.options().dtype(at::kFloat));
  flash_attn_bwd_cpu_into(dout, q, k, v, out, lse, causal, scale, window, shift, q_keys, dropout_p, seed, dq, dk, dv,
                          sinks, has_sinks ? c10::optional<at::Tensor>(dsinks) : c10::nullopt);
  return {dq, dk, dv, dsinks};
}

// The kernel's band rule for the query rows [first, first + rows) of batch element `batch` (fa::key_bounds: lo,
// full_lo, full_hi, hi in blocks of `block` keys), for tests/ops/test_attention_band.py to hold it to the Python
// and Triton copies.
std::vector<int64_t> flash_attn_key_bounds(int64_t sq, int64_t sk, bool causal, int64_t window, int64_t shift,
                                           const c10::optional<at::Tensor>& q_keys, int64_t batch, int64_t first,
                                           int64_t rows, int64_t block) {
  const char* op = "flash_attn_key_bounds";
  TORCH_CHECK_VALUE(sq >= 1 && sk >= 1, op, ": sq and sk must be >= 1, got ", sq, " and ", sk);
  TORCH_CHECK_VALUE(first >= 0 && rows >= 1 && first + rows <= sq, op, ": rows [first, first + rows) = [", first, ", ",
                    first + rows, ") must lie in [0, sq = ", sq, ")");
  TORCH_CHECK_VALUE(block >= 1, op, ": block must be >= 1, got ", block);
  TORCH_CHECK_VALUE(window >= 0 && (shift == 0 || window > 0), op, ": window must be >= 0 and shift needs one, got ",
                    window, " and ", shift);
  at::Tensor spans;
  if (q_keys.has_value() && q_keys->defined()) {
    TORCH_CHECK_VALUE(q_keys->dim() == 3 && q_keys->size(1) == sq && batch >= 0 && batch < q_keys->size(0), op,
                      ": q_keys must be [batch, sq, 2] with batch ", batch, " in range, got ", q_keys->sizes());
    spans = checked_q_keys(op, q_keys, at::empty({q_keys->size(0), sq, 1, 1}), at::empty({q_keys->size(0), sk, 1, 1}));
  }
  fa::Args a{};
  a.sq = sq;
  a.sk = sk;
  a.causal = causal;
  a.window = window;
  a.shift = shift;
  a.q_keys = spans.defined() ? spans.data_ptr<int32_t>() : nullptr;
  const fa::Bounds b = fa::key_bounds(a, batch, first, rows, block);
  return {b.lo, b.full_lo, b.full_hi, b.hi};
}

}  // namespace flash_attention_ops
}  // namespace bindings
}  // namespace megakernels

TORCH_LIBRARY_FRAGMENT(megakernels, m) {
  m.def(
      "flash_attn_key_bounds(int sq, int sk, bool causal, int window, int shift, Tensor? q_keys, int batch, "
      "int first, int rows, int block) -> int[]",
      &megakernels::bindings::flash_attention_ops::flash_attn_key_bounds);
  m.def(
      "flash_attn_fwd_cpu(Tensor q, Tensor k, Tensor v, bool causal, float scale, int window=0, int shift=0, "
      "Tensor? q_keys=None, float dropout_p=0.0, int seed=0, Tensor? sinks=None) -> (Tensor, Tensor)");
  m.def(
      "flash_attn_bwd_cpu(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
      "float scale, int window=0, int shift=0, Tensor? q_keys=None, float dropout_p=0.0, int seed=0, "
      "Tensor? sinks=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "flash_attn_bwd_cpu_into(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
      "float scale, int window, int shift, Tensor? q_keys, float dropout_p, int seed, Tensor(a!) dq, Tensor(b!) dk, "
      "Tensor(c!) dv, Tensor? sinks=None, Tensor(d!)? dsinks=None) -> ()");
}

TORCH_LIBRARY_IMPL(megakernels, CPU, m) {
  m.impl("flash_attn_fwd_cpu", &megakernels::bindings::flash_attention_ops::flash_attn_fwd_cpu);
  m.impl("flash_attn_bwd_cpu", &megakernels::bindings::flash_attention_ops::flash_attn_bwd_cpu);
  m.impl("flash_attn_bwd_cpu_into", &megakernels::bindings::flash_attention_ops::flash_attn_bwd_cpu_into);
}
