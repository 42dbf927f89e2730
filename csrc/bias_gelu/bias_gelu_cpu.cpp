// CPU kernels of the bias-GeLU family. Torch-free. Each row is converted once into an fp32 (fp64) scratch row;
// the bias add, GeLU (or its derivative) and the store are one unit-stride loop that -O3 vectorises. The dbias
// partial sums go over fixed row chunks, so the result does not depend on the thread count.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "../common/cpu_rows.h"
#include "bias_gelu.h"

#if defined(MK_TARGET_AVX512)
#include <immintrin.h>
#endif

namespace megakernels {
namespace MK_CPU_NS {  // cpu, or the ISA clone's (csrc/common/cpu_isa.h)
namespace {

using bias_gelu::Args;

#if defined(MK_TARGET_AVX512)
// The tanh GeLU in fp32 on 16 lanes: mk_exp's range reduction and polynomial (math.h), and 1 / (1 + e) as rcp14
// plus one Newton step (relative error ~2^-28, below fp32 rounding) in place of a division, whose throughput
// bounds the compiler's vectorised loop (~22 cycles a vector, about half of them the division). s = sigmoid(2u) =
// (1 + tanh(u)) / 2.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpMin)), _mm512_set1_ps(kExpMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kExpLog2e), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(kExpLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(e, n);
}

inline __m512 sigmoid_2u16(__m512 z) {
  const __m512 z2 = _mm512_mul_ps(z, z);
  const __m512 u = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(float(kSqrt2OverPi)), z),
                                 _mm512_fmadd_ps(_mm512_set1_ps(float(kGeluCubic)), z2, _mm512_set1_ps(1.0f)));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_mul_ps(_mm512_set1_ps(-2.0f), u)));
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));  // r (2 - d r)
}

// o[j] = GeLU_tanh(v[j] + b[j]) for j < h - h % 16; returns where the scalar loop takes over.
inline int64_t gelu_tanh_fwd16(const float* v, const float* b, float* o, int64_t h) {
  int64_t j = 0;
  for (; j + 16 <= h; j += 16) {
    const __m512 z = _mm512_add_ps(_mm512_loadu_ps(v + j), _mm512_loadu_ps(b + j));
    _mm512_storeu_ps(o + j, _mm512_mul_ps(z, sigmoid_2u16(z)));
  }
  return j;
}

// o[j] = g[j] GeLU_tanh'(x[j] + b[j]), pb[j] += o[j], for j < h - h % 16; returns where the scalar loop takes over.
inline int64_t gelu_tanh_bwd16(const float* x, const float* g, const float* b, float* pb, float* o, int64_t h) {
  int64_t j = 0;
  for (; j + 16 <= h; j += 16) {
    const __m512 z = _mm512_add_ps(_mm512_loadu_ps(x + j), _mm512_loadu_ps(b + j));
    const __m512 z2 = _mm512_mul_ps(z, z);
    const __m512 du = _mm512_mul_ps(_mm512_set1_ps(float(kSqrt2OverPi)),
                                    _mm512_fmadd_ps(_mm512_set1_ps(float(3 * kGeluCubic)), z2, _mm512_set1_ps(1.0f)));
    const __m512 s = sigmoid_2u16(z);
    // s + 2 z s (1 - s) du
    const __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_add_ps(z, z), s), _mm512_sub_ps(_mm512_set1_ps(1.0f), s));
    const __m512 d = _mm512_mul_ps(_mm512_loadu_ps(g + j), _mm512_fmadd_ps(t, du, s));
    _mm512_storeu_ps(pb + j, _mm512_add_ps(_mm512_loadu_ps(pb + j), d));
    _mm512_storeu_ps(o + j, d);
  }
  return j;
}
#endif

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
    int64_t j0 = 0;
#if defined(MK_TARGET_AVX512)
    if constexpr (std::is_same_v<A, float> && ACT == Activation::GeluTanh) j0 = gelu_tanh_fwd16(v, bp, o, H);
#endif
#pragma omp simd
    for (int64_t j = j0; j < H; ++j) o[j] = gelu_fwd<A>(v[j] + bp[j], ACT);
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
    int64_t j0 = 0;
#if defined(MK_TARGET_AVX512)
    if constexpr (std::is_same_v<A, float> && ACT == Activation::GeluTanh) j0 = gelu_tanh_bwd16(xv, gv, bp, pb, o, H);
#endif
#pragma omp simd
    for (int64_t j = j0; j < H; ++j) {
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

}  // namespace MK_CPU_NS
}  // namespace megakernels
