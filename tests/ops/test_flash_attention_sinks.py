"""Attention sinks in flash_attention (``sinks=``: a learnable logit per query head joining every row's softmax
denominator, gpt-oss) against an fp64 reference written here from the definition (the sink as one more column of the
scores, of value zero, through torch.softmax and autograd): forward, lse and every gradient (dq, dk, dv and dsinks),
causal and not, sq != sk both ways, GQA (the sink indexed by the query head), sliding windows, packed documents and
``flash_attention_varlen``, dropout with the documented mask, the deterministic backward, rows that see no key, on
the CPU paths (the C++ kernel, the blocked PyTorch path for fp64), the Triton kernels under the interpreter (cuda_emu)
and the GPU; the custom ops under opcheck; bad sinks named."""

from __future__ import annotations

import math

import pytest
import torch

import megakernels
from megakernels.ops import _attention_cpu, flash_attention_varlen
from megakernels.ops.attention import dropout_mask, flash_attention

# (batch, sq, sk, heads, kv_heads, head_dim): GQA and MQA, sq != sk both ways (bottom-right causal: the first sq - sk
# queries see no key), partial blocks
CASES = [(2, 40, 40, 4, 2, 32), (1, 70, 33, 2, 1, 32), (1, 33, 90, 6, 3, 16)]


def _dtypes(backend):
    if backend.name == "cuda":
        return (torch.float16, torch.bfloat16)
    if backend.emulated:  # the interpreter's bf16 tl.dot is broken (docs/design.md §3)
        return (torch.float32, torch.float16)
    return (torch.float32, torch.bfloat16)


def _tol(dtype) -> float:
    return {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]


def _inputs(case, dtype, device, seed=0):
    """q, k, v, dO in ``dtype`` and fp32 sinks spread over [-3, 3] (some above the scores, some below)."""
    b, sq, sk, h, hk, d = case
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d))
    q, k, v, do = (torch.randn(s, generator=g).to(dtype=dtype, device=device) for s in shapes)
    sinks = torch.linspace(-3.0, 3.0, h)[torch.randperm(h, generator=g)].to(device)
    return q, k, v, do, sinks


def _seen(sq, sk, causal, window=None, q_docs=None, k_docs=None):
    """``[b or 1, sq, sk]`` bool: query i sees key j (bottom-right aligned, ``flash_attention``'s rules)."""
    rel = torch.arange(sq)[:, None] + (sk - sq) - torch.arange(sk)[None, :]
    seen = rel >= 0 if causal else torch.ones(sq, sk, dtype=torch.bool)
    if window:
        seen = seen & ((rel < window) if causal else (rel.abs() < window))
    seen = seen[None]
    if q_docs is not None:
        seen = seen & (q_docs[:, :, None] == k_docs[:, None, :])
    return seen


def reference(q, k, v, sinks, causal, window=None, docs=None, keep=None, dropout_p=0.0):
    """fp64 attention whose scores get one more column per head, ``sinks[h]``, through a plain softmax; the column's
    value is zero (its probability only enters the denominator). Returns (out, lse)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kk, vv = k.repeat_interleave(h // hk, 2), v.repeat_interleave(h // hk, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(d)
    seen = _seen(sq, sk, causal, window, *(docs or (None, None)))
    s = s.masked_fill(~seen[:, None], float("-inf"))
    s = torch.cat((s, sinks[None, :, None, None].expand(b, h, sq, 1)), -1)
    p = torch.softmax(s, -1)[..., :sk]
    if keep is not None:
        p = torch.where(keep, p / (1.0 - dropout_p), 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vv), torch.logsumexp(s, -1)


def _grads(fn, q, k, v, sinks, do):
    """(out, lse, dq, dk, dv, dsinks) of ``fn(q, k, v, sinks) -> (out, lse)`` with ``out.backward(do)``."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, sinks)]
    out, lse = fn(*leaves)
    out.backward(do)
    return [out.detach(), lse.detach()] + [t.grad for t in leaves]


