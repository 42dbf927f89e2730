"""The trainer's arguments: one dataclass (what ``megakernels train`` parses into) and its validation.

Everything that can be wrong with a layout is reported here, in the parent process, before any rank starts:
each message names the flag and the rule it broke (``--tp 4 does not divide num_heads=6``).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from megakernels_models.config import MODELS, PRESETS, RECOMPUTE, ModelConfig, preset

PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("1f1b", "gpipe")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ArgumentError(ValueError):
    """An invalid combination of trainer arguments (the message names the flag and the rule)."""


@dataclasses.dataclass
class TrainArgs:
    """All of ``megakernels train``'s flags (DESIGN.md §5); the defaults are the embedded default run."""

    # model
    model: str | None = None
    preset: str | None = "gpt-tiny"
    num_layers: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    seq_length: int | None = None
    vocab_size: int | None = None
    ffn_hidden_size: int | None = None
    dropout: float | None = None
    attention: str = "flash"
    # layout
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    dp: int | None = None
    nproc: int = 1
    device: str = "cpu"
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    # optimisation
    micro_batch_size: int = 8
    global_batch_size: int = 16
    steps: int = 300
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int | None = None  # default: a tenth of --steps
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    seed: int = 1234
    precision: str = "fp32"
    recompute: str = "none"
    distributed_optimizer: bool = False
    # data
    data: str | None = None
    tokenizer: str = "byte"
    split: str = "949,50,1"
    corpus_bytes: int = 8 << 20
    # checkpoints, evaluation, logs
    save: str | None = None
    save_interval: int | None = None
    keep_checkpoints: int = 3
    load: str | None = None
    eval_interval: int = 100
    eval_steps: int = 4
    log_jsonl: str | None = None
    tensorboard: str | None = None
    progress: bool = True
    peak_tflops: float | None = None
    timeout: float = 600.0
    dry_run: bool = False
    step_timers: bool = False  # per-phase step times + peak memory in the records (megakernels bench --e2e)

    # ---- derived ------------------------------------------------------------------------------------------------

    def model_config(self) -> ModelConfig:
        """The model: the preset (if any) with the explicitly given sizes replacing its fields."""
        sizes = {k: getattr(self, k) for k in ("num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size",
                                               "ffn_hidden_size")}
        drop = {} if self.dropout is None else {"dropout": self.dropout, "attention_dropout": self.dropout}
        if sizes["vocab_size"] is None and self.tokenizer != "byte":  # the model's vocabulary is the tokenizer's
            from megakernels_models.data.tokenizer import build_tokenizer
            try:
                sizes["vocab_size"] = build_tokenizer(self.tokenizer).vocab_size
            except (OSError, ValueError):
                pass  # validate_data_args reports the tokenizer's problem, naming the flag
        if self.preset is not None:
            cfg = preset(self.preset, **sizes, **drop)
            if self.model is not None and self.model != cfg.model:
                raise ArgumentError(f"--model {self.model} contradicts --preset {self.preset} (a {cfg.model} model)")
            return cfg
        missing = [f"--{k.replace('_', '-')}" for k in ("num_layers", "hidden_size", "num_heads", "seq_length")
                   if sizes[k] is None]
        if missing:
            raise ArgumentError(f"without --preset, give {', '.join(missing)}")
        sizes = {k: v for k, v in sizes.items() if v is not None}
        sizes.setdefault("vocab_size", 261)
        return ModelConfig(self.model or "gpt", **sizes, **drop)

    def world_size(self) -> int:
        """Ranks: torchrun's ``WORLD_SIZE`` under torchrun, else ``--nproc``."""
        return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else self.nproc

    def data_parallel_size(self) -> int:
        return self.world_size() // (self.tp * self.pp)

    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size())

    def param_dtype(self) -> torch.dtype:
        return DTYPES[self.precision]


