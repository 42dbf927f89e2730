// CPU kernels of the MoE router (router.h). Torch-free. Rows are split over threads by the caller in whole
// partial-sum blocks (csrc/bindings/moe.cpp), so every block's sums are added in row order whatever the threads.
//
// Backward of a row (s the score, p = softmax(l), v_j = s_{e_j}, N their normaliser, w the weights):
//   dL/dv_j = scale (dw_j / N - sum_m dw_m v_m / N^2)   (normalize; scale dw_j otherwise)
//   aux: softmax dL/dp_i += daux_i; sigmoid dL/ds_i += (daux_i - sum_m daux_m s_m / S) / S, S = sum_m s_m
//   scores to logits: softmax dl_i = p_i (g_i - sum_m g_m p_m); sigmoid dl_i = g_i s_i (1 - s_i)
//   topk_softmax: dl_{e_j} += w_j (dw_j - sum_m (w_m / scale) dw_m)
//   lse (z-loss): dl_i += dlse_t p_i
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../common/cpu_types.h"
#include "router.h"

namespace megakernels {
namespace MK_CPU_NS {  // cpu, or the ISA clone's (csrc/common/cpu_isa.h)
namespace {

using moe::RouterArgs;
using moe::RouterGradArgs;

inline float r_exp(float d) { return d < -87.0f ? 0.0f : mk_exp(d); }
inline float r_sigmoid(float x) { return 1.0f / (1.0f + mk_exp(-x)); }

struct Scratch {
  std::vector<float> x, p, s, key, gscore;
  std::vector<unsigned char> gopen, chosen;
  explicit Scratch(int64_t E, int64_t G) : x(E), p(E), s(E), key(E), gscore(G), gopen(G), chosen(G) {}
};

// softmax of row x into p; returns its log-sum-exp.
inline float softmax_row(const float* x, float* p, int64_t E) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const float m = lane_max<float>(E, ninf, [x](int64_t i) { return x[i]; });
  const float shift = m == ninf ? 0.0f : m;
#pragma omp simd
  for (int64_t i = 0; i < E; ++i) p[i] = r_exp(x[i] - shift);
  const float sum = lane_sum<float>(E, [p](int64_t i) { return p[i]; });
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t i = 0; i < E; ++i) p[i] *= inv;
  return shift + std::log(sum);
}

// Keeps the k largest keys seen, largest first; an equal key goes after the ones already there (lower indices,
// which came first), so ties go to the lower index.
struct TopK {
  int64_t n = 0, k;
  int64_t* idx;
  float* val;
  TopK(int64_t k_, int64_t* idx_, float* val_) : k(k_), idx(idx_), val(val_) {}
  void offer(float v, int64_t i) {
    if (n == k && !(v > val[k - 1])) return;
    int64_t pos = n < k ? n++ : k - 1;
    for (; pos > 0 && val[pos - 1] < v; --pos) val[pos] = val[pos - 1], idx[pos] = idx[pos - 1];
    val[pos] = v, idx[pos] = i;
  }
};

template <typename T>
void route_row(const RouterArgs& a, int64_t r, Scratch& w, float* counts, float* aux) {
  const int64_t E = a.E, k = a.k, G = a.n_group, size = E / G;
  const float* x = row_view(static_cast<const T*>(a.logits) + r * E, w.x.data(), E);
  float* p = w.p.data();
  float* s = w.s.data();
  float* key = w.key.data();
  a.lse[r] = softmax_row(x, p, E);
  float ssum = 0.0f;
  if (a.score == 1) {
#pragma omp simd
    for (int64_t i = 0; i < E; ++i) s[i] = r_sigmoid(x[i]);
    ssum = lane_sum<float>(E, [s](int64_t i) { return s[i]; });
  }
  const float* score = a.score == 1 ? s : p;
  const float* base = a.topk_softmax ? x : score;
  if (a.bias) {
#pragma omp simd
    for (int64_t i = 0; i < E; ++i) key[i] = base[i] + a.bias[i];
  } else {
    key = const_cast<float*>(base);
  }
  unsigned char* chosen = w.chosen.data();
  if (G > 1) {  // group-limited: the topk_group groups with the largest sums of their two best keys
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t g = 0; g < G; ++g) {
      float b1 = ninf, b2 = ninf;
      for (int64_t i = g * size; i < (g + 1) * size; ++i) {
        const float v = key[i];
        if (v > b1)
          b2 = b1, b1 = v;
        else if (v > b2)
          b2 = v;
      }
      w.gscore[g] = size > 1 ? b1 + b2 : b1;
      w.gopen[g] = 1, chosen[g] = 0;
    }
    for (int64_t j = 0; j < a.topk_group; ++j) {
      int64_t best = -1;
      for (int64_t g = 0; g < G; ++g)
        if (w.gopen[g] && (best < 0 || w.gscore[g] > w.gscore[best])) best = g;
      chosen[best] = 1, w.gopen[best] = 0;
    }
  } else {
    chosen[0] = 1;
  }
  int64_t* ex = a.experts + r * k;
  float* wt = a.weights + r * k;
  TopK top(k, ex, wt);  // the chosen keys in wt until the weights overwrite them
  for (int64_t g = 0; g < G; ++g)
    if (chosen[g])
      for (int64_t i = g * size; i < (g + 1) * size; ++i) top.offer(key[i], i);
  for (int64_t j = 0; j < k; ++j) counts[ex[j]] += 1.0f;
  if (a.topk_softmax) {
    float m = x[ex[0]];  // the largest chosen logit: with a bias the keys need not be ordered as the logits
    for (int64_t j = 1; j < k; ++j) m = std::max(m, x[ex[j]]);
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += (wt[j] = r_exp(x[ex[j]] - m));
    for (int64_t j = 0; j < k; ++j) wt[j] = a.scale * (wt[j] / sum);
  } else {
    float norm = 0.0f;
    for (int64_t j = 0; j < k; ++j) norm += score[ex[j]];
    if (a.score == 1) norm += 1e-20f;
    for (int64_t j = 0; j < k; ++j) wt[j] = a.normalize ? a.scale * (score[ex[j]] / norm) : a.scale * score[ex[j]];
  }
  if (a.score == 1) {
    const float inv = 1.0f / ssum;
#pragma omp simd
    for (int64_t i = 0; i < E; ++i) aux[i] += s[i] * inv;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < E; ++i) aux[i] += p[i];
  }
}

