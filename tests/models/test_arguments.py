"""``megakernels train`` argument validation and ``--dry-run``: every broken rule is reported before any process
starts, naming the flag; the dry run reports the paper presets' costs in seconds without allocating them."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from megakernels_models.arguments import ArgumentError, TrainArgs, validate
from megakernels_models.cli import parse_train_args


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--tp", "3", "--nproc", "3"], r"--tp 3 does not divide num_heads=8"),
        (["--pp", "3", "--nproc", "3"], r"--pp 3 does not divide num_layers=4"),
        (["--pp", "2", "--vpp", "4", "--nproc", "2"], r"--pp × --vpp = 2 × 4 = 8 does not divide num_layers=4"),
        (["--vpp", "2"], r"--vpp 2 needs pipeline parallelism"),
        (["--tp", "2"], r"world size 1 .* is not divisible by --tp × --pp = 2 × 1"),
        (
            ["--nproc", "2", "--global-batch-size", "12", "--micro-batch-size", "4"],
            r"--global-batch-size 12 is not divisible by --micro-batch-size × dp = 4 × 2",
        ),
        (
            ["--nproc", "4", "--pp", "2", "--vpp", "2", "--global-batch-size", "16", "--micro-batch-size", "8"],
            r"interleaved schedule .* micro-batches per step .* multiple of --pp 2",
        ),
        (["--nproc", "2", "--dp", "4"], r"--dp 4 does not match"),
        (["--preset", "gpt-2b"], r"--preset 'gpt-2b' is unknown"),
        (
            ["--preset", "none", "--hidden-size", "64"],
            r"without --preset, give --num-layers, --num-heads, --seq-length",
        ),
        (["--min-lr", "1", "--lr", "0.1"], r"--min-lr 1.0 is larger than --lr 0.1"),
        (["--warmup-steps", "500", "--steps", "10"], r"--warmup-steps 500 is more than --steps 10"),
        (
            ["--tp", "2", "--nproc", "2", "--sequence-parallel", "--seq-length", "127"],
            r"--sequence-parallel needs --tp 2 to divide seq_length=127",
        ),
        (["--model", "bert", "--preset", "gpt-tiny"], r"--model bert contradicts --preset gpt-tiny"),
        (
            [
                "--model",
                "llama",
                "--tp",
                "3",
                "--nproc",
                "3",
                "--num-heads",
                "6",
                "--hidden-size",
                "192",
                "--num-kv-heads",
                "2",
            ],
            r"--tp 3 and num_kv_heads=2: the key/value heads must split evenly",
        ),
        (
            ["--cp", "2", "--nproc", "2", "--model", "bert"],
            r"--cp 2: context parallelism is for causal language models",
        ),
        (["--cp", "4", "--nproc", "4", "--seq-length", "100"], r"--cp 4 needs seq_length=100 divisible by 2 × cp"),
        (["--cp", "2", "--nproc", "2", "--dropout", "0.1"], r"ring attention has no attention dropout"),
        (
            ["--nproc", "2", "--device", "cuda"],
            r"--nproc 2 spawns CPU processes \(gloo\); with --device cuda launch one "
            r"process per GPU with torchrun --nproc-per-node 2",
        ),
        (["--model", "llama", "--num-experts", "4", "--moe-top-k", "5"], r"moe_top_k=5 must be in 1..num_experts=4"),
        (
            ["--model", "llama", "--num-experts", "6", "--ep", "4", "--nproc", "4", "--micro-batch-size", "4"],
            r"--ep 4 does not divide num_experts=6",
        ),
        (
            ["--model", "llama", "--num-experts", "4", "--ep", "2", "--nproc", "2", "--tp", "2"],
            r"--ep 2 does not divide the data-parallel size 1",
        ),
        (["--ep", "2", "--nproc", "2"], r"--ep 2 needs a mixture-of-experts model"),
        (["--cp", "2", "--nproc", "3"], r"world size 3 .* is not divisible by --tp × --cp × --pp = 1 × 2 × 1 = 2"),
        (["--steps", "0"], r"--steps must be a positive int, got 0"),
        (["--data", "x"], r"--data x: cannot read x\.bin"),
        (
            ["--model", "bert", "--document-masking"],
            r"--document-masking is for causal language models \(.*GPT.*\), not --model bert",
        ),
        (["--sft"], r"--sft needs --data PREFIX, made by 'megakernels preprocess --chat FILE.jsonl'"),
        (["--no-sft-packing"], r"--no-sft-packing is for --sft"),
        (["--sft", "--document-masking", "--data", "x"], r"--sft keeps each conversation's positions and attention"),
        (["--model", "gpt", "--qk-norm"], r"--qk-norm is for Qwens \(--model qwen\)"),
        (["--model", "llama", "--no-qkv-bias"], r"--qkv-bias is for Qwens \(--model qwen\)"),
        (["--model", "gpt", "--rope-scaling", "llama3"], r"rope_scaling needs rotary positions"),
        (
            ["--model", "llama", "--rope-scaling", "llama3", "--rope-original-max-positions", "0"],
            r"--rope-original-max-positions must be a positive int, got 0",
        ),
    ],
)
def test_invalid_flags_name_the_rule(flags, message):
    with pytest.raises(ArgumentError, match=message):
        validate(parse_train_args(flags))


def test_the_families_switches_and_the_position_scaling_replace_the_presets():
    """Qwen's --qkv-bias/--qk-norm, --moe-normalize and the rotary scaling flags reach the model; their --no-
    forms and --rope-scaling none remove what the preset has."""
    qwen = validate(parse_train_args(["--model", "qwen", "--qkv-bias", "--no-qk-norm", "--no-moe-normalize"]))
    assert (qwen.model, qwen.qkv_bias, qwen.qk_norm, qwen.moe_normalize) == ("qwen", True, False, False)
    assert validate(parse_train_args(["--model", "qwen"])).qk_norm  # qwen-tiny is Qwen 3 style
    flags = ["--model", "llama", "--rope-scaling", "llama3", "--rope-scaling-factor", "8"]
    scaled = validate(parse_train_args(flags + ["--rope-original-max-positions", "64", "--rope-high-freq-factor", "2"]))
    assert (scaled.rope_scaling, scaled.rope_scaling_factor, scaled.rope_original_max_positions) == ("llama3", 8.0, 64)
    assert scaled.rope_high_freq_factor == 2.0 and scaled.rope_low_freq_factor == 1.0
    big = parse_train_args(["--preset", "llama3.1-8b", "--rope-scaling", "none"]).model_config()
    assert big.rope_scaling is None and parse_train_args(["--preset", "llama3.1-8b"]).model_config().rope_scaling
    with pytest.raises(ArgumentError, match="--qk-norm is for Qwens"):
        parse_train_args(["--preset", "llama3-8b", "--qk-norm"]).model_config()


def test_per_layer_attention_and_gemmas_flags_reach_the_model():
    """--layer-types (short or transformers' names), --local-rope-theta, --sinks and Gemma's own flags replace the
    preset's fields; a wrong count or name is refused naming the rule; Gemma's flags are Gemma's only."""
    flags = ["--model", "llama", "--num-layers", "4", "--sliding-window", "5", "--local-rope-theta", "100"]
    cfg = validate(parse_train_args(flags + ["--layer-types", "sliding,sliding_attention,sliding,full", "--sinks"]))
    assert cfg.layer_types == ("sliding_attention",) * 3 + ("full_attention",)
    assert (cfg.local_rope_theta, cfg.sinks, cfg.sliding_window) == (100.0, True, 5)
    gemma = validate(
        parse_train_args(["--model", "gemma", "--query-pre-attn-scalar", "6", "--final-logit-softcapping", "3"])
    )
    assert (gemma.softmax_scale, gemma.logit_softcap) == (6.0**-0.5, 3.0)
    assert validate(parse_train_args(["--model", "gemma"])).logit_softcap is None
    with pytest.raises((ArgumentError, ValueError), match="layer_types has 2 entries"):
        validate(parse_train_args(flags + ["--layer-types", "sliding,full"]))
    with pytest.raises((ArgumentError, ValueError), match="layer_types entries must be one of"):
        validate(parse_train_args(flags + ["--layer-types", "sliding,local,full,full"]))
    with pytest.raises(ArgumentError, match="--final-logit-softcapping is for"):
        validate(parse_train_args(["--model", "llama", "--final-logit-softcapping", "3"]))


def test_the_yarn_flags_reach_the_model():
    """--rope-scaling yarn with its corrections, mscale pair and --no-rope-truncate set the config's fields; the
    attention factor follows them (0.1 ln(factor) + 1 without the mscale pair)."""
    import math

    flags = ["--model", "llama", "--rope-scaling", "yarn", "--rope-scaling-factor", "32"]
    cfg = validate(parse_train_args(flags + ["--rope-original-max-positions", "64", "--rope-beta-fast", "16"]))
    assert (cfg.rope_scaling, cfg.rope_beta_fast, cfg.rope_beta_slow, cfg.rope_truncate) == ("yarn", 16.0, 1.0, True)
    assert cfg.rope_scaling_spec().attention_factor == pytest.approx(0.1 * math.log(32) + 1)
    ds = validate(parse_train_args(flags + ["--rope-mscale", "1", "--rope-mscale-all-dim", "1", "--no-rope-truncate"]))
    assert (ds.rope_mscale, ds.rope_mscale_all_dim, ds.rope_truncate) == (1.0, 1.0, False)
    assert ds.rope_scaling_spec().attention_factor == pytest.approx(1.0)
    with pytest.raises((ArgumentError, ValueError), match="rope_beta_slow"):
        validate(parse_train_args(flags + ["--rope-beta-slow", "-1"]))


def test_the_default_is_the_embedded_tiny_gpt():
    args = parse_train_args([])
    assert args == TrainArgs()
    cfg = validate(args)
    assert (cfg.model, args.device, args.tokenizer, args.data) == ("gpt", "cpu", "byte", None)


@pytest.mark.parametrize("model", ["bert", "llama"])
def test_a_model_family_alone_picks_its_tiny_preset(model):
    cfg = validate(parse_train_args(["--model", model]))
    assert cfg == validate(parse_train_args(["--preset", f"{model}-tiny"]))
    assert parse_train_args(["--model", model]).preset_name() == f"{model}-tiny"


def test_cli_reports_errors_before_starting_processes():
    r = subprocess.run(
        [sys.executable, "-m", "megakernels_models.cli", "train", "--tp", "3", "--nproc", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "--tp 3 does not divide num_heads=8" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "name,tp",
    [
        ("gpt-1.2b", 8),
        ("gpt-2.5b", 4),
        ("gpt-4.2b", 8),
        ("gpt-8.3b", 8),
        ("bert-336m", 8),
        ("bert-1.3b", 8),
        ("bert-3.9b", 8),
    ],
)
def test_dry_run_of_paper_presets(name, tp, tmp_path):
    from megakernels_models.planning.dryrun import report

    log = tmp_path / "dry.jsonl"
    args = parse_train_args(
        [
            "--preset",
            name,
            "--tp",
            str(tp),
            "--nproc",
            str(8 * tp),
            "--micro-batch-size",
            "4",
            "--global-batch-size",
            "512",
            "--precision",
            "bf16",
            "--distributed-optimizer",
            "--sequence-parallel",
            "--recompute",
            "selective",
            "--dry-run",
            "--log-jsonl",
            str(log),
        ]
    )
    lines = []
    report(args, out=lines.append)
    rec = json.loads(log.read_text())
    assert set(rec) >= {"parameters", "flops_per_step", "memory_per_device_bytes"}
    cfg = validate(args)
    assert rec["flops_per_step"] == pytest.approx(cfg.flops_per_token("none") * 512 * cfg.seq_length)
    # weights + grads + optimizer: 2 + 4 + 12/dp bytes per parameter on the device (dp = 8)
    b = rec["memory_breakdown_bytes"]
    n = rec["parameters_per_device"]
    assert (b["weights"], b["grads"], b["optimizer"]) == (2 * n, 4 * n, pytest.approx(12 * n / 8))
    assert rec["parameters"] > tp * n * 0.9  # tp shards nearly everything
    assert any("memory per device" in line for line in lines)


def test_dry_run_pipeline_memory_and_bubble(tmp_path):
    from megakernels_models.planning.dryrun import report

    args = parse_train_args(
        [
            "--preset",
            "gpt-8.3b",
            "--pp",
            "4",
            "--nproc",
            "4",
            "--global-batch-size",
            "16",
            "--micro-batch-size",
            "1",
            "--dry-run",
        ]
    )
    rep = report(args, out=lambda s: None)
    assert rep["bubble_fraction"] == pytest.approx(3 / 16)
    assert rep["ranks"][3] == {"tp": 0, "cp": 0, "dp": 0, "pp": 3}
    # the layers are split evenly; the first stage also holds the embeddings, the last the final norm + a copy
    # of the tied word embedding
    assert rep["parameters_per_device"] < rep["parameters"] / 4 * 1.1


def test_dry_run_without_distributed_optimizer_is_18_bytes_per_param():
    from megakernels_models.planning.dryrun import report

    rep = report(parse_train_args(["--preset", "gpt-1.2b", "--precision", "bf16", "--dry-run"]), out=lambda s: None)
    b, n = rep["memory_breakdown_bytes"], rep["parameters_per_device"]
    assert b["weights"] + b["grads"] + b["optimizer"] == 18 * n


def test_dry_run_with_offload_is_6_bytes_per_param_on_the_device_and_16_over_dp_on_the_host():
    """bf16 params (2) + fp32 gradients (4) on the GPU; fp32 master, moments and gradient copy (16 / dp with
    ZeRO-1) in host memory."""
    from megakernels_models.planning.dryrun import report

    lines = []
    rep = report(
        parse_train_args(
            [
                "--preset",
                "gpt-1.2b",
                "--precision",
                "bf16",
                "--nproc",
                "4",
                "--distributed-optimizer",
                "--offload-optimizer",
                "--global-batch-size",
                "32",
                "--dry-run",
            ]
        ),
        out=lines.append,
    )
    b, n = rep["memory_breakdown_bytes"], rep["parameters_per_device"]
    assert (b["weights"], b["grads"], b["optimizer"]) == (2 * n, 4 * n, 0)
    assert rep["host_memory_per_rank_bytes"] == pytest.approx(16 * n / 4)
    assert any("host memory per rank" in line for line in lines)
    # the host AdamW steps this rank's ZeRO-1 quarter; the plan's model of the step (costs.offload_time)
    from megakernels_models.planning import costs

    assert rep["offload_seconds"]["host_adam_s"] == pytest.approx(n / 4 * costs.HOST_ADAMW_NS_PER_PARAM * 1e-9)
    assert any(line.startswith("offloaded optimizer per step on an H200") for line in lines)
    assert rep["device_bytes_per_param"] == 6
    assert any(line.startswith("device memory per parameter (--offload-optimizer): 6 bytes") for line in lines)


def test_dry_run_with_fsdp_offload_keeps_the_sharded_parameters_and_gradients_on_the_device():
    """--fsdp over 4 ranks: fp32 sharded parameters and gradients (8 bytes / 4) on the GPU; the shards' master
    copy, moments and gradient copy (16 / 4) in host memory, stepped there at a quarter of the parameters."""
    from megakernels_models.planning import costs
    from megakernels_models.planning.dryrun import report

    argv = ["--preset", "gpt-1.2b", "--nproc", "4", "--fsdp", "--offload-optimizer", "--global-batch-size", "32"]
    lines = []
    rep = report(parse_train_args([*argv, "--dry-run"]), out=lines.append)
    n = rep["parameters_per_device"]
    assert rep["device_bytes_per_param"] == 2 and rep["fsdp_shard_ranks"] == 4
    assert rep["memory_breakdown_bytes"]["optimizer"] == 0
    assert rep["host_memory_per_rank_bytes"] == pytest.approx(16 * n / 4)
    assert rep["offload_seconds"]["host_adam_s"] == pytest.approx(n / 4 * costs.HOST_ADAMW_NS_PER_PARAM * 1e-9)
    assert any(
        line.startswith("device memory per parameter (--offload-optimizer): 2 bytes = (4 + 4) / 4") for line in lines
    )
    assert any("16 bytes per parameter / 4 shard ranks" in line for line in lines)


def test_plan_with_offload_prints_the_flag_and_needs_less_memory():
    from megakernels_models.planning import costs, plan

    cfg = parse_train_args(["--preset", "gpt-8.3b", "--dry-run"]).model_config()
    off = plan.rank(cfg, 8, 64, costs.DEVICES["h100"], offload=True)[0]
    assert "--offload-optimizer" in plan.command(off["layout"], ["--preset", "gpt-8.3b"])
    on_device = costs.memory(costs.MetaModel(cfg), dataclasses.replace(off["layout"], offload_optimizer=False))
    assert off["memory_bytes"] < on_device["total"]


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--steps", "x"],
        ["train", "--precision", "fp7"],
        ["trian"],
        ["train", "--model", "llama", "--rope-scaling", "dynamic"],  # HF's dynamic NTK scaling is not ours
    ],
)
def test_a_flag_mistake_is_one_line(argv, capsys):
    from megakernels_models.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "error:" in err and "usage" not in err, err


