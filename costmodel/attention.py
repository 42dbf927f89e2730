"""FlashAttention in the static report: every sm_90 candidate config of the forward and backward at the key shapes
(d64, d128 and d256, bf16, causal and not, s = 4k and 8k with b * s = 16k tokens and h * d = 2048), and one packed case:
the s = 8k causal d128 shape with every sequence 16 documents of 512 tokens (document masking), beside the same
shape as one document, so the report shows the key blocks of other documents skipped; and each shape's default
configs with attention sinks (the ``SINK`` forward, the backward whose delta launch also sums dsinks), beside the
rows without them.

Each kernel's launches come from the launcher itself (``forward_launch`` / ``backward_launches`` on meta tensors),
so the report compiles exactly what runs. What the model needs besides the SASS is each kernel's *schedule*: how
many iterations of each of its MMA loops every CTA runs, in launch order — ``flash_attention.SCHEDULES``, beside the
launchers, held to the kernels' own loop bounds by tests/triton/test_schedules.py — and the bytes each iteration
loads (``LOOP_BYTES``, here).
"""

from __future__ import annotations

import math

import torch

from costmodel import compiled, model, tiles
from costmodel.registry import Entry, register

SHAPES = [(4096, 64), (4096, 128), (8192, 128), (4096, 256)]  # (seqlen, head_dim); batch = 16k / s, heads = 2048 / d
PACK = (8192, 128, 16)  # (seqlen, head_dim, documents per sequence): causal, default configs
DTYPE = torch.bfloat16


def _head(launch) -> int:
    return launch.kwargs["BLOCK_D"]


def _fwd_bytes(launch):
    """Each key block loads a k and a v tile (through TMA with ``TMA``), in every loop (a sliding window's near edge,
    "window", too)."""
    kv = 2 * launch.kwargs["BLOCK_N"] * _head(launch) * 2
    tma = kv if launch.kwargs.get("TMA") else 0
    return {"window": kv, "full": kv, "masked": kv}, {"window": tma, "full": tma, "masked": tma}


def _bwd_bytes(launch):
    """Each query block of the one-pass backward loads a q and a dO tile, lse and delta, and (with atomics) adds a
    dQ tile: read and written at L2; through a descriptor (``DQ_TMA``) the tile also leaves through shared memory."""
    bm, d = launch.kwargs["BLOCK_M"], _head(launch)
    atomics = 2 * bm * d * 4 if launch.kwargs.get("DQ_ATOMIC") else 0
    per_iter = 2 * bm * d * 2 + 2 * bm * 4 + atomics
    tma = bm * d * 4 if launch.kwargs.get("DQ_TMA") else 0
    return {"diag": per_iter, "full": per_iter, "tail": per_iter}, {"diag": tma, "full": tma, "tail": tma}


def _dq_bytes(launch):
    """Each key block of the dQ kernel loads a k and a v tile."""
    return {"all": 2 * launch.kwargs["BLOCK_N"] * _head(launch) * 2}, {}


# kernel name -> (L2 bytes per iteration by loop, TMA bytes per iteration by loop); the loops and their iteration
# counts come from the kernel's schedule (flash_attention.SCHEDULES)
LOOP_BYTES = {"fa_fwd_kernel": _fwd_bytes, "fa_bwd_kernel": _bwd_bytes, "fa_bwd_dq_kernel": _dq_bytes}


def kernel_prediction(launch, m: model.Machine = model.H200) -> tuple[compiled.Compiled, dict]:
    """Compile one launch and predict its time from its MMA loops, its schedule (flash_attention.SCHEDULES) and the
    bytes each iteration loads (``LOOP_BYTES``)."""
    from megakernels.triton import flash_attention as fa

    sched = fa.SCHEDULES[launch.name](launch)
    l2, tma = LOOP_BYTES[launch.name](launch)
    return tiles.kernel_prediction(launch, list(sched.loops), sched.iterations(), l2, m, tma_bytes=tma)


