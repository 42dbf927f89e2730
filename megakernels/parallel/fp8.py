"""FP8 in the tensor-parallel layers: the column- and row-parallel linears and the experts' grouped GEMMs run their
forward, input-gradient and weight-gradient GEMMs in FP8 (``megakernels.ops.fp8``) once ``enable(model, recipe)``
has set their ``fp8`` attribute (docs/parallelism.md, "FP8 training").

**Scales are those of the whole tensor, whatever the layout.** A rank holds a shard, but the quantisation of the
single-process model is the reference, so:

- a tensorwise scale comes from the amax of the whole tensor: a sharded tensor's local amax is reduced (MAX) over
  the tensor-parallel group (a weight shard, a row-parallel input, a column-parallel output gradient, a sequence
  shard); a tensor every rank holds whole (a column-parallel input without SP) needs nothing;
- 1×128 tiles and 128×128 blocks are tiles *of the full tensor*. When the shard boundaries fall on multiples of 128
  (every real model: hidden sizes and head groups are multiples of 128 per rank) a tile is wholly on one rank and
  the local op runs as is. Otherwise (small test models) a tile may straddle ranks: its amax is reduced over the
  group and the element's scale is its global tile's, and the GEMM takes the dequantised operands (the CPU's
  computation anyway; on CUDA this case is refused — ``_misaligned``).

So the quantised operands of every layout are the single process's, and losses differ across layouts only by the
order of fp32 sums (which can move an element across a rounding boundary of FP8: rare, and a few ulps of FP8).

What a layer keeps for backward: the FP8 copy of its input (1 byte an element instead of 2): ``xᵀ`` in its own
tiles along the tokens (blockwise) or x's FP8 copy (tensorwise: the transpose shares its scale), and the weight's
FP8 copy transposed. Under sequence parallelism the column-parallel layer quantises its sequence shard and
all-gathers **FP8** (the tensor and its scales: half the bytes of the bf16 gather); backward gathers again, FP8
for tensorwise (its transpose is exact), bf16 for blockwise (whose transposed tiles run along the tokens, across
the shards).

Zero-bubble pipeline schedules (``pipeline.wgrad``): inside a B pass both functions compute the input gradient and
defer the weight-gradient GEMMs, with what they read (the quantised output gradient, the input's FP8 copy or, under
sequence parallelism, the shard gathered again in W), to the W pass; the numbers are those of the undeferred GEMMs.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from megakernels.ops import fp8 as ops
from megakernels.ops.fp8 import TILE, Quantized
from megakernels.ops.grouped_gemm import segments
from megakernels.parallel import comm
from megakernels.parallel.fp8_gather import GatheredWeight
from megakernels.parallel.init import shard_pieces

ELEMENT = ops.ELEMENT


@dataclasses.dataclass(frozen=True)
class Axis:
    """Where a sharded dimension's local indices sit in the full dimension (``init.shard_pieces``)."""

    full: int
    pieces: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, full: int, rank: int, world: int, stride: int = 1, replicas: int = 1) -> Axis | None:
        """The axis of rank ``rank``'s shard, or None where its tiles are the full tensor's (aligned)."""
        if world == 1:
            return None
        pieces = tuple(shard_pieces(full, rank, world, stride, replicas))
        aligned = all(f % TILE == 0 and (n % TILE == 0 or f + n == full) for f, _, n in pieces)
        return None if aligned else cls(full, pieces)

    def tile_ids(self, device) -> torch.Tensor:
        """The global tile of every local index."""
        parts = [torch.arange(f, f + n, device=device) for f, _, n in self.pieces]
        return torch.cat(parts) // TILE

    @property
    def tiles(self) -> int:
        return -(-self.full // TILE)


def _max_over(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        return comm.all_reduce(t, group, op=dist.ReduceOp.MAX)
    return t


def _misaligned(x: torch.Tensor) -> None:
    if x.device.type == "cuda":
        raise ValueError(
            "fp8: a 1×128 tile or 128×128 block straddles two tensor-parallel shards; on CUDA every shard of a "
            "blockwise-FP8 layer must be a multiple of 128 along its split dimension (choose hidden / ffn / head "
            "sizes that divide so, or the tensorwise recipe)"
        )


def quantize(
    x: torch.Tensor,
    fmt: str,
    granularity: str,
    *,
    group=None,
    rows: Axis | None = None,
    cols: Axis | None = None,
) -> Quantized:
    """``x`` ``[M, K]`` quantised with the full tensor's scales (module docstring): tensorwise, the amax reduced
    over ``group``; tiles along a dimension with an ``Axis`` (``rows`` for blocks, ``cols``) are global tiles."""
    if granularity == "tensor":
        amax = _max_over(ops.tile_amax(x, "tensor").reshape(1), group).reshape(())
        q, s, _, _ = ops.fp8_quantize(x, fmt, "tensor", ops.pow2_scale(amax, fmt))
        return Quantized(q, s, "tensor")
    if cols is None and (granularity == "row" or rows is None):
        q, s, _, _ = ops.fp8_quantize(x, fmt, granularity)
        return Quantized(q, s, granularity)
    _misaligned(x)
    m, k = x.shape
    a = x.detach().abs().float()
    col_ids = cols.tile_ids(x.device) if cols is not None else torch.arange(k, device=x.device) // TILE
    n_cols = cols.tiles if cols is not None else -(-k // TILE)
    if granularity == "row":
        amax = a.new_zeros((m, n_cols)).scatter_reduce(1, col_ids.expand(m, k), a, "amax")
        scale = ops.pow2_scale(_max_over(amax, group), fmt)[:, col_ids]
    else:
        row_ids = rows.tile_ids(x.device) if rows is not None else torch.arange(m, device=x.device) // TILE
        n_rows = rows.tiles if rows is not None else -(-m // TILE)
        flat = (row_ids[:, None] * n_cols + col_ids[None, :]).reshape(-1)
        amax = a.new_zeros(n_rows * n_cols).scatter_reduce(0, flat, a.reshape(-1), "amax")
        scale = ops.pow2_scale(_max_over(amax, group), fmt)[flat].view(m, k)
    limit = ops.FORMAT_MAX[fmt]
    q = (x.float() / scale).clamp(-limit, limit).to(ops.FORMATS[fmt])
    return Quantized(q, scale, ELEMENT)


def transpose(t: Quantized) -> Quantized:
    """The quantised transpose, where it shares the tiles (tensor, block, element); not for 1×128 row tiles."""
    if t.granularity == "row":
        raise ValueError("fp8: 1×128 row tiles are not the transpose's tiles; quantise xᵀ itself")
    scale = t.scale if t.granularity == "tensor" else t.scale.t().contiguous()
    return Quantized(t.q.t().contiguous(), scale, t.granularity)


def gemm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ bᵀ``: the FP8 GEMM op, or the dequantised product where a tile straddled shards."""
    if ELEMENT in (a.granularity, b.granularity):
        return (a.dequantize() @ b.dequantize().t()).to(out_dtype)
    return ops.gemm(a, b, out_dtype)


# ---------------------------------------------------------------------------------------------------------------
# the sequence-parallel FP8 all-gather


def _gather_fp8(t: Quantized, group, async_op: bool):
    """All-gather along dim 0 the FP8 bytes (and 1×128 scales) of a sequence shard; the result is ``Quantized``
    (``wait()`` it when ``async_op``)."""
    pending_q = comm.all_gather(t.q.view(torch.uint8), 0, group, async_op=True)
    pending_s = comm.all_gather(t.scale, 0, group, async_op=True) if t.granularity == "row" else None

    def finish():
        q = pending_q.wait().view(t.q.dtype)
        s = pending_s.wait() if pending_s is not None else t.scale
        return Quantized(q, s, t.granularity)

    if async_op:
        return _Later(finish)
    return finish()


class _Later:
    def __init__(self, fn):
        self._fn = fn

    def wait(self):
        return self._fn()


# ---------------------------------------------------------------------------------------------------------------
# the linear layers


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    """What the FP8 linear of one layer needs to know: its recipe, its TP group, whether it is column-parallel
    (the input gathered under SP, the input gradient reduced) and the axes of its sharded dimensions."""

    recipe: ops.Fp8Recipe
    group: object
    column: bool
    sequence_parallel: bool = False
    overlap: bool = True
    out_axis: Axis | None = None  # column-parallel: the weight's rows and the output's features
    in_axis: Axis | None = None  # row-parallel: the weight's columns and the input's features

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    @property
    def sharded_group(self):
        """The group over which a sharded tensor's tensorwise amax is reduced (None: one rank)."""
        return self.group if self.world > 1 else None


class Fp8Linear(torch.autograd.Function):
    """``y = f(x) Wᵀ + b`` in FP8 with the communication of ``linear.LinearWithAsyncComm`` (column: f gathers the
    sequence under SP, the input gradient is all-reduced or reduce-scattered, overlapped with the weight-gradient
    GEMM) or none (row: the caller's mappings reduce the output)."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: LinearSpec):
        rec = spec.recipe
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        group = spec.sharded_group
        sp = spec.column and spec.sequence_parallel and spec.world > 1
        in_group = group if (sp or not spec.column) else None  # the input differs across the TP ranks
        xq = quantize(x2, rec.input_format, rec.input_granularity, group=in_group, cols=spec.in_axis)
        saved_x = None
        if sp:
            ctx.local_q = xq if rec.input_granularity == "tensor" else None
            saved_x = x2 if rec.input_granularity != "tensor" else None
            xq = _gather_fp8(xq, spec.group, async_op=False)
        elif rec.input_granularity == "tensor":
            ctx.x_t = transpose(xq)
        else:
            ctx.x_t = quantize(x2.t(), rec.input_format, "row")
        if isinstance(weight, GatheredWeight):  # FSDP gathered it in FP8 (parallel.fp8_gather)
            wq = weight.quantized()
        else:
            wq = quantize(
                weight, rec.weight_format, rec.weight_granularity, group=group, rows=spec.out_axis, cols=spec.in_axis
            )
        ctx.w_t = transpose(wq)
        ctx.spec, ctx.shape, ctx.has_bias = spec, shape, bias is not None
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.weight = weight  # where a deferred weight gradient goes (pipeline.wgrad)
        ctx.save_for_backward(saved_x)
        y = gemm(xq, wq, x.dtype)
        if bias is not None:
            y = y + bias
        lead = (shape[0] * spec.world,) + tuple(shape[1:-1]) if sp else tuple(shape[:-1])
        return y.view(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        from megakernels.parallel.pipeline import wgrad

        spec, rec = ctx.spec, ctx.spec.recipe
        (saved_x,) = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        sp = spec.column and spec.sequence_parallel and spec.world > 1
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        defer = need_dw and wgrad.deferring()
        if defer:  # a zero-bubble B pass: the weight gradient in W (module docstring)
            need_dw = False
        gathering = None
        if sp and need_dw:
            if ctx.local_q is not None:
                gathering = _gather_fp8(ctx.local_q, spec.group, async_op=True)
            else:
                gathering = comm.all_gather(saved_x, 0, spec.group, async_op=True)
            if not spec.overlap:
                done = gathering.wait()
                gathering = _Later(lambda: done)
        # the output gradient differs across the TP ranks for a column-parallel layer (its own features)
        group = spec.sharded_group if spec.column else None
        g = quantize(dy2, rec.grad_format, rec.grad_granularity, group=group, cols=spec.out_axis)
        dx = None
        if need_dx:
            comm.record("start", "dgrad")
            dx = gemm(g, ctx.w_t, dy.dtype)
            comm.record("end", "dgrad")
        if defer:
            source = (ctx.local_q if ctx.local_q is not None else saved_x) if sp else None
            x_t = None if sp else ctx.x_t
            held = [t for t in (g.q, g.scale, dy2, source, x_t) if isinstance(t, torch.Tensor)]
            held += [t for q in (source, x_t) if isinstance(q, Quantized) for t in (q.q, q.scale)]
            wgrad.push(_linear_wgrad(spec, g, dy2, x_t, source, ctx.w_dtype, ctx.weight), held)
        reducing = None
        if dx is not None and spec.column and spec.world > 1:
            if sp:
                reducing = comm.reduce_scatter(dx, 0, spec.group, async_op=True)
            else:
                reducing = comm.all_reduce(dx, spec.group, async_op=True)
            if not spec.overlap:
                dx = reducing.wait()
        dw = db = None
        if need_dw:
            if gathering is not None:
                full = gathering.wait()
                if isinstance(full, Quantized):
                    x_t = transpose(full)
                else:
                    x_t = quantize(full.t(), rec.input_format, "row")
            else:
                x_t = ctx.x_t
            dw = _linear_dw(rec, g, dy2, x_t, ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        if reducing is not None:
            dx = reducing.wait()
        if dx is not None:
            lead = ctx.shape[:-1]
            dx = dx.view(*lead, ctx.shape[-1])
        ctx.x_t = ctx.w_t = ctx.local_q = ctx.weight = None
        return dx, dw, db, None


def _linear_dw(rec, g: Quantized, dy2: torch.Tensor, x_t: Quantized, w_dtype) -> torch.Tensor:
    """``Fp8Linear``'s weight gradient: ``gᵀ x`` on the FP8 copies along the tokens."""
    g_t = transpose(g) if rec.grad_granularity == "tensor" else quantize(dy2.t(), rec.grad_format, "row")
    comm.record("start", "wgrad")
    dw = gemm(g_t, x_t, torch.float32).to(w_dtype)
    comm.record("end", "wgrad")
    return dw


def _linear_wgrad(spec: LinearSpec, g, dy2, x_t, source, w_dtype, weight):
    """The deferred weight gradient of ``Fp8Linear`` (``source``: under SP, the input shard to gather again — its
    FP8 copy, tensorwise, or the 16-bit shard)."""

    def compute():
        from megakernels.parallel.pipeline import wgrad

        rec, xt = spec.recipe, x_t
        if source is not None:
            if isinstance(source, Quantized):
                xt = transpose(_gather_fp8(source, spec.group, async_op=False))
            else:
                xt = quantize(comm.all_gather(source, 0, spec.group).t(), rec.input_format, "row")
        wgrad.accumulate(weight, _linear_dw(rec, g, dy2, xt, w_dtype))

    return compute


def linear(x, weight, bias, spec: LinearSpec) -> torch.Tensor:
    """``Fp8Linear`` (``x`` ``[..., in]``; under SP, column-parallel: ``[s/tp, b, in]``)."""
    return Fp8Linear.apply(x, weight, bias, spec)


# ---------------------------------------------------------------------------------------------------------------
# the experts


def _stack(ts: list[Quantized]) -> Quantized:
    g = ts[0].granularity
    return Quantized(torch.stack([t.q for t in ts]), torch.stack([t.scale for t in ts]), g)


def _grouped(a: Quantized, b: list[Quantized], sizes: torch.Tensor, out_dtype) -> torch.Tensor:
    """``out[rows of e] = a[rows of e] @ b[e]ᵀ``: the FP8 grouped GEMM op, or per group dequantised."""
    if ELEMENT not in (a.granularity, b[0].granularity):
        bs = _stack(b)
        return ops.fp8_grouped_gemm(
            a.q,
            a.scale,
            bs.q,
            bs.scale,
            sizes,
            a_granularity=a.granularity,
            b_granularity=bs.granularity,
            out_dtype=out_dtype,
        )
    ad = a.dequantize()
    out = ad.new_zeros((ad.shape[0], b[0].q.shape[0]))
    for e, lo, hi in segments(sizes):
        out[lo:hi] = ad[lo:hi] @ b[e].dequantize().t()
    return out.to(out_dtype)


@dataclasses.dataclass(frozen=True)
class ExpertSpec:
    """One of the experts' two grouped GEMMs: the recipe, the TP group, whether it is the column-parallel fc1 (the
    input whole on every rank, the output features sharded: ``out_axis``) or the row-parallel fc2 (``in_axis``)."""

    recipe: ops.Fp8Recipe
    group: object
    column: bool
    out_axis: Axis | None = None
    in_axis: Axis | None = None

    @property
    def sharded_group(self):
        return self.group if self.group is not None and dist.get_world_size(self.group) > 1 else None


class Fp8GroupedLinear(torch.autograd.Function):
    """``out[rows of e] = x[rows of e] W[e]ᵀ`` in FP8 (``Fp8Linear`` for the experts; no communication)."""

    @staticmethod
    def forward(ctx, x, weight, sizes, spec: ExpertSpec):
        rec, group = spec.recipe, spec.sharded_group
        xq = quantize(
            x, rec.input_format, rec.input_granularity, group=None if spec.column else group, cols=spec.in_axis
        )
        wq = [
            quantize(w, rec.weight_format, rec.weight_granularity, group=group, rows=spec.out_axis, cols=spec.in_axis)
            for w in weight.unbind(0)
        ]
        ctx.w_t = [transpose(w) for w in wq]
        ctx.xq = xq if rec.input_granularity == "tensor" else None
        ctx.spec, ctx.w_dtype = spec, weight.dtype
        ctx.weight = weight  # where a deferred weight gradient goes (pipeline.wgrad)
        ctx.save_for_backward(x if rec.input_granularity != "tensor" else None, sizes)
        return _grouped(xq, wq, sizes, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        from megakernels.parallel.pipeline import wgrad

        spec, rec = ctx.spec, ctx.spec.recipe
        x, sizes = ctx.saved_tensors
        dy = dy.contiguous()
        group = spec.sharded_group if spec.column else None
        g = quantize(dy, rec.grad_format, rec.grad_granularity, group=group, cols=spec.out_axis)
        dx = _grouped(g, ctx.w_t, sizes, dy.dtype) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            shape = (len(ctx.w_t), ctx.w_t[0].q.shape[1], ctx.w_t[0].q.shape[0])
            args = (rec, g, dy, x, ctx.xq, sizes, shape, ctx.w_dtype)
            if wgrad.deferring():  # a zero-bubble B pass: the weight gradients in W (module docstring)
                weight = ctx.weight

                def compute():
                    wgrad.accumulate(weight, _grouped_dw(*args))

                xq = ctx.xq
                wgrad.push(compute, [t for t in (g.q, g.scale, dy, x, sizes) if t is not None] + ([xq.q] if xq else []))
            else:
                dw = _grouped_dw(*args)
        ctx.w_t = ctx.xq = ctx.weight = None
        return dx, dw, None, None


def _grouped_dw(rec, g: Quantized, dy, x, xq: Quantized | None, sizes, shape, w_dtype) -> torch.Tensor:
    """``Fp8GroupedLinear``'s weight gradients, one GEMM per group along its own tokens."""
    dw = dy.new_zeros(shape, dtype=w_dtype)
    for e, lo, hi in segments(sizes):
        if rec.grad_granularity == "tensor":  # one scale: a group's rows of the whole tensor's copy
            g_t = Quantized(g.q[lo:hi].t().contiguous(), g.scale, "tensor")
            x_t = Quantized(xq.q[lo:hi].t().contiguous(), xq.scale, "tensor")
        else:  # 1×128 tiles along each group's own tokens
            g_t = quantize(dy[lo:hi].t(), rec.grad_format, "row")
            x_t = quantize(x[lo:hi].t(), rec.input_format, "row")
        dw[e] = gemm(g_t, x_t, torch.float32).to(w_dtype)
    return dw


def grouped_linear(x, weight, sizes, spec: ExpertSpec) -> torch.Tensor:
    return Fp8GroupedLinear.apply(x, weight, sizes, spec)


# ---------------------------------------------------------------------------------------------------------------
# switching a model to FP8


def layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of ``module`` that can run in FP8: those with an ``fp8`` attribute (their recipe, None for off),
    which the column- and row-parallel linears and the experts' module set when built."""
    return [m for m in module.modules() if hasattr(m, "fp8")]


def enable(module: torch.nn.Module, recipe) -> int:
    """Run every column- and row-parallel linear and every experts' module in ``module`` in FP8 with ``recipe``
    (a name or an ``Fp8Recipe``; None turns FP8 off); returns how many layers it set. Embeddings, the LM head,
    norms and attention are other modules and stay in their precision."""
    rec = None if recipe is None else ops.get_recipe(recipe)
    found = layers(module)
    for m in found:
        m.fp8 = rec
    return len(found)


@contextlib.contextmanager
def disabled(module: torch.nn.Module):
    """FP8 off in ``module`` for the block (the layers' settings restored after)."""
    found = layers(module)
    saved = [m.fp8 for m in found]
    for m in found:
        m.fp8 = None
    try:
        yield
    finally:
        for m, r in zip(found, saved):
            m.fp8 = r