def _exact(q, k, v, sinks, do, **kw):
    return _grads(lambda *t: reference(*t, **kw), *(t.detach().cpu().double() for t in (q, k, v, sinks, do)))


def _compare(got, want, dtype, what):
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        g = g.detach().cpu().double()
        assert g.shape == w.shape, f"{what} {name}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
        err = (g - w).abs().max().item()
        tol = _tol(dtype) * max(1.0, w.abs().max().item())
        assert err <= tol, f"{what} {name}: max error {err:.3g} > {tol:.3g}"


def _fa(**kw):
    """``flash_attention`` as ``fn(q, k, v, sinks) -> (out, lse)`` with the keywords ``kw``."""
    return lambda q, k, v, sinks: flash_attention(q, k, v, sinks=sinks, return_lse=True, **kw)


def _check(backend, case, causal, dtypes=None, **kw):
    for dtype in dtypes or _dtypes(backend):
        q, k, v, do, sinks = _inputs(case, dtype, backend.device)
        got = _grads(_fa(causal=causal, **kw), q, k, v, sinks, do)
        ref_kw = {key: val for key, val in kw.items() if key == "window"}
        _compare(got, _exact(q, k, v, sinks, do, causal=causal, **ref_kw), dtype, f"{case} {dtype} {kw}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_sq{}_sk{}_h{}_hk{}_d{}".format(*c))
