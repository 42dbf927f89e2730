"""Llama against a plain-PyTorch Llama written out here (same weights, fp64): RMSNorm, rotary embeddings with the
half-rotated (HuggingFace) or interleaved layout, grouped-query attention, SwiGLU, no biases, tied or untied
output; the presets' published sizes; the cost model's GQA and SwiGLU terms."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megakernels_models.models.config import PRESETS, ModelConfig
from megakernels_models.models.llama.model import LlamaModel

LLAMA = ModelConfig(
    "llama",
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    seq_length=16,
    vocab_size=261,
    ffn_hidden_size=48,
    dropout=0.0,
    attention_dropout=0.0,
    rope_theta=500.0,
)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(t, pos, theta, interleaved):
    """Rotary embedding of ``t`` [b, s, heads, d] written out: pairs (i, i + d/2), or (2i, 2i+1) interleaved."""
    d = t.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]  # [s, d/2]
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    if interleaved:
        a, b = t[..., 0::2], t[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
    a, b = t[..., : d // 2], t[..., d // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


def llama_reference(p, ids, labels, cfg, positions=None):
    """Per-token loss [b, s] of a Llama with parameters ``p`` (our names, fp64)."""
    b, s = ids.shape
    n, kv, d, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_hidden_size
    pos = torch.arange(s) if positions is None else positions
    x = p["embedding.word.weight"][ids]
    for i in range(cfg.num_layers):
        m = f"layers.{i}."
        y = _rms(x, p[m + "input_norm.weight"], cfg.layernorm_eps)
        q = (y @ p[m + "attention.q.weight"].t()).view(b, s, n, d)
        k, v = (y @ p[m + "attention.kv.weight"].t()).view(b, s, 2, kv, d).unbind(2)
        q, k = (_rotate(t, pos, cfg.rope_theta, cfg.rope_interleaved) for t in (q, k))
        k, v = k.repeat_interleave(n // kv, 2), v.repeat_interleave(n // kv, 2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        ctx = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, n * d)
        x = x + ctx @ p[m + "attention.proj.weight"].t()
        y = _rms(x, p[m + "post_attention_norm.weight"], cfg.layernorm_eps)
        gate, up = (y @ p[m + "mlp.fc1.weight"].t()).split(f, -1)
        x = x + (F.silu(gate) * up) @ p[m + "mlp.fc2.weight"].t()
    x = _rms(x, p["final_norm.weight"], cfg.layernorm_eps)
    out = p["output_layer.weight" if not cfg.tie_embeddings else "embedding.word.weight"][: cfg.vocab_size]
    logits = x @ out.t()
    return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1), reduction="none").view(b, s)


@pytest.mark.parametrize(
    "cfg",
    [
        LLAMA,
        LLAMA.replace(tie_embeddings=True),
        LLAMA.replace(rope_interleaved=True),
        LLAMA.replace(num_kv_heads=4),
        LLAMA.replace(num_kv_heads=1),
    ],
    ids=["gqa-untied", "tied", "interleaved", "mha", "mqa"],
)
def test_llama_loss_and_grads_match_plain_pytorch(single_world, cfg):
    torch.manual_seed(0)
    model = LlamaModel(cfg, seed=5)
    assert all(not n.endswith(".bias") for n, _ in model.named_parameters())
    with torch.no_grad():  # norms away from 1 so their gradients matter
        for n, prm in model.named_parameters():
            if "norm" in n:
                prm.add_(torch.randn_like(prm) * 0.2)
    ids, labels = torch.randint(0, 261, (3, cfg.seq_length)), torch.randint(0, 261, (3, cfg.seq_length))
    loss = model(ids, labels=labels)
    p = {k: v.detach().double().requires_grad_(True) for k, v in model.named_parameters()}
    ref = llama_reference(p, ids, labels, cfg)
    torch.testing.assert_close(loss.t().double(), ref, rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    ref.sum().backward()
    for name, prm in model.named_parameters():
        torch.testing.assert_close(prm.grad.double(), p[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_untied_output_layer_is_its_own_table(single_world):
    model = LlamaModel(LLAMA, seed=5)
    assert model.output_layer is not None and model.output_weight is model.output_layer.weight
    assert not torch.equal(model.output_layer.weight, model.embedding.word.weight)
    tied = LlamaModel(LLAMA.replace(tie_embeddings=True), seed=5)
    assert tied.output_layer is None and tied.output_weight is tied.embedding.word.weight


@pytest.mark.parametrize(
    "name,billions", [("llama3-1b", 1.24), ("llama3-8b", 8.03), ("llama2-7b", 6.74), ("mistral-7b", 7.24)]
)
def test_presets_have_the_published_sizes_on_the_meta_device(single_world, name, billions):
    cfg = PRESETS[name]
    n = sum(p.numel() for p in LlamaModel(cfg, seed=0, device="meta").parameters())
    assert abs(n / 1e9 - billions) / billions < 0.01, n


def test_flops_count_three_mlp_matrices_and_the_smaller_kv_projection():
    cfg = PRESETS["llama3-8b"]
    h, f, kv, l, s, V = (
        cfg.hidden_size,
        cfg.ffn_hidden_size,
        cfg.kv_size,
        cfg.num_layers,
        cfg.seq_length,
        cfg.vocab_size,
    )
    per_layer = 2 * (h * h + 2 * h * kv + h * h + 3 * h * f)
    expected = 3 * (l * per_layer + 4 * s * h * l + 2 * h * V)
    assert cfg.flops_per_token() == pytest.approx(expected, rel=1e-12)
    # 6 × the parameters that multiply (not the input embedding's lookup table) per token, plus attention
    params = l * (2 * h * h + 2 * h * kv + 3 * h * f) + V * h
    assert cfg.flops_per_token() == pytest.approx(6 * params + 12 * l * s * h, rel=1e-6)


def test_llama_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_heads=4 is not a multiple of num_kv_heads=3"):
        LLAMA.replace(num_kv_heads=3)
    with pytest.raises(ValueError, match="rotary embeddings need an even head_dim"):
        ModelConfig("llama", hidden_size=36, num_heads=4)
    with pytest.raises(ValueError, match="norm must be one of"):
        LLAMA.replace(norm="batchnorm")


def test_llama3_8b_at_32k_tokens_fits_eight_h200s_with_context_parallelism(tmp_path):
    """The dry run's memory per device for Llama-3-8B at seq 32768 on 8 GPUs (tp 2 × cp 4, bf16, ZeRO-1, SP) is
    under an H200's 141 GB, and context parallelism divides the activations by cp (those that grow with the
    tokens: measured with the unfused LM head, whose logits do; the fused head's chunk and dW sum do not, and it
    needs less)."""
    from megakernels_models.cli import parse_train_args
    from megakernels_models.planning.dryrun import report

    def run(*layout):
        return report(
            parse_train_args(
                [
                    "--preset",
                    "llama3-8b",
                    "--seq-length",
                    "32768",
                    "--nproc",
                    "8",
                    "--micro-batch-size",
                    "1",
                    "--global-batch-size",
                    "8",
                    "--precision",
                    "bf16",
                    "--distributed-optimizer",
                    "--sequence-parallel",
                    "--dry-run",
                    *layout,
                ]
            ),
            out=lambda s: None,
        )

    cp4, cp1 = run("--tp", "2", "--cp", "4"), run("--tp", "2", "--cp", "1")
    assert cp4["layout"]["cp"] == 4 and cp4["memory_per_device_bytes"] < 141e9
    assert cp4["parameters"] == pytest.approx(8.03e9, rel=0.01)
    unfused = [run("--tp", "2", "--cp", cp, "--no-fused-linear-ce") for cp in ("4", "1")]
    layers = [r["memory_breakdown_bytes"]["activations"] for r in unfused]
    assert layers[0] == pytest.approx(layers[1] / 4, rel=0.01)
    for fused, plain in zip((cp4, cp1), unfused):
        assert fused["memory_breakdown_bytes"]["activations"] < plain["memory_breakdown_bytes"]["activations"]


def test_mistral_preset_dry_runs_at_7_24_billion_with_its_window():
    from megakernels_models.cli import parse_train_args
    from megakernels_models.planning.dryrun import report

    lines = []
    rep = report(parse_train_args(["--preset", "mistral-7b", "--dry-run"]), out=lines.append)
    assert rep["parameters"] == pytest.approx(7.24e9, rel=0.005)
    assert "sliding window 4096" in lines[0]
    cfg = PRESETS["mistral-7b"]
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_hidden_size) == (
        32,
        4096,
        32,
        8,
        14336,
    )
    assert (cfg.vocab_size, cfg.seq_length, cfg.rope_theta, cfg.sliding_window) == (32000, 32768, 1e6, 4096)
    assert not cfg.tie_embeddings and cfg.norm == "rmsnorm" and cfg.layernorm_eps == 1e-5


def test_a_sliding_window_counts_attention_over_the_window_only():
    """FLOPs and the stored scores count min(window, s) keys per query."""
    cfg = PRESETS["mistral-7b"]
    full = cfg.replace(sliding_window=None)
    h, l, s, w = cfg.hidden_size, cfg.num_layers, cfg.seq_length, cfg.sliding_window
    assert full.forward_flops_per_token()["attention"] == 4.0 * s * h * l
    assert cfg.forward_flops_per_token()["attention"] == 4.0 * w * h * l
    assert cfg.replace(seq_length=1024).forward_flops_per_token()["attention"] == 4.0 * 1024 * h * l
    assert cfg.forward_flops_per_token()["layers_gemm"] == full.forward_flops_per_token()["layers_gemm"]
    scores = lambda c: c.activation_bytes_per_layer(1) - c.activation_bytes_per_layer(1, flash_attention=True)  # noqa: E731
    assert scores(full) == 5.0 * cfg.num_heads * s * s  # 5·a·s per token, s tokens, 2-byte elements
    assert scores(cfg) == 5.0 * cfg.num_heads * w * s


def test_sliding_window_setting_and_its_rules():
    from megakernels_models.arguments import ArgumentError, validate
    from megakernels_models.cli import parse_train_args

    assert LLAMA.sliding_window is None
    assert LLAMA.replace(sliding_window=64).sliding_window == 64
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="sliding_window"):
            LLAMA.replace(sliding_window=bad)
    args = lambda *f: parse_train_args(["--preset", "mistral-7b", *f, "--dry-run"])  # noqa: E731
    assert args().model_config().sliding_window == 4096
    assert args("--sliding-window", "1024").model_config().sliding_window == 1024
    assert args("--sliding-window", "0").model_config().sliding_window is None  # 0: every position
    llama = parse_train_args(["--preset", "llama-tiny", "--sliding-window", "64", "--dry-run"]).model_config()
    assert llama.sliding_window == 64 and llama.rope_theta == PRESETS["llama-tiny"].rope_theta
    with pytest.raises(ArgumentError, match="--sliding-window must be an int >= 0"):
        validate(parse_train_args(["--preset", "llama-tiny", "--sliding-window", "-3", "--dry-run"]))
