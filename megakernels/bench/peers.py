"""Optional peers compared side by side when installed: apex (FusedLayerNorm, FusedRMSNorm, FusedAdam), flash-attn
(``flash_attn_func``) and Liger-Kernel (LigerLayerNorm, LigerRMSNorm, LigerCrossEntropyLoss).

None is a dependency. A peer that cannot be imported, or whose kernels need CUDA on a CPU run, is skipped with one
note per peer (printed and written to the JSON), never an error. A peer that fails while being measured is dropped
from that row with a note (``Peers.failed``). Each hook returns callables with the same signature as the op's
eager baseline, so the family modules time them like any other implementation.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

# package -> (what it is, whether its kernels need CUDA)
PACKAGES = {"apex": ("NVIDIA apex", True), "flash_attn": ("flash-attn", True), "liger_kernel": ("Liger-Kernel", True)}


class Peers:
    """The optional peers importable on this machine for ``device``; ``notes`` says what was skipped and why."""

    def __init__(self, device: str = "cpu", enabled: bool = True):
        self.device, self.enabled = device, enabled
        self.notes: list[str] = []
        self._modules: dict[str, object | None] = {}

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def _attr(self, package: str, module: str, attr: str):
        """``module.attr`` of an optional ``package``, or None (with a note) when absent or unusable here."""
        if not self.enabled:
            return None
        label, needs_cuda = PACKAGES[package]
        if package not in self._modules:
            try:
                self._modules[package] = importlib.import_module(package)
            except Exception as e:  # an installed but broken peer is skipped too, not fatal
                self._modules[package] = None
                why = "not installed" if isinstance(e, ModuleNotFoundError) else f"import failed ({e})"
                self._note(f"peer {package} ({label}): {why}; skipped")
        if self._modules[package] is None:
            return None
        if needs_cuda and self.device != "cuda":
            self._note(f"peer {package} ({label}): installed, but its kernels need CUDA (--device cuda); skipped")
            return None
        try:
            return getattr(importlib.import_module(module), attr)
        except Exception as e:
            self._note(f"peer {package}: {module}.{attr} unavailable ({e}); skipped")
            return None

    def failed(self, name: str, what: str, error: Exception) -> None:
        """Record that peer ``name`` raised while measuring ``what`` (it is left out of that row)."""
        self._note(f"peer {name} failed on {what}: {type(error).__name__}: {error}")

    # ---- hooks, one per op family ----------------------------------------------------------------------------

    def norm(self, op: str) -> dict[str, Callable]:
        """Peers of ``layer_norm`` (x, w, b) and ``rms_norm`` (x, w): module classes applied with our parameters."""
        specs = {
            "layer_norm": [
                ("apex", "apex.normalization", "FusedLayerNorm", 1e-5),
                ("liger_kernel", "liger_kernel.transformers", "LigerLayerNorm", 1e-5),
            ],
            "rms_norm": [
                ("apex", "apex.normalization", "FusedRMSNorm", 1e-6),
                ("liger_kernel", "liger_kernel.transformers", "LigerRMSNorm", 1e-6),
            ],
        }
        out = {}
        for package, module, attr, eps in specs.get(op, []):
            cls = self._attr(package, module, attr)
            if cls is not None:
                out[package] = _module_applier(cls, eps)
        return out

    def adamw(self) -> dict[str, Callable]:
        """Peers of the AdamW step: ``factory(params, lr, weight_decay) -> optimizer``."""
        cls = self._attr("apex", "apex.optimizers", "FusedAdam")
        if cls is None:
            return {}
        return {
            "apex": lambda params, lr, weight_decay: cls(params, lr=lr, weight_decay=weight_decay, adam_w_mode=True)
        }

    def attention(self, dtype: torch.dtype) -> dict[str, Callable]:
        """Peers of FlashAttention: ``fn(q, k, v, causal)`` on ``[b, s, h, d]`` (flash-attn: fp16/bf16 only)."""
        fn = self._attr("flash_attn", "flash_attn", "flash_attn_func")
        if fn is None:
            return {}
        if dtype not in (torch.float16, torch.bfloat16):
            self._note(f"peer flash_attn: no {dtype} kernels; skipped for that dtype")
            return {}
        return {"flash_attn": lambda q, k, v, causal: fn(q, k, v, causal=causal)}

    def cross_entropy(self) -> dict[str, Callable]:
        """Peers of the mean cross-entropy: ``fn(logits, target) -> scalar``."""
        cls = self._attr("liger_kernel", "liger_kernel.transformers", "LigerCrossEntropyLoss")
        if cls is None:
            return {}
        loss = cls()
        return {"liger_kernel": lambda x, t: loss(x, t)}


def _module_applier(cls, eps: float) -> Callable:
    """``fn(x, *params)`` running module class ``cls(hidden, eps=eps)`` with our weight (and bias) substituted,
    so gradients reach the same leaves as every other implementation. One module per hidden size and device."""
    cache: dict = {}

    def apply(x, *params):
        key = (x.shape[-1], x.device, params[0].dtype)
        if key not in cache:
            cache[key] = cls(x.shape[-1], eps=eps).to(device=x.device, dtype=params[0].dtype)
        names = ("weight", "bias")[: len(params)]
        return torch.func.functional_call(cache[key], dict(zip(names, params)), (x,))

    return apply
