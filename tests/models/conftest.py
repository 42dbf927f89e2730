import pytest
import torch
import torch.distributed as dist

import megakernels.parallel as mpu


@pytest.fixture
def single_world():
    """A one-process gloo world with ``megakernels.parallel`` initialised at tp = pp = dp = 1."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mpu.initialize(1, 1)
    try:
        yield
    finally:
        mpu.destroy()
        if own:
            dist.destroy_process_group()
