"""linear_cross_entropy (the LM head GEMM fused with the cross-entropy, chunked over tokens) against F.linear +
F.cross_entropy(reduction="none") in fp64: the loss and the gradients of hidden, weight and bias, on the CPU path
(cpu), with the cross-entropy pieces on the Triton kernels under the interpreter (cuda_emu) and on the GPU (cuda);
label smoothing, ignore_index, padding columns (vocab_size), chunks that do and do not divide the tokens, empty
input, bad input named; opcheck of its custom ops; torch.compile; and that its peak memory does not grow with the
tokens' count times the vocabulary (every allocation recorded, inside the custom ops too)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megakernels.ops import cross_entropy, linear_cross_entropy
from megakernels.ops.linear_cross_entropy import (
    default_chunk_tokens,
    grad_chunks,
    linear_cross_entropy_reference,
    stats_chunks,
)

# Relative to the largest reference value. 16-bit: the logits and the gradient are rounded to the dtype, as the
# unfused head rounds them (F.linear's output and ops.cross_entropy's gradient are in the dtype).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _case(t, h, v, dtype, device, seed=0, bias=False, n_real=None, ignore=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype=dtype, device=device)
    w = (torch.randn(v, h, generator=g) / h**0.5 * 3).to(dtype=dtype, device=device)
    b = (torch.randn(v, generator=g)).to(dtype=dtype, device=device) if bias else None
    target = torch.randint(0, n_real or v, (t,), generator=g)
    target[list(ignore)] = -100
    return x, w, b, target.to(device)


def _rel(a, b):
    scale = max(b.abs().max().item(), 1e-30) if b.numel() else 1.0
    return (a.double().cpu() - b.cpu()).abs().max().item() / scale if a.numel() else 0.0


def _check(x, w, b, target, dloss, **kw):
    """The op's loss and gradients against the fp64 reference; returns (loss, dx, dw, db)."""
    leaves = [a.detach().clone().requires_grad_(True) if a is not None else None for a in (x, w, b)]
    xs, ws, bs = leaves
    loss = linear_cross_entropy(xs, ws, target, bias=bs, **kw)
    loss.backward(dloss)
    ref_leaves = [a.detach().double().requires_grad_(True) if a is not None else None for a in (x, w, b)]
    xr, wr, br = ref_leaves
    kw.pop("chunk_tokens", None)
    ref = linear_cross_entropy_reference(xr, wr, target.long(), bias=br, **kw)  # softcap included
    ref.backward(dloss.double())
    tol = TOL[x.dtype]
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    assert _rel(loss, ref) <= tol, ("loss", _rel(loss, ref))
    for name, got, want in (("dx", xs, xr), ("dw", ws, wr), ("db", bs, br)):
        if got is not None:
            assert got.grad.dtype == got.dtype and got.grad.shape == got.shape
            assert _rel(got.grad, want.grad) <= tol, (name, _rel(got.grad, want.grad))
    return loss, xs.grad, ws.grad, None if bs is None else bs.grad


DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # no tl.dot in the cross-entropy kernels: bf16 under the
# interpreter too


# every chunking once with each smoothing (7 does not divide 37 tokens; 37 is one chunk); the rest of the product in
# the slow set
GRID = [(None, 0.0), (7, 0.1), (37, 0.0), (1, 0.1)]
REST = [(c, s) for c in (None, 7, 37, 1) for s in (0.0, 0.1) if (c, s) not in GRID]


@pytest.mark.parametrize(
    "chunk, label_smoothing", GRID + [pytest.param(*case, marks=pytest.mark.slow) for case in REST]
)
def test_matches_fp64_reference(triton_backend, chunk, label_smoothing):
    dev = triton_backend.device
    for dtype in DTYPES:
        x, w, _, t = _case(37, 24, 301, dtype, dev, ignore=[0, 20], n_real=290)
        dloss = torch.randn(37, generator=torch.Generator().manual_seed(1)).to(dev)
        loss, dx, dw, _ = _check(
            x, w, None, t, dloss, chunk_tokens=chunk, label_smoothing=label_smoothing, vocab_size=290
        )
        assert loss[0].item() == 0 and loss[20].item() == 0 and (dx[0] == 0).all()  # ignored tokens
        assert (dw[290:] == 0).all()  # padding rows of the weight: no gradient


