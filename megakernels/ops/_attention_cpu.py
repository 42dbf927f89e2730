"""The CPU path of flash_attention: blocked over queries, so memory is O(block * sk) per (batch, head), never
O(sq * sk), with every product a large GEMM (the BLAS does the work).
attention.py runs it for what the C++ kernel (csrc/flash_attention) does not cover: fp64 and head dims over 256
(dropout, sliding windows, documents and sinks run the C++ kernel; this path keeps them for those).

Forward, per block of queries: scores against the visible keys only (causal blocks stop at the diagonal, windowed
ones also start at the band's near edge, so the cost grows with the window, not the sequence), the
row log-sum-exp, ``P = exp(S - lse)``, the dropout mask of megakernels.triton._common (same bits as the GPU
kernel), ``out = P V``. Backward recomputes ``P`` from the lse, per block: ``dv += P^T dO``,
``dS = P * (dO V^T - delta)``, ``dq = scale dS K``, ``dk += scale dS^T Q``. Grouped-query heads are folded into
the rows of the query block (``[b, hk, group * rows, d]``), so k and v are never repeated per query head and the
group's contributions to dk/dv sum inside the GEMM. v may have its own head dim (``d_v``): out, dO and dv have it,
delta sums over it. 16-bit inputs compute in fp32; fp64 stays fp64 (gradcheck).

Attention sinks (``sinks`` ``[h]``): one more term in each row's max and sum (the sink's logit, its value zero);
``lse`` includes it, so the backward of q, k and v is unchanged; ``dsinks`` comes from delta and lse
(_sinks.sinks_grad).

Documents (``ranges``: attention.document_ranges, each query's span of same-document keys): each batch element
runs on its own, and a query block's keys shrink further to the span from its first row's document start to its
last row's document end, so key blocks of other documents are never multiplied; inside the span, keys of another
document are masked like the causal ones.
"""

from __future__ import annotations

import math

import torch

from megakernels.ops._attention_out import empty_out
from megakernels.ops._sinks import no_sinks_grad, sinks_grad
from megakernels.ops.attention_band import key_bounds

