"""Tensor-parallel Transformer sublayers: the MLP and the self-attention block of Megatron-LM.

Both are a column-parallel linear, a rank-local middle and a row-parallel linear, so each costs exactly one
all-reduce in forward (the row layer's g) and one in backward (the column layer's f) — or, under sequence
parallelism, an all-gather + a reduce-scatter in forward and, in backward, the reduce-scatter + all-gather they
transpose to plus one all-gather that re-materialises the column layer's input instead of saving it (Megatron's
memory-for-traffic trade, hidden behind the dgrad GEMM).

MLP:        x -> ColumnParallelLinear(h, 4h) -> bias_gelu (fused bias add + tanh GeLU) -> RowParallelLinear(4h, h)
Attention:  x -> ColumnParallelLinear(h, 3h) -> split heads -> attention core -> RowParallelLinear(h, h)

The QKV weight's ``3h`` output rows are ordered ``(head, {q, k, v}, head_dim)``: head-major, so the contiguous row
block of TP rank r holds q, k and v of heads ``[r·n/tp, (r+1)·n/tp)`` and attention is rank-local. The attention
core is one of the library's (``megakernels.nn.attention``: ``"flash"``, the default, or ``"torch"``) or any module
with their contract, ``core(q, k, v, mask=None)`` on ``[b, s, heads, head_dim]``. Attention dropout runs on the
tracker's per-TP-rank stream (``random.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megakernels.nn.attention import attention_core
from megakernels.ops.bias_gelu import bias_gelu
from megakernels.parallel import init, state
from megakernels.parallel.linear import ColumnParallelLinear, RowParallelLinear
from megakernels.parallel.random import checkpoint, get_rng_tracker

def _sub_seed(seed: int | None, name: str) -> int | None:
    return None if seed is None else init.derive_seed(seed, name)


class ParallelMLP(nn.Module):
    """Megatron's MLP ``fc2(gelu(fc1(x) + b1)) + b2`` split over the tensor-parallel ranks.

    Args:
        hidden_size: h.
        ffn_hidden_size: the inner size (default 4h); must divide by tp.
        sequence_parallel: input and output are sequence shards ``[s/tp, b, h]``.
        approximate: GeLU form, ``"tanh"`` (Megatron's) or ``"none"``.
        overlap_comm: overlap fc1's backward collectives with its weight-gradient GEMM.
        init_method: fc1's (default ``N(0, 0.02²)``); output_init_method: fc2's (default the same).
        seed: defines both weights (``derive_seed(seed, "fc1")`` / ``"fc2"``); default: each drawn from the default
            CPU generator.
        device, dtype: of the parameters.

    Forward: ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism; any ``[..., h]`` otherwise) -> same shape.

    Raises:
        ValueError: ``ffn_hidden_size`` not divisible by tp, non-positive sizes, or a bad ``approximate``.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int | None = None, sequence_parallel: bool = False, *,
                 approximate: str = "tanh", overlap_comm: bool = True, init_method: init.InitMethod | None = None,
                 output_init_method: init.InitMethod | None = None, seed: int | None = None, device=None,
                 dtype=None):
        super().__init__()
        ffn_hidden_size = 4 * hidden_size if ffn_hidden_size is None else ffn_hidden_size
        if approximate not in ("tanh", "none"):
            raise ValueError(f"ParallelMLP: approximate must be 'tanh' or 'none', got {approximate!r}")
        state.check_divisible(ffn_hidden_size=ffn_hidden_size)
        self.approximate = approximate
        self.fc1 = ColumnParallelLinear(hidden_size, ffn_hidden_size, sequence_parallel=sequence_parallel,
                                        skip_bias_add=True, overlap_comm=overlap_comm, init_method=init_method,
                                        seed=_sub_seed(seed, "fc1"), device=device, dtype=dtype)
        self.fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, sequence_parallel=sequence_parallel,
                                     init_method=output_init_method or init_method, seed=_sub_seed(seed, "fc2"),
                                     device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, b1 = self.fc1(x)
        return self.fc2(bias_gelu(y, b1, self.approximate))


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention with the heads split over the tensor-parallel ranks.

    Args:
        hidden_size: h; must divide by ``num_heads``.
        num_heads: n; must divide by tp (and be >= tp).
        causal: causal (GPT) or bidirectional (BERT) attention.
        sequence_parallel: input and output are sequence shards ``[s/tp, b, h]``.
        core: the attention core, a name for ``megakernels.nn.attention_core`` (``"flash"``, ``"torch"``) or a
            module ``core(q, k, v, mask=None)`` on ``[b, s, n/tp, h/n]`` (its causality and dropout its own).
        attention_dropout: dropout on the attention probabilities while training, for a core given by name
            (per-TP-rank stream: needs ``model_parallel_seed``).
        bias: biases on the QKV and output projections.
        recompute: recompute the attention core in backward instead of saving its activations (Megatron's
            "selective" recomputation; the dropout streams are replayed, so the result is unchanged).
        overlap_comm, init_method, output_init_method, device, dtype: as ``ParallelMLP``; seed as ``ParallelMLP``
            (``"qkv"`` / ``"proj"``).

    Forward: ``x`` ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) -> same shape;
    ``attention_mask``: optional bool ``[b, 1, 1, s]`` (or broadcastable to ``[b, n, s, s]``), True = masked out
    (padding keys).

    Raises:
        ValueError: ``num_heads`` smaller than or not divisible by tp, ``hidden_size`` not divisible by
            ``num_heads``, ``attention_dropout`` outside [0, 1), or an input that is not 3-D ``[s, b, h]``.
    """

    def __init__(self, hidden_size: int, num_heads: int, causal: bool = True, sequence_parallel: bool = False, *,
                 core: str | nn.Module = "flash", attention_dropout: float = 0.0, bias: bool = True,
                 recompute: bool = False, overlap_comm: bool = True, init_method: init.InitMethod | None = None,
                 output_init_method: init.InitMethod | None = None, seed: int | None = None, device=None,
                 dtype=None):
        super().__init__()
        cls = type(self).__name__
        state.check_divisible(num_heads=num_heads)
        if hidden_size % num_heads:
            raise ValueError(f"{cls}: hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"{cls}: attention_dropout must be in [0, 1), got {attention_dropout}")
        self.hidden_size, self.num_heads, self.causal = hidden_size, num_heads, bool(causal)
        self.head_dim = hidden_size // num_heads
        self.local_heads = num_heads // state.tp_size()
        self.core = attention_core(core, causal, attention_dropout=attention_dropout) if isinstance(core, str) \
            else core
        self.recompute = bool(recompute)
        self.qkv = ColumnParallelLinear(hidden_size, 3 * hidden_size, bias, sequence_parallel=sequence_parallel,
                                        overlap_comm=overlap_comm, init_method=init_method,
                                        seed=_sub_seed(seed, "qkv"), device=device, dtype=dtype)
        self.proj = RowParallelLinear(hidden_size, hidden_size, bias, sequence_parallel=sequence_parallel,
                                      init_method=output_init_method or init_method, seed=_sub_seed(seed, "proj"),
                                      device=device, dtype=dtype)

    def _core(self, q, k, v, mask):
        if self.training and getattr(self.core, "dropout_p", 0.0) > 0.0:
            with get_rng_tracker().fork():
                return self.core(q, k, v, mask=mask)
        return self.core(q, k, v, mask=mask)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"{type(self).__name__}: x must be [s, b, h] (sequence first), got shape "
                             f"{tuple(x.shape)}")
        qkv = self.qkv(x)  # [s, b, 3h/tp] (the whole sequence, also under sequence parallelism)
        s, b = qkv.shape[:2]
        q, k, v = qkv.view(s, b, self.local_heads, 3, self.head_dim).permute(1, 0, 2, 3, 4).unbind(3)
        if self.recompute and torch.is_grad_enabled():
            ctx = checkpoint(self._core, q, k, v, attention_mask)
        else:
            ctx = self._core(q, k, v, attention_mask)
        ctx = ctx.permute(1, 0, 2, 3).reshape(s, b, self.local_heads * self.head_dim)
        return self.proj(ctx)
