"""Recording what a peer's entry points launch, on fake CUDA tensors: every Triton launch (kernel, grid,
arguments, constexprs) and every PyTorch op, recorded instead of run, and the autotuner's choice made by the model."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import types

from costmodel import model
from costmodel.peers.triton_price import price_triton

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


def call(fn, ctx, **named):
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
