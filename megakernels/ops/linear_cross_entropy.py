"""The language-model head fused with its (vocab-parallel) cross-entropy: per-token
``cross_entropy(hidden @ weight.T + bias, target)`` without ever holding the ``[tokens, vocab]`` logits.

With a 128k vocabulary the logits are the largest activation of a step (``tokens × V`` in the training dtype, and
as much again for their gradient). Here the tokens go through in chunks of ``chunk_tokens`` rows:

    forward   per chunk c:  logits_c = h_c Wᵀ (+ b)                       one GEMM (cuBLAS / ATen), [c, V_local]
                            stats_c  = (max, sum exp, x[target], sum x)   the cross-entropy's row kernel
              then the statistics of all tokens are combined (over ``group``: exactly ``ops.cross_entropy``'s
              two all-reduces, once for all chunks) into the loss and ``lse``; only ``lse`` (4 bytes a token) is
              kept beside the inputs.
    backward  per chunk c:  logits_c = h_c Wᵀ (+ b)                       recomputed
                            g_c = dloss_c (softmax - (1-eps) onehot - eps/V), written over logits_c
                            dX_c = g_c W,  dW += g_cᵀ h_c,  db += Σ g_c

Why recompute rather than compute the gradient in the forward pass (and only rescale it in backward): the
result is a per-token loss, so its gradient is an arbitrary per-token ``dloss``, and ``dW = Σ_t dloss_t g_tᵀ h_t``
cannot be recovered from an unscaled sum; recomputing is exact for any ``dloss`` and costs one more
``tokens × h × V_local`` GEMM (4 LM-head GEMMs instead of 3; about 2 % of a Llama-3-8B step's FLOPs). Memory beyond
the inputs and the outputs (loss ``[T]``, dX ``[T, h]``, dW ``[V_local, h]``): one chunk's logits ``[c, V_local]``
in the input dtype, ``lse`` ``[T]`` and the ``[T, 4]`` statistics, and in backward, for 16-bit weights over more
than one chunk, dW's fp32 sum and one chunk's 16-bit ``[V_local, h]`` product (6 bytes a weight element, weight-sized:
the price of not rounding the running sum to 16 bits every chunk): independent of the token count at a fixed chunk.
Against the unfused head's ``[T, V_local]`` logits and their gradient (4 bytes an element in 16 bits) that saves
memory from ``T > 1.5 h`` tokens a micro-batch (``megakernels bench --ops cross_entropy`` and the linear + CE
benchmark script measure it; docs/benchmarks.md has the recorded runs).

Precision: the GEMMs run in the input dtype with fp32 accumulation and the loss math is fp32, as
``F.linear`` + ``ops.cross_entropy``. dW is accumulated over chunks in fp32 (``addmm`` for fp32; for bf16/fp16
each chunk's product is rounded to the dtype once, then summed in fp32: k roundings for k chunks where the unfused
GEMM has one), then cast to the weight's dtype; with one chunk, dW is one GEMM in the dtype as unfused.

Tensor parallelism: ``weight`` is this rank's vocab shard ``[V_pad/tp, h]`` (rank r of ``group`` holds global
columns ``[r·V_local, (r+1)·V_local)``; columns ``>= vocab_size`` are padding and excluded), as the LM head's
weight. The contract on ``hidden`` is ``parallel_lm_logits``': without ``sequence_parallel`` every rank passes the
same (full) hidden and gets its full gradient — the ranks' partial ``dX = g W_r`` are all-reduced over ``group``
(the copy-to-TP-region of the unfused head); with ``sequence_parallel`` each rank passes its sequence shard
``[s/tp, b, h]``, the forward all-gathers it along dim 0 and the backward gathers it again (the gathered copy is
not kept) and reduce-scatters dX, so each rank gets its shard's gradient. dW and db need no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megakernels._backend import emulate_for
from megakernels.ops import _checks, gemm
from megakernels.ops.cross_entropy import (
    DTYPES,
    check_group,
    check_label_smoothing,
    check_softcap,
    check_target_dtype,
    check_target_values,
    check_vocab,
    combine_stats,
    cross_entropy_reference,
    grad_rows_into,
    stats_rows,
)

OP = "linear_cross_entropy"
CHUNK_LOGITS_BYTES = 256 << 20  # the default chunk: its logits are at most this many bytes counted in fp32


def default_chunk_tokens(v_local: int) -> int:
    """Tokens a chunk by default: its ``[chunk, v_local]`` logits take at most ``CHUNK_LOGITS_BYTES`` in fp32
    (a multiple of 128 rows when that is at least 128; at least 1 row): 512 for Llama 3's V = 128256 on one rank."""
    rows = CHUNK_LOGITS_BYTES // (4 * max(1, v_local))
    return max(1, rows // 128 * 128 if rows >= 128 else rows)


def _chunk_logits(h, weight, bias):
    return gemm.linear_nograd(h, weight, bias)


def _mm_into(out, a, b):
    """``out = a @ b`` (2-D), through ``gemm.mm`` where it routes the product, else ``torch.mm(out=)``."""
    if gemm.routed(a, b, a.shape[0], b.shape[1], a.shape[1]):
        out.copy_(gemm.mm(a, b))
    else:
        torch.mm(a, b, out=out)


@torch.no_grad()
def stats_chunks(
    hidden, weight, bias, target, vocab_start: int, n_valid: int, chunk: int, softcap: float, emulate: bool
):
    """``[T, 4]`` fp32 ``(max, sum exp, target logit, row sum)`` of ``hidden @ weight.T + bias``, chunk by chunk
    (the body of the custom op ``megakernels::linear_cross_entropy_stats``)."""
    t = hidden.shape[0]
    out = torch.empty((t, 4), dtype=torch.float32, device=hidden.device)
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        logits = _chunk_logits(hidden[a:b], weight, bias)
        out[a:b] = stats_rows(logits, target[a:b], vocab_start, n_valid, emulate, softcap)
    return out


@torch.library.custom_op("megakernels::linear_cross_entropy_stats", mutates_args=())
def _stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    vocab_start: int,
    n_valid: int,
    chunk: int,
    softcap: float,
    emulate: bool,
) -> torch.Tensor:
    return stats_chunks(hidden, weight, bias, target, vocab_start, n_valid, chunk, softcap, emulate)


