// Shared by the torch-facing C++ (csrc/bindings/*.cpp): argument checks whose errors name the argument and
// the rule, dtype mapping to the torch-free kernels, and backend/stream plumbing. Each kernel family has one
// bindings file that checks, allocates and dispatches (CUDA tensor -> megakernels::cuda::*, CPU tensor ->
// megakernels::cpu::*, CPU tensor with emulate=true -> megakernels::cuda_emu::*) and registers its ops with
// TORCH_LIBRARY_FRAGMENT(megakernels, ...); autograd and fake implementations live in Python (megakernels/ops/).
#pragma once
// Per-operator headers instead of <ATen/ATen.h>: the bindings need Tensor, its methods and three factories, and
// parsing all of ATen took about half of each bindings file's compile time.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>

#ifdef MEGAKERNELS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "../common/math.h"

namespace megakernels {
namespace bindings {

constexpr int64_t kFlagCuda = 1, kFlagEmu = 2;

// The CPU kernels' instruction set for this process (csrc/common/cpu_isa.h). A portable build (the default on
// x86-64) holds the kernels for the baseline, AVX2 and AVX-512 and runs the best this CPU has, or the one
// MEGAKERNELS_CPU_ISA=baseline|avx2|avx512 names; kNative: a build for one target (MEGAKERNELS_NATIVE=1, or not
// x86-64). Chosen once per process; an unknown value, or an ISA this CPU lacks, raises ValueError naming the
// variable (every CPU kernel call does, so nothing runs an instruction the CPU lacks).
enum class CpuIsa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2, kNative = 3 };
CpuIsa cpu_isa();
std::string cpu_isa_name();  // "baseline", "avx2", "avx512" or "native" (the op megakernels::cpu_isa)
// The refusal MEGAKERNELS_CPU_ISA=want meets on a CPU whose best clone is best ("" when it is chosen): the choice
// cpu_isa() makes, for any CPU (the op megakernels::cpu_isa_refusal; tests)
std::string cpu_isa_refusal(const std::string& best, const std::string& want);

#if defined(MEGAKERNELS_CPU_CLONES)
template <class F>
F pick_cpu(F baseline, F avx2, F avx512) {
  switch (cpu_isa()) {
    case CpuIsa::kAvx512: return avx512;
    case CpuIsa::kAvx2: return avx2;
    default: return baseline;
  }
}
// The CPU kernel `fn` of the chosen ISA (cpu::fn, cpu_avx2::fn or cpu_avx512::fn).
#define MK_CPU(fn)                                                                          \
  (::megakernels::bindings::pick_cpu(&::megakernels::cpu::fn, &::megakernels::cpu_avx2::fn, \
                                     &::megakernels::cpu_avx512::fn))
#else
#define MK_CPU(fn) (::megakernels::bindings::cpu_isa(), &::megakernels::cpu::fn)
#endif
// Which backends this build contains (kFlagCuda | kFlagEmu); the CPU kernels are always there.
int64_t build_flags();

DType to_dtype(at::ScalarType t);
// x (or any activation tensor) must be fp32/fp16/bf16/fp64: TypeError naming it otherwise.
void check_float_input(const char* op, const char* name, const at::Tensor& t);
// weight/bias-like: 1-D, `hidden` elements, on x's device, dtype equal to x's or fp32 for a 16-bit x.
void check_param(const char* op, const char* name, const at::Tensor& p, const at::Tensor& x, int64_t hidden);
// x on CPU or CUDA; the requested backend (emulate) exists in this build and can take x.
void check_backend(const char* op, const at::Tensor& x, bool emulate);
// t is on ref's device: ValueError naming both and their devices (every tensor argument of an op shares one).
void check_same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref);
// t has the shape, dtype and device of `ref` (named ref_name in the message).
void check_same(const char* op, const char* name, const at::Tensor& t, const char* ref_name, const at::Tensor& ref);
// x.size(-1), which must exist and be >= 1.
int64_t hidden_of(const char* op, const at::Tensor& x);
void* data_or_null(const c10::optional<at::Tensor>& t);
c10::optional<at::Tensor> contiguous_opt(const c10::optional<at::Tensor>& t);
// Turns a launcher's error string (nullptr = success) into a RuntimeError.
void raise_if(const char* op, const char* err);
#ifdef MEGAKERNELS_WITH_CUDA
void* stream_of(const at::Tensor& x);
#endif
void advise_huge_pages(const at::Tensor& t);
// Rows per at::parallel_for grain for rows of `row_elements`: enough elements per task to amortise its overhead.
inline int64_t row_grain(int64_t row_elements) { return std::max<int64_t>(1, 16384 / row_elements); }

// Where a launch of the CUDA kernels goes: for a CUDA tensor its device (guarded for the scope) and current
// stream; for the emulator (a CPU tensor) no stream.
class LaunchScope {
 public:
  explicit LaunchScope(const at::Tensor& x);
  void* stream() const { return stream_; }

 private:
#ifdef MEGAKERNELS_WITH_CUDA
  std::optional<c10::cuda::CUDAGuard> guard_;
#endif
  void* stream_ = nullptr;
};

// A family's CUDA launchers exist twice with the same signatures: built by nvcc (namespace cuda) and for the
// emulator (namespace cuda_emu). `select_kernels` returns the table for x -- the nvcc build for a CUDA tensor,
// the emulated build for a CPU tensor with emulate=true -- or nullptr when the CPU kernels should run. The
// tables are made with MK_KERNEL_TABLE(Table, ns) so that a build without CUDA never names the missing one.
#ifdef MEGAKERNELS_WITH_CUDA
#define MK_IF_CUDA(...) __VA_ARGS__
#else
#define MK_IF_CUDA(...) nullptr
#endif
#ifdef MEGAKERNELS_WITH_EMU
#define MK_IF_EMU(...) __VA_ARGS__
#else
#define MK_IF_EMU(...) nullptr
#endif
template <class Table>
const Table* select_kernels(const at::Tensor& x, bool emulate, const Table* cuda_table, const Table* emu_table) {
  const Table* t = x.is_cuda() ? cuda_table : (emulate ? emu_table : nullptr);
  TORCH_CHECK(t != nullptr || (!x.is_cuda() && !emulate), "megakernels: backend not built (checked earlier)");
  return t;
}

}  // namespace bindings
}  // namespace megakernels
