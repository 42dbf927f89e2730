"""The eager fast path of the custom ops' autograd (megakernels/ops/_autograd.py): in plain eager mode each
differentiable op runs as a ``torch.autograd.Function`` built from its registered ``setup_context`` and ``backward``,
and must give the same bits (outputs and every input gradient) as the ``torch.library`` autograd path, which runs
instead under a dispatch mode or without grad."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megakernels import ops
from megakernels.ops import _autograd


def _cases():
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    mask = torch.rand(2, 1, 8, 8, generator=g) > 0.7
    return {
        "layer_norm": (lambda x, w, b: ops.layer_norm(x, w, b, activation="gelu_tanh"), (r(6, 40), r(40), r(40))),
        "rms_norm": (lambda x, w: ops.rms_norm(x, w), (r(6, 40, dtype=torch.bfloat16), r(40, dtype=torch.bfloat16))),
        "bias_gelu": (ops.bias_gelu, (r(5, 48), r(48))),
        "softmax": (lambda x: ops.scaled_causal_softmax(x, 0.5), (r(2, 3, 16, 16),)),
        "masked_softmax": (lambda x: ops.scaled_masked_softmax(x, mask, 0.3), (r(2, 3, 8, 8),)),
        "swiglu": (ops.swiglu, (r(4, 2, 32),)),
        "fused_rope": (
            lambda q, k: ops.fused_rope(q, k, torch.arange(10).expand(2, 10), theta=500.0),
            (r(2, 10, 3, 16), r(2, 10, 1, 16)),
        ),
        "flash_attention": (
            lambda q, k, v: ops.flash_attention(q, k, v, causal=True),
            (r(2, 70, 4, 32, dtype=torch.bfloat16), r(2, 70, 2, 32, dtype=torch.bfloat16), r(2, 70, 2, 32).bfloat16()),
        ),
    }


def _run(fn, inputs):
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(1)
    sum(
        (o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs
    ).backward()  # a weight per element: every gradient term counts
    return [o.detach() for o in outs], [t.grad for t in leaves], outs[0].grad_fn


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", list(_cases()))
def test_eager_path_gives_the_library_paths_bits(name, monkeypatch):
    fn, inputs = _cases()[name]
    outs, grads, grad_fn = _run(fn, inputs)
    assert type(grad_fn).__name__.endswith("_eagerBackward"), type(grad_fn).__name__  # the fast path ran
    monkeypatch.setattr(_autograd, "_plain_eager", lambda: False)
    ref_outs, ref_grads, ref_fn = _run(fn, inputs)
    assert not type(ref_fn).__name__.endswith("_eagerBackward")  # the library's autograd ran
    for x, y in zip(outs + grads, ref_outs + ref_grads):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def test_library_path_under_a_dispatch_mode_and_without_grad():
    x, w, b = (t.requires_grad_(True) for t in (torch.randn(4, 16), torch.randn(16), torch.randn(16)))
    with _Passthrough():
        y = ops.layer_norm(x, w, b)
    assert not type(y.grad_fn).__name__.endswith("_eagerBackward")  # the mode sees the op itself
    y.sum().backward()
    assert x.grad is not None and w.grad is not None
    with torch.no_grad():
        assert ops.layer_norm(x, w, b).grad_fn is None
