"""The band rule is written once per language: megakernels.ops.attention_band (the launch schedules and the PyTorch
path), the Triton helpers ``key_bounds`` / ``query_bounds`` (every FlashAttention kernel) and the C++ CPU kernel's
``flash_attention::key_bounds``. Here the Python copy is checked against the visibility matrix (``window_mask`` and
the documents' ids, element by element), and the Triton helpers (run by a small kernel: on the GPU where there is
one, else under Triton's interpreter) and the C++ function (through its test binding) are held to it, block by
block, over many (sq, sk, blocks, window, causal, documents, shift) cases."""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl

import megakernels  # noqa: F401 - registers the compiled ops
from megakernels.ops.attention import document_ranges, window_mask
from megakernels.ops.attention_band import key_bounds, query_bounds
from megakernels.triton import interpreting
from megakernels.triton._common import key_bounds as tl_key_bounds
from megakernels.triton._common import query_bounds as tl_query_bounds


def _doc_ids(rng: random.Random, b: int, s: int, docs: int) -> torch.Tensor:
    """``[b, s]`` non-decreasing document ids in ``[0, 2 * docs)`` (even ids only: a query id may have no keys)."""
    return torch.tensor([sorted(2 * rng.randrange(docs) for _ in range(s)) for _ in range(b)])


def _cases(n: int, seed: int):
    """``n`` random cases: (sq, sk, block_m, block_n, causal, window, shift, q_docs, k_docs or None)."""
    rng = random.Random(seed)
    for _ in range(n):
        sq, sk = rng.randint(1, 150), rng.randint(1, 150)
        bm, bn = rng.choice([16, 32, 64]), rng.choice([16, 32, 64])
        causal = rng.random() < 0.5
        window = rng.choice([0, 0, 1, 5, 17, 40, 200])
        shift = rng.choice([0, 7, -13, 37, -45, 120]) if window else 0
        docs = None
        if rng.random() < 0.4:
            n_docs = rng.randint(1, 5)
            docs = (_doc_ids(rng, 2, sq, n_docs), _doc_ids(rng, 2, sk, n_docs + 1))
        yield sq, sk, bm, bn, causal, window, shift, docs


def _seen(sq, sk, causal, window, shift, docs, b) -> torch.Tensor:
    """``[sq, sk]`` bool: query i sees key j (batch element ``b``), from the masks."""
    hidden = window_mask(sq, sk, causal, window, shift)
    seen = torch.ones(sq, sk, dtype=torch.bool) if hidden is None else ~hidden
    if docs is not None:
        seen &= docs[0][b][:, None] == docs[1][b][None, :]
    return seen


def _spans(docs):
    ranges = document_ranges(*docs) if docs is not None else None
    return (None, None) if ranges is None else (ranges[0].tolist(), ranges[1].tolist())


@pytest.mark.parametrize("seed", range(3))
def test_bounds_hold_exactly_the_blocks_the_masks_see(seed):
    """For every block of rows: the key blocks outside ``[lo, hi)`` hold no seen pair, the first and last ones inside
    do, and every key of ``[full_lo, full_hi)`` is seen by every row; the same for the transpose (every block of
    keys, the query blocks of ``query_bounds``; the full ones exclude a key block running past sk)."""
    for sq, sk, bm, bn, causal, window, shift, docs in _cases(60, seed):
        q_keys, k_queries = _spans(docs)
        for b in range(2 if docs is not None else 1):
            seen = _seen(sq, sk, causal, window, shift, docs, b)
            for m0 in range(0, sq, bm):
                rows = seen[m0 : m0 + bm]
                lo, full_lo, full_hi, hi = key_bounds(
                    m0, bm, sq, sk, bn, causal, window, shift, q_keys[b] if docs is not None else None
                )
                cols = rows.any(0).nonzero().flatten()
                assert lo % bn == 0
                if len(cols):
                    assert lo <= int(cols[0]) and int(cols[-1]) < hi
                    if docs is None and m0 + bm <= sq:  # tight: the first and last key blocks hold a seen pair
                        assert int(cols[0]) // bn == lo // bn and int(cols[-1]) // bn == (hi - 1) // bn
                assert full_lo % bn == 0 and full_hi % bn == 0 and lo <= full_lo <= full_hi <= max(hi, full_lo)
                assert bool(rows[:, full_lo:full_hi].all())
            for n0 in range(0, sk, bn):
                keys = seen[:, n0 : n0 + bn]
                lo, mid, full_end, hi = query_bounds(
                    n0, bn, sq, sk, bm, causal, window, shift, k_queries[b] if docs is not None else None
                )
                qs = keys.any(1).nonzero().flatten()
                if len(qs):
                    assert lo <= int(qs[0]) and int(qs[-1]) < hi and lo % bm == 0
                assert lo <= mid <= full_end and mid % bm == 0 and full_end % bm == 0
                assert (mid == full_end or full_end <= sq) and bool(keys[mid:full_end].all())
                assert n0 + bn <= sk or mid == full_end


