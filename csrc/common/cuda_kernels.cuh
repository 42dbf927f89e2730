// Building blocks shared by the torch-free CUDA kernel files (csrc/<family>/<family>_cuda.cu): element conversion,
// 16-byte packs, row-group reductions and launch-planning helpers. Include after "cuda_compat.h".
//
// Everything here sits in namespace megakernels::MK_NS (cuda for nvcc builds, cuda_emu for the emulator) inside an
// anonymous namespace: the nvcc objects and the emulated objects are linked into one library, and host helpers
// such as sm_count() call a different runtime in each, so they must never be merged by the linker.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>

#include "cuda_compat.h"
#include "math.h"

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
    std::fprintf(stderr, "[megakernels cuda_emu] misaligned %d-byte vector access at %p\n", int(sizeof(Pack<T, N>)),
                 static_cast<const void*>(p));
    __trap();
  }
#endif
  return reinterpret_cast<Pack<T, N>*>(p);
}
template <typename T, int N>
__device__ __forceinline__ const Pack<T, N>* pack_at(const T* p) {
  return pack_at<T, N>(const_cast<T*>(p));
}

// Element k of a pack in the accumulate type. bf16 pairs share a 32-bit word, low half first: the low element
// converts with a shift and the high one with a mask, where __bfloat162float of the high half costs an extract
// (PRMT) and a shift. k is a constant of an unrolled loop, so the choice folds away.
template <typename T, int N>
__device__ __forceinline__ auto pack_acc(const Pack<T, N>& pk, int k) {
  return to_acc(pk.v[k]);
}
template <int N>
__device__ __forceinline__ float pack_acc(const Pack<__nv_bfloat16, N>& pk, int k) {
  if constexpr (N % 2 == 0) {
    uint32_t word;
    std::memcpy(&word, &pk.v[k & ~1], sizeof(word));
    return __uint_as_float((k & 1) ? (word & 0xffff0000u) : (word << 16));
  } else {
    return to_acc(pk.v[k]);
  }
}

template <typename T, int N, typename A>
__device__ __forceinline__ void load_pack(const T* p, int64_t j, A (&out)[N]) {
  const Pack<T, N> pk = *pack_at<T, N>(p + j);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = A(pack_acc(pk, k));
}

// A pack kept in its storage type (half the registers of its fp32 values for 16-bit types).
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_raw(const T* p, int64_t j) {
  return *pack_at<T, N>(p + j);
}

// A pack of 16 or 8 bytes in global memory is stored with one st.global.v4/v2.b32 (no memory clobber: no kernel
// here reads back what it stores through another pointer). Stored as a struct (or as a uint4 built from it),
// nvcc sometimes splits it into per-element stores: it did for every pack of the AdamW kernel with fp32 master
// weights, whose stores all came out as 4-byte and 2-byte STGs. Shared memory: store_shared_pack.
template <typename T, int N, typename A>
__device__ __forceinline__ void store_shared_pack(T* p, int64_t j, const A (&in)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int k = 0; k < N; ++k) pk.v[k] = Cvt<T>::from(in[k]);
  *pack_at<T, N>(p + j) = pk;
}

template <typename T, int N, typename A>
__device__ __forceinline__ void store_pack(T* p, int64_t j, const A (&in)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int k = 0; k < N; ++k) pk.v[k] = Cvt<T>::from(in[k]);
#if !MK_CUDA_EMU
  constexpr int bytes = int(sizeof(pk));
  if constexpr (bytes == 16 || bytes == 8) {
    unsigned int w[bytes / 4];
    std::memcpy(w, &pk, bytes);
    Pack<T, N>* q = pack_at<T, N>(p + j);
    if constexpr (bytes == 16)
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(q), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]));
    else
      asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(q), "r"(w[0]), "r"(w[1]));
    return;
  }
#endif
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
  __device__ __forceinline__ A operator()(A a, A b) const {
    return b > a ? b : a;
  }
};
struct SumOp {
  template <typename A>
  __device__ __forceinline__ A operator()(A a, A b) const {
    return a + b;
  }
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

// K reductions at once (`op`: SumOp, MaxOp) over each row group of a block whose groups run in lockstep (every
// thread of the block calls this the same number of times, so the barriers are never divergent): groups of
// `group_threads` (a multiple of 32) consecutive threads; every thread gets its group's results. `smem` holds at
// least 32 * K values. The same butterflies run in every warp of a group, so every thread of the group gets the
// same bits.
template <int K, typename A, typename Op>
__device__ __forceinline__ void groups_reduce(A (&v)[K], int group_threads, A* smem, A identity, Op op) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v[k] = op(v[k], __shfl_xor_sync(0xffffffffu, v[k], o));
  }
  if (group_threads <= 32) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // every warp has read the previous call's values
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) smem[k * 32 + warp] = v[k];
  }
  __syncthreads();
  // Lane l of every warp picks up warp l of its group; a butterfly over the lanes combines them (no loop: the row
  // loops that call this stay innermost).
  const int first = threadIdx.x / group_threads * (group_threads >> 5);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    v[k] = lane < (group_threads >> 5) ? smem[k * 32 + first + lane] : identity;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v[k] = op(v[k], __shfl_xor_sync(0xffffffffu, v[k], o));
  }
}

