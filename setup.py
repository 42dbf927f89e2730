"""Build of megakernels._C (torch.utils.cpp_extension + ninja).

Sources (docs/design.md §1-2):
- csrc/bindings/*.cpp              the only torch-facing C++ (checks, dispatch, TORCH_LIBRARY registration),
                                   compiled as one unit through csrc/bindings/all.cpp (which must include each),
                                   one file per kernel family plus common.cpp and module.cpp
- csrc/<family>/*_cpu.cpp          torch-free CPU kernels, built for the portable baseline (x86-64-v2), and on
                                   x86-64 again for AVX2 and AVX-512 through *_cpu_avx2.cpp / *_cpu_avx512.cpp
                                   (csrc/common/cpu_isa.h): the bindings run the best this CPU has, chosen at run
                                   time (MEGAKERNELS_CPU_ISA=baseline|avx2|avx512 picks one), so a wheel built
                                   here runs on any x86-64 CPU
- csrc/<family>/*_cuda.cu          torch-free CUDA kernels, built when nvcc and a CUDA torch are present
- csrc/<family>/*_cuda_emu.cpp     the same .cu source compiled by g++ against csrc/emu (backend "cuda_emu"),
                                   built whenever the CUDA headers are found (no GPU or CUDA torch needed)

Environment:
- MEGAKERNELS_CUDA_ARCHS      CUDA archs to build, e.g. "80;90" (default) or "90a"
- MEGAKERNELS_FORCE_CPU_ONLY  =1: skip the CUDA kernels even when nvcc is present
- MEGAKERNELS_NO_EMU          =1: skip the emulated CUDA kernels
- MEGAKERNELS_EXTENSION_BUILT =1: build no extension (scripts/setup.sh: `setup.py build_ext --inplace` has built
                                   megakernels._C in the tree already; the editable install then only adds the
                                   packages around it)
- MEGAKERNELS_NATIVE          =1: compile the CPU kernels once, with -march=native, for this machine only (no
                                   ISA clones, no run-time choice; the binary may not run on another CPU). The
                                   former MEGAKERNELS_PORTABLE=1 is the default now and is gone.
"""

import glob
import os
import platform
import shutil
import sys

from setuptools import find_packages, setup

