"""A real Slurm on the two network hosts of ``cluster.Cluster``: Debian's ``slurm-wlm`` daemons — slurmctld and a
slurmd on node 0, a slurmd on node 1, each in its node's namespace under its node's host name — authenticated by a
munge daemon of their own on node 0 (``auth/munge``, the packages' default; its socket is a file, which both nodes
reach), from a generated ``slurm.conf`` naming the two nodes. Every daemon runs on a node, so removing the nodes
(``cluster.remove_leftovers`` after a run that was killed) removes the daemons too. Clients (``sbatch``,
``squeue``, ``scontrol``) run on node 0 with ``SLURM_CONF`` pointing at it, as on a login node. Everything lives
in one temporary directory: the key, the sockets, the state, the spool, the logs.

    with Cluster() as c, Slurm(c, workdir) as s:
        s.client(["sbatch", "--wait", ...], cwd=...)

``close`` stops the daemons (their process ids; SIGTERM, then SIGKILL) and waits for them; the namespaces go with
the cluster."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess

from tests.multinode.cluster import Cluster
from tests.multinode.common import wait_until

START_S = 60.0

CONF = """\
ClusterName=mkcheck
SlurmctldHost={host0}({addr0})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge.socket
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobRequeue=1
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=600
NodeName={host0} NodeAddr={addr0} CPUs={cpus} RealMemory={memory} State=UNKNOWN
NodeName={host1} NodeAddr={addr1} CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes={host0},{host1} Default=YES MaxTime=INFINITE State=UP
"""


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


class Slurm:
    """slurmctld + two slurmd (and munged) on ``cluster``'s two nodes, configured in ``workdir``."""

    def __init__(self, cluster: Cluster, workdir: str, memory_mb: int = 4000):
        for tool in ("slurmctld", "slurmd", "sbatch", "munged", "mungekey"):
            if shutil.which(tool) is None:
                raise FileNotFoundError(f"{tool} is not installed: apt-get install slurm-wlm munge (Debian's packages)")
        self.cluster, self.dir, self.memory_mb = cluster, os.path.abspath(workdir), memory_mb
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.daemons: dict[str, subprocess.Popen] = {}

    def env(self, **extra) -> dict:
        """The environment of a Slurm client (``SLURM_CONF``), on top of this process's."""
        return dict(os.environ, SLURM_CONF=self.conf, **extra)

    def __enter__(self) -> Slurm:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _daemon(self, name: str, node: int, argv: list[str]) -> None:
        with open(os.path.join(self.dir, f"{name}.out"), "w") as log:
            self.daemons[name] = self.cluster.start(
                node, argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True
            )

    def _start(self) -> None:
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o711)  # munged wants its socket's directory searchable by everyone
        for sub in ("state", f"spool-{self.cluster.host(0)}", f"spool-{self.cluster.host(1)}"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        key = os.path.join(self.dir, "munge.key")
        subprocess.run(["mungekey", "--create", "--keyfile", key], check=True, capture_output=True)
        self._daemon(
            "munged",
            0,
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={self.dir}/munge.socket",
                f"--pid-file={self.dir}/munged.pid",
                f"--log-file={self.dir}/munged.log",
                f"--seed-file={self.dir}/munged.seed",
            ],
        )
        self._wait_for(lambda: os.path.exists(os.path.join(self.dir, "munge.socket")), "munged's socket")
        c = self.cluster
        with open(self.conf, "w") as f:
            f.write(
                CONF.format(
                    dir=self.dir,
                    host0=c.host(0),
                    host1=c.host(1),
                    addr0=c.address(0),
                    addr1=c.address(1),
                    cpus=_cpus(),
                    memory=self.memory_mb,
                )
            )
        self._daemon("slurmctld", 0, ["slurmctld", "-D", "-i", "-f", self.conf])
        for i in range(2):
            self._daemon(f"slurmd-{i}", i, ["slurmd", "-D", "-N", c.host(i), "-f", self.conf])
        self._wait_for(self._nodes_idle, "both nodes idle in sinfo")

    def _wait_for(self, condition, what: str, timeout: float = START_S) -> None:
        def done() -> bool:
            for name, p in self.daemons.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode} while waiting for {what}:\n{self.logs()}")
            return condition()

        wait_until(done, timeout, lambda: f"{what}:\n{self.logs()}", 0.2)

    def _nodes_idle(self) -> bool:
        r = self.client(["sinfo", "--noheader", "--Node", "--format=%N %t"], timeout=30, check=False)
        states = dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)
        return all(states.get(self.cluster.host(i)) == "idle" for i in range(2))

    def client(self, argv: list[str], timeout: float, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run a Slurm client command on node 0 (the login node); its output as text."""
        r = self.cluster.run(
            0, argv, timeout=timeout, capture_output=True, text=True, env=kw.pop("env", self.env()), **kw
        )
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited with {r.returncode}:\n{r.stdout}\n{r.stderr}")
        return r

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.dir)):
            if name.endswith((".log", ".out")):
                with open(os.path.join(self.dir, name), errors="replace") as f:
                    out.append(f"--- {name} ---\n{f.read()[-3000:]}")
        return "\n".join(out)

    def close(self) -> None:
        for p in self.daemons.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        for p in self.daemons.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.daemons = {}
