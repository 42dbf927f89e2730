"""Shared fixtures: every op test runs over the backends cpu, cuda_emu (CPU tensors through the emulated CUDA
kernels, or through the Triton kernels under Triton's interpreter; small shapes) and cuda (marked ``cuda``; skipped
without a GPU)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter (backend cuda_emu routes CPU tensors to them);
# it must be chosen before megakernels.triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The trainer caches the preprocessed default corpus and sample indices; tests keep theirs apart from the user's
# (spawned ranks inherit the variable).
if "MEGAKERNELS_CACHE" not in os.environ:
    import tempfile

    os.environ["MEGAKERNELS_CACHE"] = tempfile.mkdtemp(prefix="megakernels-test-cache-")

# CI runs two pytest workers on two cores: one intra-op thread each (the processes they start inherit it; spawned
# ranks set their own). With more threads than cores, a small op's parallel region waits for a descheduled thread:
# a matmul of a few KB took 6 ms on a loaded machine. Tests of thread-count behaviour set the count themselves.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Spawned worlds start their ranks from a fork server that has imported torch once (megakernels.parallel.launch):
# the suite runs hundreds of ranks, each of which would otherwise pay torch's import.
os.environ.setdefault("MEGAKERNELS_START_METHOD", "forkserver")
# ... which also imports, once, what a rank that trains would import on its own: the trainer (~1.7 s: with
# torch.distributed.checkpoint and what it pulls in) and torch._dynamo (~3 s; torch.optim.Optimizer imports it
# when the first parameter group is added).
os.environ.setdefault("MEGAKERNELS_FORKSERVER_PRELOAD", "torch._dynamo,megakernels_models.training.train")

import megakernels  # noqa: E402
from tests.helpers import Backend  # noqa: E402

# Triton's interpreter lacks the tensor-descriptor add of the FlashAttention backward and rounds its FP8 casts
# wrongly; megakernels fixes both only when asked (importing it patches nothing). The ranks of spawned worlds do not
# run the Triton kernels.
if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    from megakernels.triton import install_interpreter_descriptor_reduce, install_interpreter_fp8_casts

    install_interpreter_descriptor_reduce()
    install_interpreter_fp8_casts()


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


@pytest.fixture
def triton_backend(backend):
    """``backend`` for ops with Triton kernels: on cuda_emu they run under Triton's interpreter, which exists only
    when TRITON_INTERPRET=1 was set at import (this conftest sets it on machines without a GPU)."""
    if backend.emulated:
        from megakernels.triton import interpreting

        if not interpreting():
            pytest.skip("Triton kernels were compiled for the GPU (TRITON_INTERPRET unset): no interpreter run")
    return backend


# The longest test files (spawned worlds, CLI runs, Triton compiles and its interpreter; 15-150 s each in CI, as
# MEGAKERNELS_TEST_TIMES measured them), longest first and run before the rest: with pytest-xdist's --dist loadfile
# (scripts/test.sh) a file is one unit of work, and a long one started last would leave the other worker idle at the
# end.
LONG_POLES = (
    "tests/models/test_layouts.py",
    "tests/ops/test_flash_attention.py",
    "tests/triton/test_fp8.py",
    "tests/test_docs.py",
    "tests/models/test_hangs.py",
    "tests/models/test_preemption.py",
    "tests/triton/test_schedules.py",
    "tests/test_cpu_isa.py",
    "tests/integrations/test_transformers.py",
    "tests/costmodel/test_static.py",
    "tests/ops/test_linear_cross_entropy.py",
    "tests/test_packaging.py",
    "tests/ops/test_flash_attention_varlen.py",
    "tests/models/test_elastic.py",
    "tests/models/test_dpo.py",
    "tests/parallel/test_harness.py",
    "tests/integrations/test_accelerate.py",
    "tests/models/test_muon_training.py",
    "tests/models/test_launch.py",
    "tests/nn/test_norm_modules.py",
    "benchmarks/test_bench_llama.py",
    "tests/test_structure.py",
    "tests/ops/test_flash_attention_sinks.py",
    "tests/ops/test_flash_attention_window.py",
)


def _run_order(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return LONG_POLES.index(path) if path in LONG_POLES else len(LONG_POLES)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_run_order)  # stable: the rest keep their order
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and "backend" not in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left_behind(request):
    """A test module that leaves a torch.distributed default process group initialised fails here (and the group is
    ended): the next module's world would otherwise fail to start, far from the cause."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(
            f"{request.module.__name__} left a torch.distributed process group initialised: end the world it "
            "started (megakernels_models.inference.pretrained.release(), megakernels.parallel.destroy())"
        )


# MEGAKERNELS_TEST_TIMES=<path>: the controller writes each test file's summed setup/call/teardown time there
# (seconds, longest first), to see where the suite's time goes and to order LONG_POLES by it.
# The path is taken out of the environment at start-up: a pytest that a test runs in a subprocess (the op subset of
# test_cpu_isa) would otherwise write its own file times over the run's.
_FILE_TIMES: dict[str, float] = {}
_TIMES_PATH = os.environ.pop("MEGAKERNELS_TEST_TIMES", None)


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_TIMES[path] = _FILE_TIMES.get(path, 0.0) + report.duration


def pytest_sessionfinish(session):
    out = _TIMES_PATH
    if out and not hasattr(session.config, "workerinput"):  # the controller, or a run without xdist
        rows = sorted(_FILE_TIMES.items(), key=lambda kv: -kv[1])
        with open(out, "w") as f:
            f.writelines(f"{t:8.1f}  {p}\n" for p, t in rows)
