"""Checkpoints under the faults operators cause: damaged files are found on load (naming the tensor and the file)
and a resume falls back to the newest checkpoint that verifies; one job at a time writes a directory; a full disk
costs a reported, cleaned-up save and the next save succeeds once space is back; damaged markers and metadata give
one clear error. The disk-full cases run on a real, small tmpfs (mounting needs root, as CI has)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading

import pytest

from megakernels_models.arguments import TrainArgs
from megakernels_models.cli import main
from megakernels_models.training import checkpoint, syncpoints
from megakernels_models.training import checkpoint_store as store
from megakernels_models.training import checkpoint_verify as verified

TINY = TrainArgs(
    preset=None,
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    seq_length=16,
    dropout=0.0,
    steps=4,
    micro_batch_size=2,
    global_batch_size=4,
    eval_interval=0,
    progress=False,
    corpus_bytes=1 << 18,
)


def _train(**changes) -> list[dict]:
    from megakernels_models.training.train import train

    return train(dataclasses.replace(TINY, **changes))


def _flip_byte(ckpt: str, entry_prefix: str, mask: int = 0x10) -> tuple[str, str]:
    """Flip one byte in the middle of the stored bytes of the first chunk whose entry starts with ``entry_prefix``;
    returns (entry, file)."""
    md = verified.read_metadata(ckpt)
    index, info = next(
        (i, s) for i, s in sorted(md.storage_data.items(), key=lambda kv: kv[0].fqn) if i.fqn.startswith(entry_prefix)
    )
    path = os.path.join(ckpt, info.relative_path)
    with open(path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        b = f.read(1)
        f.seek(info.offset + info.length // 2)
        f.write(bytes([b[0] ^ mask]))
    return index.fqn, path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run of 4 steps saving after steps 2 and 4 (both kept): the pristine copy tests damage in their own copy."""
    from megakernels.parallel.launch import single_process_world

    root = tmp_path_factory.mktemp("saved")
    with single_process_world():
        records = _train(save=str(root / "ckpt"), save_interval=2, keep_checkpoints=2)
        resumed = _train(load=str(root / "ckpt" / "step-00000002"))  # what a resume from step 2 gives
    return root / "ckpt", [r["loss"] for r in records], [r["loss"] for r in resumed]


def _copy(saved, tmp_path):
    import shutil

    dst = tmp_path / "ckpt"
    shutil.copytree(saved, dst)
    return dst


