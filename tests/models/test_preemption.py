"""Preemption and auto-resume: a signal makes every rank finish its step, save and exit 0; the same command
relaunched continues from that checkpoint, and the two launches' loss curve is the uninterrupted run's exactly
(fp32, dropout on: the RNG states travel in the checkpoint). ``--exit-interval`` and ``--exit-duration-mins`` stop
the same way; ``--load`` of a directory without a checkpoint starts from scratch.

The runs are real ``megakernels train`` processes held at sync points (``megakernels_models.training.syncpoints``), so
the signals arrive at a known step and during a known part of the save, never after a sleep."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading

import pytest

from megakernels_models.arguments import ArgumentError, validate
from megakernels_models.training import checkpoint, syncpoints
from megakernels_models.training.preemption import StopConditions
from tests.models.preemption_harness import DEADLINE_S, TINY_FLAGS, Run, SyncDir, logged_losses, run_to_end
from tests.models.test_checkpoint import TINY, _train
from tests.parallel.harness import run_world

WRITE_3 = "checkpoint-write-00000003"


def test_a_signal_mid_run_then_the_same_command_gives_the_uninterrupted_curve(tmp_path):
    """One process: SIGTERM after step 3 -> the step ends, the checkpoint is saved (a second SIGTERM arrives during
    its write), exit 0 with the line saying where; the same command again resumes there. The two launches'
    losses are the uninterrupted run's, bit for bit."""
    common = TINY_FLAGS + ["--steps", "6"]
    run_to_end(common + ["--log-jsonl", str(tmp_path / "reference.jsonl")])
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "log.jsonl")
    flags = common + ["--save", ckpt, "--load", ckpt, "--log-jsonl", log]

    run = Run(flags, str(tmp_path / "sync"), holds=("step-3",))
    sync = run.sync
    sync.wait_for("step-3", [0])
    run.signal()
    sync.wait_for("signal", [0])  # the handler ran while the step was held
    sync.hold(WRITE_3)
    sync.release("step-3")
    sync.wait_for(WRITE_3, [0])
    sync.forget("signal")
    run.signal()
    sync.wait_for("signal", [0])
    sync.release(WRITE_3)
    out = run.finish()
    assert "starting from scratch" in out
    assert f"stopped after step 3 (SIGTERM): saved checkpoint {os.path.join(ckpt, 'step-00000003')}" in out
    assert checkpoint.read_latest(ckpt) == os.path.join(ckpt, "step-00000003")

    out = run_to_end(flags)  # the same command line
    assert "starting from scratch" not in out and "stopped" not in out
    assert logged_losses(log) == logged_losses(str(tmp_path / "reference.jsonl"))


def _preempted_world(rank: int, world_size: int, args):
    from megakernels_models.training.train import train

    sync_dir = os.environ.pop(syncpoints.ENV)  # the reference passes no sync point
    reference = train(dataclasses.replace(args, save=None, load=None))  # uninterrupted, same ranks and threads
    os.environ[syncpoints.ENV] = sync_dir
    first = train(args)  # stopped by the test's signal
    return reference, first, train(args)  # the same settings again: the relaunch


