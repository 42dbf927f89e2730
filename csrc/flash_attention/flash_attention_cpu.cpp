// CPU kernels of FlashAttention (flash_attention.h). Torch-free.
//
// Every product is an fp32 GEMM on small, zero-padded panels: C[M, N] (+)= A[M, K] B[K, N] with M even and N a
// multiple of 16, computed by register tiles that stream B's rows and broadcast A's entries (GCC vector
// extensions): with AVX-512's 32 registers, 6 rows x 64 columns (24 accumulators of 16 floats); with 16 (AVX2,
// and any build without AVX-512), 6 rows x 16 columns (12 accumulators of 8 floats): the 64-column tile would
// need 48 of them there, and its accumulators would live on the stack. The softmax passes are `omp simd` loops
// with mk_exp. The bf16 forward on AVX512-BF16 takes dot_gemm instead: the same tiling over vdpbf16ps (two bf16
// products a fp32 lane), compiled for that ISA and chosen at run time. Work items are split over threads by the
// caller (at::parallel_for in csrc/bindings/flash_attention.cpp); each item owns its outputs, so the results do not
// depend on the thread count.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common/cpu_types.h"
#include "flash_attention.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace megakernels {
namespace MK_CPU_NS {  // cpu, or the ISA clone's (csrc/common/cpu_isa.h)
namespace {

using flash_attention::Args;
using flash_attention::at;
using flash_attention::kBlockM;
using flash_attention::kBlockN;

// The GEMM tile's vector: one register of the widest vector unit the build targets (16 floats with AVX-512, else
// 8), and the most vectors a tile row holds (kTileVectors: 24 or 12 accumulators and a row of B in registers).
#if defined(MK_TARGET_AVX512)
constexpr int kTileLanes = 16;
constexpr int kTileVectors = 4;
#else
constexpr int kTileLanes = 8;
constexpr int kTileVectors = 2;
#endif
typedef float vf __attribute__((vector_size(4 * kTileLanes)));
typedef float vfu __attribute__((vector_size(4 * kTileLanes), aligned(4), may_alias));
// 16 floats whatever the ISA: the rows of the 16 x 16 block transpose (loaded and stored in place: no function
// passes one by value, whose ABI differs between AVX-512 builds and others).
typedef float vf16 __attribute__((vector_size(64)));
typedef float vf16u __attribute__((vector_size(64), aligned(4), may_alias));

inline vf vload(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void vstore(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (a score minus its row's max or lse); exactly 0 below mk_exp's clamp and for -inf.
inline float fa_exp(float x) { return x < -87.0f ? 0.0f : mk_exp(x); }

// C[R, kTileLanes NV] (+)= A[R, K] B[K, kTileLanes NV].
template <int R, int NV, bool ACC>
inline void tile(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t kdim) {
  vf acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = ACC ? vload(c + r * ldc + kTileLanes * v) : vf{};
  for (int64_t k = 0; k < kdim; ++k) {
    vf bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = vload(b + k * ldb + kTileLanes * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float x = a[r * lda + k];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += x * bv[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vstore(c + r * ldc + kTileLanes * v, acc[r][v]);
}

template <int R, bool ACC>
inline void tile_row(int64_t nv, const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                     int64_t kdim) {
  if constexpr (kTileVectors >= 4) {
    if (nv == 4) return tile<R, 4, ACC>(a, lda, b, ldb, c, ldc, kdim);
    if (nv == 3) return tile<R, 3, ACC>(a, lda, b, ldb, c, ldc, kdim);
  }
  if (nv >= 2) return tile<R, 2, ACC>(a, lda, b, ldb, c, ldc, kdim);
  return tile<R, 1, ACC>(a, lda, b, ldb, c, ldc, kdim);
}

// C[M, N] (+)= A[M, K] B[K, N]; M % 2 == 0, N % 16 == 0. Tiles of 6 rows x kTileVectors vectors (AVX-512: 24
// accumulators and 4 vectors of B, 28 of 32 registers; 6 rows ran ~18% faster than 4. Else 12 + 2 of 16), the
// last ones narrower or shorter.
template <bool ACC>
void gemm(int64_t m, int64_t n, int64_t kdim, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
          int64_t ldc) {
  constexpr int64_t kRows = 6, kCols = int64_t(kTileLanes) * kTileVectors;
  for (int64_t j = 0; j < n; j += kCols) {
    const int64_t nv = std::min<int64_t>(kTileVectors, (n - j) / kTileLanes);
    int64_t i = 0;
    for (; i + kRows <= m; i += kRows)
      tile_row<kRows, ACC>(nv, a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, kdim);
    for (; i + 4 <= m; i += 4) tile_row<4, ACC>(nv, a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, kdim);
    for (; i < m; i += 2) tile_row<2, ACC>(nv, a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, kdim);
  }
}

#if defined(__x86_64__)
// bf16 products on AVX512-BF16: vdpbf16ps adds, per fp32 lane, the products of two bf16 pairs. Compiled for that
// ISA whatever the build's -march, and called only where has_bf16_dot() says the CPU runs it.
#define MK_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512bf16")))

// C[R, 16 NV] (+)= A[R, 2 KP] B[2 KP, 16 NV]: A's rows bf16 (a k pair is 4 contiguous bytes), B pair-interleaved
// ([KP][ldb][2] bf16, ldb columns).
template <int R, int NV, bool ACC>
MK_BF16_DOT inline void dot_tile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float* c, int64_t ldc,
                                 int64_t kp) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = ACC ? _mm512_loadu_ps(c + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + (p * ldb + 16 * v) * 2);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * p, 4);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);
}

template <int R, bool ACC>
MK_BF16_DOT inline void dot_tile_row(int64_t nv, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                                     float* c, int64_t ldc, int64_t kp) {
  switch (nv) {
    case 4: return dot_tile<R, 4, ACC>(a, lda, b, ldb, c, ldc, kp);
    case 3: return dot_tile<R, 3, ACC>(a, lda, b, ldb, c, ldc, kp);
    case 2: return dot_tile<R, 2, ACC>(a, lda, b, ldb, c, ldc, kp);
    default: return dot_tile<R, 1, ACC>(a, lda, b, ldb, c, ldc, kp);
  }
}

// dst[0, n) = bf16(src[0, n)) rounded to nearest even (vcvtne2ps2bf16); n % 32 == 0.
MK_BF16_DOT inline void to_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
    _mm512_storeu_si512(dst + i, (__m512i)v);
  }
}

// C[M, N] (+)= A[M, 2 KP] B[2 KP, N] in bf16 with fp32 sums; M % 2 == 0, N % 16 == 0 (gemm's tiling).
template <bool ACC>
MK_BF16_DOT void dot_gemm(int64_t m, int64_t n, int64_t kp, const uint16_t* a, int64_t lda, const uint16_t* b,
                          int64_t ldb, float* c, int64_t ldc) {
  constexpr int64_t kRows = 6;
  for (int64_t j = 0; j < n; j += 64) {
    const int64_t nv = std::min<int64_t>(4, (n - j) / 16);
    int64_t i = 0;
    for (; i + kRows <= m; i += kRows)
      dot_tile_row<kRows, ACC>(nv, a + i * lda, lda, b + 2 * j, ldb, c + i * ldc + j, ldc, kp);
    for (; i + 4 <= m; i += 4) dot_tile_row<4, ACC>(nv, a + i * lda, lda, b + 2 * j, ldb, c + i * ldc + j, ldc, kp);
    for (; i < m; i += 2) dot_tile_row<2, ACC>(nv, a + i * lda, lda, b + 2 * j, ldb, c + i * ldc + j, ldc, kp);
  }
}
#endif

// 64-byte aligned fp32 scratch of one work range.
struct Scratch {
  explicit Scratch(int64_t n)
      : p(static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>((n + 15) / 16 * 16) * sizeof(float)))) {}
  ~Scratch() { std::free(p); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  float* p;
};

// dst[0, dp) = factor * src[0, d), zero padded.
template <typename T>
inline void load_padded(const T* src, float* dst, int64_t d, int64_t dp, float factor) {
  load_row(src, dst, d);
  if (factor != 1.0f) {
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) dst[c] *= factor;
  }
  for (int64_t c = d; c < dp; ++c) dst[c] = 0.0f;
}

