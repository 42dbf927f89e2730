"""FP8 GEMMs and their quantisation: tensorwise and blockwise scaling (docs/parallelism.md, "FP8 training").

A tensor ``x`` is stored as an FP8 tensor ``q`` and fp32 scales with ``x ≈ q · scale``, where one scale covers a
*tile* of elements, by granularity:

    "tensor"   one scale for the whole tensor
    "row"      1×128 tiles: ``scale[i, j]`` covers ``x[i, 128j : 128j + 128]`` (the last dimension; DeepSeek-V3's
               activation and gradient tiles; the last tile of a row may be shorter)
    "block"    128×128 blocks: ``scale[i, j]`` covers ``x[128i : 128i + 128, 128j : 128j + 128]`` (its weights)

Formats: ``e4m3`` (``torch.float8_e4m3fn``: ±448, 3 mantissa bits) and ``e5m2`` (``torch.float8_e5m2``: ±57344, 2
bits). A tile's scale is the smallest power of two ``s`` with ``amax / s <= max`` of the format, so the tile's
largest element lands in the format's top binade; ``q = round_to_nearest_even(x / s)``. Powers of two make the
division and the dequantisation exact: any device that finds the same amax writes the same bits, which is what
lets the CPU reproduce the GPU's quantisation exactly. A tile of zeros has scale 1; a non-finite amax makes the
scale (and so everything computed from the tile) non-finite, as it would be in bf16.

``fp8_gemm(a, b) = a @ bᵀ`` for ``a`` ``[M, K]`` and ``b`` ``[N, K]`` (both K-contiguous, the layout FP8 tensor cores
take): the product of FP8 operands accumulated in fp32, each 128-wide K chunk's partial sum multiplied by its two
tiles' scales and added to an fp32 accumulator (the "promotion" of DeepSeek-V3 §3.3.2: the tensor cores' limited
accumulation never sees more than 128 products), the result cast to ``out_dtype``. Tensorwise: one product of the
two scales, in the epilogue. On the CPU this is computed as the fp32 product of the dequantised operands: the same
real number up to the order of the fp32 additions.

Ops (``torch.library`` custom ops with fake implementations; CUDA tensors run the Triton kernels of
``megakernels.triton.fp8``, CPU tensors the PyTorch path here):

- ``fp8_quantize(x, fmt, granularity, scale=None, transpose=False)`` -> ``(q, scale, qt, scale_t)``: one pass over a
  2-D ``x`` writing its FP8 copy and, with ``transpose``, the FP8 copy of ``xᵀ`` (quantised in ``xᵀ``'s own tiles:
  for "row", 1×128 tiles along x's first dimension), as a weight-gradient GEMM needs it.
- ``fp8_gemm(a, a_scale, b, b_scale, ...)``, ``fp8_grouped_gemm`` (the experts of an MoE layer).
- ``fp8_linear(x, weight, bias, recipe)``: ``x Wᵀ + b`` with its forward, input-gradient and weight-gradient GEMMs
  in FP8 (differentiable; the recipes below).

Recipes (``RECIPES``): ``tensorwise`` — e4m3 activations and weights, e5m2 gradients (the gradients' range is the
widest and least predictable, and with one scale for a whole tensor e5m2's four extra binades keep its small
entries out of the subnormals; torchao's float8 training and Transformer Engine's hybrid format make the same
choice), one scale per tensor from its current amax. ``blockwise`` — DeepSeek-V3's: e4m3 everywhere (the fine tiles
bound each scale's range, so the extra mantissa bit is worth more than range), 1×128 tiles for activations and
gradients, 128×128 blocks for weights, fp32 promotion every 128 of K.
"""

from __future__ import annotations

import dataclasses

import torch

from megakernels._backend import emulate_for, runs_triton
from megakernels.ops import _checks
from megakernels.ops.grouped_gemm import check_host_sizes, segments

