// CUDA kernels of the norm family: LayerNorm (+ GeLU epilogue), RMSNorm, bias-GeLU. No torch headers: this file
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
#include <initializer_list>

#include "../common/cuda_compat.h"
#include "../common/cuda_kernels.cuh"
#include "norms.h"

namespace megakernels {
namespace MK_NS {
namespace {

using norms::BiasGeluArgs;
using norms::BwdArgs;
using norms::FwdArgs;

// Loads N consecutive parameters as accumulate values; an absent parameter reads as `fill`.
template <typename W, int N, typename A>
__device__ __forceinline__ void load_param(const W* p, int64_t j, A fill, A (&out)[N]) {
  if (p) {
    load_pack<W, N>(p, j, out);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = fill;
  }
}

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

// out[j] = sum_w partial[w * stride + j], workers in order (deterministic); one thread per column, coalesced.
template <typename W, typename A>
__global__ void column_sum_kernel(const A* partial, int64_t workers, int64_t stride, int64_t H, W* out) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= H) return;
  A s = A(0);
  for (int64_t w = 0; w < workers; ++w) s += partial[w * stride + j];
  out[j] = Cvt<W>::from(s);
}

template <typename T, typename W, int N>
__global__ void bias_gelu_fwd_kernel(BiasGeluArgs a) {
  using A = typename AccOf<T>::type;
  const T* x = static_cast<const T*>(a.x);
  const W* bias = static_cast<const W*>(a.bias);
  T* y = static_cast<T*>(a.y);
  const int64_t packs = a.rows * a.hidden / N;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < packs; p += int64_t(gridDim.x) * blockDim.x) {
    A v[N], bv[N];
    load_pack<T, N>(x, p * N, v);
    load_param<W, N>(bias, (p * N) % a.hidden, A(0), bv);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = gelu_fwd<A>(v[k] + bv[k], a.act);
    store_pack<T, N>(y, p * N, v);
  }
}

