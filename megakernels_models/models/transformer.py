"""The pre-norm Transformer layer every model family stacks, its embedding, and the chunk of layers a pipeline stage
holds.

    x = x + dropout(attention(norm(x)))        attention: column-parallel QKV, core, row-parallel projection
    x = x + dropout(mlp(norm(x)))              MLP: column-parallel fc1, fused bias+GeLU (or SwiGLU), row-parallel fc2

The configuration picks the pieces: LayerNorm or RMSNorm; learned positions (a table added to the embeddings) or
rotary embeddings (applied to queries and keys inside attention, with grouped-query attention); a GeLU or SwiGLU
MLP; biases or none; an output layer tied to the word embedding or its own. Each layer's attention follows its type
(``ModelConfig.layer_types``: a sliding window or every position, each with its rotary base), and with ``sinks``
learns one attention-sink logit per head.

Pre-norm (normalise each branch's input, keep the residual stream unnormalised) is what let Megatron-LM scale BERT
past 336M parameters; GPT-2 uses it too. The layer runs on ``[s, b, h]`` (``[s/tp, b, h]`` under sequence
parallelism). Everything that owns weights is seeded by its name (``layers.<i>.attention``, ...), so a pipeline
stage that builds only layers 8..15 gets exactly the weights those layers have in the single-process model.

Attention cores (``attention=``, ``megakernels.nn.attention``): ``"flash"`` (FlashAttention; with BERT's padding
mask, the fused masked softmax) or ``"torch"`` (PyTorch's ``scaled_dot_product_attention``, the baseline).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megakernels.nn import DocumentMask, FusedLayerNorm, FusedRMSNorm, RotaryEmbedding
from megakernels.parallel import context, init, state
from megakernels.parallel.blocks import ParallelGroupedQueryAttention, ParallelMLP, ParallelSelfAttention
from megakernels.parallel.mla import ParallelMultiLatentAttention
from megakernels.parallel.moe import MoELayer
from megakernels.parallel.params import mark_sequence_parallel, mark_shared_embedding
from megakernels.parallel.random import checkpoint, get_rng_tracker
from megakernels_models.models.config import ModelConfig


def make_norm(config: ModelConfig, device=None, dtype=None) -> nn.Module:
    """The configuration's norm over the hidden size (LayerNorm, or RMSNorm with the configuration's weight offset)."""
    if config.norm == "rmsnorm":
        return FusedRMSNorm(
            config.hidden_size, config.layernorm_eps, device=device, dtype=dtype, offset=config.norm_offset
        )
    return FusedLayerNorm(config.hidden_size, config.layernorm_eps, device=device, dtype=dtype)


def dropout(x: torch.Tensor, p: float, training: bool, sequence_parallel: bool) -> torch.Tensor:
    """Hidden dropout. Under sequence parallelism each TP rank holds different tokens, so the masks come from the
    tracker's per-TP-rank stream; otherwise the stream is the same on every TP rank (replicated activations)."""
    if not training or p == 0.0:
        return x
    if sequence_parallel:
        with get_rng_tracker().fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


def replicated_linear(
    in_features: int, out_features: int, seed: int, std: float, device=None, dtype=None, bias: bool = True
) -> nn.Linear:
    """An ``nn.Linear`` replicated on every TP rank, weight defined by ``seed`` (``N(0, std²)``), bias zero."""
    layer = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
    with torch.no_grad():
        if layer.weight.device.type != "meta":
            layer.weight.copy_(init.full_weight((out_features, in_features), seed, init.init_method_normal(std)))
            if bias:
                layer.bias.zero_()
    return layer


