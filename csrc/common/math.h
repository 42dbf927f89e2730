// Shared scalar math for the CPU (.cpp) and CUDA (.cu) kernels: compiled by g++ and by nvcc, torch-free.
// A kernel's math lives here once; each backend only decides how rows and elements are scheduled.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_isa.h"

#if defined(__CUDACC__)
#define MK_MATH __host__ __device__ __forceinline__
#elif defined(MK_CPU_ISA)
#define MK_MATH static inline  // an ISA clone's own copy, never merged with another target's (cpu_isa.h)
#else
#define MK_MATH inline
#endif

namespace megakernels {

// Element types crossing the torch-free boundary. Values match csrc/bindings' mapping from at::ScalarType.
enum class DType : int { F32 = 0, F16 = 1, BF16 = 2, F64 = 3 };

// Activation fused as an epilogue (layer_norm) or applied after a bias add (bias_gelu).
enum class Activation : int { None = 0, Gelu = 1, GeluTanh = 2 };

MK_ISA_BEGIN  // the functions below differ per target: each ISA clone of a CPU kernel has its own (cpu_isa.h)

    constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2/pi), the tanh-GeLU constant
constexpr double kInvSqrt2 = 0.7071067811865476;
constexpr double kInvSqrt2Pi = 0.3989422804014327;  // 1/sqrt(2*pi), the normal density's scale
constexpr double kGeluCubic = 0.044715;

// exp and the normal cdf/pdf behind GeLU. On the GPU the libdevice functions are fast. On the host (CPU kernels
// and the CUDA emulator) libm's erff/expf are scalar calls that stop the compiler from vectorising the row loops,
// and they would dominate a fused LayerNorm+GeLU; so single precision uses branch-free approximations that
// vectorise: a Cody-Waite + degree-6 polynomial exp (relative error ~1e-7), and Abramowitz & Stegun 7.1.26 for
// erfc (absolute error <= 1.5e-7), which shares its exp(-z^2/2) with the normal pdf so that GeLU's value and
// derivative cost one exp and one division. Double precision (gradcheck) uses libm.
// The single-precision exp's constants (also the CPU kernels' hand-vectorised copies of it): the clamp, log2(e),
// ln 2 in two parts (x - n ln2 = x - n kExpLn2Hi + n kExpLn2Lo), the polynomial's coefficients, highest first.
constexpr float kExpMin = -87.0f, kExpMax = 88.0f, kExpLog2e = 1.44269504088896341f;
constexpr float kExpLn2Hi = 0.693359375f, kExpLn2Lo = 2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
#if !defined(__CUDA_ARCH__)
MK_MATH float mk_exp(float x) {
  x = x < kExpMin ? kExpMin : (x > kExpMax ? kExpMax : x);
  float n = std::floor(x * kExpLog2e + 0.5f);  // x = n*ln2 + r, |r| <= ln2/2
  float r = x - n * kExpLn2Hi;
  r = r + n * kExpLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  float e = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-125, 127] after the clamp
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return e * scale;
}
#else
MK_MATH float mk_exp(float x) { return expf(x); }
#endif
MK_MATH double mk_exp(double x) { return std::exp(x); }

// Fast single-precision primitives: on the GPU one MUFU each, flushing denormals (ex2.approx.ftz, rcp.approx.ftz,
// tanh.approx: without .ftz, ptxas wraps ex2 and rcp in range checks that cost ~6 instructions per call); on the
// host (CPU kernels, emulator) the accurate equivalents.
MK_MATH float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return x < -126.0f ? 0.0f : mk_exp(x * 0.6931471805599453f);  // ftz: below 2^-126 is 0, as on the GPU
#endif
}
MK_MATH float fast_exp(float x) { return fast_exp2(x * 1.4426950408889634f); }
MK_MATH float fast_rcp(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return 1.0f / x;
#endif
}
MK_MATH float fast_tanh(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::tanh(x);
#endif
}

