// The softmax family's row-resident CUDA kernels (included by softmax_cuda.cu): forward and backward for rows of
// 16-byte packs up to kRowPacks * kMaxRowThreads packs (16k elements of bf16, fp16 or fp32); longer rows and
// unaligned ones take the looping kernels of softmax_cuda.cu.
//
// Design (why; costmodel/README.md has the budgets):
// - A row group of G threads (a multiple of 32) holds the row in registers (32 elements per thread; thread t takes
//   packs t, t + G, ...): x is read once, and each element is exponentiated once (the looping kernels read the row
//   twice and take two exps per element).
// - The scale is folded with log2(e) into one multiply; the exponential is ex2.approx.ftz of z - max (math.h
//   fast_exp2: one MUFU, no range checks).
// - Masks are tested per pack: a causal pack is fully kept, fully masked (not even loaded) or straddles the
//   diagonal (element tests; only its 8-byte words before the diagonal are loaded: load_raw_prefix); a boolean
//   mask is loaded as one 8- or 4-byte word per pack, and a word of zeros (no masked element) takes no
//   per-element select. In-row indices are 32-bit; the query index of a row is one 32-bit division per row.
// - Several row groups share a block in lockstep (block barriers never diverge).
// The semantics are softmax.h's, exactly: NaN or +inf among the kept inputs, or kept inputs that are all -inf, make
// the row NaN (masked positions too); a row with nothing kept is zeros.
#pragma once

namespace megakernels {
namespace MK_NS {
namespace {

using softmax::MaskKind;

constexpr int kMaxRowThreads = 512;
constexpr int kRowElems = 32;  // per thread

template <int N>
struct MaskWord;
template <>
struct MaskWord<8> {
  using type = unsigned long long;
};
template <>
struct MaskWord<4> {
  using type = unsigned int;
};

// Which of a pack's N elements are kept: bit k of the result. `n` is the causal prefix; `m` the mask row.
template <int N, MaskKind K>
__device__ __forceinline__ unsigned kept_bits(int j, int n, const unsigned char* m) {
  constexpr unsigned all = (1u << N) - 1u;
  if (K == MaskKind::Causal) {
    if (j + N <= n) return all;
    if (j >= n) return 0u;
    return (1u << (n - j)) - 1u;
  }
  if (K == MaskKind::Bool) {
    const auto word = *reinterpret_cast<const typename MaskWord<N>::type*>(
        pack_at<unsigned char, N>(const_cast<unsigned char*>(m) + j));
    if (word == 0) return all;
    unsigned bits = 0u;
#pragma unroll
    for (int k = 0; k < N; ++k) bits |= unsigned(((word >> (8 * k)) & 0xffu) == 0) << k;
    return bits;
  }
  return all;
}

// The pack at j of a row whose elements from n on are not to be read (the causal masked triangle): one load when
// the pack lies inside [0, n); else the pack's 8-byte words that hold an element before n (element loads for
// packs of 8 bytes or less), zeros from n on. A 16-byte pack straddling the diagonal is two loads at most, and no
// 8-byte word wholly inside the triangle is read (what csrc/softmax/tests checks under ASan).
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_raw_prefix(const T* p, int64_t j, int64_t n) {
  if (j + N <= n) return load_raw<T, N>(p, j);
  constexpr int W = N * sizeof(T) > 8 ? 8 / int(sizeof(T)) : 1;  // elements per load
  Pack<T, N> r;
#pragma unroll
  for (int w = 0; w < N; w += W) {
    Pack<T, W> q;
    if (j + w < n) q = load_raw<T, W>(p, j + w);
#pragma unroll
    for (int k = 0; k < W; ++k) r.v[w + k] = j + w + k < n ? q.v[k] : Cvt<T>::from(0.0f);
  }
  return r;
}
template <typename T, int N, typename A>
__device__ __forceinline__ void load_prefix(const T* p, int64_t j, int64_t n, A (&out)[N]) {
  const Pack<T, N> r = load_raw_prefix<T, N>(p, j, n);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = A(pack_acc(r, k));
}

template <typename T, int N, MaskKind K>
__global__ void __launch_bounds__(kMaxRowThreads) softmax_fwd_rows_kernel(softmax::FwdArgs a, int group_threads) {
  constexpr int P = kRowElems / N;
  constexpr unsigned all = (1u << N) - 1u;
  __shared__ float red[64];
  const int sk = int(a.sk), sq = int(a.sq);
  const float scale2 = float(a.scale) * 1.4426950408889634f;  // z in log2 units: exp(x*s - m) = 2^(x*s2 - m2)
  const float ninf = -INFINITY;
  const int groups = blockDim.x / group_threads;
  const int g = threadIdx.x / group_threads, t = threadIdx.x % group_threads;
  for (int64_t base = int64_t(blockIdx.x) * groups; base < a.rows; base += int64_t(gridDim.x) * groups) {
    const int64_t row = base + g;
    const bool active = row < a.rows;
    const unsigned rr = active ? unsigned(row) : 0u;  // rows < 2^31 on this path
    const int i = int(rr % unsigned(sq));
    const int n = K == MaskKind::Causal ? int(softmax::causal_valid(i, sq, sk)) : sk;
    const unsigned char* mr = nullptr;
    if (K == MaskKind::Bool) {
      const unsigned bh = rr / unsigned(sq);
      mr = a.mask + int64_t(bh / unsigned(a.heads)) * a.mask_sb + int64_t(bh % unsigned(a.heads)) * a.mask_sh +
           int64_t(i) * a.mask_sq;
    }
    const T* xr = static_cast<const T*>(a.x) + int64_t(rr) * sk;
    float z[P][N];
    unsigned keep[P];
    float m = ninf;
    bool any = false;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int j = (t + p * group_threads) * N;
      keep[p] = (active && j < sk) ? kept_bits<N, K>(j, n, mr) : 0u;
      if (keep[p]) {
        if (K == MaskKind::Causal)
          load_prefix<T, N>(xr, j, n, z[p]);
        else
          load_pack<T, N>(xr, j, z[p]);
      }
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const bool kk = keep[p] == all || ((keep[p] >> k) & 1u);
        z[p][k] = kk ? z[p][k] * scale2 : ninf;
        m = fmaxf(m, z[p][k]);
      }
      any |= keep[p] != 0u;
    }
    // fmaxf drops NaN; the sum below carries it (exp2(NaN - m) is NaN).
    float red_m[1] = {m};
    groups_max(red_m, group_threads, red);
    const float gm = red_m[0];
    const float msafe = gm == ninf || gm == INFINITY ? 0.0f : gm;
    float s[2] = {0.0f, any ? 1.0f : 0.0f};
#pragma unroll
    for (int p = 0; p < P; ++p) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        z[p][k] = fast_exp2(z[p][k] - msafe);  // masked: exp2(-inf) = 0
        s[0] += z[p][k];
      }
    }
    groups_sum<2>(s, group_threads, red);
    float inv = (gm == ninf || gm == INFINITY) ? NAN : fast_rcp(s[0]);
    if (s[1] == 0.0f) inv = 0.0f;  // nothing kept: zeros
    T* yr = static_cast<T*>(a.y) + int64_t(rr) * sk;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int j = (t + p * group_threads) * N;
      if (!active || j >= sk) continue;
#pragma unroll
      for (int k = 0; k < N; ++k) z[p][k] *= inv;  // masked: 0 * inv, NaN in a NaN row
      store_pack<T, N>(yr, j, z[p]);
    }
  }
}

