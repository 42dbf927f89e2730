"""Peak memory and time of the post-training losses (``megakernels.ops.post_training``: the logits never held) against
the same losses on full logits (``F.linear`` then ``log_softmax``, as TRL computes them), forward + backward, on the
CPU.

    python -m benchmarks.post_training_losses [--tokens 8192] [--hidden 1024] [--vocab 128256] [--dtype bfloat16]
                                              [--losses dpo,orpo,simpo,cpo,kto,grpo,distill] [--out DIR]

Each (loss, implementation) runs in a fresh process: the inputs are made (``tokens`` split into sequences of 512,
half chosen and half rejected where the loss pairs them), a warm-up step runs at 512 tokens, the process's peak
resident memory is reset (``/proc/self/clear_refs``) and one forward + backward step at the full size is timed; its
peak is reported above the resident memory before it (the inputs; the gradients of hidden and weight count in both).
Distillation's teacher is given as hidden states and a head (its logits are chunked too) to the fused loss, and as
full logits to the other. The machine's load average is recorded before and after; other jobs slow the times, not
the memory. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LOSSES = ("dpo", "orpo", "simpo", "cpo", "kto", "grpo", "distill")
SEQ = 512


def _inputs(loss: str, t: int, h: int, v: int, dtype):
    import torch

    g = torch.Generator().manual_seed(0)
    n = max(2, t // SEQ)
    hidden = torch.randn(n, t // n, h, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_(True)
    target = torch.randint(0, v, (n, t // n), generator=g)
    target[:, :16] = -100  # a prompt
    extra = {
        "ref": torch.randn(n, generator=g),
        "adv": torch.randn(n, generator=g),
        "desirable": torch.arange(n) % 2 == 0,
        "teacher_hidden": torch.randn(n, t // n, h, generator=g).to(dtype),
        "teacher_weight": (torch.randn(v, h, generator=g) / h**0.5).to(dtype),
    }
    return hidden, weight, target, extra


def _fused(loss: str, hidden, weight, target, x):
    from megakernels.ops import post_training as pt

    if loss == "dpo":
        return pt.dpo_loss(hidden, weight, target, x["ref"]).loss
    if loss == "orpo":
        return pt.orpo_loss(hidden, weight, target).loss
    if loss == "simpo":
        return pt.simpo_loss(hidden, weight, target).loss
    if loss == "cpo":
        return pt.cpo_loss(hidden, weight, target).loss
    if loss == "kto":
        z = x["ref"][:2]
        return pt.kto_loss(hidden, weight, target, x["ref"], x["desirable"], z, z).loss
    if loss == "grpo":
        return pt.grpo_loss(hidden, weight, target, x["adv"], entropy_coef=0.01).loss
    return pt.distill_loss(
        hidden, weight, target, teacher_hidden=x["teacher_hidden"], teacher_weight=x["teacher_weight"], kind="jsd"
    )


def _full(loss: str, hidden, weight, target, x):
    """The same losses on the whole logits (fp32 log-softmax, as TRL's trainers take it)."""
    import torch
    import torch.nn.functional as F

    from megakernels.ops import post_training as pt

    logq = torch.log_softmax(F.linear(hidden, weight).float(), -1)
    mask = target != -100
    logp = logq.gather(-1, target.clamp(min=0)[..., None])[..., 0] * mask
    sums, counts = logp.sum(1), mask.sum(1).float()
    if loss in ("dpo", "cpo", "simpo", "orpo"):
        vals = sums / counts if loss in ("simpo", "orpo") else sums
        c, r = vals.chunk(2)
        if loss == "dpo":
            rc, rr = x["ref"].chunk(2)
            return -F.logsigmoid(0.1 * ((c - rc) - (r - rr))).mean()
        if loss == "orpo":
            odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
            return -sums.chunk(2)[0].sum() / counts.chunk(2)[0].sum() - 0.1 * F.logsigmoid(odds).mean()
        if loss == "simpo":
            return -F.logsigmoid(2.0 * (c - r) - 0.5).mean()
        return -F.logsigmoid(0.1 * (c - r)).mean() - c.sum() / counts.chunk(2)[0].sum()
    if loss == "kto":
        ratio = sums - x["ref"]
        return torch.where(x["desirable"], 1 - torch.sigmoid(0.1 * ratio), 1 - torch.sigmoid(-0.1 * ratio)).mean()
    if loss == "grpo":
        ent = -(logq.exp() * logq).sum(-1)
        per_token = -x["adv"][:, None] * torch.exp(logp - logp.detach())
        m = mask.float()
        return ((per_token * m).sum(-1) / m.sum(-1)).mean() - 0.01 * (ent * m).sum() / m.sum()
    t_logq = torch.log_softmax(F.linear(x["teacher_hidden"], x["teacher_weight"]).float(), -1)
    div = pt.divergence(logq, t_logq, "jsd", 0.5)
    return (div * mask).sum() / mask.sum()


def _one(spec: dict) -> dict:
    """One point, in this (fresh) process: ``{"ms", "peak_mib"}``."""
    import torch

    from megakernels.bench.common import proc_status_bytes, reset_peak_rss

    torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, spec["dtype"])
    fn = _fused if spec["impl"] == "fused" else _full

    def step(t):
        hidden, weight, target, x = _inputs(spec["loss"], t, spec["hidden"], spec["vocab"], dtype)
        base = reset_peak_rss()
        t0 = time.perf_counter()
        fn(spec["loss"], hidden, weight, target, x).backward()
        return (time.perf_counter() - t0) * 1e3, (proc_status_bytes("VmHWM") - base) / 2**20

    step(SEQ * 2)
    ms, peak = step(spec["tokens"])
    return {"ms": ms, "peak_mib": peak}


