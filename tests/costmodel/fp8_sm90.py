"""Compile the FP8 kernels for sm_90 as real launches specialise them (the static report's compiler path:
megakernels.triton.launch and costmodel.compiled), beyond the bf16-input, e4m3 rows the static report
prices: every granularity pair of the GEMM and the grouped GEMM in every sm_90 config, an e5m2 operand, the pointer
path (a Triton without tensor descriptors), and the quantiser for every granularity, format, input dtype and scale
source at the shapes it is launched on (rows of 16 elements; a number of rows not a multiple of 16 without the
transpose).

``python -m tests.costmodel.fp8_sm90`` (without TRITON_INTERPRET) prints one JSON object per launch: kernel, formats,
granularities, config, registers, spill bytes, shared memory, MMA kind, the QGMMA opcodes (GEMMs) and the PTX
conversions to FP8 (quantiser).
"""

from __future__ import annotations

import json
import re
import sys

import torch

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
PAIRS = [
    ("tensor", "tensor"),
    ("row", "block"),
    ("row", "row"),
    ("tensor", "row"),
    ("tensor", "block"),
    ("row", "tensor"),
]


def _meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def _row(kernel: str, launch, **extra) -> dict:
    from costmodel import compiled
    from megakernels.triton.launch import compile_launch

    c = compiled.triton_kernel(launch)
    row = {"kernel": kernel, **extra, **c.resources()}
    if kernel == "quantize":
        ptx = compile_launch(launch, 90).asm["ptx"]  # cached by Triton
        row["cvt"] = sorted(set(re.findall(r"cvt\.[\w.]*e[45]m[23]x2[\w.]*", ptx)))
    elif kernel != "amax":
        row["qgmma"] = sorted({ins.op for ins in c.fn.instrs if ins.base == "QGMMA"})
    return row


def main() -> int:
    from costmodel import fp8 as sf
    from megakernels.triton import fp8

    m, n, k = 512, 768, 1024
    for ga, gb in PAIRS:
        formats = [("e4m3", "e4m3")] + ([("e5m2", "e4m3")] if (ga, gb) in PAIRS[:2] else [])
        for fa, fb in formats:
            for cfg in fp8.GEMM_CONFIGS[90]:
                launch = sf.gemm_launch((m, n, k), fa, fb, ga, gb, cfg)
                print(json.dumps(_row("gemm", launch, formats=[fa, fb], granularities=[ga, gb], config=cfg)))
        # the pointer path (a Triton without tensor descriptors), a masked K tail (K is padded to 16 before)
        a, b = _meta(m, 1008, dtype=FP8["e4m3"]), _meta(n, 1008, dtype=FP8["e4m3"])
        sa, sb = sf._scale(m, 1008, ga), sf._scale(n, 1008, gb, b_side=True)
        cfg = fp8.GEMM_CONFIGS[90][0]
        launch = fp8.gemm_launch(a, sa, ga, b, sb, gb, _meta(m, n, dtype=torch.bfloat16), cfg, tma=False)
        print(json.dumps(_row("gemm", launch, formats=["e4m3", "e4m3"], granularities=[ga, gb], config="pointers")))
    for ga, gb in (("tensor", "tensor"), ("row", "block"), ("row", "tensor"), ("tensor", "block")):
        for cfg in fp8.GROUPED_CONFIGS[90]:
            launch = sf.grouped_launch(ga, gb, cfg)
            print(json.dumps(_row("grouped", launch, formats=["e4m3", "e4m3"], granularities=[ga, gb], config=cfg)))
    # the quantiser (fp8.quantize pads x to 16-element rows, and to a multiple of 16 rows with the transpose)
    cases = [((1024, 768), "e4m3"), ((1024, 768), "e5m2"), ((1000, 768), "e4m3")]
    for shape, fmt in cases:
        for gran in ("tensor", "row", "block"):
            for dtype in (torch.bfloat16, torch.float32):
                for given in (False, True):
                    x = _meta(*shape, dtype=dtype)
                    transpose = shape[0] % 16 == 0  # 1000 rows: only without the transpose
                    outputs = fp8.quantize_outputs(x, fmt, gran, transpose)
                    scale = _meta(*outputs[1].shape) if given else None
                    amax = _meta(1, dtype=torch.int32)
                    for launch in fp8.quantize_launches(x, fmt, gran, scale, outputs, amax, sms=132):
                        extra = dict(formats=[fmt], granularities=[gran], shape=shape, dtype=str(dtype), given=given)
                        extra["transpose"] = transpose
                        name = "quantize" if launch.name == "fp8_quant_kernel" else "amax"
                        print(json.dumps(_row(name, launch, **extra)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
