"""Compile the grouped GEMM's launches for sm_90 as a real launch specialises them, and report what ptxas made.

``python -m tests.triton.grouped_gemm_sm90 [--all]`` (without TRITON_INTERPRET) prints one JSON object per launch:
pass, dtype, config, registers, spill bytes, shared memory, and the number of wgmma (HGMMA) instructions in the
SASS. The launches are built by the launchers of megakernels/triton/grouped_gemm.py on meta tensors at a
Mixtral-like shape, and specialised by Triton's own binder (16-byte divisibility of pointers and of integers that
are multiples of 16, integers equal to 1 folded), so the kernel compiled is the one a GPU launch would run. Default:
each table's first config per dtype; ``--all``: every candidate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

ARCH = 90
T, E, N, K = 8192, 8, 2048, 1024  # 4096 tokens routed top-2 over 8 experts, an expert's fc1 at hidden 1024


def _tools() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_launch(launch):
    """``triton.compile`` of ``(kernel, grid, args, kwargs)`` for sm_90 with the launch's specialisation."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel, _, args, kwargs = launch
    target = GPUTarget("cuda", ARCH, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, opts)
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def resources(compiled) -> dict:
    """registers, spill bytes (stores + loads), shared bytes and HGMMA count of a compiled kernel."""
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        info = subprocess.run([os.path.join(_tools(), "ptxas"), f"-arch=sm_{ARCH}a", "-v", ptx, "-o",
                               os.path.join(d, "v.cubin")], capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(_tools(), "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spills = sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", info))
    return {"registers": regs, "spill_bytes": spills, "shared_bytes": int(compiled.metadata.shared),
            "hgmma": len(re.findall(r"\bHGMMA\b", sass))}


def launches(every: bool):
    """(pass, dtype, config, launch) of the forward, dx and dW products at the module's shape."""
    from megakernels.triton import grouped_gemm as gg

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.empty(T, K, dtype=dtype, device="meta")
        w = torch.empty(E, N, K, dtype=dtype, device="meta")
        dout = torch.empty(T, N, dtype=dtype, device="meta")
        sizes = torch.empty(E, dtype=torch.int64, device="meta")
        rows = gg.candidates(gg.ROWS_CONFIGS, ARCH, dtype, None)
        wgrad = gg.candidates(gg.WGRAD_CONFIGS, ARCH, dtype, None)
        for cfg in rows if every else rows[:1]:
            yield "fwd", dtype, cfg, gg.rows_launch(x, w, sizes, dout, True, cfg)
            yield "dx", dtype, cfg, gg.rows_launch(dout, w, sizes, x, False, cfg)
        for cfg in wgrad if every else wgrad[:1]:
            yield "dw", dtype, cfg, gg.wgrad_launch(dout, x, sizes, w, cfg)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--all", action="store_true", help="every candidate config (default: the first of each)")
    args = p.parse_args(argv)
    for name, dtype, cfg, launch in launches(args.all):
        row = {"pass": name, "dtype": str(dtype).removeprefix("torch."), "config": list(cfg),
               "shape": f"T={T} E={E} N={N} K={K}"}
        row.update(resources(compile_launch(launch)))
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
