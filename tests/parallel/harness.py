"""The spawned gloo world of ``megakernels.parallel.launch`` for tests: a failing world fails the test."""

from __future__ import annotations

from megakernels.parallel import launch


def run_world(world_size: int, fn, *args, timeout: float = 120.0, init: str = "store", **kwargs) -> list:
    """``launch.run_world`` (``kwargs`` are its other options), raising ``AssertionError`` where it raises
    ``WorldFailed``."""
    try:
        return launch.run_world(world_size, fn, *args, timeout=timeout, init=init, **kwargs)
    except launch.WorldFailed as e:
        raise AssertionError(str(e)) from None


def record_store_ports(monkeypatch) -> list[int]:
    """The ports of the rendezvous stores that ``launch.run_world`` hosts from now on in this process (until
    ``monkeypatch`` undoes it), to check that each is released."""
    ports, original = [], launch.dist.TCPStore

    def recording(*args, **kwargs):
        store = original(*args, **kwargs)
        ports.append(store.port)
        return store

    monkeypatch.setattr(launch.dist, "TCPStore", recording)
    return ports
