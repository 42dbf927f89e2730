"""The training loop in one process: mixed precision follows the fp32 curve, fp16 starts at loss scale 2^16,
evaluation reports validation loss, and the loss falls on the embedded corpus (the tiny presets of the families
whose own tests compare them against transformers, too)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megakernels_models.arguments import TrainArgs

TINY = TrainArgs(
    preset=None,
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    seq_length=32,
    dropout=0.0,
    steps=8,
    micro_batch_size=4,
    global_batch_size=8,
    lr=3e-3,
    min_lr=3e-4,
    eval_interval=4,
    eval_steps=2,
    progress=False,
    corpus_bytes=1 << 18,
    seed=3,
)


def _train(**changes):
    from megakernels_models.training.train import train

    return train(dataclasses.replace(TINY, **changes))


def test_fp32_loss_falls_and_eval_runs(world1):
    recs = _train()
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.5
    assert [("val_loss" in r) for r in recs] == [False, False, False, True, False, False, False, True]
    assert recs[3]["val_ppl"] == pytest.approx(math.exp(recs[3]["val_loss"]))
    assert all(r["loss_scale"] == 1.0 for r in recs)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_follows_fp32(world1, precision):
    ref = _train(precision="fp32")
    recs = _train(precision=precision)
    for a, b in zip(recs, ref):
        assert abs(a["loss"] - b["loss"]) < 0.05 * b["loss"], (precision, a["loss"], b["loss"])
    if precision == "fp16":
        assert recs[0]["loss_scale"] == 2.0**16
    mem = recs[0]["memory_per_param_bytes"]
    assert mem == {"params": pytest.approx(2.0), "grads": pytest.approx(4.0), "optimizer": pytest.approx(12.0)}


def test_bert_trains(world1):
    recs = _train(model="bert", seq_length=64)
    assert recs[-1]["loss"] < recs[0]["loss"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_one_micro_batch_in_one_process_keeps_16_bit_grads_with_the_same_steps(world1, monkeypatch, precision):
    """Nothing is summed into the gradient buffers (one process, one micro-batch): they are 16-bit, and the run is
    the fp32 buffers' run bit for bit (losses, grad norms, loss scales)."""
    from megakernels_models.training import train as T

    one = dict(precision=precision, global_batch_size=4, steps=4, eval_interval=0)
    recs = _train(**one)
    assert recs[0]["memory_per_param_bytes"]["grads"] == pytest.approx(2.0)
    monkeypatch.setattr(T, "main_grad_dtype", lambda args, chunks: torch.float32)
    ref = _train(**one)
    assert ref[0]["memory_per_param_bytes"]["grads"] == pytest.approx(4.0)
    keys = ("loss", "grad_norm", "loss_scale")
    assert [[r[k] for k in keys] for r in recs] == [[r[k] for k in keys] for r in ref]


def test_the_gradient_buffers_are_fp32_wherever_something_is_summed_into_them(world1):
    from megakernels_models.training.train import main_grad_dtype

    one = dataclasses.replace(TINY, precision="bf16", global_batch_size=4)
    assert main_grad_dtype(one, 1) is None
    assert main_grad_dtype(dataclasses.replace(one, global_batch_size=8), 1) == torch.float32  # two micro-batches
    assert main_grad_dtype(one, 2) == torch.float32  # two model chunks (zb-v's V, interleaving)
    assert main_grad_dtype(dataclasses.replace(one, precision="fp32"), 1) == torch.float32
    assert main_grad_dtype(dataclasses.replace(one, offload_optimizer=True), 1) == torch.float32
    # and the planner counts what the trainer allocates
    from megakernels_models.planning.costs import Layout, bytes_per_param

    assert bytes_per_param(Layout(micro_batch_size=4, global_batch_size=4))[1] == 2
    assert bytes_per_param(Layout(micro_batch_size=4, global_batch_size=8))[1] == 4
    assert bytes_per_param(Layout(dp=2, micro_batch_size=4, global_batch_size=8))[1] == 4
    assert bytes_per_param(Layout(micro_batch_size=4, global_batch_size=4, precision="fp32"))[1] == 4


@pytest.mark.parametrize("preset", ["gemma-tiny", "gpt-oss-tiny"])
def test_a_familys_tiny_preset_trains_on_the_embedded_data(preset):
    from megakernels_models.training.train import run

    args = TrainArgs(
        preset=preset,
        steps=4,
        lr=3e-3,
        micro_batch_size=2,
        global_batch_size=2,
        eval_interval=0,
        progress=False,
        corpus_bytes=1 << 16,
    )
    losses = [r["loss"] for r in run(args)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