# torch derives CUDA_HOME from the nvcc on PATH, which may be a wrapper script outside the toolkit (as on the dev
# and CI machines: /usr/local/bin/nvcc); the conventional toolkit location is the better guess. Must be set
# before torch.utils.cpp_extension is imported, which reads it once.
if not os.environ.get("CUDA_HOME") and not os.environ.get("CUDA_PATH"):
    if os.path.exists("/usr/local/cuda/bin/nvcc") and os.path.exists("/usr/local/cuda/include/cuda_runtime.h"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"

# With the extension built already (scripts/setup.sh's editable install) nothing here needs torch: not importing it
# saves its start-up in each of the build hooks pip runs.
BUILT = os.environ.get("MEGAKERNELS_EXTENSION_BUILT", "0") == "1"
if not BUILT:
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:  # pragma: no cover - building needs torch first
        sys.exit("megakernels: install torch first, then `pip install --no-build-isolation .`")

ROOT = os.path.dirname(os.path.abspath(__file__))


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def _cuda_include():
    for home in (CUDA_HOME, os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda_bf16.h")):
            return os.path.join(home, "include")
    return None


def _nvcc():
    if CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return os.path.join(CUDA_HOME, "bin", "nvcc")
    return shutil.which("nvcc")


def _bindings_unit():
    """csrc/bindings/all.cpp, after checking that it includes every other bindings file (a family left out
    would build and import fine, without its ops)."""
    unit = os.path.join(ROOT, "csrc", "bindings", "all.cpp")
    with open(unit) as f:
        text = f.read()
    for path in sorted(glob.glob(os.path.join(ROOT, "csrc", "bindings", "*.cpp"))):
        name = os.path.basename(path)
        if name != "all.cpp" and f'#include "{name}"' not in text:
            sys.exit(f'megakernels: csrc/bindings/all.cpp must #include "{name}" (it builds every bindings file)')
    return unit


def _cpu_sources(clones: bool) -> list[str]:
    """csrc/*/*_cpu.cpp, and with ``clones`` each one's AVX2 and AVX-512 wrapper units, after checking that every
    kernel source has both (one left out would not link: the bindings call all three)."""
    kernels = sorted(glob.glob(os.path.join(ROOT, "csrc", "*", "*_cpu.cpp")))
    if not clones:
        return kernels
    wrappers = []
    for path in kernels:
        for isa in ("avx2", "avx512"):
            wrapper = path[: -len(".cpp")] + f"_{isa}.cpp"
            if not os.path.exists(wrapper):
                name = os.path.relpath(wrapper, ROOT)
                sys.exit(f"megakernels: {name} is missing (each CPU kernel has an {isa} clone)")
            wrappers.append(wrapper)
    return kernels + wrappers


def _targets():
    """megakernels/_targets.py (nvcc flags, per-arch limits), loaded by path: the package is not installed yet."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_megakernels_targets", os.path.join(ROOT, "megakernels", "_targets.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _arch_flags(archs):
    flags = []
    for arch in archs.replace(",", ";").split(";"):
        if arch.strip():
            flags += _targets().gencode(arch)
    return flags


def extensions():
    force_cpu = os.environ.get("MEGAKERNELS_FORCE_CPU_ONLY", "0") == "1"
    cuda_inc = _cuda_include()
    with_cuda = not force_cpu and torch.version.cuda is not None and _nvcc() is not None
    with_emu = cuda_inc is not None and os.environ.get("MEGAKERNELS_NO_EMU", "0") != "1"

    native = os.environ.get("MEGAKERNELS_NATIVE", "0") == "1"
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    sources = _rel([_bindings_unit()] + _cpu_sources(clones=x86 and not native))
    # -fopenmp: at::parallel_for is inline and runs `omp parallel` in *our* translation unit; without the flag it
    # silently runs serially. The libgomp.so.1 this links is the one torch has already loaded (same soname), so
    # there is one OpenMP runtime and one thread pool in the process (tests/test_threads.py checks both).
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-pthread", "-Wno-unknown-pragmas"]
    define_macros = []
    if native:
        cxx.append("-march=native")
    elif x86:
        cxx.append("-march=x86-64-v2")  # the baseline; the AVX2 and AVX-512 clones raise it per unit
        define_macros.append(("MEGAKERNELS_CPU_CLONES", "1"))
    include_dirs = [os.path.join(ROOT, "csrc")]
    if with_emu:
        sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "*", "*_cuda_emu.cpp")))
        define_macros.append(("MEGAKERNELS_WITH_EMU", "1"))
        include_dirs.append(cuda_inc)
    if with_cuda:
        sources += _rel(glob.glob(os.path.join(ROOT, "csrc", "*", "*_cuda.cu")))
        define_macros.append(("MEGAKERNELS_WITH_CUDA", "1"))
        archs = os.environ.get("MEGAKERNELS_CUDA_ARCHS", "80;90")
        nvcc = list(_targets().NVCC_FLAGS) + _arch_flags(archs)
        print(f"megakernels: building CUDA kernels for archs {archs}")
        ext = CUDAExtension(
            "megakernels._C",
            sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=["-pthread", "-fopenmp"],
        )
    else:
        why = (
            "MEGAKERNELS_FORCE_CPU_ONLY=1"
            if force_cpu
            else ("torch has no CUDA" if torch.version.cuda is None else "nvcc not found")
        )
        print(f"megakernels: CPU-only build ({why}); emulated CUDA kernels: {'yes' if with_emu else 'no'}")
        ext = CppExtension(
            "megakernels._C",
            sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-pthread", "-fopenmp"],
        )
    return [ext]


setup(
    packages=find_packages(include=["megakernels", "megakernels.*", "megakernels_models", "megakernels_models.*"]),
    ext_modules=[] if BUILT else extensions(),
    cmdclass={} if BUILT else {"build_ext": BuildExtension.with_options(use_ninja=True)},
)
