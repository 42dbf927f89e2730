"""Many checks in one spawned world: each test module registers its checks, runs them all on every rank of one world
(a process costs ~1.5 s of imports, so one world per module), and exposes each check as its own pytest test.

    CHECKS = Checks()

    @CHECKS.add("column_tp2")
    def _(rank, world_size): ...           # raises AssertionError on a wrong answer

    def _world(rank, world_size): return CHECKS.run(rank, world_size)
    world = CHECKS.fixture(4, _world)      # module-scoped fixture: {check: [error per rank]}

    @pytest.mark.parametrize("name", CHECKS.names())
    def test_parallel(world, name): CHECKS.assert_passed(world, name)

A check that raises is recorded with its traceback on that rank and the world moves on to the next check, after
tearing down ``megakernels.parallel`` state. Checks must stay symmetric (every rank reaches the same collectives),
so a failing assertion should come after the collectives of the check; otherwise the harness's timeout ends it.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

import pytest
import torch

from tests.parallel.harness import run_world

# docs/parallelism.md asks layouts to agree with the single process to <= 1e-5 relative in fp32.
RTOL = 1e-5


class Checks:
    def __init__(self):
        self._checks: dict[str, Callable] = {}

    def add(self, name: str, *args):
        def register(fn):
            if name in self._checks:
                raise ValueError(f"duplicate check {name!r}")
            self._checks[name] = (fn, args)
            return fn

        return register

    def names(self) -> list[str]:
        return list(self._checks)

    def run(self, rank: int, world_size: int) -> dict[str, str | None]:
        import megakernels.parallel as mp

        out = {}
        for name, (fn, args) in self._checks.items():
            try:
                fn(rank, world_size, *args)
                out[name] = None
            except Exception:  # noqa: BLE001 - recorded per check, reported by its own test
                out[name] = traceback.format_exc()
                # Also now, on the inherited stderr: if the failure leaves the ranks out of step and the world
                # times out, pytest's captured output still shows the cause.
                print(f"rank {rank}: check {name!r} failed:\n{out[name]}", file=sys.stderr, flush=True)
            finally:
                mp.destroy()
        return out

    def fixture(self, world_size: int, worker: Callable, timeout: float = 300.0):
        # The limit ends a hang: CI runs two pytest workers on two cores, so an 8-process world that takes 15 s on
        # an idle machine can take several times that while the other worker runs a world of its own. A world that
        # runs past it fails, with every unfinished rank's stack (run_world): it is not run again, which would hide
        # a hang that happens only sometimes.
        @pytest.fixture(scope="module")
        def world():
            return run_world(world_size, worker, timeout=timeout)

        return world

    @staticmethod
    def assert_passed(results: list[dict], name: str) -> None:
        failures = [f"--- rank {r} ---\n{res[name]}" for r, res in enumerate(results) if res[name] is not None]
        assert not failures, f"check {name!r} failed on {len(failures)} rank(s):\n" + "\n".join(failures)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    """``max |actual - expected| <= rtol · max |expected|`` (relative to the reference's scale)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    scale = e.abs().max().item() if e.numel() else 0.0
    err = (a - e).abs().max().item() if e.numel() else 0.0
    assert err <= rtol * max(scale, 1e-30), f"{what}: max abs error {err:.3g} > {rtol:g} x scale {scale:.3g}"


def block(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Block ``rank`` of ``world`` contiguous blocks of ``t`` along ``dim``."""
    return t.chunk(world, dim)[rank]


def randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    """The same fp32 tensor on every rank (a private generator, the default stream untouched)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
