"""Specification of the softmax family (scaled_softmax, scaled_masked_softmax, scaled_causal_softmax) on every
backend: forward and backward against an fp64 plain-PyTorch reference, long rows (no sequence cap), broadcast
masks, causal with sq != sk, fully masked rows, NaN/inf semantics, the causal kernel not reading the masked
triangle, fp64 gradcheck, and what is saved for backward."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from megakernels.ops import scaled_causal_softmax, scaled_masked_softmax, scaled_softmax
from megakernels.ops.softmax import causal_mask, scaled_masked_softmax_reference
from tests.helpers import TOLERANCE, Backend, assert_close_to_reference, kernel_grads, make, reference_grads

SCALE = 0.37
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SEQ_LENGTHS = [1, 17, 1000, 2048, 4097, 16384, 20000]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One op of the family as (fused, reference) over x, with the mask it implies (None for no mask)."""

    name: str
    fused: Callable  # fused(x, mask)
    mask_for: Callable  # mask_for(shape, device) -> bool tensor or None

    def reference(self, x, mask):
        return scaled_masked_softmax_reference(x, mask, SCALE, compute_dtype=x.dtype)

    def __str__(self) -> str:
        return self.name


def random_mask(shape, device, p=0.3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) < p).to(device)


PLAIN = Variant("scaled", lambda x, m: scaled_softmax(x, SCALE), lambda s, d: None)
MASKED = Variant(
    "masked", lambda x, m: scaled_masked_softmax(x, m, SCALE), lambda s, d: random_mask((s[0], 1, s[2], s[3]), d)
)
CAUSAL = Variant("causal", lambda x, m: scaled_causal_softmax(x, SCALE), lambda s, d: causal_mask(s[-2], s[-1], d))
VARIANTS = [PLAIN, MASKED, CAUSAL]


def shape_for(backend: Backend, sk: int):
    """[b, heads, sq, sk]: the emulator runs every CUDA thread as a host thread, so it gets a few rows only (still
    more than one warp-per-row block of 4 rows for short rows)."""
    if backend.emulated:
        return (1, 2, 3, sk) if sk <= 4097 else (1, 1, 2, sk)
    return (2, 2, 3, sk) if sk <= 4097 else (1, 2, 2, sk)


def assert_elementwise_close(out, ref, dx, rdx, dy, dtype, what):
    """Per element, relative to the element itself: with long rows the probabilities are ~1/sk, so a tolerance
    relative to max(1, max|ref|) alone would accept almost anything. y: |y - ref| <= tol |ref| (+ the denormal
    range, which the kernels may flush). dx = scale * y * (dy - s) with |s| <= max|dy| (y sums to 1): its error
    is bounded relative to scale * |y| * (|dy| + max|dy|)."""
    tol = TOLERANCE[dtype]
    fi = torch.finfo(dtype)
    atol = fi.tiny * fi.eps + 2e-38
    o, r = out.double().cpu(), ref.double().cpu()
    bad = (o - r).abs() > tol * r.abs() + atol
    assert not bad.any(), f"{what} y: {int(bad.sum())} elements off by more than {tol:g} relative"
    g = dy.double().cpu()
    bound = 2 * tol * abs(SCALE) * r.abs() * (g.abs() + g.abs().amax(-1, keepdim=True)) + atol
    bad = (dx.double().cpu() - rdx.double().cpu()).abs() > bound
    assert not bad.any(), f"{what} dx: {int(bad.sum())} elements off by more than their relative bound"


