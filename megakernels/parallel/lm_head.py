"""The output layer and loss of a tensor-parallel language model, with the vocabulary kept sharded.

Each TP rank holds rows ``[r·V_pad/tp, (r+1)·V_pad/tp)`` of the output embedding ``E`` (usually the word
embedding's table, tied) and computes its block of the logits, ``logits_r = f(h) E_rᵀ`` — f is copy-to-TP-region
(the gradient of h is the sum of the ranks' partial gradients) or, under sequence parallelism, the all-gather of the
sequence shard; both are fused into the overlapped linear of ``linear.py``. The ``[tokens, V]`` logits are never
gathered: ``megakernels.ops.cross_entropy(..., group=tp_group(), vocab_size=V)`` reduces the softmax statistics
over the group (Megatron-LM's vocab-parallel cross-entropy) and excludes the padded columns ``>= V``, so the loss
is that of the unpadded, unsharded model.
"""

from __future__ import annotations

import torch
from torch import nn

from megakernels.ops.cross_entropy import cross_entropy
from megakernels.parallel import init, mappings, state
from megakernels.parallel.embedding import VOCAB_PAD_MULTIPLE, VocabParallelEmbedding, pad_vocab_size
from megakernels.parallel.linear import linear_with_async_comm
from megakernels.parallel.params import mark_tensor_parallel


def parallel_lm_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    parallel_output: bool = True,
    sequence_parallel: bool = False,
    bias: torch.Tensor | None = None,
    overlap_comm: bool = True,
) -> torch.Tensor:
    """Logits against a vocab-parallel weight (usually the tied ``VocabParallelEmbedding.weight``).

    Args:
        hidden: ``[s, b, h]`` (``[s/tp, b, h]`` under ``sequence_parallel``), or any ``[..., h]`` without it.
        weight: ``[V_pad/tp, h]``, this rank's vocabulary rows.
        parallel_output: keep the logits vocab-parallel ``[..., V_pad/tp]`` (for the vocab-parallel
            cross-entropy); otherwise all-gather them to ``[..., V_pad]`` (for generation: drop the columns past
            the real vocabulary there).
        sequence_parallel: ``hidden`` is the sequence shard; the logits cover the whole sequence.
        bias: optional ``[V_pad/tp]``.
        overlap_comm: overlap the backward collectives with the weight-gradient GEMM.

    Returns:
        ``[s, b, V_pad/tp]`` (or ``[..., V_pad/tp]``; ``V_pad`` columns without ``parallel_output``).

    Raises:
        ValueError: ``hidden``'s last dimension differs from ``weight``'s, or under sequence parallelism ``hidden``
            is not 3-D.
    """
    if weight.dim() != 2 or hidden.dim() == 0 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"parallel_lm_logits: hidden has shape {tuple(hidden.shape)} and weight "
            f"{tuple(weight.shape)}; expected hidden [..., h] and weight [V_pad/tp, h]"
        )
    if sequence_parallel and hidden.dim() != 3:
        raise ValueError(
            "parallel_lm_logits: under sequence parallelism hidden must be [s/tp, b, h], got shape "
            f"{tuple(hidden.shape)}"
        )
    logits = linear_with_async_comm(hidden, weight, bias, state.tp_group(), sequence_parallel, overlap_comm)
    return logits if parallel_output else mappings.gather_from_tensor_model_parallel_region(logits)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-token fp32 loss of vocab-parallel logits ``[..., V_pad/tp]`` over the TP group; ``target`` ``[...]``
    holds global ids in ``[0, vocab_size)`` or ``ignore_index``. Columns ``>= vocab_size`` (padding) are excluded;
    ``softcap`` caps the logits to ``c · tanh(logits / c)`` inside the kernel first.
    Raises what ``megakernels.ops.cross_entropy`` raises (a target outside the vocabulary, shapes, dtypes)."""
    return cross_entropy(
        logits,
        target,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        group=state.tp_group(),
        vocab_size=vocab_size,
        softcap=softcap,
    )


class ParallelLMHead(nn.Module):
    """Output layer + vocab-parallel cross-entropy; the weight is tied to an embedding or its own.

    Args:
        hidden_size: h.
        vocab_size: the real vocabulary size V (padded like the embedding, to a multiple of ``pad_multiple · tp``).
        sequence_parallel: the hidden states are sequence shards ``[s/tp, b, h]``.
        tied_embedding: a ``VocabParallelEmbedding`` whose table is the output weight (no parameter of its own);
            otherwise a ``weight`` ``[V_pad/tp, h]`` initialised as the embedding is (seed-defined, padding zeros).
        overlap_comm, pad_multiple, init_method, seed, device, dtype: as the embedding and the linear layers.

    ``forward(hidden, target=None)``: without ``target`` the vocab-parallel logits ``[s, b, V_pad/tp]``; with
    ``target`` ``[s, b]`` (global ids, or ``ignore_index``) the per-token fp32 loss ``[s, b]``.

    Raises:
        ValueError: a tied embedding of another vocabulary size, hidden size or sequence-parallel setting.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        sequence_parallel: bool = False,
        *,
        tied_embedding: VocabParallelEmbedding | None = None,
        overlap_comm: bool = True,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        pad_multiple: int = VOCAB_PAD_MULTIPLE,
        init_method: init.InitMethod | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        cls = type(self).__name__
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.sequence_parallel, self.overlap_comm = bool(sequence_parallel), bool(overlap_comm)
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing
        if tied_embedding is not None:
            emb = tied_embedding
            if (emb.num_embeddings, emb.embedding_dim) != (vocab_size, hidden_size):
                raise ValueError(
                    f"{cls}: tied_embedding is {emb.num_embeddings} x {emb.embedding_dim}, expected "
                    f"vocab_size x hidden_size = {vocab_size} x {hidden_size}"
                )
            self.padded_vocab_size = emb.padded_num_embeddings
            self._tied = [emb]  # a list: not registered as a submodule, so its table is not a parameter twice
            emb.tie()
            self.weight = None
        else:
            self._tied = []
            self.padded_vocab_size = pad_vocab_size(vocab_size, state.tp_size(), pad_multiple)
            self.init_method = init.init_method_normal() if init_method is None else init_method
            self.seed = init.draw_seed() if seed is None else int(seed)
            self.weight = nn.Parameter(
                torch.empty(self.padded_vocab_size // state.tp_size(), hidden_size, device=device, dtype=dtype)
            )
            mark_tensor_parallel(self.weight, dim=0, real_size=vocab_size)
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)initialise an untied weight from ``seed`` (no-op when tied)."""
        if self.weight is not None:
            init.init_shard_(
                self.weight,
                (self.padded_vocab_size, self.hidden_size),
                0,
                state.tp_rank(),
                state.tp_size(),
                self.seed,
                self.init_method,
                real_rows=self.vocab_size,
            )

    @property
    def output_weight(self) -> torch.Tensor:
        return self._tied[0].weight if self._tied else self.weight

    def forward(self, hidden: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        logits = parallel_lm_logits(
            hidden, self.output_weight, True, self.sequence_parallel, overlap_comm=self.overlap_comm
        )
        if target is None:
            return logits
        return vocab_parallel_cross_entropy(logits, target, self.vocab_size, self.ignore_index, self.label_smoothing)