typedef int32_t vi __attribute__((vector_size(64)));

// Two-source lane selections of the 16 x 16 transpose's step s (8, 4, 2, 1): within every 2s x 2s block the
// top-right s x s block trades places with the bottom-left one. Row i (i & s == 0) keeps its lanes l & s == 0 and
// takes row i + s's lanes l - s for the others; row i + s takes row i's lanes l + s and keeps the rest.
constexpr int lower_lane(int s, int l) { return (l & s) ? 16 + l - s : l; }
constexpr int upper_lane(int s, int l) { return (l & s) ? 16 + l : l + s; }
template <int S, int... L>
constexpr vi lower_mask(std::integer_sequence<int, L...>) {
  return vi{lower_lane(S, L)...};
}
template <int S, int... L>
constexpr vi upper_mask(std::integer_sequence<int, L...>) {
  return vi{upper_lane(S, L)...};
}
template <int S>
inline void transpose_step(vf16* r) {
  constexpr vi lo = lower_mask<S>(std::make_integer_sequence<int, 16>{});
  constexpr vi hi = upper_mask<S>(std::make_integer_sequence<int, 16>{});
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i)
    if (!(i & S)) {
      const vf16 a = r[i], b = r[i + S];
      r[i] = __builtin_shuffle(a, b, lo);
      r[i + S] = __builtin_shuffle(a, b, hi);
    }
}

