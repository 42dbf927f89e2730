"""End-to-end training throughput: megakernels' GPT against a plain PyTorch eager GPT of the same shape.

    python -m benchmarks.e2e [--preset NAME] [--device cpu|cuda] [--precision fp32|bf16]
                             [--micro-batch-size 8] [--steps 5] [--quick] [--out DIR]

One training step = forward + backward + optimizer step on one micro-batch, tp = pp = dp = 1. The baseline is a
GPT written here the way nanoGPT writes one without fused kernels: nn.Embedding, nn.LayerNorm, attention as
matmul + masked_fill + softmax + matmul, nn.Linear + F.gelu MLP, a tied head, F.cross_entropy and
torch.optim.AdamW — identical shapes, initial weights copied from the megakernels model. Reported: tokens/s,
TFLOP/s per device (model FLOPs of Narayanan et al.: 3× forward incl. attention, no recompute), MFU against the
device's peak (the trainer's table for GPUs, a timed matmul on the CPU) and the speed-up. Never asserts on time.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.common import start, write_results

# CPU-sized GPTs (byte vocabulary): a short-context one, where the GEMMs are nearly all the time, and a
# long-context one, where attention (and so FlashAttention's skipped causal half) matters: (config, micro-batch).
_CPU = dict(model="gpt", num_layers=4, vocab_size=261, dropout=0.0, attention_dropout=0.0)
CPU_PRESETS = {
    "gpt-cpu-s256": (dict(_CPU, hidden_size=384, num_heads=6, seq_length=256), 8),
    "gpt-cpu-s1024": (dict(_CPU, hidden_size=256, num_heads=4, seq_length=1024), 2),
}


class EagerGPT(nn.Module):
    """Plain PyTorch GPT (pre-norm, learned positions, tied head), no fused kernels."""

    def __init__(self, cfg):
        super().__init__()
        h, self.n = cfg.hidden_size, cfg.num_heads
        self.wte = nn.Embedding(cfg.vocab_size, h)
        self.wpe = nn.Embedding(cfg.seq_length, h)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln1=nn.LayerNorm(h), qkv=nn.Linear(h, 3 * h), proj=nn.Linear(h, h), ln2=nn.LayerNorm(h),
            fc1=nn.Linear(h, cfg.ffn_hidden_size), fc2=nn.Linear(cfg.ffn_hidden_size, h))) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, ids, labels):
        b, s = ids.shape
        x = self.wte(ids) + self.wpe.weight[:s]
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).triu(1)
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).view(b, s, self.n, 3, -1).permute(3, 0, 2, 1, 4)
            att = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            att = att.masked_fill(causal, float("-inf")).softmax(-1)
            x = x + blk["proj"]((att @ v).transpose(1, 2).reshape(b, s, -1))
            x = x + blk["fc2"](F.gelu(blk["fc1"](blk["ln2"](x)), approximate="tanh"))
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def _copy_weights(eager: EagerGPT, fused) -> None:
    p = dict(fused.named_parameters())
    V = eager.wte.weight.shape[0]
    with torch.no_grad():
        eager.wte.weight.copy_(p["embedding.word.weight"][:V])
        eager.wpe.weight.copy_(p["embedding.position.weight"])
        eager.ln_f.weight.copy_(p["final_norm.weight"])
        eager.ln_f.bias.copy_(p["final_norm.bias"])
        names = {"ln1": "input_norm", "qkv": "attention.qkv", "proj": "attention.proj", "ln2": "post_attention_norm",
                 "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
        for i, blk in enumerate(eager.blocks):
            for ours, theirs in names.items():
                blk[ours].weight.copy_(p[f"layers.{i}.{theirs}.weight"])
                blk[ours].bias.copy_(p[f"layers.{i}.{theirs}.bias"])


def _time_steps(step, steps: int, device) -> float:
    step()  # warm-up
    step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t) / steps


def run(cfg, device: torch.device, precision: str, mbs: int, steps: int, peak: float) -> dict:
    import megakernels.parallel as mpu
    from megakernels.optim import FusedAdamW
    from megakernels_models.gpt import GPTModel

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mpu.initialize(1, 1)
    try:
        fused = GPTModel(cfg, seed=1234, device=device).to(dtype)
        eager = EagerGPT(cfg).to(device)
        _copy_weights(eager, fused)
        eager = eager.to(dtype)
        ids = torch.randint(0, cfg.vocab_size, (mbs, cfg.seq_length), device=device)
        labels = torch.randint(0, cfg.vocab_size, (mbs, cfg.seq_length), device=device)
        fused_opt = FusedAdamW(fused.parameters(), lr=1e-4, master_weights=dtype != torch.float32)
        eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-4)
        with torch.no_grad():  # same model, same loss (a check that the comparison is fair)
            a = fused(ids, labels=labels).mean().item()
            b = eager(ids, labels).item()
        assert abs(a - b) < 2e-2 * abs(b), (a, b)

        def fused_step():
            fused_opt.zero_grad(set_to_none=True)
            fused(ids, labels=labels).mean().backward()
            fused_opt.step()

        def eager_step():
            eager_opt.zero_grad(set_to_none=True)
            eager(ids, labels).backward()
            eager_opt.step()

        tokens = mbs * cfg.seq_length
        flops = cfg.flops_per_token("none") * tokens
        row = {"preset": cfg, "precision": precision, "micro_batch_size": mbs, "device": device.type}
        for name, fn in (("eager", eager_step), ("megakernels", fused_step)):
            t = _time_steps(fn, steps, device)
            row[name] = {"step_s": t, "tokens_per_s": tokens / t, "tflops": flops / t / 1e12,
                         "mfu": flops / t / 1e12 / peak}
        row["speedup"] = row["eager"]["step_s"] / row["megakernels"]["step_s"]
        row["preset"] = {k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "num_heads", "seq_length",
                                                     "vocab_size")}
        return row
    finally:
        mpu.destroy()
        dist.destroy_process_group()


def main(argv=None) -> int:
    from megakernels_models.arguments import TrainArgs
    from megakernels_models.config import ModelConfig, preset
    from megakernels_models.train import device_peak_tflops

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="a trainer preset (default: gpt-1.3b on CUDA; on the CPU "
                   f"{', '.join(CPU_PRESETS)})")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default=None, choices=["fp32", "bf16"], help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="a tiny model, 1 step (a smoke run)")
    p.add_argument("--out", default=None, help="directory for e2e.json")
    args = p.parse_args(argv)
    info = start(p, args.device)
    device = torch.device(args.device)
    precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    if args.quick:
        runs = {"quick": (preset("gpt-tiny", num_layers=2, hidden_size=64, num_heads=4, seq_length=32), 2)}
        steps = 1
    elif args.preset or args.device == "cuda":
        name = args.preset or "gpt-1.3b"
        runs = {name: (preset(name), 4 if args.device == "cuda" else 2)}
        steps = args.steps
    else:
        runs = {name: (ModelConfig(**cfg), mbs) for name, (cfg, mbs) in CPU_PRESETS.items()}
        steps = args.steps
    peak = device_peak_tflops(TrainArgs(precision=precision, device=args.device), device)
    print(f"{precision}, {args.device}, device peak {peak:.3g} TFLOP/s (MFU against it)")
    print(f"{'model':<16}{'shape':<24}{'impl':<12}{'step ms':>10}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}"
          f"{'speed-up':>10}")
    rows = []
    for name, (cfg, mbs) in runs.items():
        cfg = cfg.replace(dropout=0.0, attention_dropout=0.0)
        mbs = args.micro_batch_size or mbs
        row = run(cfg, device, precision, mbs, steps, peak)
        row["name"] = name
        shape = f"l{cfg.num_layers} h{cfg.hidden_size} s{cfg.seq_length} b{mbs}"
        for impl in ("eager", "megakernels"):
            r = row[impl]
            up = f"{row['speedup']:.2f}x" if impl == "megakernels" else ""
            print(f"{name:<16}{shape:<24}{impl:<12}{r['step_s'] * 1e3:>10.1f}{r['tokens_per_s']:>12.0f}"
                  f"{r['tflops']:>10.3g}{r['mfu']:>8.1%}{up:>10}")
        rows.append(row)
    write_results(args.out, "e2e.json", info, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
