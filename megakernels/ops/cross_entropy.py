"""Fused (vocab-parallel) cross-entropy: per-token ``-log softmax(logits)[target]`` with label smoothing, without
materialising log-probabilities, and with the vocabulary optionally sharded over a tensor-parallel group
(Megatron's vocab-parallel cross-entropy).

Per token row ``x`` (the real columns only), with ``lse = log sum_j exp(x_j)`` and ``V`` the real vocab size::

    loss = lse - (1 - eps) * x[target] - eps * mean_j x_j        (eps = label_smoothing; 0 for ignored rows)
    dx_j = dloss * (softmax(x)_j - (1 - eps) [j == target] - eps / V)

The forward streams each row once (online max and sum of exponentials, the target logit and the row sum; Triton
on CUDA, a vectorised, threaded C++ kernel on the CPU: csrc/cross_entropy) and saves only ``lse`` (4 bytes per
token) next to the logits it already holds; the backward writes the gradient into one new tensor, or into the
logits themselves with ``inplace_backward=True`` — PyTorch's F.cross_entropy keeps a full fp32 log-softmax copy on
top.

With ``group`` each rank holds the shard ``[tokens, V_local]`` of columns ``[rank * V_local, (rank + 1) *
V_local)`` (rank in ``group``), and the loss equals that of the full logits: one all-reduce(MAX) of the row
maxima, then one all-reduce(SUM) of (rescaled sum-exp, target logit, row sum) — the logits are never gathered,
and the backward needs no communication. Columns at global index ``>= vocab_size`` are padding (vocab padded to a
multiple of 128 * tp for GEMM shapes): they are excluded from the softmax and get zero gradient, so padding never
changes the loss.
"""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from megakernels._backend import emulate_for, runs_triton
from megakernels.ops import _checks

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _stats_cpu(logits, target, vocab_start: int, n_valid: int, softcap: float) -> torch.Tensor:
    """(max, sum of exp, target logit, row sum) per row: the C++ kernel (csrc/cross_entropy), one pass per row."""
    return torch.ops.megakernels.ce_stats_cpu(logits.contiguous(), target.long(), vocab_start, n_valid, softcap)


def _grad_cpu(
    logits, target, lse, dloss, vocab_start, n_valid, ignore_index, smooth_target, smooth_other, softcap, out
):
    """The gradient into ``out`` (the C++ kernel; rows with a stride of their own go through a contiguous copy)."""
    x = logits.contiguous()
    direct = out.is_contiguous() and (x is logits or out.data_ptr() != logits.data_ptr())
    dst = out if direct else torch.empty_like(x)
    torch.ops.megakernels.ce_grad_cpu(
        x, target.long(), lse, dloss, vocab_start, n_valid, ignore_index, smooth_target, smooth_other, softcap, dst
    )
    return out if direct else out.copy_(dst)


def stats_rows(logits, target, vocab_start: int, n_valid: int, emulate: bool, softcap: float = 0.0) -> torch.Tensor:
    """``[N, 4]`` fp32 per-row statistics of ``logits`` ``[N, V_local]`` (capped to ``softcap * tanh(x / softcap)``
    first when ``softcap`` > 0): the Triton kernel (CUDA, or the interpreter under cuda_emu) or the C++ CPU kernel.
    Also the chunks of ``linear_cross_entropy``."""
    if runs_triton("cross_entropy", logits, emulate):
        from megakernels.triton import cross_entropy as kernels

        return kernels.stats(logits, target, vocab_start, n_valid, softcap)
    return _stats_cpu(logits, target, vocab_start, n_valid, softcap)


@torch.library.custom_op("megakernels::cross_entropy_stats", mutates_args=())
def _stats(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, n_valid: int, softcap: float, emulate: bool
) -> torch.Tensor:
    return stats_rows(logits, target, vocab_start, n_valid, emulate, softcap)


@_stats.register_fake
def _(logits, target, vocab_start, n_valid, softcap, emulate):
    return logits.new_empty((logits.shape[0], 4), dtype=torch.float32)


def grad_rows_into(
    logits, target, lse, dloss, vocab_start, n_valid, ignore_index, smooth_target, smooth_other, emulate, out,
    softcap: float = 0.0,
):  # fmt: skip
    """The gradient of the rows' loss with respect to the (raw, uncapped) logits, into ``out`` (may be ``logits``)."""
    args = (logits, target, lse, dloss, vocab_start, n_valid, ignore_index, smooth_target, smooth_other)
    if runs_triton("cross_entropy", logits, emulate):
        from megakernels.triton import cross_entropy as kernels

        return kernels.grad(*args, out, softcap)
    return _grad_cpu(*args, softcap, out)