// [n, n] block transpose: dst[j * n + i] = src[i * n + j] (n = kBlockM = kBlockN), 16 x 16 tiles in registers.
inline void transpose_block(const float* src, float* dst) {
  static_assert(kBlockM == kBlockN && kBlockM % 16 == 0, "square score blocks of 16 x 16 tiles");
  for (int64_t i0 = 0; i0 < kBlockM; i0 += 16)
    for (int64_t j0 = 0; j0 < kBlockN; j0 += 16) {
      vf16 r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) r[i] = *reinterpret_cast<const vf16u*>(src + (i0 + i) * kBlockN + j0);
      transpose_step<8>(r);
      transpose_step<4>(r);
      transpose_step<2>(r);
      transpose_step<1>(r);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) *reinterpret_cast<vf16u*>(dst + (j0 + j) * kBlockM + i0) = r[j];
    }
}

// Columns [lo, hi) of the key block at k0 that query row `row` of batch bi sees (lo == hi: none).
inline flash_attention::Span block_columns(const Args& a, int64_t bi, int64_t row, int64_t k0) {
  const flash_attention::Span v = flash_attention::visible(a, bi, row);
  const int64_t lo = std::clamp<int64_t>(v.lo - k0, 0, kBlockN), hi = std::clamp<int64_t>(v.hi - k0, 0, kBlockN);
  return {lo, std::max(lo, hi)};
}

// Offset of (batch bi, kv head kh) in the packed buffers; key block kb's panel starts kb * kBlockN * dp later.
inline int64_t bk_offset(const Args& a, int64_t bi, int64_t kh) { return (bi * a.hk + kh) * a.nkb * kBlockN * a.dp; }

// A row of bf16 bits zero padded to dp: the source itself when d == dp (no copy), else a copy into `scratch`; the
// zero row for a missing one (null).
inline const uint16_t* padded_bits(const uint16_t* src, uint16_t* scratch, const uint16_t* zeros, int64_t d,
                                   int64_t dp) {
  if (src == nullptr) return zeros;
  if (d == dp) return src;
  std::memcpy(scratch, src, size_t(d) * sizeof(uint16_t));
  std::fill(scratch + d, scratch + dp, uint16_t(0));
  return scratch;
}

// Rows x0, x1 (dp bf16 each) interleaved into one [dp, 2] panel row: out[c] = x0[c] | x1[c] << 16.
inline void interleave_pair(const uint16_t* x0, const uint16_t* x1, uint16_t* out, int64_t dp) {
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
#pragma omp simd
  for (int64_t c = 0; c < dp; ++c) o[c] = uint32_t(x0[c]) | (uint32_t(x1[c]) << 16);
}

// Key row x (dp bf16) as column j of a transposed panel [dp / 2, kBlockN, 2]: its 32-bit words (head-dim pairs) down
// the column.
inline void words_down_column(const uint16_t* x, uint16_t* panel, int64_t j, int64_t dp) {
  uint32_t* t = reinterpret_cast<uint32_t*>(panel) + j;
  for (int64_t w = 0; w < dp / 2; ++w) {
    uint32_t word;
    std::memcpy(&word, x + 2 * w, sizeof word);
    t[w * kBlockN] = word;
  }
}

// The bf16 panels (ktb, vtb, vpb, kpb) of one key block straight from its bf16 bits (no round trip through fp32),
// a pair of keys at a time: K^T and V^T take each key's 32-bit words down its column, K and V interleave the pair.
inline void pack_block_bits(const Args& a, int64_t bi, int64_t kh, int64_t kb, int64_t panel, uint16_t* scratch,
                            const uint16_t* zeros) {
  const int64_t d = a.d, dv = a.d_v, dp = a.dp;
  const uint16_t* kbase = static_cast<const uint16_t*>(a.k);
  const uint16_t* vbase = static_cast<const uint16_t*>(a.v);
  for (int64_t j = 0; j < kBlockN; j += 2) {
    const uint16_t* x[4];  // k(j), k(j + 1), v(j), v(j + 1), zero padded
    for (int64_t e = 0; e < 2; ++e) {
      const int64_t key = kb * kBlockN + j + e;
      const bool real = key < a.sk;
      x[e] = padded_bits(real ? kbase + at(a.lk, bi, key, kh) : nullptr, scratch + e * dp, zeros, d, dp);
      x[2 + e] = padded_bits(real ? vbase + at(a.lv, bi, key, kh) : nullptr, scratch + (2 + e) * dp, zeros, dv, dp);
    }
    const int64_t pair = panel + (j / 2) * dp * 2;
    if (a.kpb) interleave_pair(x[0], x[1], a.kpb + pair, dp);
    if (a.vpb) interleave_pair(x[2], x[3], a.vpb + pair, dp);
    for (int64_t e = 0; e < 2; ++e) {
      if (a.ktb) words_down_column(x[e], a.ktb + panel, j + e, dp);
      if (a.vtb) words_down_column(x[2 + e], a.vtb + panel, j + e, dp);
    }
  }
}

