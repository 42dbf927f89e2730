// The mixture-of-experts router after its gate GEMM (megakernels/ops/moe_router.py; the GPU path is Triton): per
// token row of logits l [E], the scores, the (group-limited) top-k choice, the weights and the row's log-sum-exp,
// and per block of rows the partial sums behind the load statistics; and the backward. Torch-free.
//
// Forward, row t (fp32 math on fp32/bf16/fp16 logits):
//   p = softmax(l), lse = log sum exp l; score s = p (score 0) or sigmoid(l) (score 1);
//   selection key q_i = l_i (topk_softmax: the softmax of the k chosen logits) or s_i, plus bias_i when given;
//   with n_group > 1 the experts fall into n_group equal groups, each scored by the sum of its two largest keys
//   (its one key when a group holds one expert), and only the topk_group best groups stay eligible;
//   experts = the k largest eligible keys, largest first, ties to the lower index (groups likewise);
//   weights_j = scale * s_{e_j} / N, N = sum_j s_{e_j} (+ 1e-20 for sigmoid) when normalize, else 1; or with
//   topk_softmax, scale * softmax over the chosen logits.
//   Per block of kRouterBlock rows b: counts[b, i] = assignments to expert i; aux[b, i] = sum over the rows of
//   p_i (softmax) or s_i / sum_m s_m (sigmoid): the scores the load-balancing loss averages.
// Backward, row t, given dweights [k], daux [E] (the gradient of the sum of aux over all rows) and dlse (of the
// row's log-sum-exp, e.g. from a z-loss): dlogits [E] (math in router_cpu.cpp's comments).
#pragma once
#include <cstdint>

#include "../common/math.h"

namespace megakernels {
namespace moe {

constexpr int64_t kRouterBlock = 64;  // rows a partial-sum block: the sums do not depend on the thread count

struct RouterArgs {
  const void* logits;  // [rows, E], contiguous
  const float* bias;   // [E] selection bias, or nullptr
  float* weights;      // [rows, k]
  int64_t* experts;    // [rows, k]
  float* lse;          // [rows]
  float* counts;       // [blocks, E]
  float* aux;          // [blocks, E]
  int64_t rows, E, k, n_group, topk_group;
  int score;  // 0 softmax, 1 sigmoid
  bool normalize, topk_softmax;
  float scale;
  DType dtype;
};

struct RouterGradArgs {
  const void* logits;      // [rows, E]
  const float* lse;        // [rows]
  const int64_t* experts;  // [rows, k]
  const float* weights;    // [rows, k] (the forward's)
  const float* dweights;   // [rows, k]
  const float* daux;       // [E]
  const float* dlse;       // [rows]
  void* dlogits;           // [rows, E], logits' dtype
  int64_t rows, E, k;
  int score;
  bool normalize, topk_softmax;
  float scale;
  DType dtype;
};

}  // namespace moe

// clang-format off
MK_DECLARE_CPU_KERNELS(
void moe_router_blocks(const moe::RouterArgs& a, int64_t b0, int64_t b1);
void moe_router_grad_rows(const moe::RouterGradArgs& a, int64_t r0, int64_t r1);
)
// clang-format on
}  // namespace megakernels
