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

from megakernels.nn.attention import DocumentMask, attention_core
from megakernels.nn.norms import FusedRMSNorm
from megakernels.ops.bias_gelu import bias_gelu
from megakernels.ops.swiglu import geglu, swiglu
from megakernels.parallel import init, state
from megakernels.parallel.context import ring_attention
from megakernels.parallel.linear import ColumnParallelLinear, RowParallelLinear, linear_with_async_comm
from megakernels.parallel.params import mark_fused, mark_sequence_parallel, mark_tensor_parallel
from megakernels.parallel.random import checkpoint, get_rng_tracker


def sub_seed(seed: int | None, name: str) -> int | None:
    return None if seed is None else init.derive_seed(seed, name)


class ParallelMLP(nn.Module):
    """Megatron's MLP ``fc2(gelu(fc1(x) + b1)) + b2`` split over the tensor-parallel ranks, or the gated
    ``fc2(silu(x W_gate) * (x W_up))`` of Llama (``activation="swiglu"``), or Gemma's ``fc2(gelu_tanh(x W_gate) *
    (x W_up))`` (``activation="geglu"``).

    Gated (SwiGLU, GeGLU), fc1 is the packed ``[W_gate; W_up]`` (``[2f, h]`` in the full model) marked with stride 2,
    so TP rank r holds rows r of the gate *and* of the up projection, ``[gate_r | up_r]``: its half of the gated
    product needs nothing from another rank, and ``ops.swiglu`` (``geglu``) takes the packed output as it is.

    Args:
        hidden_size: h.
        ffn_hidden_size: the inner size f (default 4h); must divide by tp.
        sequence_parallel: input and output are sequence shards ``[s/tp, b, h]``.
        approximate: GeLU form, ``"tanh"`` (Megatron's) or ``"none"``.
        activation: ``"gelu"`` (the default), ``"swiglu"`` or ``"geglu"``.
        bias: biases on fc1 and fc2.
        overlap_comm: overlap fc1's backward collectives with its weight-gradient GEMM.
        init_method: fc1's (default ``N(0, 0.02²)``); output_init_method: fc2's (default the same).
        seed: defines both weights (``derive_seed(seed, "fc1")`` / ``"fc2"``); default: each drawn from the default
            CPU generator.
        device, dtype: of the parameters.

    Forward: ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism; any ``[..., h]`` otherwise) -> same shape.

    Raises:
        ValueError: ``ffn_hidden_size`` not divisible by tp, non-positive sizes, or a bad ``approximate``.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int | None = None,
        sequence_parallel: bool = False,
        *,
        approximate: str = "tanh",
        activation: str = "gelu",
        bias: bool = True,
        overlap_comm: bool = True,
        init_method: init.InitMethod | None = None,
        output_init_method: init.InitMethod | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        ffn_hidden_size = 4 * hidden_size if ffn_hidden_size is None else ffn_hidden_size
        if approximate not in ("tanh", "none"):
            raise ValueError(f"ParallelMLP: approximate must be 'tanh' or 'none', got {approximate!r}")
        if activation not in ("gelu", "swiglu", "geglu"):
            raise ValueError(f"ParallelMLP: activation must be 'gelu', 'swiglu' or 'geglu', got {activation!r}")
        state.check_divisible(ffn_hidden_size=ffn_hidden_size)
        self.approximate, self.activation = approximate, activation
        gated = activation != "gelu"
        self.fc1 = ColumnParallelLinear(
            hidden_size,
            2 * ffn_hidden_size if gated else ffn_hidden_size,
            bias,
            sequence_parallel=sequence_parallel,
            skip_bias_add=True,
            overlap_comm=overlap_comm,
            stride=2 if gated else 1,
            init_method=init_method,
            seed=sub_seed(seed, "fc1"),
            device=device,
            dtype=dtype,
        )
        self.fc2 = RowParallelLinear(
            ffn_hidden_size,
            hidden_size,
            bias,
            sequence_parallel=sequence_parallel,
            init_method=output_init_method or init_method,
            seed=sub_seed(seed, "fc2"),
            device=device,
            dtype=dtype,
        )
        if gated:  # [gate; up]: two logical matrices (Muon orthogonalises each)
            mark_fused(self.fc1.weight, parts=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, b1 = self.fc1(x)
        if self.activation != "gelu":
            gate = swiglu if self.activation == "swiglu" else geglu
            return self.fc2(gate(y if b1 is None else y + b1))
        if b1 is None:
            return self.fc2(F.gelu(y, approximate=self.approximate))
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
        window: sliding-window attention (Mistral; ``megakernels.ops.flash_attention``'s ``window``), also under
            context parallelism; needs a core given by name. None: every position.
        sinks: a learnable attention sink per head (gpt-oss; ``megakernels.ops.flash_attention``'s ``sinks``):
            the fp32 parameter ``sinks`` ``[n]`` in the full model, split by heads over the TP ranks, initialised
            to zero; also under context parallelism; needs a core given by name.
        overlap_comm, init_method, output_init_method, device, dtype: as ``ParallelMLP``; seed as ``ParallelMLP``
            (``"qkv"`` / ``"proj"``).

    Forward: ``x`` ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) -> same shape;
    ``attention_mask``: optional bool ``[b, 1, 1, s]`` (or broadcastable to ``[b, n, s, s]``), True = masked out
    (padding keys).

    Raises:
        ValueError: ``num_heads`` smaller than or not divisible by tp, ``hidden_size`` not divisible by
            ``num_heads``, ``attention_dropout`` outside [0, 1), or an input that is not 3-D ``[s, b, h]``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        causal: bool = True,
        sequence_parallel: bool = False,
        *,
        core: str | nn.Module = "flash",
        attention_dropout: float = 0.0,
        bias: bool = True,
        recompute: bool = False,
        window: int | None = None,
        sinks: bool = False,
        overlap_comm: bool = True,
        init_method: init.InitMethod | None = None,
        output_init_method: init.InitMethod | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        _check_heads(self, hidden_size, num_heads, attention_dropout)
        self.hidden_size, self.num_heads, self.causal = hidden_size, num_heads, bool(causal)
        self.head_dim = hidden_size // num_heads
        self.local_heads = num_heads // state.tp_size()
        self.core, self.window = make_core(self, core, causal, attention_dropout, window, sinks)
        self.sinks = _sinks(self.local_heads, sinks, device)
        self.recompute = bool(recompute)
        self.qkv = ColumnParallelLinear(
            hidden_size,
            3 * hidden_size,
            bias,
            sequence_parallel=sequence_parallel,
            overlap_comm=overlap_comm,
            init_method=init_method,
            seed=sub_seed(seed, "qkv"),
            device=device,
            dtype=dtype,
        )
        self.proj = RowParallelLinear(
            hidden_size,
            hidden_size,
            bias,
            sequence_parallel=sequence_parallel,
            init_method=output_init_method or init_method,
            seed=sub_seed(seed, "proj"),
            device=device,
            dtype=dtype,
        )
        mark_fused(self.qkv.weight, parts=3, head_dim=self.head_dim, head_major=True)  # rows (head, {q,k,v}, d)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, kv_cache=None) -> torch.Tensor:
        check_3d(self, x)
        qkv = self.qkv(x)  # [s, b, 3h/tp] (the whole sequence, also under sequence parallelism)
        s, b = qkv.shape[:2]
        # [b, s, heads, d] views, unbound before the transpose: their gradients then stack token-major, the layout of
        # qkv itself (no copy before the projection's backward GEMMs)
        q, k, v = (t.transpose(0, 1) for t in qkv.view(s, b, self.local_heads, 3, self.head_dim).unbind(3))
        if kv_cache is not None:
            k, v = kv_cache.update(self, k, v)
        ctx = attend(self, q, k, v, attention_mask)
        return self.proj(ctx.permute(1, 0, 2, 3).reshape(s, b, self.local_heads * self.head_dim))


def _check_heads(module: nn.Module, hidden_size: int, num_heads: int, attention_dropout: float) -> None:
    """Heads split over the TP ranks, whole head dims, a dropout probability."""
    cls = type(module).__name__
    state.check_divisible(num_heads=num_heads)
    if hidden_size % num_heads:
        raise ValueError(f"{cls}: hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    if not 0.0 <= attention_dropout < 1.0:
        raise ValueError(f"{cls}: attention_dropout must be in [0, 1), got {attention_dropout}")


def make_core(
    module: nn.Module,
    core,
    causal: bool,
    attention_dropout: float,
    window: int | None,
    sinks: bool = False,
    softmax_scale: float | None = None,
):
    """(the attention core: ``core`` itself or the library's core of that name, the window as an int or None)."""
    if not isinstance(core, str):
        if softmax_scale is not None:
            raise ValueError(f"{type(module).__name__}: softmax_scale needs a core given by name, not a module")
        if window:
            raise ValueError(f"{type(module).__name__}: a sliding window needs a core given by name, not a module")
        if sinks:
            raise ValueError(f"{type(module).__name__}: attention sinks need a core given by name, not a module")
        return core, None
    made = attention_core(core, causal, softmax_scale, attention_dropout=attention_dropout, window=window)
    return made, made.window


def _sinks(local_heads: int, sinks: bool, device) -> nn.Parameter | None:
    """The learnable sink logits of this rank's heads (fp32 ``[local_heads]``, zero: no pull at the start; split by
    heads over the TP ranks), or None without sinks."""
    if not sinks:
        return None
    p = nn.Parameter(torch.zeros(local_heads, dtype=torch.float32, device=device))
    mark_tensor_parallel(p, dim=0)
    return p


def _sink_logits(module: nn.Module, q: torch.Tensor) -> torch.Tensor | None:
    """The module's sinks as the kernels take them (fp32; fp64 for fp64 q), or None."""
    sinks = getattr(module, "sinks", None)
    if sinks is None:
        return None
    return sinks.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def check_3d(module: nn.Module, x: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"{type(module).__name__}: x must be [s, b, h] (sequence first), got shape {tuple(x.shape)}")


def _run_core(module: nn.Module, q, k, v, mask):
    """``mask``: None, a boolean mask (True = masked out) or a ``DocumentMask`` (packed sequences)."""
    documents = mask.ids if isinstance(mask, DocumentMask) else None
    sinks = _sink_logits(module, q)
    if state.is_initialized() and state.cp_size() > 1:
        if mask is not None and documents is None:
            raise ValueError(
                f"{type(module).__name__}: context parallelism takes no boolean attention mask (padding masks "
                "are not split over the ring; packed documents are, as a DocumentMask)"
            )
        return ring_attention(
            q,
            k,
            v,
            causal=module.causal,
            group=state.cp_group(),
            softmax_scale=getattr(module.core, "softmax_scale", None),
            window=getattr(module, "window", None),
            documents=documents,
            sinks=sinks,
        )
    kwargs = {"mask": mask} if documents is None else {"documents": documents}
    if sinks is not None:
        kwargs["sinks"] = sinks
    if module.training and getattr(module.core, "dropout_p", 0.0) > 0.0:
        with get_rng_tracker().fork():
            return module.core(q, k, v, **kwargs)
    return module.core(q, k, v, **kwargs)


def _observe_logits(module: nn.Module, q, k, mask) -> None:
    """Raise ``module.max_logits`` by this forward's logits (called by the attention blocks; ``mask``: None, a
    boolean mask or a ``DocumentMask``)."""
    from megakernels.nn.attention import DocumentMask
    from megakernels.ops.attention_logits import max_logits

    core = module.core
    documents = mask.ids if isinstance(mask, DocumentMask) else None
    with torch.no_grad():
        got = max_logits(
            q,
            k,
            getattr(core, "softmax_scale", None),
            getattr(core, "causal", module.causal),
            getattr(module, "window", None),
            None if documents is not None else mask,
            documents,
        )
        module.max_logits = torch.maximum(module.max_logits, got)


def attend(module: nn.Module, q, k, v, mask):
    """The attention core on ``[b, s, heads, d]`` q, k, v: the module's core, or ring attention over the context-
    parallel group; recomputed in backward with selective recomputation. A block tracked by qk-clip
    (``megakernels.optim.qk_clip.track``) first raises its maximum logit per head, while training."""
    if module.training and getattr(module, "max_logits", None) is not None:
        _observe_logits(module, q, k, mask)
    if module.recompute and torch.is_grad_enabled():
        return checkpoint(_run_core, module, q, k, v, mask)
    return _run_core(module, q, k, v, mask)


class ParallelGroupedQueryAttention(nn.Module):
    """Grouped-query self-attention (Llama) with rotary position embeddings, heads split over the TP ranks.

    ``num_kv_heads`` key/value heads each serve ``num_heads / num_kv_heads`` query heads. Parameters (full-model
    layout, as HuggingFace's ``q_proj`` / ``k_proj`` + ``v_proj``): ``q.weight`` ``[heads·d, h]`` split by heads
    over the TP ranks, and ``kv.weight`` ``[2·kv_heads·d, h]`` (keys, then values) marked with stride 2 so a rank
    holds its keys and their values. With ``num_kv_heads`` a multiple of tp the key/value heads split evenly;
    with fewer key/value heads than ranks (tp a multiple of ``num_kv_heads``) each head is replicated on the
    ``tp / num_kv_heads`` consecutive ranks whose query heads use it, and their gradients are summed over those
    ranks (``params`` replicas). Both projections share one input collective: the forward multiplies by their
    concatenated weight (one GEMM; the concatenation copies the weight once per forward).

    Args:
        hidden_size, num_heads: h and the query heads (divisible by tp).
        num_kv_heads: key/value heads; a multiple or a divisor of tp.
        causal, sequence_parallel, core, attention_dropout, bias, recompute, window, sinks, overlap_comm,
        init_method, output_init_method, seed, device, dtype: as ``ParallelSelfAttention`` (seeds ``"q"``,
        ``"kv"``, ``"proj"``; one sink per query head).
        rotary: a module ``rotary(q, k, positions, seq_dim=0)`` applied to the queries and keys (e.g.
            ``megakernels.nn.RotaryEmbedding``), or None.
        proj_bias: a bias on the output projection (default ``bias``; Qwen 2.5 has q/k/v biases only).
        head_dim: each head's size (default ``hidden_size / num_heads``; the query width is ``num_heads · head_dim``).
        qk_norm_eps: an RMSNorm of this epsilon over each query and key head (``q_norm``, ``k_norm``: weights of
            size d shared by the heads, before the rotary embedding; Qwen 3), or None.
        qk_norm_offset: added to those norms' weights on each call (Gemma's 1: ``1 + weight``; default 0).
        softmax_scale: the scores' scale (default ``1 / sqrt(head_dim)``; Gemma's ``query_pre_attn_scalar ** -0.5``).

    Forward: ``x`` ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism), ``positions`` (int ``[s]``, the
    tokens' positions; default ``0..s-1``), optional ``attention_mask``, optional ``kv_cache``
    (``megakernels.nn.KVCache``: attend over the cached tokens too, and cache these) -> same shape as ``x``.

    Raises:
        ValueError: heads not divisible by tp, ``num_kv_heads`` neither a multiple nor a divisor of tp or not
            dividing ``num_heads``, or what ``ParallelSelfAttention`` raises.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        causal: bool = True,
        sequence_parallel: bool = False,
        *,
        core: str | nn.Module = "flash",
        attention_dropout: float = 0.0,
        bias: bool = False,
        recompute: bool = False,
        window: int | None = None,
        sinks: bool = False,
        rotary: nn.Module | None = None,
        overlap_comm: bool = True,
        proj_bias: bool | None = None,
        qk_norm_eps: float | None = None,
        qk_norm_offset: float = 0.0,
        head_dim: int | None = None,
        softmax_scale: float | None = None,
        init_method: init.InitMethod | None = None,
        output_init_method: init.InitMethod | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        cls = type(self).__name__
        tp = state.tp_size()
        state.check_divisible(num_heads=num_heads)
        if head_dim is None and hidden_size % num_heads:
            raise ValueError(f"{cls}: hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(f"{cls}: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(
                f"{cls}: num_kv_heads={num_kv_heads} must be a multiple of the tensor-parallel size "
                f"{tp} (heads split) or divide it (heads replicated)"
            )
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"{cls}: attention_dropout must be in [0, 1), got {attention_dropout}")
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.causal, self.recompute = bool(causal), bool(recompute)
        self.sequence_parallel, self.overlap_comm = bool(sequence_parallel), bool(overlap_comm)
        self.head_dim = d = hidden_size // num_heads if head_dim is None else int(head_dim)
        replicas = max(1, tp // num_kv_heads)
        self.local_heads, self.local_kv_heads = num_heads // tp, num_kv_heads * replicas // tp
        self.core, self.window = make_core(self, core, causal, attention_dropout, window, sinks, softmax_scale)
        self.sinks = _sinks(self.local_heads, sinks, device)
        self.rotary = rotary
        self.q = ColumnParallelLinear(
            hidden_size,
            num_heads * d,
            bias,
            sequence_parallel=sequence_parallel,
            init_method=init_method,
            seed=sub_seed(seed, "q"),
            device=device,
            dtype=dtype,
        )
        self.kv = ColumnParallelLinear(
            hidden_size,
            2 * num_kv_heads * d,
            bias,
            sequence_parallel=sequence_parallel,
            stride=2,
            replicas=replicas,
            init_method=init_method,
            seed=sub_seed(seed, "kv"),
            device=device,
            dtype=dtype,
        )
        self.proj = RowParallelLinear(
            num_heads * d,
            hidden_size,
            bias if proj_bias is None else proj_bias,
            sequence_parallel=sequence_parallel,
            init_method=output_init_method or init_method,
            seed=sub_seed(seed, "proj"),
            device=device,
            dtype=dtype,
        )
        mark_fused(self.q.weight, parts=1, head_dim=d)
        mark_fused(self.kv.weight, parts=2, head_dim=d)  # [keys; values]
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:  # one RMSNorm over each head's d (Qwen 3): replicated, each rank's heads partial
            self.q_norm = FusedRMSNorm(d, qk_norm_eps, device=device, dtype=dtype, offset=qk_norm_offset)
            self.k_norm = FusedRMSNorm(d, qk_norm_eps, device=device, dtype=dtype, offset=qk_norm_offset)
            mark_sequence_parallel(self.q_norm.weight, self.k_norm.weight)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        kv_cache=None,
    ) -> torch.Tensor:
        check_3d(self, x)
        weight = torch.cat([self.q.weight, self.kv.weight])
        bias = None if self.q.bias is None else torch.cat([self.q.bias, self.kv.bias])
        y = linear_with_async_comm(x, weight, bias, state.tp_group(), self.sequence_parallel, self.overlap_comm)
        s, b = y.shape[:2]
        d, nq, nkv = self.head_dim, self.local_heads, self.local_kv_heads
        q = y[..., : nq * d].view(s, b, nq, d)
        k, v = y[..., nq * d :].view(s, b, 2, nkv, d).unbind(2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(q, k, positions, seq_dim=0)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [b, s, heads, d]
        if kv_cache is not None:
            k, v = kv_cache.update(self, k, v)
        ctx = attend(self, q, k, v, attention_mask)
        return self.proj(ctx.transpose(0, 1).reshape(s, b, nq * d))


class ParallelCrossAttention(nn.Module):
    """Multi-head cross-attention: queries from ``x`` attend every position of a ``context`` (non-causal, any
    lengths), the heads split over the tensor-parallel ranks (Flamingo's text-to-image attention).

    Parameters (full-model layout): ``q.weight`` ``[h, h]`` split by heads; ``kv.weight`` ``[2h, context_size]``
    (keys, then values) marked with stride 2 so a rank holds its heads' keys and their values; ``proj`` row-parallel.
    The core is FlashAttention with ``sq ≠ sk`` (or PyTorch's SDPA, ``core="torch"``).

    Args:
        hidden_size, num_heads: h and the heads (divisible by tp).
        context_size: width of the context (default h).
        core, attention_dropout, bias, recompute, init_method, output_init_method, seed, device, dtype: as
            ``ParallelSelfAttention`` (seeds ``"q"``, ``"kv"``, ``"proj"``).

    Forward: ``x`` ``[sq, b, h]``, ``context`` ``[sk, b, context_size]`` -> ``[sq, b, h]``.

    Raises:
        ValueError: heads not divisible by tp, ``hidden_size`` not divisible by ``num_heads``, ``attention_dropout``
            outside [0, 1), inputs that are not 3-D, or context parallelism (the context is not split over a ring).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        context_size: int | None = None,
        *,
        core: str | nn.Module = "flash",
        attention_dropout: float = 0.0,
        bias: bool = True,
        recompute: bool = False,
        init_method: init.InitMethod | None = None,
        output_init_method: init.InitMethod | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        _check_heads(self, hidden_size, num_heads, attention_dropout)
        context_size = hidden_size if context_size is None else context_size
        self.causal, self.recompute = False, bool(recompute)
        self.head_dim = hidden_size // num_heads
        self.local_heads = num_heads // state.tp_size()
        self.core = attention_core(core, False, attention_dropout=attention_dropout) if isinstance(core, str) else core
        self.q = ColumnParallelLinear(
            hidden_size,
            hidden_size,
            bias,
            init_method=init_method,
            seed=sub_seed(seed, "q"),
            device=device,
            dtype=dtype,
        )
        self.kv = ColumnParallelLinear(
            context_size,
            2 * hidden_size,
            bias,
            stride=2,
            init_method=init_method,
            seed=sub_seed(seed, "kv"),
            device=device,
            dtype=dtype,
        )
        self.proj = RowParallelLinear(
            hidden_size,
            hidden_size,
            bias,
            init_method=output_init_method or init_method,
            seed=sub_seed(seed, "proj"),
            device=device,
            dtype=dtype,
        )
        mark_fused(self.q.weight, parts=1, head_dim=self.head_dim)
        mark_fused(self.kv.weight, parts=2, head_dim=self.head_dim)  # [keys; values]

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        check_3d(self, x)
        check_3d(self, context)
        if state.is_initialized() and state.cp_size() > 1:
            raise ValueError(
                f"{type(self).__name__}: context parallelism is not supported (the context would have "
                "to be split over the ring)"
            )
        (sq, b), sk, d, n = x.shape[:2], context.shape[0], self.head_dim, self.local_heads
        q = self.q(x).view(sq, b, n, d).transpose(0, 1)
        k, v = (t.transpose(0, 1) for t in self.kv(context).view(sk, b, 2, n, d).unbind(2))
        ctx = attend(self, q, k, v, None)  # [b, sq, n, d]
        return self.proj(ctx.transpose(0, 1).reshape(sq, b, n * d))
