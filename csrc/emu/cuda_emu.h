// megakernels CUDA emulator: compiles an unchanged torch-free CUDA kernel source with a host C++17 compiler
// (g++ -x c++ -DMEGAKERNELS_CUDA_EMU) and runs it on the CPU with CUDA's execution semantics, so indexing,
// reduction and missing-barrier bugs show up without a GPU — also under -fsanitize=address/thread.
// Kernel files include csrc/common/cuda_compat.h, which includes this header in emulation builds.
//
// Layout (each part explains its own design choices):
//   emu_wait.h        atomics helpers, futex sleeping, the deadlock timeout, fatal reports
//   emu_fiber.h       a block's threads as fibers on the launching thread (the default)
//   emu_block.h       the running block: __syncthreads barrier, warp rendezvous, thread exit
//   emu_pool.h        the launch loop (blocks one after another), fibers or the host-thread worker pool
//   emu_device.h      device synchronisation API: barriers, shuffles/votes/match/reduce, atomics, fences
//   emu_intrinsics.h  math and bit intrinsics that are not host functions
//   emu_runtime.h     cudaGetLastError & co., cudaFuncSetAttribute, the MK_LAUNCH front end
//
// Needs only CUDA's host-compilable headers (cuda_bf16.h, cuda_fp16.h, vector_types.h and what they include),
// never libcudart: bf16/fp16 conversions are CUDA's own code, so their rounding is the GPU's.
// Limitations: no inline PTX (asm), no cooperative groups / grid sync, no wgmma/TMA/cp.async; static
// __shared__ arrays keep their contents between blocks (dynamic shared memory is re-poisoned per block);
// blocks run one after another, so a block spin-waiting for another block is reported as a deadlock.
#pragma once

#if defined(__CUDACC__)
#error "cuda_emu.h is the CPU emulator for host compilers; nvcc builds use the real CUDA headers (cuda_compat.h)"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <driver_types.h>
#include <vector_functions.h>
#include <vector_types.h>

// A later #include <cuda_runtime.h> or <device_launch_parameters.h> would declare what this header defines.
#ifndef __CUDA_RUNTIME_H__
#define __CUDA_RUNTIME_H__
#endif
#ifndef __DEVICE_LAUNCH_PARAMETERS_H__
#define __DEVICE_LAUNCH_PARAMETERS_H__
#endif

// ---- execution-space qualifiers ---------------------------------------------------------------------------
// __shared__ becomes `static`: one copy per kernel instantiation, which is enough because only one block runs
// at a time. __noinline__ becomes nothing (not an attribute): libstdc++ spells __attribute__((__noinline__)).
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __constant__
#undef __managed__
#undef __forceinline__
#undef __noinline__
#undef __launch_bounds__
#undef __grid_constant__
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __constant__
#define __managed__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__
#define __launch_bounds__(...)
#define __grid_constant__
#ifndef __align__
#define __align__(n) alignas(n)
#endif
#if !defined(__clang__) && !defined(__builtin_assume)
#define __builtin_assume(...) ((void)0)  // nvcc/clang optimisation hint; GCC has no such builtin
#endif

#include "emu_pool.h"

// ---- built-in variables -------------------------------------------------------------------------------------
// Macros onto per-thread (threadIdx, blockIdx) and per-launch (blockDim, gridDim) state, read-only as in CUDA.
#define threadIdx (static_cast<const uint3&>(::mk_emu::detail::t_thread_idx))
#define blockIdx (static_cast<const uint3&>(::mk_emu::detail::t_block_idx))
#define blockDim (static_cast<const dim3&>(::mk_emu::detail::g_block_dim))
#define gridDim (static_cast<const dim3&>(::mk_emu::detail::g_grid_dim))
constexpr int warpSize = 32;

#include "emu_device.h"
#include "emu_intrinsics.h"
#include "emu_runtime.h"
