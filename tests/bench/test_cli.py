"""``megakernels bench``: argument errors (exit 2, naming the flag, before anything is measured) and a quick run
that writes bench.json and one PNG per op."""

from __future__ import annotations

import json

import pytest
import torch

from megakernels.bench.cli import GROUPS, OPS, parse_shapes, resolve_ops
from megakernels_models.cli import build_parser, main


def bench(*argv) -> int:
    return main(["bench", *argv])


def test_bench_is_a_registered_subcommand():
    ns = build_parser().parse_args(["bench", "--ops", "adamw", "--quick"])
    assert ns.command == "bench" and ns.ops == "adamw" and ns.quick and callable(ns._run)


def test_unknown_op_exits_2_naming_the_flag(capsys):
    assert bench("--ops", "layer_norm,softmaxx") == 2
    err = capsys.readouterr().err
    assert "--ops" in err and "'softmaxx'" in err and "layer_norm" in err


def test_unknown_dtype_exits_2_naming_the_flag(capsys):
    assert bench("--ops", "bias_gelu", "--dtype", "float8") == 2
    assert "--dtype" in capsys.readouterr().err


def test_nonpositive_min_run_time_exits_2(capsys):
    assert bench("--min-run-time", "0") == 2
    assert "--min-run-time" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_a_gpu_exits_2(capsys):
    assert bench("--ops", "bias_gelu", "--device", "cuda") == 2
    assert "--device cuda" in capsys.readouterr().err


def test_unknown_e2e_preset_exits_2(capsys):
    assert bench("--e2e", "gpt-huge") == 2
    err = capsys.readouterr().err
    assert "--e2e" in err and "gpt-huge" in err


def test_bert_preset_is_refused_for_e2e(capsys):
    assert bench("--e2e", "bert-tiny") == 2
    err = capsys.readouterr().err
    assert "--e2e: bert-tiny is a bert model" in err and "GPT and Llama presets" in err


def test_broken_layout_rule_exits_2_naming_the_flag(capsys):
    assert bench("--e2e", "gpt-tiny", "--tp", "3") == 2
    assert "--tp 3 does not divide num_heads" in capsys.readouterr().err


def test_malformed_number_is_an_argparse_error():
    with pytest.raises(SystemExit) as e:
        bench("--steps", "many")
    assert e.value.code == 2


def test_shapes_without_one_of_a_selected_familys_size_exit_2(capsys):
    assert bench("--ops", "rms_norm,scaled_softmax", "--shapes", "64,256") == 2
    err = capsys.readouterr().err
    assert "--shapes" in err and "softmax needs b,h,sq,sk" in err


def test_shapes_go_to_the_families_with_that_many_sizes():
    assert parse_shapes("64,256;2,4,8,16;32,128", ["rms_norm", "bias_gelu", "scaled_softmax", "adamw"]) == {
        "norms": [(64, 256), (32, 128)],
        "bias_gelu": [(64, 256), (32, 128)],
        "softmax": [(2, 4, 8, 16)],
    }


@pytest.mark.parametrize(
    "flag, value", [("--shapes", "64,x"), ("--shapes", "0,4"), ("--head-dims", "64,-1"), ("--seqlens", "many")]
)
def test_malformed_sizes_exit_2_naming_the_flag(capsys, flag, value):
    assert bench("--ops", "rms_norm,flash_attention", flag, value) == 2
    assert flag in capsys.readouterr().err


def test_a_mode_may_accept_ops_of_its_own():
    assert resolve_ops("only_static,norms", e2e=False, extra=("only_static",)) == ["only_static", *GROUPS["norms"]]
    with pytest.raises(ValueError, match="'only_static'"):
        resolve_ops("only_static", e2e=False)


def test_groups_expand_in_order_without_duplicates():
    assert resolve_ops("softmax,scaled_softmax,adamw", e2e=False) == GROUPS["softmax"] + ["adamw"]
    assert resolve_ops(None, e2e=False) == list(OPS)
    assert resolve_ops(None, e2e=True) == []


