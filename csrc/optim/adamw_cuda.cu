// CUDA kernels of the optimizer family: multi-tensor AdamW, non-finite check, L2 norm. No torch headers: this file
// compiles in seconds with nvcc, and unchanged with g++ against csrc/emu (adamw_cuda_emu.cpp) to run on a CPU.
//
// Design (why):
// - Multi-tensor apply (apex's idea): the host cuts the tensor list into chunks and packs, by value into the
//   kernel's argument struct, a table of tensors and one (tensor, chunk) entry per block. A launch therefore
//   serves up to kMaxTensors tensors / kMaxChunks chunks with no device-side metadata allocation and no host
//   copy; a longer list is simply several launches. Parameters are 4 KiB at most, which sizes the tables.
// - One block per chunk, each thread striding over packs of 4 elements (16 bytes of fp32) when every pointer of
//   the tensor allows it (a view into a flat buffer may not), a scalar loop otherwise and for the tail.
// - No host synchronisation anywhere: grad_scale and found_inf are read on the device. The check kernel runs
//   first over all grads and may set *found_inf; every block of the update kernel then reads it and returns at
//   once, and the step-count kernel does the same, so a skipped step leaves params, moments and steps untouched.
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
constexpr int kMaxTensors = 32;       // AdamW: 57 bytes per tensor
constexpr int kMaxChunks = 256;
constexpr int kMaxListTensors = 96;   // check / norm: 16 bytes per tensor
constexpr int kMaxSteps = 480;


// ---------------------------------------------------------------------------------------------------------------
// Kernel argument tables.

struct AdamWBatch {
  AdamWTensor tensors[kMaxTensors];
  uint8_t vec[kMaxTensors];          // every pointer of the tensor allows packs of kPack (views may not)
  int32_t chunk[kMaxChunks];         // chunk index within its tensor
  uint8_t tensor_of[kMaxChunks];     // index into tensors
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
  int32_t chunk[kMaxChunks];
  uint8_t tensor_of[kMaxChunks];
  int64_t first_slot;                // workspace slot of this launch's first chunk (l2norm)
};

struct StepBatch {
  float* steps[kMaxSteps];
  int n;
};

// ---------------------------------------------------------------------------------------------------------------
// Kernels.

template <typename P, typename S, bool MASTER, int N>
__device__ __forceinline__ void adamw_elems(const AdamWTensor& t, int64_t i, float scale,
                                            const optim::AdamWCoeffs& c) {
  float p[N], g[N], m[N], v[N];
  if (MASTER) load_pack<float, N>(t.master, i, p);
  else load_pack<P, N>(static_cast<const P*>(t.param), i, p);
  load_pack<P, N>(static_cast<const P*>(t.grad), i, g);
  load_pack<S, N>(static_cast<const S*>(t.exp_avg), i, m);
  load_pack<S, N>(static_cast<const S*>(t.exp_avg_sq), i, v);
#pragma unroll
  for (int k = 0; k < N; ++k) optim::adamw_update(p[k], g[k] / scale, m[k], v[k], c);
  store_pack<S, N>(static_cast<S*>(t.exp_avg), i, m);
  store_pack<S, N>(static_cast<S*>(t.exp_avg_sq), i, v);
  if (MASTER) store_pack<float, N>(t.master, i, p);
  store_pack<P, N>(static_cast<P*>(t.param), i, p);
}

template <typename P, typename S, bool MASTER>
__global__ void adamw_kernel(AdamWBatch b, AdamWScalars s) {
  if (s.found_inf != nullptr && *s.found_inf != 0.0f) return;
  const int slot = b.tensor_of[blockIdx.x];
  const AdamWTensor& t = b.tensors[slot];
  const int64_t begin = int64_t(b.chunk[blockIdx.x]) * s.chunk_size;
  const int64_t len = (t.numel - begin < s.chunk_size) ? t.numel - begin : s.chunk_size;
  const optim::AdamWCoeffs c = optim::adamw_coeffs(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, *t.step);
  const float scale = s.grad_scale != nullptr ? *s.grad_scale : 1.0f;
  // Packs where the tensor allows them (uniform over the block), then the scalar tail (or the whole chunk).
  const int64_t vec_end = b.vec[slot] ? begin + len / kPack * kPack : begin;
  for (int64_t i = begin + int64_t(threadIdx.x) * kPack; i < vec_end; i += int64_t(blockDim.x) * kPack)
    adamw_elems<P, S, MASTER, kPack>(t, i, scale, c);
  for (int64_t i = vec_end + threadIdx.x; i < begin + len; i += blockDim.x)
    adamw_elems<P, S, MASTER, 1>(t, i, scale, c);
}

__global__ void increment_steps_kernel(StepBatch b, const float* found_inf) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= b.n || (found_inf != nullptr && *found_inf != 0.0f)) return;
  *b.steps[i] += 1.0f;
}