def test_softcap_matches_the_capped_fp64_reference(triton_backend):
    """The final-logit soft cap inside the row kernels: the loss of ``c tanh(logits / c)`` and the gradients with
    respect to the raw logits' inputs (the logits scaled up so that the cap bends them), with label smoothing,
    padding columns, a bias, an ignored token and chunks that do not divide the tokens."""
    for dtype in DTYPES:
        x, w, b, t = _case(19, 16, 300, dtype, triton_backend.device, bias=True, n_real=260, ignore=[5])
        w = w * 8  # logits of tens: the cap (c = 15) matters
        dloss = torch.randn(19, device=triton_backend.device)
        _check(x, w, b, t, dloss, chunk_tokens=7, softcap=15.0, label_smoothing=0.1, vocab_size=260)


def test_padding_columns_are_excluded(triton_backend):
    dev = triton_backend.device
    x, w, b, t = _case(16, 8, 300, torch.float32, dev, bias=True, n_real=256)
    with torch.no_grad():
        b[256:] = 60.0  # padding logits that would dominate the softmax were they not excluded
    _, _, dw, db = _check(x, w, b, t, torch.ones(16, device=dev), vocab_size=256, label_smoothing=0.1, chunk_tokens=5)
    assert (dw[256:] == 0).all() and (db[256:] == 0).all()


def test_bias_leading_dims_int32_target_and_ignore_index(triton_backend):
    dev = triton_backend.device
    x, w, b, t = _case(2 * 5, 16, 64, torch.float32, dev, bias=True)
    t[::3] = 7
    _check(x.view(2, 5, 16), w, b, t.view(2, 5).int(), torch.rand(2, 5, device=dev), ignore_index=7, chunk_tokens=3)


def test_equals_the_unfused_megakernels_head_in_16_bit():
    """Same roundings as F.linear + ops.cross_entropy (the logits and their gradient in the dtype): the fused op
    is that composition, chunked."""
    for dtype in (torch.bfloat16, torch.float16):
        x, w, _, t = _case(40, 32, 200, dtype, "cpu", seed=3)
        xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        xu, wu = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        dloss = torch.rand(40)
        fused = linear_cross_entropy(xs, ws, t, chunk_tokens=40, label_smoothing=0.1)
        fused.backward(dloss)
        plain = cross_entropy(torch.nn.functional.linear(xu, wu), t, label_smoothing=0.1)
        plain.backward(dloss)
        assert torch.allclose(fused, plain, rtol=1e-6, atol=1e-6)
        assert torch.allclose(xs.grad.float(), xu.grad.float(), rtol=1e-2, atol=1e-3)
        assert torch.allclose(ws.grad.float(), wu.grad.float(), rtol=1e-2, atol=1e-3)


def test_only_some_inputs_need_grad():
    x, w, b, t = _case(9, 8, 30, torch.float32, "cpu", bias=True)
    xr, wr = x.double().requires_grad_(True), w.double().requires_grad_(True)
    linear_cross_entropy_reference(xr, wr, t, bias=b.double()).sum().backward()
    ws = w.clone().requires_grad_(True)
    linear_cross_entropy(x, ws, t, bias=b, chunk_tokens=4).sum().backward()
    assert _rel(ws.grad, wr.grad) <= 1e-5
    xs = x.clone().requires_grad_(True)
    linear_cross_entropy(xs, w, t, bias=b, chunk_tokens=4).sum().backward()
    assert _rel(xs.grad, xr.grad) <= 1e-5


def test_empty_input():
    x, w, b, _ = _case(0, 8, 30, torch.float32, "cpu", bias=True)
    xs, ws, bs = (a.clone().requires_grad_(True) for a in (x, w, b))
    loss = linear_cross_entropy(xs, ws, torch.zeros(0, dtype=torch.long), bias=bs)
    assert loss.shape == (0,)
    loss.sum().backward()
    assert xs.grad.shape == (0, 8) and (ws.grad == 0).all() and (bs.grad == 0).all()


