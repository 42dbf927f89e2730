"""The parameter-marks contract (megakernels.parallel.params): who is marked how, and what each mark means to the
optimizer's norm and to checkpoints."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megakernels.parallel import params


def test_an_unmarked_parameter_is_replicated_and_counted_on_tp_rank_0_only():
    p = nn.Parameter(torch.zeros(3))
    assert not params.is_tensor_parallel(p) and not params.is_sequence_parallel(p)
    assert params.counts_in_grad_norm(p, 0) and not params.counts_in_grad_norm(p, 1)


def test_a_tensor_parallel_parameter_counts_on_every_tp_rank():
    p = nn.Parameter(torch.zeros(4, 2))
    params.mark_tensor_parallel(p, dim=1, stride=2)
    rec = params.info(p)
    assert (rec.tensor_parallel, rec.partition_dim, rec.partition_stride, rec.real_size) == (True, 1, 2, None)
    assert params.counts_in_grad_norm(p, 0) and params.counts_in_grad_norm(p, 3)


def test_the_duplicate_embedding_is_never_counted():
    first, last = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    params.mark_tensor_parallel(first, last, real_size=2)
    params.mark_shared_embedding(first)
    params.mark_shared_embedding(last, duplicate=True)
    assert params.is_shared_embedding(first) and not params.is_shared_embedding_duplicate(first)
    assert params.is_shared_embedding_duplicate(last) and not params.counts_in_grad_norm(last, 0)
    assert params.counts_in_grad_norm(first, 1)


def test_marking_a_module_marks_all_its_parameters_and_skips_none():
    norm = nn.LayerNorm(4)
    params.mark_sequence_parallel(norm, None)
    assert all(params.is_sequence_parallel(p) for p in norm.parameters())


def test_marks_survive_a_dtype_change_of_the_module():
    lin = nn.Linear(2, 2)
    params.mark_tensor_parallel(lin.weight)
    lin.to(torch.bfloat16)
    assert params.is_tensor_parallel(lin.weight)


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(dim=2), "dim must be 0 or 1"), (dict(stride=0), "stride"), (dict(stride=2, real_size=3), "real_size")],
)
def test_bad_marks_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        params.mark_tensor_parallel(nn.Parameter(torch.zeros(2)), **kwargs)
