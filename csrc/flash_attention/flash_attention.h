// FlashAttention on the CPU (megakernels/ops/attention.py routes its CPU calls here but fp64's and head dims over
// 256, which stay on megakernels/ops/_attention_cpu.py). Torch-free; csrc/bindings/flash_attention.cpp
// checks, allocates and splits the work items over threads.
//
// q [b, sq, h, d], k [b, sk, hk, d], v [b, sk, hk, d_v] (d_v, the value head dim, may differ from d: multi-head latent
// attention), out/dout [b, sq, h, d_v]; query head hh reads kv head hh / (h / hk). Each tensor has its
// own batch, token and head strides (`Layout`, in elements; head_dim contiguous): q, k, v may be views of one packed
// QKV projection, out and the gradients may be laid out token-major ([s, b, h, d] in memory) as the caller's
// layers are, so no copy is made on either side.
// Every query row i sees one contiguous span of keys (`visible`): with diag = sk - sq + shift and rel = i + diag - j,
// causal keeps rel >= 0 (bottom-right aligned), a sliding window of w keeps rel < w (causal) or |rel| < w, and
// packed documents keep [q_keys[b, i, 0], q_keys[b, i, 1]) (the query's document's keys). Both ends of the span are
// non-decreasing in i, so a block of rows sees [span(first row).lo, span(last row).hi). lse [b, h, sq] fp32 (-inf
// for a query that sees no key, whose output is 0). All math in fp32, but the bf16 forward on a CPU with AVX512-BF16
// (detected at run time: has_bf16_dot): there the products multiply bf16 (P and dS rounded to bf16, as on the GPU)
// and sum in fp32, forward and backward.
//
// Dropout (dropout_p > 0) keeps score (row, col) iff the counter hash of megakernels/triton/_common.py keeps it
// (`keep`, the same bits as the GPU kernels and the PyTorch path; row = (batch * h + head) * sq + query): the
// forward's lse and normaliser come from the whole softmax, its output from the kept probabilities times
// 1 / (1 - p); the backward drops dP where the forward dropped P.
//
// Attention sinks (sinks: fp32 [h], one logit per query head, or null) join each query row's softmax as one more
// column of logit sinks[hh] and value zero, after the key blocks (one more term of the row's max and sum); lse
// includes it, so the backward of q, k, v is unchanged, and the prep pass adds -exp(sinks[hh] - lse) * delta over
// each query block's rows into dsinks_part [b, h, nqb] (summed in a fixed order by the binding).
//
// Layout of the work: k and v are first packed per (batch, kv head, key block of kBlockN keys) into fp32 panels
// padded to dp = the larger of d and d_v rounded up to 16 (kt/vt: the block transposed, [dp, kBlockN]; kp/vp:
// [kBlockN, dp]), so every product below is a small fp32 GEMM on aligned, zero-padded panels (V and dO zero past
// d_v, q and K past d).
// - Forward, per (batch, head, query block of kBlockM rows): online softmax over the visible key blocks (blocks
//   past the causal diagonal are never visited): S = (scale q) K^T, running max and sum, O += P V.
// - Backward, per (batch, kv head, chunk of key blocks: block kb belongs to chunk kb % chunks): for every query
//   head of the group and every query block that sees the key block, P = exp(S - lse), dV += P^T dO,
//   dP = dO V^T, dS = P (dP - delta), dK += dS^T (scale q), and dS K into the chunk's own dq partial sum; then
//   dq = scale * sum over chunks (a fixed order). delta = rowsum(dO * O). `chunks` depends on the shapes only, so
//   the results are the same bits for every thread count.
#pragma once
#include <algorithm>
#include <cstdint>

#include "../common/math.h"

