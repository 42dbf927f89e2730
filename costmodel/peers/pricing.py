"""A recorded timed region priced as the benchmark harness times it: the GPU time beside the host time the L2
flush does not hide (``HOST``), and our kernels substituted for the peer's."""

from __future__ import annotations

import dataclasses
import json
import re

from costmodel import model
from costmodel.peers.recorder import Op
from costmodel.peers.torch_price import price_compiled, price_torch
from costmodel.peers.triton_price import price_triton


@dataclasses.dataclass(frozen=True)
class Host:
    """The host side of a do_bench measurement (assumptions, calibrated on the development set)."""

    triton_launch_s: float = 50e-6  # a Triton launch from Python (argument binding, the launcher)
    torch_op_s: float = 5e-6  # an eager PyTorch op, views included
    function_s: float = 30e-6  # an autograd.Function call
    backward_s: float = 130e-6  # more for a backward: the autograd engine's pass (Tensor.backward)
    flush_bytes: float = 256e6  # do_bench's L2 flush: a 256 MB zero_ before each timed call


HOST = Host()


def price(ops: list[Op], m: model.Machine, host: Host = HOST) -> dict:
    """The published time of a recorded region: the GPU's time (its kernels in order) or the host's time the
    flush does not hide, whichever is longer. A compiled call (``Recorder.compiled``) costs the host one
    ``function_s`` (the call through its compiled wrapper: guards and the generated code, no per-op dispatch) and
    ``torch_op_s`` per kernel it launches; its GPU time is ``price_compiled``'s."""
    gpu, host_t, after_sync, synced, launches = 0.0, 0.0, 0.0, False, []
    ops = list(ops)
    i = 0
    while i < len(ops):
        op = ops[i]
        i += 1
        if op.kind == "return":
            continue
        if op.kind == "compiled":
            end = next((j for j in range(i, len(ops)) if ops[j].kind == "compiled_end"), None)
            if end is None:
                raise ValueError("a compiled region without its 'compiled_end' marker")
            kernels = price_compiled(ops[i : end + 1], m)
            i = end + 1
            dh = host.function_s + host.torch_op_s * len(kernels)
            host_t += dh
            after_sync += dh
            gpu += sum(r["time_s"] for r in kernels)
            launches.extend(kernels)
            continue
        if op.kind == "ours":  # one of our launches (streaming.Part), made from C++ behind a custom op
            r = ours_price(op.launch, m)
            dh = host.torch_op_s
        elif op.kind == "triton":
            r = price_triton(op.launch, m)
            dh = host.triton_launch_s
        elif op.kind == "torch":
            r = price_torch(op, m)
            dh = host.torch_op_s
        elif op.kind == "sync":
            synced, after_sync, r, dh = True, 0.0, None, host.torch_op_s
            after_sync = max(after_sync, 0.0)
            gpu = max(gpu, host_t - host.flush_bytes / m.dram_copy)  # the host waited for the GPU
        else:
            r, dh = None, host.function_s + (host.backward_s if op.func == "backward" else 0.0)
        host_t += dh
        after_sync += dh
        if r is not None:
            gpu += r["time_s"]
            launches.append(r)
    flush = host.flush_bytes / m.dram_copy
    exposed = after_sync if synced else max(0.0, host_t - flush)
    total = max(gpu, exposed)
    return {
        "time_s": total,
        "gpu_s": gpu,
        "host_exposed_s": exposed,
        "bound": "host" if exposed > gpu else "gpu",
        "launches": launches,
    }


_OURS: dict = {}  # (our launch, machine) -> its price


def ours_price(part, m: model.Machine) -> dict:
    """Time of one of our launches (a ``streaming.Part``) on ``m``."""
    from costmodel import streaming

    key = (id(part), m.name)
    if key not in _OURS:
        _OURS[key] = (part, streaming.price_parts([part], m)[0])
    return {**_OURS[key][1], "ours": True}


def substitute(ops: list[Op], ours: dict) -> list[Op]:
    """The recorded region with each of the peer's autograd function passes (what ran between ``call`` and
    ``return``) replaced by our launches for that pass (``ours``: {"fwd"/"bwd": [Part, ...]}); the call itself
    (the autograd function's host cost) and everything around it are kept.

    Raises:
        ValueError: a pass the region runs that ``ours`` has no launches for."""
    out, inside = [], False
    for op in ops:
        if op.kind == "call":
            p = "bwd" if op.func == "backward" else "fwd"
            if p not in ours:
                raise ValueError(f"no launches of ours for the {p} pass")
            out.append(op)
            out.extend(Op("ours", launch=part) for part in ours[p])
            inside = True
        elif op.kind == "return":
            inside = False
        elif not inside:
            out.append(op)
    return out


def inside(ops: list[Op]) -> list[Op]:
    """The ops the peer's autograd functions ran (between ``call`` and ``return``)."""
    out, inside = [], False
    for op in ops:
        if op.kind in ("call", "return"):
            inside = op.kind == "call"
        elif inside:
            out.append(op)
    return out


def op_time(op: Op, m: model.Machine) -> float:
    r = price_triton(op.launch, m) if op.kind == "triton" else price_torch(op, m) if op.kind == "torch" else None
    return r["time_s"] if r else 0.0


def price_ours(r: dict, rec: list, m: model.Machine, host: Host = HOST) -> dict:
    """Our kernels in the peer's benchmark region of row ``r``: ``ours_predicted_ms`` and what binds it, or
    ``ours_reason`` why we have no prediction."""
    from costmodel import ours

    try:
        cfg = json.loads(r["extra_benchmark_config_str"] or "{}")
        parts = ours.passes(r["kernel_name"], r["kernel_operation_mode"], float(r["x_value"]), cfg, m)
        if isinstance(parts, str):
            return {"ours_predicted_ms": None, "ours_reason": parts}
        res = price(substitute(rec, parts), m, host)
    except Exception as e:  # noqa: BLE001 - a kernel of ours the model cannot read is a reason, not a crash
        return {"ours_predicted_ms": None, "ours_reason": f"{type(e).__name__}: {str(e)[:300]}"}
    mine = [q for q in res["launches"] if q.get("ours")]
    kernels_s = sum(q["time_s"] for q in mine)
    if res["bound"] == "host":
        bound = "host"
    else:  # the resource that binds our slowest launch (what the region shares with the peer binds both alike)
        top = max(mine or res["launches"], key=lambda q: q["time_s"])
        name = re.search(r"(\w+)<", top["kernel"]) or re.search(r"(\w+)\(", top["kernel"])
        bound = f"{top['bound']} ({name.group(1) if name else top['kernel']})"
    return {
        "ours_predicted_ms": res["time_s"] * 1e3,
        "ours_gpu_ms": res["gpu_s"] * 1e3,
        "ours_kernels_ms": kernels_s * 1e3,
        "ours_host_exposed_ms": res["host_exposed_s"] * 1e3,
        "ours_bound": bound,
        "ours_launches": [
            {"kernel": q["kernel"], "bound": q["bound"], "time_us": q["time_s"] * 1e6}
            | ({"ours": True} if q.get("ours") else {})
            for q in res["launches"]
        ],
    }
