"""Muon's Newton-Schulz kernels (megakernels/triton/muon.py) in the static report: the three launches of one bf16
iteration — ``A = X Xᵀ`` and ``B = c A A + b A`` by the symmetric-product kernel (lower-triangle tiles), ``X = B X
+ a X`` by the GEMM — at Llama-3-8B's matrices: a 4096 x 4096 attention projection and the 4096 x 14336 MLP up
projection (X ``[4096, 14336]``, so ``X Xᵀ`` runs over K 14336), batch 1, built by the launchers on meta tensors so
the kernel compiled is the one that runs.

Schedules: every program runs the same K loop (``K / BLOCK_K`` iterations, each loading two ``BLOCK x BLOCK_K``
tiles, or a ``BLOCK_M x BLOCK_K`` and a ``BLOCK_K x BLOCK_N`` one); the symmetric kernel has ``T (T + 1) / 2``
programs for T tiles a side. Predicted against the dense bf16 MMA peak for the FLOPs the tiles execute.
"""

from __future__ import annotations

import torch

from costmodel import tiles
from costmodel.registry import Entry, register

DTYPE = torch.bfloat16
SHAPES = {"attention 4096x4096": (4096, 4096), "mlp 4096x14336": (4096, 14336)}
PASSES = ("gram", "poly", "update")


def _meta(*shape):
    return torch.empty(shape, dtype=DTYPE, device="meta")


def launch(pass_: str, m: int, n: int):
    """The launch of ``pass_`` (gram, poly, update) of one iteration on X ``[1, m, n]``."""
    from megakernels.triton import muon

    x, x_next, gram, poly = _meta(1, m, n), _meta(1, m, n), _meta(1, m, m), _meta(1, m, m)
    return muon.iteration_launches(x, x_next, gram, poly, (3.4445, -4.7750, 2.0315), 90)[PASSES.index(pass_)]


def _entry(pass_: str, m: int, n: int) -> dict:
    lc = launch(pass_, m, n)
    kw = lc.kwargs
    if pass_ == "update":
        k, bytes_ = m, (kw["BLOCK_M"] + kw["BLOCK_N"]) * kw["BLOCK_K"] * DTYPE.itemsize
        flops = lc.grid[0] * lc.grid[1] * 2.0 * kw["BLOCK_M"] * kw["BLOCK_N"] * m
        block_k = kw["BLOCK_K"]
    else:
        k = n if pass_ == "gram" else m
        bytes_ = 2 * kw["BLOCK"] * kw["BLOCK_K"] * DTYPE.itemsize
        flops = lc.grid[0] * 2.0 * kw["BLOCK"] ** 2 * k
        block_k = kw["BLOCK_K"]
    iterations = -(-k // block_k)
    c, pred = tiles.kernel_prediction(lc, ["k"], [{"k": iterations}] * lc.num_ctas, {"k": bytes_})
    return tiles.pass_row([(lc.name, c, pred)], flops)


@register
def muon_entries() -> list[Entry]:
    out = []
    for shape, (m, n) in SHAPES.items():
        for pass_ in PASSES:
            lc = launch(pass_, m, n)
            kw = lc.kwargs
            tile = f"{kw['BLOCK']}x{kw['BLOCK']}" if "BLOCK" in kw else f"{kw['BLOCK_M']}x{kw['BLOCK_N']}"
            out.append(
                Entry(
                    f"muon.{pass_}",
                    f"{tile}x{kw['BLOCK_K']} w{lc.num_warps} s{kw['STAGES']}",
                    shape,
                    "bf16",
                    (lambda p=pass_, m=m, n=n: _entry(p, m, n)),
                    family="muon",
                    needs_wgmma=True,
                    bench={"op": "muon", "pass": pass_, "shape": shape, "dtype": "bfloat16", "variant": "sm_90"},
                )
            )
    return out