namespace megakernels {
namespace flash_attention {

constexpr int64_t kBlockM = 64;  // query rows per block
constexpr int64_t kBlockN = 64;  // keys per block
constexpr int64_t kMaxHeadDim = 256;

// Element strides of a [b, s, h, d] tensor's batch, token and head dims (head_dim contiguous).
struct Layout {
  int64_t b, s, h;
};
MK_ISA_BEGIN
inline int64_t at(const Layout& l, int64_t bi, int64_t t, int64_t hh) { return bi * l.b + t * l.s + hh * l.h; }
MK_ISA_END

struct Args {
  const void* q;     // [b, sq, h, d]
  const void* k;     // [b, sk, hk, d]
  const void* v;     // [b, sk, hk, d]
  const void* out;   // backward: the forward's output [b, sq, h, d]
  const void* dout;  // backward: its gradient [b, sq, h, d]
  void* o;           // forward: out [b, sq, h, d]
  float* lse;        // [b, h, sq]: written by the forward, read by the backward
  void* dq;          // backward outputs in q/k/v's layouts
  void* dk;
  void* dv;
  float* kt;  // packed K^T panels [b, hk, nkb, dp, kBlockN] (zero padded)
  float* kp;  // packed K [b, hk, nkb * kBlockN, dp] (backward)
  float* vp;  // packed V [b, hk, nkb * kBlockN, dp] (forward)
  // bf16 forward on AVX512-BF16 (cpu::has_bf16_dot): the same panels in bf16 with the products' k pairs
  // interleaved (vdpbf16ps takes two bf16 of k per fp32 lane): K^T [.., dp / 2, kBlockN, 2], V [.., kBlockN / 2,
  // dp, 2]; null: the fp32 panels above
  uint16_t* ktb;
  uint16_t* vpb;
  uint16_t* vtb;  // bf16 backward: V^T [.., dp / 2, kBlockN, 2] and K [.., kBlockN / 2, dp, 2] (ktb as above)
  uint16_t* kpb;
  float* vt;     // packed V^T panels [b, hk, nkb, dp, kBlockN] (backward)
  float* delta;  // backward: [b, h, sq]
  // backward: q and dO packed once per (batch, head, query block) by the prep pass, [b, h, nqb, kBlockM, dp] with
  // the padding rows zero: fp32 (q scaled) or, for the bf16 products, bf16 rows (q16, do16) and the same with
  // query pairs interleaved ([.., kBlockM / 2, dp, 2]: qpb, dopb)
  float* qs_pk;
  float* dos_pk;
  uint16_t* q16_pk;
  uint16_t* do16_pk;
  uint16_t* qpb_pk;
  uint16_t* dopb_pk;
  float* dq_part;                                     // backward: [chunks, b, h, nqb * kBlockM, dp], zero on entry
  const int32_t* q_keys;                              // packed documents: [b, sq, 2] key span of each query, or null
  const float* sinks;                                 // attention sinks [h] (fp32), or null
  float* dsinks_part;                                 // backward with sinks: [b, h, nqb] partial sums of dsinks
  Layout lq, lk, lv, lo, lout, ldout, ldq, ldk, ldv;  // of q, k, v, o, out, dout, dq, dk, dv
  int64_t b, sq, sk, h, hk, d, d_v, dp, nqb, nkb, chunks;  // d: q/k's head dim, d_v: v's; dp: both padded
  uint32_t seed_lo, seed_hi;                               // dropout: the seed's low and high 32 bits
  int32_t threshold;  // dropout: keep iff the hash's top 24 bits >= threshold (0: no dropout)
  float keep_scale;   // dropout: 1 / (1 - p)
  int64_t window;     // sliding window (0: none)
  int64_t shift;      // added to sk - sq (with a window: a chunk's offset under context parallelism)
  float scale;
  bool causal;
  DType dtype;  // F32, BF16 or F16
};

MK_ISA_BEGIN  // inline functions: each ISA clone has its own (csrc/common/cpu_isa.h)