OP = "fp8"
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FORMAT_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
_MAX_EXPONENT = {"e4m3": 9, "e5m2": 16}  # max = 0.875 · 2**exponent for both formats
GRANULARITIES = ("tensor", "row", "block")
# Not an op's granularity: one scale per element, stored expanded (megakernels.parallel.fp8, where a tile straddles
# two tensor-parallel shards and the product is taken of the dequantised operands).
ELEMENT = "element"
TILE = 128
_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How a linear layer's three GEMMs quantise their operands: a format and a granularity for the input
    activation, the weight and the output gradient."""

    name: str
    input_format: str
    weight_format: str
    grad_format: str
    input_granularity: str
    weight_granularity: str
    grad_granularity: str


RECIPES = {
    "tensorwise": Fp8Recipe("tensorwise", "e4m3", "e4m3", "e5m2", "tensor", "tensor", "tensor"),
    "blockwise": Fp8Recipe("blockwise", "e4m3", "e4m3", "e4m3", "row", "block", "row"),
}


def get_recipe(name) -> Fp8Recipe:
    """The recipe called ``name`` (an ``Fp8Recipe`` passes through)."""
    if isinstance(name, Fp8Recipe):
        return name
    if name not in RECIPES:
        raise ValueError(f"{OP}: recipe must be one of {', '.join(RECIPES)}, got {name!r}")
    return RECIPES[name]


def _check_format(fmt) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"{OP}: fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")


def _check_granularity(granularity, allowed=GRANULARITIES, name="granularity") -> None:
    if granularity not in allowed:
        raise ValueError(f"{OP}: {name} must be one of {', '.join(allowed)}, got {granularity!r}")


def _tiles(n: int) -> int:
    return -(-n // TILE)


def scale_shape(shape, granularity: str) -> tuple[int, ...]:
    """The shape of the scales of a 2-D tensor of ``shape`` at ``granularity``."""
    m, k = shape
    return {"tensor": (), "row": (m, _tiles(k)), "block": (_tiles(m), _tiles(k))}[granularity]


def pow2_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """The smallest power of two ``s`` with ``amax / s <= FORMAT_MAX[fmt]`` (exact: from amax's exponent and
    mantissa, no division); 1 where ``amax == 0``; ``amax`` itself where it is not finite (inf or nan)."""
    amax = amax.float()
    mantissa, exponent = torch.frexp(amax)
    k = exponent - _MAX_EXPONENT[fmt] + (mantissa > 0.875).to(exponent.dtype)
    s = torch.ldexp(torch.ones_like(amax), k.clamp(-126, 127))
    s = torch.where(amax > 0, s, torch.ones_like(s))
    return torch.where(torch.isfinite(amax), s, amax)


def tile_amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """fp32 ``max |x|`` of every tile of a 2-D ``x`` (``scale_shape`` of it)."""
    a = x.detach().abs().float()
    if granularity == "tensor":
        return a.amax() if a.numel() else a.new_zeros(())
    m, k = a.shape
    pad_k = _tiles(k) * TILE - k
    if granularity == "row":
        a = torch.nn.functional.pad(a, (0, pad_k))
        return a.view(m, -1, TILE).amax(-1) if m else a.new_zeros((0, _tiles(k)))
    pad_m = _tiles(m) * TILE - m
    a = torch.nn.functional.pad(a, (0, pad_k, 0, pad_m))
    return a.view(_tiles(m), TILE, _tiles(k), TILE).amax((1, 3))


def expand_scale(scale: torch.Tensor, granularity: str, shape) -> torch.Tensor:
    """The scale of every element of a 2-D tensor of ``shape`` (broadcastable against it)."""
    if granularity in ("tensor", ELEMENT):
        return scale
    m, k = shape
    s = scale.repeat_interleave(TILE, dim=1)[:, :k]
    return s if granularity == "row" else s.repeat_interleave(TILE, dim=0)[:m]


def quantize_reference(x, fmt: str, granularity: str, scale=None):
    """``(q, scale)`` of a 2-D ``x`` (plain PyTorch; the CPU path and the tests' reference)."""
    if scale is None:
        scale = pow2_scale(tile_amax(x, granularity), fmt)
    limit = FORMAT_MAX[fmt]
    q = (x.float() / expand_scale(scale, granularity, x.shape)).clamp(-limit, limit).to(FORMATS[fmt])
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, granularity: str) -> torch.Tensor:
    """``q · scale`` in fp32 (exact)."""
    return q.float() * expand_scale(scale, granularity, q.shape)


def _triton():
    try:
        from megakernels.triton import fp8 as kernels
    except ImportError as e:  # pragma: no cover - a torch without Triton
        raise RuntimeError(f"{OP}: CUDA tensors need Triton, which failed to import ({e})") from e
    return kernels


# ---------------------------------------------------------------------------------------------------------------
# quantisation


