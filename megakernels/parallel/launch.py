"""Run a function on every rank of a local gloo world of spawned processes and collect what each rank returns.

    results = run_world(4, check_something, 16, timeout=120)   # calls check_something(rank, 4, 16) on 4 ranks

``megakernels train --nproc N`` launches its ranks with it, and the multi-process tests run on it.

Spawned, not forked: each child is a fresh interpreter (no inherited CUDA/OpenMP/gloo state), so ``fn`` must be a
module-level function and its arguments and return value picklable (tensors are fine: they travel as
``torch.save`` bytes, not shared memory, so a rank may exit before the parent reads them).
``MEGAKERNELS_START_METHOD=forkserver`` starts the ranks from a fork server instead: a clean single-threaded
process that imported torch once and forks each rank from there, so a rank starts in milliseconds instead of paying
torch's import (~1.5 s of CPU each) -- for processes that run many small worlds, such as the test suite. Each rank
still gets this process's current environment and working directory, and writes to its stdout/stderr, as a
spawned one would. ``MEGAKERNELS_FORKSERVER_PRELOAD`` (comma-separated module names) adds modules for the server to
import once, e.g. ``megakernels_models.training.train`` (~1.7 s of imports per rank that trains); they must not start
threads or read the environment at import.

The rendezvous store is a ``TCPStore`` hosted by the parent on a port the kernel picks (port 0), so there is no
window between choosing a free port and binding it; every rank connects as a client. With ``init="env"`` the
children instead get torchrun's environment (``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``, with ``TORCHELASTIC_USE_AGENT_STORE=True`` as under torchrun, whose agent hosts the store the same
way) and ``fn`` initialises the process group itself.

Failure never hangs: if a rank raises, the others are killed and the parent raises ``WorldFailed`` with that
rank's traceback; if a rank dies without reporting (``os._exit``, a signal) or the whole world runs past
``timeout`` seconds, everything is killed and the parent fails with a message saying which ranks and why; a timed-out
world's message also holds the Python stack of every thread of every rank that had not finished, as it was when the
time ran out (each rank dumps its own with ``faulthandler`` on ``STACK_SIGNAL``, even while blocked in C++). Children
are always reaped and the store is closed before ``run_world`` returns or raises. With ``watch`` (``launch`` sets
it to the trainer's ``--timeout``) each rank runs a watchdog (``megakernels.parallel.watchdog``) that ends it after
that long without progress, and the parent reads the ranks' heartbeats: it ends the world when one is older than
the timeout (a stopped process cannot end itself), and every failure's message names the ranks that stopped
responding and the phase each rank was in.

No orphans: every rank is killed by the kernel when its parent dies (``PR_SET_PDEATHSIG``), whatever killed the
parent; a rank forked by the fork server lets go of the server's "alive" pipe, so the server exits with the
launcher and its ranks with it, and the watchdog also watches the launcher itself.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib.util
import io
import math
import os
import queue as queue_module
import shutil
import signal
import sys
import threading
import time
import traceback
from multiprocessing import reduction

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megakernels.parallel import liveness, nodes, watchdog

HOST = "127.0.0.1"
# The most ranks ``run_world`` starts on this machine (``megakernels train --nproc`` is refused past it).
MAX_LOCAL_RANKS = 64
_POLL_S = 0.05
# After a rank's exit code is visible, how long its result may still be in flight through the queue's pipe.
_DRAIN_S = 2.0
# On it, a rank writes the Python stacks of all its threads to its file in the world's stack directory (faulthandler:
# a C-level handler, so a rank blocked in a collective or a store wait answers too). SIGUSR1 and SIGTERM are the
# trainer's (preemption).
STACK_SIGNAL = signal.SIGUSR2
# How long a timed-out world's ranks get to write their stacks (a rank that is stopped never does).
_STACK_WAIT_S = 5.0


class WorldFailed(RuntimeError):
    """A rank of a spawned world raised, died or ran past the timeout (the message says which and why)."""


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


START_METHODS = ("spawn", "forkserver")


def _context():
    method = os.environ.get("MEGAKERNELS_START_METHOD", "spawn")
    if method not in START_METHODS:
        raise ValueError(f"MEGAKERNELS_START_METHOD must be one of {', '.join(START_METHODS)}, got {method!r}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        # torch and this package, which read the environment only when used (not at import): what a rank imports
        # after the fork sees the environment it was given (below). Nothing here starts a thread.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "megakernels.parallel.launch"] + _extra_preload())
    return ctx


def _extra_preload() -> list[str]:
    """The modules named by MEGAKERNELS_FORKSERVER_PRELOAD; ValueError for one that cannot be found (the fork
    server would skip it silently)."""
    names = [n.strip() for n in os.environ.get("MEGAKERNELS_FORKSERVER_PRELOAD", "").split(",") if n.strip()]
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ValueError(f"MEGAKERNELS_FORKSERVER_PRELOAD names module {name!r}, which cannot be imported")
    return names


class _Descriptor:
    """A descriptor of this process given to a child it starts: pickled as the child starts, it travels as
    ``multiprocessing.reduction.DupFd`` (through the fork server's socket), and the child receives that DupFd,
    whose ``detach()`` returns the child's copy. Unpickling does nothing else: the child adopts it explicitly."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received, (reduction.DupFd(self.fd),)


def _received(dup):
    return dup


def _adopt_stdio(stdout, stderr) -> None:
    """Make the descriptors received for stdout and stderr (``_Descriptor``'s DupFd) this process's own: a rank
    forked by the fork server otherwise writes to the server's, i.e. to whatever they were when it started."""
    for fd, dup in ((1, stdout), (2, stderr)):
        new = dup.detach()
        os.dup2(new, fd)
        os.close(new)


def _child(
    rank: int,
    world_size: int,
    port: int,
    init: str,
    timeout: float,
    threads: int,
    results,
    fn,
    args,
    launcher: int,
    watch: tuple[float, str] | None,
    stacks: str | None = None,
    signals: tuple[int, ...] = (),
    env: dict | None = None,
    cwd: str | None = None,
    stdout=None,
    stderr=None,
) -> None:
    # First, before anything that can take time: a rank dies with its launcher, whatever killed it.
    watchdog.die_with(launcher)
    if signals:
        _leave_launchers_group(signals)
    if stdout is not None:  # forked from the fork server: write where the launcher writes
        _adopt_stdio(stdout, stderr)
    if stacks is not None:
        _answer_stack_requests(stacks, rank)
    if env is not None:  # forked from the fork server, whose environment is the one it started with
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        _leave_fork_server()
    torch.set_num_threads(threads)
    dog = None
    if watch is not None:
        dog = watchdog.Watchdog(watch[0], rank, liveness_dir=watch[1], launcher=launcher).start()
        dog.progress("rendezvous")
    report = None
    try:
        try:
            if init == "store":
                store = dist.TCPStore(
                    HOST, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout)
                )
                dist.init_process_group(
                    "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
                )
            else:
                os.environ.update(
                    MASTER_ADDR=HOST,
                    MASTER_PORT=str(port),
                    RANK=str(rank),
                    WORLD_SIZE=str(world_size),
                    LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(world_size),
                    TORCHELASTIC_USE_AGENT_STORE=str(True),
                )
            if dog is not None:
                dog.progress("start")
            report = (rank, "ok", _dumps(fn(rank, world_size, *args)))
        finally:
            if dog is not None:
                dog.stop()
    except BaseException:  # noqa: BLE001 - everything a rank raises goes back to the parent
        report = (rank, "error", traceback.format_exc())
    # Report before tearing down: if teardown hangs (peers stuck in a collective), the parent already knows.
    results.put(report)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        results.close()
        results.join_thread()


