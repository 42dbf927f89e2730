"""``megakernels train --dpo``: the first step's loss and logged rewards are the DPO of the policy and reference
models computed here from their full fp64 log-softmax (sigmoid with label smoothing, IPO, hinge); the reference's
sums precomputed once give the same curve as computed in each step; and every layout's curve equals the single
process's (tensor and sequence parallelism, 1F1B, zb-h1, zb-v and interleaved pipelines, ZeRO-1 and its offload,
FSDP2, context parallelism), each world size one spawned world that trains its layouts in turn. Bad combinations
are refused naming the flag."""

from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest
import torch
import torch.nn.functional as F

from megakernels.parallel.launch import single_process_world
from megakernels_models.arguments import ArgumentError, TrainArgs, validate
from tests.parallel.harness import run_world

STEPS = 6
RTOL = 1e-5
BASE = TrainArgs(
    model="llama",
    preset=None,
    num_layers=4,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=48,
    seq_length=32,
    dropout=0.0,
    steps=STEPS,
    micro_batch_size=2,
    global_batch_size=8,
    lr=5e-3,
    min_lr=5e-4,
    warmup_steps=2,
    clip_grad=0.5,
    eval_interval=0,
    split="1,0,0",
    progress=False,
    seed=7,
    timeout=120,
    dpo=True,
)
# name: (world size, changes)
LAYOUTS = {
    "tp2-sp": (2, dict(tp=2, sequence_parallel=True)),
    "pp2": (2, dict(pp=2)),
    "pp2-zb-v": (2, dict(pp=2, schedule="zb-v")),
    "pp2-zb-h1": (2, dict(pp=2, schedule="zb-h1")),
    "dp2-zero1": (2, dict(distributed_optimizer=True)),
    "dp2-zero1-offload": (2, dict(distributed_optimizer=True, offload_optimizer=True)),
    "cp2": (2, dict(cp=2)),
    "fsdp2": (2, dict(fsdp=True)),
    "dp2-precompute": (2, dict(precompute_ref=True)),
    "tp2-pp2-vpp2": (4, dict(tp=2, pp=2, vpp=2)),
    "tp2-cp2-sp": (4, dict(tp=2, cp=2, sequence_parallel=True)),
}


def _pairs(path: str) -> None:
    """Single-digit sums: the right answer is chosen, a wrong one rejected."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for k in range(48):
            a, b = rng.randrange(10), rng.randrange(10)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1 + k % 3)}))
            f.write("\n")


def _args(root: str, nproc: int = 1, **changes) -> TrainArgs:
    given = dict(data=os.path.join(root, "pairs"), dpo_ref=os.path.join(root, "ref"), nproc=nproc)
    return dataclasses.replace(BASE, **{**given, **changes})


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    """The preference data, and the reference: the policy's architecture from another seed, trained two steps."""
    from megakernels_models.data.preference import preprocess_preference
    from megakernels_models.training.train import train

    root = str(tmp_path_factory.mktemp("dpo"))
    _pairs(os.path.join(root, "pairs.jsonl"))
    preprocess_preference([os.path.join(root, "pairs.jsonl")], os.path.join(root, "pairs"), "byte")
    with single_process_world():
        train(_args(root, dpo_ref=None, seed=8, steps=2, warmup_steps=0, lr=5e-2, save=os.path.join(root, "ref")))
    return root


def _curve(records) -> tuple[list[float], list[float], list[float]]:
    return [r["loss"] for r in records], [r["grad_norm"] for r in records], [r["reward_margin"] for r in records]


def _train_cases(rank: int, world_size: int, root: str, names):
    from megakernels_models.training.train import train

    out = {}
    for name in names:
        records = train(_args(root, world_size, **LAYOUTS[name][1]))
        if records is not None:
            out[name] = _curve(records)
    return out


@pytest.fixture(scope="module")
def single(root):
    from megakernels_models.training.train import train

    with single_process_world():
        return {
            "single": _curve(train(_args(root))),
            "precompute": _curve(train(_args(root, precompute_ref=True))),
        }


def _same(got, ref, what):
    for a, b, name in zip(got, ref, ("loss", "grad norm", "reward margin")):
        torch.testing.assert_close(
            torch.tensor(a, dtype=torch.float64),
            torch.tensor(b, dtype=torch.float64),
            rtol=RTOL if name != "grad norm" else 1e-4,
            atol=1e-7 if name == "reward margin" else 0,
            msg=lambda m, name=name: f"{what}: {name} differs: {a} vs {b}\n{m}",
        )


def _logps(model, batch) -> torch.Tensor:
    """Each document's summed log-probability of its labelled tokens from the full fp64 log-softmax, ``[b, s + 1]``."""
    logits = model(ids=batch["ids"], documents=(batch["documents"], batch["positions"]))  # [s, b, V_pad]
    logp = F.log_softmax(logits[..., : model.config.vocab_size].double(), -1).transpose(0, 1)
    labels = batch["labels"]
    tok = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * (labels != -100)
    out = torch.zeros(labels.shape[0], labels.shape[1] + 1, dtype=torch.float64)
    return out.scatter_add(1, batch["documents"].long(), tok)


