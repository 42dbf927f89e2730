"""The nodes of a torchrun job: which ranks each node holds, whether a layout keeps its tensor-parallel groups inside
a node, and, when a rank fails, which nodes are lost.

torchrun starts one agent per node; the agents' rendezvous numbers the nodes (``GROUP_RANK``, 0 ..
``GROUP_WORLD_SIZE`` − 1) and gives each node a contiguous block of global ranks: ``RANK − LOCAL_RANK`` is the node's
first rank and ``LOCAL_WORLD_SIZE`` its number of ranks (torch.distributed.elastic's rank assignment). Ranks are laid
out tp innermost (``megakernels.parallel.state``), so a tensor-parallel group — ``tp`` adjacent ranks — stays inside
a node exactly when every node's block splits into whole groups: ``LOCAL_WORLD_SIZE`` a multiple of ``tp`` (and each
block starting at a multiple of it). ``tp_problem`` says when it does not; the trainer refuses such a layout unless
``--tp-across-nodes`` asks for it (docs/parallelism.md).

**Naming a lost node.** A node that dies (power, kernel, network) leaves its peers blocked in a collective until its
timeout, or failing on a closed connection; neither error says which node is gone. So in a job of several nodes,
local rank 0 of every node listens on a *beacon* (a TCP socket that accepts and closes, answered by a thread), and
at start every rank learns every node's host, ranks and beacon address (one ``all_gather_object``, ``NodeMap.
gather``). When a rank fails (an exception, or its watchdog firing) it knocks on every other node's beacon, all at
once, for at most ``PROBE_S`` seconds: a node whose beacon refuses the connection has lost its processes, one that
does not answer is down or cut off, and the rank's message names it::

    megakernels train: rank 0: node 1 (host node-b, ranks 2-3) is lost: its beacon at 10.0.0.2:41217 is unreachable
    (No route to host: the node is down or cut off from this one)

Nothing is sent while the job runs: the beacons only accept connections.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import selectors
import socket
import threading
import time

import torch.distributed as dist

# How long a failing rank waits for the other nodes' beacons to answer.
PROBE_S = 2.0
# At most this many connection attempts open at once (a job of thousands of nodes stays under the open-file limit).
_PROBE_BATCH = 256
# What the trainer's flag is called (the message of ``tp_problem`` names it).
TP_ACROSS_NODES_FLAG = "--tp-across-nodes"


def torchrun_env(env=None) -> dict | None:
    """This worker's place as torchrun describes it: ``rank, local_rank, local_world_size, node, nodes`` (ints), or
    None outside torchrun (or where its environment lacks one of them)."""
    env = os.environ if env is None else env
    try:
        return {
            "rank": int(env["RANK"]),
            "local_rank": int(env["LOCAL_RANK"]),
            "local_world_size": int(env["LOCAL_WORLD_SIZE"]),
            "node": int(env.get("GROUP_RANK", "0")),
            "nodes": int(env.get("GROUP_WORLD_SIZE", "1")),
        }
    except (KeyError, ValueError):
        return None


def tp_problem(tp: int, env=None, flag: str = "--tp") -> str | None:
    """Why tensor-parallel groups of ``tp`` ranks would span nodes under this torchrun job (None: they do not, or
    this is not a torchrun job). The rule is every node's: ``LOCAL_WORLD_SIZE`` is a multiple of ``tp`` (ranks of a
    node are a contiguous block); a node whose block starts off a group boundary (nodes of different sizes) is
    caught by its own ranks' check of their group."""
    where = torchrun_env(env)
    if where is None or tp <= 1:
        return None
    rank, local = where["rank"], where["local_world_size"]
    first = rank - where["local_rank"]
    group = rank - rank % tp
    if local % tp == 0 and first <= group and group + tp <= first + local:
        return None
    if local % tp:
        why = f"its {local} ranks do not split into groups of {tp} adjacent ranks"
    else:
        why = f"the group of rank {rank}, ranks {group}-{group + tp - 1}, starts on another node"
    divisors = [d for d in range(1, local + 1) if local % d == 0]
    return (
        f"{flag} {tp} puts tensor-parallel groups across nodes: torchrun runs {local} ranks on this node "
        f"(LOCAL_WORLD_SIZE; node {where['node']} holds ranks {first}-{first + local - 1}) and {why}, so every "
        f"layer's all-reduces would cross the network; use a {flag} that divides the ranks per node "
        f"({', '.join(map(str, divisors))}), or pass {TP_ACROSS_NODES_FLAG} to run it anyway"
    )


@dataclasses.dataclass(frozen=True)
class Node:
    """One node of the job: torchrun's number for it, its host name, its ranks ``[first, first + count)`` and where
    its beacon listens (``addresses`` to try, ``port``; no port: it has none)."""

    index: int
    host: str
    first: int
    count: int
    addresses: tuple[str, ...] = ()
    port: int | None = None

    def __str__(self) -> str:
        ranks = f"rank {self.first}" if self.count == 1 else f"ranks {self.first}-{self.first + self.count - 1}"
        return f"node {self.index} (host {self.host}, {ranks})"


class Beacon:
    """A TCP socket on every interface of this host that accepts connections and closes them (a daemon thread):
    while it answers, the process holding it — and so its node — is alive and reachable."""

    def __init__(self):
        self.sock = socket.create_server(("", 0), family=socket.AF_INET, backlog=64)
        self.port = self.sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="megakernels-node-beacon", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(timeout=1.0)


