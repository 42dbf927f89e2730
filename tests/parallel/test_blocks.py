"""ParallelMLP and ParallelSelfAttention against the unsharded blocks written in plain PyTorch (fp64) with the same
seed, for tp 1, 2, 4 with sequence parallelism off and on (attention with and without learnable sinks, split by
heads), and the number of collectives each pass issues. One world of 4 gloo processes."""

from __future__ import annotations

import collections
import math

import pytest
import torch
import torch.nn.functional as F

import megakernels.parallel as mp
from megakernels.parallel import init
from tests.parallel.checks import Checks, assert_close, block, randn

CHECKS = Checks()
S, B, H, FFN, HEADS = 8, 2, 16, 32, 4
TPS = (1, 2, 4)
NORMAL = init.init_method_normal()


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _mlp_reference(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def _attention_reference(x, wqkv, bqkv, wo, bo, causal, sinks=None):
    """Multi-head attention with QKV rows ordered (head, {q, k, v}, head_dim), written out: scores, mask, softmax
    (with ``sinks`` ``[n]``: over one more column of scores per head, ``sinks[head]``, of value zero)."""
    s, b, h = x.shape
    d = h // HEADS
    q, k, v = F.linear(x, wqkv, bqkv).view(s, b, HEADS, 3, d).permute(3, 1, 2, 0, 4)  # each [b, n, s, d]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks[None, :, None, None].expand(b, HEADS, s, 1)), -1)
    ctx = (scores.softmax(-1)[..., :s] @ v).permute(2, 0, 1, 3).reshape(s, b, h)
    return F.linear(ctx, wo, bo)


def _set_biases(column, row, seed):
    """Random biases (zeros at init would not test their gradients); returns the full ones."""
    bc, br = randn(column.out_features, seed=seed), randn(row.out_features, seed=seed + 1)
    with torch.no_grad():
        column.bias.copy_(block(bc, 0, mp.tp_rank(), mp.tp_size()))
        row.bias.copy_(br)
    return bc, br


def _compare_block(module, column, row, reference, what, sp, seed, sinks=None):
    """Run module and reference forward+backward on the same x, dy; compare output, input and parameter grads (with
    ``sinks``, the full sinks the module's rows were set from: they are the reference's last input)."""
    tp, r = mp.tp_size(), mp.tp_rank()
    wc = init.full_weight((column.out_features, column.in_features), column.seed, NORMAL)
    wr = init.full_weight((row.out_features, row.in_features), row.seed, NORMAL)
    bc, br = _set_biases(column, row, seed)
    x, dy = randn(S, B, H, seed=seed + 2), randn(S, B, H, seed=seed + 3)
    xin = _leaf(block(x, 0, r, tp) if sp else x)
    y = module(xin)
    y.backward(block(dy, 0, r, tp) if sp else dy)
    mp.allreduce_sequence_parallel_grads(module)

    ref = [_leaf(t.double()) for t in (x, wc, bc, wr, br) + (() if sinks is None else (sinks,))]
    yr = reference(*ref)
    yr.backward(dy.double())
    xr, wcr, bcr, wrr, brr = ref[:5]
    if sinks is not None:
        assert_close(module.sinks.grad, block(ref[5].grad, 0, r, tp), f"{what}: sinks grad")
    assert_close(y, block(yr, 0, r, tp) if sp else yr, f"{what}: output")
    assert_close(xin.grad, block(xr.grad, 0, r, tp) if sp else xr.grad, f"{what}: input grad")
    assert_close(column.weight.grad, block(wcr.grad, 0, r, tp), f"{what}: column weight grad")
    assert_close(column.bias.grad, block(bcr.grad, 0, r, tp), f"{what}: column bias grad")
    assert_close(row.weight.grad, block(wrr.grad, 1, r, tp), f"{what}: row weight grad")
    assert_close(row.bias.grad, brr.grad, f"{what}: row bias grad")


@CHECKS.add("parallel_mlp_matches_the_unsharded_mlp")
def _(rank, world):
    for tp in TPS:
        for sp in (False, True):
            mp.initialize(tp)
            torch.manual_seed(31)
            mlp = mp.ParallelMLP(H, FFN, sequence_parallel=sp)
            _compare_block(mlp, mlp.fc1, mlp.fc2, _mlp_reference, f"mlp tp{tp} sp={sp}", sp, 40)
            mp.destroy()


@CHECKS.add("parallel_self_attention_matches_the_unsharded_attention")
def _(rank, world):
    for tp in TPS:
        for sp in (False, True):
            for causal in (True, False):
                mp.initialize(tp)
                torch.manual_seed(32)
                attn = mp.ParallelSelfAttention(H, HEADS, causal=causal, sequence_parallel=sp)
                _compare_block(
                    attn,
                    attn.qkv,
                    attn.proj,
                    lambda x, *w: _attention_reference(x, *w, causal=causal),
                    f"attention tp{tp} sp={sp} causal={causal}",
                    sp,
                    50,
                )
                mp.destroy()


def _collectives(module, x):
    """{'forward': Counter(kind), 'backward': Counter(kind)} of the collectives one pass launches."""
    with mp.record_events() as fwd:
        y = module(x)
    with mp.record_events() as bwd:
        y.sum().backward()
    return {
        name: collections.Counter(d for e, d in ev if e == "launch")
        for name, ev in (("forward", fwd), ("backward", bwd))
    }


@CHECKS.add("each_block_costs_one_all_reduce_forward_and_one_backward")
def _(rank, world):
    mp.initialize(2)
    for module in (mp.ParallelMLP(H, FFN), mp.ParallelSelfAttention(H, HEADS)):
        counts = _collectives(module, _leaf(randn(S, B, H, seed=60)))
        assert counts == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}, counts