template <typename T>
void pack_items(const Args& a, int64_t i0, int64_t i1) {
  const int64_t d = a.d, dv = a.d_v, dp = a.dp;
  Scratch buf(2 * dp);
  float *kr = buf.p, *vr = buf.p + dp;
  const bool bits_only = std::is_same_v<T, bf16> && !a.kt && !a.vt && !a.kp && !a.vp;  // the bf16 products' panels
  std::vector<uint16_t> bits_buf(bits_only ? 5 * dp : 0, uint16_t(0));  // four padded rows and a zero row
  uint16_t *bits_scratch = bits_buf.data(), *bits_zeros = bits_buf.data() + 4 * dp;
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t kb = it % a.nkb, bk = it / a.nkb, kh = bk % a.hk, bi = bk / a.hk;
    const int64_t panel = (bk * a.nkb + kb) * dp * kBlockN;  // offset of this block in every packed buffer
    if (bits_only) {
      pack_block_bits(a, bi, kh, kb, panel, bits_scratch, bits_zeros);
      continue;
    }
    for (int64_t j = 0; j < kBlockN; ++j) {
      const int64_t key = kb * kBlockN + j;
      if (key < a.sk) {
        load_padded(static_cast<const T*>(a.k) + at(a.lk, bi, key, kh), kr, d, dp, 1.0f);
        load_padded(static_cast<const T*>(a.v) + at(a.lv, bi, key, kh), vr, dv, dp, 1.0f);
      } else {
        std::fill(kr, kr + 2 * dp, 0.0f);
      }
      if (a.kt)
        for (int64_t c = 0; c < dp; ++c) a.kt[panel + c * kBlockN + j] = kr[c];
      if (a.vt)
        for (int64_t c = 0; c < dp; ++c) a.vt[panel + c * kBlockN + j] = vr[c];
      if (a.kp) std::copy(kr, kr + dp, a.kp + panel + j * dp);
      if (a.vp) std::copy(vr, vr + dp, a.vp + panel + j * dp);
      // bf16 panels, k pairs interleaved (the values are bf16: the round trip through fp32 is exact)
      if (a.ktb)
        for (int64_t c = 0; c < dp; ++c)
          a.ktb[panel + (c / 2) * kBlockN * 2 + j * 2 + c % 2] = from_float<bf16>(kr[c]).bits;
      if (a.vtb)
        for (int64_t c = 0; c < dp; ++c)
          a.vtb[panel + (c / 2) * kBlockN * 2 + j * 2 + c % 2] = from_float<bf16>(vr[c]).bits;
      if (a.vpb)
        for (int64_t c = 0; c < dp; ++c) a.vpb[panel + (j / 2) * dp * 2 + c * 2 + j % 2] = from_float<bf16>(vr[c]).bits;
      if (a.kpb)
        for (int64_t c = 0; c < dp; ++c) a.kpb[panel + (j / 2) * dp * 2 + c * 2 + j % 2] = from_float<bf16>(kr[c]).bits;
    }
  }
}

