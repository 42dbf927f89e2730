"""FSDP's parameter all-gather in FP8 for the tensorwise recipe (docs/parallelism.md, "Sharded data parallelism").

Under ``--fsdp`` / ``--zero 2`` every micro-batch all-gathers each layer's parameters (twice under ZeRO-3); an FP8
linear then quantises the gathered 16-bit weight at once. With the tensorwise recipe the weight has one scale, so the
shards can be quantised before the gather, and the gather moves 1 byte an element instead of 2. FSDP2's all-gather
extension does it: a linear's sharded fp32 master is a ``MasterWeight`` (a wrapper tensor around the shard), whose

- ``fsdp_pre_all_gather`` casts the shard to the compute dtype (as FSDP's mixed-precision policy would), takes the
  amax of the whole tensor (MAX over the FSDP shard group and the tensor-parallel group: the same scale the layer
  computes from its gathered weight, ``fp8.quantize``'s full-tensor rule) and returns the e4m3 bytes and the scale;
- ``fsdp_post_all_gather`` wraps the gathered bytes as a ``GatheredWeight`` (dtype: the compute dtype), which
  ``fp8.linear`` takes as its quantised weight as is.

The FP8 weight is therefore bit-identical to the one the layer would have quantised from a 16-bit gather (rounding
to the compute dtype first, as there; the max commutes with monotone rounding), and the losses are those of the
16-bit gather. Anything else done with a ``GatheredWeight`` (a forward with FP8 disabled, a 16-bit op) sees its
dequantised value; with a ``MasterWeight`` (the optimizer's step, checkpoints, norms) the fp32 shard itself.

Blockwise weights (128×128 blocks, which FSDP's dim-0 cut can split) and the experts' grouped weights keep the 16-bit
gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from megakernels.ops import fp8 as ops
from megakernels.parallel import comm, state

# ops that FSDP2 (and the optimizer's views of the shard) apply to the sharded master: their results stay masters
_MASTER_KEEPS = {
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.chunk.default,
    torch.ops.aten.narrow.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten._to_copy.default,
}
# views of the gathered weight FSDP takes (the flat buffer to the parameter's shape)
_GATHERED_KEEPS = {
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
}


class MasterWeight(torch.Tensor):
    """The fp32 master (a shard under FSDP) of a tensorwise-FP8 linear's weight; computes as its data."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, group=None):
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            requires_grad=data.requires_grad,
        )
        t._data, t._tp_group = data, group
        return t

    def __repr__(self) -> str:
        return f"MasterWeight({self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], self._tp_group

    @staticmethod
    def __tensor_unflatten__(inner, group, outer_size, outer_stride):
        return MasterWeight(inner["_data"], group)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        group = next(a._tp_group for a in _flat(args, kwargs) if isinstance(a, MasterWeight))
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs or {}))
        if func in _MASTER_KEEPS:
            return tree_map(lambda t: MasterWeight(t, group) if isinstance(t, torch.Tensor) else t, out)
        return out

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        compute = mp_policy.param_dtype or self._data.dtype
        value = self._data.to(compute)
        amax = value.abs().max().float().reshape(1) if value.numel() else value.new_zeros(1, dtype=torch.float32)
        for group in (mesh.get_group(mesh.ndim - 1), self._tp_group):
            if group is not None and dist.get_world_size(group) > 1:
                comm.all_reduce(amax, group, op=dist.ReduceOp.MAX)
        scale = ops.pow2_scale(amax.reshape(()), "e4m3")
        q, _, _, _ = ops.fp8_quantize(value.reshape(-1, max(1, value.shape[-1])), "e4m3", "tensor", scale)
        return (q.view(torch.uint8).view(value.shape),), (scale, compute)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,) = outputs
        scale, compute = metadata
        if out is not None:  # the same buffer gathered again: only the scale is new
            out._scale = scale
            return None
        return GatheredWeight(data, scale, compute), (data,)


class GatheredWeight(torch.Tensor):
    """A gathered tensorwise-FP8 weight: e4m3 bytes and their scale, of dtype the compute dtype; ``fp8.linear``
    uses the bytes, every other op its dequantised value."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=dtype,
            device=data.device,
        )
        t._data, t._scale = data, scale
        return t

    def __repr__(self) -> str:
        return f"GatheredWeight(shape={tuple(self.shape)}, scale={self._scale})"

    def quantized(self) -> ops.Quantized:
        return ops.Quantized(self._data.view(ops.FORMATS["e4m3"]), self._scale, "tensor")

    def dequantize(self) -> torch.Tensor:
        return (self._data.view(ops.FORMATS["e4m3"]).float() * self._scale).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _GATHERED_KEEPS:
            w = args[0]
            return GatheredWeight(func(w._data, *args[1:], **(kwargs or {})), w._scale, w.dtype)
        return func(*tree_map(_value, args), **tree_map(_value, kwargs or {}))


def _unwrap(t):
    return t._data if isinstance(t, MasterWeight) else t


def _value(t):
    return t.dequantize() if isinstance(t, GatheredWeight) else t


def _flat(args, kwargs):
    from torch.utils._pytree import tree_leaves

    return tree_leaves((args, kwargs or {}))


def wrap_linears(chunk: torch.nn.Module) -> int:
    """Before FSDP shards ``chunk``: make the weight of every column- and row-parallel linear whose FP8 recipe
    scales the weight tensorwise a ``MasterWeight`` (the parameter's marks kept); returns how many. The linears are
    the layers with an FP8 recipe (``fp8`` attribute) and one ``weight`` (the experts' module has two banks)."""
    from megakernels.parallel.params import copy_marks

    count = 0
    for m in chunk.modules():
        rec = getattr(m, "fp8", None)
        if rec is None or not isinstance(getattr(m, "weight", None), torch.nn.Parameter):
            continue
        if rec.weight_granularity != "tensor" or isinstance(m.weight.data, MasterWeight):
            continue
        old = m.weight
        group = state.tp_group() if state.is_initialized() and state.tp_size() > 1 else None
        new = torch.nn.Parameter(MasterWeight(old.detach(), group), requires_grad=old.requires_grad)
        copy_marks(old, new)
        m.weight = new
        count += 1
    return count