// dx = scale * y * (dy - sum(dy * y)) over the kept prefix (causal: the masked tail is written as zeros).
template <typename T, int N, bool CAUSAL>
__global__ void __launch_bounds__(kMaxRowThreads) softmax_bwd_rows_kernel(softmax::BwdArgs a, int group_threads) {
  constexpr int P = kRowElems / N;
  __shared__ float red[64];
  const int sk = int(a.sk), sq = int(a.sq);
  const float scale = float(a.scale);
  const int groups = blockDim.x / group_threads;
  const int g = threadIdx.x / group_threads, t = threadIdx.x % group_threads;
  for (int64_t base = int64_t(blockIdx.x) * groups; base < a.rows; base += int64_t(gridDim.x) * groups) {
    const int64_t row = base + g;
    const bool active = row < a.rows;
    const unsigned rr = active ? unsigned(row) : 0u;
    const int n = CAUSAL ? int(softmax::causal_valid(int(rr % unsigned(sq)), sq, sk)) : sk;
    const int64_t off = int64_t(rr) * sk;
    Pack<T, N> y[P];
    float d[P][N];
    float s[1] = {0.0f};
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int j = (t + p * group_threads) * N;
      const bool live = active && j < sk && j < n;
      if (live && CAUSAL) {
        y[p] = load_raw_prefix<T, N>(static_cast<const T*>(a.y) + off, j, n);
        load_prefix<T, N>(static_cast<const T*>(a.dy) + off, j, n, d[p]);
      } else if (live) {
        y[p] = load_raw<T, N>(static_cast<const T*>(a.y) + off, j);
        load_pack<T, N>(static_cast<const T*>(a.dy) + off, j, d[p]);
      }
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const bool kk = live && (!CAUSAL || j + k < n);
        if (!kk) d[p][k] = 0.0f;
        s[0] += kk ? d[p][k] * pack_acc(y[p], k) : 0.0f;
      }
    }
    groups_sum<1>(s, group_threads, red);
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int j = (t + p * group_threads) * N;
      if (!active || j >= sk) continue;
      const bool live = j < n;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const bool kk = live && (!CAUSAL || j + k < n);
        d[p][k] = kk ? scale * pack_acc(y[p], k) * (d[p][k] - s[0]) : 0.0f;
      }
      store_pack<T, N>(static_cast<T*>(a.dx) + off, j, d[p]);
    }
  }
}

inline bool rows_kernel_fits(int64_t rows, int64_t sk, int pack) {
  return sk % pack == 0 && sk <= int64_t(kRowElems) * kMaxRowThreads && rows < (int64_t(1) << 31);
}

// (group threads, rows per block, grid): G threads per row, 256-thread blocks of row groups, 2048 threads per SM.
inline RowPlan softmax_rows_plan(int64_t rows, int64_t sk) {
  RowPlan p;
  const int64_t threads = (sk + kRowElems - 1) / kRowElems;
  p.group_threads = int((threads + 31) / 32 * 32);
  int groups = p.group_threads >= 256 ? 1 : 256 / p.group_threads;
  if (MK_CUDA_EMU && groups > 2) groups = 2;  // the emulator's threads are host threads: 2 groups still lockstep
  p.block = p.group_threads * groups;
  const int64_t needed = (rows + groups - 1) / groups;
  const int64_t cap = int64_t(sm_count()) * (2048 / p.block);
  p.grid = needed < cap ? needed : cap;
  if (p.grid < 1) p.grid = 1;
  return p;
}

}  // namespace
}  // namespace MK_NS
}  // namespace megakernels