def _leave_launchers_group(signals: tuple[int, ...]) -> None:
    """Hold ``signals`` (blocked: one that arrives waits, neither lost nor acting) until the rank's code unblocks
    them with its handlers in place, and leave the launcher's process group: a signal to the group (a terminal's
    Ctrl-C, a scheduler's kill of the group) then reaches the launcher alone, which forwards it once to every
    rank, as torchrun's agent does for its workers (each in a session of its own). The launcher starts the ranks
    with the signals blocked, so one sent while a rank starts up is held too; this blocks them again for a rank
    forked by a fork server started earlier."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    with contextlib.suppress(OSError):  # already a group leader: nothing to leave
        os.setpgid(0, 0)


def _answer_stack_requests(directory: str, rank: int) -> None:
    """From now on, ``STACK_SIGNAL`` makes this process write the Python stacks of all its threads to
    ``<directory>/rank-<rank>`` (each request writes them once more, after what is there). The file appears once the
    handler is in place: the launcher signals only ranks that have one (the signal's default action ends a process)."""
    path = os.path.join(directory, f"rank-{rank}")
    f = open(path + ".tmp", "w")  # noqa: SIM115 - faulthandler writes to it until the process exits
    faulthandler.register(STACK_SIGNAL, file=f, all_threads=True)
    os.rename(path + ".tmp", path)


def _stacks_of(procs, ranks, directory: str) -> str:
    """Ask each of ``ranks`` still running for its threads' stacks and return them, one section per rank (a rank
    still starting up, or one that does not answer within ``_STACK_WAIT_S``, e.g. a stopped one, is named as such)."""
    asked = []
    for r in ranks:
        if procs[r].exitcode is None and os.path.exists(os.path.join(directory, f"rank-{r}")):
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[r].pid, STACK_SIGNAL)
                asked.append(r)
    path = {r: os.path.join(directory, f"rank-{r}") for r in asked}

    def size(r):
        try:
            return os.path.getsize(path[r])
        except OSError:
            return 0

    # A dump is written in one go by the signal handler: done when the file has stopped growing.
    deadline, last = time.monotonic() + _STACK_WAIT_S, {}
    while time.monotonic() < deadline:
        now = {r: size(r) for r in asked}
        if all(now[r] > 0 and now[r] == last.get(r) for r in asked):
            break
        last = now
        time.sleep(0.1)
    sections = []
    for r in ranks:
        text, why = "", "it was still starting up" if procs[r].exitcode is None else "it had exited"
        if r in path:
            with contextlib.suppress(OSError), open(path[r]) as f:
                text = _below_child(f.read()).rstrip()
            why = "it did not answer (stopped?)"
        sections.append(f"--- rank {r} (pid {procs[r].pid}) ---\n" + (text or f"(no stack: {why})"))
    return "\n".join(sections)


