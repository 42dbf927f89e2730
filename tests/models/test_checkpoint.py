"""Checkpoints: exact resume, atomic saves (an interrupted or killed save never loses the previous checkpoint),
the `latest` marker and its fallback, keeping the last K, and refusing another model's checkpoint.
(Resharding across layouts is tested in test_layouts.py, inside its spawned worlds.)"""

from __future__ import annotations

import dataclasses
import os

import pytest

from megakernels_models.arguments import ArgumentError, TrainArgs, validate
from megakernels_models.training import checkpoint

TINY = TrainArgs(
    preset=None,
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    seq_length=16,
    dropout=0.1,
    steps=8,
    micro_batch_size=2,
    global_batch_size=4,
    eval_interval=0,
    progress=False,
    corpus_bytes=1 << 18,
)


def _train(**changes):
    from megakernels_models.training.train import train

    return [r["loss"] for r in train(dataclasses.replace(TINY, **changes))]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_resume_is_bit_identical(world1, tmp_path, precision):
    """8 steps == 4 steps + save + resume + 4 steps, bit for bit (dropout on: the RNG states are restored)."""
    full = _train(precision=precision)
    first = _train(precision=precision, save=str(tmp_path), save_interval=4)
    assert first == full
    resumed = _train(precision=precision, load=str(tmp_path / "step-00000004"))
    assert resumed == full[4:]


def test_latest_marker_keep_and_fallback(world1, tmp_path):
    _train(steps=6, save=str(tmp_path), save_interval=1, keep_checkpoints=2)
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("step-")) == ["step-00000005", "step-00000006"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000006"
    assert checkpoint.read_latest(str(tmp_path)) == str(tmp_path / "step-00000006")
    os.remove(tmp_path / "latest")  # no marker: the newest complete checkpoint
    os.makedirs(tmp_path / "step-00000009")  # incomplete (no DCP metadata): ignored
    assert checkpoint.read_latest(str(tmp_path)) == str(tmp_path / "step-00000006")


def test_an_interrupted_save_keeps_the_previous_checkpoint(world1, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp  # the save's (checkpoint imports it when it writes)

    _train(steps=2, save=str(tmp_path))
    real_save = dcp.save

    def dies_halfway(sd, storage_writer, **kwargs):
        with open(os.path.join(storage_writer.path, "__0_0.distcp"), "wb") as f:
            f.write(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(dcp, "save", dies_halfway)
    from megakernels_models.training.train import train

    records = train(dataclasses.replace(TINY, steps=4, save=str(tmp_path), load=str(tmp_path)))
    monkeypatch.setattr(dcp, "save", real_save)
    # reported in the step's record, training went on, the next save is tried (and fails the same way here)
    assert (
        "the save of step 4 failed (the checkpoint of step 4 was not saved: RuntimeError: disk full)"
        in records[-1]["checkpoint_error"]
    )
    assert checkpoint.read_latest(str(tmp_path)) == str(tmp_path / "step-00000002")
    assert not os.path.exists(tmp_path / ".tmp-step-00000004")  # the torso of the failed save is removed


def test_another_models_checkpoint_is_refused(world1, tmp_path):
    _train(steps=1, save=str(tmp_path))
    with pytest.raises(checkpoint.CheckpointError, match="hidden_size: checkpoint 32, now 64"):
        _train(steps=2, hidden_size=64, load=str(tmp_path))


def test_save_interval_needs_save():
    with pytest.raises(ArgumentError, match="--save-interval needs --save"):
        validate(dataclasses.replace(TINY, save_interval=3))
