"""Measured rows for the kernel calibration set: ``megakernels bench --peer-csv FILE --device cuda [--out DIR]``.

At every shape of a Liger-Kernel benchmark CSV (the rows of its ``liger`` provider: op, mode, x value and config),
this times the installed Liger-Kernel's kernels and ours on this machine's GPU and writes the timings as rows of the
same format (``DIR/measured.csv``: ``kernel_provider`` ``liger`` or ``megakernels``, this GPU's name, the Liger
version installed), so a lent GPU adds measured rows that ``--static --peer-csv`` can read back.

The peer runs through the static model's drivers (``static.drivers.DRIVERS``: the peer's autograd functions called as
its own benchmark script calls them) with a ``Timer`` in place of the recorder: the regions a driver records are
the regions timed. Ours runs the same region with our ops: the norms and the SwiGLU MLP through ``ops``, the
cross-entropy as the mean of ``ops.cross_entropy``, RoPE through ``ops.fused_rope`` on the same storage (``[1, seq,
heads, d]``, which the peer reads through its ``[1, heads, seq, d]`` view; our kernel computes cos/sin itself, the
peer reads them); GeGLU has no op of ours. Times are medians over ``repeats`` runs after
``warmup`` (CUDA events around each region; on the CPU, for the tests, the host clock).
"""

from __future__ import annotations

import contextlib
import csv
import json
import statistics
import time

from costmodel.peers import drivers, table

OURS = "megakernels"
# Liger-Kernel's CSV columns, in its order (``static.table.FIELDS`` are those the model reads)
COLUMNS = (
    "kernel_name",
    "kernel_provider",
    "kernel_operation_mode",
    "metric_name",
    "metric_unit",
    "x_name",
    "x_label",
    "x_value",
    "y_value_50",
    "y_value_20",
    "y_value_80",
    "extra_benchmark_config_str",
    "gpu_name",
    "timestamp",
    "liger_version",
)


class Timer:
    """The drivers' recorder interface (``recording``, ``call``, ``ret``, ``device``), timing what a recorder would
    record: ``elapsed_s`` is the time spent inside ``recording(True)`` regions."""

    def __init__(self, device: str):
        self.device = device
        self.elapsed_s = 0.0

    @contextlib.contextmanager
    def recording(self, on: bool = True):
        if not on:
            yield
            return
        import torch

        if self.device == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            stop.record()
            stop.synchronize()
            self.elapsed_s += start.elapsed_time(stop) / 1e3
        else:
            t0 = time.perf_counter()
            yield
            self.elapsed_s += time.perf_counter() - t0

    def call(self, backward: bool = False) -> None:
        pass

    def ret(self) -> None:
        pass


# ---- ours, at the peer's regions ----------------------------------------------------------------------------------


def _timed_pass(rec: Timer, mode: str, forward, inputs: list):
    """``forward()`` timed for ``forward``/``full``, its backward (a random upstream gradient, made outside the
    timed region) timed for ``backward``/``full``."""
    import torch

    for t in inputs:
        t.grad = None
    with rec.recording(mode in ("forward", "full")):
        out = forward()
    if mode == "forward":
        return
    outs = out if isinstance(out, tuple) else (out,)
    with rec.recording(False):
        grads = [torch.randn_like(o) for o in outs]
    with rec.recording(True):
        torch.autograd.backward(outs, grads)


def _our_norm(kind: str):
    def drive(rec, mode, x, cfg):
        import torch

        from megakernels import ops

        m, n, dt = int(cfg["M"]), int(x), drivers._dtype(cfg)
        X = torch.randn(m, n, device=rec.device, dtype=dt, requires_grad=True)
        W = torch.randn(n, device=rec.device, dtype=dt, requires_grad=True)
        eps = float(cfg.get("eps", 1e-6))
        if kind == "rms_norm":
            _timed_pass(rec, mode, lambda: ops.rms_norm(X, W, eps), [X, W])
        else:
            B = torch.randn(n, device=rec.device, dtype=dt, requires_grad=True)
            _timed_pass(rec, mode, lambda: ops.layer_norm(X, W, B, eps), [X, W, B])

    return drive


def _our_cross_entropy(rec, mode, x, cfg):
    import torch

    from megakernels import ops

    rows, v = int(cfg["B"]) * int(cfg["T"]), int(x)
    X = torch.randn(rows, v, device=rec.device, dtype=drivers._dtype(cfg), requires_grad=True)
    t = torch.randint(v, (rows,), device=rec.device)
    _timed_pass(rec, mode, lambda: ops.cross_entropy(X, t).mean(), [X])


def _our_rope(rec, mode, x, cfg):
    import torch

    from megakernels import ops

    hq, hk, dt = int(cfg["num_q_heads"]), int(cfg["num_kv_heads"]), drivers._dtype(cfg)
    seq = int(cfg.get("seq_len", x))
    d = int(cfg.get("hidden_size", x)) // hq
    q = torch.randn(1, seq, hq, d, device=rec.device, dtype=dt, requires_grad=True)  # the peer's storage, read
    k = torch.randn(1, seq, hk, d, device=rec.device, dtype=dt, requires_grad=True)  # through its [1, h, s, d] view
    _timed_pass(rec, mode, lambda: ops.fused_rope(q, k, seq_dim=1), [q, k])