def test_a_signal_to_one_of_four_ranks_stops_all_of_them_and_the_relaunch_continues_exactly(tmp_path, monkeypatch):
    """Four processes (pp 2 × dp 2): SIGTERM to rank 1 only after step 3 -> every rank ends that step and saves;
    SIGTERM to the launcher during the write, which forwards it to every rank, changes nothing; the same settings
    again resume there. The curve equals, exactly, the uninterrupted run that the same world trains first (same
    ranks and threads)."""
    from tests.models import test_layouts as layouts

    ckpt = str(tmp_path / "ckpt")
    args = dataclasses.replace(layouts._args("gpt", layouts.LAYOUTS["pp2-dp2"][1], 4), save=ckpt, load=ckpt)
    done, failed = threading.Event(), []

    def alive(name):
        assert not done.is_set(), f"the world ended before {name}"

    sync = SyncDir(str(tmp_path / "sync"), alive)
    monkeypatch.setenv(syncpoints.ENV, sync.path)  # the spawned ranks inherit it

    def drive():  # the preemption, from a second thread: the launcher (this process) runs the world
        try:
            pids = sync.wait_for("step-3", range(4), timeout=3 * DEADLINE_S)  # after the reference run
            os.kill(pids[1], signal.SIGTERM)
            sync.wait_for("signal", [1])
            sync.hold(WRITE_3)
            sync.release("step-3")
            sync.wait_for(WRITE_3, range(4))
            sync.forget("signal")
            os.kill(os.getpid(), signal.SIGTERM)
            sync.wait_for("signal", range(4))
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            failed.append(e)
        finally:
            for name in ("step-3", WRITE_3):
                if os.path.exists(os.path.join(sync.path, f"{name}.hold")):
                    sync.release(name)

    sync.hold("step-3")
    driver = threading.Thread(target=drive)
    driver.start()
    try:
        ranks = run_world(4, _preempted_world, args, timeout=300, forward_signals=(signal.SIGTERM,))
    finally:
        done.set()
        driver.join()
    if failed:
        raise failed[0]
    reference, first, second = ranks[-1]  # the logging rank's records
    reference = [r["loss"] for r in reference]
    assert len(reference) == layouts.STEPS
    assert [r["step"] for r in first] == [1, 2, 3] and first[-1]["stopped"] == "SIGTERM"
    assert [r["step"] for r in second] == list(range(4, layouts.STEPS + 1))
    assert [r["loss"] for r in first + second] == reference


def test_exit_interval_stops_after_the_step_and_saves(world1, tmp_path):
    full = _train(steps=6)
    stopped = _train(steps=6, save=str(tmp_path), exit_interval=2)
    assert stopped == full[:2]
    assert checkpoint.read_latest(str(tmp_path)) == str(tmp_path / "step-00000002")
    assert _train(steps=6, save=str(tmp_path), load=str(tmp_path)) == full[2:]


def test_exit_duration_stops_after_the_first_step_past_it(world1, tmp_path):
    from megakernels_models.training.train import train

    records = train(dataclasses.replace(TINY, steps=6, save=str(tmp_path), exit_duration_mins=1e-9))
    assert [r["step"] for r in records] == [1]
    assert records[0]["stopped"].startswith("--exit-duration-mins")
    assert checkpoint.read_latest(str(tmp_path)) == str(tmp_path / "step-00000001")


def test_load_from_a_missing_or_empty_directory_starts_from_scratch(world1, tmp_path, capsys):
    full = _train(steps=2)
    assert _train(steps=2, load=str(tmp_path / "not-yet")) == full
    assert "no checkpoint in --load" in capsys.readouterr().out
    assert _train(steps=2, load=str(tmp_path)) == full  # exists, empty


def test_stop_settings_are_validated():
    with pytest.raises(ArgumentError, match="--exit-interval must be"):
        validate(dataclasses.replace(TINY, exit_interval=0))
    with pytest.raises(ArgumentError, match="--exit-duration-mins must be > 0"):
        validate(dataclasses.replace(TINY, exit_duration_mins=0.0))
    with pytest.raises(ArgumentError, match="--exit-signal must be one of SIGTERM, SIGUSR1, none"):
        validate(dataclasses.replace(TINY, exit_signal="SIGKILL"))
    with pytest.raises(ValueError, match="--exit-signal must be one of"):
        StopConditions("SIGINT")


def test_load_of_a_file_is_an_argument_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ArgumentError, match="is not a directory"):
        validate(dataclasses.replace(TINY, load=str(tmp_path / "f")))


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "a rank failed" not in err, err[-3000:]


def _records(log: str) -> list[dict]:
    import json

    with open(log) as f:
        return [r for r in map(json.loads, f) if "step" in r]


