// CUDA kernels of the gated activations (swiglu.h), forward and backward. No torch headers: compiles in seconds with
// nvcc, and unchanged with g++ against csrc/emu (swiglu_cuda_emu.cpp).
//
// Design (why): purely elementwise along a row, so a row group (a warp for rows up to 8 packs per lane, else a
// block; plan_rows) walks the row in 16-byte packs, reading the gate pack at j and the up pack at f + j, and
// writing one output pack (forward) or a gate-gradient and an up-gradient pack (backward). There is no
// reduction: the row groups only keep each thread's loads wide and coalesced. Rows whose start is not 16-byte
// aligned, or whose f is not a multiple of the pack, take single elements.
#include <cstdint>

#include "../common/cuda_compat.h"
#include "../common/cuda_kernels.cuh"
#include "swiglu.h"

namespace megakernels {
namespace MK_NS {
namespace {

using swiglu::Act;
using swiglu::Args;
using swiglu::Gate;

template <typename T, int N, Act K>
__global__ void swiglu_fwd_kernel(Args a, int group_threads) {
  using A = typename AccOf<T>::type;
  const Gate<A> p{A(a.limit), A(a.alpha)};
  const int groups = blockDim.x / group_threads;
  const int t = threadIdx.x % group_threads;
  for (int64_t row = int64_t(blockIdx.x) * groups + threadIdx.x / group_threads; row < a.rows;
       row += int64_t(gridDim.x) * groups) {
    const T* xr = static_cast<const T*>(a.x) + row * a.x_stride;
    T* yr = static_cast<T*>(a.y) + row * a.f;
    for (int64_t j = int64_t(t) * N; j < a.f; j += int64_t(group_threads) * N) {
      A g[N], u[N];
      load_pack<T, N>(xr, j, g);
      load_pack<T, N>(xr, a.f + j, u);
#pragma unroll
      for (int k = 0; k < N; ++k) g[k] = swiglu::fwd<K, A>(g[k], u[k], p);
      store_pack<T, N>(yr, j, g);
    }
  }
}

template <typename T, int N, Act K>
__global__ void swiglu_bwd_kernel(Args a, int group_threads) {
  using A = typename AccOf<T>::type;
  const Gate<A> p{A(a.limit), A(a.alpha)};
  const int groups = blockDim.x / group_threads;
  const int t = threadIdx.x % group_threads;
  for (int64_t row = int64_t(blockIdx.x) * groups + threadIdx.x / group_threads; row < a.rows;
       row += int64_t(gridDim.x) * groups) {
    const T* xr = static_cast<const T*>(a.x) + row * a.x_stride;
    const T* gr = static_cast<const T*>(a.dy) + row * a.dy_stride;
    T* dxr = static_cast<T*>(a.y) + row * 2 * a.f;
    for (int64_t j = int64_t(t) * N; j < a.f; j += int64_t(group_threads) * N) {
      A g[N], u[N], dy[N];
      load_pack<T, N>(xr, j, g);
      load_pack<T, N>(xr, a.f + j, u);
      load_pack<T, N>(gr, j, dy);
#pragma unroll
      for (int k = 0; k < N; ++k) swiglu::bwd<K, A>(g[k], u[k], dy[k], p, g[k], u[k]);
      store_pack<T, N>(dxr, j, g);
      store_pack<T, N>(dxr, a.f + j, u);
    }
  }
}

constexpr int kBlocksPerSm = 16;

template <typename T, bool BWD, Act K>
const char* run(const Args& a, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  const bool vec = a.f % V == 0 && a.x_stride % V == 0 && aligned(a.x, 16) && aligned(a.y, 16) &&
                   (!BWD || (a.dy_stride % V == 0 && aligned(a.dy, 16)));
  const RowPlan p = plan_rows(a.rows, vec ? a.f / V : a.f, kBlocksPerSm);
  const dim3 grid(unsigned(p.grid)), block(p.block);
  if (BWD) {
    if (vec)
      MK_LAUNCH((swiglu_bwd_kernel<T, V, K>), grid, block, 0, s, a, p.group_threads);
    else
      MK_LAUNCH((swiglu_bwd_kernel<T, 1, K>), grid, block, 0, s, a, p.group_threads);
  } else {
    if (vec)
      MK_LAUNCH((swiglu_fwd_kernel<T, V, K>), grid, block, 0, s, a, p.group_threads);
    else
      MK_LAUNCH((swiglu_fwd_kernel<T, 1, K>), grid, block, 0, s, a, p.group_threads);
  }
  return last_error();
}

template <bool BWD, Act K>
const char* dispatch_dtype(const Args& a, cudaStream_t s) {
  switch (a.dtype) {
    case DType::F32: return run<float, BWD, K>(a, s);
    case DType::F64: return run<double, BWD, K>(a, s);
    case DType::BF16: return run<__nv_bfloat16, BWD, K>(a, s);
    case DType::F16: return run<__half, BWD, K>(a, s);
  }
  return "unsupported dtype";
}

template <bool BWD>
const char* dispatch(const Args& a, void* stream) {
  if (a.rows == 0 || a.f == 0) return nullptr;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (a.act) {
    case Act::SiLU: return dispatch_dtype<BWD, Act::SiLU>(a, s);
    case Act::ClampedSiLU: return dispatch_dtype<BWD, Act::ClampedSiLU>(a, s);
    case Act::GeluTanh: return dispatch_dtype<BWD, Act::GeluTanh>(a, s);
  }
  return "unsupported activation";
}

}  // namespace

const char* swiglu_fwd(const Args& a, void* stream) { return dispatch<false>(a, stream); }
const char* swiglu_bwd(const Args& a, void* stream) { return dispatch<true>(a, stream); }

}  // namespace MK_NS
}  // namespace megakernels
