// Muon's Newton-Schulz iteration on a batch of matrices (megakernels/ops/muon.py; the GPU path is Triton), on the
// CPU. Torch-free; csrc/bindings/ checks.
//
// Per matrix G [rows, cols] (fp32, transposed first when rows > cols, so X is [m, n] with m <= n):
//   X = G / max(||G||_F, eps)
//   repeat steps times:  A = X Xᵀ;  B = b A + c A A;  X = a X + B X
//   out = X (transposed back)
// A and B are symmetric (A A = A Aᵀ): their products are computed for the tiles on and below the diagonal only and
// mirrored, and B's b A term is the epilogue of its product, X's a X the epilogue of B X. Work is split into
// phases (each a parallel loop over independent items: matrices, or row tiles of a matrix; the caller runs them in
// order); no item sums what another writes, so the result does not depend on the thread count.
#pragma once
#include <cstdint>

#include "../common/math.h"

namespace megakernels {
namespace muon {

struct NSArgs {
  const float* x;  // [batch, rows, cols], contiguous
  float* out;      // [batch, rows, cols]
  float* work;     // ns_workspace_floats(a) floats
  int64_t batch, rows, cols;
  int64_t steps;
  float a, b, c, eps;
};

// The phases, in the order the caller runs them: kPrepare once, then per iteration kTranspose .. kUpdate, then
// kFinish. ns_items gives each one's item count.
enum Phase : int {
  kPrepare = 0,  // per matrix: normalise into X (transposed if tall), zero the padding of every buffer
  kTranspose,    // per matrix: Xᵀ of the current X
  kGram,         // per row tile: the lower tiles of A = X Xᵀ
  kMirrorGram,   // per matrix: A's upper triangle from its lower one
  kPoly,         // per row tile: the lower tiles of B = c A A + b A
  kMirrorPoly,   // per matrix: B's upper triangle
  kUpdate,       // per row tile: the next X = B X + a X
  kFinish,       // per matrix: out = X (transposed back if tall)
};

}  // namespace muon

// Declared for the baseline and for each ISA clone (csrc/common/cpu_isa.h), one declaration a line.
// clang-format off
MK_DECLARE_CPU_KERNELS(
int64_t ns_workspace_floats(const muon::NSArgs& a);
int64_t ns_items(const muon::NSArgs& a, int phase);
void ns_run(const muon::NSArgs& a, int phase, int64_t iteration, int64_t begin, int64_t end);
)
// clang-format on
}  // namespace megakernels
