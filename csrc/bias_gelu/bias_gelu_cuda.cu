// CUDA kernels of the bias-GeLU family. No torch headers: this file compiles in seconds with nvcc, and unchanged
// with g++ against csrc/emu (bias_gelu_cuda_emu.cpp) to run on a CPU.
//
// Design (why; costmodel/README.md has the budgets):
// - A column tiling instead of a flat sweep: thread (x, y) of a block owns column pack j = blockIdx.x * blockDim.x
//   + x of the row (16 bytes: 8 bf16/fp16, 4 fp32; a pack of 1 where the row or a pointer is not aligned) and walks
//   rows blockIdx.y * blockDim.y + y, stepping by the grid's rows. Its bias pack is loaded once, the in-row index
//   is 32-bit and fixed, and there is no per-pack `index % hidden` (a 64-bit division in the flat form).
// - Each step takes kRowsPerStep rows, whose loads are all in flight before the first is used.
// - The GeLU form is a template argument (math.h's gelu_value / gelu_derivative): no branch per element.
// - Backward: a thread adds its dx values into fp32 registers for its column pack over all the rows it walks, and
//   writes them once as one row of a [grid rows, hidden] partial; column_sum_kernel adds those rows in a fixed
//   order. No workspace traffic per row; deterministic run to run.
#include <cstdint>

#include "../common/cuda_compat.h"
#include "../common/cuda_kernels.cuh"
#include "bias_gelu.h"

