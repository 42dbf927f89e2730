"""The FP8 kernels (megakernels/triton/fp8.py) in the static report, built by their launchers on meta tensors so
the kernel compiled is the one that runs:

- ``fp8_gemm``: ``a @ bᵀ`` at Llama-3-8B's linear layers over 8192 tokens (hidden 4096, 32 query and 8 key-value
  heads of 128, FFN 14336): the forward of the fused QKV (N 6144), the FFN up (N 14336) and down (K 14336)
  projections in both recipes of megakernels/ops/fp8.py — tensorwise (one scale per tensor, e4m3) and blockwise
  (1x128 tiles of the activations against 128x128 blocks of the weight, fp32 promotion every 128 of K) — and
  their backward GEMMs at the FFN up shape: the input gradient of the tensorwise recipe (e5m2 gradients against
  e4m3 weights, K 14336) and the weight gradient of the blockwise one (1x128 tiles of both operands along the
  8192 tokens). Every sm_90 candidate config; the first is the key one.
- ``fp8_grouped_gemm``: the experts' forward at the 16-bit grouped GEMM's Mixtral-like shape (T 8192 rows, 8
  experts of 1024 rows each, 4096 -> 14336; shape ``E8 4096x14336``), both recipes.
- ``fp8_quantize``: the quantiser on a bf16 8192 x 4096 activation (1x128 tiles with and without the transposed
  copy, tensorwise with it: the amax reduction and the pass) and a 14336 x 4096 weight (128x128 blocks with its
  transpose).

The GEMMs are tiled MMA kernels (``tiles``): one program per output tile runs ``K / 128`` iterations of its K loop
(``fp8.gemm_schedule`` / ``grouped_schedule``), each loading a ``BLOCK_M x 128`` tile of A and a ``BLOCK_N x 128``
tile of B (one byte an element); predicted against the dense FP8 peak. The quantiser is a streaming kernel
(``streaming``): each program walks its tiles in a grid-stride loop (``fp8.quantize_schedule``), one iteration a
128 x 128 tile; predicted against the copy bandwidth for the bytes it must move (x read once, q and qᵀ written
once, the scales; the tensorwise amax pass reads x a second time, which counts as time, not as minimum bytes).
"""

from __future__ import annotations

import torch

from costmodel import compiled, model, tiles
from costmodel.analysis import Role
from costmodel.registry import Entry, register
from costmodel.streaming import Part, evaluate
from megakernels.ops import fp8 as ops_fp8

TOKENS, HIDDEN, FFN, KV = 8192, 4096, 14336, 1024
GEMM_SHAPES = {"qkv": (TOKENS, HIDDEN + 2 * KV, HIDDEN), "up": (TOKENS, FFN, HIDDEN), "down": (TOKENS, HIDDEN, FFN)}
# (pass, recipe, shape, A's format, B's format, A's granularity, B's granularity)
GEMMS = [
    *(("fwd", "tensorwise", s, "e4m3", "e4m3", "tensor", "tensor") for s in GEMM_SHAPES.values()),
    *(("fwd", "blockwise", s, "e4m3", "e4m3", "row", "block") for s in GEMM_SHAPES.values()),
    ("dgrad", "tensorwise", (TOKENS, HIDDEN, FFN), "e5m2", "e4m3", "tensor", "tensor"),  # dx = dy W
    ("wgrad", "blockwise", (FFN, HIDDEN, TOKENS), "e4m3", "e4m3", "row", "row"),  # dW = dyᵀ x
]
GROUPED_T, GROUPED_E, GROUPED_K, GROUPED_N = 8192, 8, 4096, 14336
# recipe -> (activation, weight) granularity
RECIPES = {name: (r.input_granularity, r.weight_granularity) for name, r in ops_fp8.RECIPES.items()}
QUANT = [  # (x rows, x cols, granularity, transpose)
    (TOKENS, HIDDEN, "row", True),
    (TOKENS, HIDDEN, "row", False),
    (TOKENS, HIDDEN, "tensor", True),
    (FFN, HIDDEN, "block", True),
]
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FAMILY, QUANT_FAMILY = "fp8", "fp8_quantize"
M = model.H200


