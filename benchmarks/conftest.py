"""The benchmark suite's quick mode (``--benchmark-disable``, as CI runs it: every benchmark once, nothing timed).

In quick mode the ``torch.compile`` baseline runs once per benchmark function (its first case with a backward pass,
else its first); its other cases
(each a separate Inductor compile of seconds, on the same code path for another dtype or pass) join the ``slow``
set (``scripts/test.sh --all``). With timing on, every case runs.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if not config.getoption("benchmark_disable", default=False):
        return
    kept: dict = {}
    compiled = [
        item for item in items if getattr(item, "callspec", None) and item.callspec.params.get("impl") == "compile"
    ]
    for item in compiled:
        key = (item.path, item.originalname)
        if key not in kept or (
            item.callspec.params.get("passes") == "fwd+bwd" != kept[key].callspec.params.get("passes")
        ):
            kept[key] = item
    for item in compiled:
        if kept[(item.path, item.originalname)] is not item:
            item.add_marker(pytest.mark.slow)
