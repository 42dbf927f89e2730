"""The MoE router's kernels (megakernels/ops/moe_router.py has the math): the forward, one program per block of
``ROWS`` token rows (each row's experts, weights and lse; the block's assignment counts and aux-score sums kept in
registers and written once, so the sums over rows need no atomics and repeat bit for bit), and the backward, one
program per row.

A row of ``E`` logits is one ``BLOCK_E`` vector (the next power of two; E up to 4096 keeps it in registers). The
top-k choice is ``k`` passes of ``argmax`` with ties to the lower index, the chosen expert masked out after each;
group-limited routing scores each of the ``N_GROUP`` groups by a max and a second max over its columns, then picks
``TOPK_GROUP`` groups the same way. The k chosen values live in a ``K_BLOCK`` vector, so the weights are normalised
without a round trip through memory. Every exponential is one ``exp2``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakernels.triton.launch import Launch

LOG2E = 1.4426950408889634


@triton.jit
def _row(X, row, E, cols, valid, SIGMOID: tl.constexpr):
    """(x, p, lse, s, S): the row's logits, softmax, log-sum-exp and (with SIGMOID) sigmoid and its sum."""
    x = tl.load(X + row * E + cols, mask=valid, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    e = tl.where(valid, tl.math.exp2((x - m) * 1.4426950408889634), 0.0)
    total = tl.sum(e, 0)
    p = e / total
    lse = m + tl.log(total)
    if SIGMOID:
        s = tl.where(valid, 1.0 / (1.0 + tl.math.exp2(-x * 1.4426950408889634)), 0.0)
    else:
        s = p
    return x, p, lse, s, tl.sum(s, 0)


@triton.jit
def _route_kernel(
    X,
    BIAS,
    WEIGHTS,
    EXPERTS,
    LSE,
    COUNTS,
    AUX,
    T,
    E,
    scale,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    N_GROUP: tl.constexpr,
    G_BLOCK: tl.constexpr,
    GSIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    SIGMOID: tl.constexpr,
    NORMALIZE: tl.constexpr,
    TOPK_SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    kr = tl.arange(0, K_BLOCK)
    counts = tl.zeros([BLOCK_E], tl.float32)
    aux = tl.zeros([BLOCK_E], tl.float32)
    if HAS_BIAS:
        bias = tl.load(BIAS + cols, mask=valid, other=0.0)
    for r in range(0, ROWS):
        row = pid.to(tl.int64) * ROWS + r
        if row < T:
            x, p, lse, s, s_sum = _row(X, row, E, cols, valid, SIGMOID)
            tl.store(LSE + row, lse)
            if TOPK_SOFTMAX:
                key = x
            else:
                key = s
            if HAS_BIAS:
                key = key + bias
            key = tl.where(valid, key, float("-inf"))
            if N_GROUP > 1:
                gid = cols // GSIZE
                gr = tl.arange(0, G_BLOCK)
                gscore = tl.full([G_BLOCK], float("-inf"), tl.float32)
                for g in tl.static_range(N_GROUP):
                    kg = tl.where(gid == g, key, float("-inf"))
                    best = tl.max(kg, 0)
                    if GSIZE > 1:
                        first = tl.argmax(kg, 0, tie_break_left=True)
                        best += tl.max(tl.where(cols == first, float("-inf"), kg), 0)
                    gscore = tl.where(gr == g, best, gscore)
                open_groups = gr < N_GROUP
                eligible = cols < 0
                for _ in tl.static_range(TOPK_GROUP):
                    gi = tl.argmax(tl.where(open_groups, gscore, float("-inf")), 0, tie_break_left=True)
                    open_groups = open_groups & (gr != gi)
                    eligible = eligible | (gid == gi)
                key = tl.where(eligible & valid, key, float("-inf"))
            chosen_e = tl.zeros([K_BLOCK], tl.int64)
            chosen_v = tl.zeros([K_BLOCK], tl.float32)
            for j in tl.static_range(K):
                i = tl.argmax(key, 0, tie_break_left=True)
                sel = cols == i
                counts += tl.where(sel, 1.0, 0.0)
                if TOPK_SOFTMAX:
                    v = tl.sum(tl.where(sel, x, 0.0), 0)
                else:
                    v = tl.sum(tl.where(sel, s, 0.0), 0)
                chosen_e = tl.where(kr == j, i.to(tl.int64), chosen_e)
                chosen_v = tl.where(kr == j, v, chosen_v)
                key = tl.where(sel, float("-inf"), key)
            kmask = kr < K
            if TOPK_SOFTMAX:
                z = tl.where(kmask, chosen_v, float("-inf"))
                ez = tl.where(kmask, tl.math.exp2((z - tl.max(z, 0)) * 1.4426950408889634), 0.0)
                w = scale * (ez / tl.sum(ez, 0))
            elif NORMALIZE:
                norm = tl.sum(tl.where(kmask, chosen_v, 0.0), 0)
                if SIGMOID:
                    norm += 1e-20
                w = scale * (chosen_v / norm)
            else:
                w = scale * chosen_v
            tl.store(WEIGHTS + row * K + kr, w, mask=kmask)
            tl.store(EXPERTS + row * K + kr, chosen_e, mask=kmask)
            if SIGMOID:
                aux += s / s_sum
            else:
                aux += p
    tl.store(COUNTS + pid.to(tl.int64) * E + cols, counts, mask=valid)
    tl.store(AUX + pid.to(tl.int64) * E + cols, aux, mask=valid)


@triton.jit
def _route_bwd_kernel(
    X,
    LSE,
    EXPERTS,
    WEIGHTS,
    DWEIGHTS,
    DAUX,
    DLSE,
    DX,
    E,
    scale,
    BLOCK_E: tl.constexpr,
    K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    SIGMOID: tl.constexpr,
    NORMALIZE: tl.constexpr,
    TOPK_SOFTMAX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    kr = tl.arange(0, K_BLOCK)
    kmask = kr < K
    x = tl.load(X + row * E + cols, mask=valid, other=0.0).to(tl.float32)
    lse = tl.load(LSE + row)
    p = tl.where(valid, tl.math.exp2((x - lse) * 1.4426950408889634), 0.0)
    if SIGMOID:
        s = tl.where(valid, 1.0 / (1.0 + tl.math.exp2(-x * 1.4426950408889634)), 0.0)
    else:
        s = p
    ex = tl.load(EXPERTS + row * K + kr, mask=kmask, other=0)
    w = tl.load(WEIGHTS + row * K + kr, mask=kmask, other=0.0)
    dw = tl.load(DWEIGHTS + row * K + kr, mask=kmask, other=0.0)
    daux = tl.load(DAUX + cols, mask=valid, other=0.0)
    if SIGMOID:
        s_sum = tl.sum(s, 0)
        g = (daux - tl.sum(daux * s, 0) / s_sum) / s_sum
    else:
        g = daux
    dl = tl.zeros([BLOCK_E], tl.float32)
    if TOPK_SOFTMAX:
        c = w * (dw - tl.sum(w / scale * dw, 0))
        for j in tl.static_range(K):
            e_j = tl.sum(tl.where(kr == j, ex, 0), 0)
            dl += tl.where(cols == e_j, tl.sum(tl.where(kr == j, c, 0.0), 0), 0.0)
    else:
        v = tl.zeros([K_BLOCK], tl.float32)
        for j in tl.static_range(K):
            e_j = tl.sum(tl.where(kr == j, ex, 0), 0)
            v = tl.where(kr == j, tl.sum(tl.where(cols == e_j, s, 0.0), 0), v)
        if NORMALIZE:
            norm = tl.sum(v, 0)
            if SIGMOID:
                norm += 1e-20
            c = scale * (dw / norm - tl.sum(dw * v, 0) / (norm * norm))
        else:
            c = scale * dw
        for j in tl.static_range(K):
            e_j = tl.sum(tl.where(kr == j, ex, 0), 0)
            g += tl.where(cols == e_j, tl.sum(tl.where(kr == j, c, 0.0), 0), 0.0)
    if SIGMOID:
        dl += g * s * (1.0 - s)
    else:
        dl += p * (g - tl.sum(g * p, 0))
    dl += tl.load(DLSE + row) * p
    tl.store(DX + row * E + cols, dl.to(DX.dtype.element_ty), mask=valid)


ROWS = 16  # rows a forward program: the partial sums' block


def _sizes(e: int, k: int, n_group: int) -> dict:
    return dict(
        BLOCK_E=triton.next_power_of_2(e),
        K=k,
        K_BLOCK=triton.next_power_of_2(k),
        N_GROUP=n_group,
        G_BLOCK=triton.next_power_of_2(n_group),
        GSIZE=e // n_group,
    )


def _warps(e: int) -> int:
    return 4 if e <= 1024 else 8


def route_launch(
    logits, bias, weights, experts, lse, counts, aux, k, score, normalize, topk_softmax, scale, n_group, topk_group
) -> Launch:
    t, e = logits.shape
    return Launch(
        _route_kernel,
        (triton.cdiv(t, ROWS),),
        (logits, bias if bias is not None else lse, weights, experts, lse, counts, aux, t, e, float(scale)),
        dict(
            ROWS=ROWS,
            **_sizes(e, k, n_group),
            TOPK_GROUP=topk_group,
            SIGMOID=score == 1,
            NORMALIZE=bool(normalize),
            TOPK_SOFTMAX=bool(topk_softmax),
            HAS_BIAS=bias is not None,
            num_warps=_warps(e),
        ),
    )


def route(logits, bias, k, score, normalize, topk_softmax, scale, n_group, topk_group):
    """(weights [T, k], experts [T, k], lse [T], tokens_per_expert [E], aux_sum [E]), as the CPU kernel's."""
    t, e = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    blocks = triton.cdiv(t, ROWS)
    weights, experts = torch.empty(t, k, **f32), torch.empty(t, k, dtype=torch.int64, device=logits.device)
    lse, counts, aux = (
        torch.empty(t, **f32),
        torch.zeros(max(1, blocks), e, **f32),
        torch.zeros(max(1, blocks), e, **f32),
    )
    if t:
        route_launch(
            logits, bias, weights, experts, lse, counts, aux, k, score, normalize, topk_softmax, scale, n_group,
            topk_group,
        )()  # fmt: skip
    return weights, experts, lse, counts.sum(0), aux.sum(0)


def route_backward_launch(
    logits, lse, experts, weights, dweights, daux, dlse, dx, score, normalize, topk_softmax, scale
) -> Launch:
    t, e = logits.shape
    k = experts.shape[1]
    sizes = _sizes(e, k, 1)
    return Launch(
        _route_bwd_kernel,
        (t,),
        (logits, lse, experts, weights, dweights, daux, dlse, dx, e, float(scale)),
        dict(
            BLOCK_E=sizes["BLOCK_E"],
            K=k,
            K_BLOCK=sizes["K_BLOCK"],
            SIGMOID=score == 1,
            NORMALIZE=bool(normalize),
            TOPK_SOFTMAX=bool(topk_softmax),
            num_warps=_warps(e),
        ),
    )


def route_backward(logits, lse, experts, weights, dweights, daux, dlse, score, normalize, topk_softmax, scale):
    """dlogits [T, E] in the logits' dtype."""
    dx = torch.empty_like(logits)
    if logits.shape[0]:
        route_backward_launch(
            logits, lse, experts.contiguous(), weights.contiguous(), dweights, daux, dlse, dx, score, normalize,
            topk_softmax, scale,
        )()  # fmt: skip
    return dx
