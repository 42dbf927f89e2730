// Optimizer family bindings: multi-tensor AdamW (adamw_), the non-finite grad check (multi_tensor_nonfinite_check_)
// and the multi-tensor L2 norm (multi_tensor_l2norm). Every list is one launch's worth of tensors: one device, one
// dtype (the Python layer groups a model's parameters by (device, dtype) before calling).
#include <atomic>
#include <string>
#include <vector>

#include "../optim/optim.h"
#include "common.h"

namespace megakernels {
namespace bindings {
namespace optim_ops {  // named, not anonymous: csrc/bindings/all.cpp compiles every family in one unit

// The CUDA launchers of adamw_cuda.cu, as built by nvcc or for the emulator.
struct OptimKernels {
  const char* (*adamw)(const optim::AdamWArgs&, void*);
  const char* (*nonfinite_check)(const optim::ListArgs&, const float*, float*, void*);
  int64_t (*l2norm_workspace_floats)(const optim::ListArgs&);
  const char* (*l2norm)(const optim::ListArgs&, float*, float*, void*);
};
#define MK_OPTIM_KERNELS(ns) \
  OptimKernels { &ns::adamw, &ns::nonfinite_check, &ns::l2norm_workspace_floats, &ns::l2norm }

const OptimKernels* kernels_for(const at::Tensor& x, bool emulate) {
  static const OptimKernels* cuda_table = MK_IF_CUDA(new OptimKernels(MK_OPTIM_KERNELS(cuda)));
  static const OptimKernels* emu_table = MK_IF_EMU(new OptimKernels(MK_OPTIM_KERNELS(cuda_emu)));
  return select_kernels(x, emulate, cuda_table, emu_table);
}

int64_t chunk_or_default(const char* op, int64_t chunk_size) {
  TORCH_CHECK_VALUE(chunk_size >= 0, op, ": chunk_size must be >= 0 (0 = default), got ", chunk_size);
  return chunk_size == 0 ? optim::kDefaultChunk : chunk_size;
}

// A tensor list's element type: float32, float16 or bfloat16, the same for every tensor; no sparse or complex.
void check_list_tensor(const char* op, const char* list, size_t i, const at::Tensor& t, const at::Tensor& first) {
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": ", list, "[", i, "] is ", t.layout(),
                    "; sparse tensors are not supported");
  TORCH_CHECK_TYPE(!t.is_complex(), op, ": ", list, "[", i, "] is complex (", t.scalar_type(),
                   "); view complex params as real (torch.view_as_real) or use torch.optim.AdamW");
  const auto s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kFloat || s == at::kHalf || s == at::kBFloat16, op, ": ", list, "[", i, "] has dtype ", s,
                   "; expected float32, float16 or bfloat16");
  TORCH_CHECK_TYPE(s == first.scalar_type(), op, ": ", list, "[", i, "] has dtype ", s, " but ", list, "[0] has dtype ",
                   first.scalar_type(), "; one launch takes one dtype");
  TORCH_CHECK_VALUE(t.device() == first.device(), op, ": ", list, "[", i, "] is on ", t.device(), " but ", list,
                    "[0] is on ", first.device(), "; one launch takes one device");
}

// A per-parameter companion (grad, moment, master): the param's shape and device, the given dtype.
void check_companion(const char* op, const char* list, size_t i, const at::Tensor& t, const at::Tensor& param,
                     at::ScalarType dtype, bool need_contiguous) {
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": ", list, "[", i, "] is ", t.layout(),
                    "; sparse tensors are not supported");
  TORCH_CHECK_VALUE(t.sizes() == param.sizes(), op, ": ", list, "[", i, "] has shape ", t.sizes(), " but params[", i,
                    "] has shape ", param.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": ", list, "[", i, "] has dtype ", t.scalar_type(), ", expected ",
                   dtype);
  TORCH_CHECK_VALUE(t.device() == param.device(), op, ": ", list, "[", i, "] is on ", t.device(), " but params[", i,
                    "] is on ", param.device());
  TORCH_CHECK_VALUE(!need_contiguous || t.is_contiguous(), op, ": ", list, "[", i,
                    "] must be contiguous (it is updated in place)");
}

