"""The experts of a mixture-of-experts layer: ``num_local`` MLPs run as two grouped GEMMs over their rows.

Parameters are stacked over the local experts: ``fc1`` ``[E_local, 2f/tp, h]`` (SwiGLU: each TP shard of an
expert holds its gate and up rows, stride 2) or ``[E_local, f/tp, h]`` (GeLU), ``fc2`` ``[E_local, h, f/tp]``. Expert
``e`` of the whole model is defined by the seed of its name (``experts.<e>.fc1``), so any (ep, tp) layout holds
exactly the weights of the single-process model. Each expert's MLP is split over the tensor-parallel ranks as a
dense MLP is (column-parallel fc1, row-parallel fc2): the output is a partial sum the MoE layer reduces over TP.

The grouped GEMMs go through ``_GroupedGemm``, whose backward is ``ops.grouped_gemm``'s own, except inside a
zero-bubble B pass (``pipeline.wgrad``): there it computes the input gradient and defers the weight gradients to
the W pass, each half computed as the whole backward computes it (``grouped_gemm_backward_parts``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megakernels.ops.grouped_gemm import grouped_gemm, grouped_gemm_backward, grouped_gemm_backward_parts
from megakernels.ops.swiglu import swiglu
from megakernels.parallel import fp8, init, state
from megakernels.parallel.params import mark_expert_parallel, mark_fused


class _GroupedGemm(torch.autograd.Function):
    """``grouped_gemm(x, weight, sizes)`` whose weight gradient a zero-bubble B pass can defer (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, sizes):
        from megakernels._backend import emulate_for

        ctx.weight = weight  # where a deferred weight gradient goes (the input, whatever its layout)
        x, weight = x.contiguous(), weight.contiguous()
        ctx.save_for_backward(x, weight, sizes)
        ctx.emulate = emulate_for("grouped_gemm", x)
        return grouped_gemm(x, weight, sizes)

    @staticmethod
    def backward(ctx, dout):
        from megakernels.parallel.pipeline import wgrad

        x, weight, sizes = ctx.saved_tensors
        dout = dout.contiguous()
        if not (ctx.needs_input_grad[1] and wgrad.deferring()):
            ctx.weight = None
            dx, dw = grouped_gemm_backward(dout, x, weight, sizes, ctx.emulate)
            return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None), None

        target, ctx.weight = ctx.weight, None

        def compute():
            wgrad.accumulate(target, grouped_gemm_backward_parts(dout, x, weight, sizes, "dw"))

        wgrad.push(compute, (dout, x))
        dx = grouped_gemm_backward_parts(dout, x, weight, sizes, "dx") if ctx.needs_input_grad[0] else None
        return dx, None, None


def _grouped_gemm(x, weight, sizes):
    return _GroupedGemm.apply(x, weight, sizes)