@torch.library.custom_op("megakernels::cross_entropy_grad", mutates_args=())
def _grad(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    dloss: torch.Tensor,
    vocab_start: int,
    n_valid: int,
    ignore_index: int,
    smooth_target: float,
    smooth_other: float,
    softcap: float,
    emulate: bool,
) -> torch.Tensor:
    return grad_rows_into(
        logits,
        target,
        lse,
        dloss,
        vocab_start,
        n_valid,
        ignore_index,
        smooth_target,
        smooth_other,
        emulate,
        torch.empty_like(logits),
        softcap,
    )


@_grad.register_fake
def _(logits, target, lse, dloss, vocab_start, n_valid, ignore_index, smooth_target, smooth_other, softcap, emulate):
    return torch.empty_like(logits)


@torch.library.custom_op("megakernels::cross_entropy_grad_", mutates_args=("logits",))
def _grad_inplace(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    dloss: torch.Tensor,
    vocab_start: int,
    n_valid: int,
    ignore_index: int,
    smooth_target: float,
    smooth_other: float,
    softcap: float,
    emulate: bool,
) -> None:
    grad_rows_into(
        logits, target, lse, dloss, vocab_start, n_valid, ignore_index, smooth_target, smooth_other, emulate, logits,
        softcap,
    )  # fmt: skip


def combine_stats(stats, target, group, ignore_index: int, label_smoothing: float, vocab_size: int):
    """(per-token loss, lse) from the rows' ``(max, sum exp, target logit, row sum)`` statistics ``[N, 4]``; with
    ``group`` the statistics of the ranks' vocab shards are combined first: one all-reduce(MAX) of the maxima,
    then one all-reduce(SUM) of (rescaled sum-exp, target logit, row sum). A group of one rank has nothing to combine
    (the statistics are its own: no collective)."""
    m, s, picked, total = stats.unbind(1)
    # meta: shapes only, nothing to exchange
    if group is not None and stats.device.type != "meta" and dist.get_world_size(group) > 1:
        global_max = m.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        safe = global_max.masked_fill(torch.isneginf(global_max), 0.0)
        s = s * torch.exp(m.masked_fill(torch.isneginf(m), float("-inf")) - safe)
        sums = torch.stack([s, picked, total])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        s, picked, total = sums.unbind(0)
        m = global_max
    lse = m + torch.log(s)
    loss = lse - (1.0 - label_smoothing) * picked - (label_smoothing / vocab_size) * total
    return loss.masked_fill(target == ignore_index, 0.0), lse


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits, target, ignore_index, label_smoothing, group, vocab_size, vocab_start, inplace_backward, softcap,
        emulate,
    ):  # fmt: skip
        n_valid = max(0, min(logits.shape[1], vocab_size - vocab_start))
        stats = _stats(logits, target, vocab_start, n_valid, softcap, emulate)
        loss, lse = combine_stats(stats, target, group, ignore_index, label_smoothing, vocab_size)
        ctx.save_for_backward(logits, target, lse)
        smooth = (1.0 - label_smoothing, label_smoothing / vocab_size)
        ctx.args = (vocab_start, n_valid, ignore_index, *smooth, softcap, emulate)
        ctx.inplace_backward = inplace_backward
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    def backward(ctx, dloss, _dlse):
        logits, target, lse = ctx.saved_tensors
        dloss = dloss.contiguous()
        if ctx.inplace_backward:
            _grad_inplace(logits, target, lse, dloss, *ctx.args)
            grad = logits
        else:
            grad = _grad(logits, target, lse, dloss, *ctx.args)
        return grad, None, None, None, None, None, None, None, None, None


def check_group(op, group) -> None:
    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(
            f"{op}: group must be a torch.distributed ProcessGroup or None, got {group!r} ({type(group).__name__})"
        )


def check_target_dtype(op, target) -> None:
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: target must be an integer (int64/int32) tensor, got {target.dtype}")


def check_label_smoothing(op, label_smoothing) -> None:
    if (
        isinstance(label_smoothing, bool)
        or not isinstance(label_smoothing, numbers.Real)
        or not 0.0 <= label_smoothing <= 1.0
    ):
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing!r}")


