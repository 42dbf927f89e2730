"""Shared fixtures: every op test runs over the backends cpu, cuda_emu (CPU tensors through the emulated CUDA
kernels, small shapes) and cuda (marked ``cuda``; skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

import megakernels
from tests.helpers import Backend


def _cuda_available() -> bool:
    return torch.cuda.is_available() and megakernels.has_backend("cuda")


BACKEND_PARAMS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda_emu", id="cuda_emu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
]


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request):
    """Yields a Backend; inside the test the ops run on it (via megakernels.backend)."""
    name = request.param
    if name == "cuda" and not _cuda_available():
        pytest.skip("no CUDA GPU (or megakernels built without CUDA)")
    with megakernels.backend(name):
        yield Backend(name, "cuda" if name == "cuda" else "cpu")


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and "backend" not in getattr(item, "fixturenames", ()):
            item.add_marker(skip)
