"""Sharded data parallelism by PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) inside our 3D layout
(docs/parallelism.md, "Sharded data parallelism").

The tensor-, context-, expert- and pipeline-parallel split is ours (a rank's parameters are already its TP shard
of its pipeline stage); FSDP2 then shards each of those along dim 0 over the **data-parallel** ranks: the mesh is
built from our own groups (``DeviceMesh.from_group``), ``dp_cp_group()`` for dense parameters and
``expert_dp_group()`` for the experts, so nothing else of the layout changes. ``shard_model`` wraps each
transformer layer (and the experts of an MoE layer, on their own mesh) and the chunk itself:

- ZeRO-3 (``--fsdp``, ``reshard_after_forward=True``): a layer's parameters are all-gathered before its forward
  and freed after, gathered again for its backward; the next layer's all-gather is prefetched (FSDP2's default
  forward and backward prefetch of one module);
- ZeRO-2 (``--zero 2``, ``reshard_after_forward=False``): the gathered parameters stay from forward to backward
  (one all-gather a micro-batch instead of two);
- HSDP (``--fsdp-degree N`` < dp): a 2-D mesh, parameters sharded over N ranks and replicated across dp/N.

Gradients are reduce-scattered (averaged over the mesh) in ``reduce_dtype`` (fp32 by default; bf16 with
``--fsdp-reduce-dtype bf16``) after every micro-batch's backward and accumulated in the sharded fp32 gradient, as
our data-parallel buckets accumulate in fp32. The sharded parameters stay fp32: they are the masters, which
``ParallelOptimizer`` (fused AdamW) steps in place on each rank's shard; the mixed-precision policy casts them to
the training dtype for compute. The parameter marks (``params``) are carried over to FSDP2's sharded parameters,
so gradient-norm counting, the sequence-parallel and tied-embedding sums and checkpoints read them as before.

A rank's shard of a parameter (FSDP2: dim 0 cut into ``ceil(n / world)``-row chunks) is a contiguous range of the
flattened TP-local tensor: ``local_range`` gives it, which is how the optimizer and the checkpoints see an FSDP
parameter — like a ZeRO-1 piece.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from megakernels.parallel import state
from megakernels.parallel.ddp import sum_partial_grads
from megakernels.parallel.fp8_gather import MasterWeight, wrap_linears
from megakernels.parallel.params import copy_marks, is_expert_parallel


def _fsdp():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    return fully_shard, MixedPrecisionPolicy


def _mesh(group, degree: int | None, device: str):
    """``(mesh, shard group)``: a DeviceMesh over ``group``, 1-D (shard over all) or 2-D (replicate, shard) for
    HSDP with ``degree``, and the group a parameter is sharded over."""
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size(group)
    if degree is None or degree == world:
        return DeviceMesh.from_group(group, device), group
    ranks = dist.get_process_group_ranks(group)
    mesh = torch.tensor(ranks).view(world // degree, degree)
    # the sub-groups: shard over consecutive members, replicate across
    shard_groups = [dist.new_group(row.tolist()) for row in mesh]
    replicate_groups = [dist.new_group(col.tolist()) for col in mesh.t()]
    for g in shard_groups + replicate_groups:
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            state.adopt_group(g)
    me = ranks.index(dist.get_rank())
    shard_g, replicate_g = shard_groups[me // degree], replicate_groups[me % degree]
    dm = DeviceMesh.from_group([replicate_g, shard_g], device, mesh=mesh, mesh_dim_names=("replicate", "shard"))
    return dm, shard_g


def is_fsdp_param(p) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def local(p) -> torch.Tensor:
    """This rank's shard of an FSDP parameter (a plain tensor sharing its storage: a ``fp8_gather.MasterWeight``'s
    data); a plain tensor as is."""
    t = p._local_tensor if is_fsdp_param(p) else p
    return t._data if isinstance(t, MasterWeight) else t


def local_range(p) -> tuple[int, int]:
    """The flat range ``[lo, hi)`` of the TP-local tensor that this rank's FSDP shard of ``p`` holds."""
    from torch.distributed.tensor.placement_types import Shard

    row = math.prod(p.shape[1:])
    n = p.shape[0]
    lo_row = 0
    coords = _coordinates(p.device_mesh)
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            chunk = -(-n // p.device_mesh.size(mesh_dim))
            lo_row = min(n, coords[mesh_dim] * chunk)
    return lo_row * row, lo_row * row + local(p).numel()


def full(p) -> torch.Tensor:
    """The whole TP-local tensor of an FSDP parameter, all-gathered over the ranks it is sharded over (collective
    over them; FSDP2's dim-0 chunks padded to equal sizes for the gather)."""
    group = p._megakernels_fsdp_group
    world = dist.get_world_size(group)
    row = math.prod(p.shape[1:])
    chunk = -(-p.shape[0] // world) * row
    shard = local(p).detach().reshape(-1)
    buf = shard.new_zeros(chunk)
    buf[: shard.numel()] = shard
    out = shard.new_empty(world * chunk)
    dist.all_gather_into_tensor(out, buf, group=group)
    return out[: p.shape[0] * row].view(p.shape)


@torch.no_grad()
def assign_full(p, value: torch.Tensor) -> None:
    """Set an FSDP parameter from its whole TP-local value (this rank keeps its shard; no communication)."""
    lo, hi = local_range(p)
    shard = local(p)
    shard.copy_(value.reshape(-1)[lo:hi].view(shard.shape))


def _coordinates(mesh) -> list[int]:
    """This rank's coordinates in ``mesh``, read from its rank tensor (no process-group lookup)."""
    where = (mesh.mesh == dist.get_rank()).nonzero()
    return where[0].tolist()


def is_primary(p) -> bool:
    """Whether this rank's shard of ``p`` is the first copy of it (HSDP replicates shards across the replicate
    dimension of the mesh; norms and checkpoints count one copy)."""
    from torch.distributed.tensor.placement_types import Replicate

    if not is_fsdp_param(p):
        return True
    coords = _coordinates(p.device_mesh)
    return all(coords[d] == 0 for d, pl in enumerate(p.placements) if isinstance(pl, Replicate))


class ShardedModel(nn.Module):
    """One model chunk under FSDP2, with the interface of ``ddp.DistributedDataParallel`` the trainer and the
    optimizer use (``set_grad_sync``, ``finish_grad_sync``, ``zero_grad_buffer``, ``params``)."""

    def __init__(self, module: nn.Module, zero: int, expert_grad_factor: float = 1.0):
        super().__init__()
        self.module, self.zero, self.expert_grad_factor = module, zero, expert_grad_factor

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def set_grad_sync(self, enabled: bool) -> None:
        """Kept on: every micro-batch's gradient is reduce-scattered and accumulated sharded, in fp32 (accumulating
        the unsharded gradient in the 16-bit compute dtype instead would round it every micro-batch)."""

    def finish_grad_sync(self) -> None:
        """FSDP2 has waited for its reduce-scatters at the end of each backward: nothing left."""

    def zero_grad_buffer(self) -> None:
        for p in self.module.parameters():
            p.grad = None


def shard_model(
    chunk: nn.Module,
    *,
    zero: int = 3,
    degree: int | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    fp8_gather: bool = True,
) -> ShardedModel:
    """Shard ``chunk`` (fp32 parameters, its layers in ``chunk.layers``) with FSDP2 over the data-parallel ranks.

    Args:
        zero: 3 (reshard after forward) or 2 (keep the gathered parameters until backward).
        degree: shard over this many data-parallel ranks and replicate across the rest (HSDP); None: all.
        param_dtype: the compute dtype of the gathered parameters (None: fp32).
        reduce_dtype: the dtype of the gradient reduce-scatter.
        fp8_gather: all-gather the weights of the linears in tensorwise FP8 as FP8 (``parallel.fp8_gather``: the
            same FP8 weights as a 16-bit gather, half its bytes); False: gather them in ``param_dtype``.

    Raises:
        ValueError: ``zero`` not 2 or 3, parameters that are not fp32, a ``degree`` that does not divide the
            data-parallel size.
    """
    fn = "shard_model"
    if zero not in (2, 3):
        raise ValueError(f"{fn}: zero must be 2 or 3, got {zero!r}")
    if any(p.dtype != torch.float32 for p in chunk.parameters()):
        raise ValueError(f"{fn}: the chunk's parameters must be fp32 (the sharded masters); cast after, not before")
    dense, experts = state.dp_cp_group(), state.expert_dp_group()
    world = dist.get_world_size(dense)
    if degree is not None and (degree < 1 or world % degree):
        raise ValueError(f"{fn}: degree={degree} must divide the data-parallel size {world}")
    device = "cuda" if next(chunk.parameters()).is_cuda else "cpu"
    fully_shard, policy = _fsdp()
    mp = policy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if fp8_gather:
        wrap_linears(chunk)  # tensorwise-FP8 weights: gathered in FP8
    marks = {name: p for name, p in chunk.named_parameters()}
    mesh, shard_group = _mesh(dense, degree, device)
    expert_world = dist.get_world_size(experts)
    expert_mesh, expert_shard_group = _mesh(experts, None if degree is None else min(degree, expert_world), device)
    reshard = zero == 3
    for layer in getattr(chunk, "layers", []):
        for m in layer.modules():
            if any(is_expert_parallel(p) for p in m.parameters(recurse=False)):
                fully_shard(m, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(chunk, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    layers = list(getattr(chunk, "layers", []))
    for i, layer in enumerate(layers):  # explicit prefetch: the neighbour's all-gather overlaps this layer's work
        if i + 1 < len(layers):
            layer.set_modules_to_forward_prefetch([layers[i + 1]])
        if i > 0:
            layer.set_modules_to_backward_prefetch([layers[i - 1]])
    for name, p in chunk.named_parameters():
        copy_marks(marks[name], p)
        p._megakernels_fsdp_group = expert_shard_group if is_expert_parallel(p) else shard_group
    # Every data-parallel rank's tokens reach an expert through the all-to-all, so its gradient is a sum over the
    # dp·cp ranks' micro-batches, to be averaged over dp·cp as the dense ones are (ddp.wrap_model's divisor); FSDP
    # averages over the experts' own data-parallel ranks: ``finalize_grads`` rescales (a custom divide factor
    # would need a pre-multiplied sum, which gloo lacks).
    return ShardedModel(chunk, zero, expert_world / world)


def finalize_grads(models: list[ShardedModel]) -> None:
    """After the step's backwards: ``ddp.finalize_model_grads``' sums (sequence-parallel and TP-replicated
    parameters over TP, the tied embedding over its two stages) on the sharded gradients: every TP rank (and both
    embedding stages) holds the same FSDP shard of such a parameter, so summing the shards is summing the
    parameter's gradient. A parameter without a gradient this step gets zeros first (the sums are collective)."""
    params = list(dict.fromkeys(p for m in models for p in m.params))
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for m in models:
        if m.expert_grad_factor != 1.0:
            for p in m.params:
                if is_expert_parallel(p):
                    local(p.grad).mul_(m.expert_grad_factor)
    sum_partial_grads(params, lambda p: local(p.grad))
