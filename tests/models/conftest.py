import pytest

from megakernels.parallel.launch import single_process_world


@pytest.fixture
def world1():
    """A one-process gloo world (the trainer initialises megakernels.parallel itself)."""
    with single_process_world():
        yield


@pytest.fixture
def single_world():
    """A one-process gloo world with ``megakernels.parallel`` initialised at tp = pp = dp = 1."""
    with single_process_world(parallel=True):
        yield
