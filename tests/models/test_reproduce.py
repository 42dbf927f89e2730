"""megakernels plan --reproduce: the published-runs reader (required and optional columns; a bad cell is one error
naming the row and the column, never a traceback), the four metrics against hand computation, the summary
statistics, and the command end to end on a 2-row CSV (text and --json)."""

from __future__ import annotations

import json

import pytest

from megakernels_models.cli import main
from megakernels_models.models.config import ModelConfig
from megakernels_models.planning import costs, reproduce

HEADER = "model,num_layers,hidden,heads,vocab,seq_len,gpu,num_gpus,tp,pp,global_batch,published_metric,published_value"
ROW = "gpt,4,256,4,1024,128,a100,8,2,2,16,tflops_per_gpu,100"


def write(tmp_path, text: str, name: str = "runs.csv") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_required_columns_and_the_defaults_of_the_optional_ones(tmp_path):
    (run,) = reproduce.read_csv(write(tmp_path, f"{HEADER},extra\n{ROW},ignored\n"))
    L = run.layout
    assert (L.tp, L.pp, L.dp, L.cp, L.vpp) == (2, 2, 2, 1, 1)
    assert (L.precision, L.recompute, L.sequence_parallel, L.distributed_optimizer, L.fsdp, L.flash) == (
        "bf16",
        "none",
        False,
        False,
        False,
        True,
    )
    assert run.auto_micro_batch and not run.auto_vpp and run.gpus_per_node == costs.DEVICES["a100"].gpus_per_node
    assert run.config.num_kv_heads == 4 and run.config.model == "gpt"
    assert run.row["extra"] == "ignored" and run.metric == "tflops_per_gpu" and run.published == 100.0


def test_optional_columns(tmp_path):
    header = f"{HEADER},num_kv_heads,ffn_hidden,vpp,cp,dp,micro_batch,gpus_per_node,precision,recompute,"
    header += "sequence_parallel,distributed_optimizer,fsdp,flash_attention,source"
    row = "llama,4,256,4,1024,256,h100,16,2,2,32,mfu,0.4,2,512,2,2,2,2,4,fp8,selective,true,yes,0,false,paper"
    (run,) = reproduce.read_csv(write(tmp_path, f"{header}\n{row}\n"))
    L = run.layout
    assert (L.tp, L.pp, L.cp, L.dp, L.vpp, L.micro_batch_size) == (2, 2, 2, 2, 2, 2)
    assert (L.precision, L.recompute, L.sequence_parallel, L.distributed_optimizer, L.flash) == (
        "fp8",
        "selective",
        True,
        True,
        False,
    )
    assert run.gpus_per_node == 4 and run.config.num_kv_heads == 2 and run.config.ffn_hidden_size == 512
    assert not run.auto_micro_batch and run.row["source"] == "paper"


@pytest.mark.parametrize(
    "header,row,message",
    [
        (HEADER, ROW.replace(",8,2,2,", ",8,x,2,"), "row 1 (line 2), column 'tp': expected an integer >= 1, got 'x'"),
        (HEADER, ROW.replace("a100", "tpu"), "column 'gpu': expected one of"),
        (HEADER, ROW.replace("tflops_per_gpu", "speed"), "column 'published_metric': expected one of"),
        (HEADER, ROW.replace(",100", ","), "column 'published_value': missing"),
        (HEADER, ROW.replace(",100", ",-3"), "column 'published_value': expected a positive number"),
        (HEADER, ROW.replace(",8,2,2,", ",6,2,2,"), "column 'num_gpus': 6 GPUs are not a multiple of tp·pp·cp = 4"),
        (HEADER, ROW.replace("gpt,", "bert,"), "column 'model': expected one of gpt, llama"),
        (HEADER + ",dp", ROW + ",3", "column 'dp': tp·pp·cp·dp = 12, not num_gpus = 8"),
        (HEADER + ",micro_batch", ROW + ",3", "column 'micro_batch': 3 does not divide the 8 sequences"),
        (HEADER + ",fsdp", ROW + ",maybe", "column 'fsdp': expected true or false"),
        (HEADER + ",recompute", ROW + ",some", "column 'recompute': expected one of none, selective, full"),
        (HEADER.replace(",heads", ""), ROW, "the header lacks the required column(s) heads"),
    ],
)
def test_a_bad_cell_is_one_error_naming_the_row_and_the_column(tmp_path, capsys, header, row, message):
    """The reader refuses the row with one error; the command lists it with that reason and reproduces the good
    row (a header without a required column is the command's one-line error, status 2)."""
    path = write(tmp_path, f"{header}\n{ROW}\n{row}\n" if "header lacks" not in message else f"{header}\n{row}\n")
    if "header lacks" not in message:
        message = message.replace("row 1 (line 2)", "row 2 (line 3)")
    with pytest.raises(reproduce.ReproduceError, match=None) as info:
        reproduce.read_csv(path)
    assert message in str(info.value) and path in str(info.value)
    if "header lacks" in message:
        assert main(["plan", "--reproduce", path]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and err.count("\n") == 1
        return
    assert main(["plan", "--reproduce", path]) == 0
    out, err = capsys.readouterr()
    assert "1 published runs" in out and "1 row(s) not reproduced" in out and message in out and err == ""


def test_a_missing_file_is_a_clear_error(tmp_path, capsys):
    assert main(["plan", "--reproduce", str(tmp_path / "none.csv")]) == 2
    err = capsys.readouterr().err
    assert "none.csv: cannot read" in err and "Traceback" not in err


def test_the_metrics_against_hand_computation():
    # GPT, l=2, h=64, a=2, s=32, V=100: forward FLOPs per token = 2·(4h²·l + 2·4h²·l) + 4·s·h·l + 2·h·V
    cfg = ModelConfig("gpt", num_layers=2, hidden_size=64, num_heads=2, seq_length=32, vocab_size=100)
    l, h, s, V = 2, 64, 32, 100
    forward = 24 * l * h * h + 4 * s * h * l + 2 * h * V
    full = 3 * forward + 24 * l * h * h + 4 * s * h * l  # the layers' forward again
    assert cfg.flops_per_token("full") == pytest.approx(full)
    # Narayanan et al. 2021 eq. (3), per token: 96·l·h²·(1 + s/6h + V/16lh)
    assert full == pytest.approx(96 * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)))
    layout = costs.Layout(tp=2, pp=1, dp=2, micro_batch_size=2, global_batch_size=8, recompute="full")
    device, step = costs.DEVICES["a100"], 0.5
    tokens, n = 8 * 32, 4
    assert reproduce.metric_value("iteration_s", step, cfg, layout, device) == 0.5
    assert reproduce.metric_value("tokens_per_s_per_gpu", step, cfg, layout, device) == pytest.approx(tokens / 0.5 / n)
    got = reproduce.metric_value("tflops_per_gpu", step, cfg, layout, device)
    assert got == pytest.approx(full * tokens / 0.5 / n / 1e12)
    mfu = reproduce.metric_value("mfu", step, cfg, layout, device)
    assert mfu == pytest.approx(3 * forward * tokens / 0.5 / n / 312e12)  # model FLOPs: no recomputation


