"""The public API as fuzz entries: for each op, module and optimizer entry point, how to draw a good call, how to
make it, the plain-PyTorch reference of what it must return, and which arguments a careful user might get wrong.

An entry's ``build(draw, dtype)`` returns the keyword arguments of one good call; ``call(**kw)`` makes it through
the public API; ``reference(**kw)`` computes the expected result in fp64 with plain PyTorch (and raises where the
input makes no sense). ``tensors`` are the tensor arguments the fuzz mutates (moved to meta, made sparse, handed
over as a list, given a wrong dtype or a wrong last dim, made non-contiguous); ``scalars`` maps other arguments to
values that must be refused with an error naming the argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

import megakernels.nn as mnn
import megakernels.ops as mops
from megakernels.ops.attention import flash_attention_reference
from megakernels.ops.cross_entropy import cross_entropy_reference
from megakernels.ops.grouped_gemm import grouped_gemm, grouped_gemm_reference
from megakernels.ops.norms import layer_norm_reference, rms_norm_reference
from megakernels.ops.softmax import (
    scaled_causal_softmax_reference,
    scaled_masked_softmax_reference,
    scaled_softmax_reference,
)
from megakernels.optim import FusedAdamW, clip_grad_norm_, multi_tensor_l2norm

NAN, INF = float("nan"), float("inf")
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
BAD_REALS = [None, "0.5", NAN, True]  # for any real-valued option
BAD_EPS = [*BAD_REALS, -1.0, INF]


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    build: Callable  # (draw, dtype) -> kwargs of a good call
    call: Callable  # (**kwargs) -> tensor or tuple of tensors
    reference: Callable  # (**kwargs) -> the same structure, fp64
    dtypes: tuple = FLOATS
    tensors: tuple = ()
    scalars: dict = dataclasses.field(default_factory=dict)
    bad_dtype: dict = dataclasses.field(default_factory=dict)  # argument -> a dtype wrong for it (default int64)
    backends: tuple = ("auto",)  # cuda_emu too for the C++ kernels
    meta_ok: bool = True  # all tensor arguments on meta: a meta result (False: the module has CPU parameters)

    def __str__(self) -> str:
        return self.name


def d64(t):
    """fp64 copy of a floating tensor (other dtypes as they are): the reference computes on these."""
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def rand(draw, shape, dtype, scale=1.0):
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def dims(draw, n, lo=0, hi=3):
    return [draw(st.integers(lo, hi)) for _ in range(n)]


# ---- ops ---------------------------------------------------------------------------------------------------------


def _norm_build(draw, dtype, n_params):
    shape = (*dims(draw, draw(st.integers(0, 2))), draw(st.integers(1, 40)))
    kw = {"x": rand(draw, shape, dtype, 2.0)}
    for name in ("weight", "bias")[:n_params]:
        kw[name] = rand(draw, shape[-1:], dtype)
    kw["eps"] = draw(st.sampled_from([1e-5, 1e-6, 0.1]))
    return kw


def _softmax_build(draw, dtype, masked=False):
    b, h, sq = dims(draw, 3, 1, 3)
    sk = draw(st.integers(1, 40))
    kw = {"x": rand(draw, (b, h, sq, sk), dtype, 3.0), "scale": draw(st.sampled_from([1.0, 0.125, -2.0]))}
    if masked:
        mshape = tuple(n if draw(st.booleans()) else 1 for n in (b, h, sq)) + (sk,)
        kw["mask"] = rand(draw, mshape, torch.float32) > 0.5
    return kw


def _attention_build(draw, dtype):
    b, sq, sk = draw(st.integers(1, 2)), draw(st.integers(1, 9)), draw(st.integers(1, 9))
    hk = draw(st.integers(1, 2))
    h, d = hk * draw(st.integers(1, 2)), draw(st.sampled_from([8, 16]))
    return {
        "q": rand(draw, (b, sq, h, d), dtype),
        "k": rand(draw, (b, sk, hk, d), dtype),
        "v": rand(draw, (b, sk, hk, d), dtype),
        "causal": draw(st.booleans()),
        "window": draw(st.sampled_from([None, 1, 2, 4, 12])),
    }


def _cross_entropy_build(draw, dtype):
    n, v = draw(st.integers(1, 12)), draw(st.integers(1, 50))
    target = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    target[::3] = -100
    return {
        "logits": rand(draw, (n, v), dtype, 3.0),
        "target": target,
        "ignore_index": -100,
        "label_smoothing": draw(st.sampled_from([0.0, 0.1])),
        "group": None,
        "vocab_size": None,
    }


def _rope_build(draw, dtype):
    b, s, seq_dim = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.sampled_from([0, 1]))
    hq, hk, d = draw(st.integers(1, 4)), draw(st.integers(1, 2)), 2 * draw(st.integers(1, 12))
    grid = (s, b) if seq_dim == 0 else (b, s)
    kw = {
        "q": rand(draw, (*grid, hq, d), dtype),
        "k": rand(draw, (*grid, hk, d), dtype),
        "positions": torch.randperm(s, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))),
        "theta": draw(st.sampled_from([10000.0, 500000.0])),
        "interleaved": draw(st.booleans()),
        "position_offset": draw(st.integers(0, 50)),
        "seq_dim": seq_dim,
    }
    if draw(st.booleans()):
        kw["cos_sin"] = mops.rope_cos_sin_table(s + 60, d, kw["theta"])
    return kw


def _grouped_gemm_build(draw, dtype):
    groups, k, n = draw(st.integers(1, 3)), draw(st.integers(1, 8)), draw(st.integers(1, 8))
    sizes = torch.tensor([draw(st.integers(0, 4)) for _ in range(groups)])
    return {
        "x": rand(draw, (int(sizes.sum()), k), dtype),
        "weight": rand(draw, (groups, n, k), dtype),
        "group_sizes": sizes,
    }


OPS = [
    Entry(
        "layer_norm",
        lambda draw, dt: {**_norm_build(draw, dt, 2), "activation": draw(st.sampled_from([None, "gelu", "gelu_tanh"]))},
        lambda **kw: mops.layer_norm(**kw),
        lambda x, weight, bias, eps, activation: layer_norm_reference(d64(x), d64(weight), d64(bias), eps, activation),
        tensors=("x", "weight", "bias"),
        scalars={"eps": BAD_EPS, "activation": ["relu", 1]},
        backends=("auto", "cuda_emu"),
    ),
    Entry(
        "rms_norm",
        lambda draw, dt: _norm_build(draw, dt, 1),
        lambda **kw: mops.rms_norm(**kw),
        lambda x, weight, eps: rms_norm_reference(d64(x), d64(weight), eps),
        tensors=("x", "weight"),
        scalars={"eps": BAD_EPS},
        backends=("auto", "cuda_emu"),
    ),
    Entry(
        "bias_gelu",
        lambda draw, dt: {
            **{k: v for k, v in _norm_build(draw, dt, 2).items() if k in ("x", "bias")},
            "approximate": draw(st.sampled_from(["tanh", "none"])),
        },
        lambda **kw: mops.bias_gelu(**kw),
        lambda x, bias, approximate: F.gelu(d64(x) + d64(bias), approximate=approximate),
        tensors=("x", "bias"),
        scalars={"approximate": ["fast", None]},
        backends=("auto", "cuda_emu"),
    ),
    Entry(
        "scaled_softmax",
        lambda draw, dt: _softmax_build(draw, dt),
        lambda **kw: mops.scaled_softmax(**kw),
        lambda x, scale: scaled_softmax_reference(d64(x), scale),
        tensors=("x",),
        scalars={"scale": BAD_REALS + [INF]},
        backends=("auto", "cuda_emu"),
    ),
    Entry(
        "scaled_masked_softmax",
        lambda draw, dt: _softmax_build(draw, dt, masked=True),
        lambda **kw: mops.scaled_masked_softmax(**kw),
        lambda x, mask, scale: scaled_masked_softmax_reference(d64(x), mask, scale),
        tensors=("x", "mask"),
        scalars={"scale": BAD_REALS},
        bad_dtype={"mask": torch.float32},
        backends=("auto", "cuda_emu"),
    ),
    Entry(
        "scaled_causal_softmax",
        lambda draw, dt: _softmax_build(draw, dt),
        lambda **kw: mops.scaled_causal_softmax(**kw),
        lambda x, scale: scaled_causal_softmax_reference(d64(x), scale),
        tensors=("x",),
        scalars={"scale": BAD_REALS},
        backends=("auto", "cuda_emu"),
    ),
    Entry(
        "flash_attention",
        _attention_build,
        lambda **kw: mops.flash_attention(**kw),
        lambda q, k, v, causal, window: flash_attention_reference(d64(q), d64(k), d64(v), causal, window=window)[0],
        dtypes=(torch.float32, torch.float64),
        tensors=("q", "k", "v"),
        scalars={
            "softmax_scale": ["1", NAN, True],
            "dropout_p": [1.0, -0.1, "0", None],
            "window": [-1, 2.5, True, "3"],
        },
    ),
    Entry(
        "cross_entropy",
        _cross_entropy_build,
        lambda **kw: mops.cross_entropy(**kw),
        lambda logits, target, ignore_index, label_smoothing, group, vocab_size: cross_entropy_reference(
            d64(logits), target, ignore_index, label_smoothing, vocab_size
        ),
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        tensors=("logits", "target"),
        scalars={
            "label_smoothing": [-0.1, 1.5, "0.1", None, NAN],
            "ignore_index": ["x", 1.5, None],
            "group": ["world", 3, object()],
            "vocab_size": [0, 10**6, "8", 2.5],
        },
        bad_dtype={"target": torch.float32},
    ),
    Entry(
        "fused_rope",
        _rope_build,
        lambda **kw: mops.fused_rope(**kw),
        lambda q, k, **kw: mops.rope_reference(d64(q), d64(k), **kw),
        tensors=("q", "k", "positions"),
        bad_dtype={"positions": torch.float32},
        scalars={
            "theta": [0.0, -1.0, *BAD_REALS],
            "seq_dim": [2, -1, 1.0, None],
            "position_offset": [0.5, None, "1"],
            "interleaved": [1, "no", None],
        },
        backends=("auto", "cuda_emu"),
    ),
    Entry(
        "swiglu",
        lambda draw, dt: {
            "x": rand(draw, (*dims(draw, draw(st.integers(0, 2))), 2 * draw(st.integers(1, 40))), dt, 3.0)
        },
        lambda x: mops.swiglu(x),
        lambda x: mops.swiglu_reference(d64(x)),
        tensors=("x",),
        backends=("auto", "cuda_emu"),
    ),
    Entry(
        "grouped_gemm",
        _grouped_gemm_build,
        lambda **kw: grouped_gemm(**kw),
        lambda x, weight, group_sizes: grouped_gemm_reference(d64(x), d64(weight), group_sizes),
        dtypes=(torch.float32, torch.float64),
        tensors=("x", "weight", "group_sizes"),
        bad_dtype={"group_sizes": torch.float32},
    ),
]


# ---- modules and optimizers ---------------------------------------------------------------------------------------


def _module_norm_build(draw, dtype):
    h = draw(st.integers(1, 24))
    return {
        "normalized_shape": h,
        "eps": draw(st.sampled_from([1e-5, 1e-3])),
        "x": rand(draw, (*dims(draw, draw(st.integers(1, 2))), h), dtype),
    }


def _adamw_build(draw, dtype):
    n = draw(st.integers(1, 40))
    return {
        "param": rand(draw, (n,), torch.float32),
        "grad": rand(draw, (n,), torch.float32),
        "lr": draw(st.sampled_from([1e-3, 0.1])),
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": draw(st.sampled_from([0.0, 0.01])),
    }


def _adamw_step(cls, param, grad, **hyper):
    p = torch.nn.Parameter(param.clone())
    opt = cls([p], **hyper)
    p.grad = grad.clone()
    opt.step()
    return p.detach()


def _load_state_build(draw, dtype):
    return {
        "param": rand(draw, (draw(st.integers(1, 20)),), torch.float32),
        "step": draw(st.sampled_from([0, 3, 7.0])),
        "lr": 0.01,
    }


def _after_load(cls, param, step, lr):
    """A step taken after loading a state whose step count is ``step`` (moments zero)."""
    p = torch.nn.Parameter(param.clone())
    opt = cls([p], lr=lr)
    state = {
        "state": {0: {"step": step, "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}},
        "param_groups": [{**opt.param_groups[0], "params": [0]}],
    }
    opt.load_state_dict(state)
    p.grad = torch.ones_like(param)
    opt.step()
    return p.detach()


def _l2_build(draw, dtype):
    return {"tensors": [rand(draw, (draw(st.integers(1, 30)),), dtype) for _ in range(draw(st.integers(2, 3)))]}


MODULES = [
    Entry(
        "FusedLayerNorm",
        _module_norm_build,
        lambda normalized_shape, eps, x: mnn.FusedLayerNorm(normalized_shape, eps=eps, dtype=_dtype(x))(x),
        lambda normalized_shape, eps, x: F.layer_norm(d64(x), (normalized_shape,), eps=eps),
        tensors=("x",),
        scalars={"normalized_shape": [2.5, "4", [4.0], (), 0, True, None], "eps": BAD_EPS},
        meta_ok=False,
    ),
    Entry(
        "FusedRMSNorm",
        _module_norm_build,
        lambda normalized_shape, eps, x: mnn.FusedRMSNorm(normalized_shape, eps=eps, dtype=_dtype(x))(x),
        lambda normalized_shape, eps, x: rms_norm_reference(d64(x), None, eps),
        tensors=("x",),
        scalars={"normalized_shape": [1.5, "4", [0]], "eps": ["1e-6", -1.0, NAN]},
        meta_ok=False,
    ),
    Entry(
        "FusedBiasGeLU",
        lambda draw, dt: {"hidden_size": 8, "x": rand(draw, (draw(st.integers(0, 4)), 8), dt)},
        lambda hidden_size, x: mnn.FusedBiasGeLU(hidden_size, dtype=_dtype(x))(x),
        lambda hidden_size, x: F.gelu(d64(x), approximate="tanh"),
        tensors=("x",),
        scalars={"hidden_size": [0, 2.5, "8", None]},
        meta_ok=False,
    ),
    Entry(
        "FusedScaleMaskSoftmax",
        lambda draw, dt: _softmax_build(draw, dt),
        lambda x, scale: mnn.FusedScaleMaskSoftmax(scale)(x),
        lambda x, scale: scaled_softmax_reference(d64(x), scale),
        tensors=("x",),
        scalars={"scale": ["1", NAN, True]},
    ),
    Entry(
        "FlashSelfAttention",
        lambda draw, dt: {**_attention_build(draw, dt), "attention_dropout": 0.0},
        lambda q, k, v, causal, window, attention_dropout: mnn.FlashSelfAttention(
            causal, None, attention_dropout, window
        )(q, k, v),
        lambda q, k, v, causal, window, attention_dropout: flash_attention_reference(
            d64(q), d64(k), d64(v), causal, window=window
        )[0],
        dtypes=(torch.float32,),
        tensors=("q", "k", "v"),
        scalars={"attention_dropout": [1.0, -0.1, "0.1", None], "window": [-2, 1.5]},
    ),
    Entry(
        "RotaryEmbedding",
        lambda draw, dt: {
            **{
                k: v
                for k, v in _rope_build(draw, dt).items()
                if k in ("q", "k", "positions", "theta", "interleaved", "seq_dim")
            },
            "head_dim": None,
        },
        lambda q, k, positions, theta, interleaved, seq_dim, head_dim: mnn.RotaryEmbedding(
            getattr(q, "shape", [2])[-1] if head_dim is None else head_dim, theta, interleaved
        )(q, k, positions, seq_dim),
        lambda q, k, positions, theta, interleaved, seq_dim, head_dim: mops.rope_reference(
            d64(q), d64(k), positions, theta=theta, interleaved=interleaved, seq_dim=seq_dim
        ),
        tensors=("q", "k", "positions"),
        bad_dtype={"positions": torch.float32},
        scalars={"head_dim": [3, 0, 4.0, "8"], "theta": [0.0, None, "1e4"], "interleaved": [1, None]},
    ),
    Entry(
        "FusedSwiGLU",
        lambda draw, dt: {"x": rand(draw, (draw(st.integers(0, 4)), 2 * draw(st.integers(1, 9))), dt)},
        lambda x: mnn.FusedSwiGLU()(x),
        lambda x: mops.swiglu_reference(d64(x)),
        tensors=("x",),
    ),
    Entry(
        "FusedAdamW",
        _adamw_build,
        lambda **kw: _adamw_step(FusedAdamW, **kw),
        lambda **kw: _adamw_step(torch.optim.AdamW, **{k: d64(v) for k, v in kw.items()}),
        dtypes=(torch.float32,),
        scalars={
            "lr": [-1.0, NAN, "1e-3", None],
            "betas": [(0.9,), (1.0, 0.9), "ab"],
            "eps": [-1.0, None],
            "weight_decay": [-0.1, "0"],
        },
    ),
    Entry(
        "FusedAdamW.load_state_dict",
        _load_state_build,
        lambda **kw: _after_load(FusedAdamW, **kw),
        lambda param, step, lr: _after_load(torch.optim.AdamW, d64(param), torch.tensor(float(step)), lr),
        dtypes=(torch.float32,),
        scalars={"step": ["abc", None, -1.0, NAN, torch.tensor([1.0, 2.0]), torch.zeros((), device="meta")]},
    ),
    Entry(
        "multi_tensor_l2norm",
        _l2_build,
        lambda tensors: multi_tensor_l2norm(tensors),
        lambda tensors: torch.linalg.vector_norm(torch.cat([d64(t).flatten() for t in tensors])),
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        tensors=("tensors",),
    ),
    Entry(
        "clip_grad_norm_",
        _l2_build,
        lambda tensors: clip_grad_norm_([_with_grad(t.clone()) for t in tensors], 1.0),
        lambda tensors: torch.linalg.vector_norm(torch.cat([d64(t).flatten() for t in tensors])),
        dtypes=(torch.float32,),
    ),
]


def _dtype(x):
    """The module's parameter dtype: the input's (float32 when the input is not even a tensor)."""
    return x.dtype if isinstance(x, torch.Tensor) and x.is_floating_point() else torch.float32


def _with_grad(g: torch.Tensor) -> torch.Tensor:
    p = torch.zeros(g.shape, dtype=g.dtype, device=g.device)
    p.grad = g
    return p


ENTRIES = OPS + MODULES


def names_argument(message: str, name: str) -> bool:
    """Whether an error message names ``name`` as a word (``x`` must not be found inside ``max``)."""
    import re

    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message) is not None
