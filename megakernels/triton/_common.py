"""Pieces shared by the Triton kernels: interpreter detection, the per-arch config tuner, and the counter-based
dropout hash that the CPU paths reproduce bit for bit (``dropout_keep_reference``)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _probe():
    pass


def interpreting() -> bool:
    """Whether the kernels in this package were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not hasattr(_probe, "run") or type(_probe).__name__ == "InterpretedFunction"


def install_interpreter_descriptor_reduce() -> None:
    """Give Triton's CPU interpreter the tensor-descriptor add (``desc.atomic_add``: a TMA reduce on the GPU) it
    lacks, as the masked fp32/int atomic add of the descriptor's tile (out-of-range elements skipped, as the
    hardware clips them), so the kernels that use it run under the interpreter too. A Triton that has it, or has no
    interpreter, is left alone."""
    try:
        from triton._C.libtriton import ir
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - a Triton without the interpreter
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or hasattr(builder, "create_descriptor_reduce"):
        return

    def create_descriptor_reduce(self, kind, desc, value, indices):
        if kind != ir.DESCRIPTOR_REDUCE_KIND.ADD:
            raise NotImplementedError(f"descriptor reduce {kind} under the interpreter")
        ptrs, mask = desc.materialize_pointers(indices)
        op = ir.ATOMIC_OP.FADD if value.dtype.scalar.is_floating() else ir.ATOMIC_OP.ADD
        mask = interpreter.TensorHandle(mask, tl.int1)
        return self.create_atomic_rmw(op, ptrs, value, mask, ir.MEM_SEMANTIC.RELAXED, None)

    builder.create_descriptor_reduce = create_descriptor_reduce


_FP8_CAST_DTYPES = {  # Triton dtype name -> (torch dtype, a numpy integer dtype of its width torch takes)
    "fp8e4nv": ("float8_e4m3fn", "uint8"),
    "fp8e5": ("float8_e5m2", "uint8"),
    "fp16": ("float16", "int16"),
    "bf16": ("bfloat16", "int16"),
    "fp32": ("float32", "int32"),
}
_FP8_MAX = {"fp8e4nv": 448.0, "fp8e5": 57344.0}