def test_print_config_does_not_need_the_memory_a_run_would(capsys):
    from megakernels_models.cli import main

    assert main(["train", "--preset", "gpt-8.3b", "--print-config"]) == 0
    assert "architecture:" in capsys.readouterr().out


UNWRITABLE = "/proc/megakernels-no-such-dir"  # /proc takes no new entries, whoever asks (root too)


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--nproc", "65", "--micro-batch-size", "1", "--global-batch-size", "65"],
            "--nproc 65 is more than the 64 local processes",
        ),
        (["--nproc", "1000"], "--nproc 1000 is more than the 64 local processes"),
        (["--save", f"{UNWRITABLE}/ckpt"], f"--save '{UNWRITABLE}/ckpt' cannot be written: No such file or directory"),
        (["--tensorboard", "FILE"], "--tensorboard 'FILE' exists and is not a directory"),
        (["--log-jsonl", f"{UNWRITABLE}/log.jsonl"], "--log-jsonl '/proc/megakernels-no-such-dir/log.jsonl' cannot be"),
        (["--log-jsonl", "DIR"], "--log-jsonl 'DIR' is a directory, not a file"),
    ],
)
def test_cli_edge_cases_are_one_line_before_any_process_starts(flags, message, tmp_path, monkeypatch, capsys):
    from megakernels.parallel import launch
    from megakernels_models.cli import main

    def no_world(*a, **k):
        raise AssertionError("a world was started")

    monkeypatch.setattr(launch, "launch", no_world)
    monkeypatch.setattr(launch, "run_world", no_world)
    (tmp_path / "FILE").write_text("x")
    (tmp_path / "DIR").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_dry_run_plans_any_world_and_the_run_creates_its_output_paths(tmp_path):
    """--nproc past the local limit is a world to plan for in a dry run; the paths a run writes are created by the
    check (the run would create them), a nested --save and --log-jsonl included."""
    validate(parse_train_args(["--dry-run", "--nproc", "1000", "--global-batch-size", "8000"]))
    save, log, tb = tmp_path / "a" / "b", tmp_path / "logs" / "run.jsonl", tmp_path / "tb"
    validate(parse_train_args(["--save", str(save), "--log-jsonl", str(log), "--tensorboard", str(tb)]))
    assert save.is_dir() and log.is_file() and log.read_text() == "" and tb.is_dir()
    assert sorted(p.name for p in save.iterdir()) == []  # the probe's file is gone


def test_the_timeout_default_is_what_help_says_and_what_the_launcher_gets(monkeypatch, capsys):
    """--help states the default (seconds and minutes: Megatron-LM's 10), and a run without --timeout hands that
    many seconds to the launcher, which ends a job whose rank stopped after that long (tests/models/test_hangs.py
    stops a rank under a short --timeout)."""
    import re

    from megakernels.parallel import launch
    from megakernels_models.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    said = re.search(r"--timeout X .*?\(default: (\d+) s, (\d+) minutes", text)
    assert said is not None, text
    assert float(said.group(1)) == TrainArgs().timeout == 60 * float(said.group(2)) == 600.0
    got = {}
    monkeypatch.setattr(launch, "launch", lambda fn, *a, **k: got.update(k) or [])
    assert main(["train", "--steps", "1"]) == 0
    assert got["timeout"] == 600.0 and got["nproc"] == 1
