"""The layout's rules: the degrees (tp, cp, pp, vpp, ep, dp) against the world size, each other and the model's
shapes (heads, key/value heads, MLP widths, layers, sequence length, experts, the vision encoder), checked in the
parent process before any rank starts (``arguments.validate``). Each message names the flags and the sizes.
"""

from __future__ import annotations

import os

from megakernels_models.config import ModelConfig
from megakernels_models.settings import ArgumentError


def validate_layout(a, cfg: ModelConfig) -> None:
    """Check the layout of trainer arguments ``a`` (``TrainArgs``) against the world size and the model ``cfg``.

    Raises:
        ArgumentError: the first broken rule, naming the flags and the sizes involved.
    """
    world, model = a.world_size(), a.tp * a.cp * a.pp
    restarts = a.restart_count() if "WORLD_SIZE" in os.environ else 0
    # After an elastic restart the world is whatever rejoined, not what the command line planned for: say so.
    source = (f"torchrun's WORLD_SIZE after elastic restart {restarts}" if restarts
              else "--nproc or torchrun's WORLD_SIZE")
    names = "--tp × --cp × --pp" if a.cp > 1 else "--tp × --pp"
    sizes = " × ".join(str(x) for x in ((a.tp, a.cp, a.pp) if a.cp > 1 else (a.tp, a.pp)))
    if world % model:
        raise ArgumentError(f"the world size {world} ({source}) is not divisible by "
                            f"{names} = {sizes} = {model}")
    dp = world // model
    if a.dp is not None and a.dp != dp:
        raise ArgumentError(f"--dp {a.dp} does not match world size / ({names[2:].replace(' --', ' ')}) = "
                            f"{world} / {model} = {dp} (world size from {source}; leave --dp out and it follows "
                            "the world)")
    if cfg.num_heads % a.tp:
        raise ArgumentError(f"--tp {a.tp} does not divide num_heads={cfg.num_heads} (each TP rank holds whole heads)")
    kv = cfg.num_kv_heads
    if kv % a.tp and a.tp % kv:
        raise ArgumentError(f"--tp {a.tp} and num_kv_heads={kv}: the key/value heads must split evenly over the "
                            f"tensor-parallel ranks (num_kv_heads a multiple of tp) or be replicated on groups of "
                            f"ranks (tp a multiple of num_kv_heads)")
    if a.cp > 1:
        if cfg.model == "bert":
            raise ArgumentError(f"--cp {a.cp}: context parallelism is for causal language models (GPT, Llama); "
                                "BERT's padding masks are not split over the ring")
        if cfg.seq_length % (2 * a.cp * (a.tp if a.sequence_parallel else 1)):
            rule = "2 × cp × tp" if a.sequence_parallel else "2 × cp"
            raise ArgumentError(f"--cp {a.cp} needs seq_length={cfg.seq_length} divisible by {rule} (each rank "
                                "holds two equal chunks of every sequence)")
        if cfg.attention_dropout > 0:
            raise ArgumentError(f"--cp {a.cp} with attention dropout {cfg.attention_dropout}: ring attention has no "
                                "attention dropout (set --dropout 0)")
    if cfg.ffn_hidden_size % a.tp:
        raise ArgumentError(f"--tp {a.tp} does not divide ffn_hidden_size={cfg.ffn_hidden_size}")
    if cfg.model == "vlm":
        _validate_vision_layout(a, cfg)
    vpp = a.vpp or 1
    if vpp > 1 and a.pp == 1:
        raise ArgumentError(f"--vpp {a.vpp} needs pipeline parallelism (--pp > 1)")
    if cfg.num_layers % (a.pp * vpp):
        rule = f"--pp × --vpp = {a.pp} × {vpp} = {a.pp * vpp}" if vpp > 1 else f"--pp {a.pp}"
        raise ArgumentError(f"{rule} does not divide num_layers={cfg.num_layers} (equal layers per stage)")
    if a.global_batch_size % (a.micro_batch_size * dp):
        raise ArgumentError(f"--global-batch-size {a.global_batch_size} is not divisible by --micro-batch-size × "
                            f"dp = {a.micro_batch_size} × {dp} = {a.micro_batch_size * dp} (dp = world size {world} "
                            f"from {source} / {names[2:].replace(' --', ' ')} {model})")
    m = a.global_batch_size // (a.micro_batch_size * dp)
    if vpp > 1 and m % a.pp:
        raise ArgumentError(f"the interleaved schedule (--vpp {vpp}) needs the number of micro-batches per step "
                            f"(global / (micro × dp) = {m}) to be a multiple of --pp {a.pp}")
    if a.ep > 1 and not cfg.num_experts:
        raise ArgumentError(f"--ep {a.ep} needs a mixture-of-experts model (--num-experts > 0)")
    if dp % a.ep:
        raise ArgumentError(f"--ep {a.ep} does not divide the data-parallel size {dp} (expert-parallel groups are "
                            "carved out of the data-parallel ranks)")
    if cfg.num_experts and cfg.num_experts % a.ep:
        raise ArgumentError(f"--ep {a.ep} does not divide num_experts={cfg.num_experts} (each rank holds the same "
                            "number of experts)")
    if cfg.num_experts and a.tp > 1 and (cfg.seq_length // a.cp) % a.tp:
        raise ArgumentError(f"--tp {a.tp} must divide the tokens per rank ({cfg.seq_length // a.cp}) of a MoE model "
                            "(each TP rank routes its share of the tokens)")
    if a.sequence_parallel and (cfg.seq_length // a.cp) % a.tp:
        what = f"seq_length={cfg.seq_length}" if a.cp == 1 else f"the tokens per rank, seq_length / cp = " \
            f"{cfg.seq_length // a.cp}"
        raise ArgumentError(f"--sequence-parallel needs --tp {a.tp} to divide {what}")


def _validate_vision_layout(a, cfg: ModelConfig) -> None:
    """What a vision-language model needs of the layout: tp dividing the encoder's and projector's widths; no
    sequence or context parallelism (the image tokens are replicated over the tensor-parallel ranks)."""
    if a.sequence_parallel or a.cp > 1:
        flag = "--sequence-parallel" if a.sequence_parallel else f"--cp {a.cp}"
        raise ArgumentError(f"{flag} is not supported for --model vlm (the image tokens are not split over ranks)")
    v = cfg.vision_config()
    for name, value in (("vision_heads", v.num_heads), ("vision_hidden_size", v.hidden_size),
                        ("vision ffn_hidden_size", v.ffn_hidden_size),
                        ("projector_hidden_size", cfg.projector_hidden_size)):
        if value % a.tp:
            raise ArgumentError(f"--tp {a.tp} does not divide {name}={value} (the vision encoder and projector are "
                                "split over the tensor-parallel ranks)")
