// CUDA kernels of the optimizer family: multi-tensor AdamW, non-finite check, L2 norm. No torch headers: this file
// compiles in seconds with nvcc, and unchanged with g++ against csrc/emu (adamw_cuda_emu.cpp) to run on a CPU.
//
// Design (why; costmodel/README.md has the budgets):
// - Multi-tensor apply (apex's idea): the host packs, by value into the kernel's argument struct, a table of up to
//   kMaxTensors tensors with the prefix sums of their chunk counts; block b finds its (tensor, chunk) by a binary
//   search of those. A launch therefore serves any number of chunks of its tensors (there is no cap on the grid: a
//   100M-parameter tensor is one launch of 1526 blocks, not six launches of 256), with no device-side metadata
//   allocation and no host copy; only a list of more than kMaxTensors tensors takes several launches.
// - One block per chunk, each thread striding over packs of 4 elements (16 bytes of fp32) when every pointer of
//   the tensor allows it (a view into a flat buffer may not), a scalar loop otherwise and for the tail. Packs are
//   stored with one vector store each (cuda_kernels.cuh store_pack).
// - No host synchronisation anywhere: grad_scale and found_inf are read on the device. The check kernel runs
//   first over all grads and may set *found_inf; every block of the update kernel then reads it and returns at
//   once, and the step-count kernel does the same, so a skipped step leaves params, moments and steps untouched.
// - The non-finite check and the sum of squares read 16-byte packs too (4 loads in flight per thread), and test
//   finiteness without a division where the scale cannot make a finite value overflow (scale >= 1).
// - L2 norm: each chunk's sum of squares goes to its own slot of a workspace (fixed thread -> element mapping,
//   fixed shuffle tree), then one block sums the slots in a fixed order: the same bits on every run.
#include <cstdint>

#include "../common/cuda_compat.h"
#include "../common/cuda_kernels.cuh"
#include "optim.h"