// A float32 scalar (one element) on `device`.
void check_scalar(const char* op, const char* name, const at::Tensor& t, const at::Device& device) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": ", name, " has dtype ", t.scalar_type(),
                   "; expected a float32 scalar tensor");
  TORCH_CHECK_VALUE(t.numel() == 1, op, ": ", name, " has ", t.numel(), " elements; expected one");
  TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), " but the tensors are on ", device);
}

void check_hyper(const char* op, double lr, double beta1, double beta2, double eps, double weight_decay) {
  TORCH_CHECK_VALUE(std::isfinite(lr) && lr >= 0.0, op, ": lr must be a finite number >= 0, got ", lr);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, op, ": betas[0] must be in [0, 1), got ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, op, ": betas[1] must be in [0, 1), got ", beta2);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0, op, ": eps must be a finite number >= 0, got ", eps);
  TORCH_CHECK_VALUE(std::isfinite(weight_decay) && weight_decay >= 0.0, op,
                    ": weight_decay must be a finite number >= 0, got ", weight_decay);
}

// (tensor, begin, end) of every chunk of a list, in order: the CPU kernels' units of work.
struct Chunk {
  int64_t t, begin, end;
};
template <typename NumelOf>
std::vector<Chunk> chunk_list(int64_t n, int64_t chunk_size, NumelOf numel_of) {
  std::vector<Chunk> out;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t numel = numel_of(t);
    for (int64_t b = 0; b < numel; b += chunk_size) out.push_back({t, b, std::min(numel, b + chunk_size)});
  }
  return out;
}

// Runs fn(c) for every chunk c in [0, n) on torch's intra-op threads, handing chunks out one at a time from a
// shared counter rather than in fixed per-thread ranges: a thread that is descheduled (a busy machine, a data
// loader competing for cores) delays only the chunk it holds, not a whole share of the step. Results do not
// depend on which thread ran a chunk.
template <typename Fn>
void for_each_chunk(int64_t n, const Fn& fn) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < n;
         c = next.fetch_add(1, std::memory_order_relaxed))
      fn(c);
  });
}

