"""The trainer with ``--optimizer muon``: every layout equals the fp64 single-process reference step by step (fp32,
20 steps; ``muon_reference``), a resumed run continues bit for bit, checkpoints reshard across layouts, the memory
the run measures is the one the dry run predicts.

The layouts — tp 2 × dp 2 with ZeRO-1 (TP-split matrices gathered to their owner), pp 2 × dp 2 with ZeRO-1,
FSDP2 over 2 ranks × tp 2, the mixture-of-experts Llama at ep 2 × dp 4 with ZeRO-1 (each expert's matrices on their
own), ``--muon-tp-mode shard`` at tp 2 (against the reference orthogonalising per TP shard), and a checkpoint saved
at tp 2 × dp 2 (step 10) resumed under FSDP2 there and in one process, and MuonClip at tp 2 × dp 2 with ZeRO-1
against the single process with it — run in one spawned world of 4; tp 4 (Llama's key/value heads replicated over
pairs of ranks) in one of its own, under the ``slow`` marker."""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import tempfile

import pytest
import torch

from megakernels.parallel.launch import single_process_world
from megakernels_models.arguments import TrainArgs
from tests.models import muon_reference
from tests.parallel.harness import run_world

STEPS = 20
RTOL = 1e-5
LLAMA = dict(num_kv_heads=2, ffn_hidden_size=48, rope_theta=1000.0)
BASE = TrainArgs(
    preset=None,
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    seq_length=16,
    dropout=0.0,
    steps=STEPS,
    micro_batch_size=2,
    global_batch_size=8,
    lr=5e-3,
    min_lr=5e-4,
    warmup_steps=2,
    clip_grad=0.5,
    eval_interval=0,
    progress=False,
    corpus_bytes=1 << 18,
    seed=7,
    timeout=120,
    optimizer="muon",
)
MOE = dict(num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
CLIP_TAU = 0.08
FAMILY = {"gpt": ("gpt", {}), "llama": ("llama", LLAMA), "llama-moe": ("llama", {**LLAMA, **MOE})}
LAYOUTS = {
    "tp2-dp2-zero1": ("llama", dict(tp=2, distributed_optimizer=True)),
    "pp2-dp2-zero1": ("gpt", dict(pp=2, distributed_optimizer=True)),
    "fsdp2-tp2": ("gpt", dict(fsdp=True, tp=2)),
    "ep2-dp4-zero1": ("llama-moe", dict(ep=2, distributed_optimizer=True)),  # experts' owners over their dp pair
    "tp2-dp2-shard": ("llama", dict(tp=2, muon_tp_mode="shard")),  # against the reference's per-shard form
    # MuonClip on the grouped-query Llama, against the single process with it (tau: below its largest logits)
    "tp2-dp2-zero1-clip": ("llama", dict(tp=2, distributed_optimizer=True, muon_clip_tau=CLIP_TAU)),
}
CLIPPED = {"tp2-dp2-zero1-clip"}
# the slow set (``-m slow``): a world of its own
SLOW_LAYOUTS = {"tp4-kv-replicated": ("llama", dict(tp=4))}  # key/value heads replicated over pairs of TP ranks
SHARDED = {"tp2-dp2-shard": 2}  # layouts whose reference orthogonalises per shard of this many TP ranks
SAVE_AT = 10
CKPT = tempfile.mkdtemp(prefix="megakernels-muon-")
atexit.register(shutil.rmtree, CKPT, ignore_errors=True)


def _args(model: str, **changes) -> TrainArgs:
    family, extra = FAMILY[model]
    return dataclasses.replace(BASE, model=family, **extra, **changes)


def _curve(records) -> tuple[list[float], list[float]]:
    return [r["loss"] for r in records], [r["grad_norm"] for r in records]


def _assert_curve(got, ref, what: str, start: int = 0) -> None:
    (losses, norms), (ref_losses, ref_norms) = got, ref
    assert len(losses) == len(ref_losses) - start, what
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    torch.testing.assert_close(t(losses), t(ref_losses[start:]), rtol=RTOL, atol=0, msg=lambda m: f"{what}: {m}")
    torch.testing.assert_close(t(norms), t(ref_norms[start:]), rtol=1e-4, atol=0, msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def references():
    out = {model: muon_reference.run(_args(model), STEPS) for model in FAMILY}
    for name, tp in SHARDED.items():
        out[name] = muon_reference.run(_args(LAYOUTS[name][0]), STEPS, tp_shards=tp)
    return out


def _world(rank: int, world_size: int, root: str, layouts=None) -> dict:
    from megakernels_models.training.train import train

    out = {}
    for name, (model, changes) in (layouts or LAYOUTS).items():
        if name == "tp2-dp2-zero1":
            changes = dict(changes, save=os.path.join(root, model), save_interval=SAVE_AT, keep_checkpoints=3)
        records = train(_args(model, nproc=world_size, **changes))
        if records is not None:
            out[name] = _curve(records)
            out[("memory", name)] = records[0]["memory_per_param_bytes"]
            out[("clip", name)] = [(r.get("max_logit"), r.get("clipped_heads")) for r in records]
    if layouts is not None:
        return out
    point = os.path.join(root, "llama", f"step-{SAVE_AT:08d}")
    records = train(_args("llama", nproc=world_size, fsdp=True, tp=2, load=point))
    if records is not None:
        out["resharded"] = _curve(records)
    return out


@pytest.fixture(scope="module")
def world():
    return run_world(4, _world, CKPT, timeout=900)[-1]  # the last rank logs


@pytest.fixture(scope="module")
def slow_world():
    return run_world(4, _world, CKPT, SLOW_LAYOUTS, timeout=900)[-1]


@pytest.mark.parametrize("model", list(FAMILY))
def test_single_process_equals_the_fp64_reference(references, model):
    from megakernels_models.training.train import train

    with single_process_world():
        got = _curve(train(_args(model)))
    _assert_curve(got, references[model], f"{model} in one process")
    assert got[0][-1] < got[0][0] - 0.5


@pytest.fixture(scope="module")
def clipped_single():
    """The single process's curve and clipping log with MuonClip (no fp64 reference holds it)."""
    from megakernels_models.training.train import train

    with single_process_world():
        records = train(_args("llama", muon_clip_tau=CLIP_TAU))
    return _curve(records), [(r["max_logit"], r["clipped_heads"]) for r in records]


def test_muon_clip_equals_the_single_process(clipped_single, world):
    curve, clips = clipped_single
    assert sum(n for _, n in clips) > 0 and max(m for m, _ in clips) > CLIP_TAU  # it clipped
    name = "tp2-dp2-zero1-clip"
    _assert_curve(world[name], curve, f"llama at {name}")
    got = world[("clip", name)]
    assert [n for _, n in got] == [n for _, n in clips]
    torch.testing.assert_close(
        torch.tensor([m for m, _ in got]), torch.tensor([m for m, _ in clips]), rtol=1e-5, atol=0
    )


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n not in CLIPPED])
def test_layout_equals_the_fp64_reference(references, world, name):
    model = LAYOUTS[name][0]
    _assert_curve(world[name], references[name if name in SHARDED else model], f"{model} at {name}")
    if name in SHARDED:  # an approximation: not the whole matrices' steps
        assert world[name][0][-1] != pytest.approx(references[model][0][-1], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_LAYOUTS))