namespace megakernels {
namespace MK_NS {
namespace {

using bias_gelu::Args;

constexpr int kRowsPerStep = 4;
constexpr int kBlockThreads = 256;

template <typename T, typename W, int N, Activation ACT>
__global__ void __launch_bounds__(kBlockThreads) bias_gelu_fwd_kernel(Args a) {
  using A = typename AccOf<T>::type;
  constexpr bool LOWP = sizeof(T) == 2;
  const int j = (blockIdx.x * blockDim.x + threadIdx.x) * N;
  const int H = int(a.hidden);
  if (j >= H) return;
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  A bv[N];
  load_pack<W, N>(static_cast<const W*>(a.bias), j, bv);
  const int64_t step = int64_t(gridDim.y) * blockDim.y;
  for (int64_t r0 = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r0 < a.rows; r0 += kRowsPerStep * step) {
    A v[kRowsPerStep][N];
#pragma unroll
    for (int u = 0; u < kRowsPerStep; ++u) {
      const int64_t r = r0 + u * step;
      if (r < a.rows) load_pack<T, N>(x + r * a.hidden, j, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kRowsPerStep; ++u) {
      const int64_t r = r0 + u * step;
      if (r >= a.rows) continue;
#pragma unroll
      for (int k = 0; k < N; ++k) v[u][k] = gelu_value<ACT, LOWP>(v[u][k] + bv[k]);
      store_pack<T, N>(y + r * a.hidden, j, v[u]);
    }
  }
}

// Writes dx, and this thread's column sums of dx as row (blockIdx.y * blockDim.y + threadIdx.y) of the
// [gridDim.y * blockDim.y, hidden] partial in a.workspace.
template <typename T, typename W, int N, Activation ACT>
__global__ void __launch_bounds__(kBlockThreads) bias_gelu_bwd_kernel(Args a) {
  using A = typename AccOf<T>::type;
  constexpr bool LOWP = sizeof(T) == 2;
  const int j = (blockIdx.x * blockDim.x + threadIdx.x) * N;
  const int H = int(a.hidden);
  if (j >= H) return;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.y);
  A bv[N], acc[N];
  load_pack<W, N>(static_cast<const W*>(a.bias), j, bv);
#pragma unroll
  for (int k = 0; k < N; ++k) acc[k] = A(0);
  const int64_t first = int64_t(blockIdx.y) * blockDim.y + threadIdx.y;
  const int64_t step = int64_t(gridDim.y) * blockDim.y;
  for (int64_t r0 = first; r0 < a.rows; r0 += kRowsPerStep * step) {
    A z[kRowsPerStep][N], g[kRowsPerStep][N];
#pragma unroll
    for (int u = 0; u < kRowsPerStep; ++u) {
      const int64_t r = r0 + u * step;
      if (r < a.rows) {
        load_pack<T, N>(x + r * a.hidden, j, z[u]);
        load_pack<T, N>(dy + r * a.hidden, j, g[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kRowsPerStep; ++u) {
      const int64_t r = r0 + u * step;
      if (r >= a.rows) continue;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        g[u][k] *= gelu_derivative<ACT, LOWP>(z[u][k] + bv[k]);
        acc[k] += g[u][k];
      }
      store_pack<T, N>(dx + r * a.hidden, j, g[u]);
    }
  }
  A* part = static_cast<A*>(a.workspace) + first * a.hidden;
  constexpr int Q = N * sizeof(A) > 16 ? 16 / int(sizeof(A)) : N;  // 16-byte stores (the workspace's alignment)
#pragma unroll
  for (int k0 = 0; k0 < N; k0 += Q) store_pack<A, Q>(part, j + k0, *reinterpret_cast<const A(*)[Q]>(acc + k0));
}

// ---------------------------------------------------------------------------------------------------------------
// Launch planning (host side).

// Block: up to 256 threads along the row's packs (a multiple of 32), the rest of the 256 along rows. Grid: the
// row's packs, times enough row tiles for ~4 resident blocks per SM (rows are walked beyond that).
struct ColumnPlan {
  dim3 grid, block;
  int64_t partial_rows() const { return int64_t(grid.y) * block.y; }
};

inline ColumnPlan column_plan(int64_t rows, int64_t packs) {
  ColumnPlan p;
  const int64_t tx = packs >= kBlockThreads ? kBlockThreads : (packs + 31) / 32 * 32;
  p.block = dim3(unsigned(tx), unsigned(kBlockThreads / tx));
  const int64_t gx = (packs + tx - 1) / tx;
  const int64_t want = int64_t(sm_count()) * 4;  // 4 x 256 threads x 4 rows x 16 B: >= 64 KiB in flight per SM
  int64_t gy = (want + gx - 1) / gx;
  const int64_t needed = (rows + p.block.y - 1) / p.block.y;
  if (gy > needed) gy = needed;
  if (gy < 1) gy = 1;
  p.grid = dim3(unsigned(gx), unsigned(gy));
  return p;
}

template <typename T, typename W>
int vector_width(const Args& a, std::initializer_list<const void*> rows) {
  return pack_width<T, W>(a.hidden, rows, {a.bias});
}

template <typename T, typename W, int N>
void launch_fwd(const Args& a, const ColumnPlan& p, cudaStream_t s) {
  if (a.act == Activation::Gelu)
    MK_LAUNCH((bias_gelu_fwd_kernel<T, W, N, Activation::Gelu>), p.grid, p.block, 0, s, a);
  else
    MK_LAUNCH((bias_gelu_fwd_kernel<T, W, N, Activation::GeluTanh>), p.grid, p.block, 0, s, a);
}

template <typename T, typename W, int N>
void launch_bwd(const Args& a, const ColumnPlan& p, cudaStream_t s) {
  if (a.act == Activation::Gelu)
    MK_LAUNCH((bias_gelu_bwd_kernel<T, W, N, Activation::Gelu>), p.grid, p.block, 0, s, a);
  else
    MK_LAUNCH((bias_gelu_bwd_kernel<T, W, N, Activation::GeluTanh>), p.grid, p.block, 0, s, a);
}

template <typename T, typename W>
const char* run_fwd(const Args& a, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  const bool vec = vector_width<T, W>(a, {a.x, a.y}) == V;
  const ColumnPlan p = column_plan(a.rows, vec ? a.hidden / V : a.hidden);
  if (vec)
    launch_fwd<T, W, V>(a, p, s);
  else
    launch_fwd<T, W, 1>(a, p, s);
  return last_error();
}

template <typename T, typename W>
const char* run_bwd(const Args& a, cudaStream_t s) {
  using A = typename AccOf<T>::type;
  constexpr int V = 16 / sizeof(T);
  const bool vec = vector_width<T, W>(a, {a.x, a.dy, a.y}) == V;
  const ColumnPlan p = column_plan(a.rows, vec ? a.hidden / V : a.hidden);
  if (vec)
    launch_bwd<T, W, V>(a, p, s);
  else
    launch_bwd<T, W, 1>(a, p, s);
  if (const char* e = last_error()) return e;
  return launch_column_sum<W, A>(a.workspace, p.partial_rows(), a.hidden, 0, a.hidden, a.dbias, s);
}

template <typename T, typename W>
struct Fwd {
  static const char* run(const Args& a, cudaStream_t s) { return run_fwd<T, W>(a, s); }
};
template <typename T, typename W>
struct Bwd {
  static const char* run(const Args& a, cudaStream_t s) { return run_bwd<T, W>(a, s); }
};

}  // namespace

// The partial has one row per row-walking thread of the grid, for whichever plan (packs or scalars) runs.
int64_t bias_gelu_bwd_workspace_bytes(int64_t rows, int64_t hidden, DType x_dtype) {
  if (rows <= 0) return 0;
  const int64_t v = 16 / dtype_bytes(x_dtype);
  int64_t parts = column_plan(rows, hidden).partial_rows();
  if (hidden % v == 0) {
    const int64_t vec = column_plan(rows, hidden / v).partial_rows();
    parts = vec > parts ? vec : parts;
  }
  return parts * hidden * (x_dtype == DType::F64 ? 8 : 4);
}
const char* bias_gelu_fwd(const Args& a, void* stream) { return dispatch_x_w<Fwd>(a, stream); }
const char* bias_gelu_bwd(const Args& a, void* stream) { return dispatch_x_w<Bwd>(a, stream); }

}  // namespace MK_NS
}  // namespace megakernels
