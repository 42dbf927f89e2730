// C++ test of the CPU FlashAttention kernels without Python: forward (output and log-sum-exp) and backward (dq, dk,
// dv) against a naive fp64 attention, over fp32 and bf16, grouped-query heads, causal masking with sq < sk, sq > sk
// (queries that see no key: output 0, lse -inf, no gradient) and non-causal, head sizes that are not multiples of
// 16 (the zero-padded panels) and sequence lengths that are not multiples of the 64-row blocks. Work is split as
// the bindings split it across threads, and again one item at a time in reverse: the results must be the same
// bits (the chunked dq sum has a fixed order), and so must every tensor laid out token-major (the kernels'
// strides). Sliding windows (causal and symmetric, with a shifted diagonal) and packed documents (the queries' key
// spans) against the same reference with the mask written as a predicate. Built plain and with AddressSanitizer
// (CMakeLists.txt), so a read past a panel or a block edge fails here before it reaches a user.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../../common/cpu_types.h"
#include "../../common/test_util.h"
#include "../flash_attention.h"

using namespace megakernels;
using namespace megakernels::testing;
namespace fa = megakernels::flash_attention;

namespace {

struct Shape {
  int64_t b, sq, sk, h, hk, d;
  bool causal;
  int64_t window = 0, shift = 0;
  int64_t doc = 0;  // > 0: packed documents of `doc` tokens (queries and keys numbered alike)
};

// Whether query i sees key j (the rule of flash_attention.h, written out).
bool sees(const Shape& s, int64_t i, int64_t j) {
  const int64_t rel = i + s.sk - s.sq + s.shift - j;
  if (s.causal && rel < 0) return false;
  if (s.window > 0 && (s.causal ? rel >= s.window : std::llabs(rel) >= s.window)) return false;
  if (s.doc > 0 && i / s.doc != j / s.doc) return false;
  return true;
}

// The queries' key spans of documents of s.doc tokens ([b, sq, 2]), as megakernels.ops.attention.document_ranges.
std::vector<int32_t> q_key_spans(const Shape& s) {
  std::vector<int32_t> r;
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t i = 0; i < s.sq; ++i) {
      r.push_back(int32_t(std::min(s.sk, i / s.doc * s.doc)));
      r.push_back(int32_t(std::min(s.sk, (i / s.doc + 1) * s.doc)));
    }
  return r;
}

std::string name(const Shape& s, DType dt) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "b%lld sq%lld sk%lld h%lld hk%lld d%lld %s w%lld shift%lld doc%lld %s", (long long)s.b,
                (long long)s.sq, (long long)s.sk, (long long)s.h, (long long)s.hk, (long long)s.d,
                s.causal ? "causal" : "full", (long long)s.window, (long long)s.shift, (long long)s.doc,
                dtype_name(dt));
  return buf;
}

// fp64 attention: out [b, sq, h, d], lse [b, h, sq]; and the gradients for dout.
struct Reference {
  std::vector<double> out, lse, dq, dk, dv;
};

