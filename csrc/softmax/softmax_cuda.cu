// CUDA kernels of the softmax family (scaled, scaled + boolean mask, scaled + causal mask), forward and backward.
// No torch headers: compiles in seconds with nvcc, and unchanged with g++ against csrc/emu (softmax_cuda_emu.cpp).
//
// The row-resident kernels of softmax_rows.cuh take aligned rows of 16-byte packs up to 16k elements (one read,
// one exp per element; their design notes are there). The looping kernels below take everything else.
//
// Design of the looping kernels (why):
// - A "row group" owns a row. One warp for rows of up to 8 packs per lane (sk <= 2048 bf16 / 1024 fp32): the
//   reductions are pure shuffles and a 128-thread block serves 4 rows. Longer rows get a whole block (64..512
//   threads, ~8 packs per thread before the cap) and loop, so any sk works: there is no register-resident row and no
//   per-length instantiation, which is what capped Megatron's kernels at 16k (2k for the causal one).
// - Packs are 16 bytes (8 bf16/fp16, 4 fp32): one vectorised load per pack, the widest the memory system issues,
//   used when sk is a multiple of the pack and every row start is 16-byte aligned; otherwise packs of 1.
// - Forward is two passes over x: an online (max, sum of exp) pass, rescaled once per pack rather than once per
//   element, then a pass that writes y. The second read of the row hits L1/L2 (it was just read by the same
//   threads), so x costs ~one DRAM read: the same traffic as caching it, without its size limit.
// - The causal kernel runs both passes over the valid prefix of each row only (the straddling pack is read
//   element by element) and writes the masked tail without reading x: about half the reads and exps of the full
//   square for sq == sk.
// - Every pass takes the packs wholly inside the valid prefix in a loop of its own, with no per-element test;
//   the straddling pack (causal) and every pack of a boolean-masked row take the general loop after it.
// - The boolean mask is read through its own strides, so a [1 or b, 1 or h, 1 or sq, sk] mask is broadcast in
//   place, never materialised.
// - Backward needs only y and dy: one pass for sum(dy * y), one that writes dx (again re-reading from cache).
#include <cstdint>

#include "../common/cuda_compat.h"
#include "../common/cuda_kernels.cuh"
#include "softmax.h"
#include "softmax_rows.cuh"