def _loopback(address: str) -> bool:
    return address.startswith("127.") or address == "0.0.0.0"


def host_addresses(peer: str | None = None) -> tuple[str, ...]:
    """The IPv4 addresses other nodes may reach this host at: the one this host sends from towards ``peer`` (the
    rendezvous host: a route, no packet), and those its host name resolves to (as gloo picks its own); loopback
    addresses only when there is nothing else (every node on one machine)."""
    found: list[str] = []
    if peer:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))  # a UDP "connect" only chooses the route and source address
            found.append(s.getsockname()[0])
    with contextlib.suppress(OSError):
        found += socket.gethostbyname_ex(socket.gethostname())[2]
    found = list(dict.fromkeys(found))
    outside = [a for a in found if not _loopback(a)]
    return tuple(outside or found or ["127.0.0.1"])


# A connection that fails with one of these never reached a listening host: the node is down or cut off.
_UNREACHABLE = (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT, errno.EHOSTDOWN)


def _answer(code: int) -> str:
    if code == 0:
        return "ok"
    if code == errno.ECONNREFUSED:
        return "refused"
    return ("unreachable: " if code in _UNREACHABLE else "error: ") + os.strerror(code)


def _knock(targets: list[tuple[str, int]], timeout: float) -> dict[tuple[str, int], str]:
    """Connect to every ``(address, port)`` at once for at most ``timeout`` seconds: ``"ok"``, ``"refused"``,
    ``"unreachable: why"`` (no answer within the time included) or ``"error: why"`` for each."""
    out: dict[tuple[str, int], str] = {}
    for start in range(0, len(targets), _PROBE_BATCH):
        batch = targets[start : start + _PROBE_BATCH]
        sel = selectors.DefaultSelector()
        try:
            for target in batch:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setblocking(False)
                code = s.connect_ex(target)
                if code in (0, errno.EINPROGRESS):
                    sel.register(s, selectors.EVENT_WRITE, target)
                else:
                    out[target] = _answer(code)
                    s.close()
            deadline = time.monotonic() + timeout
            while sel.get_map() and (left := deadline - time.monotonic()) > 0:
                for key, _ in sel.select(left):
                    out[key.data] = _answer(key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
        finally:
            for key in list(sel.get_map().values()):
                out.setdefault(key.data, f"unreachable: no answer within {timeout:g} s")
                key.fileobj.close()
            sel.close()
    return out


class NodeMap:
    """Every node of a torchrun job (``nodes``, by index) and this rank's (``me``); ``beacon``: the one this process
    holds (local rank 0 of each node), closed by ``close``."""

    def __init__(self, nodes: dict[int, Node], me: int, beacon: Beacon | None = None):
        self.nodes, self.me, self.beacon = nodes, me, beacon

    @classmethod
    def gather(cls) -> NodeMap | None:
        """After ``init_process_group`` under torchrun, on every rank (a collective): open this node's beacon (local
        rank 0) and learn every node's. None in a job of one node (nothing to name)."""
        where = torchrun_env()
        if where is None or where["nodes"] <= 1:
            return None
        beacon = Beacon() if where["local_rank"] == 0 else None
        mine = {
            "node": where["node"],
            "host": socket.gethostname(),
            "first": where["rank"] - where["local_rank"],
            "count": where["local_world_size"],
            "addresses": host_addresses(os.environ.get("MASTER_ADDR")) if beacon else (),
            "port": beacon.port if beacon else None,
        }
        everyone: list = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(everyone, mine)
        except BaseException:
            if beacon is not None:
                beacon.close()
            raise
        nodes = {}
        for rec in everyone:
            if rec["port"] is not None or rec["node"] not in nodes:
                nodes[rec["node"]] = Node(
                    rec["node"], rec["host"], rec["first"], rec["count"], tuple(rec["addresses"]), rec["port"]
                )
        return cls(nodes, where["node"], beacon)

    def lost(self, timeout: float = PROBE_S) -> list[tuple[Node, str]]:
        """The other nodes whose beacon does not answer within ``timeout`` seconds, each with why (a refused
        connection: the node's processes are gone; no answer: the node is down or unreachable)."""
        others = [n for i, n in sorted(self.nodes.items()) if i != self.me and n.port is not None]
        targets = [(a, n.port) for n in others for a in n.addresses]
        answers = _knock(targets, timeout) if targets else {}
        out = []
        for n in others:
            got = [answers[(a, n.port)] for a in n.addresses]
            if "ok" in got:
                continue
            at = ", ".join(f"{a}:{n.port}" for a in n.addresses)
            if all(g == "refused" for g in got):
                why = f"its beacon at {at} refused the connection (no process of the job is left there)"
            elif all(g == "refused" or g.startswith("unreachable") for g in got):
                reasons = ", ".join(dict.fromkeys(g.split(": ", 1)[1] for g in got if g != "refused"))
                why = f"its beacon at {at} is unreachable ({reasons}: the node is down or cut off from this one)"
            else:
                why = f"its beacon at {at} did not answer ({', '.join(dict.fromkeys(got))})"
            out.append((n, why))
        return out

    def report(self, timeout: float = PROBE_S) -> str:
        """One line naming the lost nodes (``lost``), or "" when every node answers."""
        return "; ".join(f"{n} is lost: {why}" for n, why in self.lost(timeout))

    def close(self) -> None:
        if self.beacon is not None:
            self.beacon.close()
            self.beacon = None