def test_quick_run_of_one_op_writes_json_and_png(tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        bench(
            "--ops",
            "bias_gelu",
            "--dtype",
            "fp32",
            "--quick",
            "--no-compile",
            "--min-run-time",
            "0.01",
            "--out",
            str(out),
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "## bias_gelu" in printed and "vs eager" in printed and "% ceil" in printed
    data = json.loads((out / "bench.json").read_text())
    assert data["machine"]["device"] == "cpu"
    # the CPU's model and flags (those /proc/cpuinfo lists) and the fp32 GEMM route with how it was chosen
    from megakernels import host
    from megakernels.ops import gemm

    assert (data["machine"]["cpu"], data["machine"]["cpu_flags"]) == (host.cpu()["model"], host.cpu()["flags"])
    assert data["machine"]["cpu_gemm"]["route"] == gemm.route() and data["machine"]["cpu_gemm"]["source"]
    assert data["ceilings"]["copy_GBps"] > 0 and data["ceilings"]["gemm_TFLOPs"]["float32"] > 0
    assert {r["pass"] for r in data["rows"]} == {"fwd", "fwd+bwd"}
    for r in data["rows"]:
        assert r["op"] == "bias_gelu" and r["dtype"] == "float32" and r["unit"] == "GB/s"
        assert set(r["times_ms"]) == {"megakernels", "eager"} and r["rates"]["megakernels"] > 0
        assert r["fraction_of_ceiling"] == pytest.approx(r["rates"]["megakernels"] / data["ceilings"]["copy_GBps"])
        assert r["speedups"]["eager"] == pytest.approx(r["times_ms"]["eager"] / r["times_ms"]["megakernels"])
    assert (out / "bias_gelu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_run_of_the_llama_group_measures_rope_variants_and_swiglu(tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        bench(
            "--ops", "llama", "--dtype", "bf16", "--quick", "--no-compile", "--min-run-time", "0.01", "--out", str(out)
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "## rope" in printed and "## swiglu" in printed
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert {(r["op"], r["variant"], r["pass"]) for r in rows} == {
        (op, v, p) for op, v in (("rope", "angles"), ("rope", "table"), ("swiglu", "")) for p in ("fwd", "fwd+bwd")
    }
    assert all(r["dtype"] == "bfloat16" and r["unit"] == "GB/s" and "eager" in r["speedups"] for r in rows)
    assert (out / "rope.png").exists() and (out / "swiglu.png").exists()


def test_quick_run_of_grouped_gemm_compares_the_loop_and_torch_grouped_mm(tmp_path, capsys):
    from megakernels.bench import moe

    out = tmp_path / "out"
    assert (
        bench("--ops", "grouped_gemm", "--dtype", "fp32", "--quick", "--min-run-time", "0.01", "--out", str(out)) == 0
    )
    payload = json.loads((out / "bench.json").read_text())
    rows = payload["rows"]
    assert {(r["op"], r["pass"]) for r in rows} == {("grouped_gemm", p) for p in ("fwd", "fwd+bwd")}
    why = moe.available("grouped_mm", torch.float32, "cpu")
    expected = {"loop"} | ({"grouped_mm"} if why is None else set())
    assert all(set(r["speedups"]) == expected and r["unit"] == "TFLOP/s" for r in rows)
    assert why is None or why in payload["notes"]
    assert all(sum(r["group_sizes"]) == 64 * moe.TOP_K for r in rows)


def test_quick_run_of_hf_train_times_patched_against_unpatched_models(tmp_path):
    import transformers  # noqa: F401  (the test extra)

    out = tmp_path / "out"
    assert bench("--ops", "hf", "--dtype", "fp32", "--quick", "--min-run-time", "0.01", "--out", str(out)) == 0
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert {(r["variant"], r["pass"]) for r in rows} == {
        (m, p) for m in ("gpt2-tiny", "llama-tiny") for p in ("fwd+bwd", "step")
    }
    assert all(set(r["speedups"]) == {"transformers"} and r["unit"] == "TFLOP/s" for r in rows)


def test_moe_dispatch_times_expert_exchange_against_the_bare_all_to_all():
    from megakernels.bench import moe

    rows = moe.run_dispatch([2], [64], hidden=32, reps=2, log=lambda _: None)
    assert len(rows) == 1 and rows[0]["op"] == "moe_dispatch" and rows[0]["world"] == 2
    assert set(rows[0]["speedups"]) == {"all_to_all"} and rows[0]["work"] > 0


def test_offloaded_adamw_reports_ns_per_parameter_against_torchs_fused_adamw():
    from megakernels.bench.adamw import run_offload

    rows = run_offload({"2x4K": (2, 4096)}, ["bfloat16"], min_run_time=0.01, log=lambda s: None)
    (row,) = rows
    assert row["op"] == "adamw_offload" and row["size"] == 2 * 4096
    assert set(row["times_ms"]) == {"megakernels", "torch_fused", "torch_foreach"}
    assert row["extra_columns"]["ns/param"] == pytest.approx(row["times_ms"]["megakernels"] * 1e6 / row["size"])
    assert row["extra_columns"]["step ns/param"] > 0
    assert row["speedups"]["torch_fused"] == pytest.approx(
        row["times_ms"]["torch_fused"] / row["times_ms"]["megakernels"]
    )


def test_muon_times_newton_schulz_against_torch_mm_and_the_step_against_fused_adamw():
    from megakernels.bench import muon

    rows = muon.measure({"2x16x24": (2, 16, 24)}, ["float32"], min_run_time=0.01, log=lambda s: None)
    ns, step = rows
    assert (ns["op"], ns["pass"], step["pass"]) == ("muon", "newton_schulz", "step")
    assert set(ns["times_ms"]) == {"megakernels", "torch_mm"}
    assert ns["work"] == 2 * 5 * (4 * 16 * 16 * 24 + 2 * 16**3)
    assert set(step["times_ms"]) == {"megakernels", "fused_adamw", "torch_muon"}
    per = step["extra_columns"]["fused_adamw ns/param"]
    assert per == pytest.approx(step["times_ms"]["fused_adamw"] * 1e6 / (2 * 16 * 24))


def test_a_tool_that_is_not_installed_is_answered_with_how_to_install_it(capsys, monkeypatch):
    """The static cost model is a development tool beside the package: without it, its flags parse and are answered
    in one line naming the set-up command, exit status 2."""
    import argparse

    from megakernels.bench import cli

    monkeypatch.setattr(cli, "plugin_modes", list)
    p = cli.configure(argparse.ArgumentParser())
    for argv in (["--static"], ["--static", "--peer-csv", "x.csv"], ["--measure-peers", "x.csv"]):
        ns = p.parse_args(argv)
        assert ns._run(ns) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and argv[0] in err and "scripts/setup.sh" in err, err
