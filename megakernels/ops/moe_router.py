"""The mixture-of-experts router after its gate GEMM, fused: from the logits ``[tokens, E]`` to each token's ``k``
experts and weights and the load statistics, in one pass over the logits (a C++ kernel on the CPU, Triton on CUDA:
csrc/moe, megakernels/triton/moe_router.py), and its backward in one more. PyTorch composes the same routing from
softmax, topk, gather, division, bincount and a column sum: a dozen kernels and ``[tokens, E]`` temporaries.

Per token row ``l`` (fp32 math whatever the logits' dtype)::

    p = softmax(l), lse = log Σ exp l
    score s = p ("softmax") or sigmoid(l) ("sigmoid", DeepSeek-V3)
    key = s, or l with topk_softmax (gpt-oss: the softmax of the k chosen logits), plus ``bias`` (DeepSeek-V3's
          auxiliary-loss-free balancing: it moves the choice, never the weights)
    group-limited (n_group > 1): experts in n_group equal groups, a group scored by the sum of its two largest keys,
          only the topk_group best groups eligible (DeepSeek)
    experts = the k largest eligible keys, largest first; ties go to the lower index (experts and groups)
    weights = scale · s[experts] / Σ s[experts] (normalize; + 1e-20 for sigmoid) or scale · s[experts];
              with topk_softmax, scale · softmax(l[experts])

and over all rows ``tokens_per_expert`` (the assignments) and ``aux_sum`` (Σ_t p_t, or Σ_t s_t / Σ_i s_ti for
sigmoid: the scores a load-balancing loss averages). ``weights``, ``aux_sum`` and ``lse`` are differentiable with
respect to the logits (a z-loss is ``lse²``'s mean); ``experts`` and ``tokens_per_expert`` are not. The sums over
rows are taken in blocks of 64 rows added in order: the same bits for any thread count.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

import megakernels._lib  # noqa: F401  (registers torch.ops.megakernels.*)
from megakernels._backend import emulate_for, runs_triton
from megakernels.ops import _checks

OP = "moe_router"
SCORES = {"softmax": 0, "sigmoid": 1}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RouterOutput(NamedTuple):
    """``weights`` [T, k] fp32, ``experts`` [T, k] int64, ``tokens_per_expert`` [E] fp32, ``aux_sum`` [E] fp32,
    ``lse`` [T] fp32 (see the module docstring)."""

    weights: torch.Tensor
    experts: torch.Tensor
    tokens_per_expert: torch.Tensor
    aux_sum: torch.Tensor
    lse: torch.Tensor


def _forward_rows(logits, bias, k, score, normalize, topk_softmax, scale, n_group, topk_group, emulate):
    if runs_triton(OP, logits, emulate):
        from megakernels.triton import moe_router as kernels

        return kernels.route(logits, bias, k, score, normalize, topk_softmax, scale, n_group, topk_group)
    return tuple(
        torch.ops.megakernels.moe_router_cpu(
            logits, bias, k, score, normalize, topk_softmax, scale, n_group, topk_group
        )
    )


@torch.library.custom_op("megakernels::moe_router_fwd", mutates_args=())
def _fwd(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    score: int,
    normalize: bool,
    topk_softmax: bool,
    scale: float,
    n_group: int,
    topk_group: int,
    emulate: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_rows(logits, bias, k, score, normalize, topk_softmax, scale, n_group, topk_group, emulate)


@_fwd.register_fake
def _(logits, bias, k, score, normalize, topk_softmax, scale, n_group, topk_group, emulate):
    t, e = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    return (
        torch.empty(t, k, **f32),
        torch.empty(t, k, dtype=torch.int64, device=logits.device),
        torch.empty(t, **f32),
        torch.empty(e, **f32),
        torch.empty(e, **f32),
    )


@torch.library.custom_op("megakernels::moe_router_bwd", mutates_args=())
def _bwd(
    logits: torch.Tensor,
    lse: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    dweights: torch.Tensor,
    daux: torch.Tensor,
    dlse: torch.Tensor,
    score: int,
    normalize: bool,
    topk_softmax: bool,
    scale: float,
    emulate: bool,
) -> torch.Tensor:
    args = (logits, lse, experts, weights, dweights, daux, dlse, score, normalize, topk_softmax, scale)
    if runs_triton(OP, logits, emulate):
        from megakernels.triton import moe_router as kernels

        return kernels.route_backward(*args)
    return torch.ops.megakernels.moe_router_grad_cpu(*args)


@_bwd.register_fake
def _(logits, lse, experts, weights, dweights, daux, dlse, score, normalize, topk_softmax, scale, emulate):
    return torch.empty_like(logits)


class _Router(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, k, score, normalize, topk_softmax, scale, n_group, topk_group, emulate):
        weights, experts, lse, counts, aux = _fwd(
            logits, bias, k, score, normalize, topk_softmax, scale, n_group, topk_group, emulate
        )
        ctx.save_for_backward(logits, lse, experts, weights)
        ctx.args = (score, normalize, topk_softmax, scale, emulate)
        ctx.mark_non_differentiable(experts, counts)
        return weights, experts, counts, aux, lse

    @staticmethod
    def backward(ctx, dweights, _dexperts, _dcounts, daux, dlse):
        logits, lse, experts, weights = ctx.saved_tensors
        dweights = torch.zeros_like(weights) if dweights is None else dweights.float().contiguous()
        daux = logits.new_zeros(logits.shape[1], dtype=torch.float32) if daux is None else daux.float().contiguous()
        dlse = torch.zeros_like(lse) if dlse is None else dlse.float().contiguous()
        dlogits = _bwd(logits, lse, experts, weights, dweights, daux, dlse, *ctx.args)
        return (dlogits,) + (None,) * 9


def _check(logits, top_k, score, bias, scale, n_group, topk_group):
    _checks.tensor(OP, "logits", logits)
    _checks.tensor(OP, "bias", bias, optional=True)
    if logits.dim() != 2 or logits.dtype not in DTYPES or logits.shape[1] == 0:
        raise ValueError(
            f"{OP}: logits must be [tokens, experts] fp32/bf16/fp16 with at least one expert, got shape "
            f"{tuple(logits.shape)} dtype {logits.dtype}"
        )
    e = logits.shape[1]
    if score not in SCORES:
        raise ValueError(f"{OP}: score must be one of {sorted(SCORES)}, got {score!r}")
    n_group = _checks.integer(OP, "n_group", n_group)
    if not 1 <= n_group <= e or e % n_group:
        raise ValueError(f"{OP}: n_group must divide the {e} experts, got {n_group}")
    topk_group = n_group if topk_group is None else _checks.integer(OP, "topk_group", topk_group)
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"{OP}: topk_group must be in [1, n_group={n_group}], got {topk_group}")
    top_k = _checks.integer(OP, "top_k", top_k)
    eligible = topk_group * (e // n_group)
    if not 1 <= top_k <= eligible:
        raise ValueError(
            f"{OP}: top_k must be in [1, {eligible}] (the experts of the topk_group eligible groups), got {top_k}"
        )
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not 0.0 < float(scale) < float("inf"):
        raise ValueError(f"{OP}: scale must be a positive finite number, got {scale!r}")
    if bias is not None:
        if bias.shape != (e,) or not bias.dtype.is_floating_point:
            raise ValueError(f"{OP}: bias must be a floating [{e}] tensor, got shape {tuple(bias.shape)} {bias.dtype}")
        _checks.same_device(OP, "logits", logits, ("bias", bias))
    return top_k, n_group, topk_group


def moe_router(
    logits: torch.Tensor,
    top_k: int,
    *,
    score: str = "softmax",
    normalize: bool = True,
    topk_softmax: bool = False,
    bias: torch.Tensor | None = None,
    scale: float = 1.0,
    n_group: int = 1,
    topk_group: int | None = None,
) -> RouterOutput:
    """Route each token to ``top_k`` experts (the module docstring has the math).

    Args:
        logits: ``[tokens, E]`` fp32/bf16/fp16, the gate's output (CPU or CUDA); math in fp32.
        top_k: experts per token, at most the eligible groups' experts.
        score: ``"softmax"`` (Mixtral, Qwen, gpt-oss) or ``"sigmoid"`` (DeepSeek-V3).
        normalize: weights divided by their sum over the k (Mixtral; DeepSeek-V3's norm_topk_prob).
        topk_softmax: weights are the softmax of the k chosen logits (gpt-oss); ``normalize`` is then moot.
        bias: ``[E]`` added to the selection keys only (not differentiable; cast to fp32), or None.
        scale: a factor on the weights (DeepSeek's routed_scaling_factor).
        n_group, topk_group: group-limited routing (default: one group, all eligible).

    Returns:
        ``RouterOutput(weights, experts, tokens_per_expert, aux_sum, lse)``.

    Raises:
        TypeError for non-tensors or non-int counts; ValueError naming the argument for a wrong shape or dtype, an
        unknown score, a top_k, n_group or topk_group out of range, a bad scale or bias.
    """
    top_k, n_group, topk_group = _check(logits, top_k, score, bias, scale, n_group, topk_group)
    emulate = emulate_for(OP, logits, "logits")
    b = None if bias is None else bias.detach().float().contiguous()
    weights, experts, counts, aux, lse = _Router.apply(
        logits.contiguous(), b, top_k, SCORES[score], bool(normalize), bool(topk_softmax), float(scale), n_group,
        topk_group, emulate,
    )  # fmt: skip
    return RouterOutput(weights, experts, counts, aux, lse)


def _ranked(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k largest of each row, largest first, ties to the lower index (a stable sort)."""
    return torch.sort(keys, dim=-1, descending=True, stable=True).indices[..., :k]


def moe_router_reference(
    logits, top_k, *, score="softmax", normalize=True, topk_softmax=False, bias=None, scale=1.0, n_group=1,
    topk_group=None, compute_dtype=torch.float32,
):  # fmt: skip
    """The same routing from PyTorch ops in ``compute_dtype`` (tests; the choices use a stable sort, so ties go to
    the lower index as in the kernels). Returns a ``RouterOutput``."""
    topk_group = n_group if topk_group is None else topk_group
    x = logits.to(compute_dtype)
    p = torch.softmax(x, -1)
    lse = torch.logsumexp(x, -1)
    s = torch.sigmoid(x) if score == "sigmoid" else p
    key = (x if topk_softmax else s).detach()
    if bias is not None:
        key = key + bias.to(compute_dtype)
    t, e = x.shape
    if n_group > 1:
        grouped = key.view(t, n_group, e // n_group)
        two = grouped.topk(min(2, e // n_group), dim=-1).values.sum(-1)  # values only: ties do not matter here
        groups = _ranked(two, topk_group)
        allowed = torch.zeros(t, n_group, dtype=torch.bool, device=x.device).scatter_(1, groups, True)
        key = key.masked_fill(~allowed.repeat_interleave(e // n_group, dim=1), float("-inf"))
    experts = _ranked(key, top_k)
    if topk_softmax:
        weights = torch.softmax(x.gather(1, experts), -1) * scale
    else:
        chosen = s.gather(1, experts)
        if normalize:
            chosen = chosen / (chosen.sum(-1, keepdim=True) + (1e-20 if score == "sigmoid" else 0.0))
        weights = chosen * scale
    counts = torch.bincount(experts.flatten(), minlength=e).to(compute_dtype)
    aux = (s / s.sum(-1, keepdim=True) if score == "sigmoid" else p).sum(0)
    return RouterOutput(weights, experts, counts, aux, lse)
