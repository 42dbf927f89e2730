"""A Triton kernel launch as data, so that the very launch a launcher makes can also be compiled for a GPU that is
not here.

A launcher builds ``Launch`` objects (kernel, grid, arguments, constexprs, ``num_warps``/``num_stages``) and calls
them. ``compile_launch`` hands the same object to the Triton compiler for ``sm_<arch>`` with the specialisation
``JITFunction.run`` would give those arguments: 16-byte divisibility of pointers and of integers that are
multiples of 16, integers equal to 1 folded to constants, and the constexprs. Compiling a kernel from a
hand-written signature instead (as this package once did) compiles a different kernel: without the divisibility
hints Triton cannot vectorise or use TMA-friendly layouts, and the shared memory it reports is not what the launch
gets. ``compile_check`` and ``megakernels bench --static`` both go through here.

A kernel whose programs loop over tiles also has a *schedule* (``Schedule``): the ranges each program's loops run,
computed on the host by one function beside the kernel's launcher (``flash_attention.SCHEDULES``,
``grouped_gemm.rows_schedule`` / ``wgrad_schedule``). The kernels compute those bounds themselves on the device; a
schedule is their mirror, which the static model prices and tests/triton/test_schedules.py holds to the kernels (it
runs them under Triton's interpreter and records the loops they run).

Pointer arguments may be meta tensors (``torch.empty(..., device="meta")``): their ``data_ptr()`` is 0, which is
aligned, as the allocator's 256-byte-aligned buffers are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Any


@dataclasses.dataclass
class Launch:
    """One launch of a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)``.

    ``kwargs`` holds the constexprs and the launch options (``num_warps``, ``num_stages``)."""

    kernel: Any
    grid: tuple
    args: tuple
    kwargs: dict

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    @property
    def num_warps(self) -> int:
        return int(self.kwargs.get("num_warps", 4))

    @property
    def num_ctas(self) -> int:
        n = 1
        for g in self.grid:
            n *= int(g)
        return n

    def arg(self, name: str):
        """The value the launch passes for the kernel's parameter ``name`` (an argument or a constexpr)."""
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[list(self.kernel.arg_names).index(name)]

    def program_ids(self) -> list[tuple[int, ...]]:
        """Every program's id, in launch order: grid axis 0 fastest, as the block scheduler hands out CTAs."""
        ids = [()]
        for n in self.grid:
            ids = [(*rest, i) for i in range(int(n)) for rest in ids]
        return ids


@dataclasses.dataclass
class Schedule:
    """The tile loops every program of one launch runs. ``loops`` names the kernel's loops in source order;
    ``programs[i]`` lists what program ``i`` (launch order, ``Launch.program_ids``) runs, in the order it runs
    them: ``(loop, range)``, the ``range`` the kernel's ``for`` goes over (a loop entered several times, as one
    inside a loop over heads, appears once per entry)."""

    loops: tuple[str, ...]
    programs: list[list[tuple[str, range]]]

    def iterations(self) -> list[dict[str, int]]:
        """Per program (launch order): how many iterations of each loop it runs."""
        out = []
        for runs in self.programs:
            n = dict.fromkeys(self.loops, 0)
            for loop, r in runs:
                n[loop] += len(r)
            out.append(n)
        return out


