"""Backend selection (docs/design.md §3): env var, context manager, and errors instead of silent fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import megakernels
from megakernels.ops import layer_norm


def test_default_backend_is_auto_and_context_manager_nests():
    assert megakernels.current_backend() == "auto"
    with megakernels.backend("cpu"):
        assert megakernels.current_backend() == "cpu"
        with megakernels.backend("cuda_emu"):
            assert megakernels.current_backend() == "cuda_emu"
        assert megakernels.current_backend() == "cpu"
    assert megakernels.current_backend() == "auto"


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        with megakernels.backend("tpu"):
            pass


def test_emulated_kernels_are_built_here():
    # CI builds with the CUDA headers present: the cuda_emu backend must exist (never a silent skip).
    assert megakernels.has_backend("cuda_emu")


def test_env_var_selects_backend_and_cuda_emu_runs_the_emulated_kernels():
    code = (
        "import torch, megakernels; from megakernels.ops import layer_norm;"
        "x = torch.randn(4, 40);"
        "ref = torch.nn.functional.layer_norm(x, (40,));"
        "print(megakernels.current_backend(), float((layer_norm(x) - ref).abs().max()))"
    )
    env = dict(os.environ, MEGAKERNELS_BACKEND="cuda_emu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    name, err = out.split()
    assert name == "cuda_emu" and float(err) < 1e-5


def test_bad_env_var_is_an_error():
    env = dict(os.environ, MEGAKERNELS_BACKEND="gpu")
    proc = subprocess.run(
        [sys.executable, "-c", "import megakernels; megakernels.current_backend()"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "MEGAKERNELS_BACKEND: unknown backend 'gpu'" in proc.stderr


def test_cpu_backend_refuses_cuda_tensors_without_touching_them():
    if not torch.cuda.is_available():
        with megakernels.backend("cuda"):
            with pytest.raises(ValueError, match="backend cuda requested"):
                layer_norm(torch.randn(2, 3))
    else:  # pragma: no cover - GPU machines
        with megakernels.backend("cpu"):
            with pytest.raises(ValueError, match="backend cpu requested"):
                layer_norm(torch.randn(2, 3, device="cuda"))