def test_meta_tensors_give_shapes():
    x = torch.empty(3, 5, 8, device="meta")
    w = torch.empty(30, 8, device="meta")
    loss = linear_cross_entropy(x, w, torch.empty(3, 5, dtype=torch.long, device="meta"))
    assert loss.shape == (3, 5) and loss.device.type == "meta"


def test_default_chunk():
    assert default_chunk_tokens(128256) == 512  # Llama 3's vocabulary on one rank: 512 x 128256 x 4 B <= 256 MiB
    assert default_chunk_tokens(128256 // 8) == 4096
    assert default_chunk_tokens(1 << 30) == 1


def test_torch_compile_fullgraph():
    x, w, b, t = _case(9, 8, 50, torch.float32, "cpu", bias=True)
    fn = torch.compile(
        lambda a, c, d, e: linear_cross_entropy(a, c, e, bias=d, label_smoothing=0.1, chunk_tokens=4).mean(),
        fullgraph=True,
        backend="aot_eager",
    )
    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    fn(xs, ws, b, t).backward()
    xr, wr = x.double().requires_grad_(True), w.double().requires_grad_(True)
    linear_cross_entropy_reference(xr, wr, t, bias=b.double(), label_smoothing=0.1).mean().backward()
    assert _rel(xs.grad, xr.grad) <= 1e-5 and _rel(ws.grad, wr.grad) <= 1e-5


def _op_args(emulate, dtype=torch.float32):
    x, w, b, t = _case(10, 8, 40, dtype, "cpu", bias=True, n_real=36)
    lse = torch.randn(10).abs() + 3.0
    dloss = torch.randn(10)
    stats = (x, w, b, t, 0, 36, 3, 0.0, emulate)
    grad = (x, w, b, t, lse, dloss, 0, 36, -100, 0.9, 0.1 / 36, 3, 0.0, emulate, True, True)
    grad_no_bias = (x, w, None, t, lse, dloss, 0, 36, -100, 1.0, 0.0, 4, 5.0, emulate, True, False)  # capped
    return stats, grad, grad_no_bias


def test_opcheck_cpu_path():
    stats, grad, grad_no_bias = _op_args(False)
    torch.library.opcheck(torch.ops.megakernels.linear_cross_entropy_stats, stats)
    torch.library.opcheck(torch.ops.megakernels.linear_cross_entropy_grad, grad)
    torch.library.opcheck(torch.ops.megakernels.linear_cross_entropy_grad, grad_no_bias)


def test_opcheck_triton_path_under_the_interpreter(triton_backend):
    if triton_backend.name != "cuda_emu":
        pytest.skip("the Triton path on CPU tensors is the cuda_emu backend")
    stats, grad, _ = _op_args(True, torch.float16)
    torch.library.opcheck(torch.ops.megakernels.linear_cross_entropy_stats, stats)
    torch.library.opcheck(torch.ops.megakernels.linear_cross_entropy_grad, grad)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda x, w, t: (x.tolist(), w, t), "hidden must be a torch.Tensor"),
        (lambda x, w, t: (x.double(), w, t), "hidden must be \\[..., h\\] fp32/bf16/fp16"),
        (lambda x, w, t: (x, w[:, :4], t), "weight must be \\[V_local, h\\] with h = hidden's last dimension \\(8\\)"),
        (lambda x, w, t: (x, w.half(), t), "weight has dtype torch.float16, expected hidden's torch.float32"),
        (lambda x, w, t: (x, w, t[:-1]), "target has shape \\(5,\\), expected hidden's leading shape \\(6,\\)"),
        (lambda x, w, t: (x, w, t.float()), "target must be an integer"),
        (lambda x, w, t: (x, w, t.clone().fill_(30)), "target holds 30, outside \\[0, 30\\)"),
        (lambda x, w, t: (x, w.to("meta"), t), "weight is on meta but hidden is on cpu"),
    ],
)
def test_bad_input_names_the_argument(make, message):
    x, w, _, t = _case(6, 8, 30, torch.float32, "cpu")
    with pytest.raises((TypeError, ValueError), match=message):
        linear_cross_entropy(*make(x, w, t))


