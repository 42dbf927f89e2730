"""Device, layout and option rules shared by every op (megakernels/ops/_checks.py): tensors on one device (meta
with meta is fine), dense layouts only, and errors that name the argument."""

from __future__ import annotations

import pytest
import torch

from megakernels import ops
from megakernels.optim import multi_tensor_l2norm


def _norm_args():
    return {"x": torch.randn(3, 8), "weight": torch.randn(8), "bias": torch.randn(8)}


# op -> (callable taking keyword tensors, a function making good keyword tensors)
OPS = {
    "layer_norm": (lambda **t: ops.layer_norm(t["x"], t["weight"], t["bias"]), _norm_args),
    "rms_norm": (
        lambda **t: ops.rms_norm(t["x"], t["weight"]),
        lambda: {k: v for k, v in _norm_args().items() if k != "bias"},
    ),
    "bias_gelu": (
        lambda **t: ops.bias_gelu(t["x"], t["bias"]),
        lambda: {k: v for k, v in _norm_args().items() if k != "weight"},
    ),
    "scaled_softmax": (lambda **t: ops.scaled_softmax(t["x"], 0.5), lambda: {"x": torch.randn(2, 2, 3, 5)}),
    "scaled_causal_softmax": (
        lambda **t: ops.scaled_causal_softmax(t["x"], 0.5),
        lambda: {"x": torch.randn(2, 2, 3, 5)},
    ),
    "scaled_masked_softmax": (
        lambda **t: ops.scaled_masked_softmax(t["x"], t["mask"], 0.5),
        lambda: {"x": torch.randn(2, 2, 3, 5), "mask": torch.rand(2, 1, 3, 5) > 0.5},
    ),
    "flash_attention": (
        lambda **t: ops.flash_attention(t["q"], t["k"], t["v"], causal=True),
        lambda: {"q": torch.randn(1, 4, 4, 8), "k": torch.randn(1, 6, 2, 8), "v": torch.randn(1, 6, 2, 8)},
    ),
    "cross_entropy": (
        lambda **t: ops.cross_entropy(t["logits"], t["target"]),
        lambda: {"logits": torch.randn(5, 11), "target": torch.tensor([0, 3, 10, -100, 7])},
    ),
    "linear_cross_entropy": (
        lambda **t: ops.linear_cross_entropy(t["hidden"], t["weight"], t["target"], bias=t["bias"], chunk_tokens=2),
        lambda: {
            "hidden": torch.randn(5, 8),
            "weight": torch.randn(11, 8),
            "target": torch.tensor([0, 3, 10, -100, 7]),
            "bias": torch.randn(11),
        },
    ),
}
ARGS = [(op, arg) for op, (_, make) in OPS.items() for arg in make()]


@pytest.mark.parametrize("op, arg", [(o, a) for o, a in ARGS if len(OPS[o][1]()) > 1], ids=str)
def test_a_tensor_alone_on_meta_is_refused_naming_it(op, arg):
    fn, make = OPS[op]
    t = make()
    t[arg] = t[arg].to("meta")
    with pytest.raises(ValueError, match=rf"{op}: .*\b{arg}\b.* on meta.*one device|{op}: {arg} is on meta"):
        fn(**t)


@pytest.mark.parametrize("op", OPS)
def test_every_tensor_on_meta_gives_meta_results_of_the_real_shape(op):
    fn, make = OPS[op]
    t = make()
    real = fn(**t)
    meta = fn(**{k: v.to("meta") for k, v in t.items()})
    assert meta.device.type == "meta" and meta.shape == real.shape and meta.dtype == real.dtype


# COO for every argument; CSR (beta in torch) where the argument is 2-D, as CSR needs.
LAYOUTS = [(op, arg, "sparse_coo") for op, arg in ARGS] + [
    (op, arg, "sparse_csr") for op, arg in ARGS if OPS[op][1]()[arg].dim() == 2
]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("op, arg, layout", LAYOUTS, ids=str)
def test_sparse_tensors_are_refused_naming_argument_and_layout(op, arg, layout):
    fn, make = OPS[op]
    t = make()
    t[arg] = t[arg].to_sparse_csr() if layout == "sparse_csr" else t[arg].to_sparse()
    with pytest.raises(ValueError, match=rf"{op}: {arg} is a torch.{layout} tensor; only dense"):
        fn(**t)


