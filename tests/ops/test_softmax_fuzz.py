"""Property test: random [b, heads, sq, sk] shapes, dtypes, mask broadcast patterns and variants against the fp64
reference (120 examples on the C++ CPU backend, 30 through the CUDA emulator)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ops.test_softmax import CAUSAL, MASKED, PLAIN, check_forward_backward, random_mask

DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64])


def test_fuzz_against_reference(backend):
    @settings(
        max_examples=30 if backend.emulated else 120,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        b=st.integers(1, 3),
        h=st.integers(1, 3),
        sq=st.integers(1, 9),
        sk=st.integers(1, 700),
        dtype=DTYPES,
        variant=st.sampled_from([PLAIN, MASKED, CAUSAL]),
        bcast=st.tuples(st.booleans(), st.booleans(), st.booleans()),
        p=st.sampled_from([0.0, 0.3, 0.9, 1.0]),
    )
    def run(b, h, sq, sk, dtype, variant, bcast, p):
        shape = (b, h, sq, sk)
        mask = None
        if variant is MASKED:
            mshape = tuple(1 if flag else n for flag, n in zip(bcast, shape[:3])) + (sk,)
            mask = random_mask(mshape, backend.device, p=p, seed=sk)
        check_forward_backward(variant, backend, shape, dtype, mask=mask)

    run()