void adamw_(at::TensorList params, at::TensorList grads_in, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
            at::TensorList master_params, at::TensorList steps, double lr, double beta1, double beta2, double eps,
            double weight_decay, const c10::optional<at::Tensor>& grad_scale,
            const c10::optional<at::Tensor>& found_inf, int64_t chunk_size, bool emulate) {
  const char* op = "adamw";
  check_hyper(op, lr, beta1, beta2, eps, weight_decay);
  const size_t n = params.size();
  if (n == 0) return;
  const bool master = !master_params.empty();
  auto same_len = [&](const char* name, size_t len) {
    TORCH_CHECK_VALUE(len == n, op, ": ", name, " has ", len, " tensors but params has ", n);
  };
  same_len("grads", grads_in.size());
  same_len("exp_avgs", exp_avgs.size());
  same_len("exp_avg_sqs", exp_avg_sqs.size());
  same_len("steps", steps.size());
  if (master) same_len("master_params", master_params.size());
  const at::Tensor& p0 = params[0];
  check_backend(op, p0, emulate);
  const at::ScalarType pdt = p0.scalar_type();
  const at::ScalarType sdt = master ? at::kFloat : pdt;
  // grads in the params' dtype; in master mode fp32 grads too (all of them: grads[0] decides)
  const at::ScalarType gdt = master && grads_in[0].scalar_type() == at::kFloat ? at::kFloat : pdt;
  std::vector<at::Tensor> grads;
  grads.reserve(n);
  std::vector<optim::AdamWTensor> tensors(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    check_list_tensor(op, "params", i, p, p0);
    TORCH_CHECK_VALUE(p.is_contiguous(), op, ": params[", i, "] must be contiguous (it is updated in place)");
    check_companion(op, "grads", i, grads_in[i], p, gdt, false);
    check_companion(op, "exp_avgs", i, exp_avgs[i], p, sdt, true);
    check_companion(op, "exp_avg_sqs", i, exp_avg_sqs[i], p, sdt, true);
    if (master) check_companion(op, "master_params", i, master_params[i], p, at::kFloat, true);
    check_scalar(op, ("steps[" + std::to_string(i) + "]").c_str(), steps[i], p.device());
    grads.push_back(grads_in[i].contiguous());
    optim::AdamWTensor& t = tensors[i];
    t.param = p.data_ptr();
    t.grad = grads.back().data_ptr();
    t.exp_avg = exp_avgs[i].data_ptr();
    t.exp_avg_sq = exp_avg_sqs[i].data_ptr();
    t.master = master ? master_params[i].data_ptr<float>() : nullptr;
    t.step = steps[i].data_ptr<float>();
    t.numel = p.numel();
  }
  if (grad_scale.has_value()) check_scalar(op, "grad_scale", *grad_scale, p0.device());
  if (found_inf.has_value()) check_scalar(op, "found_inf", *found_inf, p0.device());

  optim::AdamWArgs a{};
  a.tensors = tensors.data();
  a.n_tensors = int64_t(n);
  a.param_dtype = to_dtype(pdt);
  a.master = master;
  a.grad_f32 = master && gdt == at::kFloat && pdt != at::kFloat;
  a.lr = lr;
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.eps = eps;
  a.weight_decay = weight_decay;
  a.grad_scale = grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr;
  a.found_inf = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
  a.chunk_size = chunk_or_default(op, chunk_size);
  if (const OptimKernels* k = kernels_for(p0, emulate)) {
    LaunchScope scope(p0);
    raise_if(op, k->adamw(a, scope.stream()));
  } else {
    if (a.found_inf && *a.found_inf != 0.0f) return;
    const std::vector<Chunk> chunks =
        chunk_list(a.n_tensors, a.chunk_size, [&](int64_t t) { return tensors[t].numel; });
    for_each_chunk(int64_t(chunks.size()),
                   [&](int64_t c) { MK_CPU(adamw_range)(a, chunks[c].t, chunks[c].begin, chunks[c].end); });
    for (size_t i = 0; i < n; ++i) *steps[i].data_ptr<float>() += 1.0f;
  }
}

// Checks shared by the list ops; returns the contiguous tensors and fills the torch-free description.
std::vector<at::Tensor> list_args(const char* op, at::TensorList tensors_in, int64_t chunk_size, bool emulate,
                                  optim::ListArgs& a, std::vector<const void*>& ptrs, std::vector<int64_t>& numels) {
  const at::Tensor& t0 = tensors_in[0];
  check_backend(op, t0, emulate);
  std::vector<at::Tensor> tensors;
  tensors.reserve(tensors_in.size());
  for (size_t i = 0; i < tensors_in.size(); ++i) {
    check_list_tensor(op, "tensors", i, tensors_in[i], t0);
    tensors.push_back(tensors_in[i].contiguous());
    ptrs.push_back(tensors.back().data_ptr());
    numels.push_back(tensors.back().numel());
  }
  a.tensors = ptrs.data();
  a.numels = numels.data();
  a.n_tensors = int64_t(tensors.size());
  a.dtype = to_dtype(t0.scalar_type());
  a.chunk_size = chunk_or_default(op, chunk_size);
  return tensors;
}

