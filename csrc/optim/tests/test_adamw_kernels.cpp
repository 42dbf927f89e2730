// C++ test of the optimizer family without Python: the multi-tensor CUDA kernels (run by the emulator, csrc/emu)
// against the CPU kernels and a naive fp64 reference. Lists mix many small tensors (odd sizes: scalar tails) with
// a few big ones that cross chunk boundaries; master mode with 16-bit or fp32 grads; more tensors than one launch table
// holds force several launches, and small chunk sizes give launches of many hundred chunks. Also the skip path
// (found_inf set: nothing changes, steps included), grad unscaling, the non-finite check and the L2 norm. Built plain,
// with AddressSanitizer and with ThreadSanitizer (CMakeLists.txt).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../../common/cpu_types.h"
#include "../../common/test_util.h"
#include "../optim.h"

using namespace megakernels;
using namespace megakernels::testing;
using cpu::bf16;
using cpu::f16;

namespace {

// The optimizer state of one tensor; copied whole so the CPU and emulated kernels start from the same bits.
struct State {
  Buf param, grad, m, v;
  std::vector<float> master;
  float step;
};

struct ListState {
  std::vector<State> s;
  std::vector<optim::AdamWTensor> views() {
    std::vector<optim::AdamWTensor> out;
    for (State& x : s)
      out.push_back({x.param.data(), x.grad.data(), x.m.data(), x.v.data(),
                     x.master.empty() ? nullptr : x.master.data(), &x.step, int64_t(x.param.size())});
    return out;
  }
};

ListState make_list(const std::vector<int64_t>& sizes, DType pdt, bool master, bool grad_f32, std::mt19937& rng,
                    float step) {
  ListState l;
  const DType sdt = master ? DType::F32 : pdt;
  for (int64_t n : sizes) {
    // Every third param is a misaligned view: its tensor takes the scalar path, the others stay vectorised.
    Buf p = random_buf(pdt, size_t(n), rng, 1.f, 0.f, l.s.size() % 3 == 1 ? 1 : 0);
    Buf g = random_buf(grad_f32 ? DType::F32 : pdt, size_t(n), rng, 0.5f);
    Buf m = random_buf(sdt, size_t(n), rng, 0.1f);
    Buf v = random_buf(sdt, size_t(n), rng, 0.f, 0.f);
    std::uniform_real_distribution<float> ud(0.f, 0.05f);
    for (size_t i = 0; i < size_t(n); ++i) v.set(i, ud(rng));  // second moments are >= 0
    std::vector<float> w;
    if (master)
      for (size_t i = 0; i < size_t(n); ++i) w.push_back(p.get(i) + 1e-3f * float(i % 7));  // not just p rounded
    l.s.push_back(State{p, g, m, v, w, step});
  }
  return l;
}

void run_cpu(const optim::AdamWArgs& a) {
  if (a.found_inf && *a.found_inf != 0.f) return;
  for (int64_t t = 0; t < a.n_tensors; ++t)
    for (int64_t b = 0; b < a.tensors[t].numel; b += a.chunk_size)
      cpu::adamw_range(a, t, b, std::min(a.tensors[t].numel, b + a.chunk_size));
  for (int64_t t = 0; t < a.n_tensors; ++t) *const_cast<float*>(a.tensors[t].step) += 1.f;
}

// fp64 AdamW of one element from the stored inputs (the reference semantics of csrc/optim/optim.h).
void reference(const optim::AdamWArgs& a, double step, double p, double g, double m, double v, double& p_out,
               double& m_out, double& v_out) {
  const double t = step + 1, bc1 = 1 - std::pow(a.beta1, t), bc2 = 1 - std::pow(a.beta2, t);
  if (a.grad_scale) g /= *a.grad_scale;
  p *= 1 - a.lr * a.weight_decay;
  m = m + (1 - a.beta1) * (g - m);
  v = a.beta2 * v + (1 - a.beta2) * g * g;
  p -= a.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + a.eps);
  p_out = p;
  m_out = m;
  v_out = v;
}

float max_abs_diff(const Buf& a, const Buf& b) {
  float e = 0.f;
  for (size_t i = 0; i < a.size(); ++i) e = std::fmax(e, std::fabs(a.get(i) - b.get(i)));
  return e;
}

bool same_bytes(const ListState& a, const ListState& b) {
  for (size_t t = 0; t < a.s.size(); ++t) {
    const State &x = a.s[t], &y = b.s[t];
    if (x.param.bytes != y.param.bytes || x.m.bytes != y.m.bytes || x.v.bytes != y.v.bytes || x.master != y.master ||
        x.step != y.step)
      return false;
  }
  return true;
}