@_stats.register_fake
def _(hidden, weight, bias, target, vocab_start, n_valid, chunk, softcap, emulate):
    _checks.same_device(OP, "hidden", hidden, ("weight", weight), ("bias", bias), ("target", target))
    return hidden.new_empty((hidden.shape[0], 4), dtype=torch.float32)


@torch.no_grad()
def grad_chunks(
    hidden, weight, bias, target, lse, dloss, vocab_start, n_valid, ignore_index, smooth_target, smooth_other, chunk,
    softcap, emulate, need_hidden, need_weight,
):  # fmt: skip
    """(dX ``[T, h]``, dW ``[V_local, h]``, db ``[V_local]``): each chunk's logits recomputed, their gradient
    written over them, then the two GEMMs. A gradient not asked for (``need_*``; db without a bias) is ``[0]``.
    The body of the custom op ``megakernels::linear_cross_entropy_grad``."""
    t = hidden.shape[0]
    dx = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    need_bias = bias is not None and need_weight
    # dW: fp32 weights accumulate in place (addmm); 16-bit ones over several chunks in an fp32 sum of the chunks'
    # 16-bit products (no mixed-dtype addmm), and in one chunk straight in the dtype, as the unfused GEMM.
    direct = weight.dtype == torch.float32 or t <= chunk
    dw_dtype = weight.dtype if direct else torch.float32
    dw = torch.empty(weight.shape, dtype=dw_dtype, device=weight.device) if need_weight else weight.new_empty(0)
    if t == 0:
        dw.zero_()
    db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else weight.new_empty(0)
    part = None
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        g = _chunk_logits(hidden[a:b], weight, bias)
        grad_rows_into(
            g, target[a:b], lse[a:b], dloss[a:b], vocab_start, n_valid, ignore_index, smooth_target, smooth_other,
            emulate, g, softcap,
        )  # fmt: skip
        if need_hidden:
            _mm_into(dx[a:b], g, weight)
        if need_weight:
            # the first chunk writes dW, the others add to it
            # oneDNN's product only where it is dW itself (one chunk): it has no in-place accumulation, and a
            # weight-sized temporary per chunk would double dW's memory
            if direct and a == 0 and b == t and gemm.routed(g, hidden, g.shape[1], hidden.shape[1], b - a):
                dw = gemm.mm(g.t(), hidden[a:b])
            elif direct and a == 0:
                torch.mm(g.t(), hidden[a:b], out=dw)
            elif direct:
                dw.addmm_(g.t(), hidden[a:b])
            else:
                part = torch.mm(g.t(), hidden[a:b], out=part)
                if a == 0:
                    dw.copy_(part)
                else:
                    dw.add_(part)
            if need_bias:
                db += g.sum(0, dtype=torch.float32)
    return dx, dw.to(weight.dtype), db.to(weight.dtype)


