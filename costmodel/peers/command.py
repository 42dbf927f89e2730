"""``megakernels bench --static --peer-csv FILE``: every row of a peer CSV modelled (``predict_row``), the
payload, and the side-by-side tables."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics

from costmodel import model
from costmodel.peers.drivers import DRIVERS, FIRST_RELEASE, MODULES, NOT_DRIVEN, SOURCE_RELEASE, peer_provider
from costmodel.peers.install import imported, install_hint, peer_dir
from costmodel.peers.pricing import HOST, Host, inside, op_time, price, price_ours
from costmodel.peers.recorder import Recorder
from costmodel.peers.table import read_csv, select, summarise

# ---- the command -----------------------------------------------------------------------------------------------


def _key(r: dict) -> tuple:
    return (
        r["kernel_name"],
        r["kernel_operation_mode"],
        r["gpu_name"],
        r["x_value"],
        r["extra_benchmark_config_str"],
        r["liger_version"],
    )


def predict_row(r: dict, peer_path: str | None, cache: dict, machines: dict | None = None, host: Host = HOST) -> dict:
    """One CSV row through the model: ``predicted_ms`` and ``rel_error``, or ``reason`` it cannot be modelled."""
    out = {
        k: r.get(k)
        for k in (
            "kernel_name",
            "kernel_provider",
            "kernel_operation_mode",
            "gpu_name",
            "x_value",
            "extra_benchmark_config_str",
            "liger_version",
        )
    }
    try:
        out["published_ms"] = float(r["y_value_50"])
    except (TypeError, ValueError):
        return {**out, "published_ms": None, "predicted_ms": None, "rel_error": None, "reason": "no y_value_50"}
    none = {"predicted_ms": None, "rel_error": None}
    if r["kernel_provider"] != peer_provider(r):
        return {**out, **none, "reason": f"provider {r['kernel_provider']!r}: only the peer's kernels are modelled"}
    if r["kernel_name"] in NOT_DRIVEN:
        return {**out, **none, "reason": f"{r['kernel_name']}: {NOT_DRIVEN[r['kernel_name']]}"}
    if r["kernel_name"] not in DRIVERS:
        return {**out, **none, "reason": f"no driver for kernel {r['kernel_name']!r} (drivers: {', '.join(DRIVERS)})"}
    used = resolve_version(r["kernel_name"], r["liger_version"] or "")
    if used != r["liger_version"]:
        out["liger_version_used"] = used
    m = model.machine_for(r["gpu_name"])
    if m is not None and machines:
        m = machines.get(m.name, m)
    if m is None:
        return {**out, **none, "reason": f"GPU {r['gpu_name']!r} is not in model.MACHINES"}
    if r["kernel_operation_mode"] not in ("forward", "backward", "full"):
        return {**out, **none, "reason": f"mode {r['kernel_operation_mode']!r}"}
    key = _key(r)
    if key not in cache:
        cache[key] = record(r, m, peer_path)
    rec = cache[key]
    if isinstance(rec, str):
        return {**out, **none, "reason": rec}
    try:
        res = price(rec, m, host)
    except Exception as e:  # noqa: BLE001 - a kernel the model cannot read is a reason, not a crash
        return {**out, **none, "reason": f"{type(e).__name__}: {str(e)[:300]}"}
    pred_ms = res["time_s"] * 1e3
    mine = price_ours(r, rec, m, host)
    if mine["ours_predicted_ms"] is not None:
        mine["ours_over_peer"] = mine["ours_predicted_ms"] / pred_ms
        if mine["ours_over_peer"] <= 1:
            mine.pop("ours_bound")  # the binding resource is reported where we are behind
        mine["peer_kernels_ms"] = sum(op_time(op, m) for op in inside(rec)) * 1e3
    return {
        **out,
        **mine,
        "predicted_ms": pred_ms,
        "rel_error": (pred_ms - out["published_ms"]) / out["published_ms"],
        "bound": res["bound"],
        "gpu_ms": res["gpu_s"] * 1e3,
        "host_exposed_ms": res["host_exposed_s"] * 1e3,
        "launches": [
            {k: v for k, v in q.items() if k != "times_s"} | {"time_us": q["time_s"] * 1e6} for q in res["launches"]
        ],
    }


def _version_key(v: str) -> tuple:
    return tuple(int(p) for p in re.findall(r"\d+", v))


def resolve_version(kernel: str, version: str) -> str:
    """The liger-kernel release that row of ``kernel`` naming ``version`` is modelled with: ``version`` itself, or,
    when that release predates the kernel's module (``FIRST_RELEASE``) or the source the row ran
    (``SOURCE_RELEASE``), the first release that has it (the row then measured the source between the two releases:
    the label is the benchmark machine's installed package)."""
    for first in (FIRST_RELEASE.get(MODULES.get(kernel, "")), SOURCE_RELEASE.get(kernel)):
        if first is not None and _version_key(first) > _version_key(version):
            version = first
    return version


def record(r: dict, m: model.Machine, peer_path: str | None) -> list | str:
    """The ops the row's timed region runs (``Op`` list), or why they cannot be recorded."""
    version = resolve_version(r["kernel_name"], r["liger_version"])
    path = peer_dir(version, peer_path)
    if path is None:
        return install_hint(version, peer_path)
    module = MODULES.get(r["kernel_name"])
    if module and not os.path.exists(os.path.join(path, "liger_kernel", module)):
        return f"liger-kernel {version} has no liger_kernel/{module}"
    try:
        cfg = json.loads(r["extra_benchmark_config_str"] or "{}")
        x = float(r["x_value"])
        x = int(x) if x.is_integer() else x
    except ValueError as e:
        return f"unreadable shape: {e}"
    rec = Recorder(m)
    try:
        with imported(path), rec.patched():
            DRIVERS[r["kernel_name"]](rec, r["kernel_operation_mode"], x, cfg)
        return rec.ops
    except Exception as e:  # noqa: BLE001 - a peer version the drivers do not fit is a reason, not a crash
        return f"{type(e).__name__}: {str(e)[:300]}"


def run(csv_path: str, peer_path: str | None = None, log=print) -> dict:
    """Every row of ``csv_path`` through the model; the ``calibration.json`` payload."""
    rows = select(read_csv(csv_path))
    cache: dict = {}
    out = []
    for r in rows:
        p = predict_row(r, peer_path, cache)
        out.append(p)
        if log and p.get("rel_error") is not None:
            log(
                f"  {p['kernel_name']:<14}{p['kernel_operation_mode']:<9}{p['gpu_name'][7:]:<20}{p['x_value']:>8}"
                f"  published {p['published_ms']:9.4f} ms  predicted {p['predicted_ms']:9.4f} ms"
                f"  {100 * p['rel_error']:+6.0f}%  {p['bound']}"
            )
    side = side_by_side(out)
    if log:
        for line in side_by_side_table(side):
            log(line)
    modelled = [p for p in out if p.get("rel_error") is not None]
    skipped = [p for p in out if p.get("rel_error") is None and p["kernel_provider"] == peer_provider(p)]
    summary = summarise(modelled)
    summary["not_modelled"] = {
        "rows": len(out) - len(modelled),
        "peer_rows": len(skipped),
        "reasons": sorted({p["reason"] for p in skipped}),
    }
    from megakernels.bench.common import git_commit

    gpus = sorted({p["gpu_name"] for p in modelled})
    return {
        "machine": {"name": "published Liger-Kernel timings on " + ", ".join(gpus)},
        "commit": git_commit(),
        "date": __import__("time").strftime("%Y-%m-%d"),
        "csv": os.path.relpath(csv_path),
        "machines": {k: dataclasses.asdict(v) for k, v in model.MACHINES.items()},
        "host": dataclasses.asdict(HOST),
        "rows": out,
        "summary": summary,
        "side_by_side": side,
    }


def _shape_key(p: dict) -> tuple:
    return (p["kernel_name"], p["kernel_operation_mode"], p["gpu_name"], p["x_value"], p["extra_benchmark_config_str"])


def side_by_side(rows: list[dict]) -> dict:
    """Per op, mode and shape of the peer's rows: our predicted time over the peer's (``ours_over_peer``) and over
    the published HuggingFace-eager and torch.compile rows of the same shape (``ours_over_hf``,
    ``ours_over_compile``); where we are behind, what binds ours; and a summary (shapes ahead, behind, the worst)."""
    published: dict = {}
    for p in rows:
        if p.get("published_ms") is not None:
            published.setdefault(_shape_key(p), {})[p["kernel_provider"]] = p["published_ms"]
    shapes = []
    for p in rows:
        if p["kernel_provider"] != peer_provider(p):
            continue
        pub = published.get(_shape_key(p), {})
        ours_ms = p.get("ours_predicted_ms")
        s = {
            "kernel_name": p["kernel_name"],
            "mode": p["kernel_operation_mode"],
            "gpu_name": p["gpu_name"],
            "x_value": p["x_value"],
            "config": p["extra_benchmark_config_str"],
            "ours_predicted_ms": ours_ms,
            "peer_predicted_ms": p.get("predicted_ms"),
            "ours_over_peer": p.get("ours_over_peer"),
            "peer_published_ms": pub.get(peer_provider(p)),
            "huggingface_ms": pub.get("huggingface"),
            "torch_compile_ms": pub.get("torch_compile"),
        }
        for name, prov in (("ours_over_hf", "huggingface"), ("ours_over_compile", "torch_compile")):
            s[name] = ours_ms / pub[prov] if ours_ms is not None and pub.get(prov) else None
        if p.get("ours_bound"):
            s["ours_bound"] = p["ours_bound"]
        if ours_ms is None:
            s["reason"] = p.get("ours_reason") or p.get("reason")
        shapes.append(s)
    done = [s for s in shapes if s["ours_over_peer"] is not None]
    behind = [s for s in done if s["ours_over_peer"] > 1]
    worst = max(done, key=lambda s: s["ours_over_peer"]) if done else None
    summary = {
        "shapes": len(shapes),
        "compared": len(done),
        "ahead": len(done) - len(behind),
        "behind": len(behind),
        "behind_within_2pct": sum(1 for s in behind if s["ours_over_peer"] <= 1.02),
        "median_ours_over_peer": statistics.median([s["ours_over_peer"] for s in done]) if done else None,
        "worst": worst,
        "behind_by_bound": {},
        "not_compared": sorted({s["reason"] for s in shapes if s["ours_over_peer"] is None and s.get("reason")}),
    }
    for s in behind:
        b = s["ours_bound"].split(" ")[0]
        summary["behind_by_bound"][b] = summary["behind_by_bound"].get(b, 0) + 1
    return {"shapes": shapes, "summary": summary}


def side_by_side_table(side: dict) -> list[str]:
    """The side-by-side table, a line a shape (op, mode, GPU, shape), then its summary."""

    def f(v, fmt):
        return format(v, fmt) if v is not None else "-".rjust(int(fmt.split(".")[0]))

    lines = [
        f"{'op':<14}{'mode':<9}{'gpu':<8}{'x':>7}  {'ours ms':>9} {'peer ms':>9} {'ours/peer':>9}"
        f"  {'liger pub':>9} {'hf pub':>9} {'ours/hf':>8} {'compile':>8}  bound of ours where behind"
    ]
    for s in side["shapes"]:
        gpu = "A100" if "A100" in s["gpu_name"] else "H100" if "H100" in s["gpu_name"] else s["gpu_name"][:7]
        tail = s.get("ours_bound", "") if (s["ours_over_peer"] or 0) > 1 else ""
        if s["ours_over_peer"] is None:
            tail = "not compared: " + str(s.get("reason"))[:70]
        cols = [
            f(s["ours_predicted_ms"], "9.4f"),
            f(s["peer_predicted_ms"], "9.4f"),
            f(s["ours_over_peer"], "9.2f") + " ",
            f(s["peer_published_ms"], "9.4f"),
            f(s["huggingface_ms"], "9.4f"),
            f(s["ours_over_hf"], "8.2f"),
            f(s["torch_compile_ms"], "8.4f") + " ",
            tail,
        ]
        lines.append(f"{s['kernel_name']:<14}{s['mode']:<9}{gpu:<8}{s['x_value']:>7}  " + " ".join(cols))
    sm = side["summary"]
    lines.append(
        f"side by side: {sm['compared']} of {sm['shapes']} peer shapes compared, ours ahead at {sm['ahead']}, "
        f"behind at {sm['behind']} ({sm['behind_within_2pct']} of them within 2%)"
        + (f" (median ours/peer {sm['median_ours_over_peer']:.2f})" if sm["compared"] else "")
        + (f"; behind by bound: {sm['behind_by_bound']}" if sm["behind"] else "")
    )
    if sm["worst"]:
        w = sm["worst"]
        lines.append(
            f"worst: {w['kernel_name']} {w['mode']} {w['gpu_name']} x={w['x_value']}: "
            f"ours/peer {w['ours_over_peer']:.2f}"
        )
    return lines
