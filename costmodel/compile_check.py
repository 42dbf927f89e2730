"""Compile every Triton kernel config for the GPUs we target, on a machine without a GPU, as launches get them.

Triton lowers a kernel to PTX and runs ptxas for a given ``GPUTarget`` without a device, so this catches what the
interpreter cannot: type errors of the real compiler, block shapes ``tl.dot`` rejects, and configs whose shared
memory does not fit the architecture (then the launch would fail with OutOfResources on the GPU), and configs that
spill registers (ptxas's stack frame, read from the cubin with cuobjdump where it is installed). Each kernel is
built by its launcher (``forward_launch``, ``backward_launches``, ``stats_launch``, ``grad_launch`` on meta
tensors at a representative shape) and compiled with the specialisation that launch gets
(megakernels.triton.launch): 16-byte-divisible pointers and strides, constants folded, the real constexprs.

``python -m costmodel.compile_check [--arch 80,90] [--full] [--defaults] [--jobs N]`` (must run without
TRITON_INTERPRET). Exit status 1 and a line per failure when anything does not compile, fit or stay unspilled.
"""

from __future__ import annotations

import argparse
import itertools
import math
import multiprocessing
import os
import sys

from megakernels.machines import ARCHS

SHARED_LIMIT = {arch: a.smem_per_block for arch, a in ARCHS.items()}  # opt-in shared memory per block

HEAD_DIMS = (32, 64, 128, 256)
# (q/k head dim, v head dim) pairs beyond the equal ones: multi-head latent attention's 192 / 128 (DeepSeek-V3). Its
# absorbed decoding form, 576 / 512, is past the Triton kernels' 256 (megakernels.ops.attention.MAX_TRITON_HEAD_DIM).
HEAD_DIM_PAIRS = ((192, 128),)


def _meta(shape, dtype):
    import torch

    return torch.empty(shape, dtype=getattr(torch, dtype), device="meta")


def attention_launches(
    arch: int,
    head_dim: int,
    cfg_index: int,
    passname: str,
    dtype: str,
    causal: bool,
    dropout: bool,
    seqlen: int = 4096,
    sinks: bool = False,
    head_dim_v: int | None = None,
):
    """The launches of one FlashAttention config (``fa.candidates(...)[cfg_index]``, by both head dims) at a
    4k-token shape, with attention sinks when ``sinks``, v (and out, dO, dV) of head dim ``head_dim_v`` (default
    q's)."""
    from megakernels.triton import flash_attention as fa

    b, h = 2, 8
    dv = head_dim if head_dim_v is None else head_dim_v
    q = _meta((b, seqlen, h, head_dim), dtype)
    v = q if dv == head_dim else _meta((b, seqlen, h, dv), dtype)  # also out, dO, dV
    lse = _meta((b, h, seqlen), "float32")
    seed = _meta((), "int64")
    sink = _meta((h,), "float32") if sinks else None
    scale, p = 1 / math.sqrt(head_dim), (0.1 if dropout else 0.0)
    if passname == "fwd":
        cfg = fa.candidates(fa.FWD_CONFIGS, arch, head_dim, dv)[cfg_index]
        return [fa.forward_launch(q, q, v, v, lse, seed, causal, scale, p, cfg, tma=arch >= 90, sinks=sink)]
    cfg = fa.candidates(fa.BWD_CONFIGS, arch, head_dim, dv)[cfg_index]
    dq = _meta((b, seqlen, h, head_dim), "float32")  # the atomic path's fp32 accumulator
    delta = _meta((2, b, h, seqlen), "float32")  # scaled delta and base-2 lse
    dsinks = fa.dsinks_scratch(q, dv) if sinks else None
    return fa.backward_launches(
        v, q, q, v, v, lse, delta, dq, q, v, seed, causal, scale, p, cfg, arch=arch, sinks=sink, dsinks=dsinks
    )


