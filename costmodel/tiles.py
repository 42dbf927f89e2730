"""The tile-loop half of the static model shared by the MMA kernels (FlashAttention, the grouped GEMM): compile a
launch, find its MMA loops, and predict its time from the per-CTA iteration counts of each loop (the kernel's
schedule, ``Schedule.iterations()`` of the function beside its launcher in megakernels/triton/) and the L2 bytes
each iteration loads (the family module's)."""

from __future__ import annotations

from costmodel import analysis, compiled, model


def kernel_prediction(
    launch,
    roles: list[str],
    ctas: list[dict],
    l2_bytes: dict,
    m: model.Machine = model.H200,
    tma_bytes: dict | None = None,
) -> tuple[compiled.Compiled, dict]:
    """Compile ``launch`` and predict its time: ``roles`` names its MMA loops in address order, ``ctas[i][role]``
    is how many iterations of each CTA ``i`` runs (launch order), ``l2_bytes[role]`` what one iteration loads,
    ``tma_bytes[role]`` what its TMA copies move through shared memory (loads and reduces).

    Raises:
        RuntimeError: the kernel does not fit an SM. ValueError: its MMA loops do not match ``roles``."""
    c = compiled.triton_kernel(launch, m.arch)
    loops = analysis.mma_loops(c, roles)
    warps = launch.num_warps
    its = {
        r: analysis.tile_iteration(c, lp, warps, l2_bytes[r], (tma_bytes or {}).get(r, 0.0)) for r, lp in loops.items()
    }
    per_sm = model.blocks_per_sm(m, c.threads, c.registers, c.shared_bytes)
    if per_sm == 0:
        raise RuntimeError(f"{launch.name}: does not fit an SM ({c.registers} registers, {c.shared_bytes} B shared)")
    outside = c.fn.totals.instructions - sum(lp.counts.instructions for lp in loops.values())
    pred = model.predict_tiles(ctas, its, per_sm, outside * warps / 4, m)
    pred["ctas_per_sm"] = per_sm
    pred["per_iteration"] = {
        r: {
            "instructions": lp.counts.instructions,
            "mufu": lp.counts.mufu,
            "branches": lp.counts.branches,
            "mma_instructions": lp.counts.mma,
            "barriers": lp.counts.barriers,
            "wgmma_waits": lp.counts.wgmma_waits,
            "overlapped_instructions": its[r].overlap_instr,
            "mma_flops": its[r].mma_flops,
            "shared_bytes": its[r].shared_bytes,
            # of the SM's shared-memory bandwidth, at the predicted time per iteration
            "shared_utilisation": round(its[r].cycles(m)["smem"] / pred["cycles_per_iteration"][r], 3),
        }
        for r, lp in loops.items()
    }
    return c, pred


def pass_row(
    parts: list, flops: float, extra_time: float = 0.0, m: model.Machine = model.H200, peak: float | None = None
) -> dict:
    """The JSON fields of a pass made of ``parts`` [(name, Compiled, prediction)]: the heaviest launch's resources,
    every launch's time, and the pass's predicted fraction of ``peak`` (default the dense bf16 MMA peak)."""
    total = sum(p["time_s"] for _, _, p in parts) + extra_time
    name, main, pred = max(parts, key=lambda p: p[2]["time_s"])
    role = next(iter(pred["per_iteration"]))
    launches = [
        {
            "kernel": n,
            **c.resources(),
            "ctas_per_sm": p["ctas_per_sm"],
            "predicted_time_us": p["time_s"] * 1e6,
            "bounds": p["bounds"],
            "tail_efficiency": round(p["tail_efficiency"], 3),
            "per_iteration": p["per_iteration"],
        }
        for n, c, p in parts
    ]
    return {
        **main.resources(),
        "kernel": name,
        "blocks_per_sm": pred["ctas_per_sm"],
        "instructions_per_iteration": pred["per_iteration"][role]["instructions"],
        "mufu_per_iteration": pred["per_iteration"][role]["mufu"],
        "bound": pred["bounds"][role],
        "hot_loop_branches": pred["per_iteration"][role]["branches"],
        "predicted_time_us": total * 1e6,
        "predicted_tflops": flops / total / 1e12,
        "predicted_fraction": flops / total / (peak or m.mma_dense_bf16),
        "launches": launches,
        **({"other_time_us": extra_time * 1e6} if extra_time else {}),
    }
