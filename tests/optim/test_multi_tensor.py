"""Specification of the multi-tensor ops on every backend: the L2 norm against torch.linalg.vector_norm, its
determinism, the non-finite check, clip_grad_norm_, and lists long enough to need several CUDA launch tables."""

from __future__ import annotations

import pytest
import torch

from megakernels.ops import multi_tensor as mt
from megakernels.optim import FusedAdamW, clip_grad_norm_, multi_tensor_l2norm
from tests.optim.cases import clone_params, grads_for, make_params, max_rel_error, set_grads

L2_TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-6, torch.float16: 2e-6}


def reference_norm(tensors):
    return torch.linalg.vector_norm(torch.cat([t.detach().double().flatten().cpu() for t in tensors]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("chunk_size", [0, 100], ids=["default_chunk", "chunk100"])
def test_l2norm_matches_vector_norm(backend, dtype, chunk_size):
    tensors = make_params([(), (1,), (3, 5), (257,), (4, 1000)], backend.device, dtype)
    out = mt.l2norm(tensors, chunk_size) if chunk_size else multi_tensor_l2norm(tensors)
    assert out.dtype == torch.float32 and out.shape == () and out.device.type == backend.device
    assert abs(out.item() - reference_norm(tensors).item()) <= L2_TOL[dtype] * reference_norm(tensors).item()


def test_l2norm_of_mixed_dtypes_and_empty_tensors(backend):
    tensors = make_params([(3, 4), (0,), (100,)], backend.device)
    tensors[2] = tensors[2].to(torch.bfloat16)
    assert abs(multi_tensor_l2norm(tensors).item() - reference_norm(tensors).item()) <= 2e-6 * reference_norm(tensors)
    assert multi_tensor_l2norm([]).item() == 0.0
    assert multi_tensor_l2norm([torch.zeros(0, device=backend.device)]).item() == 0.0


def test_l2norm_is_deterministic(backend):
    tensors = make_params([(3000,), (17,), (2, 999)], backend.device)
    first = mt.l2norm(tensors, 128)
    for _ in range(3):
        assert torch.equal(mt.l2norm(tensors, 128), first)


def test_l2norm_does_not_depend_on_the_thread_count():
    tensors = make_params([(300_000,), (17,), (2, 70_001)], "cpu")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = multi_tensor_l2norm(tensors)
        torch.set_num_threads(max(2, before))
        assert torch.equal(multi_tensor_l2norm(tensors), one)
    finally:
        torch.set_num_threads(before)


def test_l2norm_of_non_contiguous_tensors(backend):
    t = make_params([(40, 30)], backend.device)[0].detach().t()
    assert abs(multi_tensor_l2norm([t]).item() - reference_norm([t]).item()) <= 2e-6 * reference_norm([t]).item()


def test_l2norm_propagates_nonfinite(backend):
    t = make_params([(50,)], backend.device)[0].detach()
    t[7] = float("inf")
    assert multi_tensor_l2norm([t]).item() == float("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_nonfinite_check_flags_only_nonfinite_lists(backend, dtype):
    tensors = [t.detach() for t in make_params([(5,), (300,), (2, 7)], backend.device, dtype)]
    flag = torch.zeros(1, device=backend.device)
    mt.nonfinite_check_(tensors, flag, chunk_size=64)
    assert flag.item() == 0.0
    tensors[1][299] = float("nan")
    mt.nonfinite_check_(tensors, flag, chunk_size=64)
    assert flag.item() == 1.0
    # The flag only ever goes up: a clean list leaves a set flag set.
    mt.nonfinite_check_([tensors[0]], flag)
    assert flag.item() == 1.0


def test_clip_grad_norm_matches_torch(backend):
    params = make_params([(3, 5), (130,)], backend.device)
    ref = clone_params(params)
    grads = grads_for(params, 0, scale=10.0)
    set_grads(params, grads)
    set_grads(ref, grads)
    total = clip_grad_norm_(params, 1.0)
    ref_total = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert abs(total.item() - ref_total.item()) <= 2e-6 * ref_total.item()
    for p, r in zip(params, ref):
        assert max_rel_error(p.grad, r.grad) <= 1e-5


def test_long_lists_span_several_launch_tables(backend):
    # 40 tensors (a launch table holds 32) of ~300 elements in chunks of 32: ~380 chunks (a table holds 256),
    # with tensors cut between tables.
    shapes = [(280 + 3 * i,) for i in range(40)]
    params = make_params(shapes, backend.device)
    ref_params = clone_params(params)
    ours = FusedAdamW(params, lr=1e-2, chunk_size=32)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, foreach=False)
    for s in range(2):
        grads = grads_for(params, s)
        set_grads(params, grads)
        set_grads(ref_params, grads)
        ours.step()
        ref.step()
    for p, r in zip(params, ref_params):
        assert max_rel_error(p, r) <= 1e-6
    assert abs(mt.l2norm(params, 32).item() - reference_norm(params).item()) <= 2e-6 * reference_norm(params).item()
    flag = torch.zeros(1, device=backend.device)
    grads = [p.grad for p in params]
    grads[-1][-1] = float("inf")
    mt.nonfinite_check_(grads, flag, chunk_size=32)
    assert flag.item() == 1.0
