"""The end-to-end baseline: a plain eager PyTorch model of the same shape as megakernels' GPT or Llama, with no
kernels of megakernels, and one training step of each timed on one device.

``EagerGPT`` is written the way nanoGPT writes a GPT: nn.Embedding, nn.LayerNorm, one QKV nn.Linear, attention
through PyTorch's ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``, nn.Linear + F.gelu MLP, a tied head.
``EagerLlama`` the way Llama's reference code writes one: nn.Embedding, nn.RMSNorm, separate q/k/v/o nn.Linear
(no biases), rotary embeddings with plain tensor ops (half rotation, as megakernels' Llama), grouped-query
attention through SDPA (``enable_gqa``), a SwiGLU MLP of three nn.Linear, final RMSNorm and its own head (or the
tied one). Both end in F.cross_entropy and train with torch.optim.AdamW — identical shapes, initial weights copied
from the megakernels model (``copy_weights``; the two losses checked equal before anything is timed, so the
comparison is of the same model).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from megakernels.precisions import dtype_of

# CPU-sized GPTs (byte vocabulary): a short-context one, where the GEMMs are nearly all the time, and a
# long-context one, where attention (and so FlashAttention's skipped causal half) matters: (config, micro-batch).
_CPU = dict(model="gpt", num_layers=4, vocab_size=261, dropout=0.0, attention_dropout=0.0)
CPU_PRESETS = {
    "gpt-cpu-s256": (dict(_CPU, hidden_size=384, num_heads=6, seq_length=256), 8),
    "gpt-cpu-s1024": (dict(_CPU, hidden_size=256, num_heads=4, seq_length=1024), 2),
}
PRECISIONS = ("fp32", "bf16")  # the eager baseline's (megakernels.precisions)
SHAPE = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "seq_length", "vocab_size")  # reported fields


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
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).view(b, s, self.n, 3, -1).permute(3, 0, 2, 1, 4)  # [b, n, s, d]
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["proj"](att.transpose(1, 2).reshape(b, s, -1))
            x = x + blk["fc2"](F.gelu(blk["fc1"](blk["ln2"](x)), approximate="tanh"))
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def _layer(cfg) -> tuple:
    return cfg.norm, cfg.activation, cfg.position_embedding, cfg.norm_position


def llama_unsupported(cfg) -> str | None:
    """What of Llama-family ``cfg`` ``EagerLlama`` does not implement (None: it implements the whole model)."""
    checks = (
        (cfg.num_experts, "mixture-of-experts layers"),
        (cfg.sliding_window, "sliding-window attention"),
        (cfg.sinks, "attention sinks"),
        (cfg.rope_scaling, "rotary position scaling"),
        (cfg.rope_interleaved, "the interleaved rotary layout"),
        (cfg.qk_norm, "query/key norms"),
        (cfg.qkv_bias or cfg.bias, "biases"),
        (
            _layer(cfg) != ("rmsnorm", "swiglu", "rope", "pre"),
            "a layer other than Llama's (pre-norm RMSNorm, rotary positions, SwiGLU)",
        ),
    )
    return next((what for bad, what in checks if bad), None)


def gpt_unsupported(cfg) -> str | None:
    """What of GPT-family ``cfg`` ``EagerGPT`` does not implement (None: it implements the whole model)."""
    checks = (
        (cfg.num_experts, "mixture-of-experts layers"),
        (cfg.sinks, "attention sinks"),
        (
            _layer(cfg) != ("layernorm", "gelu_tanh", "learned", "pre")
            or not (cfg.bias and cfg.qkv_bias and cfg.tie_embeddings),
            "a layer other than GPT's (pre-norm LayerNorm, learned positions, tanh GeLU, biases, tied head)",
        ),
    )
    return next((what for bad, what in checks if bad), None)


class EagerLlama(nn.Module):
    """Plain PyTorch Llama (pre-norm RMSNorm, rotary positions, grouped-query attention, SwiGLU, no biases; its own
    head unless ``cfg.tie_embeddings``), no fused kernels.

    Raises:
        ValueError: ``cfg`` has a feature this model does not implement (``llama_unsupported``).
    """

    def __init__(self, cfg):
        super().__init__()
        missing = llama_unsupported(cfg)
        if missing:
            raise ValueError(f"EagerLlama: {missing} not implemented")
        h, f, eps = cfg.hidden_size, cfg.ffn_hidden_size, cfg.layernorm_eps
        self.n, self.n_kv, self.d, self.theta = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta
        n, n_kv, d = self.n, self.n_kv, self.d
        self.tok = nn.Embedding(cfg.vocab_size, h)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    attn_norm=nn.RMSNorm(h, eps=eps),
                    q=nn.Linear(h, n * d, bias=False),
                    k=nn.Linear(h, n_kv * d, bias=False),
                    v=nn.Linear(h, n_kv * d, bias=False),
                    o=nn.Linear(n * d, h, bias=False),
                    mlp_norm=nn.RMSNorm(h, eps=eps),
                    gate=nn.Linear(h, f, bias=False),
                    up=nn.Linear(h, f, bias=False),
                    down=nn.Linear(f, h, bias=False),
                )
            )
            for _ in range(cfg.num_layers)
        )
        self.norm = nn.RMSNorm(h, eps=eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(h, cfg.vocab_size, bias=False)

    def rotary(self, s: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) ``[s, d]`` in ``dtype`` of the angles ``pos · theta^(-2i/d)`` (fp32), each half-dimension's
        angle repeated in both halves (the half-rotated layout)."""
        i = torch.arange(0, self.d, 2, dtype=torch.float64, device=device)
        inv_freq = (1.0 / self.theta ** (i / self.d)).float()
        angle = torch.arange(s, dtype=torch.float32, device=device)[:, None] * inv_freq
        angle = torch.cat([angle, angle], -1)
        return angle.cos().to(dtype), angle.sin().to(dtype)

    def forward(self, ids, labels):
        """Mean next-token loss of ``ids [b, s]`` against ``labels [b, s]`` (fp32)."""
        b, s = ids.shape
        n, n_kv, d = self.n, self.n_kv, self.d
        x = self.tok(ids)
        cos, sin = self.rotary(s, ids.device, x.dtype)

        def rope(t):  # t [b, heads, s, d]: first half x1, second half x2 -> (x1 cos - x2 sin, x2 cos + x1 sin)
            x1, x2 = t.chunk(2, -1)
            return t * cos + torch.cat([-x2, x1], -1) * sin

        for blk in self.blocks:
            y = blk["attn_norm"](x)
            q = rope(blk["q"](y).view(b, s, n, d).transpose(1, 2))
            k = rope(blk["k"](y).view(b, s, n_kv, d).transpose(1, 2))
            v = blk["v"](y).view(b, s, n_kv, d).transpose(1, 2)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_kv != n)
            x = x + blk["o"](att.transpose(1, 2).reshape(b, s, n * d))
            y = blk["mlp_norm"](x)
            x = x + blk["down"](F.silu(blk["gate"](y)) * blk["up"](y))
        x = self.norm(x)
        logits = self.head(x) if self.head is not None else x @ self.tok.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def copy_weights(eager: EagerGPT | EagerLlama, fused) -> None:
    """Copy a (tp = pp = 1) megakernels ``GPTModel``'s (into an ``EagerGPT``) or ``LlamaModel``'s (into an
    ``EagerLlama``) weights into ``eager`` (the vocabulary padding dropped)."""
    if isinstance(eager, EagerLlama):
        _copy_llama(eager, fused)
    else:
        _copy_gpt(eager, fused)


