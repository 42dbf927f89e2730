// CPU kernels of the cross-entropy (cross_entropy.h). Torch-free.
//
// Forward, per row: one pass for max and sum (x read once; a 16-bit row converted once into an fp32 scratch row
// that stays in L2), one pass for sum(exp(x - max)) with mk_exp, the polynomial exp that vectorises. Backward, per
// row: one pass writing scale * (exp(x - lse) - smooth_other) (in place when out is the logits), then the target's
// column. Every loop is `omp simd` (-fopenmp-simd: no OpenMP runtime); rows are split over threads by the caller
// (at::parallel_for in csrc/bindings/cross_entropy.cpp).
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../common/cpu_types.h"
#include "cross_entropy.h"

namespace megakernels {
namespace MK_CPU_NS {  // cpu, or the ISA clone's (csrc/common/cpu_isa.h)
namespace {

using cross_entropy::GradArgs;
using cross_entropy::StatsArgs;

// exp(d) for d = x - max <= 0 (or NaN, which stays NaN); exactly 0 below the clamp of mk_exp.
inline float ce_exp(float d) { return d < -87.0f ? 0.0f : mk_exp(d); }

// tanh(z) as 1 - 2 / (exp(2z) + 1) with the polynomial exp (vectorises; exactly +-1 where exp saturates). Its
// absolute error is ~1e-7, so a capped logit c tanh(x / c) is within an ulp or two of the libm value.
inline float cap_tanh(float z) { return 1.0f - 2.0f / (mk_exp(2.0f * z) + 1.0f); }

template <typename T>
void stats_rows(const StatsArgs& a, int64_t r0, int64_t r1) {
  const int64_t n = a.n_valid, cols = a.cols;
  const float cap = a.softcap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  // 16-bit rows are converted into the scratch row; capped rows are written there (fp32 ones too)
  std::vector<float> buf(std::is_same_v<T, float> && cap == 0.0f ? 0 : static_cast<size_t>(n));
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = r0; r < r1; ++r) {
    float* st = a.stats + 4 * r;
    if (n == 0) {
      st[0] = ninf, st[1] = 0.0f, st[2] = 0.0f, st[3] = 0.0f;
      continue;
    }
    const float* x = row_view(static_cast<const T*>(a.logits) + r * cols, buf.data(), n);
    if (cap > 0.0f) {
      float* y = buf.data();
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) y[j] = cap * cap_tanh(x[j] * inv_cap);
      x = y;
    }
    float m = lane_max<float>(n, ninf, [x](int64_t j) { return x[j]; });
    const float total = lane_sum<float>(n, [x](int64_t j) { return x[j]; });
    const float shift = m == ninf ? 0.0f : m;
    float s = lane_sum<float>(n, [x, shift](int64_t j) { return ce_exp(x[j] - shift); });
    if (std::isnan(total)) m = s = total;  // a NaN in the row (the max reduction may have dropped it)
    const int64_t t = a.target[r] - a.vocab_start;
    st[0] = m;
    st[1] = s;
    st[2] = t >= 0 && t < n ? x[t] : 0.0f;
    st[3] = total;
  }
}

template <typename T>
void grad_rows(const GradArgs& a, int64_t r0, int64_t r1) {
  const int64_t n = a.n_valid, cols = a.cols;
  std::vector<float> buf(std::is_same_v<T, float> ? 0 : static_cast<size_t>(n));
  for (int64_t r = r0; r < r1; ++r) {
    T* out = static_cast<T*>(a.out) + r * cols;
    const float* x = row_view(static_cast<const T*>(a.logits) + r * cols, buf.data(), n);
    float* g = out_view(out, buf.data());  // fp32: the output row itself (x's row when in place); 16-bit: scratch
    const float scale = a.target[r] == a.ignore_index ? 0.0f : a.dloss[r];
    const float lse = a.lse[r], other = a.smooth_other, cap = a.softcap;
    const int64_t t = a.target[r] - a.vocab_start;
    const bool in_shard = t >= 0 && t < n;
    const float x_t = in_shard ? x[t] : 0.0f;  // read before the loop overwrites it (in place)
    float d_t = 1.0f;                          // the cap's derivative at the target
    if (cap > 0.0f) {
      const float inv_cap = 1.0f / cap;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float th = cap_tanh(x[j] * inv_cap);
        g[j] = scale * (ce_exp(cap * th - lse) - other) * (1.0f - th * th);
      }
      const float th_t = cap_tanh(x_t * inv_cap);
      d_t = 1.0f - th_t * th_t;
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) g[j] = scale * (ce_exp(x[j] - lse) - other);
    }
    if (in_shard) g[t] -= scale * a.smooth_target * d_t;
    finish_out(g, out, n);
    for (int64_t j = n; j < cols; ++j) out[j] = from_float<T>(0.0f);
  }
}

}  // namespace

void cross_entropy_stats_rows(const StatsArgs& a, int64_t r0, int64_t r1) {
  switch (a.dtype) {
    case DType::BF16: return stats_rows<bf16>(a, r0, r1);
    case DType::F16: return stats_rows<f16>(a, r0, r1);
    default: return stats_rows<float>(a, r0, r1);
  }
}

void cross_entropy_grad_rows(const GradArgs& a, int64_t r0, int64_t r1) {
  switch (a.dtype) {
    case DType::BF16: return grad_rows<bf16>(a, r0, r1);
    case DType::F16: return grad_rows<f16>(a, r0, r1);
    default: return grad_rows<float>(a, r0, r1);
  }
}

}  // namespace MK_CPU_NS
}  // namespace megakernels
