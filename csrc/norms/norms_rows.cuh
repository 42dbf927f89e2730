// The norm family's row-resident CUDA kernels (included by norms_cuda.cu): LayerNorm / RMSNorm forward and
// backward for rows of 16-byte packs up to kRowPacksPerThread * kMaxRowThreads packs (16k elements of bf16, fp16
// or fp32) with every parameter present. Other inputs take the looping kernels of norms_cuda.cu.
//
// Design (why; costmodel/README.md has the instruction budgets they are held to):
// - A row group of G threads (a multiple of 32) holds the row in registers: thread t takes packs t, t + G, ...
//   (P of them, 32 elements, so a warp's accesses are contiguous). One DRAM read of x (and dy). (The fp32
//   backward re-reads x in its dx pass, from L1/L2: 32 fp32 values of x beside 32 of dz would spill.)
// - Statistics are two-pass over the registers: mean, then the centred sum of squares: exact for rows with a
//   large mean, one multiply by 1/H per row instead of Welford's divide per element.
// - The activation is a template argument: no branch in the element loop, and the backward computes the GeLU
//   derivative once per element (dz is kept in registers for the dx pass).
// - Several row groups share a block and run in lockstep, so the group reductions use block barriers that are
//   never divergent; a group past the last row takes part with nothing loaded.
// - Weight/bias gradients: each thread adds its columns' dz * xhat and dz into its group's fp32 row of shared
//   memory for every row it processes (no global traffic per row, no atomics); at the end the block adds its groups
//   in a fixed order and writes one [K, hidden] partial per block; column_sum_kernel sums the blocks in a fixed
//   order. Deterministic run to run.
#pragma once

namespace megakernels {
namespace MK_NS {
namespace {

constexpr int kMaxRowThreads = 512;

// Packs per thread of the row-resident kernels: 32 elements per thread for every storage type, so that a row of
// 1k elements is one warp (shuffle-only reductions) and per-row work is spread over many elements; a row of 16k
// takes 512 threads.
template <typename T>
constexpr int row_packs_per_thread() {
  return 32 / (16 / int(sizeof(T)));
}

template <typename T, typename W, int N, int P, Activation ACT, bool RMS>
__global__ void __launch_bounds__(kMaxRowThreads) norm_fwd_rows_kernel(norms::FwdArgs a, int group_threads) {
  constexpr bool LOWP = sizeof(T) == 2;
  __shared__ float red[64];
  const T* x = static_cast<const T*>(a.x);
  const W* w = static_cast<const W*>(a.w);
  const W* b = static_cast<const W*>(a.b);
  T* y = static_cast<T*>(a.y);
  const int H = int(a.hidden);
  const float inv_h = 1.0f / float(H);
  const int groups = blockDim.x / group_threads;
  const int g = threadIdx.x / group_threads, t = threadIdx.x % group_threads;
  for (int64_t base = int64_t(blockIdx.x) * groups; base < a.rows; base += int64_t(gridDim.x) * groups) {
    const int64_t row = base + g;
    const bool active = row < a.rows;
    const T* xr = x + (active ? row : 0) * a.hidden;
    float v[P][N];
    bool in[P];
    float s[1] = {0.0f};
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int j = (t + p * group_threads) * N;
      in[p] = active && j < H;
      if (in[p]) {
        load_pack<T, N>(xr, j, v[p]);
      } else {
#pragma unroll
        for (int k = 0; k < N; ++k) v[p][k] = 0.0f;
      }
#pragma unroll
      for (int k = 0; k < N; ++k) s[0] += v[p][k];
    }
    float mean = 0.0f;
    if (!RMS) {
      groups_sum<1>(s, group_threads, red);
      mean = s[0] * inv_h;
    }
    float q[1] = {0.0f};
#pragma unroll
    for (int p = 0; p < P; ++p) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float d = in[p] ? v[p][k] - mean : 0.0f;
        q[0] += d * d;
      }
    }
    groups_sum<1>(q, group_threads, red);
    const float rstd = rsqrtf(q[0] * inv_h + float(a.eps));
    if (active && t == 0) {
      if (!RMS) static_cast<float*>(a.mean)[row] = mean;
      static_cast<float*>(a.rstd)[row] = rstd;
    }
#pragma unroll
    for (int p = 0; p < P; ++p) {
      if (!in[p]) continue;
      const int j = (t + p * group_threads) * N;
      float wv[N], bv[N];
      load_pack<W, N>(w, j, wv);
      if (!RMS) load_pack<W, N>(b, j, bv);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float z = (v[p][k] - mean) * rstd * wv[k] + (RMS ? 0.0f : bv[k]);
        v[p][k] = gelu_value<ACT, LOWP>(z);
      }
      store_pack<T, N>(y + row * a.hidden, j, v[p]);
    }
  }
}