// DOT: the bf16 forward on AVX512-BF16 (q, K and V as bf16 panels, P rounded to bf16 for P V; the sums in fp32),
// inlined into fwd_items_dot, which is compiled for that ISA.
template <typename T, bool DOT>
__attribute__((always_inline)) inline void fwd_body(const Args& a, int64_t i0, int64_t i1) {
  const int64_t d = a.d, dv = a.d_v, dp = a.dp, g = a.h / a.hk;
  Scratch buf(2 * kBlockM * dp + kBlockM * kBlockN + (DOT ? (kBlockM * dp + kBlockM * kBlockN + 1) / 2 : 0));
  float *qs = buf.p, *o = buf.p + kBlockM * dp, *s = buf.p + 2 * kBlockM * dp;
  uint16_t* q16 = reinterpret_cast<uint16_t*>(s + kBlockM * kBlockN);  // DOT: q [kBlockM, dp], P [kBlockM, kBlockN]
  uint16_t* pb = q16 + kBlockM * dp;
  float m[kBlockM], l[kBlockM];
  for (int64_t it = i0; it < i1; ++it) {
    // Query blocks in the order 0, n-1, 1, n-2, ...: a contiguous range of items holds cheap and expensive
    // causal blocks alike.
    const int64_t p = it % a.nqb, bh = it / a.nqb, hh = bh % a.h, bi = bh / a.h, kh = hh / g;
    const int64_t qb = p % 2 == 0 ? p / 2 : a.nqb - 1 - p / 2;
    const int64_t r0 = qb * kBlockM, rows = std::min(kBlockM, a.sq - r0);
    const T* q = static_cast<const T*>(a.q) + at(a.lq, bi, r0, hh);
    for (int64_t r = 0; r < kBlockM; ++r) {
      if constexpr (DOT) {  // q's own bits, zero padded; the scale is applied to S
        if (r < rows) std::memcpy(q16 + r * dp, q + r * a.lq.s, d * sizeof(uint16_t));
        std::fill(q16 + r * dp + (r < rows ? d : 0), q16 + (r + 1) * dp, uint16_t(0));
      } else if (r < rows) {
        load_padded(q + r * a.lq.s, qs + r * dp, d, dp, a.scale);
      } else {
        std::fill(qs + r * dp, qs + (r + 1) * dp, 0.0f);
      }
      m[r] = kNegInf;
      l[r] = 0.0f;
    }
    std::fill(o, o + kBlockM * dp, 0.0f);
    // Only the key blocks that meet the band of some row of the block are visited; in those inside every row's
    // band no row needs its columns cut.
    const flash_attention::Bounds kb = flash_attention::key_bounds(a, bi, r0, rows, kBlockN);
    const float* kt = DOT ? nullptr : a.kt + bk_offset(a, bi, kh);
    const float* vp = DOT ? nullptr : a.vp + bk_offset(a, bi, kh);
    for (int64_t k0 = kb.lo; k0 < kb.hi; k0 += kBlockN) {
      const bool every_row = k0 >= kb.full_lo && k0 + kBlockN <= kb.full_hi;
#if defined(__x86_64__)
      if constexpr (DOT)
        dot_gemm<false>(kBlockM, kBlockN, dp / 2, q16, dp, a.ktb + bk_offset(a, bi, kh) + k0 * dp, kBlockN, s, kBlockN);
      else
#endif
        gemm<false>(kBlockM, kBlockN, d, qs, dp, kt + k0 * dp, kBlockN, s, kBlockN);
      for (int64_t r = 0; r < kBlockM; ++r) {
        float* sr = s + r * kBlockN;
        if constexpr (DOT) {
          const float sc = a.scale;
#pragma omp simd
          for (int64_t j = 0; j < kBlockN; ++j) sr[j] *= sc;
        }
        const flash_attention::Span vis = r >= rows   ? flash_attention::Span{0, 0}
                                          : every_row ? flash_attention::Span{0, kBlockN}
                                                      : block_columns(a, bi, r0 + r, k0);
        for (int64_t j = 0; j < vis.lo; ++j) sr[j] = kNegInf;
        for (int64_t j = vis.hi; j < kBlockN; ++j) sr[j] = kNegInf;
        const float mx = lane_max<float>(kBlockN, kNegInf, [sr](int64_t j) { return sr[j]; });
        const float mn = std::max(m[r], mx);
        if (mn == kNegInf) {  // nothing seen yet: P = 0
          std::fill(sr, sr + kBlockN, 0.0f);
          continue;
        }
        const float alpha = fa_exp(m[r] - mn);
        const float sum = lane_sum<float>(kBlockN, [sr, mn](int64_t j) {  // P = exp(S - max), in place
          const float e = fa_exp(sr[j] - mn);
          sr[j] = e;
          return e;
        });
        if (a.threshold > 0) {  // the normaliser has every probability; O gets the kept ones, scaled
          const uint32_t rh = flash_attention::dropout_row_hash(a, (bi * a.h + hh) * a.sq + r0 + r);
          const float ks = a.keep_scale;
          const int32_t th = a.threshold;
#pragma omp simd
          for (int64_t j = 0; j < kBlockN; ++j) sr[j] = flash_attention::keep(rh, k0 + j, th) ? sr[j] * ks : 0.0f;
        }
        l[r] = l[r] * alpha + sum;
        m[r] = mn;
        if (alpha != 1.0f) {
          float* orow = o + r * dp;
#pragma omp simd
          for (int64_t c = 0; c < dp; ++c) orow[c] *= alpha;
        }
      }
#if defined(__x86_64__)
      if constexpr (DOT) {  // P in bf16 (as the GPU kernels' P V), the sum in fp32
        to_bf16(s, pb, kBlockM * kBlockN);
        dot_gemm<true>(kBlockM, dp, kBlockN / 2, pb, kBlockN, a.vpb + bk_offset(a, bi, kh) + k0 * dp, dp, o, dp);
      } else
#endif
        gemm<true>(kBlockM, dp, kBlockN, s, kBlockN, vp + k0 * dp, dp, o, dp);
    }
    T* out = static_cast<T*>(a.o) + at(a.lo, bi, r0, hh);
    float* lse = a.lse + (bi * a.h + hh) * a.sq + r0;
    for (int64_t r = 0; r < rows; ++r) {
      float* orow = o + r * dp;
      float mr = m[r], lr = l[r], alpha = 1.0f;
      if (a.sinks) {  // the sink column: logit sinks[hh], value zero (its rescale of O folds into 1 / l)
        const float sink = a.sinks[hh], mn = std::max(mr, sink);
        if (mn != kNegInf) {
          alpha = fa_exp(mr - mn);
          lr = lr * alpha + fa_exp(sink - mn);
          mr = mn;
        }
      }
      const float inv = lr > 0.0f ? alpha / lr : 0.0f;
#pragma omp simd
      for (int64_t c = 0; c < dv; ++c) orow[c] *= inv;
      store_row(orow, out + r * a.lo.s, dv);
      lse[r] = lr > 0.0f ? mr + std::log(lr) : kNegInf;
    }
  }
}

