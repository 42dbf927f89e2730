// CUDA kernel of rotary position embedding, q and k in one launch, forward and inverse (backward). No torch
// headers: compiles in seconds with nvcc, and unchanged with g++ against csrc/emu (rope_cuda_emu.cpp).
//
// Design (why):
// - A "lane group" of `lanes` threads owns one head row at a time; lane p owns NP consecutive pairs (a 16-byte
//   pack: for the half-rotated layout one pack from each half of the row, for the interleaved one pack of NP
//   pairs). A warp's load of one head therefore covers whole 128-byte segments of that row.
// - A work item is (token, slice of heads of q or of k). The item's NP (cos, sin) pairs are computed once and
//   applied to every head of the slice: the trigonometry (a double-precision range reduction and fp32
//   polynomials, rope.h) costs ~1/(2 * heads_per_slice) of its price per element. Slices are as large as the
//   grid allows while still filling the GPU (launch planning below).
// - inv_freq (theta^(-2i/d), double then fp32) is computed once per block into shared memory.
// - Any strides on the token and head dims (q and k sliced out of a fused QKV projection): the kernel indexes
//   them; 16-byte packs are used when every row start is aligned, else single elements.
#include <cstdint>

#include "../common/cuda_compat.h"
#include "../common/cuda_kernels.cuh"
#include "rope.h"

