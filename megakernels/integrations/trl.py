"""TRL's trainers on megakernels' fused LM head (docs/integrations.md).

    import megakernels.integrations.trl as mktrl

    with mktrl.patch_trl():                   # while building the trainers (or patch_trl() ... .revert())
        trainer = SFTTrainer(model=model, ...)  # DPOTrainer, GRPOTrainer, ... alike
    trainer.train()

TRL's trainers give every model they train (and their reference models) a fused LM head of TRL's own
(``trl.trainer.utils.add_fused_lm_head``): the forward, called with ``fused_lm_head=True``, returns per-token
log-probabilities (and entropy, top-1 flags, ... as the trainer asks) without the ``[tokens, vocab]`` logits. While
:func:`patch_trl` is active, that function still installs TRL's head, and over it a forward that serves those calls
with megakernels' chunked ops: ``megakernels.ops.linear_cross_entropy`` the log-probabilities alone (a reference
model's) and the loss; ``megakernels.ops.linear_logprobs`` log-probabilities and entropies together in one fused op
(each chunk's logits once forward and once backward: what GRPO's and RLOO's policies ask for); and for the other
statistics a trainer asks for (SFT's and DPO's metrics) ``linear_cross_entropy`` and one more chunked pass over the
head through ``megakernels.ops.gemm`` (the entropy with its gradient). Whatever that forward cannot serve exactly
goes to TRL's head: calls without ``fused_lm_head``, a head wrapped by PEFT or sharded (DTensor),
``cast_lm_head_to_fp32``, soft-capped or scaled logits, MoE models (TRL adds their router loss), a model type
megakernels does not know.

TRL is optional: importing this module does not import it; :func:`patch_trl` does.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys

import torch

from megakernels import ops
from megakernels.ops import gemm
from megakernels.ops.linear_cross_entropy import default_chunk_tokens

__all__ = ["patch_trl", "TRLPatch", "head_statistics", "SERVED_OUTPUTS"]

# the per-token outputs of TRL's fused head this one computes ("log_probs" always; the loss is their mean)
SERVED_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# config attributes that transform the logits before the softmax (TRL's head applies them; this one does not)
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
)


class _HeadStatistics(torch.autograd.Function):
    """Per-token statistics of ``z = hidden @ weight.T + bias`` (fp32), chunk by chunk: entropy (differentiable),
    ``log Σ p²``, the mean logit and whether the target is the (first) argmax (not differentiable)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, chunk):
        t = hidden.shape[0]
        entropy, lse, log_sq, mean = (torch.empty(t, dtype=torch.float32, device=hidden.device) for _ in range(4))
        top1 = torch.empty(t, dtype=torch.bool, device=hidden.device)
        with torch.no_grad():
            for a in range(0, t, chunk):
                b = min(t, a + chunk)
                z = gemm.linear_nograd(hidden[a:b], weight, bias).float()
                lse[a:b] = torch.logsumexp(z, -1)
                log_p = z - lse[a:b, None]
                entropy[a:b] = -(torch.exp(log_p) * log_p).sum(-1)  # not lse - Σ p z: no cancellation
                log_sq[a:b] = torch.logsumexp(2 * log_p, -1)
                mean[a:b] = z.mean(-1)
                top1[a:b] = z.argmax(-1) == target[a:b]
        ctx.save_for_backward(hidden, weight, bias, lse, entropy)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(log_sq, mean, top1)
        ctx.set_materialize_grads(False)
        return entropy, log_sq, mean, top1

    @staticmethod
    def backward(ctx, d_entropy, *_):
        hidden, weight, bias, lse, entropy = ctx.saved_tensors
        if d_entropy is None:
            return None, None, None, None, None
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = torch.empty_like(hidden) if need_x else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for a in range(0, hidden.shape[0], ctx.chunk):
            b = min(hidden.shape[0], a + ctx.chunk)
            z = gemm.linear_nograd(hidden[a:b], weight, bias).float()
            log_p = z - lse[a:b, None]
            # d entropy / d z_v = -p_v (log p_v + entropy)
            dz = (-d_entropy[a:b, None].float() * torch.exp(log_p) * (log_p + entropy[a:b, None])).to(hidden.dtype)
            if need_x:
                dx[a:b] = dz @ weight
            if need_w:
                dw += (dz.t() @ hidden[a:b]).float()
            if need_b:
                db += dz.float().sum(0)
        return (
            dx,
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype),
            None,
            None,
        )