def test_bad_options_name_the_argument():
    x, w, b, t = _case(6, 8, 30, torch.float32, "cpu", bias=True)
    cases = [
        (dict(chunk_tokens=0), "chunk_tokens must be a positive int or None, got 0"),
        (dict(chunk_tokens=2.0), "chunk_tokens must be a positive int"),
        (dict(label_smoothing=-0.1), "label_smoothing must be in \\[0, 1\\]"),
        (dict(softcap=0.0), "softcap must be a positive finite number or None, got 0.0"),
        (dict(softcap=float("inf")), "softcap must be a positive finite number"),
        (dict(vocab_size=31), "vocab_size must be an int in \\[1, 30\\] \\(the weight's rows hold 30 columns\\)"),
        (dict(ignore_index=1.5), "ignore_index"),
        (dict(bias=b[:-1]), "bias must be \\[V_local\\] = \\[30\\]"),
        (dict(bias=b.half()), "bias must be .* dtype torch.float16"),
        (dict(group="tp"), "group must be a torch.distributed ProcessGroup or None"),
        (dict(sequence_parallel=True), "sequence_parallel=True needs group"),
        (dict(vocab_size=20), "target holds 2[0-9], outside \\[0, 20\\)"),
    ]
    t = t.clone()
    t[0] = 25
    for kw, message in cases:
        with pytest.raises((TypeError, ValueError), match=message):
            linear_cross_entropy(x, w, t, **kw)


class _LiveBytes(TorchDispatchMode):
    """Every tensor allocated while active (outputs of every op, and of the ATen ops inside the fused op's custom
    ops, which it runs under itself), by storage: the live bytes' peak and the largest allocation."""

    def __init__(self):
        super().__init__()
        self.live, self.current, self.peak, self.largest = {}, 0, 0, 0

    def _free(self, key):
        self.current -= self.live.pop(key)

    def track(self, out):
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size == 0 or key in self.live:
                    continue
                self.live[key] = size
                self.current += size
                self.peak, self.largest = max(self.peak, self.current), max(self.largest, size)
                weakref.finalize(storage, self._free, key)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.track(func(*args, **(kwargs or {})))


STATS_OP, GRAD_OP = "megakernels::linear_cross_entropy_stats", "megakernels::linear_cross_entropy_grad"


@torch.library.register_torch_dispatch(STATS_OP, _LiveBytes)
def _(mode, func, types, args, kwargs):
    with mode:  # the chunk loop's own allocations are recorded too
        return mode.track(stats_chunks(*args, **kwargs))


@torch.library.register_torch_dispatch(GRAD_OP, _LiveBytes)
def _(mode, func, types, args, kwargs):
    with mode:
        return mode.track(grad_chunks(*args, **kwargs))


def _peak(tokens, fused, h=4, v=2048, chunk=64):
    x, w, _, t = _case(tokens, h, v, torch.float32, "cpu")
    x.requires_grad_(True)
    w.requires_grad_(True)
    mode = _LiveBytes()
    with mode:
        if fused:
            loss = linear_cross_entropy(x, w, t, chunk_tokens=chunk)
        else:
            loss = torch.nn.functional.cross_entropy(x @ w.t(), t, reduction="none")
        loss.sum().backward()
    return mode.peak, mode.largest


def test_peak_memory_does_not_grow_with_tokens_times_vocab():
    h, v, chunk = 4, 2048, 64
    chunk_logits = chunk * v * 4
    small, large = _peak(1024, True), _peak(8192, True)
    # The largest allocation is one chunk's logits whatever the tokens (the unfused head's is all of them).
    assert small[1] == large[1] == chunk_logits, (small, large)
    # Peak live bytes grow by the per-token tensors only (dX [T, h], loss, lse, the [T, 4] statistics, dloss: a
    # few dozen bytes a token), not by the logits' v * 4 = 8 KiB a token.
    per_token = (large[0] - small[0]) / (8192 - 1024)
    assert per_token <= 4 * h + 64, per_token
    assert large[0] <= 8192 * (4 * h + 64) + 3 * chunk_logits + 3 * v * h * 4, large
    unfused = _peak(8192, False)
    assert unfused[1] >= 8192 * v * 4 and unfused[0] > 10 * large[0]  # the measurement sees the logits when present