def test_sinks_match_the_extra_column_reference(triton_backend, case, causal):
    _check(triton_backend, case, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sinks_with_sliding_windows(triton_backend, causal):
    """Windows inside one block and across blocks (the interpreter's are 32 wide)."""
    for window in (5, 40):
        _check(triton_backend, (2, 70, 70, 4, 2, 32), causal, dtypes=_dtypes(triton_backend)[:1], window=window)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sinks_with_the_deterministic_backward_repeat_bitwise(triton_backend, causal):
    case = (1, 70, 45, 4, 2, 32)
    dtype = _dtypes(triton_backend)[0]
    q, k, v, do, sinks = _inputs(case, dtype, triton_backend.device, seed=1)
    fn = _fa(causal=causal, deterministic=True)
    first, second = _grads(fn, q, k, v, sinks, do), _grads(fn, q, k, v, sinks, do)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    _compare(first, _exact(q, k, v, sinks, do, causal=causal), dtype, "deterministic")


def test_sinks_with_dropout_match_the_reference_with_the_documented_mask(triton_backend):
    """The sink is never dropped (its value is zero): the kept key probabilities are scaled, the denominator keeps
    every term, the sink's included."""
    case, p = (2, 37, 45, 4, 2, 32), 0.3
    dev = triton_backend.device
    dtype = _dtypes(triton_backend)[0]
    q, k, v, do, sinks = _inputs(case, dtype, dev, seed=2)
    seed = int(
        torch.randint(0, 2**62, (), dtype=torch.int64, device=dev, generator=torch.Generator(dev).manual_seed(7))
    )
    keep = dropout_mask(seed, 2, 4, 37, 45, p)
    for causal in (False, True):
        gen = torch.Generator(device=dev).manual_seed(7)
        got = _grads(_fa(causal=causal, dropout_p=p, generator=gen), q, k, v, sinks, do)
        want = _exact(q, k, v, sinks, do, causal=causal, keep=keep, dropout_p=p)
        _compare(got, want, dtype, f"dropout causal={causal}")


def test_rows_that_see_no_key_give_zero_and_the_sink_as_lse(triton_backend):
    """Causal with sq > sk: the first sq - sk queries see only the sink: output 0, lse ``sinks[h]``, no share of any
    gradient (their dO . O is 0)."""
    q, k, v, do, sinks = _inputs((1, 50, 20, 4, 2, 32), torch.float32, triton_backend.device, seed=3)
    got = _grads(_fa(causal=True), q, k, v, sinks, do)
    out, lse = got[0].cpu(), got[1].cpu()
    assert (out[:, :30] == 0).all()
    assert torch.equal(lse[..., :30], sinks.cpu()[None, :, None].expand(1, 4, 30))
    _compare(got, _exact(q, k, v, sinks, do, causal=True), torch.float32, "no key")


def test_a_minus_inf_sink_is_no_sink(triton_backend):
    q, k, v, _, _ = _inputs((2, 40, 40, 4, 2, 32), torch.float32, triton_backend.device, seed=4)
    none = torch.full((4,), float("-inf"), device=triton_backend.device)
    for causal in (False, True):
        out, lse = flash_attention(q, k, v, causal=causal, sinks=none, return_lse=True)
        ref_out, ref_lse = flash_attention(q, k, v, causal=causal, return_lse=True)
        torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sinks_over_packed_documents_and_varlen(triton_backend, causal):
    """Every query's denominator holds its head's sink once, whatever its document: documents through the dense op
    (a mask of equal ids in the reference) and flash_attention_varlen (batch 1 over cu_seqlens), GQA."""
    dev = triton_backend.device
    lengths = [5, 1, 40, 0, 23]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    dtype = _dtypes(triton_backend)[0]
    q, k, v, do, sinks = _inputs((1, 69, 69, 4, 2, 32), dtype, dev, seed=5)
    want = _exact(q, k, v, sinks, do, causal=causal, docs=(ids, ids))
    got = _grads(_fa(causal=causal, documents=ids.to(dev)), q, k, v, sinks, do)
    _compare(got, want, dtype, "documents")
    cu = _cu(lengths).to(dev)

    def varlen(q, k, v, s):
        out, lse = flash_attention_varlen(q[0], k[0], v[0], cu, cu, 40, 40, causal=causal, sinks=s, return_lse=True)
        return out[None], lse[None]

    _compare(_grads(varlen, q, k, v, sinks, do), want, dtype, "varlen")


def test_gradcheck_cpu_fp64_sinks():
    """The blocked PyTorch path (fp64) under gradcheck, sinks included: causal, a window, GQA."""
    g = torch.Generator().manual_seed(6)
    for causal, window in ((False, None), (True, None), (True, 3)):
        q = torch.randn(1, 9, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(1, 11, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
        sinks = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
        fn = lambda *t: flash_attention(*t[:3], causal=causal, window=window, sinks=t[3])  # noqa: E731
        assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_routing_with_sinks(dtype, monkeypatch):
    """fp32 with sinks runs the C++ kernel (the blocked path refuses here); fp64 keeps the blocked path, whose
    results are the reference's."""
    calls = []
    fwd, bwd = _attention_cpu.forward, _attention_cpu.backward

    def spy(fn, name):
        def run(*a, **kw):
            calls.append(name)
            return fn(*a, **kw)

        return run

    monkeypatch.setattr(_attention_cpu, "forward", spy(fwd, "fwd"))
    monkeypatch.setattr(_attention_cpu, "backward", spy(bwd, "bwd"))
    q, k, v, do, sinks = _inputs((2, 40, 50, 4, 2, 16), dtype, "cpu", seed=7)
    sinks = sinks.to(dtype)
    with megakernels.backend("cpu"):
        got = _grads(_fa(causal=True), q, k, v, sinks, do)
    assert calls == ([] if dtype == torch.float32 else ["fwd", "bwd"])
    _compare(got, _exact(q, k, v, sinks, do, causal=True), dtype, str(dtype))


def test_cpu_kernel_and_blocked_path_agree():
    """The C++ kernel's and the blocked PyTorch path's sinks, called directly: out, lse, dq, dk, dv, dsinks."""
    q, k, v, do, sinks = _inputs((2, 150, 170, 4, 2, 64), torch.float32, "cpu", seed=8)
    for causal, window in ((False, 0), (True, 0), (True, 60)):
        out, lse = torch.ops.megakernels.flash_attn_fwd_cpu(q, k, v, causal, 0.125, window, 0, None, 0.0, 0, sinks)
        py_out, py_lse = _attention_cpu.forward(q, k, v, causal, 0.125, 0.0, 0, window, 0, None, sinks)
        torch.testing.assert_close(out, py_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, py_lse, rtol=1e-5, atol=1e-5)
        bwd = torch.ops.megakernels.flash_attn_bwd_cpu
        grads = bwd(do, q, k, v, out, lse, causal, 0.125, window, 0, None, 0.0, 0, sinks)
        py_grads = _attention_cpu.backward(do, q, k, v, out, lse, causal, 0.125, 0.0, 0, window, 0, None, sinks)
        assert grads[3].shape == (4,) and grads[3].dtype == torch.float32
        for x, y in zip(grads, py_grads, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("emulate", [False, True], ids=["cpu", "triton_interpreter"])
def test_opcheck_with_sinks(emulate):
    if emulate:
        from megakernels.triton import interpreting

        if not interpreting():
            pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1)")
    q, k, v, do, sinks = _inputs((1, 20, 20, 4, 2, 16), torch.float32, "cpu", seed=9)
    ids = torch.tensor([[0] * 7 + [1] * 13])
    args = (q, k, v, True, 0.25, 0.0, None, emulate, False, 5, 2, ids, ids, sinks)
    torch.library.opcheck(torch.ops.megakernels.flash_attn_fwd.default, args)
    out, lse = torch.ops.megakernels.flash_attn_fwd(*args)
    torch.library.opcheck(torch.ops.megakernels.flash_attn_bwd.default, (do, q, k, v, out, lse, *args[3:]))
    leaves = tuple(t.clone().requires_grad_(True) for t in (q, k, v))
    torch.library.opcheck(
        torch.ops.megakernels.flash_attn_fwd.default, leaves + args[3:-1] + (sinks.clone().requires_grad_(),)
    )


def test_empty_sequences_keep_the_sinks_in_the_graph():
    q = torch.randn(1, 3, 2, 8, requires_grad=True)
    k = torch.randn(1, 0, 2, 8, requires_grad=True)
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    out, lse = flash_attention(q, k, k, sinks=sinks, return_lse=True)
    assert (out == 0).all() and torch.equal(lse, sinks.detach()[None, :, None].expand(1, 2, 3))
    out.sum().backward()
    assert torch.equal(sinks.grad, torch.zeros(2))


@pytest.mark.parametrize(
    ("sinks", "error", "match"),
    [
        ([0.0, 0.0], TypeError, "sinks must be a torch.Tensor"),
        (torch.zeros(3), ValueError, r"sinks must have shape \[heads\] = \[2\]"),
        (torch.zeros(1, 2), ValueError, r"sinks must have shape \[heads\] = \[2\]"),
        (torch.zeros(2, dtype=torch.bfloat16), ValueError, "sinks must be float32"),
        (torch.zeros(2, dtype=torch.float64), ValueError, "sinks must be float32"),
        (torch.zeros(2, device="meta"), ValueError, "sinks is on meta, expected q's device cpu"),
    ],
)
def test_bad_sinks_are_refused_by_name(sinks, error, match):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(error, match=match):
        flash_attention(q, q, q, sinks=sinks)


def test_cpu_kernel_refuses_bad_sinks():
    q = torch.zeros(1, 8, 2, 16)
    for bad in (torch.zeros(3), torch.zeros(2, dtype=torch.float16)):
        with pytest.raises(ValueError, match=r"sinks must be a CPU float32 \[heads\] = \[2\]"):
            torch.ops.megakernels.flash_attn_fwd_cpu(q, q, q, True, 1.0, 0, 0, None, 0.0, 0, bad)
    out, lse = torch.ops.megakernels.flash_attn_fwd_cpu(q, q, q, True, 1.0, 0, 0, None, 0.0, 0, torch.zeros(2))
    into = torch.ops.megakernels.flash_attn_bwd_cpu_into
    grads = (torch.empty_like(q), torch.empty_like(q), torch.empty_like(q))
    with pytest.raises(ValueError, match="sinks and dsinks go together"):
        into(q, q, q, q, out, lse, True, 1.0, 0, 0, None, 0.0, 0, *grads, torch.zeros(2), None)