def _load() -> list[float]:
    return list(os.getloadavg())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.post_training_losses", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default=None)
    p.add_argument("--point", default=None, help=argparse.SUPPRESS)  # a child's spec
    args = p.parse_args(argv)
    if args.point:
        print(json.dumps(_one(json.loads(args.point))))
        return 0
    losses = [x for x in args.losses.split(",") if x]
    bad = [x for x in losses if x not in LOSSES]
    if bad:
        p.error(f"--losses: unknown {bad}; choose from {', '.join(LOSSES)}")
    from megakernels.bench.common import machine, machine_line, run_point, write_json

    info, load0, rows = machine("cpu"), _load(), []
    print(machine_line(info))
    print(
        f"{'loss':<8}{'fused ms':>10}{'full ms':>10}{'speed-up':>10}{'fused MiB':>11}{'full MiB':>10}{'peak ratio':>12}"
    )
    for loss in losses:
        got = {}
        for impl in ("fused", "full"):
            spec = dict(vars(args), loss=loss, impl=impl)
            spec.pop("point"), spec.pop("out"), spec.pop("losses")
            got[impl] = run_point("benchmarks.post_training_losses", spec, ROOT)
        row = {"loss": loss, **got}  # {"fused": {"ms", "peak_mib"} or {"error"}, "full": ...}
        rows.append(row)
        fused, full = got["fused"], got["full"]
        if "ms" in fused and "ms" in full:
            print(
                f"{loss:<8}{fused['ms']:>10.0f}{full['ms']:>10.0f}{full['ms'] / fused['ms']:>9.2f}x"
                f"{fused['peak_mib']:>11.0f}{full['peak_mib']:>10.0f}{fused['peak_mib'] / full['peak_mib']:>12.2f}"
            )
        else:
            print(f"{loss:<8} failed: {got}")
    payload = {"machine": info, "load": {"before": load0, "after": _load()}, "config": vars(args), "results": rows}
    path = write_json(args.out, "post_training_losses.json", payload)
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