def _below_child(dump: str) -> str:
    """A faulthandler dump without the frames that start a rank (multiprocessing's, below ``_child``)."""
    out, skipping = [], False
    for line in dump.splitlines():
        if not line.startswith("  File "):
            skipping = False
        elif skipping:
            continue
        out.append(line)
        skipping = skipping or (line.startswith("  File ") and line.endswith(" in _child"))
    return "\n".join(out)


def _leave_fork_server() -> None:
    """Close this rank's write end of the fork server's "alive" pipe. multiprocessing gives one to every process the
    server forks, so that the server lives while any of them does; but the server is the rank's parent, and the
    rank must die when the server does (it exits when the launcher does): a rank stopped by SIGSTOP would otherwise
    keep the server, and so itself, alive for ever after its launcher died. A rank that starts processes of its own
    from a fork server starts a new one."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # private: multiprocessing has no public way to let go of the pipe
    with contextlib.suppress(AttributeError, OSError, TypeError):
        fd, server._forkserver_alive_fd, server._forkserver_address = server._forkserver_alive_fd, None, None
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def _forwarding(signals, procs):
    """While inside: each of ``signals`` received by this process is sent on to the living ``procs`` (those started
    by then: start them inside ``_held``); a second SIGINT is not, it raises ``KeyboardInterrupt`` here (a second
    Ctrl-C ends the world at once)."""
    interrupts = []

    def forward(signum, frame):
        if signum == signal.SIGINT:
            interrupts.append(signum)
            if len(interrupts) > 1:
                raise KeyboardInterrupt
        for p in procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    installed = {}
    if threading.current_thread() is threading.main_thread():  # handlers can be set in the main thread only
        installed = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        yield
    finally:
        for sig, previous in installed.items():
            signal.signal(sig, previous)


@contextlib.contextmanager
def _held(signals):
    """While inside, ``signals`` are blocked in this thread (delivered on leaving): the processes started inside
    inherit them blocked, and one that arrives meanwhile is forwarded once they all exist."""
    if not signals or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _stop(procs, grace: float = 1.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


def run_world(
    world_size: int,
    fn,
    *args,
    timeout: float = 120.0,
    init: str = "store",
    threads: int = 1,
    world_timeout: float | None = -1.0,
    forward_signals: tuple[int, ...] = (),
    watch: float | None = None,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks in a gloo world; return their results.

    Args:
        world_size: number of processes (1..``MAX_LOCAL_RANKS``).
        fn: a module-level (picklable) function; its return value must be picklable.
        args: extra picklable arguments passed to every rank.
        timeout: seconds for each collective and the rendezvous; also for the whole world (startup included)
            unless ``world_timeout`` says otherwise.
        world_timeout: seconds for the whole world; None for no limit (a training run), -1 for ``timeout``.
        init: ``"store"`` (the default; the process group is initialised before ``fn`` runs) or ``"env"``
            (torchrun's environment variables are set and ``fn`` initialises the process group).
        threads: CPU threads per rank (``torch.set_num_threads``, ``OMP_NUM_THREADS``).
        forward_signals: signals that this process, while it waits, passes on to every living rank instead of
            acting on them (the trainer's stop signals: the ranks save and exit, and so does the launcher); a
            second SIGINT among them is not passed on but raises ``KeyboardInterrupt`` here, ending the world.
            The ranks hold them blocked from their start (one sent while a rank starts up waits) until ``fn``
            unblocks them (``signal.pthread_sigmask``) with its handlers in place, and each rank leaves this
            process's group, so a signal to the whole group reaches each rank once, through this process.
        watch: seconds a rank may go without reporting progress (``megakernels.parallel.watchdog``; ``fn`` must
            call ``watchdog.progress`` more often than that) before its watchdog ends it; this process also ends
            the world when a rank's heartbeat is that old (a stopped process), and says which rank stopped
            responding and in which phase each rank was. None: no watchdog.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        ValueError: ``world_size`` outside 1..64, an unknown ``init`` or ``MEGAKERNELS_START_METHOD``, ``watch``
            not > 0.
        WorldFailed: a rank raised (its traceback is in the message), died, stopped responding, or the world timed
            out.
    """
    if not 1 <= int(world_size) <= MAX_LOCAL_RANKS:
        raise ValueError(f"run_world: world_size must be in 1..{MAX_LOCAL_RANKS}, got {world_size}")
    if init not in ("store", "env"):
        raise ValueError(f"run_world: init must be 'store' or 'env', got {init!r}")
    if watch is not None and not watch > 0:
        raise ValueError(f"run_world: watch must be > 0 seconds (or None), got {watch}")
    ctx = _context()
    results = ctx.Queue()
    store = dist.TCPStore(
        HOST, 0, world_size, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout)
    )
    procs = []
    beats = liveness.new_dir() if watch is not None else None
    stacks = liveness.new_dir("stacks")  # where the ranks dump their stacks when the world times out
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    try:
        # The children read these at import time, before any code of ours runs in them.
        os.environ.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        forked = ctx.get_start_method() == "forkserver"
        where = (dict(os.environ), os.getcwd(), _Descriptor(1), _Descriptor(2)) if forked else ()
        with _forwarding(forward_signals, procs):
            with _held(forward_signals):
                for rank in range(world_size):
                    p = ctx.Process(
                        target=_child,
                        name=f"rank{rank}",
                        daemon=True,
                        args=(
                            rank,
                            world_size,
                            store.port,
                            init,
                            timeout,
                            threads,
                            results,
                            fn,
                            args,
                            os.getpid(),
                            None if watch is None else (watch, beats),
                            stacks,
                            tuple(forward_signals),
                            *where,
                        ),
                    )
                    p.start()
                    procs.append(p)
            return _collect(
                procs,
                results,
                world_size,
                timeout if world_timeout == -1.0 else world_timeout,
                fn,
                _Liveness(beats, watch) if beats is not None else None,
                stacks,
            )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _stop(procs)
        results.close()
        results.join_thread()
        del store
        if beats is not None:
            shutil.rmtree(beats, ignore_errors=True)
        if stacks is not None:
            shutil.rmtree(stacks, ignore_errors=True)


