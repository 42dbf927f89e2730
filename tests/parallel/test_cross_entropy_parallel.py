"""megakernels.ops.cross_entropy with ``group``: each rank holds a vocab shard, and the per-token loss and the
logits' gradient equal F.cross_entropy of the full (unsharded) logits, with label smoothing, ignore_index and
padding columns; over 2 and 4 gloo ranks (sub-groups of one world of 4), on the CPU path and on the Triton kernels
under the interpreter. Also: exactly two all-reduces forward (MAX, then SUM) and none backward.

linear_cross_entropy (the LM head fused with it) with ``group``: each rank holds a vocab shard of the weight; the
loss and the gradients of the hidden states (summed over the group: all-reduced, or reduce-scattered to each
rank's sequence shard under sequence parallelism) and of the weight shard and bias equal F.linear +
F.cross_entropy of the full weight in fp64; the same two all-reduces forward and one collective (dX's) backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megakernels
from megakernels.ops import cross_entropy, linear_cross_entropy
from megakernels.ops.cross_entropy import cross_entropy_reference
from megakernels.ops.linear_cross_entropy import linear_cross_entropy_reference
from tests.parallel.checks import Checks, assert_close, block

CHECKS = Checks()
N, V_REAL, V_PADDED = 24, 250, 256  # 256 columns sharded over the group, the last 6 are padding


def _full(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V_PADDED, generator=g) * 3
    x[:, V_REAL:] = 40.0  # padding that would dominate the softmax were it not excluded
    t = torch.randint(0, V_REAL, (N,), generator=g)
    t[0], t[1], t[5] = V_REAL - 1, 0, -100
    return x, t


def _group_of(size: int, rank: int):
    """Groups of ``size`` consecutive ranks (created on every rank, in the same order); this rank's group."""
    mine = None
    for start in range(0, dist.get_world_size(), size):
        g = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = g
    return mine


def _check_group(rank, size, backend, dtype, smoothing):
    group = _group_of(size, rank)
    r = dist.get_rank(group)
    x, t = _full(size)
    x = x.to(dtype)
    shard = block(x, 1, r, size).clone().requires_grad_(True)
    dloss = torch.randn(N, generator=torch.Generator().manual_seed(3))
    with megakernels.backend(backend):
        loss = cross_entropy(shard, t, label_smoothing=smoothing, group=group, vocab_size=V_REAL)
    loss.backward(dloss)
    xr = x.double().requires_grad_(True)
    ref = cross_entropy_reference(xr, t, label_smoothing=smoothing, vocab_size=V_REAL)
    ref.backward(dloss.double())
    what = f"group {size} {backend} {dtype} eps={smoothing}"
    assert_close(loss, ref, f"{what}: loss", rtol=1e-5)
    assert loss[5].item() == 0.0
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert_close(shard.grad, block(xr.grad, 1, r, size), f"{what}: grad", rtol=tol)


for _size in (2, 4):
    for _backend in ("cpu", "cuda_emu"):
        for _dtype, _eps in ((torch.float32, 0.0), (torch.float32, 0.1), (torch.bfloat16, 0.1)):
            CHECKS.add(f"group{_size}_{_backend}_{str(_dtype)[6:]}_eps{_eps}", _size, _backend, _dtype, _eps)(
                lambda rank, world, size, backend, dtype, eps: _check_group(rank, size, backend, dtype, eps)
            )


@CHECKS.add("two_all_reduces_forward_none_backward")
def _(rank, world):
    calls = []
    real = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(op)
        return real(tensor, op=op, group=group, async_op=async_op)

    x, t = _full(7)
    shard = block(x, 1, rank, world).clone().requires_grad_(True)
    dist.all_reduce = counting
    try:
        loss = cross_entropy(shard, t, group=dist.group.WORLD, vocab_size=V_REAL)
        assert calls == [dist.ReduceOp.MAX, dist.ReduceOp.SUM], calls
        loss.sum().backward()
        assert len(calls) == 2
    finally:
        dist.all_reduce = real


