"""FlashAttention (the FlashAttention-2 algorithm): ``softmax(q k^T * scale [+ causal mask]) v`` without ever
materialising the ``[sq, sk]`` attention matrix, forward and backward.

Layout ``[batch, seqlen, heads, head_dim]`` as flash-attn; v (so the output and its gradient) may have a head dim
of its own (``d_v != d_qk``, multi-head latent attention), the scale defaulting to q's. Grouped-query / multi-query
attention: k and v may have fewer heads than q (``heads_q % heads_kv == 0``); query head ``i`` reads k/v head
``i // (heads_q / heads_kv)``. Causal masking is aligned to the bottom-right corner: query ``i`` sees key ``j`` iff
``j <= i + sk - sq``, so with ``sq < sk`` the queries are the last positions of the keys (decoding), and with
``sq > sk`` the first ``sq - sk`` queries see nothing and output zeros (lse ``-inf``).

Sliding window (``window=w``, Mistral): with ``rel = i + sk - sq - j`` (how far key ``j`` lies behind query ``i``,
bottom-right aligned), causal attention sees ``0 <= rel < w`` — HuggingFace Mistral's ``i - w < j <= i``, flash-attn's
``window_size=(w - 1, 0)``: the query itself and the ``w - 1`` keys before it — and non-causal attention the
symmetric band ``|rel| < w`` (flash-attn's ``(w - 1, w - 1)``, which HuggingFace's flash-attention path passes; its
eager bidirectional overlay takes ``|rel| <= w`` instead). The kernels visit only the key blocks that meet the band,
so the cost grows with ``w``, not with the sequence. The custom ops also take a ``shift`` added to ``sk - sq`` (with a
window only): context parallelism (megakernels/parallel/context.py) attends chunks at any absolute offset.

Packed documents (``documents=``, and ``flash_attention_varlen`` over it): query i sees key j only if their
document ids are equal, on top of the rules above. Ids are non-decreasing, so each token's same-document tokens on
the other side are one span (``document_ranges``); the kernels cut every query block's keys (and every key block's
queries, in the backward) to the spans of its documents, so other documents' blocks are never visited. The custom
ops take the ids as ``q_docs``/``k_docs`` after ``shift``.

Attention sinks (``sinks=``, gpt-oss): a learnable logit per query head joins every row's softmax denominator as a
column of logit ``sinks[h]`` (not scaled by ``softmax_scale``) and value zero: ``P = exp(S - lse)`` with ``lse =
log(sum_j exp(S_j) + exp(sinks[h]))``, so a row's probabilities sum to ``1 - P_sink``. The forward adds the column
after the key blocks (one more term in the online softmax), the lse it returns includes it, so the backward of q, k
and v is unchanged (``delta = rowsum(dO * O)`` already sums over the sink, whose value is zero), and
``dsinks[h] = -sum over the head's rows of P_sink * delta`` is reduced in fp32 beside delta. The custom ops take the
sinks last; without them (None) every kernel is the one without sinks.

Dispatch (docs/design.md §2): CUDA tensors run the Triton kernels (megakernels/triton/flash_attention.py, fp16/bf16/
fp32); CPU tensors run the C++ FlashAttention kernel (csrc/flash_attention: ``torch.ops.megakernels.flash_attn_fwd_cpu``
/ ``flash_attn_bwd_cpu``) when it covers the call (causal or not, windows, documents, dropout, sinks; fp32/bf16/fp16,
head_dim <= 256), else the blocked CPU path (megakernels/ops/_attention_cpu.py, memory O(block * sk)); under
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
from megakernels.ops._attention_out import empty_out
from megakernels.ops._autograd import eager_autograd
from megakernels.ops._sinks import no_sinks_grad

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


def document_ranges(q_docs: torch.Tensor | None, k_docs: torch.Tensor | None):
    """The kernels' view of document ids (non-decreasing along the sequence, so a document is a contiguous run):
    ``(q_keys [b, sq, 2], k_queries [b, sk, 2])`` int32, where query i sees keys ``[q_keys[b, i, 0], q_keys[b, i,
    1])`` (those with its id) and key j is seen by queries ``[k_queries[b, j, 0], k_queries[b, j, 1])``; None
    without documents. Computed on the ids' device by binary search (no host sync). A block of rows sees the keys
    from its first row's start to its last row's end, and every key from its last row's start to its first row's
    end: the kernels' loop bounds and masks come from these."""
    if q_docs is None and k_docs is None:
        return None
    if q_docs is None or k_docs is None:
        raise ValueError("flash_attention: q_docs and k_docs go together (both or neither)")
    qd, kd = q_docs.to(torch.int64).contiguous(), k_docs.to(torch.int64).contiguous()

    def spans(seq, values):
        lo = torch.searchsorted(seq, values, right=False)
        hi = torch.searchsorted(seq, values, right=True)
        return torch.stack((lo, hi), -1).to(torch.int32).contiguous()

    return spans(kd, qd), spans(qd, kd)


