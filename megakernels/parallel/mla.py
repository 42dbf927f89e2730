"""Multi-head latent attention (DeepSeek-V2/V3), heads split over the TP ranks.

Per token ``x`` ``[h]``::

    q      = q_b(RMSNorm(q_a(x)))                  (q_lora_rank set)   or q(x)   [heads, qk_nope + qk_rope]
    c, kr  = kv_a(x) = [latent of kv_lora_rank | one rotary key of qk_rope]     (shared by all heads)
    k_nope, v = kv_b(RMSNorm(c))                    [heads, qk_nope], [heads, v_head]
    q_rope, kr rotated (RoPE; ``rope_interleave``: the rotary dims taken as interleaved pairs, as DeepSeek lays
           them out, and returned as halves, as transformers does)
    k      = [k_nope | kr broadcast to every head]; out = proj(attention(q, k, v))

so queries and keys have ``qk_nope + qk_rope`` dims (V3: 192) and values ``v_head`` (128): the attention core takes
``d_v != d_qk``. The softmax scale is ``(qk_nope + qk_rope)^-1/2`` unless given (YaRN's ``mscale_all_dim`` folds into
it: ``megakernels.ops.rope.yarn_softmax_scale``).

Tensor parallelism (Megatron's split): the up-projections ``q_b``, ``kv_b`` (and ``q`` without a query latent) and
the output projection split by heads; the down-projections ``q_a``, ``kv_a`` and the latent norms are replicated and
computed on every TP rank from the whole sequence (gathered under sequence parallelism). Each rank's heads give a
partial gradient of the latents, so the replicated weights' gradients are summed over TP (``mark_sequence_parallel``)
and the input's gradient by the gather's (or the copy's) backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megakernels.nn.norms import FusedRMSNorm
from megakernels.parallel import init, mappings, state
from megakernels.parallel.blocks import attend, check_3d, make_core, sub_seed
from megakernels.parallel.linear import ColumnParallelLinear, RowParallelLinear
from megakernels.parallel.params import mark_sequence_parallel


def _replicated(out_features: int, in_features: int, seed, init_method, device, dtype) -> nn.Parameter:
    p = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
    if p.device.type != "meta":
        with torch.no_grad():
            p.copy_(
                init.full_weight(
                    (out_features, in_features),
                    init.draw_seed() if seed is None else seed,
                    init_method or init.init_method_normal(),
                )
            )
    mark_sequence_parallel(p)  # each TP rank's heads give a partial gradient: summed over TP
    return p


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """The last dim's interleaved pairs ``(x0, x1), (x2, x3), ...`` as halves ``(x0, x2, ..., x1, x3, ...)``."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], -1)


