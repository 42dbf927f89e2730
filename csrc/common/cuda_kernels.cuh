// Building blocks shared by the torch-free CUDA kernel files (csrc/<family>/<family>_cuda.cu): element conversion,
// 16-byte packs, row-group reductions and launch-planning helpers. Include after "cuda_compat.h".
//
// Everything here sits in namespace megakernels::MK_NS (cuda for nvcc builds, cuda_emu for the emulator) inside an
// anonymous namespace: the nvcc objects and the emulated objects are linked into one library, and host helpers
// such as sm_count() call a different runtime in each, so they must never be merged by the linker.
#pragma once
#include <cstdint>
#include <cstdio>

#include "cuda_compat.h"

#ifdef MEGAKERNELS_CUDA_EMU
#define MK_NS cuda_emu
#else
#define MK_NS cuda
#endif

namespace megakernels {
namespace MK_NS {
namespace {

// Accumulate type: fp32 for every storage type but fp64.
template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

// Round-to-nearest-even conversion from the accumulate type to storage.
template <typename T>
struct Cvt;
template <>
struct Cvt<float> {
  __device__ __forceinline__ static float from(float v) { return v; }
};
template <>
struct Cvt<double> {
  __device__ __forceinline__ static double from(double v) { return v; }
};
template <>
struct Cvt<__half> {
  __device__ __forceinline__ static __half from(float v) { return __float2half_rn(v); }
};
template <>
struct Cvt<__nv_bfloat16> {
  __device__ __forceinline__ static __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
};

// N elements loaded or stored as one aligned access (16 bytes for the vector instantiations).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// The address of a pack. A GPU faults on a vector access that is not aligned to its size, while the x86 host
// running the emulator does not: so the emulated build checks the alignment here and traps with the kernel,
// block and thread named, instead of silently passing a test that would crash on the device.
template <typename T, int N>
__device__ __forceinline__ Pack<T, N>* pack_at(T* p) {
#if MK_CUDA_EMU
  if (reinterpret_cast<uintptr_t>(p) % alignof(Pack<T, N>) != 0) {
    std::fprintf(stderr, "[megakernels cuda_emu] misaligned %d-byte vector access at %p\n",
                 int(sizeof(Pack<T, N>)), static_cast<const void*>(p));
    __trap();
  }
#endif
  return reinterpret_cast<Pack<T, N>*>(p);
}
template <typename T, int N>
__device__ __forceinline__ const Pack<T, N>* pack_at(const T* p) {
  return pack_at<T, N>(const_cast<T*>(p));
}

template <typename T, int N, typename A>
__device__ __forceinline__ void load_pack(const T* p, int64_t j, A (&out)[N]) {
  const Pack<T, N> pk = *pack_at<T, N>(p + j);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = A(to_acc(pk.v[k]));
}

template <typename T, int N, typename A>
__device__ __forceinline__ void store_pack(T* p, int64_t j, const A (&in)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int k = 0; k < N; ++k) pk.v[k] = Cvt<T>::from(in[k]);
  *pack_at<T, N>(p + j) = pk;
}

// store_pack into global memory as one 16-byte access, always. store_pack leaves merging the element stores of a
// pack of __nv_bfloat16/__half to the compiler, which cannot merge them across the conversions' inline assembly
// once it has interleaved the two (seen in rope_cuda.cu: eight 2-byte stores per pack, 4x the store
// instructions). Packs of other sizes, and the emulator, go through store_pack.
template <typename T, int N, typename A>
__device__ __forceinline__ void store_pack_global(T* p, int64_t j, const A (&in)[N]) {
#if MK_CUDA_EMU
  store_pack<T, N>(p, j, in);
#else
  if constexpr (sizeof(T) * N == 16) {
    Pack<T, N> pk;
#pragma unroll
    for (int k = 0; k < N; ++k) pk.v[k] = Cvt<T>::from(in[k]);
    uint32_t w[4];
    memcpy(w, &pk, 16);
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(pack_at<T, N>(p + j)), "r"(w[0]), "r"(w[1]),
                 "r"(w[2]), "r"(w[3])
                 : "memory");
  } else {
    store_pack<T, N>(p, j, in);
  }
#endif
}

struct MaxOp {
  template <typename A>
  __device__ __forceinline__ A operator()(A a, A b) const { return b > a ? b : a; }
};
struct SumOp {
  template <typename A>
  __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};

// Reduction over a row group (a warp, or the whole block): shuffles within the warp; for a block-wide group one
// more level through shared memory `smem` (>= 32 elements). `group_threads` must be uniform over the block, so
// the __syncthreads() below are never divergent. Every lane gets the result (xor butterflies are symmetric).
template <typename A, typename Op>
__device__ __forceinline__ A group_reduce(A v, int group_threads, A* smem, A identity, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (group_threads <= 32) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();  // every warp has read the previous reduction's smem
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < warps ? smem[lane] : identity;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <typename A>
__device__ __forceinline__ A group_sum(A v, int group_threads, A* smem) {
  return group_reduce(v, group_threads, smem, A(0), SumOp());
}

// ---- host side -------------------------------------------------------------------------------------------------

inline int sm_count() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    sms = 1;
  return sms > 0 ? sms : 1;
}

inline bool aligned(const void* p, int64_t bytes) {
  return p == nullptr || (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

// nullptr after a successful launch, else the CUDA error string (the launchers' return convention).
inline const char* last_error() {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

// Row-wise launch shape. A row group of one warp serves rows of up to 8 packs per lane (4 rows per 128-thread
// block); longer rows get a whole block of 64..1024 threads, ~8 packs each. The grid is capped at
// `max_blocks_per_sm` per SM and row groups loop over the remaining rows.
struct RowPlan {
  int group_threads;  // threads per row
  int block;          // threads per block
  int64_t grid;
  int64_t workers() const { return grid * (block / group_threads); }  // row groups in the grid
};

inline RowPlan plan_rows(int64_t rows, int64_t packs, int max_blocks_per_sm) {
  RowPlan p;
  if (packs <= 32 * 8) {
    p.group_threads = 32;
    p.block = 128;
  } else {
    const int64_t threads = (packs / 8 + 31) / 32 * 32;
    p.group_threads = p.block = int(threads < 64 ? 64 : (threads > 1024 ? 1024 : threads));
  }
  const int64_t groups = p.block / p.group_threads;
  const int64_t needed = (rows + groups - 1) / groups;
  const int64_t cap = int64_t(sm_count()) * max_blocks_per_sm;
  p.grid = needed < cap ? needed : cap;
  if (p.grid < 1) p.grid = 1;
  return p;
}

}  // namespace
}  // namespace MK_NS
}  // namespace megakernels