namespace megakernels {
namespace MK_NS {
namespace {

using rope::Args;

template <typename T, int N, bool VEC, typename A>
__device__ __forceinline__ void load_n(const T* p, int64_t j, A (&out)[N]) {
  if constexpr (VEC) {
    load_pack<T, N>(p, j, out);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = A(to_acc(p[j + k]));
  }
}

template <typename T, int N, bool VEC, typename A>
__device__ __forceinline__ void store_n(T* p, int64_t j, const A (&in)[N]) {
  if constexpr (VEC) {
    store_pack_global<T, N>(p, j, in);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[j + k] = Cvt<T>::from(in[k]);
  }
}

// Pairs [i0, i0 + NP) of one head row: x -> y, rotated by (c, s).
template <typename T, bool INTERLEAVED, int NP, bool VEC, typename A>
__device__ __forceinline__ void rotate_pack(const T* x, T* y, int64_t half, int64_t i0, const A (&c)[NP],
                                            const A (&s)[NP]) {
  if constexpr (INTERLEAVED) {
    A e[2 * NP];
    load_n<T, 2 * NP, VEC>(x, 2 * i0, e);
#pragma unroll
    for (int k = 0; k < NP; ++k) {
      const A x1 = e[2 * k], x2 = e[2 * k + 1];
      e[2 * k] = x1 * c[k] - x2 * s[k];
      e[2 * k + 1] = x2 * c[k] + x1 * s[k];
    }
    store_n<T, 2 * NP, VEC>(y, 2 * i0, e);
  } else {
    A lo[NP], hi[NP];
    load_n<T, NP, VEC>(x, i0, lo);
    load_n<T, NP, VEC>(x, half + i0, hi);
#pragma unroll
    for (int k = 0; k < NP; ++k) {
      const A x1 = lo[k], x2 = hi[k];
      lo[k] = x1 * c[k] - x2 * s[k];
      hi[k] = x2 * c[k] + x1 * s[k];
    }
    store_n<T, NP, VEC>(y, i0, lo);
    store_n<T, NP, VEC>(y, half + i0, hi);
  }
}

template <typename T, bool INTERLEAVED, int NP, bool VEC>
__global__ void rope_kernel(Args a, int lanes, int64_t heads_per_slice) {
  using A = typename AccOf<T>::type;
  MK_DYNAMIC_SHARED(float, inv_s);
  const int64_t half = a.d / 2;
  if (!a.cos_sin) {
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) inv_s[i] = rope::inv_freq(i, a.d, a.log2_theta);
    __syncthreads();
  }
  const int slots = blockDim.x / lanes, lane = threadIdx.x % lanes, slot = threadIdx.x / lanes;
  if (slot >= slots) return;  // no barrier follows
  const int64_t packs = half / NP;
  const int64_t slices_q = (a.heads[0] + heads_per_slice - 1) / heads_per_slice;
  const int64_t slices = slices_q + (a.heads[1] + heads_per_slice - 1) / heads_per_slice;
  const int64_t items = a.n0 * a.n1 * slices;
  const A sign = a.inverse ? A(-1) : A(1);
  for (int64_t item = int64_t(blockIdx.x) * slots + slot; item < items; item += int64_t(gridDim.x) * slots) {
    const int64_t token = item / slices, slice = item - token * slices;
    const int64_t i0 = token / a.n1, i1 = token - i0 * a.n1;
    const int64_t pos = rope::position_of(a, i0, i1);
    const bool is_q = slice < slices_q;  // selects, not indexing: Args stays in parameter space
    const int64_t heads = is_q ? a.heads[0] : a.heads[1];
    const int64_t h_begin = (is_q ? slice : slice - slices_q) * heads_per_slice;
    const int64_t h_end = h_begin + heads_per_slice < heads ? h_begin + heads_per_slice : heads;
    const T* xb = static_cast<const T*>(is_q ? a.x[0] : a.x[1]) + i0 * (is_q ? a.xs0[0] : a.xs0[1]) +
                  i1 * (is_q ? a.xs1[0] : a.xs1[1]);
    T* yb =
        static_cast<T*>(is_q ? a.y[0] : a.y[1]) + i0 * (is_q ? a.ys0[0] : a.ys0[1]) + i1 * (is_q ? a.ys1[0] : a.ys1[1]);
    const int64_t xsh = is_q ? a.xsh[0] : a.xsh[1], ysh = is_q ? a.ysh[0] : a.ysh[1];
    const bool in_table = pos >= 0 && pos < a.max_pos;
    for (int64_t p = lane; p < packs; p += lanes) {
      const int64_t i0p = p * NP;
      A c[NP], s[NP];
      if (a.cos_sin) {
        // Out-of-range positions are refused by the bindings; here they only must not read outside the table.
        const float* row = a.cos_sin + (in_table ? pos : 0) * a.d + 2 * i0p;
#pragma unroll
        for (int k = 0; k < NP; ++k) {
          const Pack<float, 2> cs = *pack_at<float, 2>(row + 2 * k);
          c[k] = in_table ? A(cs.v[0]) : A(NAN);
          s[k] = sign * A(cs.v[1]);
        }
      } else {
        const float pf = float(pos);
#pragma unroll
        for (int k = 0; k < NP; ++k) {
          rope::sincos_angle(pf * inv_s[i0p + k], s[k], c[k]);
          s[k] *= sign;
        }
      }
#pragma unroll 2
      for (int64_t h = h_begin; h < h_end; ++h)
        rotate_pack<T, INTERLEAVED, NP, VEC>(xb + h * xsh, yb + h * ysh, half, i0p, c, s);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Launch planning (host side).

constexpr int kBlock = 256;
constexpr int kBlocksPerSm = 8;

template <typename T, bool INTERLEAVED, int NP, bool VEC>
const char* launch(const Args& a, cudaStream_t stream) {
  const int64_t half = a.d / 2, packs = half / NP;
  const int lanes = int(packs < kBlock ? packs : kBlock);
  const int slots = kBlock / lanes;
  const int64_t tokens = a.n0 * a.n1;
  // Heads per slice: all of them when the tokens alone fill the GPU, else split so that they do.
  const int64_t max_heads = a.heads[0] > a.heads[1] ? a.heads[0] : a.heads[1];
  const int64_t want = int64_t(sm_count()) * 2048, have = tokens * lanes * 2;
  const int64_t splits = have >= want ? 1 : (want + have - 1) / have;
  int64_t hps = (max_heads + splits - 1) / splits;
  if (hps < 1) hps = 1;
  const int64_t slices = (a.heads[0] + hps - 1) / hps + (a.heads[1] + hps - 1) / hps;
  const int64_t items = tokens * slices;
  int64_t grid = (items + slots - 1) / slots;
  const int64_t cap = int64_t(sm_count()) * kBlocksPerSm;
  if (grid > cap) grid = cap;
  const size_t smem = a.cos_sin ? 0 : size_t(half) * sizeof(float);
  MK_LAUNCH((rope_kernel<T, INTERLEAVED, NP, VEC>), dim3(unsigned(grid)), dim3(lanes * slots), smem, stream, a, lanes,
            hps);
  return last_error();
}

// 16-byte packs need every row start of x and y (both tensors) aligned and the pack to divide the row.
template <typename T>
bool vector_ok(const Args& a, int64_t elems) {
  constexpr int64_t V = 16 / sizeof(T);
  if (elems % V != 0) return false;
  for (int u = 0; u < 2; ++u) {
    if (!aligned(a.x[u], 16) || !aligned(a.y[u], 16)) return false;
    const int64_t strides[6] = {a.xs0[u], a.xs1[u], a.xsh[u], a.ys0[u], a.ys1[u], a.ysh[u]};
    for (int64_t st : strides)
      if (st % V != 0) return false;
  }
  return true;
}

template <typename T>
const char* run(const Args& a, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  const int64_t half = a.d / 2;
  if (a.interleaved) {
    if (vector_ok<T>(a, a.d)) return launch<T, true, V / 2, true>(a, s);
    return launch<T, true, 1, false>(a, s);
  }
  if (vector_ok<T>(a, half)) return launch<T, false, V, true>(a, s);
  return launch<T, false, 1, false>(a, s);
}

}  // namespace

const char* rope(const Args& a, void* stream) {
  if (a.n0 * a.n1 == 0 || a.d == 0 || a.heads[0] + a.heads[1] == 0) return nullptr;
  if (!a.cos_sin && a.d / 2 > 12288) return "head dim above 24576: inv_freq does not fit the 48 KiB of shared memory";
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case DType::F32: return run<float>(a, s);
    case DType::F64: return run<double>(a, s);
    case DType::BF16: return run<__nv_bfloat16>(a, s);
    case DType::F16: return run<__half>(a, s);
  }
  return "unsupported dtype";
}

}  // namespace MK_NS
}  // namespace megakernels
