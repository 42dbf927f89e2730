// The one header a torch-free .cu kernel file includes for its CUDA environment. The same source then builds
//   - with nvcc:                      real CUDA (cuda_runtime.h, cuda_bf16.h, cuda_fp16.h);
//   - with g++ -x c++ -DMEGAKERNELS_CUDA_EMU: the CPU emulator (csrc/emu/cuda_emu.h), which runs the kernels
//     with CUDA semantics so tests without a GPU exercise the very code the GPU runs.
// Only the few constructs whose spelling must differ between the two go through macros:
//
//   MK_LAUNCH(kernel, grid, block, smem_bytes, stream, args...)
//       kernel<<<grid, block, smem_bytes, stream>>>(args...). Parenthesise a template kernel whose argument
//       list has commas: MK_LAUNCH((my_kernel<float, 4>), ...). Afterwards cudaGetLastError() returns the
//       launch error in both builds. The emulator runs the grid before returning (blocks one after another).
//   MK_DYNAMIC_SHARED(T, name)
//       declares `T* name` pointing at the block's dynamic shared memory (16-byte aligned at least). Do not
//       write `extern __shared__` directly: the emulator cannot provide it.
//   MK_HD
//       __host__ __device__ __forceinline__, for math helpers shared by host and device code.
//   MK_CUDA_EMU
//       1 in emulator builds, 0 otherwise (for the rare code that must differ, e.g. inline PTX).
#pragma once

#if defined(MEGAKERNELS_CUDA_EMU)

#include "../emu/cuda_emu.h"

#define MK_CUDA_EMU 1
#define MK_LAUNCH(kernel, grid, block, smem_bytes, stream, ...) \
  ::mk_emu::make_launch(kernel, grid, block, smem_bytes, stream, #kernel)(__VA_ARGS__)
#define MK_DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(::mk_emu::dynamic_smem())

#else

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define MK_CUDA_EMU 0
#define MK_LAUNCH(kernel, grid, block, smem_bytes, stream, ...) kernel<<<grid, block, smem_bytes, stream>>>(__VA_ARGS__)
#define MK_DYNAMIC_SHARED(T, name)                                        \
  extern __shared__ __align__(16) unsigned char mk_dynamic_smem_bytes_[]; \
  T* name = reinterpret_cast<T*>(mk_dynamic_smem_bytes_)

#endif

#define MK_HD __host__ __device__ __forceinline__
