"""examples/hf_accelerate_train.py under ``accelerate launch`` on 2 CPU processes (gloo): a patched Llama trained
with FusedAdamW through ``accelerator.prepare`` has the same losses and gradients as a single process on the same
global batches, and ``accelerator.save_state`` / ``load_state`` carry the FusedAdamW state into a resumed run (here
on one process: Accelerate's checkpoints hold the unwrapped model and the full optimizer state)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import accelerate  # noqa: F401  (the test extra's; imported, never skipped)
import pytest
import torch

import megakernels.integrations.transformers as mkt
from megakernels.optim import FusedAdamW
from tests.integrations import hf_models as H

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "hf_accelerate_train.py"  # the example under test
STEPS, SAVED_AT, BATCH, SEQ, LR = 4, 2, 8, 16, 3e-3


def _launch(tmp_path: Path, name: str, processes: int, *args: str) -> dict:
    """The example under ``accelerate launch`` on ``processes`` CPU processes (1: plain ``python``)."""
    log = tmp_path / f"{name}.json"
    launcher = (
        [
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            "0",
        ]
        if processes > 1
        else []
    )
    cmd = [
        sys.executable,
        *launcher,
        str(SCRIPT),
        "--global-batch-size",
        str(BATCH),
        "--seq-length",
        str(SEQ),
        "--lr",
        str(LR),
        "--log-json",
        str(log),
        *args,
    ]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(log.read_text())


def _train(example, model, optimizer, first: int, last: int) -> list[tuple[float, list[float]]]:
    """Steps ``first..last-1`` on one process, without Accelerate, on the example's global batches: per step the
    loss and every parameter's gradient norm."""
    data = example.dataset(4096, SEQ).tensors[0]  # the example's default --samples
    out = []
    for i in range(first, last):
        ids = data[i * BATCH : (i + 1) * BATCH]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out.append((loss.item(), [p.grad.norm().item() for p in model.parameters()]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


@pytest.fixture(scope="module")
def single_process():
    """The single-process run: steps, the model and optimizer state dicts at SAVED_AT."""
    example = H.accelerate_example()
    model = example.build_model(0)
    mkt.apply(model)
    optimizer = FusedAdamW(model.parameters(), lr=LR, weight_decay=0.01)
    steps = _train(example, model, optimizer, 0, SAVED_AT)
    at_save = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    steps += _train(example, model, optimizer, SAVED_AT, STEPS)
    return example, steps, at_save


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accelerate")
    first = _launch(tmp, "first", 2, "--steps", str(SAVED_AT), "--save-state", str(tmp / "state"))
    # resumed on one process: the state saved by two loads at another world size
    resumed = _launch(tmp, "resumed", 1, "--steps", str(STEPS), "--load-state", str(tmp / "state"))
    return tmp, first, resumed


def test_two_processes_match_one_process_on_the_same_global_batches(runs, single_process):
    _, first, _ = runs
    _, reference, _ = single_process
    assert first["world"] == 2
    torch.testing.assert_close(first["losses"], [loss for loss, _ in reference[:SAVED_AT]], rtol=1e-5, atol=0)
    for step, (ranks, (_, norms)) in enumerate(zip(first["grad_norms"], reference)):
        assert ranks[0] == ranks[1], f"step {step}: the ranks' gradients differ after the all-reduce"
        torch.testing.assert_close(ranks[0], norms, rtol=1e-4, atol=1e-7)


def test_save_state_holds_the_fused_adamw_state(runs, single_process):
    tmp, _, _ = runs
    _, _, (_, expected) = single_process
    saved = torch.load(tmp / "state" / "optimizer.bin", weights_only=False)
    assert saved["state"].keys() == expected["state"].keys()
    for idx, state in expected["state"].items():
        assert float(saved["state"][idx]["step"]) == SAVED_AT
        for key in ("exp_avg", "exp_avg_sq"):
            # all-reduced and single-process gradients differ in the last bits: relative to each tensor's scale
            torch.testing.assert_close(
                saved["state"][idx][key], state[key], rtol=1e-4, atol=1e-4 * float(state[key].abs().max())
            )


def test_load_state_resumes_as_if_never_interrupted(runs, single_process):
    _, _, resumed = runs
    example, uninterrupted, (weights, _) = single_process
    torch.testing.assert_close(resumed["losses"], [loss for loss, _ in uninterrupted[SAVED_AT:]], rtol=1e-5, atol=0)
    # A resume that lost the moments would show: fresh FusedAdamW state on the saved weights goes elsewhere.
    model = example.build_model(0)
    model.load_state_dict(weights)
    mkt.apply(model)
    forgetful = _train(example, model, FusedAdamW(model.parameters(), lr=LR, weight_decay=0.01), SAVED_AT, STEPS)
    assert abs(forgetful[-1][0] - uninterrupted[-1][0]) > 1e-3