@torch.library.custom_op("megakernels::fp8_quantize", mutates_args=())
def _quantize(
    x: torch.Tensor, fmt: str, granularity: str, scale: torch.Tensor | None, transpose: bool, emulate: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if runs_triton("fp8_quantize", x, emulate):
        return _triton().quantize(x, fmt, granularity, scale, transpose)
    q, s = quantize_reference(x, fmt, granularity, scale)
    s = s.clone() if scale is not None else s  # an op's output may not alias its input
    if not transpose:
        return q, s, q.new_empty((0,)), s.new_empty((0,))
    if granularity == "row":
        qt, st = quantize_reference(x.t().contiguous(), fmt, "row")
    else:  # one scale, or square blocks: the transposed copy shares the scales
        # (clones: a transpose of a one-row tensor is already contiguous, and an op's outputs may not alias)
        qt = q.t().clone(memory_format=torch.contiguous_format)
        st = s.t().clone(memory_format=torch.contiguous_format) if granularity == "block" else s.clone()
    return q, s, qt, st


@_quantize.register_fake
def _(x, fmt, granularity, scale, transpose, emulate):
    dtype = FORMATS[fmt]
    q = x.new_empty(x.shape, dtype=dtype)
    s = x.new_empty(scale_shape(x.shape, granularity), dtype=torch.float32)
    if not transpose:
        return q, s, x.new_empty((0,), dtype=dtype), x.new_empty((0,), dtype=torch.float32)
    t_shape = (x.shape[1], x.shape[0])
    return q, s, x.new_empty(t_shape, dtype=dtype), x.new_empty(scale_shape(t_shape, granularity), dtype=torch.float32)


def fp8_quantize(
    x: torch.Tensor, fmt: str = "e4m3", granularity: str = "tensor", scale=None, transpose: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Quantise a 2-D ``x`` to FP8 (module docstring): ``(q, scale, qt, scale_t)``, the last two None without
    ``transpose``.

    Args:
        x: ``[M, K]`` fp32/bf16/fp16, CPU or CUDA.
        fmt: ``"e4m3"`` or ``"e5m2"``.
        granularity: ``"tensor"``, ``"row"`` (1×128 tiles) or ``"block"`` (128×128).
        scale: precomputed scales (``scale_shape(x.shape, granularity)``, fp32), e.g. from an amax reduced over
            several ranks; computed from x when None.
        transpose: also write ``xᵀ`` ``[K, M]`` quantised in its own tiles (what a weight-gradient GEMM reads).

    Raises:
        TypeError / ValueError naming the argument for a non-tensor, a dtype or rank the op does not take, an
        unknown format or granularity, or scales of the wrong shape, dtype or device.
    """
    name = "fp8_quantize"
    _checks.tensor(name, "x", x)
    _check_format(fmt)
    _check_granularity(granularity)
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in _IN_DTYPES:
        raise ValueError(f"{name}: x must be fp32, bf16 or fp16, got {x.dtype}")
    if scale is not None:
        _checks.tensor(name, "scale", scale)
        _checks.same_device(name, "x", x, ("scale", scale))
        want = scale_shape(x.shape, granularity)
        if tuple(scale.shape) != want or scale.dtype != torch.float32:
            raise ValueError(
                f"{name}: scale must be fp32 of shape {want} for x {tuple(x.shape)} at granularity "
                f"{granularity!r}, got {scale.dtype} {tuple(scale.shape)}"
            )
    q, s, qt, st = _quantize(x.contiguous(), fmt, granularity, scale, bool(transpose), emulate_for(name, x))
    return (q, s, qt, st) if transpose else (q, s, None, None)


# ---------------------------------------------------------------------------------------------------------------
# GEMMs

_A_GRANULARITIES = ("tensor", "row")


def _check_operand(op, name, t, s, granularity, allowed) -> None:
    _checks.tensor(op, name, t)
    _checks.tensor(op, f"{name}_scale", s)
    _check_granularity(granularity, allowed, f"{name}_granularity")
    if t.dtype not in FORMATS.values():
        raise ValueError(f"{op}: {name} must be an FP8 tensor (float8_e4m3fn or float8_e5m2), got {t.dtype}")
    if s.dtype != torch.float32:
        raise ValueError(f"{op}: {name}_scale must be fp32, got {s.dtype}")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 operand as the GEMM ops take it: its bytes (uint8; the format travels as a string), which every
    generic tool can copy and compare (``opcheck`` compares inputs, which float8 arithmetic cannot)."""
    return t.contiguous().view(torch.uint8)


def _format(t: torch.Tensor) -> str:
    return "e4m3" if t.dtype == torch.float8_e4m3fn else "e5m2"


def _check_out_dtype(op, out_dtype) -> None:
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be fp32, bf16 or fp16, got {out_dtype}")


def gemm_reference(a, a_scale, a_granularity, b, b_scale, b_granularity, out_dtype):
    """``a @ bᵀ`` of the dequantised operands in fp32, cast to ``out_dtype`` (the CPU path)."""
    return (dequantize(a, a_scale, a_granularity) @ dequantize(b, b_scale, b_granularity).t()).to(out_dtype)


@torch.library.custom_op("megakernels::fp8_gemm", mutates_args=())
def _gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_granularity: str,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_granularity: str,
    out_dtype: torch.dtype,
    formats: str,
    emulate: bool,
) -> torch.Tensor:
    fa, fb = formats.split(",")
    a, b = a.view(FORMATS[fa]), b.view(FORMATS[fb])
    if runs_triton("fp8_gemm", a, emulate):
        return _triton().gemm(a, a_scale, a_granularity, b, b_scale, b_granularity, out_dtype)
    return gemm_reference(a, a_scale, a_granularity, b, b_scale, b_granularity, out_dtype)


@_gemm.register_fake
def _(a, a_scale, a_granularity, b, b_scale, b_granularity, out_dtype, formats, emulate):
    _checks.same_device("fp8_gemm", "a", a, ("b", b), ("a_scale", a_scale), ("b_scale", b_scale))
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    a_granularity: str = "tensor",
    b_granularity: str = "tensor",
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``dequant(a) @ dequant(b)ᵀ`` with FP8 operands and fp32 accumulation promoted every 128 of K (module
    docstring), in ``out_dtype``.

    Args:
        a: ``[M, K]`` FP8 (e4m3 or e5m2); ``a_scale`` its scales at ``a_granularity`` ("tensor" or "row").
        b: ``[N, K]`` FP8; ``b_scale`` at ``b_granularity`` ("tensor", "row" or "block").
        out_dtype: fp32, bf16 or fp16.

    Raises:
        TypeError / ValueError naming the argument: non-FP8 operands, mismatched K, scales of the wrong shape or
        dtype, tensors on different devices, two e5m2 operands (FP8 tensor cores take at most one).
    """
    op = "fp8_gemm"
    _check_operand(op, "a", a, a_scale, a_granularity, _A_GRANULARITIES)
    _check_operand(op, "b", b, b_scale, b_granularity, GRANULARITIES)
    _check_out_dtype(op, out_dtype)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{op}: a and b must be 2-D ([M, K] and [N, K]), got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{op}: b has K={b.shape[1]}, expected a's {a.shape[1]}")
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise ValueError(f"{op}: a and b are both e5m2; FP8 tensor cores take at most one e5m2 operand")
    _checks.same_device(op, "a", a, ("b", b), ("a_scale", a_scale), ("b_scale", b_scale))
    for name, t, s, g in (("a", a, a_scale, a_granularity), ("b", b, b_scale, b_granularity)):
        if tuple(s.shape) != scale_shape(t.shape, g):
            raise ValueError(
                f"{op}: {name}_scale has shape {tuple(s.shape)}, expected {scale_shape(t.shape, g)} for {name} "
                f"{tuple(t.shape)} at granularity {g!r}"
            )
    return _gemm(
        _bytes(a),
        a_scale,
        a_granularity,
        _bytes(b),
        b_scale,
        b_granularity,
        out_dtype,
        f"{_format(a)},{_format(b)}",
        emulate_for(op, a, "a"),
    )


def _grouped_scale_shape(b_shape, granularity) -> tuple[int, ...]:
    e, n, k = b_shape
    return {"tensor": (e,), "block": (e, _tiles(n), _tiles(k))}[granularity]


@torch.library.custom_op("megakernels::fp8_grouped_gemm", mutates_args=())
def _grouped(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_granularity: str,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_granularity: str,
    group_sizes: torch.Tensor,
    out_dtype: torch.dtype,
    formats: str,
    emulate: bool,
) -> torch.Tensor:
    fa, fb = formats.split(",")
    a, b = a.view(FORMATS[fa]), b.view(FORMATS[fb])
    if runs_triton("fp8_grouped_gemm", a, emulate):
        return _triton().grouped_gemm(a, a_scale, a_granularity, b, b_scale, b_granularity, group_sizes, out_dtype)
    out = a.new_zeros((a.shape[0], b.shape[1]), dtype=out_dtype)
    for e, lo, hi in segments(group_sizes):
        sa = a_scale if a_granularity == "tensor" else a_scale[lo:hi]
        out[lo:hi] = gemm_reference(a[lo:hi], sa, a_granularity, b[e], b_scale[e], b_granularity, out_dtype)
    return out


@_grouped.register_fake
def _(a, a_scale, a_granularity, b, b_scale, b_granularity, group_sizes, out_dtype, formats, emulate):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def fp8_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_sizes: torch.Tensor,
    *,
    a_granularity: str = "tensor",
    b_granularity: str = "tensor",
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``out[rows of group e] = dequant(a)[rows of e] @ dequant(b[e])ᵀ`` (``ops.grouped_gemm`` in FP8).

    Args:
        a: ``[T, K]`` FP8, rows sorted by group; ``a_scale`` a scalar ("tensor") or ``[T, ceil(K/128)]`` ("row").
        b: ``[E, N, K]`` FP8; ``b_scale`` ``[E]`` ("tensor": one scale per group's weight) or
            ``[E, ceil(N/128), ceil(K/128)]`` ("block").
        group_sizes: int32/int64 ``[E]``, non-negative, summing to T.

    Raises:
        TypeError / ValueError naming the argument, as ``fp8_gemm`` and ``ops.grouped_gemm``.
    """
    op = "fp8_grouped_gemm"
    _check_operand(op, "a", a, a_scale, a_granularity, _A_GRANULARITIES)
    _check_operand(op, "b", b, b_scale, b_granularity, ("tensor", "block"))
    _check_out_dtype(op, out_dtype)
    _checks.tensor(op, "group_sizes", group_sizes)
    if a.dim() != 2 or b.dim() != 3 or b.shape[2] != a.shape[1]:
        raise ValueError(f"{op}: a must be [T, K] and b [E, N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if (
        group_sizes.dim() != 1
        or group_sizes.shape[0] != b.shape[0]
        or group_sizes.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"{op}: group_sizes must be int32/int64 [E={b.shape[0]}], got {group_sizes.dtype} "
            f"{tuple(group_sizes.shape)}"
        )
    if tuple(a_scale.shape) != scale_shape(a.shape, a_granularity):
        raise ValueError(
            f"{op}: a_scale has shape {tuple(a_scale.shape)}, expected {scale_shape(a.shape, a_granularity)}"
        )
    if tuple(b_scale.shape) != _grouped_scale_shape(b.shape, b_granularity):
        raise ValueError(
            f"{op}: b_scale has shape {tuple(b_scale.shape)}, expected {_grouped_scale_shape(b.shape, b_granularity)}"
        )
    _checks.same_device(op, "a", a, ("b", b), ("a_scale", a_scale), ("b_scale", b_scale))
    check_host_sizes(a, group_sizes, op, "a")
    return _grouped(
        _bytes(a),
        a_scale,
        a_granularity,
        _bytes(b),
        b_scale,
        b_granularity,
        group_sizes,
        out_dtype,
        f"{_format(a)},{_format(b)}",
        emulate_for(op, a, "a"),
    )


# ---------------------------------------------------------------------------------------------------------------
# the linear layer


@dataclasses.dataclass
class Quantized:
    """An FP8 tensor, its scales and their granularity."""

    q: torch.Tensor
    scale: torch.Tensor
    granularity: str

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.granularity)


