// C++ test of rotary position embedding without Python: the CUDA kernel (run by the emulator, csrc/emu) against the
// CPU kernel and a naive fp64 reference, over dtypes, both pair layouts, head dims (scalar and 16-byte packs), GQA
// head counts, sequence-first and batch-first token grids, q/k as strided views of one packed QKV buffer,
// explicit (non-adjacent) positions with an offset, a cached cos/sin table, and the inverse rotation. Built plain,
// with AddressSanitizer and with ThreadSanitizer (CMakeLists.txt).
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "../../common/cpu_types.h"
#include "../../common/test_util.h"
#include "../rope.h"

using namespace megakernels;
using namespace megakernels::testing;

namespace {

struct Case {
  DType dt;
  bool interleaved;
  int64_t d, hq, hk, n0, n1;
  int seq_dim;
  bool positions, table, inverse;
  size_t off;  // element offset of the packed buffer: 1 makes every row start unaligned (scalar path)
};

std::string name(const Case& c) {
  return std::string(dtype_name(c.dt)) + (c.interleaved ? " interleaved" : " half") + " d=" + std::to_string(c.d) +
         " hq=" + std::to_string(c.hq) + " hk=" + std::to_string(c.hk) + " grid=" + std::to_string(c.n0) + "x" +
         std::to_string(c.n1) + " seq_dim=" + std::to_string(c.seq_dim) + (c.positions ? " positions" : "") +
         (c.table ? " table" : "") + (c.inverse ? " inverse" : "") + (c.off ? " unaligned" : "");
}

void run_case(const Case& c, std::mt19937& rng) {
  const std::string tag = name(c);
  const int64_t half = c.d / 2, heads = c.hq + 2 * c.hk;  // packed [q | k | v] heads per token
  const int64_t tokens = c.n0 * c.n1, seq = c.seq_dim == 0 ? c.n0 : c.n1, batch = tokens / seq;
  const double theta = 500000.0;
  Buf qkv = random_buf(c.dt, size_t(tokens * heads * c.d), rng, 1.f, 0.f, c.off);

  // Positions [batch, seq] with a stride of 3 (a strided view), not a range: two chunks apart (context parallel).
  std::vector<int64_t> pos_store(size_t(batch * seq * 3));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0; s < seq; ++s) pos_store[size_t((b * seq + s) * 3)] = (s < seq / 2 ? s : 9000 + s) + 7 * b;
  const int64_t offset = c.positions ? 5 : 1000;
  auto position = [&](int64_t b, int64_t s) {
    return offset + (c.positions ? pos_store[size_t((b * seq + s) * 3)] : s);
  };
  int64_t max_pos = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0; s < seq; ++s) max_pos = std::max(max_pos, position(b, s) + 1);
  // The cached table: cos/sin of the contract's fp32 angles.
  std::vector<float> table(c.table ? size_t(max_pos * c.d) : 0);
  auto inv = [&](int64_t i) { return float(std::pow(theta, -2.0 * double(i) / double(c.d))); };
  for (int64_t p = 0; p < (c.table ? max_pos : 0); ++p)
    for (int64_t i = 0; i < half; ++i) {
      const double ang = double(float(p) * inv(i));
      table[size_t(p * c.d + 2 * i)] = float(std::cos(ang));
      table[size_t(p * c.d + 2 * i + 1)] = float(std::sin(ang));
    }

  rope::Args a{};
  const int64_t hs[2] = {c.hq, c.hk};
  Buf out_cpu[2] = {Buf(c.dt, size_t(tokens * c.hq * c.d)), Buf(c.dt, size_t(tokens * c.hk * c.d))};
  Buf out_emu[2] = {Buf(c.dt, size_t(tokens * c.hq * c.d)), Buf(c.dt, size_t(tokens * c.hk * c.d))};
  const size_t esz = elem_size(c.dt);
  for (int u = 0; u < 2; ++u) {
    a.x[u] = static_cast<const unsigned char*>(qkv.data()) + size_t(u == 0 ? 0 : c.hq * c.d) * esz;
    a.heads[u] = hs[u];
    a.xs1[u] = heads * c.d, a.xs0[u] = c.n1 * heads * c.d, a.xsh[u] = c.d;
    a.ys1[u] = hs[u] * c.d, a.ys0[u] = c.n1 * hs[u] * c.d, a.ysh[u] = c.d;
  }
  a.n0 = c.n0, a.n1 = c.n1, a.d = c.d, a.seq_dim = c.seq_dim;
  a.positions = c.positions ? pos_store.data() : nullptr;
  a.pos_sb = 3 * seq, a.pos_ss = 3;
  a.position_offset = offset;
  a.cos_sin = c.table ? table.data() : nullptr;
  a.max_pos = max_pos;
  a.log2_theta = std::log2(theta);
  a.interleaved = c.interleaved, a.inverse = c.inverse, a.dtype = c.dt;

  // fp64 reference from the same stored inputs.
  std::vector<double> ref[2];
  for (int u = 0; u < 2; ++u) {
    ref[u].assign(size_t(tokens * hs[u] * c.d), 0.0);
    for (int64_t i0 = 0; i0 < c.n0; ++i0)
      for (int64_t i1 = 0; i1 < c.n1; ++i1) {
        const int64_t s = c.seq_dim == 0 ? i0 : i1, b = c.seq_dim == 0 ? i1 : i0;
        const int64_t p = position(b, s);
        for (int64_t h = 0; h < hs[u]; ++h)
          for (int64_t i = 0; i < half; ++i) {
            const double ang = double(float(p) * inv(i));
            const double cs = std::cos(ang), sn = (c.inverse ? -1.0 : 1.0) * std::sin(ang);
            const int64_t j1 = c.interleaved ? 2 * i : i, j2 = c.interleaved ? 2 * i + 1 : i + half;
            const size_t src = size_t(i0 * a.xs0[u] + i1 * a.xs1[u] + h * c.d) + size_t(u == 0 ? 0 : c.hq * c.d);
            const double x1 = qkv.get(src + size_t(j1)), x2 = qkv.get(src + size_t(j2));
            const size_t dst = size_t(i0 * a.ys0[u] + i1 * a.ys1[u] + h * c.d);
            ref[u][dst + size_t(j1)] = x1 * cs - x2 * sn;
            ref[u][dst + size_t(j2)] = x2 * cs + x1 * sn;
          }
      }
  }

  a.y[0] = out_cpu[0].data(), a.y[1] = out_cpu[1].data();
  cpu::rope_tokens(a, 0, tokens);
  a.y[0] = out_emu[0].data(), a.y[1] = out_emu[1].data();
  const char* err = cuda_emu::rope(a, nullptr);
  expect(err == nullptr, tag + " launch: " + (err ? err : ""));
  // fp64 data: Buf reads values back as float, and the table is fp32.
  const float t = c.dt == DType::F64 ? 1e-6f : tol(c.dt);
  for (int u = 0; u < 2; ++u) {
    const std::string which = u == 0 ? " q" : " k";
    compare(tag + which + " cpu vs fp64", out_cpu[u], ref[u], t);
    compare(tag + which + " emu vs fp64", out_emu[u], ref[u], t);
    compare(tag + which + " emu vs cpu", out_emu[u], as_doubles(out_cpu[u]), t);
  }
}