namespace megakernels {
namespace MK_NS {
namespace {

using optim::AdamWArgs;
using optim::AdamWTensor;
using optim::ListArgs;

constexpr int kBlock = 256;
constexpr int kPack = 4;
constexpr int kMaxTensors = 32;      // AdamW: 57 bytes per tensor
constexpr int kMaxListTensors = 96;  // check / norm: 17 bytes per tensor
constexpr int kMaxSteps = 480;

// ---------------------------------------------------------------------------------------------------------------
// Kernel argument tables. first_chunk[t] is the launch's block index of tensor t's first chunk (a prefix sum;
// first_chunk[n] is the grid size).

struct AdamWBatch {
  AdamWTensor tensors[kMaxTensors];
  int32_t first_chunk[kMaxTensors + 1];
  uint8_t vec[kMaxTensors];  // every pointer of the tensor allows packs of kPack (views may not)
  int32_t n;
};

struct AdamWScalars {
  double lr, beta1, beta2, eps, weight_decay;
  const float* grad_scale;
  const float* found_inf;
  int64_t chunk_size;
};

struct ListBatch {
  const void* tensors[kMaxListTensors];
  int64_t numels[kMaxListTensors];
  int32_t first_chunk[kMaxListTensors + 1];
  uint8_t vec[kMaxListTensors];
  int32_t n;
  int64_t first_slot;  // workspace slot of this launch's first chunk (l2norm)
};

struct StepBatch {
  float* steps[kMaxSteps];
  int n;
};

// The table entry whose chunks contain block b: the last t with first_chunk[t] <= b.
__device__ __forceinline__ int tensor_of_block(const int32_t* first_chunk, int n, int b) {
  int lo = 0, hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (first_chunk[mid] <= b)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// ---------------------------------------------------------------------------------------------------------------
// Kernels.

// P: param storage; G: grad storage (P, or float with fp32 grads in master mode); S: moment storage.
template <typename P, typename G, typename S, bool MASTER, int N>
__device__ __forceinline__ void adamw_elems(const AdamWTensor& t, int64_t i, float scale, const optim::AdamWCoeffs& c) {
  float p[N], g[N], m[N], v[N];
  if (MASTER)
    load_pack<float, N>(t.master, i, p);
  else
    load_pack<P, N>(static_cast<const P*>(t.param), i, p);
  load_pack<G, N>(static_cast<const G*>(t.grad), i, g);
  load_pack<S, N>(static_cast<const S*>(t.exp_avg), i, m);
  load_pack<S, N>(static_cast<const S*>(t.exp_avg_sq), i, v);
#pragma unroll
  for (int k = 0; k < N; ++k) optim::adamw_update(p[k], g[k] / scale, m[k], v[k], c);
  store_pack<S, N>(static_cast<S*>(t.exp_avg), i, m);
  store_pack<S, N>(static_cast<S*>(t.exp_avg_sq), i, v);
  if (MASTER) store_pack<float, N>(t.master, i, p);
  store_pack<P, N>(static_cast<P*>(t.param), i, p);
}

template <typename P, typename G, typename S, bool MASTER>
__global__ void adamw_kernel(AdamWBatch b, AdamWScalars s) {
  if (s.found_inf != nullptr && *s.found_inf != 0.0f) return;
  const int slot = tensor_of_block(b.first_chunk, b.n, int(blockIdx.x));
  const AdamWTensor& t = b.tensors[slot];
  const int64_t begin = int64_t(int(blockIdx.x) - b.first_chunk[slot]) * s.chunk_size;
  const int64_t len = (t.numel - begin < s.chunk_size) ? t.numel - begin : s.chunk_size;
  const optim::AdamWCoeffs c = optim::adamw_coeffs(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, *t.step);
  const float scale = s.grad_scale != nullptr ? *s.grad_scale : 1.0f;
  // Packs where the tensor allows them (uniform over the block), then the scalar tail (or the whole chunk).
  const int64_t vec_end = b.vec[slot] ? begin + len / kPack * kPack : begin;
  for (int64_t i = begin + int64_t(threadIdx.x) * kPack; i < vec_end; i += int64_t(blockDim.x) * kPack)
    adamw_elems<P, G, S, MASTER, kPack>(t, i, scale, c);
  for (int64_t i = vec_end + threadIdx.x; i < begin + len; i += blockDim.x)
    adamw_elems<P, G, S, MASTER, 1>(t, i, scale, c);
}

__global__ void increment_steps_kernel(StepBatch b, const float* found_inf) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= b.n || (found_inf != nullptr && *found_inf != 0.0f)) return;
  *b.steps[i] += 1.0f;
}

// The [begin, end) range of this block's chunk in tensor ti of a list launch.
__device__ __forceinline__ int list_chunk(const ListBatch& b, int64_t chunk_size, int64_t& begin, int64_t& end) {
  const int ti = tensor_of_block(b.first_chunk, b.n, int(blockIdx.x));
  begin = int64_t(int(blockIdx.x) - b.first_chunk[ti]) * chunk_size;
  end = (b.numels[ti] - begin < chunk_size) ? b.numels[ti] : begin + chunk_size;
  return ti;
}

// Calls f(values of N elements) over a chunk: packs of kPack where the tensor allows (4 in flight per thread), then
// the scalar rest. A value past the chunk is not passed.
template <typename T, typename F>
__device__ __forceinline__ void for_chunk_values(const T* x, bool vec, int64_t begin, int64_t end, F f) {
  const int64_t vec_end = vec ? begin + (end - begin) / kPack * kPack : begin;
  const int64_t step = int64_t(blockDim.x) * kPack;
  int64_t i = begin + int64_t(threadIdx.x) * kPack;
  for (; i + 3 * step < vec_end; i += 4 * step) {
    float v[4][kPack];
#pragma unroll
    for (int u = 0; u < 4; ++u) load_pack<T, kPack>(x, i + u * step, v[u]);
#pragma unroll
    for (int u = 0; u < 4; ++u) f(v[u]);
  }
  for (; i < vec_end; i += step) {
    float v[kPack];
    load_pack<T, kPack>(x, i, v);
    f(v);
  }
  for (int64_t k = vec_end + threadIdx.x; k < end; k += blockDim.x) {
    float v[1] = {to_acc(x[k])};
    f(v);
  }
}

template <typename T>
__global__ void nonfinite_kernel(ListBatch b, int64_t chunk_size, const float* grad_scale, float* found_inf) {
  int64_t begin, end;
  const int ti = list_chunk(b, chunk_size, begin, end);
  const T* x = static_cast<const T*>(b.tensors[ti]);
  const float scale = grad_scale != nullptr ? *grad_scale : 1.0f;
  int bad = 0;
  if (scale >= 1.0f) {  // x / scale is finite exactly when x is: test x itself, no division
    for_chunk_values(x, b.vec[ti], begin, end, [&](const auto& v) {
#pragma unroll
      for (int k = 0; k < int(sizeof(v) / sizeof(v[0])); ++k) bad |= !(fabsf(v[k]) <= 3.402823466e38f);
    });
  } else {
    for_chunk_values(x, b.vec[ti], begin, end, [&](const auto& v) {
#pragma unroll
      for (int k = 0; k < int(sizeof(v) / sizeof(v[0])); ++k) bad |= !isfinite(v[k] / scale);
    });
  }
  // One writer per block; blocks only ever write 1, so concurrent blocks agree.
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
}

__device__ __forceinline__ float block_sum(float v, float* smem) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < warps ? smem[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__global__ void sumsq_kernel(ListBatch b, int64_t chunk_size, float* partials) {
  __shared__ float smem[32];
  int64_t begin, end;
  const int ti = list_chunk(b, chunk_size, begin, end);
  const T* x = static_cast<const T*>(b.tensors[ti]);
  float acc[kPack] = {0.0f, 0.0f, 0.0f, 0.0f};  // one per pack lane: independent add chains
  for_chunk_values(x, b.vec[ti], begin, end, [&](const auto& v) {
#pragma unroll
    for (int k = 0; k < int(sizeof(v) / sizeof(v[0])); ++k) acc[k] += v[k] * v[k];
  });
  const float s = block_sum((acc[0] + acc[1]) + (acc[2] + acc[3]), smem);
  if (threadIdx.x == 0) partials[b.first_slot + blockIdx.x] = s;
}

__global__ void finish_norm_kernel(const float* partials, int64_t n, float* out) {
  __shared__ float smem[32];
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += partials[i];
  s = block_sum(s, smem);
  if (threadIdx.x == 0) *out = std::sqrt(s);
}

// ---------------------------------------------------------------------------------------------------------------
// Host side: cutting lists into launches.

// Walks the tensors of a list in order and packs them into launch tables: add(slot, t, first_chunk) puts tensor t
// into a table slot whose chunks start at that block index, and flush(slots, chunks) launches a full table (no room
// for the next tensor) and the last one. Empty tensors take no slot.
template <typename NumelOf, typename Add, typename Flush>
const char* for_each_launch(int64_t n_tensors, int64_t chunk_size, int max_tensors, NumelOf numel_of, Add add,
                            Flush flush) {
  int slots = 0;
  int64_t chunks = 0;
  for (int64_t t = 0; t < n_tensors; ++t) {
    const int64_t nc = optim::chunks_of(numel_of(t), chunk_size);
    if (nc == 0) continue;
    if (slots == max_tensors) {
      if (const char* e = flush(slots, chunks)) return e;
      slots = 0;
      chunks = 0;
    }
    add(slots++, t, chunks);
    chunks += nc;
  }
  return slots > 0 ? flush(slots, chunks) : nullptr;
}

template <typename P, typename G, typename S, bool MASTER>
const char* run_adamw(const AdamWArgs& a, cudaStream_t stream) {
  AdamWScalars s{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_scale, a.found_inf, a.chunk_size};
  // Chunks start at multiples of chunk_size, so packs stay aligned inside a tensor when its pointers are.
  const bool vec_chunks = a.chunk_size % kPack == 0;
  AdamWBatch b;
  auto add = [&](int slot, int64_t t, int64_t first) {
    const AdamWTensor& x = a.tensors[t];
    b.tensors[slot] = x;
    b.first_chunk[slot] = int32_t(first);
    b.vec[slot] = vec_chunks && aligned(x.param, sizeof(P) * kPack) && aligned(x.grad, sizeof(G) * kPack) &&
                  aligned(x.exp_avg, sizeof(S) * kPack) && aligned(x.exp_avg_sq, sizeof(S) * kPack) &&
                  aligned(x.master, sizeof(float) * kPack);
  };
  auto flush = [&](int slots, int64_t chunks) -> const char* {
    b.n = slots;
    b.first_chunk[slots] = int32_t(chunks);
    MK_LAUNCH((adamw_kernel<P, G, S, MASTER>), dim3(unsigned(chunks)), dim3(kBlock), 0, stream, b, s);
    return last_error();
  };
  if (const char* e = for_each_launch(
          a.n_tensors, a.chunk_size, kMaxTensors, [&](int64_t t) { return a.tensors[t].numel; }, add, flush))
    return e;
  // Steps advance after every update launch has read them (same stream, so in order).
  StepBatch sb;
  sb.n = 0;
  for (int64_t t = 0; t <= a.n_tensors; ++t) {
    if (sb.n == kMaxSteps || (t == a.n_tensors && sb.n > 0)) {
      MK_LAUNCH(increment_steps_kernel, dim3((sb.n + kBlock - 1) / kBlock), dim3(kBlock), 0, stream, sb, a.found_inf);
      if (const char* e = last_error()) return e;
      sb.n = 0;
    }
    if (t < a.n_tensors) sb.steps[sb.n++] = const_cast<float*>(a.tensors[t].step);
  }
  return nullptr;
}

template <typename P>
const char* adamw_master(const AdamWArgs& a, cudaStream_t s) {
  if (a.master && a.grad_f32) return run_adamw<P, float, float, true>(a, s);
  return a.master ? run_adamw<P, P, float, true>(a, s) : run_adamw<P, P, P, false>(a, s);
}

// Runs kernel(batch, ...) over the chunks of a list; `first_slot` of each batch counts the chunks before it.
template <typename Launch>
const char* for_each_list_launch(const ListArgs& a, Launch launch) {
  ListBatch b;
  b.first_slot = 0;
  const int64_t elem = a.dtype == DType::F32 ? 4 : 2;
  auto add = [&](int slot, int64_t t, int64_t first) {
    b.tensors[slot] = a.tensors[t];
    b.numels[slot] = a.numels[t];
    b.first_chunk[slot] = int32_t(first);
    b.vec[slot] = a.chunk_size % kPack == 0 && aligned(a.tensors[t], elem * kPack);
  };
  auto flush = [&](int slots, int64_t chunks) -> const char* {
    b.n = slots;
    b.first_chunk[slots] = int32_t(chunks);
    if (const char* e = launch(b, int(chunks))) return e;
    b.first_slot += chunks;
    return nullptr;
  };
  return for_each_launch(
      a.n_tensors, a.chunk_size, kMaxListTensors, [&](int64_t t) { return a.numels[t]; }, add, flush);
}

}  // namespace

const char* adamw(const AdamWArgs& a, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (a.param_dtype) {
    case DType::F32: return adamw_master<float>(a, s);
    case DType::BF16: return adamw_master<__nv_bfloat16>(a, s);
    case DType::F16: return adamw_master<__half>(a, s);
    default: return "adamw: unsupported dtype";
  }
}

const char* nonfinite_check(const ListArgs& a, const float* grad_scale, float* found_inf, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return for_each_list_launch(a, [&](const ListBatch& b, int chunks) -> const char* {
    switch (a.dtype) {
      case DType::F32:
        MK_LAUNCH(nonfinite_kernel<float>, dim3(chunks), dim3(kBlock), 0, s, b, a.chunk_size, grad_scale, found_inf);
        break;
      case DType::BF16:
        MK_LAUNCH(nonfinite_kernel<__nv_bfloat16>, dim3(chunks), dim3(kBlock), 0, s, b, a.chunk_size, grad_scale,
                  found_inf);
        break;
      case DType::F16:
        MK_LAUNCH(nonfinite_kernel<__half>, dim3(chunks), dim3(kBlock), 0, s, b, a.chunk_size, grad_scale, found_inf);
        break;
      default: return "nonfinite_check: unsupported dtype";
    }
    return last_error();
  });
}

int64_t l2norm_workspace_floats(const ListArgs& a) {
  int64_t n = 0;
  for (int64_t t = 0; t < a.n_tensors; ++t) n += optim::chunks_of(a.numels[t], a.chunk_size);
  return n;
}

const char* l2norm(const ListArgs& a, float* partials, float* out, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const char* e = for_each_list_launch(a, [&](const ListBatch& b, int chunks) -> const char* {
    switch (a.dtype) {
      case DType::F32:
        MK_LAUNCH(sumsq_kernel<float>, dim3(chunks), dim3(kBlock), 0, s, b, a.chunk_size, partials);
        break;
      case DType::BF16:
        MK_LAUNCH(sumsq_kernel<__nv_bfloat16>, dim3(chunks), dim3(kBlock), 0, s, b, a.chunk_size, partials);
        break;
      case DType::F16:
        MK_LAUNCH(sumsq_kernel<__half>, dim3(chunks), dim3(kBlock), 0, s, b, a.chunk_size, partials);
        break;
      default: return "l2norm: unsupported dtype";
    }
    return last_error();
  });
  if (e) return e;
  MK_LAUNCH(finish_norm_kernel, dim3(1), dim3(kBlock), 0, s, partials, l2norm_workspace_floats(a), out);
  return last_error();
}

}  // namespace MK_NS
}  // namespace megakernels