@CHECKS.add("sequence_parallel_blocks_all_gather_and_reduce_scatter_instead")
def _(rank, world):
    mp.initialize(4)
    for module in (
        mp.ParallelMLP(H, FFN, sequence_parallel=True),
        mp.ParallelSelfAttention(H, HEADS, sequence_parallel=True),
    ):
        counts = _collectives(module, _leaf(randn(S // 4, B, H, seed=61)))
        # backward: the output's all-gather, the input gradient's reduce-scatter, and the re-gather of the column
        # layer's input (not saved by forward) for its weight gradient
        assert counts == {
            "forward": {"all_gather": 1, "reduce_scatter": 1},
            "backward": {"all_gather": 2, "reduce_scatter": 1},
        }, counts


@CHECKS.add("attention_core_is_pluggable_with_layout_b_s_h_d")
def _(rank, world):
    from megakernels.nn import TorchSelfAttention

    mp.initialize(2)
    calls = []

    class Core(TorchSelfAttention):
        def forward(self, q, k, v, mask=None):
            calls.append((tuple(q.shape), tuple(k.shape), tuple(v.shape), self.causal, mask))
            return super().forward(q, k, v, mask=mask)

    torch.manual_seed(33)
    by_name = mp.ParallelSelfAttention(H, HEADS, core="torch")
    torch.manual_seed(33)
    plugged = mp.ParallelSelfAttention(H, HEADS, core=Core(causal=True))
    x = randn(S, B, H, seed=62)
    assert torch.equal(by_name(x), plugged(x))
    assert calls == [((B, S, HEADS // 2, H // HEADS),) * 3 + (True, None)]


@CHECKS.add("both_library_cores_match_the_unsharded_attention")
def _(rank, world):
    for core in ("flash", "torch"):
        for tp in TPS:
            for sp in (False, True):
                mp.initialize(tp)
                torch.manual_seed(35)
                attn = mp.ParallelSelfAttention(H, HEADS, sequence_parallel=sp, core=core)
                _compare_block(
                    attn,
                    attn.qkv,
                    attn.proj,
                    lambda x, *w: _attention_reference(x, *w, causal=True),
                    f"{core} attention tp{tp} sp={sp}",
                    sp,
                    70,
                )
                mp.destroy()


@CHECKS.add("attention_sinks_are_split_by_heads_and_match_the_unsharded_attention")
def _(rank, world):
    sinks = torch.tensor([-2.0, 0.5, 1.5, 3.0])
    for core in ("flash", "torch"):
        for tp in TPS:
            for sp in (False, True):
                mp.initialize(tp)
                torch.manual_seed(36)
                attn = mp.ParallelSelfAttention(H, HEADS, sequence_parallel=sp, core=core, sinks=True)
                assert attn.sinks.shape == (HEADS // tp,) and attn.sinks.dtype == torch.float32
                assert not attn.sinks.any()  # zero at the start
                with torch.no_grad():
                    attn.sinks.copy_(block(sinks, 0, mp.tp_rank(), tp))
                _compare_block(
                    attn,
                    attn.qkv,
                    attn.proj,
                    lambda x, *w: _attention_reference(x, *w[:4], causal=True, sinks=w[4]),
                    f"{core} attention with sinks tp{tp} sp={sp}",
                    sp,
                    80,
                    sinks=sinks,
                )
                mp.destroy()


@CHECKS.add("attention_dropout_uses_the_tensor_parallel_stream")
def _(rank, world):
    mp.initialize(2)
    torch.manual_seed(34)
    attn = mp.ParallelSelfAttention(H, HEADS, attention_dropout=0.5)
    x = randn(S, B, H, seed=63)
    with pytest.raises(KeyError, match="model_parallel_seed"):
        attn(x)
    outs = []
    for _ in range(2):
        mp.model_parallel_seed(7)
        outs.append(attn(x))
        after = torch.rand(4)  # the default stream did not move for the attention dropout
        torch.manual_seed(7)
        assert torch.equal(after, torch.rand(4))
    assert torch.equal(outs[0], outs[1])
    attn.eval()
    assert_close(
        attn(x),
        _attention_reference(
            x.double(),
            init.full_weight((3 * H, H), attn.qkv.seed, NORMAL).double(),
            torch.zeros(3 * H, dtype=torch.float64),
            init.full_weight((H, H), attn.proj.seed, NORMAL).double(),
            torch.zeros(H, dtype=torch.float64),
            causal=True,
        ),
        "eval: no dropout",
    )
    assert not torch.allclose(outs[0], attn(x))


@CHECKS.add("block_configuration_errors")
def _(rank, world):
    mp.initialize(4)
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by the tensor-parallel size 4"):
        mp.ParallelSelfAttention(24, 6)
    with pytest.raises(ValueError, match="hidden_size=18 is not divisible by num_heads=4"):
        mp.ParallelSelfAttention(18, 4)
    with pytest.raises(ValueError, match=r"attention_dropout must be in \[0, 1\), got 1.0"):
        mp.ParallelSelfAttention(H, HEADS, attention_dropout=1.0)
    with pytest.raises(ValueError, match=r"x must be \[s, b, h\] \(sequence first\)"):
        mp.ParallelSelfAttention(H, HEADS)(torch.zeros(S, H))
    with pytest.raises(ValueError, match="approximate must be 'tanh' or 'none'"):
        mp.ParallelMLP(H, FFN, approximate="sigmoid")
    from megakernels.nn import TorchSelfAttention

    with pytest.raises(ValueError, match="attention sinks need a core given by name"):
        mp.ParallelSelfAttention(H, HEADS, core=TorchSelfAttention(causal=True), sinks=True)


def _world(rank, world_size):
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(4, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_block(world, name):
    CHECKS.assert_passed(world, name)
