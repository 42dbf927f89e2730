"""The multi-process harness itself: results come back in rank order; a rank that raises, dies or hangs fails the
parent with a message (never a hang), and no child process is left behind."""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from megakernels.parallel import launch
from tests.parallel import harness
from tests.parallel.harness import run_world


def _sum_of_ranks(rank, world_size, scale):
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    return {"rank": rank, "sum": x * scale, "threads": torch.get_num_threads()}


def _rank_one_raises(rank, world_size):
    if rank == 1:
        raise RuntimeError("deliberate failure on rank one")
    dist.barrier()  # rank 0 waits for a peer that never comes: it must be killed, not waited for


def _rank_one_exits(rank, world_size):
    if rank == 1:
        os._exit(7)
    dist.barrier()


def _rank_zero_hangs(rank, world_size):
    if rank == 0:
        threading.Event().wait()  # a hang: an event nothing sets
    return rank


def _rank_zero_hangs_and_rank_one_waits_for_it(rank, world_size):
    if rank == 0:
        threading.Event().wait()  # a hang in Python: an event nothing sets
    dist.barrier()  # blocked in gloo (C++): its stack must come back all the same


def _env_initialised(rank, world_size):
    assert not dist.is_initialized()
    dist.init_process_group("gloo")  # from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, as under torchrun
    x = torch.ones(1)
    dist.all_reduce(x)
    return int(x.item()), dist.get_rank()


def _where_am_i(rank, world_size):
    # one write of the whole line: print's text and newline are two writes, which two ranks sharing the file
    # interleave when stdout is unbuffered
    sys.stdout.write(f"rank {rank} on stdout\n")
    sys.stdout.flush()
    return os.getcwd(), os.environ.get("MEGAKERNELS_TEST_MARK")


def _preloaded(rank, world_size, names):
    return {name: name in sys.modules for name in names}


def _no_children_left():
    deadline = time.monotonic() + 5
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not multiprocessing.active_children()


def _port_released(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_results_come_back_in_rank_order_with_one_thread_per_rank(monkeypatch, start_method):
    monkeypatch.setenv("MEGAKERNELS_START_METHOD", start_method)
    ports = harness.record_store_ports(monkeypatch)
    out = run_world(3, _sum_of_ranks, 2.0, timeout=60)
    assert [r["rank"] for r in out] == [0, 1, 2]
    assert all(torch.equal(r["sum"], torch.tensor([6.0])) for r in out)
    assert all(r["threads"] == 1 for r in out)
    _no_children_left()
    assert len(ports) == 1 and _port_released(ports[0])


def test_env_init_lets_the_function_initialise_like_torchrun():
    assert run_world(2, _env_initialised, init="env", timeout=60) == [(2, 0), (2, 1)]
    _no_children_left()


def test_a_raising_rank_fails_the_parent_with_its_traceback(monkeypatch):
    ports = harness.record_store_ports(monkeypatch)
    with pytest.raises(AssertionError, match="rank 1 raised") as info:  # not "timed out": it did not wait
        run_world(2, _rank_one_raises, timeout=60)
    assert "deliberate failure on rank one" in str(info.value)
    assert "_rank_one_raises" in str(info.value)  # the traceback, not just the message
    assert "timed out" not in str(info.value)
    _no_children_left()
    assert len(ports) == 1 and _port_released(ports[0])


def test_a_dying_rank_fails_the_parent_instead_of_hanging():
    with pytest.raises(AssertionError, match="rank 1 died with exit code 7") as info:  # before the timeout
        run_world(2, _rank_one_exits, timeout=60)
    assert "timed out" not in str(info.value)
    _no_children_left()


def test_a_hanging_world_times_out():
    # Rank 1 returns at once, unless a loaded machine made its start-up alone outlast the timeout.
    with pytest.raises(AssertionError, match=r"timed out after 5 s; ranks \[0(, 1)?\] had not finished"):
        run_world(2, _rank_zero_hangs, timeout=5)
    _no_children_left()


def test_a_timed_out_world_reports_where_every_unfinished_rank_was(monkeypatch):
    monkeypatch.setenv("MEGAKERNELS_START_METHOD", "forkserver")
    made, new_dir = [], launch.liveness.new_dir

    def recording(*args):
        made.append(new_dir(*args))
        return made[-1]

    monkeypatch.setattr(launch.liveness, "new_dir", recording)
    run_world(1, _sum_of_ranks, 1.0, timeout=120)  # the fork server is up: the ranks below start in milliseconds
    with pytest.raises(AssertionError, match=r"timed out after 10 s; ranks \[0, 1\] had not finished") as info:
        run_world(2, _rank_zero_hangs_and_rank_one_waits_for_it, timeout=10)
    message = str(info.value)
    rank0, rank1 = message.split("--- rank 0 (pid ")[1].split("--- rank 1 (pid ")
    assert "in _rank_zero_hangs_and_rank_one_waits_for_it" in rank0 and " in barrier" not in rank0
    assert " in barrier" in rank1 and "in _rank_zero_hangs_and_rank_one_waits_for_it" in rank1
    _no_children_left()
    assert made and not any(os.path.exists(d) for d in made)  # the stack directories are removed


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="world_size"):
        run_world(0, _sum_of_ranks, 1.0)
    with pytest.raises(ValueError, match="init"):
        run_world(1, _sum_of_ranks, 1.0, init="file")


