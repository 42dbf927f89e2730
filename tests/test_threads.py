"""The CPU kernels take their threads from torch's intra-op pool: one OpenMP runtime in the process (torch's),
and torch's thread setting is left as it was. Checked in a fresh interpreter: other tests load libraries that bring
their own OpenMP (sentencepiece's wheel does), which says nothing about megakernels."""

from __future__ import annotations

import torch

from megakernels.ops import bias_gelu, layer_norm


def loaded_openmp_runtimes() -> set[str]:
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if line.rstrip().endswith(".so") or ".so." in line}
    return {p for p in paths if any(k in p.rsplit("/", 1)[-1] for k in ("gomp", "libomp", "iomp"))}


def _check_in_this_process():
    before = torch.get_num_threads()
    x = torch.randn(512, 256, requires_grad=True)
    layer_norm(x, activation="gelu").sum().backward()
    bias_gelu(x.detach(), torch.zeros(256))
    runtimes = loaded_openmp_runtimes()
    assert len(runtimes) <= 1, f"more than one OpenMP runtime loaded: {sorted(runtimes)}"
    assert torch.get_num_threads() == before


def test_single_openmp_runtime_and_thread_setting_untouched():
    import subprocess
    import sys

    code = "from tests.test_threads import _check_in_this_process as f; f()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
