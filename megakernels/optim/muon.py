"""Muon: momentum orthogonalised by a Newton-Schulz iteration for the hidden matrices, AdamW for everything else, in
one ``torch.optim`` optimizer.

Per step and Muon parameter ``W`` ``[m, n]`` (or a stack ``[E, m, n]`` of expert matrices) with gradient ``G``::

    B = momentum * B + (1 - momentum) * G              the momentum buffer (torch.optim.Muon's form)
    U = G + momentum * (B - G)   (nesterov)   or   B
    O = NS(U)                                          per logical matrix (below), megakernels.ops.muon
    W = W * (1 - lr * weight_decay) - lr * scale(m', n') * O

``scale`` makes the update's RMS comparable across shapes (``lr_scale``): ``"match_rms_adamw"`` (Moonlight's
``0.2 * sqrt(max(m', n'))``: the update has AdamW's typical RMS, so AdamW's learning rate and weight decay carry
over), ``"original"`` (``sqrt(max(1, m'/n'))``, Keller Jordan's) or ``"spectral_unclamped"`` (``sqrt(m'/n')``),
with ``(m', n')`` the shape of the logical matrix orthogonalised.

Logical matrices. A fused weight (the QKV projection, the packed gate/up projection of SwiGLU) holds several
matrices in its rows; orthogonalising the concatenation would couple them. The weights the library's layers build
carry a ``fused`` mark (``megakernels.parallel.params.mark_fused``: parts, head size, row order) and ``split``
chooses: ``"projection"`` (the default: each projection on its own, all heads together: Q, K, V; gate, up),
``"head"`` (each head of each projection on its own) or ``"none"`` (the whole weight as one matrix). The
matrices of one shape (the layers of a model, the experts of a layer) go through the kernel as one batch.

Parameter groups. ``Muon(model)`` groups by rule (``muon_param_groups``): matrices (2-D, or 3-D stacks of expert
matrices) of hidden layers to Muon; embeddings and output tables (any ``nn.Embedding`` or
``megakernels.parallel.VocabParallelEmbedding``, ``lm_head``), router weights (a mixture-of-experts gate), norms
and biases (fewer than 2 dims) to AdamW, computed by ``FusedAdamW``'s multi-tensor kernel. Groups given by hand
carry ``"use_muon": True`` or ``False``. ``state_dict()`` holds both (``momentum_buffer`` for Muon parameters, as
torch.optim.Muon; ``step``/``exp_avg``/``exp_avg_sq`` for AdamW ones, as torch.optim.AdamW), and
``load_state_dict`` restores it.

The distributed form (data-parallel owners of whole matrices, tensor-parallel gathers): ``ParallelOptimizer``
(``megakernels.parallel.optimizer``) with ``optimizer="muon"``, on the functions of this module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from megakernels.ops import _checks
from megakernels.ops import muon as _ns
from megakernels.optim.adamw import FusedAdamW, saved_step

LR_SCALES = ("match_rms_adamw", "original", "spectral_unclamped")
SPLITS = ("projection", "head", "none")
NS_DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}
COEFFICIENTS = _ns.COEFFICIENTS


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a weight's rows pack logical matrices (``megakernels.parallel.params``' fused mark)."""

    parts: int = 1
    head_dim: int | None = None
    head_major: bool = False


def layout_of(p: torch.Tensor) -> Layout:
    """The fused layout of ``p`` from its marks (one matrix when unmarked)."""
    from megakernels.parallel import params as marks  # not at import: megakernels.parallel imports this package

    rec = marks.info(p)
    return Layout(rec.fused_parts, rec.fused_head_dim, rec.fused_head_major)