class _Liveness:
    """The launcher's view of its ranks' heartbeats (``megakernels.parallel.watchdog``)."""

    def __init__(self, directory: str, timeout: float):
        self.directory, self.timeout = directory, timeout
        self.next_check = time.monotonic()

    def unresponsive(self, procs, done) -> str | None:
        """Why the world must end now: a living rank's heartbeat is older than the timeout (checked once per
        watchdog interval); else None."""
        now = time.monotonic()
        if now < self.next_check:
            return None
        self.next_check = now + watchdog.interval(self.timeout)
        records = liveness.read(self.directory)
        late = [
            r
            for r, rec in records.items()
            if r not in done and procs[r].exitcode is None and now - rec["beat"] > self.timeout
        ]
        if not late:
            return None
        return self.report(set())

    def report(self, skip) -> str:
        """What each rank not in ``skip`` was doing: the stale ones first, as having stopped responding."""
        records = {r: rec for r, rec in liveness.read(self.directory).items() if r not in skip}
        return liveness.summary(records, time.monotonic(), watchdog.stale_after(self.timeout))

    def verdict(self, rank: int) -> str | None:
        """The line a rank's watchdog printed before ending it, if it left one."""
        return liveness.read_verdict(self.directory, rank)


def _collect(
    procs, results, world_size: int, timeout: float | None, fn, beats: _Liveness | None = None, stacks=None
) -> list:
    name = f"run_world({world_size}, {getattr(fn, '__qualname__', repr(fn))})"
    out: dict[int, object] = {}
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    dead_since: dict[int, float] = {}

    def dead_ranks(wait: float) -> list[str]:
        # Ranks that exited without reporting; a peer's exit usually surfaces first as a gloo error on a survivor.
        end = time.monotonic() + wait
        while True:
            dead = [died(r, p.exitcode) for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
            if dead or time.monotonic() >= end:
                return dead
            time.sleep(_POLL_S)

    def died(rank: int, code: int) -> str:
        if beats is not None and code == watchdog.EXIT_CODE:
            return f"rank {rank} was ended by its watchdog (no progress for the {beats.timeout:g} s timeout)"
        return f"rank {rank} died with exit code {code} before returning a result"

    def failed(cause: str, skip=()) -> WorldFailed:
        # Which ranks stopped responding and where every rank was: stale heartbeats first, so the rank that
        # stopped is named before the peers that timed out waiting for it.
        states = beats.report(set(skip)) if beats is not None else ""
        return WorldFailed(f"{name}: " + (f"{states}; " if states else "") + cause)

    while len(out) < world_size:
        try:
            rank, status, payload = results.get(timeout=_POLL_S)
        except queue_module.Empty:
            pass
        else:
            if status == "error":
                dead = dead_ranks(0.5)
                cause = "".join(f"{d}; " for d in dead)
                raise failed(f"{cause}rank {rank} raised:\n{payload}", skip=[rank])
            out[rank] = _loads(payload)
            continue
        now = time.monotonic()
        for rank, p in enumerate(procs):
            if rank in out or p.exitcode is None:
                continue
            # Exited without a result yet: give the queue's pipe a moment, then call it dead.
            first = dead_since.setdefault(rank, now)
            if beats is not None and p.exitcode == watchdog.EXIT_CODE:
                verdict = beats.verdict(rank)  # its line, with what its peers were doing
                raise WorldFailed(f"{name}: {verdict}") if verdict else failed(died(rank, p.exitcode), skip=[rank])
            if now - first > _DRAIN_S:
                raise failed(died(rank, p.exitcode), skip=[rank])
        if beats is not None:
            stopped = beats.unresponsive(procs, out)
            if stopped is not None:
                raise WorldFailed(f"{name}: {stopped}")
        if now > deadline:
            missing = [r for r in range(world_size) if r not in out]
            where = "" if stacks is None else "; where each was:\n" + _stacks_of(procs, missing, stacks)
            raise WorldFailed(
                f"{name}: timed out after {timeout:g} s; ranks {missing} had not finished (a hang, "
                f"a deadlock or a dead peer){where}"
            )
    return [out[r] for r in range(world_size)]


@contextlib.contextmanager
def single_process_world(device: str = "cpu", timeout: float = 600.0, parallel: bool = False):
    """A one-rank ``torch.distributed`` world in this process (gloo, or nccl for ``device="cuda"``), torn down on
    exit; with ``parallel``, ``megakernels.parallel`` initialised at tp = pp = dp = 1 inside it. For single-device
    training, evaluation, dry runs and benchmarks, which run the same code as a multi-rank world."""
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        if not parallel:
            yield
            return
        from megakernels.parallel import state

        state.initialize(1, 1)
        try:
            yield
        finally:
            state.destroy()
    finally:
        dist.destroy_process_group()


def _call(rank: int, world_size: int, fn, args):
    return fn(*args)


def _remove_if_empty(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _init_torchrun_world(backend: str, timeout: datetime.timedelta) -> None:
    """``init_process_group`` from torchrun's environment, every key of this world under a prefix of its own.

    torchrun's agents share one store across the rendezvous rounds of a job (the rank-0 agent's), and process
    groups are named by a count, the same in every round: after an elastic restart a rank could read the address a
    rank of the previous round published for a group of the same name and connect to a dead process ("Connection
    refused" in ``new_group``). A round is one restart count (``TORCHELASTIC_RESTART_COUNT``: each failure adds
    one) at one world size (a scale-up restarts at a larger world without counting), so the prefix holds both."""
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    generation = f"megakernels/restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-world-{world}/"
    dist.init_process_group(
        backend, store=dist.PrefixStore(generation + "default_pg", store), rank=rank, world_size=world, timeout=timeout
    )


def _name_lost_nodes(node_map) -> None:
    """A torchrun worker failed: print which other nodes are lost, if any (``nodes.NodeMap.report``)."""
    if node_map is None:
        return
    try:
        report = node_map.report()
    except Exception as e:  # noqa: BLE001 - the rank's own error follows; say why this report is missing
        report = f"could not tell which nodes answer: {e}"
    if report:
        print(f"{watchdog.PROGRAM}: rank {os.environ.get('RANK', '?')}: {report}", file=sys.stderr, flush=True)


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (its environment names the rendezvous)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(fn, *args, nproc: int = 1, device: str = "cpu", timeout: float = 600.0, signals: tuple[int, ...] = ()):
    """Run ``fn(*args)`` on every rank of a ``torch.distributed`` world and return the last rank's result.

    The world is torchrun's when this process was started by it (nccl for ``device="cuda"``, each rank on GPU
    ``LOCAL_RANK``; gloo otherwise), else this process alone (``nproc == 1``), else ``nproc`` spawned local gloo
    processes with ``cpu_count // nproc`` threads each (the CPU's way to run a multi-rank layout). The process
    group is torn down afterwards in every case. For CUDA it sets ``CUDA_DEVICE_MAX_CONNECTIONS=1`` unless the
    environment sets it (the overlap of collectives with GEMMs depends on it, docs/parallelism.md).

    Every rank runs a watchdog (``megakernels.parallel.watchdog``): ``fn`` reports its phases with
    ``watchdog.progress``, and a rank that goes ``timeout`` seconds without progress (a step, a collective, a save)
    is ended with a line naming its phase; the job ends within about twice the timeout. A spawned rank or a
    torchrun worker also dies with its launcher (the spawning process, or torchrun's agent), whatever killed it.
    Under torchrun, a failing rank also ends its local peers that stopped responding: a stopped process cannot act
    on the agent's SIGTERM, which the agent would wait 30 s for; and in a job of several nodes it names the nodes
    that are lost (``megakernels.parallel.nodes``: each node's local rank 0 holds a beacon the others knock on).

    ``signals`` are those ``fn`` handles (the trainer's stop signals): spawned ranks start with them held and
    receive them through this process, once each, even when they are sent to the whole process group
    (``run_world``'s ``forward_signals``); ``fn`` unblocks them with its handlers installed.

    Raises:
        ValueError: ``nproc > 1`` with ``device="cuda"`` outside torchrun (one process per GPU is torchrun's job).
        WorldFailed: a spawned rank raised, died or stopped responding (its error in the message).
    """
    if device == "cuda":
        # One hardware queue, so collectives queued before a GEMM start before it (docs/parallelism.md). Read when
        # the CUDA context is created, which has not happened yet in a launcher's process.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if under_torchrun():
        agent = os.getppid()  # torchrun's agent started this process; a death before this line goes unnoticed
        watchdog.die_with(agent)
        beats = liveness.local_dir()
        with (
            contextlib.ExitStack() as cleanup,
            watchdog.Watchdog(
                timeout, int(os.environ["RANK"]), liveness_dir=beats, launcher=agent, end_stale_peers=True
            ) as dog,
        ):
            if beats is not None and not os.environ.get(liveness.ENV_DIR):
                # the agent's directory, once its last rank is done with it (removal fails while records remain)
                cleanup.callback(_remove_if_empty, beats)
            dog.progress("rendezvous")
            if device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            _init_torchrun_world("nccl" if device == "cuda" else "gloo", datetime.timedelta(seconds=timeout))
            node_map = None
            try:
                # in a job of several nodes: every node's ranks and beacon, to name a lost node when a rank fails
                node_map = nodes.NodeMap.gather()
                if node_map is not None:
                    dog.explain = node_map.report
                dog.progress("start")
                return fn(*args)
            except BaseException:
                dog.end_stale_peers()
                _name_lost_nodes(node_map)
                raise
            finally:
                dog.progress("teardown")
                dog.explain = None
                if node_map is not None:
                    node_map.close()
                dist.destroy_process_group()
    if nproc == 1:
        if device == "cuda":
            torch.cuda.set_device(0)
        with single_process_world(device, timeout), watchdog.Watchdog(timeout):
            return fn(*args)
    if device == "cuda":
        raise ValueError(
            f"launch: nproc={nproc} spawns CPU (gloo) processes; for GPUs use torchrun --nproc-per-node {nproc}"
        )
    threads = max(1, (os.cpu_count() or 1) // nproc)
    # A stop signal sent to this launcher or to its whole process group reaches every rank once; they decide
    # together when to stop (megakernels_models.training.preemption).
    return run_world(
        nproc,
        _call,
        fn,
        args,
        timeout=timeout,
        threads=threads,
        world_timeout=None,
        forward_signals=tuple(signals),
        watch=timeout,
    )[-1]
