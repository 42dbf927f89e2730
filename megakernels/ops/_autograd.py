"""The eager fast path of the custom ops' autograd.

Each differentiable op registers its backward with ``torch.library.register_autograd`` (what torch.compile, opcheck
and the functorch transforms go through). In plain eager mode that path costs ~20 us of Python a call (filling the
schema's defaults, redispatching through the Python dispatcher), as much as a small kernel on the CPU.
``eager_autograd`` runs the same op with the same ``setup_context`` and ``backward`` as a ``torch.autograd.Function``
instead, below the Autograd dispatch key, whenever nothing else has to see the call: grad enabled, an input that
requires grad, no torch.compile tracing, no functorch transform and no dispatch or function mode active. Everything
else (no grad, compile, vmap/grad, FakeTensorMode, a TorchDispatchMode) calls the op itself. The kernels and the
saved tensors are the same either way, so are the results.
"""

from __future__ import annotations

import torch
from torch._C._functorch import peek_interpreter_stack


def _plain_eager() -> bool:
    return (
        not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._is_torch_function_mode_enabled()
        and peek_interpreter_stack() is None
    )


def eager_autograd(name: str, op, setup_context, backward):
    """``op`` (a custom op taking positional arguments) as a callable whose eager autograd is a plain
    ``torch.autograd.Function`` named ``name`` (its graph nodes ``<name>Backward``), built from the
    ``setup_context(ctx, inputs, output)`` and ``backward(ctx, *grads)`` registered for it (module docstring)."""

    def forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():
            out = op(*args)
        setup_context(ctx, args, out)
        return out

    def backward_(ctx, *grads):
        return backward(ctx, *grads)

    methods = {"forward": staticmethod(forward), "backward": staticmethod(backward_)}
    Function = type(name, (torch.autograd.Function,), methods)

    def call(*args):
        if (
            torch.is_grad_enabled()
            and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            and _plain_eager()
        ):
            return Function.apply(*args)
        return op(*args)

    return call
