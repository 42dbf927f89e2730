"""A process that imported Triton for its interpreter and ran kernels under it (this test suite) still compiles
kernels for a GPU target in process (``launch.compile_launch``: the static model and the peer calibration price
peers' kernels that way). Triton 3.8 leaves two traps there, which a warm on-disk cache hides: its standard
library's ``@jit`` functions are interpreted objects, and an interpreted device-function call (``tl.max`` in a
kernel) patches ``tl.core``'s builtins without restoring them. Compiled here into an empty cache directory."""

from __future__ import annotations

import pytest
import torch

from megakernels.triton import interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs Triton's interpreter (TRITON_INTERPRET=1)")


def test_a_kernel_compiles_after_an_interpreted_device_call(tmp_path, monkeypatch):
    import triton.language as tl

    from megakernels.triton.launch import Launch, compile_launch
    from tests.triton import kernels

    x = torch.randn(3, 16)
    out = torch.empty(3)
    kernels.row_max_kernel[(3,)](x, out, N=16)  # interpreted: tl.max is a device-function call
    torch.testing.assert_close(out, x.max(1).values)
    program_id = tl.core.program_id

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # no cached compile to hide a frontend failure
    kernel = kernels.row_sum_kernel_source()
    meta = torch.empty(64, device="meta")
    compiled = compile_launch(Launch(kernel, (1,), (meta, meta, 4), {"N": 16, "num_warps": 1}), 90)
    assert compiled.asm["cubin"] and "row_sum_kernel" in compiled.metadata.name
    assert tl.core.program_id is program_id  # the language is left as the compile found it
    kernels.row_max_kernel[(3,)](x, out, N=16)  # and the interpreter still runs
    torch.testing.assert_close(out, x.max(1).values)