template <typename T, typename W, int N>
__global__ void bias_gelu_bwd_kernel(BiasGeluArgs a, int group_threads) {
  using A = typename AccOf<T>::type;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  const W* bias = static_cast<const W*>(a.bias);
  const int64_t H = a.hidden;
  const int groups = blockDim.x / group_threads;
  const int t = threadIdx.x % group_threads;
  const int64_t worker = int64_t(blockIdx.x) * groups + threadIdx.x / group_threads;
  const int64_t workers = int64_t(gridDim.x) * groups;
  A* pb = static_cast<A*>(a.workspace) + worker * H;
  bool first = true;
  for (int64_t row = worker; row < a.rows; row += workers, first = false) {
    for (int64_t j = int64_t(t) * N; j < H; j += int64_t(group_threads) * N) {
      A z[N], g[N], bv[N];
      load_pack<T, N>(x + row * H, j, z);
      load_pack<T, N>(dy + row * H, j, g);
      load_param<W, N>(bias, j, A(0), bv);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        g[k] *= gelu_grad<A>(z[k] + bv[k], a.act);
        pb[j + k] = (first ? A(0) : pb[j + k]) + g[k];
      }
      store_pack<T, N>(static_cast<T*>(a.y) + row * H, j, g);
    }
  }
  if (first) {
    for (int64_t j = t; j < H; j += group_threads) pb[j] = A(0);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Launch planning (host side).

int64_t elem_size(DType d) { return d == DType::F64 ? 8 : (d == DType::F32 ? 4 : 2); }

// `max_blocks_per_sm` bounds the grid: forward passes want many resident blocks for latency hiding; backward
// passes want few workers, since each worker owns a [2, hidden] fp32 partial row.
RowPlan norm_plan(int64_t rows, int64_t hidden, DType x_dtype, int max_blocks_per_sm) {
  const int64_t per_pack = 16 / elem_size(x_dtype);  // the vector width decides the shape, scalar path or not
  return plan_rows(rows, (hidden + per_pack - 1) / per_pack, max_blocks_per_sm);
}
constexpr int kFwdBlocksPerSm = 16;
constexpr int kBwdBlocksPerSm = 2;

// Pack width N: 16 bytes of T when every row starts 16-byte aligned and all pointers allow it, else 1.
template <typename T, typename W>
int pack_width(int64_t hidden, std::initializer_list<const void*> row_ptrs, std::initializer_list<const void*> params) {
  constexpr int N = 16 / sizeof(T);
  if (hidden % N != 0) return 1;
  for (const void* p : row_ptrs)
    if (!aligned(p, 16)) return 1;
  for (const void* p : params)
    if (!aligned(p, int64_t(sizeof(W)) * N)) return 1;
  return N;
}

template <typename T, typename W>
const char* run_fwd(const FwdArgs& a, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  const RowPlan p = norm_plan(a.rows, a.hidden, a.x_dtype, kFwdBlocksPerSm);
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

template <typename W, typename A>
const char* launch_column_sum(const void* ws, int64_t workers, int64_t stride, int64_t offset, int64_t H, void* out,
                              cudaStream_t s) {
  if (!out) return nullptr;
  MK_LAUNCH((column_sum_kernel<W, A>), dim3((H + 255) / 256), dim3(256), 0, s, static_cast<const A*>(ws) + offset,
            workers, stride, H, static_cast<W*>(out));
  return last_error();
}

template <typename T, typename W>
const char* run_bwd(const BwdArgs& a, cudaStream_t s) {
  using A = typename AccOf<T>::type;
  constexpr int V = 16 / sizeof(T);
  const RowPlan p = norm_plan(a.rows, a.hidden, a.x_dtype, kBwdBlocksPerSm);
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
const char* run_bias_gelu_fwd(const BiasGeluArgs& a, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  const bool vec = pack_width<T, W>(a.hidden, {a.x, a.y}, {a.bias}) == V;
  const int64_t packs = a.rows * a.hidden / (vec ? V : 1);
  int64_t grid = (packs + 255) / 256;
  const int64_t cap = int64_t(sm_count()) * 32;
  if (grid > cap) grid = cap;
  if (vec) MK_LAUNCH((bias_gelu_fwd_kernel<T, W, V>), dim3(grid), dim3(256), 0, s, a);
  else MK_LAUNCH((bias_gelu_fwd_kernel<T, W, 1>), dim3(grid), dim3(256), 0, s, a);
  return last_error();
}

template <typename T, typename W>
const char* run_bias_gelu_bwd(const BiasGeluArgs& a, cudaStream_t s) {
  using A = typename AccOf<T>::type;
  constexpr int V = 16 / sizeof(T);
  const RowPlan p = norm_plan(a.rows, a.hidden, a.x_dtype, kBwdBlocksPerSm);
  const bool vec = pack_width<T, W>(a.hidden, {a.x, a.dy, a.y}, {a.bias}) == V;
  if (vec) MK_LAUNCH((bias_gelu_bwd_kernel<T, W, V>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
  else MK_LAUNCH((bias_gelu_bwd_kernel<T, W, 1>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
  if (const char* e = last_error()) return e;
  return launch_column_sum<W, A>(a.workspace, p.workers(), a.hidden, 0, a.hidden, a.dbias, s);
}

template <template <typename, typename> class F, typename Args>
const char* dispatch(const Args& a, void* stream) {
  if (a.rows == 0) return nullptr;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (a.x_dtype) {
    case DType::F32: return F<float, float>::run(a, s);
    case DType::F64: return F<double, double>::run(a, s);
    case DType::BF16:
      return a.w_dtype == DType::F32 ? F<__nv_bfloat16, float>::run(a, s) : F<__nv_bfloat16, __nv_bfloat16>::run(a, s);
    case DType::F16: return a.w_dtype == DType::F32 ? F<__half, float>::run(a, s) : F<__half, __half>::run(a, s);
  }
  return "unsupported dtype";
}

template <typename T, typename W>
struct Fwd {
  static const char* run(const FwdArgs& a, cudaStream_t s) { return run_fwd<T, W>(a, s); }
};
template <typename T, typename W>
struct Bwd {
  static const char* run(const BwdArgs& a, cudaStream_t s) { return run_bwd<T, W>(a, s); }
};
template <typename T, typename W>
struct BgFwd {
  static const char* run(const BiasGeluArgs& a, cudaStream_t s) { return run_bias_gelu_fwd<T, W>(a, s); }
};
template <typename T, typename W>
struct BgBwd {
  static const char* run(const BiasGeluArgs& a, cudaStream_t s) { return run_bias_gelu_bwd<T, W>(a, s); }
};

}  // namespace

int64_t norm_bwd_workspace_bytes(int64_t rows, int64_t hidden, DType x_dtype) {
  if (rows <= 0) return 0;
  return norm_plan(rows, hidden, x_dtype, kBwdBlocksPerSm).workers() * 2 * hidden * (x_dtype == DType::F64 ? 8 : 4);
}
int64_t bias_gelu_bwd_workspace_bytes(int64_t rows, int64_t hidden, DType x_dtype) {
  return norm_bwd_workspace_bytes(rows, hidden, x_dtype) / 2;
}
const char* norm_fwd(const FwdArgs& a, void* stream) { return dispatch<Fwd>(a, stream); }
const char* norm_bwd(const BwdArgs& a, void* stream) { return dispatch<Bwd>(a, stream); }
const char* bias_gelu_fwd(const BiasGeluArgs& a, void* stream) { return dispatch<BgFwd>(a, stream); }
const char* bias_gelu_bwd(const BiasGeluArgs& a, void* stream) { return dispatch<BgBwd>(a, stream); }

}  // namespace MK_NS
}  // namespace megakernels