def interpreter_fp8_casts_installed() -> bool:
    """Whether Triton's interpreter converts to and from FP8 as a GPU does (``install_interpreter_fp8_casts``)."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - a Triton without the interpreter
        return False
    return getattr(interpreter._convert_float, "megakernels_fp8", False)


def install_interpreter_fp8_casts() -> None:
    """Make Triton's CPU interpreter convert between FP8 (e4m3, e5m2) and fp32/fp16/bf16 as sm_90 does.

    The interpreter's own conversion (Triton 3.8) rounds a narrowing cast half-up on the dropped bits without the
    carry into the exponent (fp32 -124.0 becomes e4m3 -64.0) and widens e5m2 subnormals to zero, so FP8 kernels
    (the quantiser's casts, the operands of an FP8 ``tl.dot``) compute wrong values under it. Installed, the
    conversions with round-to-nearest-even (or none given) go through torch's exact conversion, narrowing ones
    saturating to the format's largest finite value as the GPU's ``cvt.rn.satfinite`` does (NaN stays NaN); any
    other conversion is the interpreter's. Idempotent; a Triton without the interpreter is left alone."""
    try:
        import numpy as np
        from triton._C.libtriton import ir
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - a Triton without the interpreter
        return
    if interpreter_fp8_casts_installed():
        return
    original = interpreter._convert_float
    exact_modes = (None, ir.ROUNDING_MODE.RTNE)

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        src, dst = _FP8_CAST_DTYPES.get(input_dtype.name), _FP8_CAST_DTYPES.get(output_dtype.name)
        fp8 = input_dtype.name in _FP8_MAX or output_dtype.name in _FP8_MAX
        if src is None or dst is None or not fp8 or rounding_mode not in exact_modes:
            return original(input, input_dtype, output_dtype, rounding_mode)
        bits = np.ascontiguousarray(input).view(getattr(np, src[1])).copy()
        t = torch.from_numpy(bits).view(getattr(torch, src[0])).float()
        if output_dtype.name in _FP8_MAX:
            limit = _FP8_MAX[output_dtype.name]
            t = torch.where(torch.isnan(t), t, t.clamp(-limit, limit))
        out = t.to(getattr(torch, dst[0])).view(getattr(torch, dst[1])).numpy()
        return out.view(f"uint{8 * out.itemsize}").reshape(np.shape(input))

    convert_float.megakernels_fp8 = True
    interpreter._convert_float = convert_float


# ----------------------------------------------------------------------------------------------------------------
# Config choice. Each kernel has, per GPU architecture, an ordered list of candidate configs; the first is the
# default. With MEGAKERNELS_AUTOTUNE=1 (the default on a GPU) every candidate is timed once per shape class and the
# fastest kept; under the interpreter, or with MEGAKERNELS_AUTOTUNE=0, the first is used.

_TUNED: dict[tuple, dict] = {}


def arch_of(device: torch.device) -> int:
    """Compute capability as an integer (90 for sm_90); 0 for a CPU tensor (interpreter)."""
    if device.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def pick_config(key: tuple, candidates: list[dict], launch) -> dict:
    """The config for ``key``: the first candidate, or the fastest by ``triton.testing.do_bench`` when autotuning.

    ``launch(config)`` runs the kernel once with that config (it must be safe to repeat)."""
    if len(candidates) == 1 or interpreting() or os.environ.get("MEGAKERNELS_AUTOTUNE", "1") == "0":
        return candidates[0]
    best = _TUNED.get(key)
    if best is None:
        timings = []
        for cfg in candidates:
            try:
                timings.append((triton.testing.do_bench(lambda: launch(cfg), warmup=5, rep=20), cfg))
            except triton.runtime.errors.OutOfResources:
                continue
        if not timings:
            raise RuntimeError(f"megakernels: no Triton config fits this GPU for {key}")
        best = min(timings, key=lambda t: t[0])[1]
        _TUNED[key] = best
    return best


def seq_bucket(n: int) -> int:
    """Shape class of a sequence length for the tuning cache (next power of two, at least 64)."""
    return max(64, triton.next_power_of_2(n))


# ----------------------------------------------------------------------------------------------------------------
# The band rule (megakernels/ops/attention_band.py states it and holds the Python copy the schedules and the PyTorch
# path use; tests/ops/test_attention_band.py runs these helpers under the interpreter against it). Query ``i`` sees
# key ``j`` iff ``rel = i + diag - j`` (how far the key lies behind the query; ``diag = SK - SQ``, plus a window's
# ``SHIFT``, aligns the bottom-right corners) satisfies ``rel >= 0`` when causal, ``rel < window`` (causal:
# HuggingFace Mistral's ``i - w < j <= i``, flash-attn's ``window_size=(w - 1, 0)``) or ``|rel| < window`` (not:
# flash-attn's ``(w - 1, w - 1)``) with a window, and ``j`` in the row's document span with documents.


@triton.jit
def in_band(rows, cols, diag, window, CAUSAL: tl.constexpr):
    """Boolean mask (broadcast of ``rows`` and ``cols``, absolute query and key indices) of the window's band."""
    rel = rows + diag - cols
    if CAUSAL:
        return (rel >= 0) & (rel < window)
    return (rel < window) & (rel > -window)


@triton.jit
def band_diag(SQ, SK, SHIFT, WINDOWED: tl.constexpr):
    """``diag`` of the band: ``SK - SQ``, plus ``SHIFT`` with a window (the only case that takes one)."""
    if WINDOWED:
        return SK - SQ + SHIFT
    return SK - SQ


@triton.jit
def _clip_to_spans(lo, full_lo, full_hi, hi, spans, first, last, BLOCK: tl.constexpr):
    """``(lo, full_lo, full_hi, hi)`` (in blocks of ``BLOCK`` of the other side) cut to the document spans of the
    block's first and last rows (``spans``: ``[s, 2]`` int32, non-decreasing): blocks from ``[spans[first][0],
    spans[last][1])``, unmasked only in ``[spans[last][0], spans[first][1])``."""
    lo = tl.maximum(lo, tl.load(spans + first * 2) // BLOCK * BLOCK)
    hi = tl.maximum(tl.minimum(hi, tl.load(spans + last * 2 + 1)), lo)
    full_lo = tl.maximum(full_lo, tl.cdiv(tl.load(spans + last * 2), BLOCK) * BLOCK)
    full_hi = tl.minimum(full_hi, tl.load(spans + first * 2 + 1) // BLOCK * BLOCK)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), tl.cdiv(hi, BLOCK) * BLOCK)
    return lo, full_lo, tl.maximum(full_hi, full_lo), hi


@triton.jit
def key_bounds(
    pid_m,
    SQ,
    SK,
    SHIFT,
    WINDOW,
    spans,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOCS: tl.constexpr,
):
    """``(lo, full_lo, full_hi, hi)`` of query block ``pid_m`` (rows ``[pid_m * BLOCK_M, + BLOCK_M)``): key blocks
    from ``lo`` up to ``hi`` meet some row's band, those in ``[full_lo, full_hi)`` every row's (inside SK).
    ``spans``: with ``DOCS``, the batch element's ``[SQ, 2]`` int32 key spans (the rows' documents). Without a
    window or documents ``lo = full_lo = 0`` (constants)."""
    m0 = pid_m * BLOCK_M
    if WINDOWED:
        diag = SK - SQ + SHIFT
        lo = tl.maximum(m0 + diag - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        if CAUSAL:
            hi = tl.minimum(SK, tl.maximum(m0 + BLOCK_M + diag, 0))
            full_hi = tl.minimum(tl.maximum(m0 + diag + 1, 0), SK) // BLOCK_N * BLOCK_N
        else:
            hi = tl.minimum(SK, tl.maximum(m0 + BLOCK_M + diag + WINDOW - 1, 0))
            full_hi = tl.minimum(tl.maximum(m0 + diag + WINDOW, 0), SK) // BLOCK_N * BLOCK_N
        hi = tl.maximum(hi, lo)
        full_lo = tl.cdiv(tl.maximum(m0 + BLOCK_M + diag - WINDOW, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), tl.cdiv(hi, BLOCK_N) * BLOCK_N)
        full_hi = tl.maximum(full_hi, full_lo)
    else:
        lo = 0
        full_lo = 0
        if CAUSAL:  # query i sees key j iff j <= i + SK - SQ
            hi = tl.minimum(SK, tl.maximum((pid_m + 1) * BLOCK_M + SK - SQ, 0))
            full_hi = tl.minimum(tl.maximum(m0 + SK - SQ + 1, 0), SK) // BLOCK_N * BLOCK_N
        else:
            hi = SK
            full_hi = SK // BLOCK_N * BLOCK_N
    if DOCS:
        last = tl.minimum(m0 + BLOCK_M, SQ) - 1
        lo, full_lo, full_hi, hi = _clip_to_spans(lo, full_lo, full_hi, hi, spans, m0, last, BLOCK_N)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_bounds(
    pid_n,
    SQ,
    SK,
    SHIFT,
    WINDOW,
    spans,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOCS: tl.constexpr,
):
    """``(lo, mid, full_end, hi)`` of key block ``pid_n`` (keys ``[pid_n * BLOCK_N, + BLOCK_N)``; the backward's
    transpose of ``key_bounds``): query blocks from ``lo`` up to ``hi`` meet some key's band, those in ``[mid,
    full_end)`` see every key of the block inside SQ (none for a block that runs past SK, whose padding keys are
    masked). ``spans``: with ``DOCS``, the batch element's ``[SK, 2]`` query spans (the keys' documents). The last
    loop starts at ``max(full_end, mid)`` (``full_end < mid`` only without a window or documents)."""
    n0 = pid_n * BLOCK_N
    if WINDOWED:
        diag = SK - SQ + SHIFT
        if CAUSAL:
            lo = tl.maximum(n0 - diag, 0) // BLOCK_M * BLOCK_M
            mid = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M
        else:
            lo = tl.maximum(n0 - diag - WINDOW + 1, 0) // BLOCK_M * BLOCK_M
            mid = tl.cdiv(tl.maximum(n0 + BLOCK_N - diag - WINDOW, 0), BLOCK_M) * BLOCK_M
        hi = tl.maximum(tl.minimum(SQ, tl.maximum(n0 + BLOCK_N - diag + WINDOW - 1, 0)), lo)
        mid = tl.minimum(tl.maximum(mid, lo), tl.cdiv(hi, BLOCK_M) * BLOCK_M)
        full_end = tl.minimum(tl.maximum(n0 - diag + WINDOW, 0), SQ) // BLOCK_M * BLOCK_M
        if n0 + BLOCK_N > SK:  # the key tail: every query block masked
            full_end = mid
        full_end = tl.maximum(full_end, mid)
    else:
        if CAUSAL:  # query i sees key j iff j <= i + SK - SQ
            lo = tl.maximum(n0 + SQ - SK, 0) // BLOCK_M * BLOCK_M
            mid = tl.minimum(
                tl.cdiv(tl.maximum((pid_n + 1) * BLOCK_N - 1 + SQ - SK, 0), BLOCK_M) * BLOCK_M,
                SQ // BLOCK_M * BLOCK_M,
            )
        else:
            lo = 0
            mid = 0
        full_end = SQ // BLOCK_M * BLOCK_M
        if (pid_n + 1) * BLOCK_N > SK:  # the key tail: every query block masked
            mid = full_end
        mid = tl.maximum(mid, lo)
        hi = SQ
    if DOCS:
        last = tl.minimum(n0 + BLOCK_N, SK) - 1
        lo, mid, full_end, hi = _clip_to_spans(lo, mid, full_end, hi, spans, n0, last, BLOCK_M)
    return lo, mid, full_end, hi


# ----------------------------------------------------------------------------------------------------------------
# Dropout: keep(seed, row, col) from a 32-bit integer hash (murmur3's finaliser), so the mask is a pure function of
# the seed and the element's coordinates: the same on CPU and GPU, the same in forward and backward, independent of
# the block sizes. ``row`` is the flat (batch*heads + head)*sq + query index, ``col`` the key index.

_M1, _M2, _GOLD, _MIX = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9, 0x27D4EB2F


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def dropout_row_hash(seed_lo, seed_hi, rows):
    """Per-row part of the hash; ``rows`` int32 flat row indices, seeds uint32."""
    h = _fmix32(rows.to(tl.uint32) + seed_hi * 0x9E3779B9)
    return _fmix32(h ^ seed_lo)


@triton.jit
def dropout_keep(row_hash, cols, threshold):
    """Boolean keep-mask: the top 24 bits of hash(row, col) compared against ``threshold = int(p * 2**24)``."""
    h = _fmix32(row_hash + cols.to(tl.uint32) * 0x27D4EB2F)
    return (h >> 8).to(tl.int32) >= threshold


def dropout_threshold(p: float) -> int:
    return int(round(p * (1 << 24)))


def split_seed(seed: int) -> tuple[int, int]:
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF


def _fmix32_torch(h: torch.Tensor) -> torch.Tensor:
    mask = 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * _M1) & mask
    h = h ^ (h >> 13)
    h = (h * _M2) & mask
    return h ^ (h >> 16)


def dropout_keep_reference(seed: int, rows: torch.Tensor, cols: torch.Tensor, p: float) -> torch.Tensor:
    """The same keep-mask in PyTorch (int64 arithmetic masked to 32 bits): ``[len(rows), len(cols)]`` bool."""
    lo, hi = split_seed(seed)
    mask = 0xFFFFFFFF
    r = _fmix32_torch(((rows.to(torch.int64) & mask) + hi * _GOLD) & mask)
    r = _fmix32_torch(r ^ lo)
    h = _fmix32_torch((r[:, None] + (cols.to(torch.int64)[None, :] * _MIX)) & mask)
    return (h >> 8) >= dropout_threshold(p)