def check_forward_backward(variant, backend, shape, dtype, mask=None, factor=1.0):
    x = make(shape, dtype, backend.device, scale=3.0, seed=0)
    dy = make(shape, dtype, backend.device, seed=99)
    mask = variant.mask_for(shape, backend.device) if mask is None else mask
    out, (dx,) = kernel_grads(lambda t: variant.fused(t, mask), [x], dy)
    ref, (rdx,) = reference_grads(lambda t: variant.reference(t, mask), [x], dy)
    assert out.dtype == dtype and dx.dtype == dtype
    assert_close_to_reference(out, ref, dtype, f"{variant} y", factor=factor)
    assert_close_to_reference(dx, rdx, dtype, f"{variant} dx", factor=2 * factor)
    assert_elementwise_close(out, ref, dx, rdx, dy, dtype, str(variant))
    return out, dx


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sk", SEQ_LENGTHS)
def test_forward_and_backward_match_fp64_reference(variant, backend, dtype, sk):
    check_forward_backward(variant, backend, shape_for(backend, sk), dtype)


def test_rows_of_65536_keys(backend):
    """No sequence cap: Megatron's kernels stop at 16k (2k causal); these take any length."""
    sk = 65536
    for variant in VARIANTS:
        check_forward_backward(variant, backend, (1, 1, 1 if backend.emulated else 2, sk), torch.bfloat16)


@pytest.mark.parametrize(
    "shape", [(7,), (3, 40), (2, 3, 96), (2, 1, 3, 64), (2, 2, 1, 2, 5)], ids=lambda s: f"rank{len(s)}"
)
def test_scaled_softmax_takes_any_leading_shape(backend, shape):
    check_forward_backward(PLAIN, backend, shape, torch.float32)


@pytest.mark.parametrize("shape", [(5, 9), (2, 3, 4, 4), (2, 1, 1, 3, 8)], ids=lambda s: f"rank{len(s)}")
def test_causal_softmax_takes_any_leading_shape(backend, shape):
    check_forward_backward(CAUSAL, backend, shape, torch.float32)


MASK_SHAPES = [
    (1, 1, 5, 24),
    (3, 1, 5, 24),
    (1, 2, 5, 24),
    (3, 2, 5, 24),
    (3, 1, 1, 24),
    (1, 2, 1, 24),
    (5, 24),
    (1, 24),
    (2, 5, 24),
]


@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mask_broadcasts_over_batch_heads_and_queries(backend, mask_shape):
    shape = (3, 2, 5, 24)  # 2- and 3-dim masks are right-aligned, as in PyTorch broadcasting
    check_forward_backward(MASKED, backend, shape, torch.float32, mask=random_mask(mask_shape, backend.device))


def test_expanded_and_strided_masks_are_read_in_place(backend):
    """A mask that is already an expanded (stride-0) view, or a slice with gaps, gives the same result."""
    shape = (2, 3, 4, 16)
    base = random_mask((2, 1, 4, 16), backend.device)
    check_forward_backward(MASKED, backend, shape, torch.float32, mask=base.expand(2, 3, 4, 16))
    wide = random_mask((2, 1, 8, 32), backend.device)
    check_forward_backward(MASKED, backend, shape, torch.float32, mask=wide[:, :, ::2, 5:21])
    check_forward_backward(MASKED, backend, shape, torch.float32, mask=random_mask((16, 4), backend.device).t())
    odd_rows = random_mask((2, 1, 4, 17), backend.device)[..., :16]  # aligned start, rows 17 bytes apart
    check_forward_backward(MASKED, backend, shape, torch.float32, mask=odd_rows)


@pytest.mark.parametrize("sq, sk", [(3, 10), (10, 3), (1, 7), (7, 1), (5, 5), (40, 130), (130, 40)])
def test_causal_with_sq_different_from_sk_is_bottom_right_aligned(backend, sq, sk):
    out, _ = check_forward_backward(CAUSAL, backend, (2, 1, sq, sk), torch.float32)
    # Spot-check the convention itself: the last query row sees every key, masked entries are exactly 0.
    assert torch.all(out[..., -1, :] > 0)
    assert torch.all(out[..., causal_mask(sq, sk, out.device)] == 0)