def _meta(*shape, dtype=DTYPE):
    return torch.empty(shape, dtype=dtype, device="meta")


def _documents(b: int, s: int, docs: int):
    """The kernels' document spans (host tensors: the schedules read them) for ``docs`` equal documents per
    sequence, or None for one document."""
    if docs <= 1:
        return None
    from megakernels.ops.attention import document_ranges

    ids = torch.arange(docs).repeat_interleave(s // docs).expand(b, s)
    return document_ranges(ids, ids)


def _attended(s: int, docs: int) -> int:
    """Sum of the squared document lengths: the score entries that FLOPs count (halved when causal)."""
    return docs * (s // docs) ** 2


def _fwd_entry(
    s: int, d: int, causal: bool, cfg, docs: int = 1, m: model.Machine = model.H200, sinks: bool = False
) -> dict:
    from megakernels.triton import flash_attention as fa

    b, h = 16384 // s, 2048 // d
    q, out, lse = _meta(b, s, h, d), _meta(b, s, h, d), _meta(b, h, s, dtype=torch.float32)
    ranges = _documents(b, s, docs)
    launch = fa.forward_launch(
        q,
        q,
        q,
        out,
        lse,
        lse,
        causal,
        1 / math.sqrt(d),
        0.0,
        cfg,
        tma=m.arch >= 90,
        ranges=ranges,
        sinks=_meta(h, dtype=torch.float32) if sinks else None,
    )
    c, pred = kernel_prediction(launch, m)
    flops = 4 * b * h * _attended(s, docs) * d * (0.5 if causal else 1.0)
    return tiles.pass_row([(launch.name, c, pred)], flops, m=m)


def _bwd_entry(
    s: int,
    d: int,
    causal: bool,
    cfg,
    deterministic: bool = False,
    docs: int = 1,
    m: model.Machine = model.H200,
    sinks: bool = False,
) -> dict:
    from megakernels.triton import flash_attention as fa

    b, h = 16384 // s, 2048 // d
    q, lse = _meta(b, s, h, d), _meta(b, h, s, dtype=torch.float32)
    dq = q if deterministic else _meta(b, s, h, d, dtype=torch.float32)
    delta = _meta(2, b, h, s, dtype=torch.float32)  # scaled delta and base-2 lse
    sink_args = dict(sinks=_meta(h, dtype=torch.float32), dsinks=fa.dsinks_scratch(q)) if sinks else {}
    launches = fa.backward_launches(
        q,
        q,
        q,
        q,
        q,
        lse,
        delta,
        dq,
        q,
        q,
        lse,
        causal,
        1 / math.sqrt(d),
        0.0,
        cfg,
        deterministic,
        arch=m.arch,
        ranges=_documents(b, s, docs),
        **sink_args,
    )
    mma = [ln for ln in launches if ln.name in fa.SCHEDULES]
    parts = [(ln.name, *kernel_prediction(ln, m)) for ln in mma]
    elems = b * s * h * d
    # Streaming launches at the copy rate: delta reads dO and O (4 B per element); the atomic path also zeroes
    # the fp32 dQ buffer (4 B) and converts it to bf16 after (4 + 2 B).
    extra = (4 + (0 if deterministic else 10)) * elems / m.dram_copy + m.launch_s * 2
    if sinks:  # the delta launch writes one fp32 partial per program; one more launch sums them
        extra += 2 * sink_args["dsinks"].numel() * 4 / m.dram_copy + m.launch_s
    flops = 10 * b * h * _attended(s, docs) * d * (0.5 if causal else 1.0)
    return tiles.pass_row(parts, flops, extra, m=m)


def _key(s: int, d: int, passname: str) -> bool:
    """Whether the test suite holds a row to the static bar (no spills, shared memory, wgmma): the s = 4k rows,
    but the d256 backward, which is reported and not held: its dK and dV products run on mma.sync (flash_attention's
    BWD_CONFIGS says why)."""
    return s == 4096 and not (d == 256 and passname != "fwd")


def _config_name(cfg) -> str:
    bm, bn, w, st, *limit = cfg
    return f"{bm}x{bn} w{w} s{st}" + (f" r{limit[0]}" if limit else "")


def default_prediction(passname: str, s: int, d: int, causal: bool, m: model.Machine = model.H200) -> dict:
    """The static row of the default config (the first candidate on ``m``'s arch) of the ``passname`` ("fwd" or
    "bwd") kernel at sequence ``s``, head dim ``d`` (batch 16k / s, heads 2048 / d), with its ``config`` name."""
    from megakernels.triton import flash_attention as fa

    table, entry = (fa.FWD_CONFIGS, _fwd_entry) if passname == "fwd" else (fa.BWD_CONFIGS, _bwd_entry)
    cfg = fa.candidates(table, m.arch, d)[0]
    return {"config": _config_name(cfg), **entry(s, d, causal, cfg, m=m)}


@register
def flash_attention_entries() -> list[Entry]:
    from megakernels.triton import flash_attention as fa

    out = []
    for s, d in SHAPES:
        b, h = 16384 // s, 2048 // d
        for causal in (False, True):
            shape = f"b{b} s{s} h{h} d{d}{' causal' if causal else ''}"
            for passname, table, fn in (("fwd", fa.FWD_CONFIGS, _fwd_entry), ("bwd", fa.BWD_CONFIGS, _bwd_entry)):
                bench = {
                    "op": "flash_attention",
                    "pass": passname,
                    "shape": f"{b}x{h}x{s}x{d}",
                    "dtype": "bfloat16",
                    "variant": f"d{d} {'causal' if causal else 'full'}",
                }
                for i, cfg in enumerate(fa.candidates(table, 90, d)):
                    # the default config also with attention sinks (the SINK kernels), its twin the row before
                    for sinks in (False, True) if i == 0 else (False,):
                        out.append(
                            Entry(
                                f"flash_attention.{passname}",
                                _config_name(cfg),
                                shape + (" sinks" if sinks else ""),
                                "bf16",
                                (lambda fn=fn, s=s, d=d, c=causal, cfg=cfg, k=sinks: fn(s, d, c, cfg, sinks=k)),
                                family="attention",
                                needs_wgmma=True,
                                key=_key(s, d, passname),
                                bench=None if sinks else bench,
                            )
                        )
            # deterministic=True: the one-pass kernel without dQ, then the dQ kernel (its default config)
            cfg = fa.candidates(fa.BWD_CONFIGS, 90, d)[0]
            out.append(
                Entry(
                    "flash_attention.bwd_deterministic",
                    _config_name(cfg),
                    shape,
                    "bf16",
                    (lambda s=s, d=d, causal=causal, cfg=cfg: _bwd_entry(s, d, causal, cfg, True)),
                    family="attention",
                    needs_wgmma=True,
                    key=_key(s, d, "bwd"),
                )
            )
    # Packed documents: the s = 8k causal shape whose sequences are each PACK[2] documents (the kernels' DOCS
    # variant), at the default configs; its one-document twin is the row above with the same shape and config.
    s, d, docs = PACK
    b, h = 16384 // s, 2048 // d
    for passname, table, fn in (("fwd", fa.FWD_CONFIGS, _fwd_entry), ("bwd", fa.BWD_CONFIGS, _bwd_entry)):
        cfg = fa.candidates(table, 90, d)[0]
        out.append(
            Entry(
                f"flash_attention.{passname}",
                _config_name(cfg),
                f"b{b} s{s} h{h} d{d} causal {docs}x{s // docs} docs",
                "bf16",
                (lambda fn=fn, cfg=cfg: fn(s, d, True, cfg, docs=docs)),
                family="attention",
                needs_wgmma=True,
                key=True,
                bench={
                    "op": "flash_attention",
                    "pass": passname,
                    "shape": f"{b}x{h}x{s}x{d}",
                    "dtype": "bfloat16",
                    "variant": f"d{d} causal {docs} docs",  # megakernels.bench.attention's packed rows
                },
            )
        )
    return out