template <typename T>
void route_blocks(const RouterArgs& a, int64_t b0, int64_t b1) {
  Scratch w(a.E, std::max<int64_t>(1, a.n_group));
  for (int64_t b = b0; b < b1; ++b) {
    float* counts = a.counts + b * a.E;
    float* aux = a.aux + b * a.E;
    std::fill(counts, counts + a.E, 0.0f);
    std::fill(aux, aux + a.E, 0.0f);
    const int64_t r1 = std::min(a.rows, (b + 1) * moe::kRouterBlock);
    for (int64_t r = b * moe::kRouterBlock; r < r1; ++r) route_row<T>(a, r, w, counts, aux);
  }
}

template <typename T>
void grad_rows(const RouterGradArgs& a, int64_t r0, int64_t r1) {
  const int64_t E = a.E, k = a.k;
  std::vector<float> xb(E), p(E), s(E), g(E), dl(E);
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = row_view(static_cast<const T*>(a.logits) + r * E, xb.data(), E);
    const float lse = a.lse[r];
#pragma omp simd
    for (int64_t i = 0; i < E; ++i) p[i] = r_exp(x[i] - lse);
    float ssum = 0.0f;
    if (a.score == 1) {
#pragma omp simd
      for (int64_t i = 0; i < E; ++i) s[i] = r_sigmoid(x[i]);
      ssum = lane_sum<float>(E, [&s](int64_t i) { return s[i]; });
    }
    const float* score = a.score == 1 ? s.data() : p.data();
    const int64_t* ex = a.experts + r * k;
    const float* wt = a.weights + r * k;
    const float* dw = a.dweights + r * k;
    // the aux scores' gradient, on the scores
    if (a.score == 1) {
      const float dot = lane_sum<float>(E, [&](int64_t i) { return a.daux[i] * s[i]; });
      const float inv = 1.0f / ssum;
#pragma omp simd
      for (int64_t i = 0; i < E; ++i) g[i] = (a.daux[i] - dot * inv) * inv;
    } else {
      std::copy(a.daux, a.daux + E, g.begin());
    }
    std::fill(dl.begin(), dl.end(), 0.0f);
    if (a.topk_softmax) {
      float dot = 0.0f;
      for (int64_t j = 0; j < k; ++j) dot += wt[j] / a.scale * dw[j];
      for (int64_t j = 0; j < k; ++j) dl[ex[j]] += wt[j] * (dw[j] - dot);
    } else if (a.normalize) {
      float norm = 0.0f, dot = 0.0f;
      for (int64_t j = 0; j < k; ++j) norm += score[ex[j]], dot += dw[j] * score[ex[j]];
      if (a.score == 1) norm += 1e-20f;
      for (int64_t j = 0; j < k; ++j) g[ex[j]] += a.scale * (dw[j] / norm - dot / (norm * norm));
    } else {
      for (int64_t j = 0; j < k; ++j) g[ex[j]] += a.scale * dw[j];
    }
    if (a.score == 1) {
#pragma omp simd
      for (int64_t i = 0; i < E; ++i) dl[i] += g[i] * s[i] * (1.0f - s[i]);
    } else {
      const float dot = lane_sum<float>(E, [&](int64_t i) { return g[i] * p[i]; });
#pragma omp simd
      for (int64_t i = 0; i < E; ++i) dl[i] += p[i] * (g[i] - dot);
    }
    const float zc = a.dlse[r];
    T* out = static_cast<T*>(a.dlogits) + r * E;
#pragma omp simd
    for (int64_t i = 0; i < E; ++i) dl[i] += zc * p[i];
    if constexpr (std::is_same_v<T, float>)
      std::copy(dl.begin(), dl.end(), out);
    else
      store_row(dl.data(), out, E);
  }
}

}  // namespace

void moe_router_blocks(const RouterArgs& a, int64_t b0, int64_t b1) {
  switch (a.dtype) {
    case DType::BF16: return route_blocks<bf16>(a, b0, b1);
    case DType::F16: return route_blocks<f16>(a, b0, b1);
    default: return route_blocks<float>(a, b0, b1);
  }
}

void moe_router_grad_rows(const RouterGradArgs& a, int64_t r0, int64_t r1) {
  switch (a.dtype) {
    case DType::BF16: return grad_rows<bf16>(a, r0, r1);
    case DType::F16: return grad_rows<f16>(a, r0, r1);
    default: return grad_rows<float>(a, r0, r1);
  }
}

}  // namespace MK_CPU_NS
}  // namespace megakernels
