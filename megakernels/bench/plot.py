"""One PNG per op: speed (GB/s or TFLOP/s) against size, one line per implementation, the measured ceiling as a
dashed line. Rows of one op that differ in dtype, pass or variant (head dim, causal) go to separate panels of the
same figure, so every line compares implementations on identical work. Uses matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

from megakernels.bench.common import OURS


def _panels(rows: list[dict]) -> dict[str, list[dict]]:
    panels: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        label = " ".join(x for x in (r["dtype"], r["pass"], r.get("variant", "")) if x)
        panels[label].append(r)
    return panels


def plot_op(rows: list[dict], path: str) -> str:
    """Write the figure of one op's ``rows`` (result rows of ``common.result_row``) to ``path``; returns it.

    Raises:
        ValueError: ``rows`` empty or of more than one op.
    """
    ops = {r["op"] for r in rows}
    if len(ops) != 1:
        raise ValueError(f"plot_op: rows must hold exactly one op, got {sorted(ops) or 'none'}")
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    panels = _panels(rows)
    cols = 2 if len(panels) <= 4 else 4
    cols = min(cols, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), squeeze=False)
    unit = rows[0]["unit"]
    for ax, (label, prs) in zip(axes.flat, panels.items()):
        prs = sorted(prs, key=lambda r: r["size"])
        impls = list(dict.fromkeys(k for r in prs for k in r["rates"]))
        for impl in impls:
            pts = [(r["size"], r["rates"][impl]) for r in prs if impl in r["rates"]]
            style = dict(linewidth=2.2, marker="o") if impl == OURS else dict(linewidth=1.2, marker=".")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=impl, **style)
        ceilings = {r["ceiling"] for r in prs if r.get("ceiling")}
        for c in sorted(ceilings):
            ax.axhline(c, linestyle="--", color="gray", linewidth=1)
        if ceilings:
            ax.plot([], [], linestyle="--", color="gray", label=prs[0]["ceiling_name"] or "ceiling")
        sizes = {r["size"] for r in prs}
        if len(sizes) > 1 and max(sizes) / min(sizes) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel(prs[0]["size_label"])
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(f"{rows[0]['op']}: {unit} vs size (dashed: measured ceiling)", fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def available() -> bool:
    """Whether matplotlib (the ``bench`` extra) is installed."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_plots(rows: list[dict], out_dir: str) -> list[str]:
    """``out_dir/<op>.png`` for every op in ``rows``; returns the paths written."""
    by_op: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_op[r["op"]].append(r)
    return [plot_op(op_rows, os.path.join(out_dir, f"{op}.png")) for op, op_rows in by_op.items()]
