"""What the parallel machinery must know about each parameter: one record per parameter, set by the layer that
creates it, read by gradient reduction, the optimizer, checkpoints and the dry run.

The contract (every producer and consumer goes through the functions below, never through ad-hoc attributes):

============================  =============================================================================
mark                          meaning, and who relies on it
============================  =============================================================================
tensor parallel               sharded over the tensor-parallel group: TP rank r holds block r of the full tensor
(dim, stride, replicas,       along ``dim``. With ``stride`` s > 1 the full dim is s equal segments (e.g. the
real_size)                    gate and up halves of a packed SwiGLU projection) and rank r holds block r of
                              each, concatenated (``init.shard_pieces``). With ``replicas`` c > 1, c consecutive
                              TP ranks hold the same block (a key/value head shared by the query heads of c
                              ranks): the full dim has tp/c blocks, rank r holds block r // c, and the c copies'
                              gradients are summed over ``state.tp_replica_group(c)``. ``real_size`` < full
                              size: only the first ``real_size`` entries are real (a vocabulary padded for GEMM
                              shapes). Checkpoints place shards with it; the global grad norm counts such a
                              gradient on every TP rank (each holds a part), once per replica group.
sequence parallel             a replicated parameter applied to this rank's sequence shard (LayerNorm weights, a
                              row-parallel bias under sequence parallelism): its gradient is partial per TP rank
                              and is summed over the TP group once per step (``ddp.finalize_model_grads``).
shared embedding              the word embedding tied between the first and the last pipeline stage: its
(duplicate)                   gradient is summed over the embedding group; the last stage's copy is the
                              ``duplicate``, which the grad norm skips (the table is counted once).
expert parallel               the stacked weights ``[E_local, ...]`` of a mixture-of-experts layer's experts
(num_experts, first)          ``first .. first + E_local - 1`` (of ``num_experts``); the tensor-parallel marks
                              then describe each expert's matrix (dim 0 or 1 of ``p[i]``). Their gradients are
                              reduced over ``state.expert_dp_group()`` (the ranks holding the same experts), the
                              grad norm sums them over the expert-parallel group too, and checkpoints store
                              each expert under its global name (``...experts.<e>.fc1``).
fused (parts, head_dim,       a weight whose rows (dim -2, the output features) pack several logical matrices:
head_major)                   ``parts`` projections (q, k, v; gate, up), each of heads of ``head_dim`` rows
                              (None: no heads). ``head_major``: the rows are ordered ``(head, part, head_dim)``
                              (the GPT QKV weight), else ``(part, head, head_dim)`` (the stride-marked packed
                              weights). The same form holds for a TP rank's shard (its heads). Muon
                              (``megakernels.optim.muon``) orthogonalises each logical matrix on its own.
============================  =============================================================================

A parameter nobody marked is replicated over the TP group: the grad norm counts it on TP rank 0 only, and a
checkpoint stores TP rank 0's copy.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from megakernels.validation import positive_int

_ATTR = "_megakernels_parallel"


@dataclasses.dataclass
class ParamInfo:
    """The parallel marks of one parameter (see the module docstring)."""

    tensor_parallel: bool = False
    partition_dim: int = 0
    partition_stride: int = 1
    replicas: int = 1
    real_size: int | None = None
    sequence_parallel: bool = False
    shared_embedding: bool = False
    shared_embedding_duplicate: bool = False
    expert_parallel: bool = False
    num_experts: int = 0
    expert_first: int = 0
    fused_parts: int = 1
    fused_head_dim: int | None = None
    fused_head_major: bool = False


_DEFAULT = ParamInfo()


def info(p) -> ParamInfo:
    """The marks of ``p`` (a default, unmarked record if it has none; do not modify the returned default)."""
    return getattr(p, _ATTR, _DEFAULT)


def _own(p) -> ParamInfo:
    rec = getattr(p, _ATTR, None)
    if rec is None:
        rec = ParamInfo()
        setattr(p, _ATTR, rec)
    return rec


def _params(items) -> list:
    out = []
    for item in items:
        if item is None:
            continue
        out.extend(item.parameters() if isinstance(item, nn.Module) else [item])
    return out


def mark_tensor_parallel(
    *params, dim: int = 0, stride: int = 1, replicas: int = 1, real_size: int | None = None
) -> None:
    """Mark parameters (None entries are skipped) as sharded over the TP group along ``dim``.

    Raises:
        ValueError: ``dim`` not 0/1, ``stride`` or ``replicas`` < 1, or ``real_size`` with ``stride`` or
            ``replicas`` > 1.
    """
    if dim not in (0, 1):
        raise ValueError(f"mark_tensor_parallel: dim must be 0 or 1, got {dim!r}")
    positive_int(stride, "stride", where="mark_tensor_parallel")
    positive_int(replicas, "replicas", where="mark_tensor_parallel")
    if real_size is not None and (stride > 1 or replicas > 1):
        raise ValueError(
            "mark_tensor_parallel: real_size (a padded dimension) cannot be combined with stride or replicas > 1"
        )
    for p in _params(params):
        rec = _own(p)
        rec.tensor_parallel, rec.partition_dim, rec.real_size = True, dim, real_size
        rec.partition_stride, rec.replicas = stride, replicas


def mark_expert_parallel(p, *, num_experts: int, first: int, dim: int, stride: int = 1, replicas: int = 1) -> None:
    """Mark stacked expert weights (see the module docstring): experts ``first ..`` of ``num_experts``, each
    expert's matrix tensor-parallel along ``dim`` (0 or 1) with ``stride`` (``replicas=tp``: replicated over the TP
    group, as a per-expert bias added once to the TP partial sums)."""
    mark_tensor_parallel(p, dim=dim, stride=stride, replicas=replicas)
    rec = _own(p)
    rec.expert_parallel, rec.num_experts, rec.expert_first = True, num_experts, first


def is_expert_parallel(p) -> bool:
    return info(p).expert_parallel


def mark_sequence_parallel(*items) -> None:
    """Mark parameters, or every parameter of modules, as applied to sequence shards (None entries skipped)."""
    for p in _params(items):
        _own(p).sequence_parallel = True


def mark_shared_embedding(p, duplicate: bool = False) -> None:
    """Mark the tied word embedding of a pipeline stage; ``duplicate`` for the last stage's copy."""
    rec = _own(p)
    rec.shared_embedding = True
    rec.shared_embedding_duplicate = rec.shared_embedding_duplicate or bool(duplicate)


