"""The multi-node checks (``scripts/multinode_check.sh``): two network namespaces as two hosts, torchrun across them,
a real Slurm. They need root, take minutes and start daemons, so the test suite (``scripts/test.sh``) leaves them
out: they are collected only with ``MEGAKERNELS_MULTINODE=1`` (which the script sets), and otherwise deselected —
reported as deselected, never as passed or skipped."""

from __future__ import annotations

import os

import pytest

ENABLED = os.environ.get("MEGAKERNELS_MULTINODE") == "1"
HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    if ENABLED:
        return
    mine = [i for i in items if str(i.path).startswith(HERE + os.sep)]
    if mine:
        config.hook.pytest_deselected(items=mine)
        items[:] = [i for i in items if i not in mine]


@pytest.fixture(scope="session", autouse=True)
def _root_only():
    if os.geteuid() != 0:
        pytest.fail("the multi-node checks need root (network namespaces, Slurm's daemons)")


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict[int, float]:
    """The single process's loss curve of the checks' model (common.FLAGS): step -> loss."""
    from tests.multinode.common import FLAGS, steps, train

    log = tmp_path_factory.mktemp("reference") / "log.jsonl"
    r = train(FLAGS + ["--log-jsonl", str(log)])
    assert r.returncode == 0, r.stdout + r.stderr
    curve = steps(log)
    assert sorted(curve) == [1, 2, 3, 4, 5, 6]
    return curve