def _cpp_kernel_covers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a CPU call runs the C++ kernel (csrc/flash_attention: causal or not, sliding windows, packed
    documents, dropout; v's head dim may differ) rather than megakernels/ops/_attention_cpu.py, which keeps fp64 and
    head dims over 256."""
    dims_ok = 1 <= q.shape[-1] <= MAX_TRITON_HEAD_DIM and 1 <= v.shape[-1] <= MAX_TRITON_HEAD_DIM
    return q.dtype in _TRITON_DTYPES and dims_ok and q.shape[1] > 0 and k.shape[1] > 0


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
    q_docs: torch.Tensor | None = None,
    k_docs: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_shift(window, shift)
    ranges = document_ranges(q_docs, k_docs)
    if runs_triton("flash_attention", q, emulate):
        return _triton_kernels().forward(q, k, v, causal, scale, dropout_p, seed, window, shift, ranges, sinks)
    if _cpp_kernel_covers(q, k, v):
        q_keys = ranges[0] if ranges is not None else None
        return torch.ops.megakernels.flash_attn_fwd_cpu(
            q, k, v, causal, scale, window, shift, q_keys, dropout_p, _host_seed(seed), sinks
        )
    from megakernels.ops import _attention_cpu

    return _attention_cpu.forward(q, k, v, causal, scale, dropout_p, _host_seed(seed), window, shift, ranges, sinks)


@_flash_attn_fwd.register_fake
def _(
    q,
    k,
    v,
    causal,
    scale,
    dropout_p,
    seed,
    emulate,
    deterministic=False,
    window=0,
    shift=0,
    q_docs=None,
    k_docs=None,
    sinks=None,
):
    _checks.same_device("flash_attention", "q", q, ("k", k), ("v", v), ("sinks", sinks))
    b, sq, h, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return empty_out(q, v.shape[-1]), q.new_empty((b, h, sq), dtype=lse_dtype)


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
    q_docs: torch.Tensor | None = None,
    k_docs: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_shift(window, shift)
    ranges = document_ranges(q_docs, k_docs)
    if runs_triton("flash_attention", q, emulate):
        return _triton_kernels().backward(
            grad_out, q, k, v, out, lse, causal, scale, dropout_p, seed, deterministic, window, shift, ranges, sinks
        )
    if _cpp_kernel_covers(q, k, v):
        q_keys = ranges[0] if ranges is not None else None
        return torch.ops.megakernels.flash_attn_bwd_cpu(
            grad_out, q, k, v, out, lse, causal, scale, window, shift, q_keys, dropout_p, _host_seed(seed), sinks
        )
    from megakernels.ops import _attention_cpu

    return _attention_cpu.backward(
        grad_out, q, k, v, out, lse, causal, scale, dropout_p, _host_seed(seed), window, shift, ranges, sinks
    )


@_flash_attn_bwd.register_fake
def _(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    causal,
    scale,
    dropout_p,
    seed,
    emulate,
    deterministic=False,
    window=0,
    shift=0,
    q_docs=None,
    k_docs=None,
    sinks=None,
):
    _checks.same_device(
        "flash_attention_backward",
        "q",
        q,
        ("grad_out", grad_out),
        ("k", k),
        ("v", v),
        ("out", out),
        ("lse", lse),
        ("sinks", sinks),
    )
    dsinks = torch.empty_like(sinks) if sinks is not None else no_sinks_grad(q)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, dropout_p, seed, emulate, deterministic, window, shift, q_docs, k_docs, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seed, q_docs, k_docs, sinks)
    ctx.causal, ctx.scale, ctx.dropout_p, ctx.emulate = causal, scale, dropout_p, emulate
    ctx.deterministic, ctx.window, ctx.shift = deterministic, window, shift
    ctx.set_materialize_grads(True)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, seed, q_docs, k_docs, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = _flash_attn_bwd(
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
        q_docs,
        k_docs,
        sinks,
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, dsinks if sinks is not None else None


_flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)
_flash_attn_fwd_eager = eager_autograd("flash_attn_fwd_eager", _flash_attn_fwd, _setup_context, _backward)


def check_window(op: str, window) -> int:
    """``window`` as the kernels take it: None or 0 (full attention) as 0, else a positive int.

    Raises:
        ValueError: anything else, naming ``op``."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0:
        raise ValueError(f"{op}: window must be a positive int, or None or 0 (full attention), got {window!r}")
    return int(window)


def check_sinks(op: str, sinks, q: torch.Tensor) -> torch.Tensor | None:
    """``sinks`` as the custom ops take it: None, or a ``[heads]`` tensor (q's heads: one sink logit per query
    head), fp32 (fp64 with fp64 q), on q's device; made contiguous.

    Raises:
        TypeError: not a tensor. ValueError: wrong shape, dtype or device."""
    if sinks is None:
        return None
    _checks.tensor(op, "sinks", sinks)
    h = q.shape[2]
    if tuple(sinks.shape) != (h,):
        raise ValueError(
            f"{op}: sinks must have shape [heads] = [{h}] (one logit per query head), got {list(sinks.shape)}"
        )
    allowed = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
    if sinks.dtype not in allowed:
        raise ValueError(
            f"{op}: sinks must be float32{' or float64' if len(allowed) > 1 else ''} (fp32 logits), got {sinks.dtype}"
        )
    if sinks.device != q.device:
        raise ValueError(f"{op}: sinks is on {sinks.device}, expected q's device {q.device}")
    return sinks.contiguous()


def check_documents(op: str, documents, q: torch.Tensor, k: torch.Tensor):
    """``documents`` as the custom ops take it: None, or ``(q_docs [b, sq], k_docs [b, sk])`` (one ``[b, s]``
    tensor stands for both when sq == sk), int32 or int64 on q's device, non-decreasing along the sequence (checked
    for CPU tensors; on a GPU it would cost a host sync).

    Raises:
        TypeError: not a tensor or a pair of tensors. ValueError: wrong dtype, shape, device or order."""
    if documents is None:
        return None
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    if isinstance(documents, torch.Tensor):
        if sq != sk:
            raise ValueError(
                f"{op}: documents as one tensor needs sq == sk (got sq={sq}, sk={sk}); pass (q_docs, k_docs)"
            )
        pair = (("documents", documents, sq),)
    elif isinstance(documents, (tuple, list)) and len(documents) == 2:
        pair = (("documents[0] (q_docs)", documents[0], sq), ("documents[1] (k_docs)", documents[1], sk))
    else:
        raise TypeError(
            f"{op}: documents must be a [b, s] id tensor or a pair (q_docs [b, sq], k_docs [b, sk]), "
            f"got {type(documents).__name__}"
        )
    for name, t, s in pair:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{op}: {name} must be int32 or int64 document ids, got {t.dtype}")
        if tuple(t.shape) != (b, s):
            raise ValueError(f"{op}: {name} must have shape [batch, seqlen] = {[b, s]}, got {list(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device}, expected q's device {q.device}")
        if t.device.type != "cpu" or s < 2:
            continue
        decreasing = (t[:, 1:] < t[:, :-1]).any()
        if torch.compiler.is_compiling():  # no data-dependent branch in a graph: an asserting op instead
            torch._assert_async(torch.logical_not(decreasing), f"{op}: {name} must be non-decreasing")
        elif bool(decreasing):
            raise ValueError(
                f"{op}: {name} must be non-decreasing along the sequence (packed documents are contiguous runs)"
            )
    return (pair[0][1], pair[-1][1])


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
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"{op}: v has shape {tuple(v.shape)}, expected k's batch, seqlen and heads {tuple(k.shape[:3])} "
            "(v's head_dim may differ from q/k's)"
        )
    b, _, h, d = q.shape
    if k.shape[0] != b:
        raise ValueError(f"{op}: k has batch {k.shape[0]}, expected q's batch {b}")
    if k.shape[3] != d:
        raise ValueError(f"{op}: k has head_dim {k.shape[3]}, expected q's head_dim {d} (q.shape[-1] == k.shape[-1])")
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
    if q.device.type == "cuda":
        for name, dim in (("q/k", d), ("v", v.shape[3])):
            if dim % 8 != 0 or dim > MAX_TRITON_HEAD_DIM or dim == 0:
                raise ValueError(
                    f"{op}: {name} head_dim {dim} is not supported on CUDA (a multiple of 8, at most "
                    f"{MAX_TRITON_HEAD_DIM})"
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
    documents: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
):
    """Exact attention ``softmax(q k^T * softmax_scale) v`` per head, memory linear in the sequence length.

    Args:
        q: ``[batch, sq, heads, head_dim]``; k: ``[batch, sk, heads_kv, head_dim]`` (q's head_dim) with ``heads %
            heads_kv == 0`` (GQA/MQA); v: ``[batch, sk, heads_kv, head_dim_v]``, k's batch, seqlen and heads with
            a head dim of its own (multi-head latent attention: 192 / 128). Same dtype and device; fp16/bf16/fp32
            on CUDA (both head dims multiples of 8, <= 256), also fp64 on CPU. The last dim must be contiguous
            (other strides are free; it is copied otherwise).
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
        documents: document ids of packed sequences (document masking): one int32/int64 ``[batch, s]`` tensor
            (sq == sk: the same ids for queries and keys) or a pair ``(q_docs [batch, sq], k_docs [batch, sk])``.
            Query i sees key j only if ``q_docs[b, i] == k_docs[b, j]``, on top of ``causal`` and ``window``
            (which stay index-based). Ids must be non-decreasing along the sequence (each document one contiguous
            run; checked for CPU tensors). Key blocks wholly in other documents are skipped: the cost follows the
            sum of the squared document lengths, not the packed length squared. See ``flash_attention_varlen``.
        sinks: attention sinks (gpt-oss): fp32 ``[heads]``, one logit per query head (GQA: indexed by the query
            head), joining each row's softmax denominator as a key of that logit (not scaled by ``softmax_scale``)
            and a zero value: ``P = exp(S - lse)``, ``lse = log(sum_j exp(S_j) + exp(sinks[h]))``. Differentiable;
            the gradient is summed over batch and queries in fp32. A query that sees no key then gets output 0 and
            lse ``sinks[h]``. None: no sink (the kernels without one).

    Returns:
        ``out`` ``[batch, sq, heads, head_dim_v]`` in q's dtype (and ``lse`` when asked, the sinks included);
        differentiable w.r.t. q, k, v (and sinks).

    Raises:
        TypeError for a non-tensor; ValueError naming the argument for wrong rank, dtype or device mismatches,
        k's head_dim not q's, v's batch/seqlen/heads not k's, heads not divisible, unsupported head dim, bad
        softmax_scale, dropout_p, window, documents or sinks.
    """
    scale = _check(q, k, v, softmax_scale, dropout_p)
    window = check_window("flash_attention", window)
    sinks = check_sinks("flash_attention", sinks, q)
    docs = check_documents("flash_attention", documents, q, k)
    q_docs, k_docs = docs if docs is not None else (None, None)
    if window >= max(q.shape[1], k.shape[1]):  # the band holds every (query, key) pair: the kernel without one
        window = 0
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    emulate = emulate_for("flash_attention", q, "q")
    seed = draw_seed(q.device, generator) if dropout_p > 0.0 else None  # no launch without dropout
    if q.numel() == 0 or k.shape[1] == 0:
        touch = q.sum() + k.sum() + v.sum() + (sinks.sum() if sinks is not None else 0.0)
        out = q.new_zeros(q.shape[:3] + v.shape[3:]) + 0.0 * touch  # keeps the autograd graph
        lse = torch.full(q.shape[:1] + q.shape[2:3] + q.shape[1:2], float("-inf"), device=q.device)
        if sinks is not None:  # only the sink is seen
            lse = lse.to(sinks.dtype).copy_(sinks.detach()[:, None])
        return (out, lse) if return_lse else out
    out, lse = _flash_attn_fwd_eager(
        q,
        k,
        v,
        bool(causal),
        scale,
        float(dropout_p),
        seed,
        emulate,
        bool(deterministic),
        window,
        0,
        q_docs,
        k_docs,
        sinks,
    )
    return (out, lse) if return_lse else out


