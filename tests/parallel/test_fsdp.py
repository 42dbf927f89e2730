"""Sharded data parallelism by FSDP2 (megakernels/parallel/fsdp.py), one world of 4 gloo processes: the shard ranges
the optimizer and the checkpoints use are FSDP2's own shards; a parameter gathered by ``full`` and set back by
``assign_full`` round-trips; HSDP counts one replica; the order FSDP2 issues its collectives in (the next layer's
all-gather before this layer computes, each layer's reduce-scatter right after its backward: on GPU streams they
overlap the compute; on gloo FSDP2 issues them synchronously, so the order is what can be checked here); ZeRO-2
gathers each layer once per step, ZeRO-3 twice. The trained curves are in tests/models/test_layouts.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import megakernels.parallel as mp
from tests.parallel.checks import Checks

CHECKS = Checks()
LAYERS = 4


def _chunk(zero: int = 3, degree=None):
    from megakernels.parallel import fsdp
    from megakernels_models.models.registry import task_for
    from tests.models.test_layouts import BASE

    cfg = dataclasses.replace(BASE, model="gpt", num_layers=LAYERS).model_config()
    chunk = task_for(cfg).build_chunk(7, attention="torch")
    plain = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    return chunk, fsdp.shard_model(chunk, zero=zero, degree=degree), plain


@CHECKS.add("shards_are_contiguous_ranges_and_round_trip")
def _(rank, world):
    from megakernels.parallel import fsdp

    mp.initialize(1)
    chunk, _, plain = _chunk()
    for name, p in chunk.named_parameters():
        lo, hi = fsdp.local_range(p)
        assert torch.equal(fsdp.local(p).reshape(-1), plain[name].reshape(-1)[lo:hi]), name
        whole = fsdp.full(p)
        assert torch.equal(whole, plain[name]), name
        fsdp.assign_full(p, whole * 2)
        assert torch.equal(fsdp.full(p), plain[name] * 2), name
    # the shards of the four ranks tile each parameter exactly once
    sizes = torch.tensor([sum(hi - lo for lo, hi in [fsdp.local_range(p)]) for p in chunk.parameters()])
    dist.all_reduce(sizes)
    assert sizes.tolist() == [p.numel() for p in chunk.parameters()]


@CHECKS.add("hsdp_shards_over_two_and_counts_one_replica")
def _(rank, world):
    from megakernels.parallel import fsdp

    mp.initialize(1)
    chunk, _, plain = _chunk(degree=2)
    p = chunk.layers[0].attention.qkv.weight
    lo, hi = fsdp.local_range(p)
    assert hi - lo == -(-p.shape[0] // 2) * p.shape[1]  # half of it: sharded over 2, not 4
    assert torch.equal(fsdp.full(p), plain["layers.0.attention.qkv.weight"])
    primary = torch.tensor([float(fsdp.is_primary(p))])
    dist.all_reduce(primary)
    assert primary.item() == 2  # of the 4 ranks, one shard each of one replica


def _events(zero: int):
    chunk, _, _ = _chunk(zero=zero)
    events = []
    originals = {"all_gather": dist.all_gather_single, "reduce_scatter": dist.reduce_scatter_single}

    def recording(kind):
        def call(*args, **kwargs):
            events.append(("launch", kind))
            return originals[kind](*args, **kwargs)

        return call

    for i, layer in enumerate(chunk.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: events.append(("start", f"forward {i}")))
        layer.register_forward_hook(lambda m, a, o, i=i: events.append(("end", f"forward {i}")))
        layer.register_full_backward_pre_hook(lambda m, g, i=i: events.append(("start", f"backward {i}")))
        layer.register_full_backward_hook(lambda m, gi, go, i=i: events.append(("end", f"backward {i}")))
    dist.all_gather_single, dist.reduce_scatter_single = recording("all_gather"), recording("reduce_scatter")
    try:
        tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
        chunk(ids=tokens, labels=tokens).sum().backward()
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = originals["all_gather"], originals["reduce_scatter"]
    return events


@CHECKS.add("zero3_prefetches_the_next_layer_and_reduces_after_each_backward")
def _(rank, world):
    mp.initialize(1)
    events = _events(3)
    gathers = lambda upto: events[:upto].count(("launch", "all_gather"))  # noqa: E731
    for i in range(LAYERS):
        # before layer i computes: the root's, layers 0..i's and the next layer's all-gathers
        assert gathers(events.index(("start", f"forward {i}"))) >= min(i + 2, LAYERS) + 1, (i, events)
    for i in range(LAYERS - 1, 0, -1):
        start, end = events.index(("start", f"backward {i}")), events.index(("end", f"backward {i}"))
        assert ("launch", "all_gather") in events[start:end], (i, events)  # layer i-1's, prefetched
        after = events[end : events.index(("start", f"backward {i - 1}"))]
        assert ("launch", "reduce_scatter") in after, (i, events)  # layer i's gradient, right away
    assert events.count(("launch", "reduce_scatter")) == LAYERS + 1  # each layer's and the root's
    assert events.count(("launch", "all_gather")) > 2 * LAYERS  # forward and again backward


@CHECKS.add("zero2_gathers_each_layer_once")
def _(rank, world):
    mp.initialize(1)
    events = _events(2)
    assert events.count(("launch", "all_gather")) == LAYERS + 1
    assert events.count(("launch", "reduce_scatter")) == LAYERS + 1


@CHECKS.add("tensorwise_fp8_weights_are_gathered_in_fp8_with_the_16_bit_gathers_numbers")
def _(rank, world):
    """fsdp 4, bf16 compute, FP8 tensorwise linears: the FP8 all-gather gives the loss and every gradient shard of
    the 16-bit gather bit for bit (the same FP8 weights), and moves one byte a linear weight element instead of
    two."""
    from megakernels.parallel import fp8, fsdp
    from megakernels_models.models.registry import task_for
    from tests.models.test_layouts import BASE

    mp.initialize(1)
    cfg = dataclasses.replace(BASE, model="gpt", num_layers=LAYERS).model_config()
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = {}
    for gather in (True, False):
        chunk = task_for(cfg).build_chunk(7, attention="torch")
        linears = sum(m.weight.numel() for m in chunk.modules() if hasattr(m, "fp8") and m.weight.dim() == 2)
        assert fp8.enable(chunk, "tensorwise") > 0
        fsdp.shard_model(chunk, param_dtype=torch.bfloat16, fp8_gather=gather)
        sent = []
        original = dist.all_gather_single

        def counting(out, inp, *args, **kwargs):
            sent.append(inp.numel() * inp.element_size())
            return original(out, inp, *args, **kwargs)

        dist.all_gather_single = counting
        try:
            loss = chunk(ids=tokens, labels=tokens).float().sum()
            loss.backward()
        finally:
            dist.all_gather_single = original
        grads = [fsdp.local(p.grad).clone() for p in chunk.parameters()]
        runs[gather] = (loss.item(), grads, sum(sent))
    (loss8, grads8, bytes8), (loss16, grads16, bytes16) = runs[True], runs[False]
    assert loss8 == loss16
    assert all(torch.equal(a, b) for a, b in zip(grads8, grads16))
    # forward and backward gather every layer (ZeRO-3): the linears' shards at 1 byte instead of 2, padded to equal
    # shards over the 4 ranks
    saved = bytes16 - bytes8
    assert 2 * linears / world <= saved <= 2 * (linears / world + 4 * 128 * LAYERS * 8), (saved, linears)


def _world(rank, world_size):
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(4, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_fsdp(world, name):
    CHECKS.assert_passed(world, name)