// Dynamic shared memory: groups x K x hidden floats (K = 2 for LayerNorm: dw and db; 1 for RMSNorm), then for fp32
// groups x hidden floats of dz. Writes the block's [K, hidden] partial to a.workspace + blockIdx.x * K * hidden.
template <typename T, typename W, int N, int P, Activation ACT, bool RMS>
__global__ void __launch_bounds__(kMaxRowThreads) norm_bwd_rows_kernel(norms::BwdArgs a, int group_threads) {
  constexpr bool LOWP = sizeof(T) == 2;
  // 32 fp32 values of x and of dz per thread do not fit in registers beside the rest: the fp32 kernel re-reads x
  // (from L1/L2) and keeps dz in shared memory between the two passes.
  constexpr bool KEEP_X = sizeof(T) == 2;
  constexpr int K = RMS ? 1 : 2;
  __shared__ float red[64];
  MK_DYNAMIC_SHARED(float, acc);
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  const W* w = static_cast<const W*>(a.w);
  const W* b = static_cast<const W*>(a.b);
  const int H = int(a.hidden);
  const float inv_h = 1.0f / float(H);
  const int groups = blockDim.x / group_threads;
  const int g = threadIdx.x / group_threads, t = threadIdx.x % group_threads;
  float* my_acc = acc + g * K * H;            // this group's [K, H]; thread t owns the columns of its packs
  float* my_dz = acc + (groups * K + g) * H;  // fp32 only: this group's dz row
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int j = (t + p * group_threads) * N;
    if (j < H) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        my_acc[j + k] = 0.0f;
        if (!RMS) my_acc[H + j + k] = 0.0f;
      }
    }
  }
  for (int64_t base = int64_t(blockIdx.x) * groups; base < a.rows; base += int64_t(gridDim.x) * groups) {
    const int64_t row = base + g;
    const bool active = row < a.rows;
    const int64_t off = (active ? row : 0) * a.hidden;
    const float mean = (RMS || !active) ? 0.0f : static_cast<const float*>(a.mean)[row];
    const float rstd = active ? static_cast<const float*>(a.rstd)[row] : 0.0f;
    Pack<T, N> xs[KEEP_X ? P : 1];  // x in its storage type: the dx pass recomputes xhat from it
    float dz[KEEP_X ? P : 1][N];
    float s[2] = {0.0f, 0.0f};
    // fp32: two packs at a time (a fully unrolled pass would hoist 8 packs of 4 tensors into registers).
#pragma unroll(KEEP_X ? P : 2)
    for (int p = 0; p < P; ++p) {
      const int j = (t + p * group_threads) * N;
      if (!active || j >= H) continue;
      float wv[N], bv[N];
      float (&d)[N] = dz[KEEP_X ? p : 0];
      const Pack<T, N> xp = load_raw<T, N>(x + off, j);
      if (KEEP_X) xs[KEEP_X ? p : 0] = xp;
      load_pack<T, N>(dy + off, j, d);
      load_pack<W, N>(w, j, wv);
      if (!RMS && ACT != Activation::None) {
        load_pack<W, N>(b, j, bv);
      } else {
#pragma unroll
        for (int k = 0; k < N; ++k) bv[k] = 0.0f;
      }
      // Four columns at a time through the shared accumulators (few live registers).
#pragma unroll
      for (int k0 = 0; k0 < N; k0 += 4) {
        constexpr int Q = N < 4 ? N : 4;
        float pw[Q], pb[Q];
        load_pack<float, Q>(my_acc, j + k0, pw);
        if (!RMS) load_pack<float, Q>(my_acc + H, j + k0, pb);
#pragma unroll
        for (int k = k0; k < k0 + Q; ++k) {
          const float xh = (pack_acc(xp, k) - mean) * rstd;
          if (ACT != Activation::None) d[k] *= gelu_derivative<ACT, LOWP>(xh * wv[k] + bv[k]);
          const float gw = d[k] * wv[k];
          s[0] += gw;
          s[1] += gw * xh;
          pw[k - k0] += d[k] * xh;
          if (!RMS) pb[k - k0] += d[k];
        }
        store_shared_pack<float, Q>(my_acc, j + k0, pw);
        if (!RMS) store_shared_pack<float, Q>(my_acc + H, j + k0, pb);
      }
      if (!KEEP_X) store_shared_pack<float, N>(my_dz, j, d);
    }
    groups_sum<2>(s, group_threads, red);
    const float c1 = RMS ? 0.0f : s[0] * inv_h;
    const float c2 = s[1] * inv_h;
#pragma unroll(KEEP_X ? P : 2)
    for (int p = 0; p < P; ++p) {
      const int j = (t + p * group_threads) * N;
      if (!active || j >= H) continue;
      float wv[N];
      float (&d)[N] = dz[KEEP_X ? p : 0];
      load_pack<W, N>(w, j, wv);
      const Pack<T, N> xp = KEEP_X ? xs[KEEP_X ? p : 0] : load_raw<T, N>(x + off, j);
      if (!KEEP_X) load_pack<float, N>(my_dz, j, d);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float xh = (pack_acc(xp, k) - mean) * rstd;
        d[k] = rstd * (d[k] * wv[k] - c1 - xh * c2);
      }
      store_pack<T, N>(static_cast<T*>(a.dx) + off, j, d);
    }
  }
  __syncthreads();
  float* out = static_cast<float*>(a.workspace) + int64_t(blockIdx.x) * K * H;
  for (int i = threadIdx.x; i < K * H; i += blockDim.x) {
    float total = 0.0f;
    for (int q = 0; q < groups; ++q) total += acc[q * K * H + i];
    out[i] = total;
  }
}

