"""A peer's published GPU timings through the static model: ``megakernels bench --static --peer-csv FILE``.

Liger-Kernel publishes per-kernel timings (``benchmark/data/*.csv`` of its repository: ``kernel_name,
kernel_provider, kernel_operation_mode, metric_name, x_value, y_value_50, extra_benchmark_config_str, gpu_name,
liger_version``). For every ``liger`` row of an op we drive (``DRIVERS``), the liger-kernel version the row names
is imported from a scratch directory (``peer_path``), its Python entry points are run on fake CUDA tensors at the
row's shapes — exactly the launches its benchmark script times, recorded instead of run: every Triton launch
(kernel, grid, arguments, constexprs) and every PyTorch op (a GEMM, a reduction, an allocation) — and each Triton
launch is compiled for the row's GPU (``model.machine_for(gpu_name)``), read from its SASS and priced by the same
streaming model as our kernels (``model.predict_stream``). Nothing runs on a GPU.

Per Triton launch, per program (Triton's unit of work):

- instructions and MUFU operations: the SASS outside loops (cold blocks excluded) plus each loop's own code times
  its trip count; trip counts come from the Triton IR (``scf.for`` bounds evaluated from the launch's arguments at
  program 0); the i-th SASS loop is the i-th IR loop (a kernel whose loop counts differ is not modelled);
- bytes through L2: the SASS's global loads and stores (32 lanes x width, every lane counted);
- bytes that must cross DRAM: each tensor argument the IR loads from once, each it stores to once (a tensor both
  loaded and stored counts twice), unless the programs resident on the whole GPU touch more than the L2 holds, in
  which case every L2 byte is a DRAM byte (re-reads miss);
- bytes in flight: a program's loads of one loop iteration (all its loads without a loop) x resident programs.

Where a driver gives what a tensor holds and the loop bounds read it at a program-dependent place (the MoE's
per-expert token counts), each program's trips are evaluated: the launch's work is their sum, and it lasts no
less than its busiest program would as a launch of its own.

A PyTorch op costs, on the GPU: a GEMM its tiles in waves over the SMs at ``mma_sustained`` of the dtype's dense
peak (``cublas.gemm_time``: tile and wave quantization, split-K; fp32 on the CUDA cores) or its bytes at the copy
rate when slower, anything else its tensors' bytes at the copy rate; views and ``empty`` cost nothing.
Every kernel adds ``launch_s``. A ``torch.compile``d function's ops (a compiled region) are priced as Inductor
runs them (``fuse_compiled``): GEMMs as they are, the ops between them fused into one kernel of the bytes it reads
and writes outside itself, its rows read once per loop Inductor runs over them (``_row_passes``).

The benchmark harness (``triton.testing.do_bench``) times a region on CUDA events after zeroing a 256 MB buffer
(its L2 flush), so the host's work of the region overlaps the flush: the published time is the larger of the GPU
time and the host time the flush does not hide (``HOST``), all of it after a device sync (``.item()``).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import importlib
import inspect
import json
import math
import os
import re
import statistics
import sys
import types

from megakernels.bench.static import cublas, model

FIELDS = (
    "kernel_name",
    "kernel_provider",
    "kernel_operation_mode",
    "metric_name",
    "x_value",
    "y_value_50",
    "extra_benchmark_config_str",
    "gpu_name",
    "liger_version",
)


@dataclasses.dataclass(frozen=True)
class Host:
    """The host side of a do_bench measurement (assumptions, calibrated on the development set)."""

    triton_launch_s: float = 50e-6  # a Triton launch from Python (argument binding, the launcher)
    torch_op_s: float = 5e-6  # an eager PyTorch op, views included
    function_s: float = 30e-6  # an autograd.Function call
    backward_s: float = 130e-6  # more for a backward: the autograd engine's pass (Tensor.backward)
    flush_bytes: float = 256e6  # do_bench's L2 flush: a 256 MB zero_ before each timed call


HOST = Host()


# ---- the CSV ---------------------------------------------------------------------------------------------------


def read_csv(path: str) -> list[dict]:
    """The rows of a CSV in Liger-Kernel's format (the ``FIELDS`` columns; others kept as they are).

    Raises:
        ValueError: a column of ``FIELDS`` is missing."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in FIELDS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: not a Liger-Kernel benchmark CSV (no column {', '.join(missing)})")
        return [dict(r) for r in reader]


