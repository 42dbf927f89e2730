// Moving a mixture-of-experts layer's token rows to their experts and back (megakernels/ops/moe_permute.py; the
// GPU path is Triton). Torch-free.
//
// The index pass (no sort: a counting pass): the assignments a = t * k + j (token t's j-th expert e = experts[a])
// in that order; each expert keeps its first `capacity` (all when capacity < 0), its kept rows padded up to a
// multiple of pad_multiple; the experts' row blocks follow each other in expert order. dest[a] is the row of
// assignment a, or -1 when it was dropped. sizes[e] = its rows (padding included), kept[e] = its kept assignments.
// The unpermute: out[t] = sum_j w[t, j] * rows[dest[t * k + j]] (dropped ones contribute nothing), fp32 sums;
// its backward: drows[dest[a]] = w[a] * dout[t], dw[a] = dot(dout[t], rows[dest[a]]) (padding rows get 0).
#pragma once
#include <cstdint>

#include "../common/math.h"

namespace megakernels {
namespace moe {

struct PermuteIndexArgs {
  const int64_t* experts;  // [tokens * k]
  int64_t* dest;           // [tokens * k]
  int64_t* sizes;          // [E]
  int64_t* kept;           // [E]
  int64_t assignments, E, capacity, pad_multiple;
};

struct UnpermuteArgs {
  const void* rows;     // [R, h]
  const int64_t* dest;  // [tokens * k]
  const float* w;       // [tokens, k]
  void* out;            // [tokens, h]
  int64_t tokens, k, h;
  DType dtype;
};

struct UnpermuteGradArgs {
  const void* rows;     // [R, h]
  const int64_t* dest;  // [tokens * k]
  const float* w;       // [tokens, k]
  const void* dout;     // [tokens, h]
  void* drows;          // [R, h], zeroed by the caller where no assignment lands (padding)
  float* dw;            // [tokens, k]
  int64_t tokens, k, h;
  DType dtype;
};

}  // namespace moe

// clang-format off
MK_DECLARE_CPU_KERNELS(
void moe_permute_index(const moe::PermuteIndexArgs& a);
void moe_unpermute_rows(const moe::UnpermuteArgs& a, int64_t t0, int64_t t1);
void moe_unpermute_grad_rows(const moe::UnpermuteGradArgs& a, int64_t t0, int64_t t1);
)
// clang-format on
}  // namespace megakernels