template <typename T>
__global__ void nonfinite_kernel(ListBatch b, int64_t chunk_size, const float* grad_scale, float* found_inf) {
  const int ti = b.tensor_of[blockIdx.x];
  const T* x = static_cast<const T*>(b.tensors[ti]);
  const int64_t begin = int64_t(b.chunk[blockIdx.x]) * chunk_size;
  const int64_t end = (b.numels[ti] - begin < chunk_size) ? b.numels[ti] : begin + chunk_size;
  const float scale = grad_scale != nullptr ? *grad_scale : 1.0f;
  int bad = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) bad |= !isfinite(to_acc(x[i]) / scale);
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
  const int ti = b.tensor_of[blockIdx.x];
  const T* x = static_cast<const T*>(b.tensors[ti]);
  const int64_t begin = int64_t(b.chunk[blockIdx.x]) * chunk_size;
  const int64_t end = (b.numels[ti] - begin < chunk_size) ? b.numels[ti] : begin + chunk_size;
  float s = 0.0f;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float v = to_acc(x[i]);
    s += v * v;
  }
  s = block_sum(s, smem);
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

// Walks the (tensor, chunk) pairs of a list in order and packs them into launch tables: set_tensor(slot, t) puts
// tensor t into a table slot, add_chunk(pos, slot, c) makes block `pos` handle chunk c of that slot, and
// flush(chunks) launches a full table (too many chunks, or too many tensors for the next one) and the last one.
// A tensor cut by a flush continues in slot 0 of the next table.
template <typename NumelOf, typename SetTensor, typename AddChunk, typename Flush>
const char* for_each_launch(int64_t n_tensors, int64_t chunk_size, int max_tensors, NumelOf numel_of,
                            SetTensor set_tensor, AddChunk add_chunk, Flush flush) {
  int tensors = 0, chunks = 0, slot = 0;
  for (int64_t t = 0; t < n_tensors; ++t) {
    const int64_t nc = optim::chunks_of(numel_of(t), chunk_size);
    for (int64_t c = 0; c < nc; ++c) {
      if (chunks == kMaxChunks || (c == 0 && tensors == max_tensors)) {
        if (const char* e = flush(chunks)) return e;
        tensors = chunks = 0;
      }
      if (c == 0 || tensors == 0) {
        slot = tensors++;
        set_tensor(slot, t);
      }
      add_chunk(chunks++, slot, c);
    }
  }
  return chunks > 0 ? flush(chunks) : nullptr;
}

template <typename P, typename S, bool MASTER>
const char* run_adamw(const AdamWArgs& a, cudaStream_t stream) {
  AdamWScalars s{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.grad_scale, a.found_inf, a.chunk_size};
  // Chunks start at multiples of chunk_size, so packs stay aligned inside a tensor when its pointers are.
  const bool vec_chunks = a.chunk_size % kPack == 0;
  AdamWBatch b;
  auto set_tensor = [&](int slot, int64_t t) {
    const AdamWTensor& x = a.tensors[t];
    b.tensors[slot] = x;
    b.vec[slot] = vec_chunks && aligned(x.param, sizeof(P) * kPack) && aligned(x.grad, sizeof(P) * kPack) &&
                  aligned(x.exp_avg, sizeof(S) * kPack) && aligned(x.exp_avg_sq, sizeof(S) * kPack) &&
                  aligned(x.master, sizeof(float) * kPack);
  };
  auto add_chunk = [&](int pos, int slot, int64_t c) {
    b.tensor_of[pos] = uint8_t(slot);
    b.chunk[pos] = int32_t(c);
  };
  auto flush = [&](int chunks) -> const char* {
    MK_LAUNCH((adamw_kernel<P, S, MASTER>), dim3(chunks), dim3(kBlock), 0, stream, b, s);
    return last_error();
  };
  if (const char* e = for_each_launch(
          a.n_tensors, a.chunk_size, kMaxTensors, [&](int64_t t) { return a.tensors[t].numel; }, set_tensor,
          add_chunk, flush))
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
  return a.master ? run_adamw<P, float, true>(a, s) : run_adamw<P, P, false>(a, s);
}

// Runs kernel(batch, ...) over the chunks of a list; `first_slot` of each batch counts the chunks before it.
template <typename Launch>
const char* for_each_list_launch(const ListArgs& a, Launch launch) {
  ListBatch b;
  b.first_slot = 0;
  auto set_tensor = [&](int slot, int64_t t) {
    b.tensors[slot] = a.tensors[t];
    b.numels[slot] = a.numels[t];
  };
  auto add_chunk = [&](int pos, int slot, int64_t c) {
    b.tensor_of[pos] = uint8_t(slot);
    b.chunk[pos] = int32_t(c);
  };
  auto flush = [&](int chunks) -> const char* {
    if (const char* e = launch(b, chunks)) return e;
    b.first_slot += chunks;
    return nullptr;
  };
  return for_each_launch(a.n_tensors, a.chunk_size, kMaxListTensors, [&](int64_t t) { return a.numels[t]; },
                         set_tensor, add_chunk, flush);
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
      case DType::F32: MK_LAUNCH(sumsq_kernel<float>, dim3(chunks), dim3(kBlock), 0, s, b, a.chunk_size, partials); break;
      case DType::BF16:
        MK_LAUNCH(sumsq_kernel<__nv_bfloat16>, dim3(chunks), dim3(kBlock), 0, s, b, a.chunk_size, partials);
        break;
      case DType::F16: MK_LAUNCH(sumsq_kernel<__half>, dim3(chunks), dim3(kBlock), 0, s, b, a.chunk_size, partials); break;
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