def _positive(name: str, v, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ArgumentError(f"--{name} must be a positive integer, got {v!r}")


def validate(a: TrainArgs) -> ModelConfig:
    """Check every argument and their combinations; return the model configuration.

    Raises:
        ArgumentError: the first broken rule, naming the flag(s).
    """
    if a.model is not None and a.model not in MODELS:
        raise ArgumentError(f"--model must be one of {', '.join(MODELS)}, got {a.model!r}")
    if a.preset is not None and a.preset not in PRESETS:
        raise ArgumentError(f"--preset {a.preset!r} is unknown; known presets: {', '.join(PRESETS)}")
    for name in ("tp", "pp", "nproc", "micro_batch_size", "global_batch_size", "steps", "eval_steps"):
        _positive(name.replace("_", "-"), getattr(a, name))
    for name in ("vpp", "dp", "save_interval"):
        _positive(name.replace("_", "-"), getattr(a, name), allow_none=True)
    if isinstance(a.eval_interval, bool) or not isinstance(a.eval_interval, int) or a.eval_interval < 0:
        raise ArgumentError(f"--eval-interval must be an integer >= 0 (0 = never), got {a.eval_interval!r}")
    try:
        cfg = a.model_config()
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    for name, choices in (("precision", PRECISIONS), ("recompute", RECOMPUTE), ("attention", ("flash", "torch")),
                          ("schedule", SCHEDULES), ("device", ("cpu", "cuda"))):
        if getattr(a, name) not in choices:
            raise ArgumentError(f"--{name} must be one of {', '.join(choices)}, got {getattr(a, name)!r}")
    if a.device == "cuda" and not torch.cuda.is_available() and not a.dry_run:
        raise ArgumentError("--device cuda: no CUDA device is available")
    world = a.world_size()
    if world % (a.tp * a.pp):
        raise ArgumentError(f"the world size {world} (--nproc or torchrun's WORLD_SIZE) is not divisible by "
                            f"--tp × --pp = {a.tp} × {a.pp} = {a.tp * a.pp}")
    dp = world // (a.tp * a.pp)
    if a.dp is not None and a.dp != dp:
        raise ArgumentError(f"--dp {a.dp} does not match world size / (tp × pp) = {world} / {a.tp * a.pp} = {dp}")
    if cfg.num_heads % a.tp:
        raise ArgumentError(f"--tp {a.tp} does not divide num_heads={cfg.num_heads} (each TP rank holds whole heads)")
    if cfg.ffn_hidden_size % a.tp:
        raise ArgumentError(f"--tp {a.tp} does not divide ffn_hidden_size={cfg.ffn_hidden_size}")
    vpp = a.vpp or 1
    if vpp > 1 and a.pp == 1:
        raise ArgumentError(f"--vpp {a.vpp} needs pipeline parallelism (--pp > 1)")
    if cfg.num_layers % (a.pp * vpp):
        rule = f"--pp × --vpp = {a.pp} × {vpp} = {a.pp * vpp}" if vpp > 1 else f"--pp {a.pp}"
        raise ArgumentError(f"{rule} does not divide num_layers={cfg.num_layers} (equal layers per stage)")
    if a.global_batch_size % (a.micro_batch_size * dp):
        raise ArgumentError(f"--global-batch-size {a.global_batch_size} is not divisible by --micro-batch-size × "
                            f"dp = {a.micro_batch_size} × {dp} = {a.micro_batch_size * dp}")
    m = a.global_batch_size // (a.micro_batch_size * dp)
    if vpp > 1 and m % a.pp:
        raise ArgumentError(f"the interleaved schedule (--vpp {vpp}) needs the number of micro-batches per step "
                            f"(global / (micro × dp) = {m}) to be a multiple of --pp {a.pp}")
    if a.sequence_parallel and cfg.seq_length % a.tp:
        raise ArgumentError(f"--sequence-parallel needs --tp {a.tp} to divide seq_length={cfg.seq_length}")
    for name in ("lr", "min_lr", "weight_decay", "clip_grad"):
        v = getattr(a, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be a number >= 0, got {v!r}")
    if a.min_lr > a.lr:
        raise ArgumentError(f"--min-lr {a.min_lr} is larger than --lr {a.lr}")
    if a.warmup_steps is None:
        a.warmup_steps = a.steps // 10
    if isinstance(a.warmup_steps, bool) or not isinstance(a.warmup_steps, int) or not 0 <= a.warmup_steps <= a.steps:
        raise ArgumentError(f"--warmup-steps must be an integer in 0..--steps ({a.steps}), got {a.warmup_steps!r}")
    if isinstance(a.seed, bool) or not isinstance(a.seed, int) or a.seed < 0:
        raise ArgumentError(f"--seed must be an integer >= 0, got {a.seed!r}")
    if a.save_interval is not None and a.save is None:
        raise ArgumentError("--save-interval needs --save DIR")
    _positive("keep-checkpoints", a.keep_checkpoints)
    if a.save is not None and os.path.exists(a.save) and not os.path.isdir(a.save):
        raise ArgumentError(f"--save {a.save!r} exists and is not a directory")
    if a.load is not None:
        from megakernels_models.checkpoint import CheckpointError, read_latest
        try:
            read_latest(a.load)
        except CheckpointError as e:
            raise ArgumentError(str(e)) from None
    try:
        split = [int(x) for x in a.split.split(",")]
        if len(split) != 3 or min(split) < 0 or split[0] == 0:
            raise ValueError
    except ValueError:
        raise ArgumentError(f"--split must be three non-negative integers like 949,50,1 (train > 0), got "
                            f"{a.split!r}") from None
    if a.eval_interval and split[1] == 0:
        raise ArgumentError("--eval-interval needs a validation split (the middle number of --split is 0)")
    from megakernels_models.data.build import validate_data_args  # data.build imports this module
    validate_data_args(a, cfg)
    if not a.timeout > 0:
        raise ArgumentError(f"--timeout must be > 0 seconds, got {a.timeout}")
    if a.peak_tflops is not None and not a.peak_tflops > 0:
        raise ArgumentError(f"--peak-tflops must be > 0, got {a.peak_tflops}")
    return cfg
