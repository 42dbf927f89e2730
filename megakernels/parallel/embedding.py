"""Vocabulary-parallel word embedding and the output layer tied to it.

The ``[V, h]`` embedding table is split by rows (vocabulary ids) over the tensor-parallel ranks: rank r holds ids
``[r·V/tp, (r+1)·V/tp)``. A lookup gives each rank the rows of the ids it holds and zeros for the others, and g
(all-reduce; a reduce-scatter along the sequence under sequence parallelism) sums them into the full embedding.

For GEMM-friendly shapes V is padded to a multiple of ``128 · tp`` (GPT-2's 50,257 becomes 51,200 at tp 8). The
padding never changes the math (docs/parallelism.md): padded rows are zeros that no real id looks up, their logits are
excluded from the softmax by the loss (``vocab_size``) and from generation, and the real rows are generated from
the seed in blocks that do not depend on how many padded rows follow (``megakernels.parallel.init``).

The output layer reusing the table is in ``lm_head.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megakernels.nn.tied_embedding import TiedEmbedding
from megakernels.parallel import init, mappings, state
from megakernels.parallel.params import mark_tensor_parallel
from megakernels.validation import positive_int

VOCAB_PAD_MULTIPLE = 128


def pad_vocab_size(vocab_size: int, tp: int, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    """The smallest multiple of ``multiple · tp`` that is >= ``vocab_size`` (50257, tp 8 -> 51200).

    Raises:
        ValueError: a non-positive argument.
    """
    for name, v in (("vocab_size", vocab_size), ("tp", tp), ("multiple", multiple)):
        positive_int(v, name, where="pad_vocab_size")
    step = multiple * tp
    return -(-vocab_size // step) * step


class VocabParallelEmbedding(nn.Module):
    """Word embedding with the (padded) vocabulary split over the tensor-parallel ranks.

    Parameters: ``weight`` ``[V_pad/tp, h]``: rows ``[r·V_pad/tp, (r+1)·V_pad/tp)`` of the full padded table on TP
    rank r; rows of ids >= ``num_embeddings`` are zeros. Real rows are ``N(0, 0.02²)`` by default, defined by
    ``seed`` for every tp and every amount of padding.

    Args:
        num_embeddings: the real vocabulary size V.
        embedding_dim: hidden size h.
        sequence_parallel: ids are ``[s, b]`` and the output is this rank's sequence shard ``[s/tp, b, h]``.
        pad_multiple: V is padded to a multiple of ``pad_multiple · tp`` (1 disables padding beyond tp).
        init_method, seed, device, dtype: as ``ColumnParallelLinear``.

    Forward: integer ids ``[...]`` with values in ``[0, V)`` -> ``[..., h]`` (``[s/tp, b, h]`` under sequence
    parallelism). Ids in ``[V, V_pad)`` give zeros; ids outside ``[0, V_pad)`` are not checked (that would cost a
    device synchronisation per step) and give zeros too.

    Raises:
        ValueError / TypeError: non-positive sizes, non-integer ids, or under sequence parallelism ids that are not
            ``[s, b]`` with ``s`` divisible by tp.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        sequence_parallel: bool = False,
        *,
        pad_multiple: int = VOCAB_PAD_MULTIPLE,
        init_method: init.InitMethod | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        cls = type(self).__name__
        for name, v in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            positive_int(v, name, where=cls)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp, self.sequence_parallel = state.tp_size(), bool(sequence_parallel)
        self.padded_num_embeddings = pad_vocab_size(num_embeddings, self.tp, pad_multiple)
        self.local_num_embeddings = self.padded_num_embeddings // self.tp
        self.vocab_start = state.tp_rank() * self.local_num_embeddings
        self.vocab_end = self.vocab_start + self.local_num_embeddings
        self.init_method = init.init_method_normal() if init_method is None else init_method
        self.seed = init.draw_seed() if seed is None else int(seed)
        self.weight = nn.Parameter(torch.empty(self.local_num_embeddings, embedding_dim, device=device, dtype=dtype))
        mark_tensor_parallel(self.weight, dim=0, real_size=num_embeddings)
        # set by an output layer tied to this table (``ParallelLMHead``): the lookup's gradient rows then go into
        # the output layer's weight gradient (``megakernels.nn.TiedEmbedding``)
        self.tied: TiedEmbedding | None = None
        self.reset_parameters()

    def tie(self) -> None:
        """An output layer multiplies by this table: fold the lookup's gradient into its weight gradient."""
        if self.tied is None or self.tied.weight is not self.weight:
            self.tied = TiedEmbedding(self.weight)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)initialise from ``seed``: this rank's rows of the full table, padded rows zero."""
        init.init_shard_(
            self.weight,
            (self.padded_num_embeddings, self.embedding_dim),
            0,
            state.tp_rank(),
            self.tp,
            self.seed,
            self.init_method,
            real_rows=self.num_embeddings,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cls = type(self).__name__
        if (
            not isinstance(ids, torch.Tensor)
            or ids.dtype.is_floating_point
            or ids.dtype.is_complex
            or ids.dtype == torch.bool
        ):
            raise TypeError(
                f"{cls}: ids must be an integer tensor, got "
                f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}"
            )
        if self.sequence_parallel and (ids.dim() != 2 or ids.shape[0] % self.tp):
            raise ValueError(
                f"{cls}: under sequence parallelism ids must be [s, b] with s divisible by the "
                f"tensor-parallel size {self.tp}, got shape {tuple(ids.shape)}"
            )
        tied = self.tied if self.tied is not None and self.tied.weight is self.weight else None
        lookup = tied.lookup if tied is not None else lambda i: F.embedding(i, self.weight)
        if self.tp == 1:
            out = lookup(ids)
        else:  # the masked rows' gradients are zeros, added to row 0 (by the dense backward or the fold alike)
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            out = lookup(local).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(out)
        return mappings.reduce_from_tensor_model_parallel_region(out)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} (padded {self.padded_num_embeddings}, /{self.tp}), {self.embedding_dim}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
