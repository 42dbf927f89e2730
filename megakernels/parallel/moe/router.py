"""The router of a mixture-of-experts layer: which ``k`` experts each token goes to, with which weights, and the
auxiliary losses that keep the experts busy evenly.

All in fp32: ``logits = x Wᵀ (+ b)`` ([tokens, E]), ``p = softmax(logits)``, the top-``k`` experts of each token
and their probabilities (renormalised over the ``k`` with ``normalize=True``, as Mixtral; as they are otherwise, as
Switch/GShard), or with ``softmax_topk=True`` (gpt-oss) the softmax of the ``k`` chosen logits alone. Over a
micro-batch's tokens:

- load-balancing loss (Switch Transformer): ``E · Σ_i f_i · P_i``, ``f_i`` the fraction of the ``T·k`` assignments
  that went to expert ``i`` (not differentiable), ``P_i`` the mean router probability of expert ``i``; 1 when
  balanced;
- router z-loss (ST-MoE): ``mean_t (logsumexp_i logits_ti)²``, keeping the logits small.

With ``seq_aux=True`` the load-balancing loss is computed per sequence and averaged over the micro-batch's
sequences (DeepSeek-V3's complementary sequence-wise balance loss): ``mean_b E · Σ_i f_bi · P_bi``, ``f_bi`` and
``P_bi`` as above over the tokens of sequence ``b`` alone; with one sequence it is the loss above.

When the micro-batch's tokens are split over ranks (context parallelism), the sums behind ``f``, ``P`` and the
z-loss are summed over ``stats_group`` first, so every layout computes the same losses as one process; each rank's
gradient flows into its own tokens only (the sum's backward is the identity), which is the gradient of that one
loss.

DeepSeek-V3's routing (``score="sigmoid"``): sigmoid scores, group-limited top-k (``n_group`` groups scored by the
sum of their two best keys, the ``topk_group`` best eligible), the chosen scores normalised and scaled by
``scaling`` (routed_scaling_factor); ``P`` is then the mean of each token's scores over their sum. With
``expert_bias`` the router keeps DeepSeek's auxiliary-loss-free balancing bias, an fp32 buffer ``[E]`` (in the
state dict: checkpointed) added to the selection keys only; ``update_expert_biases`` moves it after each optimizer
step by ``rate · sign(mean load − load)`` from the step's loads (summed over the ranks holding the layer, so every
replica moves it alike).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from megakernels.ops.moe_router import moe_router, moe_router_reference
from megakernels.parallel import init


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward: each rank's share of a global sum."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, dx):
        return dx, None


def sum_over(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over ``group`` (None or one rank: ``x``), differentiable as each rank's share."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _SumOverGroup.apply(x, group)


class TopKRouter(nn.Module):
    """Linear gate + top-k routing (see the module docstring).

    Args:
        hidden_size: h.
        num_experts: E.
        top_k: experts per token (1 <= top_k <= E).
        normalize: renormalise the k probabilities to sum to 1.
        bias: a bias ``[E]`` on the logits (zero at the start; gpt-oss).
        softmax_topk: the weights are the softmax over the k chosen logits (gpt-oss's order: top-k, then softmax)
            instead of the top k of the softmax over every expert; ``normalize`` is then moot (they sum to 1).
        score, n_group, topk_group, scaling: ``"softmax"`` or ``"sigmoid"`` scores and group-limited routing
            (``ops.moe_router``), the weights' factor (DeepSeek's routed_scaling_factor).
        expert_bias: keep the auxiliary-loss-free balancing bias (module docstring).
        seq_aux: the load-balancing loss per sequence (module docstring).
        init_method, seed, device, dtype: of the gate's weight ``[E, h]`` (replicated on every rank).

    ``forward(x, stats_group=None, sequences=1)``: ``x`` ``[tokens, h]`` -> ``(weights [tokens, k] fp32, experts
    [tokens, k] int64, stats)`` with ``stats``: ``aux_loss`` and ``z_loss`` (fp32 scalars, differentiable) and
    ``tokens_per_expert`` ([E], the micro-batch's assignments, summed over ``stats_group``). ``sequences``: how many
    sequences the tokens are, sequence-first (``[s, b]`` flattened: token ``t`` belongs to sequence ``t % b``), for
    ``seq_aux``.

    Raises:
        ValueError: ``top_k`` outside ``1..num_experts``; (forward) a token count that ``sequences`` does not divide.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        normalize: bool = True,
        *,
        bias: bool = False,
        softmax_topk: bool = False,
        score: str = "softmax",
        n_group: int = 1,
        topk_group: int | None = None,
        scaling: float = 1.0,
        expert_bias: bool = False,
        seq_aux: bool = False,
        init_method: init.InitMethod | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"TopKRouter: top_k={top_k} must be in 1..num_experts={num_experts}")
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, bool(normalize)
        self.softmax_topk = bool(softmax_topk)
        self.score, self.n_group, self.topk_group, self.scaling = score, n_group, topk_group, float(scaling)
        self.seq_aux = bool(seq_aux)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
            self.register_buffer("expert_load", torch.zeros(num_experts, device=device, dtype=torch.float32), False)
        else:
            self.expert_bias = self.expert_load = None
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(num_experts, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            with torch.no_grad():
                self.weight.copy_(
                    init.full_weight(
                        (num_experts, hidden_size),
                        init.draw_seed() if seed is None else seed,
                        init_method or init.init_method_normal(),
                    )
                )

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name in ("expert_bias", "expert_load"):  # fp32 whatever the model is cast to
            if getattr(self, name) is not None and self._buffers[name].dtype != torch.float32:
                self._buffers[name] = self._buffers[name].float()
        return self

    def forward(self, x: torch.Tensor, stats_group=None, sequences: int = 1):
        if self.seq_aux and (sequences < 1 or x.shape[0] % sequences):
            raise ValueError(f"TopKRouter: {x.shape[0]} tokens are not {sequences} sequences of equal length")
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # fp32 routing (fp64 for fp64 models)
        logits = x.to(acc) @ self.weight.to(acc).t()
        if self.bias is not None:
            logits = logits + self.bias.to(acc)
        # the fused router (ops.moe_router: one pass, ties to the lower expert); its PyTorch twin for fp64 models
        route = moe_router if acc == torch.float32 else functools.partial(moe_router_reference, compute_dtype=acc)
        out = route(
            logits, self.top_k, normalize=self.normalize and self.top_k > 1, topk_softmax=self.softmax_topk,
            score=self.score, n_group=self.n_group, topk_group=self.topk_group, scale=self.scaling,
            bias=None if self.expert_bias is None else self.expert_bias.float(),
        )  # fmt: skip
        weights, experts, counts = out.weights, out.experts, out.tokens_per_expert.to(acc)
        E = self.num_experts
        total = torch.tensor([float(x.shape[0])], dtype=acc, device=x.device)
        if stats_group is not None and dist.get_world_size(stats_group) > 1:
            counts, total = counts.clone(), total.clone()
            dist.all_reduce(counts, group=stats_group)
            dist.all_reduce(total, group=stats_group)
        prob_sum = sum_over(out.aux_sum, stats_group)
        z_sum = sum_over(out.lse.square().sum(), stats_group)
        f = counts / (total * self.top_k)
        P = prob_sum / total
        aux = self._sequence_aux(logits, experts, sequences, stats_group) if self.seq_aux else E * (f * P).sum()
        stats = {"aux_loss": aux, "z_loss": z_sum / total[0], "tokens_per_expert": counts}
        if self.expert_load is not None and self.training and torch.is_grad_enabled():
            self.expert_load += counts.detach().float()
        return weights, experts, stats

    def _sequence_aux(self, logits, experts, b: int, group) -> torch.Tensor:
        """``mean_b E · Σ_i f_bi · P_bi`` over the ``b`` sequences of ``logits`` ``[s·b, E]`` (their tokens summed
        over ``group`` first): each token's scores as the batch-wise loss takes them (the softmax, or the sigmoid
        scores over their sum)."""
        E = self.num_experts
        if self.score == "sigmoid":
            s = torch.sigmoid(logits)
            p = s / s.sum(-1, keepdim=True)
        else:
            p = torch.softmax(logits, -1)
        prob = sum_over(p.view(-1, b, E).sum(0), group)  # [b, E], differentiable
        seq = torch.arange(logits.shape[0], device=logits.device) % b
        slots = (seq[:, None] * E + experts).flatten()
        counts = torch.zeros(b * E, dtype=logits.dtype, device=logits.device)
        counts.index_add_(0, slots, torch.ones_like(slots, dtype=logits.dtype))
        length = torch.tensor([float(logits.shape[0] // b)], dtype=logits.dtype, device=logits.device)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
            dist.all_reduce(length, group=group)
        f = counts.view(b, E) / (length * self.top_k)
        return E * (f * prob / length).sum(-1).mean()


@torch.no_grad()
def update_expert_biases(model: nn.Module, rate: float, group=None) -> float | None:
    """DeepSeek's auxiliary-loss-free balancing after an optimizer step: each router with an ``expert_bias`` adds
    ``rate · sign(mean load − load)`` to it, the load being the step's assignments per expert (its forwards since
    the last update, summed over ``group``: the ranks that hold the layer and saw other tokens, the data-parallel
    group), then forgets the load. Returns the largest bias norm (for the log), None without such routers.

    Raises:
        ValueError: a ``rate`` that is not a finite number >= 0.
    """
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 <= rate < float("inf"):
        raise ValueError(f"update_expert_biases: rate must be a finite number >= 0, got {rate!r}")
    norm = None
    for m in model.modules():
        if isinstance(m, TopKRouter) and m.expert_bias is not None:
            load = m.expert_load.float()
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(load, group=group)
            m.expert_bias.copy_(m.expert_bias.float() + rate * torch.sign(load.mean() - load))
            m.expert_load.zero_()
            norm = max(norm or 0.0, float(m.expert_bias.float().norm()))
    return norm