def test_causal_rows_with_no_visible_key_are_zero(backend):
    """sq > sk: the first sq - sk queries see no key; they give zeros and zero gradient, not NaN."""
    x = make((2, 2, 9, 4), torch.float32, backend.device).requires_grad_(True)
    y = scaled_causal_softmax(x, SCALE)
    y.backward(make(y.shape, torch.float32, backend.device, seed=3))
    assert torch.equal(y[..., :5, :], torch.zeros_like(y[..., :5, :]))
    assert torch.equal(x.grad[..., :5, :], torch.zeros_like(x.grad[..., :5, :]))
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sk", [7, 64, 3000])
def test_fully_masked_rows_give_zeros_and_zero_grad(backend, dtype, sk):
    shape = (2, 2, 3, sk)
    mask = random_mask((2, 1, 3, sk), backend.device, p=0.5)
    mask[0, :, 1] = True  # one fully masked row per head of batch 0
    mask[1, :, 2] = True
    out, dx = check_forward_backward(MASKED, backend, shape, dtype, mask=mask)
    for b, i in [(0, 1), (1, 2)]:
        assert torch.equal(out[b, :, i].float(), torch.zeros_like(out[b, :, i].float()))
        assert torch.equal(dx[b, :, i].float(), torch.zeros_like(dx[b, :, i].float()))
    assert torch.isfinite(out).all() and torch.isfinite(dx).all()


def test_all_masked_input_gives_zeros(backend):
    x = make((1, 2, 3, 50), torch.float32, backend.device)
    out = scaled_masked_softmax(x, torch.ones(1, 1, 3, 50, dtype=torch.bool, device=backend.device))
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("sk", [33, 2500])
def test_causal_kernel_never_reads_the_masked_triangle(backend, sk):
    """NaN in every masked element of x: the output and gradient stay finite and equal to the clean input's."""
    sq = 6
    x = make((1, 2, sq, sk), torch.float32, backend.device, scale=2.0)
    poisoned = x.masked_fill(causal_mask(sq, sk, backend.device), float("nan"))
    dy = make(x.shape, torch.float32, backend.device, seed=8)
    out, (dx,) = kernel_grads(lambda t: scaled_causal_softmax(t, SCALE), [poisoned], dy)
    ref, (rdx,) = reference_grads(lambda t: CAUSAL.reference(t, causal_mask(sq, sk, t.device)), [x], dy)
    assert torch.isfinite(out).all() and torch.isfinite(dx).all()
    assert_close_to_reference(out, ref, torch.float32, "y")
    assert_close_to_reference(dx, rdx, torch.float32, "dx", factor=2)


def test_masked_kernel_ignores_values_under_the_mask(backend):
    """-inf semantics, not -10000: a masked element contributes nothing, whatever x holds there (NaN, +inf, 1e30)."""
    shape = (2, 2, 4, 40)
    x = make(shape, torch.float32, backend.device)
    mask = random_mask((2, 1, 4, 40), backend.device, p=0.4)
    dirty = x.clone()
    full = mask.expand(shape)
    dirty[full] = torch.tensor([float("nan"), float("inf"), 1e30, -1e30], device=backend.device).repeat(
        int(full.sum()) // 4 + 1
    )[: int(full.sum())]
    assert torch.equal(scaled_masked_softmax(dirty, mask, SCALE), scaled_masked_softmax(x, mask, SCALE))
    assert_close_to_reference(
        scaled_masked_softmax(dirty, mask, SCALE), MASKED.reference(x.double(), mask), torch.float32, "y"
    )


