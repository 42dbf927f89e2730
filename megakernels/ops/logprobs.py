"""Per-token log-probabilities (and entropies) of given tokens, from the LM head's hidden states and weight, chunk by
chunk: ``log softmax((h Wᵀ + b) / T)[target]`` and ``H = −Σ p log p`` without ever holding the ``[tokens, vocab]``
logits. Every preference, policy-gradient and distillation loss of ``megakernels.ops.post_training`` is a function of
these per-token numbers, so their memory is this op's: one chunk's logits at a time.

    forward   per chunk c:  x_c = (h_c Wᵀ + b) / T                       one GEMM in the input dtype, then fp32
                            (max, Σ exp(x − max), x[target], Σ exp(x − max)·x)
              the ranks' statistics combined over ``group`` (one all-reduce(MAX), one all-reduce(SUM)), giving
              lse, logp = x[target] − lse and, with ``entropy``, E_p[x] and H = lse − E_p[x]; lse and E_p[x] kept
    backward  per chunk c:  x_c recomputed, p = exp(x − lse)
                            g = dlogp (onehot − p) − dH p (x − E_p[x]),  then / T
                            dX = g W,  dW += gᵀ h,  db += Σ g

Without ``entropy`` and at ``T = 1`` the forward and backward are ``linear_cross_entropy``'s own kernels (``logp`` is
minus its per-token loss). Tensor parallelism and sequence parallelism follow ``linear_cross_entropy``'s contract:
``weight`` is this rank's vocab shard, hidden's gradient is summed over ``group`` (reduce-scattered under
``sequence_parallel``). A token whose target is ``ignore_index`` has logp 0 and entropy 0 and passes no gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megakernels.ops import _checks, gemm
from megakernels.ops.linear_cross_entropy import check_head, gather_rows, linear_cross_entropy, reduce_scatter_rows

OP = "linear_logprobs"


def _logits(h, weight, bias, vocab_start: int, n_valid: int, inv_temp: float) -> torch.Tensor:
    """fp32 ``[c, V_local]`` logits over temperature, the padding columns (``>= n_valid``) at -inf."""
    x = gemm.linear_nograd(h, weight, bias).float()
    if inv_temp != 1.0:
        x.mul_(inv_temp)
    if n_valid < x.shape[1]:
        x[:, n_valid:] = float("-inf")
    return x


def _local_targets(target, vocab_start: int, n_valid: int):
    """(the local column of each target, whether this shard holds it) for a chunk's global targets."""
    local = target - vocab_start
    held = (local >= 0) & (local < n_valid)
    return local.clamp(0, max(n_valid - 1, 0)), held


@torch.no_grad()
def stats_chunks(hidden, weight, bias, target, vocab_start: int, n_valid: int, chunk: int, inv_temp: float):
    """``[T, 4]`` fp32 ``(max, Σ exp(x − max), x[target] (0 off this shard), Σ exp(x − max)·x)`` of
    ``x = (hidden @ weight.T + bias) / T``, chunk by chunk (the body of ``megakernels::linear_logprobs_stats``)."""
    t = hidden.shape[0]
    out = torch.zeros((t, 4), dtype=torch.float32, device=hidden.device)
    if n_valid <= 0:
        out[:, 0] = float("-inf")
        return out
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        x = _logits(hidden[a:b], weight, bias, vocab_start, n_valid, inv_temp)
        m = x.max(1).values
        col, held = _local_targets(target[a:b], vocab_start, n_valid)
        out[a:b, 0] = m
        out[a:b, 2] = torch.where(held, x.gather(1, col[:, None])[:, 0], 0.0)
        e = torch.exp(x - m[:, None])  # the chunk's one temporary beside its logits
        out[a:b, 1] = e.sum(1)
        out[a:b, 3] = torch.einsum("ij,ij->i", e, x.masked_fill_(torch.isneginf(x), 0.0))
    return out


@torch.library.custom_op("megakernels::linear_logprobs_stats", mutates_args=())
def _stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    vocab_start: int,
    n_valid: int,
    chunk: int,
    inv_temp: float,
) -> torch.Tensor:
    return stats_chunks(hidden, weight, bias, target, vocab_start, n_valid, chunk, inv_temp)


@_stats.register_fake
def _(hidden, weight, bias, target, vocab_start, n_valid, chunk, inv_temp):
    _checks.same_device(OP, "hidden", hidden, ("weight", weight), ("bias", bias), ("target", target))
    return hidden.new_empty((hidden.shape[0], 4), dtype=torch.float32)