def _check_cu_seqlens(op: str, name: str, cu: torch.Tensor, total: int, max_name: str, max_seqlen) -> list | None:
    """Shape, dtype and (for CPU tensors) values of one ``cu_seqlens``; returns its values when on the CPU."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise ValueError(f"{op}: {name} must be int32 (flash-attn's convention), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{op}: {name} must be 1-D [n_docs + 1] with n_docs >= 1, got shape {list(cu.shape)}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral) or max_seqlen < 0:
        raise ValueError(f"{op}: {max_name} must be a non-negative int, got {max_seqlen!r}")
    if cu.device.type != "cpu":
        return None
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"{op}: {name} must start at 0, got {vals[0]}")
    if any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{op}: {name} must be non-decreasing (cumulative document lengths), got {vals}")
    if vals[-1] != total:
        raise ValueError(f"{op}: {name}'s last entry {vals[-1]} must equal the total tokens {total}")
    longest = max(b - a for a, b in zip(vals, vals[1:]))
    if longest > max_seqlen:
        raise ValueError(f"{op}: {max_name}={max_seqlen} is shorter than the longest document ({longest} tokens)")
    return vals


def _doc_ids(cu: torch.Tensor, total: int, device) -> torch.Tensor:
    """``[1, total]`` int32: the index of the document each token belongs to (empty documents hold no token)."""
    pos = torch.arange(total, device=cu.device, dtype=torch.int32)
    return (torch.searchsorted(cu, pos, right=True) - 1).to(device=device, dtype=torch.int32)[None]


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
    return_lse: bool = False,
    generator: torch.Generator | None = None,
    deterministic: bool = False,
    sinks: torch.Tensor | None = None,
):
    """Attention over packed variable-length sequences (flash-attn's varlen convention): document ``i`` is q rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` against k/v rows ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]``; no token
    sees another document's. ``flash_attention`` with ``documents`` at batch 1, so key blocks of other documents
    are skipped (the cost follows the sum of squared document lengths).

    Args:
        q: ``[total_q, heads, head_dim]``; k: ``[total_k, heads_kv, head_dim]``; v: ``[total_k, heads_kv,
            head_dim_v]`` (v's head dim may differ; dtypes, devices, GQA as ``flash_attention``).
        cu_seqlens_q, cu_seqlens_k: int32 ``[n_docs + 1]`` cumulative lengths, from 0 to total_q / total_k,
            non-decreasing (empty documents allowed). Their values are checked when they are CPU tensors (on a GPU
            that would cost a host sync; flash-attn does not check them either).
        max_seqlen_q, max_seqlen_k: the longest document's lengths (checked for CPU ``cu_seqlens``; not otherwise
            needed).
        causal: causal within each document, bottom-right aligned per document (flash-attn's varlen convention).
        softmax_scale, dropout_p, return_lse, generator, deterministic: as ``flash_attention`` (lse ``[heads,
            total_q]``; the dropout mask is ``flash_attention``'s at batch 1 over the packed sequence).
        window: sliding window within each document, bottom-right aligned per document (``flash_attention``'s).
        sinks: fp32 ``[heads]`` attention sinks, one per query head (``flash_attention``'s): every query's
            denominator has its head's sink once, whatever its document.

    Causal or windowed attention needs every document (with queries and keys) to end the same number of keys after
    its queries: ``cu_seqlens_k[i + 1] - cu_seqlens_q[i + 1] == total_k - total_q``, which holds when every
    document has as many queries as keys (self-attention; pass the same tensor twice to skip the check) and for a
    single document. Other layouts would need a per-document diagonal: they are refused (ValueError), never
    answered with another alignment. Checking them reads both ``cu_seqlens`` on the host (a sync on a GPU) unless
    they are the same tensor.

    Returns:
        ``out`` ``[total_q, heads, head_dim_v]`` (and ``lse`` ``[heads, total_q]`` fp32 when asked).

    Raises:
        TypeError / ValueError naming the argument: q/k/v as ``flash_attention`` (but 3-D), cu_seqlens not int32,
        not 1-D, of different lengths, not starting at 0, decreasing, not ending at the total, a max_seqlen shorter
        than a document, causal/window with documents whose alignment differs, or bad sinks.
    """
    op = "flash_attention_varlen"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.tensor(op, name, t)
        if t.dim() != 3:
            raise ValueError(f"{op}: {name} must be 3-D [total_tokens, heads, head_dim], got shape {list(t.shape)}")
    total_q, total_k = q.shape[0], k.shape[0]
    cq = _check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, total_q, "max_seqlen_q", max_seqlen_q)
    ck = _check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, total_k, "max_seqlen_k", max_seqlen_k)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"{op}: cu_seqlens_q has {cu_seqlens_q.numel()} entries and cu_seqlens_k {cu_seqlens_k.numel()}; both are "
            "[n_docs + 1]"
        )
    w = check_window(op, window)
    if (causal or w) and cu_seqlens_q is not cu_seqlens_k:
        cq = cq if cq is not None else cu_seqlens_q.tolist()
        ck = ck if ck is not None else cu_seqlens_k.tolist()
        offset = total_k - total_q
        bad = [
            i for i in range(len(cq) - 1) if cq[i + 1] > cq[i] and ck[i + 1] > ck[i] and ck[i + 1] - cq[i + 1] != offset
        ]
        if bad:
            i = bad[0]
            raise ValueError(
                f"{op}: causal/window attention is bottom-right aligned per document, which these kernels support "
                f"only where every document ends total_k - total_q = {offset} keys after its queries (documents "
                f"with as many queries as keys); document {i} has {cq[i + 1] - cq[i]} queries and "
                f"{ck[i + 1] - ck[i]} keys ending at {ck[i + 1]} vs {cq[i + 1]} (cu_seqlens_q / cu_seqlens_k)"
            )
    docs = (_doc_ids(cu_seqlens_q, total_q, q.device), _doc_ids(cu_seqlens_k, total_k, q.device))
    res = flash_attention(
        q[None],
        k[None],
        v[None],
        causal=causal,
        softmax_scale=softmax_scale,
        dropout_p=dropout_p,
        return_lse=return_lse,
        generator=generator,
        deterministic=deterministic,
        window=window,
        documents=docs,
        sinks=sinks,
    )
    if return_lse:
        out, lse = res
        return out[0], lse[0]
    return res[0]


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
    q,
    k,
    v,
    causal=False,
    softmax_scale=None,
    keep=None,
    dropout_p=0.0,
    compute_dtype=torch.float64,
    window=None,
    sinks=None,
):
    """Materialising attention in ``compute_dtype``: returns (out ``[b, sq, h, d_v]``, lse ``[b, h, sq]``); v's
    head dim ``d_v`` may differ from q/k's (the default scale is ``1 / sqrt(d_qk)``).

    ``keep`` (``[b, h, sq, sk]`` bool) applies dropout with scale ``1 / (1 - dropout_p)``; ``window`` as
    ``flash_attention``'s; ``sinks`` ``[h]``: one more column of scores per head, of logit ``sinks[h]``, whose
    value is zero (dropped from the output). Queries that see no key give zeros and lse -inf (with sinks: lse
    ``sinks[h]``)."""
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
    if sinks is not None:
        s = torch.cat((s, sinks.to(compute_dtype)[:, None, None].expand(b, h, sq, 1)), -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None])
    if sinks is not None:
        p = p[..., :sk]
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    return torch.matmul(p, vc).transpose(1, 2), lse
