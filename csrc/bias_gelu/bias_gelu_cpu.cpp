// CPU kernels of the bias-GeLU family. Torch-free. Each row is converted once into an fp32 (fp64) scratch row;
// the bias add, GeLU (or its derivative) and the store are one unit-stride loop that -O3 vectorises. The dbias
// partial sums go over fixed row chunks, so the result does not depend on the thread count.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "../common/cpu_rows.h"
#include "bias_gelu.h"

namespace megakernels {
namespace cpu {
namespace {

using bias_gelu::Args;

template <typename T, typename W, typename A, Activation ACT>
void fwd_rows(const Args& a, int64_t r0, int64_t r1) {
  const int64_t H = a.hidden;
  const std::vector<A> b = load_param<W, A>(a.bias, H, A(0));
  const size_t conv = std::is_same_v<T, A> ? 0 : static_cast<size_t>(H);
  std::vector<A> in_buf(conv), out_buf(conv);
  const A* bp = b.data();
  for (int64_t r = r0; r < r1; ++r) {
    const A* v = row_view(static_cast<const T*>(a.x) + r * H, in_buf.data(), H);
    T* y = static_cast<T*>(a.y) + r * H;
    A* o = out_view(y, out_buf.data());
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) o[j] = gelu_fwd<A>(v[j] + bp[j], ACT);
    finish_out(o, y, H);
  }
}

template <typename T, typename W, typename A, Activation ACT>
void bwd_chunk(const Args& a, int64_t c) {
  const int64_t H = a.hidden;
  const int64_t rpc = chunk_rows(a.rows, H);
  const int64_t r0 = c * rpc, r1 = std::min(a.rows, r0 + rpc);
  A* pb = static_cast<A*>(a.workspace) + c * H;
  std::fill(pb, pb + H, A(0));
  const std::vector<A> b = load_param<W, A>(a.bias, H, A(0));
  const size_t conv = std::is_same_v<T, A> ? 0 : static_cast<size_t>(H);
  std::vector<A> xbuf(conv), dybuf(conv), obuf(conv);
  const A* bp = b.data();
  for (int64_t r = r0; r < r1; ++r) {
    const A* xv = row_view(static_cast<const T*>(a.x) + r * H, xbuf.data(), H);
    const A* gv = row_view(static_cast<const T*>(a.dy) + r * H, dybuf.data(), H);
    T* dx = static_cast<T*>(a.y) + r * H;
    A* o = out_view(dx, obuf.data());
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) {
      const A g = gv[j] * gelu_grad<A>(xv[j] + bp[j], ACT);
      pb[j] += g;
      o[j] = g;
    }
    finish_out(o, dx, H);
  }
}

template <typename T, typename W, typename A, Activation ACT>
struct FwdOp {
  static void run(const Args& a, int64_t r0, int64_t r1) { fwd_rows<T, W, A, ACT>(a, r0, r1); }
};
template <typename T, typename W, typename A, Activation ACT>
struct BwdOp {
  static void run(const Args& a, int64_t c) { bwd_chunk<T, W, A, ACT>(a, c); }
};
template <typename T, typename W, typename A, Activation ACT>
struct FinishOp {
  static void run(const Args& a, int64_t c0, int64_t c1) {
    finish_cols<W, A>(a.workspace, row_chunks(a.rows, a.hidden), a.hidden, 0, a.dbias, c0, c1);
  }
};

}  // namespace

int64_t bias_gelu_bwd_chunks(int64_t rows, int64_t hidden) { return row_chunks(rows, hidden); }
int64_t bias_gelu_bwd_workspace_bytes(int64_t rows, int64_t hidden, DType x_dtype) {
  return row_chunks(rows, hidden) * hidden * (x_dtype == DType::F64 ? 8 : 4);
}
void bias_gelu_fwd_rows(const Args& a, int64_t r0, int64_t r1) {
  dispatch<FwdOp>(a.x_dtype, a.w_dtype, a.act, a, r0, r1);
}
void bias_gelu_bwd_chunk(const Args& a, int64_t c) { dispatch<BwdOp>(a.x_dtype, a.w_dtype, a.act, a, c); }
void bias_gelu_bwd_finish_cols(const Args& a, int64_t c0, int64_t c1) {
  dispatch<FinishOp>(a.x_dtype, a.w_dtype, Activation::None, a, c0, c1);
}

}  // namespace cpu
}  // namespace megakernels
