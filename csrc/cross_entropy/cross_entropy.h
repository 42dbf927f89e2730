// Cross-entropy over rows of logits (megakernels/ops/cross_entropy.py; the GPU path is Triton): the per-row
// statistics of the forward and the gradient of the backward, on the CPU. Torch-free; csrc/bindings/ checks.
//
// A row holds one rank's shard of the vocabulary: columns [0, n_valid) are real (global index vocab_start + j),
// columns [n_valid, cols) are padding. For row r with target t (global id):
//   stats[r] = (m, s, picked, total): m = max_j x_j, s = sum_j exp(x_j - m') with m' = m (0 when m = -inf),
//   picked = x_{t - vocab_start} when the target is in this shard (else 0), total = sum_j x_j; all over the real
//   columns, in fp32, a NaN anywhere in the row making s and total NaN.
//   grad[r, j] = scale_r * (exp(x_j - lse_r) - smooth_other - smooth_target [j == t - vocab_start]) for real j,
//   0 on padding; scale_r = dloss_r, or 0 when t == ignore_index. out may be the logits themselves (in place).
// With softcap = c > 0 every x_j above is first capped to y_j = c tanh(x_j / c) (Gemma's final-logit soft cap), and
// the gradient with respect to the raw logit carries the cap's derivative: grad[r, j] *= 1 - (y_j / c)^2.
#pragma once
#include <cstdint>

#include "../common/math.h"

namespace megakernels {
namespace cross_entropy {

struct StatsArgs {
  const void* logits;     // [rows, cols], contiguous
  const int64_t* target;  // [rows]
  float* stats;           // [rows, 4]
  int64_t rows, cols, n_valid, vocab_start;
  float softcap;  // 0: none
  DType dtype;    // F32, BF16 or F16
};

struct GradArgs {
  const void* logits;     // [rows, cols]
  const int64_t* target;  // [rows]
  const float* lse;       // [rows]
  const float* dloss;     // [rows]
  void* out;              // [rows, cols]; may alias logits
  int64_t rows, cols, n_valid, vocab_start, ignore_index;
  float smooth_target, smooth_other;
  float softcap;  // 0: none
  DType dtype;
};

}  // namespace cross_entropy

// Declared for the baseline and for each ISA clone (csrc/common/cpu_isa.h), one declaration a line.
// clang-format off
MK_DECLARE_CPU_KERNELS(
void cross_entropy_stats_rows(const cross_entropy::StatsArgs& a, int64_t r0, int64_t r1);
void cross_entropy_grad_rows(const cross_entropy::GradArgs& a, int64_t r0, int64_t r1);
)
// clang-format on
}  // namespace megakernels