def quantize_pair(x: torch.Tensor, fmt: str, granularity: str, scale=None) -> tuple[Quantized, Quantized]:
    """``x`` and ``xᵀ`` quantised (one ``fp8_quantize`` pass)."""
    q, s, qt, st = fp8_quantize(x, fmt, granularity, scale, transpose=True)
    return Quantized(q, s, granularity), Quantized(qt, st, granularity)


def gemm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ bᵀ`` of two quantised operands (``fp8_gemm``)."""
    return fp8_gemm(
        a.q, a.scale, b.q, b.scale, a_granularity=a.granularity, b_granularity=b.granularity, out_dtype=out_dtype
    )


def linear_grads(dy: torch.Tensor, x_t: Quantized, w_t: Quantized, rec: Fp8Recipe, need_dx: bool, need_dw: bool):
    """The input and weight gradients of ``y = x Wᵀ`` from ``dy`` ``[T, N]``, ``xᵀ`` and ``Wᵀ`` quantised:
    ``dx = dy W`` (dy in 1×128 tiles along N against W's blocks) and ``dW = dyᵀ x`` (both operands' tiles along
    the tokens). Gradients in dy's dtype (dx) and fp32 (dW, which the caller casts)."""
    if need_dw:
        g, g_t = quantize_pair(dy, rec.grad_format, rec.grad_granularity)
    else:
        g, g_t = Quantized(*fp8_quantize(dy, rec.grad_format, rec.grad_granularity)[:2], rec.grad_granularity), None
    dx = gemm(g, w_t, dy.dtype) if need_dx else None
    dw = gemm(g_t, x_t, torch.float32) if need_dw else None
    return dx, dw