@torch.library.custom_op("megakernels::linear_cross_entropy_grad", mutates_args=())
def _grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    lse: torch.Tensor,
    dloss: torch.Tensor,
    vocab_start: int,
    n_valid: int,
    ignore_index: int,
    smooth_target: float,
    smooth_other: float,
    chunk: int,
    softcap: float,
    emulate: bool,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return grad_chunks(
        hidden, weight, bias, target, lse, dloss, vocab_start, n_valid, ignore_index, smooth_target, smooth_other,
        chunk, softcap, emulate, need_hidden, need_weight,
    )  # fmt: skip


@_grad.register_fake
def _(
    hidden, weight, bias, target, lse, dloss, vocab_start, n_valid, ignore_index, smooth_target, smooth_other, chunk,
    softcap, emulate, need_hidden, need_weight,
):  # fmt: skip
    _checks.same_device(OP, "hidden", hidden, ("weight", weight), ("bias", bias), ("target", target))
    dx = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    dw = torch.empty_like(weight) if need_weight else weight.new_empty(0)
    db = weight.new_empty(weight.shape[0] if bias is not None and need_weight else 0)
    return dx, dw, db


# Newer torch names the single-tensor collectives *_single (the old names warn there; older torch has only those).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gather_rows(x, group):
    """All-gather ``x`` along dim 0 over ``group`` (rank order)."""
    world = dist.get_world_size(group)
    out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
    if x.device.type != "meta":  # meta: shapes only, nothing to exchange
        all_gather_single(out, x.contiguous(), group=group)
    return out