def test_the_summary_statistics():
    s = reproduce.summary([0.1, -0.2, 0.05, -0.4, 0.3])
    assert s["count"] == 5 and s["median_abs_rel_error"] == pytest.approx(0.2)
    # |errors| sorted 0.05 0.1 0.2 0.3 0.4: the 90th percentile is 0.3 + 0.6·(0.4 − 0.3)
    assert s["p90_abs_rel_error"] == pytest.approx(0.36)
    assert reproduce.percentile([1.0, 2.0], 50) == pytest.approx(1.5)


def test_the_command_end_to_end_on_two_rows(tmp_path, capsys):
    path = write(
        tmp_path,
        f"{HEADER},micro_batch,source\n{ROW},2,first\nllama,4,256,4,1024,128,h100,8,2,1,16,iteration_s,0.01,,second\n",
    )
    assert main(["plan", "--reproduce", path, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    assert len(rows) == 2 and report["summary"]["count"] == 2
    for r in rows:
        assert r["rel_error"] == pytest.approx(r["predicted"] / r["published_value"] - 1)
        assert r["csv"] == path and r["step_s"] > 0
    assert rows[0]["source"] == "first" and rows[0]["layout"]["micro_batch"] == 2
    assert rows[1]["predicted"] == pytest.approx(rows[1]["step_s"])  # iteration_s is the step time
    assert rows[1]["layout"]["micro_batch"] in (1, 2, 4)  # auto: the fastest that fits
    errors = sorted(abs(r["rel_error"]) for r in rows)
    assert report["summary"]["median_abs_rel_error"] == pytest.approx(sum(errors) / 2)
    assert main(["plan", "--reproduce", path]) == 0
    out = capsys.readouterr().out
    assert "2 published runs" in out and "median |error|" in out and "tflops_per_gpu" in out


def test_gemm_efficiency_is_the_kernel_models_sustained_gemm_times_one_calibrated_training_fraction():
    """The step-time model's GEMM efficiency of every GPU the kernel model knows comes from that model's measured
    sustained fraction (A100 85.9 %, sm_90 80 %), times one training fraction calibrated on the A100 rows of the
    shipped development set (Narayanan et al. 2021 Table 1): their median signed error is within 2 % of zero and
    no row is off by 10 %."""
    import os
    import statistics

    from costmodel.model import MACHINES

    for gpu, machine in (("a100", "A100-SXM4-80GB"), ("h100", "H100-SXM"), ("h200", "H200")):
        assert costs.DEVICES[gpu].efficiency == pytest.approx(
            MACHINES[machine].mma_sustained * costs.TRAINING_GEMM_FRACTION, abs=1e-4
        )
    assert costs.DEVICES["a100"].efficiency > costs.DEVICES["h100"].efficiency  # A100 sustains more of its peak
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    report = reproduce.reproduce(os.path.join(root, "benchmarks", "published", "narayanan2021_table1.csv"))
    errors = [r["rel_error"] for r in report["rows"]]
    assert len(errors) == 10
    assert abs(statistics.median(errors)) < 0.02
    assert max(abs(e) for e in errors) < 0.10


def test_uneven_pipeline_stages_are_timed_by_the_largest_stage(tmp_path):
    """pp = 4 over 10 layers (stages of 3, 3, 2, 2 as Megatron-LM's first/last-stage options allow): the step is
    that of 4 stages of 3 layers, and a FLOP metric counts the 10 layers' FLOPs over it."""
    head = f"{HEADER},micro_batch,vpp"
    rows = [
        "gpt,10,1024,16,1024,256,a100,8,2,4,32,iteration_s,1.0,1,1",
        "gpt,12,1024,16,1024,256,a100,8,2,4,32,iteration_s,1.0,1,1",
        "gpt,10,1024,16,1024,256,a100,8,2,4,32,tflops_per_gpu,100,1,1",
    ]
    report = reproduce.reproduce(write(tmp_path, "\n".join([head, *rows]) + "\n"))
    uneven, even, flops = report["rows"]
    assert uneven["step_s"] == pytest.approx(even["step_s"]) and uneven["layout"]["stage_layers"] == 3
    ten = ModelConfig("gpt", num_layers=10, hidden_size=1024, num_heads=16, seq_length=256, vocab_size=1024)
    assert flops["predicted"] == pytest.approx(ten.flops_per_token("none") * 32 * 256 / uneven["step_s"] / 8 / 1e12)


@pytest.mark.parametrize("value", ["0.43", "43", "43%"])
def test_mfu_is_read_as_a_fraction_a_percentage_or_with_a_percent_sign(tmp_path, value):
    path = write(tmp_path, f"{HEADER}\ngpt,4,256,4,1024,128,a100,8,2,2,16,mfu,{value}\n")
    (run,) = reproduce.read_csv(path)
    assert run.published == pytest.approx(0.43)


def test_an_mfu_above_100_is_refused_naming_the_cell(tmp_path):
    path = write(tmp_path, f"{HEADER}\ngpt,4,256,4,1024,128,a100,8,2,2,16,mfu,430\n")
    with pytest.raises(reproduce.ReproduceError, match="published_value"):
        reproduce.read_csv(path)


def test_the_gpu_column_takes_the_sxm_parts_spellings_and_refuses_other_parts():
    for name, key in (
        ("h100", "h100"),
        ("H100 SXM5", "h100"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("A100-SXM4-80GB", "a100"),
        ("H200", "h200"),
        ("V100", "v100"),
    ):
        assert reproduce.device_key(name) == key, name
    for name in ("H100 PCIe", "H100 NVL", "A100-SXM4-40GB", "MI300X", "B200"):
        assert reproduce.device_key(name) is None, name


def test_malformed_rows_are_listed_with_the_reason_and_the_rest_reproduced(tmp_path, capsys):
    """Rows a published table gets wrong — a vpp of n/a, a global batch that does not split over the
    data-parallel replicas, an interleaved layout no micro-batch size fits, sizes no tensor can hold — are listed
    with the reason naming the row and line; the good rows are predicted as they are without the bad ones; with
    no good row the command exits 1."""
    head = f"{HEADER},vpp"
    good = [f"{ROW},", "llama,4,256,4,1024,128,h100,8,2,1,16,iteration_s,0.01,"]
    bad = {
        f"{ROW},n/a": "column 'vpp': expected an integer >= 1 or auto (empty: 1), got 'n/a'",
        ROW.replace(",16,tflops", ",15,tflops") + ",": "column 'global_batch': 15 sequences do not split over dp = 2",
        ROW.replace(",16,tflops", ",6,tflops") + ",2": "vpp 2: the interleaved schedule runs micro-batches in groups",
        ROW.replace(",256,", ",1000000000000,", 1) + ",": "make a weight larger than a tensor can be",
    }
    lines = [good[0], *bad, good[1]]
    path = write(tmp_path, "\n".join([head, *lines]) + "\n")
    assert main(["plan", "--reproduce", path, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    alone = reproduce.reproduce(write(tmp_path, "\n".join([head, *good]) + "\n", "good.csv"))
    assert [r["predicted"] for r in report["rows"]] == [r["predicted"] for r in alone["rows"]]
    assert [r["csv_row"] for r in report["rows"]] == [1, 6] and report["summary"] == alone["summary"]
    listed = report["not_reproduced"]
    assert [(r["row"], r["line"]) for r in listed] == [(2, 3), (3, 4), (4, 5), (5, 6)]
    for r, why in zip(listed, bad.values()):
        assert why in r["reason"] and f"{path}: row {r['row']} (line {r['line']})" in r["reason"], r
    assert main(["plan", "--reproduce", path]) == 0
    out = capsys.readouterr().out
    assert "2 published runs" in out and "4 row(s) not reproduced" in out and all(w in out for w in bad.values())
    only_bad = write(tmp_path, "\n".join([head, *bad]) + "\n", "bad.csv")
    assert main(["plan", "--reproduce", only_bad]) == 1
    out, err = capsys.readouterr()
    assert "0 published runs" in out and "4 row(s) not reproduced" in out and "Traceback" not in out + err