def _linear_parts(x2, weight, rec):
    xq, x_t = quantize_pair(x2, rec.input_format, rec.input_granularity)
    wq, w_t = quantize_pair(weight, rec.weight_format, rec.weight_granularity)
    return xq, x_t, wq, w_t


@torch.library.custom_op("megakernels::fp8_linear", mutates_args=())
def _linear(x: torch.Tensor, weight: torch.Tensor, recipe_name: str) -> torch.Tensor:
    rec = RECIPES[recipe_name]
    xq, _, wq, _ = _linear_parts(x, weight, rec)
    return gemm(xq, wq, x.dtype)


@_linear.register_fake
def _(x, weight, recipe_name):
    _checks.same_device("fp8_linear", "x", x, ("weight", weight))
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("megakernels::fp8_linear_bwd", mutates_args=())
def _linear_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, recipe_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    rec = RECIPES[recipe_name]
    _, x_t, _, w_t = _linear_parts(x, weight, rec)
    dx, dw = linear_grads(dy, x_t, w_t, rec, True, True)
    return dx.to(x.dtype), dw.to(weight.dtype)


@_linear_bwd.register_fake
def _(dy, x, weight, recipe_name):
    return torch.empty_like(x), torch.empty_like(weight)


def _linear_setup(ctx, inputs, output):
    x, weight, recipe_name = inputs
    ctx.save_for_backward(x, weight)
    ctx.recipe_name = recipe_name


