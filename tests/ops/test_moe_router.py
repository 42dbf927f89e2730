"""ops.moe_router against its PyTorch composition in fp64 (moe_router_reference: softmax/sigmoid, a stable sort for
the choices, gather, bincount, a column sum), forward and gradients, on the C++ CPU kernel (cpu), the Triton
kernels under the interpreter (cuda_emu) and the GPU (cuda); and against the MoE layer's own router."""

import pytest
import torch

from megakernels.ops import moe_router, moe_router_reference

E = 24
ROUTINGS = {
    "mixtral": dict(top_k=2),
    "switch": dict(top_k=1, normalize=False),
    "gpt-oss": dict(top_k=4, topk_softmax=True),
    "deepseek-v3": dict(top_k=6, score="sigmoid", n_group=4, topk_group=2, scale=2.5),
    "sigmoid-unnormalised": dict(top_k=3, score="sigmoid", normalize=False),
    "biased-softmax": dict(top_k=3, n_group=3, topk_group=1),
}


def _logits(t, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, E, generator=g) * 2).to(dtype).to(device)


def _bias(name, device):
    if name not in ("deepseek-v3", "biased-softmax"):
        return None
    return (torch.randn(E, generator=torch.Generator().manual_seed(7)) * 0.05).to(device)


def _run(x, kw, bias, upstream):
    xs = x.detach().clone().requires_grad_(True)
    out = moe_router(xs, **kw, bias=bias)
    dw, da, dl = upstream
    ((out.weights * dw).sum() + (out.aux_sum * da).sum() + (out.lse * dl).sum()).backward()
    return out, xs.grad


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_matches_the_fp64_reference(triton_backend, name):
    kw = ROUTINGS[name]
    dev = triton_backend.device
    # the interpreter is slow: fp32 over 40 rows there (3 programs of 16, the last one partial); every dtype on the CPU
    emu = triton_backend.name == "cuda_emu"
    dtypes = (torch.float32,) if emu else (torch.float32, torch.bfloat16, torch.float16)
    t = 40 if emu else 70  # 70: more than one partial-sum block of the CPU kernel, the last one partial
    for dtype in dtypes:
        x = _logits(t, dtype, dev)
        bias = _bias(name, dev)
        g = torch.Generator().manual_seed(1)
        upstream = (
            torch.randn(t, kw["top_k"], generator=g).to(dev),
            torch.randn(E, generator=g).to(dev),
            torch.randn(t, generator=g).to(dev),
        )
        out, grad = _run(x, kw, bias, upstream)
        xr = x.detach().double().requires_grad_(True)
        ref = moe_router_reference(xr, **kw, bias=bias, compute_dtype=torch.float64)
        dw, da, dl = (u.double() for u in upstream)
        ((ref.weights * dw).sum() + (ref.aux_sum * da).sum() + (ref.lse * dl).sum()).backward()
        assert torch.equal(out.experts.cpu(), ref.experts.cpu()), name  # the same experts, in the same order
        assert torch.equal(out.tokens_per_expert.double().cpu(), ref.tokens_per_expert.cpu())
        assert out.weights.dtype == torch.float32 and out.experts.dtype == torch.int64
        torch.testing.assert_close(out.weights.double().cpu(), ref.weights.cpu(), rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(out.aux_sum.double().cpu(), ref.aux_sum.cpu(), rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(out.lse.double().cpu(), ref.lse.cpu(), rtol=1e-6, atol=1e-6)
        assert grad.dtype == dtype
        tol = 2e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(grad.double().cpu(), xr.grad.cpu(), rtol=tol, atol=tol * xr.grad.abs().max().item())


def test_ties_go_to_the_lower_index(triton_backend):
    """Equal logits (a freshly initialised gate, repeated rows): the lower expert and group indices win."""
    dev = triton_backend.device
    x = torch.zeros(5, E, device=dev)
    x[1, 10:14] = 3.0  # four equal best: 10, 11 chosen
    x[2, ::2] = 1.0  # every even expert ties
    for kw in (
        dict(top_k=2),
        dict(top_k=3, score="sigmoid", n_group=4, topk_group=2),
        dict(top_k=4, topk_softmax=True),
    ):
        out = moe_router(x, **kw)
        ref = moe_router_reference(x.double(), **kw, compute_dtype=torch.float64)
        assert torch.equal(out.experts.cpu(), ref.experts.cpu()), kw
    assert moe_router(x, 2).experts[1].tolist() == [10, 11] and moe_router(x, 2).experts[0].tolist() == [0, 1]


def test_the_bias_moves_the_choice_not_the_weights():
    x = _logits(32, torch.float32, "cpu")
    bias = torch.zeros(E)
    bias[5] = 100.0  # expert 5 always chosen, its weight still its own score
    out = moe_router(x, 2, score="sigmoid", normalize=False, bias=bias)
    assert (out.experts[:, 0] == 5).all()
    torch.testing.assert_close(out.weights[:, 0], torch.sigmoid(x[:, 5]))


def test_the_moe_layers_router_runs_it_and_its_losses_are_switchs_and_st_moes():
    """The layer's router (the fused op) against the PyTorch composition in fp64: the same experts and weights, the
    load-balancing loss E * sum_i f_i P_i and the z-loss mean_t lse_t^2, with their gradients to the gate."""
    from megakernels.parallel.moe.router import TopKRouter

    torch.manual_seed(0)
    router = TopKRouter(16, E, 2)
    h = torch.randn(50, 16)
    weights, experts, stats = router(h)
    (weights.sum() + stats["aux_loss"] + stats["z_loss"]).backward()
    w64 = router.weight.detach().double().requires_grad_(True)
    ref = moe_router_reference(h.double() @ w64.t(), 2, compute_dtype=torch.float64)
    assert torch.equal(experts, ref.experts)
    torch.testing.assert_close(weights.double(), ref.weights)
    f, p = ref.tokens_per_expert / (50 * 2), ref.aux_sum / 50
    aux, z = E * (f * p).sum(), ref.lse.square().mean()
    torch.testing.assert_close(stats["aux_loss"].double(), aux)
    torch.testing.assert_close(stats["z_loss"].double(), z)
    (ref.weights.sum() + aux + z).backward()
    torch.testing.assert_close(router.weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-6)


def test_sums_are_the_same_bits_for_any_thread_count():
    x = _logits(300, torch.float32, "cpu")
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = moe_router(x, 2)
        torch.set_num_threads(2)
        two = moe_router(x, 2)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(one.aux_sum, two.aux_sum) and torch.equal(one.tokens_per_expert, two.tokens_per_expert)


def test_opcheck_and_compile():
    x = _logits(20, torch.float32, "cpu")
    torch.library.opcheck(
        torch.ops.megakernels.moe_router_fwd, (x, torch.zeros(E), 3, 1, True, False, 1.5, 4, 2, False)
    )
    out = moe_router(x, 3)
    args = (
        x,
        out.lse,
        out.experts,
        out.weights,
        torch.randn(20, 3),
        torch.randn(E),
        torch.randn(20),
        0,
        True,
        False,
        1.0,
        False,
    )
    torch.library.opcheck(torch.ops.megakernels.moe_router_bwd, args)
    fn = torch.compile(lambda a: moe_router(a, 3).weights.sum(), fullgraph=True, backend="aot_eager")
    xs = x.clone().requires_grad_(True)
    fn(xs).backward()
    xr = x.double().requires_grad_(True)
    moe_router_reference(xr, 3, compute_dtype=torch.float64).weights.sum().backward()
    torch.testing.assert_close(xs.grad.double(), xr.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(top_k=0), "top_k must be in \\[1, 24\\]"),
        (dict(top_k=7, n_group=4, topk_group=1), "top_k must be in \\[1, 6\\]"),
        (dict(top_k=2, n_group=5), "n_group must divide the 24 experts, got 5"),
        (dict(top_k=2, n_group=4, topk_group=5), "topk_group must be in \\[1, n_group=4\\], got 5"),
        (dict(top_k=2, score="relu"), "score must be one of"),
        (dict(top_k=2, scale=0.0), "scale must be a positive finite number"),
        (dict(top_k=2, bias=torch.zeros(3)), "bias must be a floating \\[24\\] tensor"),
        (dict(top_k=2.0), "top_k must be an int"),
    ],
)
def test_bad_arguments_are_named(kw, message):
    with pytest.raises((TypeError, ValueError), match=message):
        moe_router(_logits(4, torch.float32, "cpu"), **kw)


def test_bad_logits_are_named():
    with pytest.raises(ValueError, match="logits must be \\[tokens, experts\\]"):
        moe_router(torch.zeros(2, 3, 4), 1)
    with pytest.raises(ValueError, match="logits must be"):
        moe_router(torch.zeros(4, E, dtype=torch.float64), 1)
