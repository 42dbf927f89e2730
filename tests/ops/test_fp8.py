"""The FP8 op family (megakernels/ops/fp8.py): power-of-two scales, bit-exact quantisation against a decoder-table
reference, the tiles of each granularity, FP8 GEMMs and the grouped GEMM against fp64, fp8_linear's gradients,
opcheck of every op, bad input named, and torchao's float8 linear (the peer for the tensorwise recipe) on the same
inputs."""

from __future__ import annotations

import math

import pytest
import torch

from megakernels.ops import fp8

FMTS = ("e4m3", "e5m2")


def _codes(fmt: str) -> torch.Tensor:
    """Every finite value of the format, decoded by torch from its 256 byte patterns (sorted, unique)."""
    vals = torch.arange(256, dtype=torch.uint8).view(fp8.FORMATS[fmt]).double()
    return torch.unique(vals[torch.isfinite(vals)])


def _nearest_even(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round ``y`` (float64, already within ±max) to the nearest value of the format, ties to the value whose
    encoding is even — computed from the decoded table, independently of torch's float8 cast."""
    table = _codes(fmt)
    idx = torch.searchsorted(table, y).clamp(1, len(table) - 1)
    lo, hi = table[idx - 1], table[idx]
    d_lo, d_hi = (y - lo).abs(), (hi - y).abs()
    even_hi = _is_even(hi, fmt)
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even_hi)
    return torch.where(pick_hi, hi, lo)


def _is_even(v: torch.Tensor, fmt: str) -> torch.Tensor:
    return (v.to(fp8.FORMATS[fmt]).view(torch.uint8) % 2) == 0


