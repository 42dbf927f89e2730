"""fp32 GEMMs on the CPU through oneDNN, where oneDNN is measured faster here: ``mm``, ``linear`` (autograd) and
``linear_nograd``.

PyTorch runs an fp32 ``mm`` / ``F.linear`` on the CPU through MKL's sgemm. Which of it and oneDNN's fp32 GEMM
(``torch.ops.mkldnn._linear_pointwise``, the op Inductor's CPU backend uses) is faster depends on the machine: on an
AMD CPU with AVX-512, MKL takes its AVX2 path and oneDNN's AVX-512 kernel runs about twice as fast (fp32 products and
sums either way), while on one with AVX2 only the two run alike (the recorded runs: docs/benchmarks.md). So the route
is chosen by measurement, never by the CPU's vendor or model:
``choice()`` times both on a training step's products (``MEASURED``) at this process's thread count, takes oneDNN
when it needs at most ``ONEDNN_AT_MOST`` of PyTorch's time, and caches the outcome per CPU (model and flags),
thread count and torch version in ``host.cache_dir()/cpu_gemm_route.json`` (as the trainer caches its CPU peak),
so the measurement runs once per machine (a machine busy with other work can time either slower: removing the file
measures again). ``MEGAKERNELS_CPU_GEMM=onednn`` or ``torch`` sets the route instead (``auto``, the default: the
measured one).

The layers of this package (the trainer's column/row-parallel linears, the tied LM head, the patched transformers
linears) call these functions instead of ``torch.mm`` / ``F.linear``; they route a product to oneDNN when all of
these hold, and to PyTorch otherwise (nothing changes):

- nothing is being compiled, and every operand is a plain ``torch.Tensor`` or ``nn.Parameter`` (no fake,
  functional or DTensor subclass: compiling and tracing see PyTorch's ops) on the CPU, in fp32;
- the product is at least ``MIN_FLOPS`` multiply-adds (oneDNN's call costs ~12 us, MKL's ~2 us: below this size
  MKL is as fast);
- oneDNN is built in (``torch.backends.mkldnn.is_available()``) and the route is oneDNN (``route()``).

``mm`` and ``linear_nograd`` record no autograd history (for use inside autograd functions); ``linear`` is
differentiable (its backward's two products routed the same way, ``db`` a column sum).
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F

from megakernels import host

MIN_FLOPS = 1 << 21  # multiply-adds (m n k) from which oneDNN's fp32 GEMM is ahead on the CPU (measured: ~1.15x)
ENV = "MEGAKERNELS_CPU_GEMM"
ROUTES = ("onednn", "torch")
# The products timed to choose the route (m, k, n; a [m, k] by a weight's [n, k]ᵀ, as F.linear takes it): a GPT-2
# small layer's QKV and MLP-down forward at 512 tokens and its MLP-up weight gradient (dyᵀ x).
MEASURED = ((512, 768, 2304), (512, 3072, 768), (3072, 512, 768))
# oneDNN is chosen when it needs at most this share of PyTorch's time: a tie stays with PyTorch's own op, and the
# margin keeps a noisy measurement from choosing a route that is no faster.
ONEDNN_AT_MOST = 0.9
_TRIALS = 5
CACHE_FILE = "cpu_gemm_route.json"

_BUILT_IN = torch.backends.mkldnn.is_available()
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_chosen: dict[str, dict] = {}  # this process's choices, by cache key


def available() -> bool:
    """oneDNN is built into this torch."""
    return _BUILT_IN


def _override() -> str | None:
    """``MEGAKERNELS_CPU_GEMM``'s route (None: ``auto`` or unset).

    Raises:
        ValueError: another value, naming the variable and the choices.
    """
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value == "auto":
        return None
    if value not in ROUTES:
        raise ValueError(f"{ENV} must be one of auto, {', '.join(ROUTES)}, got {os.environ[ENV]!r}")
    return value


def measure(trials: int = _TRIALS) -> dict:
    """Time PyTorch's ``F.linear`` and oneDNN's GEMM on the ``MEASURED`` products at this process's thread count,
    taking turns call by call, best of ``trials`` each (a busy machine can only slow a trial). Not cached.

    Returns:
        ``{"route": "onednn" | "torch", "onednn_s", "torch_s"}``: the sums of the best times over the products,
        and the route they give (oneDNN when ``onednn_s <= ONEDNN_AT_MOST * torch_s``).

    Raises:
        RuntimeError: oneDNN is not built in (``available()``).
    """
    if not _BUILT_IN:
        raise RuntimeError("megakernels.ops.gemm.measure: oneDNN is not built into this torch")
    g = torch.Generator().manual_seed(0)  # never the default generator: a training run's streams stay untouched
    total = {"onednn": 0.0, "torch": 0.0}
    with torch.no_grad():
        for m, k, n in MEASURED:
            x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
            fns = {"onednn": lambda: _onednn(x, w, None), "torch": lambda: F.linear(x, w)}
            best = dict.fromkeys(fns, float("inf"))
            for f in fns.values():  # warm-up: thread pool, packing buffers
                f()
            for _ in range(trials):
                for name, f in fns.items():
                    t0 = time.perf_counter()
                    f()
                    best[name] = min(best[name], time.perf_counter() - t0)
            for name in total:
                total[name] += best[name]
    route = "onednn" if total["onednn"] <= ONEDNN_AT_MOST * total["torch"] else "torch"
    return {"route": route, "onednn_s": total["onednn"], "torch_s": total["torch"]}


def _cache_key() -> str:
    return f"{host.cpu_key()}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def _cache_path() -> str:
    return os.path.join(host.cache_dir(), CACHE_FILE)


def _read_cache() -> dict:
    try:
        with open(_cache_path(), encoding="utf-8") as f:
            cache = json.load(f)
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, record: dict) -> None:
    path = _cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        cache = _read_cache()
        cache[key] = record
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(cache, f, indent=1)
        os.replace(tmp, path)  # concurrent writers: the last complete file wins, never a torn one
    except OSError:
        pass  # an unwritable cache costs a measurement in the next process, nothing else


def choice() -> dict:
    """This machine's measured route at this thread count: ``measure()``'s record with ``"source"`` —
    ``"measured"`` (now, and written to the cache) or ``"cache"`` (``host.cache_dir()/cpu_gemm_route.json``).
    Measured once per process and cache key; ``{"route": "torch", "source": "no oneDNN"}`` without oneDNN."""
    if not _BUILT_IN:
        return {"route": "torch", "source": "no oneDNN"}
    key = _cache_key()
    if key in _chosen:
        return _chosen[key]
    cached = _read_cache().get(key)
    if isinstance(cached, dict) and cached.get("route") in ROUTES:
        record = {**cached, "source": "cache"}
    else:
        record = measure()
        _write_cache(key, record)
        record = {**record, "source": "measured"}
    _chosen[key] = record
    return record


def route() -> str:
    """Where an eligible fp32 CPU product goes: ``MEGAKERNELS_CPU_GEMM``'s route when it names one, else the
    measured one (``choice()``); ``"torch"`` without oneDNN.

    Raises:
        ValueError: ``MEGAKERNELS_CPU_GEMM`` is not auto, onednn or torch.
    """
    forced = _override()
    if not _BUILT_IN:
        return "torch"
    return forced or choice()["route"]


def describe() -> dict:
    """The route and why, for a results file: ``{"route", "source": "MEGAKERNELS_CPU_GEMM" | "measured" |
    "cache" | "no oneDNN", "onednn_s", "torch_s" (when measured), "threads"}``."""
    forced = _override()
    if forced is not None and _BUILT_IN:
        return {"route": forced, "source": ENV, "threads": torch.get_num_threads()}
    return {**choice(), "threads": torch.get_num_threads()}


def enabled() -> bool:
    """oneDNN is built in and the route is oneDNN (``route()``: measured, or ``MEGAKERNELS_CPU_GEMM``)."""
    return _BUILT_IN and route() == "onednn"


def routed(a: torch.Tensor, b: torch.Tensor, m: int, n: int, k: int) -> bool:
    """Whether the product of ``a`` and ``b`` (``m x k`` by ``k x n``) goes to oneDNN (module docstring): never where
    autograd would record it (oneDNN's op has no derivative: a backward with ``create_graph`` runs PyTorch's)."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return False
    return _eligible(a, b, m, n, k)


