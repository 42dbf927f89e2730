"""Each head dim's default FlashAttention config and the cross-entropy kernels compile for sm_80, fit its shared
memory and spill no register, compiled as a launch gets them (the real Triton compiler and ptxas, which need no
GPU; the interpreter checks none of it). Every sm_90 config is compiled by tests/costmodel/test_static.py;
``python -m costmodel.compile_check --full`` compiles every config in every variant."""

import os
import subprocess
import sys


def test_default_configs_compile_and_fit_for_sm80():
    import triton  # noqa: F401  (the cost model compiles with it)

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "costmodel.compile_check", "--arch", "80", "--defaults"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kernel configs compiled and fit without spills" in proc.stdout
