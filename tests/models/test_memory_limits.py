"""A model larger than the machine is refused before allocation, with the numbers; the limits are read from
/proc/meminfo, the cgroup (v2 and v1) and RLIMIT_AS; ``--no-memory-check`` and ``--dry-run`` skip the check. Also
``--timeout``'s bounds (1e-9 ended in a DistNetworkError traceback)."""

from __future__ import annotations

import dataclasses

import pytest

from megakernels_models.arguments import ArgumentError, TrainArgs, validate
from megakernels_models.cli import main, parse_train_args
from megakernels_models.training import memory_limits

HUGE = ["--preset", "none", "--num-layers", "8", "--hidden-size", "65536", "--num-heads", "64", "--seq-length", "128"]


def _host(monkeypatch, available=None, per_process=None):
    monkeypatch.setattr(memory_limits, "host_memory", lambda: {"available": available, "per_process": per_process})


def test_a_model_larger_than_this_machine_is_refused_by_the_cli_in_one_line(capsys):
    assert main(["train", *HUGE]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "the model needs about" in err and "of memory (1 rank(s) ×" in err and "--no-memory-check" in err


def test_the_default_run_passes_the_real_check():
    args = TrainArgs()
    memory_limits.check(args, validate(args))


def test_ranks_times_the_estimate_must_fit_the_available_memory(monkeypatch):
    args = parse_train_args(["--nproc", "2"])
    cfg = validate(dataclasses.replace(args, memory_check=False))
    need = memory_limits.estimate(args, cfg)["device"]
    _host(monkeypatch, available=(int(1.5 * need), "a fake limit"))
    memory_limits.check(dataclasses.replace(args, nproc=1), cfg)  # one rank fits
    with pytest.raises(
        ArgumentError,
        match=r"the model needs about .* \(2 rank\(s\) × .* the --dry-run estimate\) "
        r"but this machine has .* available \(a fake limit\); --no-memory-check",
    ):
        validate(args)
    validate(dataclasses.replace(args, memory_check=False))
    validate(dataclasses.replace(args, dry_run=True))


def test_one_rank_must_fit_the_process_limit(monkeypatch):
    _host(monkeypatch, per_process=(1 << 20, "RLIMIT_AS (ulimit -v)"))
    with pytest.raises(
        ArgumentError,
        match=r"each rank needs about .* but a process may use 1\.05 MB "
        r"\(RLIMIT_AS \(ulimit -v\)\)",
    ):
        validate(TrainArgs())


def test_on_cuda_the_estimate_must_fit_the_devices_free_memory(monkeypatch):
    _host(monkeypatch)
    monkeypatch.setattr(memory_limits, "device_memory", lambda index: (10 << 20, 80 << 30))
    args = dataclasses.replace(TrainArgs(), device="cuda")
    cfg = validate(dataclasses.replace(args, dry_run=True))
    with pytest.raises(ArgumentError, match=r"per GPU .* but cuda:0 has 10\.5 MB free of 85\.9 GB"):
        memory_limits.check(args, cfg)
    monkeypatch.setattr(memory_limits, "device_memory", lambda index: (80 << 30, 80 << 30))
    memory_limits.check(args, cfg)


def _limits(monkeypatch, tmp_path, meminfo_kb: int, cgroup: str, files: dict[str, str]):
    (tmp_path / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_kb} kB\n")
    (tmp_path / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        (tmp_path / "fs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / rel).write_text(text)
    monkeypatch.setattr(memory_limits, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(memory_limits, "PROC_CGROUP", str(tmp_path / "cgroup"))
    monkeypatch.setattr(memory_limits, "CGROUP_ROOT", str(tmp_path / "fs"))
    return memory_limits.host_memory()["available"]


def test_the_cgroup_v2_limit_of_the_process_or_an_ancestor_counts(monkeypatch, tmp_path):
    got = _limits(
        monkeypatch,
        tmp_path,
        4 << 20,
        "0::/job.slice/run\n",
        {"job.slice/run/memory.max": "max\n", "job.slice/memory.max": f"{1 << 30}\n"},
    )
    assert got == (1 << 30, f"the cgroup limit {tmp_path}/fs/job.slice/memory.max")


def test_the_cgroup_v1_limit_counts_and_unlimited_is_ignored(monkeypatch, tmp_path):
    got = _limits(
        monkeypatch,
        tmp_path,
        4 << 20,
        "4:memory:/docker/abc\n0::/\n",
        {
            "memory/docker/abc/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/memory.limit_in_bytes": f"{512 << 20}\n",
        },
    )
    assert got == (512 << 20, f"the cgroup limit {tmp_path}/fs/memory/memory.limit_in_bytes")


def test_memavailable_counts_when_it_is_the_least(monkeypatch, tmp_path):
    got = _limits(monkeypatch, tmp_path, 1024, "0::/\n", {"memory.max": f"{1 << 30}\n"})
    assert got == (1 << 20, f"MemAvailable in {tmp_path}/meminfo")


@pytest.mark.parametrize(
    "value,message",
    [
        (
            "1e-9",
            r"--timeout must be at least 1 s and at most 31536000 s \(a year\): how long a collective waits for a "
            r"peer, got 1e-09",
        ),
        ("0", "--timeout must be at least 1 s"),
        ("1e12", "--timeout must be at least 1 s and at most"),
        ("nan", "--timeout must be a finite number, got nan"),
        ("inf", "--timeout must be a finite number, got inf"),
    ],
)
def test_timeout_is_bounded(value, message):
    with pytest.raises(ArgumentError, match=message):
        validate(parse_train_args(["--timeout", value]))


def test_a_tiny_timeout_is_one_line_before_any_process_starts(capsys):
    assert main(["train", "--nproc", "2", "--timeout", "1e-9"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "--timeout must be" in err


def test_the_weight_bytes_count_the_built_models_weights():
    """The shape count under the memory check of sizes past a tensor's limit: the built model's linear layers'
    and word embedding's weights, less the vocabulary's padding rows (biases, norms, the position table, the
    padding and an untied output layer left out: a lower bound)."""
    from megakernels.parallel.embedding import pad_vocab_size
    from megakernels_models.planning import costs

    for flags in ([], ["--model", "llama"], ["--precision", "bf16"]):
        args = parse_train_args(flags)
        cfg = validate(args, check_memory=False)
        meta = costs.MetaModel(cfg)
        matrices = sum(p.numel() for n, p in meta.model.named_parameters() if p.dim() == 2 and "position" not in n)
        padded = pad_vocab_size(cfg.vocab_size, 1)
        padding = (padded - cfg.vocab_size) * cfg.hidden_size
        head = 0 if cfg.tie_embeddings else padded * cfg.hidden_size  # an untied output layer: counted once
        size = 2 if "bf16" in flags else 4
        assert memory_limits.weight_bytes(args, cfg) == (matrices - padding - head) * size, flags


@pytest.mark.parametrize("source", ["flag", "config"])
def test_sizes_no_tensor_can_hold_are_the_memory_checks_one_line_refusal(source, tmp_path, capsys):
    """--hidden-size 1000000000 (also a config file's architecture): the memory check refuses with the weights'
    count (4 layers × 12 h² + the byte vocabulary's 261 × h, fp32), not a storage-size overflow traceback."""
    h = 1_000_000_000
    if source == "flag":
        argv = ["train", "--hidden-size", str(h)]
    else:
        (tmp_path / "big.yaml").write_text(
            f"architecture:\n  model: gpt\n  num_layers: 4\n  hidden_size: {h}\n  num_heads: 8\n  seq_length: 256\n"
            "  vocab_size: 261\n"
        )
        argv = ["train", "--config", str(tmp_path / "big.yaml")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    expected = memory_limits.human(4 * (4 * 12 * h * h + 261 * h), "B")
    assert f"the model needs at least {expected} of memory (its weights alone in fp32" in err, err
    assert "Traceback" not in err and "overflow" not in err and len(err.strip().splitlines()) == 1
    assert main([*argv, "--dry-run"]) == 2  # no memory check there: the sizes are refused as such
    err = capsys.readouterr().err
    assert "make a weight larger than a tensor can be" in err and len(err.strip().splitlines()) == 1, err