def _our_swiglu_mlp(rec, mode, x, cfg):
    """The peer's SwiGLU-MLP region with ours: gate and up as one GEMM against their concatenated weights (as our
    modules hold them), the fused SwiGLU, the down projection."""
    import torch
    import torch.nn.functional as F

    from megakernels import ops

    b = int(cfg.get("B", cfg.get("bsz", 1)))
    rows, h, f, dt = b * int(x), int(cfg["hidden_size"]), int(cfg["intermediate_size"]), drivers._dtype(cfg)
    X = torch.randn(rows, h, device=rec.device, dtype=dt, requires_grad=True)
    Wgu = torch.randn(2 * f, h, device=rec.device, dtype=dt, requires_grad=True)
    Wd = torch.randn(h, f, device=rec.device, dtype=dt, requires_grad=True)
    _timed_pass(rec, mode, lambda: F.linear(ops.swiglu(F.linear(X, Wgu)), Wd), [X, Wgu, Wd])


# GeGLU has no op of ours (bias-GeLU is not gated): its rows time the peer only.
OUR_DRIVERS = {
    "rms_norm": _our_norm("rms_norm"),
    "layer_norm": _our_norm("layer_norm"),
    "cross_entropy": _our_cross_entropy,
    "rope": _our_rope,
    "swiglu": _our_swiglu_mlp,
}


# ---- the command --------------------------------------------------------------------------------------------------


def shapes(rows: list[dict]) -> list[dict]:
    """The distinct (op, mode, x value, config) of the peer's rows, in the CSV's order."""
    seen, out = set(), []
    for r in table.select(rows, providers=("liger",)):
        key = (r["kernel_name"], r["kernel_operation_mode"], r["x_value"], r["extra_benchmark_config_str"])
        if key not in seen and r["kernel_operation_mode"] in ("forward", "backward", "full"):
            seen.add(key)
            out.append(r)
    return out


def time_driver(drive, device: str, mode: str, x, cfg: dict, repeats: int, warmup: int) -> list[float]:
    """Seconds of ``drive``'s timed regions, ``repeats`` times after ``warmup`` untimed runs."""
    out = []
    for i in range(warmup + repeats):
        rec = Timer(device)
        drive(rec, mode, x, cfg)
        if i >= warmup:
            out.append(rec.elapsed_s)
    return out


def _row(r: dict, provider: str, seconds: list[float], gpu: str, version: str, stamp: str) -> dict:
    ms = [s * 1e3 for s in seconds]
    return {
        **{k: r.get(k, "") for k in COLUMNS},
        "kernel_provider": provider,
        "metric_name": "speed",
        "metric_unit": "ms",
        "y_value_50": table.percentile(ms, 0.5),
        "y_value_20": table.percentile(ms, 0.2),
        "y_value_80": table.percentile(ms, 0.8),
        "gpu_name": gpu,
        "timestamp": stamp,
        "liger_version": version,
    }


def _liger_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:  # noqa: BLE001 - not installed
        return None


def measure(csv_path: str, device: str = "cuda", repeats: int = 20, warmup: int = 3, log=print) -> dict:
    """Ours and the installed peer's timings at every shape of ``csv_path``: ``{"rows": [...], "notes": [...]}``,
    rows in the CSV's own format."""
    import torch

    rows = shapes(table.read_csv(csv_path))
    gpu = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    version, notes, out = _liger_version(), [], []
    if version is None:
        notes.append("liger-kernel is not installed: only our kernels are timed")
    elif device != "cuda":
        notes.append("Liger-Kernel's kernels need CUDA: only our kernels are timed")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    for r in rows:
        x = float(r["x_value"])
        x = int(x) if x.is_integer() else x
        cfg = json.loads(r["extra_benchmark_config_str"] or "{}")
        mode, name = r["kernel_operation_mode"], r["kernel_name"]
        timed = {}
        if name in OUR_DRIVERS:
            timed[OURS] = time_driver(OUR_DRIVERS[name], device, mode, x, cfg, repeats, warmup)
        if version is not None and device == "cuda" and name in drivers.DRIVERS:
            try:
                timed["liger"] = time_driver(drivers.DRIVERS[name], device, mode, x, cfg, repeats, warmup)
            except Exception as e:  # noqa: BLE001 - a peer version the drivers do not fit is a note
                notes.append(f"liger {name} {mode} x={x}: {type(e).__name__}: {str(e)[:200]}")
        for provider, seconds in timed.items():
            out.append(_row(r, provider, seconds, gpu, version or "", stamp))
        if log and timed:
            text = "  ".join(f"{p} {1e3 * statistics.median(s):.4f} ms" for p, s in timed.items())
            log(f"  {name:<14}{mode:<9}{x:>8}  {text}")
    return {"rows": out, "notes": notes, "gpu": gpu, "liger_version": version}


def write_csv(path: str, rows: list[dict]) -> None:
    """``rows`` in the Liger CSV format (its header, in its column order)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(COLUMNS), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
