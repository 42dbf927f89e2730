"""The forwards that replace transformers' own in patched modules, and the attention and loss functions registered
with transformers. Every one keeps the module's parameters and their names (state dicts load either way) and
computes what the module it replaces computes, through megakernels' fused ops (docs/integrations.md):

- norms: ``LayerNorm`` -> ``megakernels.ops.layer_norm``; ``*RMSNorm`` -> ``rms_norm`` (one pass each way, fp32
  statistics; transformers' RMSNorm rounds the normalised input to the input dtype before the weight, ours after);
  Gemma's ``x * (1 + weight)`` RMSNorm -> ``megakernels.nn.norms.offset_rms_norm`` (the ``1 + weight`` formed in
  fp32 per call, the stored weight unchanged).
- MLPs: GPT-2's ``c_fc`` + GeLU, BERT's intermediate ``dense`` + GeLU and its LM-head transform -> the GEMM
  without bias, then ``bias_gelu``; the Llama/Mistral MLP -> one GEMM against the concatenated gate and up weights
  (a copy of those weights per call, smaller than the activations it saves a pass over), then ``swiglu`` (Gemma's
  tanh-GeLU MLP: ``geglu``). A forward that reads a submodule's weight does so only while that submodule is a plain
  ``nn.Linear`` / ``Conv1D`` (``owned``, checked on every call: PEFT, quantisation or a hook may wrap it after the
  patch); otherwise it runs the module's own forward, which calls the submodules.
- Mixtral's / Qwen 3 MoE's / gpt-oss's / DeepSeek-V3's experts (``_dispatch``: under transformers' default
  ``"grouped_mm"``, or ``"megakernels"``) -> tokens sorted by expert (``megakernels.parallel.moe.dispatch.permute``),
  two ``grouped_gemm`` around ``swiglu`` (gpt-oss's clamped one, its interleaved gate/up columns reordered per call and
  its biases added), outputs weighted and summed back in fp32 (``unpermute``); their routers (the gate's GEMM as the
  class computes it, then softmax or sigmoid scores, DeepSeek's group-limited top-k with its correction bias,
  gpt-oss's softmax over the chosen logits, the weights normalised and scaled) -> ``megakernels.ops.moe_router``
  (one pass each way, fp32 math; ties go to the lower expert).
- attention (``_dispatch``: the calls of a patched model under transformers' default ``"sdpa"``, or under
  ``"megakernels"``) -> ``flash_attention`` when transformers passes no mask (causal without padding, or bidirectional
  without padding: its SDPA mask function returns None exactly then, and ours also when the only reason for a mask
  is a sliding window, which the kernel applies itself, skipping the key blocks outside it), gpt-oss's sinks
  (``s_aux``) inside the kernel, DeepSeek's value head dim apart from the query's; with a mask (padding, a chunked
  prefill), a softcap, a position bias or a head dim (the query's or the value's) the CUDA kernel does not take,
  transformers' own SDPA path runs (the family's eager attention where there are sinks, which SDPA has not); with
  ``output_attentions=True``, the family's eager attention (which returns the weights) under the same mask.
- tied input and output embeddings (GPT-2; Gemma 3, its lookup scaled; Llama, Qwen models with
  ``tie_word_embeddings``) -> one
  ``megakernels.nn.TiedEmbedding``: the lookup's gradient rows are added into the output layer's weight gradient
  instead of a zero-filled ``[vocab, hidden]`` table the engine then adds.
- causal-LM loss -> ``cross_entropy`` on the logits as they are (bf16 stays bf16: no fp32 copy of the logits),
  with transformers' label shift, ``ignore_index`` and ``num_items_in_batch`` normalisation; or, with the fused head
  (``fused_head_forward``, opt-in), the LM head and the loss as one ``linear_cross_entropy`` in training.

Every bound forward has the signature of the forward it replaces (``__signature__`` / ``functools.wraps``), so
``generate``, TRL and anything else that inspects ``forward`` sees the real parameters.

Each module forward is bound to one module instance by ``_families.patch_modules`` (``self`` is that module).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys

import torch
import torch.nn.functional as F

from megakernels import ops
from megakernels.nn.norms import offset_rms_norm
from megakernels.ops import gemm
from megakernels.ops.attention import MAX_TRITON_HEAD_DIM
from megakernels.ops.grouped_gemm import grouped_gemm
from megakernels.parallel.moe.dispatch import permute, unpermute

NAME = "megakernels"  # the attn_implementation (and mask function) registered with transformers


# ---- modules a forward may read the weights of ------------------------------------------------------------------


def _conv1d_class():
    from transformers.pytorch_utils import Conv1D

    return Conv1D


def owned(module) -> bool:
    """Whether a forward may read ``module``'s weight instead of calling it: a plain ``nn.Linear`` or transformers
    ``Conv1D`` (the exact class: PEFT's LoRA/DoRA layers, quantised and parametrized linears are other classes)
    with plain tensors for weights, no forward of its own other than one this integration bound, and no hooks
    (which a read of the weight would skip)."""
    cls = type(module)
    if cls is not torch.nn.Linear and cls is not _conv1d_class():
        return False
    own = module.__dict__.get("forward")
    if own is not None and not getattr(own, "megakernels", False):
        return False
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks:
        return False
    return type(module.weight) in _PLAIN and (module.bias is None or type(module.bias) in _PLAIN)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


# ---- norms --------------------------------------------------------------------------------------------------------


def _norm_weight_ok(x: torch.Tensor, w: torch.Tensor | None) -> bool:
    return w is None or w.dtype == x.dtype or (w.dtype == torch.float32 and x.dtype in (torch.float16, torch.bfloat16))


def layer_norm_forward(self, x):
    """``torch.nn.LayerNorm`` (1-D normalized shape) -> ``layer_norm``; x ``[..., h]`` in any dtype it takes, out in
    x's dtype. Other shapes or weight dtypes run torch's forward."""
    if len(self.normalized_shape) != 1 or not _norm_weight_ok(x, self.weight):
        return torch.nn.LayerNorm.forward(self, x)
    return ops.layer_norm(x, self.weight, self.bias, self.eps)


def rms_norm_forward(self, x, *, input_dtype: bool = False):
    """transformers' ``*RMSNorm`` (``weight``, ``variance_epsilon``) -> ``rms_norm``; x ``[..., h]``, out in x's
    dtype. A weight in another dtype than x runs transformers' forward (its output dtype is the promoted one),
    except with ``input_dtype`` (gpt-oss's norm, which multiplies in fp32 and returns x's dtype whatever the
    weight's: the fp32 norms of an fp16 model stay fused) for a fp16/bf16/fp32 x."""
    if self.weight.dtype != x.dtype:  # transformers promotes (fp32 weight * bf16 x is fp32): its own forward
        if not input_dtype or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return type(self).forward(self, x)
        return ops.rms_norm(x, self.weight.float(), self.variance_epsilon)
    return ops.rms_norm(x, self.weight, self.variance_epsilon)


def offset_rms_norm_forward(self, x):
    """Gemma's RMSNorm (``weight`` stored as the offset from one, ``eps``): ``x / rms(x) * (1 + weight)`` with the
    product in fp32, out in x's dtype whatever the weight's, as Gemma's forward (``offset_rms_norm``); x
    ``[..., h]``. A fp64 x (which Gemma's forward computes in fp32) runs the class's forward."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return type(self).forward(self, x)
    return offset_rms_norm(x, self.weight, self.eps, 1.0)


# ---- MLPs ---------------------------------------------------------------------------------------------------------

_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


def gelu_kind(name) -> str | None:
    """``approximate`` of ``bias_gelu`` for transformers' activation name, None when it is no GeLU we fuse."""
    return _GELU.get(name) if isinstance(name, str) else None


def gpt2_mlp_forward(self, hidden_states, *, approximate: str):
    """GPT-2's MLP (``c_fc``/``c_proj`` Conv1D, weight ``[in, out]``): ``[..., h]`` -> ``[..., h]``; transformers'
    forward where ``c_fc`` is not ``owned``."""
    fc = self.c_fc  # Conv1D: x @ weight + bias, weight [in, out]
    if not owned(fc):
        return type(self).forward(self, hidden_states)
    h = ops.bias_gelu(gemm.linear(hidden_states, fc.weight.t()), fc.bias, approximate=approximate)
    return self.dropout(self.c_proj(h))


def bert_intermediate_forward(self, hidden_states, *, approximate: str):
    """BERT's intermediate layer: ``[..., h]`` -> ``[..., ffn]``, GeLU(dense); transformers' forward where
    ``dense`` is not ``owned``."""
    if not owned(self.dense):
        return type(self).forward(self, hidden_states)
    return ops.bias_gelu(gemm.linear(hidden_states, self.dense.weight), self.dense.bias, approximate=approximate)


def bert_head_transform_forward(self, hidden_states, *, approximate: str):
    """BERT's LM-head transform: dense + GeLU fused, then its LayerNorm (itself patched when norms are);
    transformers' forward where ``dense`` is not ``owned``."""
    if not owned(self.dense):
        return type(self).forward(self, hidden_states)
    h = ops.bias_gelu(gemm.linear(hidden_states, self.dense.weight), self.dense.bias, approximate=approximate)
    return self.LayerNorm(h)


_GLU = {"silu": ops.swiglu, "gelu_tanh": ops.geglu}


def gated_mlp_forward(self, x, *, activation: str = "silu"):
    """Llama/Mistral's MLP, ``down(silu(gate(x)) * up(x))`` (``activation="gelu_tanh"``: Gemma's, the tanh GeLU):
    ``[..., h]`` -> ``[..., h]``; transformers' forward (which calls ``gate_proj`` and ``up_proj``) where either is
    not ``owned``."""
    gate, up = self.gate_proj, self.up_proj
    if not (owned(gate) and owned(up)):
        return type(self).forward(self, x)
    weight = torch.cat([gate.weight, up.weight])
    bias = torch.cat([gate.bias, up.bias]) if gate.bias is not None else None
    return self.down_proj(_GLU[activation](gemm.linear(x, weight, bias)))


# ---- linear layers ------------------------------------------------------------------------------------------------


def linear_forward(self, x):
    """``nn.Linear``: ``x Wᵀ + b`` through ``megakernels.ops.gemm`` (oneDNN for fp32 on the CPU, ``F.linear``
    elsewhere)."""
    return gemm.linear(x, self.weight, self.bias)


def conv1d_forward(self, x):
    """transformers' ``Conv1D`` (GPT-2's projections, weight ``[in, out]``): ``x W + b`` as ``linear_forward``."""
    return gemm.linear(x, self.weight.t(), self.bias)


# The expert classes (qualified names) whose gate is gpt-oss's clamped SwiGLU (``_families`` fills it from the
# families' ``clamped_experts``): ``limit`` and ``alpha`` on the module, gate and up columns interleaved.
CLAMPED_SWIGLU_EXPERTS: set[str] = set()


def _experts_gate(self):
    """The fused gate of an expert bank: ``swiglu`` where it computes transformers' default gate with SiLU,
    ``swiglu(limit=, alpha=)`` for gpt-oss's clamped one; None for any other (a class's own gate, an activation
    other than SiLU, no gate)."""
    cls = type(self)
    if not getattr(self, "has_gate", True):
        return None
    if f"{cls.__module__}.{cls.__qualname__}" in CLAMPED_SWIGLU_EXPERTS:
        return functools.partial(ops.swiglu, limit=float(self.limit), alpha=float(self.alpha))
    from transformers.integrations.moe import _default_apply_gate

    act = getattr(getattr(self, "config", None), "hidden_act", None)
    default_gate = getattr(cls, "_apply_gate", _default_apply_gate) is _default_apply_gate
    return ops.swiglu if act in ("silu", "swish") and default_gate else None


def _gate_first(t: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Gate/up ``[..., 2f, ·]`` rows (``dim=-2``) as the kernels take them, gate first: interleaved ones (gpt-oss:
    gate = rows 0, 2, ..., up = rows 1, 3, ...) gathered into a copy; concatenated ones as they are."""
    return torch.cat([t[..., 0::2, :], t[..., 1::2, :]], dim=-2) if interleaved else t


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Expert banks in transformers' layouts (``gate_up_proj`` ``[E, 2f, h]``, ``down_proj`` ``[E, h, f]``; or
    with ``is_transposed`` ``[E, h, 2f]`` / ``[E, f, h]``; gate and up concatenated, or interleaved without
    ``is_concatenated``; ``*_bias`` ``[E, ·]`` with ``has_bias``), transformers' experts-function signature
    (hidden ``[T, h]``, ``top_k_index`` / ``top_k_weights`` ``[T, k]``): the rows of every expert in one grouped GEMM
    each way around the fused gate (``_experts_gate``: Mixtral's / Qwen 3 MoE's SwiGLU, gpt-oss's clamped one). A
    transposed or interleaved bank is reordered into the kernels' layout per call (a copy of the weights; the
    parameters are untouched). Experts with another gate run transformers' ``grouped_mm`` function."""
    gate = _experts_gate(self)
    if gate is None:
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    transposed = getattr(self, "is_transposed", False)
    interleaved = not getattr(self, "is_concatenated", True)
    w_up, w_down = self.gate_up_proj, self.down_proj
    if transposed:
        w_up, w_down = w_up.transpose(1, 2), w_down.transpose(1, 2).contiguous()
    w_up = _gate_first(w_up, interleaved).contiguous()
    perm = permute(hidden_states, top_k_index, self.num_experts)
    y = grouped_gemm(perm.rows, w_up, perm.group_sizes)
    if getattr(self, "has_bias", False):
        expert = torch.repeat_interleave(
            torch.arange(self.num_experts, device=y.device), perm.group_sizes, output_size=y.shape[0]
        )
        b_up = _gate_first(self.gate_up_proj_bias[..., None], interleaved)[..., 0]
        y = grouped_gemm(gate(y + b_up[expert]), w_down, perm.group_sizes) + self.down_proj_bias[expert]
    else:
        y = grouped_gemm(gate(y), w_down, perm.group_sizes)
    # PyTorch's multiply-and-sum, not the fused one: it rounds as the unpatched experts' sum does, so a patched
    # model's fp32 training stays on the unpatched curve (the fused sum's other rounding order, amplified by AdamW,
    # moves gpt-oss's DoRA loss by 3e-4 within three steps)
    return unpermute(y, perm, top_k_weights, fused=False)


def router_forward(
    self, hidden_states, *, score: str = "softmax", topk_softmax: bool = False, cast: bool = False,
    fp32: bool = False, normalize: bool | None = None,
):  # fmt: skip
    """transformers' top-k routers (Mixtral's, Qwen 3 MoE's, gpt-oss's, DeepSeek-V2's and V3's): hidden ``[..., h]``
    -> ``(router_logits [T, E], top_k_weights [T, k], top_k_index [T, k])`` as the class returns them (``cast``: the
    weights in the logits' dtype, as Qwen 3 MoE's and gpt-oss's; ``fp32``: the gate's GEMM in fp32, as DeepSeek's),
    the routing through ``ops.moe_router``. ``normalize`` (None: the module's ``norm_topk_prob``, default True) and
    the module's attributes say the rest: ``bias`` on the logits, ``e_score_correction_bias`` on the selection keys,
    ``num_group`` / ``topk_group``, ``routed_scaling_factor``. A ``topk_method`` other than greedy top-k (DeepSeek-V2's
    ``group_limited_greedy``, which scores a group by its best expert) runs the class's forward."""
    if getattr(self, "topk_method", "greedy") != "greedy":
        return type(self).forward(self, hidden_states)
    h = hidden_states.reshape(-1, self.hidden_dim)
    if fp32:
        logits = F.linear(h.float(), self.weight.float())
    else:
        logits = F.linear(h, self.weight, getattr(self, "bias", None))
    if normalize is None:
        normalize = bool(getattr(self, "norm_topk_prob", True))
    out = ops.moe_router(
        logits.float(), self.top_k, score=score, topk_softmax=topk_softmax,
        normalize=normalize and self.top_k > 1 and not topk_softmax,
        bias=getattr(self, "e_score_correction_bias", None), scale=float(getattr(self, "routed_scaling_factor", 1.0)),
        n_group=int(getattr(self, "num_group", None) or 1), topk_group=getattr(self, "topk_group", None),
    )  # fmt: skip
    return logits, out.weights.to(logits.dtype) if cast else out.weights, out.experts


# ---- attention ----------------------------------------------------------------------------------------------------


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None, **kwargs):
    """transformers' attention-function signature: q ``[b, h, sq, d]``, k ``[b, h_kv, sk, d]``, v ``[b, h_kv, sk, d_v]``
    (``h % h_kv == 0``; ``d_v`` may differ from ``d``: DeepSeek's latent attention) -> (out ``[b, sq, h, d_v]``, weights
    or None), scaled by ``scaling`` (the module's: DeepSeek's YaRN mscale, Gemma's ``query_pre_attn_scalar``; None:
    ``1/sqrt(d)``). Without a mask this is what transformers' SDPA path computes: causal (unless the module or the call
    says otherwise) for more than one query, the keys cut to the queries when a static cache hands over more keys than
    queries at prefill, no mask for a single query. With ``output_attentions=True`` the family's eager attention runs
    under the same mask and returns the weights ``[b, h, sq, sk]``.

    Raises:
        ValueError: ``output_attentions=True`` for a module whose family has no eager attention to return weights.
    """
    d, d_v, sq = query.shape[-1], value.shape[-1], query.shape[2]
    if weights_requested(kwargs):
        return _eager_attention(module, query, key, value, attention_mask, scaling, dropout, is_causal, kwargs)
    sinks = kwargs.get("s_aux")
    unsupported = (
        kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or (query.device.type == "cuda" and any(n % 8 or n > MAX_TRITON_HEAD_DIM for n in (d, d_v)))
    )
    if sinks is not None and (attention_mask is not None or unsupported):  # SDPA has no sinks
        return _eager_attention(module, query, key, value, attention_mask, scaling, dropout, is_causal, kwargs)
    if attention_mask is not None or unsupported:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    causal, window, key, value = _unmasked_causality(module, query, key, value, is_causal, kwargs)
    documents = packed_documents(kwargs.get("position_ids"), query.shape[0], sq)
    out = ops.flash_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        causal=causal,
        softmax_scale=scaling,
        dropout_p=float(dropout),
        window=window,
        documents=documents,
        sinks=None if sinks is None else sinks.float(),  # the kernel's sinks are fp32; the cast passes the gradient
    )
    return out, None


def weights_requested(kwargs) -> bool:
    """Whether the caller asked for the attention weights: ``output_attentions`` reaching the attention, or (models
    that keep it from their layers, GPT-2's) transformers' output collector recording them for this forward."""
    if kwargs.get("output_attentions"):
        return True
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without the collector passes output_attentions down
        return False
    collected = _active_collector.get()
    return collected is not None and ("attentions" in collected or "cross_attentions" in collected)


def _unmasked_causality(module, query, key, value, is_causal, kwargs):
    """(causal, window, key, value) of a call transformers made without a mask: causal unless the module or the call
    says otherwise, and only for more than one query (one query attends every key) or under a sliding window
    (Mistral's, Qwen's sliding layers': the kernel's own window); a static cache's unfilled keys cut at prefill."""
    sq = query.shape[2]
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    window = kwargs.get("sliding_window")
    causal = bool(causal) and (sq > 1 or window is not None)
    if causal and sq > 1 and key.shape[2] > sq:
        key, value = key[:, :, :sq], value[:, :, :sq]
    return causal, window, key, value


def _eager_attention(module, query, key, value, attention_mask, scaling, dropout, is_causal, kwargs):
    """The family's ``eager_attention_forward`` (the one transformers runs under ``"eager"``, returning the weights;
    sinks included) with the mask the call stands for: ``attention_mask`` as an additive mask, or without one the
    causal / sliding window / packed-sequence mask FlashAttention would have applied."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        why = "output_attentions=True" if weights_requested(kwargs) else "attention sinks (s_aux) with a mask"
        raise ValueError(
            f"{why}: {type(module).__name__} has no eager attention to compute it with; "
            "load the model with attn_implementation='eager'"
        )
    if attention_mask is None:
        causal, window, key, value = _unmasked_causality(module, query, key, value, is_causal, kwargs)
        allowed = None
        sq, sk = query.shape[2], key.shape[2]
        q_pos = torch.arange(sk - sq, sk, device=query.device)[:, None]
        k_pos = torch.arange(sk, device=query.device)[None, :]
        if causal:
            allowed = k_pos <= q_pos
        if window is not None:
            allowed = (q_pos - k_pos < window) & (True if allowed is None else allowed)
        documents = packed_documents(kwargs.get("position_ids"), query.shape[0], sq)
        if documents is not None and sq == sk:
            same = documents[:, :, None] == documents[:, None, :]
            allowed = same if allowed is None else same & allowed
        if allowed is not None:
            attention_mask = allowed.expand(query.shape[0], 1, sq, sk) if allowed.dim() == 2 else allowed[:, None]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min
        )
    kwargs = {k: v for k, v in kwargs.items() if k != "is_causal"}
    return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def packed_documents(position_ids, batch: int, sq: int) -> torch.Tensor | None:
    """Padding-free packed batches (transformers' ``DataCollatorWithFlattening``: the sequences concatenated, their
    ``position_ids`` restarting at each): each token's sequence, int32 ``[b, s]`` (a new one wherever a position is
    not its predecessor's plus one, transformers' rule); None when no row holds more than one sequence (read on the
    host once per positions tensor, remembered on it for the other layers; always the ids while compiling) or the
    positions are not the queries'."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != sq or sq < 2:
        return None
    compiling = torch.compiler.is_compiling()
    key = (position_ids._version, batch)
    cached = None if compiling else getattr(position_ids, "_megakernels_documents", None)
    if cached is not None and cached[0] == key:  # every layer asks with the same positions: one host read a forward
        return cached[1]
    pos = position_ids.expand(batch, -1) if position_ids.shape[0] != batch else position_ids
    starts = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1
    documents = starts.cumsum(-1, dtype=torch.int32)
    if compiling:
        return documents
    if not bool(documents[:, -1].any()):
        documents = None
    position_ids._megakernels_documents = (key, documents)
    return documents


