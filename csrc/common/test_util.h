// Helpers for the torch-free C++ kernel tests (csrc/<family>/tests/*.cpp): a check counter that reports like
// the other tests, dtype-tagged buffers with float views, and the per-dtype tolerances the Python tests use too.
#pragma once
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cpu_types.h"
#include "math.h"

namespace megakernels {
namespace testing {

struct Counts {
  int checks = 0, failures = 0;
};
inline Counts& counts() {
  static Counts c;
  return c;
}

// Records one check; prints the first 30 failures.
inline void expect(bool ok, const std::string& what) {
  Counts& c = counts();
  ++c.checks;
  if (!ok && ++c.failures <= 30) std::printf("FAIL: %s\n", what.c_str());
}

// Prints "N checks, M failures" and returns the process exit code.
inline int report() {
  std::printf("%d checks, %d failures\n", counts().checks, counts().failures);
  return counts().failures == 0 ? 0 : 1;
}

inline size_t elem_size(DType d) { return d == DType::F64 ? 8 : (d == DType::F32 ? 4 : 2); }
inline const char* dtype_name(DType d) {
  return d == DType::F32 ? "f32" : d == DType::BF16 ? "bf16" : d == DType::F16 ? "f16" : "f64";
}
// Allowed error relative to max(1, max|reference|) for a result stored in `d`.
inline float tol(DType d) { return d == DType::F32 ? 2e-5f : d == DType::BF16 ? 1.6e-2f : 2e-3f; }

// n values of `dt` starting `off` elements into the allocation (off = 1 makes a view that is not 16-byte
// aligned). Fresh storage is poisoned (0xA5 bytes), so an output a kernel forgot to write shows up.
struct Buf {
  DType dt;
  std::vector<unsigned char> bytes;
  size_t off;
  Buf(DType d, size_t n, size_t o = 0) : dt(d), bytes((n + o) * elem_size(d), 0xA5), off(o) {}
  void* data() { return bytes.data() + off * elem_size(dt); }
  const void* data() const { return bytes.data() + off * elem_size(dt); }
  size_t size() const { return bytes.size() / elem_size(dt) - off; }
  float get(size_t i) const {
    switch (dt) {
      case DType::F32: return static_cast<const float*>(data())[i];
      case DType::F64: return float(static_cast<const double*>(data())[i]);
      case DType::BF16: return cpu::to_float(static_cast<const cpu::bf16*>(data())[i]);
      case DType::F16: return cpu::to_float(static_cast<const cpu::f16*>(data())[i]);
    }
    return 0.f;
  }
  void set(size_t i, float v) {
    switch (dt) {
      case DType::F32: static_cast<float*>(data())[i] = v; break;
      case DType::F64: static_cast<double*>(data())[i] = v; break;
      case DType::BF16: static_cast<cpu::bf16*>(data())[i] = cpu::from_float<cpu::bf16>(v); break;
      case DType::F16: static_cast<cpu::f16*>(data())[i] = cpu::from_float<cpu::f16>(v); break;
    }
  }
};

// Normal(shift, scale^2) values rounded to `dt`.
inline Buf random_buf(DType dt, size_t n, std::mt19937& rng, float scale, float shift = 0.f, size_t off = 0) {
  std::normal_distribution<float> nd(0.f, 1.f);
  Buf b(dt, n, off);
  for (size_t i = 0; i < n; ++i) b.set(i, nd(rng) * scale + shift);
  return b;
}

// Elementwise |a-b| <= tol * max(1, max|b|); the error must be finite.
inline void compare(const std::string& what, const Buf& a, const Buf& b, float t) {
  float scale = 1.f, err = 0.f;
  for (size_t i = 0; i < b.size(); ++i) scale = std::fmax(scale, std::fabs(b.get(i)));
  for (size_t i = 0; i < b.size(); ++i) err = std::fmax(err, std::fabs(a.get(i) - b.get(i)));
  expect(err <= t * scale && std::isfinite(err), what + ": max error " + std::to_string(err));
}

// GeLU in fp64 (the references): erf form, tanh form, or the identity.
inline double gelu64(double z, Activation act) {
  if (act == Activation::Gelu) return 0.5 * z * (1 + std::erf(z / std::sqrt(2.0)));
  if (act == Activation::GeluTanh) return 0.5 * z * (1 + std::tanh(kSqrt2OverPi * (z + kGeluCubic * z * z * z)));
  return z;
}

}  // namespace testing
}  // namespace megakernels