def mark_fused(*params, parts: int, head_dim: int | None = None, head_major: bool = False) -> None:
    """Mark weights (None entries are skipped) whose rows pack ``parts`` logical matrices of heads of ``head_dim``
    rows (see the module docstring): ``head_major`` rows ``(head, part, head_dim)``, else ``(part, head, head_dim)``.

    Raises:
        ValueError: ``parts`` or ``head_dim`` < 1, or a weight whose row count is not a multiple of
            ``parts * head_dim`` (of ``parts`` without heads).
    """
    positive_int(parts, "parts", where="mark_fused")
    if head_dim is not None:
        positive_int(head_dim, "head_dim", where="mark_fused")
    block = parts * (head_dim or 1)
    for p in _params(params):
        if p.dim() < 2 or p.shape[-2] % block:
            raise ValueError(
                f"mark_fused: a weight of shape {tuple(p.shape)} does not hold {parts} parts"
                + (f" of heads of {head_dim} rows" if head_dim else "")
                + " in its rows (dim -2)"
            )
        rec = _own(p)
        rec.fused_parts, rec.fused_head_dim, rec.fused_head_major = parts, head_dim, bool(head_major)


def is_tensor_parallel(p) -> bool:
    return info(p).tensor_parallel


def is_sequence_parallel(p) -> bool:
    return info(p).sequence_parallel


def is_shared_embedding(p) -> bool:
    return info(p).shared_embedding


def is_shared_embedding_duplicate(p) -> bool:
    return info(p).shared_embedding_duplicate


def counts_in_grad_norm(p, tp_rank: int) -> bool:
    """Whether this rank adds ``p``'s gradient to a global norm summed over the model-parallel ranks: a sharded
    parameter on every TP rank (on the first of each replica group), a replicated one on TP rank 0, the duplicate
    embedding never."""
    rec = info(p)
    sharded = rec.tensor_parallel and tp_rank % rec.replicas == 0
    return (sharded or tp_rank == 0) and not rec.shared_embedding_duplicate


def copy_marks(src, dst) -> None:
    """Give ``dst`` the marks of ``src`` (e.g. a master copy of a parameter)."""
    rec = getattr(src, _ATTR, None)
    if rec is not None:
        setattr(dst, _ATTR, dataclasses.replace(rec))


__all__ = [
    "ParamInfo",
    "info",
    "mark_tensor_parallel",
    "mark_sequence_parallel",
    "mark_shared_embedding",
    "is_tensor_parallel",
    "is_sequence_parallel",
    "is_shared_embedding",
    "is_shared_embedding_duplicate",
    "counts_in_grad_norm",
    "copy_marks",
    "mark_expert_parallel",
    "is_expert_parallel",
    "mark_fused",
]
