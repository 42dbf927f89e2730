"""Layout-independent initialisation of strided and replicated shards: each rank's shard is exactly its pieces of
the seed-defined full weight."""

from __future__ import annotations

import pytest
import torch

from megakernels.parallel import init

NORMAL = init.init_method_normal()


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("world,stride,replicas", [(4, 1, 1), (4, 2, 1), (4, 2, 2), (4, 1, 4), (2, 3, 1)])
def test_a_shard_is_its_pieces_of_the_full_weight(dim, world, stride, replicas):
    full_shape = (288, 24) if dim == 0 else (20, 288)
    full = init.full_weight(full_shape, 99, NORMAL)
    n = full_shape[dim] * replicas // world
    for rank in range(world):
        shard = torch.empty((n, full_shape[1]) if dim == 0 else (full_shape[0], n))
        init.init_shard_(shard, full_shape, dim, rank, world, 99, NORMAL, stride=stride, replicas=replicas)
        seg, blk = full_shape[dim] // stride, n // stride
        i = rank // replicas
        expected = torch.cat([full.narrow(dim, j * seg + i * blk, blk) for j in range(stride)], dim)
        torch.testing.assert_close(shard, expected, rtol=0, atol=0)


def test_pieces_and_bad_shapes():
    assert init.shard_pieces(8, 1, 2, stride=2) == [(2, 0, 2), (6, 2, 2)]
    assert init.shard_pieces(8, 3, 4, replicas=2) == [(4, 0, 4)]
    with pytest.raises(ValueError, match="does not split"):
        init.shard_pieces(6, 0, 4)
    with pytest.raises(ValueError, match="expected"):
        init.init_shard_(torch.empty(3, 4), (8, 4), 0, 0, 2, 1, NORMAL, stride=2)
