// CPU kernels of the norm family: LayerNorm (+ GeLU epilogue), RMSNorm. Torch-free.
//
// Layout of the work: one row is converted once into an fp32 (fp64 for double) scratch row that stays in L1/L2,
// then every pass over it (mean, variance, normalise + epilogue) is a unit-stride loop that -O3 vectorises
// (`omp simd` needs only -fopenmp-simd: no OpenMP runtime, threads come from torch's pool in the caller).
// The variance is two-pass over the cached row: exact for rows with a large mean, and free since the row is
// already in cache. Backward recomputes xhat from the saved mean/rstd (nothing else is saved), and reduces the
// weight/bias grads over fixed row chunks so the result does not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "../common/cpu_rows.h"
#include "norms.h"

namespace megakernels {
namespace MK_CPU_NS {  // cpu, or the ISA clone's (csrc/common/cpu_isa.h)
namespace {

using norms::BwdArgs;
using norms::FwdArgs;

template <typename A>
inline A row_sum(const A* v, int64_t n) {
  return lane_sum<A>(n, [v](int64_t j) { return v[j]; });
}

// Per row: mean, variance (two passes over the cached row), then normalise + affine + activation + store in one
// loop. The activation is a template argument so that loop has no branch on it and vectorises.
template <typename T, typename W, typename A, Activation ACT>
void fwd_rows(const FwdArgs& a, int64_t r0, int64_t r1) {
  const int64_t H = a.hidden;
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  A* mean_out = static_cast<A*>(a.mean);
  A* rstd_out = static_cast<A*>(a.rstd);
  const std::vector<A> w = load_param<W, A>(a.w, H, A(1));
  const std::vector<A> b = load_param<W, A>(a.b, H, A(0));
  std::vector<A> in_buf(std::is_same_v<T, A> ? 0 : static_cast<size_t>(H));
  std::vector<A> out_buf(std::is_same_v<T, A> ? 0 : static_cast<size_t>(H));
  const A* wp = w.data();
  const A* bp = b.data();
  for (int64_t r = r0; r < r1; ++r) {
    const A* v = row_view(x + r * H, in_buf.data(), H);
    const A mean = a.rms ? A(0) : row_sum(v, H) / A(H);
    const A ss = lane_sum<A>(H, [v, mean](int64_t j) { return (v[j] - mean) * (v[j] - mean); });
    const A rstd = A(1) / std::sqrt(ss / A(H) + A(a.eps));
    if (!a.rms) mean_out[r] = mean;
    rstd_out[r] = rstd;
    A* o = out_view(y + r * H, out_buf.data());
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) o[j] = gelu_fwd<A>((v[j] - mean) * rstd * wp[j] + bp[j], ACT);
    finish_out(o, y + r * H, H);
  }
}

// Per row, two passes: (1) xhat, dz = dy * act'(xhat*w + b), the weight/bias partial sums and the two row sums;
// (2) dx = rstd * (dz*w - mean(dz*w) - xhat * mean(dz*w*xhat)) (RMSNorm has no mean term).
template <typename T, typename W, typename A, Activation ACT>
void bwd_chunk(const BwdArgs& a, int64_t c) {
  const int64_t H = a.hidden;
  const int64_t rpc = chunk_rows(a.rows, H);
  const int64_t r0 = c * rpc, r1 = std::min(a.rows, r0 + rpc);
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  const A* mean_in = static_cast<const A*>(a.mean);
  const A* rstd_in = static_cast<const A*>(a.rstd);
  A* pw = static_cast<A*>(a.workspace) + c * 2 * H;  // this chunk's partial sum of dz * xhat
  A* pb = pw + H;                                    // and of dz
  std::fill(pw, pw + 2 * H, A(0));
  const std::vector<A> w = load_param<W, A>(a.w, H, A(1));
  const std::vector<A> b = load_param<W, A>(a.b, H, A(0));
  const size_t conv = std::is_same_v<T, A> ? 0 : static_cast<size_t>(H);
  std::vector<A> xbuf(conv), dybuf(conv), xhbuf(static_cast<size_t>(H)), gwbuf(static_cast<size_t>(H)), obuf(conv);
  A *xh = xhbuf.data(), *gw = gwbuf.data();
  const A *wp = w.data(), *bp = b.data();
  const A invH = A(1) / A(H);
  for (int64_t r = r0; r < r1; ++r) {
    const A mean = a.rms ? A(0) : mean_in[r];
    const A rstd = rstd_in[r];
    const A* xv = row_view(x + r * H, xbuf.data(), H);
    const A* gv = row_view(dy + r * H, dybuf.data(), H);
    A s1 = 0, s2 = 0;
#pragma omp simd reduction(+ : s1, s2)
    for (int64_t j = 0; j < H; ++j) {
      const A xhat = (xv[j] - mean) * rstd;
      const A dz = gv[j] * gelu_grad<A>(xhat * wp[j] + bp[j], ACT);
      pw[j] += dz * xhat;
      pb[j] += dz;
      const A g = dz * wp[j];
      xh[j] = xhat;
      gw[j] = g;  // the same rounded dz*w enters the sums and dx: a constant row gives dx == 0 exactly
      s1 += g;
      s2 += g * xhat;
    }
    const A c1 = a.rms ? A(0) : s1 * invH;
    const A c2 = s2 * invH;
    A* o = out_view(dx + r * H, obuf.data());
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) o[j] = rstd * (gw[j] - c1 - xh[j] * c2);
    finish_out(o, dx + r * H, H);
  }
}

template <typename T, typename W, typename A, Activation ACT>
struct FwdOp {
  static void run(const FwdArgs& a, int64_t r0, int64_t r1) { fwd_rows<T, W, A, ACT>(a, r0, r1); }
};
template <typename T, typename W, typename A, Activation ACT>
struct BwdOp {
  static void run(const BwdArgs& a, int64_t c) { bwd_chunk<T, W, A, ACT>(a, c); }
};
template <typename T, typename W, typename A, Activation ACT>
struct BwdFinishOp {
  static void run(const BwdArgs& a, int64_t c0, int64_t c1) {
    const int64_t chunks = norm_bwd_chunks(a.rows, a.hidden);
    finish_cols<W, A>(a.workspace, chunks, 2 * a.hidden, 0, a.dw, c0, c1);
    finish_cols<W, A>(a.workspace, chunks, 2 * a.hidden, a.hidden, a.db, c0, c1);
  }
};
}  // namespace

int64_t norm_bwd_chunks(int64_t rows, int64_t hidden) { return row_chunks(rows, hidden); }
int64_t norm_bwd_workspace_bytes(int64_t rows, int64_t hidden, DType x_dtype) {
  const int64_t acc = x_dtype == DType::F64 ? 8 : 4;
  return norm_bwd_chunks(rows, hidden) * 2 * hidden * acc;
}
void norm_fwd_rows(const FwdArgs& a, int64_t r0, int64_t r1) {
  dispatch<FwdOp>(a.x_dtype, a.w_dtype, a.act, a, r0, r1);
}
void norm_bwd_chunk(const BwdArgs& a, int64_t c) { dispatch<BwdOp>(a.x_dtype, a.w_dtype, a.act, a, c); }
void norm_bwd_finish_cols(const BwdArgs& a, int64_t c0, int64_t c1) {
  dispatch<BwdFinishOp>(a.x_dtype, a.w_dtype, Activation::None, a, c0, c1);
}
}  // namespace MK_CPU_NS
}  // namespace megakernels
