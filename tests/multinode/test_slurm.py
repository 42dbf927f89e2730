"""``examples/slurm_train.sbatch`` under a real Slurm (``slurm.Slurm``: Debian's slurmctld and two slurmd on the two
network hosts of ``cluster.Cluster``), submitted with ``sbatch`` as users submit it — the script file and the
trainer's flags, the machine's resources given on the command line (no GPUs, two CPUs a task: gloo, two ranks a
node) — for the layout suite's model at tp 2 inside each node × dp 2 across the two nodes:

- a job killed mid-run (SIGKILL to every step, after the checkpoint of step 2), then the same sbatch line
  submitted again: the new job resumes from that checkpoint and completes, exit 0, the loss curve the single
  process's;
- the time-limit warning (USR1 to the batch script, what ``--signal=B:USR1@600`` sends ten minutes before the
  limit): every rank saves after the step it is in and stops, the script requeues the job, and the requeued job
  resumes there and completes (``sbatch --wait`` returns 0), the loss curve again the single process's.

The jobs are held at a sync point while the test acts (``megakernels_models.training.syncpoints``), every wait is a
condition with a deadline, and no process of a job is left on either node afterwards."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.models.preemption_harness import SyncDir
from tests.multinode.cluster import Cluster
from tests.multinode.common import DEADLINE_S, FLAGS, ROOT, compare, env, layouts, record, steps, wait_until
from tests.multinode.slurm import Slurm

SCRIPT = os.path.join(ROOT, "examples", "slurm_train.sbatch")
# This machine's resources, given on sbatch's command line over the script's #SBATCH lines (8 GPUs, 64 CPUs).
RESOURCES = ["--nodes", "2", "--gpus-per-node", "0", "--cpus-per-task", "2"]
JOB_FLAGS = FLAGS + ["--tp", "2", "--save-interval", "2", "--timeout", "120"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("slurm")
    with Cluster() as c, Slurm(c, str(workdir / "daemons")) as s:
        yield s


def _job_processes(cluster: Cluster) -> dict[int, list[str]]:
    """The processes of a training job on each node (torchrun agents, ranks, srun's steps), by node."""
    out = {}
    for i in range(2):
        found = []
        for pid in cluster.pids(i):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "megakernels" in cmd or "torch.distributed.run" in cmd or "torchrun" in cmd or "slurmstepd" in cmd:
                found.append(f"{pid}: {cmd}")
        out[i] = found
    return out


def _no_job_left(slurm: Slurm) -> None:
    wait_until(
        lambda: not any(_job_processes(slurm.cluster).values()),
        60,
        lambda: f"end of the job processes left: {_job_processes(slurm.cluster)}",
        0.2,
    )


class Job:
    """One ``sbatch --wait --parsable`` submission of the shipped script from ``workdir``."""

    def __init__(self, slurm: Slurm, workdir, flags: list[str], run_env: dict):
        self.slurm, self.workdir = slurm, workdir
        self.proc = subprocess.Popen(
            slurm.cluster.command(0, ["sbatch", "--wait", "--parsable", *RESOURCES, SCRIPT, *flags]),
            cwd=workdir,
            env=dict(run_env, SLURM_CONF=slurm.conf),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.id = self.proc.stdout.readline().strip().split(";")[0]  # printed at submission, before the wait
        assert self.id.isdigit(), self.proc.communicate(timeout=60)

    @property
    def output(self) -> str:
        path = os.path.join(self.workdir, f"megakernels-{self.id}.out")
        return open(path, errors="replace").read() if os.path.exists(path) else ""  # noqa: SIM115

    def wait(self) -> int:
        try:
            _, err = self.proc.communicate(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.slurm.client(["scancel", "--full", "--signal", "KILL", self.id], timeout=30, check=False)
            raise
        self.stderr = err
        return self.proc.returncode

    def alive(self, name: str) -> None:
        assert self.proc.poll() is None, f"job {self.id} ended before {name}:\n{self.output[-6000:]}"


def test_a_killed_job_resubmitted_resumes_from_its_last_checkpoint(slurm, reference, tmp_path):
    log = tmp_path / "log.jsonl"
    sync = SyncDir(str(tmp_path / "sync"))
    sync.hold("step-3")  # every rank finished step 3; the checkpoint of step 2 is complete
    first = Job(slurm, tmp_path, JOB_FLAGS + ["--log-jsonl", str(log)], env(MEGAKERNELS_SYNC_DIR=sync.path))
    sync.alive = first.alive
    sync.wait_for("step-3", range(4), timeout=DEADLINE_S)
    # the job dies (a node failure, a cancelled job): SIGKILL to every step and to the batch script
    slurm.client(["scancel", "--full", "--signal", "KILL", first.id], timeout=30)
    status = first.wait()
    assert status != 0, first.output[-6000:]
    _no_job_left(slurm)
    assert sorted(steps(log)) in ([1, 2], [1, 2, 3]), first.output[-6000:]

    start = time.monotonic()
    second = Job(slurm, tmp_path, JOB_FLAGS + ["--log-jsonl", str(log)], env())  # the same sbatch line again
    assert second.wait() == 0, second.output[-6000:] + second.stderr
    wall = time.monotonic() - start
    out = second.output
    assert "2 nodes (mk-node[0-1]) × 2 ranks (cpu), rendezvous at mk-node0:29500" in out, out[-6000:]
    assert "done: 4 steps" in out, out[-6000:]  # steps 3-6, from the checkpoint of step 2
    assert [(x["world_size"], x["tp"], x["dp"]) for x in layouts(log)] == [(4, 2, 2), (4, 2, 2)]
    worst = compare(steps(log), reference, range(1, 7))
    _no_job_left(slurm)
    record("slurm: killed job resubmitted", max_loss_rel_diff_fraction=worst, resubmitted_job_s=wall)


def test_the_time_limit_warning_saves_requeues_and_the_job_completes(slurm, reference, tmp_path):
    log = tmp_path / "log.jsonl"
    sync = SyncDir(str(tmp_path / "sync"))
    sync.hold("step-3")
    start = time.monotonic()
    job = Job(slurm, tmp_path, JOB_FLAGS + ["--log-jsonl", str(log)], env(MEGAKERNELS_SYNC_DIR=sync.path))
    sync.alive = job.alive
    sync.wait_for("step-3", range(4), timeout=DEADLINE_S)
    # what Slurm sends the batch script ten minutes before the time limit (#SBATCH --signal=B:USR1@600)
    slurm.client(["scancel", "--batch", "--signal", "USR1", job.id], timeout=30)
    sync.wait_for("signal", range(4), timeout=DEADLINE_S)  # the script passed it on: every rank got SIGTERM
    sync.release("step-3")
    assert job.wait() == 0, job.output[-6000:] + job.stderr
    wall = time.monotonic() - start
    out = job.output
    assert f"time limit near: the ranks saved into checkpoints/megakernels; requeueing job {job.id}" in out, out[-6000:]
    assert "stopped after step 3 (SIGTERM): saved checkpoint checkpoints/megakernels/step-00000003" in out, out[-6000:]
    assert f"megakernels job {job.id} (restart 1)" in out, out[-6000:]
    assert "done: 3 steps" in out, out[-6000:]  # the requeued job: steps 4-6
    assert [(x["world_size"], x["tp"], x["dp"]) for x in layouts(log)] == [(4, 2, 2), (4, 2, 2)]
    worst = compare(steps(log), reference, range(1, 7))
    _no_job_left(slurm)
    record("slurm: time-limit warning, requeue", max_loss_rel_diff_fraction=worst, job_with_requeue_s=wall)
