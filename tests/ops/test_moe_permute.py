"""ops.moe_permute / moe_unpermute against a stable argsort of the assignments and the weighted sum in fp64, on the
C++ CPU kernels (cpu), the Triton kernels under the interpreter (cuda_emu) and the GPU (cuda)."""

import pytest
import torch

from megakernels.ops.moe_permute import moe_permute, moe_permute_reference, moe_unpermute

E = 6


def _routing(t, k, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    # a skewed router: expert 0 popular, expert 5 never chosen (an empty group)
    scores = torch.rand(t, E - 1, generator=g) + torch.tensor([0.6, 0.2, 0.0, 0.0, 0.0])
    experts = scores.topk(k, dim=-1).indices
    weights = torch.rand(t, k, generator=g)
    return experts.to(device), weights.to(device)


@pytest.mark.parametrize("capacity, pad", [(None, 1), (None, 4), (9, 1), (7, 8), (0, 1)])
def test_matches_the_argsort_reference(triton_backend, capacity, pad):
    dev = triton_backend.device
    experts, weights = _routing(300, 2, device=dev)  # 600 assignments: several blocks of the Triton index pass
    x = torch.randn(300, 5, dtype=torch.float64).float().to(dev)
    got = moe_permute(x, experts, E, capacity=capacity, pad_multiple=pad)
    rows, sizes, dest = moe_permute_reference(x, experts, E, capacity, pad)
    assert torch.equal(got.dest.cpu(), dest.cpu())
    assert torch.equal(got.group_sizes.cpu(), sizes.cpu()) and got.group_sizes[E - 1] == 0
    assert torch.equal(got.rows.cpu(), rows.cpu())
    assert got.dropped == int((dest < 0).sum()) and got.dropped == (0 if capacity is None else got.dropped)
    assert (got.group_sizes % pad == 0).all()


def test_unpermute_and_gradients_match_fp64(triton_backend):
    dev = triton_backend.device
    dtypes = (
        (torch.float32, torch.bfloat16)
        if triton_backend.name == "cuda_emu"
        else (torch.float32, torch.bfloat16, torch.float16)
    )
    for dtype in dtypes:
        experts, weights = _routing(70, 3, seed=1, device=dev)
        x = torch.randn(70, 300, dtype=torch.float64).to(dtype).to(dev)  # h = 300: more than one column block
        xs, ws = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        perm = moe_permute(xs, experts, E, capacity=30, pad_multiple=4)
        scale = torch.arange(perm.rows.shape[0], device=dev, dtype=dtype)[:, None] * 0.01 + 1  # "experts": row-wise
        out = moe_unpermute(perm.rows * scale, perm.dest, ws)
        dout = torch.randn(70, 300, dtype=torch.float64).to(dtype).to(dev)
        out.backward(dout)
        # fp64: token t's output is sum_j w_tj * scale[dest] * x_t over the kept assignments
        xr, wr = x.double().cpu().requires_grad_(True), weights.double().cpu().requires_grad_(True)
        dest = perm.dest.cpu().view(70, 3)
        s = torch.where(dest >= 0, scale.double().cpu()[dest.clamp(min=0), 0], 0.0)
        ref = ((wr * s).sum(1, keepdim=True)) * xr
        ref.backward(dout.double().cpu())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double().cpu(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(xs.grad.double().cpu(), xr.grad, rtol=tol, atol=tol)
        torch.testing.assert_close(ws.grad.double().cpu(), wr.grad, rtol=tol, atol=tol * 30)
        assert out.dtype == dtype and ws.grad.dtype == torch.float32


def test_the_moe_layers_dispatch_uses_them():
    from megakernels.parallel.moe.dispatch import permute, unpermute

    experts, weights = _routing(40, 2)
    x = torch.randn(40, 8)
    perm = permute(x, experts, E, capacity=10)
    rows, sizes, dest = moe_permute_reference(x, experts, E, 10)
    assert torch.equal(perm.rows, rows) and torch.equal(perm.group_sizes, sizes)
    out = unpermute(perm.rows * 2, perm, weights)
    kept = (dest.view(40, 2) >= 0).double()
    torch.testing.assert_close(out.double(), 2 * (weights.double() * kept).sum(1, keepdim=True) * x.double())


def test_opcheck():
    experts, weights = _routing(20, 2)
    torch.library.opcheck(torch.ops.megakernels.moe_permute_index, (experts, E, 5, 2, False))
    perm = moe_permute(torch.randn(20, 4), experts, E)
    rows = torch.randn_like(perm.rows)
    torch.library.opcheck(torch.ops.megakernels.moe_unpermute_fwd, (rows, perm.dest, weights, False))
    torch.library.opcheck(
        torch.ops.megakernels.moe_unpermute_bwd, (rows, perm.dest, weights, torch.randn(20, 4), False)
    )


def test_bad_arguments_are_named():
    experts, weights = _routing(4, 2)
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="experts must be int64"):
        moe_permute(x, experts.int(), E)
    with pytest.raises(ValueError, match="x must be \\[tokens, h\\] with experts' 4 tokens"):
        moe_permute(x[:3], experts, E)
    with pytest.raises(ValueError, match="capacity"):
        moe_permute(x, experts, E, capacity=-1)
    with pytest.raises(ValueError, match="pad_multiple"):
        moe_permute(x, experts, E, pad_multiple=0)
    with pytest.raises(ValueError, match="experts holds 6, outside \\[0, 6\\)"):
        moe_permute(x, experts.clone().fill_(6), E)
    perm = moe_permute(x, experts, E)
    with pytest.raises(ValueError, match="weights must be \\[tokens, k\\]"):
        moe_unpermute(perm.rows, perm.dest, weights[:, :1])
    with pytest.raises(ValueError, match="dest holds 99"):
        moe_unpermute(perm.rows, perm.dest.clone().fill_(99), weights)


def test_fixed_buffers_give_every_expert_capacity_rows_and_the_same_result():
    """The sync-free mode: expert e's rows at [e * C', (e + 1) * C'), the kept ones first, zero rows after; after
    the unpermute the same output and gradients as the variable-size layout."""
    experts, weights = _routing(50, 2, seed=3)
    x = torch.randn(50, 7)
    fixed = moe_permute(x, experts, E, capacity=12, pad_multiple=8, fixed=True)
    var = moe_permute(x, experts, E, capacity=12)
    assert fixed.rows.shape == (E * 16, 7) and (fixed.group_sizes == 16).all()
    assert isinstance(fixed.dropped, torch.Tensor) and int(fixed.dropped) == var.dropped > 0
    for e in range(E):
        kept = int(var.kept[e])
        block = fixed.rows[e * 16 : (e + 1) * 16]
        start = int(var.group_sizes[:e].sum())
        assert torch.equal(block[:kept], var.rows[start : start + kept]) and (block[kept:] == 0).all()
    torch.testing.assert_close(
        moe_unpermute(fixed.rows * 3, fixed.dest, weights), moe_unpermute(var.rows * 3, var.dest, weights)
    )
    with pytest.raises(ValueError, match="fixed=True needs a capacity"):
        moe_permute(x, experts, E, fixed=True)


def test_the_layer_with_a_capacity_compiles_as_one_graph():
    """With a capacity the layer reads nothing back to the host: it traces as one graph (fullgraph), and the
    compiled layer equals the eager one."""
    from megakernels.parallel.launch import single_process_world
    from megakernels.parallel.moe import MoELayer

    with single_process_world(parallel=True):
        layer = MoELayer(16, 32, E, 2, seed=5, capacity_factor=0.75)
        x = torch.randn(9, 2, 16)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x), layer(x))
