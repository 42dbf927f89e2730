"""The band rule of every attention path, in Python: which keys a query sees, and the blocks a tiled loop visits.

Query ``i`` sees key ``j`` iff, with ``diag = sk - sq + shift`` (bottom-right aligned causality; ``shift`` moves a
sliding window's diagonal for a context-parallel chunk) and ``rel = i + diag - j``: ``rel >= 0`` when causal,
``rel < window`` (causal) or ``|rel| < window`` (not) with a window, and, with packed documents, ``j`` inside the
query's document span (``spans[i]``, megakernels.ops.attention.document_ranges). So every query sees one span of
keys and every key is seen by one span of queries, both ends non-decreasing: a block of rows meets the keys from
its first row's start to its last row's end, and every one of its rows sees the keys from its last row's start to
its first row's end.

The same rule is written once per language: the Triton kernels' ``key_bounds`` / ``query_bounds``
(megakernels/triton/_common.py), the C++ CPU kernel's ``flash_attention::key_bounds`` (csrc/flash_attention/
flash_attention.h), and here, for the launch schedules (megakernels.triton.flash_attention) and the blocked
PyTorch path (megakernels.ops._attention_cpu); tests/ops/test_attention_band.py holds the three together.
Torch- and Triton-free.
"""

from __future__ import annotations

from collections.abc import Sequence


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _clip_to_spans(bounds, spans: Sequence, first: int, last: int, block: int) -> tuple[int, int, int, int]:
    """``(lo, full_lo, full_hi, hi)`` cut to the document spans of the block's ``first`` and ``last`` rows: blocks
    from ``[spans[first][0], spans[last][1])``, unmasked only in ``[spans[last][0], spans[first][1])``."""
    lo, full_lo, full_hi, hi = bounds
    lo = max(lo, spans[first][0] // block * block)
    hi = max(min(hi, spans[last][1]), lo)
    full_lo = max(full_lo, _cdiv(spans[last][0], block) * block)
    full_hi = min(full_hi, spans[first][1] // block * block)
    full_lo = min(max(full_lo, lo), _cdiv(hi, block) * block)
    return lo, full_lo, max(full_hi, full_lo), hi


def key_bounds(
    first: int,
    rows: int,
    sq: int,
    sk: int,
    block: int,
    causal: bool,
    window: int = 0,
    shift: int = 0,
    spans: Sequence | None = None,
) -> tuple[int, int, int, int]:
    """``(lo, full_lo, full_hi, hi)`` of the query rows ``[first, first + rows)``, in blocks of ``block`` keys: the
    key blocks from ``lo`` (a multiple of ``block``) up to ``hi`` meet some row's band, those in ``[full_lo,
    full_hi)`` (multiples of ``block``, inside ``sk``) lie in every row's, so a loop visits ``[lo, full_lo)`` and
    ``[full_hi, hi)`` with masks and ``[full_lo, full_hi)`` without. ``spans``: the rows' document key spans (one
    batch element's ``[sq][2]``; the last row is clipped to ``sq - 1`` for them). ``block = 1`` gives the exact
    key span ``[lo, hi)`` of the rows."""
    if window:
        diag = sk - sq + shift
        lo = max(first + diag - window + 1, 0) // block * block
        if causal:
            hi = min(sk, max(first + rows + diag, 0))
            full_hi = min(max(first + diag + 1, 0), sk) // block * block
        else:
            hi = min(sk, max(first + rows + diag + window - 1, 0))
            full_hi = min(max(first + diag + window, 0), sk) // block * block
        hi = max(hi, lo)
        full_lo = min(max(_cdiv(max(first + rows + diag - window, 0), block) * block, lo), _cdiv(hi, block) * block)
        bounds = (lo, full_lo, max(full_hi, full_lo), hi)
    elif causal:  # query i sees key j iff j <= i + sk - sq
        bounds = (0, 0, min(max(first + sk - sq + 1, 0), sk) // block * block, min(sk, max(first + rows + sk - sq, 0)))
    else:
        bounds = (0, 0, sk // block * block, sk)
    if spans is not None:
        bounds = _clip_to_spans(bounds, spans, first, min(first + rows, sq) - 1, block)
    return bounds


def query_bounds(
    first: int,
    keys: int,
    sq: int,
    sk: int,
    block: int,
    causal: bool,
    window: int = 0,
    shift: int = 0,
    spans: Sequence | None = None,
) -> tuple[int, int, int, int]:
    """``(lo, mid, full_end, hi)`` of the keys ``[first, first + keys)``, in blocks of ``block`` queries (the
    backward's transpose of ``key_bounds``): the query blocks from ``lo`` up to ``hi`` meet some key's band, those
    in ``[mid, full_end)`` see every key of the block inside ``sq`` (none when the block runs past ``sk``: its
    padding keys are masked), and ``mid <= full_end``. ``spans``: the keys' document query spans (``[sk][2]``)."""
    if window:
        diag = sk - sq + shift
        if causal:
            lo = max(first - diag, 0) // block * block
            mid = _cdiv(max(first + keys - 1 - diag, 0), block) * block
        else:
            lo = max(first - diag - window + 1, 0) // block * block
            mid = _cdiv(max(first + keys - diag - window, 0), block) * block
        hi = max(min(sq, max(first + keys - diag + window - 1, 0)), lo)
        mid = min(max(mid, lo), _cdiv(hi, block) * block)
        full_end = mid if first + keys > sk else min(max(first - diag + window, 0), sq) // block * block
        bounds = (lo, mid, max(full_end, mid), hi)
    else:
        full_end = sq // block * block
        lo = mid = 0
        if causal:  # query i sees key j iff j <= i + sk - sq
            lo = max(first + sq - sk, 0) // block * block
            mid = min(_cdiv(max(first + keys - 1 + sq - sk, 0), block) * block, full_end)
        if first + keys > sk:
            mid = full_end
        bounds = (lo, max(mid, lo), full_end, sq)
    if spans is not None:
        bounds = _clip_to_spans(bounds, spans, first, min(first + keys, sk) - 1, block)
    return bounds


__all__ = ["key_bounds", "query_bounds"]
