// Row-wise CPU kernel helpers shared by families whose ops take [hidden] parameters and reduce their gradients
// over rows (norms, bias_gelu): parameters converted once per call, fixed row chunks for the parameter-gradient
// partial sums (independent of the thread count, so results are bit-identical for any number of threads), the
// in-order column reduction of those partials, and the (x dtype, parameter dtype, activation) dispatch.
#pragma once
#include "cpu_isa.h"
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_types.h"
#include "math.h"

namespace megakernels {
namespace MK_CPU_NS {  // cpu, or the ISA clone's (cpu_isa.h)

// Parameters converted once per call into the accumulate type; `fill` everywhere when absent.
template <typename W, typename A>
std::vector<A> load_param(const void* p, int64_t n, A fill) {
  std::vector<A> v(static_cast<size_t>(n), fill);
  if (p) load_row(static_cast<const W*>(p), v.data(), n);
  return v;
}

// Rows per parameter-gradient chunk: enough chunks to feed every core, few enough that the [chunks, k, hidden]
// partial sums stay small (at most ~32 MiB) and the final column reduction is cheap.
inline int64_t chunk_rows(int64_t rows, int64_t hidden) {
  int64_t max_chunks = std::max<int64_t>(1, std::min<int64_t>(64, (int64_t(4) << 20) / std::max<int64_t>(1, hidden)));
  int64_t chunks = std::max<int64_t>(1, std::min(rows, max_chunks));
  return (rows + chunks - 1) / chunks;
}

inline int64_t row_chunks(int64_t rows, int64_t hidden) {
  if (rows <= 0) return 0;
  const int64_t rpc = chunk_rows(rows, hidden);
  return (rows + rpc - 1) / rpc;
}

// out[j] = sum over chunks of partial[c * stride + offset + j], in chunk order, for columns [c0, c1).
template <typename W, typename A>
void finish_cols(const void* workspace, int64_t chunks, int64_t stride, int64_t offset, void* out, int64_t c0,
                 int64_t c1) {
  if (!out) return;
  const A* p = static_cast<const A*>(workspace) + offset;
  std::vector<A> acc(size_t(c1 - c0), A(0));
  for (int64_t c = 0; c < chunks; ++c) {
    const A* pc = p + c * stride;
#pragma omp simd
    for (int64_t j = c0; j < c1; ++j) acc[size_t(j - c0)] += pc[j];
  }
  store_row(acc.data(), static_cast<W*>(out) + c0, c1 - c0);
}

// (x dtype, parameter dtype, activation) -> F<T, W, A, ACT>::run(args...). Parameters are x's dtype or fp32.
template <template <typename, typename, typename, Activation> class F, typename T, typename W, typename A,
          typename... Args>
void dispatch_act(Activation act, Args&&... args) {
  switch (act) {
    case Activation::None: return F<T, W, A, Activation::None>::run(args...);
    case Activation::Gelu: return F<T, W, A, Activation::Gelu>::run(args...);
    case Activation::GeluTanh: return F<T, W, A, Activation::GeluTanh>::run(args...);
  }
}
template <template <typename, typename, typename, Activation> class F, typename... Args>
void dispatch(DType xd, DType wd, Activation act, Args&&... args) {
  switch (xd) {
    case DType::F32: return dispatch_act<F, float, float, float>(act, args...);
    case DType::F64: return dispatch_act<F, double, double, double>(act, args...);
    case DType::BF16:
      if (wd == DType::F32) return dispatch_act<F, bf16, float, float>(act, args...);
      return dispatch_act<F, bf16, bf16, float>(act, args...);
    case DType::F16:
      if (wd == DType::F32) return dispatch_act<F, f16, float, float>(act, args...);
      return dispatch_act<F, f16, f16, float>(act, args...);
  }
}

}  // namespace MK_CPU_NS
}  // namespace megakernels
