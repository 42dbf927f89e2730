"""Bad input to FusedAdamW and the multi-tensor ops: clear errors that name the argument, never a crash."""

from __future__ import annotations

import pytest
import torch

from megakernels.ops import multi_tensor as mt
from megakernels.optim import FusedAdamW, multi_tensor_l2norm


def p(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype, requires_grad=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": -1e-3}, "lr must be"),
        ({"eps": -1.0}, "eps must be"),
        ({"weight_decay": -0.1}, "weight_decay must be"),
        ({"betas": (1.0, 0.999)}, r"betas\[0\] must be in \[0, 1\)"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\] must be in \[0, 1\)"),
        ({"betas": (0.9,)}, "betas must be a pair"),
    ],
)
def test_bad_hyperparameters_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedAdamW([p(3)], **kwargs)


def test_bad_hyperparameters_in_a_param_group_are_rejected():
    with pytest.raises(ValueError, match="lr must be"):
        FusedAdamW([{"params": [p(3)]}, {"params": [p(2)], "lr": -1.0}])


def test_tensor_lr_is_rejected_with_a_clear_error():
    with pytest.raises(TypeError, match="tensor lr"):
        FusedAdamW([p(3)], lr=torch.tensor(1e-3))


def test_complex_params_are_rejected():
    with pytest.raises(TypeError, match="complex"):
        FusedAdamW([torch.zeros(3, dtype=torch.complex64, requires_grad=True)])


def test_float64_params_are_rejected():
    with pytest.raises(TypeError, match="float64"):
        FusedAdamW([p(3, dtype=torch.float64)])


def test_sparse_grads_are_rejected():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = FusedAdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradient"):
        opt.step()


def test_amsgrad_group_from_a_torch_state_dict_is_rejected():
    params = [p(3)]
    opt = FusedAdamW(params)
    opt.load_state_dict(torch.optim.AdamW([p(3)], amsgrad=True).state_dict())
    params[0].grad = torch.ones(3)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        opt.step()


def kernel_lists(params, dtype=None):
    dtype = dtype or params[0].dtype
    grads = [torch.ones_like(x) for x in params]
    moments = [torch.zeros_like(x, dtype=dtype) for x in params]
    moments2 = [torch.zeros_like(x, dtype=dtype) for x in params]
    steps = [torch.zeros(()) for _ in params]
    return grads, moments, moments2, steps


HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


def test_kernel_rejects_mixed_dtypes_in_one_launch():
    params = [torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16)]
    grads, m, v, steps = kernel_lists(params)
    with pytest.raises(TypeError, match=r"params\[1\] has dtype BFloat16 but params\[0\] has dtype Float"):
        mt.adamw_(params, grads, m, v, [], steps, **HYPER)


def test_kernel_rejects_mismatched_shapes_and_state_dtypes():
    params = [torch.zeros(3), torch.zeros(4)]
    grads, m, v, steps = kernel_lists(params)
    grads[1] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"grads\[1\] has shape \[5\] but params\[1\] has shape \[4\]"):
        mt.adamw_(params, grads, m, v, [], steps, **HYPER)
    grads, m, v, steps = kernel_lists(params)
    m[0] = m[0].to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"exp_avgs\[0\] has dtype BFloat16"):
        mt.adamw_(params, grads, m, v, [], steps, **HYPER)


def test_kernel_takes_fp32_grads_of_16_bit_params_only_with_masters_and_all_of_them():
    params = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)]
    grads, m, v, steps = kernel_lists(params, torch.float32)
    masters = [x.float() for x in params]
    fp32 = [g.float() for g in grads]
    mt.adamw_(params, fp32, m, v, masters, steps, **HYPER)  # accepted: master mode, every grad fp32
    with pytest.raises(TypeError, match=r"grads\[0\] has dtype Float, expected BFloat16"):
        mt.adamw_(params, fp32, *kernel_lists(params)[1:3], [], steps, **HYPER)  # no masters: grads in param dtype
    with pytest.raises(TypeError, match=r"grads\[1\] has dtype BFloat16, expected Float"):
        mt.adamw_(params, [fp32[0], grads[1]], m, v, masters, steps, **HYPER)  # one launch, one grad dtype


