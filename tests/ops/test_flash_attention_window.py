"""Sliding-window flash_attention (``window=``) against an fp64 masked-softmax reference written here from the
definition (HuggingFace Mistral's ``sliding_window``: causal query i sees key j iff ``i - w < j <= i``, positions
bottom-right aligned when sq != sk; without causality the band ``|i - j| < w``), on the CPU path, the Triton kernels
under the interpreter (cuda_emu) and the GPU: windows inside one key block and across several, causal and not,
sq != sk both ways, GQA, both backward forms (atomic dQ and the deterministic dQ kernel)."""

from __future__ import annotations

import math

import pytest
import torch

from megakernels.ops.attention import flash_attention

# (batch, sq, sk, heads, kv_heads, head_dim); the interpreter's blocks are 32 x 32
CASES = [(1, 70, 70, 2, 1, 32), (2, 40, 97, 4, 2, 32), (1, 97, 40, 2, 2, 32)]
WINDOWS = [1, 5, 33, 50]  # the query alone, inside one block, just over one, over one and a half


def visible(sq: int, sk: int, causal: bool, window: int | None) -> torch.Tensor:
    """``[sq, sk]`` bool: query i (absolute position ``i + sk - sq``) sees key j."""
    qpos = torch.arange(sq)[:, None] + (sk - sq)
    kpos = torch.arange(sk)[None, :]
    seen = kpos <= qpos if causal else torch.ones(sq, sk, dtype=torch.bool)
    if window is not None:
        seen = seen & (kpos > qpos - window) if causal else seen & ((qpos - kpos).abs() < window)
    return seen


def reference(q, k, v, causal, window):
    """fp64 softmax attention with the mask made explicit; a query that sees no key gives zeros."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qd = q.double().transpose(1, 2)
    kd = k.double().transpose(1, 2).repeat_interleave(h // hk, 1)
    vd = v.double().transpose(1, 2).repeat_interleave(h // hk, 1)
    s = qd @ kd.transpose(-1, -2) / math.sqrt(d)
    seen = visible(sq, sk, causal, window)
    s = s.masked_fill(~seen, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # all -inf rows: nan -> 0
    return (p @ vd).transpose(1, 2)


def _inputs(case, dtype, device, seed=0):
    b, sq, sk, h, hk, d = case
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d))
    return [torch.randn(s, generator=g).to(dtype=dtype, device=device) for s in shapes]


def _grads(fn, q, k, v, do):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(do)
    return [out.detach()] + [t.grad for t in leaves]


def _dtypes(backend):
    if backend.name == "cuda":
        return (torch.float16, torch.bfloat16)
    return (torch.float32, torch.float16)  # the interpreter's bf16 tl.dot is broken (docs/design.md §3)


def _check(backend, case, causal, window, deterministic=False, dtypes=None):
    for dtype in dtypes or _dtypes(backend):
        q, k, v, do = _inputs(case, dtype, backend.device)
        got = _grads(
            lambda *t: flash_attention(*t, causal=causal, window=window, deterministic=deterministic), q, k, v, do
        )
        want = _grads(lambda *t: reference(*t, causal, window), *(t.cpu().double() for t in (q, k, v, do)))
        tol = 2e-5 if dtype == torch.float32 else 1e-2
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            err = (g.cpu().double() - w).abs().max().item()
            assert err < tol * max(1.0, w.abs().max().item()), f"{name} {dtype} window={window}: error {err:.3g}"


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_sq{}_sk{}_h{}_hk{}_d{}".format(*c))
def test_window_matches_masked_softmax(triton_backend, case, causal, window):
    _check(triton_backend, case, causal, window, dtypes=_dtypes(triton_backend)[:1])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_window_in_every_dtype_and_the_deterministic_backward(triton_backend, causal):
    _check(triton_backend, (2, 40, 97, 4, 2, 32), causal, 33)
    _check(triton_backend, (1, 97, 40, 2, 1, 32), causal, 5, deterministic=True)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_window_with_64_row_query_blocks(triton_backend, causal, monkeypatch):
    """Query blocks of 64 rows over key blocks of 32 (dQ as dS K; bands whose edges fall inside a block)."""
    from megakernels.triton import flash_attention as fa

    if not triton_backend.emulated:
        pytest.skip("sets the config of the Triton interpreter (cuda_emu)")
    monkeypatch.setattr(fa, "INTERPRETER_CONFIG", (64, 32, 4, 1))
    _check(triton_backend, (1, 130, 97, 2, 1, 32), causal, 40, dtypes=(torch.float32,))


def test_window_as_long_as_the_sequence_is_full_attention(triton_backend):
    q, k, v, _ = _inputs((1, 40, 40, 2, 2, 32), torch.float32, triton_backend.device)
    for causal in (True, False):
        full = flash_attention(q, k, v, causal=causal)
        assert torch.equal(flash_attention(q, k, v, causal=causal, window=40), full)
        assert torch.equal(flash_attention(q, k, v, causal=causal, window=0), full)
        assert torch.equal(flash_attention(q, k, v, causal=causal, window=10**6), full)
        assert not torch.allclose(flash_attention(q, k, v, causal=causal, window=39), full)


def test_window_lse_is_minus_inf_only_for_rows_that_see_no_key(triton_backend):
    q, k, v, _ = _inputs((1, 50, 20, 2, 1, 32), torch.float32, triton_backend.device)  # first 30 queries: no key
    out, lse = flash_attention(q, k, v, causal=True, window=7, return_lse=True)
    assert torch.isneginf(lse[..., :30]).all() and torch.isfinite(lse[..., 30:]).all()
    assert (out[:, :30] == 0).all()


def test_gradcheck_cpu_fp64_window():
    g = torch.Generator().manual_seed(3)
    for causal in (True, False):
        q, k, v = (
            torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
            for s in ((1, 9, 4, 8), (1, 11, 2, 8), (1, 11, 2, 8))
        )
        assert torch.autograd.gradcheck(lambda *t: flash_attention(*t, causal=causal, window=3), (q, k, v))


@pytest.mark.parametrize("window", [-1, 2.0, True, "4"])
def test_bad_window_is_refused(window):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="window must be a positive int, or None or 0"):
        flash_attention(q, q, q, causal=True, window=window)


def test_a_shifted_diagonal_needs_a_window():
    """The ops' ``shift`` (context parallelism's chunk offset) moves a window's band; without a window it is refused
    rather than ignored."""
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="needs window > 0"):
        torch.ops.megakernels.flash_attn_fwd(q, q, q, True, 0.3, 0.0, None, False, False, 0, 2)
    out, _ = torch.ops.megakernels.flash_attn_fwd(q, q, q, True, 0.3, 0.0, None, False, False, 2, -4)
    assert (out == 0).all()  # every key 4 positions ahead of its query: none in a causal window