@pytest.mark.parametrize("loss, smoothing", [("sigmoid", 0.1), ("ipo", 0.0), ("hinge", 0.0)])
def test_first_step_is_the_dpo_of_the_models(root, loss, smoothing):
    from megakernels_models.data.build import build_datasets
    from megakernels_models.data.datasets import collate
    from megakernels_models.models.registry import task_for
    from megakernels_models.training import checkpoint
    from megakernels_models.training.train import train

    args = _args(root, steps=1, warmup_steps=0, dpo_loss=loss, dpo_label_smoothing=smoothing, dpo_beta=0.5)
    cfg = validate(args)
    with single_process_world():
        rec = train(args)[0]
    with single_process_world(parallel=True):
        task = task_for(cfg)
        policy = task.build_chunk(args.seed, fused_linear_ce=False).eval()
        ref = task.build_chunk(99, fused_linear_ce=False).eval()
        checkpoint.load(checkpoint.read_latest(args.dpo_ref), [ref], None, cfg)
        ds = build_datasets(args, cfg)[0]
        batch = collate([ds[i] for i in range(args.global_batch_size)])
        with torch.no_grad():
            pol, rf, counts = _logps(policy, batch), _logps(ref, batch), None
    mask = batch["labels"] != -100
    counts = torch.zeros_like(pol).scatter_add(1, batch["documents"].long(), mask.double())
    pairs = (batch["documents"].max(1).values + 1) // 2
    rows = [(b, j) for b in range(len(pairs)) for j in range(int(pairs[b]))]
    c = torch.stack([pol[b, 2 * j] - rf[b, 2 * j] for b, j in rows])
    r = torch.stack([pol[b, 2 * j + 1] - rf[b, 2 * j + 1] for b, j in rows])
    beta = args.dpo_beta
    if loss == "sigmoid":
        z = beta * (c - r)
        losses = -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)
    elif loss == "hinge":
        losses = torch.relu(1 - beta * (c - r))
    else:
        len_c = torch.stack([counts[b, 2 * j] for b, j in rows])
        len_r = torch.stack([counts[b, 2 * j + 1] for b, j in rows])
        losses = (c / len_c - r / len_r - 1 / (2 * beta)) ** 2
    assert len(rows) > args.global_batch_size  # packed: several pairs a sample
    want = {
        "loss": losses.mean(),
        "dpo_loss": losses.mean(),
        "chosen_rewards": (beta * c).mean(),
        "rejected_rewards": (beta * r).mean(),
        "reward_margin": (beta * (c - r)).mean(),
        "reward_accuracy": (c > r).double().mean(),
    }
    assert abs(float(want["reward_margin"])) > 1e-3  # the reference is another model
    for k, v in want.items():
        assert rec[k] == pytest.approx(float(v), rel=1e-5, abs=1e-6), (k, rec[k], float(v))


def test_precomputed_reference_gives_the_same_curve(single):
    _same(single["precompute"], single["single"], "precompute")
    assert single["single"][0][-1] < single["single"][0][0]


_WORLDS: dict[int, dict] = {}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(root, single, name):
    n = LAYOUTS[name][0]
    if n not in _WORLDS:
        names = [k for k, (size, _) in LAYOUTS.items() if size == n]
        _WORLDS[n] = run_world(n, _train_cases, root, names, timeout=600)[-1]  # the last rank logs
    _same(_WORLDS[n][name], single["single"], name)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(dpo=False), "--dpo-ref is for --dpo"),
        (dict(dpo_beta=0.0), "--dpo-beta must be > 0"),
        (dict(dpo_label_smoothing=0.5), "--dpo-label-smoothing must be in [0, 0.5)"),
        (dict(dpo_loss="ipo", dpo_label_smoothing=0.1), "--dpo-label-smoothing is for --dpo-loss sigmoid"),
        (dict(dpo_loss="kto"), "--dpo-loss must be one of sigmoid, ipo, hinge"),
        (dict(sft=True), "drop --sft"),
        (dict(model="bert"), "--dpo is for causal language models"),
        (dict(data=None), "--dpo trains on one preference dataset"),
        (dict(dpo_ref="/nonexistent"), "neither a megakernels checkpoint directory nor a HuggingFace"),
    ],
)
def test_bad_combinations_are_refused(root, changes, message):
    with pytest.raises(ArgumentError) as e:
        validate(_args(root, **changes))
    assert message in str(e.value)


def test_a_dpo_checkpoint_is_not_taken_for_the_reference(root):
    with pytest.raises(ArgumentError, match="written by a --dpo run, so it is not the reference: give --dpo-ref"):
        validate(_args(root, dpo_ref=None, load=os.path.join(root, "ref")))
    from megakernels_models.data.preprocess import preprocess

    with open(os.path.join(root, "text.txt"), "w") as f:
        f.write("plain text, not pairs\n" * 20)
    preprocess([os.path.join(root, "text.txt")], os.path.join(root, "text"), "byte")
    with pytest.raises(ArgumentError, match="is not preference data"):
        validate(_args(root, data=os.path.join(root, "text")))
