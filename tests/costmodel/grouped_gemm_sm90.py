"""Compile the grouped GEMM's default launches for sm_90 as a real launch specialises them (the static report's
compiler path: megakernels.triton.launch and costmodel.compiled), in every dtype.

``python -m tests.costmodel.grouped_gemm_sm90`` (without TRITON_INTERPRET) prints one JSON object per launch: pass,
dtype, config, registers, spill bytes, shared memory and MMA kind. ``megakernels bench --static --ops grouped_gemm``
covers the bf16 candidates with predictions; this covers the fp16 and fp32 defaults too.
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> int:
    from costmodel import compiled, gemm
    from megakernels.triton import grouped_gemm as gg

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for pass_, table in (("fwd", gg.ROWS_CONFIGS), ("dx", gg.ROWS_CONFIGS), ("dw", gg.WGRAD_CONFIGS)):
            cfg = gg.candidates(table, 90, dtype, None)[0]
            row = {"pass": pass_, "dtype": str(dtype).removeprefix("torch."), "config": list(cfg)}
            row.update(compiled.triton_kernel(gemm.launches(pass_, cfg, dtype)).resources())
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