template <typename T>
void fwd_items(const Args& a, int64_t i0, int64_t i1) {
  fwd_body<T, false>(a, i0, i1);
}

#if defined(__x86_64__)
MK_BF16_DOT void fwd_items_dot(const Args& a, int64_t i0, int64_t i1) { fwd_body<bf16, true>(a, i0, i1); }
#endif

// Offset of row r of query block qb of (batch bi, head hh) in the backward's q / dO panels (Args::qs_pk ...).
inline int64_t q_panel(const Args& a, int64_t bi, int64_t hh, int64_t qb, int64_t r) {
  return (((bi * a.h + hh) * a.nqb + qb) * kBlockM + r) * a.dp;
}

// One query block of (batch bi, head hh) for the backward: delta = rowsum(dO * O) of its rows, and q and dO into
// their panels (q_panel; the padding rows zero): fp32 (q scaled), or bf16 rows and the block's query pairs
// interleaved, written from the source bits.
template <typename T>
void bwd_prep_blocks(const Args& a, int64_t i0, int64_t i1) {
  const int64_t d = a.d, dv = a.d_v, dp = a.dp;
  Scratch buf(2 * dv);
  float *x = buf.p, *y = buf.p + dv;
  const bool dot = a.q16_pk != nullptr;                           // the bf16 products' panels (bf16 only)
  std::vector<uint16_t> bits_buf(dot ? 5 * dp : 0, uint16_t(0));  // four padded rows and a zero row
  uint16_t *scratch = bits_buf.data(), *zeros = bits_buf.data() + 4 * dp;
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t qb = it % a.nqb, bh = it / a.nqb, hh = bh % a.h, bi = bh / a.h;
    const int64_t r0 = qb * kBlockM, rows = std::min(kBlockM, a.sq - r0), off = q_panel(a, bi, hh, qb, 0);
    const T* q = static_cast<const T*>(a.q) + at(a.lq, bi, r0, hh);
    const T* dout = static_cast<const T*>(a.dout) + at(a.ldout, bi, r0, hh);
    const T* out = static_cast<const T*>(a.out) + at(a.lout, bi, r0, hh);
    float dsink = 0.0f;  // with sinks: this block's share of dsinks[hh], -sum P_sink * delta
    for (int64_t r = 0; r < rows; ++r) {
      const float* o = row_view(out + r * a.lout.s, x, dv);
      const float* g = row_view(dout + r * a.ldout.s, y, dv);
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t c = 0; c < dv; ++c) acc += o[c] * g[c];
      const int64_t row = (bi * a.h + hh) * a.sq + r0 + r;
      a.delta[row] = acc;
      if (a.sinks && a.lse[row] != kNegInf) dsink -= fa_exp(a.sinks[hh] - a.lse[row]) * acc;
    }
    if (a.sinks) a.dsinks_part[(bi * a.h + hh) * a.nqb + qb] = dsink;
    if (!dot) {
      for (int64_t r = 0; r < kBlockM; ++r) {
        float *qs = a.qs_pk + off + r * dp, *dos = a.dos_pk + off + r * dp;
        if (r < rows) {
          load_padded(q + r * a.lq.s, qs, d, dp, a.scale);
          load_padded(dout + r * a.ldout.s, dos, dv, dp, 1.0f);
        } else {
          std::fill(qs, qs + dp, 0.0f);
          std::fill(dos, dos + dp, 0.0f);
        }
      }
      continue;
    }
    const uint16_t* qbits = reinterpret_cast<const uint16_t*>(q);
    const uint16_t* dbits = reinterpret_cast<const uint16_t*>(dout);
    for (int64_t r = 0; r < kBlockM; r += 2) {
      const uint16_t* rq[2];
      const uint16_t* rd[2];
      for (int64_t e = 0; e < 2; ++e) {
        const bool real = r + e < rows;
        rq[e] = padded_bits(real ? qbits + (r + e) * a.lq.s : nullptr, scratch + e * dp, zeros, d, dp);
        rd[e] = padded_bits(real ? dbits + (r + e) * a.ldout.s : nullptr, scratch + (2 + e) * dp, zeros, dv, dp);
        std::memcpy(a.q16_pk + off + (r + e) * dp, rq[e], size_t(dp) * sizeof(uint16_t));
        std::memcpy(a.do16_pk + off + (r + e) * dp, rd[e], size_t(dp) * sizeof(uint16_t));
      }
      interleave_pair(rq[0], rq[1], a.qpb_pk + off + (r / 2) * dp * 2, dp);
      interleave_pair(rd[0], rd[1], a.dopb_pk + off + (r / 2) * dp * 2, dp);
    }
  }
}

