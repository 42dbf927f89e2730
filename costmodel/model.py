"""The static cost model: from what a kernel compiles to (``sass``) and how it is launched, a predicted time and
fraction of the H200's ceiling. Written down, with its assumptions, in costmodel/README.md; the constants
below are the ones the first GPU run calibrates (scripts/gpu_check.sh prints predicted beside measured).

Two kernel kinds:

- **Streaming** (memory-bound: norms, softmax, bias-GeLU, cross-entropy, AdamW). Per element: SASS instructions
  issued, MUFU operations, bytes through L2, and the bytes that must cross DRAM. The memory time is the larger of
  the DRAM time (at the copy bandwidth, or less when too few bytes are in flight per SM to cover the memory
  latency) and the L2 time (one pipeline); it combines with the issue time (4 schedulers x 32 lanes per SM per
  clock, at ``issue_efficiency``) and the MUFU time (16 per SM per clock) as a p-norm (``overlap_p``), plus the
  launch; the constants are fitted on a peer's published timings (``fit``).
- **Tiled MMA** (FlashAttention). Per tile iteration of one CTA: tensor-core cycles (wgmma at the dense bf16
  rate, mma.sync at a fraction of it), issue cycles of everything else, MUFU cycles, L2 cycles of the K/V tile
  loads, shared-memory cycles (wgmma operands read from shared memory, TMA/cp.async fills, LDS/STS). A CTA's
  critical path is MMA (each wgmma no faster than its shared-memory operands arrive) + softmax minus what the
  SASS overlaps (instructions issued between a wgmma and the wait on it); k resident CTAs per SM share the units.
  CTAs are list-scheduled onto the SMs in launch order, so a causal grid launched lightest-first pays for its
  tail.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

from megakernels import machines


@dataclasses.dataclass(frozen=True)
class Machine:
    """One GPU as the model sees it: the part's figures from ``megakernels.machines`` (``machine``) and the model's
    own constants, some assumed and some calibrated on published timings (``fit``). Rates are per SM per clock
    unless named otherwise; ``sources`` says where each figure comes from."""

    name: str
    arch: int
    sms: int
    clock_hz: float  # the clock at which the dense tensor-core rating holds
    boost_clock_hz: float
    mma_dense_bf16: float  # FLOP/s, dense bf16 peak (the attention ceiling); fp16 is the same
    mma_dense_fp8: float  # FLOP/s dense (0: no fp8 tensor cores)
    mma_dense_tf32: float  # FLOP/s dense
    fp32_simt: float  # FLOP/s, FP32 on the CUDA cores (an fp32 GEMM without TF32: ``cublas``)
    mma_sustained: float  # fraction of that peak the best large bf16 GEMM sustains (MAMF)
    dram_peak: float  # B/s
    dram_copy: float  # B/s, a device-to-device copy (the streaming ceiling)
    l2_bw: float  # B/s, L2 -> SM: all SMs reading L2-resident data
    l2_bytes: int  # L2 capacity
    l1_bytes: int  # L1 data cache and shared memory together, per SM (spilled registers cache here)
    max_warps: int
    max_blocks: int
    regs: int
    smem: int  # shared memory per SM
    smem_per_block: int  # opt-in per block
    smem_reserved: int  # per block
    mma_per_clk: float  # dense 16-bit tensor-core FLOPs per SM per clock: 4096 on sm_90 (wgmma), 2048 on sm_80
    issue_lanes: int = 128  # 4 schedulers x 1 warp-instruction x 32 lanes
    mufu_lanes: int = 16  # ex2 / rcp / rsqrt / lg2 results per SM per clock
    mma_sync_rate: float = 0.625  # mma.sync's rate relative to wgmma on Hopper (1 where mma.sync is the MMA)
    smem_bytes_per_clk: float = 128.0  # shared memory per SM (32 banks x 4 B): wgmma operand reads, TMA and
    # cp.async fills, LDS/STS share it (assumption; calibrate)
    dram_latency_s: float = 0.8e-6  # loaded DRAM latency: bytes in flight per SM must cover it
    launch_s: float = 8e-6  # per kernel launch as CUDA events time it: launch, ramp-up, drain (calibrated)
    issue_efficiency: float = 0.9  # fraction of the issue slots a streaming kernel's warps fill (calibrated)
    overlap_p: float = 4.0  # memory, issue and MUFU combine as (sum t_i^p)^(1/p); inf = perfect overlap (calibrated)
    sources: tuple = ()  # (field, source) pairs: where each number comes from

    @property
    def mma_rate(self) -> float:
        """Sustained dense 16-bit tensor-core FLOPs per SM per clock."""
        return self.mma_per_clk * self.mma_sustained

    @property
    def mma_fp8_rate(self) -> float:
        """The same for FP8 operands (the 16-bit rate on a GPU without FP8 tensor cores)."""
        return self.mma_rate * (self.mma_dense_fp8 / self.mma_dense_bf16 if self.mma_dense_fp8 else 1.0)

    def mma_clocks(self, flops: float, sync_flops: float = 0.0, fp8_flops: float = 0.0, tf32_flops: float = 0.0):
        """SM clocks the tensor cores take for ``flops`` (of which ``sync_flops`` on mma.sync, at
        ``mma_sync_rate``; ``fp8_flops`` at the dense FP8 rate; ``tf32_flops`` at the tf32 one; the rest at the dense
        16-bit rate), each at ``mma_sustained`` of its peak."""
        rate, fp8_rate = self.mma_rate, self.mma_fp8_rate
        tf32 = tf32_flops * (self.mma_dense_bf16 / self.mma_dense_tf32 - 1.0) / rate  # beyond its 16-bit time
        return (
            (flops - sync_flops - fp8_flops) / rate
            + fp8_flops / fp8_rate
            + sync_flops / (rate * self.mma_sync_rate)
            + tf32
        )

    @property
    def issue_per_s(self) -> float:
        return self.sms * self.issue_lanes * self.clock_hz

    @property
    def mufu_per_s(self) -> float:
        return self.sms * self.mufu_lanes * self.clock_hz


_MODEL_SOURCES = (
    ("dram_latency_s, launch_s", "assumptions, calibrated against Liger-Kernel's published timings"),
    ("issue_efficiency, overlap_p", "calibrated against Liger-Kernel's published timings (``fit``)"),
    ("mma_sync_rate, smem_bytes_per_clk", "assumptions"),
)


def machine(gpu: machines.GPU) -> Machine:
    """The model's machine for one part of ``megakernels.machines``."""
    a = gpu.limits
    return Machine(
        name=gpu.name,
        arch=gpu.arch,
        sms=gpu.sms,
        clock_hz=gpu.clock_hz,
        boost_clock_hz=gpu.boost_clock_hz,
        mma_dense_bf16=gpu.bf16_dense,
        mma_dense_fp8=gpu.fp8_dense,
        mma_dense_tf32=gpu.tf32_dense,
        fp32_simt=gpu.fp32,
        mma_sustained=gpu.mma_sustained,
        dram_peak=gpu.hbm,
        dram_copy=gpu.copy,
        l2_bw=gpu.l2_bw,
        l2_bytes=gpu.l2_bytes,
        l1_bytes=gpu.l1_bytes,
        max_warps=a.max_warps,
        max_blocks=a.max_blocks,
        regs=a.regs,
        smem=a.smem_per_sm,
        smem_per_block=a.smem_per_block,
        smem_reserved=a.smem_reserved,
        mma_per_clk=a.mma_per_clk,
        mma_sync_rate=0.625 if gpu.arch >= 90 else 1.0,  # mma.sync is Ampere's tensor-core instruction
        sources=(*gpu.sources, ("limits", a.source), *_MODEL_SOURCES),
    )