_BLOCK_BYTES = 4 << 20  # budget for one block's score matrix


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_per_block(b: int, h: int, sk: int, itemsize: int) -> int:
    return max(16, min(1024, _BLOCK_BYTES // max(1, b * h * sk * itemsize)))


def _blocks(sq: int, sk: int, rows: int, causal: bool, window: int = 0, shift: int = 0, spans=None):
    """(start, stop, k0, k1) per query block: its rows see keys in ``[k0, k1)`` only (``attention_band.key_bounds``
    of its rows, exact: blocks of one key). With causality keys past the block's last row are skipped; with a window
    also keys before the band of its first row; with documents (``spans``: per query row ``(lo, hi)``, its
    document's keys, non-decreasing) keys outside ``[spans[start][0], spans[stop - 1][1])``."""
    for start in range(0, sq, rows):
        stop = min(sq, start + rows)
        k0, _, _, k1 = key_bounds(start, stop - start, sq, sk, 1, causal, window, shift, spans)
        yield start, stop, k0, k1


def _batches(b: int, ranges):
    """(b0, b1, spans) per group of batch elements run together: all at once without documents, else one at a time
    with its rows' key spans."""
    if ranges is None:
        yield 0, b, None
        return
    q_keys = ranges[0].tolist()
    for i in range(b):
        yield i, i + 1, q_keys[i]


def _by_kv_head(t: torch.Tensor, hk: int) -> torch.Tensor:
    """``[b, s, h, d]`` -> ``[b, hk, group, s, d]`` (a view)."""
    b, s, h, d = t.shape
    return t.view(b, s, hk, h // hk, d).permute(0, 2, 3, 1, 4)


def _block_mask(
    start, stop, k0, k1, sq, sk, causal, window, shift, dropout_p, seed, b, h, hk, device, b0=0, spans=None
):
    """(mask [rows, k1 - k0], True = not seen, or None; dropout keep [b, hk, group*rows, k1 - k0] or None) for
    batch elements ``b0 .. b0 + b``; ``spans``: the rows' document key spans (one batch element)."""
    causal_mask = None
    rows, cols = torch.arange(start, stop, device=device), torch.arange(k0, k1, device=device)
    if window:  # query i sees key j iff 0 <= i + diag - j < window (causal) or |i + diag - j| < window
        rel = rows[:, None] + (sk - sq + shift) - cols[None, :]
        causal_mask = (rel >= window) | ((rel < 0) if causal else (rel <= -window))
    elif causal:
        causal_mask = cols[None, :] > rows[:, None] + (sk - sq)
    if spans is not None:
        span = torch.tensor(spans[start:stop], device=device).view(-1, 2)
        other = (cols[None, :] < span[:, :1]) | (cols[None, :] >= span[:, 1:])
        if bool(other.any()):
            causal_mask = other if causal_mask is None else causal_mask | other
    keep = None
    if dropout_p > 0.0:
        from megakernels.triton._common import dropout_keep_reference

        g = h // hk
        heads = torch.arange(h, device=device).view(hk, g)
        flat = (
            torch.arange(b0, b0 + b, device=device)[:, None, None, None] * h + heads[None, :, :, None]
        ) * sq + torch.arange(start, stop, device=device)[None, None, None, :]
        keep = dropout_keep_reference(seed, flat.reshape(-1), cols, dropout_p)
        keep = keep.view(b, hk, g * (stop - start), k1 - k0)
    return causal_mask, keep


def _scores(qb, kt, causal_mask, g):
    """``q k^T`` for a block (q already scaled), causal positions at -inf: ``[b, hk, g*rows, kv]``."""
    s = torch.matmul(qb, kt)
    if causal_mask is not None:
        s.view(*s.shape[:2], g, -1, s.shape[-1]).masked_fill_(causal_mask, float("-inf"))
    return s


def _sink_rows(sinks, hk: int, g: int, rows: int, ct):
    """The sinks of a block's rows ``[hk, g * rows, 1]`` (the query heads of a k/v head, each for its rows), or
    None."""
    if sinks is None:
        return None
    return sinks.to(ct).view(hk, g, 1).expand(hk, g, rows).reshape(hk, g * rows, 1)


def forward(
    q,
    k,
    v,
    causal: bool,
    scale: float,
    dropout_p: float,
    seed: int,
    window: int = 0,
    shift: int = 0,
    ranges=None,
    sinks=None,
):

    b, sq, h, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    g = h // hk
    ct = _compute_dtype(q.dtype)
    out = empty_out(q, dv)
    lse = torch.empty((b, hk, g, sq), dtype=ct)  # fp32 (fp64 for fp64 input: gradcheck)
    keep_scale = 1.0 / (1.0 - dropout_p)
    rows_per_block = _rows_per_block(b, h, sk, 4)
    sink_lse = sinks.to(ct).view(hk, g, 1) if sinks is not None else float("-inf")  # a row that sees no key
    for b0, b1, spans in _batches(b, ranges):
        nb = b1 - b0
        qh, kh, vh = _by_kv_head(q[b0:b1], hk), _by_kv_head(k[b0:b1], hk)[:, :, 0], _by_kv_head(v[b0:b1], hk)[:, :, 0]
        kt = kh.to(ct).transpose(-1, -2)  # [nb, hk, d, sk]
        vc = vh.to(ct)
        oh = _by_kv_head(out[b0:b1], hk)
        lse_b = lse[b0:b1]
        for start, stop, k0, k1 in _blocks(sq, sk, rows_per_block, causal, window, shift, spans):
            rows = stop - start
            if k1 == k0:
                oh[:, :, :, start:stop].zero_()
                lse_b[..., start:stop] = sink_lse
                continue
            causal_mask, keep = _block_mask(
                start, stop, k0, k1, sq, sk, causal, window, shift, dropout_p, seed, nb, h, hk, q.device, b0, spans
            )
            qb = (qh[:, :, :, start:stop].to(ct) * scale).reshape(nb, hk, g * rows, d)
            # In place on the block's scores: max, exp(s - max), row sums (4 passes; the GEMMs are the BLAS's).
            p = _scores(qb, kt[..., k0:k1], causal_mask, g)
            m = p.amax(-1, keepdim=True)
            sink = _sink_rows(sinks, hk, g, rows, ct)
            if sink is not None:
                m = torch.maximum(m, sink)
            m = m.masked_fill_(torch.isneginf(m), 0.0)  # a row that sees no key: P = 0, l = 0, lse = -inf
            l = p.sub_(m).exp_().sum(-1, keepdim=True)
            if sink is not None:
                l = l + torch.exp(sink - m)
            if keep is not None:
                p = p.masked_fill_(~keep, 0.0)
            o = torch.matmul(p, vc[:, :, k0:k1]).mul_(keep_scale / l.masked_fill(l == 0, 1.0))
            oh[:, :, :, start:stop] = o.view(nb, hk, g, rows, dv)
            lse_b[..., start:stop] = (m + torch.log(l)).view(nb, hk, g, rows)
    return out, lse.view(b, h, sq)


def backward(
    do,
    q,
    k,
    v,
    out,
    lse,
    causal: bool,
    scale: float,
    dropout_p: float,
    seed: int,
    window: int = 0,
    shift: int = 0,
    ranges=None,
    sinks=None,
):
    b, sq, h, d = q.shape
    sk, hk, d_v = k.shape[1], k.shape[2], v.shape[3]
    g = h // hk
    ct = _compute_dtype(q.dtype)
    delta_all = (do.to(ct) * out.to(ct)).sum(-1)  # [b, sq, h]
    delta_all = delta_all.view(b, sq, hk, g).permute(0, 2, 3, 1)  # [b, hk, g, sq]
    lse_all = lse.view(b, hk, g, sq)
    dq = torch.empty_like(q)
    dk = torch.zeros((b, hk, sk, d), dtype=ct)
    dv = torch.zeros((b, hk, sk, d_v), dtype=ct)
    keep_scale = 1.0 / (1.0 - dropout_p)
    rows_per_block = _rows_per_block(b, h, sk, 4)
    for b0, b1, spans in _batches(b, ranges):
        nb = b1 - b0
        qh, doh = _by_kv_head(q[b0:b1], hk), _by_kv_head(do[b0:b1], hk)
        kc = _by_kv_head(k[b0:b1], hk)[:, :, 0].to(ct)  # [nb, hk, sk, d]
        vc = _by_kv_head(v[b0:b1], hk)[:, :, 0].to(ct)
        kt, vt = kc.transpose(-1, -2), vc.transpose(-1, -2)
        delta, lse_b = delta_all[b0:b1], lse_all[b0:b1]
        dqh = _by_kv_head(dq[b0:b1], hk)
        dk_b, dv_b = dk[b0:b1], dv[b0:b1]
        for start, stop, k0, k1 in _blocks(sq, sk, rows_per_block, causal, window, shift, spans):
            rows = stop - start
            if k1 == k0:
                dqh[:, :, :, start:stop].zero_()
                continue
            causal_mask, keep = _block_mask(
                start, stop, k0, k1, sq, sk, causal, window, shift, dropout_p, seed, nb, h, hk, q.device, b0, spans
            )
            qb = (qh[:, :, :, start:stop].to(ct) * scale).reshape(nb, hk, g * rows, d)
            dob = doh[:, :, :, start:stop].to(ct).reshape(nb, hk, g * rows, d_v)
            m = lse_b[..., start:stop].reshape(nb, hk, g * rows, 1).to(ct)
            p = _scores(qb, kt[..., k0:k1], causal_mask, g).sub_(m.masked_fill(torch.isneginf(m), math.inf)).exp_()
            dp = torch.matmul(dob, vt[..., k0:k1])
            if keep is not None:
                pd = p.masked_fill(~keep, 0.0).mul_(keep_scale)
                dp = dp.masked_fill_(~keep, 0.0).mul_(keep_scale)
            else:
                pd = p
            dv_b[:, :, k0:k1] += torch.matmul(pd.transpose(-1, -2), dob)
            ds = dp.sub_(delta[..., start:stop].reshape(nb, hk, g * rows, 1)).mul_(p)
            dqh[:, :, :, start:stop] = torch.matmul(ds, kc[:, :, k0:k1]).mul_(scale).view(nb, hk, g, rows, d)
            dk_b[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), qb)  # qb holds scale * q
    dk = dk.permute(0, 2, 1, 3).to(k.dtype)
    dv = dv.permute(0, 2, 1, 3).to(v.dtype)
    dsinks = sinks_grad(do, out, lse, sinks) if sinks is not None else no_sinks_grad(q)
    return dq, dk.contiguous(), dv.contiguous(), dsinks
