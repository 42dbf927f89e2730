"""The grouped GEMM (MoE experts) in the static report: the forward (x_e @ W_eᵀ), dx (dy_e @ W_e) and dW
(dy_eᵀ @ x_e) launches of every sm_90 16-bit candidate config at a Mixtral-like expert shape — 4096 tokens routed
top-2 over 8 experts (T = 8192 rows, 1024 per expert), hidden 4096, expert FFN 14336, bf16 — built by the launchers
of megakernels/triton/grouped_gemm.py on meta tensors, so the kernel compiled is the one that runs.

Schedules (``grouped_gemm.rows_schedule`` / ``wgrad_schedule``, beside the launchers, for balanced groups: held
to the kernels' own loop bounds by tests/triton/test_schedules.py): the row kernel's grid is (row tiles + E, column
tiles); the first T / BLOCK_M programs of axis 0 each run K / BLOCK_K iterations and the E spare ones exit at once.
The dW kernel runs one CTA per (N, K) tile per expert, T_e / BLOCK_T iterations each.
"""

from __future__ import annotations

import torch

from costmodel import tiles
from costmodel.registry import Entry, register

T, E, HIDDEN, FFN = 8192, 8, 4096, 14336
DTYPE = torch.bfloat16


def _rows_bytes(launch) -> dict:
    """Each k step loads an A tile and a B tile."""
    return {"k": (launch.kwargs["BLOCK_M"] + launch.kwargs["BLOCK_N"]) * launch.kwargs["BLOCK_K"] * DTYPE.itemsize}


def _wgrad_bytes(launch) -> dict:
    """Each row step loads a dout tile and an x tile."""
    return {"t": (launch.kwargs["BLOCK_N"] + launch.kwargs["BLOCK_K"]) * launch.kwargs["BLOCK_T"] * DTYPE.itemsize}


def _meta(*shape, dtype=DTYPE):
    return torch.empty(shape, dtype=dtype, device="meta")


def launches(pass_: str, cfg: tuple, dtype: torch.dtype = DTYPE):
    """The launch of ``pass_`` (fwd, dx, dw) at the module's shape in ``dtype`` with config ``cfg``."""
    from megakernels.triton import grouped_gemm as gg

    x, w, y = _meta(T, HIDDEN, dtype=dtype), _meta(E, FFN, HIDDEN, dtype=dtype), _meta(T, FFN, dtype=dtype)
    sizes = _meta(E, dtype=torch.int64)
    if pass_ == "fwd":
        return gg.rows_launch(x, w, sizes, y, True, cfg)
    if pass_ == "dx":
        return gg.rows_launch(y, w, sizes, x, False, cfg)
    return gg.wgrad_launch(y, x, sizes, w, cfg)


def _entry(pass_: str, cfg: tuple) -> dict:
    from megakernels.triton import grouped_gemm as gg

    launch = launches(pass_, cfg)
    sizes = [T // E] * E  # balanced groups
    if pass_ == "dw":
        sched, l2 = gg.wgrad_schedule(launch, sizes), _wgrad_bytes(launch)
    else:
        sched, l2 = gg.rows_schedule(launch, sizes), _rows_bytes(launch)
    c, pred = tiles.kernel_prediction(launch, list(sched.loops), sched.iterations(), l2)
    return tiles.pass_row([(launch.name, c, pred)], 2.0 * T * HIDDEN * FFN)


@register
def grouped_gemm_entries() -> list[Entry]:
    from megakernels.triton import grouped_gemm as gg

    out = []
    shape = f"T{T} E{E} {HIDDEN}x{FFN}"
    for pass_, table in (("fwd", gg.ROWS_CONFIGS), ("dx", gg.ROWS_CONFIGS), ("dw", gg.WGRAD_CONFIGS)):
        bench = {"op": "grouped_gemm", "pass": pass_, "shape": shape, "dtype": "bfloat16", "variant": "balanced"}
        for i, cfg in enumerate(gg.candidates(table, 90, DTYPE, None)):
            out.append(
                Entry(
                    f"grouped_gemm.{pass_}",
                    "x".join(map(str, cfg[:3])) + f" w{cfg[3]} s{cfg[4]}",
                    shape,
                    "bf16",
                    (lambda p=pass_, c=cfg: _entry(p, c)),
                    family="moe",
                    needs_wgmma=True,
                    key=i == 0,
                    bench=bench,
                )
            )
    return out