class ParallelMultiLatentAttention(nn.Module):
    """Multi-head latent attention (module docstring).

    Args:
        hidden_size, num_heads: h and the heads (divisible by tp).
        q_lora_rank: the query latent's size, or None for a direct query projection (DeepSeek-V2-Lite).
        kv_lora_rank: the joint key/value latent's size.
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: each head's non-rotary and rotary query/key dims and its
            value dim.
        rotary: a module ``rotary(q, k, positions, seq_dim=0)`` over ``qk_rope_head_dim`` (e.g.
            ``megakernels.nn.RotaryEmbedding``), or None.
        rope_interleave: the rotary dims are interleaved pairs (DeepSeek's checkpoints; transformers' default).
        norm_eps: the latent RMSNorms' epsilon.
        causal, sequence_parallel, core, attention_dropout, recompute, softmax_scale, init_method,
        output_init_method, seed, device, dtype: as ``ParallelGroupedQueryAttention`` (seeds ``"q_a"``, ``"q_b"``
        or ``"q"``, ``"kv_a"``, ``"kv_b"``, ``"proj"``).
        bias: biases on the down-projections and the output projection (transformers' ``attention_bias``).

    Forward: ``x`` ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism), ``attention_mask``, ``positions``,
    ``kv_cache`` as ``ParallelGroupedQueryAttention`` -> same shape as ``x``.

    Raises:
        ValueError: heads not divisible by tp, a non-positive rank or head dim, an odd ``qk_rope_head_dim``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rotary: nn.Module | None = None,
        rope_interleave: bool = True,
        norm_eps: float = 1e-6,
        causal: bool = True,
        sequence_parallel: bool = False,
        core: str | nn.Module = "flash",
        attention_dropout: float = 0.0,
        bias: bool = False,
        recompute: bool = False,
        softmax_scale: float | None = None,
        init_method: init.InitMethod | None = None,
        output_init_method: init.InitMethod | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        cls = type(self).__name__
        state.check_divisible(num_heads=num_heads)
        sizes = dict(kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim)
        if q_lora_rank is not None:
            sizes["q_lora_rank"] = q_lora_rank
        for name, v in sizes.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{cls}: {name} must be a positive int, got {v!r}")
        if isinstance(qk_rope_head_dim, bool) or not isinstance(qk_rope_head_dim, int) or qk_rope_head_dim < 2:
            raise ValueError(f"{cls}: qk_rope_head_dim must be an even int >= 2, got {qk_rope_head_dim!r}")
        if qk_rope_head_dim % 2:
            raise ValueError(f"{cls}: qk_rope_head_dim must be even, got {qk_rope_head_dim}")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"{cls}: attention_dropout must be in [0, 1), got {attention_dropout}")
        tp = state.tp_size()
        self.hidden_size, self.num_heads, self.local_heads = hidden_size, num_heads, num_heads // tp
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.head_dim = self.qk_dim  # the query/key width a head's logits see (qk-clip, logit observers)
        self.causal, self.recompute = bool(causal), bool(recompute)
        self.sequence_parallel, self.rope_interleave = bool(sequence_parallel), bool(rope_interleave)
        scale = self.qk_dim**-0.5 if softmax_scale is None else softmax_scale
        self.core, self.window = make_core(self, core, causal, attention_dropout, None, False, scale)
        self.sinks = None
        self.rotary = rotary
        out_q = num_heads * self.qk_dim
        common = dict(device=device, dtype=dtype)
        if q_lora_rank is None:
            self.q = ColumnParallelLinear(
                hidden_size, out_q, False, init_method=init_method, seed=sub_seed(seed, "q"), **common
            )
            self.q_a = self.q_a_bias = self.q_a_norm = self.q_b = None
        else:
            self.q = None
            self.q_a = _replicated(q_lora_rank, hidden_size, sub_seed(seed, "q_a"), init_method, **common)
            self.q_a_bias = self._bias(q_lora_rank, bias, **common)
            self.q_a_norm = FusedRMSNorm(q_lora_rank, norm_eps, **common)
            self.q_b = ColumnParallelLinear(
                q_lora_rank, out_q, False, init_method=init_method, seed=sub_seed(seed, "q_b"), **common
            )
        self.kv_a = _replicated(
            kv_lora_rank + qk_rope_head_dim, hidden_size, sub_seed(seed, "kv_a"), init_method, **common
        )
        self.kv_a_bias = self._bias(kv_lora_rank + qk_rope_head_dim, bias, **common)
        self.kv_a_norm = FusedRMSNorm(kv_lora_rank, norm_eps, **common)
        self.kv_b = ColumnParallelLinear(
            kv_lora_rank,
            num_heads * (qk_nope_head_dim + v_head_dim),
            False,
            init_method=init_method,
            seed=sub_seed(seed, "kv_b"),
            **common,
        )
        for norm in (self.q_a_norm, self.kv_a_norm):
            if norm is not None:
                mark_sequence_parallel(norm.weight)
        self.proj = RowParallelLinear(
            num_heads * v_head_dim,
            hidden_size,
            bias,
            sequence_parallel=sequence_parallel,
            init_method=output_init_method or init_method,
            seed=sub_seed(seed, "proj"),
            **common,
        )

    @staticmethod
    def _bias(n: int, on: bool, device, dtype) -> nn.Parameter | None:
        if not on:
            return None
        p = nn.Parameter(torch.zeros(n, device=device, dtype=dtype))
        mark_sequence_parallel(p)
        return p

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        kv_cache=None,
    ) -> torch.Tensor:
        check_3d(self, x)
        if self.sequence_parallel:
            full = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
        else:
            full = mappings.copy_to_tensor_model_parallel_region(x)
        s, b = full.shape[:2]
        nh = self.local_heads
        if self.q is not None:
            q = F.linear(full, self.q.weight)
        else:
            q = F.linear(self.q_a_norm(F.linear(full, self.q_a, self.q_a_bias)), self.q_b.weight)
        q = q.view(s, b, nh, self.qk_dim)
        latent = F.linear(full, self.kv_a, self.kv_a_bias)
        c, k_rot = latent.split([self.kv_lora_rank, self.rope], -1)
        kv = F.linear(self.kv_a_norm(c), self.kv_b.weight).view(s, b, nh, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        q_nope, q_rot = q.split([self.nope, self.rope], -1)
        k_rot = k_rot.reshape(s, b, 1, self.rope)
        if self.rope_interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        if self.rotary is not None:
            q_rot, k_rot = self.rotary(q_rot, k_rot, positions, seq_dim=0)
        q = torch.cat([q_nope, q_rot], -1)
        k = torch.cat([k_nope, k_rot.expand(s, b, nh, self.rope)], -1)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [b, s, heads, d]
        if kv_cache is not None:
            k, v = kv_cache.update(self, k, v)
        ctx = attend(self, q, k, v, attention_mask)
        return self.proj(ctx.transpose(0, 1).reshape(s, b, nh * self.v_dim))