// Standard normal cdf Phi(z) and pdf phi(z).
MK_MATH void normal_cdf_pdf(double z, double& cdf, double& pdf) {
  cdf = 0.5 * std::erfc(-z * kInvSqrt2);
  pdf = kInvSqrt2Pi * std::exp(-0.5 * z * z);
}
// Single precision: the same Abramowitz & Stegun form on the GPU, with its exp and reciprocal as fast primitives
// (one MUFU.EX2 and one MUFU.RCP, ~16 instructions for value and derivative together; normcdff alone takes ~25 and
// erff ~26).
MK_MATH void normal_cdf_pdf(float z, float& cdf, float& pdf) {
  const float x = std::fabs(z) * float(kInvSqrt2);
#if defined(__CUDA_ARCH__)
  const float e = fast_exp2(z * z * float(-0.5 * 1.4426950408889634));  // exp(-x^2)
  const float t = fast_rcp(1.0f + 0.3275911f * x);
#else  // the CPU kernels' vectorised form (a select in fast_exp2 would cost them)
  const float e = mk_exp(-0.5f * z * z);
  const float t = 1.0f / (1.0f + 0.3275911f * x);
#endif
  pdf = float(kInvSqrt2Pi) * e;
  const float half_erfc =
      0.5f * e * t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  cdf = z >= 0.0f ? 1.0f - half_erfc : half_erfc;
}

// GeLU(z) = z * Phi(z) and its derivative Phi(z) + z * phi(z). The tanh form (Megatron's/GPT-2's approximation)
// 0.5 z (1 + tanh(u)), u = sqrt(2/pi) (z + 0.044715 z^3), is evaluated as z * sigmoid(2u): one exp, no tanh.
template <typename A>
MK_MATH A gelu_fwd(A z, Activation act) {
  if (act == Activation::Gelu) {
    A cdf, pdf;
    normal_cdf_pdf(z, cdf, pdf);
    return z * cdf;
  }
  if (act == Activation::GeluTanh) {
    const A u = A(kSqrt2OverPi) * (z + A(kGeluCubic) * z * z * z);
    return z / (A(1) + mk_exp(A(-2) * u));
  }
  return z;
}

template <typename A>
MK_MATH A gelu_grad(A z, Activation act) {
  if (act == Activation::Gelu) {
    A cdf, pdf;
    normal_cdf_pdf(z, cdf, pdf);
    return cdf + z * pdf;
  }
  if (act == Activation::GeluTanh) {
    const A u = A(kSqrt2OverPi) * (z + A(kGeluCubic) * z * z * z);
    const A du = A(kSqrt2OverPi) * (A(1) + A(3 * kGeluCubic) * z * z);
    const A s = A(1) / (A(1) + mk_exp(A(-2) * u));  // (1 + tanh(u)) / 2
    return s + A(2) * z * s * (A(1) - s) * du;
  }
  return A(1);
}

