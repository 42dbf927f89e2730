"""Launching ``megakernels train``: the default run, torchrun, and how a rank's failure surfaces (every rank exits
with the failing rank's error; never a hang)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

TINY = [
    "--preset",
    "gpt-tiny",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--corpus-bytes",
    "262144",
    "--no-progress",
]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return env


def _records(path) -> list[dict]:
    """The per-step records of a JSONL log (the ``{"config": ...}`` header of each run left out)."""
    with open(path) as f:
        return [r for r in (json.loads(line) for line in f if line.strip()) if "config" not in r]


def test_train_logs_every_contract_field(tmp_path):
    log = tmp_path / "log.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megakernels_models.cli",
            "train",
            *TINY,
            "--steps",
            "4",
            "--warmup-steps",
            "2",
            "--lr",
            "0.01",
            "--min-lr",
            "0.001",
            "--eval-interval",
            "2",
            "--eval-steps",
            "1",
            "--log-jsonl",
            str(log),
            "--tensorboard",
            str(tmp_path / "tb"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert r.returncode == 0, r.stderr
    recs = _records(log)
    assert [x["step"] for x in recs] == [1, 2, 3, 4]
    for rec in recs:
        assert set(rec) >= {
            "step",
            "loss",
            "lr",
            "grad_norm",
            "loss_scale",
            "tokens",
            "tokens_per_s",
            "tflops_per_device",
            "mfu",
            "elapsed_s",
        }
        assert rec["tokens"] == rec["step"] * 4 * 32
    assert "val_loss" in recs[1] and "val_ppl" in recs[3] and "val_loss" not in recs[0]
    # linear warmup over 2 steps to 0.01, then cosine decay to 0.001 at step 4
    expected = [0.005, 0.01, 0.001 + 0.009 * 0.5 * (1 + math.cos(math.pi / 2)), 0.001]
    assert [x["lr"] for x in recs] == pytest.approx(expected, rel=1e-12)
    # MFU is the step's model TFLOP/s over this machine's CPU peak for one thread (the run's OMP_NUM_THREADS), as
    # the peak cache holds it after the run (a step beating a peak measured under load raises it)
    from megakernels_models.training import mfu

    with open(mfu._cache_path()) as f:
        peak = json.load(f)[mfu._key(torch.float32, 1)]
    last = recs[-1]
    assert last["mfu"] == pytest.approx(last["tflops_per_device"] / peak, rel=1e-6)
    assert all(x["mfu"] > 0 and x["tflops_per_device"] > 0 for x in recs)
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    assert "done: 4 steps" in r.stdout


def test_torchrun_launch(tmp_path):
    log = tmp_path / "log.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "megakernels_models.cli",
            "train",
            *TINY,
            "--steps",
            "2",
            "--pp",
            "2",
            "--eval-interval",
            "0",
            "--log-jsonl",
            str(log),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["step"] for x in _records(log)] == [1, 2]


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_killed_rank_ends_the_whole_run_with_its_error(tmp_path):
    log = tmp_path / "log.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megakernels_models.cli",
            "train",
            *TINY,
            "--steps",
            "100000",
            "--nproc",
            "2",
            "--eval-interval",
            "0",
            "--log-jsonl",
            str(log),
            "--timeout",
            "60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(_env(), MEGAKERNELS_START_METHOD="spawn"),
    )  # the ranks: the launcher's children
    try:
        deadline = time.monotonic() + 240
        while not (log.exists() and log.read_text().strip()):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        ranks = [c for c in _children(proc.pid) if "spawn_main" in _cmdline(c)]
        assert len(ranks) == 2, [_cmdline(c) for c in _children(proc.pid)]
        os.kill(ranks[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)  # a hang would end here as a TimeoutExpired
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1
    assert "a rank failed" in err and "died with exit code -9" in err, err[-2000:]
    for c in ranks:  # no rank is left behind
        assert not os.path.exists(f"/proc/{c}") or "spawn_main" not in _cmdline(c)