namespace megakernels {
namespace MK_NS {
namespace {

using softmax::BwdArgs;
using softmax::FwdArgs;
using softmax::MaskKind;

template <int N>
__device__ __forceinline__ void load_mask(const unsigned char* m, int64_t j, bool (&out)[N]) {
  Pack<unsigned char, N> pk = *pack_at<unsigned char, N>(m + j);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = pk.v[k] != 0;
}

// N elements of x from the row's valid prefix [0, n) (load_prefix), and which of them take part: not masked
// (boolean mask) and inside the prefix: the forward passes' general loops.
template <typename T, int N, MaskKind K, typename A>
__device__ __forceinline__ void load_valid(const T* xr, const unsigned char* mr, int64_t j, int64_t n, A (&z)[N],
                                           bool (&ok)[N]) {
  if (K == MaskKind::Causal)
    load_prefix<T, N>(xr, j, n, z);
  else
    load_pack<T, N>(xr, j, z);  // n == sk, a multiple of N: never a partial pack
  if (K == MaskKind::Bool) {
    load_mask<N>(mr, j, ok);
#pragma unroll
    for (int k = 0; k < N; ++k) ok[k] = !ok[k];
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) ok[k] = j + k < n;
  }
}

// The first of a thread's positions j0, j0 + step, ... at or after `from`.
__device__ __forceinline__ int64_t first_at_or_after(int64_t j0, int64_t from, int64_t step) {
  return j0 >= from ? j0 : j0 + (from - j0 + step - 1) / step * step;
}

__device__ __forceinline__ bool group_any(bool p, int group_threads) {
  return group_threads <= 32 ? __any_sync(0xffffffffu, p) != 0 : __syncthreads_or(p) != 0;
}

template <typename T, int N, MaskKind K>
__global__ void softmax_fwd_kernel(FwdArgs a, int group_threads) {
  using A = typename AccOf<T>::type;
  __shared__ A smem[32];
  const A scale = A(a.scale);
  const A ninf = -A(INFINITY);
  const int64_t sk = a.sk;
  const int groups = blockDim.x / group_threads;
  const int t = threadIdx.x % group_threads;
  const int64_t step = int64_t(group_threads) * N;
  for (int64_t row = int64_t(blockIdx.x) * groups + threadIdx.x / group_threads; row < a.rows;
       row += int64_t(gridDim.x) * groups) {
    const T* xr = static_cast<const T*>(a.x) + row * sk;
    T* yr = static_cast<T*>(a.y) + row * sk;
    const int64_t i = row % a.sq;
    const int64_t n = K == MaskKind::Causal ? softmax::causal_valid(i, a.sq, sk) : sk;
    const unsigned char* mr = nullptr;
    if (K == MaskKind::Bool) {
      const int64_t bh = row / a.sq;
      mr = a.mask + (bh / a.heads) * a.mask_sb + (bh % a.heads) * a.mask_sh + i * a.mask_sq;
    }
    // Pass 1: this thread's running max m and sum s of exp(z - m) over its valid elements. -inf inputs add
    // nothing (and must not: exp(-inf - -inf) is NaN); a NaN input makes s NaN.
    A m = ninf, s = A(0);
    bool any_valid = false;
    // Packs wholly inside the valid prefix (all of them but a causal row's straddling pack; none with a boolean
    // mask, which is tested per element) take a loop without per-element tests: a -inf input adds exp(-inf) = 0
    // as long as the running max is finite, so only a pack seen while it is still -inf needs a stand-in (0).
    const int64_t n_full = K == MaskKind::Bool ? 0 : n / N * N;
    for (int64_t j = int64_t(t) * N; j < n_full; j += step) {
      A z[N];
      load_pack<T, N>(xr, j, z);
      A pm = ninf;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        z[k] *= scale;
        pm = MaxOp()(pm, z[k]);
      }
      if (pm > m) {
        s = s * softmax::softmax_exp(m - pm);
        m = pm;
      }
      const A mm = m == ninf ? A(0) : m;
#pragma unroll
      for (int k = 0; k < N; ++k) s += softmax::softmax_exp(z[k] - mm);
    }
    for (int64_t j = first_at_or_after(int64_t(t) * N, n_full, step); j < n; j += step) {
      A z[N];
      bool ok[N];
      load_valid<T, N, K>(xr, mr, j, n, z, ok);
      A pm = ninf;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        z[k] = ok[k] ? z[k] * scale : ninf;
        pm = MaxOp()(pm, z[k]);
        any_valid |= ok[k];
      }
      if (pm > m) {
        s = s * softmax::softmax_exp(m - pm);
        m = pm;
      }
#pragma unroll
      for (int k = 0; k < N; ++k) s += z[k] == ninf ? A(0) : softmax::softmax_exp(z[k] - m);
    }
    const A gm = group_reduce(m, group_threads, smem, ninf, MaxOp());
    const A gs = group_reduce(m == ninf ? A(0) : s * softmax::softmax_exp(m - gm), group_threads, smem, A(0), SumOp());
    const bool row_valid = K == MaskKind::Bool ? group_any(any_valid, group_threads) : n > 0;
    // Valid inputs that are all -inf, or a +inf among them, give torch.softmax's NaN row.
    A inv = (gm == ninf || gm == -ninf) ? A(NAN) : A(1) / gs;
    if (!row_valid) inv = A(0);
    const A fill = A(0) * inv;  // masked positions: 0, or NaN in a NaN row
    // Pass 2: write y over the whole row; x is re-read (from cache) only where it is valid. The packs of the
    // valid prefix first, without per-element tests (n_full > 0 implies a valid row).
    for (int64_t j = int64_t(t) * N; j < n_full; j += step) {
      A z[N];
      load_pack<T, N>(xr, j, z);
#pragma unroll
      for (int k = 0; k < N; ++k) z[k] = softmax::softmax_exp(z[k] * scale - gm) * inv;
      store_pack<T, N>(yr, j, z);
    }
    for (int64_t j = first_at_or_after(int64_t(t) * N, n_full, step); j < sk; j += step) {
      A z[N];
      if (j < n && row_valid) {
        bool ok[N];
        load_valid<T, N, K>(xr, mr, j, n, z, ok);
#pragma unroll
        for (int k = 0; k < N; ++k) z[k] = ok[k] ? softmax::softmax_exp(z[k] * scale - gm) * inv : fill;
      } else {
#pragma unroll
        for (int k = 0; k < N; ++k) z[k] = fill;
      }
      store_pack<T, N>(yr, j, z);
    }
  }
}

