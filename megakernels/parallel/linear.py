"""Column- and row-parallel linear layers (Megatron-LM), with the input-gradient collective overlapped.

``y = x Wᵀ + b`` with ``W`` ``[out, in]``:

- ``ColumnParallelLinear`` splits W by output features: rank i holds ``W_i`` ``[out/tp, in]`` and computes
  ``y_i = f(x) W_iᵀ + b_i``. Its input's gradient is ``Σ_i dy_i W_i`` — a sum over ranks (f's all-reduce).
- ``RowParallelLinear`` splits W by input features: rank i holds ``W_i`` ``[out, in/tp]``, takes ``x_i`` (the
  output of a column-parallel layer, already split) and computes ``y = g(Σ_i x_i W_iᵀ) + b``.

Column then row needs exactly one all-reduce forward (g) and one backward (f). Under sequence parallelism
(activations outside the pair split along the sequence, dim 0 of ``[s, b, h]``) f becomes an all-gather of the
input along the sequence and g a reduce-scatter; backward mirrors them.

Overlap (``LinearWithAsyncComm``, Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``): the column
layer's forward and backward are one autograd function with f fused into it, so its backward can order the work:

    without SP:  dgrad = dy W           -> launch all-reduce(dgrad)          | wgrad = dyᵀ x  -> wait
    with SP:     launch all-gather(x)   | dgrad = dy W -> wait all-gather
                 launch reduce-scatter(dgrad)                                 | wgrad = dyᵀ x_full -> wait

(``|`` = concurrently). The forward's gathered input is not saved under SP (it is ``tp`` times the shard), so
backward gathers it again, hidden behind the dgrad GEMM. With ``overlap_comm=False`` every collective is waited
for right after its launch (the baseline of ``benchmarks/parallel_overlap.py``).

Zero-bubble pipeline schedules (``pipeline.wgrad``): inside a B pass both layers compute the input gradient only
and defer ``dW = dyᵀ x`` to the W pass. The column layer's input-gradient collective still runs (and is waited
for) in B, overlapped with what is left of B's work; under SP its W gathers the input again (the shard is what
waits until W), a collective every TP rank runs at the same W of the schedule. The row layer's forward is one
small autograd function (``RowLinear``, ``x Wᵀ`` without communication) so that its backward can split too.

On CUDA the collective runs on nccl's stream and ``wait()`` only makes the compute stream wait for it. The overlap
needs ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware queue: the communication kernel, queued first, starts before
the GEMM queued after it takes every SM); ``megakernels train`` sets it for CUDA runs (docs/parallelism.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megakernels.nn.tied_embedding import dense_gradient_sent
from megakernels.ops import gemm
from megakernels.parallel import comm, fp8, init, mappings, state
from megakernels.parallel.params import is_sequence_parallel, mark_sequence_parallel, mark_tensor_parallel
from megakernels.validation import positive_int


class LinearWithAsyncComm(torch.autograd.Function):
    """``y = f(x) Wᵀ + b`` (f = copy-to-TP-region, or all-gather along dim 0 under sequence parallelism) in one
    autograd function whose backward overlaps the input-gradient collective with the weight-gradient GEMM."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel: bool, overlap: bool):
        world = dist.get_world_size(group)
        ctx.group, ctx.sp, ctx.overlap = group, sequence_parallel and world > 1, overlap
        ctx.comm = world > 1
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        ctx.weight = weight  # where a deferred weight gradient goes (``_deferred_target``)
        total = comm.all_gather(x, 0, group) if ctx.sp else x
        return gemm.linear_nograd(total, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        from megakernels.parallel.pipeline import wgrad

        x, weight = ctx.saved_tensors
        group, overlap = ctx.group, ctx.overlap
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        target, ctx.weight = ctx.weight, None
        if need_dw and wgrad.deferring():  # a zero-bubble B pass: dW in the W pass (module docstring)
            wgrad.push(_column_wgrad(x, dy, target, group, ctx.sp), (x, dy))
            need_dw = False
        gathering = None
        if ctx.sp and need_dw:
            gathering = comm.all_gather(x, 0, group, async_op=True)
            if not overlap:
                gathering.wait()
        dx = None
        if need_dx:
            comm.record("start", "dgrad")
            dx = _dgrad(dy, weight)
            comm.record("end", "dgrad")
        total = gathering.wait() if gathering is not None else x
        reducing = None
        if dx is not None and ctx.comm:
            if ctx.sp:
                reducing = comm.reduce_scatter(dx, 0, group, async_op=True)
            else:
                reducing = comm.all_reduce(dx, group, async_op=True)
            if not overlap:
                dx = reducing.wait()
        dw = db = None
        if need_dw:
            dy2 = dy.reshape(-1, dy.shape[-1])
            comm.record("start", "wgrad")
            dw = gemm.mm(dy2.t(), total.reshape(-1, total.shape[-1]))
            comm.record("end", "wgrad")
            dense_gradient_sent(target, dw)  # an LM head on a tied table: the lookup's rows go into dw
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0)
        if reducing is not None:
            dx = reducing.wait()
        return dx, dw, db, None, None, None


