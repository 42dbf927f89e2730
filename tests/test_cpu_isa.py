"""Portable builds choose the CPU kernels' instruction set at run time (csrc/common/cpu_isa.h): the default build holds
each CPU kernel for x86-64-v2, AVX2 and AVX-512, runs the best this CPU has, and MEGAKERNELS_CPU_ISA picks a
narrower one, so a wheel built here runs (and is tested) as on a CPU without AVX-512. Here: the choice follows the
CPU's flags, the op tests pass with the kernels of each ISA this CPU can run (in a subprocess with the variable
set: results against the same references at the same tolerances), an unknown or unsupported ISA is refused with a
message naming the variable, and the clones hold the instructions of their ISA (zmm registers in the AVX-512 ones,
no AVX at all in the baseline)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import megakernels
from megakernels import host

ROOT = Path(__file__).resolve().parents[1]

# A fast, representative subset of the op tests: every CPU kernel family, its CPU backend only (the emulated CUDA
# kernels and Triton do not run the CPU kernels).
OP_TESTS = [
    "tests/ops/test_norms.py",
    "tests/ops/test_softmax.py",
    "tests/ops/test_bias_gelu.py",
    "tests/ops/test_swiglu.py",
    "tests/ops/test_rope.py",
    "tests/ops/test_flash_attention_cpu_kernel.py",
    "tests/optim/test_fused_adamw.py",
]
# x86-64-v3 (the AVX2 clone) and v4 (the AVX-512 one) as /proc/cpuinfo names their features
V3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}
V4 = V3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}


def _best_isa() -> str:
    flags = set(host.cpu()["flags"].split())
    return "avx512" if V4 <= flags else "avx2" if V3 <= flags else "baseline"


def _portable() -> bool:
    return megakernels.cpu_isa() != "native"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MEGAKERNELS_CPU_ISA"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env=_env(**env), capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_the_best_isa_of_this_cpu_is_chosen():
    if not _portable():
        pytest.fail("megakernels was built with MEGAKERNELS_NATIVE=1: the tests of the portable build need the default")
    assert megakernels.cpu_isa() == _best_isa(), host.cpu()["flags"]


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_the_op_tests_pass_with_each_isa(isa):
    """The op subset in a subprocess with MEGAKERNELS_CPU_ISA set: it reports that ISA and every test passes. An ISA
    this CPU lacks is refused instead (the next test). The best ISA this CPU has is the one the whole suite runs
    (the test above): naming it reports it, and its op tests are the suite's own."""
    order = ["baseline", "avx2", "avx512"]
    if order.index(isa) > order.index(_best_isa()):
        run = _python("import megakernels; megakernels.cpu_isa()", MEGAKERNELS_CPU_ISA=isa)
        assert run.returncode != 0 and "MEGAKERNELS_CPU_ISA" in run.stderr
        return
    run = _python("import megakernels; print(megakernels.cpu_isa())", MEGAKERNELS_CPU_ISA=isa)
    assert run.returncode == 0 and run.stdout.split() == [isa], run.stderr
    if isa == _best_isa():
        return
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", *OP_TESTS, "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-k", "cpu"],
        env=_env(MEGAKERNELS_CPU_ISA=isa),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert re.search(r"\d+ passed", tests.stdout) and " failed" not in tests.stdout, tests.stdout[-2000:]


@pytest.mark.parametrize(
    "value,message",
    [
        ("sse9", r"MEGAKERNELS_CPU_ISA=sse9 is not one of baseline, avx2, avx512"),
        ("AVX2", r"MEGAKERNELS_CPU_ISA=AVX2 is not one of baseline, avx2, avx512"),
    ],
)
def test_an_unknown_isa_is_refused_naming_the_variable(value, message):
    """Both the query and any CPU kernel call raise ValueError with the message (no kernel runs)."""
    code = (
        "import torch, megakernels\n"
        "for call in (megakernels.cpu_isa, lambda: megakernels.ops.rms_norm(torch.ones(2, 8), torch.ones(8))):\n"
        "    try:\n"
        "        call()\n"
        "    except ValueError as e:\n"
        "        print('refused:', e)\n"
        "    else:\n"
        "        print('ran')\n"
    )
    run = _python(code, MEGAKERNELS_CPU_ISA=value)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 2 and all(re.search(message, line) for line in lines), run.stdout


