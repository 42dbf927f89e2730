"""Our kernels at a peer's benchmark shapes: the launches megakernels makes for a Liger-Kernel CSV row's op, mode,
shape and dtype, on the row's GPU (``model.Machine``: its SM count and shared memory shape the launch plans, its
arch the compile), priced by the same streaming model as the peer's (``streaming.price_parts``).

``passes(row, machine)`` returns, per autograd pass the peer's benchmark region runs (``fwd``, ``bwd``), the
``streaming.Part`` list of our launches for it, or a string saying why we have none (an op megakernels lacks, a
shape our modelled path does not take). ``peer.price_ours`` puts them where the peer's function ran in the
recorded region, keeping what the benchmark does around it (the MLP's GEMMs, the gradient accumulation).
"""

from __future__ import annotations

import json

from costmodel import model

# Liger-Kernel kernel names we have no kernel for, and why.
LACKING = {
    "geglu": "megakernels has no GeGLU kernel (bias_gelu is bias + GeLU, not gated)",
}
DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float32": "fp32", "bfloat16": "bf16", "float32": "fp32"}
# The row-resident norm kernels take rows up to 16k elements (csrc/norms/norms_rows.cuh's rows_kernel_fits:
# 32 elements a thread x kMaxRowThreads 512); longer rows take the looping kernels, not in the static model.
MAX_ROW = 16384


def _dtype(cfg: dict, default: str = "torch.float32") -> str | None:
    return DTYPE_NAMES.get(str(cfg.get("dtype", default)))


def passes(kernel_name: str, mode: str, x, cfg: dict | str, m: model.Machine) -> dict | str:
    """{pass name: [Part, ...]} of our launches for the row, or why there are none."""
    from costmodel import elementwise, streaming

    if isinstance(cfg, str):
        cfg = json.loads(cfg or "{}")
    if kernel_name in LACKING:
        return LACKING[kernel_name]
    names = {"forward": ["fwd"], "backward": ["bwd"], "full": ["fwd", "bwd"]}.get(mode)
    if names is None:
        return f"mode {mode!r}"
    dt = _dtype(cfg)
    if dt is None:
        return f"dtype {cfg.get('dtype')!r}: our modelled kernels are bf16 and fp32"
    x = int(x)
    if kernel_name in ("rms_norm", "layer_norm"):
        rows = int(cfg["M"])
        if x > MAX_ROW:
            return f"hidden {x} > {MAX_ROW}: our looping norm kernel is not in the static model"
        return {p: streaming._norm_parts(kernel_name, p, dt, rows, x, m) for p in names}
    if kernel_name == "cross_entropy":
        rows = int(cfg["B"]) * int(cfg["T"])
        return {p: streaming._ce_parts(p, rows, x, m, dt) for p in names}
    if kernel_name == "swiglu":
        rows = int(cfg.get("B", cfg.get("bsz", 1))) * x
        return {p: elementwise._swiglu_parts(p, dt, rows, int(cfg["intermediate_size"]), m) for p in names}
    if kernel_name == "rope":
        hq, hk = int(cfg["num_q_heads"]), int(cfg["num_kv_heads"])
        hidden, seq = int(cfg.get("hidden_size", x)), int(cfg.get("seq_len", x))
        # the inverse rotation (backward) is the same kernel
        return {p: elementwise._rope_parts(dt, seq, hq, hk, hidden // hq, m) for p in names}
    return f"megakernels has no kernel for {kernel_name!r}"