class TransformerLayer(nn.Module):
    """One pre-norm layer (see the module docstring).

    Args:
        config: the model's configuration.
        layer_number: the layer's index in the whole model (names its seed).
        seed: the model's seed.
        causal: causal (GPT) or bidirectional (BERT) attention.
        sequence_parallel: activations are sequence shards ``[s/tp, b, h]``.
        attention: ``"flash"`` or ``"torch"``.
        recompute: ``"none"``, ``"selective"`` (the attention core is recomputed in backward) or ``"full"`` (the
            whole layer is; only its input is kept).
        device, dtype: of the parameters.

    Forward: ``x`` ``[s, b, h]``, optional ``attention_mask`` (bool ``[b, 1, 1, s]``, True = padding key) -> same
    shape as ``x``.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_number: int,
        seed: int,
        *,
        causal: bool,
        sequence_parallel: bool = False,
        attention: str = "flash",
        recompute: str = "none",
        device=None,
        dtype=None,
    ):
        super().__init__()
        c = config
        self.layer_number, self.dropout_p, self.sequence_parallel = layer_number, c.dropout, bool(sequence_parallel)
        self.recompute_layer = recompute == "full"
        normal = init.init_method_normal(c.init_std)
        scaled = init.scaled_init_method_normal(c.init_std, c.num_layers)
        name = f"layers.{layer_number}"
        self.input_norm = make_norm(c, device, dtype)
        common = dict(
            core=attention,
            attention_dropout=c.attention_dropout,
            bias=c.bias,
            recompute=recompute == "selective",
            window=c.layer_window(layer_number),
            sinks=c.sinks,
            **({"softmax_scale": c.softmax_scale} if c.softmax_scale is not None else {}),
            init_method=normal,
            output_init_method=scaled,
            seed=init.derive_seed(seed, f"{name}.attention"),
            device=device,
            dtype=dtype,
        )
        self.rotary = c.position_embedding == "rope"
        mla = getattr(c, "mla", None)
        rope = None
        if self.rotary:  # multi-head latent attention (DeepSeek) rotates its rotary part alone (interleaved inside)
            theta, scaling = c.layer_rope(layer_number)
            rope = RotaryEmbedding(
                c.head_dim if mla is None else c.qk_rope_head_dim,
                theta,
                interleaved=c.rope_interleaved and mla is None,
                scaling=scaling,
                max_positions=c.seq_length if scaling is not None else None,
                device=device,
            )
        if mla is not None:
            self.attention = ParallelMultiLatentAttention(
                c.hidden_size,
                c.num_heads,
                **mla,
                rotary=rope,
                norm_eps=c.layernorm_eps,
                causal=causal,
                sequence_parallel=sequence_parallel,
                **{k: v for k, v in common.items() if k not in ("window", "sinks", "softmax_scale")},
                softmax_scale=c.softmax_scale,
            )
        elif self.rotary:
            self.attention = ParallelGroupedQueryAttention(
                c.hidden_size,
                c.num_heads,
                c.num_kv_heads,
                causal,
                sequence_parallel,
                rotary=rope,
                **{**common, "bias": c.qkv_bias},
                proj_bias=c.bias,
                qk_norm_eps=c.layernorm_eps if c.qk_norm else None,
                qk_norm_offset=c.norm_offset,
                head_dim=c.head_dim,
            )
        else:
            if c.num_kv_heads != c.num_heads:
                raise ValueError(
                    "TransformerLayer: grouped-query attention needs rotary positions (position_embedding='rope')"
                )
            self.attention = ParallelSelfAttention(c.hidden_size, c.num_heads, causal, sequence_parallel, **common)
        self.post_attention_norm = make_norm(c, device, dtype)
        if c.is_moe_layer(layer_number):
            self.mlp = MoELayer(
                c.hidden_size,
                c.moe_ffn_hidden_size,
                c.num_experts,
                c.moe_top_k,
                sequence_parallel,
                activation=c.activation,
                normalize=c.moe_normalize,
                bias=c.moe_biases,
                softmax_topk=c.moe_softmax_topk,
                **(dict(zip(("swiglu_limit", "swiglu_alpha"), c.swiglu_clamp)) if c.swiglu_clamp else {}),
                aux_loss_coeff=c.moe_aux_loss_coeff,
                z_loss_coeff=c.moe_z_loss_coeff,
                capacity_factor=c.moe_capacity_factor,
                shared_experts=c.moe_shared_experts,
                score=c.moe_score,
                n_group=c.moe_n_group,
                topk_group=c.moe_topk_group,
                routed_scaling=c.moe_routed_scaling,
                expert_bias=c.moe_expert_bias,
                seq_aux_loss=c.moe_seq_aux_loss,
                seed=init.derive_seed(seed, f"{name}.mlp"),
                init_method=normal,
                output_init_method=scaled,
                device=device,
                dtype=dtype,
            )
        else:
            self.mlp = ParallelMLP(
                c.hidden_size,
                c.ffn_hidden_size,
                sequence_parallel,
                approximate="tanh" if c.activation == "gelu_tanh" else "none",
                activation=c.activation if c.activation in ("swiglu", "geglu") else "gelu",
                bias=c.bias,
                init_method=normal,
                output_init_method=scaled,
                seed=init.derive_seed(seed, f"{name}.mlp"),
                device=device,
                dtype=dtype,
            )
        self.post_norm = c.norm_position == "post"
        # Gemma's sandwich: the attention's and the MLP's outputs normalised before their residual sums
        self.attention_output_norm = make_norm(c, device, dtype) if c.sandwich_norms else None
        self.mlp_output_norm = make_norm(c, device, dtype) if c.sandwich_norms else None
        if sequence_parallel:
            mark_sequence_parallel(
                self.input_norm, self.post_attention_norm, self.attention_output_norm, self.mlp_output_norm
            )

    def _attention(self, x, attention_mask, positions, kv_cache):
        if self.rotary:
            return self.attention(x, attention_mask, positions, kv_cache=kv_cache)
        return self.attention(x, attention_mask, kv_cache=kv_cache)

    def _forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor | None, kv_cache=None
    ) -> torch.Tensor:
        drop = lambda y: dropout(y, self.dropout_p, self.training, self.sequence_parallel)  # noqa: E731
        if self.post_norm:  # the original BERT: normalise each residual sum (input_norm is then after attention)
            x = self.input_norm(x + drop(self._attention(x, attention_mask, positions, kv_cache)))
            return self.post_attention_norm(x + drop(self.mlp(x)))
        a = self._attention(self.input_norm(x), attention_mask, positions, kv_cache)
        x = x + drop(a if self.attention_output_norm is None else self.attention_output_norm(a))
        m = self.mlp(self.post_attention_norm(x))
        return x + drop(m if self.mlp_output_norm is None else self.mlp_output_norm(m))

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        kv_cache=None,
    ) -> torch.Tensor:
        if self.recompute_layer and torch.is_grad_enabled():
            return checkpoint(self._forward, x, attention_mask, positions)
        return self._forward(x, attention_mask, positions, kv_cache)


class MultiTokenPrediction(nn.Module):
    """One multi-token prediction module (DeepSeek-V3), on the last pipeline stage: from the previous depth's hidden
    state ``h`` (the main layers' output for the first, before the final norm) and the embedding ``e`` of the token
    ``depth`` positions ahead, ``layer(eh_proj([enorm(e); hnorm(h)]))`` is this depth's hidden state; ``norm`` of it
    goes through the model's output layer to predict the token ``depth + 1`` positions after the next. The word
    embedding and the output layer are the model's (shared); the projection is replicated over tensor parallelism
    (under sequence parallelism each rank projects its tokens; its gradient is summed over the group), and the
    layer is a ``TransformerLayer`` numbered after the model's last (``num_layers + depth - 1``: its seed, and a MoE
    layer where the last ones are).

    Forward: ``(h, e)`` ``[s, b, h]`` each (``[s/tp, b, h]`` under sequence parallelism), the attention mask and
    positions of the main layers -> ``(hidden, normed)``: the next depth's input and the output layer's."""

    def __init__(self, config: ModelConfig, depth: int, seed: int, **layer):
        """``layer``: ``TransformerLayer``'s keyword arguments but ``causal`` (``sequence_parallel``, ...)."""
        super().__init__()
        c = config
        device, dtype = layer.get("device"), layer.get("dtype")
        self.enorm, self.hnorm, self.norm = (make_norm(c, device, dtype) for _ in range(3))
        h = c.hidden_size
        self.eh_proj = replicated_linear(
            2 * h, h, init.derive_seed(seed, f"mtp.{depth - 1}.eh_proj"), c.init_std, device, dtype, bias=False
        )
        self.layer = TransformerLayer(c, c.num_layers + depth - 1, seed, causal=True, **layer)
        if layer.get("sequence_parallel"):
            mark_sequence_parallel(self.enorm, self.hnorm, self.norm, self.eh_proj)

    def forward(self, h, e, attention_mask=None, positions=None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))
        x = self.layer(x, attention_mask, positions)
        return x, self.norm(x)