@pytest.mark.parametrize("group", ["world", 3, object()])
def test_cross_entropy_group_that_is_not_a_process_group_is_a_type_error(group):
    with pytest.raises(TypeError, match="cross_entropy: group must be a torch.distributed ProcessGroup or None"):
        ops.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), group=group)


def test_linear_cross_entropy_on_meta_gives_a_meta_loss_and_gradients():
    hidden = torch.randn(4, 6, 8, device="meta", requires_grad=True)
    weight = torch.randn(10, 8, device="meta", requires_grad=True)
    target = torch.empty(4, 6, dtype=torch.int64, device="meta")
    loss = ops.linear_cross_entropy(hidden, weight, target, label_smoothing=0.1, chunk_tokens=5)
    assert loss.device.type == "meta" and loss.shape == (4, 6)
    loss.sum().backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape


def test_cross_entropy_on_meta_gives_a_meta_loss_and_gradient():
    logits = torch.randn(4, 6, 10, device="meta", requires_grad=True)
    loss = ops.cross_entropy(logits, torch.empty(4, 6, dtype=torch.int64, device="meta"), label_smoothing=0.1)
    assert loss.device.type == "meta" and loss.shape == (4, 6)
    loss.sum().backward()
    assert logits.grad.device.type == "meta" and logits.grad.shape == logits.shape


@pytest.mark.parametrize(
    "value, exc",
    [(None, TypeError), ("1e-5", TypeError), (True, TypeError), (-1.0, ValueError), (float("inf"), ValueError)],
)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_eps_must_be_a_finite_number_at_least_zero(op, value, exc):
    with pytest.raises(exc, match=f"{op}: eps must be"):
        getattr(ops, op)(torch.randn(2, 4), eps=value)


@pytest.mark.parametrize("value", [1.5, "x", None])
def test_cross_entropy_ignore_index_must_be_an_int(value):
    with pytest.raises(TypeError, match="cross_entropy: ignore_index must be an int"):
        ops.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), ignore_index=value)


def test_l2norm_refuses_meta_mixed_with_real_tensors_and_takes_all_meta():
    with pytest.raises(ValueError, match=r"multi_tensor_l2norm: tensors\[1\] is on meta but tensors\[0\] is on cpu"):
        multi_tensor_l2norm([torch.ones(3), torch.ones(3, device="meta")])
    assert multi_tensor_l2norm([torch.ones(3, device="meta")] * 2).device.type == "meta"


def test_raw_ops_refuse_meta_mixed_with_cpu_too():
    # The dispatcher sends any call with a meta argument to the fake implementation: it must check as well.
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="layer_norm: weight is on meta but x is on cpu"):
        torch.ops.megakernels.norm_fwd(x, torch.ones(4, device="meta"), None, 1e-5, 0, False, False)
    with pytest.raises(ValueError, match=r"adamw: grads\[0\] is on meta but params\[0\] is on cpu"):
        p = torch.zeros(4)
        torch.ops.megakernels.adamw_(
            [p],
            [torch.zeros(4, device="meta")],
            [torch.zeros(4)],
            [torch.zeros(4)],
            [],
            [torch.zeros(())],
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.0,
            None,
            None,
            0,
            False,
        )


def test_grouped_gemm_refuses_meta_group_sizes_for_real_tensors():
    from megakernels.ops.grouped_gemm import grouped_gemm

    with pytest.raises(ValueError, match="grouped_gemm: group_sizes is on meta but x is on cpu"):
        grouped_gemm(torch.randn(5, 4), torch.randn(2, 3, 4), torch.tensor([2, 3], device="meta"))
    out = grouped_gemm(
        torch.randn(5, 4, device="meta"), torch.randn(2, 3, 4, device="meta"), torch.tensor([2, 3], device="meta")
    )
    assert out.device.type == "meta" and out.shape == (5, 3)
