"""``megakernels train --grpo``: on a tiny model, a step's advantages, loss, gradient norm, entropy and reward are
those computed here from the sampled completions (the reward function records them) with the initial model's full
fp64 log-softmax at the sampling temperature; the curves at tp 2 and dp 2 (ZeRO-1) equal the single process's (the
sampler's seeds depend on the prompt, not the layout); the example reward scores answers; bad settings are refused
naming the flag. That a tiny model's reward rises over a few hundred steps is a recorded result
(benchmarks/results/*-grpo-arithmetic.md), not a test."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F

from megakernels.parallel.launch import single_process_world
from megakernels_models.arguments import ArgumentError, TrainArgs, validate
from megakernels_models.training.rewards import arithmetic
from tests.parallel.harness import run_world

SEEN: list[tuple] = []  # what ``recorded`` was called with, and what it returned


def recorded(prompts, completions, completion_ids, answer, **fields):
    """A reward that varies between completions (the sum of their token ids mod 5), recording its calls."""
    rewards = [float(sum(ids) % 5) for ids in completion_ids]
    SEEN.append((list(prompts), [list(c) for c in completion_ids], rewards, list(answer)))
    return rewards


BASE = TrainArgs(
    model="llama",
    preset=None,
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=48,
    seq_length=16,
    dropout=0.0,
    steps=3,
    micro_batch_size=4,
    global_batch_size=8,
    lr=1e-2,
    warmup_steps=0,
    eval_interval=0,
    progress=False,
    seed=3,
    timeout=120,
    grpo=True,
    reward="tests.models.test_grpo:recorded",
    grpo_group_size=4,
    grpo_beta=0.1,
    max_completion_tokens=5,
    temperature=0.7,
)
LAYOUTS = {"tp2": dict(tp=2), "dp2-zero1": dict(distributed_optimizer=True)}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("grpo") / "prompts.jsonl")
    with open(path, "w") as f:
        for a, b in ((1, 2), (3, 4), (2, 2), (5, 1)):
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return path


def _args(prompts: str, nproc: int = 1, **changes) -> TrainArgs:
    return dataclasses.replace(BASE, data=prompts, nproc=nproc, **changes)


def _curve(records):
    return [[r[k] for r in records] for k in ("loss", "grad_norm", "reward", "entropy")]


def _layouts(rank: int, world_size: int, prompts: str):
    from megakernels_models.training.train import train

    out = {}
    for name, changes in LAYOUTS.items():
        records = train(_args(prompts, world_size, **changes))
        if records is not None:
            out[name] = _curve(records)
    return out


@pytest.fixture(scope="module")
def single(prompts):
    from megakernels_models.training.train import train

    SEEN.clear()
    with single_process_world():
        records = train(_args(prompts))
    return records, list(SEEN)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_step_is_the_grpo_of_the_sampled_completions(prompts, loss_type):
    from megakernels_models.models.registry import task_for
    from megakernels_models.training.train import train

    args = _args(prompts, steps=1, grpo_loss=loss_type)
    cfg = validate(args)
    SEEN.clear()
    with single_process_world():
        rec = train(args)[0]
    ((texts, completions, rewards, answers),) = SEEN
    g = args.grpo_group_size
    assert len(set(texts[::g])) == 2 and texts == [t for t in texts[::g] for _ in range(g)]  # two prompts, G each
    assert answers == [
        str(sum(int(x) for x in t[:-1].split("+"))) for t in texts
    ]  # the prompts' other fields reach the reward
    assert all(1 <= len(c) <= args.max_completion_tokens for c in completions)
    assert len({tuple(c) for c in completions}) > 1  # sampled, not greedy
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, g)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
    assert adv.abs().max() > 0.1

    with single_process_world(parallel=True):
        model = task_for(cfg).build_chunk(args.seed)
        per_seq, tokens, entropy = [], [], []
        for text, completion, a in zip(texts, completions, adv):
            prompt = list(text.encode())
            ids = torch.tensor([prompt + completion])
            logits = model(ids=ids)[:, 0, : cfg.vocab_size].double() / args.temperature
            logp = F.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
            picked = logp.gather(1, torch.tensor(completion)[:, None])[:, 0]
            ratio = torch.exp(picked - picked.detach())  # one step per generation: the sampling policy is this one
            per_seq.append((-a * ratio).sum() / (1 if loss_type == "dapo" else len(completion)))
            tokens.append(len(completion))
            entropy.append(-(logp.exp() * logp).sum(-1).detach())
        loss = torch.stack(per_seq).sum() / (sum(tokens) if loss_type == "dapo" else len(per_seq))
        loss.backward()  # the KL term (beta 0.1) is 0 with zero gradient: the reference is this model
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
    assert rec["loss"] == pytest.approx(float(loss.detach()), abs=1e-6)
    assert rec["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    assert rec["entropy"] == pytest.approx(float(torch.cat(entropy).mean()), rel=1e-5)
    assert rec["reward"] == pytest.approx(float(r.mean()), rel=1e-6)
    assert rec["kl"] == pytest.approx(0.0, abs=1e-6)
    assert rec["completion_tokens"] == pytest.approx(sum(tokens) / len(tokens))


def test_layouts_match_single_process(prompts, single):
    records, seen = single
    assert len(seen) == BASE.steps and records[-1]["kl"] > 0  # the policy moved away from the reference
    got = run_world(2, _layouts, prompts, timeout=600)[-1]
    want = _curve(records)
    for name in LAYOUTS:
        for a, b, what in zip(got[name], want, ("loss", "grad norm", "reward", "entropy")):
            torch.testing.assert_close(
                torch.tensor(a, dtype=torch.float64),
                torch.tensor(b, dtype=torch.float64),
                rtol=1e-4,
                atol=1e-6,
                msg=lambda m, name=name, what=what: f"{name}: {what} differs\n{m}",
            )


def test_the_example_reward():
    got = arithmetic(["3+4="] * 5, ["7", " 7\n", "72", "5", "x7"], ["7"] * 5)
    assert got == [1.0, 1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 prompts, 1 completions and 2 answers"):
        arithmetic(["a", "b"], ["c"], ["d", "e"])


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(grpo=False), "--reward is for --grpo"),
        (dict(pp=2, nproc=2), "--pp 2 is not supported"),
        (dict(tp=2, sequence_parallel=True, nproc=2), "--sequence-parallel cannot split"),
        (dict(fsdp=True, nproc=2), "FSDP (--fsdp / --zero 2) is not supported"),
        (dict(reward=None), "--grpo needs --reward MODULE:FUNCTION"),
        (dict(reward="nomodule_here:f"), "importing nomodule_here failed"),
        (dict(reward="tests.models.test_grpo:nothing"), "has no function nothing"),
        (dict(grpo_group_size=3), "--grpo-group-size 3 must divide"),
        (dict(grpo_group_size=1, global_batch_size=8), "--grpo-group-size must be"),
        (dict(temperature=0.0), "--temperature must be > 0"),
        (dict(max_completion_tokens=14), "more than --seq-length 16 leaves"),
        (dict(model="bert"), "--grpo samples text"),
        (dict(dpo=True), "drop --dpo"),
    ],
)
def test_bad_settings_are_refused(prompts, changes, message):
    with pytest.raises(ArgumentError) as e:
        validate(_args(prompts, **changes))
    assert message in str(e.value)


def test_bad_prompts_name_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1="}\n{"text": "x"}\n')
    with pytest.raises(ArgumentError, match=f"{path}:2: expected"):
        validate(_args(str(path)))
    with pytest.raises(ArgumentError, match="no such file"):
        validate(_args(os.path.join(str(tmp_path), "none.jsonl")))


def test_a_grpo_checkpoint_is_not_taken_for_the_reference(prompts, tmp_path):
    from megakernels_models.training.train import train

    with single_process_world():
        train(_args(prompts, steps=1, grpo_beta=0.0, save=str(tmp_path / "ckpt")))
    with pytest.raises(ArgumentError, match="written by a --grpo run, so it is not the reference"):
        validate(_args(prompts, load=str(tmp_path / "ckpt")))
    validate(_args(prompts, load=str(tmp_path / "ckpt"), grpo_beta=0.0))  # without the KL term it resumes