def shifted(t: torch.Tensor, k: int, fill, documents: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` ``[b, s]`` moved ``k`` positions left (``out[:, i] = t[:, i + k]``), the last ``k`` columns ``fill``,
    and with ``documents`` (ids ``[b, s]``) ``fill`` too where position ``i + k`` is in another document than ``i``
    (multi-token prediction's inputs and labels)."""
    if k >= t.shape[1]:
        return torch.full_like(t, fill)
    out = torch.cat([t[:, k:], t.new_full((t.shape[0], k), fill)], dim=1)
    if documents is not None:
        same = torch.cat([documents[:, k:] == documents[:, :-k], documents.new_zeros(documents.shape[0], k).bool()], 1)
        out = out.masked_fill(~same, fill)
    return out


class LanguageModelEmbedding(nn.Module):
    """Word (vocab-parallel) + learned position (+ token type) embeddings, then dropout (no position table with
    rotary embeddings).

    Forward: ``ids`` ``[s, b]`` (and ``token_types`` ``[s, b]``), ``positions`` (int ``[s]``, each token's position,
    or ``[b, s]``, each sample's own; default ``0..s-1``) -> ``[s, b, h]`` (``[s/tp, b, h]`` under sequence
    parallelism: the word embedding's reduce-scatter leaves this rank's tokens, and the position and type embeddings
    are added to those tokens only).
    """

    def __init__(
        self,
        config: ModelConfig,
        seed: int,
        *,
        sequence_parallel: bool = False,
        token_types: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        from megakernels.parallel import VocabParallelEmbedding, state

        c = config
        self.sequence_parallel, self.dropout_p = bool(sequence_parallel), c.dropout
        self.multiplier = c.embedding_multiplier
        normal = init.init_method_normal(c.init_std)
        self.word = VocabParallelEmbedding(
            c.vocab_size,
            c.hidden_size,
            sequence_parallel,
            init_method=normal,
            seed=init.derive_seed(seed, "embedding.word"),
            device=device,
            dtype=dtype,
        )
        self.position = (
            replicated_embedding(
                c.seq_length, c.hidden_size, init.derive_seed(seed, "embedding.position"), c.init_std, device, dtype
            )
            if c.position_embedding == "learned"
            else None
        )
        self.token_type = (
            replicated_embedding(
                c.num_token_types,
                c.hidden_size,
                init.derive_seed(seed, "embedding.token_type"),
                c.init_std,
                device,
                dtype,
            )
            if token_types
            else None
        )
        # Post-norm models normalise the embeddings' sum.
        self.norm = make_norm(c, device, dtype) if c.norm_position == "post" else None
        self._tp_rank, self._tp = state.tp_rank(), state.tp_size()
        if sequence_parallel:
            mark_sequence_parallel(self.position, self.token_type, self.norm)

    def forward(
        self, ids: torch.Tensor, token_types: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        s = ids.shape[0]
        x = self.word(ids)
        if self.multiplier is not None:  # rounded to the table's dtype first, as Gemma's checkpoints were trained
            x = x * torch.tensor(self.multiplier, dtype=x.dtype, device=x.device)
        lo, hi = 0, s
        if self.sequence_parallel:
            lo, hi = self._tp_rank * s // self._tp, (self._tp_rank + 1) * s // self._tp
        if self.position is not None:
            table = self.position.weight
            if positions is None:
                x = x + table[lo:hi].unsqueeze(1)
            elif positions.dim() == 2:  # each sample's own positions (packed documents), [b, s]
                x = x + table[positions.t()[lo:hi]]
            else:
                x = x + table[positions[lo:hi]].unsqueeze(1)
        if self.token_type is not None:
            if token_types is None:
                raise ValueError("LanguageModelEmbedding: token_types [s, b] are required (BERT segments)")
            x = x + self.token_type(token_types[lo:hi])
        if self.norm is not None:
            x = self.norm(x)
        return dropout(x, self.dropout_p, self.training, self.sequence_parallel)


def replicated_embedding(num: int, dim: int, seed: int, std: float, device=None, dtype=None) -> nn.Embedding:
    """An ``nn.Embedding`` replicated on every TP rank, ``N(0, std²)`` defined by ``seed``."""
    emb = nn.Embedding(num, dim, device=device, dtype=dtype)
    if emb.weight.device.type != "meta":
        with torch.no_grad():
            emb.weight.copy_(init.full_weight((num, dim), seed, init.init_method_normal(std)))
    return emb


class LanguageModel(nn.Module):
    """What every family shares: one pipeline chunk of a Transformer with a word embedding and an output layer.

    A chunk holds the embedding if it is the first pipeline stage (``pre_process``), the layers in ``layers`` and,
    if it is the last stage (``post_process``), the final norm and the output layer. A tied output layer's weight is
    the word embedding's: when the last stage is not also the first it holds its own copy of the word embedding
    (same seed, so the same values); both copies are marked as the shared embedding and the last stage's as its
    duplicate (``megakernels.parallel.params``): the trainer sums their gradients over the embedding group, so both
    copies take identical steps, and a global grad norm counts the table once. An untied output layer is a
    vocab-parallel table of its own (``output_layer``).

    Under context parallelism a chunk holds its rank's two chunks of every sequence (``parallel.context``): the
    learned positions and rotary embeddings use those tokens' positions.

    Args:
        config: the model.
        seed: the model's seed (weights depend on it and on nothing about the layout).
        layers: indices of the layers this chunk holds (default all).
        pre_process, post_process: first / last pipeline stage.
        causal: attention mask kind.
        sequence_parallel, attention, recompute: as ``TransformerLayer``.
        fused_linear_ce: a causal LM's loss through ``ops.linear_cross_entropy`` (the output layer and the
            cross-entropy fused over token chunks, the logits never held) instead of the vocab-parallel logits and
            ``ops.cross_entropy``; the same per-token losses. Families with another head (BERT) ignore it.
        token_types: BERT's segment embeddings.
        device, dtype: of the parameters.
    """

    def __init__(
        self,
        config: ModelConfig,
        seed: int,
        *,
        layers: range | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        causal: bool,
        sequence_parallel: bool = False,
        attention: str = "flash",
        recompute: str = "none",
        fused_linear_ce: bool = True,
        token_types: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        from megakernels.parallel import VocabParallelEmbedding

        c = self.config = config
        self.fused_linear_ce = bool(fused_linear_ce)
        layers = range(c.num_layers) if layers is None else layers
        if layers and (layers.start < 0 or layers.stop > c.num_layers):
            raise ValueError(f"{type(self).__name__}: layers {layers} outside 0..{c.num_layers - 1}")
        self.pre_process, self.post_process = bool(pre_process), bool(post_process)
        self.sequence_parallel = bool(sequence_parallel)
        self.embedding = (
            LanguageModelEmbedding(
                c, seed, sequence_parallel=sequence_parallel, token_types=token_types, device=device, dtype=dtype
            )
            if pre_process
            else None
        )
        layer = dict(
            sequence_parallel=sequence_parallel, attention=attention, recompute=recompute, device=device, dtype=dtype
        )
        self.layers = nn.ModuleList(TransformerLayer(c, i, seed, causal=causal, **layer) for i in layers)
        self.output_embedding = self.output_layer = self.final_norm = None
        if post_process:
            if c.norm_position == "pre":
                self.final_norm = make_norm(c, device, dtype)
                if sequence_parallel:
                    mark_sequence_parallel(self.final_norm)
            table = lambda name: VocabParallelEmbedding(  # noqa: E731
                c.vocab_size,
                c.hidden_size,
                sequence_parallel,
                init_method=init.init_method_normal(c.init_std),
                seed=init.derive_seed(seed, name),
                device=device,
                dtype=dtype,
            )
            if not c.tie_embeddings:
                self.output_layer = table("output_layer")
            if not pre_process and (c.tie_embeddings or c.mtp_layers):
                self.output_embedding = table("embedding.word")  # the head's table, or multi-token prediction's
        self.mtp = None
        if post_process and c.mtp_layers and causal:
            self.mtp = nn.ModuleList(MultiTokenPrediction(c, k, seed, **layer) for k in range(1, c.mtp_layers + 1))
        word = self.word_embedding_weight
        shared = c.tie_embeddings or (c.mtp_layers and causal)  # the first stage's table is used on the last too
        if shared and word is not None and not (pre_process and post_process):
            mark_shared_embedding(word, duplicate=self.output_embedding is not None)
        if c.tie_embeddings and pre_process and post_process and self.embedding is not None:
            self.embedding.word.tie()  # one table, both uses: the lookup's gradient rows go into the head's
        self._cp, self._cp_rank = (state.cp_size(), state.cp_rank()) if state.is_initialized() else (1, 0)

    @property
    def word_embedding_weight(self) -> torch.Tensor | None:
        """The word embedding table this chunk holds (``[V_pad/tp, h]``), or None on a middle stage."""
        if self.embedding is not None:
            return self.embedding.word.weight
        return None if self.output_embedding is None else self.output_embedding.weight

    @property
    def output_weight(self) -> torch.Tensor | None:
        """The output layer's vocab-parallel table (``[V_pad/tp, h]``) on the last stage: the word embedding's when
        tied, else ``output_layer``'s; None elsewhere."""
        if not self.post_process:
            return None
        return self.output_layer.weight if self.output_layer is not None else self.word_embedding_weight

    @property
    def padded_vocab_size(self) -> int:
        emb = next(
            e
            for e in (self.output_layer, self.output_embedding, self.embedding and self.embedding.word)
            if e is not None
        )
        return emb.padded_num_embeddings

    def _packed(self, documents, attention_mask, positions):
        """(the attention mask, the positions) of a packed batch: the document ids as a ``DocumentMask``, the
        per-sample positions."""
        doc_ids, doc_positions = documents
        if doc_ids is not None:
            if attention_mask is not None:
                raise ValueError(f"{type(self).__name__}: pass either an attention mask or documents, not both")
            attention_mask = DocumentMask(doc_ids)
        if doc_positions is not None:
            positions = doc_positions
        return attention_mask, positions

    def positions(self, device) -> torch.Tensor | None:
        """Positions of this rank's tokens under context parallelism (None: ``0..s-1``)."""
        if self._cp == 1:
            return None
        return context.positions(self.config.seq_length, self._cp, self._cp_rank, device)

    def encode(
        self,
        ids=None,
        hidden=None,
        token_types=None,
        attention_mask=None,
        kv_cache=None,
        documents=None,
        mtp_inputs: dict | None = None,
    ) -> torch.Tensor:
        """Embedding (first stage: ``ids`` ``[b, s]``, this rank's tokens under context parallelism) or ``hidden``
        from the previous stage, then the layers, then (last stage) the final norm. Returns ``[s, b, h]``
        (``[s/tp, b, h]`` under sequence parallelism). With ``kv_cache`` (``megakernels.nn.KVCache``, one stage,
        no context parallelism) the tokens continue the cached ones: their positions start at ``kv_cache.offset``
        and attention sees the cached keys too; the offset advances.

        Packed sequences: ``documents`` = ``(ids, positions)``, int ``[b, s]`` each: every token attends only
        within its document (ids non-decreasing; the whole sequence's, also under context parallelism, where the
        ring reads each chunk's), and its position (rotary or learned) is ``positions``' (restarting per document;
        this rank's tokens', as ``ids`` of the first argument); either may be None.

        ``mtp_inputs`` (a dict, on a last stage with multi-token prediction): filled with what ``mtp_hidden`` reads
        (the layers' output before the final norm, the attention mask and the positions)."""
        device = (ids if ids is not None else hidden).device if (ids is not None or hidden is not None) else None
        positions = self.positions(device)
        if documents is not None:
            attention_mask, positions = self._packed(documents, attention_mask, positions)
        if kv_cache is not None:
            if self._cp > 1 or not (self.pre_process and self.post_process):
                raise ValueError(f"{type(self).__name__}: a KV cache needs the whole model on one rank (pp 1, cp 1)")
            positions = kv_cache.positions(ids.shape[1], ids.device)
            last = kv_cache.offset + ids.shape[1] - 1  # on the host: decoding may pass a scaled rotary's table
            for m in self.modules():
                if isinstance(m, RotaryEmbedding) and m.scaling is not None:
                    m.cover(last)
        if self.pre_process:
            if ids is None:
                raise ValueError(f"{type(self).__name__}: the first pipeline stage needs ids [b, s]")
            x = self.embedding(ids.t(), None if token_types is None else token_types.t(), positions)
        else:
            if hidden is None:
                raise ValueError(f"{type(self).__name__}: a later pipeline stage needs hidden from the previous one")
            x = hidden
        for layer in self.layers:
            x = layer(x, attention_mask, positions, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(ids.shape[1])
        out = self.final_norm(x) if self.final_norm is not None else x
        if self.mtp is not None and mtp_inputs is not None:
            mtp_inputs.update(hidden=x, attention_mask=attention_mask, positions=positions)
        return out

    def mtp_hidden(self, ids: torch.Tensor, inputs: dict, documents: torch.Tensor | None = None) -> list:
        """The multi-token prediction modules' outputs for the output layer, one ``[s, b, h]`` a depth (``[s/tp, b,
        h]`` under sequence parallelism), from ``inputs`` (what ``encode(..., mtp_inputs=inputs)`` put there) and
        the micro-batch's whole ``ids`` ``[b, s]``: depth ``k`` embeds the tokens ``k`` positions ahead (within
        each document: ``documents``' ids)."""
        table = self.embedding.word if self.embedding is not None else self.output_embedding
        h, out = inputs["hidden"], []
        for k, module in enumerate(self.mtp, start=1):
            e = table(shifted(ids, k, 0, documents).t())
            h, normed = module(h, e, inputs["attention_mask"], inputs["positions"])
            out.append(normed)
        return out