def test_slow_layout_equals_the_fp64_reference(references, slow_world, name):
    model = SLOW_LAYOUTS[name][0]
    _assert_curve(slow_world[name], references[model], f"{model} at {name}")


def test_checkpoint_reshards(references, world):
    """Saved at tp 2 × dp 2 with ZeRO-1 (step 10): resumed under FSDP2 × tp 2 in the world and in one process,
    steps 11..20 follow the reference."""
    from megakernels_models.training.train import train

    _assert_curve(world["resharded"], references["llama"], "tp2-dp2 -> fsdp2-tp2", SAVE_AT)
    with single_process_world():
        got = _curve(train(_args("llama", load=os.path.join(CKPT, "llama", f"step-{SAVE_AT:08d}"))))
    _assert_curve(got, references["llama"], "tp2-dp2 -> one process", SAVE_AT)


def test_zero1_owns_whole_matrices(world):
    """ZeRO-1 over dp 2 (fp32): 4 bytes of weights and 4 of gradients per parameter, and the optimizer state split
    over the two ranks: Muon's momentum (4 bytes) for the matrices a rank owns, AdamW's moments for its shard of
    the rest — about half of the single process's."""
    mem = world[("memory", "tp2-dp2-zero1")]
    with single_process_world():
        from megakernels_models.training.train import train

        one = train(_args("llama", steps=1, warmup_steps=0))[0]["memory_per_param_bytes"]
    assert one["optimizer"] < 8.0  # Muon's matrices hold one buffer, not two
    assert mem["optimizer"] == pytest.approx(one["optimizer"] / 2, rel=0.15)


