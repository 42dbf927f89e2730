"""FusedAdamW: torch.optim.AdamW's algorithm as one multi-tensor kernel pass per (device, dtype) group.

Per step and parameter (torch.optim.AdamW's order of operations; fp32 arithmetic)::

    t   = step + 1
    p   = p * (1 - lr * weight_decay)                    decoupled weight decay
    m   = m + (1 - beta1) * (g - m)                      first moment
    v   = beta2 * v + (1 - beta2) * g * g                second moment
    p   = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

State per parameter: ``step`` (float32 scalar tensor: on the CPU for CPU params, as torch's default AdamW keeps
it; on the param's device for CUDA params, as torch's fused/capturable AdamW keeps it), ``exp_avg`` and
``exp_avg_sq``, plus ``master_param`` in master-weight mode. ``state_dict()`` therefore loads into
torch.optim.AdamW and back.

Mixed precision (``master_weights=True``): a bf16/fp16 parameter gets an fp32 ``master_param`` and fp32 moments;
the update runs on the master and writes the rounded value into the parameter in the same pass. fp32 parameters
are updated directly either way. The master copy is taken at the first step: load new values into the model
*before* the first step (or load an optimizer state_dict, which carries the masters).

Rounded copies (``set_rounded_copies``): an fp32 parameter may have a bf16/fp16 copy that the kernel writes, rounded,
in the same pass as the update: a trainer that keeps the fp32 masters (and fp32 gradient buffers) as the optimizer's
parameters and the 16-bit model weights as their copies saves a copy pass per step
(``megakernels.parallel.ParallelOptimizer``).

Loss scaling: ``step(grad_scale=s, found_inf=f)`` divides every grad by ``s`` inside the kernel and first runs a
fused check over all grads of all groups; if any unscaled grad is inf or NaN, ``f`` is set to 1.0 and the step
changes nothing (params, moments, step counts). On CUDA the flag never leaves the device: the update kernels read
it and return early, so there is no host synchronisation. Without ``grad_scale``/``found_inf`` there is no check
(torch.optim.AdamW's behaviour: non-finite grads propagate). ``step(..., check=False)`` skips the check pass and
only obeys ``found_inf``, for a caller that has vetted the grads already (``ParallelOptimizer`` derives the flag
from the global grad norm it computes anyway). ``torch.amp.GradScaler.step(opt)`` works too: like
torch's fused optimizers, FusedAdamW declares ``_step_supports_amp_scaling`` and takes the scale and the flag from
the attributes the scaler sets, so the grads are unscaled inside the kernel rather than by a separate pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megakernels.ops import _checks
from megakernels.ops import multi_tensor as _mt

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HALF = (torch.float16, torch.bfloat16)


def _hyper(name: str, value) -> float:
    if isinstance(value, torch.Tensor):
        raise TypeError(
            f"FusedAdamW: {name} must be a Python number, got a tensor; tensor {name} (for "
            f"CUDA-graph capture) is not supported, pass float({name})"
        )
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"FusedAdamW: {name} must be a number, got {type(value).__name__}")
    return float(value)


def _check_hypers(lr, betas, eps, weight_decay) -> None:
    lr = _hyper("lr", lr)
    if not (lr >= 0.0 and lr != float("inf")):
        raise ValueError(f"FusedAdamW: lr must be a finite number >= 0, got {lr}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"FusedAdamW: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        b = _hyper(f"betas[{i}]", b)
        if not 0.0 <= b < 1.0:
            raise ValueError(f"FusedAdamW: betas[{i}] must be in [0, 1), got {b}")
    eps = _hyper("eps", eps)
    if not (eps >= 0.0 and eps != float("inf")):
        raise ValueError(f"FusedAdamW: eps must be a finite number >= 0, got {eps}")
    weight_decay = _hyper("weight_decay", weight_decay)
    if not (weight_decay >= 0.0 and weight_decay != float("inf")):
        raise ValueError(f"FusedAdamW: weight_decay must be a finite number >= 0, got {weight_decay}")


def saved_step(idx, state: dict) -> float:
    """The ``step`` of one parameter's saved state: a finite number >= 0, as a Python number or a one-element
    real tensor (torch.optim.AdamW saves a float32 scalar tensor)."""
    where = f"FusedAdamW.load_state_dict: state[{idx!r}]['step']"
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"FusedAdamW.load_state_dict: state[{idx!r}] has no 'step' entry")
    step = state["step"]
    if isinstance(step, torch.Tensor):
        if (
            step.numel() != 1
            or step.is_complex()
            or step.dtype == torch.bool
            or step.layout != torch.strided
            or step.device.type == "meta"
        ):
            raise ValueError(
                f"{where} must be a number or a one-element real tensor with a value, got a "
                f"{step.layout} {step.dtype} tensor of shape {tuple(step.shape)} on {step.device}"
            )
        step = step.item()
    value = _checks.real("FusedAdamW.load_state_dict", f"state[{idx!r}]['step']", step, minimum=0.0)
    return value


def _step_device(p: torch.Tensor) -> torch.device:
    return p.device if p.device.type == "cuda" else torch.device("cpu")


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with multi-tensor fused kernels on CPU and CUDA.

    Args:
        params: parameters or param groups (dicts), as for any torch optimizer. float32, float16 or bfloat16,
            dense, contiguous; CPU or CUDA.
        lr, betas, eps, weight_decay: as torch.optim.AdamW (defaults 1e-3, (0.9, 0.999), 1e-8, 1e-2); read from
            each param group at every step, so lr schedulers work. Python numbers only (no tensor lr).
        master_weights: keep fp32 master weights and fp32 moments for bf16/fp16 parameters (mixed precision).
        chunk_size: elements per multi-tensor chunk (0: the kernels' default, 65536); for tests and tuning.

    Raises (at construction or step, naming the argument): ValueError for lr/eps/weight_decay < 0 or betas outside
    [0, 1), TypeError for a tensor lr or a complex / non-float parameter, RuntimeError for a sparse gradient,
    NotImplementedError for amsgrad / maximize groups (e.g. loaded from a torch state_dict).
    """

    # torch.amp.GradScaler.step then skips its own unscale pass and sets `grad_scale` / `found_inf` on the optimizer.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        master_weights: bool = False,
        chunk_size: int = 0,
    ) -> None:
        _check_hypers(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False)
        self.master_weights = bool(master_weights)
        self.chunk_size = int(chunk_size)
        self._rounded: dict[torch.Tensor, torch.Tensor] = {}
        self._grads_of: dict[torch.Tensor, torch.Tensor] = {}
        super().__init__(params, defaults)

    def set_rounded_copies(
        self, copies: dict[torch.Tensor, torch.Tensor], grads: dict[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """After this, every step that updates an fp32 param ``p`` of ``copies`` also writes ``p`` rounded to
        ``copies[p]``'s dtype into ``copies[p]``, in the same kernel pass (the copy equals ``p.to(dtype)``, bit for
        bit); a skipped step (``found_inf``) writes nothing. Replaces the copies set before (an empty dict: none).

        Args:
            copies: ``{param: copy}``: each param float32 and in this optimizer's param groups, each copy a
                contiguous bfloat16/float16 tensor of the param's shape on its device (it need not require grad;
                e.g. a view of a model's 16-bit weights).
            grads: ``{param: grad}`` for params of ``copies`` whose gradient is read from ``grad`` instead of
                ``param.grad``: a tensor of the copy's dtype, shape and device (e.g. a view of 16-bit gradient
                buffers: the kernel reads 16-bit gradients as it does for 16-bit params with fp32 masters, with no
                fp32 copy of them). Replaces the ones set before.

        Raises:
            ValueError / TypeError naming the entry: a param not in the groups or not float32, a copy of another
            shape, device or dtype, or not contiguous.
        """
        owned = {id(p) for group in self.param_groups for p in group["params"]}
        checked = {}
        for i, (p, copy) in enumerate(copies.items()):
            where = f"FusedAdamW.set_rounded_copies: entry {i}"
            if id(p) not in owned:
                raise ValueError(f"{where}: the param is not in this optimizer's param groups")
            if p.dtype != torch.float32:
                raise TypeError(f"{where}: the param has dtype {p.dtype}; rounded copies are of float32 params")
            if not isinstance(copy, torch.Tensor) or copy.dtype not in _HALF:
                raise TypeError(f"{where}: the copy must be a bfloat16 or float16 tensor")
            if copy.shape != p.shape or copy.device != p.device or not copy.is_contiguous():
                raise ValueError(
                    f"{where}: the copy must be contiguous, of the param's shape {tuple(p.shape)} on {p.device}; "
                    f"got shape {tuple(copy.shape)} on {copy.device}"
                    + ("" if copy.is_contiguous() else " (not contiguous)")
                )
            checked[p] = copy
        grads_of = {}
        for i, (p, g) in enumerate((grads or {}).items()):
            where = f"FusedAdamW.set_rounded_copies: grads entry {i}"
            copy = checked.get(p)
            if copy is None:
                raise ValueError(f"{where}: the param has no rounded copy")
            if not isinstance(g, torch.Tensor) or g.dtype != copy.dtype:
                raise TypeError(f"{where}: the grad must be a tensor of the copy's dtype {copy.dtype}")
            if g.shape != p.shape or g.device != p.device:
                raise ValueError(
                    f"{where}: the grad must have the param's shape {tuple(p.shape)} on {p.device}; got shape "
                    f"{tuple(g.shape)} on {g.device}"
                )
            grads_of[p] = g
        self._rounded, self._grads_of = checked, grads_of

    @staticmethod
    def check_param(p: torch.Tensor, i: int) -> None:
        """A parameter the kernels take: real float32/float16/bfloat16, dense (``i``: its index, for the message).

        Raises:
            TypeError: a complex or other non-float dtype. ValueError: a sparse parameter.
        """
        if p.is_complex():
            raise TypeError(
                f"FusedAdamW: params[{i}] is complex ({p.dtype}); not supported "
                "(view it as real with torch.view_as_real, or use torch.optim.AdamW)"
            )
        if p.dtype not in _DTYPES:
            raise TypeError(f"FusedAdamW: params[{i}] has dtype {p.dtype}; expected float32, float16 or bfloat16")
        if p.layout != torch.strided:
            raise ValueError(f"FusedAdamW: params[{i}] is {p.layout}; only dense parameters are supported")

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hypers(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        for i, p in enumerate(group["params"]):
            self.check_param(p, i)

    def _uses_master(self, p: torch.Tensor) -> bool:
        return self.master_weights and p.dtype in _HALF

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        master = self._uses_master(p)
        moment_dtype = torch.float32 if master else p.dtype
        state["step"] = torch.zeros((), dtype=torch.float32, device=_step_device(p))
        state["exp_avg"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.contiguous_format)
        if master:
            state["master_param"] = p.detach().to(torch.float32, copy=True).contiguous()

    def _collect(self):
        """Per param group: {(device, dtype): lists for the kernel}, initialising state on first use."""
        work = []
        for gi, group in enumerate(self.param_groups):
            if group.get("amsgrad", False):
                raise NotImplementedError(f"FusedAdamW: param_groups[{gi}] has amsgrad=True; not supported")
            if group.get("maximize", False):
                raise NotImplementedError(f"FusedAdamW: param_groups[{gi}] has maximize=True; not supported")
            _check_hypers(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            buckets: dict = {}
            for i, p in enumerate(group["params"]):
                g = self._grads_of.get(p)
                if g is None:
                    if p.grad is None:
                        continue
                    g = p.grad
                if g.is_sparse or g.layout != torch.strided:
                    raise RuntimeError(
                        f"FusedAdamW: param_groups[{gi}].params[{i}] has a sparse gradient; "
                        "AdamW does not support sparse gradients (use torch.optim.SparseAdam)"
                    )
                self.check_param(p, i)
                state = self.state[p]
                if len(state) == 0:
                    self._init_state(p, state)
                copy = self._rounded.get(p)
                # a rounded copy: the kernel's 16-bit param, with p as its fp32 master (fp32 or 16-bit grads)
                key = (p.device, p.dtype, copy.dtype if copy is not None else None, g.dtype)
                lists = buckets.setdefault(key, ([], [], [], [], [], []))
                lists[0].append(p if copy is None else copy)
                lists[1].append(g)
                lists[2].append(state["exp_avg"])
                lists[3].append(state["exp_avg_sq"])
                if copy is not None:
                    lists[4].append(p)
                elif self._uses_master(p):
                    lists[4].append(state["master_param"])
                lists[5].append(state["step"])
            work.append((group, buckets))
        return work

    def _check_nonfinite(self, work, grad_scale, found_inf) -> dict[torch.device, torch.Tensor]:
        """Runs the fused non-finite check over every grad of every group; returns the flag per device."""
        devices = {dev for _g, buckets in work for (dev, *_) in buckets}
        flags = {}
        for dev in devices:
            if found_inf is not None and found_inf.device == dev:
                flags[dev] = found_inf
            else:
                flags[dev] = torch.zeros((), dtype=torch.float32, device=dev)
        scales = {dev: grad_scale.to(dev) if grad_scale is not None else None for dev in devices}
        for _group, buckets in work:
            for (dev, *_), lists in buckets.items():
                _mt.nonfinite_check_(lists[1], flags[dev], scales[dev], self.chunk_size)
        if len(devices) > 1 or (found_inf is not None and found_inf.device not in devices):
            # Any device's overflow skips the step everywhere (device-to-device copies, no host sync).
            anchor = found_inf.device if found_inf is not None else next(iter(devices))
            total = torch.stack([f.reshape(()).to(anchor) for f in flags.values()]).amax()
            if found_inf is not None:
                found_inf.copy_(torch.maximum(found_inf.reshape(()), total).reshape(found_inf.shape))
            flags = {dev: total.to(dev).reshape(()) for dev in devices}
        return flags

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], torch.Tensor] | None = None,
        grad_scale: torch.Tensor | float | None = None,
        found_inf: torch.Tensor | None = None,
        *,
        check: bool = True,
    ):
        """One AdamW step over every parameter with a grad.

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).
            grad_scale: the loss scale; grads are divided by it inside the kernel (float32 scalar tensor or number).
            found_inf: float32 one-element tensor; set to 1.0 (and the step skipped) when any unscaled grad is not
                finite. A non-zero value on entry also skips the step.
            check: False: no pass over the grads to check them (``found_inf`` is read, never set): for a caller that
                knows whether the unscaled grads are finite, e.g. from their norm.
        Returns:
            The closure's loss, or None.
        """
        # torch.amp.GradScaler hands optimizers that declare _step_supports_amp_scaling the scale and the flag as
        # attributes (torch's own fused optimizers' contract) instead of unscaling the grads itself.
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if found_inf is not None:
            if not isinstance(found_inf, torch.Tensor) or found_inf.dtype != torch.float32 or found_inf.numel() != 1:
                raise TypeError("FusedAdamW.step: found_inf must be a float32 tensor with one element")
        if grad_scale is not None and not isinstance(grad_scale, torch.Tensor):
            grad_scale = torch.tensor(float(grad_scale), dtype=torch.float32)
        if grad_scale is not None:
            if grad_scale.numel() != 1 or not grad_scale.is_floating_point():
                raise TypeError("FusedAdamW.step: grad_scale must be a float scalar tensor (one element)")
            grad_scale = grad_scale.reshape(()).to(torch.float32)
        work = self._collect()
        flags = None
        if check and (grad_scale is not None or found_inf is not None):
            flags = self._check_nonfinite(work, grad_scale, found_inf)
        elif found_inf is not None:  # the caller's flag as it is, on every device of the params
            flags = {dev: found_inf.reshape(()).to(dev) for _g, buckets in work for (dev, *_) in buckets}
        for group, buckets in work:
            beta1, beta2 = group["betas"]
            for (dev, *_), (params, grads, exp_avgs, exp_avg_sqs, masters, steps) in buckets.items():
                _mt.adamw_(
                    params,
                    grads,
                    exp_avgs,
                    exp_avg_sqs,
                    masters,
                    steps,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    grad_scale=grad_scale.to(dev) if grad_scale is not None else None,
                    found_inf=flags[dev] if flags is not None else None,
                    chunk_size=self.chunk_size,
                )
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state saved by FusedAdamW or by torch.optim.AdamW (amsgrad=False).

        torch's loader casts moments to each param's dtype; in master-weight mode the fp32 moments and master
        copies are restored from the saved tensors instead, and a state without masters (e.g. from
        torch.optim.AdamW) starts its masters from the current params. Steps become float32 scalar tensors on
        the CPU (CPU params) or on the param's device (CUDA params).
        """
        saved_state = state_dict["state"]
        for idx, orig in saved_state.items():  # all checked before any change
            saved_step(idx, orig)
        super().load_state_dict(state_dict)
        self.restore_loaded(saved_state, state_dict["param_groups"])

    def restore_loaded(self, saved_state: dict, saved_groups: list[dict]) -> None:
        """After torch's ``Optimizer.load_state_dict``: the steps as float32 tensors placed like ``_init_state``'s,
        the fp32 moments and masters of master-weight mode. ``saved_groups`` pair with ``self.param_groups`` in
        order (``Muon`` passes its AdamW groups)."""
        for saved_group, group in zip(saved_groups, self.param_groups):
            for idx, p in zip(saved_group["params"], group["params"]):
                if idx not in saved_state or p not in self.state:
                    continue
                orig, state = saved_state[idx], self.state[p]
                step = saved_step(idx, orig)
                state["step"] = torch.tensor(step, dtype=torch.float32, device=_step_device(p))
                if self._uses_master(p):
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key] = orig[key].to(device=p.device, dtype=torch.float32).contiguous()
                    if "master_param" in orig:
                        state["master_param"] = orig["master_param"].to(device=p.device, dtype=torch.float32)
                    else:
                        state["master_param"] = p.detach().to(torch.float32, copy=True)
                    state["master_param"] = state["master_param"].contiguous()
                else:
                    state.pop("master_param", None)
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key] = state[key].contiguous()