@triton.jit
def _bounds_kernel(
    OUT,
    SPANS,
    SQ,
    SK,
    WINDOW,
    SHIFT,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOCS: tl.constexpr,
    KEYS: tl.constexpr,
):
    """Writes, per (block, batch element), the kernels' (lo, full_lo, full_hi, hi) of a query block (``KEYS``: from
    ``key_bounds``) or (lo, mid, full_end, hi) of a key block (``query_bounds``)."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    if KEYS:
        spans = SPANS + b * SQ * 2
        out = tl_key_bounds(pid, SQ, SK, SHIFT, WINDOW, spans, BLOCK_M, BLOCK_N, CAUSAL, WINDOWED, DOCS)
    else:
        spans = SPANS + b * SK * 2
        out = tl_query_bounds(pid, SQ, SK, SHIFT, WINDOW, spans, BLOCK_M, BLOCK_N, CAUSAL, WINDOWED, DOCS)
    base = OUT + (b * tl.num_programs(0) + pid) * 4
    for i in tl.static_range(4):
        tl.store(base + i, out[i])


def _run_bounds(sq, sk, bm, bn, causal, window, shift, spans, keys: bool) -> list:
    device = "cpu" if interpreting() else "cuda"
    blocks = triton.cdiv(sq, bm) if keys else triton.cdiv(sk, bn)
    batch = 1 if spans is None else spans.shape[0]
    out = torch.full((batch, blocks, 4), -(2**30), dtype=torch.int32, device=device)
    span_arg = out if spans is None else spans.to(device)
    _bounds_kernel[(blocks, batch)](
        out, span_arg, sq, sk, window, shift, bm, bn, causal, window > 0, spans is not None, keys
    )
    return out.cpu().tolist()


@pytest.mark.parametrize("seed", range(2))
def test_triton_bounds_are_the_python_ones(seed):
    """The jit helpers every FlashAttention kernel takes its loop bounds from give the Python function's bounds for
    every block of every case (forward / dQ: the query blocks' keys; backward: the key blocks' queries)."""
    if not interpreting() and not torch.cuda.is_available():
        pytest.fail("no GPU and no interpreter: the conftest sets TRITON_INTERPRET=1 on a machine without a GPU")
    for sq, sk, bm, bn, causal, window, shift, docs in _cases(40, 100 + seed):
        ranges = document_ranges(*docs) if docs is not None else None
        q_keys, k_queries = _spans(docs)
        got = _run_bounds(sq, sk, bm, bn, causal, window, shift, None if ranges is None else ranges[0], True)
        for b, per_block in enumerate(got):
            want = [
                list(key_bounds(m0, bm, sq, sk, bn, causal, window, shift, q_keys[b] if docs is not None else None))
                for m0 in range(0, sq, bm)
            ]
            assert per_block == want, (sq, sk, bm, bn, causal, window, shift, b)
        got = _run_bounds(sq, sk, bm, bn, causal, window, shift, None if ranges is None else ranges[1], False)
        for b, per_block in enumerate(got):
            want = [
                list(
                    query_bounds(n0, bn, sq, sk, bm, causal, window, shift, k_queries[b] if docs is not None else None)
                )
                for n0 in range(0, sk, bn)
            ]
            assert per_block == want, (sq, sk, bm, bn, causal, window, shift, b)


@pytest.mark.parametrize("seed", range(2))
def test_cpp_bounds_are_the_python_ones(seed):
    """The C++ kernel's ``key_bounds`` (its forward's key blocks of 64 and its backward's exact spans, block 1) is the
    Python function for the rows its blocks hold (the last block's rows cut at sq)."""
    for sq, sk, _, _, causal, window, shift, docs in _cases(60, 200 + seed):
        ranges = document_ranges(*docs) if docs is not None else None
        q_keys, _ = _spans(docs)
        for b in range(2 if docs is not None else 1):
            for block in (1, 16, 64):
                for first in range(0, sq, 64):
                    rows = min(64, sq - first)
                    got = torch.ops.megakernels.flash_attn_key_bounds(
                        sq, sk, causal, window, shift, None if ranges is None else ranges[0], b, first, rows, block
                    )
                    spans = q_keys[b] if docs is not None else None
                    want = key_bounds(first, rows, sq, sk, block, causal, window, shift, spans)
                    assert list(got) == list(want), (sq, sk, causal, window, shift, b, first, block)


def test_cpp_bounds_refuse_bad_arguments():
    op = torch.ops.megakernels.flash_attn_key_bounds
    with pytest.raises(ValueError, match=r"rows \[first, first \+ rows\)"):
        op(10, 10, True, 0, 0, None, 0, 8, 4, 1)
    with pytest.raises(ValueError, match="block must be >= 1"):
        op(10, 10, True, 0, 0, None, 0, 0, 4, 0)
    with pytest.raises(ValueError, match="shift needs one"):
        op(10, 10, True, 0, 3, None, 0, 0, 4, 1)


@pytest.mark.parametrize("sq,sk,window,shift", [(64, 64, 10, 50), (100, 70, 5, 60), (64, 100, 8, 90)])
def test_cpu_kernel_stops_at_sk_when_the_band_leaves_the_keys(sq, sk, window, shift):
    """A window shifted so far that the band of a block's last rows lies past sk: the C++ kernel visits only the key
    blocks inside sk (it once ran on to that row's band start and read past the packed keys) and matches fp64
    attention with the same mask; rows that see no key give zeros."""
    g = torch.Generator().manual_seed(sq + sk)
    q, k, v = (torch.randn(1, n, 2, 32, generator=g) for n in (sq, sk, sk))
    out, _ = torch.ops.megakernels.flash_attn_fwd_cpu(q, k, v, True, 0.2, window, shift)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 0.2
    p = torch.softmax(s.masked_fill(window_mask(sq, sk, True, window, shift), float("-inf")), -1).nan_to_num(0.0)
    ref = torch.einsum("bhqk,bkhd->bqhd", p, v.double())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
