"""The end-to-end baseline: a plain PyTorch GPT of the same shape as megakernels' GPT, with no fused kernels, and
one training step of each timed on one device.

The baseline is written the way nanoGPT writes a GPT: nn.Embedding, nn.LayerNorm, attention as matmul +
masked_fill + softmax + matmul, nn.Linear + F.gelu MLP, a tied head, F.cross_entropy and torch.optim.AdamW —
identical shapes, initial weights copied from the megakernels model (and the two losses checked equal before
anything is timed, so the comparison is of the same model).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

# CPU-sized GPTs (byte vocabulary): a short-context one, where the GEMMs are nearly all the time, and a
# long-context one, where attention (and so FlashAttention's skipped causal half) matters: (config, micro-batch).
_CPU = dict(model="gpt", num_layers=4, vocab_size=261, dropout=0.0, attention_dropout=0.0)
CPU_PRESETS = {
    "gpt-cpu-s256": (dict(_CPU, hidden_size=384, num_heads=6, seq_length=256), 8),
    "gpt-cpu-s1024": (dict(_CPU, hidden_size=256, num_heads=4, seq_length=1024), 2),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class EagerGPT(nn.Module):
    """Plain PyTorch GPT (pre-norm, learned positions, tied head), no fused kernels."""

    def __init__(self, cfg):
        super().__init__()
        h, self.n = cfg.hidden_size, cfg.num_heads
        self.wte = nn.Embedding(cfg.vocab_size, h)
        self.wpe = nn.Embedding(cfg.seq_length, h)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    ln1=nn.LayerNorm(h),
                    qkv=nn.Linear(h, 3 * h),
                    proj=nn.Linear(h, h),
                    ln2=nn.LayerNorm(h),
                    fc1=nn.Linear(h, cfg.ffn_hidden_size),
                    fc2=nn.Linear(cfg.ffn_hidden_size, h),
                )
            )
            for _ in range(cfg.num_layers)
        )
        self.ln_f = nn.LayerNorm(h)

    def forward(self, ids, labels):
        """Mean next-token loss of ``ids [b, s]`` against ``labels [b, s]`` (fp32)."""
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


def copy_weights(eager: EagerGPT, fused) -> None:
    """Copy a (tp = pp = 1) megakernels ``GPTModel``'s weights into ``eager`` (the vocabulary padding dropped)."""
    p = dict(fused.named_parameters())
    V = eager.wte.weight.shape[0]
    with torch.no_grad():
        eager.wte.weight.copy_(p["embedding.word.weight"][:V])
        eager.wpe.weight.copy_(p["embedding.position.weight"])
        eager.ln_f.weight.copy_(p["final_norm.weight"])
        eager.ln_f.bias.copy_(p["final_norm.bias"])
        names = {
            "ln1": "input_norm",
            "qkv": "attention.qkv",
            "proj": "attention.proj",
            "ln2": "post_attention_norm",
            "fc1": "mlp.fc1",
            "fc2": "mlp.fc2",
        }
        for i, blk in enumerate(eager.blocks):
            for ours, theirs in names.items():
                blk[ours].weight.copy_(p[f"layers.{i}.{theirs}.weight"])
                blk[ours].bias.copy_(p[f"layers.{i}.{theirs}.bias"])


def time_steps(step, steps: int, device: torch.device) -> tuple[float, int | None]:
    """(Mean seconds per call of ``step`` over ``steps`` calls after two warm-up calls, the memory one call
    allocates beyond what was held before it: activations, gradients, temporaries; CUDA only, None on the CPU,
    where freed memory stays resident and a peak resident set would not separate the two models)."""
    step()  # warm-up
    step()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t) / steps
    return seconds, (torch.cuda.max_memory_allocated() - base if cuda else None)


def compare_single(cfg, device: torch.device, precision: str, mbs: int, steps: int, peak: float) -> dict:
    """One training step (forward + backward + AdamW on one micro-batch, tp = pp = dp = 1) of the eager GPT and of
    megakernels' ``GPTModel`` (fused kernels, FusedAdamW), timed one after the other in this process.

    Returns:
        ``{"precision", "micro_batch_size", "device", "shape", "eager": {...}, "megakernels": {...}, "speedup"}``,
        each implementation with ``step_s, tokens_per_s, tflops, mfu, step_memory_bytes`` (see ``time_steps``).

    Raises:
        ValueError: ``precision`` other than fp32 / bf16.
        RuntimeError: the two models' initial losses differ by more than 2% (the comparison would be unfair).
    """
    from megakernels.optim import FusedAdamW
    from megakernels.parallel.launch import single_process_world
    from megakernels_models.models.gpt.model import GPTModel

    if precision not in DTYPES:
        raise ValueError(f"compare_single: precision must be one of {', '.join(DTYPES)}, got {precision!r}")
    dtype = DTYPES[precision]
    with single_process_world(device.type, parallel=True):
        fused = GPTModel(cfg, seed=1234, device=device).to(dtype)
        eager = EagerGPT(cfg).to(device)
        copy_weights(eager, fused)
        eager = eager.to(dtype)
        ids = torch.randint(0, cfg.vocab_size, (mbs, cfg.seq_length), device=device)
        labels = torch.randint(0, cfg.vocab_size, (mbs, cfg.seq_length), device=device)
        fused_opt = FusedAdamW(fused.parameters(), lr=1e-4, master_weights=dtype != torch.float32)
        eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-4)
        with torch.no_grad():  # same model, same loss (a check that the comparison is fair)
            a = fused(ids, labels=labels).mean().item()
            b = eager(ids, labels).item()
        if not abs(a - b) < 2e-2 * abs(b):
            raise RuntimeError(f"compare_single: initial losses differ (megakernels {a:.5f}, eager {b:.5f})")

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
        row = {
            "precision": precision,
            "micro_batch_size": mbs,
            "device": device.type,
            "shape": {
                k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size")
            },
        }
        for name, fn in (("eager", eager_step), ("megakernels", fused_step)):
            t, mem = time_steps(fn, steps, device)
            row[name] = {
                "step_s": t,
                "tokens_per_s": tokens / t,
                "tflops": flops / t / 1e12,
                "mfu": flops / t / 1e12 / peak,
                "step_memory_bytes": mem,
            }
        row["speedup"] = row["eager"]["step_s"] / row["megakernels"]["step_s"]
        return row
