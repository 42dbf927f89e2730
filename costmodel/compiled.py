"""Compiling the shipped kernels as a real launch gets them, without a GPU, and turning their SASS into costs.

- CUDA C++ families: ``nvcc -cubin`` of the torch-free ``csrc/<family>/<family>_cuda.cu`` for ``sm_<arch>`` with
  the flags setup.py builds the extension with; a kernel is found by its demangled name (the template
  instantiation a launch on aligned tensors takes: the 16-byte pack width).
- Triton kernels: ``megakernels.triton.launch.compile_launch`` of the Launch the launcher builds (meta tensors;
  specialised as JITFunction.run would).

Both are cached: in this process, and cubins of the CUDA families on disk under ``~/.cache/megakernels/static``
(keyed by the sources, nvcc's version and the flags), so a second report or test run does not recompile.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import os
import subprocess
import tempfile

from costmodel import model, sass
from megakernels import _targets

# The nvcc flags of setup.py's CUDA build (megakernels/_targets.py; with its -gencode for one arch).
NVCC_FLAGS = list(_targets.NVCC_FLAGS)


@dataclasses.dataclass
class Compiled:
    """One compiled kernel: its SASS and what a launch of it needs."""

    fn: sass.Function
    threads: int
    shared_bytes: int  # per block: static + dynamic
    symbol: str

    @property
    def registers(self) -> int:
        return self.fn.resources.registers if self.fn.resources else 0

    @property
    def spill_bytes(self) -> int:
        return self.fn.resources.stack_bytes if self.fn.resources else 0

    @property
    def mma(self) -> str:
        t = self.fn.totals
        if t.wgmma:  # HGMMA/QGMMA count in both; the rest of ``mma`` is HMMA (mma.sync)
            return "wgmma" if t.mma == t.wgmma else "wgmma+mma.sync"
        return "mma.sync" if t.mma else "none"

    @property
    def tma(self) -> bool:
        return self.fn.totals.tma > 0

    def resources(self) -> dict:
        return {
            "registers": self.registers,
            "spill_bytes": self.spill_bytes,
            "shared_bytes": self.shared_bytes,
            "mma": self.mma,
            "tma": self.tma,
        }


def csrc_dir() -> str | None:
    import megakernels

    d = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(megakernels.__file__))), "csrc")
    return d if os.path.isdir(d) else None


def nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    import shutil

    return shutil.which("nvcc")


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "megakernels", "static")


@functools.cache
def family_cubin(source: str, arch: int) -> bytes:
    """The cubin of ``csrc/<source>`` (e.g. ``norms/norms_cuda.cu``) for ``sm_<arch>``.

    Raises:
        RuntimeError: no csrc tree (an installed wheel), no nvcc, or a compile error (nvcc's message)."""
    root, tool = csrc_dir(), nvcc()
    if root is None:
        raise RuntimeError("static analysis of the CUDA kernels needs the csrc/ sources (a source checkout)")
    if tool is None:
        raise RuntimeError("static analysis of the CUDA kernels needs nvcc")
    family = source.split("/")[0]
    src = os.path.join(root, source)
    if not os.path.exists(src):
        raise RuntimeError(f"no CUDA source {src}")
    flags = NVCC_FLAGS + _targets.gencode(arch)
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(root, "common", "*")) + glob.glob(os.path.join(root, family, "*.[ch]*"))):
        with open(path, "rb") as f:
            h.update(os.path.relpath(path, root).encode() + f.read())  # not the checkout's path: clones share
    version = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
    h.update((version + " ".join(flags)).encode())
    path = os.path.join(_cache_dir(), f"{family}-sm{arch}-{h.hexdigest()[:20]}.cubin")
    if os.path.exists(path):
        with open(path, "rb") as f:
            return f.read()
    os.makedirs(_cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "k.cubin")
        proc = subprocess.run([tool, "-cubin", *flags, "-I", root, "-o", out, src], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed on {src}:\n{proc.stderr[-2000:]}")
        with open(out, "rb") as f:
            data = f.read()
    tmp_path = f"{path}.{os.getpid()}"
    with open(tmp_path, "wb") as f:
        f.write(data)
    os.replace(tmp_path, path)  # atomic: parallel runs may race here
    return data


@functools.cache
def _family_functions(source: str, arch: int) -> tuple[dict, dict]:
    funcs = sass.read_cubin(family_cubin(source, arch))
    return funcs, sass.demangle(list(funcs))


def cuda_kernel(source: str, pattern: str, threads: int, arch: int = 90) -> Compiled:
    """The kernel of ``csrc/<source>`` (``family`` alone: ``family/family_cuda.cu``) whose demangled name
    contains ``pattern`` (exactly one must).

    Raises:
        RuntimeError: none or several match."""
    if "/" not in source:
        source = f"{source}/{source}_cuda.cu"
    funcs, names = _family_functions(source, arch)
    hits = [n for n in funcs if pattern in names[n]]
    if len(hits) != 1:
        raise RuntimeError(f"{source}: {len(hits)} kernels match {pattern!r}")
    fn = funcs[hits[0]]
    return Compiled(fn, threads, fn.resources.static_shared if fn.resources else 0, names[hits[0]])


_TRITON: dict = {}


def kernel_function(ck) -> sass.Function:
    """The kernel's function (SASS and resource usage) in a Triton CompiledKernel's cubin."""
    funcs = sass.read_cubin(ck.asm["cubin"])
    return funcs[ck.metadata.name] if ck.metadata.name in funcs else next(iter(funcs.values()))


def triton_kernel(launch, arch: int = 90) -> Compiled:
    """The Triton kernel of ``launch`` (a megakernels.triton.launch.Launch) compiled for ``sm_<arch>``."""
    from megakernels.triton.launch import compile_launch, specialise

    sig, consts, attrs, options = specialise(launch, arch)
    key = (
        launch.name,
        arch,
        repr(sorted(sig.items())),
        repr(sorted(consts.items(), key=repr)),
        repr(sorted(attrs.items(), key=repr)),
        options.get("num_warps"),
        options.get("num_stages"),
        options.get("maxnreg"),
    )
    if key not in _TRITON:
        ck = compile_launch(launch, arch)
        fn = kernel_function(ck)
        static = fn.resources.static_shared if fn.resources else 0
        # Triton's dynamic shared memory is metadata.shared; the static 1 KiB it shows on sm_90 is the reserve.
        shared = max(int(ck.metadata.shared), 0) + (static if static > model.H200.smem_reserved else 0)
        _TRITON[key] = Compiled(fn, launch.num_warps * 32, shared, ck.metadata.name)
    return _TRITON[key]
