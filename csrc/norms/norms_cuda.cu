// CUDA kernels of the norm family: LayerNorm (+ GeLU epilogue), RMSNorm. No torch headers: this file
// compiles in seconds with nvcc, and unchanged with g++ against csrc/emu (norms_cuda_emu.cpp) to run on a CPU.
//
// Two kinds of kernels:
// - the row-resident kernels of norms_rows.cuh, for the common case (16-bit or fp32 rows of whole 16-byte packs up
//   to 16k elements, weight and bias present): the row in registers, one DRAM read, the activation compiled in,
//   weight/bias gradients accumulated in shared memory per block (their design notes are there);
// - the looping kernels below for everything else (fp64, unaligned views or sizes, longer rows, absent
//   parameters), which any hidden size takes:
//   - a "row group" owns a row: one warp for rows of up to 8 packs per lane, a whole block (64..1024 threads) for
//     longer rows; packs of 16 bytes where alignment allows, else scalar;
//   - statistics: Welford per thread, merged across lanes with Chan's formula; the normalise pass re-reads the row
//     from cache;
//   - weight/bias grads: each row group accumulates its rows into its own fp32 row of a workspace
//     [workers, 2, hidden] (a column is owned by one thread of the group), then column_sum_kernel adds the
//     workers in a fixed order.
// Both are deterministic run to run.
#include <cstdint>

#include "../common/cuda_compat.h"
#include "../common/cuda_kernels.cuh"
#include "norms.h"
#include "norms_rows.cuh"

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

// The row-resident kernels (norms_rows.cuh) take 16-bit and fp32 rows of whole 16-byte packs up to 16k elements
// with every parameter present; they return false for anything else, which the looping kernels below take.
template <typename T, typename W>
bool run_fwd_rows(const FwdArgs& a, cudaStream_t s) {
  if constexpr (sizeof(T) == 8) {
    return false;
  } else {
    constexpr int V = 16 / sizeof(T), P = row_packs_per_thread<T>();
    if (!a.w || (!a.rms && !a.b) || !rows_kernel_fits(a.hidden, V, P) ||
        pack_width<T, W>(a.hidden, {a.x, a.y}, {a.w, a.b}) != V)
      return false;
    const RowsPlan p = rows_plan(a.rows, a.hidden, V, P, 0);
    const dim3 grid(unsigned(p.grid)), block(unsigned(p.group_threads * p.groups));
    if (a.rms) {
      MK_LAUNCH((norm_fwd_rows_kernel<T, W, V, P, Activation::None, true>), grid, block, 0, s, a, p.group_threads);
    } else if (a.act == Activation::Gelu) {
      MK_LAUNCH((norm_fwd_rows_kernel<T, W, V, P, Activation::Gelu, false>), grid, block, 0, s, a, p.group_threads);
    } else if (a.act == Activation::GeluTanh) {
      MK_LAUNCH((norm_fwd_rows_kernel<T, W, V, P, Activation::GeluTanh, false>), grid, block, 0, s, a, p.group_threads);
    } else {
      MK_LAUNCH((norm_fwd_rows_kernel<T, W, V, P, Activation::None, false>), grid, block, 0, s, a, p.group_threads);
    }
    return true;
  }
}

template <typename T, typename W, int P, Activation ACT, bool RMS>
const char* launch_bwd_rows(const BwdArgs& a, const RowsPlan& p, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  auto kernel = norm_bwd_rows_kernel<T, W, V, P, ACT, RMS>;
  if (p.smem > 48 * 1024) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(p.smem)) != cudaSuccess)
      return last_error();
  }
  MK_LAUNCH(kernel, dim3(unsigned(p.grid)), dim3(unsigned(p.group_threads * p.groups)), p.smem, s, a, p.group_threads);
  return last_error();
}

template <typename T, typename W, int P>
const char* launch_bwd_rows_act(const BwdArgs& a, const RowsPlan& p, cudaStream_t s) {
  if (a.rms) return launch_bwd_rows<T, W, P, Activation::None, true>(a, p, s);
  if (a.act == Activation::Gelu) return launch_bwd_rows<T, W, P, Activation::Gelu, false>(a, p, s);
  if (a.act == Activation::GeluTanh) return launch_bwd_rows<T, W, P, Activation::GeluTanh, false>(a, p, s);
  return launch_bwd_rows<T, W, P, Activation::None, false>(a, p, s);
}

