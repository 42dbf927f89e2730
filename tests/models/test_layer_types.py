"""Per-layer attention types (``ModelConfig.layer_types``: sliding and full layers, each with its window and rotary
base) and attention sinks (``sinks``: a learnable fp32 logit per head and layer) in the layer stack, against a plain
fp64 PyTorch Llama written out here with each layer's own window, rotary base and sink column; the FLOP count of
windowed layers against the band they attend; the parameters the sinks add; the configuration's rules."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megakernels_models.models.config import ModelConfig
from megakernels_models.models.llama.model import LlamaModel
from tests.models.test_llama import LLAMA, _rms, _rotate

TYPES = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
MIXED = LLAMA.replace(num_layers=4, sliding_window=5, layer_types=TYPES, local_rope_theta=30.0, sinks=True)


def reference(p, ids, labels, cfg):
    """Per-token loss [b, s] of a Llama with parameters ``p`` (our names, fp64) whose layer i attends causally within
    ``cfg.layer_window(i)`` (every key when None) with rotary base ``local_rope_theta`` on sliding layers and
    ``rope_theta`` on full ones, and (with sinks) one more score column per head, ``attention.sinks``, of value 0."""
    b, s = ids.shape
    n, kv, d, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_hidden_size
    pos = torch.arange(s)
    x = p["embedding.word.weight"][ids]
    for i in range(cfg.num_layers):
        m = f"layers.{i}."
        sliding = cfg.layer_types[i] == "sliding_attention"
        theta = cfg.local_rope_theta if sliding and cfg.local_rope_theta is not None else cfg.rope_theta
        rel = pos[:, None] - pos[None, :]  # how far key j lies behind query i
        hidden = (rel < 0) | ((rel >= cfg.sliding_window) if sliding else torch.zeros_like(rel, dtype=torch.bool))
        y = _rms(x, p[m + "input_norm.weight"], cfg.layernorm_eps)
        q = (y @ p[m + "attention.q.weight"].t()).view(b, s, n, d)
        k, v = (y @ p[m + "attention.kv.weight"].t()).view(b, s, 2, kv, d).unbind(2)
        q, k = (_rotate(t, pos, theta, False) for t in (q, k))
        k, v = k.repeat_interleave(n // kv, 2), v.repeat_interleave(n // kv, 2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(hidden, float("-inf"))
        if cfg.sinks:
            scores = torch.cat((scores, p[m + "attention.sinks"][None, :, None, None].expand(b, n, s, 1)), -1)
        probs = scores.softmax(-1)[..., :s]
        ctx = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, n * d)
        x = x + ctx @ p[m + "attention.proj.weight"].t()
        y = _rms(x, p[m + "post_attention_norm.weight"], cfg.layernorm_eps)
        gate, up = (y @ p[m + "mlp.fc1.weight"].t()).split(f, -1)
        x = x + (F.silu(gate) * up) @ p[m + "mlp.fc2.weight"].t()
    x = _rms(x, p["final_norm.weight"], cfg.layernorm_eps)
    logits = x @ p["output_layer.weight"][: cfg.vocab_size].t()
    return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1), reduction="none").view(b, s)


@pytest.mark.parametrize("attention", ["flash", "torch"])
@pytest.mark.parametrize(
    "cfg", [MIXED, MIXED.replace(sinks=False), MIXED.replace(local_rope_theta=None)], ids=["sinks", "no-sinks", "theta"]
)
def test_alternating_layers_match_the_hand_built_reference(single_world, cfg, attention):
    """Every parameter's gradient too, the sinks' included (set away from their zero start so that they matter)."""
    torch.manual_seed(0)
    model = LlamaModel(cfg, seed=5, attention=attention)
    windows = [layer.attention.window for layer in model.layers]
    assert windows == [5, None, 5, None]
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "norm" in name:
                prm.add_(torch.randn_like(prm) * 0.2)
            if name.endswith("attention.sinks"):
                assert prm.dtype == torch.float32 and prm.shape == (4,) and not prm.any()  # zero at the start
                prm.copy_(torch.randn(4) * 2)
    ids, labels = torch.randint(0, 261, (3, 16)), torch.randint(0, 261, (3, 16))
    loss = model(ids, labels=labels)
    p = {k: v.detach().double().requires_grad_(True) for k, v in model.named_parameters()}
    ref = reference(p, ids, labels, cfg)
    torch.testing.assert_close(loss.t().double(), ref, rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    ref.sum().backward()
    names = [name for name, _ in model.named_parameters()]
    assert sum(name.endswith("attention.sinks") for name in names) == (4 if cfg.sinks else 0)
    for name, prm in model.named_parameters():
        torch.testing.assert_close(prm.grad.double(), p[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_sinks_are_counted_and_trained_like_any_parameter(single_world):
    plain = LlamaModel(MIXED.replace(sinks=False), seed=5, device="meta")
    sunk = LlamaModel(MIXED, seed=5, device="meta")
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(sunk) - count(plain) == MIXED.num_layers * MIXED.num_heads
    model = LlamaModel(MIXED, seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ids = torch.randint(0, 261, (2, 16))
    model(ids, labels=ids).mean().backward()
    opt.step()
    sinks = [p for name, p in model.named_parameters() if name.endswith("attention.sinks")]
    assert len(sinks) == 4 and all(s.abs().sum() > 0 for s in sinks)  # a step moves them off zero


def test_a_windowed_layer_costs_its_band():
    """A layer's attention FLOPs are ``4 · q`` per key each query attends: a sliding layer's band (``min(w, s)``
    keys a query), a full layer's whole sequence (the paper's square). With every layer sliding, layer_types gives
    the model-wide ``sliding_window``'s count; without windows, the full model's."""
    cfg = MIXED.replace(seq_length=64, sliding_window=10)
    s, q, w = 64, cfg.q_size, 10
    band = s * min(w, s)  # (query, key) pairs of a windowed layer's band over one sequence
    square = s * s
    attention = cfg.forward_flops_per_token()["attention"]
    assert attention == 4 * q * (2 * band + 2 * square) / s
    everywhere = cfg.replace(layer_types=("sliding_attention",) * 4, local_rope_theta=None)
    model_wide = cfg.replace(layer_types=None, local_rope_theta=None)
    assert everywhere.forward_flops_per_token() == model_wide.forward_flops_per_token()
    assert model_wide.forward_flops_per_token()["attention"] == 4 * q * 4 * band / s
    full = cfg.replace(layer_types=("full_attention",) * 4, local_rope_theta=None)
    assert full.forward_flops_per_token()["attention"] == 4 * q * 4 * square / s
    # the window caps at the sequence: a window longer than it is the square
    assert cfg.replace(sliding_window=1000).forward_flops_per_token()["attention"] == 4 * q * 4 * square / s
    # the scores' activation memory follows the layers' mean attended keys
    assert cfg.attended_keys == (2 * w + 2 * s) / 4


def test_layer_types_round_trip_through_a_checkpoint_dict_and_a_config_file():
    import dataclasses

    from megakernels_models.config_file import dump

    stored = dataclasses.asdict(MIXED)
    stored["layer_types"] = list(stored["layer_types"])  # as JSON reads it back
    assert ModelConfig.from_dict(stored) == MIXED and isinstance(MIXED.layer_types, tuple)
    assert "sliding_attention" in dump({"architecture": {"layer_types": list(MIXED.layer_types)}})


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(layer_types=("full_attention",) * 3), "layer_types has 3 entries, expected one for each of the"),
        (dict(layer_types=("full_attention", "local") * 2), "layer_types entries must be one of"),
        (dict(layer_types="full_attention"), "layer_types must be a list of"),
        (dict(sliding_window=None), "sliding_attention layers, which need sliding_window"),
        (dict(layer_types=None), "local_rope_theta and local_rope_scaling .* need layer_types"),
        (dict(local_rope_theta=1.0), "local_rope_theta must be > 1"),
    ],
)
def test_bad_layer_types_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        MIXED.replace(**changes)


def test_local_rope_scaling_applies_to_the_full_layers_only_when_asked():
    cfg = MIXED.replace(rope_scaling="linear", rope_scaling_factor=4.0, local_rope_scaling=False)
    assert cfg.layer_rope(0) == (30.0, None)
    assert cfg.layer_rope(1)[0] == 500.0 and cfg.layer_rope(1)[1].factor == 4.0
    assert MIXED.replace(rope_scaling="linear", rope_scaling_factor=4.0).layer_rope(0)[1].factor == 4.0
    with pytest.raises(ValueError, match="need position_embedding='rope'"):
        ModelConfig("gpt", num_layers=2, layer_types=("full_attention",) * 2, local_rope_theta=20.0)


def test_a_config_file_with_layer_types_and_sinks_reprints_and_plans(tmp_path, capsys):
    """An architecture with per-layer types and sinks in a config file: ``--print-config`` writes a file that
    gives the same model, and the dry run plans it with the sinks counted and each layer's attention FLOPs."""
    import dataclasses

    import yaml

    from megakernels_models.cli import main, parse_train_args
    from megakernels_models.models.config import PRESETS
    from megakernels_models.planning.dryrun import report

    base = PRESETS["llama-tiny"]
    arch = {**dataclasses.asdict(base), "sliding_window": 64, "local_rope_theta": 1000.0, "sinks": True}
    arch["layer_types"] = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"architecture": arch, "steps": 2, "global-batch-size": 8}))
    assert main(["train", "--config", str(job), "--print-config"]) == 0
    (tmp_path / "again.yaml").write_text(capsys.readouterr().out)
    args = parse_train_args(["--config", str(tmp_path / "again.yaml"), "--dry-run"])
    from megakernels_models.arguments import validate

    cfg = validate(args, check_outputs=False)
    assert cfg.layer_types == tuple(arch["layer_types"]) and cfg.sinks and cfg.local_rope_theta == 1000.0
    lines = []
    rep = report(args, cfg, out=lines.append)
    assert "3 sliding-window (64) and 1 full attention layers, attention sinks" in lines[0]
    plain_args = parse_train_args(["--preset", "llama-tiny", "--global-batch-size", "8", "--dry-run"])
    plain = report(plain_args, out=lambda line: None)
    assert rep["parameters"] - plain["parameters"] == base.num_layers * base.num_heads
    tokens = 8 * base.seq_length
    s, q = base.seq_length, base.q_size
    saved = 3 * 4 * q * 3 * (s - 64) * tokens  # three sliding layers attend 64 keys a query instead of s (fwd + bwd)
    assert plain["flops_per_step"] - rep["flops_per_step"] == pytest.approx(saved, rel=1e-12)