// DOT: the bf16 backward on AVX512-BF16: the five products multiply bf16 (q, dO, K, V as they are; P^T, dS^T and
// dS rounded to bf16) and sum in fp32; q unscaled, so S and dK take the scale after their products.
template <typename T, bool DOT>
__attribute__((always_inline)) inline void bwd_body(const Args& a, int64_t i0, int64_t i1) {
  const int64_t d = a.d, dv = a.d_v, dp = a.dp, g = a.h / a.hk, sq_pad = a.nqb * kBlockM;
  const int64_t tile = kBlockM * kBlockN;
  // DOT: P^T, dS^T, dS in bf16
  const int64_t dot16 = DOT ? 3 * tile : 0;
  Scratch buf(2 * kBlockN * dp + 5 * tile + (dot16 + 1) / 2);
  float *dka = buf.p, *dva = dka + kBlockN * dp;
  float *p = dva + kBlockN * dp, *dp_ = p + tile, *ds = dp_ + tile, *pt = ds + tile, *dst = pt + tile;
  uint16_t *pt16 = reinterpret_cast<uint16_t*>(dst + tile), *dst16 = pt16 + tile, *ds16 = dst16 + tile;
  float lse[kBlockM], delta[kBlockM];
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t chunk = it % a.chunks, bk = it / a.chunks, kh = bk % a.hk, bi = bk / a.hk;
    const int64_t base = bk_offset(a, bi, kh);
    for (int64_t kb = chunk; kb < a.nkb; kb += a.chunks) {
      const int64_t k0 = kb * kBlockN, keys = std::min(kBlockN, a.sk - k0);
      std::fill(dka, dka + 2 * kBlockN * dp, 0.0f);
      const float* kt = DOT ? nullptr : a.kt + base + k0 * dp;
      const float* kp = DOT ? nullptr : a.kp + base + k0 * dp;
      const float* vt = DOT ? nullptr : a.vt + base + k0 * dp;
      for (int64_t gi = 0; gi < g; ++gi) {
        const int64_t hh = kh * g + gi;
        for (int64_t qb = 0; qb < a.nqb; ++qb) {
          const int64_t r0 = qb * kBlockM, rows = std::min(kBlockM, a.sq - r0);
          // skip the query block unless its rows' keys meet this key block
          const flash_attention::Bounds span = flash_attention::key_bounds(a, bi, r0, rows, 1);
          if (span.lo >= k0 + keys || span.hi <= k0) continue;
          // q and dO as the prep pass packed them (q_panel)
          const int64_t pk = q_panel(a, bi, hh, qb, 0);
          const float *qs = DOT ? nullptr : a.qs_pk + pk, *dos = DOT ? nullptr : a.dos_pk + pk;
          const uint16_t *q16 = DOT ? a.q16_pk + pk : nullptr, *do16 = DOT ? a.do16_pk + pk : nullptr;
          const uint16_t *qpb = DOT ? a.qpb_pk + pk : nullptr, *dopb = DOT ? a.dopb_pk + pk : nullptr;
          const float* lse_in = a.lse + (bi * a.h + hh) * a.sq + r0;
          const float* delta_in = a.delta + (bi * a.h + hh) * a.sq + r0;
          for (int64_t r = 0; r < kBlockM; ++r) {
            lse[r] = r < rows ? (lse_in[r] == kNegInf ? kPosInf : lse_in[r]) : kPosInf;  // no key seen: P = 0
            delta[r] = r < rows ? delta_in[r] : 0.0f;
          }
#if defined(__x86_64__)
          if constexpr (DOT) {
            dot_gemm<false>(kBlockM, kBlockN, dp / 2, q16, dp, a.ktb + base + k0 * dp, kBlockN, p, kBlockN);
            dot_gemm<false>(kBlockM, kBlockN, dp / 2, do16, dp, a.vtb + base + k0 * dp, kBlockN, dp_, kBlockN);
            const float sc = a.scale;
#pragma omp simd
            for (int64_t e = 0; e < tile; ++e) p[e] *= sc;
          } else
#endif
          {
            gemm<false>(kBlockM, kBlockN, d, qs, dp, kt, kBlockN, p, kBlockN);
            gemm<false>(kBlockM, kBlockN, dv, dos, dp, vt, kBlockN, dp_, kBlockN);
          }
          for (int64_t r = 0; r < kBlockM; ++r) {
            float *pr = p + r * kBlockN, *dpr = dp_ + r * kBlockN, *dsr = ds + r * kBlockN;
            const flash_attention::Span vis = r < rows ? block_columns(a, bi, r0 + r, k0) : flash_attention::Span{0, 0};
            const float lr = lse[r], dr = delta[r];
            if (a.threshold > 0) {  // dV takes the kept P, scaled; dP is dropped where P was
              const uint32_t rh = flash_attention::dropout_row_hash(a, (bi * a.h + hh) * a.sq + r0 + r);
              const float ks = a.keep_scale;
              const int32_t th = a.threshold;
#pragma omp simd
              for (int64_t j = 0; j < kBlockN; ++j) {
                const float e = j >= vis.lo && j < vis.hi ? fa_exp(pr[j] - lr) : 0.0f;
                const bool kept = flash_attention::keep(rh, k0 + j, th);
                pr[j] = kept ? e * ks : 0.0f;
                dsr[j] = e * ((kept ? dpr[j] * ks : 0.0f) - dr);
              }
              continue;
            }
#pragma omp simd
            for (int64_t j = 0; j < kBlockN; ++j) {
              const float e = j >= vis.lo && j < vis.hi ? fa_exp(pr[j] - lr) : 0.0f;
              pr[j] = e;
              dsr[j] = e * (dpr[j] - dr);
            }
          }
          transpose_block(p, pt);
          transpose_block(ds, dst);
          float* dqp = a.dq_part + (((chunk * a.b + bi) * a.h + hh) * sq_pad + r0) * dp;
#if defined(__x86_64__)
          if constexpr (DOT) {
            to_bf16(pt, pt16, tile);
            to_bf16(dst, dst16, tile);
            to_bf16(ds, ds16, tile);
            dot_gemm<true>(kBlockN, dp, kBlockM / 2, pt16, kBlockM, dopb, dp, dva, dp);
            dot_gemm<true>(kBlockN, dp, kBlockM / 2, dst16, kBlockM, qpb, dp, dka, dp);  // unscaled q: scaled below
            dot_gemm<true>(kBlockM, dp, kBlockN / 2, ds16, kBlockN, a.kpb + base + k0 * dp, dp, dqp, dp);
          } else
#endif
          {
            gemm<true>(kBlockN, dp, kBlockM, pt, kBlockM, dos, dp, dva, dp);
            gemm<true>(kBlockN, dp, kBlockM, dst, kBlockM, qs, dp, dka, dp);
            gemm<true>(kBlockM, dp, kBlockN, ds, kBlockN, kp, dp, dqp, dp);
          }
        }
      }
      if constexpr (DOT) {
        const float sc = a.scale;
#pragma omp simd
        for (int64_t e = 0; e < kBlockN * dp; ++e) dka[e] *= sc;
      }
      for (int64_t j = 0; j < keys; ++j) {
        store_row(dka + j * dp, static_cast<T*>(a.dk) + at(a.ldk, bi, k0 + j, kh), d);
        store_row(dva + j * dp, static_cast<T*>(a.dv) + at(a.ldv, bi, k0 + j, kh), dv);
      }
    }
  }
}