template <typename T, typename W>
bool run_bwd_rows(const BwdArgs& a, cudaStream_t s, const char** err) {
  if constexpr (sizeof(T) == 8) {
    return false;
  } else {
    constexpr int V = 16 / sizeof(T), P = row_packs_per_thread<T>();
    if (!a.w || (!a.rms && !a.b) || !rows_kernel_fits(a.hidden, V, P) ||
        pack_width<T, W>(a.hidden, {a.x, a.dy, a.dx}, {a.w, a.b}) != V)
      return false;
    const int k = a.rms ? 1 : 2;
    const RowsPlan p = rows_plan(a.rows, a.hidden, V, P, k + (sizeof(T) == 4 ? 1 : 0));  // + the fp32 dz row
    *err = launch_bwd_rows_act<T, W, P>(a, p, s);
    if (!*err) *err = launch_column_sum<W, float>(a.workspace, p.grid, k * a.hidden, 0, a.hidden, a.dw, s);
    if (!*err && !a.rms)
      *err = launch_column_sum<W, float>(a.workspace, p.grid, k * a.hidden, a.hidden, a.hidden, a.db, s);
    return true;
  }
}

template <typename T, typename W>
const char* run_fwd(const FwdArgs& a, cudaStream_t s) {
  if (run_fwd_rows<T, W>(a, s)) return last_error();
  constexpr int V = 16 / sizeof(T);
  const RowPlan p = row_plan(a.rows, a.hidden, a.x_dtype, kFwdBlocksPerSm);
  const bool vec = pack_width<T, W>(a.hidden, {a.x, a.y}, {a.w, a.b}) == V;
  if (a.rms) {
    if (vec)
      MK_LAUNCH((norm_fwd_kernel<T, W, V, true>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
    else
      MK_LAUNCH((norm_fwd_kernel<T, W, 1, true>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
  } else {
    if (vec)
      MK_LAUNCH((norm_fwd_kernel<T, W, V, false>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
    else
      MK_LAUNCH((norm_fwd_kernel<T, W, 1, false>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
  }
  return last_error();
}

template <typename T, typename W>
const char* run_bwd(const BwdArgs& a, cudaStream_t s) {
  const char* err = nullptr;
  if (run_bwd_rows<T, W>(a, s, &err)) return err;
  using A = typename AccOf<T>::type;
  constexpr int V = 16 / sizeof(T);
  const RowPlan p = row_plan(a.rows, a.hidden, a.x_dtype, kBwdBlocksPerSm);
  const bool vec = pack_width<T, W>(a.hidden, {a.x, a.dy, a.dx}, {a.w, a.b}) == V;
  if (a.rms) {
    if (vec)
      MK_LAUNCH((norm_bwd_kernel<T, W, V, true>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
    else
      MK_LAUNCH((norm_bwd_kernel<T, W, 1, true>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
  } else {
    if (vec)
      MK_LAUNCH((norm_bwd_kernel<T, W, V, false>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
    else
      MK_LAUNCH((norm_bwd_kernel<T, W, 1, false>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
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

// Enough for either backward path (which one runs depends on the pointers, known only at launch).
int64_t norm_bwd_workspace_bytes(int64_t rows, int64_t hidden, DType x_dtype) {
  if (rows <= 0) return 0;
  const int64_t loop =
      row_plan(rows, hidden, x_dtype, kBwdBlocksPerSm).workers() * 2 * hidden * (x_dtype == DType::F64 ? 8 : 4);
  const int pack = int(16 / dtype_bytes(x_dtype)), ppt = 32 / pack;
  if (x_dtype == DType::F64 || !rows_kernel_fits(hidden, pack, ppt)) return loop;
  const int64_t resident =
      int64_t(rows_plan(rows, hidden, pack, ppt, x_dtype == DType::F32 ? 3 : 2).grid) * 2 * hidden * 4;
  return loop > resident ? loop : resident;
}
const char* norm_fwd(const FwdArgs& a, void* stream) { return dispatch_x_w<Fwd>(a, stream); }
const char* norm_bwd(const BwdArgs& a, void* stream) { return dispatch_x_w<Bwd>(a, stream); }

}  // namespace MK_NS
}  // namespace megakernels
