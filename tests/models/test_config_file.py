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
from megakernels_models.config_file import load
from megakernels_models.models.config import PRESETS, ModelConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--corpus-bytes",
    "262144",
    "--no-progress",
    "--eval-interval",
    "0",
]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_ships_as_a_file_equal_to_it(name):
    path = ROOT / "configs" / "presets" / f"{name}.yaml"
    cfg = ModelConfig(**load(str(path))["architecture"])
    assert cfg == PRESETS[name]


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "jobs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_example_job_validates_and_fits_an_h200(path):
    from megakernels_models.planning.dryrun import report

    args = parse_train_args(["--config", str(path), "--dry-run"])
    rep = report(args, validate(args), out=lambda s: None)
    assert rep["memory_per_device_bytes"] < 141e9 and rep["layout"]["world"] == args.nproc


def test_flags_override_the_file(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("preset: llama-tiny\nsteps: 7\nglobal-batch-size: 32\nlr: 0.01\n")
    args = parse_train_args(["--config", str(f), "--steps", "9"])
    assert (args.preset, args.steps, args.global_batch_size, args.lr) == ("llama-tiny", 9, 32, 0.01)


@pytest.mark.parametrize(
    "text,message",
    [
        ("global_batch: 8\n", "unknown setting 'global_batch' (did you mean 'global_batch_size'?)"),
        (
            "architecture:\n  num_layer: 2\n",
            "unknown architecture field 'num_layer' for a gpt model (did you mean 'num_layers'?)",
        ),
        ("architecture:\n  model: llama\n  image_size: 64\n", "unknown architecture field 'image_size' for a llama"),
        ("architecture:\n  model: t5\n", "architecture: model must be one of"),
        ("- 1\n- 2\n", "expected a mapping of settings, got a list"),
        ("steps: [\n", "not valid YAML"),
    ],
)
def test_bad_files_are_refused_naming_the_problem(tmp_path, capsys, text, message):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    assert main(["train", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_print_config_output_reproduces_the_run(tmp_path, capsys):
    flags = [
        "--model",
        "llama",
        *TINY,
        "--num-kv-heads",
        "2",
        "--tp",
        "2",
        "--nproc",
        "2",
        "--lr-decay-style",
        "wsd",
        "--adam-beta2",
        "0.99",
    ]
    assert main(["train", *flags, "--print-config"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "run.yaml").write_text(printed)
    again = parse_train_args(["--config", str(tmp_path / "run.yaml")])
    original = parse_train_args(flags)
    assert validate(again) == validate(original)
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out == printed


def test_the_log_starts_with_the_configuration_and_checkpoints_keep_it(tmp_path):
    from megakernels_models.training import checkpoint
    from megakernels_models.training.train import train

    args = parse_train_args(
        [*TINY, "--steps", "2", "--log-jsonl", str(tmp_path / "log.jsonl"), "--save", str(tmp_path / "ckpt")]
    )
    with single_process_world():
        train(args)
    lines = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert set(lines[0]) == {"config"} and [x["step"] for x in lines[1:]] == [1, 2]
    assert lines[0]["config"]["architecture"]["num_layers"] == 2 and lines[0]["config"]["steps"] == 2
    meta = checkpoint.read_meta(checkpoint.read_latest(str(tmp_path / "ckpt")))
    assert meta["train_config"] == lines[0]["config"]


def test_optimiser_settings_reach_the_optimizer(monkeypatch):
    from megakernels.parallel import optimizer as optimizer_module
    from megakernels_models.training import train as train_module

    seen = {}
    real = optimizer_module.ParallelOptimizer

    class Spy(real):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            seen["betas"] = self.param_groups[0]["betas"]
            seen["eps"] = self.param_groups[0]["eps"]
            seen["no_decay"] = [len(g["params"]) for g in self.param_groups]

    monkeypatch.setattr(train_module, "ParallelOptimizer", Spy)
    args = parse_train_args(
        [
            *TINY,
            "--steps",
            "4",
            "--warmup-steps",
            "0",
            "--lr",
            "0.01",
            "--min-lr",
            "0.001",
            "--lr-decay-style",
            "linear",
            "--lr-decay-steps",
            "2",
            "--adam-beta1",
            "0.8",
            "--adam-beta2",
            "0.9",
            "--adam-eps",
            "1e-6",
            "--no-weight-decay",
            "embedding",
        ]
    )
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
        validate(
            parse_train_args(
                ["--steps", "30", "--warmup-steps", "0", "--lr-decay-style", "wsd", "--lr-wsd-decay-steps", "50"]
            )
        )
    assert TrainArgs().lr_decay_style == "cosine"


# ---- numbers, types and precedence (issue 35) -------------------------------------------------------------------


def _file(tmp_path, text: str, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _refused(argv, capsys) -> str:
    """``megakernels train argv``'s one-line error (exit 2, no traceback)."""
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "text,name,value",
    [
        ("lr: 1e-3", "lr", 1e-3),
        ("min_lr: 3e-5", "min_lr", 3e-5),
        ("lr: 1E-3", "lr", 1e-3),
        ("adam_eps: 1.0e-8", "adam_eps", 1e-8),
        ("weight_decay: .1", "weight_decay", 0.1),
        ("lr: -.5e-1", "lr", -0.05),
        ("steps: 3e2", "steps", 300),
        ("global_batch_size: 1.6E1", "global_batch_size", 16),
        ("steps: 300.0", "steps", 300),
        ("lr: 1", "lr", 1.0),
        ("steps: '40'", "steps", 40),
    ],
)
def test_yaml_numbers_are_numbers_however_written(tmp_path, text, name, value):
    got = load(_file(tmp_path, text + "\n"))[name]
    assert got == value and type(got) is type(value)


def test_json_numbers_and_the_global_yaml_loader_are_unchanged(tmp_path):
    import yaml

    got = load(_file(tmp_path, '{"lr": 1e-3, "steps": 3e2, "min_lr": 0}', "job.json"))
    assert (got["lr"], got["steps"], got["min_lr"]) == (1e-3, 300, 0.0) and type(got["steps"]) is int
    assert yaml.safe_load("x: 1e-3") == {"x": "1e-3"}  # only the trainer's own loader reads YAML 1.2 floats


def test_flags_take_numbers_by_the_files_rule(capsys):
    args = parse_train_args(["--steps", "3e2", "--lr", "1e-3", "--global-batch-size", "16.0"])
    assert (args.steps, args.lr, args.global_batch_size) == (300, 1e-3, 16) and type(args.steps) is int
    with pytest.raises(SystemExit) as e:
        parse_train_args(["--steps", "2.5"])
    assert e.value.code == 2 and "argument --steps: expected an integer, got '2.5' (str)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text,message",
    [
        ('save_interval: "x"', "save_interval: expected an integer, got 'x' (str)"),
        ("steps: 2.5", "steps: expected an integer, got 2.5 (float)"),
        ("steps: .nan", "steps: expected an integer, got nan (float)"),
        ("steps: true", "steps: expected an integer, got True (bool)"),
        ("steps: null", "steps: expected an integer, got None (NoneType)"),
        ("timeout: fast", "timeout: expected a number, got 'fast' (str)"),
        ("peak_tflops: [1]", "peak_tflops: expected a number, got [1] (list)"),
        ("async_save: 3", "async_save: expected true or false, got 3 (int)"),
        ("tokenizer: 5", "tokenizer: expected a string, got 5 (int)"),
        ("precision: fp4", "precision: expected one of fp32, bf16, fp16, fp8, got 'fp4'"),
        ("save-interval: {a: 1}", "save-interval: expected an integer, got {'a': 1} (dict)"),
        ("architecture:\n  hidden_size: wide", "architecture: hidden_size: expected an integer, got 'wide' (str)"),
        ("architecture:\n  bias: 1", "architecture: bias: expected true or false, got 1 (int)"),
        ("architecture: 3", "architecture must be a mapping of model fields, got a int"),
        ("architecture:\n  model: [gpt]", "architecture: model must be a family name (a string), got ['gpt'] (list)"),
        ("steps: !!timestamp x", "not valid YAML"),
        ("a: [1, {b: }", "not valid YAML: "),
    ],
)
def test_type_mistakes_are_one_line_naming_the_file_and_key(tmp_path, capsys, text, message):
    path = _file(tmp_path, text + "\n")
    assert f"--config {path}: {message}" in _refused(["--config", path], capsys)


@pytest.mark.parametrize(
    "content,message",
    [
        (b"\xff\xfe\x00lr: 1", "not UTF-8 text"),
        (b'{"lr": 1e-3,', "not valid JSON: "),
        (b"[" * 100000, "not valid"),
    ],
)
def test_unreadable_files_are_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "job.json"
    path.write_bytes(content)
    assert f"--config {path}: {message}" in _refused(["--config", str(path)], capsys)


def test_range_mistakes_in_a_file_name_the_file(tmp_path, capsys):
    path = _file(tmp_path, "steps: -1\n")
    assert f"--steps must be a positive int, got -1 (steps: from --config {path})" in _refused(
        ["--config", path], capsys
    )
    path = _file(tmp_path, "lr: 0.1\nmin_lr: 1\n")
    assert f"--min-lr 1.0 is larger than --lr 0.1 (lr, min_lr: from --config {path})" in _refused(
        ["--config", path], capsys
    )
    path = _file(tmp_path, "lr: .nan\n")
    assert f"--lr must be a finite number >= 0, got nan (lr: from --config {path})" in _refused(
        ["--config", path], capsys
    )
    # a flag that replaces the file's value is the flag's mistake
    assert "from --config" not in _refused(["--config", _file(tmp_path, "steps: 5\n"), "--steps", "0"], capsys)


HUGE = "architecture:\n  num_layers: 48\n  hidden_size: 8192\n  num_heads: 64\n"


def test_an_architecture_that_differs_from_a_preset_flag_is_refused_naming_the_fields(tmp_path, capsys):
    path = _file(tmp_path, HUGE)
    err = _refused(["--config", path, "--preset", "gpt-tiny", *TINY[8:]], capsys)
    assert (
        f"--config {path}: architecture differs from --preset gpt-tiny in num_layers=48 (the preset's 4), "
        "hidden_size=8192 (the preset's 256), num_heads=64 (the preset's 8)"
    ) in err


def test_an_architecture_that_differs_from_the_files_preset_is_refused(tmp_path, capsys):
    path = _file(tmp_path, "preset: llama-tiny\narchitecture:\n  num_layers: 2\n")
    assert "architecture differs from the same file's preset llama-tiny in num_layers=2" in _refused(
        ["--config", path], capsys
    )


def test_an_architecture_that_agrees_with_the_preset_trains_the_preset(tmp_path, capsys):
    assert main(["train", "--preset", "llama-tiny", "--print-config"]) == 0
    path = _file(tmp_path, capsys.readouterr().out)
    assert validate(parse_train_args(["--config", path, "--preset", "llama-tiny"])) == PRESETS["llama-tiny"]
    # size flags replace both, and what follows from them (the MLP's width) agrees too
    cfg = validate(parse_train_args(["--config", path, "--preset", "llama-tiny", "--hidden-size", "512"]))
    assert cfg == PRESETS["llama-tiny"].replace(hidden_size=512)


def test_flags_then_file_then_preset(tmp_path):
    path = _file(tmp_path, "preset: llama-tiny\nsteps: 7\n")
    assert validate(parse_train_args(["--config", path, "--preset", "gpt-tiny"])).model == "gpt"  # flag over file
    path = _file(tmp_path, "architecture:\n  num_layers: 4\n  hidden_size: 64\n  num_heads: 4\n  seq_length: 32\n")
    cfg = validate(parse_train_args(["--config", path, "--num-layers", "2"]))  # a size flag over the file
    assert (cfg.num_layers, cfg.hidden_size, cfg.seq_length) == (2, 64, 32)
    assert (
        validate(parse_train_args(["--config", _file(tmp_path, HUGE), "--preset", "none", "--dry-run"])).num_layers
        == 48
    )  # --preset none: the architecture is the model


def test_print_config_quotes_text_that_reads_as_a_number(tmp_path):
    from megakernels_models.config_file import dump

    path = _file(tmp_path, dump({"data": "3e2", "freeze": "1E5", "lr": 1e-3}))
    assert load(path) == {
        "data": "3e2",
        "freeze": "1E5",
        "lr": 1e-3,
        "config_file": path,
        "config_settings": {"data": "3e2", "freeze": "1E5", "lr": 1e-3},
    }


@pytest.mark.parametrize("model", ["vlm", "llama"])
def test_print_config_folds_every_model_setting_into_the_architecture(model, tmp_path, capsys):
    """The model's settings (sizes, MoE, vision) appear once, inside ``architecture:``, and the file reproduces
    the run's configuration."""
    import yaml

    from megakernels_models.arguments import ARCHITECTURE_SETTINGS

    assert main(["train", "--model", model, "--print-config"]) == 0
    printed = capsys.readouterr().out
    top = yaml.safe_load(printed)
    assert not set(ARCHITECTURE_SETTINGS) & set(top), sorted(set(ARCHITECTURE_SETTINGS) & set(top))
    (tmp_path / "run.yaml").write_text(printed)
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out == printed