void test_adamw(DType pdt, bool master, const std::vector<int64_t>& sizes, int64_t chunk, bool scaled,
                std::mt19937& rng, bool grad_f32 = false) {
  const std::string tag = std::string("adamw ") + dtype_name(pdt) + (master ? " master" : "") +
                          (grad_f32 ? " fp32-grads" : "") + " tensors=" + std::to_string(sizes.size()) +
                          " chunk=" + std::to_string(chunk) + (scaled ? " scaled" : "");
  const float step0 = 4.f;
  ListState orig = make_list(sizes, pdt, master, grad_f32, rng, step0);
  float scale = 8.f;
  if (scaled)  // scaled grads: the kernels divide by the scale
    for (State& s : orig.s)
      for (size_t i = 0; i < s.grad.size(); ++i) s.grad.set(i, s.grad.get(i) * scale);
  ListState on_cpu = orig, on_emu = orig;
  auto views_cpu = on_cpu.views(), views_emu = on_emu.views();
  optim::AdamWArgs a{};
  a.n_tensors = int64_t(sizes.size());
  a.param_dtype = pdt;
  a.master = master;
  a.grad_f32 = grad_f32;
  a.lr = 1e-2;
  a.beta1 = 0.9;
  a.beta2 = 0.999;
  a.eps = 1e-8;
  a.weight_decay = 0.1;
  a.grad_scale = scaled ? &scale : nullptr;
  a.chunk_size = chunk;
  a.tensors = views_cpu.data();
  run_cpu(a);
  a.tensors = views_emu.data();
  const char* err = cuda_emu::adamw(a, nullptr);
  expect(err == nullptr, tag + " launch: " + (err ? err : ""));

  const float ptol = pdt == DType::F32 ? 2e-6f : (pdt == DType::BF16 ? 8e-3f : 1e-3f);
  for (size_t t = 0; t < sizes.size(); ++t) {
    const std::string tt = tag + " tensor " + std::to_string(t) + " (" + std::to_string(sizes[t]) + ")";
    const State &o = orig.s[t], &c = on_cpu.s[t], &e = on_emu.s[t];
    expect(c.step == step0 + 1 && e.step == step0 + 1, tt + " step advanced once");
    // The emulated CUDA kernels and the CPU kernels run the same per-element math (optim.h): equal up to FMA
    // contraction differences between the two compilations.
    expect(max_abs_diff(c.param, e.param) <= ptol * 4,
           tt + " param emu vs cpu " + std::to_string(max_abs_diff(c.param, e.param)));
    expect(max_abs_diff(c.m, e.m) <= 1e-6f && max_abs_diff(c.v, e.v) <= 1e-6f, tt + " moments emu vs cpu");
    double worst = 0;
    for (size_t i = 0; i < o.param.size(); ++i) {
      const double p_in = master ? o.master[i] : o.param.get(i);
      double p, m, v;
      reference(a, step0, p_in, o.grad.get(i), o.m.get(i), o.v.get(i), p, m, v);
      const double p_emu = master ? e.master[i] : e.param.get(i);
      worst = std::fmax(worst, std::fabs(p_emu - p) / std::fmax(1.0, std::fabs(p)));
      if (master) {
        Buf r(pdt, 1);
        r.set(0, e.master[i]);
        expect(r.get(0) == e.param.get(i), tt + " param is the rounded master");
      }
      const double mtol = master || pdt == DType::F32 ? 1e-6 : 1e-2;
      if (std::fabs(e.m.get(i) - m) > mtol * std::fmax(1.0, std::fabs(m)) ||
          std::fabs(e.v.get(i) - v) > mtol * std::fmax(1.0, std::fabs(v))) {
        expect(false, tt + " moments vs fp64 at " + std::to_string(i));
        break;
      }
    }
    const double rtol = master || pdt == DType::F32 ? 2e-6 : ptol;
    expect(worst <= rtol, tt + " param vs fp64: " + std::to_string(worst));
  }

  // Skip path: with *found_inf != 0 neither backend changes anything, steps included.
  ListState skip_cpu = orig, skip_emu = orig;
  auto vs_cpu = skip_cpu.views(), vs_emu = skip_emu.views();
  float flag = 1.f;
  a.found_inf = &flag;
  a.tensors = vs_cpu.data();
  run_cpu(a);
  a.tensors = vs_emu.data();
  err = cuda_emu::adamw(a, nullptr);
  expect(err == nullptr, tag + " skip launch");
  expect(same_bytes(skip_cpu, orig) && same_bytes(skip_emu, orig), tag + " found_inf=1 changes nothing");
}

optim::ListArgs list_of(std::vector<Buf>& bufs, std::vector<const void*>& ptrs, std::vector<int64_t>& numels, DType dt,
                        int64_t chunk) {
  ptrs.clear();
  numels.clear();
  for (Buf& b : bufs) {
    ptrs.push_back(b.data());
    numels.push_back(int64_t(b.size()));
  }
  return optim::ListArgs{ptrs.data(), numels.data(), int64_t(bufs.size()), dt, chunk};
}