def _eligible(a: torch.Tensor, b: torch.Tensor, m: int, n: int, k: int) -> bool:
    if m * n * k < MIN_FLOPS or torch.compiler.is_compiling():  # a compiled graph holds PyTorch's ops
        return False
    return (
        type(a) in _PLAIN
        and type(b) in _PLAIN
        and a.device.type == "cpu"
        and b.device.type == "cpu"
        and a.dtype == torch.float32
        and b.dtype == torch.float32
        and enabled()
    )


def _onednn(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x2 wᵀ (+ bias)``: ``x2`` ``[m, k]``, ``w`` ``[n, k]`` (either may be a transposed view)."""
    if bias is not None and (type(bias) is not torch.Tensor or bias.dtype != torch.float32):
        return _onednn(x2, w, None) + bias
    return torch.ops.mkldnn._linear_pointwise(x2, w, bias, "none", [], "")


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D ``a`` ``[m, k]`` and ``b`` ``[k, n]`` (no autograd history when routed)."""
    if a.dim() == 2 and b.dim() == 2 and routed(a, b, a.shape[0], b.shape[1], a.shape[1]):
        return _onednn(a, b.t(), None)
    return torch.mm(a, b)


def linear_nograd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[..., k]``, ``weight`` ``[n, k]`` (no autograd history when
    routed)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if weight.dim() == 2 and routed(x, weight, rows, weight.shape[0], k):
        return _onednn(x.reshape(rows, k), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class _Linear(torch.autograd.Function):
    """``y = x Wᵀ + b`` with the three products through ``mm`` / ``linear_nograd``."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear_nograd(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = mm(dy2, weight).view(x.shape)
        if ctx.needs_input_grad[1]:
            dw = mm(dy2.t(), x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, differentiable; routed to oneDNN (forward and backward) where ``routed`` says
    so for the forward's product, and ``F.linear`` itself otherwise (its autograd, create_graph included)."""
    if x.dtype != torch.float32 or not x.is_cpu:  # the common cases first: a GPU, 16-bit training
        return F.linear(x, weight, bias)
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if weight.dim() == 2 and _eligible(x, weight, rows, weight.shape[0], k):
        return _Linear.apply(x, weight, bias)
    return F.linear(x, weight, bias)
