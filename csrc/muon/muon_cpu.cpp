// CPU kernels of Muon's Newton-Schulz iteration (muon.h). Torch-free.
//
// Every product is an fp32 GEMM C = alpha A B (+ beta D) by register tiles that stream a packed panel of B's rows
// and broadcast A's entries from a packed panel of its rows (GCC vector extensions): 6 rows x 64 columns with
// AVX-512's 32 registers (24 accumulators), 6 x 16 with 16 (12 accumulators), over 256 rows of B at a time. The
// buffers' rows are padded with zeros to a whole number of vectors, which the products keep zero, so every tile
// is whole in its columns; a tile's missing rows are packed as zeros and not stored. The symmetric products
// (A = X Xᵀ as X times its transpose, B = A A + b A) compute only the column tiles that reach the diagonal of
// their row tile, and a mirror pass copies the lower triangle up. A work item is a block of kBlockRows rows, which
// packs each column panel of B once for all its row tiles; the blocks of a triangle are dealt out in the order
// 0, last, 1, last - 1, ... so that any contiguous range of items has about the same work.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "muon.h"

namespace megakernels {
namespace MK_CPU_NS {  // cpu, or the ISA clone's (csrc/common/cpu_isa.h)
namespace {

using muon::NSArgs;

#if defined(MK_TARGET_AVX512)
constexpr int kLanes = 16;
constexpr int kVectors = 4;
#else
constexpr int kLanes = 8;
constexpr int kVectors = 2;
#endif
constexpr int kRows = 6;
constexpr int64_t kBlockRows = 16 * kRows;  // the rows of one work item of a product
constexpr int64_t kCols = int64_t(kLanes) * kVectors;
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef float vfu __attribute__((vector_size(4 * kLanes), aligned(4), may_alias));

inline vf vload(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void vstore(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// The shapes of one matrix's buffers: X [m, np] twice (the iterates), Xᵀ [n, mp], A [m, mp], B [m, mp].
struct Dims {
  int64_t m, n, mp, np, per;
  bool tall;
};

Dims dims(const NSArgs& a) {
  Dims d{};
  d.tall = a.rows > a.cols;
  d.m = d.tall ? a.cols : a.rows;
  d.n = d.tall ? a.rows : a.cols;
  d.mp = round_up(d.m, kLanes);
  d.np = round_up(d.n, kLanes);
  d.per = 2 * d.m * d.np + d.n * d.mp + 2 * d.m * d.mp;
  return d;
}

struct Buffers {
  float *x[2], *xt, *gram, *poly;
};

Buffers buffers(const NSArgs& a, const Dims& d, int64_t matrix) {
  float* base = a.work + matrix * d.per;
  Buffers b{};
  b.x[0] = base;
  b.x[1] = base + d.m * d.np;
  b.xt = base + 2 * d.m * d.np;
  b.gram = b.xt + d.n * d.mp;
  b.poly = b.gram + d.m * d.mp;
  return b;
}

// Rows r < rows of C[.., col + NV vectors] (+)= sum_k A[r, k] B[k, ..] over k < kdim, from packed panels: `a`
// [kdim, kRows] (A's rows interleaved), `b` [kdim, NV vectors]; FIRST starts the sums at zero, else from C's
// partial sums. Not inlined: alone in its function, the loop keeps the accumulators in registers (inlined into
// row_block, its live pointers pushed some accumulators to the stack).
template <int NV, bool FIRST>
__attribute__((noinline)) void tile(const float* a, const float* b, float* const* crow, int rows, int64_t col,
                                    int64_t kdim) {
  vf acc[kRows][NV];
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = FIRST || r >= rows ? vf{} : vload(crow[r] + col + kLanes * v);
  for (int64_t k = 0; k < kdim; ++k) {
    vf bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = vload(b + (k * NV + v) * kLanes);
#pragma GCC unroll 6
    for (int r = 0; r < kRows; ++r) {
      const float x = a[k * kRows + r];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += x * bv[v];
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r)  // a constant bound (with a test inside): the accumulators stay registers
    if (r < rows)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) vstore(crow[r] + col + kLanes * v, acc[r][v]);
}

template <int NV>
inline void tile(const float* a, const float* b, float* const* crow, int rows, int64_t col, int64_t kdim, bool first) {
  if (first)
    tile<NV, true>(a, b, crow, rows, col, kdim);
  else
    tile<NV, false>(a, b, crow, rows, col, kdim);
}

// C = alpha C (+ beta D) on rows r < rows, columns [col, col + width).
void epilogue(float* const* crow, const float* const* drow, int rows, int64_t col, int64_t width, float alpha,
              float beta) {
  for (int r = 0; r < rows; ++r) {
    float* c = crow[r] + col;
    if (drow != nullptr) {
      const float* d = drow[r] + col;
      for (int64_t j = 0; j < width; ++j) c[j] = alpha * c[j] + beta * d[j];
    } else if (alpha != 1.0f) {
      for (int64_t j = 0; j < width; ++j) c[j] *= alpha;
    }
  }
}

// Rows [i_begin, i_end) of C = alpha A B (+ beta D), by row tiles of kRows; for a symmetric product (`lower`) only
// the column tiles that start before a row tile's last row. The sums run over kDepth rows of B at a time, with A's
// rows of the block and each column panel of B packed into contiguous buffers (which stay in cache: the rows of a
// padded matrix are often a multiple of 4 KB apart, which maps them onto the same L1 sets). C must not alias A, B
// or D.
void row_block(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, const float* d,
               int64_t ldd, int64_t i_begin, int64_t i_end, int64_t width, bool lower, int64_t kdim, float alpha,
               float beta) {
  constexpr int64_t kDepth = 256;
  const int64_t tiles = (i_end - i_begin + kRows - 1) / kRows;
  float* crow[kRows];
  const float* drow[kRows];
  const float* const* dp = d != nullptr ? drow : nullptr;
  thread_local std::vector<float> apack, bpack;
  apack.resize(static_cast<size_t>(tiles * kDepth * kRows));
  bpack.resize(static_cast<size_t>(kDepth * kCols));
  for (int64_t k0 = 0; k0 < kdim; k0 += kDepth) {
    const int64_t kd = std::min(kDepth, kdim - k0);
    const bool first = k0 == 0, last = k0 + kd == kdim;
    for (int64_t t = 0; t < tiles; ++t)
      for (int r = 0; r < kRows; ++r) {
        const int64_t i = i_begin + t * kRows + r;
        float* dst = apack.data() + t * kd * kRows + r;
        for (int64_t k = 0; k < kd; ++k) dst[k * kRows] = i < i_end ? a[i * lda + k0 + k] : 0.0f;
      }
    for (int64_t col = 0; col < width; col += kCols) {
      const int64_t nv = std::min<int64_t>(kVectors, (width - col) / kLanes);
      const int64_t pw = nv * kLanes;
      for (int64_t k = 0; k < kd; ++k) std::memcpy(bpack.data() + k * pw, b + (k0 + k) * ldb + col, sizeof(float) * pw);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t i0 = i_begin + t * kRows;
        const int rows = int(std::min<int64_t>(kRows, i_end - i0));
        if (lower && col >= i0 + rows) continue;
        for (int r = 0; r < kRows; ++r) {
          const int64_t i = i0 + std::min(r, rows - 1);
          crow[r] = c + i * ldc;
          drow[r] = d != nullptr ? d + i * ldd : nullptr;
        }
        const float* ap = apack.data() + t * kd * kRows;
        const float* bp = bpack.data();
        switch (nv) {
#if defined(MK_TARGET_AVX512)
          case 4: tile<4>(ap, bp, crow, rows, col, kd, first); break;
          case 3: tile<3>(ap, bp, crow, rows, col, kd, first); break;
#endif
          case 2: tile<2>(ap, bp, crow, rows, col, kd, first); break;
          default: tile<1>(ap, bp, crow, rows, col, kd, first); break;
        }
        if (last) epilogue(crow, dp, rows, col, pw, alpha, beta);
      }
    }
  }
}

// dst[j, i] = src[i, j] for i < rows, j < cols, by 32 x 32 blocks.
void transpose(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t cols) {
  constexpr int64_t kBlock = 32;
  for (int64_t i0 = 0; i0 < rows; i0 += kBlock)
    for (int64_t j0 = 0; j0 < cols; j0 += kBlock)
      for (int64_t i = i0; i < std::min(rows, i0 + kBlock); ++i)
        for (int64_t j = j0; j < std::min(cols, j0 + kBlock); ++j) dst[j * ldd + i] = src[i * lds + j];
}

// The upper triangle of the symmetric [m, m] matrix s from its lower one.
void mirror(float* s, int64_t ld, int64_t m) {
  constexpr int64_t kBlock = 32;
  for (int64_t i0 = 0; i0 < m; i0 += kBlock)
    for (int64_t j0 = i0; j0 < m; j0 += kBlock)
      for (int64_t i = i0; i < std::min(m, i0 + kBlock); ++i)
        for (int64_t j = std::max(j0, i + 1); j < std::min(m, j0 + kBlock); ++j) s[i * ld + j] = s[j * ld + i];
}

// Row block of item t of a triangle of `tiles` row blocks: 0, tiles - 1, 1, tiles - 2, ...
int64_t dealt(int64_t t, int64_t tiles) { return t % 2 == 0 ? t / 2 : tiles - 1 - t / 2; }

void prepare(const NSArgs& a, const Dims& d, int64_t matrix) {
  const float* g = a.x + matrix * a.rows * a.cols;
  double ss = 0.0;
  for (int64_t i = 0; i < a.rows * a.cols; ++i) ss += double(g[i]) * double(g[i]);
  const float scale = float(1.0 / std::max(std::sqrt(ss), double(a.eps)));
  float* x = buffers(a, d, matrix).x[0];
  if (d.tall) {
    transpose(g, a.cols, x, d.np, a.rows, a.cols);
    for (int64_t i = 0; i < d.m; ++i)
      for (int64_t j = 0; j < d.n; ++j) x[i * d.np + j] *= scale;
  } else {
    for (int64_t i = 0; i < d.m; ++i)
      for (int64_t j = 0; j < d.n; ++j) x[i * d.np + j] = g[i * a.cols + j] * scale;
  }
}

void finish(const NSArgs& a, const Dims& d, int64_t matrix) {
  const float* x = buffers(a, d, matrix).x[a.steps % 2];
  float* out = a.out + matrix * a.rows * a.cols;
  if (d.tall) {
    transpose(x, d.np, out, a.cols, d.m, d.n);
  } else {
    for (int64_t i = 0; i < d.m; ++i) std::memcpy(out + i * a.cols, x + i * d.np, sizeof(float) * d.n);
  }
}

}  // namespace

int64_t ns_workspace_floats(const NSArgs& a) {
  const Dims d = dims(a);
  return a.batch * d.per;
}

int64_t ns_items(const NSArgs& a, int phase) {
  const Dims d = dims(a);
  const int64_t blocks = (d.m + kBlockRows - 1) / kBlockRows;
  switch (phase) {
    case muon::kGram:
    case muon::kPoly:
    case muon::kUpdate: return a.batch * blocks;
    default: return a.batch;
  }
}

void ns_run(const NSArgs& a, int phase, int64_t iteration, int64_t begin, int64_t end) {
  const Dims d = dims(a);
  const int64_t blocks = (d.m + kBlockRows - 1) / kBlockRows;
  for (int64_t item = begin; item < end; ++item) {
    const bool per_matrix = phase != muon::kGram && phase != muon::kPoly && phase != muon::kUpdate;
    const int64_t matrix = per_matrix ? item : item / blocks;
    const Buffers buf = buffers(a, d, matrix);
    const float* x = buf.x[iteration % 2];
    if (per_matrix) {
      switch (phase) {
        case muon::kPrepare: prepare(a, d, matrix); break;
        case muon::kTranspose: transpose(x, d.np, buf.xt, d.mp, d.m, d.n); break;
        case muon::kMirrorGram: mirror(buf.gram, d.mp, d.m); break;
        case muon::kMirrorPoly: mirror(buf.poly, d.mp, d.m); break;
        case muon::kFinish: finish(a, d, matrix); break;
        default: break;
      }
      continue;
    }
    const int64_t t = item % blocks;
    const int64_t i0 = (phase == muon::kUpdate ? t : dealt(t, blocks)) * kBlockRows;
    const int64_t i1 = std::min(d.m, i0 + kBlockRows);
    switch (phase) {
      case muon::kGram:  // A = X Xᵀ, the tiles reaching the diagonal
        row_block(x, d.np, buf.xt, d.mp, buf.gram, d.mp, nullptr, 0, i0, i1, d.mp, true, d.n, 1.0f, 0.0f);
        break;
      case muon::kPoly:  // B = c A A + b A (A symmetric: A's rows are its columns)
        row_block(buf.gram, d.mp, buf.gram, d.mp, buf.poly, d.mp, buf.gram, d.mp, i0, i1, d.mp, true, d.m, a.c, a.b);
        break;
      default:  // the next X = B X + a X
        row_block(buf.poly, d.mp, x, d.np, buf.x[(iteration + 1) % 2], d.np, x, d.np, i0, i1, d.np, false, d.m, 1.0f,
                  a.a);
        break;
    }
  }
}

}  // namespace MK_CPU_NS
}  // namespace megakernels
