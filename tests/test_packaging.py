"""Packaging: ``pip install megakernels`` (kernels, ops, nn, optim, parallel) needs only torch and numpy; the
trainer's dependencies are the ``train`` extra, matplotlib the ``bench`` extra, transformers and accelerate the
``hf`` extra, and without matplotlib ``megakernels bench --out`` still writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
TRAIN_ONLY = (
    "tqdm",
    "tensorboard",
    "tokenizers",
    "sentencepiece",
    "safetensors",
    "yaml",
    "transformers",
    "accelerate",
    "matplotlib",
)

# The path finder no longer finds the named top-level packages: to every importer (and to find_spec) they are
# not installed, as on a kernels-only install.
_BLOCK = """
import sys
from importlib.machinery import PathFinder
_blocked, _find = set(%r), PathFinder.find_spec
PathFinder.find_spec = classmethod(
    lambda cls, name, path=None, target=None: None if name.split(".")[0] in _blocked else _find(name, path, target))
"""


def _run(code: str, blocked=TRAIN_ONLY, args=()) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _BLOCK % (list(blocked),) + code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _names(specs) -> set[str]:
    import re

    return {re.split(r"[<>=!~\[ ;]", s, maxsplit=1)[0].lower() for s in specs}


def test_the_package_depends_on_torch_and_numpy_only():
    p = _project()
    assert _names(p["dependencies"]) == {"torch", "numpy"}
    assert _names(p["optional-dependencies"]["train"]) >= {
        "tqdm",
        "tensorboard",
        "tokenizers",
        "sentencepiece",
        "safetensors",
        "pyyaml",
    }
    assert "matplotlib" in _names(p["optional-dependencies"]["bench"])
    assert _names(p["optional-dependencies"]["hf"]) == {"transformers", "accelerate"}
    assert _names(p["optional-dependencies"]["test"]) >= {"transformers", "accelerate"}  # CI tests the integration


def test_the_library_works_without_the_trainers_dependencies():
    """Ops, modules, the optimizer and a one-rank parallel world run with every train/bench package missing."""
    code = """
import torch
import megakernels
from megakernels import ops, nn, optim, parallel
from megakernels.parallel.launch import single_process_world
x = torch.randn(4, 64, requires_grad=True)
ln = nn.FusedLayerNorm(64, activation="gelu")
ln(x).sum().backward()
opt = optim.FusedAdamW(ln.parameters(), lr=1e-3)
opt.step()
q = torch.randn(1, 8, 2, 16)
ops.flash_attention(q, q, q, causal=True)
with single_process_world(parallel=True):
    layer = parallel.ColumnParallelLinear(64, 32)
    layer(torch.randn(3, 64))
import megakernels.integrations.transformers as mkt  # importable without transformers; its calls name the extra
try:
    mkt.apply(ln)
except ImportError as e:
    assert "pip install 'megakernels[hf]'" in str(e), e
else:
    raise AssertionError("apply ran without transformers")
blocked = [m for m in TRAIN_ONLY if m in sys.modules]
assert not blocked, blocked
print("OK")
""".replace("TRAIN_ONLY", repr(list(TRAIN_ONLY)))
    r = _run(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


def test_bench_without_matplotlib_writes_json_and_says_how_to_get_plots(tmp_path):
    code = """
from megakernels_models.cli import main
raise SystemExit(main(["bench", "--ops", "bias_gelu", "--dtype", "fp32", "--quick", "--no-compile", "--no-peers",
                       "--out", sys.argv[1]]))
"""
    r = _run(code, blocked=("matplotlib",), args=(str(tmp_path),))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "matplotlib is not installed" in r.stdout and "megakernels[bench]" in r.stdout
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert rows and all(r["op"] == "bias_gelu" for r in rows)
    assert not list(tmp_path.glob("*.png"))


def test_the_trainer_without_its_extra_names_the_extra_to_install():
    code = """
from megakernels_models.cli import main
raise SystemExit(main(["train", "--steps", "1", "--log-jsonl", "/dev/null"]))
"""
    r = _run(code, blocked=("tqdm", "tokenizers", "sentencepiece", "tensorboard"))
    assert r.returncode == 2, r.stderr[-3000:]
    assert "pip install 'megakernels[train]'" in r.stderr


def test_the_library_benchmarks_its_kernels_without_the_trainer_or_the_tools(tmp_path):
    """``python -m megakernels.bench`` runs with the trainer package, its dependencies and the tools beside the
    package (the static cost model) missing, and imports nothing of the trainer."""
    code = """
import importlib.metadata
_ep = importlib.metadata.entry_points  # no tool installed beside the package:
importlib.metadata.entry_points = lambda **kw: [] if kw.get("group") == "megakernels.bench" else _ep(**kw)
from megakernels.bench.__main__ import main
status = main(["--ops", "layer_norm", "--dtype", "fp32", "--quick", "--no-compile", "--no-peers", "--out", sys.argv[1]])
assert not [m for m in sys.modules if m.split(".")[0] in ("megakernels_models", "costmodel")]
raise SystemExit(status)
"""
    r = _run(code, blocked=(*TRAIN_ONLY, "megakernels_models", "costmodel"), args=(str(tmp_path),))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert rows and {r["op"] for r in rows} == {"layer_norm"}
    assert (
        "[--e2e PRESET]"
        not in subprocess.run(
            [sys.executable, "-m", "megakernels.bench", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
        ).stdout
    )


def test_the_trainer_runs_without_the_tools_beside_the_package(tmp_path):
    code = """
import importlib.metadata
_ep = importlib.metadata.entry_points
importlib.metadata.entry_points = lambda **kw: [] if kw.get("group") == "megakernels.bench" else _ep(**kw)
from megakernels_models.cli import main
status = main(["train", "--steps", "2", "--eval-interval", "0", "--no-progress", "--corpus-bytes", "100000",
               "--global-batch-size", "2", "--micro-batch-size", "2"])
assert "costmodel" not in sys.modules
raise SystemExit(status)
"""
    r = _run(code, blocked=("costmodel",))
    assert r.returncode == 0, r.stderr[-3000:]


def test_the_wheel_ships_the_package_and_the_trainer_only(tmp_path):
    """What ``pip wheel .`` packs besides the compiled extension: setuptools' build_py of the project (the step
    that copies the Python packages into the wheel), here without compiling anything."""
    r = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MEGAKERNELS_FORCE_CPU_ONLY": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    top = sorted(p.name for p in tmp_path.iterdir())
    assert top == ["megakernels", "megakernels_models"], top
    files = [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()]
    assert not [f for f in files if "costmodel" in f or "/static/" in f], files
    assert "megakernels/machines.py" in files and "megakernels_models/cli.py" in files