def test_forkserver_ranks_get_the_current_environment_directory_and_stdout(monkeypatch, tmp_path):
    """The fork server keeps the environment, directory and stdout it started with; each rank must still see the
    launcher's as they are at launch, as a spawned rank does."""
    monkeypatch.setenv("MEGAKERNELS_START_METHOD", "forkserver")
    run_world(1, _where_am_i, timeout=60)  # the server is running from here on
    monkeypatch.setenv("MEGAKERNELS_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "stdout.txt"
    saved = os.dup(1)
    try:
        with open(log, "w") as f:
            os.dup2(f.fileno(), 1)
            out = run_world(2, _where_am_i, timeout=60)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert out == [(str(tmp_path), "set after the server started")] * 2
    # (other writers of this process's stdout may add lines of their own while it is redirected)
    assert sorted(line for line in log.read_text().splitlines() if "on stdout" in line) == [
        "rank 0 on stdout",
        "rank 1 on stdout",
    ]
    _no_children_left()


def test_forkserver_ranks_start_with_the_preload_modules_imported(monkeypatch):
    """What MEGAKERNELS_FORKSERVER_PRELOAD names (tests/conftest.py: the trainer) is imported by the fork server
    once, so a rank starts with it; nothing this test module imports pulls it in."""
    monkeypatch.setenv("MEGAKERNELS_START_METHOD", "forkserver")
    names = [n for n in os.environ.get("MEGAKERNELS_FORKSERVER_PRELOAD", "").split(",") if n]
    assert "megakernels_models.training.train" in names and "torch._dynamo" in names
    assert run_world(2, _preloaded, names, timeout=60) == [{name: True for name in names}] * 2


def test_a_preload_module_that_does_not_exist_is_named(monkeypatch):
    monkeypatch.setenv("MEGAKERNELS_START_METHOD", "forkserver")
    monkeypatch.setenv("MEGAKERNELS_FORKSERVER_PRELOAD", "torch,no_such_module_here")
    with pytest.raises(ValueError, match="MEGAKERNELS_FORKSERVER_PRELOAD names module 'no_such_module_here'"):
        run_world(1, _sum_of_ranks, 1.0)


def test_an_unknown_start_method_is_named(monkeypatch):
    monkeypatch.setenv("MEGAKERNELS_START_METHOD", "fork")
    with pytest.raises(ValueError, match="MEGAKERNELS_START_METHOD must be one of spawn, forkserver, got 'fork'"):
        run_world(1, _sum_of_ranks, 1.0)
