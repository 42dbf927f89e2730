// CPU kernels of the MoE permutation (permute.h). Torch-free. The index pass is sequential (a few integer
// operations per assignment); the unpermute and its backward split tokens over threads (csrc/bindings/moe.cpp).
//
// Rounding: each weighted row is rounded, then added, in choice order (no FMA contraction, as PyTorch's
// multiply-then-sum rounds each product); the backward's dot products still sum in another order than PyTorch's.
#pragma GCC optimize("fp-contract=off")
#include <algorithm>
#include <type_traits>
#include <vector>

#include "../common/cpu_types.h"
#include "permute.h"

namespace megakernels {
namespace MK_CPU_NS {  // cpu, or the ISA clone's (csrc/common/cpu_isa.h)
namespace {

template <typename T>
void unpermute_rows(const moe::UnpermuteArgs& a, int64_t t0, int64_t t1) {
  const int64_t h = a.h, k = a.k;
  std::vector<float> acc(h), buf(std::is_same_v<T, float> ? 0 : h);
  const T* rows = static_cast<const T*>(a.rows);
  for (int64_t t = t0; t < t1; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t d = a.dest[t * k + j];
      if (d < 0) continue;
      const float wj = a.w[t * k + j];
      const float* r = row_view(rows + d * h, buf.data(), h);
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) acc[i] += wj * r[i];
    }
    T* out = static_cast<T*>(a.out) + t * h;
    if constexpr (std::is_same_v<T, float>)
      std::copy(acc.begin(), acc.end(), out);
    else
      store_row(acc.data(), out, h);
  }
}

template <typename T>
void unpermute_grad_rows(const moe::UnpermuteGradArgs& a, int64_t t0, int64_t t1) {
  const int64_t h = a.h, k = a.k;
  std::vector<float> gb(std::is_same_v<T, float> ? 0 : h), rb(std::is_same_v<T, float> ? 0 : h), out(h);
  const T* rows = static_cast<const T*>(a.rows);
  for (int64_t t = t0; t < t1; ++t) {
    const float* g = row_view(static_cast<const T*>(a.dout) + t * h, gb.data(), h);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t d = a.dest[t * k + j];
      if (d < 0) {
        a.dw[t * k + j] = 0.0f;
        continue;
      }
      const float* r = row_view(rows + d * h, rb.data(), h);
      a.dw[t * k + j] = lane_sum<float>(h, [g, r](int64_t i) { return g[i] * r[i]; });
      const float wj = a.w[t * k + j];
      T* dr = static_cast<T*>(a.drows) + d * h;
      if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) dr[i] = wj * g[i];
      } else {
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) out[i] = wj * g[i];
        store_row(out.data(), dr, h);
      }
    }
  }
}

}  // namespace

void moe_permute_index(const moe::PermuteIndexArgs& a) {
  const int64_t E = a.E, m = a.pad_multiple;
  std::vector<int64_t> count(E, 0), start(E, 0), seen(E, 0);
  for (int64_t i = 0; i < a.assignments; ++i) ++count[a.experts[i]];
  int64_t offset = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t kept = a.capacity < 0 ? count[e] : std::min(count[e], a.capacity);
    a.kept[e] = kept;
    a.sizes[e] = (kept + m - 1) / m * m;
    start[e] = offset;
    offset += a.sizes[e];
  }
  for (int64_t i = 0; i < a.assignments; ++i) {
    const int64_t e = a.experts[i], pos = seen[e]++;
    a.dest[i] = pos < a.kept[e] ? start[e] + pos : -1;
  }
}

void moe_unpermute_rows(const moe::UnpermuteArgs& a, int64_t t0, int64_t t1) {
  switch (a.dtype) {
    case DType::BF16: return unpermute_rows<bf16>(a, t0, t1);
    case DType::F16: return unpermute_rows<f16>(a, t0, t1);
    default: return unpermute_rows<float>(a, t0, t1);
  }
}

void moe_unpermute_grad_rows(const moe::UnpermuteGradArgs& a, int64_t t0, int64_t t1) {
  switch (a.dtype) {
    case DType::BF16: return unpermute_grad_rows<bf16>(a, t0, t1);
    case DType::F16: return unpermute_grad_rows<f16>(a, t0, t1);
    default: return unpermute_grad_rows<float>(a, t0, t1);
  }
}

}  // namespace MK_CPU_NS
}  // namespace megakernels
