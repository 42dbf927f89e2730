"""Asynchronous and incremental checkpoints: an asynchronous save writes what the model was at its step while
training goes on; a kill inside a save (synchronous or asynchronous, held at a sync point inside DCP's write) leaves
the previous checkpoint latest and loadable; a failed asynchronous write is reported at the next step and the
previous checkpoint stays latest; frozen parameters are not rewritten, later checkpoints reference the files that
hold them, and keep-K pruning never deletes a referenced file."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megakernels_models.training import checkpoint
from tests.models.preemption_harness import TINY_FLAGS, Run
from tests.models.test_checkpoint import TINY, _train


def test_an_asynchronous_save_holds_the_state_of_its_step(world1, tmp_path):
    """Staged at the step: resuming from the asynchronous checkpoint of step 2 (written while steps 3, 4 ran)
    continues the curve bit for bit, as the synchronous checkpoint does."""
    full = _train(steps=4)
    assert _train(steps=4, save=str(tmp_path), save_interval=1, async_save=True, keep_checkpoints=4) == full
    assert _train(steps=4, load=str(tmp_path / "step-00000002")) == full[2:]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_kill_inside_a_save_leaves_the_previous_checkpoint_latest(world1, tmp_path, mode):
    ckpt = str(tmp_path / "ckpt")
    flags = TINY_FLAGS + ["--steps", "6", "--save", ckpt, "--save-interval", "1", "--keep-checkpoints", "2"]
    run = Run(
        flags + (["--async-save"] if mode == "async" else []),
        str(tmp_path / "sync"),
        holds=("checkpoint-write-00000003",),
    )
    run.sync.wait_for("checkpoint-write-00000003", [0])  # step 3's data files written, its metadata not
    if mode == "async":
        run.sync.wait_for("step-4", [0])  # training went on while the write was held
    run.kill()
    assert checkpoint.read_latest(ckpt) == os.path.join(ckpt, "step-00000002")
    assert not os.path.exists(os.path.join(ckpt, ".tmp-step-00000003", ".metadata"))
    full = _train(steps=6, dropout=0.1)
    resumed = _train(steps=6, dropout=0.1, load=ckpt)
    torch.testing.assert_close(resumed, full[2:], rtol=1e-5, atol=0)  # another thread count than the killed run


def test_a_failed_asynchronous_write_is_reported_and_the_previous_checkpoint_stays_latest(
    world1, tmp_path, monkeypatch
):
    real = checkpoint.Writer.write_data

    def fails_from_step_4(self, plan, planner):
        if self._point >= "checkpoint-write-00000004":
            raise OSError("no space left on device")
        return real(self, plan, planner)

    monkeypatch.setattr(checkpoint.Writer, "write_data", fails_from_step_4)
    log = tmp_path / "log.jsonl"
    from megakernels_models.training.train import train

    last = train(
        dataclasses.replace(
            TINY, steps=5, save=str(tmp_path / "ckpt"), save_interval=2, async_save=True, log_jsonl=str(log)
        )
    )[-1]
    # the last save's failure ends the run as failed (the command exits 1), with one line, no traceback
    assert re.search("save of step 5 failed .*no space left.*step-00000002 stays latest", last["failed"])
    records = [json.loads(line) for line in log.read_text().splitlines() if '"step"' in line]
    errors = {r["step"]: r["checkpoint_error"] for r in records if "checkpoint_error" in r}
    assert list(errors) == [5] and "save of step 4 failed" in errors[5] and "step-00000002 stays latest" in errors[5]
    assert checkpoint.read_latest(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt" / "step-00000002")


def _files(path) -> dict[str, str]:
    """``{entry: file holding it (relative to the checkpoint)}``."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    return {index.fqn: info.relative_path for index, info in md.storage_data.items()}


def test_frozen_parameters_are_referenced_not_rewritten_and_pruning_keeps_referenced_files(world1, tmp_path):
    frozen = dict(freeze="embedding.word")
    full = _train(steps=6, **frozen)
    first = _train(steps=6, exit_interval=4, save=str(tmp_path), save_interval=1, keep_checkpoints=2, **frozen)
    assert first == full[:4]
    assert sorted(os.listdir(tmp_path)) == [".lock", "latest", "step-00000001", "step-00000003", "step-00000004"]
    assert not os.path.exists(tmp_path / "step-00000001" / ".metadata")  # a store now, not a checkpoint
    for step in (3, 4):
        files = _files(tmp_path / f"step-0000000{step}")
        assert files["model.embedding.word.weight"].startswith("../step-00000001/")
        assert not files["model.layers.0.mlp.fc1.weight"].startswith("../")
        assert os.path.exists(tmp_path / f"step-0000000{step}" / files["model.embedding.word.weight"])
    sizes = {s: sum(f.stat().st_size for f in (tmp_path / f"step-0000000{s}").glob("*.distcp")) for s in (1, 3, 4)}
    embedding = 261 * 32 * 4  # fp32 bytes of the word embedding (vocabulary 261, hidden 32): weight and 2 moments
    assert sizes[3] == sizes[4] and sizes[3] + 3 * embedding <= sizes[1]
    assert _train(steps=6, load=str(tmp_path), **frozen) == full[4:]  # loads through the references
    # A new run's first save writes everything; once no kept checkpoint references step 1, it goes.
    _train(steps=6, save=str(tmp_path), load=str(tmp_path), save_interval=1, keep_checkpoints=1, **frozen)
    assert sorted(os.listdir(tmp_path)) == [".lock", "latest", "step-00000005", "step-00000006"]
