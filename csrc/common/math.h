// Shared scalar math for the CPU (.cpp) and CUDA (.cu) kernels: compiled by g++ and by nvcc, torch-free.
// A kernel's math lives here once; each backend only decides how rows and elements are scheduled.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MK_MATH __host__ __device__ __forceinline__
#else
#define MK_MATH inline
#endif

namespace megakernels {

// Element types crossing the torch-free boundary. Values match bindings.cpp's mapping from at::ScalarType.
enum class DType : int { F32 = 0, F16 = 1, BF16 = 2, F64 = 3 };

// Activation fused as an epilogue (layer_norm) or applied after a bias add (bias_gelu).
enum class Activation : int { None = 0, Gelu = 1, GeluTanh = 2 };

constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2/pi), the tanh-GeLU constant
constexpr double kInvSqrt2 = 0.7071067811865476;
constexpr double kInvSqrt2Pi = 0.3989422804014327;  // 1/sqrt(2*pi), the normal density's scale
constexpr double kGeluCubic = 0.044715;

// exp/erf/tanh. On the GPU the hardware-backed libdevice functions are fast. On the host (CPU kernels and the
// CUDA emulator) libm's erff/tanhf are scalar calls that stop the compiler from vectorising the row loops, and
// they would dominate a fused LayerNorm+GeLU; so single precision uses branch-free polynomials (relative error
// ~1e-7, below fp32's own rounding of the inputs) that vectorise. Double precision (gradcheck) uses libm.
#if defined(__CUDA_ARCH__)
MK_MATH float mk_exp(float x) { return expf(x); }
MK_MATH float mk_erf(float x) { return erff(x); }
MK_MATH float mk_tanh(float x) { return tanhf(x); }
#else
MK_MATH float mk_exp(float x) {
  // Cody-Waite range reduction x = n*ln2 + r, |r| <= ln2/2, then a degree-6 minimax polynomial for e^r.
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float e = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return e * scale;
}
MK_MATH float mk_erf(float x) {
  // erf(x) = sign(x) * (1 - poly(t) * exp(-x^2)), t = 1/(1 + p|x|): a rational approximation with max absolute
  // error 1.2e-7, branch-free apart from the sign select.
  float a = std::fabs(x);
  float t = 1.0f / (1.0f + 0.5f * a);
  float y = t * mk_exp(-a * a - 1.26551223f +
                       t * (1.00002368f +
                            t * (0.37409196f +
                                 t * (0.09678418f +
                                      t * (-0.18628806f +
                                           t * (0.27886807f +
                                                t * (-1.13520398f +
                                                     t * (1.48851587f + t * (-0.82215223f + t * 0.17087277f)))))))));
  float r = 1.0f - y;
  return x < 0.0f ? -r : r;
}
MK_MATH float mk_tanh(float x) {
  // tanh(x) = 1 - 2/(e^{2x}+1); exact to fp32 rounding away from 0, and |x| < 0.0625 uses the odd series,
  // where the subtraction would cancel.
  float a = std::fabs(x);
  float big = 1.0f - 2.0f / (mk_exp(2.0f * a) + 1.0f);
  float x2 = a * a;
  float small = a * (1.0f + x2 * (-0.333333333f + x2 * (0.133333333f + x2 * -0.0539682540f)));
  float r = a < 0.0625f ? small : big;
  return x < 0.0f ? -r : r;
}
#endif
MK_MATH double mk_exp(double x) { return std::exp(x); }
MK_MATH double mk_erf(double x) { return std::erf(x); }
MK_MATH double mk_tanh(double x) { return std::tanh(x); }

// GeLU(z) = z * Phi(z) and its derivative Phi(z) + z * phi(z); the tanh form is Megatron's/GPT-2's approximation.
template <typename A>
MK_MATH A gelu_fwd(A z, Activation act) {
  if (act == Activation::Gelu) return A(0.5) * z * (A(1) + mk_erf(z * A(kInvSqrt2)));
  if (act == Activation::GeluTanh) {
    A u = A(kSqrt2OverPi) * (z + A(kGeluCubic) * z * z * z);
    return A(0.5) * z * (A(1) + mk_tanh(u));
  }
  return z;
}

template <typename A>
MK_MATH A gelu_grad(A z, Activation act) {
  if (act == Activation::Gelu) {
    A cdf = A(0.5) * (A(1) + mk_erf(z * A(kInvSqrt2)));
    A pdf = A(kInvSqrt2Pi) * mk_exp(A(-0.5) * z * z);
    return cdf + z * pdf;
  }
  if (act == Activation::GeluTanh) {
    A u = A(kSqrt2OverPi) * (z + A(kGeluCubic) * z * z * z);
    A t = mk_tanh(u);
    A du = A(kSqrt2OverPi) * (A(1) + A(3 * kGeluCubic) * z * z);
    return A(0.5) * (A(1) + t) + A(0.5) * z * (A(1) - t * t) * du;
  }
  return A(1);
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

}  // namespace megakernels
