"""FP8 training in one process (``--precision fp8``, megakernels/parallel/fp8.py): the FP8 layers are exactly the
transformer blocks' linears and experts; the curve follows bf16's; a run resumes bit for bit (FP8 keeps no scaling
state: every scale comes from the current amax) and its checkpoint loads in bf16 and fp32; bad flags are named.
The layouts' agreement is in test_layouts.py (the *-fp8 models); 300-step curves in benchmarks/fp8_numerics.py."""

from __future__ import annotations

import dataclasses

import pytest

from megakernels_models.arguments import ArgumentError, TrainArgs, validate
from megakernels_models.cli import parse_train_args as parse_args

TINY = TrainArgs(
    preset=None,
    model="llama",
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=128,
    seq_length=32,
    dropout=0.1,
    steps=8,
    micro_batch_size=4,
    global_batch_size=8,
    lr=3e-3,
    min_lr=3e-4,
    eval_interval=0,
    progress=False,
    corpus_bytes=1 << 18,
    seed=3,
    precision="fp8",
)


def _losses(**changes):
    return _losses_of(dataclasses.replace(TINY, **changes))


def _losses_of(args: TrainArgs) -> list[float]:
    from megakernels_models.training.train import train

    return [r["loss"] for r in train(args)]


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_follows_bf16_and_resumes_bit_for_bit(world1, tmp_path, recipe):
    bf16 = _losses(precision="bf16")
    full = _losses(fp8_recipe=recipe)
    assert full[-1] < full[0] - 0.5
    for a, b in zip(full, bf16):
        assert abs(a - b) < 0.03 * b, (recipe, full, bf16)
    first = _losses(fp8_recipe=recipe, save=str(tmp_path), save_interval=4)
    assert first == full
    assert _losses(fp8_recipe=recipe, load=str(tmp_path / "step-00000004")) == full[4:]
    # the checkpoint is a plain one: it resumes in bf16 and in fp32 too, near the FP8 curve
    for precision in ("bf16", "fp32"):
        other = _losses(precision=precision, load=str(tmp_path / "step-00000004"))
        assert all(abs(a - b) < 0.03 * b for a, b in zip(other, full[4:])), (precision, other, full[4:])


def test_only_the_blocks_linears_and_experts_are_fp8(world1):
    import megakernels.parallel as mp
    from megakernels.parallel import fp8
    from megakernels_models.models.registry import task_for

    mp.initialize(1)
    try:
        for model, per_layer in (("gpt", 4), ("llama", 5), ("gpt", 3)):
            extra = dict(num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32) if per_layer == 3 else {}
            if model == "gpt":
                extra.update(num_kv_heads=None, ffn_hidden_size=None)
            cfg = dataclasses.replace(TINY, model=model, **extra).model_config()
            chunk = task_for(cfg).build_chunk(0, attention="torch")
            # attention qkv (llama: q and kv) and proj, and the MLP's fc1 and fc2 or the experts' one module
            assert fp8.enable(chunk, "tensorwise") == per_layer * cfg.num_layers, model
            fp8_names = [n for n, m in chunk.named_modules() if getattr(m, "fp8", None) is not None]
            assert all(".layers." in f".{n}" or n.startswith("layers.") for n in fp8_names), fp8_names
            with fp8.disabled(chunk):
                assert all(getattr(m, "fp8", None) is None for m in chunk.modules())
            assert sum(getattr(m, "fp8", None) is not None for m in chunk.modules()) == per_layer * cfg.num_layers
    finally:
        mp.destroy()


def test_flags():
    args = parse_args(["--precision", "fp8", "--fp8-recipe", "blockwise", "--fp8-base-precision", "fp32"])
    assert (args.precision, args.fp8_recipe, args.fp8_base_precision) == ("fp8", "blockwise", "fp32")
    assert str(args.param_dtype()) == "torch.float32" and args.base_precision() == "fp32"
    assert str(parse_args(["--precision", "fp8"]).param_dtype()) == "torch.bfloat16"
    with pytest.raises(ArgumentError, match="--fp8-recipe must be one of tensorwise, blockwise"):
        validate(dataclasses.replace(TINY, fp8_recipe="delayed"))
    with pytest.raises(ArgumentError, match="--fp8-base-precision must be one of bf16, fp32"):
        validate(dataclasses.replace(TINY, fp8_base_precision="fp16"))


# gpt-tiny's widths (4 layers of 256, 8 heads, ffn 1024) at a short sequence; fp32 outside the FP8 GEMMs, so what
# differs between layouts is FP8's own rounding and the order of fp32 sums, nothing of bf16's.
GPT_TINY_FP8 = TrainArgs(
    preset="gpt-tiny",
    seq_length=64,
    micro_batch_size=2,
    global_batch_size=4,
    steps=3,
    eval_interval=0,
    progress=False,
    corpus_bytes=1 << 20,
    precision="fp8",
    fp8_base_precision="fp32",
)


def _tp2_world(rank: int, world_size: int, args: TrainArgs):
    from megakernels_models.training.train import train

    curves = [train(dataclasses.replace(args, tp=2, nproc=2, sequence_parallel=sp)) for sp in (False, True)]
    return [[r["loss"] for r in c] for c in curves] if rank == world_size - 1 else None


def test_fp8_at_tp_2_follows_one_process(world1):
    """Tensorwise FP8 at --tp 2, with and without sequence parallelism, against one process: every scale is the
    whole tensor's (tests/parallel/test_overlap.py checks each), so the first step's loss is the single process's
    up to the order of fp32 sums; after the updates the runs part only by what an fp32 ulp moved across an FP8
    rounding boundary (docs/parallelism.md: a one-ulp perturbation of one process parts from it as much)."""
    from tests.parallel.harness import run_world

    one = _losses_of(GPT_TINY_FP8)
    for sp, got in zip((False, True), run_world(2, _tp2_world, GPT_TINY_FP8, timeout=600)[-1]):
        rel = [abs(a - b) / b for a, b in zip(got, one)]
        assert len(got) == len(one) == 3 and rel[0] <= 1e-6 and max(rel) <= 2e-4, (sp, got, one, rel)
