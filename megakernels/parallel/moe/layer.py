"""The mixture-of-experts MLP: route every token to ``top_k`` of ``num_experts`` expert MLPs and sum their outputs
weighted by the router (Shazeer et al. 2017; Switch, GShard, Mixtral), optionally plus shared experts every token
goes through.

Data flow on one rank (``x`` ``[s, b, h]``, or ``[s/tp, b, h]`` under sequence parallelism):

1. the router sees each token once over the tensor-parallel group: this rank's sequence shard (the scatter of the
   replicated ``x`` without sequence parallelism); its decisions are all-gathered so every TP rank knows the
   routing of every token, and its losses' statistics are summed over the TP (and context-parallel) ranks;
2. every TP rank holds all tokens (the all-gather of the shard under sequence parallelism) and permutes the
   assignments by expert (``dispatch.permute``; a capacity drops the over-capacity ones and, without expert
   parallelism, gives every expert a fixed-size buffer, so that no count is read back to the host);
3. with expert parallelism the rows travel to the ranks of their experts and back (``dispatcher``: all-to-all
   with variable splits, optionally in overlapped chunks, or all-gather / reduce-scatter);
4. the local experts run as grouped GEMMs on their TP shards (``experts.GroupedMLP``);
5. the outputs are un-permuted and weighted, the shared experts added, and the partial sums reduced over TP
   (all-reduce, or reduce-scatter back to the sequence shard).

The router's weight gets a partial gradient per TP rank (its tokens only) and is marked to have it summed over TP.
The auxiliary losses are not added to the language-model loss tensor (a pipeline's last stage never sees the
other stages' layers): their gradient enters here, in backward, scaled by ``set_aux_loss_scale`` (the trainer's
loss scale and micro-batch normalisation); their values go to ``stats`` for the logs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megakernels.parallel import comm, init, mappings, state
from megakernels.parallel.blocks import ParallelMLP
from megakernels.parallel.moe import dispatcher as dispatchers
from megakernels.parallel.moe import stats
from megakernels.parallel.moe.experts import GroupedMLP
from megakernels.parallel.moe.router import TopKRouter
from megakernels.parallel.params import mark_sequence_parallel

_aux_scale = 1.0


def set_aux_loss_scale(scale: float) -> None:
    """What the auxiliary losses' gradient is multiplied by in backward (the trainer sets it per step: loss scale ×
    gradient-reduction factor / micro-batches per global batch)."""
    global _aux_scale
    _aux_scale = float(scale)


class _InjectAuxLoss(torch.autograd.Function):
    """Identity on ``x``; in backward, also the gradient of ``loss`` (scaled by ``set_aux_loss_scale``)."""

    @staticmethod
    def forward(ctx, x, loss):
        ctx.save_for_backward(loss)
        return x

    @staticmethod
    def backward(ctx, dx):
        (loss,) = ctx.saved_tensors
        return dx, torch.full_like(loss, _aux_scale)


class MoELayer(nn.Module):
    """A mixture-of-experts MLP over the tensor-, expert- and sequence-parallel layout (module docstring).

    Args:
        hidden_size, ffn_hidden_size: h and each expert's f.
        num_experts, top_k: E and experts per token.
        sequence_parallel: input and output are sequence shards ``[s/tp, b, h]``.
        activation: the experts' ``"swiglu"``, ``"gelu"`` or ``"gelu_tanh"``.
        normalize: renormalise the top-k router weights (Mixtral) or not (Switch/GShard).
        bias: biases in the router and in every expert (gpt-oss; ``TopKRouter``'s and ``GroupedMLP``'s).
        softmax_topk: the router's weights are the softmax over the k chosen logits (gpt-oss; ``TopKRouter``).
        swiglu_limit, swiglu_alpha: the experts' clamped SwiGLU (gpt-oss; ``ops.swiglu``); None: plain SwiGLU.
        aux_loss_coeff, z_loss_coeff: the auxiliary losses' coefficients (0: not computed into the gradient).
        capacity_factor: rows per expert ``ceil(factor · tokens · k / E)`` (over-capacity assignments dropped);
            None is dropless.
        shared_experts: dense experts of ``ffn_hidden_size`` each every token goes through (0: none); they run while
            the first token exchange is in flight.
        score, n_group, topk_group, routed_scaling, expert_bias: DeepSeek-V3's routing (``TopKRouter``: sigmoid
            scores, group-limited top-k, the weights' factor, the auxiliary-loss-free balancing bias).
        seq_aux_loss: the load-balancing loss per sequence of the micro-batch, averaged (DeepSeek-V3's
            sequence-wise loss; ``TopKRouter``'s ``seq_aux``).
        fp8_dispatch: the dispatched rows travel as FP8 with a scale a row (``moe.dispatcher``; None:
            ``dispatcher.configure``'s, the trainer's ``--moe-fp8-dispatch``).
        dispatcher, a2a_chunks: the token dispatcher (``moe.dispatcher``: ``alltoall``, ``allgather`` or a
            registered one) and its number of overlapped chunks; None: ``dispatcher.configure``'s (the trainer's
            ``--moe-dispatcher``, ``--moe-a2a-chunks``).
        seed: the layer's seed (router ``"router"``, experts ``"experts.<e>.fc1"``, shared ``"shared"``).
        init_method, output_init_method, device, dtype: as ``ParallelMLP``.

    Forward: ``x`` ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) -> same shape.

    Raises:
        ValueError: ``top_k`` outside ``1..num_experts``, experts not divisible by the expert-parallel size, a
            sequence not divisible by tp (the router splits it), a bad capacity factor.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int,
        sequence_parallel: bool = False,
        *,
        activation: str = "swiglu",
        normalize: bool = True,
        bias: bool = False,
        softmax_topk: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.0,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        capacity_factor: float | None = None,
        shared_experts: int = 0,
        dispatcher: str | None = None,
        a2a_chunks: int | None = None,
        fp8_dispatch: bool | None = None,
        score: str = "softmax",
        n_group: int = 1,
        topk_group: int | None = None,
        routed_scaling: float = 1.0,
        expert_bias: bool = False,
        seq_aux_loss: bool = False,
        seed: int = 0,
        init_method: init.InitMethod | None = None,
        output_init_method: init.InitMethod | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        cls = type(self).__name__
        ep = state.ep_size()
        if num_experts % ep:
            raise ValueError(f"{cls}: num_experts={num_experts} is not divisible by the expert-parallel size {ep}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"{cls}: capacity_factor must be > 0 or None (dropless), got {capacity_factor}")
        self.num_experts, self.top_k, self.sequence_parallel = num_experts, top_k, bool(sequence_parallel)
        self.aux_loss_coeff, self.z_loss_coeff, self.capacity_factor = aux_loss_coeff, z_loss_coeff, capacity_factor
        if dispatcher is not None or a2a_chunks is not None or fp8_dispatch is not None:
            name, chunks, fp8 = dispatchers.settings(dispatcher, a2a_chunks, fp8_dispatch)
            dispatchers.make(name, None, 1, chunks, fp8)  # checked
        self.dispatcher, self.a2a_chunks, self.fp8_dispatch = dispatcher, a2a_chunks, fp8_dispatch
        local = num_experts // ep
        self.router = TopKRouter(
            hidden_size,
            num_experts,
            top_k,
            normalize,
            bias=bias,
            softmax_topk=softmax_topk,
            score=score,
            n_group=n_group,
            topk_group=topk_group,
            scaling=routed_scaling,
            expert_bias=expert_bias,
            seq_aux=seq_aux_loss,
            init_method=init_method,
            seed=init.derive_seed(seed, "router"),
            device=device,
            dtype=dtype,
        )
        mark_sequence_parallel(self.router)  # each TP rank routes its share of the tokens (module docstring)
        self.experts = GroupedMLP(
            hidden_size,
            ffn_hidden_size,
            num_experts,
            state.ep_rank() * local,
            local,
            activation=activation,
            bias=bias,
            swiglu_limit=swiglu_limit,
            swiglu_alpha=swiglu_alpha,
            seed=seed,
            init_method=init_method,
            output_init_method=output_init_method,
            device=device,
            dtype=dtype,
        )
        self.shared = None
        if shared_experts:
            self.shared = ParallelMLP(
                hidden_size,
                ffn_hidden_size * shared_experts,
                sequence_parallel,
                activation="swiglu" if activation == "swiglu" else "gelu",
                approximate="tanh" if activation == "gelu_tanh" else "none",
                bias=False,
                init_method=init_method,
                output_init_method=output_init_method,
                seed=init.derive_seed(seed, "shared"),
                device=device,
                dtype=dtype,
            )

    def _route(self, x: torch.Tensor):
        """Router on this rank's token shard; decisions gathered to every TP rank; statistics over tp and cp."""
        tp = state.tp_size()
        local = x if (self.sequence_parallel or tp == 1) else mappings.scatter_to_sequence_parallel_region(x)
        s_local, b, h = local.shape
        # the micro-batch's tokens are split over the TP ranks (here) and the context-parallel ranks
        weights, experts, st = self.router(local.reshape(-1, h), state.tp_cp_group(), sequences=b)
        if tp > 1:
            weights = mappings.gather_from_sequence_parallel_region(
                weights.view(s_local, b, -1), tensor_parallel_output_grad=True
            )
            experts = comm.all_gather(experts.view(s_local, b, -1).contiguous(), 0, state.tp_group())
        return weights.reshape(-1, self.top_k), experts.reshape(-1, self.top_k), st

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"{type(self).__name__}: x must be [s, b, h] (sequence first), got shape {tuple(x.shape)}")
        weights, experts, st = self._route(x)
        full = x
        if self.sequence_parallel:
            full = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
        else:
            full = mappings.copy_to_tensor_model_parallel_region(x)
        s, b, h = full.shape
        tokens = full.reshape(-1, h)
        capacity = None
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * tokens.shape[0] * self.top_k / self.num_experts)
        # with a capacity, fixed-size buffers (every expert `capacity` rows, from every rank under expert
        # parallelism): no counts exchanged, nothing read back to the host
        name, chunks, fp8 = dispatchers.settings(self.dispatcher, self.a2a_chunks, self.fp8_dispatch)
        ep_group = state.ep_group() if state.ep_size() > 1 else None
        run = dispatchers.make(name, ep_group, self.num_experts, chunks, fp8)
        # the shared experts run while the first exchange is in flight
        side = None if self.shared is None else (lambda: self.shared(x))
        out, perm, shared = run(tokens, weights, experts, self.experts, capacity, side)
        out = out.view(s, b, h)
        if self.training and torch.is_grad_enabled():
            aux = self.aux_loss_coeff * st["aux_loss"] + self.z_loss_coeff * st["z_loss"]
            if aux.requires_grad:
                out = _InjectAuxLoss.apply(out, aux)
            stats.record(
                st["aux_loss"].detach(),
                st["z_loss"].detach(),
                st["tokens_per_expert"],
                perm.dropped,
                perm.num_tokens * perm.k,
            )
        if self.sequence_parallel:
            out = mappings.reduce_scatter_to_sequence_parallel_region(out)
        else:
            out = mappings.reduce_from_tensor_model_parallel_region(out)
        return out if shared is None else out + shared
