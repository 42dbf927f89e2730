"""cross_entropy against F.cross_entropy(reduction="none") in fp64, on the CPU path (cpu), the Triton kernels
under the interpreter (cuda_emu) and the GPU (cuda)."""

import pytest
import torch

from megakernels.ops import cross_entropy
from megakernels.ops.cross_entropy import cross_entropy_reference

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}  # math is fp32 on the stored logits
GRAD_TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}  # gradient stored in logits' dtype


def _case(n, v, dtype, device, seed=0, ignore=()):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g) * 4).to(dtype=dtype, device=device)
    t = torch.randint(0, v, (n,), generator=g)
    t[list(ignore)] = -100
    return x, t.to(device)


def _check_against_reference(x, t, dloss, **kwargs):
    inplace = kwargs.pop("inplace_backward", False)
    xs = x.detach().clone().requires_grad_(not inplace)
    logits = xs if not inplace else xs.clone().requires_grad_(True)
    loss = cross_entropy(logits, t, inplace_backward=inplace, **kwargs)
    loss.backward(dloss)
    grad = logits.grad
    xr = x.detach().double().requires_grad_(True)
    ref = cross_entropy_reference(
        xr,
        t,
        ignore_index=kwargs.get("ignore_index", -100),
        label_smoothing=kwargs.get("label_smoothing", 0.0),
        vocab_size=kwargs.get("vocab_size"),
        softcap=kwargs.get("softcap"),
    )
    ref.backward(dloss.double())
    assert loss.dtype == torch.float32 and loss.shape == t.shape
    scale = max(1.0, ref.abs().max().item())
    assert (loss.double().cpu() - ref.cpu()).abs().max().item() <= TOL[x.dtype] * scale
    assert grad.dtype == x.dtype
    assert (grad.double().cpu() - xr.grad.cpu()).abs().max().item() <= GRAD_TOL[x.dtype] * dloss.abs().max().item()
    return loss, grad


def _dtypes(triton_backend):
    return (
        (torch.float32, torch.bfloat16, torch.float16)
        if triton_backend.name != "cuda_emu"
        else (torch.float32, torch.bfloat16)
    )


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("n, v", [(1, 10), (37, 301), (8, 1000)])
def test_matches_f_cross_entropy(triton_backend, n, v, label_smoothing):
    for dtype in _dtypes(triton_backend):
        x, t = _case(n, v, dtype, triton_backend.device, ignore=[0] if n > 4 else [])
        dloss = torch.randn(n, device=triton_backend.device)
        loss, grad = _check_against_reference(x, t, dloss, label_smoothing=label_smoothing)
        if n > 4:  # the ignored token: loss 0, gradient 0
            assert loss[0].item() == 0 and (grad[0] == 0).all()


@pytest.mark.parametrize("inplace", [False, True])
def test_softcap_matches_the_capped_fp64_reference(triton_backend, inplace):
    """Gemma's final-logit soft cap in the kernels: the loss of ``c tanh(x / c)``, the gradient with respect to the
    raw logits (the cap's derivative in it), with label smoothing, padding columns and an ignored token, on logits
    large enough for the cap to bend them (and a -inf logit, which caps to -c)."""
    for dtype in _dtypes(triton_backend):
        x, t = _case(13, 301, dtype, triton_backend.device, ignore=[2])
        x = x * 10
        x[4, 7] = float("-inf")
        t = t.clamp(max=279)
        t[4] = 3
        dloss = torch.randn(13, device=triton_backend.device)
        kw = dict(softcap=30.0, label_smoothing=0.1, vocab_size=280, inplace_backward=inplace)
        loss, grad = _check_against_reference(x, t, dloss, **kw)
        assert (grad[:, 280:] == 0).all() and (grad[2] == 0).all()
        uncapped = cross_entropy(x, t, vocab_size=280, label_smoothing=0.1)
        assert (loss - uncapped).abs().max() > 1.0  # the cap changed the loss: the test checks the capped one