Reference reference(const Shape& s, const std::vector<double>& q, const std::vector<double>& k,
                    const std::vector<double>& v, const std::vector<double>& dout, double scale) {
  Reference r;
  const int64_t group = s.h / s.hk;
  r.out.assign(s.b * s.sq * s.h * s.d, 0.0);
  r.lse.assign(s.b * s.h * s.sq, -std::numeric_limits<double>::infinity());
  r.dq.assign(q.size(), 0.0);
  r.dk.assign(k.size(), 0.0);
  r.dv.assign(v.size(), 0.0);
  auto qi = [&](int64_t b, int64_t i, int64_t h) { return ((b * s.sq + i) * s.h + h) * s.d; };
  auto ki = [&](int64_t b, int64_t j, int64_t h) { return ((b * s.sk + j) * s.hk + h) * s.d; };
  std::vector<double> p(s.sk), dp(s.sk);
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t h = 0; h < s.h; ++h)
      for (int64_t i = 0; i < s.sq; ++i) {
        const int64_t kh = h / group;
        int64_t first = 0, last = s.sk - 1;  // the visible keys are one run: its ends
        while (first < s.sk && !sees(s, i, first)) ++first;
        while (last >= first && !sees(s, i, last)) --last;
        if (last < first) continue;  // sees no key
        for (int64_t j = first; j <= last; ++j) expect(sees(s, i, j), "the visible keys of a query are one run");
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = first; j <= last; ++j) {
          double dot = 0;
          for (int64_t c = 0; c < s.d; ++c) dot += q[qi(b, i, h) + c] * k[ki(b, j, kh) + c];
          p[j] = dot * scale;
          mx = std::max(mx, p[j]);
        }
        double sum = 0;
        for (int64_t j = first; j <= last; ++j) sum += std::exp(p[j] - mx);
        r.lse[(b * s.h + h) * s.sq + i] = mx + std::log(sum);
        double delta = 0;
        for (int64_t j = first; j <= last; ++j) {
          p[j] = std::exp(p[j] - mx) / sum;
          double g = 0;
          for (int64_t c = 0; c < s.d; ++c) {
            r.out[qi(b, i, h) + c] += p[j] * v[ki(b, j, kh) + c];
            g += dout[qi(b, i, h) + c] * v[ki(b, j, kh) + c];
          }
          dp[j] = g;
          delta += p[j] * g;
        }
        for (int64_t j = first; j <= last; ++j) {
          const double ds = p[j] * (dp[j] - delta);
          for (int64_t c = 0; c < s.d; ++c) {
            r.dq[qi(b, i, h) + c] += scale * ds * k[ki(b, j, kh) + c];
            r.dk[ki(b, j, kh) + c] += scale * ds * q[qi(b, i, h) + c];
            r.dv[ki(b, j, kh) + c] += p[j] * dout[qi(b, i, h) + c];
          }
        }
      }
  return r;
}

fa::Args make_args(const Shape& s, DType dt, float scale, const std::vector<int32_t>& spans) {
  fa::Args a{};
  a.window = s.window, a.shift = s.shift;
  a.q_keys = s.doc > 0 ? spans.data() : nullptr;
  a.b = s.b, a.sq = s.sq, a.sk = s.sk, a.h = s.h, a.hk = s.hk, a.d = s.d, a.d_v = s.d;
  a.dp = (s.d + 15) / 16 * 16;
  a.nqb = (s.sq + fa::kBlockM - 1) / fa::kBlockM;
  a.nkb = (s.sk + fa::kBlockN - 1) / fa::kBlockN;
  a.scale = scale;
  a.causal = s.causal;
  a.dtype = dt;
  const fa::Layout lq{s.sq * s.h * s.d, s.h * s.d, s.d}, lk{s.sk * s.hk * s.d, s.hk * s.d, s.d};  // contiguous
  a.lq = a.lo = a.lout = a.ldout = a.ldq = lq;
  a.lk = a.lv = a.ldk = a.ldv = lk;
  return a;
}

// Every tensor's layout token-major: [b, s, h, d] indexed over [s, b, h, d] memory.
void set_token_major(fa::Args& a, const Shape& s) {
  const fa::Layout lq{s.h * s.d, s.b * s.h * s.d, s.d}, lk{s.hk * s.d, s.b * s.hk * s.d, s.d};
  a.lq = a.lo = a.lout = a.ldout = a.ldq = lq;
  a.lk = a.lv = a.ldk = a.ldv = lk;
}

// Runs fn over [0, n) in the pieces a thread pool might use (`reverse`: one item at a time, last first).
template <typename F>
void split(int64_t n, bool reverse, F fn) {
  if (!reverse) {
    const int64_t grain = std::max<int64_t>(1, n / 3);
    for (int64_t i = 0; i < n; i += grain) fn(i, std::min(n, i + grain));
    return;
  }
  for (int64_t i = n - 1; i >= 0; --i) fn(i, i + 1);
}

