"""Compile every Triton kernel config for the GPUs we target, on a machine without a GPU.

Triton lowers a kernel to PTX and runs ptxas for a given ``GPUTarget`` without a device, so this catches what the
interpreter cannot: type errors of the real compiler, block shapes ``tl.dot`` rejects, and configs whose shared
memory does not fit the architecture (then the launch would fail with OutOfResources on the GPU).

``python -m megakernels.triton.compile_check [--full]`` (must run without TRITON_INTERPRET). Exit status 1 and a
line per failure when anything does not compile or fit.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import sys

# Opt-in shared memory per block (bytes): sm_90 (H100/H200) 227 KiB, sm_80 (A100) 163 KiB.
SHARED_LIMIT = {90: 232448, 80: 166912}
_DTYPE_NAME = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_FP32_POINTERS = {"LSE", "DELTA"}
_FLOAT_ARGS = {"qk_scale", "scale", "keep_scale"}
_INT_ARGS = {"H", "HK", "GROUP", "SQ", "SK"}  # upper-case scalars (sizes), not pointers


def signature(kernel, dtype: str, constexprs: dict) -> dict:
    """Triton signature of a megakernels kernel: upper-case names are pointers (except the sizes in _INT_ARGS) (fp32 for LSE/DELTA, int64 for
    SEED, else the data dtype), scale arguments fp32, every other runtime argument int32."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name == "SEED":
            sig[name] = "*i64"
        elif name in _FP32_POINTERS:
            sig[name] = "*fp32"
        elif name.isupper() and name not in _INT_ARGS:
            sig[name] = "*" + _DTYPE_NAME[dtype]
        elif name in _FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_kernel(kernel, arch: int, dtype: str, constexprs: dict, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=kernel, signature=signature(kernel, dtype, constexprs), constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def flash_attention_jobs(full: bool):
    """(name, kernel, arch, dtype, constexprs, warps, stages): every candidate config of every arch and head dim
    in the fp16 causal variant, plus every variant (dtype x causal x dropout) of the sm_90 d128 default; with
    ``full``, every config in every variant."""
    from megakernels.triton import flash_attention as fa

    for arch in SHARED_LIMIT:
        for table, kernels in ((fa.FWD_CONFIGS, (fa._fwd_kernel,)),
                               (fa.BWD_CONFIGS, (fa._bwd_dkdv_kernel, fa._bwd_dq_kernel))):
            for head_dim, configs in table[arch].items():
                for i, (bm, bn, warps, stages) in enumerate(configs):
                    variants = list(itertools.product(("float16", "bfloat16"), (False, True), (False, True)))
                    if not full and not (arch == 90 and head_dim == 128 and i == 0):
                        variants = [("float16", True, False)]
                    for dtype, causal, dropout in variants:
                        for kernel in kernels:
                            consts = dict(HEAD_DIM=head_dim, BLOCK_D=fa.padded_head_dim(head_dim), BLOCK_M=bm,
                                          BLOCK_N=bn, CAUSAL=causal, DROPOUT=dropout, PRECISION="tf32")
                            yield (kernel.fn.__name__, arch, dtype, consts, warps, stages)


def _check_one(job) -> str | None:
    """None when the job compiles and fits, else a one-line failure."""
    from megakernels.triton import flash_attention as fa

    name, arch, dtype, consts, warps, stages = job
    what = (f"{name} sm_{arch} {dtype} d{consts['HEAD_DIM']} {consts['BLOCK_M']}x{consts['BLOCK_N']} "
            f"w{warps} s{stages} causal={consts['CAUSAL']} dropout={consts['DROPOUT']}")
    try:
        compiled = compile_kernel(getattr(fa, name), arch, dtype, consts, warps, stages)
    except Exception as e:  # noqa: BLE001 - report every failing config, then fail
        return f"FAIL {what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if compiled.metadata.shared > SHARED_LIMIT[arch]:
        return f"FAIL {what}: shared memory {compiled.metadata.shared} B > {SHARED_LIMIT[arch]} B"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="every config in every variant (slow)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (the interpreter does not compile)", file=sys.stderr)
        return 2
    jobs = list(flash_attention_jobs(args.full))
    with multiprocessing.get_context("spawn").Pool(max(1, args.jobs)) as pool:
        failures = [f for f in pool.imap_unordered(_check_one, jobs) if f]
    for line in failures:
        print(line)
    print(f"compile_check: {len(jobs) - len(failures)}/{len(jobs)} kernel configs compiled and fit")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
