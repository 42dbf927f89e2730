// C++ test of the gated activations (SwiGLU, clamped SwiGLU, GeGLU) without Python: the CUDA kernels (run by the
// emulator, csrc/emu) against the CPU kernels and a naive fp64 reference, forward and backward, over dtypes, widths f
// (scalar and 16-byte packs, warp- and block-per-row paths), row strides wider than 2f (a view), unaligned rows, and
// saturating gate values. Built plain, with AddressSanitizer and with ThreadSanitizer (CMakeLists.txt).
#include <algorithm>
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

// The fp64 reference of one element, written from the formulas (not from swiglu.h's helpers).
void reference(swiglu::Act act, double g, double u, double dy, double& y, double& dg, double& du) {
  const double limit = 7.0, alpha = 1.702, c = std::sqrt(2.0 / M_PI);
  if (act == swiglu::Act::GeluTanh) {
    const double t = std::tanh(c * (g + 0.044715 * g * g * g));
    const double gelu = 0.5 * g * (1 + t);
    const double dgelu = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * c * (1 + 3 * 0.044715 * g * g);
    y = gelu * u, dg = dy * u * dgelu, du = dy * gelu;
    return;
  }
  const bool clamp = act == swiglu::Act::ClampedSiLU;
  const double gc = clamp ? std::min(g, limit) : g, uc = clamp ? std::clamp(u, -limit, limit) + 1 : u;
  const double a = clamp ? alpha : 1.0, s = 1.0 / (1.0 + std::exp(-a * gc));
  y = gc * s * uc;
  dg = (clamp && g >= limit) ? 0.0 : dy * uc * (s + a * gc * s * (1.0 - s));
  du = (clamp && std::abs(u) >= limit) ? 0.0 : dy * gc * s;
}

// rows x [2f] stored with row stride `stride` (>= 2f) from element `off` of its buffer.
void run_case(swiglu::Act act, DType dt, int64_t rows, int64_t f, int64_t stride, size_t off, float scale,
              std::mt19937& rng) {
  const std::string tag = "act=" + std::to_string(int(act)) + " " + std::string(dtype_name(dt)) +
                          " rows=" + std::to_string(rows) + " f=" + std::to_string(f) +
                          " stride=" + std::to_string(stride) + (off ? " unaligned" : "");
  Buf x = random_buf(dt, size_t(rows * stride), rng, scale, 0.f, off);
  Buf dy = random_buf(dt, size_t(rows * f), rng, 1.f);
  std::vector<double> y_ref(size_t(rows * f)), dx_ref(size_t(rows * 2 * f));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < f; ++j) {
      const double g = x.get(size_t(r * stride + j)), u = x.get(size_t(r * stride + f + j));
      reference(act, g, u, dy.get(size_t(r * f + j)), y_ref[size_t(r * f + j)], dx_ref[size_t(r * 2 * f + j)],
                dx_ref[size_t(r * 2 * f + f + j)]);
    }
  swiglu::Args a{};
  a.x = x.data();
  a.dy = dy.data();
  a.rows = rows, a.f = f, a.x_stride = stride, a.dy_stride = f, a.dtype = dt;
  a.act = act, a.limit = 7.0, a.alpha = 1.702;
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
  const swiglu::Act acts[] = {swiglu::Act::SiLU, swiglu::Act::ClampedSiLU, swiglu::Act::GeluTanh};
  for (swiglu::Act act : acts)
    for (DType dt : dtypes) {
      for (int64_t f : {1, 3, 8, 40, 1000, 2056, 4104}) {
        // scale 4 for the clamped form: values on both sides of the bound (7)
        const float scale = act == swiglu::Act::ClampedSiLU ? 4.f : 2.f;
        run_case(act, dt, 5, f, 2 * f, 0, scale, rng);             // contiguous rows
        run_case(act, dt, 3, f, 2 * f + 8, 0, scale, rng);         // a view: rows wider than 2f
        if (f > 1) run_case(act, dt, 3, f, 2 * f, 1, scale, rng);  // every row start unaligned: scalar path
      }
      run_case(act, dt, 4, 64, 128, 0, 60.f, rng);  // |gate| up to ~200: exp saturates, no NaN
    }
  return report();
}
