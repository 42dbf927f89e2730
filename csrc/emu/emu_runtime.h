// CUDA emulator: the host-side runtime subset and the launch front end. Included by cuda_emu.h.
//
// cuda_bf16.h pulls in cuda_runtime_api.h, which declares the real runtime functions as extern "C". Defining
// bodies for those declarations would export symbols named like libcudart's: in a library that links both the
// emulated and the real kernels, one would silently replace the other. So each runtime name used here is a macro
// onto a megakernels_emu_* function with C++ linkage, and no libcudart is needed.
#pragma once

#include <cstdio>
#include <cstring>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace mk_emu {
namespace detail {

inline thread_local cudaError_t t_last_error = cudaSuccess;  // per host thread, as in the CUDA runtime

constexpr int kNumSMs = 4;  // small, so grid-size heuristics (blocks = k * SMs) stay cheap to emulate
constexpr size_t kDefaultSmem = 48 * 1024;
constexpr size_t kMaxSmemOptin = 232448;

// cudaFuncAttributeMaxDynamicSharedMemorySize per kernel: above 48 KiB a launch needs the opt-in, as on the GPU.
struct SmemOptins {
  std::mutex mu;
  std::vector<std::pair<const void*, size_t>> entries;
};
inline SmemOptins& smem_optins() {
  static SmemOptins s;
  return s;
}
inline size_t smem_limit(const void* fn) {
  SmemOptins& s = smem_optins();
  std::lock_guard<std::mutex> lk(s.mu);
  for (auto& e : s.entries)
    if (e.first == fn) return e.second;
  return kDefaultSmem;
}

inline cudaError_t validate(dim3 grid, dim3 block, size_t smem, const void* fn) {
  if (!fn) return cudaErrorInvalidDeviceFunction;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x == 0 || block.y == 0 || block.z == 0)
    return cudaErrorInvalidConfiguration;
  if (grid.x > 2147483647u || grid.y > 65535u || grid.z > 65535u) return cudaErrorInvalidConfiguration;
  if (block.x > 1024 || block.y > 1024 || block.z > 64) return cudaErrorInvalidConfiguration;
  if (static_cast<unsigned long long>(block.x) * block.y * block.z > kMaxThreadsPerBlock)
    return cudaErrorInvalidConfiguration;
  if (smem > smem_limit(fn)) return cudaErrorInvalidValue;
  return cudaSuccess;
}

template <class... P>
struct KernelCall {
  void (*kernel)(P...);
  std::tuple<std::decay_t<P>...> args;
};

// Each emulated thread gets its own copy of the arguments: kernel parameters are per-thread locals.
template <class... P>
void trampoline(const void* p) {
  const auto* call = static_cast<const KernelCall<P...>*>(p);
  std::apply(call->kernel, call->args);
}

}  // namespace detail

inline void* dynamic_smem(const char* what = "MK_DYNAMIC_SHARED") { return detail::ctx(what).blk->smem; }
inline size_t dynamic_smem_bytes() { return detail::ctx("mk_emu::dynamic_smem_bytes").blk->smem_bytes; }
inline bool in_kernel() { return detail::t_ctx != nullptr; }
// Overrides MEGAKERNELS_EMU_TIMEOUT_S: how long a barrier may wait before the emulator reports a deadlock.
inline void set_timeout_seconds(double s) {
  __atomic_store_n(&detail::g_timeout_ns, static_cast<int64_t>((s > 0 ? s : 60.0) * 1e9), __ATOMIC_RELAXED);
}

// What MK_LAUNCH expands to: make_launch(kernel, ...)(args...). Synchronous: the grid has finished when the
// call returns (a stream only orders work, and everything here is already in order).
template <class... P>
struct Launch {
  void (*kernel)(P...);
  dim3 grid, block;
  size_t smem;
  const char* name;

  template <class... A>
  void operator()(A&&... a) const {
    static_assert(sizeof...(A) == sizeof...(P), "MK_LAUNCH: wrong number of kernel arguments");
    const void* key = reinterpret_cast<const void*>(kernel);
    if (detail::t_ctx) {
      detail::fatal_begin();
      std::fprintf(stderr, "[megakernels cuda_emu] launching %s from inside a kernel is not supported\n", name);
      detail::fatal_stop();
    }
    cudaError_t err = detail::validate(grid, block, smem, key);
    if (err != cudaSuccess) {
      detail::t_last_error = err;
      return;
    }
    detail::KernelCall<P...> call{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(a)...)};
    std::lock_guard<std::mutex> lk(detail::launch_mutex());  // one grid at a time, from any host thread
    detail::run_grid(name, &detail::trampoline<P...>, &call, grid, block, smem);
  }
};

template <class... P>
Launch<P...> make_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t,
                         const char* name) {
  return Launch<P...>{kernel, grid, block, smem_bytes, name};
}

}  // namespace mk_emu

