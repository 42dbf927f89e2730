"""Bad input to fused_rope and swiglu: a clear exception naming the argument and the rule, never a crash or a wrong
answer."""

from __future__ import annotations

import pytest
import torch

from megakernels.ops import fused_rope, rope_cos_sin_table, swiglu


def qk(d=8, hq=2, hk=1, b=2, s=3, dtype=torch.float32, device="cpu"):
    return torch.randn(b, s, hq, d, dtype=dtype, device=device), torch.randn(b, s, hk, d, dtype=dtype, device=device)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda d: fused_rope(*qk(d=7, device=d)), ValueError, r"fused_rope: head_dim \(q's last dim\) must be even"),
        (
            lambda d: fused_rope(qk(device=d)[0], qk(d=16, device=d)[1]),
            ValueError,
            "k has head_dim 16 but q has head_dim 8",
        ),
        (lambda d: fused_rope(qk(device=d)[0], qk(s=4, device=d)[1]), ValueError, "their first two dims"),
        (lambda d: fused_rope(qk(device=d)[0][0], qk(device=d)[1]), ValueError, "q has shape"),
        (lambda d: fused_rope(qk(device=d)[0], qk(device=d)[1].half()), TypeError, "k has dtype"),
        (lambda d: fused_rope(*(t.int() for t in qk(device=d))), TypeError, "q has dtype"),
        (lambda d: fused_rope(qk(device=d)[0].tolist(), qk(device=d)[1]), TypeError, "q must be a torch.Tensor"),
        (
            lambda d: fused_rope(*qk(device=d), torch.tensor([0.0, 1.0, 2.0], device=d)),
            TypeError,
            "positions has dtype",
        ),
        (lambda d: fused_rope(*qk(device=d), torch.arange(4, device=d)), ValueError, r"positions has shape \[4\]"),
        (lambda d: fused_rope(*qk(device=d), torch.arange(3)[None].to(d)), ValueError, "positions has shape"),
        (lambda d: fused_rope(*qk(device=d), seq_dim=2), ValueError, "seq_dim must be 0"),
        (lambda d: fused_rope(*qk(device=d), seq_dim=1.0), TypeError, "seq_dim must be an int"),
        (lambda d: fused_rope(*qk(device=d), theta=0.0), ValueError, "theta must be a finite number > 0"),
        (lambda d: fused_rope(*qk(device=d), theta=float("nan")), ValueError, "theta must be a finite number"),
        (lambda d: fused_rope(*qk(device=d), theta=None), TypeError, "theta must be a real number"),
        (lambda d: fused_rope(*qk(device=d), position_offset=1.5), TypeError, "position_offset must be an int"),
        (lambda d: fused_rope(*qk(device=d), interleaved="yes"), TypeError, "interleaved must be a bool"),
        (
            lambda d: fused_rope(*qk(device=d), cos_sin=torch.zeros(8, 4, 2, dtype=torch.float64, device=d)),
            TypeError,
            "cos_sin has dtype",
        ),
        (lambda d: fused_rope(*qk(device=d), cos_sin=torch.zeros(8, 3, 2, device=d)), ValueError, "cos_sin has shape"),
        (
            lambda d: fused_rope(*qk(device=d), cos_sin=rope_cos_sin_table(2, 8, device=d)),
            ValueError,
            r"positions \[0, 3\) .* outside the cos_sin table's 2 rows",
        ),
        (
            lambda d: fused_rope(
                *qk(device=d), torch.tensor([0, 5, 1], device=d), cos_sin=rope_cos_sin_table(4, 8, device=d)
            ),
            ValueError,
            "reaches 5, outside the cos_sin table's 4 rows",
        ),
        (
            lambda d: fused_rope(*qk(device=d), position_offset=-1, cos_sin=rope_cos_sin_table(8, 8, device=d)),
            ValueError,
            "outside the cos_sin table",
        ),
        (
            lambda d: fused_rope(*qk(device=d), cos_sin=rope_cos_sin_table(8, 8, device=d).requires_grad_(True)),
            ValueError,
            "cos_sin requires grad",
        ),
        (lambda d: swiglu(torch.randn(3, 5, device=d)), ValueError, "swiglu: x's last dim is 5; expected an even size"),
        (lambda d: swiglu(torch.tensor(1.0, device=d)), ValueError, "swiglu: x must have at least 1 dimension"),
        (lambda d: swiglu(torch.ones(2, 4, dtype=torch.int64, device=d)), TypeError, "swiglu: x has dtype"),
        (lambda d: swiglu([1.0, 2.0]), TypeError, "swiglu: x must be a torch.Tensor"),
    ],
)
def test_bad_input_raises_naming_the_argument(backend, call, exc, match):
    with pytest.raises(exc, match=match):
        call(backend.device)


def test_meta_mixed_with_cpu_is_refused_and_all_meta_traces():
    q, k = qk()
    with pytest.raises(ValueError, match="fused_rope: k is on meta but q is on cpu"):
        fused_rope(q, k.to("meta"))
    with pytest.raises(ValueError, match="fused_rope: positions is on meta but q is on cpu"):
        fused_rope(q, k, torch.arange(3, device="meta"))
    out = fused_rope(q.to("meta"), k.to("meta"), torch.arange(3, device="meta"))
    assert [t.device.type for t in out] == ["meta", "meta"] and out[1].shape == k.shape
    assert swiglu(torch.empty(2, 6, device="meta")).shape == (2, 3)
    with pytest.raises(ValueError, match="swiglu: x has shape"):
        swiglu(torch.empty(2, 5, device="meta"))


@pytest.mark.parametrize("op", ["rope", "swiglu"])
def test_sparse_input_is_refused(op):
    with pytest.raises(ValueError, match="is a torch.sparse_coo tensor"):
        if op == "rope":
            q, k = qk()
            fused_rope(q.to_sparse(), k)
        else:
            swiglu(torch.randn(2, 4).to_sparse())


def test_backward_with_wrong_grad_shape_is_an_error():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"swiglu_backward: grad_output has shape \[3, 3\], expected \[3, 4\]"):
        torch.ops.megakernels.swiglu_bwd(torch.randn(3, 3), x, False)
    with pytest.raises(TypeError, match="swiglu_backward: grad_output has dtype"):
        torch.ops.megakernels.swiglu_bwd(torch.randn(3, 4).double(), x, False)


def test_cuda_backend_refuses_cpu_tensors():
    import megakernels

    with megakernels.backend("cuda"):
        with pytest.raises(ValueError, match="fused_rope: backend cuda requested, but q is on cpu"):
            fused_rope(*qk())
        with pytest.raises(ValueError, match="swiglu: backend cuda requested, but x is on cpu"):
            swiglu(torch.randn(2, 4))