void test_lists(DType dt, const std::vector<int64_t>& sizes, int64_t chunk, std::mt19937& rng) {
  const std::string tag = std::string("lists ") + dtype_name(dt) + " tensors=" + std::to_string(sizes.size()) +
                          " chunk=" + std::to_string(chunk);
  std::vector<Buf> bufs;
  for (int64_t n : sizes) bufs.push_back(random_buf(dt, size_t(n), rng, 1.f));
  std::vector<const void*> ptrs;
  std::vector<int64_t> numels;
  optim::ListArgs a = list_of(bufs, ptrs, numels, dt, chunk);

  // L2 norm: emulated vs CPU chunks vs fp64.
  double ref = 0;
  for (Buf& b : bufs)
    for (size_t i = 0; i < b.size(); ++i) ref += double(b.get(i)) * b.get(i);
  ref = std::sqrt(ref);
  double cpu_ss = 0;
  for (int64_t t = 0; t < a.n_tensors; ++t)
    for (int64_t b = 0; b < numels[t]; b += chunk) cpu_ss += cpu::sumsq_range(a, t, b, std::min(numels[t], b + chunk));
  std::vector<float> partials(size_t(std::max<int64_t>(1, cuda_emu::l2norm_workspace_floats(a))), NAN);
  float out = -1.f;
  const char* err = cuda_emu::l2norm(a, partials.data(), &out, nullptr);
  expect(err == nullptr, tag + " l2norm launch");
  expect(std::fabs(out - ref) <= 2e-6 * ref,
         tag + " l2norm emu vs fp64: " + std::to_string(out) + " vs " + std::to_string(ref));
  expect(std::fabs(std::sqrt(cpu_ss) - ref) <= 2e-6 * ref, tag + " l2norm cpu vs fp64");
  float again = -1.f;
  cuda_emu::l2norm(a, partials.data(), &again, nullptr);
  expect(again == out, tag + " l2norm deterministic");

  // Non-finite check: clean list leaves the flag; one NaN / inf anywhere (here: the last element) sets it; a
  // finite value that overflows once divided by the scale sets it too.
  float flag = 0.f, scale = 1.f;
  err = cuda_emu::nonfinite_check(a, &scale, &flag, nullptr);
  expect(err == nullptr && flag == 0.f, tag + " check clean");
  for (float bad : {float(NAN), float(INFINITY)}) {
    Buf& last = bufs.back();
    const float keep = last.get(last.size() - 1);
    last.set(last.size() - 1, bad);
    flag = 0.f;
    cuda_emu::nonfinite_check(a, nullptr, &flag, nullptr);
    bool cpu_bad = false;
    for (int64_t b = 0; b < numels.back(); b += chunk)
      cpu_bad |= cpu::nonfinite_range(a, nullptr, a.n_tensors - 1, b, std::min(numels.back(), b + chunk));
    expect(flag == 1.f && cpu_bad, tag + " check finds " + std::to_string(bad));
    last.set(last.size() - 1, keep);
  }
  if (dt == DType::F32) {
    bufs[0].set(0, 3e38f);
    float tiny = 0.5f;
    flag = 0.f;
    cuda_emu::nonfinite_check(a, &tiny, &flag, nullptr);
    expect(flag == 1.f && cpu::nonfinite_range(a, &tiny, 0, 0, std::min(numels[0], chunk)),
           tag + " check sees overflow after unscaling");
  }
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  // Many small tensors (more than one launch table holds), odd sizes, and big ones crossing chunk boundaries.
  std::vector<int64_t> many;
  for (int i = 0; i < 45; ++i) many.push_back(1 + (i * 37) % 61);
  const std::vector<int64_t> mixed = {1, 3, 4, 5, 1031, 7, 4096, 2, 9000, 13};
  const std::vector<int64_t> big = {20001, 3, 70000};
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    for (bool master : {false, true}) {
      if (dt == DType::F32 && master) continue;
      test_adamw(dt, master, many, 16, false, rng);   // > 32 tensors: several tables, hundreds of chunks
      test_adamw(dt, master, mixed, 256, true, rng);  // big tensors of many chunks each
      if (master && dt != DType::F32) {               // fp32 grads of 16-bit params (fp32 gradient buffers)
        test_adamw(dt, true, many, 16, false, rng, true);
        test_adamw(dt, true, mixed, 256, true, rng, true);
      }
    }
  }
  test_adamw(DType::F32, false, big, 65536, false, rng);  // the default chunk: 70000 crosses one boundary
  test_adamw(DType::F32, false, big, 300, true, rng);     // > 256 chunks within one tensor
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    test_lists(dt, many, 16, rng);
    test_lists(dt, mixed, 512, rng);
  }
  test_lists(DType::F32, {70000, 1, 65536}, 65536, rng);
  return report();
}