def _with(x, row, col, value):
    x = x.clone()
    x[..., row, col] = value
    return x


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("sk", [20, 1500])
def test_nan_and_inf_in_x_propagate_like_torch_softmax(backend, variant, sk):
    """Row 0: a NaN; row 1: +inf; row 2: -inf among finite values; row 3: all -inf (every unmasked value)."""
    shape = (1, 1, 4, sk)
    x = make(shape, torch.float32, backend.device)
    x = _with(_with(_with(x, 0, sk - 1, float("nan")), 1, sk - 1, float("inf")), 2, 0, float("-inf"))
    x[..., 3, :] = float("-inf")
    mask = variant.mask_for(shape, backend.device)
    if mask is not None and variant is MASKED:
        mask[..., :, sk - 1] = False  # keep the NaN / inf visible
        mask[..., :, 0] = False
    if variant is CAUSAL:  # make the poisoned columns visible: sq == 4 rows see the last 4 .. sk keys
        x = make(shape, torch.float32, backend.device)
        x = _with(_with(_with(x, 0, 0, float("nan")), 1, 0, float("inf")), 2, 1, float("-inf"))
        x[..., 3, :] = float("-inf")
    out = variant.fused(x, mask)
    ref = variant.reference(x.double(), mask)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0, equal_nan=True)
    assert torch.isnan(out[..., 0, :]).all() and torch.isnan(out[..., 1, :]).all() and torch.isnan(out[..., 3, :]).all()
    assert torch.isfinite(out[..., 2, :]).all()


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("shape", [(1, 2, 3, 5), (2, 1, 4, 9)], ids=lambda s: "x".join(map(str, s)))
def test_gradcheck_fp64(backend, variant, shape):
    x = make(shape, torch.float64, backend.device).requires_grad_(True)
    mask = variant.mask_for(shape, backend.device)
    if mask is not None and variant is MASKED:
        mask[0, 0, 0] = True  # include a fully masked row
    assert torch.autograd.gradcheck(lambda t: variant.fused(t, mask), [x], eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_fp64_input(backend, variant):
    check_forward_backward(variant, backend, (2, 2, 3, 300), torch.float64)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_empty_input_gives_empty_result(backend, variant):
    x = torch.zeros(0, 2, 3, 8, device=backend.device, requires_grad=True)
    mask = variant.mask_for((1, 2, 3, 8), backend.device)
    out = variant.fused(x, mask)
    assert out.shape == x.shape
    out.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_non_contiguous_input_is_handled(backend, variant):
    x = make((2, 3, 20, 20), torch.float32, backend.device).transpose(-1, -2)
    assert not x.is_contiguous()
    mask = variant.mask_for(x.shape, backend.device)
    assert_close_to_reference(variant.fused(x, mask), variant.reference(x.double(), mask), torch.float32, "y")


def test_saves_only_the_output_for_backward(backend):
    x = make((2, 2, 4, 64), torch.bfloat16, backend.device).requires_grad_(True)
    mask = random_mask((2, 1, 4, 64), backend.device)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = scaled_masked_softmax(x, mask, SCALE)
    assert len(saved) == 1 and saved[0].shape == y.shape and saved[0].dtype == torch.bfloat16


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_deterministic_run_to_run(backend, variant):
    shape = (2, 2, 5, 300)
    x = make(shape, torch.float32, backend.device)
    dy = make(shape, torch.float32, backend.device, seed=3)
    mask = variant.mask_for(shape, backend.device)
    first = kernel_grads(lambda t: variant.fused(t, mask), [x], dy)
    second = kernel_grads(lambda t: variant.fused(t, mask), [x], dy)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1][0], second[1][0])


def test_cpu_result_independent_of_thread_count():
    shape = (4, 4, 32, 257)
    x = make(shape, torch.float32, "cpu")
    dy = make(shape, torch.float32, "cpu", seed=4)
    mask = random_mask((4, 1, 32, 257), "cpu")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel_grads(lambda t: scaled_masked_softmax(t, mask, SCALE), [x], dy)
        torch.set_num_threads(max(2, threads))
        many = kernel_grads(lambda t: scaled_masked_softmax(t, mask, SCALE), [x], dy)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1][0], many[1][0])


@pytest.mark.cuda
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "shape",
    [(8, 16, 512, 512), (2, 16, 2048, 2048), (1, 8, 128, 16384), (1, 4, 16, 65536), (4, 8, 100, 1027)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_gpu_sizes_match_reference(variant, dtype, shape):
    """Real attention sizes (GPU only): many rows per grid, warp- and block-per-row paths at scale."""
    import megakernels

    with megakernels.backend("cuda"):
        check_forward_backward(variant, Backend("cuda", "cuda"), shape, dtype)
