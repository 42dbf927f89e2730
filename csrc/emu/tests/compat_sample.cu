// One source, two builds: nvcc compiles it for sm_90 (test emu_nvcc_compile), g++ compiles it as C++ with
// -DMEGAKERNELS_CUDA_EMU and runs it on the CPU (tests compat_sample_*). It uses every cuda_compat.h macro.
#include "common/cuda_compat.h"

MK_HD float scaled(float x, float s) { return x * s; }

// Scales x into y through dynamic shared memory (reversed twice) and sums y into *total.
template <typename T, int kUnroll>
__global__ void __launch_bounds__(256)
    scale_kernel(const T* __restrict__ x, float* __restrict__ y, float* __restrict__ total, float s, int n) {
  MK_DYNAMIC_SHARED(float, tile);
  const int t = threadIdx.x, base = blockIdx.x * blockDim.x * kUnroll;
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int i = base + k * blockDim.x + t;
    tile[k * blockDim.x + t] = i < n ? scaled(float(x[i]), s) : 0.f;
  }
  __syncthreads();
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int i = base + k * blockDim.x + t;
    const float v = tile[k * blockDim.x + t];
    if (i < n) y[i] = v;
    acc += v;
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((t & 31) == 0) atomicAdd(total, acc);
}

// The host side: one launch of a template kernel with commas in its argument list.
const char* launch_scale(const __nv_bfloat16* x, float* y, float* total, float s, int n, cudaStream_t stream) {
  constexpr int kUnroll = 4, kThreads = 256;
  const int blocks = (n + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  MK_LAUNCH((scale_kernel<__nv_bfloat16, kUnroll>), dim3(blocks), dim3(kThreads), kThreads * kUnroll * sizeof(float),
            stream, x, y, total, s, n);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

#if MK_CUDA_EMU
#include <cstdio>
#include <vector>
int main() {
  const int n = 3000;
  std::vector<__nv_bfloat16> x(n);
  std::vector<float> y(n, -1.f);
  float total = 0.f, want = 0.f;
  for (int i = 0; i < n; ++i) {
    x[i] = __float2bfloat16(float(i % 7));
    want += 2.f * float(i % 7);
  }
  const char* err = launch_scale(x.data(), y.data(), &total, 2.f, n, nullptr);
  int bad = err != nullptr;
  for (int i = 0; i < n; ++i) bad += y[i] != 2.f * float(i % 7);
  bad += total != want;
  std::printf("compat_sample: %s, total %g (want %g), %d mismatches\n", err ? err : "launched", total, want, bad);
  return bad ? 1 : 0;
}
#endif
