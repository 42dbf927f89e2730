"""The cost model's modes of ``megakernels bench`` (its entry point): found when the tool is installed, its own
``--ops`` names, and its modes run alone."""

from __future__ import annotations

import pytest

from costmodel import cli
from megakernels.bench import cli as bench_cli
from megakernels.bench.cli import OPS
from megakernels_models.cli import main


def test_the_installed_tool_adds_its_modes():
    assert {m.dest for m in bench_cli.plugin_modes()} >= {"static", "measure_peers"}


def test_the_static_report_covers_every_measured_op():
    # moe_dispatch times a collective, hf_train whole HuggingFace models, adamw_offload the CPU AdamW: no GPU kernel
    import argparse

    ns = argparse.Namespace(ops=None, static=True, peer_csv=None, peer_path=None)
    ops = cli.Static().prepare(ns)
    assert set(OPS) - {"moe_dispatch", "hf_train", "adamw_offload"} <= set(ops)


@pytest.mark.parametrize("argv", [["--static", "--e2e", "gpt-tiny"], ["--static", "--plan-check"]])
def test_the_static_report_runs_alone(capsys, argv):
    assert main(["bench", *argv]) == 2
    assert "--static" in capsys.readouterr().err


def test_a_missing_peer_csv_is_named(capsys, tmp_path):
    assert main(["bench", "--static", "--peer-csv", str(tmp_path / "none.csv")]) == 2
    assert "--peer-csv: no file" in capsys.readouterr().err


def test_python_m_costmodel_runs_the_modes_without_an_install(capsys, tmp_path):
    """``python -m costmodel`` (a lent GPU machine: the repository on PYTHONPATH, nothing installed) parses the
    same modes; the entry point's are not added twice when the tool is installed too."""
    from costmodel.__main__ import main as module_main

    assert module_main(["--measure-peers", str(tmp_path / "none.csv")]) == 2
    assert "--measure-peers: no file" in capsys.readouterr().err