// A table position outside [0, max_pos) reads nothing outside the table and gives NaN rows (never a silent value).
void out_of_table_positions_give_nan() {
  std::mt19937 rng(7);
  const int64_t d = 8;
  Buf q = random_buf(DType::F32, size_t(2 * d), rng, 1.f), k = random_buf(DType::F32, size_t(2 * d), rng, 1.f);
  std::vector<float> table(size_t(2 * d), 0.5f);
  std::vector<int64_t> pos = {1, 2};  // 2 is past a 2-row table
  rope::Args a{};
  for (int u = 0; u < 2; ++u) {
    a.x[u] = u == 0 ? q.data() : k.data();
    a.heads[u] = 1;
    a.xs0[u] = 2 * d, a.xs1[u] = d, a.xsh[u] = d, a.ys0[u] = 2 * d, a.ys1[u] = d, a.ysh[u] = d;
  }
  a.n0 = 1, a.n1 = 2, a.d = d, a.seq_dim = 1, a.positions = pos.data(), a.pos_ss = 1, a.cos_sin = table.data();
  a.max_pos = 2, a.dtype = DType::F32;
  for (int emu = 0; emu < 2; ++emu) {
    Buf yq(DType::F32, size_t(2 * d)), yk(DType::F32, size_t(2 * d));
    a.y[0] = yq.data(), a.y[1] = yk.data();
    if (emu)
      expect(cuda_emu::rope(a, nullptr) == nullptr, "out-of-table launch");
    else
      cpu::rope_tokens(a, 0, 2);
    bool ok = true;
    for (int64_t j = 0; j < d; ++j) ok = ok && std::isfinite(yq.get(size_t(j))) && std::isnan(yq.get(size_t(d + j)));
    expect(ok, std::string(emu ? "emu" : "cpu") + ": a position past the table gives NaN, others finite");
  }
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  const DType dtypes[] = {DType::F32, DType::BF16, DType::F16, DType::F64};
  for (DType dt : dtypes)
    for (bool il : {false, true})
      for (int64_t d : {2, 6, 64, 128}) {
        run_case({dt, il, d, 4, 2, 3, 5, 1, false, false, false, 0}, rng);  // [b, s, h, d], positions = range
        run_case({dt, il, d, 3, 1, 6, 2, 0, true, false, true, 0}, rng);    // [s, b, h, d], positions, inverse
        run_case({dt, il, d, 2, 2, 2, 4, 1, true, true, false, 1}, rng);    // table, unaligned rows
      }
  // Many tokens and heads: the launch splits heads into slices and loops the grid.
  run_case({DType::BF16, false, 128, 32, 8, 2, 33, 1, true, false, false, 0}, rng);
  run_case({DType::F32, true, 64, 5, 3, 40, 2, 0, false, false, true, 0}, rng);
  out_of_table_positions_give_nan();
  return report();
}
