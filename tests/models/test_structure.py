"""The package's shape (docs/design.md §3): families only in their folders, few top-level modules, no import cycles,
no private names imported across modules, and a family added from outside works end to end through its spec."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from megakernels_models.models import registry

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "megakernels_models"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _imports(path: pathlib.Path):
    """``(module, name)`` of every ``from X import name`` and ``(module, None)`` of every ``import X``, deferred
    imports inside functions included (those only type checkers run, under ``if TYPE_CHECKING:``, left out)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", getattr(block.test, "attr", "")) == "TYPE_CHECKING"
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
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
    bad = [
        f"{name} imports {item} from {module}"
        for name, path in MODULES.items()
        for module, item in _imports(path)
        if item and item.startswith("_") and module.startswith("megakernels") and module != name
    ]
    assert bad == []


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


def test_only_the_family_folders_compare_with_a_family_name():
    """``cfg.model == "vlm"`` and the like: outside ``models/`` the spec answers (``registry.family(cfg)``)."""
    bad = []
    for name, path in MODULES.items():
        if name.startswith("megakernels_models.models"):
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
