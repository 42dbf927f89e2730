// Rotary position embedding (RoPE): arguments, the shared angle math, and launcher declarations for the CPU kernel
// (rope_cpu.cpp), the CUDA kernel (rope_cuda.cu) and its CPU emulation (rope_cuda_emu.cpp). Torch-free.
//
// One call rotates two tensors (q and k) of one token layout: [n0, n1, heads, d] with any element strides on the
// first three dims and a contiguous last dim; the sequence is dim 0 (seq_dim 0, Megatron's [s, b, h, d]) or dim 1
// ([b, s, h, d]). Each token's position is position_offset + positions[batch, seq] (positions may be absent: the
// sequence index), and pair i of a head (i < d/2) turns by the angle pos * inv_freq[i]:
//
//   half-rotated (NeoX / Llama, HF's rotate_half): pair (x[i], x[i + d/2])
//   interleaved (GPT-J):                           pair (x[2i], x[2i + 1])
//   (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)      inverse (backward): the same with -sin
//
// The numbers are a contract shared with the Python reference (megakernels/ops/rope.py): inv_freq[i] is
// theta^(-2i/d) computed in double and rounded once to fp32; the angle is the fp32 product float(pos) *
// inv_freq[i] (what HF Llama computes); its sin and cos are taken to ~1 ulp of fp32 (fp64 for fp64 data). With a
// cached table, cos_sin[pos][i] = (cos, sin) replaces all of that. Rotation math is fp32 (fp64 for fp64 data).
#pragma once
#include <cmath>
#include <cstdint>

#include "../common/math.h"

namespace megakernels {
namespace rope {

struct Args {
  const void* x[2];  // q, k: [n0, n1, heads[t], d], strides xs0/xs1/xsh (elements), last dim contiguous
  void* y[2];        // outputs, same shapes, strides ys0/ys1/ysh
  int64_t heads[2];
  int64_t xs0[2], xs1[2], xsh[2];
  int64_t ys0[2], ys1[2], ysh[2];
  int64_t n0, n1, d;
  int seq_dim;               // which of n0 / n1 is the sequence
  const int64_t* positions;  // nullptr: the sequence index; else positions[batch * pos_sb + seq * pos_ss]
  int64_t pos_sb, pos_ss;
  int64_t position_offset;
  const float* cos_sin;  // nullptr: angles from theta; else [max_pos, d/2, 2] (cos, sin) contiguous, fp32
  int64_t max_pos;
  double log2_theta;
  bool interleaved;
  bool inverse;
  DType dtype;
};

// The position of the token at (i0, i1) of the [n0, n1] token grid.
MK_MATH int64_t position_of(const Args& a, int64_t i0, int64_t i1) {
  const int64_t seq = a.seq_dim == 0 ? i0 : i1, batch = a.seq_dim == 0 ? i1 : i0;
  return a.position_offset + (a.positions ? a.positions[batch * a.pos_sb + seq * a.pos_ss] : seq);
}

// theta^(-2i/d), correctly rounded to fp32 (double exp2 is accurate to ~1 ulp of double).
MK_MATH float inv_freq(int64_t i, int64_t d, double log2_theta) {
  return float(exp2(-(2.0 * double(i) / double(d)) * log2_theta));
}

// sin and cos of an fp32 angle to ~1 ulp: the reduction x = k*pi/2 + r is done in double (exact to ~1e-11 even
// for the 1e5-radian angles of long contexts, where fp32 Cody-Waite loses digits), then minimax polynomials in
// fp32 on |r| <= pi/4 (Cephes' sinf/cosf coefficients) and the quadrant of k. Branch-free, so the CPU loop over a
// token's pairs vectorises, and the GPU needs no slow-path local memory as sincosf's Payne-Hanek reduction does.
MK_MATH void sincos_angle(float angle, float& s, float& c) {
  const double x = double(angle);
  const double k = rint(x * 0.63661977236758134308);  // 2/pi
  const float r = float(fma(-k, 1.5707963267948966192, x));
  const float z = r * r;
  const float sr = r + r * z * (-1.6666654611e-1f + z * (8.3321608736e-3f + z * -1.9515295891e-4f));
  const float cr =
      1.0f - 0.5f * z + z * z * (4.166664568298827e-2f + z * (-1.388731625493765e-3f + z * 2.443315711809948e-5f));
  const int q = int(int64_t(k) & 3);
  const float s0 = (q & 1) ? cr : sr, c0 = (q & 1) ? sr : cr;
  s = (q & 2) ? -s0 : s0;
  c = ((q + 1) & 2) ? -c0 : c0;
}
// fp64 data (gradcheck): the same fp32 angle, its sin and cos in double.
MK_MATH void sincos_angle(float angle, double& s, double& c) {
  s = sin(double(angle));
  c = cos(double(angle));
}

}  // namespace rope

// The CPU kernel: rotates the tokens [token_begin, token_end) of the n0 * n1 grid (token = i0 * n1 + i1).
// Parallelism comes from the caller (at::parallel_for over tokens).
// Declared for the baseline and for each ISA clone (csrc/common/cpu_isa.h), one declaration a line.
// clang-format off
MK_DECLARE_CPU_KERNELS(
void rope_tokens(const rope::Args& a, int64_t token_begin, int64_t token_end);
)
// clang-format on

// The CUDA kernel, compiled by nvcc (namespace cuda) and for the emulator (namespace cuda_emu). Returns nullptr on
// success, else the CUDA error string. `stream` is a cudaStream_t (nullptr for the emulator).
#define MK_DECLARE_ROPE_LAUNCHERS const char* rope(const rope::Args& a, void* stream);
namespace cuda {
MK_DECLARE_ROPE_LAUNCHERS
}
namespace cuda_emu {
MK_DECLARE_ROPE_LAUNCHERS
}

}  // namespace megakernels