def _fallback_specialisation(launch: Launch):
    """Signature, constexprs and attributes for Triton versions without ``create_function_from_signature``: the
    rules of JITFunction.run (pointer dtype from the tensor, 16-divisibility of pointers and integers, 1 folded to
    a constant, floats fp32)."""
    import torch

    names = launch.kernel.arg_names
    values = dict(zip(names, launch.args))
    values.update({k: v for k, v in launch.kwargs.items() if k in names})
    sig, consts, attrs = {}, {}, {}
    tname = {
        torch.float16: "fp16",
        torch.bfloat16: "bf16",
        torch.float32: "fp32",
        torch.float64: "fp64",
        torch.int64: "i64",
        torch.int32: "i32",
        torch.int8: "i8",
        torch.uint8: "u8",
        torch.bool: "i1",
    }
    for i, name in enumerate(names):
        v = values[name]
        if i in launch.kernel.constexprs or name in launch.kwargs:
            sig[name], consts[(i,)] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + tname[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if v == 1:
                sig[name], consts[(i,)] = "constexpr", 1
            else:
                sig[name] = "i64" if not -(2**31) <= v < 2**31 else "i32"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    options = {k: v for k, v in launch.kwargs.items() if k not in names}
    return sig, consts, attrs, options


def specialise(launch: Launch, arch: int):
    """(signature, constexprs, attrs, options dict) that ``JITFunction.run`` derives from the launch's arguments,
    for the CUDA target ``sm_<arch>``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", arch, 32))
    try:
        from triton.runtime.jit import create_function_from_signature

        binder = create_function_from_signature(launch.kernel.signature, launch.kernel.params, backend)
        bound, spec, opts = binder(*launch.args, **launch.kwargs)
        options, signature, constexprs, attrs = launch.kernel._pack_args(backend, launch.kwargs, bound, spec, opts)
        return signature, constexprs, attrs, options.__dict__
    except (ImportError, AttributeError, TypeError):  # a Triton whose binder differs: the same rules, written out
        sig, consts, attrs, options = _fallback_specialisation(launch)
        return sig, consts, attrs, backend.parse_options(options).__dict__


def compile_launch(launch: Launch, arch: int):
    """``triton.compile`` of the launch's kernel for ``sm_<arch>`` (``sm_90a`` features on 90), specialised as the
    launch would be. Needs no GPU (the Triton compiler and ptxas only). Returns the CompiledKernel (``asm['cubin']``,
    ``metadata.shared``, ...). Triton's on-disk cache makes a repeated compile cheap. In a process that imported
    Triton for its interpreter (the test suite, which also prices peers' kernels in process) the compile runs in
    ``_compiler_language()``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = specialise(launch, arch)
    src = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    with _compiler_language():
        return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


@contextlib.contextmanager
def without_interpreter():
    """``TRITON_INTERPRET`` unset inside the block, put back after: what ``@triton.jit`` reads to build a compiled
    (not interpreted) function, and Triton's frontend at every constexpr-function call."""
    interp = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield interp
    finally:
        if interp is not None:
            os.environ["TRITON_INTERPRET"] = interp


_JIT_TWINS: dict = {}  # an interpreted standard-library function -> its compiled twin, made once
_MISSING = object()


def _language_objects() -> tuple:
    """The objects Triton's interpreter patches while it runs a kernel (``triton.runtime.interpreter._patch_lang``)."""
    import triton.language as tl

    return (tl, tl.core, tl.core.tensor, tl.math, tl.core.dtype, tl.core.tensor_descriptor_base)


def _snapshot() -> list:
    try:
        return [(obj, dict(vars(obj))) for obj in _language_objects()]
    except (ImportError, AttributeError):  # no Triton, or one whose language differs: nothing to restore
        return []


# Triton's language as imported, before any kernel ran under the interpreter (this module is imported with the
# kernels' package, ahead of their first launch).
_PRISTINE = _snapshot()


def _interpreted_functions():
    """``(module, name, function)`` for each interpreted ``@jit`` function of Triton's language modules."""
    from triton.runtime.interpreter import InterpretedFunction

    for name, module in list(sys.modules.items()):
        if module is not None and (name == "triton.language" or name.startswith("triton.language.")):
            for attr, value in list(vars(module).items()):
                if isinstance(value, InterpretedFunction):
                    yield module, attr, value


@contextlib.contextmanager
def _compiler_language():
    """What Triton's compiler needs in a process that imported Triton for its interpreter (``TRITON_INTERPRET``
    set), all of it restored afterwards:

    * the variable unset (the frontend reads it at every constexpr-function call and, set, leaves results
      unwrapped);
    * the standard library's ``@jit`` functions (``tl.sum``'s combine function, ``tl.sigmoid``, ``tl.cdiv``,
      ``tl.rand``...), made interpreted at import, swapped for compiled twins of the same Python functions;
    * the language's builtins as imported: the interpreter patches ``tl`` and ``tl.core`` for each kernel it runs
      and restores them, but a device-function call (``InterpretedFunction.__call__``, e.g. ``tl.max`` inside a
      kernel) patches them without restoring (Triton 3.8), leaving ``tl.core.program_id`` and the rest in their
      interpreter form for the rest of the process.

    Without these a kernel failed to compile after any interpreted run in the same process (``'ir.value' object has
    no attribute 'dtype'``) unless Triton's on-disk cache already held it."""
    changed = []

    def put(obj, attr, value):
        changed.append((obj, attr, vars(obj).get(attr, _MISSING)))
        if value is _MISSING:
            delattr(obj, attr)
        else:
            setattr(obj, attr, value)

    with without_interpreter() as interp:
        try:
            for obj, pristine in _PRISTINE:
                now = vars(obj)
                for attr in [a for a in pristine if now.get(a, _MISSING) is not pristine[a]]:
                    put(obj, attr, pristine[attr])
                if isinstance(obj, type):  # a class's new attributes are the interpreter's (``tensor.T``); a
                    for attr in [a for a in now if a not in pristine]:  # module's may be submodules imported since
                        put(obj, attr, _MISSING)
            if interp not in (None, "", "0"):
                from triton.runtime.jit import JITFunction

                for module, attr, value in list(_interpreted_functions()):
                    if value not in _JIT_TWINS:
                        _JIT_TWINS[value] = JITFunction(value.fn, **getattr(value, "kwargs", {}))
                    put(module, attr, _JIT_TWINS[value])
            yield
        finally:
            for obj, attr, value in reversed(changed):
                if value is _MISSING:
                    if attr in vars(obj):
                        delattr(obj, attr)
                else:
                    setattr(obj, attr, value)