# The model types whose patched attention takes a padding-free packed batch from ``position_ids`` (the families
# with ``packs``; ``_families`` fills it where it defines them, so that this module needs nothing of that one).
PACKING_MODEL_TYPES: set[str] = set()


def _packed_without_padding(allow_is_causal_skip: bool, kwargs: dict) -> bool:
    """transformers asks for a mask although nothing is padded and nothing is cached: in the families patched here
    that is a packed batch (its positions restart), which the attention takes from ``position_ids`` instead."""
    return (
        not allow_is_causal_skip
        and not kwargs.get("use_vmap", False)  # a mask function of the model's own (Gemma's bidirectional overlay)
        and getattr(kwargs.get("config"), "model_type", None) in PACKING_MODEL_TYPES
        and kwargs.get("attention_mask") is None
        and not isinstance(kwargs.get("q_offset", 0), torch.Tensor)
        and kwargs.get("q_offset", 0) == 0
        and kwargs.get("kv_offset", 0) == 0
        and kwargs.get("kv_length") == kwargs.get("q_length")
    )


def attention_mask(*args, local_size: int | None = None, allow_is_causal_skip: bool = True, **kwargs):
    """The mask function registered with the attention: transformers' SDPA mask, except that a sliding window
    alone needs no mask (FlashAttention applies it): None whenever the mask would be None without the window —
    causal attention without padding, a whole prefill or one decoded query; and none for a padding-free packed batch
    (the attention reads the sequences from ``position_ids`` and FlashAttention keeps them apart)."""
    from transformers.masking_utils import sdpa_mask

    if _packed_without_padding(allow_is_causal_skip, kwargs):
        return None
    if local_size is not None and allow_is_causal_skip and sdpa_mask(*args, **kwargs) is None:
        return None
    return sdpa_mask(*args, local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


# ---- tied input and output embeddings ------------------------------------------------------------------------------


def tied_lookup_forward(self, input_ids, *, table, scaled: bool = False):
    """The input embedding of a tied table (``megakernels.nn.TiedEmbedding``): its gradient goes into the output
    layer's; ``scaled``: the rows times the module's ``embed_scale`` in the weight's dtype (Gemma's scaled
    embedding). A module whose table was replaced since (resized, re-tied) runs its class's own forward."""
    if self.weight is not table.weight:
        return type(self).forward(self, input_ids)
    rows = table.lookup(input_ids, self.padding_idx)
    return rows * self.embed_scale.to(self.weight.dtype) if scaled else rows


def tied_logits_forward(self, hidden, *, table):
    """The output layer of a tied table (``megakernels.nn.TiedEmbedding``), or ``nn.Linear``'s own forward once its
    weight is another tensor or it has a bias."""
    if self.weight is not table.weight or self.bias is not None:
        return type(self).forward(self, hidden)
    return table.logits(hidden)


# ---- loss ---------------------------------------------------------------------------------------------------------


def causal_lm_loss(
    logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100, shift_labels=None, **kwargs
):
    """transformers' ``ForCausalLMLoss`` (tokens < n predict n; mean over the counted tokens, or sum over
    ``num_items_in_batch``) through the fused cross-entropy: fp32 math, the logits read in their own dtype."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(logits.device)
    per_token = ops.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target, ignore_index=ignore_index, vocab_size=vocab_size
    )
    if num_items_in_batch is None:
        return per_token.sum() / (target != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(per_token.device)
    return per_token.sum() / num_items_in_batch


@functools.cache
def forward_signature(cls) -> inspect.Signature:
    """The signature of ``cls.forward`` (``self`` included), through transformers' decorators."""
    return inspect.signature(cls.forward)


def bound_signature(cls) -> inspect.Signature:
    """``cls.forward``'s signature without ``self``: what a forward bound to an instance shows."""
    sig = forward_signature(cls)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def _output_class(cls):
    """The output class ``cls.forward`` declares (a ``ModelOutput`` dataclass), else ``CausalLMOutputWithPast``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils import ModelOutput

    out = forward_signature(cls).return_annotation
    return out if isinstance(out, type) and issubclass(out, ModelOutput) else CausalLMOutputWithPast


def head_fuses(model) -> bool:
    """Whether the fused head may stand in for ``model``'s LM head and loss on this call: the head is ``owned`` (not
    wrapped by PEFT or anything else since the patch), the loss is transformers' causal-LM loss or ours (not one the
    caller installed), and autocast, if on, computes in the head's dtype."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or not owned(head):
        return False
    loss = model.__dict__.get("_loss_function")
    if loss is not None and loss is not causal_lm_loss:
        return False
    device = head.weight.device.type
    dtype = autocast_dtype(device)
    return dtype is None or dtype == head.weight.dtype


