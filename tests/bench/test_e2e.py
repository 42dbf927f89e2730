"""``megakernels bench --e2e``: the trainer measured on a layout (tokens/s, TFLOP/s, MFU, peak memory, the time
split) beside the one-device eager-PyTorch baseline (GPT or Llama); the eager models are the megakernels models
(equal losses in fp32, before and during training; the eager Llama also equals transformers' LlamaForCausalLM);
and the trainer's optional step timers."""

from __future__ import annotations

import json

import pytest
import torch

from megakernels.parallel.launch import single_process_world
from megakernels_models.bench import e2e, eager_gpt
from megakernels_models.cli import main
from megakernels_models.models.config import preset
from megakernels_models.training.timers import FIELDS, PHASES, StepTimers

# Small models with weights large enough (init_std 0.2) that attention is far from uniform: a wrong causal mask,
# rotary convention or key/value head mapping changes the loss by percents, not by 1e-6.
SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, seq_length=32, dropout=0.0, attention_dropout=0.0, init_std=0.2)
SMALL_CONFIGS = {
    "gpt": lambda: preset("gpt-tiny", **SMALL),
    "llama": lambda: preset("llama-tiny", **SMALL, num_kv_heads=2, ffn_hidden_size=176),
    "llama-tied": lambda: preset("llama-tiny", **SMALL, num_kv_heads=2, ffn_hidden_size=176, tie_embeddings=True),
}