def test_kernel_rejects_list_length_mismatch_and_bad_steps():
    params = [torch.zeros(3), torch.zeros(4)]
    grads, m, v, steps = kernel_lists(params)
    with pytest.raises(ValueError, match="exp_avg_sqs has 1 tensors but params has 2"):
        mt.adamw_(params, grads, m, v[:1], [], steps, **HYPER)
    steps[1] = torch.zeros((), dtype=torch.float64)
    with pytest.raises(TypeError, match=r"steps\[1\] has dtype Double"):
        mt.adamw_(params, grads, m, v, [], steps, **HYPER)


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("lr", -1.0, "lr must be"),
        ("eps", -1.0, "eps must be"),
        ("weight_decay", -1.0, "weight_decay must be"),
        ("beta1", 1.0, r"betas\[0\]"),
        ("beta2", 1.5, r"betas\[1\]"),
    ],
)
def test_kernel_rejects_bad_hyperparameters(name, value, match):
    params = [torch.zeros(3)]
    grads, m, v, steps = kernel_lists(params)
    with pytest.raises(ValueError, match=match):
        mt.adamw_(params, grads, m, v, [], steps, **{**HYPER, name: value})


def test_kernel_rejects_non_contiguous_params():
    params = [torch.zeros(4, 3).t()]
    grads, m, v, steps = kernel_lists(params)
    with pytest.raises(ValueError, match=r"params\[0\] must be contiguous"):
        mt.adamw_(params, grads, [x.contiguous() for x in m], [x.contiguous() for x in v], [], steps, **HYPER)


def test_l2norm_rejects_bad_tensors():
    with pytest.raises(TypeError, match=r"tensors\[1\] has dtype torch.int64"):
        multi_tensor_l2norm([torch.zeros(3), torch.zeros(3, dtype=torch.long)])
    with pytest.raises(TypeError, match=r"tensors\[0\] is complex"):
        multi_tensor_l2norm([torch.zeros(3, dtype=torch.complex64)])
    with pytest.raises(TypeError, match=r"tensors\[0\] must be a torch.Tensor"):
        multi_tensor_l2norm([3.0])


def test_found_inf_must_be_a_float32_scalar():
    params = [p(3)]
    opt = FusedAdamW(params)
    params[0].grad = torch.ones(3)
    with pytest.raises(TypeError, match="found_inf must be a float32 tensor"):
        opt.step(found_inf=torch.zeros(2))


def test_bad_params_added_later_are_rejected():
    opt = FusedAdamW([p(3)])
    with pytest.raises(TypeError, match="complex"):
        opt.add_param_group({"params": [torch.zeros(2, dtype=torch.complex64, requires_grad=True)]})


def _saved_state(step):
    param = p(4)
    opt = FusedAdamW([param])
    param.grad = torch.ones(4)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["step"] = step
    return sd


@pytest.mark.parametrize(
    "step, exc",
    [
        ("abc", TypeError),
        (None, TypeError),
        (-1.0, ValueError),
        (float("nan"), ValueError),
        (torch.tensor([1.0, 2.0]), ValueError),
        (torch.tensor(True), ValueError),
        (torch.zeros((), device="meta"), ValueError),
    ],
)
def test_bad_step_in_a_loaded_state_is_refused_naming_it_and_nothing_changes(step, exc):
    param = p(4)
    opt = FusedAdamW([param])
    with pytest.raises(exc, match=r"FusedAdamW.load_state_dict: state\[0\]\['step'\] must be"):
        opt.load_state_dict(_saved_state(step))
    assert len(opt.state) == 0  # refused before anything was loaded


@pytest.mark.parametrize("step", [3, 3.0, torch.tensor(3.0), torch.tensor([3.0]), torch.tensor(3, dtype=torch.int64)])
def test_a_step_given_as_number_or_one_element_tensor_loads(step):
    opt = FusedAdamW([p(4)])
    opt.load_state_dict(_saved_state(step))
    (state,) = opt.state.values()
    assert state["step"].dtype == torch.float32 and state["step"].shape == () and float(state["step"]) == 3.0
