"""Column/row-parallel linear and vocab-parallel embedding against the unsharded plain-PyTorch
layer with the same seed (outputs, input and parameter gradients, fp32 vs an fp64 reference, <= 1e-5 relative),
for tp 1, 2, 4 with sequence parallelism off and on; plus layout-independent initialisation and vocab padding.
One world of 4 gloo processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import megakernels.parallel as mp
from megakernels.parallel import init
from tests.parallel.checks import Checks, assert_close, block, randn

CHECKS = Checks()
S, B = 8, 2
TPS = (1, 2, 4)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _gather(shard: torch.Tensor, dim: int) -> torch.Tensor:
    """The full tensor from the TP ranks' shards (for checking layouts, not used by the layers)."""
    parts = [torch.empty_like(shard) for _ in range(mp.tp_size())]
    dist.all_gather(parts, shard.detach().contiguous(), group=mp.tp_group())
    return torch.cat(parts, dim)


@CHECKS.add("column_parallel_linear_matches_nn_linear")
def _(rank, world):
    for tp in TPS:
        for sp, gather in ((False, False), (False, True), (True, False)):
            what = f"tp{tp} sp={sp} gather_output={gather}"
            mp.initialize(tp)
            r = mp.tp_rank()
            torch.manual_seed(11)
            layer = mp.ColumnParallelLinear(16, 24, gather_output=gather, sequence_parallel=sp)
            w, b = init.full_weight((24, 16), layer.seed, init.init_method_normal()), randn(24, seed=5)
            with torch.no_grad():
                layer.bias.copy_(block(b, 0, r, tp))
            x, dy = randn(S, B, 16, seed=6), randn(S, B, 24, seed=7)
            xin = _leaf(block(x, 0, r, tp) if sp else x)
            y = layer(xin)
            y.backward(dy if gather else block(dy, -1, r, tp))

            xr, wr, br = _leaf(x.double()), _leaf(w.double()), _leaf(b.double())
            yr = F.linear(xr, wr, br)
            yr.backward(dy.double())
            assert_close(y, yr if gather else block(yr, -1, r, tp), f"{what}: output")
            assert_close(xin.grad, block(xr.grad, 0, r, tp) if sp else xr.grad, f"{what}: input grad")
            assert_close(layer.weight.grad, block(wr.grad, 0, r, tp), f"{what}: weight grad")
            assert_close(layer.bias.grad, block(br.grad, 0, r, tp), f"{what}: bias grad")
            mp.destroy()


@CHECKS.add("row_parallel_linear_matches_nn_linear")
def _(rank, world):
    for tp in TPS:
        for sp, parallel_in in ((False, True), (False, False), (True, True)):
            what = f"tp{tp} sp={sp} input_is_parallel={parallel_in}"
            mp.initialize(tp)
            r = mp.tp_rank()
            torch.manual_seed(12)
            layer = mp.RowParallelLinear(24, 16, input_is_parallel=parallel_in, sequence_parallel=sp)
            w, b = init.full_weight((16, 24), layer.seed, init.init_method_normal()), randn(16, seed=8)
            with torch.no_grad():
                layer.bias.copy_(b)
            x, dy = randn(S, B, 24, seed=9), randn(S, B, 16, seed=10)
            xin = _leaf(block(x, -1, r, tp) if parallel_in else x)
            y = layer(xin)
            y.backward(block(dy, 0, r, tp) if sp else dy)
            mp.allreduce_sequence_parallel_grads(layer)

            xr, wr, br = _leaf(x.double()), _leaf(w.double()), _leaf(b.double())
            yr = F.linear(xr, wr, br)
            yr.backward(dy.double())
            assert_close(y, block(yr, 0, r, tp) if sp else yr, f"{what}: output")
            assert_close(xin.grad, block(xr.grad, -1, r, tp) if parallel_in else xr.grad, f"{what}: input grad")
            assert_close(layer.weight.grad, block(wr.grad, 1, r, tp), f"{what}: weight grad")
            assert_close(layer.bias.grad, br.grad, f"{what}: bias grad")
            assert mp.is_sequence_parallel(layer.bias) == sp
            mp.destroy()


V, H = 300, 16  # V pads to 384 (tp 1), 512 (tp 2: 256-multiples), 512 (tp 4)


def _ids(seed: int) -> torch.Tensor:
    ids = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(seed))
    ids[0, 0], ids[1, 0] = 0, V - 1  # both ends of the real vocabulary
    return ids


