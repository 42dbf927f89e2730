"""Configuration files: every shipped preset and job is valid and true, flags override a file, unknown names are
refused with the nearest valid one, --print-config reproduces the run, and the resolved configuration is saved at
the top of the JSONL log and in every checkpoint. Also the optimiser knobs the files expose (Adam betas and eps,
decay styles and steps, weight-decay exclusions) reach the optimizer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megakernels.parallel.launch import single_process_world
from megakernels_models.arguments import ArgumentError, TrainArgs, validate
from megakernels_models.cli import main, parse_train_args
from megakernels_models.config import PRESETS, ModelConfig
from megakernels_models.config_file import load

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--corpus-bytes", "262144", "--no-progress",
        "--eval-interval", "0"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_ships_as_a_file_equal_to_it(name):
    path = ROOT / "configs" / "presets" / f"{name}.yaml"
    cfg = ModelConfig(**load(str(path))["architecture"])
    assert cfg == PRESETS[name]


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "jobs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_example_job_validates_and_fits_an_h200(path):
    from megakernels_models.dryrun import report

    args = parse_train_args(["--config", str(path), "--dry-run"])
    rep = report(args, validate(args), out=lambda s: None)
    assert rep["memory_per_device_bytes"] < 141e9 and rep["layout"]["world"] == args.nproc


def test_flags_override_the_file(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("preset: llama-tiny\nsteps: 7\nglobal-batch-size: 32\nlr: 0.01\n")
    args = parse_train_args(["--config", str(f), "--steps", "9"])
    assert (args.preset, args.steps, args.global_batch_size, args.lr) == ("llama-tiny", 9, 32, 0.01)


@pytest.mark.parametrize("text,message", [
    ("global_batch: 8\n", "unknown setting 'global_batch' (did you mean 'global_batch_size'?)"),
    ("architecture:\n  num_layer: 2\n", "unknown architecture field 'num_layer' (did you mean 'num_layers'?)"),
    ("- 1\n- 2\n", "expected a mapping of settings, got a list"),
    ("steps: [\n", "not valid YAML"),
])
def test_bad_files_are_refused_naming_the_problem(tmp_path, capsys, text, message):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    assert main(["train", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_print_config_output_reproduces_the_run(tmp_path, capsys):
    flags = ["--model", "llama", *TINY, "--num-kv-heads", "2", "--tp", "2", "--nproc", "2", "--lr-decay-style",
             "wsd", "--adam-beta2", "0.99"]
    assert main(["train", *flags, "--print-config"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "run.yaml").write_text(printed)
    again = parse_train_args(["--config", str(tmp_path / "run.yaml")])
    original = parse_train_args(flags)
    assert validate(again) == validate(original)
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out == printed


def test_the_log_starts_with_the_configuration_and_checkpoints_keep_it(tmp_path):
    from megakernels_models import checkpoint
    from megakernels_models.train import train

    args = parse_train_args([*TINY, "--steps", "2", "--log-jsonl", str(tmp_path / "log.jsonl"), "--save",
                             str(tmp_path / "ckpt")])
    with single_process_world():
        train(args)
    lines = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert set(lines[0]) == {"config"} and [x["step"] for x in lines[1:]] == [1, 2]
    assert lines[0]["config"]["architecture"]["num_layers"] == 2 and lines[0]["config"]["steps"] == 2
    meta = checkpoint.read_meta(checkpoint.read_latest(str(tmp_path / "ckpt")))
    assert meta["train_config"] == lines[0]["config"]


def test_optimiser_settings_reach_the_optimizer(monkeypatch):
    from megakernels.parallel import optimizer as optimizer_module
    from megakernels_models import train as train_module

    seen = {}
    real = optimizer_module.ParallelOptimizer

    class Spy(real):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            seen["betas"] = self.param_groups[0]["betas"]
            seen["eps"] = self.param_groups[0]["eps"]
            seen["no_decay"] = [len(g["params"]) for g in self.param_groups]

    monkeypatch.setattr(train_module, "ParallelOptimizer", Spy)
    args = parse_train_args([*TINY, "--steps", "4", "--warmup-steps", "0", "--lr", "0.01", "--min-lr", "0.001",
                             "--lr-decay-style", "linear", "--lr-decay-steps", "2", "--adam-beta1", "0.8",
                             "--adam-beta2", "0.9", "--adam-eps", "1e-6", "--no-weight-decay", "embedding"])
    with single_process_world():
        records = train_module.train(args)
    assert [r["lr"] for r in records] == pytest.approx([0.0055, 0.001, 0.001, 0.001])
    assert seen["betas"] == (0.8, 0.9) and seen["eps"] == 1e-6
    # decayed: the 2-D weights but the embeddings; the rest (biases, norms, embeddings) not
    plain = dataclasses.replace(args, no_weight_decay="")
    assert seen["no_decay"][1] > 0 and plain.no_weight_decay == ""


def test_bad_optimiser_settings_name_the_flag():
    with pytest.raises(ArgumentError, match=r"--adam-beta2 must be in \[0, 1\), got 1.0"):
        validate(parse_train_args(["--adam-beta2", "1.0"]))
    with pytest.raises(ArgumentError, match="--lr-wsd-decay-steps 50 is more than the 30 steps after warmup"):
        validate(parse_train_args(["--steps", "30", "--warmup-steps", "0", "--lr-decay-style", "wsd",
                                   "--lr-wsd-decay-steps", "50"]))
    assert TrainArgs().lr_decay_style == "cosine"