def test_resume_is_bit_exact(tmp_path):
    from megakernels_models.training.train import train

    with single_process_world():
        whole = _curve(train(_args("llama", steps=6)))
    with single_process_world():
        train(_args("llama", steps=6, save=str(tmp_path), save_interval=3, exit_interval=3))
    with single_process_world():
        resumed = _curve(train(_args("llama", steps=6, load=str(tmp_path))))
    assert resumed[0] == whole[0][3:] and resumed[1] == whole[1][3:]


def test_dry_run_counts_one_momentum_for_the_matrices():
    """gpt-1.2b in bf16: AdamW's 12 bytes (fp32 master, two moments) per parameter become 8 (master, momentum) for
    the 12·h² hidden-matrix parameters of each layer; ZeRO-1 over dp 4 divides both."""
    from megakernels_models.cli import parse_train_args
    from megakernels_models.planning.dryrun import report

    argv = ["--preset", "gpt-1.2b", "--precision", "bf16", "--optimizer", "muon", "--dry-run"]
    for extra, dp in (([], 1), (["--nproc", "4", "--distributed-optimizer", "--global-batch-size", "32"], 4)):
        args = parse_train_args(argv + extra)
        rep = report(args, out=lambda s: None)
        cfg = args.model_config()
        n = rep["parameters_per_device"]
        matrices = cfg.num_layers * 12 * cfg.hidden_size**2
        assert rep["memory_breakdown_bytes"]["optimizer"] == pytest.approx((12 * (n - matrices) + 8 * matrices) / dp)
        assert rep["layout"]["optimizer"] == "muon"


def test_the_dry_run_predicts_the_measured_state():
    """The tiny Llama (fp32, one process): the optimizer bytes per parameter the trainer measures on its tensors are
    the dry run's."""
    from megakernels_models.planning.dryrun import report
    from megakernels_models.training.train import train

    args = _args("llama", steps=1, warmup_steps=0)
    with single_process_world():
        measured = train(args)[0]["memory_per_param_bytes"]
    rep = report(dataclasses.replace(args, dry_run=True), out=lambda s: None)
    predicted = rep["memory_breakdown_bytes"]["optimizer"] / rep["parameters_per_device"]
    assert measured["optimizer"] == pytest.approx(predicted, rel=1e-9)


def test_the_planner_adds_newton_schulz_to_the_step():
    """gpt-1.2b: per layer and iteration, Q, K, V and the output projection ([h, h]: 3h³ + h³ each) and the MLP's
    [4h, h] and [h, 4h] (3h²·4h + h³ each) — 42h³ FLOPs — at the 16-bit peak × efficiency, over tp and dp owners."""
    from megakernels_models.cli import parse_train_args
    from megakernels_models.planning import costs

    args = parse_train_args(["--preset", "gpt-1.2b", "--precision", "bf16", "--dry-run"])
    cfg = args.model_config()
    meta = costs.MetaModel(cfg)
    h, steps = cfg.hidden_size, 5
    assert costs.muon_ns_flops(meta, 1, 1, "interleaved", steps) == [pytest.approx(cfg.num_layers * steps * 42 * h**3)]
    device = costs.DEVICES["h100"]
    adamw = costs.Layout(tp=2, dp=4, global_batch_size=64, micro_batch_size=2, distributed_optimizer=True)
    muon = dataclasses.replace(adamw, optimizer="muon")
    extra = (
        costs.compute_parts(meta, muon, device)["optimizer_s"] - costs.compute_parts(meta, adamw, device)["optimizer_s"]
    )
    rate = device.tflops_16 * 1e12 * costs.gemm_efficiency(cfg, muon, device)
    assert extra == pytest.approx(cfg.num_layers * steps * 42 * h**3 / (2 * 4) / rate)