def reduce_scatter_rows(x, group):
    world = dist.get_world_size(group)
    out = x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))
    if x.device.type != "meta":
        reduce_scatter_single(out, x.contiguous(), group=group)
    return out


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, bias, target, ignore_index, label_smoothing, group, sequence_parallel, vocab_size,
        vocab_start, chunk, softcap, emulate,
    ):  # fmt: skip
        comm = group is not None and dist.get_world_size(group) > 1
        full = gather_rows(hidden, group) if sequence_parallel and comm else hidden
        x = full.reshape(-1, full.shape[-1]).contiguous()
        n_valid = max(0, min(weight.shape[0], vocab_size - vocab_start))
        stats = _stats(x, weight, bias, target, vocab_start, n_valid, chunk, softcap, emulate)
        loss, lse = combine_stats(stats, target, group, ignore_index, label_smoothing, vocab_size)
        ctx.save_for_backward(hidden, weight, bias, target, lse)
        ctx.shape, ctx.group, ctx.sp, ctx.comm = full.shape, group, sequence_parallel, comm
        smooth = (1.0 - label_smoothing, label_smoothing / vocab_size)
        ctx.args = (vocab_start, n_valid, ignore_index, *smooth, chunk, softcap)
        ctx.emulate = emulate
        return loss

    @staticmethod
    def backward(ctx, dloss):
        hidden, weight, bias, target, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        full = gather_rows(hidden, ctx.group) if ctx.sp and ctx.comm else hidden  # gathered again, not kept
        x = full.reshape(-1, full.shape[-1]).contiguous()
        dx, dw, db = _grad(
            x, weight, bias, target, lse, dloss.contiguous().float(), *ctx.args, ctx.emulate, need_hidden, need_weight
        )
        if ctx.needs_input_grad[1]:  # a table tied to an input embedding: its lookups' rows are folded into dw
            from megakernels.nn.tied_embedding import dense_gradient_sent  # (megakernels.nn imports the ops)

            dense_gradient_sent(weight, dw)
        if need_hidden:
            dx = dx.view(ctx.shape)
            if ctx.comm:  # each rank's dX is its vocab shard's share: summed over the group
                if ctx.sp:
                    dx = reduce_scatter_rows(dx, ctx.group)
                elif dx.device.type != "meta":
                    dist.all_reduce(dx, group=ctx.group)
        return (
            dx if need_hidden else None,
            dw if ctx.needs_input_grad[1] else None,
            db if bias is not None and ctx.needs_input_grad[2] else None,
        ) + (None,) * 10