void multi_tensor_nonfinite_check_(at::TensorList tensors_in, const c10::optional<at::Tensor>& grad_scale,
                                   const at::Tensor& found_inf, int64_t chunk_size, bool emulate) {
  const char* op = "multi_tensor_nonfinite_check";
  if (tensors_in.empty()) return;
  optim::ListArgs a{};
  std::vector<const void*> ptrs;
  std::vector<int64_t> numels;
  const auto tensors = list_args(op, tensors_in, chunk_size, emulate, a, ptrs, numels);
  const at::Device dev = tensors_in[0].device();
  check_scalar(op, "found_inf", found_inf, dev);
  TORCH_CHECK_VALUE(found_inf.is_contiguous(), op, ": found_inf must be contiguous");
  if (grad_scale.has_value()) check_scalar(op, "grad_scale", *grad_scale, dev);
  const float* scale = grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr;
  float* flag = found_inf.data_ptr<float>();
  if (const OptimKernels* k = kernels_for(tensors_in[0], emulate)) {
    LaunchScope scope(tensors_in[0]);
    raise_if(op, k->nonfinite_check(a, scale, flag, scope.stream()));
  } else {
    const std::vector<Chunk> chunks = chunk_list(a.n_tensors, a.chunk_size, [&](int64_t t) { return numels[t]; });
    std::vector<char> bad(chunks.size(), 0);
    for_each_chunk(int64_t(chunks.size()), [&](int64_t c) {
      bad[c] = MK_CPU(nonfinite_range)(a, scale, chunks[c].t, chunks[c].begin, chunks[c].end);
    });
    for (char x : bad)
      if (x) *flag = 1.0f;
  }
}

at::Tensor multi_tensor_l2norm(at::TensorList tensors_in, int64_t chunk_size, bool emulate) {
  const char* op = "multi_tensor_l2norm";
  TORCH_CHECK_VALUE(!tensors_in.empty(), op, ": tensors is empty");
  optim::ListArgs a{};
  std::vector<const void*> ptrs;
  std::vector<int64_t> numels;
  const auto tensors = list_args(op, tensors_in, chunk_size, emulate, a, ptrs, numels);
  const at::Tensor& t0 = tensors_in[0];
  at::Tensor out = at::zeros({}, t0.options().dtype(at::kFloat));
  if (const OptimKernels* k = kernels_for(t0, emulate)) {
    LaunchScope scope(t0);
    at::Tensor ws = at::empty({std::max<int64_t>(1, k->l2norm_workspace_floats(a))}, out.options());
    raise_if(op, k->l2norm(a, ws.data_ptr<float>(), out.data_ptr<float>(), scope.stream()));
  } else {
    const std::vector<Chunk> chunks = chunk_list(a.n_tensors, a.chunk_size, [&](int64_t t) { return numels[t]; });
    std::vector<float> partial(chunks.size(), 0.0f);
    for_each_chunk(int64_t(chunks.size()), [&](int64_t c) {
      partial[c] = MK_CPU(sumsq_range)(a, chunks[c].t, chunks[c].begin, chunks[c].end);
    });
    double s = 0.0;  // chunk order, independent of the thread count
    for (float p : partial) s += p;
    *out.data_ptr<float>() = float(std::sqrt(s));
  }
  return out;
}

}  // namespace optim_ops
}  // namespace bindings
}  // namespace megakernels

TORCH_LIBRARY_FRAGMENT(megakernels, m) {
  m.def(
      "adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs,"
      " Tensor(d!)[] master_params, Tensor(e!)[] steps, float lr, float beta1, float beta2, float eps,"
      " float weight_decay, Tensor? grad_scale, Tensor? found_inf, int chunk_size, bool emulate) -> ()");
  m.def(
      "multi_tensor_nonfinite_check_(Tensor[] tensors, Tensor? grad_scale, Tensor(a!) found_inf, int chunk_size,"
      " bool emulate) -> ()");
  m.def("multi_tensor_l2norm(Tensor[] tensors, int chunk_size, bool emulate) -> Tensor");
}

TORCH_LIBRARY_IMPL(megakernels, CPU, m) {
  m.impl("adamw_", &megakernels::bindings::optim_ops::adamw_);
  m.impl("multi_tensor_nonfinite_check_", &megakernels::bindings::optim_ops::multi_tensor_nonfinite_check_);
  m.impl("multi_tensor_l2norm", &megakernels::bindings::optim_ops::multi_tensor_l2norm);
}

#ifdef MEGAKERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(megakernels, CUDA, m) {
  m.impl("adamw_", &megakernels::bindings::optim_ops::adamw_);
  m.impl("multi_tensor_nonfinite_check_", &megakernels::bindings::optim_ops::multi_tensor_nonfinite_check_);
  m.impl("multi_tensor_l2norm", &megakernels::bindings::optim_ops::multi_tensor_l2norm);
}
#endif
