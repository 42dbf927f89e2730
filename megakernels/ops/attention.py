"""FlashAttention (the FlashAttention-2 algorithm): ``softmax(q k^T * scale [+ causal mask]) v`` without ever
materialising the ``[sq, sk]`` attention matrix, forward and backward.

Layout ``[batch, seqlen, heads, head_dim]`` as flash-attn. Grouped-query / multi-query attention: k and v may
have fewer heads than q (``heads_q % heads_kv == 0``); query head ``i`` reads k/v head ``i // (heads_q /
heads_kv)``. Causal masking is aligned to the bottom-right corner: query ``i`` sees key ``j`` iff
``j <= i + sk - sq``, so with ``sq < sk`` the queries are the last positions of the keys (decoding), and with
``sq > sk`` the first ``sq - sk`` queries see nothing and output zeros (lse ``-inf``).

Sliding window (``window=w``, Mistral): with ``rel = i + sk - sq - j`` (how far key ``j`` lies behind query ``i``,
bottom-right aligned), causal attention sees ``0 <= rel < w`` — HuggingFace Mistral's ``i - w < j <= i``, flash-attn's
``window_size=(w - 1, 0)``: the query itself and the ``w - 1`` keys before it — and non-causal attention the
symmetric band ``|rel| < w`` (flash-attn's ``(w - 1, w - 1)``, which HuggingFace's flash-attention path passes; its
eager bidirectional overlay takes ``|rel| <= w`` instead). The kernels visit only the key blocks that meet the band,
so the cost grows with ``w``, not with the sequence. The custom ops also take a ``shift`` added to ``sk - sq`` (with a
window only): context parallelism (megakernels/parallel/context.py) attends chunks at any absolute offset.

Dispatch (docs/design.md §2): CUDA tensors run the Triton kernels (megakernels/triton/flash_attention.py, fp16/bf16/
fp32); CPU tensors run the blocked CPU path (megakernels/ops/_attention_cpu.py, memory O(block * sk)); under
``megakernels.backend("cuda_emu")`` CPU tensors run the *Triton* kernels through Triton's interpreter (which needs
``TRITON_INTERPRET=1`` before megakernels.triton is imported).

Dropout (``dropout_p > 0``): the keep-mask is a counter hash of (seed, batch*heads + head, query, key) that the
backward regenerates; the seed is drawn from the device's default generator (or ``generator``) as a device tensor,
so runs are reproducible under ``torch.manual_seed``, never sync the host, and follow an RNG tracker's fork. The
same seed gives the same mask on every device (``dropout_mask`` returns it).
"""

from __future__ import annotations

import math
import numbers

import torch

from megakernels._backend import emulate_for, runs_triton
from megakernels.ops import _checks

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_TRITON_HEAD_DIM = 256


def _triton_kernels():
    try:
        from megakernels.triton import flash_attention as kernels
    except ImportError as e:  # pragma: no cover - a torch without Triton
        raise RuntimeError(f"flash_attention: CUDA tensors need Triton, which failed to import ({e})") from e
    return kernels


def _host_seed(seed: torch.Tensor | None) -> int:
    return int(seed.item()) if seed is not None else 0


def _check_shift(window: int, shift: int) -> None:
    if shift and not window:
        raise ValueError(f"flash_attention: shift={shift} moves a sliding window's diagonal; it needs window > 0")


@torch.library.custom_op("megakernels::flash_attn_fwd", mutates_args=())
def _flash_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    dropout_p: float,
    seed: torch.Tensor | None,
    emulate: bool,
    deterministic: bool = False,
    window: int = 0,
    shift: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_shift(window, shift)
    if runs_triton("flash_attention", q, emulate):
        return _triton_kernels().forward(q, k, v, causal, scale, dropout_p, seed, window, shift)
    from megakernels.ops import _attention_cpu

    return _attention_cpu.forward(q, k, v, causal, scale, dropout_p, _host_seed(seed), window, shift)


@_flash_attn_fwd.register_fake
def _(q, k, v, causal, scale, dropout_p, seed, emulate, deterministic=False, window=0, shift=0):
    _checks.same_device("flash_attention", "q", q, ("k", k), ("v", v))
    b, sq, h, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty((b, h, sq), dtype=lse_dtype)


@torch.library.custom_op("megakernels::flash_attn_bwd", mutates_args=())
def _flash_attn_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    dropout_p: float,
    seed: torch.Tensor | None,
    emulate: bool,
    deterministic: bool = False,
    window: int = 0,
    shift: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_shift(window, shift)
    if runs_triton("flash_attention", q, emulate):
        return _triton_kernels().backward(
            grad_out, q, k, v, out, lse, causal, scale, dropout_p, seed, deterministic, window, shift
        )
    from megakernels.ops import _attention_cpu

    return _attention_cpu.backward(
        grad_out, q, k, v, out, lse, causal, scale, dropout_p, _host_seed(seed), window, shift
    )