template <typename T, int N, bool CAUSAL>
__global__ void softmax_bwd_kernel(BwdArgs a, int group_threads) {
  using A = typename AccOf<T>::type;
  __shared__ A smem[32];
  const A scale = A(a.scale);
  const int64_t sk = a.sk;
  const int groups = blockDim.x / group_threads;
  const int t = threadIdx.x % group_threads;
  const int64_t step = int64_t(group_threads) * N;
  for (int64_t row = int64_t(blockIdx.x) * groups + threadIdx.x / group_threads; row < a.rows;
       row += int64_t(gridDim.x) * groups) {
    const T* yr = static_cast<const T*>(a.y) + row * sk;
    const T* gr = static_cast<const T*>(a.dy) + row * sk;
    T* dxr = static_cast<T*>(a.dx) + row * sk;
    const int64_t n = CAUSAL ? softmax::causal_valid(row % a.sq, a.sq, sk) : sk;
    const int64_t n_full = n / N * N;  // packs wholly inside the valid prefix: no per-element tests
    A s = A(0);
    for (int64_t j = int64_t(t) * N; j < n_full; j += step) {
      A y[N], g[N];
      load_pack<T, N>(yr, j, y);
      load_pack<T, N>(gr, j, g);
#pragma unroll
      for (int k = 0; k < N; ++k) s += y[k] * g[k];
    }
    for (int64_t j = first_at_or_after(int64_t(t) * N, n_full, step); j < n; j += step) {
      A y[N], g[N];
      if (CAUSAL) {
        load_prefix<T, N>(yr, j, n, y);  // past n both read as 0
        load_prefix<T, N>(gr, j, n, g);
      } else {
        load_pack<T, N>(yr, j, y);
        load_pack<T, N>(gr, j, g);
      }
#pragma unroll
      for (int k = 0; k < N; ++k) s += y[k] * g[k];
    }
    s = group_reduce(s, group_threads, smem, A(0), SumOp());
    for (int64_t j = int64_t(t) * N; j < n_full; j += step) {
      A y[N], d[N];
      load_pack<T, N>(yr, j, y);
      load_pack<T, N>(gr, j, d);
#pragma unroll
      for (int k = 0; k < N; ++k) d[k] = scale * y[k] * (d[k] - s);
      store_pack<T, N>(dxr, j, d);
    }
    for (int64_t j = first_at_or_after(int64_t(t) * N, n_full, step); j < sk; j += step) {
      A d[N];
      if (j < n) {
        A y[N];
        if (CAUSAL) {
          load_prefix<T, N>(yr, j, n, y);
          load_prefix<T, N>(gr, j, n, d);
        } else {
          load_pack<T, N>(yr, j, y);
          load_pack<T, N>(gr, j, d);
        }
#pragma unroll
        for (int k = 0; k < N; ++k) d[k] = j + k < n ? scale * y[k] * (d[k] - s) : A(0);
      } else {
#pragma unroll
        for (int k = 0; k < N; ++k) d[k] = A(0);
      }
      store_pack<T, N>(dxr, j, d);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Launch planning (host side).

constexpr int kBlocksPerSm = 16;  // enough resident blocks to hide latency; row groups loop beyond
// Long rows get blocks of at most 512 threads: a kernel over 32 registers a thread (the causal ones, the
// backward) still keeps 3-4 blocks and their loads in flight on an SM, where a 1024-thread block would run alone.
constexpr int kMaxLoopThreads = 512;

template <typename T, int N, MaskKind K>
void launch_fwd(const FwdArgs& a, cudaStream_t s) {
  const RowPlan p = plan_rows(a.rows, a.sk / N, kBlocksPerSm, kMaxLoopThreads);
  MK_LAUNCH((softmax_fwd_kernel<T, N, K>), dim3(unsigned(p.grid)), dim3(p.block), 0, s, a, p.group_threads);
}

template <typename T, int N>
void launch_fwd_kind(const FwdArgs& a, cudaStream_t s) {
  switch (a.kind) {
    case MaskKind::None: return launch_fwd<T, N, MaskKind::None>(a, s);
    case MaskKind::Bool: return launch_fwd<T, N, MaskKind::Bool>(a, s);
    case MaskKind::Causal: return launch_fwd<T, N, MaskKind::Causal>(a, s);
  }
}

template <typename T>
const char* run_fwd(const FwdArgs& a, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  // Vector packs need every row of x, y and the mask to start aligned: x and y are contiguous, but a mask view
  // (a slice of a wider mask) can have any strides.
  const bool mask_ok = a.kind != MaskKind::Bool ||
                       (aligned(a.mask, V) && a.mask_sb % V == 0 && a.mask_sh % V == 0 && a.mask_sq % V == 0);
  const bool vec = a.sk % V == 0 && aligned(a.x, 16) && aligned(a.y, 16) && mask_ok;
  if constexpr (sizeof(T) <= 4) {
    if (vec && rows_kernel_fits(a.rows, a.sk, V)) {
      const RowPlan p = softmax_rows_plan(a.rows, a.sk);
      const dim3 grid(unsigned(p.grid)), block(unsigned(p.block));
      switch (a.kind) {
        case MaskKind::None:
          MK_LAUNCH((softmax_fwd_rows_kernel<T, V, MaskKind::None>), grid, block, 0, s, a, p.group_threads);
          break;
        case MaskKind::Bool:
          MK_LAUNCH((softmax_fwd_rows_kernel<T, V, MaskKind::Bool>), grid, block, 0, s, a, p.group_threads);
          break;
        case MaskKind::Causal:
          MK_LAUNCH((softmax_fwd_rows_kernel<T, V, MaskKind::Causal>), grid, block, 0, s, a, p.group_threads);
          break;
      }
      return last_error();
    }
  }
  if (vec)
    launch_fwd_kind<T, V>(a, s);
  else
    launch_fwd_kind<T, 1>(a, s);
  return last_error();
}

template <typename T>
const char* run_bwd(const BwdArgs& a, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  const bool vec = a.sk % V == 0 && aligned(a.y, 16) && aligned(a.dy, 16) && aligned(a.dx, 16);
  if constexpr (sizeof(T) <= 4) {
    if (vec && rows_kernel_fits(a.rows, a.sk, V)) {
      const RowPlan p = softmax_rows_plan(a.rows, a.sk);
      const dim3 grid(unsigned(p.grid)), block(unsigned(p.block));
      if (a.causal)
        MK_LAUNCH((softmax_bwd_rows_kernel<T, V, true>), grid, block, 0, s, a, p.group_threads);
      else
        MK_LAUNCH((softmax_bwd_rows_kernel<T, V, false>), grid, block, 0, s, a, p.group_threads);
      return last_error();
    }
  }
  const RowPlan p = plan_rows(a.rows, vec ? a.sk / V : a.sk, kBlocksPerSm, kMaxLoopThreads);
  const dim3 grid(unsigned(p.grid)), block(p.block);
  if (vec) {
    if (a.causal)
      MK_LAUNCH((softmax_bwd_kernel<T, V, true>), grid, block, 0, s, a, p.group_threads);
    else
      MK_LAUNCH((softmax_bwd_kernel<T, V, false>), grid, block, 0, s, a, p.group_threads);
  } else {
    if (a.causal)
      MK_LAUNCH((softmax_bwd_kernel<T, 1, true>), grid, block, 0, s, a, p.group_threads);
    else
      MK_LAUNCH((softmax_bwd_kernel<T, 1, false>), grid, block, 0, s, a, p.group_threads);
  }
  return last_error();
}

template <template <typename> class F, typename Args>
const char* dispatch(const Args& a, void* stream) {
  if (a.rows == 0 || a.sk == 0) return nullptr;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case DType::F32: return F<float>::run(a, s);
    case DType::F64: return F<double>::run(a, s);
    case DType::BF16: return F<__nv_bfloat16>::run(a, s);
    case DType::F16: return F<__half>::run(a, s);
  }
  return "unsupported dtype";
}

template <typename T>
struct Fwd {
  static const char* run(const FwdArgs& a, cudaStream_t s) { return run_fwd<T>(a, s); }
};
template <typename T>
struct Bwd {
  static const char* run(const BwdArgs& a, cudaStream_t s) { return run_bwd<T>(a, s); }
};

}  // namespace

const char* softmax_fwd(const FwdArgs& a, void* stream) { return dispatch<Fwd>(a, stream); }
const char* softmax_bwd(const BwdArgs& a, void* stream) { return dispatch<Bwd>(a, stream); }

}  // namespace MK_NS
}  // namespace megakernels
