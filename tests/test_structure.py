"""The packages' shape (docs/design.md): no import cycles in ``megakernels`` and ``megakernels_models`` (typing-only
imports counted), no private names imported across modules, nothing of the tools beside the package (the cost model)
imported or named, each vocabulary defined once, families compared by name only in the registry, few top-level
modules, and a family added from outside works end to end through its spec."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from megakernels_models.models import registry

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "megakernels_models"
PACKAGES = ("megakernels", "megakernels_models")


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the two packages (compiled extensions included: ``megakernels._C`` is a module, not an
    attribute of the package)."""
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*"):
            if p.suffix not in (".py", ".so") or "__pycache__" in p.parts:
                continue
            parts = list(p.relative_to(ROOT).parts)
            parts[-1] = parts[-1].split(".")[0]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = p
    return out


MODULES = _modules()


def _imports(path: pathlib.Path):
    """``(module, name)`` of every ``from X import name`` and ``(module, None)`` of every ``import X``, deferred
    imports inside functions and those only type checkers run included."""
    if path.suffix != ".py":
        return
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                yield node.module, a.name
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None


def _graph() -> dict[str, set[str]]:
    edges = {}
    for name, path in MODULES.items():
        deps = set()
        for module, item in _imports(path):
            if item is not None and f"{module}.{item}" in MODULES:
                deps.add(f"{module}.{item}")
            elif module in MODULES:
                deps.add(module)
        edges[name] = deps - {name}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_no_private_names_imported_across_modules():
    """A name a module keeps to itself (``_helper``) is not imported by another; a package's private modules
    (``megakernels.ops._checks``, the compiled ``_C``) are its own to import."""
    bad = [
        f"{name} imports {item} from {module}"
        for name, path in MODULES.items()
        for module, item in _imports(path)
        if item
        and item.startswith("_")
        and module.startswith("megakernels")
        and module != name
        and f"{module}.{item}" not in MODULES
    ]
    assert bad == []


def test_nothing_imports_or_names_the_tools_beside_the_package():
    """The cost model lives beside the package (costmodel/, not in the wheel): no module of either package imports
    it, and none names it (the package finds tools through an entry-point group, never by name)."""
    named = [str(p.relative_to(ROOT)) for p in MODULES.values() if p.suffix == ".py" and "costmodel" in p.read_text()]
    assert named == []


# Each vocabulary of the project, with the one module that may spell it out: a tuple, list or set of its names and
# nothing else, three of them at least (both, for the two FP8 recipes), or a dict keyed by two or more whose values
# are torch dtypes, is a definition; fewer names are a choice among them.
VOCABULARIES = {
    "precisions": ({"fp32", "bf16", "fp16", "fp8"}, "megakernels/precisions.py"),
    "dtype names": ({"float32", "bfloat16", "float16"}, "megakernels/precisions.py"),
    "FP8 recipes": ({"tensorwise", "blockwise"}, "megakernels/ops/fp8.py"),
    "pipeline schedules": (
        {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "forward_only"},
        "megakernels/parallel/pipeline/schedules.py",
    ),
    "recompute modes": ({"none", "selective", "full"}, "megakernels_models/models/config.py"),
}
SCANNED = ("megakernels", "megakernels_models", "costmodel", "benchmarks")


def _definitions(tree: ast.AST, names: set[str]):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
        elif isinstance(node, ast.Dict) and any(
            isinstance(v, ast.Attribute) and getattr(v.value, "id", "") == "torch" for v in node.values
        ):
            values = [k.value if isinstance(k, ast.Constant) else None for k in node.keys]
        else:
            continue
        enough = 2 if isinstance(node, ast.Dict) else min(3, len(names))
        if len(values) >= enough and all(v in names for v in values):
            yield node.lineno


def _vocabulary_definitions() -> dict[str, list[str]]:
    out = {}
    for vocab, (names, home) in VOCABULARIES.items():
        out[vocab] = [
            f"{p.relative_to(ROOT)}:{line}"
            for pkg in SCANNED
            for p in sorted((ROOT / pkg).rglob("*.py"))
            if str(p.relative_to(ROOT)) != home
            for line in _definitions(ast.parse(p.read_text()), names)
        ]
    return out


def test_each_vocabulary_is_defined_once():
    """Precision names and their dtypes, FP8 recipes, pipeline schedules, recompute modes: spelt out in their home
    module only, imported everywhere else (a choice among them, such as a benchmark's dtypes, names one or writes
    ``(*HALF, "fp8")``)."""
    assert _vocabulary_definitions() == {v: [] for v in VOCABULARIES}
    for vocab, (names, home) in VOCABULARIES.items():
        spelt = {n.value for n in ast.walk(ast.parse((ROOT / home).read_text())) if isinstance(n, ast.Constant)}
        assert names <= spelt, (vocab, home)


def test_the_vocabulary_check_sees_a_second_definition():
    tree = ast.parse(
        "A = ('fp32', 'bf16', 'fp16')\nB = {'bf16': torch.bfloat16, 'fp16': torch.float16}\nC = ('fp32', 'bf16', x)\n"
        "D = ('bf16', 'fp16')\n"
    )
    assert list(_definitions(tree, VOCABULARIES["precisions"][0])) == [1, 2]


def test_gpu_peaks_are_written_only_in_the_machine_table():
    """The data-sheet peaks (H100/H200 989 and 1979 TFLOP/s dense, A100 312) appear as numbers only in
    ``megakernels/machines.py``."""
    peaks = {989.0, 989e12, 1979.0, 1979e12, 312.0, 312e12}
    bad = [
        f"{p.relative_to(ROOT)}:{node.lineno}"
        for pkg in SCANNED
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if str(p.relative_to(ROOT)) != "megakernels/machines.py"
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and float(node.value) in peaks
    ]
    assert bad == []