def head_statistics(hidden, weight, bias, target, chunk_tokens: int | None = None):
    """Per-token statistics of the logits ``hidden @ weight.T + bias`` without holding them (chunks of
    ``chunk_tokens`` rows, by default ``linear_cross_entropy``'s).

    Args:
        hidden: ``[T, h]`` fp32/bf16/fp16. weight: ``[V, h]``, bias: ``[V]`` or None, in hidden's dtype.
        target: ``[T]`` int64 class ids.

    Returns:
        ``(entropy, log_sum_sq_probs, mean_logits, is_top1)``, each ``[T]``: fp32 entropy of the softmax
        (differentiable w.r.t. hidden, weight and bias), fp32 ``log Σ_v p_v²`` and mean logit, and bool "the target
        is the first argmax" (these three without gradient).

    Raises:
        ValueError: shapes or dtypes that do not fit (named).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"head_statistics: hidden must be [T, h] and weight [V, h], got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise ValueError(f"head_statistics: weight and bias must be in hidden's dtype {hidden.dtype}")
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"head_statistics: target must be [{hidden.shape[0]}], got {tuple(target.shape)}")
    chunk = default_chunk_tokens(weight.shape[0]) if chunk_tokens is None else int(chunk_tokens)
    return _HeadStatistics.apply(hidden, weight, bias, target, chunk)


def _serves(model, cast_lm_head_to_fp32: bool, outputs) -> bool:
    """Whether megakernels' head can stand in for TRL's on ``model`` (checked once, when TRL installs its head)."""
    from megakernels.integrations.transformers import FAMILIES

    config = model.config.get_text_config()
    family = FAMILIES.get(getattr(config, "model_type", None))
    return (
        family is not None
        and family.fused_head  # a causal LM without a router loss
        and not cast_lm_head_to_fp32
        and set(outputs) <= set(SERVED_OUTPUTS)
        and all(getattr(config, a, None) in (None, 1, 1.0) for a in _LOGIT_TRANSFORMS)
        and not getattr(config, "output_router_logits", False)
    )


def fused_lm_head_forward(self, *args, _trl_forward, _temperature: float, _outputs: tuple, **kwargs):
    """TRL's fused-head protocol on megakernels' ops: ``model(..., labels=labels, fused_lm_head=True)`` returns TRL's
    ``FusedCausalLMOutput`` (per-token ``log_probs`` of the next-token labels under the temperature, the requested
    statistics, zero where the label is -100; ``loss`` their negated mean or sum over ``num_items_in_batch``). Other
    calls, and heads megakernels does not own at call time, go to TRL's forward (``_trl_forward``)."""
    from megakernels.integrations.transformers._forwards import autocast_dtype, owned

    head = self.get_output_embeddings()
    if not kwargs.get("fused_lm_head") or type(head) is not torch.nn.Linear or not owned(head):
        return _trl_forward(*args, **kwargs)
    from trl.trainer.utils import FusedCausalLMOutput

    kwargs = dict(kwargs)
    kwargs.pop("fused_lm_head")
    labels, shift = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
    n = kwargs.pop("num_items_in_batch", None)
    kwargs["use_cache"] = False
    out = self.base_model(*args, **kwargs)
    if shift is None:
        hidden, target = out.last_hidden_state[:, :-1], labels[:, 1:]
    else:
        hidden, target = out.last_hidden_state, shift
    weight, bias = head.weight, head.bias
    hidden, target = hidden.to(weight.device), target.to(weight.device)
    device = weight.device.type
    dtype = autocast_dtype(device) or hidden.dtype
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    if _temperature != 1.0:  # softmax(z / T): the same head on hidden / T (and bias / T)
        hidden = hidden / _temperature
        bias = None if bias is None else bias / _temperature
    mask = target != -100
    rows, ids = hidden[mask], target[mask]  # only the scored positions go through the head
    off = torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else contextlib.nullcontext()
    with off:
        if set(_outputs) == {"log_probs"}:  # a reference model
            picked, stats = -ops.linear_cross_entropy(rows, weight, ids, bias=bias), {}
        elif set(_outputs) == {"log_probs", "entropy"}:  # GRPO's and RLOO's policy: one fused op for both
            picked, entropy = ops.linear_logprobs(rows, weight, ids, bias=bias, entropy=True)
            stats = {"entropy": entropy}
        else:
            picked = -ops.linear_cross_entropy(rows, weight, ids, bias=bias)
            stats = dict(zip(SERVED_OUTPUTS[1:], head_statistics(rows, weight, bias, ids)))
    fields = {"log_probs": picked}
    fields.update({k: v for k, v in stats.items() if k in _outputs})
    # back to the label positions; masked_scatter keeps an all-masked batch differentiable (a zero)
    per_token = {k: v.new_zeros(mask.shape).masked_scatter(mask, v) for k, v in fields.items()}
    log_probs = per_token["log_probs"]
    loss = -log_probs.sum() / (mask.sum().clamp(min=1) if n is None else n)
    return FusedCausalLMOutput(loss=loss, label_mask=mask, **per_token)