def _copy_llama(eager: EagerLlama, fused) -> None:
    p = dict(fused.named_parameters())
    V = eager.tok.weight.shape[0]
    kv = eager.n_kv * eager.d
    with torch.no_grad():
        eager.tok.weight.copy_(p["embedding.word.weight"][:V])
        eager.norm.weight.copy_(p["final_norm.weight"])
        if eager.head is not None:
            eager.head.weight.copy_(p["output_layer.weight"][:V])
        for i, blk in enumerate(eager.blocks):
            w = lambda name: p[f"layers.{i}.{name}.weight"]  # noqa: E731
            blk["attn_norm"].weight.copy_(w("input_norm"))
            blk["q"].weight.copy_(w("attention.q"))
            blk["k"].weight.copy_(w("attention.kv")[:kv])  # kv.weight is [keys; values]
            blk["v"].weight.copy_(w("attention.kv")[kv:])
            blk["o"].weight.copy_(w("attention.proj"))
            blk["mlp_norm"].weight.copy_(w("post_attention_norm"))
            gate, up = w("mlp.fc1").chunk(2)  # fc1.weight is [W_gate; W_up]
            blk["gate"].weight.copy_(gate)
            blk["up"].weight.copy_(up)
            blk["down"].weight.copy_(w("mlp.fc2"))