struct Result {
  Buf out, dq, dk, dv;
  std::vector<float> lse;
};

// x [b, s, h, d] (contiguous) moved to token-major memory ([s, b, h, d], as views of a sequence-first projection
// lay it out), or back (`back`).
Buf token_major(const Buf& x, int64_t b, int64_t s, int64_t h, int64_t d, bool back = false) {
  Buf y(x.dt, x.size());
  const size_t e = elem_size(x.dt);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t t = 0; t < s; ++t) {
      const size_t plain = size_t((bi * s + t) * h * d), tm = size_t((t * b + bi) * h * d);
      std::memcpy(static_cast<unsigned char*>(y.data()) + (back ? plain : tm) * e,
                  static_cast<const unsigned char*>(x.data()) + (back ? tm : plain) * e, size_t(h * d) * e);
    }
  return y;
}

// `tm`: every tensor in token-major memory (the kernels told so by their layouts), the results moved back.
Result run(const Shape& s, DType dt, const Buf& q_in, const Buf& k_in, const Buf& v_in, const Buf& dout_in, float scale,
           bool reverse, bool dot = false, bool tm = false, bool tm_layout = false) {
  if (tm) {
    const Buf q = token_major(q_in, s.b, s.sq, s.h, s.d), k = token_major(k_in, s.b, s.sk, s.hk, s.d);
    const Buf v = token_major(v_in, s.b, s.sk, s.hk, s.d), dout = token_major(dout_in, s.b, s.sq, s.h, s.d);
    Result r = run(s, dt, q, k, v, dout, scale, reverse, dot, false, true);
    return {token_major(r.out, s.b, s.sq, s.h, s.d, true), token_major(r.dq, s.b, s.sq, s.h, s.d, true),
            token_major(r.dk, s.b, s.sk, s.hk, s.d, true), token_major(r.dv, s.b, s.sk, s.hk, s.d, true), r.lse};
  }
  const Buf &q = q_in, &k = k_in, &v = v_in, &dout = dout_in;
  const std::vector<int32_t> spans = s.doc > 0 ? q_key_spans(s) : std::vector<int32_t>();
  fa::Args a = make_args(s, dt, scale, spans);
  if (tm_layout) set_token_major(a, s);
  const size_t panels = size_t(a.b * a.hk * a.nkb * fa::kBlockN * a.dp);
  Result r{Buf(dt, q.size()), Buf(dt, q.size()), Buf(dt, k.size()), Buf(dt, v.size()), {}};
  r.lse.assign(size_t(s.b * s.h * s.sq), 0.f);
  // forward
  std::vector<float> kt(panels, 0.f), vp(panels, 0.f);
  std::vector<uint16_t> ktb(dot ? panels : 0), vpb(dot ? panels : 0);
  a.q = q.data(), a.k = k.data(), a.v = v.data(), a.o = r.out.data(), a.lse = r.lse.data();
  if (dot)  // the bf16 forward on AVX512-BF16: bf16 panels only
    a.ktb = ktb.data(), a.vpb = vpb.data();
  else
    a.kt = kt.data(), a.vp = vp.data();
  split(a.b * a.hk * a.nkb, reverse, [&](int64_t i0, int64_t i1) { cpu::flash_attn_pack(a, i0, i1); });
  split(a.b * a.h * a.nqb, reverse, [&](int64_t i0, int64_t i1) { cpu::flash_attn_fwd(a, i0, i1); });
  // backward, with the bindings' number of key-block chunks
  fa::Args g = make_args(s, dt, scale, spans);
  if (tm_layout) set_token_major(g, s);
  g.chunks = std::clamp<int64_t>((16 + g.b * g.hk - 1) / (g.b * g.hk), 1, g.nkb);
  std::vector<float> kt2(panels, 0.f), kp(panels, 0.f), vt(panels, 0.f), delta(size_t(s.b * s.h * s.sq), 0.f);
  std::vector<float> part(size_t(g.chunks * g.b * g.h * g.nqb * fa::kBlockM * g.dp), 0.f);
  g.q = q.data(), g.k = k.data(), g.v = v.data(), g.out = r.out.data(), g.dout = dout.data();
  g.lse = r.lse.data(), g.dq = r.dq.data(), g.dk = r.dk.data(), g.dv = r.dv.data();
  std::vector<uint16_t> ktb2(dot ? panels : 0), kpb(dot ? panels : 0), vtb(dot ? panels : 0);
  if (dot)  // the bf16 backward on AVX512-BF16: bf16 panels only
    g.ktb = ktb2.data(), g.kpb = kpb.data(), g.vtb = vtb.data();
  else
    g.kt = kt2.data(), g.kp = kp.data(), g.vt = vt.data();
  g.delta = delta.data(), g.dq_part = part.data();
  const size_t q_panels = size_t(g.b * g.h * g.nqb * fa::kBlockM * g.dp);  // q and dO, packed by the prep pass
  std::vector<float> q_f32(dot ? 0 : 2 * q_panels);
  std::vector<uint16_t> q_b16(dot ? 4 * q_panels : 0);
  if (dot)
    g.q16_pk = q_b16.data(), g.do16_pk = g.q16_pk + q_panels, g.qpb_pk = g.q16_pk + 2 * q_panels,
    g.dopb_pk = g.q16_pk + 3 * q_panels;
  else
    g.qs_pk = q_f32.data(), g.dos_pk = g.qs_pk + q_panels;
  const int64_t rows = g.b * g.sq * g.h;
  split(g.b * g.hk * g.nkb, reverse, [&](int64_t i0, int64_t i1) { cpu::flash_attn_pack(g, i0, i1); });
  split(g.b * g.h * g.nqb, reverse, [&](int64_t i0, int64_t i1) { cpu::flash_attn_bwd_prep(g, i0, i1); });
  split(g.b * g.hk * g.chunks, reverse, [&](int64_t i0, int64_t i1) { cpu::flash_attn_bwd_kv(g, i0, i1); });
  split(rows, reverse, [&](int64_t i0, int64_t i1) { cpu::flash_attn_bwd_dq(g, i0, i1); });
  return r;
}