def _install(original):
    """``trl.trainer.utils.add_fused_lm_head`` with megakernels' head over TRL's (same signature)."""

    @functools.wraps(original)
    def add_fused_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs",)):
        original(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32, outputs=outputs)
        if not _serves(model, cast_lm_head_to_fp32, outputs):
            return
        trl_forward = model.forward
        bound = functools.partial(
            fused_lm_head_forward,
            model,
            _trl_forward=trl_forward,
            _temperature=float(temperature),
            _outputs=tuple(outputs),
        )
        bound.megakernels = True
        bound.megakernels_trl = True
        bound.__signature__ = inspect.signature(trl_forward)
        model.forward = bound

    add_fused_lm_head.megakernels = True
    return add_fused_lm_head


class TRLPatch:
    """TRL's ``add_fused_lm_head`` replaced (in ``trl.trainer.utils`` and every TRL module that imported it, or
    imports it meanwhile) by one that puts megakernels' head over TRL's; ``revert()`` (or leaving the ``with``
    block) restores TRL's function everywhere. Models given a head meanwhile keep it."""

    _active: TRLPatch | None = None

    def __init__(self):
        import trl.trainer.utils as utils

        self._original = utils.add_fused_lm_head
        self._ours = _install(self._original)
        self._swap(self._original, self._ours)
        TRLPatch._active = self

    @staticmethod
    def _swap(old, new) -> None:
        """Every loaded TRL module holding ``old`` as ``add_fused_lm_head`` gets ``new`` (``trl.trainer.utils``
        first: a trainer module imported later takes the function from there)."""
        for name, module in list(sys.modules.items()):
            trl_module = name == "trl" or name.startswith("trl.")
            if trl_module and module is not None and module.__dict__.get("add_fused_lm_head") is old:
                module.add_fused_lm_head = new

    @property
    def active(self) -> bool:
        return TRLPatch._active is self

    def revert(self) -> None:
        """Restore TRL's ``add_fused_lm_head`` (idempotent)."""
        if not self.active:
            return
        self._swap(self._ours, self._original)  # also in the modules imported while it was active
        TRLPatch._active = None

    def __enter__(self) -> TRLPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.revert()


def patch_trl() -> TRLPatch:
    """While active, every TRL trainer built (SFT, DPO, GRPO, RLOO, KTO, ...) gets megakernels' fused LM head over
    TRL's own for its model and reference model (see the module docstring for what it serves and what it leaves to
    TRL's head).

    Returns:
        The active :class:`TRLPatch` (a context manager; ``revert()`` undoes it).

    Raises:
        ImportError: TRL is not installed. ValueError: a patch is active already (revert it first).
    """
    try:
        import trl.trainer.utils  # noqa: F401
    except ImportError as e:
        raise ImportError("megakernels.integrations.trl.patch_trl: needs TRL (pip install trl)") from e
    if TRLPatch._active is not None:
        raise ValueError("megakernels.integrations.trl.patch_trl: TRL is patched already; revert() that patch first")
    return TRLPatch()
