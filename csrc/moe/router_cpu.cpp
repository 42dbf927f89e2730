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

// The index of the largest key among the allowed and not yet taken, the lower index on ties; -1 when none is.
inline int64_t arg_best(const float* key, const unsigned char* ok, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i)
    if (ok[i] && (best < 0 || key[i] > key[best])) best = i;
  return best;
}

struct Scratch {
  std::vector<float> x, p, s, key;
  std::vector<unsigned char> ok, gok;
  std::vector<float> gscore;
  explicit Scratch(int64_t E, int64_t G) : x(E), p(E), s(E), key(E), ok(E), gok(G), gscore(G) {}
};

// softmax (and its lse) of row x into p; the sigmoid into s when asked.
inline float softmax_row(const float* x, float* p, int64_t E) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float m = ninf;
  for (int64_t i = 0; i < E; ++i) m = std::max(m, x[i]);
  const float shift = m == ninf ? 0.0f : m;
  float sum = 0.0f;
  for (int64_t i = 0; i < E; ++i) sum += (p[i] = r_exp(x[i] - shift));
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < E; ++i) p[i] *= inv;
  return shift + std::log(sum);
}

template <typename T>
void route_row(const RouterArgs& a, int64_t r, Scratch& w, float* counts, float* aux) {
  const int64_t E = a.E, k = a.k, G = a.n_group;
  const float* x = row_view(static_cast<const T*>(a.logits) + r * E, w.x.data(), E);
  float* p = w.p.data();
  float* s = w.s.data();
  a.lse[r] = softmax_row(x, p, E);
  float ssum = 0.0f;
  if (a.score == 1)
    for (int64_t i = 0; i < E; ++i) ssum += (s[i] = r_sigmoid(x[i]));
  const float* score = a.score == 1 ? s : p;
  for (int64_t i = 0; i < E; ++i) w.key[i] = (a.topk_softmax ? x[i] : score[i]) + (a.bias ? a.bias[i] : 0.0f);
  std::fill(w.ok.begin(), w.ok.end(), static_cast<unsigned char>(1));
  if (G > 1) {  // group-limited: the topk_group groups with the largest sums of their two best keys
    const int64_t size = E / G;
    for (int64_t g = 0; g < G; ++g) {
      const float* kg = w.key.data() + g * size;
      const int64_t first = arg_best(kg, w.ok.data() + g * size, size);
      float total = kg[first];
      if (size > 1) {
        w.ok[g * size + first] = 0;
        total += kg[arg_best(kg, w.ok.data() + g * size, size)];
        w.ok[g * size + first] = 1;
      }
      w.gscore[g] = total;
      w.gok[g] = 1;
    }
    std::vector<unsigned char> chosen(G, 0);
    for (int64_t j = 0; j < a.topk_group; ++j) {
      const int64_t g = arg_best(w.gscore.data(), w.gok.data(), G);
      chosen[g] = 1, w.gok[g] = 0;
    }
    for (int64_t i = 0; i < E; ++i) w.ok[i] = chosen[i / size];
  }
  int64_t* ex = a.experts + r * k;
  float* wt = a.weights + r * k;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t e = arg_best(w.key.data(), w.ok.data(), E);
    ex[j] = e;
    w.ok[e] = 0;
    counts[e] += 1.0f;
  }
  if (a.topk_softmax) {
    float m = x[ex[0]];  // the largest chosen logit: keys are logits (+ bias), not ordered by x with a bias
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
    for (int64_t i = 0; i < E; ++i) aux[i] += s[i] * inv;
  } else {
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
    for (int64_t i = 0; i < E; ++i) p[i] = r_exp(x[i] - lse);
    float ssum = 0.0f;
    if (a.score == 1)
      for (int64_t i = 0; i < E; ++i) ssum += (s[i] = r_sigmoid(x[i]));
    const float* score = a.score == 1 ? s.data() : p.data();
    const int64_t* ex = a.experts + r * k;
    const float* wt = a.weights + r * k;
    const float* dw = a.dweights + r * k;
    // the aux scores' gradient, on the scores
    if (a.score == 1) {
      float dot = 0.0f;
      for (int64_t i = 0; i < E; ++i) dot += a.daux[i] * s[i];
      const float inv = 1.0f / ssum;
      for (int64_t i = 0; i < E; ++i) g[i] = (a.daux[i] - dot * inv) * inv;
    } else {
      for (int64_t i = 0; i < E; ++i) g[i] = a.daux[i];
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
      for (int64_t i = 0; i < E; ++i) dl[i] += g[i] * s[i] * (1.0f - s[i]);
    } else {
      float dot = 0.0f;
      for (int64_t i = 0; i < E; ++i) dot += g[i] * p[i];
      for (int64_t i = 0; i < E; ++i) dl[i] += p[i] * (g[i] - dot);
    }
    const float zc = a.dlse[r];
    T* out = static_cast<T*>(a.dlogits) + r * E;
    for (int64_t i = 0; i < E; ++i) out[i] = from_float<T>(dl[i] + zc * p[i]);
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
