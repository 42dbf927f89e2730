"""The suite's own rules (docs/design.md §5): a package of the ``test`` extra is imported, never skipped; a
test never sleeps to hit a window nor asserts on elapsed time — the one sleep allowed is inside a loop that polls
a condition with a deadline. Each rule has a check that it sees a breach."""

from __future__ import annotations

import ast
import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SUITES = ("tests", "benchmarks")
CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns"}


def _test_extra() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    return {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower().replace("-", "_") for d in deps}


def _calls(node: ast.AST, name: str):
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            if (isinstance(f, ast.Attribute) and f.attr == name) or (isinstance(f, ast.Name) and f.id == name):
                yield n


def _reads_a_clock(node: ast.AST) -> bool:
    return any(next(_calls(node, c), None) is not None for c in CLOCKS)


def _parents(tree: ast.AST) -> dict:
    return {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}


def _in_polling_loop(node: ast.AST, parents: dict) -> bool:
    """Inside a ``while`` loop that reads a clock (its deadline) in its condition or body."""
    p = parents.get(node)
    while p is not None:
        if isinstance(p, ast.While) and _reads_a_clock(p):
            return True
        if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return False
        p = parents.get(p)
    return False


def breaches(source: str, extra: set[str]) -> list[str]:
    tree = ast.parse(source)
    parents = _parents(tree)
    out = []
    for call in _calls(tree, "importorskip"):
        arg = call.args[0] if call.args else None
        if isinstance(arg, ast.Constant) and str(arg.value).split(".")[0].lower() in extra:
            out.append(f"{call.lineno}: importorskip({arg.value!r}) of a test-extra package")
    for call in _calls(tree, "sleep"):
        if not _in_polling_loop(call, parents):
            out.append(f"{call.lineno}: sleep outside a loop polling a condition with a deadline")
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and _reads_a_clock(node.test) and not _in_polling_loop(node, parents):
            out.append(f"{node.lineno}: an assertion on the clock outside a polling loop")
    return out


def test_the_suite_keeps_its_rules():
    extra = _test_extra()
    assert {"transformers", "accelerate", "peft", "trl", "hypothesis"} <= extra
    found = {
        str(p.relative_to(ROOT)): b
        for suite in SUITES
        for p in sorted((ROOT / suite).rglob("*.py"))
        if (b := breaches(p.read_text(), extra))
    }
    assert found == {}


def test_the_rules_see_a_breach():
    src = """
import time, pytest
pytest.importorskip("peft")
pytest.importorskip("some_gpu_only_package")
def f(proc):
    time.sleep(1)
    t0 = time.perf_counter(); run()
    assert time.perf_counter() - t0 < 2
    deadline = time.monotonic() + 5
    while proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
"""
    assert [b.split(":")[0] for b in breaches(src, {"peft"})] == ["3", "6", "8"]
