// C++ test of SwiGLU without Python: the CUDA kernels (run by the emulator, csrc/emu) against the CPU kernels and a
// naive fp64 reference, forward and backward, over dtypes, widths f (scalar and 16-byte packs, warp- and
// block-per-row paths), row strides wider than 2f (a view), unaligned rows, and saturating gate values. Built plain,
// with AddressSanitizer and with ThreadSanitizer (CMakeLists.txt).
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "../../common/cpu_types.h"
#include "../../common/test_util.h"
#include "../swiglu.h"

using namespace megakernels;
using namespace megakernels::testing;

namespace {

// rows x [2f] stored with row stride `stride` (>= 2f) from element `off` of its buffer.
void run_case(DType dt, int64_t rows, int64_t f, int64_t stride, size_t off, float scale, std::mt19937& rng) {
  const std::string tag = std::string(dtype_name(dt)) + " rows=" + std::to_string(rows) + " f=" + std::to_string(f) +
                          " stride=" + std::to_string(stride) + (off ? " unaligned" : "");
  Buf x = random_buf(dt, size_t(rows * stride), rng, scale, 0.f, off);
  Buf dy = random_buf(dt, size_t(rows * f), rng, 1.f);
  std::vector<double> y_ref(size_t(rows * f)), dx_ref(size_t(rows * 2 * f));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < f; ++j) {
      const double g = x.get(size_t(r * stride + j)), u = x.get(size_t(r * stride + f + j));
      const double s = 1.0 / (1.0 + std::exp(-g)), g_dy = dy.get(size_t(r * f + j));
      y_ref[size_t(r * f + j)] = g * s * u;
      dx_ref[size_t(r * 2 * f + j)] = g_dy * u * (s + g * s * (1.0 - s));
      dx_ref[size_t(r * 2 * f + f + j)] = g_dy * g * s;
    }
  swiglu::Args a{};
  a.x = x.data();
  a.dy = dy.data();
  a.rows = rows, a.f = f, a.x_stride = stride, a.dy_stride = f, a.dtype = dt;
  const float t = dt == DType::F64 ? 1e-6f : tol(dt);  // Buf reads values back as float
  Buf y_cpu(dt, size_t(rows * f)), y_emu(dt, size_t(rows * f));
  a.y = y_cpu.data();
  cpu::swiglu_fwd_rows(a, 0, rows);
  a.y = y_emu.data();
  const char* err = cuda_emu::swiglu_fwd(a, nullptr);
  expect(err == nullptr, tag + " fwd launch: " + (err ? err : ""));
  compare(tag + " y cpu vs fp64", y_cpu, y_ref, t);
  compare(tag + " y emu vs fp64", y_emu, y_ref, t);
  compare(tag + " y emu vs cpu", y_emu, as_doubles(y_cpu), t);

  Buf dx_cpu(dt, size_t(rows * 2 * f)), dx_emu(dt, size_t(rows * 2 * f));
  a.y = dx_cpu.data();
  cpu::swiglu_bwd_rows(a, 0, rows);
  a.y = dx_emu.data();
  err = cuda_emu::swiglu_bwd(a, nullptr);
  expect(err == nullptr, tag + " bwd launch: " + (err ? err : ""));
  compare(tag + " dx cpu vs fp64", dx_cpu, dx_ref, 2 * t);
  compare(tag + " dx emu vs fp64", dx_emu, dx_ref, 2 * t);
  compare(tag + " dx emu vs cpu", dx_emu, as_doubles(dx_cpu), 2 * t);
}

}  // namespace

int main() {
  std::mt19937 rng(4321);
  const DType dtypes[] = {DType::F32, DType::BF16, DType::F16, DType::F64};
  for (DType dt : dtypes) {
    for (int64_t f : {1, 3, 8, 40, 1000, 2056, 4104}) {
      run_case(dt, 5, f, 2 * f, 0, 2.f, rng);             // contiguous rows
      run_case(dt, 3, f, 2 * f + 8, 0, 2.f, rng);         // a view: rows wider than 2f
      if (f > 1) run_case(dt, 3, f, 2 * f, 1, 2.f, rng);  // every row start unaligned: scalar path
    }
    run_case(dt, 4, 64, 128, 0, 60.f, rng);  // |gate| up to ~200: exp saturates, silu -> 0 or g, no NaN
  }
  return report();
}