def check_head(op, hidden, weight, target, ignore_index, label_smoothing, group, vocab_size, chunk_tokens, bias, sp):
    """The arguments of an op on the LM head's hidden states and weight shard (this one, ``ops.logprobs``'):
    ``(ignore_index, vocab_size, vocab_start, chunk)``.

    Raises:
        TypeError, ValueError: as ``linear_cross_entropy`` documents, the messages naming ``op``.
    """
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        _checks.tensor(op, name, t)
    _checks.tensor(op, "bias", bias, optional=True)
    ignore_index = _checks.integer(op, "ignore_index", ignore_index)
    check_group(op, group)
    if hidden.dim() < 1 or hidden.dtype not in DTYPES:
        raise ValueError(
            f"{op}: hidden must be [..., h] fp32/bf16/fp16, got shape {tuple(hidden.shape)} dtype {hidden.dtype}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"{op}: weight must be [V_local, h] with h = hidden's last dimension ({hidden.shape[-1]}), got shape "
            f"{tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(f"{op}: weight has dtype {weight.dtype}, expected hidden's {hidden.dtype}")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != hidden.dtype):
        raise ValueError(
            f"{op}: bias must be [V_local] = [{weight.shape[0]}] in hidden's dtype {hidden.dtype}, got shape "
            f"{tuple(bias.shape)} dtype {bias.dtype}"
        )
    check_target_dtype(op, target)
    _checks.same_device(op, "hidden", hidden, ("weight", weight), ("target", target), ("bias", bias))
    lead = tuple(hidden.shape[:-1])
    if sp:
        if group is None:
            raise ValueError(f"{op}: sequence_parallel=True needs group (the ranks holding the sequence shards)")
        if hidden.dim() < 2:
            raise ValueError(f"{op}: under sequence_parallel hidden must be [s/tp, ..., h], got {tuple(hidden.shape)}")
        lead = (hidden.shape[0] * dist.get_world_size(group),) + lead[1:]
    if tuple(target.shape) != lead:
        raise ValueError(
            f"{op}: target has shape {tuple(target.shape)}, expected hidden's leading shape {lead}"
            f"{' (the sequence gathered over the group)' if sp else ''}"
        )
    check_label_smoothing(op, label_smoothing)
    vocab_size, vocab_start = check_vocab(op, weight.shape[0], group, vocab_size, what="weight's rows")
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.shape[0])
    elif isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"{op}: chunk_tokens must be a positive int or None, got {chunk_tokens!r}")
    check_target_values(op, target, ignore_index, vocab_size)
    return ignore_index, vocab_size, vocab_start, chunk_tokens


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    group=None,
    vocab_size: int | None = None,
    chunk_tokens: int | None = None,
    bias: torch.Tensor | None = None,
    sequence_parallel: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-token ``ops.cross_entropy(hidden @ weight.T + bias, target, ...)``, the logits never materialised (at
    most ``chunk_tokens`` rows of them at a time; see the module docstring for memory, precision and the
    tensor-parallel contract).

    Args:
        hidden: ``[..., h]`` fp32/bf16/fp16 (any leading shape, flattened); under ``sequence_parallel`` this rank's
            sequence shard ``[s/tp, ..., h]``.
        weight: ``[V_local, h]`` in hidden's dtype: this rank's vocab shard when ``group`` is given.
        target: int64/int32 ``hidden.shape[:-1]`` (``[s, ...]``, the whole sequence, under ``sequence_parallel``):
            global class ids in ``[0, vocab_size)`` or ``ignore_index`` (loss 0, no gradient).
        ignore_index, label_smoothing, group, vocab_size: as ``ops.cross_entropy``.
        chunk_tokens: tokens a chunk (default ``default_chunk_tokens(V_local)``: about 256 MiB of fp32 logits).
        bias: optional ``[V_local]`` in hidden's dtype.
        sequence_parallel: ``hidden`` is a sequence shard over ``group`` (gathered along dim 0).
        softcap: the final-logit soft cap c: the loss of ``c * tanh(logits / c)``, in the row kernel (None: none).

    Returns:
        ``[...]`` fp32 per-token loss (``target``'s shape), differentiable w.r.t. hidden, weight and bias. With
        ``group``, hidden's gradient is summed over the group (all-reduced; reduce-scattered under
        ``sequence_parallel``): what ``parallel_lm_logits`` gives.

    Raises:
        TypeError for non-tensors, a non-int ignore_index, a ``group`` that is not a ProcessGroup; ValueError
        naming the argument for a wrong dtype, shape or layout, a device mismatch, a target outside
        ``[0, vocab_size)`` that is not ignore_index, a bad label_smoothing, vocab_size, chunk_tokens or softcap.
    """
    sp = bool(sequence_parallel)
    ignore_index, vocab_size, vocab_start, chunk = check_head(
        OP, hidden, weight, target, ignore_index, label_smoothing, group, vocab_size, chunk_tokens, bias, sp
    )
    softcap = check_softcap(OP, softcap)
    emulate = emulate_for(OP, hidden, "hidden")
    loss = _LinearCrossEntropy.apply(
        hidden,
        weight.contiguous(),
        None if bias is None else bias.contiguous(),
        target.reshape(-1).long(),
        ignore_index,
        float(label_smoothing),
        group,
        sp,
        vocab_size,
        vocab_start,
        chunk,
        softcap,
        emulate,
    )
    return loss.view(target.shape).clone()  # not a view (ops.cross_entropy says why)


def linear_cross_entropy_reference(
    hidden, weight, target, ignore_index=-100, label_smoothing=0.0, vocab_size=None, bias=None,
    compute_dtype=torch.float64, softcap=None,
):  # fmt: skip
    """``F.linear`` then ``F.cross_entropy(reduction="none")`` in ``compute_dtype`` over the full (unsharded) weight's
    first ``vocab_size`` rows (tests)."""
    logits = torch.nn.functional.linear(
        hidden.to(compute_dtype), weight.to(compute_dtype), None if bias is None else bias.to(compute_dtype)
    )
    return cross_entropy_reference(logits, target, ignore_index, label_smoothing, vocab_size, compute_dtype, softcap)