def test_sigterm_to_the_process_group_of_a_spawned_run_saves_and_the_relaunch_resumes(tmp_path, capsys):
    """``kill -TERM -PGID`` of a ``--nproc 2`` run (a scheduler's group kill) while both ranks are still setting
    up, before they have a handler: the signal waits for it, every rank ends the first step and saves, exit 0 with
    the line of a SIGTERM to the launcher alone; the checkpoint resumes (in one process: any layout)."""
    from megakernels_models.cli import main

    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "log.jsonl")
    flags = TINY_FLAGS + ["--steps", "100000", "--save", ckpt, "--load", ckpt, "--log-jsonl", log]
    run = Run(flags + ["--nproc", "2"], str(tmp_path / "sync"), holds=("start",), group=True)
    run.sync.wait_for("start", [0, 1])
    run.signal_group(signal.SIGTERM)
    run.sync.release("start")
    code, out, err = run.ended()
    assert code == 0, f"status {code}:\n{out}\n{err[-3000:]}"
    _no_traceback(err)
    step = _records(log)[-1]["step"]
    assert step == 1 and _records(log)[-1]["stopped"] == "SIGTERM"
    saved = os.path.join(ckpt, f"step-{step:08d}")
    assert f"stopped after step {step} (SIGTERM): saved checkpoint {saved}" in out
    assert checkpoint.read_latest(ckpt) == saved
    capsys.readouterr()
    assert (
        main(["train", *TINY_FLAGS, "--steps", str(step + 1), "--save", ckpt, "--load", ckpt, "--log-jsonl", log]) == 0
    )
    assert "starting from scratch" not in capsys.readouterr().out
    assert [r["step"] for r in _records(log)][-2:] == [step, step + 1]  # the relaunch trained step + 1 only
    assert checkpoint.read_latest(ckpt) == os.path.join(ckpt, f"step-{step + 1:08d}")


def test_sigint_to_the_process_group_stops_cleanly_and_a_second_one_ends_the_run_at_once(tmp_path):
    """Ctrl-C (SIGINT to the group) of a ``--nproc 2`` run: the clean stop of the exit signal, exit 0, no
    traceback. Relaunched, held after step 2 while the first SIGINT reaches both ranks, a second SIGINT ends the run
    at once: status 130 and one line naming the latest checkpoint (the one the first launch saved, which loads)."""
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "log.jsonl")
    flags = TINY_FLAGS + ["--steps", "100000", "--nproc", "2", "--save", ckpt, "--load", ckpt, "--log-jsonl", log]
    run = Run(flags, group=True)
    run.logged_step(log)
    run.signal_group(signal.SIGINT)
    code, out, err = run.ended()
    assert code == 0, f"status {code}:\n{out}\n{err[-3000:]}"
    _no_traceback(err)
    step = _records(log)[-1]["step"]
    saved = os.path.join(ckpt, f"step-{step:08d}")
    assert f"stopped after step {step} (SIGINT): saved checkpoint {saved}" in out

    held = f"step-{step + 2}"
    run = Run(flags, str(tmp_path / "sync"), holds=(held,), group=True)
    run.sync.wait_for(held, [0, 1])
    run.signal_group(signal.SIGINT)
    run.sync.wait_for("signal", [0, 1])  # the first reached both ranks (through the launcher, once each)
    run.signal_group(signal.SIGINT)
    code, out, err = run.ended()
    assert code == 130, f"status {code}:\n{out}\n{err[-3000:]}"
    _no_traceback(err)
    assert err.strip().splitlines() == [
        f"megakernels train: interrupted: ended at once without saving; the latest checkpoint is {saved}"
    ], err[-3000:]
    assert [r["step"] for r in _records(log)][-2:] == [step, step + 1]  # resumed; ended while held after step + 2
    assert checkpoint.read_latest(ckpt) == saved