def combine(stats: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, target logit, E_p[x]) of every token from its ranks' ``[T, 4]`` statistics: one all-reduce(MAX) of the
    maxima, one all-reduce(SUM) of the rescaled sums and the target logit (held by one shard); none for one rank."""
    m, s, picked, ex = stats.unbind(1)
    if group is not None and stats.device.type != "meta" and dist.get_world_size(group) > 1:
        top = m.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        scale = torch.exp(m - top.masked_fill(torch.isneginf(top), 0.0)).nan_to_num(0.0)
        sums = torch.stack([s * scale, picked, ex * scale])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        s, picked, ex = sums.unbind(0)
        m = top
    return m + torch.log(s), picked, ex / s


@torch.no_grad()
def grad_chunks(
    hidden, weight, bias, target, lse, mean_x, dlogp, dent, vocab_start, n_valid, chunk, inv_temp, need_hidden,
    need_weight,
):  # fmt: skip
    """(dX ``[T, h]``, dW ``[V_local, h]``, db ``[V_local]``) of ``Σ dlogp·logp + dent·H``: each chunk's logits
    recomputed (module docstring). A gradient not asked for is ``[0]``. The body of
    ``megakernels::linear_logprobs_grad``."""
    t = hidden.shape[0]
    dx = torch.zeros_like(hidden) if need_hidden else hidden.new_empty(0)
    need_bias = bias is not None and need_weight
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else weight.new_empty(0)
    db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else weight.new_empty(0)
    if n_valid > 0:
        for a in range(0, t, chunk):
            b = min(t, a + chunk)
            x = _logits(hidden[a:b], weight, bias, vocab_start, n_valid, inv_temp)
            g = torch.exp(x - lse[a:b, None])  # p, then the gradient in place: the chunk's one temporary
            col, held = _local_targets(target[a:b], vocab_start, n_valid)
            # g = dlogp (onehot - p) - dH p (x - E_p[x]) = -p (dlogp + dH (x - E_p[x])) + dlogp onehot
            if dent is not None:
                x.masked_fill_(torch.isneginf(x), 0.0).sub_(mean_x[a:b, None]).mul_(dent[a:b, None])
                g.mul_(x.add_(dlogp[a:b, None])).neg_()
            else:
                g.mul_(-dlogp[a:b, None])
            del x
            g.scatter_add_(1, col[:, None], torch.where(held, dlogp[a:b], 0.0)[:, None])
            if inv_temp != 1.0:
                g.mul_(inv_temp)
            g = g.to(hidden.dtype)
            if need_hidden:
                dx[a:b] = gemm.mm(g, weight)
            if need_weight:
                dw.add_(gemm.mm(g.t(), hidden[a:b]).float())
                if need_bias:
                    db += g.float().sum(0)
    return dx, dw.to(weight.dtype), db.to(weight.dtype)


@torch.library.custom_op("megakernels::linear_logprobs_grad", mutates_args=())
def _grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    lse: torch.Tensor,
    mean_x: torch.Tensor,
    dlogp: torch.Tensor,
    dent: torch.Tensor | None,
    vocab_start: int,
    n_valid: int,
    chunk: int,
    inv_temp: float,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return grad_chunks(
        hidden, weight, bias, target, lse, mean_x, dlogp, dent, vocab_start, n_valid, chunk, inv_temp, need_hidden,
        need_weight,
    )  # fmt: skip


@_grad.register_fake
def _(
    hidden, weight, bias, target, lse, mean_x, dlogp, dent, vocab_start, n_valid, chunk, inv_temp, need_hidden,
    need_weight,
):  # fmt: skip
    _checks.same_device(OP, "hidden", hidden, ("weight", weight), ("bias", bias), ("target", target))
    dx = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    dw = torch.empty_like(weight) if need_weight else weight.new_empty(0)
    db = weight.new_empty(weight.shape[0] if bias is not None and need_weight else 0)
    return dx, dw, db


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, bias, target, ignore_index, group, sp, vocab_size, vocab_start, chunk, inv_temp, entropy
    ):
        comm = group is not None and dist.get_world_size(group) > 1
        full = gather_rows(hidden, group) if sp and comm else hidden
        x = full.reshape(-1, full.shape[-1]).contiguous()
        n_valid = max(0, min(weight.shape[0], vocab_size - vocab_start))
        stats = _stats(x, weight, bias, target, vocab_start, n_valid, chunk, inv_temp)
        lse, picked, mean_x = combine(stats, group)
        ignored = target == ignore_index
        logp = (picked - lse).masked_fill(ignored, 0.0)
        ent = (lse - mean_x).masked_fill(ignored, 0.0)
        ctx.save_for_backward(hidden, weight, bias, target, lse, mean_x, ignored)
        ctx.shape, ctx.group, ctx.sp, ctx.comm = full.shape, group, sp, comm
        ctx.args = (vocab_start, n_valid, chunk, inv_temp)
        ctx.entropy = entropy
        return logp, ent

    @staticmethod
    def backward(ctx, dlogp, dent):
        hidden, weight, bias, target, lse, mean_x, ignored = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        full = gather_rows(hidden, ctx.group) if ctx.sp and ctx.comm else hidden  # gathered again, not kept
        x = full.reshape(-1, full.shape[-1]).contiguous()
        dlogp = (torch.zeros_like(lse) if dlogp is None else dlogp.float()).masked_fill(ignored, 0.0).contiguous()
        if ctx.entropy and dent is not None:
            dent = dent.float().masked_fill(ignored, 0.0).contiguous()
        else:
            dent = None
        dx, dw, db = _grad(x, weight, bias, target, lse, mean_x, dlogp, dent, *ctx.args, need_hidden, need_weight)
        if need_hidden:
            dx = dx.view(ctx.shape)
            if ctx.comm:
                if ctx.sp:
                    dx = reduce_scatter_rows(dx, ctx.group)
                elif dx.device.type != "meta":
                    dist.all_reduce(dx, group=ctx.group)
        return (
            dx if need_hidden else None,
            dw if ctx.needs_input_grad[1] else None,
            db if bias is not None and ctx.needs_input_grad[2] else None,
        ) + (None,) * 9


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    group=None,
    vocab_size: int | None = None,
    chunk_tokens: int | None = None,
    bias: torch.Tensor | None = None,
    sequence_parallel: bool = False,
    temperature: float = 1.0,
    entropy: bool = False,
):
    """Per-token ``log softmax((hidden @ weight.T + bias) / temperature)[target]`` (and the entropy of that
    distribution), the logits never materialised (module docstring).

    Args:
        hidden, weight, target, ignore_index, group, vocab_size, chunk_tokens, bias, sequence_parallel: as
            ``linear_cross_entropy`` (``target``: the tokens whose log-probabilities are taken).
        temperature: the logits are divided by it (> 0; RL sampling's temperature).
        entropy: also return each token's entropy.

    Returns:
        fp32 ``target``-shaped log-probabilities (0 at ``ignore_index``), and with ``entropy`` a tuple
        ``(logp, entropy)``; differentiable w.r.t. hidden, weight and bias.

    Raises:
        TypeError, ValueError: as ``linear_cross_entropy``, and a temperature that is not a positive finite number.
    """
    temperature = _checks.real(OP, "temperature", temperature, minimum=0.0)
    if not temperature > 0:
        raise ValueError(f"{OP}: temperature must be > 0, got {temperature}")
    sp = bool(sequence_parallel)
    ignore_index, vocab, vocab_start, chunk = check_head(
        OP, hidden, weight, target, ignore_index, 0.0, group, vocab_size, chunk_tokens, bias, sp
    )
    if not entropy and temperature == 1.0:  # linear_cross_entropy's kernels: logp is minus its loss
        return -linear_cross_entropy(
            hidden,
            weight,
            target,
            ignore_index=ignore_index,
            group=group,
            vocab_size=vocab,
            chunk_tokens=chunk,
            bias=bias,
            sequence_parallel=sp,
        )
    logp, ent = _LinearLogprobs.apply(
        hidden,
        weight.contiguous(),
        None if bias is None else bias.contiguous(),
        target.reshape(-1).long(),
        ignore_index,
        group,
        sp,
        vocab,
        vocab_start,
        chunk,
        1.0 / temperature,
        bool(entropy),
    )
    logp = logp.view(target.shape).clone()
    return (logp, ent.view(target.shape).clone()) if entropy else logp


def linear_logprobs_reference(
    hidden, weight, target, ignore_index=-100, vocab_size=None, bias=None, temperature=1.0, compute_dtype=torch.float64
):
    """(logp, entropy) in ``compute_dtype`` from the full logits over the unsharded weight's first ``vocab_size``
    rows (tests)."""
    logits = torch.nn.functional.linear(
        hidden.to(compute_dtype), weight.to(compute_dtype), None if bias is None else bias.to(compute_dtype)
    )
    logits = logits[..., : vocab_size or weight.shape[0]] / temperature
    logq = torch.log_softmax(logits, -1)
    ignored = target == ignore_index
    logp = logq.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(ignored, 0.0)
    ent = -(logq.exp() * logq).sum(-1).masked_fill(ignored, 0.0)
    return logp, ent