def _canonical(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``x`` ``[..., rows, cols]`` as ``[..., parts, heads, head_dim, cols]`` (a view; permuted for head-major)."""
    *batch, rows, cols = x.shape
    d = layout.head_dim or rows // layout.parts
    if rows % (layout.parts * d):
        raise ValueError(
            f"muon: a weight of {rows} rows does not hold {layout.parts} parts"
            + (f" of heads of {layout.head_dim} rows" if layout.head_dim else "")
        )
    heads = rows // (layout.parts * d)
    if layout.head_major:
        return x.view(*batch, heads, layout.parts, d, cols).transpose(-4, -3)
    return x.view(*batch, layout.parts, heads, d, cols)


def split_matrices(x: torch.Tensor, layout: Layout, split: str) -> torch.Tensor:
    """The logical matrices of ``x`` ``[..., rows, cols]`` (leading dims: a stack of expert matrices) as one batch
    ``[k, m, n]`` (a copy where the rows interleave): ``split`` ``"none"`` one per ``[rows, cols]`` matrix,
    ``"projection"`` one per part, ``"head"`` one per head of each part."""
    rows, cols = x.shape[-2:]
    if split == "none" or (layout.parts == 1 and (split == "projection" or layout.head_dim is None)):
        return x.reshape(-1, rows, cols)
    c = _canonical(x, layout)
    heads, d = c.shape[-3], c.shape[-2]
    if split == "projection":
        return c.reshape(-1, heads * d, cols)
    return c.reshape(-1, d, cols)


def merge_matrices(blocks: torch.Tensor, layout: Layout, split: str, shape) -> torch.Tensor:
    """The inverse of ``split_matrices``: ``blocks`` ``[k, m, n]`` back in a tensor of ``shape``."""
    shape = tuple(shape)
    rows, cols = shape[-2:]
    if split == "none" or (layout.parts == 1 and (split == "projection" or layout.head_dim is None)):
        return blocks.reshape(shape)
    d = layout.head_dim or rows // layout.parts
    heads = rows // (layout.parts * d)
    c = blocks.reshape(*shape[:-2], layout.parts, heads, d, cols)
    if layout.head_major:
        c = c.transpose(-4, -3)
    return c.reshape(shape)


def update_scale(rows: int, cols: int, rule: str) -> float:
    """The factor on the orthogonalised update of a ``[rows, cols]`` matrix (module docstring)."""
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "spectral_unclamped":
        return math.sqrt(rows / cols)
    raise ValueError(f"muon: lr_scale must be one of {list(LR_SCALES)}, got {rule!r}")


def momentum_input(buf: torch.Tensor, grad: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Advance the momentum buffer ``buf`` by ``grad`` in place and return what Newton-Schulz orthogonalises:
    the Nesterov look-ahead ``grad + momentum * (buf - grad)`` (a new tensor) or ``buf`` itself."""
    buf.lerp_(grad.to(buf.dtype), 1.0 - momentum)
    return grad.to(buf.dtype).lerp(buf, momentum) if nesterov else buf


def ns_dtype_for(device: torch.device, ns_dtype) -> torch.dtype:
    """The Newton-Schulz dtype: ``ns_dtype`` (``"bf16"``, ``"fp32"`` or a torch dtype), or for ``"auto"``/None
    bfloat16 on CUDA and float32 elsewhere (a CPU has no bfloat16 matrix units worth the rounding)."""
    if isinstance(ns_dtype, torch.dtype):
        return ns_dtype
    dtype = NS_DTYPES.get("auto" if ns_dtype is None else ns_dtype, "unknown")
    if dtype == "unknown":
        raise ValueError(f"muon: ns_dtype must be one of {list(NS_DTYPES)} or a torch dtype, got {ns_dtype!r}")
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return dtype


def orthogonalize(
    batches: list[torch.Tensor],
    *,
    steps: int = 5,
    coefficients=COEFFICIENTS,
    eps: float = _ns.EPS,
    ns_dtype=None,
    lr_scale: str = "match_rms_adamw",
) -> list[torch.Tensor]:
    """Newton-Schulz of every matrix of ``batches`` (each ``[k, m, n]``), those of one shape and device in one
    kernel call, each multiplied by its ``update_scale``; returns fp32 tensors shaped like ``batches``."""
    by_shape: dict[tuple, list[int]] = {}
    for i, b in enumerate(batches):
        by_shape.setdefault((b.device, b.dtype, tuple(b.shape[1:])), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(batches)
    for (device, _dtype, (m, n)), idx in by_shape.items():
        stack = torch.cat([batches[i] for i in idx]) if len(idx) > 1 else batches[idx[0]]
        o = _ns.newton_schulz(stack, steps, coefficients, eps, ns_dtype_for(device, ns_dtype))
        o = o.float().mul_(update_scale(m, n, lr_scale))
        at = 0
        for i in idx:
            k = batches[i].shape[0]
            out[i] = o[at : at + k]
            at += k
    return out


# ---- parameter groups --------------------------------------------------------------------------------------


def _table_types() -> tuple[type, ...]:
    from megakernels.parallel.embedding import VocabParallelEmbedding

    return (nn.Embedding, VocabParallelEmbedding)


def _router_types() -> tuple[type, ...]:
    from megakernels.parallel.moe.router import TopKRouter

    return (TopKRouter,)


_HEAD_NAMES = ("lm_head", "output_layer", "output_embedding")
_ROUTER_LEAVES = ("router", "gate")  # a mixture-of-experts gate (Mixtral's block_sparse_moe.gate, Qwen's mlp.gate)


def is_muon_matrix(name: str, p: torch.Tensor, module: nn.Module) -> bool:
    """The rule of ``muon_param_groups`` for one parameter ``name`` of ``module`` (its owner): a 2-D matrix, or a
    3-D stack of expert matrices, of a hidden layer — not an embedding or output table, not a router."""
    if p.dim() not in (2, 3) or (p.dim() == 3 and not _is_expert_stack(p)):
        return False
    if isinstance(module, _table_types() + _router_types()):
        return False
    parts = name.split(".")
    if any(part in _HEAD_NAMES for part in parts):
        return False
    owner = parts[-2] if len(parts) > 1 else ""
    return owner not in _ROUTER_LEAVES


def _is_expert_stack(p) -> bool:
    from megakernels.parallel import params as marks

    return marks.is_expert_parallel(p)


def muon_param_groups(
    model: nn.Module, *, exclude: Callable[[str, torch.Tensor], bool] | None = None, **muon_options
) -> list[dict]:
    """``[{"params": matrices, "use_muon": True, **muon_options}, {"params": the rest, "use_muon": False}]`` for
    the trainable parameters of ``model`` by ``is_muon_matrix`` (a parameter shared by several modules, such as a
    tied embedding, goes to AdamW if any of them says so); ``exclude(name, p)`` True sends more to AdamW. Empty
    groups are left out."""
    matrices, rest, seen = [], [], {}
    for mod_name, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            name = f"{mod_name}.{leaf}" if mod_name else leaf
            ok = is_muon_matrix(name, p, module) and not (exclude is not None and exclude(name, p))
            seen[id(p)] = (p, seen.get(id(p), (p, True))[1] and ok)
    for p, ok in seen.values():
        (matrices if ok else rest).append(p)
    groups = []
    if matrices:
        groups.append({"params": matrices, "use_muon": True, **muon_options})
    if rest:
        groups.append({"params": rest, "use_muon": False})
    return groups


# ---- the optimizer -----------------------------------------------------------------------------------------


def check_muon_hypers(where: str, group: dict) -> None:
    """The Muon hyper-parameters of ``group`` (lr, weight_decay, momentum, ns_steps, lr_scale, split, ns_dtype).

    Raises:
        ValueError / TypeError naming the entry and the rule.
    """
    lr = _checks.real(where, "lr", group["lr"], minimum=0.0)
    del lr
    _checks.real(where, "weight_decay", group["weight_decay"], minimum=0.0)
    momentum = _checks.real(where, "momentum", group["momentum"], minimum=0.0)
    if momentum >= 1.0:
        raise ValueError(f"{where}: momentum must be in [0, 1), got {momentum}")
    _checks.integer(where, "ns_steps", group["ns_steps"], minimum=1)
    _ns.check_input(where, torch.zeros(1, 1), group["ns_steps"], group["ns_coefficients"], group["eps"])
    if group["lr_scale"] not in LR_SCALES:
        raise ValueError(f"{where}: lr_scale must be one of {list(LR_SCALES)}, got {group['lr_scale']!r}")
    if group["split"] not in SPLITS:
        raise ValueError(f"{where}: split must be one of {list(SPLITS)}, got {group['split']!r}")
    if not isinstance(group["ns_dtype"], torch.dtype) and group["ns_dtype"] not in NS_DTYPES:
        raise ValueError(
            f"{where}: ns_dtype must be one of {list(NS_DTYPES)} or a torch dtype, got {group['ns_dtype']!r}"
        )


class Muon(torch.optim.Optimizer):
    """Muon for the hidden matrices and AdamW for the rest, in one optimizer (module docstring).

    Args:
        params: an ``nn.Module`` (grouped by ``muon_param_groups``), or parameters or groups as for any torch
            optimizer: plain parameters all go to Muon (each must be a matrix); a group goes to Muon unless it
            says ``"use_muon": False``.
        lr: the learning rate of every group (default 1e-3: with ``lr_scale="match_rms_adamw"``, an AdamW rate).
        weight_decay: decoupled, ``W *= 1 - lr * weight_decay`` (default 0.1).
        momentum, nesterov: the momentum (in [0, 1), default 0.95) and its Nesterov form (default True).
        ns_steps, ns_coefficients, eps: the Newton-Schulz iteration (5 steps; ``(3.4445, -4.7750, 2.0315)``;
            the norm's floor 1e-7).
        lr_scale: ``"match_rms_adamw"`` (default), ``"original"`` or ``"spectral_unclamped"``.
        split: the logical matrices of fused weights, ``"projection"`` (default), ``"head"`` or ``"none"``.
        ns_dtype: ``"auto"`` (bfloat16 on CUDA, float32 on the CPU), ``"bf16"``, ``"fp32"`` or a torch dtype.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW groups' (defaults: ``lr``,
            ``(0.9, 0.95)``, 1e-8, ``weight_decay``).

    Muon parameters: float32/float16/bfloat16, dense, of 2 or more dims (the last two the matrix; leading dims a
    stack of matrices orthogonalised one by one); the momentum buffer has the parameter's dtype.

    Raises (naming the argument): ValueError for a hyper-parameter out of range, an unknown ``lr_scale``,
    ``split`` or ``ns_dtype``, a Muon parameter of fewer than 2 dims; TypeError for a non-float parameter;
    RuntimeError for a sparse gradient; FusedAdamW's errors for the AdamW groups.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: tuple[float, float, float] = COEFFICIENTS,
        eps: float = _ns.EPS,
        lr_scale: str = "match_rms_adamw",
        split: str = "projection",
        ns_dtype="auto",
        *,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
    ) -> None:
        if isinstance(params, nn.Module):
            params = muon_param_groups(params)
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self._adamw_defaults = dict(
            lr=lr if adamw_lr is None else adamw_lr,
            betas=tuple(adamw_betas),
            eps=adamw_eps,
            weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay,
            amsgrad=False,
            maximize=False,
        )
        self._adamw: FusedAdamW | None = None
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=bool(nesterov),
            ns_steps=ns_steps,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            lr_scale=lr_scale,
            split=split,
            ns_dtype=ns_dtype,
            use_muon=True,
        )
        super().__init__(groups, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """Adds a group: a Muon group (the Muon defaults fill it) or, with ``"use_muon": False``, an AdamW group
        (the AdamW defaults fill it; checked by FusedAdamW)."""
        group = dict(param_group)
        if not group.get("use_muon", True):
            for k, v in self._adamw_defaults.items():
                group.setdefault(k, v)
            for k in [k for k in group if k not in self._adamw_defaults and k not in ("params", "use_muon")]:
                raise ValueError(f"Muon: an AdamW group (use_muon=False) takes no {k!r}")
        super().add_param_group(group)
        group = self.param_groups[-1]
        where = f"Muon: param_groups[{len(self.param_groups) - 1}]"
        if group["use_muon"]:
            check_muon_hypers(where, group)
            for i, p in enumerate(group["params"]):
                FusedAdamW.check_param(p, i)
                if p.dim() < 2:
                    raise ValueError(
                        f"{where}: params[{i}] has shape {tuple(p.shape)}; Muon orthogonalises matrices (2 or "
                        "more dims): put vectors in a group with use_muon=False"
                    )
        self._link()

    def _link(self) -> None:
        """The AdamW part: a FusedAdamW over this optimizer's AdamW groups (the same dicts) and its state."""
        adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        if not adam_groups:
            self._adamw = None
            return
        if self._adamw is None:
            self._adamw = FusedAdamW([{"params": list(adam_groups[0]["params"])}])
        self._adamw.param_groups = adam_groups
        self._adamw.state = self.state
        for g in adam_groups:
            for i, p in enumerate(g["params"]):
                FusedAdamW.check_param(p, i)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        """One step: Muon on the Muon groups, FusedAdamW on the AdamW groups. Returns the closure's loss or None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._link()
        for gi, group in enumerate(self.param_groups):
            if group["use_muon"]:
                self._muon_group(gi, group)
        if self._adamw is not None:
            self._adamw.step()
        return loss

    def _muon_group(self, gi: int, group: dict) -> None:
        check_muon_hypers(f"Muon: param_groups[{gi}]", group)
        params, inputs, layouts = [], [], []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse or p.grad.layout != torch.strided:
                raise RuntimeError(f"Muon: param_groups[{gi}].params[{i}] has a sparse gradient; not supported")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            u = momentum_input(state["momentum_buffer"], p.grad, group["momentum"], group["nesterov"])
            layout = layout_of(p)
            params.append(p)
            layouts.append(layout)
            inputs.append(split_matrices(u, layout, group["split"]))
        updates = orthogonalize(
            inputs,
            steps=group["ns_steps"],
            coefficients=group["ns_coefficients"],
            eps=group["eps"],
            ns_dtype=group["ns_dtype"],
            lr_scale=group["lr_scale"],
        )
        lr, wd = group["lr"], group["weight_decay"]
        for p, layout, o in zip(params, layouts, updates):
            o = merge_matrices(o, layout, group["split"], p.shape)
            p.mul_(1.0 - lr * wd).add_(o.to(p.dtype), alpha=-lr)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores ``state_dict()``: the Muon momentum buffers and the AdamW part as ``FusedAdamW`` does
        (float32 ``step`` tensors placed as it places them).

        Raises:
            ValueError: a saved AdamW state without a valid ``step``; torch's errors for mismatched groups.
        """
        saved_groups = state_dict["param_groups"]
        adam_saved = [g for g in saved_groups if not g.get("use_muon", True)]
        adam_ids = {i for g in adam_saved for i in g["params"]}
        for idx, st in state_dict["state"].items():
            if idx in adam_ids:
                saved_step(idx, st)
        super().load_state_dict(state_dict)
        self._link()
        if self._adamw is not None:
            self._adamw.restore_loaded(state_dict["state"], adam_saved)
