// CUDA kernels of the norm family: LayerNorm (+ GeLU epilogue), RMSNorm. No torch headers: this file
// compiles in seconds with nvcc, and unchanged with g++ against csrc/emu (norms_cuda_emu.cpp) to run on a CPU.
//
// Design (why):
// - A "row group" owns a row: one warp for rows of up to 8 packs per lane (hidden <= 2048 bf16 / 1024 fp32), so
//   the reductions are pure shuffles and a 128-thread block serves 4 rows at once; one block (64..1024 threads)
//   for longer rows, so every row is spread over enough threads to keep ~8 packs in flight each. Any hidden size
//   works: sizes that are not a multiple of the pack width take the scalar (pack of 1) instantiation.
// - Packs are 16 bytes (8 bf16/fp16, 4 fp32): one vectorised load per pack, the widest the memory system issues.
// - Statistics: Welford per thread, merged across lanes with Chan's formula; stable where sum/sum-of-squares
//   cancels (rows with a large mean). The normalise pass re-reads the row, which the stats pass has just pulled
//   into L1/L2, instead of caching it in registers: no hidden-size-specific instantiations, no register spills.
// - Weight/bias grads: each row group (a "worker") accumulates its rows into its own fp32 row of a workspace
//   [workers, 2, hidden] (a column is owned by one thread of the group for every row, so no atomics and no
//   races), then a second small kernel sums the workers in a fixed order: deterministic, run to run.
#include <cstdint>

#include "../common/cuda_compat.h"
#include "../common/cuda_kernels.cuh"
#include "norms.h"

