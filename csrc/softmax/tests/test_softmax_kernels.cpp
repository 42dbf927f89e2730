// C++ test of the softmax family without Python: the CUDA kernels (run by the emulator, csrc/emu) against the CPU
// kernels and a naive fp64 reference, over dtypes, row lengths (warp- and block-per-row paths, vector and scalar
// packs), no mask / broadcast boolean masks / causal with sq != sk, and fully masked rows. Built plain, with
// AddressSanitizer and with ThreadSanitizer (CMakeLists.txt), so an out-of-bounds access, a read of the causal
// kernels' masked triangle or a missing barrier in softmax_cuda.cu fails here before it reaches a GPU.
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../../common/cpu_types.h"
#include "../../common/test_util.h"
#include "../softmax.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

using namespace megakernels;
using namespace megakernels::testing;
using cpu::bf16;
using cpu::f16;
using softmax::MaskKind;

namespace {

// The causal kernels must not read the masked triangle. Under AddressSanitizer the masked tail of every row is
// poisoned while they run (from the first 8-byte granule wholly inside it: ASan's granularity), so a read there is
// a hard error rather than a value that happened to be ignored. Elsewhere this is a no-op.
void poison_causal_tails(const Buf& b, int64_t rows, int64_t sq, int64_t sk, bool poison) {
#if defined(__SANITIZE_ADDRESS__)
  const size_t elem = b.dt == DType::F32 ? 4 : 2;
  for (int64_t r = 0; r < rows; ++r) {
    const uintptr_t row = reinterpret_cast<uintptr_t>(b.bytes.data()) + size_t(r * sk) * elem;
    const uintptr_t begin = (row + size_t(softmax::causal_valid(r % sq, sq, sk)) * elem + 7) & ~uintptr_t(7);
    const uintptr_t end = row + size_t(sk) * elem;
    if (end > begin) {
      if (poison)
        ASAN_POISON_MEMORY_REGION(reinterpret_cast<void*>(begin), end - begin);
      else
        ASAN_UNPOISON_MEMORY_REGION(reinterpret_cast<void*>(begin), end - begin);
    }
  }
#else
  (void)b, (void)rows, (void)sq, (void)sk, (void)poison;
#endif
}

// Mask shape [mb, mh, mq, sk] broadcast against x [b, h, sq, sk]; contiguous, strides 0 on broadcast dims.
struct Mask {
  int64_t mb, mh, mq;
  std::vector<unsigned char> m;
};

void test_case(DType dt, MaskKind kind, int64_t b, int64_t h, int64_t sq, int64_t sk, const Mask* mask,
               std::mt19937& rng) {
  const std::string tag = std::string(kind == MaskKind::None   ? "plain"
                                      : kind == MaskKind::Bool ? "masked"
                                                               : "causal") +
                          " " + dtype_name(dt) + " [" + std::to_string(b) + "," + std::to_string(h) + "," +
                          std::to_string(sq) + "," + std::to_string(sk) + "]" +
                          (mask ? " mask [" + std::to_string(mask->mb) + "," + std::to_string(mask->mh) + "," +
                                      std::to_string(mask->mq) + "]"
                                : "");
  const int64_t rows = b * h * sq;
  const size_t n = size_t(rows * sk);
  const double scale = 0.37;
  Buf x = random_buf(dt, n, rng, 3.f), dy = random_buf(dt, n, rng, 1.f);

  softmax::FwdArgs f{};
  f.x = x.data();
  f.rows = rows;
  f.sq = sq;
  f.sk = sk;
  f.heads = h;
  f.scale = scale;
  f.dtype = dt;
  f.kind = kind;
  if (mask) {
    f.mask = mask->m.data();
    f.mask_sq = mask->mq == 1 ? 0 : sk;
    f.mask_sh = mask->mh == 1 ? 0 : mask->mq * sk;
    f.mask_sb = mask->mb == 1 ? 0 : mask->mh * mask->mq * sk;
  }
  auto masked = [&](int64_t r, int64_t j) {
    const int64_t i = r % sq, bh = r / sq;
    if (kind == MaskKind::Causal) return j > i + (sk - sq);
    if (kind == MaskKind::None) return false;
    return mask->m[size_t((bh / h) * f.mask_sb + (bh % h) * f.mask_sh + i * f.mask_sq + j)] != 0;
  };

  // fp64 reference from the same stored inputs: y, then dx = scale * y * (dy - sum(dy * y)).
  std::vector<double> y_ref(n), dx_ref(n);
  int64_t dead_rows = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double m = -std::numeric_limits<double>::infinity(), s = 0, dot = 0;
    bool any = false;
    for (int64_t j = 0; j < sk; ++j)
      if (!masked(r, j)) m = std::fmax(m, double(x.get(size_t(r * sk + j))) * scale), any = true;
    for (int64_t j = 0; j < sk; ++j)
      if (!masked(r, j)) s += std::exp(double(x.get(size_t(r * sk + j))) * scale - m);
    dead_rows += !any;
    for (int64_t j = 0; j < sk; ++j) {
      const size_t k = size_t(r * sk + j);
      y_ref[k] = !any || masked(r, j) ? 0.0 : std::exp(double(x.get(k)) * scale - m) / s;
    }
    for (int64_t j = 0; j < sk; ++j) dot += y_ref[size_t(r * sk + j)] * double(dy.get(size_t(r * sk + j)));
    for (int64_t j = 0; j < sk; ++j) {
      const size_t k = size_t(r * sk + j);
      dx_ref[k] = scale * y_ref[k] * (double(dy.get(k)) - dot);
    }
  }