template <int K, typename A>
__device__ __forceinline__ void groups_sum(A (&v)[K], int group_threads, A* smem) {
  groups_reduce<K>(v, group_threads, smem, A(0), SumOp());
}

// fmaxf: a NaN operand is dropped (callers that must propagate NaN carry it through a sum instead).
struct FmaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
template <int K>
__device__ __forceinline__ void groups_max(float (&v)[K], int group_threads, float* smem) {
  groups_reduce<K>(v, group_threads, smem, -INFINITY, FmaxOp());
}

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

// out[j] = sum over parts w of partial[w * stride + j], deterministic and wide: a block takes 32 column packs of
// V columns (V = 4: float4 loads where the layout allows, else 1) and up to 32 part-lanes (a power of two, fewer
// for few parts); lane l sums parts l, l + lanes, ... in order (their loads all in flight), then lane 0 adds the
// lane sums in order. The result depends on the number of parts only, never on timing. The parts are a few
// hundred rows of a few thousand floats: the time is the latency of one round of loads, not a serial walk.
constexpr int kSumCols = 32;
constexpr int kSumLanes = 32;
template <typename W, typename A, int V>
__global__ void __launch_bounds__(kSumCols* kSumLanes)
    column_sum_kernel(const A* partial, int64_t parts, int64_t stride, int64_t H, W* out) {
  __shared__ A lane_sums[kSumLanes][kSumCols * V];
  const int c = threadIdx.x, lane = threadIdx.y, lanes = blockDim.y;  // lanes <= kSumLanes (fewer parts: fewer)
  const int64_t j = (int64_t(blockIdx.x) * kSumCols + c) * V;
  A s[V];
#pragma unroll
  for (int k = 0; k < V; ++k) s[k] = A(0);
  if (j < H) {
#pragma unroll 4
    for (int64_t w = lane; w < parts; w += lanes) {
      A v[V];
      load_pack<A, V>(partial, w * stride + j, v);
#pragma unroll
      for (int k = 0; k < V; ++k) s[k] += v[k];
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k) lane_sums[lane][c * V + k] = s[k];
  __syncthreads();
  if (lane == 0 && j < H) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      A total = A(0);
      for (int l = 0; l < lanes; ++l) total += lane_sums[l][c * V + k];
      out[j + k] = Cvt<W>::from(total);
    }
  }
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

inline RowPlan plan_rows(int64_t rows, int64_t packs, int max_blocks_per_sm, int max_threads = 1024) {
  RowPlan p;
  if (packs <= 32 * 8) {
    p.group_threads = 32;
    p.block = 128;
  } else {
    const int64_t threads = (packs / 8 + 31) / 32 * 32;
    p.group_threads = p.block = int(threads < 64 ? 64 : (threads > max_threads ? max_threads : threads));
  }
  const int64_t groups = p.block / p.group_threads;
  const int64_t needed = (rows + groups - 1) / groups;
  const int64_t cap = int64_t(sm_count()) * max_blocks_per_sm;
  p.grid = needed < cap ? needed : cap;
  if (p.grid < 1) p.grid = 1;
  return p;
}

inline int64_t dtype_bytes(DType d) { return d == DType::F64 ? 8 : (d == DType::F32 ? 4 : 2); }

// plan_rows for rows of `hidden` elements of `x_dtype` in 16-byte packs (the vector width decides the shape,
// scalar path or not). `max_blocks_per_sm` bounds the grid: row groups loop over the remaining rows.
inline RowPlan row_plan(int64_t rows, int64_t hidden, DType x_dtype, int max_blocks_per_sm) {
  const int64_t per_pack = 16 / dtype_bytes(x_dtype);
  return plan_rows(rows, (hidden + per_pack - 1) / per_pack, max_blocks_per_sm);
}

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

template <typename W, typename A>
const char* launch_column_sum(const void* ws, int64_t workers, int64_t stride, int64_t offset, int64_t H, void* out,
                              cudaStream_t s) {
  if (!out) return nullptr;
  const A* base = static_cast<const A*>(ws) + offset;
  // The emulator runs every thread as a host thread: 2 lanes there still take the lane-combining path.
  const int max_lanes = MK_CUDA_EMU ? 2 : kSumLanes;
  int lanes = 1;
  while (lanes < max_lanes && lanes < workers) lanes *= 2;
  const dim3 block(kSumCols, unsigned(lanes));
  if (H % 4 == 0 && stride % 4 == 0 && aligned(base, 4 * sizeof(A))) {
    MK_LAUNCH((column_sum_kernel<W, A, 4>), dim3(unsigned((H + 4 * kSumCols - 1) / (4 * kSumCols))), block, 0, s, base,
              workers, stride, H, static_cast<W*>(out));
  } else {
    MK_LAUNCH((column_sum_kernel<W, A, 1>), dim3(unsigned((H + kSumCols - 1) / kSumCols)), block, 0, s, base, workers,
              stride, H, static_cast<W*>(out));
  }
  return last_error();
}

// (x dtype, parameter dtype) -> F<T, W>::run(a, stream): parameters in x's dtype, or fp32 for a 16-bit x.
template <template <typename, typename> class F, typename Args>
const char* dispatch_x_w(const Args& a, void* stream) {
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

}  // namespace
}  // namespace MK_NS
}  // namespace megakernels
