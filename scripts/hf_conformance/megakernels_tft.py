"""A pytest plugin for transformers' own model tests under megakernels' class patching (README.md beside it).

    python -m pytest -p megakernels_tft tests/models/llama [--mk-patch llama] [--mk-fused-head] [--mk-silu]

``--mk-patch FAMILY`` keeps ``megakernels.integrations.transformers.patch_classes(FAMILY)`` active for the session;
``--mk-fused-head`` patches with ``fused_head=True``; ``--mk-silu`` builds the causal-LM testers with
``hidden_act="silu"``. The terminal summary counts what ``apply`` patched.
"""

from __future__ import annotations

_STATE = {"patch": None, "counts": dict.fromkeys(("models", "norms", "mlp", "experts", "attention", "fused_head"), 0)}


def pytest_addoption(parser):
    group = parser.getgroup("megakernels")
    group.addoption("--mk-patch", default=None, help="class-patch this model family for the session")
    group.addoption("--mk-fused-head", action="store_true", help="patch_classes(..., fused_head=True)")
    group.addoption("--mk-silu", action="store_true", help="causal-LM testers with hidden_act='silu'")


def _silu_testers() -> None:
    """The causal-LM testers read their defaults from ``tests/causal_lm_tester.py`` (or testing_utils in some
    releases): switch its ``hidden_act`` to SiLU wherever it is defined."""
    import importlib

    for name in ("transformers.testing_utils", "tests.causal_lm_tester"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        defaults = getattr(module, "_TEXT_MODEL_TESTER_DEFAULTS", None)
        if isinstance(defaults, dict):
            defaults["hidden_act"] = "silu"
        tester = getattr(module, "CausalLMModelTester", None)
        if tester is not None and hasattr(tester, "hidden_act"):
            tester.hidden_act = "silu"


def pytest_configure(config):
    if config.getoption("--mk-silu"):
        _silu_testers()
    family = config.getoption("--mk-patch")
    if not family:
        return
    import megakernels.integrations.transformers as mkt

    _STATE["patch"] = mkt.patch_classes(family, fused_head=config.getoption("--mk-fused-head"))
    original, counts = mkt.apply, _STATE["counts"]

    def counting_apply(model, **options):
        done = original(model, **options)
        for key in ("norms", "mlp", "experts"):
            counts[key] += done[key]
        counts["models"] += 1
        counts["attention"] += bool(done["attention"])
        counts["fused_head"] += bool(done["fused_head"])
        return done

    mkt.apply = counting_apply  # the class patch's post_init looks apply up when it runs


def pytest_unconfigure(config):
    if _STATE["patch"] is not None:
        _STATE["patch"].revert()


def pytest_terminal_summary(terminalreporter):
    patch = _STATE["patch"]
    what = f"{patch.model_type} {patch.options}: applied {_STATE['counts']}" if patch else "none"
    terminalreporter.write_line(f"megakernels class patch: {what}")