def test_softcap_opcheck():
    x, t = _case(6, 70, torch.float32, "cpu")
    lse, dloss = torch.randn(6).abs() + 3, torch.randn(6)
    torch.library.opcheck(torch.ops.megakernels.cross_entropy_stats, (x, t, 0, 64, 5.0, False))
    torch.library.opcheck(
        torch.ops.megakernels.cross_entropy_grad, (x, t, lse, dloss, 0, 64, -100, 0.9, 0.1 / 64, 5.0, False)
    )


def test_padding_columns_are_excluded(triton_backend):
    x, t = _case(16, 300, torch.float32, triton_backend.device)
    t = t.clamp(max=255)
    x[:, 256:] = 50.0  # padding with big logits would dominate the softmax if it were not excluded
    _, grad = _check_against_reference(
        x, t, torch.ones(16, device=triton_backend.device), vocab_size=256, label_smoothing=0.1
    )
    assert (grad[:, 256:] == 0).all()


def test_inplace_backward_writes_the_gradient_into_the_logits(triton_backend):
    x, t = _case(12, 257, torch.float32, triton_backend.device, ignore=[3])
    logits = x.clone().requires_grad_(True)
    buf = logits * 1.0  # a temporary, as the LM head's output
    cross_entropy(buf, t, inplace_backward=True).sum().backward()
    xr = x.double().requires_grad_(True)
    cross_entropy_reference(xr, t).sum().backward()
    assert torch.allclose(logits.grad.double().cpu(), xr.grad.cpu(), atol=1e-6)
    assert torch.allclose(buf.detach().double().cpu(), xr.grad.cpu(), atol=1e-6)  # the storage now holds it


def test_leading_dims_and_ignore_index(triton_backend):
    x, t = _case(2 * 5, 64, torch.float32, triton_backend.device)
    t[::3] = 7
    _check_against_reference(
        x.view(2, 5, 64), t.view(2, 5), torch.rand(2, 5, device=triton_backend.device), ignore_index=7
    )


def test_torch_compile_fullgraph():
    x, t = _case(9, 50, torch.float32, "cpu")
    fn = torch.compile(
        lambda a, b: cross_entropy(a, b, label_smoothing=0.1).mean(), fullgraph=True, backend="aot_eager"
    )
    xs = x.clone().requires_grad_(True)
    fn(xs, t).backward()
    xr = x.double().requires_grad_(True)
    cross_entropy_reference(xr, t, label_smoothing=0.1).mean().backward()
    assert torch.allclose(xs.grad.double(), xr.grad, atol=1e-6)


@pytest.mark.parametrize(
    "args, message",
    [
        (lambda x, t: (x, t.float()), "target must be an integer"),
        (lambda x, t: (x, t[:-1]), "target has shape"),
        (lambda x, t: (x.int(), t), "logits must be"),
        (lambda x, t: (x, t.clone().fill_(50)), "target holds 50, outside \\[0, 50\\)"),
        (lambda x, t: (x, t.clone().fill_(-1)), "target holds -1"),
        (lambda x, t: (x.tolist(), t), "logits must be a torch.Tensor"),
    ],
)
def test_bad_input_names_the_argument(args, message):
    x, t = _case(4, 50, torch.float32, "cpu")
    with pytest.raises((ValueError, TypeError), match=message):
        cross_entropy(*args(x, t))


def test_bad_options():
    x, t = _case(4, 50, torch.float32, "cpu")
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        cross_entropy(x, t, label_smoothing=1.5)
    for bad in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="softcap must be a positive finite number or None"):
            cross_entropy(x, t, softcap=bad)
    with pytest.raises(ValueError, match="vocab_size must be an int in \\[1, 50\\]"):
        cross_entropy(x, t, vocab_size=51)
    with pytest.raises(ValueError, match="target holds 45, outside \\[0, 40\\)"):
        cross_entropy(x, t.clone().fill_(45), vocab_size=40)