@CHECKS.add("vocab_parallel_embedding_matches_nn_embedding")
def _(rank, world):
    for tp in TPS:
        for sp in (False, True):
            what = f"tp{tp} sp={sp}"
            mp.initialize(tp)
            r = mp.tp_rank()
            torch.manual_seed(13)
            emb = mp.VocabParallelEmbedding(V, H, sequence_parallel=sp)
            vpad = {1: 384, 2: 512, 4: 512}[tp]
            assert emb.padded_num_embeddings == vpad and emb.weight.shape == (vpad // tp, H)
            w = init.full_weight((V, H), emb.seed, init.init_method_normal())
            ids, dy = _ids(14), randn(S, B, H, seed=15)
            y = emb(ids)
            y.backward(block(dy, 0, r, tp) if sp else dy)

            wr = _leaf(w.double())
            yr = F.embedding(ids, wr)
            yr.backward(dy.double())
            assert_close(y, block(yr, 0, r, tp) if sp else yr, f"{what}: output")
            grad_padded = torch.cat([wr.grad, torch.zeros(vpad - V, H, dtype=torch.float64)])
            assert_close(emb.weight.grad, block(grad_padded, 0, r, tp), f"{what}: weight grad")
            assert torch.equal(_gather(emb.weight, 0)[V:], torch.zeros(vpad - V, H)), f"{what}: padded rows"
            mp.destroy()


@CHECKS.add("initial_weights_depend_on_the_seed_not_the_layout")
def _(rank, world):
    full = {}
    for tp in TPS:
        mp.initialize(tp)
        torch.manual_seed(21)
        col, row = mp.ColumnParallelLinear(16, 520), mp.RowParallelLinear(520, 12)
        emb = mp.VocabParallelEmbedding(V, H)
        full[tp] = (_gather(col.weight, 0), _gather(row.weight, 1), _gather(emb.weight, 0)[:V])
        mp.destroy()
    for tp in TPS[1:]:
        for a, b, name in zip(full[tp], full[1], ("column", "row", "embedding")):
            assert torch.equal(a, b), f"{name} weight at tp{tp} differs from tp1"
    w = full[1][0]
    assert abs(w.mean().item()) < 2e-3 and abs(w.std().item() - 0.02) < 1e-3  # N(0, 0.02²)
    assert not torch.equal(full[1][0][:8], full[1][0][128:136])  # row blocks draw different streams


@CHECKS.add("real_embedding_rows_do_not_depend_on_padding")
def _(rank, world):
    mp.initialize(2)
    tables = []
    for multiple in (1, 8, 128):
        torch.manual_seed(22)
        emb = mp.VocabParallelEmbedding(V, H, pad_multiple=multiple)
        tables.append(_gather(emb.weight, 0))
    assert [t.shape[0] for t in tables] == [300, 304, 512]
    assert torch.equal(tables[0], tables[1][:V]) and torch.equal(tables[0], tables[2][:V])


@CHECKS.add("meta_device_layers_materialise_to_the_same_weights")
def _(rank, world):
    mp.initialize(4)
    torch.manual_seed(23)
    eager = mp.ColumnParallelLinear(16, 24), mp.RowParallelLinear(24, 16), mp.VocabParallelEmbedding(V, H)
    torch.manual_seed(23)
    lazy = (
        mp.ColumnParallelLinear(16, 24, device="meta"),
        mp.RowParallelLinear(24, 16, device="meta"),
        mp.VocabParallelEmbedding(V, H, device="meta"),
    )
    for e, m in zip(eager, lazy):
        assert m.weight.is_meta
        m.to_empty(device="cpu")
        m.reset_parameters()
        for (name, pe), pm in zip(e.named_parameters(), m.parameters()):
            assert torch.equal(pe, pm), f"{type(e).__name__}.{name}"


@CHECKS.add("init_shard_generates_only_its_block_of_the_full_weight")
def _(rank, world):
    full = init.full_weight((300, 40), seed=5, init_method=init.init_method_normal(), real_rows=260)
    assert torch.equal(full[260:], torch.zeros(40, 40))
    for world_, dim in ((4, 0), (5, 0), (4, 1), (8, 1)):
        shape = (300 // world_, 40) if dim == 0 else (300, 40 // world_)
        parts = [
            init.init_shard_(
                torch.empty(shape, dtype=torch.float64),
                (300, 40),
                dim,
                i,
                world_,
                5,
                init.init_method_normal(),
                real_rows=260,
            )
            for i in range(world_)
        ]
        assert torch.equal(torch.cat(parts, dim).float(), full), f"world {world_} dim {dim}"
    with pytest.raises(ValueError, match=r"shard has shape \(10, 40\), expected \(75, 40\)"):
        init.init_shard_(torch.empty(10, 40), (300, 40), 0, 0, 4, 5, init.init_method_normal())


@CHECKS.add("layer_input_errors_name_the_argument")
def _(rank, world):
    mp.initialize(2)
    col = mp.ColumnParallelLinear(16, 24, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: x has shape \(4, 2, 15\), expected last dimension 16"):
        col(torch.zeros(4, 2, 15))
    with pytest.raises(ValueError, match=r"sequence parallelism x must be \[s/tp, b, h\]"):
        col(torch.zeros(4, 16))
    with pytest.raises(ValueError, match="gather_output=True cannot be combined with sequence_parallel=True"):
        mp.ColumnParallelLinear(16, 24, gather_output=True, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel=True needs input_is_parallel=True"):
        mp.RowParallelLinear(24, 16, input_is_parallel=False, sequence_parallel=True)
    with pytest.raises(ValueError, match="in_features must be a positive int, got 0"):
        mp.ColumnParallelLinear(0, 24)
    row = mp.RowParallelLinear(24, 16)
    with pytest.raises(ValueError, match=r"RowParallelLinear: x has shape \(4, 24\), expected last dimension 12"):
        row(torch.zeros(4, 24))
    emb = mp.VocabParallelEmbedding(V, H, sequence_parallel=True)
    with pytest.raises(TypeError, match="ids must be an integer tensor, got torch.float32"):
        emb(torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"ids must be \[s, b\] with s divisible by the tensor-parallel size 2"):
        emb(torch.zeros(3, 2, dtype=torch.long))


def _world(rank, world_size):
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(4, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_layer(world, name):
    CHECKS.assert_passed(world, name)


def test_vocab_padding_to_a_multiple_of_128_tp():
    assert mp.pad_vocab_size(50257, 8) == 51200  # GPT-2 at tp 8, as Megatron-LM
    assert mp.pad_vocab_size(50257, 1) == 50304
    assert mp.pad_vocab_size(256, 2) == 256 and mp.pad_vocab_size(257, 2) == 512
    with pytest.raises(ValueError, match="pad_vocab_size: tp must be a positive int, got 0"):
        mp.pad_vocab_size(50257, 0)
