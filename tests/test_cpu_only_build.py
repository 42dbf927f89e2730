"""The CPU-only build (MEGAKERNELS_FORCE_CPU_ONLY=1, or no nvcc): the torch-facing unit compiled as setup.py
compiles it for that build must not reference a single CUDA launcher (namespace megakernels::cuda), or the
extension would fail to load. Compiling that one unit (~10 CPU-s) checks what differs between the two builds:
every other source is compiled the same way in both. The whole CPU-only build with the op tests is
scripts/check_cpu_only_build.sh (minutes of compiling)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setup_module():
    """setup.py's helpers, without running setup()."""
    import importlib.util
    import unittest.mock

    spec = importlib.util.spec_from_file_location("_mk_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    with unittest.mock.patch("setuptools.setup"):
        spec.loader.exec_module(module)
    return module


def test_the_cpu_only_bindings_reference_no_cuda_launcher(tmp_path, monkeypatch):
    if shutil.which("g++") is None or shutil.which("nm") is None:
        pytest.fail("g++ and nm are needed (they build the extension)")
    from torch.utils.cpp_extension import include_paths

    monkeypatch.setenv("MEGAKERNELS_FORCE_CPU_ONLY", "1")
    ext = _setup_module().extensions()[0]
    flags = [f"-D{k}={v}" for k, v in ext.define_macros]
    assert "-DMEGAKERNELS_WITH_CUDA=1" not in flags
    unit = [s for s in ext.sources if s.endswith(os.path.join("bindings", "all.cpp"))]
    assert unit, ext.sources
    obj = tmp_path / "bindings.o"
    cmd = (
        [
            "g++",
            "-c",
            str(ROOT / unit[0]),
            "-o",
            str(obj),
            "-O0",
            "-std=c++20",
            "-fPIC",
            f"-I{sysconfig.get_paths()['include']}",
            "-DTORCH_EXTENSION_NAME=_C",
            "-D_GLIBCXX_USE_CXX11_ABI=1",
        ]
        + [f"-I{ROOT / d}" for d in ext.include_dirs]  # an absolute d stays itself
        + [f"-I{p}" for p in include_paths()]
        + flags
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    undefined = subprocess.run(
        ["nm", "-C", "--undefined-only", str(obj)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    cuda = [s for s in undefined if "megakernels::cuda::" in s]
    assert not cuda, "the CPU-only bindings reference CUDA launchers:\n" + "\n".join(cuda)
    # The check sees launcher references: with the emulator built, the emulated ones are referenced.
    if "-DMEGAKERNELS_WITH_EMU=1" in flags:
        assert any("megakernels::cuda_emu::" in s for s in undefined), "no emulated launcher referenced"