# Where a deferred weight gradient goes: the weight the layer's forward was given, kept as an attribute of the
# autograd context. Not the tensor ``saved_tensors`` returns: under activation recomputation (non-reentrant
# ``torch.utils.checkpoint``) that is the recomputed forward's alias of the parameter, whose ``.grad`` nobody reads;
# the context itself is the original forward's, and its inputs are the parameters.


def _column_wgrad(x, dy, weight, group, sp: bool):
    """The deferred ``dW = dyᵀ f(x)`` of ``LinearWithAsyncComm`` (gathering the sequence again under SP)."""

    def compute():
        from megakernels.parallel.pipeline import wgrad

        total = comm.all_gather(x, 0, group) if sp else x
        dy2 = dy.reshape(-1, dy.shape[-1])
        comm.record("start", "wgrad")
        dw = gemm.mm(dy2.t(), total.reshape(-1, total.shape[-1]))
        comm.record("end", "wgrad")
        wgrad.accumulate(weight, dw)

    return compute


class RowLinear(torch.autograd.Function):
    """``y = x Wᵀ (+ b)`` without communication (the row-parallel layer's GEMM; the caller reduces ``y``), as
    ``F.linear`` computes it and its backward (``dx = dy W``, ``dW = dyᵀ x``, ``db = Σ dy``), whose ``dW`` a
    zero-bubble B pass defers to W (``pipeline.wgrad``). The bias goes into the GEMM only where nothing reduces
    ``y`` afterwards (one tensor-parallel rank): it is added once, after the reduction, otherwise."""

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ctx.save_for_backward(x, weight)
        ctx.weight = weight  # where a deferred weight gradient goes (``_deferred_target``)
        ctx.has_bias = bias is not None
        return gemm.linear_nograd(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        from megakernels.parallel.pipeline import wgrad

        x, weight = ctx.saved_tensors
        target, ctx.weight = ctx.weight, None
        dx = _dgrad(dy, weight) if ctx.needs_input_grad[0] else None
        dw = db = None
        if ctx.needs_input_grad[1]:
            if wgrad.deferring():
                wgrad.push(_row_wgrad(x, dy, target), (x, dy))
            else:
                dw = _row_dw(x, dy)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0)
        return dx, dw, db


def _row_dw(x, dy):
    return gemm.mm(dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1]))


def _dgrad(dy, weight):
    """``dy W`` for ``dy`` ``[..., out]``, ``W`` ``[out, in]``."""
    return gemm.mm(dy.reshape(-1, dy.shape[-1]), weight).view(*dy.shape[:-1], weight.shape[1])


def _row_wgrad(x, dy, weight):
    def compute():
        from megakernels.parallel.pipeline import wgrad

        wgrad.accumulate(weight, _row_dw(x, dy))

    return compute


def linear_with_async_comm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    group=None,
    sequence_parallel: bool = False,
    overlap_comm: bool = True,
) -> torch.Tensor:
    """``f(x) @ weight.T + bias`` with f fused (see the module docstring); ``group`` defaults to ``tp_group()``.

    Args:
        x: ``[..., in]``; ``[s/tp, b, in]`` under ``sequence_parallel``.
        weight: this rank's ``[out_local, in]`` shard; bias ``[out_local]`` or None.

    Returns:
        ``[..., out_local]`` (``[s, b, out_local]`` under ``sequence_parallel``).
    """
    group = state.tp_group() if group is None else group
    return LinearWithAsyncComm.apply(x, weight, bias, group, bool(sequence_parallel), bool(overlap_comm))


def _check_features(cls: str, in_features, out_features) -> tuple[int, int]:
    return positive_int(in_features, "in_features", where=cls), positive_int(out_features, "out_features", where=cls)


def _check_input(cls: str, x: torch.Tensor, features: int, sequence_parallel: bool) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{cls}: x must be a tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != features:
        raise ValueError(f"{cls}: x has shape {tuple(x.shape)}, expected last dimension {features}")
    if sequence_parallel and x.dim() != 3:
        raise ValueError(
            f"{cls}: under sequence parallelism x must be [s/tp, b, h] (sequence first), got shape {tuple(x.shape)}"
        )


