"""The static cost model's mirrors of launch logic stay what the launchers do (costmodel/README.md): ``plan_rows``
(csrc/common/cuda_kernels.cuh), ``rows_plan`` (csrc/norms/norms_rows.cuh), ``softmax_rows_plan``
(csrc/softmax/softmax_rows.cuh) and ``column_plan`` (csrc/bias_gelu/bias_gelu_cuda.cu) against the C++ they
mirror, compiled here by the host compiler against the CUDA emulator (about a second each), over many shapes. (The
Triton kernels' schedules are held to the kernels by tests/triton/test_schedules.py.)"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from costmodel.streaming import column_plan, plan_rows, rows_plan, softmax_rows_plan

CSRC = Path(__file__).resolve().parents[2] / "csrc"
# The emulator runs a block's threads as host threads and caps the row groups of a block at 2 (MK_CUDA_EMU in the
# row plans); the static model mirrors the GPU build, so the row-plan headers are compiled here with the GPU
# build's MK_CUDA_EMU, after the emulator's own headers.
GPU_PLANS = "#undef MK_CUDA_EMU\n#define MK_CUDA_EMU 0\n"
PLANS = {
    "plan_rows": (
        '#include "common/cuda_kernels.cuh"\n',
        4,
        "const RowPlan p = plan_rows(a[0], a[1], int(a[2]), int(a[3]));\n"
        'std::printf("%d %d %lld\\n", p.group_threads, p.block, (long long)p.grid);',
    ),
    "rows_plan": (
        '#include "common/cuda_kernels.cuh"\n#include "norms/norms.h"\n'
        + GPU_PLANS
        + '#include "norms/norms_rows.cuh"\n',
        5,
        "const RowsPlan p = rows_plan(a[0], a[1], int(a[2]), int(a[3]), int(a[4]));\n"
        'std::printf("%d %d %d\\n", p.group_threads, p.groups, p.grid);',
    ),
    "softmax_rows_plan": (
        '#include "common/cuda_kernels.cuh"\n#include "softmax/softmax.h"\n'
        + GPU_PLANS
        + '#include "softmax/softmax_rows.cuh"\n',
        2,
        "const RowPlan p = softmax_rows_plan(a[0], a[1]);\n"
        'std::printf("%d %d %lld\\n", p.group_threads, p.block, (long long)p.grid);',
    ),
    "column_plan": (
        '#include "bias_gelu/bias_gelu_cuda.cu"\n',
        2,
        "const ColumnPlan p = column_plan(a[0], a[1]);\n"
        'std::printf("%u %u %u %u\\n", p.block.x, p.block.y, p.grid.x, p.grid.y);',
    ),
}


def _program(includes: str, nargs: int, call: str) -> str:
    """A program that prints the SM count, then for each line of ``nargs`` integers on stdin what ``call`` prints
    for them (``a[i]``)."""
    reads = ", ".join(f"&a[{i}]" for i in range(nargs))
    return (
        f"#include <cstdio>\n{includes}using namespace megakernels::MK_NS;\nint main() {{\n  long long a[{nargs}];\n"
        f'  std::printf("%d\\n", sm_count());\n'
        f'  while (std::scanf("{" ".join(["%lld"] * nargs)}", {reads}) == {nargs}) {{\n{call}\n  }}\n}}\n'
    )


def _cuda_include() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda_bf16.h")):
            return os.path.join(home, "include")
    return None


@pytest.fixture(scope="module")
def cpp_plan(tmp_path_factory):
    """``cpp_plan(name)(cases)`` -> (the SM count, what the C++ plan ``name`` (``PLANS``) gives each case)."""
    cxx, inc = shutil.which(os.environ.get("CXX", "c++")), _cuda_include()
    if cxx is None or inc is None or not CSRC.exists():
        pytest.skip("needs a C++ compiler, cuda_bf16.h (the emulator's headers) and the csrc tree")
    d = tmp_path_factory.mktemp("plans")

    def build(name):
        (d / f"{name}.cc").write_text(_program(*PLANS[name]))
        exe = d / name
        cmd = [cxx, "-std=c++20", "-O0", "-x", "c++", "-DMEGAKERNELS_CUDA_EMU", "-I", str(CSRC), "-isystem", inc]
        r = subprocess.run([*cmd, str(d / f"{name}.cc"), "-o", str(exe), "-pthread"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]

        def run(cases):
            out = subprocess.run(
                [str(exe)], input="".join(" ".join(map(str, c)) + "\n" for c in cases), capture_output=True, text=True
            ).stdout.split("\n")
            return int(out[0]), [tuple(int(v) for v in line.split()) for line in out[1 : 1 + len(cases)]]

        return run

    return build


def _compare(run, cases, mirror):
    sms, got = run(cases)
    want = [tuple(mirror(*c, sms=sms)) for c in cases]
    assert len(got) == len(cases)
    bad = [(c, g, w) for c, g, w in zip(cases, got, want, strict=True) if g != w]
    assert not bad, f"{len(bad)} of {len(cases)} cases differ (case, C++, Python), e.g. {bad[:5]}"


def test_plan_rows_is_the_launchers(cpp_plan):
    rows = [1, 2, 3, 4, 5, 7, 31, 100, 127, 128, 129, 1000, 4096, 65537, 1 << 20]
    packs = [1, 8, 31, 32, 255, 256, 257, 263, 264, 511, 512, 520, 1000, 2048, 4096, 8192, 8200, 16384, 65536]
    cases = list(itertools.product(rows, packs, [1, 2, 4, 16], [512, 1024]))
    _compare(cpp_plan("plan_rows"), cases, plan_rows)


ROWS = [1, 2, 3, 7, 31, 100, 129, 1000, 4096, 65537, 1 << 20]


def test_norm_rows_plan_is_the_launchers(cpp_plan):
    """(rows, hidden, pack, packs per thread, accumulators): bf16 and fp32 packs at 32 elements a thread, as the
    launcher's, and others; the forward (no accumulators) and the backward's 1-3 shared-memory rows."""
    hidden = [8, 24, 64, 256, 1000, 1024, 2048, 4000, 4096, 8192, 12288, 16384]
    packs = [(8, 4), (4, 8), (8, 2), (2, 16)]
    cases = [
        (r, h, pack, ppt, acc)
        for r, h, (pack, ppt), acc in itertools.product(ROWS, hidden, packs, [0, 1, 2, 3])
        if h % pack == 0
    ]
    _compare(cpp_plan("rows_plan"), cases, rows_plan)


def test_softmax_rows_plan_is_the_launchers(cpp_plan):
    sk = [1, 8, 31, 32, 33, 100, 256, 1000, 1024, 1025, 2048, 4096, 5000, 8192, 12288, 16384]
    _compare(cpp_plan("softmax_rows_plan"), list(itertools.product(ROWS, sk)), softmax_rows_plan)


def test_bias_gelu_column_plan_is_the_launchers(cpp_plan):
    packs = [1, 8, 31, 32, 33, 100, 255, 256, 257, 512, 1000, 2048, 4096]
    _compare(cpp_plan("column_plan"), list(itertools.product(ROWS, packs)), column_plan)


def test_setup_py_and_the_static_model_compile_with_one_flag_table():
    """setup.py reads megakernels/_targets.py by path (it runs before the package is installed); the static model
    compiles the CUDA kernels with the same flags."""
    import importlib.util
    import unittest.mock

    from costmodel import compiled
    from megakernels import _targets

    spec = importlib.util.spec_from_file_location("_mk_setup_flags", CSRC.parent / "setup.py")
    setup_py = importlib.util.module_from_spec(spec)
    with unittest.mock.patch("setuptools.setup"):
        spec.loader.exec_module(setup_py)
    assert setup_py._targets().NVCC_FLAGS == _targets.NVCC_FLAGS == tuple(compiled.NVCC_FLAGS)
    assert setup_py._arch_flags("80; 9.0") == [*_targets.gencode(80), *_targets.gencode(90)]


def test_the_optimizer_model_uses_the_kernels_chunk_and_block():
    """The streaming model's AdamW / non-finite / sum-of-squares launches: one block of kBlock threads per chunk of
    kDefaultChunk elements, as csrc/optim launches them (the constants read from the sources)."""
    import re

    from costmodel import streaming

    chunk = re.search(r"constexpr int64_t kDefaultChunk = (\d+);", (CSRC / "optim" / "optim.h").read_text())
    cu = (CSRC / "optim" / "adamw_cuda.cu").read_text()
    block = re.search(r"constexpr int kBlock = (\d+);", cu)
    assert chunk and block, "the optimizer's chunk or block constant moved: update this test and the model"
    assert (streaming.CHUNK, streaming.OPTIM_BLOCK) == (int(chunk.group(1)), int(block.group(1)))
    assert "dim3(unsigned(chunks)), dim3(kBlock)" in cu  # one block per chunk, as the model's grid