// GeLU with the activation fixed at compile time, for kernels whose hot loop must not branch on it. `LOWP`: the
// result is stored in 16 bits. The erf form is gelu_fwd / gelu_grad (normal_cdf_pdf above: ~16 instructions, 2
// MUFU). The tanh form in single precision: with 16-bit storage 0.5 z (1 + tanh u) through tanh.approx.f32 on the
// GPU (one MUFU.TANH, relative error 2^-11, below bf16/fp16 rounding), with fp32 storage z * sigmoid(2u) through
// ex2 and rcp (2 MUFU, relative error ~2^-22). The emulator and the CPU run the same formulas with accurate
// primitives, so only the primitive differs between a GPU and the tests that run here.
// The erf form with 16-bit storage: Phi(z) ~= sigmoid(2 p(z)), p(z) = z (c1 + c3 z^2 + c5 z^4), a weighted minimax
// fit (|Phi error| <= 1.9e-5 for every z, GeLU's <= 5.5e-5, its derivative's <= 1.4e-4: ten times closer to the exact
// GeLU than the tanh form, and below bf16/fp16 rounding of values and gradients of order 0.1 and up). One ex2 and
// one rcp, ~9 instructions (the A&S erfc form is ~16). z^2 is capped at 100 (|z| = 10, where Phi is 0 or 1 in
// fp32) so that the negative z^5 term never turns p around. The derivative is that of the same function.
constexpr double kGeluErfC1 = 0.797717590518013, kGeluErfC3 = 0.03679872855395207, kGeluErfC5 = -0.0003159486753902881;
constexpr double kM2Log2e = -2.0 * 1.4426950408889634;  // ex2's argument is -2 log2(e) p(z)
// Returns -2 p'(z); s = sigmoid(2 p(z)).
MK_MATH float gelu_erf_lowp(float z, float& s) {
  const float z2 = fminf(z * z, 100.0f);
  const float q =
      float(kM2Log2e * kGeluErfC1) + z2 * (float(kM2Log2e * kGeluErfC3) + z2 * float(kM2Log2e * kGeluErfC5));
  s = fast_rcp(1.0f + fast_exp2(z * q));
  return float(-2 * kGeluErfC1) + z2 * (float(-6 * kGeluErfC3) + z2 * float(-10 * kGeluErfC5));
}

template <Activation ACT, bool LOWP, typename A>
MK_MATH A gelu_value(A z) {
  if constexpr (ACT == Activation::Gelu && LOWP && std::is_same_v<A, float>) {
    float s;
    (void)gelu_erf_lowp(z, s);
    return z * s;
  } else if constexpr (ACT == Activation::GeluTanh && std::is_same_v<A, float>) {
    const float u = float(kSqrt2OverPi) * z * (1.0f + float(kGeluCubic) * z * z);
    if constexpr (LOWP) return 0.5f * z * (1.0f + fast_tanh(u));
    return z * fast_rcp(1.0f + fast_exp(-2.0f * u));
  } else {
    return gelu_fwd<A>(z, ACT);
  }
}

template <Activation ACT, bool LOWP, typename A>
MK_MATH A gelu_derivative(A z) {
  if constexpr (ACT == Activation::Gelu && LOWP && std::is_same_v<A, float>) {
    float s;
    const float dq = gelu_erf_lowp(z, s);  // GeLU' = s + z (2p') s (1 - s)
    return s - (z * dq) * (s - s * s);
  } else if constexpr (ACT == Activation::GeluTanh && std::is_same_v<A, float>) {
    const float z2 = z * z;
    const float u = float(kSqrt2OverPi) * z * (1.0f + float(kGeluCubic) * z2);
    const float du = float(kSqrt2OverPi) * (1.0f + float(3 * kGeluCubic) * z2);
    if constexpr (LOWP) {
      const float t = fast_tanh(u);
      return 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * du;
    }
    const float sg = fast_rcp(1.0f + fast_exp(-2.0f * u));  // (1 + tanh(u)) / 2
    return sg + 2.0f * z * sg * (1.0f - sg) * du;
  } else {
    return gelu_grad<A>(z, ACT);
  }
}

// Welford's running (count, mean, M2) and Chan's pairwise merge: one pass over a row, numerically stable for
// rows with a large mean (sum/sum-of-squares would cancel), and merges across threads in any tree shape.
template <typename A>
struct Welford {
  A n, mean, m2;
};
template <typename A>
MK_MATH void welford_add(Welford<A>& s, A x) {
  s.n += A(1);
  A d = x - s.mean;
  s.mean += d / s.n;
  s.m2 += d * (x - s.mean);
}
template <typename A>
MK_MATH Welford<A> welford_merge(const Welford<A>& a, const Welford<A>& b) {
  A n = a.n + b.n;
  if (n == A(0)) return a;
  A d = b.mean - a.mean;
  A fb = b.n / n;
  return Welford<A>{n, a.mean + d * fb, a.m2 + b.m2 + d * d * a.n * fb};
}

MK_ISA_END
}  // namespace megakernels