# The parts the model prices (sm_80 and sm_90: the architectures the kernels are compiled for).
MACHINES: dict[str, Machine] = {k: machine(g) for k, g in machines.GPUS.items() if g.arch in machines.ARCHS}
H200 = MACHINES["H200"]


def machine_for(gpu_name: str) -> Machine | None:
    """The machine of a GPU named as torch names it (``NVIDIA H100 80GB HBM3``), or None when the model has none."""
    gpu = machines.gpu_named(gpu_name)
    return MACHINES.get(gpu.key) if gpu is not None else None


def blocks_per_sm(m: Machine, threads: int, registers: int, shared: int, grid_cap: int | None = None) -> int:
    """Resident blocks per SM: registers (allocated per warp in units of 256), shared memory, warps, blocks, and
    the launch's own cap (a grid of ``grid_cap`` blocks per SM at most)."""
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    limits = [m.max_blocks, m.max_warps // warps, m.regs // (regs_per_warp * warps)]
    if shared:
        limits.append(m.smem // (shared + m.smem_reserved))
    if grid_cap is not None:
        limits.append(max(1, grid_cap))
    return max(0, min(limits))


# ---- streaming kernels -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class StreamCost:
    """Per element of the op (not per thread): what the hot loops and their row overhead cost."""

    instructions: float
    mufu: float
    l2_bytes: float  # through L2 (all global traffic but the L1-resident parameters)
    dram_bytes: float  # that must cross DRAM (the compulsory traffic)
    min_bytes: float  # the op's minimum (what the GB/s of `megakernels bench` counts)
    in_flight_per_sm: float  # bytes of loads in flight per SM in the DRAM-reading loop
    warps_per_sm: int
    sm_fraction: float = 1.0  # of the SMs the grid occupies (a grid smaller than the machine leaves SMs idle)
    mma_cycles: float = 0.0  # tensor-core SM-clocks (a kernel with tl.dot: its MMA FLOPs at the sustained rate)


def combine(times: list[float], p: float) -> float:
    """Resource times that overlap imperfectly: the p-norm (sum t^p)^(1/p), between their sum (p = 1) and their
    largest (p = inf, perfect overlap)."""
    big = max(times)
    if big <= 0 or math.isinf(p):
        return big
    return big * sum((t / big) ** p for t in times) ** (1 / p)


def predict_stream(c: StreamCost, elements: float, launches: int = 1, m: Machine = H200) -> dict:
    """Time and fraction of the copy ceiling for ``elements`` elements processed by ``launches`` launches."""
    f = max(c.sm_fraction, 1e-9)
    # loads in flight cover the DRAM latency or not; a kernel that only stores waits on no load
    bw = min(m.dram_copy, c.in_flight_per_sm * m.sms * f / m.dram_latency_s) if c.in_flight_per_sm > 0 else m.dram_copy
    times = {
        "dram": elements * c.dram_bytes / bw,
        "l2": elements * c.l2_bytes / (m.l2_bw * f),
        "issue": elements * c.instructions / (m.issue_per_s * f * m.issue_efficiency),
        "mufu": elements * c.mufu / (m.mufu_per_s * f),
        "mma": elements * c.mma_cycles / (m.sms * m.clock_hz * f),
    }
    bound = max(times, key=times.get)
    # DRAM -> L2 -> SM is one pipeline (a byte read from DRAM streams on through L2): those two overlap fully;
    # the memory side, the issue slots and the MUFU overlap as the warps hide latency (the p-norm)
    memory = max(times["dram"], times["l2"])
    t = combine([memory, times["issue"], times["mufu"], times["mma"]], m.overlap_p) + launches * m.launch_s
    achieved = elements * c.min_bytes / t if t > 0 else 0.0
    return {
        "time_s": t,
        "bound": bound,
        "times_s": times,
        "bandwidth_Bps": achieved,
        "latency_limited_bw_Bps": bw,
        "predicted_fraction": achieved / m.dram_copy,
    }


# ---- tiled MMA kernels -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class TileIteration:
    """One CTA's pass through a loop iteration, from the SASS (per warp) and the launch."""

    warps: int
    instructions: float  # per warp
    mufu: float  # per warp
    mma_flops: float  # per CTA
    wgmma: bool  # tensor cores through wgmma (else mma.sync)
    overlap_instr: float  # per warp: instructions issued while a wgmma is in flight
    l2_bytes: float  # per CTA (tile loads)
    mma_sync_flops: float = 0.0  # per CTA: the part of mma_flops on mma.sync in a loop that also has wgmma
    shared_bytes: float = 0.0  # per CTA: bytes through shared memory (wgmma operands, fills, LDS/STS)
    wgmma_ops: tuple = ()  # per CTA: (FLOPs, shared-memory operand bytes, count) of each wgmma shape
    mma_fp8_flops: float = 0.0  # per CTA: the part of mma_flops on FP8 wgmma (at the dense FP8 rate)
    fp8_ops: tuple = ()  # per CTA: wgmma_ops of the FP8 wgmmas

    def cycles(self, m: Machine) -> dict:
        rate, fp8_rate = m.mma_rate, m.mma_fp8_rate  # tensor-core FLOP per SM-clock
        sync = self.mma_sync_flops if self.wgmma else self.mma_flops
        fp8 = self.mma_fp8_flops if self.wgmma else 0.0
        mma = m.mma_clocks(self.mma_flops, sync, fp8)
        issue = self.instructions * self.warps / 4
        mufu = self.mufu * 32 * self.warps / m.mufu_lanes
        l2 = self.l2_bytes / (m.l2_bw / m.sms / m.clock_hz)
        smem = self.shared_bytes / m.smem_bytes_per_clk
        # On the CTA's own path a wgmma takes the slower of its tensor-core time and the reads of its
        # shared-memory operands (a 64x32x16 wgmma with A in shared memory reads 3 KiB for 20 clocks of MMA).
        fed = mma + sum(n * max(0.0, b / m.smem_bytes_per_clk - f / rate) for f, b, n in self.wgmma_ops)
        fed += sum(n * max(0.0, b / m.smem_bytes_per_clk - f / fp8_rate) for f, b, n in self.fp8_ops)
        soft = max(issue, mufu)
        overlap = min(fed, self.overlap_instr * self.warps / 4)
        return {"mma": mma, "issue": issue, "mufu": mufu, "l2": l2, "smem": smem, "critical": fed + soft - overlap}


def per_iteration_cycles(it: TileIteration, ctas_per_sm: int, m: Machine = H200) -> tuple[float, str]:
    """SM cycles one CTA-iteration costs when ``ctas_per_sm`` CTAs share the SM, and what bounds it.

    The SM's units (tensor cores, issue slots at ``issue_efficiency``, MUFU, L2, shared memory) overlap as the
    streaming model's terms do (the p-norm at ``overlap_p``, fitted on a peer's published timings), not
    perfectly: four units each near saturation cost more than the busiest alone. The CTAs' critical path (MMA,
    then the softmax it waits for) bounds it from below."""
    c = it.cycles(m)
    units = {
        "mma": c["mma"],
        "issue": c["issue"] / m.issue_efficiency,
        "mufu": c["mufu"],
        "l2": c["l2"],
        "smem": c["smem"],
    }
    terms = {**units, "latency": c["critical"] / max(1, ctas_per_sm)}
    bound = max(terms, key=terms.get)
    return max(combine(list(units.values()), m.overlap_p), terms["latency"]), bound


def schedule(durations: list[float], slots: int) -> float:
    """Makespan of jobs taken in launch order by the first free of ``slots`` workers (the block scheduler)."""
    free = [0.0] * min(slots, max(1, len(durations)))
    heapq.heapify(free)
    end = 0.0
    for d in durations:
        t = heapq.heappop(free) + d
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def predict_tiles(
    ctas: list[dict], iterations: dict, ctas_per_sm: int, overhead_cycles: float, m: Machine = H200
) -> dict:
    """Time of a grid whose CTA ``i`` runs ``ctas[i][role]`` iterations of each loop role (``iterations[role]``
    a TileIteration), in launch order; ``overhead_cycles`` per CTA (prologue, epilogue)."""
    per = {role: per_iteration_cycles(it, ctas_per_sm, m) for role, it in iterations.items()}
    # A CTA occupies one of ctas_per_sm slots of an SM; in its slot it advances at 1/ctas_per_sm of the SM's rate.
    durations = [(overhead_cycles + sum(n * per[r][0] for r, n in cta.items())) * ctas_per_sm for cta in ctas]
    cycles = schedule(durations, m.sms * max(1, ctas_per_sm))
    busy = sum(durations) / (m.sms * max(1, ctas_per_sm))
    bounds = {r: b for r, (_, b) in per.items()}
    return {
        "time_s": cycles / m.clock_hz + m.launch_s,
        "tail_efficiency": busy / cycles if cycles else 1.0,
        "bounds": bounds,
        "cycles_per_iteration": {r: c for r, (c, _) in per.items()},
    }
