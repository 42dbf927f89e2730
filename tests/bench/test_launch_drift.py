"""The static cost model's mirrors of launch logic stay what the launchers do (docs/design.md §7): ``plan_rows``
against csrc/common/cuda_kernels.cuh's, compiled here by the host compiler against the CUDA emulator (under a
second), over many shapes; the attention schedules only for kernels that exist."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megakernels.bench.static.streaming import plan_rows

CSRC = Path(__file__).resolve().parents[2] / "csrc"
PROGRAM = r"""
#include <cstdio>
#include "common/cuda_kernels.cuh"
using namespace megakernels::MK_NS;
int main() {
  long long rows, packs;
  int blocks_per_sm, max_threads;
  std::printf("%d\n", sm_count());
  while (std::scanf("%lld %lld %d %d", &rows, &packs, &blocks_per_sm, &max_threads) == 4) {
    const RowPlan p = plan_rows(rows, packs, blocks_per_sm, max_threads);
    std::printf("%d %d %lld\n", p.group_threads, p.block, (long long)p.grid);
  }
}
"""


def _cuda_include() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda_bf16.h")):
            return os.path.join(home, "include")
    return None


@pytest.fixture(scope="module")
def cpp_plan_rows(tmp_path_factory):
    cxx, inc = shutil.which(os.environ.get("CXX", "c++")), _cuda_include()
    if cxx is None or inc is None or not CSRC.exists():
        pytest.skip("needs a C++ compiler, cuda_bf16.h (the emulator's headers) and the csrc tree")
    d = tmp_path_factory.mktemp("plan_rows")
    (d / "plan.cc").write_text(PROGRAM)
    exe = d / "plan"
    cmd = [cxx, "-std=c++20", "-O0", "-x", "c++", "-DMEGAKERNELS_CUDA_EMU", "-I", str(CSRC), "-isystem", inc]
    r = subprocess.run([*cmd, str(d / "plan.cc"), "-o", str(exe), "-pthread"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]

    def run(cases):
        out = subprocess.run(
            [str(exe)], input="".join(f"{r} {p} {b} {t}\n" for r, p, b, t in cases), capture_output=True, text=True
        ).stdout.split("\n")
        return int(out[0]), [tuple(int(v) for v in line.split()) for line in out[1 : 1 + len(cases)]]

    return run


def test_plan_rows_is_the_launchers(cpp_plan_rows):
    rows = [1, 2, 3, 4, 5, 7, 31, 100, 127, 128, 129, 1000, 4096, 65537, 1 << 20]
    packs = [1, 8, 31, 32, 255, 256, 257, 263, 264, 511, 512, 520, 1000, 2048, 4096, 8192, 8200, 16384, 65536]
    cases = list(itertools.product(rows, packs, [1, 2, 4, 16], [512, 1024]))
    sms, got = cpp_plan_rows(cases)
    want = [plan_rows(r, p, b, t, sms=sms) for r, p, b, t in cases]
    bad = [(c, g, w) for c, g, w in zip(cases, got, want, strict=True) if g != w]
    assert not bad, f"{len(bad)} of {len(cases)} (rows, packs, blocks/SM, max threads) differ, e.g. {bad[:5]}"


def test_setup_py_and_the_static_model_compile_with_one_flag_table():
    """setup.py reads megakernels/_targets.py by path (it runs before the package is installed); the static model
    compiles the CUDA kernels with the same flags."""
    import importlib.util
    import unittest.mock

    from megakernels import _targets
    from megakernels.bench.static import compiled

    spec = importlib.util.spec_from_file_location("_mk_setup_flags", CSRC.parent / "setup.py")
    setup_py = importlib.util.module_from_spec(spec)
    with unittest.mock.patch("setuptools.setup"):
        spec.loader.exec_module(setup_py)
    assert setup_py._targets().NVCC_FLAGS == _targets.NVCC_FLAGS == tuple(compiled.NVCC_FLAGS)
    assert setup_py._arch_flags("80; 9.0") == [*_targets.gencode(80), *_targets.gencode(90)]
