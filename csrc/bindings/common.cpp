// Definitions of csrc/bindings/common.h.
#include "common.h"

#include <cmath>
#include <cstdlib>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace megakernels {
namespace bindings {

int64_t build_flags() {
  int64_t f = 0;
#ifdef MEGAKERNELS_WITH_CUDA
  f |= kFlagCuda;
#endif
#ifdef MEGAKERNELS_WITH_EMU
  f |= kFlagEmu;
#endif
  return f;
}

namespace {

constexpr const char* kIsaNames[] = {"baseline", "avx2", "avx512", "native"};

struct IsaChoice {
  CpuIsa isa;
  std::string error;  // non-empty: MEGAKERNELS_CPU_ISA asked for what cannot run
};

// What MEGAKERNELS_CPU_ISA=want chooses on a CPU whose best clone is ``best`` (a portable build).
[[maybe_unused]] IsaChoice choose_among_clones(CpuIsa best, const std::string& want) {
  if (want.empty()) return {best, ""};
  for (int i = 0; i < 3; ++i) {
    if (want != kIsaNames[i]) continue;
    if (i > int(best))
      return {best, "MEGAKERNELS_CPU_ISA=" + want + " asks for an instruction set this CPU lacks (it runs " +
                        kIsaNames[int(best)] + " at most)"};
    return {CpuIsa(i), ""};
  }
  return {best, "MEGAKERNELS_CPU_ISA=" + want + " is not one of baseline, avx2, avx512"};
}

IsaChoice choose_cpu_isa() {
  const char* env = std::getenv("MEGAKERNELS_CPU_ISA");
  const std::string want = env ? env : "";
#if defined(MEGAKERNELS_CPU_CLONES)
  // x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE; v4 adds AVX-512 F, BW, VL, DQ, CD (and the OS saves its
  // state: __builtin_cpu_supports checks XCR0)
  __builtin_cpu_init();
  const CpuIsa best = __builtin_cpu_supports("x86-64-v4")   ? CpuIsa::kAvx512
                      : __builtin_cpu_supports("x86-64-v3") ? CpuIsa::kAvx2
                                                            : CpuIsa::kBaseline;
  return choose_among_clones(best, want);
#else
  if (want.empty() || want == "native") return {CpuIsa::kNative, ""};
  return {CpuIsa::kNative, "MEGAKERNELS_CPU_ISA=" + want +
                               " cannot be chosen: this build holds the CPU kernels for one target only (built with "
                               "MEGAKERNELS_NATIVE=1, or not for x86-64)"};
#endif
}

}  // namespace

CpuIsa cpu_isa() {
  static const IsaChoice choice = choose_cpu_isa();
  TORCH_CHECK_VALUE(choice.error.empty(), "megakernels: ", choice.error);
  return choice.isa;
}

std::string cpu_isa_name() { return kIsaNames[int(cpu_isa())]; }

std::string cpu_isa_refusal(const std::string& best, const std::string& want) {
  for (int i = 0; i < 3; ++i)
    if (best == kIsaNames[i]) return choose_among_clones(CpuIsa(i), want).error;
  TORCH_CHECK_VALUE(false, "cpu_isa_refusal: best must be baseline, avx2 or avx512, got ", best);
}

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kDouble: return DType::F64;
    default: TORCH_CHECK(false, "unsupported dtype");
  }
}

void check_float_input(const char* op, const char* name, const at::Tensor& t) {
  const auto s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kFloat || s == at::kHalf || s == at::kBFloat16 || s == at::kDouble, op, ": ", name,
                   " has dtype ", s, "; expected float32, float16, bfloat16 or float64");
}