def autocast_dtype(device: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device`` (a device type), None where it is off or has no autocast
    (``meta``)."""
    if not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def fused_head_forward(self, *args, _body: str = "model", **kwargs):
    """A ``*ForCausalLM``'s forward (bound with its class forward's signature: ``self.<_body>``, the decoder, then
    ``self.lm_head``) whose training loss is ``ops.linear_cross_entropy``: in training mode with ``labels``, the
    hidden states go straight into the fused LM head + cross-entropy (chunks of tokens; the ``[tokens, vocab]``
    logits are not made) and the output (the class's output type, cache and hidden states included) has no
    ``logits`` until ``.logits`` is read, which computes them (``_lazy_logits_class``); transformers' label shift,
    ``ignore_index`` -100, ``shift_labels`` and ``num_items_in_batch`` as its causal-LM loss; a config's
    ``final_logit_softcapping`` (Gemma's) caps the logits inside the fused loss, and the logits read. Otherwise (no
    labels, evaluation mode, a head or loss ``head_fuses`` refuses, router logits asked for) the class's own
    forward, logits included."""
    cls = type(self)
    sig = forward_signature(cls)
    try:
        arguments = dict(sig.bind(self, *args, **kwargs).arguments)
    except TypeError:  # the class's forward raises its own error
        return cls.forward(self, *args, **kwargs)
    labels = arguments.get("labels")
    if labels is None or not self.training or not head_fuses(self):
        return cls.forward(self, *args, **kwargs)
    arguments.pop(next(iter(sig.parameters)))  # self
    var_kw = [n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD]
    extra = dict(arguments.pop(var_kw[0], {})) if var_kw else {}
    router = arguments.get("output_router_logits", extra.get("output_router_logits"))
    if router or (router is None and getattr(self.config, "output_router_logits", False)):
        return cls.forward(self, *args, **kwargs)  # an MoE's auxiliary loss joins the loss there
    arguments.pop("labels")
    keep = arguments.pop("logits_to_keep", 0)
    return_dict = extra.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    outputs = getattr(self, _body)(**arguments, **extra, return_dict=True)
    hidden = outputs.last_hidden_state
    if keep is not None and not (isinstance(keep, int) and keep == 0):  # what the class's forward projects
        hidden = hidden[:, slice(-keep, None) if isinstance(keep, int) else keep, :]
    shift = extra.get("shift_labels")
    if shift is None:
        shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
    shift = shift.to(hidden.device)
    head = self.get_output_embeddings()
    softcap = getattr(self.config, "final_logit_softcapping", None)
    per_token = ops.linear_cross_entropy(
        hidden, head.weight, shift, bias=head.bias, vocab_size=self.config.vocab_size, softcap=softcap
    )
    n = extra.get("num_items_in_batch")
    if n is None:
        n = (shift != -100).sum()
    elif torch.is_tensor(n):
        n = n.to(per_token.device)
    out_cls = _output_class(cls)
    fields = {f.name for f in dataclasses.fields(out_cls)} - {"loss", "logits"}
    rest = {k: v for k, v in outputs.items() if k in fields}
    logits = functools.partial(_head_logits, head, hidden, softcap)
    if not return_dict:  # a tuple has no lazy field: its logits are where the class's forward puts them
        return out_cls(loss=per_token.sum() / n, logits=logits(), **rest).to_tuple()
    out = _lazy_logits_class(out_cls)(loss=per_token.sum() / n, **rest)
    object.__setattr__(out, "_megakernels_logits", logits)
    return out


def _head_logits(head, hidden, softcap):
    """The LM head's logits on ``hidden``, capped as transformers caps them (``c * tanh(logits / c)``) under a
    final-logit soft cap ``c``."""
    logits = head(hidden)
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


@functools.cache
def _lazy_logits_class(out_cls):
    """``out_cls`` (a ``ModelOutput``) whose ``logits``, absent, are computed on the first read of ``.logits``
    (``_megakernels_logits()``: the LM head on the hidden states, differentiable), so that code reading the
    training logits of a fused-head model gets them, and only that code pays for them."""

    def __getattribute__(self, name):
        if name != "logits":
            return out_cls.__getattribute__(self, name)
        logits = out_cls.__getattribute__(self, "logits")
        make = self.__dict__.get("_megakernels_logits")
        if logits is None and make is not None:
            logits = make()
            self["logits"] = logits
        return logits

    return type(f"{out_cls.__name__}WithLazyLogits", (out_cls,), {"__getattribute__": __getattribute__})


def register() -> None:
    """Register ``attn_implementation="megakernels"`` (and its mask function: transformers' SDPA masks, which are
    None when no mask is needed) and ``experts_implementation="megakernels"`` with transformers, and the dispatchers
    that run them for patched models under transformers' default names (``_dispatch.install``). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from megakernels.integrations.transformers import _dispatch

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, attention_mask)
    experts = _dispatch.experts_interface_class()
    if experts is not None:
        experts.register(NAME, experts_forward)
    _dispatch.install(attention_forward, attention_mask, experts_forward)