def _linear_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = _linear_bwd(dy.contiguous(), x, weight, ctx.recipe_name)
    return dx, dw, None


_linear.register_autograd(_linear_backward, setup_context=_linear_setup)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, recipe="tensorwise"):
    """``x Wᵀ + b`` with the forward, input-gradient and weight-gradient GEMMs in FP8 (``recipe``: "tensorwise" or
    "blockwise", module docstring); the bias is added in x's dtype. A drop-in for ``F.linear`` on one device (the
    tensor-parallel layers of ``megakernels.parallel`` take ``fp8=`` instead, which also reduces scales over their
    ranks and saves only FP8 copies for backward).

    Args:
        x: ``[..., K]`` fp32/bf16/fp16. weight: ``[N, K]`` in x's dtype. bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in x's dtype; differentiable w.r.t. x, weight and bias.
    """
    op = "fp8_linear"
    rec = get_recipe(recipe)
    _checks.tensor(op, "x", x)
    _checks.tensor(op, "weight", weight)
    _checks.tensor(op, "bias", bias, optional=True)
    if x.dtype not in _IN_DTYPES:
        raise ValueError(f"{op}: x must be fp32, bf16 or fp16, got {x.dtype}")
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{op}: weight must be [N, K] with K = x's last dimension, got x {tuple(x.shape)} and weight "
            f"{tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"{op}: weight has dtype {weight.dtype}, expected x's {x.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"{op}: bias must be [{weight.shape[0]}] in x's dtype, got {bias.dtype} {tuple(bias.shape)}")
    _checks.same_device(op, "x", x, ("weight", weight), ("bias", bias))
    y = _linear(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), rec.name)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def linear_reference(x, weight, bias=None, recipe="tensorwise"):
    """What ``fp8_linear``'s forward computes, in plain PyTorch: the fp32 product of the quantise-dequantised
    operands, cast to x's dtype (tests)."""
    rec = RECIPES[recipe]
    x2 = x.reshape(-1, x.shape[-1])
    xd = dequantize(*quantize_reference(x2, rec.input_format, rec.input_granularity), rec.input_granularity)
    wd = dequantize(*quantize_reference(weight, rec.weight_format, rec.weight_granularity), rec.weight_granularity)
    y = (xd @ wd.t()).to(x.dtype).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias
