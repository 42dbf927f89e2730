// C++ test of the bias-GeLU family without Python: the CUDA kernels (run by the emulator, csrc/emu) against the CPU
// kernels and against a naive fp64 reference, over dtypes, hidden sizes (vector and scalar packs, row plans of one
// warp and of a block per row), both GeLU forms and fp32 bias with 16-bit x. Built plain, with AddressSanitizer
// and with ThreadSanitizer (CMakeLists.txt).
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "../../common/cpu_types.h"
#include "../../common/test_util.h"
#include "../bias_gelu.h"

using namespace megakernels;
using namespace megakernels::testing;

namespace {

void test_bias_gelu(DType dt, DType wdt, int64_t rows, int64_t H, Activation act, std::mt19937& rng) {
  const std::string tag = std::string("bias_gelu ") + dtype_name(dt) + "/" + dtype_name(wdt) +
                          " rows=" + std::to_string(rows) + " H=" + std::to_string(H) +
                          " act=" + std::to_string(int(act));
  const size_t n = size_t(rows * H);
  Buf x = random_buf(dt, n, rng, 2.f, 0.f), dy = random_buf(dt, n, rng, 1.f, 0.f);
  Buf bias = random_buf(wdt, size_t(H), rng, 1.f, 0.f);
  bias_gelu::Args a{};
  a.x = x.data();
  a.bias = bias.data();
  a.dy = dy.data();
  a.rows = rows;
  a.hidden = H;
  a.x_dtype = dt;
  a.w_dtype = wdt;
  a.act = act;
  Buf y_cpu(dt, n), y_emu(dt, n), y_ref(DType::F32, n);
  a.y = y_cpu.data();
  cpu::bias_gelu_fwd_rows(a, 0, rows);
  a.y = y_emu.data();
  const char* err = cuda_emu::bias_gelu_fwd(a, nullptr);
  expect(err == nullptr, tag + " fwd launch");
  for (size_t i = 0; i < n; ++i) y_ref.set(i, float(gelu64(double(x.get(i)) + bias.get(i % size_t(H)), act)));
  compare(tag + " y emu vs cpu", y_emu, y_cpu, tol(dt));
  compare(tag + " y emu vs fp64", y_emu, y_ref, tol(dt));

  Buf dx_cpu(dt, n), dx_emu(dt, n), db_cpu(wdt, size_t(H)), db_emu(wdt, size_t(H));
  std::vector<unsigned char> ws_cpu(size_t(cpu::bias_gelu_bwd_workspace_bytes(rows, H, dt)));
  a.y = dx_cpu.data();
  a.dbias = db_cpu.data();
  a.workspace = ws_cpu.data();
  for (int64_t c = 0; c < cpu::bias_gelu_bwd_chunks(rows, H); ++c) cpu::bias_gelu_bwd_chunk(a, c);
  cpu::bias_gelu_bwd_finish_cols(a, 0, H);
  std::vector<unsigned char> ws_emu(size_t(cuda_emu::bias_gelu_bwd_workspace_bytes(rows, H, dt)), 0xFF);
  a.y = dx_emu.data();
  a.dbias = db_emu.data();
  a.workspace = ws_emu.data();
  err = cuda_emu::bias_gelu_bwd(a, nullptr);
  expect(err == nullptr, tag + " bwd launch");
  compare(tag + " dx emu vs cpu", dx_emu, dx_cpu, 2 * tol(dt));
  compare(tag + " dbias emu vs cpu", db_emu, db_cpu,
          2 * tol(wdt == DType::F32 ? dt : wdt) * std::fmax(1.f, std::sqrt(float(rows))));
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  const int64_t hiddens[] = {1, 3, 40, 256, 1000, 2056, 4104};
  const DType dtypes[] = {DType::F32, DType::BF16, DType::F16};
  for (DType dt : dtypes) {
    for (int64_t H : hiddens) {
      const int64_t rows = H >= 2056 ? 3 : 6;
      test_bias_gelu(dt, dt, rows, H, Activation::GeluTanh, rng);
      test_bias_gelu(dt, dt, rows, H, Activation::Gelu, rng);
      if (dt != DType::F32) test_bias_gelu(dt, DType::F32, rows, H, Activation::GeluTanh, rng);
    }
  }
  return report();
}