def cross_entropy_launches(arch: int, vocab: int = 50304, softcap: float = 0.0):
    """The cross-entropy's two kernels (with the final-logit soft cap compiled in when ``softcap``)."""
    from megakernels.triton import cross_entropy as ce

    x, tgt, f32 = _meta((1024, vocab), "bfloat16"), _meta((1024,), "int64"), _meta((1024, 4), "float32")
    return [
        ce.stats_launch(x, tgt, f32, 0, vocab, arch, softcap),
        ce.grad_launch(x, tgt, f32, f32, 0, vocab, -100, 0.9, 0.1 / vocab, x, arch, softcap),
    ]


def moe_router_launches(arch: int, experts: int = 256, k: int = 8, n_group: int = 8, sigmoid: bool = True):
    """The MoE router's forward and backward at DeepSeek-V3's routing (256 experts, top-8 of 4 of 8 groups,
    sigmoid scores) by default."""
    from megakernels.triton import moe_router as mr

    t, x = 4096, _meta((4096, experts), "bfloat16")
    f32, idx = _meta((t, k), "float32"), _meta((t, k), "int64")
    part = _meta((mr.ROWS, experts), "float32")
    score, topk_group = int(sigmoid), max(1, n_group // 2)
    fwd = (x, _meta((experts,), "float32"), f32, idx, _meta((t,), "float32"), part, part)
    return [
        mr.route_launch(*fwd, k, score, True, not sigmoid, 2.5, n_group, topk_group),
        mr.route_backward_launch(
            x, _meta((t,), "float32"), idx, f32, f32, _meta((experts,), "float32"), _meta((t,), "float32"), x, score,
            True, not sigmoid, 2.5,
        ),
    ]  # fmt: skip


def moe_permute_launches(arch: int, experts: int = 256, k: int = 8, hidden: int = 7168):
    """The MoE permutation's index pass and unpermute (forward, backward) at DeepSeek-V3's sizes by default."""
    from megakernels.triton import moe_permute as mp

    t = 4096
    flat = _meta((t * k,), "int64")
    per = _meta((mp.BLOCK, experts), "int64")
    rows, w, out = _meta((t * k, hidden), "bfloat16"), _meta((t, k), "float32"), _meta((t, hidden), "bfloat16")
    return [
        *mp.permute_index_launches(
            flat, per, per, _meta((experts,), "int64"), _meta((experts,), "int64"), flat, experts
        ),
        mp.unpermute_launch(rows, flat, w, out),
        mp.unpermute_backward_launch(rows, flat, w, out, rows, w),
    ]


def jobs(archs, full: bool, defaults: bool):
    """(what, arch, builder args): every candidate config of every head dim in the fp16 causal variant, plus every
    variant (dtype x causal x dropout) of each arch's d128 default, and each default's fp16 causal variant with
    attention sinks; for each pair of ``HEAD_DIM_PAIRS`` (v's head dim of its own) every candidate in the bf16
    causal variant and the default's dropout and non-causal ones; with ``full``, every config in every variant (and
    each default's with sinks); with ``defaults``, each head dim's first config in the fp16 causal variant (and each
    pair's). Plus the cross-entropy kernels, without and with the soft cap, and the MoE router's and permutation's."""
    from megakernels.triton import flash_attention as fa

    for arch in archs:
        yield (f"cross_entropy sm_{arch}", arch, ("ce",))
        yield (f"cross_entropy sm_{arch} softcap", arch, ("ce", 50304, 30.0))
        yield (f"moe_router sm_{arch} deepseek-v3", arch, ("router",))
        yield (f"moe_router sm_{arch} gpt-oss", arch, ("router", 128, 4, 1, False))
        yield (f"moe_permute sm_{arch}", arch, ("permute",))
        for passname, table in (("fwd", fa.FWD_CONFIGS), ("bwd", fa.BWD_CONFIGS)):
            for head_dim in HEAD_DIMS:
                for i, cfg in enumerate(fa.candidates(table, arch, head_dim)):
                    if defaults and i:
                        continue
                    variants = list(itertools.product(("float16", "bfloat16"), (False, True), (False, True)))
                    if defaults or (not full and not (head_dim == 128 and i == 0)):
                        variants = [("float16", True, False)]
                    for dtype, causal, dropout in variants:
                        what = (
                            f"flash_attention {passname} sm_{arch} {dtype} d{head_dim} {cfg} causal={causal} "
                            f"dropout={dropout}"
                        )
                        yield (what, arch, ("fa", head_dim, i, passname, dtype, causal, dropout))
                    if i == 0 and not defaults:
                        what = f"flash_attention {passname} sm_{arch} float16 d{head_dim} {cfg} causal=True sinks"
                        yield (what, arch, ("fa", head_dim, i, passname, "float16", True, False, 4096, True))
            # v's own head dim: every candidate of the larger dim's table in the bf16 causal variant, the default
            # also with dropout and without causality
            for d, dv in HEAD_DIM_PAIRS:
                for i, cfg in enumerate(fa.candidates(table, arch, d, dv)):
                    if defaults and i:
                        continue
                    variants = [(True, False)] + ([(True, True), (False, False)] if i == 0 and not defaults else [])
                    for causal, dropout in variants:
                        what = (
                            f"flash_attention {passname} sm_{arch} bfloat16 d{d}/{dv} {cfg} causal={causal} "
                            f"dropout={dropout}"
                        )
                        yield (what, arch, ("fa", d, i, passname, "bfloat16", causal, dropout, 4096, False, dv))


def _spill_bytes(compiled) -> int:
    """The stack frame ptxas gave the kernel (spilled registers), from its cubin; 0 without cuobjdump."""
    from costmodel import sass
    from costmodel.compiled import kernel_function

    if sass.find_tool("cuobjdump") is None:
        return 0
    fn = kernel_function(compiled)
    return fn.resources.stack_bytes if fn.resources else 0


def _check_one(job) -> str | None:
    """None when every launch of the job compiles and fits, else a one-line failure."""
    from megakernels.triton.launch import compile_launch

    what, arch, spec = job
    try:
        build = {"ce": cross_entropy_launches, "router": moe_router_launches, "permute": moe_permute_launches}.get(
            spec[0], attention_launches
        )
        launches = build(arch, *spec[1:])
        for launch in launches:
            compiled = compile_launch(launch, arch)
            if compiled.metadata.shared > SHARED_LIMIT[arch]:
                return f"FAIL {what} {launch.name}: shared memory {compiled.metadata.shared} B > {SHARED_LIMIT[arch]} B"
            spills = _spill_bytes(compiled)
            if spills:
                return f"FAIL {what} {launch.name}: {spills} B of spilled registers a thread"
    except Exception as e:  # noqa: BLE001 - report every failing config, then fail
        return f"FAIL {what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="80,90", help="comma list of 80, 90")
    parser.add_argument("--full", action="store_true", help="every config in every variant (slow)")
    parser.add_argument("--defaults", action="store_true", help="each head dim's default config only")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes")
    args = parser.parse_args(argv)
    try:
        archs = [int(a) for a in args.arch.split(",") if a]
        if not archs or any(a not in SHARED_LIMIT for a in archs):
            raise ValueError
    except ValueError:
        parser.error(f"--arch: expected a comma list of {', '.join(map(str, SHARED_LIMIT))}, got {args.arch!r}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (the interpreter does not compile)", file=sys.stderr)
        return 2
    todo = list(jobs(archs, args.full, args.defaults))
    with multiprocessing.get_context("spawn").Pool(max(1, min(args.jobs, len(todo)))) as pool:
        failures = [f for f in pool.imap_unordered(_check_one, todo) if f]
    for line in failures:
        print(line)
    print(f"compile_check: {len(todo) - len(failures)}/{len(todo)} kernel configs compiled and fit without spills")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