    // The dropout hash (murmur3's finaliser over the row, then the column; megakernels/triton/_common.py).
    inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}
inline uint32_t dropout_row_hash(const Args& a, int64_t row) {
  return fmix32(fmix32(uint32_t(row) + a.seed_hi * 0x9E3779B9u) ^ a.seed_lo);
}
inline bool keep(uint32_t row_hash, int64_t col, int32_t threshold) {
  return int32_t(fmix32(row_hash + uint32_t(col) * 0x27D4EB2Fu) >> 8) >= threshold;
}

// The band rule (megakernels/ops/attention_band.py states it; tests/ops/test_attention_band.py holds this copy to
// the Python and Triton ones). Keys [lo, hi) of query row i's causal/window band: lo >= 0, 0 <= hi <= sk (hi <= lo:
// none); rows past sq follow the same formula.
struct Span {
  int64_t lo, hi;
};
inline Span band_keys(const Args& a, int64_t i) {
  const int64_t diag = a.sk - a.sq + a.shift;
  int64_t lo = 0, hi = a.sk;
  if (a.window > 0) lo = std::max<int64_t>(i + diag - a.window + 1, 0);
  if (a.causal)
    hi = std::min<int64_t>(std::max<int64_t>(i + diag + 1, 0), a.sk);
  else if (a.window > 0)
    hi = std::min<int64_t>(std::max<int64_t>(i + diag + a.window, 0), a.sk);
  return {lo, hi};
}

// Keys [lo, hi) that query row i of batch bi sees: its band cut to its document's keys (hi == lo: none).
inline Span visible(const Args& a, int64_t bi, int64_t i) {
  Span s = band_keys(a, i);
  if (a.q_keys) {
    const int32_t* r = a.q_keys + (bi * a.sq + i) * 2;
    s.lo = std::max<int64_t>(s.lo, r[0]);
    s.hi = std::min<int64_t>(s.hi, r[1]);
  }
  return {s.lo, std::max(s.hi, s.lo)};
}

// Key blocks of `block` keys for the query rows [first, first + rows) of batch bi: those from lo (a multiple of
// block) up to hi meet some row's band, those in [full_lo, full_hi) (multiples of block, inside sk) every row's.
// block = 1: the rows' exact key span [lo, hi).
struct Bounds {
  int64_t lo, full_lo, full_hi, hi;
};
inline Bounds key_bounds(const Args& a, int64_t bi, int64_t first, int64_t rows, int64_t block) {
  const auto cdiv = [](int64_t x, int64_t y) { return (x + y - 1) / y; };  // x >= 0
  Span f = band_keys(a, first), l = band_keys(a, first + rows - 1);
  if (a.q_keys) {
    const int32_t* rf = a.q_keys + (bi * a.sq + first) * 2;
    const int32_t* rl = a.q_keys + (bi * a.sq + std::min(first + rows, a.sq) - 1) * 2;
    f = {std::max<int64_t>(f.lo, rf[0]), std::min<int64_t>(f.hi, rf[1])};
    l = {std::max<int64_t>(l.lo, rl[0]), std::min<int64_t>(l.hi, rl[1])};
  }
  Bounds b;
  b.lo = f.lo / block * block;
  b.hi = std::max(l.hi, b.lo);
  b.full_lo = std::min(std::max(cdiv(l.lo, block) * block, b.lo), cdiv(b.hi, block) * block);
  b.full_hi = std::max(std::max<int64_t>(f.hi, 0) / block * block, b.full_lo);
  return b;
}

MK_ISA_END

}  // namespace flash_attention

// Declared for the baseline and for each ISA clone (csrc/common/cpu_isa.h), one declaration a line.
// clang-format off
MK_DECLARE_CPU_KERNELS(
// Work items: pack b * hk * nkb (into whichever of kt, kp, vp, vt is non-null); fwd b * h * nqb;
// bwd_prep (delta, and q and dO into their panels) b * h * nqb; bwd_dq rows b * sq * h; bwd_kv b * hk * chunks.
// Whether this CPU has AVX512-BF16 (detected at run time): bf16 forwards then multiply bf16 panels, fp32 sums.
bool has_bf16_dot();
void flash_attn_pack(const flash_attention::Args& a, int64_t i0, int64_t i1);
void flash_attn_fwd(const flash_attention::Args& a, int64_t i0, int64_t i1);
void flash_attn_bwd_prep(const flash_attention::Args& a, int64_t r0, int64_t r1);
void flash_attn_bwd_kv(const flash_attention::Args& a, int64_t i0, int64_t i1);
void flash_attn_bwd_dq(const flash_attention::Args& a, int64_t r0, int64_t r1);
)
// clang-format on
}  // namespace megakernels