namespace megakernels {
namespace MK_NS {
namespace {

using norms::BwdArgs;
using norms::FwdArgs;

template <typename A>
__device__ __forceinline__ Welford<A> shfl_welford(const Welford<A>& s, int o) {
  return Welford<A>{__shfl_xor_sync(0xffffffffu, s.n, o), __shfl_xor_sync(0xffffffffu, s.mean, o),
                    __shfl_xor_sync(0xffffffffu, s.m2, o)};
}

// Welford merge over a row group. Chan's merge is not bitwise symmetric, so lane 0's result is broadcast: every
// thread then normalises with exactly the statistics that are saved for the backward pass.
template <typename A>
__device__ __forceinline__ Welford<A> group_welford(Welford<A> s, int group_threads, A* smem) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s = welford_merge(s, shfl_welford(s, o));
  if (group_threads > 32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) {
      smem[warp] = s.n;
      smem[32 + warp] = s.mean;
      smem[64 + warp] = s.m2;
    }
    __syncthreads();
    s = lane < warps ? Welford<A>{smem[lane], smem[32 + lane], smem[64 + lane]} : Welford<A>{A(0), A(0), A(0)};
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s = welford_merge(s, shfl_welford(s, o));
  }
  return Welford<A>{__shfl_sync(0xffffffffu, s.n, 0), __shfl_sync(0xffffffffu, s.mean, 0),
                    __shfl_sync(0xffffffffu, s.m2, 0)};
}

template <typename T, typename W, int N, bool RMS>
__global__ void norm_fwd_kernel(FwdArgs a, int group_threads) {
  using A = typename AccOf<T>::type;
  __shared__ A smem[96];
  const T* x = static_cast<const T*>(a.x);
  const W* w = static_cast<const W*>(a.w);
  const W* b = static_cast<const W*>(a.b);
  T* y = static_cast<T*>(a.y);
  const int64_t H = a.hidden;
  const int groups = blockDim.x / group_threads;
  const int t = threadIdx.x % group_threads;
  for (int64_t row = int64_t(blockIdx.x) * groups + threadIdx.x / group_threads; row < a.rows;
       row += int64_t(gridDim.x) * groups) {
    const T* xr = x + row * H;
    A mean = A(0), var;
    if (RMS) {
      A ss = A(0);
      for (int64_t j = int64_t(t) * N; j < H; j += int64_t(group_threads) * N) {
        A v[N];
        load_pack<T, N>(xr, j, v);
#pragma unroll
        for (int k = 0; k < N; ++k) ss += v[k] * v[k];
      }
      var = group_sum(ss, group_threads, smem) / A(H);
    } else {
      Welford<A> st{A(0), A(0), A(0)};
      for (int64_t j = int64_t(t) * N; j < H; j += int64_t(group_threads) * N) {
        A v[N];
        load_pack<T, N>(xr, j, v);
#pragma unroll
        for (int k = 0; k < N; ++k) welford_add(st, v[k]);
      }
      st = group_welford(st, group_threads, smem);
      mean = st.mean;
      var = st.m2 / A(H);
    }
    const A rstd = A(1) / std::sqrt(var + A(a.eps));
    if (t == 0) {
      if (!RMS) static_cast<A*>(a.mean)[row] = mean;
      static_cast<A*>(a.rstd)[row] = rstd;
    }
    for (int64_t j = int64_t(t) * N; j < H; j += int64_t(group_threads) * N) {
      A v[N], wv[N], bv[N];
      load_pack<T, N>(xr, j, v);
      load_param<W, N>(w, j, A(1), wv);
      load_param<W, N>(b, j, A(0), bv);
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = gelu_fwd<A>((v[k] - mean) * rstd * wv[k] + bv[k], a.act);
      store_pack<T, N>(y + row * H, j, v);
    }
  }
}

// Loads N elements of a row of x and dy and the parameters, and turns them into xhat and dz, the gradient
// reaching the affine output w*xhat+b (through the GeLU if fused). Both backward passes go through here: the
// second recomputes rather than keeping the row in registers or shared memory.
template <typename T, typename W, int N, typename A>
__device__ __forceinline__ void load_xhat_dz(const T* xr, const T* gr, const W* w, const W* b, int64_t j, A mean,
                                             A rstd, Activation act, A (&xh)[N], A (&dz)[N], A (&wv)[N]) {
  A bv[N];
  load_pack<T, N>(xr, j, xh);
  load_pack<T, N>(gr, j, dz);
  load_param<W, N>(w, j, A(1), wv);
  load_param<W, N>(b, j, A(0), bv);
#pragma unroll
  for (int k = 0; k < N; ++k) xh[k] = (xh[k] - mean) * rstd;
  if (act != Activation::None) {
#pragma unroll
    for (int k = 0; k < N; ++k) dz[k] *= gelu_grad<A>(xh[k] * wv[k] + bv[k], act);
  }
}

template <typename T, typename W, int N, bool RMS>
__global__ void norm_bwd_kernel(BwdArgs a, int group_threads) {
  using A = typename AccOf<T>::type;
  __shared__ A smem[32];
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  const W* w = static_cast<const W*>(a.w);
  const W* b = static_cast<const W*>(a.b);
  const int64_t H = a.hidden;
  const int groups = blockDim.x / group_threads;
  const int t = threadIdx.x % group_threads;
  const int64_t worker = int64_t(blockIdx.x) * groups + threadIdx.x / group_threads;
  const int64_t workers = int64_t(gridDim.x) * groups;
  A* pw = static_cast<A*>(a.workspace) + worker * 2 * H;
  A* pb = pw + H;
  bool first = true;
  for (int64_t row = worker; row < a.rows; row += workers, first = false) {
    const A mean = RMS ? A(0) : static_cast<const A*>(a.mean)[row];
    const A rstd = static_cast<const A*>(a.rstd)[row];
    const T* xr = x + row * H;
    const T* gr = dy + row * H;
    A s1 = A(0), s2 = A(0);
    for (int64_t j = int64_t(t) * N; j < H; j += int64_t(group_threads) * N) {
      A xh[N], g[N], wv[N];
      load_xhat_dz<T, W, N>(xr, gr, w, b, j, mean, rstd, a.act, xh, g, wv);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        pw[j + k] = (first ? A(0) : pw[j + k]) + g[k] * xh[k];
        pb[j + k] = (first ? A(0) : pb[j + k]) + g[k];
        const A gw = g[k] * wv[k];
        s1 += gw;
        s2 += gw * xh[k];
      }
    }
    const A c1 = RMS ? A(0) : group_sum(s1, group_threads, smem) / A(H);
    const A c2 = group_sum(s2, group_threads, smem) / A(H);
    for (int64_t j = int64_t(t) * N; j < H; j += int64_t(group_threads) * N) {
      A xh[N], g[N], wv[N];
      load_xhat_dz<T, W, N>(xr, gr, w, b, j, mean, rstd, a.act, xh, g, wv);
#pragma unroll
      for (int k = 0; k < N; ++k) g[k] = rstd * (g[k] * wv[k] - c1 - xh[k] * c2);
      store_pack<T, N>(static_cast<T*>(a.dx) + row * H, j, g);
    }
  }
  if (first) {  // a worker without rows still owns a partial row that the column sum reads
    for (int64_t j = t; j < 2 * H; j += group_threads) pw[j] = A(0);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Launch planning (host side).

constexpr int kFwdBlocksPerSm = 16;
constexpr int kBwdBlocksPerSm = 2;

template <typename T, typename W>
const char* run_fwd(const FwdArgs& a, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  const RowPlan p = row_plan(a.rows, a.hidden, a.x_dtype, kFwdBlocksPerSm);
  const bool vec = pack_width<T, W>(a.hidden, {a.x, a.y}, {a.w, a.b}) == V;
  if (a.rms) {
    if (vec) MK_LAUNCH((norm_fwd_kernel<T, W, V, true>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
    else MK_LAUNCH((norm_fwd_kernel<T, W, 1, true>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
  } else {
    if (vec) MK_LAUNCH((norm_fwd_kernel<T, W, V, false>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
    else MK_LAUNCH((norm_fwd_kernel<T, W, 1, false>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
  }
  return last_error();
}

template <typename T, typename W>
const char* run_bwd(const BwdArgs& a, cudaStream_t s) {
  using A = typename AccOf<T>::type;
  constexpr int V = 16 / sizeof(T);
  const RowPlan p = row_plan(a.rows, a.hidden, a.x_dtype, kBwdBlocksPerSm);
  const bool vec = pack_width<T, W>(a.hidden, {a.x, a.dy, a.dx}, {a.w, a.b}) == V;
  if (a.rms) {
    if (vec) MK_LAUNCH((norm_bwd_kernel<T, W, V, true>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
    else MK_LAUNCH((norm_bwd_kernel<T, W, 1, true>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
  } else {
    if (vec) MK_LAUNCH((norm_bwd_kernel<T, W, V, false>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
    else MK_LAUNCH((norm_bwd_kernel<T, W, 1, false>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
  }
  if (const char* e = last_error()) return e;
  if (const char* e = launch_column_sum<W, A>(a.workspace, p.workers(), 2 * a.hidden, 0, a.hidden, a.dw, s)) return e;
  return launch_column_sum<W, A>(a.workspace, p.workers(), 2 * a.hidden, a.hidden, a.hidden, a.db, s);
}

template <typename T, typename W>
struct Fwd {
  static const char* run(const FwdArgs& a, cudaStream_t s) { return run_fwd<T, W>(a, s); }
};
template <typename T, typename W>
struct Bwd {
  static const char* run(const BwdArgs& a, cudaStream_t s) { return run_bwd<T, W>(a, s); }
};
}  // namespace

int64_t norm_bwd_workspace_bytes(int64_t rows, int64_t hidden, DType x_dtype) {
  if (rows <= 0) return 0;
  return row_plan(rows, hidden, x_dtype, kBwdBlocksPerSm).workers() * 2 * hidden * (x_dtype == DType::F64 ? 8 : 4);
}
const char* norm_fwd(const FwdArgs& a, void* stream) { return dispatch_x_w<Fwd>(a, stream); }
const char* norm_bwd(const BwdArgs& a, void* stream) { return dispatch_x_w<Bwd>(a, stream); }

}  // namespace MK_NS
}  // namespace megakernels