def _meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def _scale(rows: int, cols: int, granularity: str, b_side: bool = False):
    """Meta scales of a ``[rows, cols]`` operand as the kernel takes them (B's row scales transposed)."""
    tr, tc = -(-rows // 128), -(-cols // 128)
    if granularity == "tensor":
        return _meta()
    if granularity == "row":
        return _meta(tc, rows) if b_side else _meta(rows, tc)
    return _meta(tr, tc)


def gemm_launch(shape, fa: str, fb: str, ga: str, gb: str, cfg: tuple):
    """The launch of ``fp8.gemm`` for ``a [M, K] @ b [N, K]ᵀ`` -> bf16 with config ``cfg``."""
    from megakernels.triton import fp8

    m, n, k = shape
    a, b = _meta(m, k, dtype=FP8[fa]), _meta(n, k, dtype=FP8[fb])
    out = _meta(m, n, dtype=torch.bfloat16)
    return fp8.gemm_launch(a, _scale(m, k, ga), ga, b, _scale(n, k, gb, b_side=True), gb, out, cfg)


def grouped_launch(ga: str, gb: str, cfg: tuple):
    from megakernels.triton import fp8

    t, e, k, n = GROUPED_T, GROUPED_E, GROUPED_K, GROUPED_N
    a, b = _meta(t, k, dtype=torch.float8_e4m3fn), _meta(e, n, k, dtype=torch.float8_e4m3fn)
    sa = _scale(t, k, ga)
    sb = _meta(e) if gb == "tensor" else _meta(e, -(-n // 128), -(-k // 128))
    return fp8.grouped_launch(a, sa, ga, b, sb, gb, _meta(e, dtype=torch.int64), _meta(t, n, dtype=torch.bfloat16), cfg)


def _tile_bytes(launch) -> dict:
    """Each K step loads a BLOCK_M x 128 tile of A and a BLOCK_N x 128 tile of B, one byte an element."""
    return {"k": (launch.kwargs["BLOCK_M"] + launch.kwargs["BLOCK_N"]) * launch.kwargs["BLOCK_K"]}


def _qgmma(c: compiled.Compiled) -> dict:
    """The FP8 wgmma instructions of the kernel's SASS, by opcode (their count per warp)."""
    out: dict[str, int] = {}
    for ins in c.fn.instrs:
        if ins.base == "QGMMA":
            out[ins.op] = out.get(ins.op, 0) + 1
    return out


def _mma_row(launch, sched, flops: float) -> dict:
    c, pred = tiles.kernel_prediction(launch, list(sched.loops), sched.iterations(), _tile_bytes(launch))
    return {**tiles.pass_row([(launch.name, c, pred)], flops, peak=M.mma_dense_fp8), "fp8_wgmma": _qgmma(c)}


def _gemm_entry(shape, fa, fb, ga, gb, cfg) -> dict:
    from megakernels.triton import fp8

    launch = gemm_launch(shape, fa, fb, ga, gb, cfg)
    m, n, k = shape
    return _mma_row(launch, fp8.gemm_schedule(launch), 2.0 * m * n * k)


def _grouped_entry(ga, gb, cfg) -> dict:
    from megakernels.triton import fp8

    launch = grouped_launch(ga, gb, cfg)
    sched = fp8.grouped_schedule(launch, [GROUPED_T // GROUPED_E] * GROUPED_E)  # balanced groups
    return _mma_row(launch, sched, 2.0 * GROUPED_T * GROUPED_K * GROUPED_N)


def _config_name(cfg: tuple) -> str:
    """``BLOCK_M x BLOCK_N``, warps, stages (BLOCK_K is always 128)."""
    return f"{cfg[0]}x{cfg[1]} w{cfg[2]} s{cfg[3]}"


@register
def fp8_gemm_entries() -> list[Entry]:
    from megakernels.triton import fp8

    out = []
    for pass_, recipe, shape, fa, fb, ga, gb in GEMMS:
        shape_name = "x".join(map(str, shape))
        bench = {"op": "fp8_gemm", "pass": pass_, "shape": shape_name, "dtype": fa, "variant": recipe}
        for i, cfg in enumerate(fp8.candidates(fp8.GEMM_CONFIGS, 90, None)):
            out.append(
                Entry(
                    f"fp8_gemm.{pass_}",
                    _config_name(cfg),
                    f"{shape_name} {recipe}",
                    fa,
                    (lambda s=shape, f=(fa, fb, ga, gb), c=cfg: _gemm_entry(s, *f, c)),
                    family=FAMILY,
                    key=i == 0,
                    needs_wgmma=True,
                    bench=bench,
                )
            )
    shape_name = f"E{GROUPED_E} {GROUPED_K}x{GROUPED_N}"  # 8 experts of 1024 rows each, k x n
    for recipe, (ga, gb) in RECIPES.items():
        bench = {"op": "fp8_grouped_gemm", "pass": "fwd", "shape": shape_name, "dtype": "e4m3", "variant": recipe}
        for i, cfg in enumerate(fp8.candidates(fp8.GROUPED_CONFIGS, 90, None)):
            out.append(
                Entry(
                    "fp8_grouped_gemm.fwd",
                    _config_name(cfg),
                    f"{shape_name} {recipe}",
                    "e4m3",
                    (lambda g=(ga, gb), c=cfg: _grouped_entry(*g, c)),
                    family=FAMILY,
                    key=i == 0,
                    needs_wgmma=True,
                    bench=bench,
                )
            )
    return out


# ---- the quantiser (streaming) -----------------------------------------------------------------------------------


def quantize_launches(rows: int, cols: int, granularity: str, transpose: bool, fmt: str = "e4m3"):
    """The launches of ``fp8.quantize`` on a bf16 ``[rows, cols]`` meta tensor (scales computed)."""
    from megakernels.triton import fp8

    x = _meta(rows, cols, dtype=torch.bfloat16)
    outputs = fp8.quantize_outputs(x, fmt, granularity, transpose)
    amax = _meta(1, dtype=torch.int32) if granularity == "tensor" else None
    return fp8.quantize_launches(x, fmt, granularity, None, outputs, amax, sms=M.sms)


def _quant_parts(rows: int, cols: int, granularity: str, transpose: bool) -> list[Part]:
    """One Part per launch: a role of 16-byte loads of bf16 x (pack 8) and the 16-byte stores of q (and qᵀ), one
    pack of q's 16 bytes per two of x's; the scales' 4-byte stores are the loop's scalar traffic."""
    from megakernels.triton import fp8

    n = rows * cols
    scale_bytes = 0.0 if granularity == "tensor" else 4.0 / 128
    out_bytes = (1 + scale_bytes) * (2 if transpose else 1)
    parts = []
    # the quantising pass first (the row shows the first part's resources), then the amax pass it follows
    for launch in reversed(quantize_launches(rows, cols, granularity, transpose)):
        threads = launch.num_warps * 32
        per_program = max(len(r) for runs in fp8.quantize_schedule(launch).programs for _, r in runs)
        pack = 8
        packs = per_program * 128 * 128 / threads / pack
        if launch.name == "fp8_amax_kernel":
            roles, dram, minimum = [Role("amax", 1, reads_dram=True)], 2.0, 0.0
        else:
            roles = [Role("quantize", 1 if transpose else 2, stores=1, reads_dram=True)]
            pack = 8 if transpose else 16
            packs = per_program * 128 * 128 / threads / pack
            dram = minimum = 2.0 + out_bytes
        parts.append(
            Part(
                (lambda ln=launch: compiled.triton_kernel(ln)),
                roles,
                pack,
                packs,
                launch.num_ctas,
                n,
                dram,
                minimum,
                name=launch.name,
            )
        )
    return parts


@register
def fp8_quantize_entries() -> list[Entry]:
    out = []
    for rows, cols, gran, transpose in QUANT:
        shape = f"{rows}x{cols} {gran}{' +T' if transpose else ''}"
        bench = {"op": "fp8_quantize", "pass": "fwd", "shape": shape, "dtype": "bfloat16", "variant": gran}
        out.append(
            Entry(
                "fp8_quantize.fwd",
                "128x128 w8",
                shape,
                "bf16",
                (lambda r=rows, c=cols, g=gran, t=transpose: evaluate(_quant_parts(r, c, g, t))),
                family=QUANT_FAMILY,
                bench=bench,
            )
        )
    return out