def test_an_isa_this_cpu_lacks_is_refused():
    """The choice's rule for any CPU (``megakernels::cpu_isa_refusal``: what the variable meets on a CPU whose best
    clone is the first argument) refuses each ISA above the best, naming the variable, and takes the others; on a
    CPU without AVX-512 the variable itself is refused."""
    import torch

    refusal = torch.ops.megakernels.cpu_isa_refusal
    for best, want in (("baseline", "avx2"), ("baseline", "avx512"), ("avx2", "avx512")):
        message = f"MEGAKERNELS_CPU_ISA={want} asks for an instruction set this CPU lacks (it runs {best} at most)"
        assert refusal(best, want) == message
    for best, want in (("avx2", "avx2"), ("avx512", "baseline"), ("avx2", ""), ("avx512", "avx512")):
        assert refusal(best, want) == ""
    assert "is not one of baseline, avx2, avx512" in refusal("avx512", "sse9")
    with pytest.raises(ValueError, match="best must be baseline, avx2 or avx512"):
        refusal("native", "avx2")
    if _best_isa() != "avx512":  # this CPU lacks AVX-512: the variable asking for it is refused at the first call
        run = _python("import megakernels; megakernels.cpu_isa()", MEGAKERNELS_CPU_ISA="avx512")
        assert run.returncode != 0
        assert "MEGAKERNELS_CPU_ISA=avx512 asks for an instruction set this CPU lacks" in run.stderr, run.stderr


def _disassembly(namespace: str) -> str:
    """The disassembly of the softmax forward (fp32 rows, a causal mask) that namespace ``namespace`` of the built
    extension holds (``cpu``: the baseline; ``cpu_avx2``, ``cpu_avx512``: the clones)."""
    lib = glob.glob(str(ROOT / "megakernels" / "_C*.so"))
    if not lib or shutil.which("objdump") is None or shutil.which("nm") is None:
        pytest.fail("needs the built extension, nm and objdump (binutils, which the build needs too)")
    name = (
        f"void megakernels::{namespace}::(anonymous namespace)::fwd_rows<float, float, "
        "(megakernels::softmax::MaskKind)1>(megakernels::softmax::FwdArgs const&, long, long)"
    )
    syms = subprocess.run(["nm", "-S", "-C", "--defined-only", lib[0]], capture_output=True, text=True, check=True)
    found = [line.split(" ", 3) for line in syms.stdout.splitlines() if line.endswith(" " + name)]
    assert len(found) == 1, name
    start, size = int(found[0][0], 16), int(found[0][1], 16)
    cmd = ["objdump", "-d", "--no-show-raw-insn", f"--start-address={start}", f"--stop-address={start + size}", lib[0]]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def test_the_clones_hold_their_instruction_sets():
    """The softmax forward (loops the compiler vectorises for the target): the AVX-512 clone's uses zmm registers,
    the AVX2 clone's ymm and FMA but no zmm, the baseline's neither (x86-64-v2 has no AVX)."""
    if not _portable():
        pytest.fail("megakernels was built with MEGAKERNELS_NATIVE=1: it has no clones")
    avx512, avx2, base = _disassembly("cpu_avx512"), _disassembly("cpu_avx2"), _disassembly("cpu")
    assert "%zmm" in avx512
    assert "%ymm" in avx2 and "vfmadd" in avx2 and "%zmm" not in avx2
    assert "%ymm" not in base and "%zmm" not in base and "vfmadd" not in base and "%xmm" in base