@_flash_attn_bwd.register_fake
def _(grad_out, q, k, v, out, lse, causal, scale, dropout_p, seed, emulate, deterministic=False, window=0, shift=0):
    _checks.same_device(
        "flash_attention_backward", "q", q, ("grad_out", grad_out), ("k", k), ("v", v), ("out", out), ("lse", lse)
    )
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, dropout_p, seed, emulate, deterministic, window, shift = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seed)
    ctx.causal, ctx.scale, ctx.dropout_p, ctx.emulate = causal, scale, dropout_p, emulate
    ctx.deterministic, ctx.window, ctx.shift = deterministic, window, shift
    ctx.set_materialize_grads(True)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, seed = ctx.saved_tensors
    dq, dk, dv = _flash_attn_bwd(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        ctx.causal,
        ctx.scale,
        ctx.dropout_p,
        seed,
        ctx.emulate,
        ctx.deterministic,
        ctx.window,
        ctx.shift,
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None


_flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def check_window(op: str, window) -> int:
    """``window`` as the kernels take it: None or 0 (full attention) as 0, else a positive int.

    Raises:
        ValueError: anything else, naming ``op``."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0:
        raise ValueError(f"{op}: window must be a positive int, or None or 0 (full attention), got {window!r}")
    return int(window)


def _check(q, k, v, softmax_scale, dropout_p) -> float:
    op = "flash_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.tensor(op, name, t)
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D [batch, seqlen, heads, head_dim], got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{op}: {name} has dtype {t.dtype}, expected q's dtype {q.dtype}")
    _checks.same_device(op, "q", q, ("k", k), ("v", v))
    if k.shape != v.shape:
        raise ValueError(f"{op}: v has shape {tuple(v.shape)}, expected k's shape {tuple(k.shape)}")
    b, _, h, d = q.shape
    if k.shape[0] != b:
        raise ValueError(f"{op}: k has batch {k.shape[0]}, expected q's batch {b}")
    if k.shape[3] != d:
        raise ValueError(f"{op}: k has head_dim {k.shape[3]}, expected q's head_dim {d}")
    hk = k.shape[2]
    if hk == 0 or h % hk != 0:
        raise ValueError(
            f"{op}: q has {h} heads, which is not a multiple of k/v's {hk} heads (grouped-query "
            "attention needs heads_q % heads_kv == 0)"
        )
    allowed = _TRITON_DTYPES if q.device.type == "cuda" else _CPU_DTYPES
    if q.dtype not in allowed:
        raise ValueError(
            f"{op}: q has dtype {q.dtype}; supported on {q.device.type}: {', '.join(str(t) for t in allowed)}"
        )
    if q.device.type == "cuda" and (d % 8 != 0 or d > MAX_TRITON_HEAD_DIM or d == 0):
        raise ValueError(
            f"{op}: head_dim {d} is not supported on CUDA (a multiple of 8, at most {MAX_TRITON_HEAD_DIM})"
        )
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    elif (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, numbers.Real)
        or not math.isfinite(softmax_scale)
    ):
        raise ValueError(f"{op}: softmax_scale must be a finite real number or None, got {softmax_scale!r}")
    else:
        scale = float(softmax_scale)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{op}: dropout_p must be in [0, 1), got {dropout_p!r}")
    return scale


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def draw_seed(device, generator: torch.Generator | None = None) -> torch.Tensor:
    """A fresh dropout seed: an int64 scalar tensor on ``device`` drawn from its generator (no host sync)."""
    return torch.randint(0, 2**62, (), device=device, dtype=torch.int64, generator=generator)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    generator: torch.Generator | None = None,
    deterministic: bool = False,
    window: int | None = None,
):
    """Exact attention ``softmax(q k^T * softmax_scale) v`` per head, memory linear in the sequence length.

    Args:
        q: ``[batch, sq, heads, head_dim]``; k, v: ``[batch, sk, heads_kv, head_dim]`` with ``heads % heads_kv
            == 0`` (GQA/MQA). Same dtype and device; fp16/bf16/fp32 on CUDA (head_dim a multiple of 8, <= 256),
            also fp64 on CPU. The last dim must be contiguous (other strides are free; it is copied otherwise).
        causal: bottom-right aligned causal mask (query i sees key j iff ``j <= i + sk - sq``).
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        dropout_p: attention-probability dropout in [0, 1); pass 0 in evaluation.
        return_lse: also return the row log-sum-exp ``[batch, heads, sq]`` (fp32; ``-inf`` for a query that
            sees no key).
        generator: where the dropout seed is drawn from (default: the device's default generator).
        deterministic: the Triton backward gives the same bits on every run (dQ from its own kernel, which recomputes
            the scores: seven matmuls instead of five);
            by default dQ is accumulated with fp32 atomics, whose order varies. The CPU path is always
            deterministic.
        window: sliding-window attention over the last ``window`` keys, the query's own included (causal: query i
            sees key j iff ``i + sk - sq - window < j <= i + sk - sq``, HuggingFace Mistral's ``sliding_window``);
            without causality the band ``|i + sk - sq - j| < window``. None: every key (as a window at least the
            sequence long; so is 0). Key blocks outside the band are skipped: the cost grows with the window.

    Returns:
        ``out`` ``[batch, sq, heads, head_dim]`` in q's dtype (and ``lse`` when asked); differentiable w.r.t.
        q, k, v.

    Raises:
        TypeError for a non-tensor; ValueError naming the argument for wrong rank, dtype or device mismatches,
        k/v shape mismatch, heads not divisible, unsupported head dim, bad softmax_scale, dropout_p or window.
    """
    scale = _check(q, k, v, softmax_scale, dropout_p)
    window = check_window("flash_attention", window)
    if window >= max(q.shape[1], k.shape[1]):  # the band holds every (query, key) pair: the kernel without one
        window = 0
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    emulate = emulate_for("flash_attention", q, "q")
    seed = draw_seed(q.device, generator) if dropout_p > 0.0 else None  # no launch without dropout
    if q.numel() == 0 or k.shape[1] == 0:
        out = torch.zeros_like(q) + 0.0 * (q.sum() + k.sum() + v.sum())  # keeps the autograd graph
        lse = torch.full(q.shape[:1] + q.shape[2:3] + q.shape[1:2], float("-inf"), device=q.device)
        return (out, lse) if return_lse else out
    out, lse = _flash_attn_fwd(
        q, k, v, bool(causal), scale, float(dropout_p), seed, emulate, bool(deterministic), window, 0
    )
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------------------------
# Reference semantics in plain PyTorch (tests; documentation).


def dropout_mask(seed: int, batch: int, heads: int, sq: int, sk: int, dropout_p: float, device=None) -> torch.Tensor:
    """The keep-mask ``[batch, heads, sq, sk]`` (bool) that flash_attention uses for ``seed`` on every device."""
    from megakernels.triton._common import dropout_keep_reference

    rows = torch.arange(batch * heads * sq, device=device)
    return dropout_keep_reference(seed, rows, torch.arange(sk, device=device), dropout_p).view(batch, heads, sq, sk)


def window_mask(sq: int, sk: int, causal: bool, window: int | None = None, shift: int = 0, device=None) -> torch.Tensor:
    """``[sq, sk]`` bool, True where query i does *not* see key j: ``rel = i + sk - sq + shift - j`` outside
    ``0 <= rel`` (causal) and ``|rel| < window`` (a window); None where every key is seen."""
    if not causal and not window:
        return None
    rel = torch.arange(sq, device=device)[:, None] + (sk - sq + shift) - torch.arange(sk, device=device)[None, :]
    hidden = rel < 0 if causal else torch.zeros_like(rel, dtype=torch.bool)
    if window:
        hidden = hidden | (rel >= window) | (rel <= -window)
    return hidden


def flash_attention_reference(
    q, k, v, causal=False, softmax_scale=None, keep=None, dropout_p=0.0, compute_dtype=torch.float64, window=None
):
    """Materialising attention in ``compute_dtype``: returns (out ``[b, sq, h, d]``, lse ``[b, h, sq]``).

    ``keep`` (``[b, h, sq, sk]`` bool) applies dropout with scale ``1 / (1 - dropout_p)``; ``window`` as
    ``flash_attention``'s. Queries that see no key give zeros and lse -inf."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    qc = q.to(compute_dtype).transpose(1, 2)
    kc = k.to(compute_dtype).transpose(1, 2).repeat_interleave(h // hk, 1)
    vc = v.to(compute_dtype).transpose(1, 2).repeat_interleave(h // hk, 1)
    s = torch.matmul(qc, kc.transpose(-1, -2)) * scale
    hidden = window_mask(sq, sk, causal, window, device=q.device)
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None])
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    return torch.matmul(p, vc).transpose(1, 2), lse