template <typename T>
void bwd_kv_items(const Args& a, int64_t i0, int64_t i1) {
  bwd_body<T, false>(a, i0, i1);
}

#if defined(__x86_64__)
MK_BF16_DOT void bwd_kv_items_dot(const Args& a, int64_t i0, int64_t i1) { bwd_body<bf16, true>(a, i0, i1); }
#endif

template <typename T>
void bwd_dq_rows(const Args& a, int64_t r0, int64_t r1) {
  const int64_t d = a.d, dp = a.dp, sq_pad = a.nqb * kBlockM;
  Scratch buf(d);
  for (int64_t r = r0; r < r1; ++r) {  // r = (bi * sq + i) * h + hh
    const int64_t hh = r % a.h, bi = r / a.h / a.sq, i = r / a.h % a.sq;
    std::fill(buf.p, buf.p + d, 0.0f);
    for (int64_t c = 0; c < a.chunks; ++c) {
      const float* part = a.dq_part + (((c * a.b + bi) * a.h + hh) * sq_pad + i) * dp;
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) buf.p[e] += part[e];
    }
#pragma omp simd
    for (int64_t e = 0; e < d; ++e) buf.p[e] *= a.scale;
    store_row(buf.p, static_cast<T*>(a.dq) + at(a.ldq, bi, i, hh), d);
  }
}

#define MK_FA_DISPATCH(fn)                        \
  switch (a.dtype) {                              \
    case DType::BF16: return fn<bf16>(a, i0, i1); \
    case DType::F16: return fn<f16>(a, i0, i1);   \
    default: return fn<float>(a, i0, i1);         \
  }

}  // namespace

void flash_attn_pack(const Args& a, int64_t i0, int64_t i1) { MK_FA_DISPATCH(pack_items) }
bool has_bf16_dot() {
#if defined(__x86_64__)
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

void flash_attn_fwd(const Args& a, int64_t i0, int64_t i1) {
#if defined(__x86_64__)
  if (a.dtype == DType::BF16 && a.ktb != nullptr) return fwd_items_dot(a, i0, i1);
#endif
  MK_FA_DISPATCH(fwd_items)
}
void flash_attn_bwd_prep(const Args& a, int64_t i0, int64_t i1) { MK_FA_DISPATCH(bwd_prep_blocks) }
void flash_attn_bwd_kv(const Args& a, int64_t i0, int64_t i1) {
#if defined(__x86_64__)
  if (a.dtype == DType::BF16 && a.ktb != nullptr) return bwd_kv_items_dot(a, i0, i1);
#endif
  MK_FA_DISPATCH(bwd_kv_items)
}
void flash_attn_bwd_dq(const Args& a, int64_t i0, int64_t i1) { MK_FA_DISPATCH(bwd_dq_rows) }

}  // namespace MK_CPU_NS
}  // namespace megakernels