@pytest.mark.parametrize("fmt", FMTS)
def test_scales_are_the_smallest_power_of_two_that_fits(fmt):
    amax = torch.cat([torch.logspace(-20, 20, 2001, dtype=torch.float64), torch.tensor([448.0, 57344.0, 449.0])])
    s = fp8.pow2_scale(amax.float(), fmt).double()
    a = amax.float().double()
    mantissa, _ = torch.frexp(s)
    assert (mantissa == 0.5).all()  # a power of two
    assert (a / s <= fp8.FORMAT_MAX[fmt]).all()
    assert (a / (s / 2) > fp8.FORMAT_MAX[fmt]).all()  # and the smallest one
    edge = fp8.pow2_scale(torch.tensor([0.0, float("inf")]), fmt)
    assert edge[0] == 1.0 and math.isinf(edge[1])


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
def test_quantisation_is_bit_exact_round_to_nearest_even(fmt, granularity):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 300, generator=g) * torch.exp(3 * torch.randn(200, 1, generator=g))
    x[5, 130:200] = 0  # part of a tile zero
    x[140:, 256:] = 0  # a whole block (and the last row tiles) zero
    q, s, _, _ = fp8.fp8_quantize(x, fmt, granularity)
    # the scales: each tile's amax (an explicit loop over the tiles)
    tm, tk = (1, 128) if granularity == "row" else (128, 128) if granularity == "block" else (200, 300)
    for i in range(0, 200, tm):
        for j in range(0, 300, tk):
            amax = x[i : i + tm, j : j + tk].abs().max()
            want = fp8.pow2_scale(amax, fmt)
            got = s if granularity == "tensor" else s[i // tm, j // tk]
            assert got == want, (i, j)
    per_elem = fp8.expand_scale(s, granularity, x.shape).double()
    ref = _nearest_even((x.double() / per_elem).clamp(-fp8.FORMAT_MAX[fmt], fp8.FORMAT_MAX[fmt]), fmt)
    assert torch.equal(q.double(), ref)
    assert q.dtype == fp8.FORMATS[fmt]


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
def test_transposed_copy_is_the_transpose_quantised_in_its_own_tiles(granularity):
    x = torch.randn(150, 260).bfloat16() * torch.linspace(0.01, 100, 260).bfloat16()
    q, s, qt, st = fp8.fp8_quantize(x, "e4m3", granularity, transpose=True)
    q2, s2, _, _ = fp8.fp8_quantize(x.t().contiguous(), "e4m3", granularity)
    assert torch.equal(qt.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(st, s2)
    if granularity != "row":  # one scale or square blocks: the transpose of the copy
        assert torch.equal(qt.view(torch.uint8), q.t().contiguous().view(torch.uint8))


def test_given_scale_is_used():
    x = torch.randn(64, 64)
    q, s, _, _ = fp8.fp8_quantize(x, "e4m3", "tensor", torch.tensor(4.0))
    assert s == 4.0 and torch.equal(q.float(), (x / 4).to(torch.float8_e4m3fn).float())


def _deq(q, s, g):
    return q.double() * fp8.expand_scale(s, g, q.shape).double()


@pytest.mark.parametrize("a_gran,b_gran", [("tensor", "tensor"), ("row", "block"), ("row", "row"), ("row", "tensor")])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gemm_is_the_product_of_the_dequantised_operands(a_gran, b_gran, out_dtype):
    g = torch.Generator().manual_seed(2)
    a_x, b_x = torch.randn(70, 300, generator=g), torch.randn(190, 300, generator=g) * 5  # K = 2 tiles + 44
    a, sa, _, _ = fp8.fp8_quantize(a_x, "e4m3", a_gran)
    b, sb, _, _ = fp8.fp8_quantize(b_x, "e5m2" if a_gran == "tensor" else "e4m3", b_gran)
    y = fp8.fp8_gemm(a, sa, b, sb, a_granularity=a_gran, b_granularity=b_gran, out_dtype=out_dtype)
    ref = _deq(a, sa, a_gran) @ _deq(b, sb, b_gran).t()
    assert y.dtype == out_dtype and y.shape == (70, 190)
    tol = 1e-5 if out_dtype == torch.float32 else 8e-3
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("gran", [("tensor", "tensor"), ("row", "block")])
def test_grouped_gemm_matches_a_loop_of_gemms(gran):
    a_gran, b_gran = gran
    g = torch.Generator().manual_seed(3)
    sizes = torch.tensor([5, 0, 130, 7])
    x, w = torch.randn(142, 200, generator=g), torch.randn(4, 150, 200, generator=g)
    a, sa, _, _ = fp8.fp8_quantize(x, "e4m3", a_gran)
    qs = [fp8.fp8_quantize(w[e], "e4m3", b_gran) for e in range(4)]
    b, sb = torch.stack([q[0] for q in qs]), torch.stack([q[1] for q in qs])
    y = fp8.fp8_grouped_gemm(a, sa, b, sb, sizes, a_granularity=a_gran, b_granularity=b_gran, out_dtype=torch.float32)
    ad = _deq(a, sa, a_gran)
    start = 0
    for e, n in enumerate(sizes.tolist()):
        ref = ad[start : start + n] @ _deq(qs[e][0], qs[e][1], b_gran).t()
        torch.testing.assert_close(y[start : start + n].double(), ref, rtol=1e-5, atol=1e-4)
        start += n


@pytest.mark.parametrize("recipe", list(fp8.RECIPES))
def test_fp8_linear_forward_and_gradients(recipe):
    """Against fp64 products of the independently quantised operands: y = Q(x) Q(W)ᵀ, dx = Q(dy) Q(W) with dy in
    tiles along the output features, dW = Q(dyᵀ) Q(xᵀ) with both in tiles along the tokens."""
    rec = fp8.RECIPES[recipe]
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 90, 260, generator=g) * torch.exp(torch.randn(3, 90, 1, generator=g))).requires_grad_()
    w = (torch.randn(140, 260, generator=g) / 16).requires_grad_()
    b = torch.randn(140, generator=g).requires_grad_()
    dy = torch.randn(3, 90, 140, generator=g) * 1e-3
    y = fp8.fp8_linear(x, w, b, recipe=recipe)
    y.backward(dy)

    def q(t, fmt, gr):
        qt, s = fp8.quantize_reference(t, fmt, gr)
        return _deq(qt, s, gr)

    x2, dy2 = x.detach().reshape(-1, 260), dy.reshape(-1, 140)
    wq = q(w.detach(), rec.weight_format, rec.weight_granularity)
    y_ref = q(x2, rec.input_format, rec.input_granularity) @ wq.t() + b.detach().double()
    dx_ref = q(dy2, rec.grad_format, rec.grad_granularity) @ wq
    if recipe == "tensorwise":
        dw_ref = q(dy2, rec.grad_format, "tensor").t() @ q(x2, rec.input_format, "tensor")
    else:
        dw_ref = q(dy2.t(), rec.grad_format, "row") @ q(x2.t(), rec.input_format, "row").t()
    torch.testing.assert_close(y.detach().double().reshape(-1, 140), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double().reshape(-1, 260), dx_ref, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(w.grad.double(), dw_ref, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(b.grad, dy2.sum(0))
    # and the quantisation error is FP8's: a few percent of the fp64 product, not more
    exact = x2.double() @ w.detach().double().t() + b.detach().double()
    assert (y.detach().double().reshape(-1, 140) - exact).norm() / exact.norm() < 0.06


def _opcheck_args():
    x = torch.randn(40, 150)
    a, sa, _, _ = fp8.fp8_quantize(x, "e4m3", "row")
    b, sb, _, _ = fp8.fp8_quantize(torch.randn(130, 150), "e4m3", "block")
    bt, sbt, _, _ = fp8.fp8_quantize(torch.randn(130, 150), "e4m3", "tensor")
    sizes = torch.tensor([10, 0, 30])
    bg = torch.stack([b, b, b])
    sbg = torch.stack([sb, sb, sb])
    ops = torch.ops.megakernels

    def u8(t):
        return t.view(torch.uint8)

    return [
        (ops.fp8_quantize, (x, "e4m3", "row", None, True, False)),
        (ops.fp8_quantize, (x.bfloat16(), "e5m2", "tensor", torch.tensor(2.0), True, False)),
        (ops.fp8_quantize, (x, "e4m3", "block", None, False, False)),
        (ops.fp8_gemm, (u8(a), sa, "row", u8(b), sb, "block", torch.bfloat16, "e4m3,e4m3", False)),
        (ops.fp8_gemm, (u8(a), sa, "row", u8(bt), sbt, "tensor", torch.float32, "e4m3,e4m3", False)),
        (ops.fp8_grouped_gemm, (u8(a), sa, "row", u8(bg), sbg, "block", sizes, torch.float32, "e4m3,e4m3", False)),
        (
            ops.fp8_linear,
            (torch.randn(40, 150, requires_grad=True), torch.randn(20, 150, requires_grad=True), "blockwise"),
        ),
        (
            ops.fp8_linear,
            (torch.randn(40, 150, requires_grad=True), torch.randn(20, 150, requires_grad=True), "tensorwise"),
        ),
        (ops.fp8_linear_bwd, (torch.randn(40, 20), torch.randn(40, 150), torch.randn(20, 150), "tensorwise")),
    ]


@pytest.mark.parametrize("i", range(9))
def test_opcheck(i):
    op, args = _opcheck_args()[i]
    torch.library.opcheck(op, args)


def test_compiles_fullgraph():
    x, w = torch.randn(32, 64), torch.randn(48, 64)
    f = torch.compile(lambda x, w: fp8.fp8_linear(x, w, recipe="blockwise"), fullgraph=True, backend="eager")
    torch.testing.assert_close(f(x, w), fp8.fp8_linear(x, w, recipe="blockwise"))


def test_bad_input_is_named():
    x = torch.randn(8, 16)
    q, s, _, _ = fp8.fp8_quantize(x, "e4m3", "tensor")
    with pytest.raises(ValueError, match="fmt"):
        fp8.fp8_quantize(x, "e3m4")
    with pytest.raises(ValueError, match="granularity"):
        fp8.fp8_quantize(x, "e4m3", "column")
    with pytest.raises(ValueError, match="x must be 2-D"):
        fp8.fp8_quantize(x[0])
    with pytest.raises(ValueError, match="x must be fp32, bf16 or fp16"):
        fp8.fp8_quantize(x.double())
    with pytest.raises(ValueError, match="scale must be fp32 of shape"):
        fp8.fp8_quantize(x, "e4m3", "row", torch.tensor(1.0))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        fp8.fp8_quantize([1.0])
    with pytest.raises(ValueError, match="a must be an FP8 tensor"):
        fp8.fp8_gemm(x, s, q, s)
    with pytest.raises(ValueError, match="b has K=8"):
        fp8.fp8_gemm(q, s, q.t().contiguous(), s)
    with pytest.raises(ValueError, match="b_scale has shape"):
        fp8.fp8_gemm(q, s, q, torch.ones(2, 2), b_granularity="block")
    e5 = q.float().to(torch.float8_e5m2)
    with pytest.raises(ValueError, match="both e5m2"):
        fp8.fp8_gemm(e5, s, e5, s)
    with pytest.raises(ValueError, match="out_dtype"):
        fp8.fp8_gemm(q, s, q, s, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="group_sizes must be >= 0 and sum"):
        fp8.fp8_grouped_gemm(q, s, q[None], s[None], torch.tensor([3]))
    with pytest.raises(ValueError, match="recipe must be one of"):
        fp8.fp8_linear(x, x, recipe="delayed")
    with pytest.raises(ValueError, match="weight must be \\[N, K\\]"):
        fp8.fp8_linear(x, torch.randn(4, 5))
    with pytest.raises(ValueError, match="on meta"):
        fp8.fp8_linear(x, torch.randn(4, 16, device="meta"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensorwise_matches_torchao_float8_linear(dtype):
    """torchao's float8 training (tensorwise dynamic scaling, e4m3 forward, e5m2 gradients) with its scales rounded
    to powers of two, as ours: the same inputs give the same output and gradients up to the order of fp32 sums
    (torch._scaled_mm on the CPU) and the output's final rounding."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    g = torch.Generator().manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(256, 384, bias=False)).to(dtype)  # the converter swaps children
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(384, 256, generator=g) / 16)
    w0 = model[0].weight.detach().clone()
    convert_to_float8_training(model, config=Float8LinearConfig(round_scales_to_power_of_2=True))
    lin = model[0]
    assert type(lin).__name__ == "Float8Linear"
    x = (torch.randn(128, 256, generator=g) * 3).to(dtype)
    dy = torch.randn(128, 384, generator=g).to(dtype)
    xa = x.clone().requires_grad_()
    ya = model(xa)
    ya.backward(dy)
    xo, wo = x.clone().requires_grad_(), w0.clone().requires_grad_()
    yo = fp8.fp8_linear(xo, wo, recipe="tensorwise")
    yo.backward(dy)
    # (bit-identical on the development machine; a different sum order may move the last bit of a bf16 output)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-3)
    torch.testing.assert_close(yo, ya, **tol)
    torch.testing.assert_close(xo.grad, xa.grad, **tol)
    torch.testing.assert_close(wo.grad, lin.weight.grad, **tol)