def check_softcap(op, softcap) -> float:
    """``softcap`` as a float (0.0 for None: no cap); it must be a positive finite number."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not 0.0 < softcap < float("inf"):
        raise ValueError(f"{op}: softcap must be a positive finite number or None, got {softcap!r}")
    return float(softcap)


def check_vocab(op, v_local: int, group, vocab_size, what: str = "logits") -> tuple[int, int]:
    """(vocab_size, this rank's first global column) for ``v_local`` columns a rank over ``group``."""
    world, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    padded = v_local * world
    if vocab_size is None:
        vocab_size = padded
    elif isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= padded:
        raise ValueError(
            f"{op}: vocab_size must be an int in [1, {padded}] (the {what} hold {padded} columns"
            f"{' over the group' if group is not None else ''}), got {vocab_size!r}"
        )
    return vocab_size, rank * v_local


def check_target_values(op, target, ignore_index: int, vocab_size: int) -> None:
    """Every target is in ``[0, vocab_size)`` or ``ignore_index`` (nothing to check on meta; an asserting op when
    compiled)."""
    if target.device.type == "meta":  # no values to check: shapes only
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if torch.compiler.is_compiling():  # no data-dependent branch in a graph: an asserting op instead
        torch._assert_async(torch.logical_not(bad.any()), f"{op}: target outside [0, {vocab_size})")
    elif bool(bad.any()):
        value = int(target[bad].flatten()[0])
        raise ValueError(f"{op}: target holds {value}, outside [0, {vocab_size}) and not ignore_index ({ignore_index})")


def _check(logits, target, ignore_index, label_smoothing, group, vocab_size, softcap):
    op = "cross_entropy"
    _checks.tensor(op, "logits", logits)
    _checks.tensor(op, "target", target)
    ignore_index = _checks.integer(op, "ignore_index", ignore_index)
    check_group(op, group)
    if logits.dim() < 1 or logits.dtype not in DTYPES:
        raise ValueError(
            f"{op}: logits must be [..., vocab] fp32/bf16/fp16, got shape {tuple(logits.shape)} dtype {logits.dtype}"
        )
    check_target_dtype(op, target)
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"{op}: target has shape {tuple(target.shape)}, expected logits' leading shape {tuple(logits.shape[:-1])}"
        )
    _checks.same_device(op, "logits", logits, ("target", target))
    check_label_smoothing(op, label_smoothing)
    vocab_size, vocab_start = check_vocab(op, logits.shape[-1], group, vocab_size)
    check_target_values(op, target, ignore_index, vocab_size)
    return vocab_size, vocab_start, check_softcap(op, softcap)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    group=None,
    vocab_size: int | None = None,
    inplace_backward: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy (``F.cross_entropy(..., reduction="none")`` semantics) of possibly vocab-sharded
    logits.

    Args:
        logits: ``[..., V_local]`` fp32/bf16/fp16 (this rank's vocab shard when ``group`` is given); math in fp32.
        target: ``[...]`` int64/int32 global class ids, or ``ignore_index`` (those tokens get loss 0 and no
            gradient).
        label_smoothing: eps in [0, 1], spread over the ``vocab_size`` real classes as PyTorch does.
        group: a torch.distributed process group over which the vocab is sharded in rank order (None: the full
            vocab is local).
        vocab_size: the real vocab size; columns at global index >= vocab_size are padding and excluded (default:
            every column is real).
        inplace_backward: write the gradient into ``logits``' storage (saves a logits-sized buffer; only valid
            when nothing else needs those logits after this loss, e.g. straight out of the LM head GEMM).
        softcap: the final-logit soft cap c (Gemma 2/3's ``final_logit_softcapping``): the loss is that of
            ``c * tanh(logits / c)``, computed in the kernel (the capped logits are never stored), and the gradient
            is with respect to the raw logits. None: no cap.

    Returns:
        ``[...]`` fp32 per-token loss, differentiable w.r.t. logits.

    Raises:
        TypeError for non-tensors, a non-int ignore_index, a ``group`` that is not a ProcessGroup; ValueError
        naming the argument for a wrong dtype, shape or layout (sparse), a device mismatch, a target outside
        ``[0, vocab_size)`` that is not ignore_index, a bad label_smoothing, vocab_size or softcap.

    Meta tensors (logits and target both on ``meta``) give a meta loss of the right shape: nothing is computed,
    the target values are not checked and no collective runs.
    """
    vocab_size, vocab_start, softcap = _check(logits, target, ignore_index, label_smoothing, group, vocab_size, softcap)
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.numel() and flat.stride(-1) != 1:
        flat = flat.contiguous()
    emulate = emulate_for("cross_entropy", logits, "logits")
    loss, _ = _CrossEntropy.apply(
        flat,
        target.reshape(-1),
        int(ignore_index),
        float(label_smoothing),
        group,
        vocab_size,
        vocab_start,
        bool(inplace_backward),
        softcap,
        emulate,
    )
    # a tensor of its own, not a view: a module's output that is a view loses hooks to in-place ops (FSDP2's
    # pre-backward hook on a wrapped model's loss); [tokens] floats, nothing beside the logits
    return loss.view(lead).clone()


def cross_entropy_reference(
    logits, target, ignore_index=-100, label_smoothing=0.0, vocab_size=None, compute_dtype=torch.float64, softcap=None
):
    """``F.cross_entropy(reduction="none")`` in ``compute_dtype`` over the first ``vocab_size`` columns of full
    (unsharded) logits, capped to ``softcap * tanh(logits / softcap)`` first when ``softcap`` is given."""
    v = logits.shape[-1] if vocab_size is None else vocab_size
    x = logits[..., :v].to(compute_dtype).reshape(-1, v)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    return torch.nn.functional.cross_entropy(
        x, target.reshape(-1), ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none"
    ).view(target.shape)