def _perturb_norms(model):
    """Norm weights (and biases) away from their initial 1 (0), so that copying them is tested too."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.parametrize("name", list(SMALL_CONFIGS))
def test_eager_model_is_the_megakernels_model_in_fp32(name):
    """Same loss to ~1e-7 (asserted 1e-5) at the copied weights, and the same losses over training steps of
    FusedAdamW and torch.optim.AdamW (equal hyperparameters)."""
    from megakernels.optim import FusedAdamW

    cfg = SMALL_CONFIGS[name]()
    fused_cls, eager_cls = eager_gpt.FAMILIES[cfg.model][:2]
    with single_process_world("cpu", parallel=True):
        fused = fused_cls()(cfg, seed=11)
        _perturb_norms(fused)
        eager = eager_cls(cfg)
        eager_gpt.copy_weights(eager, fused)
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
        labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
        labels[0, :3] = -100  # ignored by both
        fused_opt = FusedAdamW(fused.parameters(), lr=1e-3, weight_decay=0.1)
        eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3, weight_decay=0.1)
        ours, theirs = [], []
        for _ in range(4):
            for opt, losses, loss in (
                (fused_opt, ours, lambda: fused(ids, labels=labels).float().sum() / (labels != -100).sum()),
                (eager_opt, theirs, lambda: eager(ids, labels)),
            ):
                opt.zero_grad(set_to_none=True)
                value = loss()
                value.backward()
                opt.step()
                losses.append(value.item())
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5)
    assert ours == pytest.approx(theirs, rel=1e-4)
    assert theirs[-1] < theirs[0] - 0.1  # the steps did train


def test_eager_llama_equals_transformers_llama():
    """An independent reference for the eager Llama's conventions (half-rotation RoPE of base theta, key/value head
    i serving query heads i·g .. i·g+g-1, RMSNorm eps, gate/up/down): transformers' LlamaForCausalLM with the
    same weights gives the same loss."""
    import torch.nn.functional as F
    import transformers

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=261,
        max_position_embeddings=32,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        attn_implementation="eager",
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    _perturb_norms(hf)
    cfg = preset("llama-tiny", **SMALL, num_kv_heads=2, ffn_hidden_size=176, rope_theta=5000.0)
    eager = eager_gpt.EagerLlama(cfg)
    hp = dict(hf.named_parameters())
    names = dict(
        attn_norm="input_layernorm",
        q="self_attn.q_proj",
        k="self_attn.k_proj",
        v="self_attn.v_proj",
        o="self_attn.o_proj",
        mlp_norm="post_attention_layernorm",
        gate="mlp.gate_proj",
        up="mlp.up_proj",
        down="mlp.down_proj",
    )
    with torch.no_grad():
        eager.tok.weight.copy_(hp["model.embed_tokens.weight"])
        eager.norm.weight.copy_(hp["model.norm.weight"])
        eager.head.weight.copy_(hp["lm_head.weight"])
        for i, blk in enumerate(eager.blocks):
            for ours, theirs in names.items():
                blk[ours].weight.copy_(hp[f"model.layers.{i}.{theirs}.weight"])
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
        labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
        logits = hf(ids).logits
        expected = F.cross_entropy(logits.double().reshape(-1, cfg.vocab_size), labels.reshape(-1)).item()
        assert eager(ids, labels).item() == pytest.approx(expected, rel=1e-5)


def test_e2e_takes_gpt_and_llama_presets_only():
    cfg, _ = e2e.model_config("llama-tiny", "cpu")
    assert cfg.model == "llama" and (cfg.num_kv_heads, cfg.ffn_hidden_size, cfg.vocab_size) == (2, 704, 261)
    with pytest.raises(ValueError, match="--e2e: bert-tiny is a bert model"):
        e2e.model_config("bert-tiny", "cpu")
    with pytest.raises(ValueError, match="--e2e: qwen-tiny is a qwen model"):
        e2e.model_config("qwen-tiny", "cpu")
    ns = _namespace(e2e="llama-moe-tiny", quick=False, pp=1, no_baseline=False)
    with pytest.raises(ValueError, match="--e2e: llama-moe-tiny has no eager baseline: mixture-of-experts"):
        e2e.prepare(ns)
    # the trainer trains the model the baseline measures: a Llama preset, a quick Llama, a CPU-sized GPT
    for name in ("llama-tiny", "gpt-cpu-s256"):
        ns = _namespace(e2e=name, quick=False, pp=1)
        ((_, cfg, mbs, targs),) = e2e.prepare(ns)
        assert targs.model == cfg.model and targs.model_config() == cfg
    ns = _namespace(e2e="llama-tiny", quick=True, pp=1)
    ((name, cfg, _, targs),) = e2e.prepare(ns)
    assert name == e2e.QUICK_LLAMA and targs.model == "llama" and targs.model_config() == cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads) == (2, 64, 2)


def test_quick_llama_e2e_reports_the_eager_llama(tmp_path, capsys):
    assert main(["bench", "--e2e", "llama-tiny", "--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "eager Llama (PyTorch)" in printed and "megakernels LlamaModel" in printed and "GPT" not in printed
    assert "a4 kv2 s32" in printed
    (entry,) = json.loads((tmp_path / "bench.json").read_text())["e2e"]
    assert entry["model"] == "llama" and entry["baseline"]["model"] == "llama"
    assert entry["trainer"]["tokens_per_s"] > 0 and entry["baseline"]["eager"]["tokens_per_s"] > 0


def test_quick_e2e_reports_the_trainer_and_the_baseline(tmp_path, capsys):
    assert main(["bench", "--e2e", "gpt-tiny", "--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "megakernels train" in printed and "eager GPT (PyTorch)" in printed and "trainer step split" in printed
    (entry,) = json.loads((tmp_path / "bench.json").read_text())["e2e"]
    t = entry["trainer"]
    assert t["steps"] == 2 and t["tokens_per_s"] > 0 and t["tflops_per_device"] > 0 and 0 < t["mfu"]
    assert set(t["time_split_s"]) == set(PHASES) and t["time_split_s"]["forward"] > 0
    assert sum(t["time_split_s"].values()) == pytest.approx(t["time_split_per_rank_s"][0]["total"], rel=1e-6)
    assert len(t["peak_memory_bytes_per_rank"]) == 1 and t["peak_memory_bytes_per_rank"][0] > 0
    assert t["layout"]["microbatches"] == 1 and t["schedule_bubble_fraction"] == 0.0
    base = entry["baseline"]
    assert base["eager"]["tokens_per_s"] > 0 and base["speedup"] > 0


def test_pipeline_layout_measures_the_bubble_on_every_rank(capsys):
    assert main(["bench", "--e2e", "gpt-tiny", "--quick", "--pp", "2", "--no-baseline"]) == 0
    out = capsys.readouterr().out
    assert "tp1 pp2 dp1, b2x4" in out and "peak memory per rank" in out
    assert "ideal bubble fraction 0.250" in out


def _namespace(**kw):
    from argparse import Namespace

    fields = dict(
        e2e="gpt-tiny",
        device="cpu",
        quick=True,
        precision=None,
        tp=1,
        pp=2,
        vpp=None,
        dp=None,
        nproc=None,
        micro_batch_size=None,
        global_batch_size=None,
        steps=2,
        warmup=1,
        sequence_parallel=False,
        distributed_optimizer=False,
        recompute="none",
        schedule="1f1b",
        attention="flash",
        peak_tflops=1.0,
        no_baseline=True,
        no_trainer=False,
    )
    return Namespace(**{**fields, **kw})


def test_e2e_json_has_one_entry_per_rank(tmp_path):
    ns = _namespace()
    (entry,) = e2e.run(ns, log=lambda s: None)
    t = entry["trainer"]
    assert len(t["time_split_per_rank_s"]) == 2 and len(t["peak_memory_bytes_per_rank"]) == 2
    assert all(r["bubble"] > 0 for r in t["time_split_per_rank_s"])  # each stage waits for the other
    assert t["device_peak_tflops"] == pytest.approx(1.0)


def test_disabled_timers_change_nothing():
    timers = StepTimers(False, torch.device("cpu"))

    def f():
        return 1

    assert timers.wrap_forward(f) is f and timers.exchange_hook is None
    rec = {}
    timers.start(), timers.mark("pipeline"), timers.finish(rec)
    assert rec == {}


class FakeClock:
    """A host clock the test advances: each phase takes exactly the time the test says."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_enabled_timers_split_a_step_into_phases():
    clock = FakeClock()
    timers = StepTimers(True, torch.device("cpu"), clock=clock)
    fwd = timers.wrap_forward(lambda: clock.advance(0.02))
    exchange = timers.exchange_hook(lambda: clock.advance(0.01))  # what the pipeline executor wraps
    timers.start()
    fwd()
    exchange()
    clock.advance(0.01)  # "backward"
    timers.mark("pipeline")
    clock.advance(0.01)
    timers.mark("communication")
    timers.mark("optimizer")
    rec = {}
    timers.finish(rec)
    (mine,) = rec["step_timers"]["per_rank"]
    v = dict(zip(rec["step_timers"]["fields"], mine))
    assert list(rec["step_timers"]["fields"]) == list(FIELDS)
    phases = {p: v[p] for p in ("forward", "backward", "bubble", "communication", "optimizer")}
    assert phases == pytest.approx(
        {"forward": 0.02, "backward": 0.01, "bubble": 0.01, "communication": 0.01, "optimizer": 0.0}, abs=1e-9
    )
    assert v["total"] == pytest.approx(0.05) == pytest.approx(sum(v[p] for p in PHASES)) and v["peak_memory_bytes"] > 0
    fwd()  # outside a step: not counted