def _machine_measurements(tree: ast.AST):
    """Lines that measure this machine: the ``2 n³`` FLOPs of a square GEMM (a GEMM peak) or ``/proc/cpuinfo``."""
    for node in ast.walk(tree):
        cube = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and getattr(node.right, "value", 0) == 3
        if cube or (isinstance(node, ast.Constant) and node.value == "/proc/cpuinfo"):
            yield node.lineno


def test_the_machine_is_measured_in_one_place():
    """The CPU GEMM peak is measured by ``megakernels/bench/ceilings.py`` alone (the trainer's MFU and the benchmarks
    call it), and the CPU is read from ``/proc/cpuinfo`` by ``megakernels/host.py`` alone."""
    homes = {"megakernels/bench/ceilings.py", "megakernels/host.py"}
    bad = [
        f"{p.relative_to(ROOT)}:{line}"
        for pkg in SCANNED
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if str(p.relative_to(ROOT)) not in homes
        for line in _machine_measurements(ast.parse(p.read_text()))
    ]
    assert bad == []
    assert sorted(_machine_measurements(ast.parse("f = 2.0 * n**3 / s\nopen('/proc/cpuinfo')\ng = n**2\n"))) == [1, 2]


def test_at_most_ten_modules_at_the_top_level():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 10, top


def _names_a_family(node: ast.Compare) -> bool:
    families = set(registry.names())
    for side in [node.left, *node.comparators]:
        values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
        if any(isinstance(v, ast.Constant) and v.value in families for v in values):
            return True
    return False


def test_only_the_registry_compares_with_a_family_name():
    """``cfg.model == "vlm"`` and the like: the spec answers (``registry.family(cfg)``), and a family's own classes
    compare with their ``family`` attribute."""
    bad = []
    for name, path in MODULES.items():
        if name == "megakernels_models.models.registry" or path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and _names_a_family(node):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bad == []


def test_the_family_check_sees_a_comparison():
    tree = ast.parse("cfg.model == 'bert'\ncfg.model in ('gpt', 'x')\ncfg.model == other\n")
    assert [_names_a_family(n) for n in ast.walk(tree) if isinstance(n, ast.Compare)] == [True, True, False]


def test_every_preset_is_its_familys_and_every_family_has_a_tiny_one():
    for spec in registry.families():
        assert spec.presets and all(cfg.model == spec.name for cfg in spec.presets.values())
        assert isinstance(spec.presets[spec.tiny_preset], spec.config_class)
    assert sorted(registry.PRESETS) == sorted(p for s in registry.families() for p in s.presets)


def test_a_family_registered_from_outside_trains_and_plans(tmp_path):
    """A family is a config class, a model class and one ``register`` call: `megakernels train --model NAME` then
    validates, plans (--dry-run) and trains it, with no other module changed."""
    script = tmp_path / "toy.py"
    script.write_text(
        textwrap.dedent(
            """
            import dataclasses, json, sys
            import torch
            from megakernels_models.models.config import ModelConfig
            from megakernels_models.models.gpt.model import GPTModel
            from megakernels_models.models.registry import FamilySpec, register
            from megakernels_models.models.tasks import CausalLMTask

            @dataclasses.dataclass(frozen=True)
            class ToyConfig(ModelConfig):
                model: str = "toy"
                family = "toy"
                DEFAULTS = dict(
                    norm="rmsnorm", position_embedding="rope", activation="gelu_tanh", bias=False, tie_embeddings=True
                )

            class ToyModel(GPTModel):
                family = "toy"

            tiny = ToyConfig(
                num_layers=2, hidden_size=64, num_heads=4, seq_length=32, vocab_size=261, dropout=0.0,
                attention_dropout=0.0,
            )
            spec = FamilySpec("toy", "toy", ToyConfig, lambda: ToyModel, CausalLMTask, "tokens", {"toy-tiny": tiny})
            register(spec)
            from megakernels.parallel.launch import single_process_world
            from megakernels_models.cli import main

            with single_process_world("cpu", parallel=True):
                direct = sum(p.numel() for p in ToyModel(ModelConfig("toy", **tiny.shared()), 0).parameters())
            print(json.dumps({"direct": direct, "config": type(ModelConfig("toy")).__name__}), flush=True)
            sys.exit(main(sys.argv[1:]))
            """
        )
    )
    common = ["--model", "toy", "--global-batch-size", "4", "--micro-batch-size", "2", "--corpus-bytes", "100000"]
    env_cmd = [sys.executable, str(script), "train", *common]
    log = tmp_path / "dry.jsonl"
    dry = subprocess.run(
        [*env_cmd, "--dry-run", "--log-jsonl", str(log)], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert dry.returncode == 0, dry.stderr[-3000:]
    head = json.loads(dry.stdout.split("\n", 1)[0])
    rep = json.loads(log.read_text().splitlines()[-1])
    assert head["config"] == "ToyConfig" and rep["parameters"] == head["direct"]
    run = subprocess.run(
        [*env_cmd, "--steps", "4", "--lr", "3e-3", "--eval-interval", "0", "--no-progress"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    done = [line for line in run.stdout.splitlines() if line.startswith("done:")]
    first, last = (float(x) for x in done[0].split("loss ")[1].split(",")[0].split(" -> "))
    assert last < first, done


@pytest.mark.parametrize("spec", registry.families(), ids=lambda s: s.name)
def test_each_spec_builds_its_tiny_model(spec):
    assert spec.model().__name__.endswith("Model")
    cfg = spec.presets[spec.tiny_preset]
    assert type(spec.task(cfg, spec.model())).__name__.endswith("Task")