def _copy_gpt(eager: EagerGPT, fused) -> None:
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


def _gpt_model():
    from megakernels_models.models.gpt.model import GPTModel

    return GPTModel


def _llama_model():
    from megakernels_models.models.llama.model import LlamaModel

    return LlamaModel


# cfg.model -> (megakernels model class (imported on call), eager model class, what it does not implement,
# report labels (eager, megakernels)).
FAMILIES = {
    "gpt": (_gpt_model, EagerGPT, gpt_unsupported, ("eager GPT (PyTorch)", "megakernels GPTModel")),
    "llama": (_llama_model, EagerLlama, llama_unsupported, ("eager Llama (PyTorch)", "megakernels LlamaModel")),
}


def unsupported(cfg) -> str | None:
    """Why ``cfg`` has no eager baseline (a family other than GPT and Llama, or a feature the family's eager model
    does not implement), or None."""
    if cfg.model not in FAMILIES:
        return f"{cfg.model} models (GPT and Llama only)"
    missing = FAMILIES[cfg.model][2](cfg)
    return f"{missing} (the eager {cfg.model} model)" if missing else None


def impl_labels(model: str) -> tuple[str, str]:
    """The report's names of the eager and the megakernels implementation of family ``model``."""
    return FAMILIES[model][3]


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
    """One training step (forward + backward + AdamW on one micro-batch, tp = pp = dp = 1) of the eager model of
    ``cfg``'s family (``EagerGPT`` or ``EagerLlama``) and of megakernels' (``GPTModel`` or ``LlamaModel``: fused
    kernels, FusedAdamW), timed one after the other in this process.

    Returns:
        ``{"model", "precision", "micro_batch_size", "device", "shape", "eager": {...}, "megakernels": {...},
        "speedup"}``, each implementation with ``step_s, tokens_per_s, tflops, mfu, step_memory_bytes`` (see
        ``time_steps``).

    Raises:
        ValueError: ``precision`` other than fp32 / bf16, or a model the eager baselines do not implement
            (``unsupported``).
        RuntimeError: the two models' initial losses differ by more than 2% (the comparison would be unfair).
    """
    from megakernels.optim import FusedAdamW
    from megakernels.parallel.launch import single_process_world

    if precision not in PRECISIONS:
        raise ValueError(f"compare_single: precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    missing = unsupported(cfg)
    if missing:
        raise ValueError(f"compare_single: no eager baseline for {missing}")
    fused_cls, eager_cls = FAMILIES[cfg.model][:2]
    dtype = dtype_of(precision)
    with single_process_world(device.type, parallel=True):
        fused = fused_cls()(cfg, seed=1234, device=device).to(dtype)
        eager = eager_cls(cfg).to(device)
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
            "model": cfg.model,
            "precision": precision,
            "micro_batch_size": mbs,
            "device": device.type,
            "shape": {k: getattr(cfg, k) for k in SHAPE},
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