// ---- the runtime subset ----------------------------------------------------------------------------------
inline cudaError_t megakernels_emu_cudaGetLastError() {
  cudaError_t e = mk_emu::detail::t_last_error;
  mk_emu::detail::t_last_error = cudaSuccess;
  return e;
}
inline cudaError_t megakernels_emu_cudaPeekAtLastError() { return mk_emu::detail::t_last_error; }
inline const char* megakernels_emu_cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    default: return "cudaErrorUnknown";
  }
}
inline const char* megakernels_emu_cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    default: return "unrecognized error code";
  }
}
inline cudaError_t megakernels_emu_cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t megakernels_emu_cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : (mk_emu::detail::t_last_error = cudaErrorInvalidDevice);
}
inline cudaError_t megakernels_emu_cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
inline cudaError_t megakernels_emu_cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return mk_emu::detail::t_last_error = cudaErrorInvalidDevice;
  switch (attr) {  // an H100-like device with few SMs
    case cudaDevAttrMultiProcessorCount: *value = mk_emu::detail::kNumSMs; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = int(mk_emu::detail::kMaxSmemOptin); break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = int(mk_emu::detail::kDefaultSmem); break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = 233472; break;
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = 2048; break;
    case cudaDevAttrMaxBlockDimX:
    case cudaDevAttrMaxBlockDimY: *value = 1024; break;
    case cudaDevAttrMaxBlockDimZ: *value = 64; break;
    case cudaDevAttrMaxGridDimX: *value = 2147483647; break;
    case cudaDevAttrMaxGridDimY:
    case cudaDevAttrMaxGridDimZ: *value = 65535; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrMaxRegistersPerBlock: *value = 65536; break;
    case cudaDevAttrL2CacheSize: *value = 50 * 1024 * 1024; break;
    default: return mk_emu::detail::t_last_error = cudaErrorInvalidValue;
  }
  return cudaSuccess;
}
inline cudaError_t megakernels_emu_cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  using namespace mk_emu::detail;
  if (!func) return t_last_error = cudaErrorInvalidDeviceFunction;
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;  // carve-out etc.: no effect here
  if (value < 0 || size_t(value) > kMaxSmemOptin) return t_last_error = cudaErrorInvalidValue;
  SmemOptins& s = smem_optins();
  std::lock_guard<std::mutex> lk(s.mu);
  for (auto& e : s.entries)
    if (e.first == func) {
      e.second = size_t(value);
      return cudaSuccess;
    }
  s.entries.emplace_back(func, size_t(value));
  return cudaSuccess;
}
template <class... P>
inline cudaError_t megakernels_emu_cudaFuncSetAttribute(void (*func)(P...), cudaFuncAttribute attr, int value) {
  return megakernels_emu_cudaFuncSetAttribute(reinterpret_cast<const void*>(func), attr, value);
}
// Launches are synchronous, so every synchronisation is already done.
inline cudaError_t megakernels_emu_cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t megakernels_emu_cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
// All memory is host memory: copies and sets are plain memcpy/memset.
inline cudaError_t megakernels_emu_cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t = nullptr) {
  if (n) std::memset(p, v, n);
  return cudaSuccess;
}
inline cudaError_t megakernels_emu_cudaMemset(void* p, int v, size_t n) {
  return megakernels_emu_cudaMemsetAsync(p, v, n);
}
inline cudaError_t megakernels_emu_cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind,
                                                   cudaStream_t = nullptr) {
  if (n) std::memmove(dst, src, n);
  return cudaSuccess;
}
inline cudaError_t megakernels_emu_cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind k) {
  return megakernels_emu_cudaMemcpyAsync(dst, src, n, k);
}
// __constant__ and __device__ variables are ordinary globals here.
template <class T>
inline cudaError_t megakernels_emu_cudaMemcpyToSymbol(T& symbol, const void* src, size_t n, size_t offset = 0,
                                                      cudaMemcpyKind = cudaMemcpyHostToDevice) {
  if (offset + n > sizeof(T)) return mk_emu::detail::t_last_error = cudaErrorInvalidValue;
  std::memcpy(reinterpret_cast<char*>(&symbol) + offset, src, n);
  return cudaSuccess;
}
template <class T>
inline cudaError_t megakernels_emu_cudaMemcpyFromSymbol(void* dst, const T& symbol, size_t n, size_t offset = 0,
                                                        cudaMemcpyKind = cudaMemcpyDeviceToHost) {
  if (offset + n > sizeof(T)) return mk_emu::detail::t_last_error = cudaErrorInvalidValue;
  std::memcpy(dst, reinterpret_cast<const char*>(&symbol) + offset, n);
  return cudaSuccess;
}

#define cudaGetLastError megakernels_emu_cudaGetLastError
#define cudaPeekAtLastError megakernels_emu_cudaPeekAtLastError
#define cudaGetErrorName megakernels_emu_cudaGetErrorName
#define cudaGetErrorString megakernels_emu_cudaGetErrorString
#define cudaGetDevice megakernels_emu_cudaGetDevice
#define cudaSetDevice megakernels_emu_cudaSetDevice
#define cudaGetDeviceCount megakernels_emu_cudaGetDeviceCount
#define cudaDeviceGetAttribute megakernels_emu_cudaDeviceGetAttribute
#define cudaFuncSetAttribute megakernels_emu_cudaFuncSetAttribute
#define cudaDeviceSynchronize megakernels_emu_cudaDeviceSynchronize
#define cudaStreamSynchronize megakernels_emu_cudaStreamSynchronize
#define cudaMemsetAsync megakernels_emu_cudaMemsetAsync
#define cudaMemset megakernels_emu_cudaMemset
#define cudaMemcpyAsync megakernels_emu_cudaMemcpyAsync
#define cudaMemcpy megakernels_emu_cudaMemcpy
#define cudaMemcpyToSymbol megakernels_emu_cudaMemcpyToSymbol
#define cudaMemcpyFromSymbol megakernels_emu_cudaMemcpyFromSymbol