// weight/bias: 1-D, `hidden` elements, on x's device, dtype equal to x's or float32 (mixed precision, only for a
// 16-bit x: an fp32 x with fp32 weights is already "mixed").
void check_param(const char* op, const char* name, const at::Tensor& p, const at::Tensor& x, int64_t hidden) {
  check_float_input(op, name, p);
  TORCH_CHECK_VALUE(p.dim() == 1 && p.numel() == hidden, op, ": ", name, " has shape ", p.sizes(), ", expected [",
                    hidden, "] (the hidden size, x's last dimension)");
  check_same_device(op, name, p, "x", x);
  const bool half_x = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
  TORCH_CHECK_TYPE(p.scalar_type() == x.scalar_type() || (half_x && p.scalar_type() == at::kFloat), op, ": ", name,
                   " has dtype ", p.scalar_type(), " but x has dtype ", x.scalar_type(),
                   "; expected the same dtype, or float32 for a float16/bfloat16 x");
}

void check_backend(const char* op, const at::Tensor& x, bool emulate) {
  TORCH_CHECK_VALUE(x.device().is_cpu() || x.device().is_cuda(), op, ": x is on ", x.device(),
                    "; expected a CPU or CUDA tensor");
  if (x.device().is_cuda()) {
    TORCH_CHECK_VALUE(!emulate, op, ": the cuda_emu backend runs CPU tensors; x is on ", x.device());
    TORCH_CHECK(build_flags() & kFlagCuda, op, ": x is a CUDA tensor but megakernels was built without CUDA ",
                "(reinstall with nvcc and a CUDA build of torch present)");
  }
  if (emulate)
    TORCH_CHECK(build_flags() & kFlagEmu, op, ": backend cuda_emu requested but the emulated CUDA kernels were not ",
                "built (they need the CUDA headers at build time: set CUDA_HOME and reinstall)");
}

void check_same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
                    ref.device(), "; every tensor argument must be on one device");
}

void check_same(const char* op, const char* name, const at::Tensor& t, const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.sizes() == ref.sizes(), op, ": ", name, " has shape ", t.sizes(), ", expected ", ref.sizes(),
                    " (", ref_name, "'s shape)");
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(), ", expected ",
                   ref.scalar_type(), " (", ref_name, "'s dtype)");
  check_same_device(op, name, t, ref_name, ref);
}

int64_t hidden_of(const char* op, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x must have at least 1 dimension (the normalised one); got a scalar");
  const int64_t h = x.size(-1);
  TORCH_CHECK_VALUE(h >= 1, op, ": x has an empty last dimension (hidden size 0); nothing to normalise");
  return h;
}

void* data_or_null(const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

c10::optional<at::Tensor> contiguous_opt(const c10::optional<at::Tensor>& t) {
  if (!t.has_value()) return t;
  return t->contiguous();
}

void raise_if(const char* op, const char* err) { TORCH_CHECK(err == nullptr, op, ": CUDA kernel failed: ", err); }

#ifdef MEGAKERNELS_WITH_CUDA
void* stream_of(const at::Tensor& x) { return c10::cuda::getCurrentCUDAStream(x.device().index()).stream(); }
#endif

// A large fresh CPU output is first touched by the kernel, page by page: on Linux each 4 KiB page fault costs
// ~1 us, more than the whole fused kernel spends per page (a 32 MiB output: ~8 ms of faults vs ~2 ms of math).
// Advising transparent huge pages for the 2 MiB-aligned interior turns 8192 faults into 16. It only changes how
// the kernel backs memory that this op is about to overwrite entirely; torch does the same for its own
// allocations under THP_MEM_ALLOC_ENABLE=1.
LaunchScope::LaunchScope(const at::Tensor& x) {
#ifdef MEGAKERNELS_WITH_CUDA
  if (x.is_cuda()) {
    guard_.emplace(x.device());
    stream_ = stream_of(x);
  }
#else
  (void)x;
#endif
}

void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  if (!t.device().is_cpu() || t.nbytes() < 4 * kHuge) return;
  const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t begin = (p + kHuge - 1) & ~(kHuge - 1), end = (p + t.nbytes()) & ~(kHuge - 1);
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // advice only
#else
  (void)t;
#endif
}

}  // namespace bindings
}  // namespace megakernels
