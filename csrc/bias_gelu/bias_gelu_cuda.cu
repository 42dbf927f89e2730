// CUDA kernels of the bias-GeLU family. No torch headers: this file compiles in seconds with nvcc, and unchanged
// with g++ against csrc/emu (bias_gelu_cuda_emu.cpp) to run on a CPU.
//
// Forward: a grid-stride loop over 16-byte packs of the flattened [rows, hidden] tensor. Backward: row groups
// (csrc/common/cuda_kernels.cuh's plan_rows) each own a [hidden] fp32 partial dbias row of a workspace, then a
// column sum over the row groups in a fixed order (deterministic).
#include <cstdint>

#include "../common/cuda_compat.h"
#include "../common/cuda_kernels.cuh"
#include "bias_gelu.h"

namespace megakernels {
namespace MK_NS {
namespace {

using bias_gelu::Args;

template <typename T, typename W, int N>
__global__ void bias_gelu_fwd_kernel(Args a) {
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
__global__ void bias_gelu_bwd_kernel(Args a, int group_threads) {
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

constexpr int kBwdBlocksPerSm = 2;  // each row group owns a [hidden] partial row: few of them

template <typename T, typename W>
const char* run_bias_gelu_fwd(const Args& a, cudaStream_t s) {
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
const char* run_bias_gelu_bwd(const Args& a, cudaStream_t s) {
  using A = typename AccOf<T>::type;
  constexpr int V = 16 / sizeof(T);
  const RowPlan p = row_plan(a.rows, a.hidden, a.x_dtype, kBwdBlocksPerSm);
  const bool vec = pack_width<T, W>(a.hidden, {a.x, a.dy, a.y}, {a.bias}) == V;
  if (vec) MK_LAUNCH((bias_gelu_bwd_kernel<T, W, V>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
  else MK_LAUNCH((bias_gelu_bwd_kernel<T, W, 1>), dim3(p.grid), dim3(p.block), 0, s, a, p.group_threads);
  if (const char* e = last_error()) return e;
  return launch_column_sum<W, A>(a.workspace, p.workers(), a.hidden, 0, a.hidden, a.dbias, s);
}

template <typename T, typename W>
struct BgFwd {
  static const char* run(const Args& a, cudaStream_t s) { return run_bias_gelu_fwd<T, W>(a, s); }
};
template <typename T, typename W>
struct BgBwd {
  static const char* run(const Args& a, cudaStream_t s) { return run_bias_gelu_bwd<T, W>(a, s); }
};

}  // namespace

int64_t bias_gelu_bwd_workspace_bytes(int64_t rows, int64_t hidden, DType x_dtype) {
  if (rows <= 0) return 0;
  return row_plan(rows, hidden, x_dtype, kBwdBlocksPerSm).workers() * hidden * (x_dtype == DType::F64 ? 8 : 4);
}
const char* bias_gelu_fwd(const Args& a, void* stream) { return dispatch_x_w<BgFwd>(a, stream); }
const char* bias_gelu_bwd(const Args& a, void* stream) { return dispatch_x_w<BgBwd>(a, stream); }

}  // namespace MK_NS
}  // namespace megakernels