def select(rows: list[dict], kernels=None, gpus=None, providers=None, metric: str = "speed") -> list[dict]:
    """The rows of ``metric`` (in ms) whose kernel, GPU name (substring) and provider are among those given."""
    out = []
    for r in rows:
        if r["metric_name"] != metric or r.get("metric_unit", "ms") not in ("ms", ""):
            continue
        if kernels is not None and r["kernel_name"] not in kernels:
            continue
        if gpus is not None and not any(g in r["gpu_name"] for g in gpus):
            continue
        if providers is not None and r["kernel_provider"] not in providers:
            continue
        out.append(r)
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by linear interpolation between order statistics (numpy's default)."""
    v = sorted(values)
    if not v:
        return math.nan
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarise(rows: list[dict]) -> dict:
    """Row count, median and 90th percentile of |rel_error| over the rows that have one: overall and per GPU."""

    def stats(rs):
        e = [abs(r["rel_error"]) for r in rs]
        return {
            "rows": len(e),
            "median_abs_rel_error": statistics.median(e) if e else None,
            "p90_abs_rel_error": percentile(e, 0.9) if e else None,
        }

    done = [r for r in rows if r.get("rel_error") is not None]
    out = {"overall": stats(done), "per_gpu": {}}
    for g in sorted({r["gpu_name"] for r in done}):
        out["per_gpu"][g] = stats([r for r in done if r["gpu_name"] == g])
    out["not_modelled"] = sum(1 for r in rows if r.get("rel_error") is None)
    return out


# ---- recording what a peer's entry points launch ---------------------------------------------------------------


@dataclasses.dataclass
class Op:
    """One recorded step: a Triton ``launch`` (megakernels.triton.launch.Launch), a PyTorch op (``func`` with its
    input and output tensors' (shape, dtype) lists) or a host ``sync``."""

    kind: str  # "triton" | "torch" | "sync" | "call" | "return" | "compiled" | "compiled_end"
    launch: object = None
    func: object = None
    inputs: tuple = ()
    outputs: tuple = ()
    # inside a compiled region (``Recorder.compiled``): the (inputs, outputs) memory the op touches, each a tuple of
    # ``_access`` entries; on a "compiled_end" marker, (the storages the compiled function returns,)
    access: tuple = ()


def _meta(v):
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    if isinstance(v, torch.Tensor):
        with _disable_current_modes():
            return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
    return v


def _tensors(x) -> tuple:
    import torch

    if isinstance(x, torch.Tensor):
        return ((tuple(x.shape), x.dtype),)
    if isinstance(x, (list, tuple)):
        return tuple(t for y in x for t in _tensors(y))
    return ()


def _same_memory(a, b) -> bool:
    """Whether tensors ``a`` and ``b`` are the same elements of the same storage (as ATen's copy_ tests)."""
    import torch

    return (
        isinstance(b, torch.Tensor)
        and a.untyped_storage()._cdata == b.untyped_storage()._cdata
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _access(region: dict, x) -> tuple:
    """The memory each tensor in ``x`` names, for a compiled region's data flow: (storage, view, bytes, storage
    bytes) per tensor. A storage is numbered the first time the region meets it (and held until the region ends,
    so that its address is not reused by another); a view is (offset, shape, strides, dtype); bytes are the view's
    distinct elements (a stride-0 dimension adds none) x element size, at most the storage's."""
    import torch

    if isinstance(x, torch.Tensor):
        storage = x.untyped_storage()
        key = storage._cdata
        if key not in region["ids"]:
            region["ids"][key] = len(region["ids"])
            region["held"].append(x)
        distinct = math.prod(n for n, st in zip(x.shape, x.stride()) if st != 0) * x.element_size()
        view = (x.storage_offset(), tuple(x.shape), tuple(x.stride()), str(x.dtype))
        return ((region["ids"][key], view, min(distinct, storage.nbytes()), storage.nbytes()),)
    if isinstance(x, (list, tuple)):
        return tuple(a for y in x for a in _access(region, y))
    if isinstance(x, dict):
        return _access(region, list(x.values()))
    return ()


class Recorder:
    """A context that records (``ops``) instead of running: Triton launches and PyTorch ops on fake CUDA tensors.
    CUDA queries a peer's launcher makes (the SM count, the current device) answer as ``machine``."""

    device = "cuda"  # where the drivers make their tensors (fake ones here)

    def __init__(self, machine: model.Machine):
        self.m = machine
        self.ops: list[Op] = []
        self.active = True
        # what the host reads back from the GPU, in order (``.item()``, ``bool(t)``): a driver that knows what the
        # real tensors hold sets these; past them a read answers 1 (True)
        self.answers: list = []
        # kernel argument name -> the integers a driver knows that argument's tensor holds (loop bounds a kernel
        # loads from memory, ``IR.eval``); attached to each launch that has such an argument
        self.contents: dict[str, list[int]] = {}
        # autotuned kernels: (kernel, key) -> the config kept, and each tuning's candidates (``autotune``)
        self.tuned: dict = {}
        self.tunings: list[dict] = []
        self._capture: list | None = None
        # the compiled region being recorded (``compiled``): its storages' numbers and the tensors held for them
        self._region: dict | None = None

    @contextlib.contextmanager
    def patched(self):
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction

        from megakernels.triton.launch import Launch

        rec = self

        def run(kernel, *args, grid, warmup=False, **kwargs):
            if not rec.active and rec._capture is None:
                return
            if callable(grid):
                grid = grid(dict(zip(kernel.arg_names, args)) | kwargs)
            meta_kwargs = {k: _meta(v) for k, v in kwargs.items()}
            launch = Launch(kernel, tuple(grid), tuple(_meta(a) for a in args), meta_kwargs)
            known = {k: rec.contents[k] for k in kernel.arg_names if k in rec.contents}
            if known:
                launch.contents = known
            if rec._capture is not None:
                rec._capture.append(launch)
            elif rec._region is not None:  # a Triton kernel in a compiled region: each tensor read and written
                tensors = _access(rec._region, [*args, *kwargs.values()])
                rec.ops.append(Op("triton", launch=launch, access=(tensors, tensors)))
            else:
                rec.ops.append(Op("triton", launch=launch))

        def tuned_run(tuner, *args, **kwargs):
            return autotune(rec, tuner, args, kwargs)

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in (
                    torch.ops.aten._local_scalar_dense.default,
                    torch.ops.aten.equal.default,
                    torch.ops.aten.is_nonzero.default,
                ):
                    if rec.active:
                        rec.ops.append(Op("sync", func=func))
                    if rec.answers:
                        return rec.answers.pop(0)
                    return True if func is not torch.ops.aten._local_scalar_dense.default else 1
                if func is torch.ops.aten.copy_.default and _same_memory(args[0], args[1]):
                    return args[0]  # a copy onto the same memory: ATen returns before launching anything
                out = func(*args, **kwargs)
                if rec.active and func is not torch.ops.prim.device.default:  # the fake tensors' own query,
                    # dispatched after their views: a program on real tensors never runs it
                    ins = list(args) + list(kwargs.values())
                    access = ()
                    if rec._region is not None:
                        access = (_access(rec._region, ins), _access(rec._region, out))
                    rec.ops.append(Op("torch", func=func, inputs=_tensors(ins), outputs=_tensors(out), access=access))
                return out

        props = types.SimpleNamespace(
            multi_processor_count=self.m.sms, name=self.m.name, major=self.m.arch // 10, minor=self.m.arch % 10
        )
        tensor = torch.tensor

        def fake_tensor(data, *a, device=None, dtype=None, **k):
            with _disable_current_modes():
                t = tensor(data, dtype=dtype)
            return torch.empty(t.shape, dtype=t.dtype, device=device)

        saved = [
            (JITFunction, "run"),
            (Autotuner, "run"),
            (torch.cuda, "is_available"),
            (torch.cuda, "get_device_properties"),
            (torch.cuda, "device"),
            (torch.cuda, "get_device_capability"),
            (torch.cuda, "current_device"),
            (torch.cuda, "device_count"),
            (torch, "tensor"),
            (torch.Tensor, "contiguous"),
        ]
        old = [getattr(o, n) for o, n in saved]
        JITFunction.run = run
        Autotuner.run = tuned_run
        torch.cuda.is_available = lambda: True
        torch.cuda.get_device_properties = lambda *a, **k: props
        torch.cuda.device = lambda *a, **k: contextlib.nullcontext()
        torch.cuda.get_device_capability = lambda *a, **k: (self.m.arch // 10, self.m.arch % 10)
        torch.cuda.current_device = lambda: 0
        torch.cuda.device_count = lambda: 1
        torch.tensor = fake_tensor
        contiguous = torch.Tensor.contiguous

        def fake_contiguous(t, memory_format=torch.contiguous_format):
            # a strided fake CUDA tensor's copy_ reaches the CUDA runtime: the same copy as a clone
            if t.is_contiguous(memory_format=memory_format):
                return t
            if isinstance(t, torch._subclasses.fake_tensor.FakeTensor):
                return t.clone(memory_format=memory_format)
            return contiguous(t, memory_format=memory_format)

        torch.Tensor.contiguous = fake_contiguous
        getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__
        fake_type = torch._subclasses.fake_tensor.FakeTensor

        @contextlib.contextmanager
        def on_meta(*xs):
            # Python indexing puts a device guard on the indexed tensor's device, which for a fake CUDA tensor
            # reaches the CUDA runtime: the fake tensors involved are indexed as meta ones (the same ATen ops are
            # dispatched, and recorded) and their results made CUDA ones again
            fakes = [x for x in xs if isinstance(x, fake_type) and x.fake_device.type == "cuda"]
            saved = [(x, x.fake_device) for x in fakes]
            for x in fakes:
                x.fake_device = torch.device("meta")
            try:
                yield saved[0][1] if saved else None
            finally:
                for x, d in saved:
                    x.fake_device = d

        def index_args(t, idx):
            return (t, *(idx if isinstance(idx, tuple) else (idx,)))

        def fake_getitem(t, idx):
            with on_meta(*index_args(t, idx)) as device:
                out = getitem(t, idx)
            if device is not None and isinstance(out, fake_type) and out.fake_device.type == "meta":
                out.fake_device = device
            return out

        def fake_setitem(t, idx, value):
            with on_meta(*index_args(t, idx), value):
                setitem(t, idx, value)

        saved += [(torch.Tensor, "__getitem__"), (torch.Tensor, "__setitem__")]
        old += [getitem, setitem]
        torch.Tensor.__getitem__ = fake_getitem
        torch.Tensor.__setitem__ = fake_setitem

        def fake_compile(fn=None, *a, **k):
            # torch.compile(fn, ...) or torch.compile(...)(fn): the function runs as its eager ops, recorded as a
            # compiled region (priced as Inductor runs it: ``price_compiled``)
            if fn is None:
                return lambda f: fake_compile(f, *a, **k)

            def compiled_fn(*args, **kwargs):
                with rec.compiled() as returns:
                    return returns(fn(*args, **kwargs))

            return compiled_fn

        saved.append((torch, "compile"))
        old.append(torch.compile)
        torch.compile = fake_compile
        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                self._dispatch = Dispatch
                yield self
        finally:
            for (o, n), v in zip(saved, old):
                setattr(o, n, v)

    @contextlib.contextmanager
    def recording(self, on: bool = True):
        """Record the ops run inside (``on``) or run them unrecorded (setting up a forward for a backward)."""
        prev, self.active = self.active, on
        with self._dispatch():
            try:
                yield
            finally:
                self.active = prev

    def call(self, backward: bool = False) -> None:
        """Mark a Python-level call of a peer's autograd function (host cost ``HOST.function_s``, and
        ``HOST.backward_s`` more for a backward)."""
        if self.active:
            self.ops.append(Op("call", func="backward" if backward else "forward"))

    def ret(self) -> None:
        """Mark the end of a peer's autograd function (what ran since ``call`` is the peer's own work: our kernels
        take its place in ``price_ours``). Costs nothing."""
        if self.active:
            self.ops.append(Op("return"))

    @contextlib.contextmanager
    def compiled(self):
        """Record what runs inside as one ``torch.compile``d call (markers "compiled" and "compiled_end", and each
        op's memory, ``Op.access``); yields ``returns(out)``, which notes the call's return value (the region's
        outputs) and gives it back. A region inside a region is part of it (Dynamo inlines the inner call)."""
        if self._region is not None or not self.active:
            yield lambda out: out
            return
        self._region = {"ids": {}, "held": [], "returns": ()}
        self.ops.append(Op("compiled"))

        def returns(out):
            self._region["returns"] = tuple(a[0] for a in _access(self._region, out))
            return out

        try:
            yield returns
        finally:
            self.ops.append(Op("compiled_end", access=(self._region["returns"],)))
            self._region = None


_CONFIG_TIMES: dict = {}


def _launch_key(launch, m: model.Machine) -> tuple:
    """What decides a launch's price on ``m``: the kernel, grid, each argument's shape/strides/dtype or value, the
    constexprs and launch options, the contents a driver gave."""

    def arg(a):
        if hasattr(a, "shape"):
            return (tuple(a.shape), tuple(a.stride()), str(a.dtype))
        return repr(a)

    contents = getattr(launch, "contents", {})
    return (
        m.name,
        id(launch.kernel),
        launch.grid,
        tuple(arg(a) for a in launch.args),
        tuple(sorted((k, arg(v)) for k, v in launch.kwargs.items())),
        tuple(sorted((k, tuple(v)) for k, v in contents.items())),
    )


def autotune(rec: Recorder, tuner, args: tuple, kwargs: dict):
    """A ``@triton.autotune`` kernel launched under ``rec``: as Triton's autotuner, the first launch of a key (the
    values of the tuner's key arguments and the tensor arguments' dtypes) tries every config it lists (after its
    own pruning) and later launches of the key reuse the config kept; here each config's launch is compiled for
    ``rec.m`` and priced (``price_triton``) and the model's fastest is kept, where the autotuner keeps the measured
    fastest. The launch is then made with that config (recorded if ``rec`` records). Each tuning is appended to
    ``rec.tunings`` ({"kernel", "key", "configs": [(config, time_s)], "chosen"})."""
    from torch.utils._python_dispatch import _disable_current_modes

    tuner.nargs = dict(zip(tuner.arg_names, args))
    named = {k: v for k, v in {**tuner.nargs, **kwargs}.items() if k in tuner.arg_names}
    key = [named[k] for k in tuner.keys if k in named] + [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
    key = (tuner.base_fn.__name__, *key)
    if key not in rec.tuned:
        configs = tuner.prune_configs(kwargs) if len(tuner.configs) > 1 else tuner.configs
        if len(configs) == 1:
            rec.tuned[key] = configs[0]
        else:
            timed = []
            for config in configs:
                prev, rec._capture = rec._capture, []
                try:
                    tuner.fn.run(*args, **kwargs, **config.all_kwargs())
                    (launch,) = rec._capture
                finally:
                    rec._capture = prev
                k = _launch_key(launch, rec.m)
                if k not in _CONFIG_TIMES:
                    with _disable_current_modes():
                        _CONFIG_TIMES[k] = price_triton(launch, rec.m)["time_s"]
                timed.append((config, _CONFIG_TIMES[k]))
            chosen = min(timed, key=lambda ct: ct[1])[0]
            rec.tuned[key] = chosen
            rec.tunings.append({"kernel": key[0], "key": key[1:], "configs": timed, "chosen": chosen})
    config = rec.tuned[key]
    if config.pre_hook:
        config.pre_hook({**tuner.nargs, **kwargs, **config.all_kwargs()})
    return tuner.fn.run(*args, **kwargs, **config.all_kwargs())


class Ctx:
    """The ``ctx`` an autograd.Function's forward and backward get (called directly: the autograd engine needs a
    CUDA stream even for fake tensors)."""

    needs_input_grad = (True,) * 16

    def save_for_backward(self, *t):
        self.saved_tensors = t

    def mark_non_differentiable(self, *a):
        pass

    def set_materialize_grads(self, *a):
        pass


def _call(fn, ctx, **named):
    """``fn(ctx, ...)`` with the arguments ``fn`` names among ``named`` (parameter names differ across versions);
    required parameters not given are None."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    args = []
    for p in params:
        if p.name in named:
            args.append(named[p.name])
        elif p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            args.append(None)
        else:
            break
    return fn(ctx, *args)


# ---- the ops a row can name: how the peer's benchmark script calls it at the row's shape -----------------------


def _dtype(cfg: dict, default="torch.float32"):
    import torch

    return getattr(torch, str(cfg.get("dtype", default)).replace("torch.", ""))


def _fn(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _function_pass(rec, fn, mode, fwd_args: dict, grads, timed_grads: bool = False):
    """A Liger autograd function's forward and/or backward, recorded as ``mode`` asks; the backward's gradients
    (None in forward mode). ``grads(out)`` makes the output gradients: before the timed region (the benchmark's dy),
    or inside it with ``timed_grads`` (a loss's ``backward()`` filling its unit gradient)."""
    ctx = Ctx()
    with rec.recording(mode in ("forward", "full")):
        rec.call()
        out = _call(fn.forward, ctx, **fwd_args)
        rec.ret()
    if mode == "forward":
        return
    with rec.recording(timed_grads):
        g = grads(out)
    with rec.recording(True):
        rec.call(backward=True)
        out = fn.backward(ctx, *g)
        rec.ret()
    return out


def _norm(kind):
    def drive(rec, mode, x, cfg):
        import torch

        m, n, dt = int(cfg["M"]), int(x), _dtype(cfg)
        X = torch.randn(m, n, device=rec.device, dtype=dt)
        W = torch.randn(n, device=rec.device, dtype=dt)
        eps = float(cfg.get("eps", 1e-6))
        if kind == "rms_norm":
            fn = _fn("liger_kernel.ops.rms_norm", "LigerRMSNormFunction")
            args = {"X": X, "W": W, "eps": eps}
        else:
            fn = _fn("liger_kernel.ops.layer_norm", "LigerLayerNormFunction")
            args = {"X": X, "W": W, "B": torch.randn(n, device=rec.device, dtype=dt), "eps": eps}
        _function_pass(rec, fn, mode, args, lambda y: (torch.randn_like(y),))

    return drive


def _cross_entropy(rec, mode, x, cfg):
    import torch

    rows, v = int(cfg["B"]) * int(cfg["T"]), int(x)
    X = torch.randn(rows, v, device=rec.device, dtype=_dtype(cfg))
    t = torch.randint(v, (rows,), device=rec.device)
    fn = _fn("liger_kernel.ops.cross_entropy", "LigerCrossEntropyFunction")
    args = {"_input": X, "target": t, "ignore_index": -100}

    def grads(out):
        loss = out[0] if isinstance(out, tuple) else out
        return (torch.ones_like(loss),) + ((None,) if isinstance(out, tuple) else ())

    _function_pass(rec, fn, mode, args, grads)
    if mode == "full":  # the benchmark's full pass sets no grad_to_none: the engine accumulates into X.grad
        with rec.recording(True):
            _ = X + X


def _rope(rec, mode, x, cfg):
    import torch

    hq, hk, dt = int(cfg["num_q_heads"]), int(cfg["num_kv_heads"]), _dtype(cfg)
    hidden = int(cfg.get("hidden_size", x))
    seq = int(cfg.get("seq_len", x))
    d = hidden // hq
    q = torch.randn(1, seq, hq, d, device=rec.device, dtype=dt).transpose(1, 2)
    k = torch.randn(1, seq, hk, d, device=rec.device, dtype=dt).transpose(1, 2)
    cos = torch.randn(1, seq, d, device=rec.device, dtype=dt)
    sin = torch.randn(1, seq, d, device=rec.device, dtype=dt)
    fn = _fn("liger_kernel.ops.rope", "LigerRopeFunction")
    args = {"q": q, "k": k, "cos": cos, "sin": sin, "position_ids": None, "unsqueeze_dim": 1}
    _function_pass(rec, fn, mode, args, lambda out: (torch.randn_like(out[0]), torch.randn_like(out[1])))


def _gated_mlp(function: str):
    """LLaMA's MLP with a peer's gated activation: gate and up projections, the activation, the down projection
    (the peer's benchmark times the whole module), and their backward as nn.Linear's autograd computes it."""

    def drive(rec, mode, x, cfg):
        import torch

        b = int(cfg.get("B", cfg.get("bsz", 1)))
        rows, h, f, dt = b * int(x), int(cfg["hidden_size"]), int(cfg["intermediate_size"]), _dtype(cfg)
        fn = _fn(f"liger_kernel.ops.{function[0]}", function[1])
        X = torch.randn(rows, h, device=rec.device, dtype=dt)
        Wg, Wu = torch.randn(f, h, device=rec.device, dtype=dt), torch.randn(f, h, device=rec.device, dtype=dt)
        Wd = torch.randn(h, f, device=rec.device, dtype=dt)
        ctx = Ctx()
        with rec.recording(mode in ("forward", "full")):
            g, u = X @ Wg.t(), X @ Wu.t()
            rec.call()
            a = _call(fn.forward, ctx, a=g, b=u)
            rec.ret()
            y = a @ Wd.t()
        if mode == "forward":
            return
        with rec.recording(False):
            dy = torch.randn_like(y)
        with rec.recording(True):
            da = dy @ Wd
            _ = dy.t() @ a
            rec.call(backward=True)
            dg, du = fn.backward(ctx, da)[:2]
            rec.ret()
            dx = dg @ Wg
            dx = dx + du @ Wu
            _ = dg.t() @ X
            _ = du.t() @ X

    return drive


def _accumulate(rec, grad) -> None:
    """The autograd engine adding a fresh gradient into a leaf's ``.grad`` that a previous timed call left (the
    benchmarks that do not reset it): one elementwise pass of the gradient's size."""
    with rec.recording(True):
        _ = grad + grad


def _divergence(module: str, function: str, normalise: str, target: str):
    """A peer's loss between two distributions over the vocabulary (KL, JSD, TVD) as its benchmark times it:
    ``input = randn(B·T, V, requires_grad).<normalise>(-1)`` (fp32), ``target = randn(B·T, V).<target>(-1)``, the
    loss with its default reduction. Backward then runs through the normalisation's backward into the leaf, whose
    ``.grad`` accumulates over the timed calls (the benchmark's ``grad_to_none`` names the non-leaf input)."""

    def drive(rec, mode, x, cfg):
        import torch

        rows, v = int(cfg["B"]) * int(cfg["T"]), int(x)
        leaf = torch.randn(rows, v, device=rec.device)
        inp = getattr(torch, normalise)(leaf, -1)
        tgt = getattr(torch, target)(torch.randn(rows, v, device=rec.device), -1)
        fn = _fn(f"liger_kernel.ops.{module}", function)
        args = {  # the input and target names each version's forward uses; the benchmark's defaults
            "y_pred": inp,
            "_input": inp,
            "p": inp,
            "y_true": tgt,
            "target": tgt,
            "q": tgt,
            "shift_labels": None,
            "reduction": "batchmean",
            "log_target": False,
            "beta": 0.5,
            "ignore_index": -100,
        }
        grads = _function_pass(rec, fn, mode, args, lambda loss: (torch.ones_like(loss),), timed_grads=True)
        if grads is None:
            return
        aten = torch.ops.aten
        back = aten._log_softmax_backward_data if normalise == "log_softmax" else aten._softmax_backward_data
        with rec.recording(True):
            dleaf = back(grads[0], inp, -1, torch.float32)
        _accumulate(rec, dleaf)

    return drive


def _relu_squared(rec, mode, x, cfg):
    import torch

    X = torch.randn(int(cfg["M"]), int(x), device=rec.device, dtype=_dtype(cfg))
    fn = _fn("liger_kernel.ops.relu_squared", "LigerReLUSquaredFunction")
    _function_pass(rec, fn, mode, {"X": X, "x": X, "input": X}, lambda y: (torch.randn_like(y),))


def _llama4_rope(rec, mode, x, cfg):
    """Llama 4's complex-multiplication RoPE on ``q [1, s, hq, d]``, ``k [1, s, hk, d]`` with the complex
    ``freqs_cis [1, s, d/2]`` of transformers' Llama4TextRotaryEmbedding; backward as ``torch.autograd.grad`` of
    both outputs (nothing accumulates)."""
    import torch

    hq, hk, dt = int(cfg["num_q_heads"]), int(cfg["num_kv_heads"]), _dtype(cfg)
    hidden = int(cfg.get("hidden_size", x))
    seq = int(cfg.get("seq_len", x))
    d = hidden // hq
    q = torch.randn(1, seq, hq, d, device=rec.device, dtype=dt)
    k = torch.randn(1, seq, hk, d, device=rec.device, dtype=dt)
    freqs = torch.randn(1, seq, d // 2, device=rec.device, dtype=torch.complex64)
    fn = _fn("liger_kernel.ops.llama4_rope", "LigerLlama4RopeFunction")
    args = {"q": q, "k": k, "freqs_cis": freqs, "xq": q, "xk": k}
    _function_pass(rec, fn, mode, args, lambda out: (torch.randn_like(out[0]), torch.randn_like(out[1])))


def _megatron(kind: str):
    """Liger's Megatron-LM modules on Megatron's ``[S, B, ·]`` bf16 activations as their benchmarks time them:
    ``forward`` the module; ``backward`` forward + ``out.sum().backward()`` (the input's ``.grad`` reset each call,
    a weight's accumulating); ``full`` the same, RMSNorm's input ``.grad`` accumulating too."""

    def drive(rec, mode, x, cfg):
        import torch

        s, b, n = int(cfg["S"]), int(cfg["B"]), int(x)
        ctx = Ctx()
        if kind == "rms_norm":
            X = torch.randn(s, b, n, device=rec.device, dtype=torch.bfloat16)
            W = torch.randn(n, device=rec.device, dtype=torch.bfloat16)
            fn = _fn("liger_kernel.ops.rms_norm", "LigerRMSNormFunction")
            args = {"X": X, "W": W, "eps": 1e-6, "offset": 0.0, "casting_mode": "llama", "in_place": False}
            args["row_mode"] = None
        else:  # swiglu: fc1's output, gate and up concatenated on the last dimension
            X = torch.randn(s, b, 2 * n, device=rec.device, dtype=torch.bfloat16)
            fn = _fn("liger_kernel.ops.swiglu", "LigerFusedGateUpSiLUMulFunction")
            args = {"y": X, "in_place": False}
        with rec.recording(True):
            rec.call()
            out = _call(fn.forward, ctx, **args)
            rec.ret()
            if mode == "forward":
                return
            _ = out.sum()
            # the sum's gradient, a stride-0 expansion of one scalar, made contiguous by the peer's backward: one
            # write pass of the output's size (recorded as the fill it amounts to)
            g = torch.ones_like(out)
            rec.call(backward=True)
            grads = fn.backward(ctx, g)
            rec.ret()
        if kind == "rms_norm":
            _accumulate(rec, grads[1])  # the weight's gradient, never reset by the benchmark
            if mode == "full":
                _accumulate(rec, grads[0])

    return drive


def _fused_add_rms_norm(rec, mode, x, cfg):
    """Residual add + RMSNorm (``LigerFusedAddRMSNorm``: an fp32 weight of ones, eps from the row) on ``x, r [M, N]``
    returning the normed rows and the new residual; backward with both gradients given; the inputs' ``.grad`` reset
    each call (``grad_to_none``), the weight's accumulating."""
    import torch

    m, n, dt = int(cfg["M"]), int(x), _dtype(cfg)
    X = torch.randn(m, n, device=rec.device, dtype=dt)
    R = torch.randn(m, n, device=rec.device, dtype=dt)
    W = torch.ones(n, device=rec.device)
    fn = _fn("liger_kernel.ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction")
    eps = float(cfg.get("eps", 1e-6))
    args = {"X": X, "R": R, "W": W, "eps": eps, "offset": 0.0, "casting_mode": "llama", "in_place": False}
    grads = _function_pass(rec, fn, mode, args, lambda out: (torch.randn_like(out[0]), torch.randn_like(out[1])))
    if grads is not None:
        _accumulate(rec, grads[2])


def _neighborhood_attention(rec, mode, x, cfg):
    """``LigerFusedNeighborhoodAttention`` as its benchmark times it: q/k/v projections (``nn.Linear``, biases per
    the row), the fused neighborhood attention over ``[batch, heads, seq, head_dim]``, the output projection; backward
    through all of it with the input's ``.grad`` reset each call and the projections' weight and bias gradients
    accumulating."""
    import torch
    import torch.nn.functional as F

    b, s, h, dt = int(cfg["batch_size"]), int(x), int(cfg["hidden_size"]), _dtype(cfg)
    heads = int(cfg["num_heads"])
    d = h // heads
    bias = bool(cfg.get("bias", True))
    X = torch.randn(b, s, h, device=rec.device, dtype=dt)
    W = [torch.randn(h, h, device=rec.device, dtype=dt) for _ in range(4)]
    B = [torch.randn(h, device=rec.device, dtype=dt) if bias else None for _ in range(4)]
    fn = _fn("liger_kernel.ops.fused_neighborhood_attention", "LigerFusedNeighborhoodAttentionFunction")
    args = {"kernel_size": int(cfg.get("kernel_size", 7)), "dilation": int(cfg.get("dilation", 1)), "scale": d**-0.5}
    ctx = Ctx()

    def heads_of(t):
        return t.view(b, s, heads, d).transpose(1, 2)

    with rec.recording(mode in ("forward", "full")):
        q, k, v = (heads_of(F.linear(X, W[i], B[i])) for i in range(3))
        rec.call()
        att = _call(fn.forward, ctx, query=q, key=k, value=v, **args)
        rec.ret()
        a = att.transpose(1, 2).contiguous().view(b, s, h)
        y = F.linear(a, W[3], B[3])
    if mode == "forward":
        return
    with rec.recording(False):
        dy = torch.randn_like(y)
    with rec.recording(True):
        rows = dy.reshape(b * s, h)
        da = rows @ W[3]
        grads = [rows.t() @ a.reshape(b * s, h)]  # out_proj's weight gradient
        if bias:
            grads.append(rows.sum(0))
        datt = da.view(b, s, heads, d).transpose(1, 2)
        rec.call(backward=True)
        dq, dk, dv = fn.backward(ctx, datt)[:3]
        rec.ret()
        dx = None
        for i, g in enumerate((dq, dk, dv)):
            g = g.transpose(1, 2).reshape(b * s, h)
            part = g @ W[i]
            dx = part if dx is None else dx + part
            grads.append(g.t() @ X.reshape(b * s, h))
            if bias:
                grads.append(g.sum(0))
    for g in grads:  # the module's parameters are not in grad_to_none: their gradients accumulate
        _accumulate(rec, g)


def _loss_pass(rec, fn, mode, fwd_args: dict, leaves: list, reset: list):
    """A peer's fused linear + loss autograd function (the loss and its gradients made in the forward; the backward
    scales the saved gradients unless the loss gradient is 1, which the benchmark's ``y.backward()`` gives) as its
    benchmark times it: ``forward`` the call; ``backward`` ``y.backward(retain_graph=True)`` of a forward made
    before; ``full`` the two. ``leaves``: the positions among the backward's returned gradients of the leaves
    autograd accumulates into (``.grad`` of the inputs and parameters that require it), of which ``reset`` the
    benchmark's ``grad_to_none`` clears before each call (a fresh ``.grad`` then costs no add)."""
    import torch

    ctx = Ctx()
    with rec.recording(mode in ("forward", "full")), torch.no_grad():
        rec.call()
        out = _call(fn.forward, ctx, **fwd_args)
        rec.ret()
    if mode == "forward":
        return
    loss = out[0] if isinstance(out, tuple) else out
    with rec.recording(True):
        g = torch.ones_like(loss)  # the engine's seed gradient of a scalar loss
        rec.answers.append(False)  # the backward's "grad_output != 1" test reads False
        rec.call(backward=True)
        grads = fn.backward(ctx, g, *([None] * (len(out) - 1) if isinstance(out, tuple) else []))
        rec.ret()
    for i in leaves:
        if grads[i] is not None and (mode == "full" or i not in reset):
            _accumulate(rec, grads[i])


def _fused_linear_jsd(rec, mode, x, cfg):
    """``LigerFusedLinearJSD`` as its benchmark times it: student and teacher LM heads ``[V, H]`` (no bias) on
    ``student_input, teacher_input [BT, H]`` (``torch.rand``, the student's requiring grad), no labels. The forward
    chunks BT by ``cdiv(V, H)`` (per chunk: both logit GEMMs, their log-softmax, the JSD kernel writing its
    gradient in place, the softmax backward, the student's input and weight gradient GEMMs); the backward skips its
    rescale at a unit loss gradient. ``full`` = forward + ``y.backward()``: the student input's and the student
    weight's ``.grad`` accumulate (nothing is reset)."""
    import torch

    bt, h, v, dt = int(x), int(cfg["H"]), int(cfg["V"]), _dtype(cfg)
    xs = torch.rand(bt, h, device=rec.device, dtype=dt)
    xt = torch.rand(bt, h, device=rec.device, dtype=dt)
    ws = torch.rand(v, h, device=rec.device, dtype=dt).requires_grad_(True)
    wt = torch.rand(v, h, device=rec.device, dtype=dt).requires_grad_(True)
    fn = _fn("liger_kernel.ops.fused_linear_jsd", "LigerFusedLinearJSDFunction")
    args = {
        "student_input": xs,
        "student_weight": ws,
        "teacher_input": xt,
        "teacher_weight": wt,
        "shift_labels": None,
        "jsd_beta": 0.5,
        "ignore_index": -100,
        "temperature": 1.0,
    }
    _loss_pass(rec, fn, mode, args, leaves=[0, 1], reset=[0, 1])


# Where the chunked losses make their tensors: their chunk function runs ``torch.func.grad_and_value``, whose autograd
# graph asks the device for a stream, which for a fake CUDA tensor reaches the CUDA runtime; they launch no Triton
# kernel, so their fake tensors are meta ones (the same ATen ops, recorded and priced alike)
_AUTOGRAD_DEVICE = "meta"


def _distill_jsd_loss(rec, mode, x, cfg):
    """The chunked distillation JSD loss (``chunked_loss.jsd_loss.LigerFusedLinearJSDFunction``) as its benchmark
    times it: student head ``[V, H/2]`` on ``[BT, H/2]`` (requiring grad), teacher head ``[V, H]`` on ``[BT, H]``,
    biases per the row, random labels; hard and soft loss weights from the row. The forward runs the release's
    chunk function per chunk of 1024 rows (both logit GEMMs, the losses and, through ``torch.func.grad_and_value``,
    the student's gradients, accumulated). The chunk function is ``torch.compile``d in the release: the recorder's
    ``torch.compile`` records each call as a compiled region (``Recorder.compiled``), priced as Inductor runs it
    (``price_compiled``). ``full`` = forward + ``y.backward()``: the student input's and weight's ``.grad``
    accumulate."""
    import torch

    dev = _AUTOGRAD_DEVICE
    bt, h, v, dt = int(x), int(cfg["H"]), int(cfg["V"]), _dtype(cfg)
    bias = bool(cfg.get("bias", False))
    xs = torch.rand(bt, h // 2, device=dev, dtype=dt)
    xt = torch.rand(bt, h, device=dev, dtype=dt)
    ws = torch.randn(v, h // 2, device=dev, dtype=dt).requires_grad_(True)
    wt = torch.randn(v, h, device=dev, dtype=dt).requires_grad_(True)
    bs = torch.randn(v, device=dev, dtype=dt).requires_grad_(True) if bias else None
    bt_ = torch.randn(v, device=dev, dtype=dt).requires_grad_(True) if bias else None
    target = torch.randint(0, v, (bt,), device=dev)
    fn = _fn("liger_kernel.chunked_loss.jsd_loss", "LigerFusedLinearJSDFunction")
    args = {
        "student_input": xs,
        "student_weight": ws,
        "teacher_input": xt,
        "teacher_weight": wt,
        "true_labels": target,
        "student_bias": bs,
        "teacher_bias": bt_,
        "weight_hard_loss": float(cfg.get("weight_hard_loss", 0.5)),
        "weight_soft_loss": float(cfg.get("weight_soft_loss", 0.5)),
        "beta": 0.5,
        "ignore_index": int(cfg.get("ignore_index", -100)),
        "temperature": 1.0,
        "compiled": True,
    }
    # the backward returns (input, weight, teacher input, teacher weight, labels, student bias, ...)
    _loss_pass(rec, fn, mode, args, leaves=[0, 1, 5], reset=[0])


def _kto_loss(rec, mode, x, cfg):
    """The chunked KTO loss (``LigerFusedLinearKTOFunction``) as its benchmark times it: policy head ``[V, H]``
    (bias per the row) and reference head (no bias) on ``[B, T, H]`` inputs that do not require grad, labels with
    ``ignore_index`` tokens, boolean preference labels, a precomputed KL; one chunk a sequence (the release's
    chunk size 1), each: the policy and reference logit GEMMs, the per-token log-probabilities and the loss, and
    through ``torch.func.grad_and_value`` the policy's gradients, accumulated. The chunk function is
    ``torch.compile``d in the release: each call is recorded as a compiled region and priced as Inductor runs it
    (``price_compiled``). ``full`` = forward + ``y.backward()``: the head's weight and bias ``.grad`` accumulate."""
    import torch

    dev = _AUTOGRAD_DEVICE
    b, t, h, v, dt = int(x), int(cfg["T"]), int(cfg["H"]), int(cfg["V"]), _dtype(cfg)
    bias = bool(cfg.get("bias", False))
    inp = torch.randn(b, t, h, device=dev, dtype=dt)
    ref = torch.randn(b, t, h, device=dev, dtype=dt)
    w = torch.randn(v, h, device=dev, dtype=dt).requires_grad_(True)
    wr = torch.randn(v, h, device=dev, dtype=dt).requires_grad_(True)
    bw = torch.randn(v, device=dev, dtype=dt).requires_grad_(True) if bias else None
    target = torch.randint(v, (b, t), device=dev)
    labels = torch.randint(2, (b,), device=dev).bool()
    kl = torch.randn(1, device=dev, dtype=dt)
    fn = _fn("liger_kernel.chunked_loss.kto_loss", "LigerFusedLinearKTOFunction")
    args = {
        "_input": inp,
        "weight": w,
        "target": target,
        "preference_labels": labels,
        "bias": bw,
        "ref_input": ref,
        "ref_weight": wr,
        "ref_bias": None,
        "kl": kl,
        "ignore_index": int(cfg.get("ignore_index", -100)),
        "beta": float(cfg.get("beta", 0.1)),
        "compiled": True,
        "use_ref_model": True,
    }
    # the backward returns (input, weight, target, preference labels, bias, ...)
    _loss_pass(rec, fn, mode, args, leaves=[1, 4], reset=[])


MOE_WARMUP_TOKENS = 8192  # the benchmark's autotune warm-up: its model profile's token count (Qwen3-MoE-30B)
MOE_WARMUP_EXPERTS = 8  # in the expert sweep, the first warm-up (fewest experts) is the one that tunes
MOE_WEIGHT_SCALE = 0.02  # the benchmark's weights: ``randn(..., requires_grad=True) * 0.02``


def _moe_routing(t: int, e: int, k: int, block_m: int) -> tuple[list[int], int]:
    """The routing the benchmark's random top-k makes, simulated on the host: ``topk(randn(t, e), k)`` (seed 42,
    the CPU generator; the distribution, not the benchmark's draws) -> (each expert's first row in the sorted
    token list, E + 1 entries; the M-tiles of ``block_m`` rows the experts' rows take)."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        g = torch.Generator().manual_seed(42)
        idx = torch.topk(torch.randn(t, e, generator=g), k, dim=-1).indices
        counts = torch.bincount(idx.flatten(), minlength=e).tolist()
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return starts, sum(-(-c // block_m) for c in counts)


def _fused_moe(rec, mode, x, cfg):
    """``LigerFusedMoEFunction`` as its benchmark times it: bf16 ``x [T, H]`` (a leaf), gate-up ``[E, 2I, H]`` and
    down ``[E, H, I]`` weights, int32 top-k indices and their softmax weights (a leaf); T or E is the swept ``x``.
    Forward: the three routing kernels, one ``.item()`` (the M-tile count), the gate-up GEMM with SwiGLU, the down
    GEMM, the weighted token gather; backward (with a random ``dO``, drawn inside the timed call in ``full``): the
    down-projection backward, dW2, dX expanded, the gather-sum, dW1, and then the autograd engine's own work on the
    weights' gradients. The weights are made as ``randn(..., requires_grad=True) * MOE_WEIGHT_SCALE``: what the
    function receives is the product, whose ``MulBackward0`` scales each weight gradient (a pass reading it and
    writing a new one) into the ``randn`` leaf, whose ``.grad`` the benchmark never clears (its ``grad_to_none``
    names the products, which keep none), so ``AccumulateGrad`` adds it in place on every timed call (``+=``: two
    reads and a write). ``x.grad`` and the routing weights' ``.grad`` are cleared each call (the engine keeps the
    fresh gradient, no pass). The GEMM and gather kernels are autotuned (``autotune``) on the key (H, I): the benchmark
    tunes once, in a warm-up pass at ``MOE_WARMUP_TOKENS`` tokens (and ``MOE_WARMUP_EXPERTS`` experts in the
    expert sweep) before any timed call, so the driver runs that warm-up (unrecorded) first. The per-expert token
    counts that set the M-tile count and the dW kernels' loop trips come from ``_moe_routing``: each dW program's
    trips are those of its expert, so a dW launch is priced by the sum of its programs' work and no shorter than
    its busiest program (``analyse_triton``)."""
    import torch

    sweep = cfg.get("sweep_dim", "T")
    if sweep not in ("T", "E"):
        raise ValueError(f"fused_moe: sweep_dim {sweep!r} is neither 'T' nor 'E'")
    t = int(x) if sweep == "T" else int(cfg["T"])
    e = int(x) if sweep == "E" else int(cfg["E"])
    h, i, k, dt = int(cfg["H"]), int(cfg["intermediate_dim"]), int(cfg["K"]), _dtype(cfg)
    mod = importlib.import_module("liger_kernel.ops.fused_moe")
    fn, block_m = mod.LigerFusedMoEFunction, mod.BLOCK_M_TOKEN

    def inputs(t, e):
        xx = torch.randn(t, h, device=rec.device, dtype=dt)
        gup = torch.randn(e, 2 * i, h, device=rec.device, dtype=dt)
        dn = torch.randn(e, h, i, device=rec.device, dtype=dt)
        idx = torch.randint(e, (t, k), device=rec.device, dtype=torch.int32)
        wts = torch.randn(t, k, device=rec.device, dtype=dt)
        return xx, gup, dn, idx, wts

    def region(t, e, record_forward: bool, backward: bool, record_backward: bool):
        starts, tiles = _moe_routing(t, e, k, block_m)
        rec.contents = {"expert_start_ptr": starts}
        with rec.recording(False):
            xx, gup, dn, idx, wts = inputs(t, e)
        ctx = Ctx()
        rec.answers.append(tiles)  # the forward's one read-back: the M-tile count
        with rec.recording(record_forward):
            rec.call()
            out = _call(fn.forward, ctx, x=xx, gate_up_proj=gup, down_proj=dn, top_k_index=idx, top_k_weights=wts)
            rec.ret()
        if not backward:
            return
        with rec.recording(record_backward and record_forward):  # full: ``y.backward(torch.randn_like(y))``
            do = torch.randn_like(out)
        with rec.recording(record_backward):
            rec.call(backward=True)
            grads = fn.backward(ctx, do)
            rec.ret()
            for g in (grads[2], grads[1]):  # the engine reaches the down weight's node first
                scaled = g * MOE_WEIGHT_SCALE  # MulBackward0
                _ = scaled + scaled  # AccumulateGrad: the leaf's ``.grad += scaled``

    region(MOE_WARMUP_TOKENS, MOE_WARMUP_EXPERTS if sweep == "E" else e, False, True, False)
    region(t, e, mode in ("forward", "full"), mode in ("backward", "full"), True)
    rec.contents = {}


DRIVERS = {
    "rms_norm": _norm("rms_norm"),
    "layer_norm": _norm("layer_norm"),
    "cross_entropy": _cross_entropy,
    "rope": _rope,
    "swiglu": _gated_mlp(("swiglu", "LigerSiLUMulFunction")),
    "geglu": _gated_mlp(("geglu", "LigerGELUMulFunction")),
    "kl_div": _divergence("kl_div", "LigerKLDivLossFunction", "log_softmax", "softmax"),
    "jsd": _divergence("jsd", "LigerJSDFunction", "log_softmax", "log_softmax"),
    "tvd": _divergence("tvd", "LigerTVDLossFunction", "softmax", "softmax"),
    "relu_squared": _relu_squared,
    "llama4_rope": _llama4_rope,
    "megatron_rms_norm": _megatron("rms_norm"),
    "megatron_swiglu": _megatron("swiglu"),
    "fused_add_rms_norm": _fused_add_rms_norm,
    "fused_neighborhood_attention": _neighborhood_attention,
    "fused_linear_jsd": _fused_linear_jsd,
    "distill_jsd_loss": _distill_jsd_loss,
    "kto_loss": _kto_loss,
    "fused_moe": _fused_moe,
}
# The provider name of the peer's kernels in a kernel's rows where it is not "liger" (other providers of those rows
# are its own variants or the eager reference)
PROVIDERS = {"fused_add_rms_norm": "liger_fused_add_rms_norm"}


def _peer_provider(r: dict) -> str:
    return PROVIDERS.get(r["kernel_name"], "liger")


# The module each driver imports (under liger_kernel/), to find a release that has it: a row's liger_version is
# what the benchmark machine had installed, which lags the source the row was measured with when the kernel was
# newer than that release (``resolve_version``).
MODULES = {
    "rms_norm": "ops/rms_norm.py",
    "layer_norm": "ops/layer_norm.py",
    "cross_entropy": "ops/cross_entropy.py",
    "rope": "ops/rope.py",
    "swiglu": "ops/swiglu.py",
    "geglu": "ops/geglu.py",
    "kl_div": "ops/kl_div.py",
    "jsd": "ops/jsd.py",
    "tvd": "ops/tvd.py",
    "relu_squared": "ops/relu_squared.py",
    "llama4_rope": "ops/llama4_rope.py",
    "megatron_rms_norm": "megatron/rms_norm.py",
    "megatron_swiglu": "megatron/swiglu.py",
    "fused_add_rms_norm": "ops/fused_add_rms_norm.py",
    "fused_neighborhood_attention": "ops/fused_neighborhood_attention.py",
    "fused_linear_jsd": "ops/fused_linear_jsd.py",
    "distill_jsd_loss": "chunked_loss/jsd_loss.py",
    "kto_loss": "chunked_loss/kto_loss.py",
    "fused_moe": "ops/fused_moe.py",
}
# The first release of liger-kernel whose wheel holds each module a row may name before it existed (read from the
# registry's wheels): layer_norm and kl_div 0.3.0, jsd 0.4.0, fused_neighborhood_attention 0.6.0, llama4_rope 0.6.2,
# relu_squared 0.8.0, the Megatron RMSNorm 0.8.1 and SwiGLU (its fused gate-up kernel) 0.8.2, the fused linear JSD
# 0.4.0, the fused MoE 0.8.0.
FIRST_RELEASE = {
    "ops/fused_linear_jsd.py": "0.4.0",
    "ops/fused_moe.py": "0.8.0",
    "ops/layer_norm.py": "0.3.0",
    "ops/kl_div.py": "0.3.0",
    "ops/jsd.py": "0.4.0",
    "ops/llama4_rope.py": "0.6.2",
    "ops/relu_squared.py": "0.8.0",
    "megatron/rms_norm.py": "0.8.1",
    "megatron/swiglu.py": "0.8.2",
    "ops/fused_neighborhood_attention.py": "0.6.0",
}
# Kernels whose rows ran source that the first release holding the module does not match, with the first release
# that does (read from the repository's history): the distillation JSD rows (2024-12) ran the chunk function on
# chunks of 1024 rows, which 0.5.3-0.5.4 changed to one row a chunk and 0.5.5 restored; the KTO rows (2025-03-03)
# ran the unpaired-preference base after its masked-sum rewrite, first released in 0.5.5. The TVD rows (2026-03-03)
# and the fused add + RMSNorm rows (2026-04-07) name 0.7.0 but were committed together with a rewrite of their kernel
# (Liger-Kernel 5c9cecc8, #1127: the gradient's scale inside the forward kernel; b7025a70, #1187: the backward's
# register pressure), which 0.8.0 first released: the commit that wrote a row ran the source of that commit
# (benchmarks/peer/provenance.py compares the two for every row group).
SOURCE_RELEASE = {"distill_jsd_loss": "0.5.5", "kto_loss": "0.5.5", "tvd": "0.8.0", "fused_add_rms_norm": "0.8.0"}
# Drivers a row cannot have, with the reason: what the benchmark times is outside the model.
NOT_DRIVEN = {
    "megatron_cross_entropy": "its benchmark times a loop of calls through torch.distributed's vocabulary-parallel "
    "collectives without do_bench's L2 flush (a harness the model does not describe)",
}


# ---- the installed peer ----------------------------------------------------------------------------------------


def default_peer_root() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "megakernels", "peers")


def peer_dir(version: str, peer_path: str | None) -> str | None:
    """Where liger-kernel ``version`` is installed: ``peer_path/liger-kernel-<version>`` or
    ``peer_path/liger-<version>`` (``pip install --no-deps --target DIR liger-kernel==<version>``), or
    ``peer_path`` itself when it holds that version; None when not found."""
    for root in [peer_path, default_peer_root()] if peer_path else [default_peer_root()]:
        for d in (os.path.join(root, f"liger-kernel-{version}"), os.path.join(root, f"liger-{version}"), root):
            if os.path.isdir(os.path.join(d, "liger_kernel")) and _installed_version(d) == version:
                return d
    return None


def _installed_version(d: str) -> str | None:
    for name in os.listdir(d):
        m = re.fullmatch(r"liger_kernel-(.+)\.dist-info", name)
        if m:
            return m.group(1)
    return None


def install_hint(version: str, peer_path: str | None) -> str:
    root = peer_path or default_peer_root()
    return (
        f"liger-kernel {version} is not installed: pip install --no-deps --target "
        f"{os.path.join(root, 'liger-kernel-' + version)} liger-kernel=={version}"
    )


@contextlib.contextmanager
def imported(path: str):
    """liger_kernel imported from ``path`` (and forgotten afterwards, so another version can be imported)."""

    def forget():
        for k in [k for k in sys.modules if k == "liger_kernel" or k.startswith("liger_kernel.")]:
            del sys.modules[k]

    from megakernels.triton.launch import without_interpreter

    forget()
    sys.path.insert(0, path)
    try:
        with without_interpreter():  # @triton.jit must build JIT functions, to be compiled
            yield
    finally:
        sys.path.remove(path)
        forget()


# ---- pricing ---------------------------------------------------------------------------------------------------

_FOR = re.compile(r"scf\.for\s+%[\w.]+\s*=\s*(%[\w.]+)\s+to\s+(%[\w.]+)\s+step\s+(%[\w.]+)")
_DEF = re.compile(r"^\s*(%[\w.#]+)(?::\d+)?\s*=\s*([\w.]+)\s*(.*)$")
_ARITH = {
    "arith.addi": lambda a, b: a + b,
    "arith.subi": lambda a, b: a - b,
    "arith.muli": lambda a, b: a * b,
    "arith.divsi": lambda a, b: int(a / b),
    "arith.divui": lambda a, b: a // b,
    "arith.remsi": lambda a, b: a - b * int(a / b),
    "arith.minsi": min,
    "arith.maxsi": max,
    "arith.minui": min,
    "arith.maxui": max,
}


_ELEMENT = {"f64": 8, "i64": 8, "f32": 4, "i32": 4, "bf16": 2, "f16": 2, "i16": 2, "i8": 1, "i1": 1}


def _access_bytes(line: str) -> int:
    """Bytes one ``tt.load`` / ``tt.store`` line of TTIR moves: its pointer tile's elements x element size."""
    m = re.search(r":\s*tensor<([\dx]+)x!tt\.ptr<(\w+)>>", line)
    if m:
        return math.prod(int(d) for d in m.group(1).split("x")) * _ELEMENT.get(m.group(2), 4)
    m = re.search(r":\s*!tt\.ptr<(\w+)>", line)
    return _ELEMENT.get(m.group(1), 4) if m else 0


class IR:
    """What the pricing needs from a kernel's Triton IR (TTIR): its ``scf.for`` loops' trip counts and which
    pointer arguments it loads from and stores to."""

    def __init__(self, ttir: str, values: dict, contents: dict | None = None):
        self.contents = contents or {}  # argument name -> the integers its tensor holds (``Recorder.contents``)
        self.defs: dict[str, tuple[str, list[str], str]] = {}
        self.loops: list[tuple[str, str, str, int]] = []  # (lb, ub, step, depth)
        self.loop_bytes: list[int] = []  # per loop: the bytes its own loads and stores move in one iteration
        # every global access: (load / store / atomic..., its pointer, bytes per execution, the loops around it)
        self.accesses: list[tuple[str, str, int, list[int]]] = []
        self.values = values
        depth, open_loops = 0, []
        for line in ttir.splitlines():
            m = _FOR.search(line)
            if m:
                self.loops.append((*m.groups(), depth))
                self.loop_bytes.append(0)
                open_loops.append((len(self.loops) - 1, depth))
                for a, b in (
                    re.findall(r"(%[\w.]+)\s*=\s*(%[\w.]+)", line.split("iter_args", 1)[1])
                    if ("iter_args" in line)
                    else []
                ):
                    self.defs[a] = ("alias", [b], "")
            elif open_loops and re.search(r"\btt\.(load|store|atomic)", line):
                self.loop_bytes[open_loops[-1][0]] += _access_bytes(line)
            acc = re.search(r"\btt\.(load|store|atomic\w*)\s+(%[\w.#]+)", line)
            if acc and not m:
                self.accesses.append((acc.group(1), acc.group(2), _access_bytes(line), [i for i, _ in open_loops]))
            d = _DEF.match(line)
            if d and not m:
                self.defs[d.group(1)] = (d.group(2), re.findall(r"%[\w.#]+", d.group(3)), d.group(3))
            depth += line.count("{") - line.count("}")
            while open_loops and depth <= open_loops[-1][1]:
                open_loops.pop()
        self.loaded, self.stored = set(), set()
        for line in ttir.splitlines():
            for op, into in (("tt.load", self.loaded), ("tt.store", self.stored), ("tt.atomic", self.stored)):
                if re.search(rf"\b{op}", line):
                    ptr = re.findall(r"%[\w.#]+", line.split(op, 1)[1])
                    if ptr:
                        into.update(self._args(ptr[0], set()))

    def _args(self, v: str, seen: set) -> set:
        if v in seen:
            return set()
        seen.add(v)
        name = v[1:].split("#")[0]
        if name in self.values:
            return {name}
        if v not in self.defs:
            return set()
        op, operands, _ = self.defs[v]
        if op in ("arith.constant",):
            return set()
        out = set()
        for o in operands:
            out |= self._args(o, seen)
        return out

    def eval(self, v: str, pid: int | tuple = 0):
        """The integer value ``v`` holds in program ``pid`` (one index for every grid axis, or (x, y, z))."""
        name = v[1:].split("#")[0]
        if name in self.values and not hasattr(self.values[name], "shape"):
            return int(self.values[name])
        if v not in self.defs:
            raise ValueError(f"loop bound {v} is not a constant or an argument")
        op, operands, rest = self.defs[v]
        if op == "arith.constant":
            return int(re.match(r"\s*(-?\d+)", rest).group(1))
        if op == "tt.get_program_id":
            return pid if isinstance(pid, int) else pid["xyz".index(rest.split()[0])]
        if op in ("arith.extsi", "arith.extui", "arith.trunci", "arith.index_cast", "alias"):
            return self.eval(operands[0], pid)
        if op in _ARITH:
            return _ARITH[op](self.eval(operands[0], pid), self.eval(operands[1], pid))
        if op == "tt.load" and operands:  # a scalar read from a tensor whose contents a driver gave
            base, offset = operands[0], 0
            while base in self.defs and self.defs[base][0] == "tt.addptr":
                base, offset = self.defs[base][1][0], offset + self.eval(self.defs[base][1][1], pid)
            name = base[1:].split("#")[0]
            if name in self.contents:
                return int(self.contents[name][offset])
        raise ValueError(f"loop bound through {op}")

    def trips(self, pid: int | tuple = 0) -> list[tuple[int, int]]:
        """(trip count in program ``pid``, nesting depth) of each loop, in program order."""
        out = []
        for lb, ub, st, depth in self.loops:
            lo, hi, step = self.eval(lb, pid), self.eval(ub, pid), self.eval(st, pid)
            out.append((max(0, -(-(hi - lo) // step)), depth))
        return out

    def program_axes(self, values: list[str] | None = None) -> set[int]:
        """The grid axes (0 x, 1 y, 2 z) whose program index the loop bounds (or ``values``) depend on, through
        any arithmetic and loads (a tile index read from a tensor at a program-dependent place counts)."""
        axes, seen = set(), set()
        todo = list(values) if values is not None else [v for lp in self.loops for v in lp[:3]]
        while todo:
            v = todo.pop()
            if v in seen or v not in self.defs:
                continue
            seen.add(v)
            op, operands, rest = self.defs[v]
            if op == "tt.get_program_id":
                axes.add("xyz".index(rest.split()[0]))
            todo.extend(operands)
        return axes

    def base(self, ptr: str) -> str | None:
        """The pointer argument a tile of pointers ``ptr`` offsets (through addptr, splat, broadcast, reshapes and
        loop-carried aliases), or None."""
        seen = set()
        while ptr not in seen:
            seen.add(ptr)
            name = ptr[1:].split("#")[0]
            if name in self.values:
                return name
            if ptr not in self.defs or not self.defs[ptr][1]:
                return None
            op, operands, _ = self.defs[ptr]
            if op not in ("tt.addptr", "tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape", "alias"):
                return None
            ptr = operands[0]
        return None


def sweep_rereads(ir: IR, nbytes: dict, grid: tuple, l2_bytes: float) -> tuple[float, list]:
    """DRAM bytes beyond each tensor's one read that a launch's re-reads across grid sweeps cost: (bytes, one
    (tensor, axis, reads, sweep bytes, hit share) per tensor that pays them).

    The block scheduler dispatches programs in launch order, axis x fastest (then y, z). A tensor whose accesses
    do not depend on program axis ``a`` (y or z; ``IR.program_axes`` of its pointers) is read again by the
    programs that differ only along ``a``, one full sweep of the faster axes apart: between two reads of the same
    bytes the launch touches every tensor's bytes that the faster axes index (a tensor's size over the extents of
    its axes at or above ``a``, at most what that many programs access). While that sweep fits in the L2 the
    re-reads hit; when it does not, the share of it the L2 holds (``l2_bytes`` / sweep: what an L2 that does not
    keep the oldest lines first retains; an LRU would keep none) hits and the rest of each re-read crosses DRAM.
    Re-reads along x (adjacent programs, running together) and within a program are L2 hits, as before."""
    g = [int(x) for x in grid] + [1] * (3 - len(grid))
    trips = [t for t, _ in ir.trips()]
    per: dict = {}  # tensor -> [bytes per program (program 0's trips), axes, loaded]
    for op, ptr, b, loops in ir.accesses:
        name = ir.base(ptr)
        if name not in nbytes:
            continue
        e = per.setdefault(name, [0.0, set(), False])
        e[0] += b * math.prod(trips[i] for i in loops)
        e[1] |= ir.program_axes([ptr])
        e[2] = e[2] or op == "load"
    extra, why = 0.0, []
    for name, (b, axes, loaded) in per.items():
        free = [a for a in range(3) if g[a] > 1 and a not in axes]
        if not loaded or not free or free[0] == 0:
            continue
        a = free[0]
        stride = math.prod(g[:a])
        sweep = sum(
            min(nbytes[y] / math.prod(g[c] for c in ax if c >= a), stride * by) for y, (by, ax, _) in per.items()
        )
        if sweep <= l2_bytes:
            continue
        reads = math.prod(g[c] for c in free if c >= a)
        size = min(nbytes[name], b * math.prod(g) / reads)  # the part of it the launch reads
        hit = l2_bytes / sweep
        extra += size * (reads - 1) * (1.0 - hit)
        why.append((name, "xyz"[a], reads, sweep, round(hit, 3)))
    return extra, why


def _program_counts(fn, trips: list[int]):
    """Per program, per warp: (the ``sass.Counts`` of the costliest path through the function, loads of one iteration
    of the first loop that loads, or of the whole program without one). The path is ``sass.Function.path_counts``':
    an early exit (an ignored row) is not added to the path it skips."""
    total, runs = fn.path_counts(trips)
    in_flight = total.load_bytes()
    for lp in fn.loops:
        if lp.counts.load_bytes() and runs[id(lp)]:
            in_flight = lp.counts.load_bytes()
            break
    return total, in_flight


_ANALYSED: dict = {}


def price_triton(launch, m: model.Machine) -> dict:
    """Time of one Triton launch on ``m``: compiled for its arch, read from SASS, priced by ``predict_stream``."""
    key = (id(launch), m.name)
    if key not in _ANALYSED:
        _ANALYSED[key] = (launch, analyse_triton(launch, m))
    cost, details = _ANALYSED[key][1]
    pred = model.predict_stream(cost, details["grid"], 1, m)
    if details.get("busiest_program_s", 0.0) > pred["time_s"]:  # unequal programs: the busiest one ends the launch
        return {**details, "bound": "tail", "time_s": details["busiest_program_s"], "times_s": pred["times_s"]}
    return {**details, "bound": pred["bound"], "time_s": pred["time_s"], "times_s": pred["times_s"]}


def spill_traffic(
    local: float, frame: float, shared: float, resident: int, programs: int, m: model.Machine
) -> tuple[float, float]:
    """(bytes to L2, bytes to DRAM) of a launch's ``local`` bytes through local memory (LDL/STL of spilled
    registers), each program's spill frame ``frame`` bytes (per thread x threads), ``resident`` programs per SM with
    ``shared`` bytes of shared memory each. Local memory is cached in L1: the share of the resident frames that fits
    in the L1 shared memory leaves hits there (the accesses then cost their issue slots only); the rest misses to
    L2, and of that the share beyond the L2's capacity (the frames of every busy SM together) to DRAM as well."""
    frames = frame * resident
    if not local or not frames:
        return 0.0, 0.0
    l1_miss = 1.0 - min(1.0, max(0.0, m.l1_bytes - shared * resident) / frames)
    l2_miss = 1.0 - min(1.0, m.l2_bytes / (frames * min(m.sms, math.ceil(programs / resident))))
    return local * l1_miss, local * l1_miss * l2_miss


def _program_shares(ir: IR, grid: tuple) -> list[tuple[tuple, int]] | None:
    """The programs of a launch on ``grid`` whose loop bounds depend on the program index: (program index (x, y,
    z), how many programs share its trips) for every index along the axes the bounds read (the others at 0); None
    when every program runs the same trips."""
    import itertools

    axes = ir.program_axes()
    if not axes:
        return None
    g = [int(x) for x in grid] + [1] * (3 - len(grid))
    ranges = [range(g[a]) if a in axes else range(1) for a in range(3)]
    n = math.prod(g[a] for a in range(3) if a not in axes)
    return [(pid, n) for pid in itertools.product(*ranges)]


def analyse_triton(launch, m: model.Machine) -> tuple:
    """(StreamCost per program, details) of one Triton launch compiled for ``m``."""
    import torch
    from megakernels.bench.static import compiled

    from megakernels.triton.launch import compile_launch

    c = compiled.triton_kernel(launch, m.arch)
    ck = compile_launch(launch, m.arch)  # Triton's cache: the IR of the same compile
    values = dict(zip(launch.kernel.arg_names, launch.args))
    values.update({k: v for k, v in launch.kwargs.items() if k in launch.kernel.arg_names})
    ir = IR(ck.asm["ttir"], values, getattr(launch, "contents", None))
    n_loops = len(c.fn.loops)
    constant = [all(re.match(r"%c", x) for x in lp[:3]) for lp in ir.loops]

    def aligned(ir_trips):
        # the IR's loops matched to the SASS's: (trips, depth, bytes of one IR iteration) per SASS loop
        trips = [(t, d, b) for (t, d), b in zip(ir_trips, ir.loop_bytes)]
        if len(trips) != n_loops:
            # ptxas unrolls loops of known trip count away: drop the IR loops with constant bounds first
            var = [tdb for tdb, k in zip(trips, constant) if not k]
            if len(var) != n_loops and len({t for t, _, _ in trips}) == 1:
                var = [(trips[0][0], 0, 0)] * n_loops  # every loop of the IR runs the same count: so do the SASS's
            if len(var) != n_loops:
                raise ValueError(f"{launch.name}: {len(trips)} loops in the IR, {n_loops} in the SASS")
            trips = var
        return trips

    trips = aligned(ir.trips())
    warps = launch.num_warps
    # ptxas may unroll a loop of a small body u times (and peel the remainder): its SASS iteration then moves u
    # of the IR's iterations' bytes and runs trips / u times
    unroll = []
    for (_, _, ir_bytes), lp in zip(trips, c.fn.loops):
        sass_bytes = (lp.counts.load_bytes() + lp.counts.store_bytes()) * 32 * warps
        unroll.append(round(sass_bytes / ir_bytes) if ir_bytes and sass_bytes >= 1.5 * ir_bytes else 1)

    def program(trips):
        # one program's work (per warp) at these loop trips: the costliest path's counts, tensor-core clocks
        total, flight = _program_counts(c.fn, [t / u for (t, _, _), u in zip(trips, unroll)])
        mma = m.mma_clocks(total.mma_flops, total.mma_sync_flops, total.mma_fp8_flops, total.mma_tf32_flops)
        work = (total.instructions, total.mufu, total.load_bytes() + total.store_bytes(), total.local_bytes, mma)
        return work, flight

    programs = launch.num_ctas
    (instr, mufu, moved, local, mma), flight = program(trips)
    # Programs whose loop bounds a driver's contents set per program (``Recorder.contents``: the MoE's per-expert
    # token counts) do unequal work: each distinct program's trips are evaluated, the launch's work is their sum
    # (the per-program cost below is its mean), and its busiest program is priced as a launch of its own
    shares = _program_shares(ir, launch.grid) if getattr(launch, "contents", None) else None
    busiest = None
    if shares is not None:
        groups: dict = {}
        for pid, n in shares:
            t = tuple(aligned(ir.trips(pid)))
            groups[t] = groups.get(t, 0) + n
        works = [(t, n, *program(list(t))) for t, n in groups.items()]
        instr, mufu, moved, local, mma = (sum(n * w[i] for _, n, w, _ in works) / programs for i in range(5))
        flight = sum(n * f for _, n, _, f in works) / programs
        trips = [(sum(n * t[i][0] for t, n, _, _ in works) / programs, d, b) for i, (_, d, b) in enumerate(trips)]
        busiest = works
    mma_cycles = mma * warps
    resident = model.blocks_per_sm(m, c.threads, c.registers, c.shared_bytes, math.ceil(programs / m.sms))
    nbytes = {k: v.numel() * v.element_size() for k, v in values.items() if isinstance(v, torch.Tensor)}
    compulsory = sum(nbytes[k] for k in ir.loaded if k in nbytes) + sum(nbytes[k] for k in ir.stored if k in nbytes)
    l2_total = moved * 32 * warps * programs
    # Re-reads hit L2 while the data a program reuses stays there: one iteration of a single top-level loop (a
    # stream of rows), else everything the program loads (several passes over the same row). A loop's depth counts
    # the IR's enclosing braces (module, function), so the top level is the smallest depth.
    loaded = sum(nbytes[k] for k in ir.loaded if k in nbytes) / programs
    depths = [d for _, d, _ in trips]
    top = [t for t, d, _ in trips if d == min(depths)] if depths else []
    reuse = loaded / max(1, top[0]) if len(top) == 1 else loaded
    touched = reuse * min(programs, resident * m.sms)
    dram_total = compulsory if touched <= m.l2_bytes else max(compulsory, l2_total)
    # re-reads a grid sweep apart that the L2 cannot hold across the sweep (``sweep_rereads``)
    sweep_extra, sweep_why = sweep_rereads(ir, nbytes, launch.grid, m.l2_bytes)
    if touched <= m.l2_bytes and sweep_extra:
        dram_total = min(max(compulsory, l2_total), compulsory + sweep_extra)
    spilled = local * 32 * warps * programs
    to_l2, to_dram = spill_traffic(spilled, c.spill_bytes * c.threads, c.shared_bytes, resident, programs, m)
    l2_total += to_l2
    dram_total += to_dram
    cost = model.StreamCost(
        instructions=instr * 32 * warps,
        mufu=mufu * 32 * warps,
        l2_bytes=l2_total / programs,
        dram_bytes=dram_total / programs,
        min_bytes=compulsory / programs,
        in_flight_per_sm=flight * 32 * warps * resident,
        warps_per_sm=resident * warps,
        sm_fraction=min(1.0, programs / m.sms),
        mma_cycles=mma_cycles,
    )
    details = {}
    if busiest is not None:
        # the launch lasts at least as long as its busiest program would as a launch of its own (one program on
        # one SM, its loads alone in flight; its DRAM bytes its L2 bytes at the launch's DRAM share of them)
        def alone(work, flight):
            w_instr, w_mufu, w_moved, w_local, w_mma = work
            l2 = w_moved * 32 * warps + (w_local * 32 * warps * to_l2 / spilled if spilled else 0.0)
            one = model.StreamCost(
                instructions=w_instr * 32 * warps,
                mufu=w_mufu * 32 * warps,
                l2_bytes=l2,
                dram_bytes=l2 * dram_total / l2_total if l2_total else 0.0,
                min_bytes=0.0,
                in_flight_per_sm=flight * 32 * warps,
                warps_per_sm=warps,
                sm_fraction=1.0 / m.sms,
                mma_cycles=w_mma * warps,
            )
            return model.predict_stream(one, 1, 1, m)["time_s"]

        t, _, work, f = max(busiest, key=lambda w: alone(w[2], w[3]))
        details = {"busiest_program_s": alone(work, f), "busiest_loop_trips": [x for x, _, _ in t]}
    return cost, {
        "kernel": launch.name,
        "grid": programs,
        "warps": warps,
        "registers": c.registers,
        "spill_bytes": c.spill_bytes,
        "local_bytes": spilled,
        "blocks_per_sm": resident,
        "loop_trips": [t for t, _, _ in trips],
        "instructions_per_program": instr * warps,
        "dram_bytes": dram_total,
        "l2_bytes": l2_total,
        **({"sweep_rereads": sweep_why} if sweep_extra else {}),
        **details,
    }


def _op_name(op: Op) -> str:
    return op.func.__name__.split(".")[0] if hasattr(op.func, "__name__") else str(op.func)


def launches_nothing(op: Op) -> bool:
    """Whether a recorded PyTorch op launches no kernel: a view, an allocation, a query, an op with no output."""
    schema = getattr(op.func, "_schema", None)
    if schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return True  # a view (an in-place op, whose return aliases the tensor it writes, launches a kernel)
    return not op.outputs or _op_name(op) in (
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "device",
        "lift_fresh",
        "sym_size",
        "sym_stride",
        "sym_numel",
    )


# PyTorch ops whose kernels write their outputs without reading their inputs' data (the input gives a shape, or is
# the tensor filled in place)
WRITES_ONLY = frozenset(
    {"zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like", "fill_", "zero_", "normal_",
     "uniform_", "random_", "bernoulli_"}
)  # fmt: skip


def price_torch(op: Op, m: model.Machine) -> dict | None:
    """GPU time of one recorded PyTorch op on ``m``; None for one that launches no kernel."""

    if launches_nothing(op):
        return None
    name = _op_name(op)

    def size(t):
        return math.prod(t[0]) * t[1].itemsize

    # an op that only writes (a factory like zeros_like, a fill) reads nothing of its inputs
    nbytes = (0 if name in WRITES_ONLY else sum(size(t) for t in op.inputs)) + sum(size(t) for t in op.outputs)
    # PyTorch's CUDA softmax backward (not the log one) is two kernels: tmp = grad * output, then the row kernel on
    # (tmp, output) (aten/src/ATen/native/cuda/SoftMax.cu, softmax_backward_cuda_out)
    kernels = 2 if name == "_softmax_backward_data" else 1
    nbytes *= kernels
    t = nbytes / m.dram_copy
    bound = "dram"
    extra = {"kernels": kernels} if kernels > 1 else {}
    if name in ("mm", "addmm", "bmm", "baddbmm", "matmul") and len(op.inputs) >= 2:
        a, b = op.inputs[-2][0], op.inputs[-1][0]
        batch, rows, cols, depth = cublas.dims(a, b)
        g = cublas.gemm_time(m, batch, rows, cols, depth, op.inputs[-1][1])
        extra = {"gemm": f"{batch}x{rows}x{cols}x{depth} {str(op.inputs[-1][1]).split('.')[-1]}", **g}
        extra.pop("time_s")
        if g["time_s"] > t:
            t, bound = g["time_s"], "mma"
    return {"kernel": f"aten.{name}", "bound": bound, "time_s": t + kernels * m.launch_s, "dram_bytes": nbytes, **extra}


# The ops Inductor leaves as extern kernels (called as they are from its generated code): the GEMMs; a Triton kernel
# a compiled function launches is its own kernel too
EXTERN = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "_scaled_mm", "convolution", "_convolution"})


def fuse_compiled(ops: list[Op]) -> list[tuple]:
    """The kernels Inductor runs for one compiled call, from the ops recorded in it (between its "compiled" and
    "compiled_end" markers, the latter included for the call's outputs), in order of first appearance: ("extern",
    op) for a GEMM (``EXTERN``) or a Triton launch, kept as it is; ("fused", {"ops", "read_bytes", "write_bytes"})
    for a fused kernel. Assumptions about Inductor (docs/static-cost-model.md §9):

    - every op that launches something and is not extern joins a fused kernel; the fused kernels are the levels of
      the data flow between externs: an op joins level g, the latest level among its inputs' producers (a fused
      kernel's level, or an extern's), and an extern fed by level g runs after it and before level g + 1 (an
      extern fed only by externs or by the call's inputs shares their level);
    - a fused kernel reads from DRAM each tensor it reads that it did not produce itself (once, whatever the number
      of its ops that read it), and writes each tensor it produces that is read outside it (by a later kernel) or
      leaves the call (a returned storage, or one made before the call that the call writes into); what it makes
      and uses itself stays on chip. Bytes are the views' distinct elements, at most the storage's;
    - where its rows are longer than a persistent reduction holds, a fused kernel runs as Inductor's looped
      reduction: one loop over the rows per reduction a later op of the kernel needs, each loop reading again what
      it uses (``_row_passes``: the kernel's reads are its passes' reads summed; "passes" counts them);
    - views and allocations launch nothing.

    Raises:
        ValueError: a read-back (a graph break) inside the call, or no "compiled_end" marker."""
    if not ops or ops[-1].kind != "compiled_end":
        raise ValueError("a compiled region's ops must end with its 'compiled_end' marker")
    returned = set(ops[-1].access[0]) if ops[-1].access else set()
    version: dict[int, int] = {}  # storage -> its current version (each write makes one)
    made_by: dict[tuple, tuple] = {}  # (storage, version) -> ("g", level) | ("e", level)
    readers: dict[tuple, set] = {}  # (storage, version) -> the kernels that read it
    outside, seen = set(), set()  # storages the call did not make; storages met
    groups: dict[int, dict] = {}
    kernels: list = []  # ("extern", op, tag) | ("group", level), in order of first appearance

    def level_of(sid: int) -> tuple:
        return made_by.get((sid, version.get(sid, 0)), ("in", 0))

    for i, op in enumerate(ops[:-1]):
        if op.kind == "sync":
            raise ValueError("a read-back inside a compiled region (a graph break) is not modelled")
        if op.kind not in ("torch", "triton"):
            continue
        ins, outs = op.access or ((), ())
        for a in ins:
            if a[0] not in seen:
                seen.add(a[0])
                outside.add(a[0])
        seen.update(a[0] for a in outs)
        extern = op.kind == "triton" or _op_name(op) in EXTERN
        if op.kind == "torch" and not extern and launches_nothing(op):
            continue  # a view or an allocation
        made = [level_of(a[0]) for a in ins]
        if extern:
            level = max([g + 1 if kind == "g" else g for kind, g in made], default=0)
            tag = ("e", i)
            kernels.append(("extern", op, tag))
        else:
            level = max([g for _, g in made], default=0)
            tag = ("g", level)
            if level not in groups:
                groups[level] = {"ops": 0, "reads": {}, "writes": {}, "trace": []}
                kernels.append(("group", level))
            group = groups[level]
            group["ops"] += 1
        in_keys = []
        for a in ins:
            key = (a[0], version.get(a[0], 0))
            in_keys.append((key, a[1], a[2], a[3]))
            readers.setdefault(key, set()).add(tag)
            if not extern and made_by.get(key) != tag:
                group["reads"].setdefault(key, {})[a[1]] = (a[2], a[3])
        out_keys = []
        for a in outs:
            version[a[0]] = version.get(a[0], 0) + 1
            key = (a[0], version[a[0]])
            out_keys.append((key, a[1], a[2], a[3]))
            made_by[key] = ("e", level) if extern else tag
            if not extern:
                group["writes"].setdefault(key, {})[a[1]] = (a[2], a[3])
        if not extern:
            group["trace"].append((_op_name(op), in_keys, out_keys))

    def nbytes(views: dict) -> int:
        return min(sum(b for b, _ in views.values()), max(s for _, s in views.values()))

    out = []
    for k in kernels:
        if k[0] == "extern":
            out.append(("extern", k[1]))
            continue
        tag, group = ("g", k[1]), groups[k[1]]
        written, stored = 0, set()
        for key, views in group["writes"].items():
            sid, v = key
            leaves = v == version[sid] and (sid in returned or sid in outside)
            if leaves or readers.get(key, set()) - {tag}:
                written += nbytes(views)
                stored.add(key)
        passes, materialised = _row_passes(group["trace"], stored)
        seen_views: dict = {}
        for _, ins, outs in group["trace"]:
            for key, view, b, sb in (*ins, *outs):
                seen_views.setdefault(key, {})[view] = (b, sb)
        read = sum(nbytes(seen_views[key]) for keys in passes for key in keys)
        written += sum(nbytes(seen_views[key]) for key in materialised - stored)
        out.append(("fused", {"ops": group["ops"], "read_bytes": read, "write_bytes": written, "passes": len(passes)}))
    return out


# How Inductor runs the ops of one fused kernel over their rows (torch 2.x, torch/_inductor): the ops that reduce a
# row and then use the result (softmax and log-softmax, forward and backward) decompose into a reduction and a
# pointwise use of it; those that reduce to fewer elements end a row's data flow there.
ROW_NORMALISE = frozenset({"_log_softmax", "_softmax", "_log_softmax_backward_data", "_softmax_backward_data"})
# indirect reads: one element of the indexed input per output element (a gather's load, not a pass over the row)
GATHERS = frozenset({"gather", "nll_loss_forward", "nll_loss2d_forward", "index_select", "index", "take_along_dim"})
# indirect writes: Inductor stores their result (a scatter cannot be recomputed where it is used)
SCATTERS = frozenset({"scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "index_put",
                      "index_put_", "index_add", "index_add_", "masked_scatter"})  # fmt: skip
# inputs an op takes for their shape only (the positions among its tensor arguments)
SHAPE_ONLY = {"nll_loss_backward": (1,), "nll_loss2d_backward": (1,), "new_zeros": (0,), "new_ones": (0,),
              "new_full": (0,), "new_empty": (0,)}  # fmt: skip
# a reduction whose row is at most this long runs persistent, the row held in registers and read once
# (torch/_inductor/choices.py, InductorChoices.should_use_persistent_reduction: ReductionHint.INNER -> 1024)
PERSISTENT_RBLOCK = 1024


def _numel(entry: tuple) -> int:
    """Elements of the view of one access entry (key, (offset, shape, strides, dtype), bytes, storage bytes)."""
    return math.prod(entry[1][1])


def _keeps_last(ins: list, outs: list) -> bool:
    """Whether a reduction keeps its largest input's last dimension (reduces leading ones: a column reduction)."""
    src = max(ins, key=_numel)[1][1]
    out = outs[0][1][1]
    return len(src) >= 2 and _numel(outs[0]) > 1 and bool(out) and out[-1] == src[-1]


def _row_passes(trace: list, stored: set) -> tuple[list, set]:
    """The DRAM reads of one fused kernel's row passes, as Inductor's looped reduction kernel makes them: (a list
    of sets of the tensors (storage, version) each pass reads, the tensors the kernel materialises).

    ``trace`` is the kernel's ops in order (name, inputs, outputs; each entry (key, view, bytes, storage bytes));
    ``stored`` the tensors the kernel writes out. Rules, each from Inductor's source:

    - an op runs in pass p, the latest pass at which one of its inputs is ready; a row reduction's result (a
      reduction, or the statistics of a softmax family op) is ready one pass after the pass that reads its input:
      a node that needs a reduction's result closes the kernel's loop over the row and opens the next one
      (codegen/simd.py, ``SIMDKernel.disable_reduction`` -> ``codegen_body``), and each loop loads again what it
      uses;
    - a value made in the kernel is recomputed where it is used (Inductor inlines pointwise nodes into their
      readers): a pass that uses it reads the tensors it was made from, unless it is stored (written out of the
      kernel, or a scatter's result: Inductor's scatters are kernels of their own), when the pass reads it (a
      stored value the same pass made is still on chip); reduction results are per row, held on chip;
    - a reduction over leading dimensions (a column sum) has another iteration order and gets a loop of its own
      (``Scheduler.can_fuse`` needs the same numel and reduction numel);
    - a softmax family op's reduction reads its first input (the backward's: the gradient), the use of its result
      all its inputs;
    - gathers read one element a row, and shape-only inputs (a factory's, ``WRITES_ONLY``) nothing;
    - where the longest reduced row is at most ``PERSISTENT_RBLOCK`` the kernel is a persistent reduction: the row
      stays in registers, so every tensor is read once (the passes collapse into one)."""
    ready: dict = {}  # key -> the pass from which the value can be used
    made: dict = {}  # key -> (pass it is made in, the tensors a use reads)
    passes: dict = {}
    materialised: set = set()
    extra = 0  # column reductions' own loops
    row = 0

    def sources(key):
        return made[key][1] if key in made else frozenset({key})

    for name, ins, outs in trace:
        shape_only = range(len(ins)) if name in WRITES_ONLY else SHAPE_ONLY.get(name, ())
        used = [e for i, e in enumerate(ins) if i not in shape_only]
        p = max((ready.get(e[0], 0) for e in used), default=0)
        full = [e for e in used if name not in GATHERS or e[2] == min(x[2] for x in used)]
        src = frozenset().union(*(sources(e[0]) for e in full)) if full else frozenset()
        # a softmax family op's reduction reads its first input only (the input, or the gradient: the backward's
        # row sum is of the gradient; the output it scales is read where the result is used)
        reads = sources(used[0][0]) if name in ROW_NORMALISE and used else src
        out_bytes = max((e[2] for e in outs), default=0)
        reduces = name in ROW_NORMALISE or bool(
            name not in GATHERS and used and outs and out_bytes and _numel(outs[0]) < max(_numel(e) for e in used)
        )
        if reduces or name in ROW_NORMALISE:
            row = max(row, max(e[1][1][-1] if e[1][1] else 1 for e in used))
        column = reduces and name not in ROW_NORMALISE and _keeps_last(used, outs)
        if column:
            extra += 1
            passes[("column", extra)] = set(reads)
        else:  # what the pass made and did not scatter is still on chip
            passes.setdefault(p, set()).update(
                k for k in reads if not (k in made and made[k][0] == p and k not in materialised)
            )
        at = p + 1 if reduces else p  # the pass that makes the output
        if name in ROW_NORMALISE and any(key in stored for key, *_ in outs):  # written where it is made
            passes.setdefault(at, set()).update(k for k in src if not (k in made and made[k][0] == at))
        for key, *_ in outs:
            if name in SCATTERS:
                materialised.add(key)
            if key in stored or name in SCATTERS:
                made[key] = (at, frozenset({key}))
            elif reduces and name not in ROW_NORMALISE:
                made[key] = (at, frozenset())  # per row, on chip
            else:
                made[key] = (at, src)
            ready[key] = at
    order = [passes[k] for k in sorted(k for k in passes if not isinstance(k, tuple))]
    order = [s for s in order if s]
    columns = [s for k, s in passes.items() if isinstance(k, tuple) and s]
    if row <= PERSISTENT_RBLOCK:
        merged = set().union(*order, *columns) if order or columns else set()
        return ([merged] if merged else []), materialised
    return order + columns, materialised


def price_compiled(ops: list[Op], m: model.Machine) -> list[dict]:
    """The GPU time of each kernel of one compiled call (``fuse_compiled``) on ``m``: an extern as it is priced
    eagerly (``price_torch``, ``price_triton``); a fused kernel its DRAM bytes at the copy rate and one launch."""
    out = []
    for kind, k in fuse_compiled(ops):
        if kind == "extern":
            out.append(price_triton(k.launch, m) if k.kind == "triton" else price_torch(k, m))
            continue
        nbytes = k["read_bytes"] + k["write_bytes"]
        t = nbytes / m.dram_copy + m.launch_s
        out.append({"kernel": f"inductor.fused({k['ops']} ops)", "bound": "dram", "time_s": t, "dram_bytes": nbytes})
    return out


def price(ops: list[Op], m: model.Machine, host: Host = HOST) -> dict:
    """The published time of a recorded region: the GPU's time (its kernels in order) or the host's time the
    flush does not hide, whichever is longer. A compiled call (``Recorder.compiled``) costs the host one
    ``function_s`` (the call through its compiled wrapper: guards and the generated code, no per-op dispatch) and
    ``torch_op_s`` per kernel it launches; its GPU time is ``price_compiled``'s."""
    gpu, host_t, after_sync, synced, launches = 0.0, 0.0, 0.0, False, []
    ops = list(ops)
    i = 0
    while i < len(ops):
        op = ops[i]
        i += 1
        if op.kind == "return":
            continue
        if op.kind == "compiled":
            end = next((j for j in range(i, len(ops)) if ops[j].kind == "compiled_end"), None)
            if end is None:
                raise ValueError("a compiled region without its 'compiled_end' marker")
            kernels = price_compiled(ops[i : end + 1], m)
            i = end + 1
            dh = host.function_s + host.torch_op_s * len(kernels)
            host_t += dh
            after_sync += dh
            gpu += sum(r["time_s"] for r in kernels)
            launches.extend(kernels)
            continue
        if op.kind == "ours":  # one of our launches (streaming.Part), made from C++ behind a custom op
            r = ours_price(op.launch, m)
            dh = host.torch_op_s
        elif op.kind == "triton":
            r = price_triton(op.launch, m)
            dh = host.triton_launch_s
        elif op.kind == "torch":
            r = price_torch(op, m)
            dh = host.torch_op_s
        elif op.kind == "sync":
            synced, after_sync, r, dh = True, 0.0, None, host.torch_op_s
            after_sync = max(after_sync, 0.0)
            gpu = max(gpu, host_t - host.flush_bytes / m.dram_copy)  # the host waited for the GPU
        else:
            r, dh = None, host.function_s + (host.backward_s if op.func == "backward" else 0.0)
        host_t += dh
        after_sync += dh
        if r is not None:
            gpu += r["time_s"]
            launches.append(r)
    flush = host.flush_bytes / m.dram_copy
    exposed = after_sync if synced else max(0.0, host_t - flush)
    total = max(gpu, exposed)
    return {
        "time_s": total,
        "gpu_s": gpu,
        "host_exposed_s": exposed,
        "bound": "host" if exposed > gpu else "gpu",
        "launches": launches,
    }


def ours_price(part, m: model.Machine) -> dict:
    """Time of one of our launches (a ``streaming.Part``) on ``m``."""
    from megakernels.bench.static import streaming

    key = (id(part), m.name)
    if key not in _ANALYSED:
        _ANALYSED[key] = (part, streaming.price_parts([part], m)[0])
    return {**_ANALYSED[key][1], "ours": True}


def substitute(ops: list[Op], ours: dict) -> list[Op]:
    """The recorded region with each of the peer's autograd function passes (what ran between ``call`` and
    ``return``) replaced by our launches for that pass (``ours``: {"fwd"/"bwd": [Part, ...]}); the call itself
    (the autograd function's host cost) and everything around it are kept.

    Raises:
        ValueError: a pass the region runs that ``ours`` has no launches for."""
    out, inside = [], False
    for op in ops:
        if op.kind == "call":
            p = "bwd" if op.func == "backward" else "fwd"
            if p not in ours:
                raise ValueError(f"no launches of ours for the {p} pass")
            out.append(op)
            out.extend(Op("ours", launch=part) for part in ours[p])
            inside = True
        elif op.kind == "return":
            inside = False
        elif not inside:
            out.append(op)
    return out


def _inside(ops: list[Op]) -> list[Op]:
    """The ops the peer's autograd functions ran (between ``call`` and ``return``)."""
    out, inside = [], False
    for op in ops:
        if op.kind in ("call", "return"):
            inside = op.kind == "call"
        elif inside:
            out.append(op)
    return out


def _op_time(op: Op, m: model.Machine) -> float:
    r = price_triton(op.launch, m) if op.kind == "triton" else price_torch(op, m) if op.kind == "torch" else None
    return r["time_s"] if r else 0.0


def price_ours(r: dict, rec: list, m: model.Machine, host: Host = HOST) -> dict:
    """Our kernels in the peer's benchmark region of row ``r``: ``ours_predicted_ms`` and what binds it, or
    ``ours_reason`` why we have no prediction."""
    from megakernels.bench.static import ours

    try:
        cfg = json.loads(r["extra_benchmark_config_str"] or "{}")
        parts = ours.passes(r["kernel_name"], r["kernel_operation_mode"], float(r["x_value"]), cfg, m)
        if isinstance(parts, str):
            return {"ours_predicted_ms": None, "ours_reason": parts}
        res = price(substitute(rec, parts), m, host)
    except Exception as e:  # noqa: BLE001 - a kernel of ours the model cannot read is a reason, not a crash
        return {"ours_predicted_ms": None, "ours_reason": f"{type(e).__name__}: {str(e)[:300]}"}
    mine = [q for q in res["launches"] if q.get("ours")]
    kernels_s = sum(q["time_s"] for q in mine)
    if res["bound"] == "host":
        bound = "host"
    else:  # the resource that binds our slowest launch (what the region shares with the peer binds both alike)
        top = max(mine or res["launches"], key=lambda q: q["time_s"])
        name = re.search(r"(\w+)<", top["kernel"]) or re.search(r"(\w+)\(", top["kernel"])
        bound = f"{top['bound']} ({name.group(1) if name else top['kernel']})"
    return {
        "ours_predicted_ms": res["time_s"] * 1e3,
        "ours_gpu_ms": res["gpu_s"] * 1e3,
        "ours_kernels_ms": kernels_s * 1e3,
        "ours_host_exposed_ms": res["host_exposed_s"] * 1e3,
        "ours_bound": bound,
        "ours_launches": [
            {"kernel": q["kernel"], "bound": q["bound"], "time_us": q["time_s"] * 1e6}
            | ({"ours": True} if q.get("ours") else {})
            for q in res["launches"]
        ],
    }


# ---- the command -----------------------------------------------------------------------------------------------


def _key(r: dict) -> tuple:
    return (
        r["kernel_name"],
        r["kernel_operation_mode"],
        r["gpu_name"],
        r["x_value"],
        r["extra_benchmark_config_str"],
        r["liger_version"],
    )


def predict_row(r: dict, peer_path: str | None, cache: dict, machines: dict | None = None, host: Host = HOST) -> dict:
    """One CSV row through the model: ``predicted_ms`` and ``rel_error``, or ``reason`` it cannot be modelled."""
    out = {
        k: r.get(k)
        for k in (
            "kernel_name",
            "kernel_provider",
            "kernel_operation_mode",
            "gpu_name",
            "x_value",
            "extra_benchmark_config_str",
            "liger_version",
        )
    }
    try:
        out["published_ms"] = float(r["y_value_50"])
    except (TypeError, ValueError):
        return {**out, "published_ms": None, "predicted_ms": None, "rel_error": None, "reason": "no y_value_50"}
    none = {"predicted_ms": None, "rel_error": None}
    if r["kernel_provider"] != _peer_provider(r):
        return {**out, **none, "reason": f"provider {r['kernel_provider']!r}: only the peer's kernels are modelled"}
    if r["kernel_name"] in NOT_DRIVEN:
        return {**out, **none, "reason": f"{r['kernel_name']}: {NOT_DRIVEN[r['kernel_name']]}"}
    if r["kernel_name"] not in DRIVERS:
        return {**out, **none, "reason": f"no driver for kernel {r['kernel_name']!r} (drivers: {', '.join(DRIVERS)})"}
    used = resolve_version(r["kernel_name"], r["liger_version"] or "")
    if used != r["liger_version"]:
        out["liger_version_used"] = used
    m = model.machine_for(r["gpu_name"])
    if m is not None and machines:
        m = machines.get(m.name, m)
    if m is None:
        return {**out, **none, "reason": f"GPU {r['gpu_name']!r} is not in model.MACHINES"}
    if r["kernel_operation_mode"] not in ("forward", "backward", "full"):
        return {**out, **none, "reason": f"mode {r['kernel_operation_mode']!r}"}
    key = _key(r)
    if key not in cache:
        cache[key] = record(r, m, peer_path)
    rec = cache[key]
    if isinstance(rec, str):
        return {**out, **none, "reason": rec}
    try:
        res = price(rec, m, host)
    except Exception as e:  # noqa: BLE001 - a kernel the model cannot read is a reason, not a crash
        return {**out, **none, "reason": f"{type(e).__name__}: {str(e)[:300]}"}
    pred_ms = res["time_s"] * 1e3
    mine = price_ours(r, rec, m, host)
    if mine["ours_predicted_ms"] is not None:
        mine["ours_over_peer"] = mine["ours_predicted_ms"] / pred_ms
        if mine["ours_over_peer"] <= 1:
            mine.pop("ours_bound")  # the binding resource is reported where we are behind
        mine["peer_kernels_ms"] = sum(_op_time(op, m) for op in _inside(rec)) * 1e3
    return {
        **out,
        **mine,
        "predicted_ms": pred_ms,
        "rel_error": (pred_ms - out["published_ms"]) / out["published_ms"],
        "bound": res["bound"],
        "gpu_ms": res["gpu_s"] * 1e3,
        "host_exposed_ms": res["host_exposed_s"] * 1e3,
        "launches": [
            {k: v for k, v in q.items() if k != "times_s"} | {"time_us": q["time_s"] * 1e6} for q in res["launches"]
        ],
    }


def _version_key(v: str) -> tuple:
    return tuple(int(p) for p in re.findall(r"\d+", v))


def resolve_version(kernel: str, version: str) -> str:
    """The liger-kernel release that row of ``kernel`` naming ``version`` is modelled with: ``version`` itself, or,
    when that release predates the kernel's module (``FIRST_RELEASE``) or the source the row ran
    (``SOURCE_RELEASE``), the first release that has it (the row then measured the source between the two releases:
    the label is the benchmark machine's installed package)."""
    for first in (FIRST_RELEASE.get(MODULES.get(kernel, "")), SOURCE_RELEASE.get(kernel)):
        if first is not None and _version_key(first) > _version_key(version):
            version = first
    return version


def ensure_peer(version: str, peer_path: str | None) -> str | None:
    """``peer_dir(version)``, installing liger-kernel ``version`` there first when it is missing (``pip install
    --no-deps --target``, the registry's wheel; ``MEGAKERNELS_PEER_INSTALL=0`` turns this off). None when it is
    neither installed nor installable."""
    path = peer_dir(version, peer_path)
    if path is None and os.environ.get("MEGAKERNELS_PEER_INSTALL", "1") != "0":
        import subprocess

        target = os.path.join(peer_path or default_peer_root(), f"liger-kernel-{version}")
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", target]
        try:
            subprocess.run([*cmd, f"liger-kernel=={version}"], capture_output=True, timeout=600, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        path = peer_dir(version, peer_path)
    return path


def record(r: dict, m: model.Machine, peer_path: str | None) -> list | str:
    """The ops the row's timed region runs (``Op`` list), or why they cannot be recorded."""
    version = resolve_version(r["kernel_name"], r["liger_version"])
    path = ensure_peer(version, peer_path)
    if path is None:
        return install_hint(version, peer_path)
    module = MODULES.get(r["kernel_name"])
    if module and not os.path.exists(os.path.join(path, "liger_kernel", module)):
        return f"liger-kernel {version} has no liger_kernel/{module}"
    try:
        cfg = json.loads(r["extra_benchmark_config_str"] or "{}")
        x = float(r["x_value"])
        x = int(x) if x.is_integer() else x
    except ValueError as e:
        return f"unreadable shape: {e}"
    rec = Recorder(m)
    try:
        with imported(path), rec.patched():
            DRIVERS[r["kernel_name"]](rec, r["kernel_operation_mode"], x, cfg)
        return rec.ops
    except Exception as e:  # noqa: BLE001 - a peer version the drivers do not fit is a reason, not a crash
        return f"{type(e).__name__}: {str(e)[:300]}"


def run(csv_path: str, peer_path: str | None = None, log=print) -> dict:
    """Every row of ``csv_path`` through the model; the ``calibration.json`` payload."""
    rows = select(read_csv(csv_path))
    cache: dict = {}
    out = []
    for r in rows:
        p = predict_row(r, peer_path, cache)
        out.append(p)
        if log and p.get("rel_error") is not None:
            log(
                f"  {p['kernel_name']:<14}{p['kernel_operation_mode']:<9}{p['gpu_name'][7:]:<20}{p['x_value']:>8}"
                f"  published {p['published_ms']:9.4f} ms  predicted {p['predicted_ms']:9.4f} ms"
                f"  {100 * p['rel_error']:+6.0f}%  {p['bound']}"
            )
    side = side_by_side(out)
    if log:
        for line in side_by_side_table(side):
            log(line)
    modelled = [p for p in out if p.get("rel_error") is not None]
    skipped = [p for p in out if p.get("rel_error") is None and p["kernel_provider"] == _peer_provider(p)]
    summary = summarise(modelled)
    summary["not_modelled"] = {
        "rows": len(out) - len(modelled),
        "peer_rows": len(skipped),
        "reasons": sorted({p["reason"] for p in skipped}),
    }
    from megakernels.bench.common import git_commit

    gpus = sorted({p["gpu_name"] for p in modelled})
    return {
        "machine": {"name": "published Liger-Kernel timings on " + ", ".join(gpus)},
        "commit": git_commit(),
        "date": __import__("time").strftime("%Y-%m-%d"),
        "csv": os.path.relpath(csv_path),
        "machines": {k: dataclasses.asdict(v) for k, v in model.MACHINES.items()},
        "host": dataclasses.asdict(HOST),
        "rows": out,
        "summary": summary,
        "side_by_side": side,
    }


def _shape_key(p: dict) -> tuple:
    return (p["kernel_name"], p["kernel_operation_mode"], p["gpu_name"], p["x_value"], p["extra_benchmark_config_str"])


def side_by_side(rows: list[dict]) -> dict:
    """Per op, mode and shape of the peer's rows: our predicted time over the peer's (``ours_over_peer``) and over
    the published HuggingFace-eager and torch.compile rows of the same shape (``ours_over_hf``,
    ``ours_over_compile``); where we are behind, what binds ours; and a summary (shapes ahead, behind, the worst)."""
    published: dict = {}
    for p in rows:
        if p.get("published_ms") is not None:
            published.setdefault(_shape_key(p), {})[p["kernel_provider"]] = p["published_ms"]
    shapes = []
    for p in rows:
        if p["kernel_provider"] != _peer_provider(p):
            continue
        pub = published.get(_shape_key(p), {})
        ours_ms = p.get("ours_predicted_ms")
        s = {
            "kernel_name": p["kernel_name"],
            "mode": p["kernel_operation_mode"],
            "gpu_name": p["gpu_name"],
            "x_value": p["x_value"],
            "config": p["extra_benchmark_config_str"],
            "ours_predicted_ms": ours_ms,
            "peer_predicted_ms": p.get("predicted_ms"),
            "ours_over_peer": p.get("ours_over_peer"),
            "peer_published_ms": pub.get(_peer_provider(p)),
            "huggingface_ms": pub.get("huggingface"),
            "torch_compile_ms": pub.get("torch_compile"),
        }
        for name, prov in (("ours_over_hf", "huggingface"), ("ours_over_compile", "torch_compile")):
            s[name] = ours_ms / pub[prov] if ours_ms is not None and pub.get(prov) else None
        if p.get("ours_bound"):
            s["ours_bound"] = p["ours_bound"]
        if ours_ms is None:
            s["reason"] = p.get("ours_reason") or p.get("reason")
        shapes.append(s)
    done = [s for s in shapes if s["ours_over_peer"] is not None]
    behind = [s for s in done if s["ours_over_peer"] > 1]
    worst = max(done, key=lambda s: s["ours_over_peer"]) if done else None
    summary = {
        "shapes": len(shapes),
        "compared": len(done),
        "ahead": len(done) - len(behind),
        "behind": len(behind),
        "behind_within_2pct": sum(1 for s in behind if s["ours_over_peer"] <= 1.02),
        "median_ours_over_peer": statistics.median([s["ours_over_peer"] for s in done]) if done else None,
        "worst": worst,
        "behind_by_bound": {},
        "not_compared": sorted({s["reason"] for s in shapes if s["ours_over_peer"] is None and s.get("reason")}),
    }
    for s in behind:
        b = s["ours_bound"].split(" ")[0]
        summary["behind_by_bound"][b] = summary["behind_by_bound"].get(b, 0) + 1
    return {"shapes": shapes, "summary": summary}


def side_by_side_table(side: dict) -> list[str]:
    """The side-by-side table, a line a shape (op, mode, GPU, shape), then its summary."""

    def f(v, fmt):
        return format(v, fmt) if v is not None else "-".rjust(int(fmt.split(".")[0]))

    lines = [
        f"{'op':<14}{'mode':<9}{'gpu':<8}{'x':>7}  {'ours ms':>9} {'peer ms':>9} {'ours/peer':>9}"
        f"  {'liger pub':>9} {'hf pub':>9} {'ours/hf':>8} {'compile':>8}  bound of ours where behind"
    ]
    for s in side["shapes"]:
        gpu = "A100" if "A100" in s["gpu_name"] else "H100" if "H100" in s["gpu_name"] else s["gpu_name"][:7]
        tail = s.get("ours_bound", "") if (s["ours_over_peer"] or 0) > 1 else ""
        if s["ours_over_peer"] is None:
            tail = "not compared: " + str(s.get("reason"))[:70]
        cols = [
            f(s["ours_predicted_ms"], "9.4f"),
            f(s["peer_predicted_ms"], "9.4f"),
            f(s["ours_over_peer"], "9.2f") + " ",
            f(s["peer_published_ms"], "9.4f"),
            f(s["huggingface_ms"], "9.4f"),
            f(s["ours_over_hf"], "8.2f"),
            f(s["torch_compile_ms"], "8.4f") + " ",
            tail,
        ]
        lines.append(f"{s['kernel_name']:<14}{s['mode']:<9}{gpu:<8}{s['x_value']:>7}  " + " ".join(cols))
    sm = side["summary"]
    lines.append(
        f"side by side: {sm['compared']} of {sm['shapes']} peer shapes compared, ours ahead at {sm['ahead']}, "
        f"behind at {sm['behind']} ({sm['behind_within_2pct']} of them within 2%)"
        + (f" (median ours/peer {sm['median_ours_over_peer']:.2f})" if sm["compared"] else "")
        + (f"; behind by bound: {sm['behind_by_bound']}" if sm["behind"] else "")
    )
    if sm["worst"]:
        w = sm["worst"]
        lines.append(
            f"worst: {w['kernel_name']} {w['mode']} {w['gpu_name']} x={w['x_value']}: "
            f"ours/peer {w['ours_over_peer']:.2f}"
        )
    return lines