bool same_bits(const Buf& a, const Buf& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * elem_size(a.dt)) == 0;
}

void check(const Shape& s, DType dt, std::mt19937& rng) {
  const std::string what = name(s, dt);
  const size_t nq = size_t(s.b * s.sq * s.h * s.d), nk = size_t(s.b * s.sk * s.hk * s.d);
  const Buf q = random_buf(dt, nq, rng, 1.f), k = random_buf(dt, nk, rng, 1.f), v = random_buf(dt, nk, rng, 1.f);
  const Buf dout = random_buf(dt, nq, rng, 1.f);
  const float scale = 1.f / std::sqrt(float(s.d));
  const Result got = run(s, dt, q, k, v, dout, scale, false);
  // the reference sees the rounded inputs; its output is compared with the kernel's rounding tolerance, and the
  // backward (which reads the stored output) with twice it
  const Reference ref = reference(s, as_doubles(q), as_doubles(k), as_doubles(v), as_doubles(dout), scale);
  compare(what + " out", got.out, ref.out, tol(dt));
  compare(what + " dq", got.dq, ref.dq, 2 * tol(dt));
  compare(what + " dk", got.dk, ref.dk, 2 * tol(dt));
  compare(what + " dv", got.dv, ref.dv, 2 * tol(dt));
  double lse_err = 0;
  bool lse_ok = true;
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    if (std::isinf(ref.lse[i])) {
      lse_ok = lse_ok && std::isinf(got.lse[i]) && got.lse[i] < 0;
    } else {
      lse_err = std::max(lse_err, std::fabs(got.lse[i] - ref.lse[i]));
    }
  }
  expect(lse_ok && lse_err <= 1e-4 * std::max(1.0, std::sqrt(double(s.sk))),
         what + " lse: max error " + std::to_string(lse_err) + (lse_ok ? "" : " (a query with no key is not -inf)"));
  if (dt == DType::BF16 && cpu::has_bf16_dot()) {  // bf16 products (P and dS rounded to bf16), forward and backward
    const Result dot = run(s, dt, q, k, v, dout, scale, false, true);
    compare(what + " out (bf16 products)", dot.out, ref.out, 2 * tol(dt));
    compare(what + " dq (bf16 products)", dot.dq, ref.dq, 4 * tol(dt));
    compare(what + " dk (bf16 products)", dot.dk, ref.dk, 4 * tol(dt));
    compare(what + " dv (bf16 products)", dot.dv, ref.dv, 4 * tol(dt));
    const Result dot_tm = run(s, dt, q, k, v, dout, scale, false, true, true);
    expect(same_bits(dot.out, dot_tm.out) && same_bits(dot.dq, dot_tm.dq) && same_bits(dot.dk, dot_tm.dk) &&
               same_bits(dot.dv, dot_tm.dv) && dot.lse == dot_tm.lse,
           what + ": token-major layouts change the bf16-product results");
    const Result dot_again = run(s, dt, q, k, v, dout, scale, true, true);
    expect(same_bits(dot.out, dot_again.out) && same_bits(dot.dq, dot_again.dq) && same_bits(dot.dk, dot_again.dk) &&
               same_bits(dot.dv, dot_again.dv) && dot.lse == dot_again.lse,
           what + ": the bf16-product passes depend on how the work items are split");
  } else if (dt == DType::BF16) {
    std::printf("note: this CPU has no AVX512-BF16; the bf16-product passes are not run\n");
  }
  const Result tm = run(s, dt, q, k, v, dout, scale, false, false, true);  // token-major memory: the same bits
  expect(same_bits(got.out, tm.out) && same_bits(got.dq, tm.dq) && same_bits(got.dk, tm.dk) &&
             same_bits(got.dv, tm.dv) && got.lse == tm.lse,
         what + ": token-major layouts change the results");
  const Result again = run(s, dt, q, k, v, dout, scale, true);
  expect(same_bits(got.out, again.out) && same_bits(got.dq, again.dq) && same_bits(got.dk, again.dk) &&
             same_bits(got.dv, again.dv) && got.lse == again.lse,
         what + ": the results depend on how the work items are split");
}

}  // namespace

int main() {
  std::mt19937 rng(20261202);
  const Shape shapes[] = {
      {2, 70, 70, 4, 2, 40, true},                // GQA 2:1, blocks with a ragged edge, head size padded to 48
      {1, 33, 100, 2, 2, 64, false},              // more keys than queries, no mask
      {1, 100, 30, 3, 1, 24, true},               // MQA; the first 70 queries see no key (bottom-right causal)
      {1, 130, 200, 2, 1, 128, true},             // several query and key blocks, sq < sk
      {1, 17, 17, 1, 1, 256, true},               // the largest head size
      {1, 200, 200, 2, 1, 32, true, 40},          // a causal window narrower than a block
      {1, 90, 260, 2, 2, 48, false, 70},          // a symmetric window, sq < sk
      {1, 150, 200, 2, 1, 32, true, 50, 37},      // a window on a shifted diagonal (context parallelism)
      {2, 230, 230, 4, 2, 40, false, 0, 0, 70},   // documents of 70 tokens
      {1, 257, 257, 2, 1, 24, true, 33, 0, 100},  // causal documents under a window
  };
  for (const Shape& s : shapes) {
    check(s, DType::F32, rng);
    check(s, DType::BF16, rng);
  }
  return report();
}