class GroupedMLP(nn.Module):
    """``num_local`` experts ``fc2(act(fc1(x)))`` on rows sorted by expert.

    Args:
        hidden_size, ffn_hidden_size: h and each expert's f (divisible by tp).
        num_experts: E of the whole layer; this rank holds ``[first, first + num_local)``.
        first, num_local: the local experts.
        activation: ``"swiglu"``, ``"gelu"`` (erf) or ``"gelu_tanh"``.
        bias: per-expert biases on fc1 and fc2 (zero at the start; module docstring).
        swiglu_limit, swiglu_alpha: the clamped SwiGLU's bound and slope (``ops.swiglu``); None: plain SwiGLU.
        seed: the layer's seed (each expert's weights from ``derive_seed(seed, "experts.<e>.fc1")``).
        init_method, output_init_method, device, dtype: as ``ParallelMLP``.

    ``forward(rows [N, h], group_sizes [num_local])`` -> ``[N, h]``, partial over the TP ranks.

    Raises:
        ValueError: ``swiglu_limit`` with an activation other than ``"swiglu"``.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        first: int,
        num_local: int,
        *,
        activation: str = "swiglu",
        bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.0,
        seed: int = 0,
        init_method: init.InitMethod | None = None,
        output_init_method: init.InitMethod | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        tp, r = state.tp_size(), state.tp_rank()
        state.check_divisible(ffn_hidden_size=ffn_hidden_size)
        if swiglu_limit is not None and activation != "swiglu":
            raise ValueError(f"GroupedMLP: swiglu_limit is the clamped SwiGLU's; activation is {activation!r}")
        self.swiglu_limit, self.swiglu_alpha, self.tp_rank = swiglu_limit, float(swiglu_alpha), r
        self.activation, self.first, self.num_local = activation, first, num_local
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.fp8 = None  # an ops.fp8.Fp8Recipe: the grouped GEMMs in FP8 (megakernels.parallel.fp8.enable)
        gated = activation == "swiglu"
        rows = (2 if gated else 1) * ffn_hidden_size
        self.fc1 = nn.Parameter(torch.empty(num_local, rows // tp, hidden_size, device=device, dtype=dtype))
        self.fc2 = nn.Parameter(torch.empty(num_local, hidden_size, ffn_hidden_size // tp, device=device, dtype=dtype))
        mark_expert_parallel(self.fc1, num_experts=num_experts, first=first, dim=0, stride=2 if gated else 1)
        mark_expert_parallel(self.fc2, num_experts=num_experts, first=first, dim=1)
        if gated:  # each expert's [gate; up]: two logical matrices (Muon orthogonalises each)
            mark_fused(self.fc1, parts=2)
        self.fc1_bias = self.fc2_bias = None
        if bias:
            self.fc1_bias = nn.Parameter(torch.zeros(num_local, rows // tp, device=device, dtype=dtype))
            self.fc2_bias = nn.Parameter(torch.zeros(num_local, hidden_size, device=device, dtype=dtype))
            mark_expert_parallel(self.fc1_bias, num_experts=num_experts, first=first, dim=0, stride=2 if gated else 1)
            mark_expert_parallel(self.fc2_bias, num_experts=num_experts, first=first, dim=0, replicas=tp)
        if self.fc1.device.type != "meta":
            normal = init_method or init.init_method_normal()
            for i in range(num_local):
                e = first + i
                init.init_shard_(
                    self.fc1[i],
                    (rows, hidden_size),
                    0,
                    r,
                    tp,
                    init.derive_seed(seed, f"experts.{e}.fc1"),
                    normal,
                    stride=2 if gated else 1,
                )
                init.init_shard_(
                    self.fc2[i],
                    (hidden_size, ffn_hidden_size),
                    1,
                    r,
                    tp,
                    init.derive_seed(seed, f"experts.{e}.fc2"),
                    output_init_method or normal,
                )

    def forward(self, rows: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        gemm1 = gemm2 = _grouped_gemm
        if self.fp8 is not None:
            tp, r, group = state.tp_size(), state.tp_rank(), state.tp_group()
            gated = self.activation == "swiglu"
            out_axis = fp8.Axis.of((2 if gated else 1) * self.ffn_hidden_size, r, tp, stride=2 if gated else 1)
            spec1 = fp8.ExpertSpec(self.fp8, group, column=True, out_axis=out_axis)
            spec2 = fp8.ExpertSpec(self.fp8, group, column=False, in_axis=fp8.Axis.of(self.ffn_hidden_size, r, tp))
            gemm1 = lambda x, w, s: fp8.grouped_linear(x, w, s, spec1)  # noqa: E731
            gemm2 = lambda x, w, s: fp8.grouped_linear(x, w, s, spec2)  # noqa: E731
        y = gemm1(rows, self.fc1, group_sizes)
        expert = None
        if self.fc1_bias is not None:  # each row's expert
            local = torch.arange(self.num_local, device=rows.device)
            expert = torch.repeat_interleave(local, group_sizes, output_size=rows.shape[0])
            y = y + self.fc1_bias[expert]
        if self.activation == "swiglu":
            y = swiglu(y, self.swiglu_limit, self.swiglu_alpha)
        else:
            y = F.gelu(y, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        y = gemm2(y, self.fc2, group_sizes)
        if expert is not None:  # once over the TP partial sums: rank 0's copy (the others' get a zero gradient)
            y = y + self.fc2_bias[expert] * (1.0 if self.tp_rank == 0 else 0.0)
        return y
