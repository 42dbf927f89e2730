"""Two network hosts on one Linux machine: network namespaces joined by a veth pair (root only; nothing leaves the
machine). Each node has its own network stack, address and host name (a UTS namespace per process started on it,
and an ``/etc/hosts`` that ``ip netns exec`` mounts for the namespace), so what runs on it sees a host of its own:
torchrun's rendezvous resolves node 0's name to its address, gloo binds to the node's address, and a connection
between the nodes goes through the kernel's TCP stack and the veth link, not loopback.

    with Cluster() as c:
        p = c.start(0, ["torchrun", ...], env=..., stdout=...)   # a process on node 0
        c.cut(1)          # node 1 leaves the network: nothing it sends arrives, nothing reaches it
        c.kill_all(1)     # SIGKILL every process of node 1
    # every process of both nodes killed, the namespaces and their /etc/netns files removed

``Cluster.close`` (and ``remove_leftovers``, for namespaces of a run that was itself killed) always leave the machine
as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess

from tests.multinode.common import wait_until

PREFIX = "mkn"  # every namespace of these checks is named mkn<pid>-<node>
SUBNET = "10.231.0"
NETNS_ETC = "/etc/netns"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def namespace_pids(ns: str) -> list[int]:
    r = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def _kill_namespace(ns: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process of ``ns`` until none is left (at most ``timeout`` s); the pids that were found."""
    seen: list[int] = []

    def none_left() -> bool:
        pids = namespace_pids(ns)
        seen.extend(p for p in pids if p not in seen)
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        return not pids

    wait_until(none_left, timeout, lambda: f"end of namespace {ns}'s processes {namespace_pids(ns)} (SIGKILL)", 0.05)
    return seen


def _remove_namespace(ns: str) -> None:
    _kill_namespace(ns)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)


def remove_leftovers() -> list[str]:
    """Remove the namespaces of these checks whose creating process is gone (a run killed before its cleanup)."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if not ns.startswith(PREFIX):
            continue
        pid = ns[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _remove_namespace(ns)
            removed.append(ns)
    return removed


class Cluster:
    """``nodes`` network hosts (2: one veth pair) named ``host(i)`` at ``address(i)``."""

    def __init__(self, nodes: int = 2, hostnames: tuple[str, ...] = ("mk-node0", "mk-node1")):
        if os.geteuid() != 0:
            raise PermissionError("network namespaces need root: run the multi-node checks as root")
        if nodes != 2:
            raise ValueError("Cluster: two nodes (one veth pair)")
        self.n = nodes
        self.hostnames = hostnames
        self.namespaces = [f"{PREFIX}{os.getpid()}-{i}" for i in range(nodes)]
        self.devices = [f"mkv{os.getpid() % 100000}-{i}" for i in range(nodes)]
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    def host(self, i: int) -> str:
        return self.hostnames[i]

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def __enter__(self) -> Cluster:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        remove_leftovers()
        for ns in self.namespaces:
            _ip("netns", "add", ns)
            self._made.append(ns)
        _ip("link", "add", self.devices[0], "type", "veth", "peer", "name", self.devices[1])
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.address(i)} {self.host(i)}\n" for i in range(self.n))
        for i, (ns, dev) in enumerate(zip(self.namespaces, self.devices)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
            with open(os.path.join(NETNS_ETC, ns, "hosts"), "w") as f:
                f.write(hosts)

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` as a command that runs on node ``i``: in a mount and UTS namespace of its own, joined to the
        node's network namespace, with the node's host name and ``/etc/hosts``. (``ip netns exec`` would also
        remount ``/sys``, which hides the machine's cgroup mounts that slurmd needs.)"""
        ns = self.namespaces[i]
        return [
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "--",
            "nsenter",
            f"--net=/var/run/netns/{ns}",
            "--",
            "/bin/sh",
            "-c",
            'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"',
            self.host(i),
            os.path.join(NETNS_ETC, ns, "hosts"),
            *argv,
        ]

    def start(self, i: int, argv: list[str], **popen) -> subprocess.Popen:
        """Start ``argv`` on node ``i`` (``subprocess.Popen``'s keywords); the process is the command itself."""
        p = subprocess.Popen(self.command(i, argv), **popen)
        self.procs.append(p)
        return p

    def run(self, i: int, argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(i, argv), timeout=timeout, **kw)

    def pids(self, i: int) -> list[int]:
        """The processes of node ``i`` now."""
        return namespace_pids(self.namespaces[i])

    def cut(self, i: int) -> None:
        """Take node ``i`` off the network: its link goes down (the peer's loses its carrier), so nothing it sends
        arrives and nothing reaches it, and no connection of it is closed or reset."""
        _ip("-n", self.namespaces[i], "link", "set", self.devices[i], "down")

    def reconnect(self, i: int) -> None:
        """Put node ``i`` back on the network (after ``cut``)."""
        _ip("-n", self.namespaces[i], "link", "set", self.devices[i], "up")

    def kill_all(self, i: int) -> list[int]:
        """SIGKILL every process of node ``i`` (and wait until none is left); the pids killed."""
        return _kill_namespace(self.namespaces[i])

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        for ns in self._made:
            _remove_namespace(ns)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        self._made = []
