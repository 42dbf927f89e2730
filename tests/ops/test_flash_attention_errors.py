"""Bad input to flash_attention raises an error that names the argument and the rule."""

import pytest
import torch

from megakernels.ops import flash_attention


def _qkv(b=1, sq=8, sk=8, h=4, hk=2, d=32, dtype=torch.float32):
    return (
        torch.randn(b, sq, h, d, dtype=dtype),
        torch.randn(b, sk, hk, d, dtype=dtype),
        torch.randn(b, sk, hk, d, dtype=dtype),
    )


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda q, k, v: (q[0], k, v), "q must be 4-D"),
        (lambda q, k, v: (q, k.half(), v), "k has dtype torch.float16, expected q's dtype"),
        (lambda q, k, v: (q, k, v[:, :4]), "v has shape"),
        (lambda q, k, v: (q, torch.randn(2, 8, 2, 32), torch.randn(2, 8, 2, 32)), "k has batch 2"),
        (lambda q, k, v: (q, k[..., :16], v[..., :16]), "k has head_dim 16, expected q's head_dim 32"),
        (lambda q, k, v: (q[:, :, :3], k, v), "q has 3 heads, which is not a multiple of k/v's 2 heads"),
        (lambda q, k, v: (q.int(), k.int(), v.int()), "q has dtype torch.int32"),
        (lambda q, k, v: (q.tolist(), k, v), "q must be a torch.Tensor"),
    ],
)
def test_bad_tensors_name_the_argument(mutate, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[").replace(".", r"\.")):
        flash_attention(*mutate(*_qkv()))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dropout_p=1.0), "dropout_p must be in"),
        (dict(dropout_p=-0.1), "dropout_p must be in"),
        (dict(softmax_scale=float("nan")), "softmax_scale must be a finite"),
        (dict(softmax_scale="1"), "softmax_scale must be a finite"),
    ],
)
def test_bad_options_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        flash_attention(*_qkv(), **kwargs)


def test_empty_sequences_give_zeros_and_gradients():
    q, k, v = _qkv(sk=0)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, lse = flash_attention(q, k, v, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all() and lse.shape == (1, 4, 8)
    out.sum().backward()
    assert q.grad is not None and (q.grad == 0).all()


@pytest.mark.cuda
def test_cuda_rejects_unsupported_head_dim():
    q, k, v = (t.cuda().half() for t in _qkv(d=20))
    with pytest.raises(ValueError, match="head_dim 20 is not supported on CUDA"):
        flash_attention(q, k, v)


def test_cuda_emu_without_the_interpreter_is_an_error_not_a_fallback(monkeypatch):
    import megakernels
    import megakernels.triton

    monkeypatch.setattr(megakernels.triton, "interpreting", lambda: False)
    with megakernels.backend("cuda_emu"):
        with pytest.raises(RuntimeError, match="flash_attention: backend cuda_emu runs the Triton kernels"):
            flash_attention(*_qkv())
        with pytest.raises(RuntimeError, match="cross_entropy: backend cuda_emu runs the Triton kernels"):
            megakernels.ops.cross_entropy(torch.randn(3, 10), torch.tensor([1, 2, 3]))