class ColumnParallelLinear(nn.Module):
    """``y = x Wᵀ + b`` with W split by output features over the tensor-parallel ranks.

    Parameters: ``weight`` ``[out/tp, in]`` (rows ``[r·out/tp, (r+1)·out/tp)`` of the full weight on TP rank r),
    ``bias`` ``[out/tp]`` (zeros at init). The full weight is defined by ``seed`` (drawn from the default CPU
    generator when None) and ``init_method`` (``N(0, 0.02²)`` by default), the same for every tp. With ``stride``
    s the full output is s equal segments and each rank holds its block of every one (a packed projection stays
    self-contained per rank); with ``replicas`` c, c consecutive ranks hold the same block (``[out·c/tp, in]``), for
    outputs too few to split tp ways (``megakernels.parallel.params``).

    Args:
        in_features, out_features: sizes of the full layer; ``out_features`` must divide by tp.
        bias: whether to add a bias.
        gather_output: all-gather the output to ``[..., out]`` (otherwise each rank keeps ``[..., out/tp]``).
        sequence_parallel: input is ``[s/tp, b, in]``, all-gathered along the sequence (fused into the GEMM).
        skip_bias_add: return ``(y_without_bias, bias)`` so a following fused op can add it (Megatron's).
        overlap_comm: overlap backward's collectives with the weight-gradient GEMM (True) or wait at once.
        stride, replicas: the layout of the shards (above); ``out_features`` must divide by ``stride · tp / c``.
        init_method, seed: see ``megakernels.parallel.init``.
        device, dtype: of the parameters; on the meta device nothing is initialised (``reset_parameters`` later).

    Forward: ``x`` ``[..., in]`` (``[s/tp, b, in]`` under sequence parallelism) -> ``[..., out/tp]`` (``[s, b,
    out/tp]``), or ``[..., out]`` with ``gather_output``.

    Raises:
        ValueError: non-positive sizes, ``out_features`` not divisible by tp, ``gather_output`` together with
            ``sequence_parallel``, or an input whose last dimension is not ``in_features``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        *,
        skip_bias_add: bool = False,
        overlap_comm: bool = True,
        stride: int = 1,
        replicas: int = 1,
        init_method: init.InitMethod | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        cls = type(self).__name__
        self.in_features, self.out_features = _check_features(cls, in_features, out_features)
        self.tp = state.tp_size()
        self.stride, self.replicas = (
            positive_int(stride, "stride", where=cls),
            positive_int(replicas, "replicas", where=cls),
        )
        if self.tp % replicas:
            raise ValueError(f"{cls}: replicas={replicas} does not divide the tensor-parallel size {self.tp}")
        parts = self.tp // replicas
        if gather_output and (stride > 1 or replicas > 1):
            raise ValueError(
                f"{cls}: gather_output=True needs stride=1 and replicas=1 (the gathered rows would not "
                "be in the full weight's order)"
            )
        if out_features % (stride * parts):
            raise ValueError(
                f"{cls}: out_features={out_features} is not divisible by stride × tp / replicas = {stride} × {parts}"
            )
        if gather_output and sequence_parallel:
            raise ValueError(
                f"{cls}: gather_output=True cannot be combined with sequence_parallel=True (the output "
                "of a sequence-parallel column layer feeds a row-parallel one)"
            )
        self.gather_output, self.sequence_parallel = bool(gather_output), bool(sequence_parallel)
        self.skip_bias_add, self.overlap_comm = bool(skip_bias_add), bool(overlap_comm)
        self.fp8 = None  # an ops.fp8.Fp8Recipe: the GEMMs in FP8 (megakernels.parallel.fp8.enable)
        self.init_method = init.init_method_normal() if init_method is None else init_method
        self.seed = init.draw_seed() if seed is None else int(seed)
        local = out_features // parts
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local, device=device, dtype=dtype)) if bias else None
        mark_tensor_parallel(self.weight, self.bias, stride=stride, replicas=replicas)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)initialise from ``seed``: this rank's rows of the full weight; bias zeros."""
        init.init_shard_(
            self.weight,
            (self.out_features, self.in_features),
            0,
            state.tp_rank(),
            self.tp,
            self.seed,
            self.init_method,
            stride=self.stride,
            replicas=self.replicas,
        )
        if self.bias is not None and self.bias.device.type != "meta":
            self.bias.zero_()

    def forward(self, x: torch.Tensor):
        _check_input(type(self).__name__, x, self.in_features, self.sequence_parallel)
        bias = None if self.skip_bias_add else self.bias
        if self.fp8 is not None:
            spec = fp8.LinearSpec(
                self.fp8,
                state.tp_group(),
                column=True,
                sequence_parallel=self.sequence_parallel,
                overlap=self.overlap_comm,
                out_axis=fp8.Axis.of(self.out_features, state.tp_rank(), self.tp, self.stride, self.replicas),
            )
            y = fp8.linear(x, self.weight, bias, spec)
        else:
            y = linear_with_async_comm(
                x, self.weight, bias, state.tp_group(), self.sequence_parallel, self.overlap_comm
            )
        if self.gather_output:
            y = mappings.gather_from_tensor_model_parallel_region(y)
        return (y, self.bias) if self.skip_bias_add else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(/{self.tp // self.replicas}, stride {self.stride}), "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """``y = x Wᵀ + b`` with W split by input features over the tensor-parallel ranks.

    Parameters: ``weight`` ``[out, in/tp]`` (columns ``[r·in/tp, (r+1)·in/tp)`` of the full weight on TP rank r),
    ``bias`` ``[out]``, replicated, added after the reduction (zeros at init). Under sequence parallelism each rank
    adds the bias to its own tokens only, so its gradient is partial: the bias is marked sequence-parallel (``params``)
    and ``allreduce_sequence_parallel_grads`` sums such gradients over the TP group (once per step, as Megatron).

    Args:
        in_features, out_features: sizes of the full layer; ``in_features`` must divide by tp.
        bias: whether to add a bias.
        input_is_parallel: the input is already split ``[..., in/tp]`` (the output of a column-parallel layer);
            otherwise it is ``[..., in]`` and scattered here.
        sequence_parallel: reduce-scatter the output along the sequence (``[s, b, in/tp] -> [s/tp, b, out]``)
            instead of all-reducing it.
        skip_bias_add: return ``(y_without_bias, bias)``.
        init_method, seed, device, dtype: as ``ColumnParallelLinear``.

    Raises:
        ValueError: non-positive sizes, ``in_features`` not divisible by tp, ``sequence_parallel`` with
            ``input_is_parallel=False``, or an input of the wrong last dimension.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        *,
        skip_bias_add: bool = False,
        init_method: init.InitMethod | None = None,
        seed: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        cls = type(self).__name__
        self.in_features, self.out_features = _check_features(cls, in_features, out_features)
        self.tp = state.tp_size()
        state.check_divisible(in_features=in_features)
        if sequence_parallel and not input_is_parallel:
            raise ValueError(f"{cls}: sequence_parallel=True needs input_is_parallel=True")
        self.input_is_parallel, self.sequence_parallel = bool(input_is_parallel), bool(sequence_parallel)
        self.skip_bias_add = bool(skip_bias_add)
        self.fp8 = None  # an ops.fp8.Fp8Recipe: the GEMMs in FP8 (megakernels.parallel.fp8.enable)
        self.init_method = init.init_method_normal() if init_method is None else init_method
        self.seed = init.draw_seed() if seed is None else int(seed)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.tp, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        if self.bias is not None and self.sequence_parallel:
            mark_sequence_parallel(self.bias)
        mark_tensor_parallel(self.weight, dim=1)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)initialise from ``seed``: this rank's columns of the full weight; bias zeros."""
        init.init_shard_(
            self.weight, (self.out_features, self.in_features), 1, state.tp_rank(), self.tp, self.seed, self.init_method
        )
        if self.bias is not None and self.bias.device.type != "meta":
            self.bias.zero_()

    def forward(self, x: torch.Tensor):
        cls = type(self).__name__
        local = self.in_features // self.tp
        _check_input(cls, x, local if self.input_is_parallel else self.in_features, False)
        if not self.input_is_parallel:
            x = mappings.scatter_to_tensor_model_parallel_region(x)
        if self.fp8 is not None:
            axis = fp8.Axis.of(self.in_features, state.tp_rank(), self.tp)
            partial = fp8.linear(x, self.weight, None, fp8.LinearSpec(self.fp8, state.tp_group(), False, in_axis=axis))
        elif self.tp == 1 and not self.sequence_parallel and self.bias is not None and not self.skip_bias_add:
            # nothing reduces y: the bias goes into the GEMM
            return RowLinear.apply(x, self.weight, self.bias)
        else:
            partial = RowLinear.apply(x, self.weight)
        if self.sequence_parallel:
            if partial.dim() != 3:
                raise ValueError(
                    f"{cls}: under sequence parallelism x must be [s, b, h/tp] (sequence first), got "
                    f"shape {tuple(x.shape)}"
                )
            y = mappings.reduce_scatter_to_sequence_parallel_region(partial)
        else:
            y = mappings.reduce_from_tensor_model_parallel_region(partial)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (/{self.tp}), out_features={self.out_features}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


def allreduce_sequence_parallel_grads(module: nn.Module, group=None) -> None:
    """Sum over the TP group the gradients of ``module``'s parameters marked sequence-parallel (``params``).

    Under sequence parallelism a replicated parameter applied to the sequence shard (a row-parallel bias, a
    LayerNorm's weight and bias) gets from each rank only its tokens' share of the gradient; call this after
    backward, before the optimizer step. Parameters without a gradient are skipped; no-op on one TP rank.
    """
    group = state.tp_group() if group is None else group
    if dist.get_world_size(group) == 1:
        return
    grads = [p.grad for p in module.parameters() if is_sequence_parallel(p) and p.grad is not None]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    comm.all_reduce(flat, group)
    for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)