@pytest.mark.parametrize("prefix", ["model.layers.1.", "optimizer.exp_avg_sq.", "meta"])
def test_a_flipped_byte_is_named_by_verify(saved, tmp_path, prefix, capsys):
    ckpt = _copy(saved[0], tmp_path)
    assert verified.verify(str(ckpt / "step-00000004")) == []
    entry, file = _flip_byte(str(ckpt / "step-00000004"), prefix)
    problems = verified.verify(str(ckpt / "step-00000004"))
    assert len(problems) == 1 and entry in problems[0] and file in problems[0], problems
    assert main(["checkpoint", "verify", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert "step-00000002: ok" in out and "step-00000004: FAILED" in out and entry in out


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(saved, world1, tmp_path, capsys):
    ckpt = _copy(saved[0], tmp_path)
    _flip_byte(str(ckpt / "step-00000004"), "optimizer.exp_avg.")
    losses = [r["loss"] for r in _train(steps=4, load=str(ckpt))]
    assert losses == saved[2]  # resumed from step 2, exactly as a resume from it gives
    err = capsys.readouterr().err
    assert "step-00000004 fails verification" in err and "falling back to" in err and "step-00000002" in err


def test_a_damaged_checkpoint_named_directly_is_refused(saved, world1, tmp_path):
    ckpt = _copy(saved[0], tmp_path)
    entry, _ = _flip_byte(str(ckpt / "step-00000004"), "model.embedding.")
    with pytest.raises(checkpoint.CheckpointError, match=f"no checkpoint verifies.*{entry}"):
        _train(steps=6, load=str(ckpt / "step-00000004"))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_metadata_is_one_clear_error_and_resume_falls_back(saved, world1, tmp_path, damage, capsys):
    ckpt = _copy(saved[0], tmp_path)
    meta = ckpt / "step-00000004" / store.METADATA
    data = meta.read_bytes()
    meta.write_bytes(data[: len(data) // 3] if damage == "truncated" else os.urandom(len(data)))
    with pytest.raises(checkpoint.CheckpointError, match=r"\.metadata is unreadable"):
        checkpoint.read_meta(str(ckpt / "step-00000004"))
    assert "unreadable" in verified.verify(str(ckpt / "step-00000004"))[0]
    assert [r["loss"] for r in _train(steps=4, load=str(ckpt))] == saved[2]
    assert "falling back" in capsys.readouterr().err


def test_a_damaged_meta_entry_without_digests_is_one_clear_error(saved, tmp_path):
    ckpt = _copy(saved[0], tmp_path)
    os.remove(ckpt / "step-00000004" / verified.DIGESTS)  # as a checkpoint from before digests
    _flip_byte(str(ckpt / "step-00000004"), "meta", mask=0x80)  # no longer UTF-8
    with pytest.raises(checkpoint.CheckpointError, match="'meta' entry is unreadable"):
        checkpoint.read_meta(str(ckpt / "step-00000004"))


@pytest.mark.parametrize("marker", ["binary", "directory", "empty"])
def test_a_damaged_latest_marker_falls_back_to_the_newest_complete_checkpoint(saved, tmp_path, marker):
    ckpt = _copy(saved[0], tmp_path)
    latest = ckpt / store.LATEST
    os.remove(latest)
    if marker == "binary":
        latest.write_bytes(b"\xff\xfe\x00step\x9c")
    elif marker == "directory":
        latest.mkdir()
    else:
        latest.write_bytes(b"")
    assert checkpoint.read_latest(str(ckpt)) == str(ckpt / "step-00000004")


def test_verify_cli_exit_status_without_checkpoints(tmp_path, capsys):
    assert main(["checkpoint", "verify", str(tmp_path)]) == 2
    assert main(["checkpoint", "verify", str(tmp_path / "nowhere")]) == 2
    assert "no such directory" in capsys.readouterr().err


# ---- one writer per directory -------------------------------------------------------------------------------


def test_a_second_writer_is_refused_while_the_owner_lives(tmp_path):
    first = store.DirectoryLock(str(tmp_path)).acquire()
    try:
        with pytest.raises(RuntimeError, match=rf"in use by another job \(pid {os.getpid()} on host"):
            store.DirectoryLock(str(tmp_path)).acquire()
    finally:
        first.release()
    store.DirectoryLock(str(tmp_path)).acquire().release()  # released: free again


def test_a_training_run_refuses_a_directory_another_job_writes(world1, tmp_path):
    holder = store.DirectoryLock(str(tmp_path)).acquire()
    try:
        with pytest.raises(checkpoint.CheckpointError, match="in use by another job"):
            _train(steps=1, save=str(tmp_path))
    finally:
        holder.release()
    assert not any(n.startswith("step-") for n in os.listdir(tmp_path))


def test_a_dead_owners_lock_is_taken_over(tmp_path):
    code = (
        "import sys; from megakernels_models.training import checkpoint_store as s;"
        " s.DirectoryLock(sys.argv[1]).acquire();"
        " print('locked', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(RuntimeError, match=f"pid {proc.pid}"):
            store.DirectoryLock(str(tmp_path)).acquire()
        proc.kill()
        proc.wait(timeout=30)
        lock = store.DirectoryLock(str(tmp_path)).acquire()
        assert f"pid {proc.pid}" in lock.took_over
        lock.release()
    finally:
        proc.kill()
        proc.wait(timeout=30)


# ---- a full disk ----------------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path, saved):
    """A tmpfs with room for three checkpoints of the tiny model (a real file system that runs out of space)."""
    size = sum(f.stat().st_size for f in (saved[0] / "step-00000004").iterdir())
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={3 * size + (64 << 10)}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount, size
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(mount, leave: int) -> str:
    """Fill the file system at ``mount`` up to ``leave`` free bytes."""
    import shutil

    path = os.path.join(mount, "filler")
    with open(path, "wb") as f:
        f.write(b"\0" * max(0, shutil.disk_usage(mount).free - leave))
    return path


def _wait_for(path, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.005)  # polling a condition the run sets, with a deadline


def _while_held(monkeypatch, sync_dir, actions: dict):
    """Run the trainer with ``actions[step]()`` done while the run is held after that optimizer step."""
    monkeypatch.setenv(syncpoints.ENV, str(sync_dir))
    sync_dir.mkdir()
    for step in actions:
        (sync_dir / f"step-{step}.hold").touch()

    def act():
        for step, fn in sorted(actions.items()):
            _wait_for(sync_dir / f"step-{step}.0")
            fn()
            os.remove(sync_dir / f"step-{step}.hold")

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("how", ["precheck", "enospc", "enospc-async"])
def test_a_full_disk_costs_one_reported_save_and_the_next_one_succeeds(
    world1, small_disk, tmp_path, monkeypatch, how, capsys
):
    mount, size = small_disk
    if how != "precheck":  # let the save start, so that the file system itself says it is full
        monkeypatch.setattr(checkpoint, "SPACE_MARGIN", 0.0)
    filler = []

    def space_back():  # once the failed save (in the writer thread, for async) has cleaned up
        _wait_for(tmp_path / "sync" / "checkpoint-failed-00000001.0")
        os.remove(filler[0])

    thread = _while_held(
        monkeypatch, tmp_path / "sync", {1: lambda: filler.append(_fill(mount, size // 3)), 2: space_back}
    )
    records = _train(
        steps=4, save=str(mount / "ckpt"), save_interval=1, keep_checkpoints=1, async_save=how.endswith("async")
    )
    thread.join()
    errors = {r["step"]: r.get("checkpoint_error") for r in records}
    # an asynchronous save's failure is reported at the next step boundary
    failed_step = 2 if how.endswith("async") else 1
    expected = "not enough disk space" if how == "precheck" else "No space left on device"
    assert expected in (errors[failed_step] or ""), errors
    assert "save of step 1 failed" in errors[failed_step] and "there is no checkpoint yet" in errors[failed_step]
    assert [s for s, e in errors.items() if e] == [failed_step]
    assert not [n for n in os.listdir(mount / "ckpt") if n.startswith(".tmp-")]  # cleaned up
    assert store.find_latest(str(mount / "ckpt")).endswith("step-00000004")
    assert verified.verify(str(mount / "ckpt" / "step-00000004")) == []
    assert "Traceback" not in capsys.readouterr().err


def test_saves_failing_in_a_row_stop_the_run(world1, small_disk, tmp_path, monkeypatch, capsys):
    mount, size = small_disk
    thread = _while_held(monkeypatch, tmp_path / "sync", {2: lambda: _fill(mount, size // 3)})
    records = _train(steps=8, save=str(mount / "ckpt"), save_interval=1, max_save_failures=2)
    thread.join()
    assert [r["step"] for r in records] == [1, 2, 3]  # step 1 saved; steps 2 and 3 failed
    assert "2 checkpoint saves in a row failed" in records[-1]["failed"]
    assert "step-00000001" in records[-1]["failed"]
    err = capsys.readouterr().err
    assert "error: stopped after step 3" in err and "Traceback" not in err


def test_an_unwritable_log_is_one_warning_and_training_goes_on(world1, capsys):
    records = _train(steps=2, log_jsonl="/dev/full")
    assert len(records) == 2
    err = capsys.readouterr().err
    assert err.count("cannot write --log-jsonl /dev/full") == 1 and "Traceback" not in err


# ---- fuzz: damaged checkpoints --------------------------------------------------------------------------------


def _damage(ckpt, draw) -> tuple[str, bool]:
    """Damage one file of the checkpoint ``ckpt`` as ``draw`` says; returns (what was done, whether the stored
    tensors' bytes changed: a change verification must find)."""
    from hypothesis import strategies as st

    files = sorted(p for p in ckpt.iterdir() if p.is_file())
    file = draw(st.sampled_from(files))
    data = bytearray(file.read_bytes())
    how = draw(st.sampled_from(["flip", "truncate", "garbage", "delete"]))
    data_file = file.suffix == ".distcp"
    if how == "flip" and data:
        at = draw(st.integers(0, len(data) - 1))
        data[at] ^= draw(st.integers(1, 255))
        file.write_bytes(bytes(data))
        # a data file holds only chunks (DCP's pickled headers are inside their ranges)
        return f"flip byte {at} of {file.name}", data_file
    if how == "truncate" and data:
        file.write_bytes(bytes(data[: draw(st.integers(0, len(data) - 1))]))
        return f"truncate {file.name}", data_file
    if how == "garbage":
        file.write_bytes(os.urandom(max(1, len(data))))
        return f"garbage {file.name}", data_file
    file.unlink()
    return f"delete {file.name}", data_file


def test_fuzz_damaged_checkpoints_are_found_or_refused_never_a_traceback(saved, tmp_path):
    """Any damage to any file of a checkpoint: verification never raises; damage to the stored bytes is always
    found; reading the checkpoint's meta either works or raises CheckpointError (nothing else)."""
    import shutil

    from hypothesis import given, settings
    from hypothesis import strategies as st

    pristine = saved[0] / "step-00000004"
    seen = []

    @settings(max_examples=40, deadline=None, derandomize=True, database=None)
    @given(st.data())
    def check(data):
        ckpt = tmp_path / "case"
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.copytree(pristine, ckpt)
        what, must_find = _damage(ckpt, data.draw)
        seen.append(what)
        problems = verified.verify(str(ckpt))
        assert isinstance(problems, list)
        if must_find:
            assert problems, f"{what}: not found"
        try:
            checkpoint.read_meta(str(ckpt))
        except checkpoint.CheckpointError:
            pass

    check()
    assert any("flip" in s for s in seen) and any("delete" in s for s in seen)


def test_readers_skip_a_damaged_newest_checkpoint(saved, tmp_path, capsys):
    """Evaluation, conversion and generation find their checkpoint through read_latest: it verifies too."""
    ckpt = _copy(saved[0], tmp_path)
    entry, _ = _flip_byte(str(ckpt / "step-00000004"), "model.final_norm")
    assert checkpoint.read_latest(str(ckpt)) == str(ckpt / "step-00000002")
    assert entry in capsys.readouterr().err
    _flip_byte(str(ckpt / "step-00000002"), "model.final_norm")
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint verifies"):
        checkpoint.read_latest(str(ckpt))


def test_an_incremental_checkpoint_verifies_the_older_files_it_references(world1, tmp_path):
    """Frozen parameters are not rewritten (their chunks point at an older step's file): their digests travel with
    the newer checkpoint, and damage in the older file is found when the newer checkpoint is verified."""
    _train(steps=3, save=str(tmp_path), save_interval=1, keep_checkpoints=3, freeze="embedding.word")
    newest = tmp_path / "step-00000003"
    md = verified.read_metadata(str(newest))
    shared = [(i, s) for i, s in md.storage_data.items() if s.relative_path.startswith("../")]
    assert shared and verified.verify(str(newest)) == []
    index, info = shared[0]
    file = os.path.normpath(os.path.join(newest, info.relative_path))
    with open(file, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        b = f.read(1)
        f.seek(info.offset + info.length // 2)
        f.write(bytes([b[0] ^ 0x01]))
    problems = verified.verify(str(newest))
    assert len(problems) == 1 and index.fqn in problems[0] and file in problems[0]
