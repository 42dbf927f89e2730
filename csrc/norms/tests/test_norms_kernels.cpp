// C++ test of the norm family without Python: the CUDA kernels (run by the emulator, csrc/emu) against the CPU
// kernels and against a naive fp64 reference, over dtypes, hidden sizes (warp- and block-per-row paths, vector
// and scalar packs), activations, RMS/LayerNorm, with and without affine parameters. Built plain, with
// AddressSanitizer and with ThreadSanitizer (CMakeLists.txt), so an out-of-bounds access or a missing barrier in
// norms_cuda.cu fails here before it reaches a GPU.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../../common/cpu_types.h"
#include "../../common/test_util.h"
#include "../norms.h"

using namespace megakernels;
using namespace megakernels::testing;
using cpu::bf16;
using cpu::f16;

namespace {

void compare_floats(const std::string& what, const std::vector<float>& a, const std::vector<float>& b, float t) {
  float err = 0.f;
  for (size_t i = 0; i < a.size(); ++i) err = std::fmax(err, std::fabs(a[i] - b[i]) / std::fmax(1.f, std::fabs(b[i])));
  expect(err <= t && std::isfinite(err), what + ": max rel error " + std::to_string(err));
}

void test_norm(DType dt, DType wdt, int64_t rows, int64_t H, Activation act, bool rms, bool affine, std::mt19937& rng) {
  const std::string tag = std::string(rms ? "rms" : "ln") + " " + dtype_name(dt) + "/" + dtype_name(wdt) +
                          " rows=" + std::to_string(rows) + " H=" + std::to_string(H) +
                          " act=" + std::to_string(int(act)) + (affine ? "" : " no-affine");
  const size_t n = size_t(rows * H);
  Buf x = random_buf(dt, n, rng, 2.f, 0.5f), dy = random_buf(dt, n, rng, 1.f, 0.f);
  Buf w = random_buf(wdt, size_t(H), rng, 0.5f, 1.f), b = random_buf(wdt, size_t(H), rng, 0.5f, 0.f);

  norms::FwdArgs f{};
  f.x = x.data();
  f.w = affine ? w.data() : nullptr;
  f.b = affine && !rms ? b.data() : nullptr;
  f.rows = rows;
  f.hidden = H;
  f.eps = 1e-5;
  f.x_dtype = dt;
  f.w_dtype = wdt;
  f.act = act;
  f.rms = rms;
  Buf y_cpu(dt, n), y_emu(dt, n);
  std::vector<float> mean_cpu(rows), rstd_cpu(rows), mean_emu(rows), rstd_emu(rows);
  f.y = y_cpu.data();
  f.mean = mean_cpu.data();
  f.rstd = rstd_cpu.data();
  cpu::norm_fwd_rows(f, 0, rows);
  f.y = y_emu.data();
  f.mean = mean_emu.data();
  f.rstd = rstd_emu.data();
  const char* err = cuda_emu::norm_fwd(f, nullptr);
  expect(err == nullptr, tag + " fwd launch: " + (err ? err : ""));
  compare(tag + " y emu vs cpu", y_emu, y_cpu, tol(dt));
  compare_floats(tag + " rstd emu vs cpu", rstd_emu, rstd_cpu, 1e-5f);
  if (!rms) compare_floats(tag + " mean emu vs cpu", mean_emu, mean_cpu, 1e-5f);

  // fp64 reference of the forward pass from the same stored inputs.
  Buf y_ref(DType::F32, n);
  for (int64_t r = 0; r < rows; ++r) {
    double m = 0, v = 0;
    for (int64_t j = 0; j < H; ++j) m += x.get(size_t(r * H + j));
    m = rms ? 0 : m / double(H);
    for (int64_t j = 0; j < H; ++j) v += (x.get(size_t(r * H + j)) - m) * (x.get(size_t(r * H + j)) - m);
    const double rs = 1.0 / std::sqrt(v / double(H) + 1e-5);
    for (int64_t j = 0; j < H; ++j) {
      double z = (x.get(size_t(r * H + j)) - m) * rs;
      if (affine) z = z * w.get(size_t(j)) + (rms ? 0.0 : b.get(size_t(j)));
      y_ref.set(size_t(r * H + j), float(gelu64(z, act)));
    }
  }
  compare(tag + " y emu vs fp64", y_emu, y_ref, tol(dt));

  norms::BwdArgs g{};
  g.dy = dy.data();
  g.x = x.data();
  g.w = f.w;
  g.b = f.b;
  g.mean = mean_cpu.data();
  g.rstd = rstd_cpu.data();
  g.rows = rows;
  g.hidden = H;
  g.x_dtype = dt;
  g.w_dtype = wdt;
  g.act = act;
  g.rms = rms;
  Buf dx_cpu(dt, n), dx_emu(dt, n), dw_cpu(wdt, size_t(H)), dw_emu(wdt, size_t(H)), db_cpu(wdt, size_t(H)),
      db_emu(wdt, size_t(H));
  const bool has_w = g.w != nullptr, has_b = g.b != nullptr;
  std::vector<unsigned char> ws_cpu(size_t(cpu::norm_bwd_workspace_bytes(rows, H, dt)));
  g.dx = dx_cpu.data();
  g.dw = has_w ? dw_cpu.data() : nullptr;
  g.db = has_b ? db_cpu.data() : nullptr;
  g.workspace = ws_cpu.data();
  for (int64_t c = 0; c < cpu::norm_bwd_chunks(rows, H); ++c) cpu::norm_bwd_chunk(g, c);
  cpu::norm_bwd_finish_cols(g, 0, H);
  // Poison the emulated kernel's workspace: every partial it sums must have been written by it.
  std::vector<unsigned char> ws_emu(size_t(cuda_emu::norm_bwd_workspace_bytes(rows, H, dt)), 0xFF);
  g.dx = dx_emu.data();
  g.dw = has_w ? dw_emu.data() : nullptr;
  g.db = has_b ? db_emu.data() : nullptr;
  g.workspace = ws_emu.data();
  err = cuda_emu::norm_bwd(g, nullptr);
  expect(err == nullptr, tag + " bwd launch: " + (err ? err : ""));
  compare(tag + " dx emu vs cpu", dx_emu, dx_cpu, 2 * tol(dt));
  const float ptol = 2 * tol(wdt == DType::F32 ? dt : wdt) * std::fmax(1.f, std::sqrt(float(rows)));
  if (has_w) compare(tag + " dw emu vs cpu", dw_emu, dw_cpu, ptol);
  if (has_b) compare(tag + " db emu vs cpu", db_emu, db_cpu, ptol);
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  // Hidden sizes: 1 and odd sizes (scalar packs), warp-per-row (<= 8 packs per lane), block-per-row (> 256 packs).
  const int64_t hiddens[] = {1, 3, 40, 256, 1000, 2056, 4104};
  const DType dtypes[] = {DType::F32, DType::BF16, DType::F16};
  const Activation acts[] = {Activation::None, Activation::Gelu, Activation::GeluTanh};
  for (DType dt : dtypes) {
    for (int64_t H : hiddens) {
      const int64_t rows = H >= 2056 ? 3 : 6;  // 6 rows: one full 4-warp block plus a partly idle one
      for (Activation act : acts) test_norm(dt, dt, rows, H, act, false, true, rng);
      test_norm(dt, dt, rows, H, Activation::None, true, true, rng);
      test_norm(dt, dt, rows, H, Activation::Gelu, false, false, rng);
      if (dt != DType::F32) {
        test_norm(dt, DType::F32, rows, H, Activation::GeluTanh, false, true, rng);
        test_norm(dt, DType::F32, rows, H, Activation::None, true, true, rng);
      }
    }
  }
  return report();
}