S, B, H = 8, 3, 8  # 24 tokens as [s, b]; the weight [V_PADDED, H] sharded by rows


def _check_linear(rank, size, backend, dtype, smoothing, sp, chunk):
    group = _group_of(size, rank)
    r = dist.get_rank(group)
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(S, B, H, generator=g).to(dtype)
    weight = (torch.randn(V_PADDED, H, generator=g) * 0.7).to(dtype)
    bias = torch.randn(V_PADDED, generator=g).to(dtype)
    with torch.no_grad():
        bias[V_REAL:] = 40.0  # padding that would dominate the softmax were it not excluded
    _, t = _full(size)
    t = t.view(S, B)
    hin = (block(hidden, 0, r, size) if sp else hidden).clone().requires_grad_(True)
    w = block(weight, 0, r, size).clone().requires_grad_(True)
    b = block(bias, 0, r, size).clone().requires_grad_(True)
    dloss = torch.randn(S, B, generator=torch.Generator().manual_seed(3))
    with megakernels.backend(backend):
        loss = linear_cross_entropy(
            hin, w, t, bias=b, label_smoothing=smoothing, group=group, vocab_size=V_REAL, chunk_tokens=chunk,
            sequence_parallel=sp,
        )  # fmt: skip
    loss.backward(dloss)
    hr, wr, br = (a.double().requires_grad_(True) for a in (hidden, weight, bias))
    ref = linear_cross_entropy_reference(hr, wr, t, label_smoothing=smoothing, vocab_size=V_REAL, bias=br)
    ref.backward(dloss.double())
    what = f"linear group {size} {backend} {dtype} eps={smoothing} sp={sp} chunk={chunk}"
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert loss.shape == (S, B)
    assert_close(loss, ref, f"{what}: loss", rtol=tol)
    assert_close(hin.grad, block(hr.grad, 0, r, size) if sp else hr.grad, f"{what}: hidden grad", rtol=tol)
    assert_close(w.grad, block(wr.grad, 0, r, size), f"{what}: weight grad", rtol=tol)
    assert_close(b.grad, block(br.grad, 0, r, size), f"{what}: bias grad", rtol=tol)


for _name, _args in {
    "linear_group2_cpu_fp32": (2, "cpu", torch.float32, 0.1, False, 5),
    "linear_group2_cpu_fp32_sp": (2, "cpu", torch.float32, 0.0, True, 7),
    "linear_group4_cpu_fp32_sp": (4, "cpu", torch.float32, 0.1, True, None),
    "linear_group2_cpu_bf16": (2, "cpu", torch.bfloat16, 0.1, False, 9),
    "linear_group2_cuda_emu_fp32_sp": (2, "cuda_emu", torch.float32, 0.1, True, 10),
}.items():
    CHECKS.add(_name, *_args)(
        lambda rank, world, size, backend, dtype, eps, sp, chunk: _check_linear(
            rank, size, backend, dtype, eps, sp, chunk
        )
    )


@CHECKS.add("linear_two_all_reduces_forward_one_backward")
def _(rank, world):
    calls = []
    real = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(op)
        return real(tensor, op=op, group=group, async_op=async_op)

    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(N, H, generator=g).requires_grad_(True)
    w = block(torch.randn(V_PADDED, H, generator=g), 0, rank, world).clone().requires_grad_(True)
    _, t = _full(7)
    dist.all_reduce = counting
    try:
        loss = linear_cross_entropy(hidden, w, t, group=dist.group.WORLD, vocab_size=V_REAL, chunk_tokens=5)
        assert calls == [dist.ReduceOp.MAX, dist.ReduceOp.SUM], calls  # once for all 5 chunks
        loss.sum().backward()
        assert calls[2:] == [dist.ReduceOp.SUM], calls  # dX, summed over the vocab shards
    finally:
        dist.all_reduce = real


def _world(rank, world_size):
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(4, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_vocab_parallel_cross_entropy(world, name):
    CHECKS.assert_passed(world, name)