  const bool causal = kind == MaskKind::Causal;
  Buf y_cpu(dt, n), y_emu(dt, n);
  if (causal) poison_causal_tails(x, rows, sq, sk, true);
  f.y = y_cpu.data();
  cpu::softmax_fwd_rows(f, 0, rows);
  f.y = y_emu.data();
  const char* err = cuda_emu::softmax_fwd(f, nullptr);
  if (causal) poison_causal_tails(x, rows, sq, sk, false);
  expect(err == nullptr, tag + " fwd launch: " + (err ? err : ""));
  compare(tag + " y cpu vs fp64", y_cpu, y_ref, tol(dt));
  compare(tag + " y emu vs fp64", y_emu, y_ref, tol(dt));
  compare(tag + " y emu vs cpu", y_emu, as_doubles(y_cpu), tol(dt));
  // Masked positions and fully masked rows are exactly 0 in both.
  bool zeros = true;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < sk; ++j)
      if (y_ref[size_t(r * sk + j)] == 0.0 && masked(r, j))
        zeros = zeros && y_cpu.get(size_t(r * sk + j)) == 0.f && y_emu.get(size_t(r * sk + j)) == 0.f;
  expect(zeros, tag + " masked outputs are exactly 0" + (dead_rows ? " (incl. fully masked rows)" : ""));

  // Backward from the CPU forward's output (the same stored y for both kernels).
  softmax::BwdArgs g{};
  g.dy = dy.data();
  g.y = y_cpu.data();
  g.rows = rows;
  g.sq = sq;
  g.sk = sk;
  g.scale = scale;
  g.dtype = dt;
  g.causal = causal;
  Buf dx_cpu(dt, n), dx_emu(dt, n);
  if (causal) poison_causal_tails(y_cpu, rows, sq, sk, true), poison_causal_tails(dy, rows, sq, sk, true);
  g.dx = dx_cpu.data();
  cpu::softmax_bwd_rows(g, 0, rows);
  g.dx = dx_emu.data();
  err = cuda_emu::softmax_bwd(g, nullptr);
  if (causal) poison_causal_tails(y_cpu, rows, sq, sk, false), poison_causal_tails(dy, rows, sq, sk, false);
  expect(err == nullptr, tag + " bwd launch: " + (err ? err : ""));
  compare(tag + " dx cpu vs fp64", dx_cpu, dx_ref, 2 * tol(dt));
  compare(tag + " dx emu vs fp64", dx_emu, dx_ref, 2 * tol(dt));
  compare(tag + " dx emu vs cpu", dx_emu, as_doubles(dx_cpu), 2 * tol(dt));
}

Mask random_mask(int64_t mb, int64_t mh, int64_t mq, int64_t sk, std::mt19937& rng, bool dead_row) {
  std::bernoulli_distribution bern(0.3);
  Mask m{mb, mh, mq, std::vector<unsigned char>(size_t(mb * mh * mq * sk))};
  for (auto& v : m.m) v = bern(rng);
  if (dead_row)
    for (int64_t j = 0; j < sk; ++j) m.m[size_t(j)] = 1;  // (0, 0, 0, :) fully masked
  return m;
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  // Row lengths: 1 and odd sizes (scalar packs), warp-per-row (<= 8 packs per lane), block-per-row (> 256 packs).
  const int64_t lengths[] = {1, 3, 17, 40, 256, 1000, 2056, 4104};
  const DType dtypes[] = {DType::F32, DType::BF16, DType::F16};
  for (DType dt : dtypes) {
    for (int64_t sk : lengths) {
      const int64_t sq = sk >= 2056 ? 2 : 3;
      test_case(dt, MaskKind::None, 2, 1, sq, sk, nullptr, rng);  // 6 rows: a full 4-row block and a partial one
      // Masks broadcast over batch, heads and queries: [1,1,sq,sk], [b,1,sq,sk], [1,h,sq,sk], [b,h,1,sk].
      const int64_t shapes[][3] = {{1, 1, sq}, {2, 1, sq}, {1, 2, sq}, {2, 2, 1}};
      for (auto& s : shapes) {
        const Mask m = random_mask(s[0], s[1], s[2], sk, rng, /*dead_row=*/true);
        test_case(dt, MaskKind::Bool, 2, 2, sq, sk, &m, rng);
      }
      // Causal: square, fewer queries than keys (bottom-right aligned), more queries than keys (dead rows).
      test_case(dt, MaskKind::Causal, 1, 2, sq, sk, nullptr, rng);
      if (sk > 3) test_case(dt, MaskKind::Causal, 1, 1, sq, sk, nullptr, rng);
      test_case(dt, MaskKind::Causal, 1, 1, sk < 8 ? sk + 3 : 5, sk < 8 ? sk : 7, nullptr, rng);
    }
  }
  return report();
}