// Launch plan of the row-resident kernels: G threads per row, `groups` rows per block in lockstep.
struct RowsPlan {
  int group_threads, groups, grid;
  size_t smem;  // dynamic shared memory per block (backward)
};

inline bool rows_kernel_fits(int64_t hidden, int pack, int packs_per_thread) {
  return hidden % pack == 0 && hidden / pack <= int64_t(packs_per_thread) * kMaxRowThreads;
}

// Resident blocks per SM: up to 2048 threads (forward; ~64 registers), 2 for the backward (~120 registers, and
// every block adds a [K, hidden] partial for the column sum), fewer where shared memory allows fewer.
inline RowsPlan rows_plan(int64_t rows, int64_t hidden, int pack, int packs_per_thread, int accumulators) {
  RowsPlan p{};
  const int64_t threads = (hidden / pack + packs_per_thread - 1) / packs_per_thread;
  p.group_threads = int((threads + 31) / 32 * 32);
  p.groups = p.group_threads >= 256 ? 1 : 256 / p.group_threads;
  if (MK_CUDA_EMU && p.groups > 2) p.groups = 2;  // the emulator's threads are host threads: 2 groups still lockstep
  const int block = p.group_threads * p.groups;
  p.smem = size_t(p.groups) * accumulators * hidden * sizeof(float);
  int per_sm = accumulators > 0 ? 2 : 2048 / block;
  if (p.smem > 0) {
    const int by_smem = int((228 * 1024) / (p.smem + 2048));
    per_sm = per_sm < by_smem ? per_sm : by_smem;
  }
  if (per_sm < 1) per_sm = 1;
  const int64_t needed = (rows + p.groups - 1) / p.groups;
  const int64_t cap = int64_t(sm_count()) * per_sm;
  p.grid = int(needed < cap ? needed : cap);
  if (p.grid < 1) p.grid = 1;
  return p;
}

}  // namespace
}  // namespace MK_NS
}  // namespace megakernels
