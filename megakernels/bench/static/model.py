"""The static cost model: from what a kernel compiles to (``sass``) and how it is launched, a predicted time and
fraction of the H200's ceiling. Written down, with its assumptions, in docs/static-cost-model.md; the constants
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

from megakernels import _targets


@dataclasses.dataclass(frozen=True)
class Machine:
    """One GPU as the model sees it (defaults: the H200 SXM, sm_90). Rates are per SM per clock unless named
    otherwise. ``MACHINES`` holds every GPU the model knows, each value with its source (``sources``)."""

    name: str = "H200 SXM (sm_90)"
    arch: int = 90
    sms: int = 132
    clock_hz: float = 1.83e9  # the clock at which the 989 TFLOP/s dense bf16 rating holds (boost: 1.98)
    boost_clock_hz: float = 1.98e9
    issue_lanes: int = 128  # 4 schedulers x 1 warp-instruction x 32 lanes
    mufu_lanes: int = 16  # ex2 / rcp / rsqrt / lg2 results per SM per clock
    mma_dense_bf16: float = 989e12  # FLOP/s, wgmma dense bf16 peak (the attention ceiling); fp16 is the same
    mma_dense_fp8: float = 1979e12  # FLOP/s dense (0: no fp8 tensor cores)
    mma_dense_tf32: float = 494.7e12  # FLOP/s dense
    fp32_simt: float = 67e12  # FLOP/s, FP32 on the CUDA cores (an fp32 GEMM without TF32: ``cublas``)
    mma_sustained: float = 0.80  # fraction of that peak the best large bf16 GEMM sustains (MAMF, ``sources``)
    mma_sync_rate: float = 0.625  # mma.sync's rate relative to wgmma on Hopper
    dram_peak: float = 4.8e12  # B/s, HBM3e
    dram_copy: float = 4.3e12  # B/s, a measured device-to-device copy (the streaming ceiling)
    l2_bw: float = 9.8e12  # B/s, L2 -> SM: all SMs reading L2-resident data, measured on an H200 (``L2_SRC``)
    l2_bytes: int = 50 << 20  # L2 capacity
    l1_bytes: int = 256 << 10  # L1 data cache and shared memory together, per SM (spilled registers cache here)
    smem_bytes_per_clk: float = 128.0  # shared memory per SM (32 banks x 4 B): wgmma operand reads, TMA and
    # cp.async fills, LDS/STS share it (assumption; calibrate)
    dram_latency_s: float = 0.8e-6  # loaded DRAM latency: bytes in flight per SM must cover it
    launch_s: float = 8e-6  # per kernel launch as CUDA events time it: launch, ramp-up, drain (calibrated)
    issue_efficiency: float = 0.9  # fraction of the issue slots a streaming kernel's warps fill (calibrated)
    overlap_p: float = 4.0  # memory, issue and MUFU combine as (sum t_i^p)^(1/p); inf = perfect overlap (calibrated)
    max_warps: int = 64
    max_blocks: int = 32
    regs: int = 65536
    smem: int = _targets.SHARED_PER_SM[90]  # 228 KiB per SM
    smem_per_block: int = _targets.SHARED_LIMIT[90]  # 227 KiB opt-in per block
    smem_reserved: int = 1024  # per block, on sm_90
    sources: tuple = ()  # (field, source) pairs: where each number comes from

    @property
    def mma_per_clk(self) -> float:
        """Dense bf16 tensor-core FLOPs per SM per clock: 4096 on sm_90 (wgmma), 2048 on sm_80 (mma.sync); the
        rated peak is this x SMs x ``clock_hz``."""
        return 4096.0 if self.arch >= 90 else 2048.0

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


# Device-to-device copy over the HBM peak, measured on the H200 (4.3 of 4.8 TB/s); assumed for the GPUs whose copy
# rate nobody here has measured.
COPY_FRACTION = 4.3 / 4.8

_HOPPER_SRC = (
    (
        "sms, l2_bytes, l1_bytes, smem, regs, max_warps, max_blocks",
        "NVIDIA H100 Tensor Core GPU Architecture whitepaper (256 KB of combined L1 and shared memory per SM); "
        "CUDA C Programming Guide, compute capability 9.0 table",
    ),
    (
        "mma_dense_*, fp32_simt, dram_peak, boost_clock_hz",
        "NVIDIA H100 / H200 datasheets (dense = the sparse figure / 2; FP32: SXM and H200 67, NVL 60, PCIe 51 TFLOP/s)",
    ),
    ("clock_hz", "mma_dense_bf16 / (sms x 4096 FLOP/clk/SM): the clock the dense rating assumes"),
    ("dram_copy", "H200: a measured copy; others dram_peak x COPY_FRACTION (assumption)"),
    ("dram_latency_s, launch_s", "assumptions, calibrated against Liger-Kernel's published timings"),
    (
        "mma_sustained",
        "the maximum achievable matmul FLOPS (MAMF) table of github.com/stas00/ml-engineering, "
        "compute/accelerator/README.md: H100 SXM 792.1 of 989 TFLOP/s bf16 (80.1 %, CUDA 12.1), GH200 83.0 %; "
        "0.80 for every sm_90 part (the NVL and PCIe parts' power limits are in their clocks)",
    ),
)

# Where each machine's ``l2_bw`` comes from: the sustained read bandwidth of data resident in L2 from all SMs, what
# the model prices L2 bytes at. Dominik Ernst's gpu-benches ``gpu-l2-cache`` (github.com/te42kyfo/gpu-benches,
# files gpu-l2-cache/<gpu>.txt) measures exactly that: a CUDA kernel whose blocks, on every SM, read doubles of an
# L2-resident buffer (the L1 not targeted), the buffer scanned from 1 MB to past the L2's size; each value below is
# the median of its 8-32 MB data sets (past the small sets' L1 sharing, inside the L2). Chips and Cheese's OpenCL
# test reports less on the same H100 PCIe (over 5.5 TB/s from the near L2 partition, 3.8 TB/s over the whole
# 50 MB; A100 4.5 TB/s) with the card's clock falling to 1395 MHz under its 350 W limit: not used
# (docs/static-cost-model.md, section 5).
_GPU_BENCHES = "D. Ernst, gpu-benches gpu-l2-cache (github.com/te42kyfo/gpu-benches), "
L2_SRC = {
    "H200": _GPU_BENCHES + "gpu-l2-cache/h200.txt (commit 3088b33, 2024-04-03): 9.68-10.25 TB/s over 8-32 MB of "
    "L2-resident data read by every SM, median 9.84; 9.8e12",
    "H100-SXM": "no H100 SXM measurement found: the H200's (" + _GPU_BENCHES + "h200.txt, median 9.84 TB/s), the "
    "same GH100 die with the same 132 SMs, 50 MB of L2 and 1.98 GHz boost at 700 W (only the HBM differs); 9.8e12",
    "H100-PCIe": _GPU_BENCHES + "gpu-l2-cache/h100_pcie.txt (commit f54baaa, 2023-11-02): 6.87-7.03 TB/s over "
    "8-32 MB, median 6.95; 6.95e12",
    "H100-NVL": "no H100 NVL measurement found: the H100 PCIe's measured 6.95 TB/s ("
    + _GPU_BENCHES
    + "h100_pcie.txt) per SM (61 GB/s) x 132 SMs; the NVL is the same die under a similar power limit (350-400 "
    "against 350 W) and boost clock (1.785 against 1.755 GHz), so no clock scaling; 8.0e12 (assumption)",
    "A100-SXM4-80GB": _GPU_BENCHES + "gpu-l2-cache/a100_80.txt (commit 3088b33, 2024-04-03; an A100 80GB, the form "
    "factor not stated): 5.17-5.45 TB/s over 8-28 MB (it falls past 28 MB), median 5.40; 5.4e12",
}

H200 = Machine(sources=(*_HOPPER_SRC, ("l2_bw", L2_SRC["H200"])))

MACHINES: dict[str, Machine] = {
    "H200": H200,
    "H100-SXM": dataclasses.replace(
        H200,
        name="H100 SXM5 80GB (sm_90)",
        dram_peak=3.35e12,
        dram_copy=3.35e12 * COPY_FRACTION,
        l2_bw=9.8e12,  # the H200's measurement: the same die, SMs, L2 and clocks (``L2_SRC``)
        sources=(*_HOPPER_SRC, ("l2_bw", L2_SRC["H100-SXM"])),
    ),
    "H100-NVL": dataclasses.replace(
        H200,
        name="H100 NVL 94GB (sm_90)",
        clock_hz=835e12 / (132 * 4096),  # power-limited: 835 of the SXM's 989 TFLOP/s at the same SM count
        boost_clock_hz=1.785e9,
        mma_dense_bf16=835e12,
        mma_dense_fp8=1670e12,
        mma_dense_tf32=417.5e12,
        fp32_simt=60e12,
        dram_peak=3.9e12,
        dram_copy=3.9e12 * COPY_FRACTION,
        l2_bw=8.0e12,  # the H100 PCIe's measured 6.95 TB/s per SM x 132 SMs (assumption, ``L2_SRC``)
        sources=(*_HOPPER_SRC, ("l2_bw", L2_SRC["H100-NVL"])),
    ),
    "H100-PCIe": dataclasses.replace(
        H200,
        name="H100 PCIe 80GB (sm_90)",
        sms=114,
        clock_hz=756e12 / (114 * 4096),  # 1.62 GHz: the 350 W limit (boost 1.755)
        boost_clock_hz=1.755e9,
        mma_dense_bf16=756e12,
        mma_dense_fp8=1513e12,
        mma_dense_tf32=378e12,
        fp32_simt=51e12,
        dram_peak=2.0e12,
        dram_copy=2.0e12 * COPY_FRACTION,
        l2_bw=6.95e12,  # measured on an H100 PCIe (gpu-benches gpu-l2-cache, ``L2_SRC``)
        sources=(*_HOPPER_SRC, ("l2_bw", L2_SRC["H100-PCIe"])),
    ),
    "A100-SXM4-80GB": Machine(
        name="A100 SXM4 80GB (sm_80)",
        arch=80,
        sms=108,
        clock_hz=1.41e9,  # boost; 312e12 / (108 x 2048 FLOP/clk/SM)
        boost_clock_hz=1.41e9,
        mma_dense_bf16=312e12,
        mma_dense_fp8=0.0,
        mma_dense_tf32=156e12,
        fp32_simt=19.5e12,
        mma_sync_rate=1.0,  # mma.sync is Ampere's tensor-core instruction
        mma_sustained=0.859,  # MAMF: 267.9 of 312 TFLOP/s (``sources``)
        dram_peak=2.039e12,
        dram_copy=2.039e12 * COPY_FRACTION,
        l2_bw=5.4e12,  # measured on an A100 80GB (gpu-benches gpu-l2-cache, ``L2_SRC``)
        l2_bytes=40 << 20,
        l1_bytes=192 << 10,
        smem=_targets.SHARED_PER_SM[80],
        smem_per_block=_targets.SHARED_LIMIT[80],
        sources=(
            (
                "sms, l2_bytes, l1_bytes, smem, regs, max_warps, max_blocks",
                "NVIDIA A100 Tensor Core GPU Architecture "
                "whitepaper (192 KB of combined L1 and shared memory per SM); CUDA C Programming Guide, compute "
                "capability 8.0 table",
            ),
            (
                "mma_dense_*, dram_peak, clock_hz",
                "NVIDIA A100 datasheet (80GB SXM: 312 TFLOP/s bf16 dense, 19.5 FP32, 2039 GB/s, 1410 MHz boost)",
            ),
            ("dram_copy", "dram_peak x COPY_FRACTION (assumption)"),
            ("l2_bw", L2_SRC["A100-SXM4-80GB"]),
            ("dram_latency_s, launch_s", "assumptions, calibrated against Liger-Kernel's published timings"),
            (
                "mma_sustained",
                "the MAMF table of github.com/stas00/ml-engineering, compute/accelerator/README.md: A100 SXM "
                "267.9 of 312 TFLOP/s bf16 (85.9 %, CUDA 12.1)",
            ),
        ),
    ),
}

# ``gpu_name`` as torch.cuda.get_device_name() prints it (a substring, first match wins) -> MACHINES key.
GPU_NAMES = (
    ("H200", "H200"),
    ("H100 NVL", "H100-NVL"),
    ("H100 PCIe", "H100-PCIe"),
    ("H100 80GB HBM3", "H100-SXM"),
    ("H100 SXM", "H100-SXM"),
    ("A100-SXM4-80GB", "A100-SXM4-80GB"),
)


def machine_for(gpu_name: str) -> Machine | None:
    """The machine of a GPU named as torch names it (``NVIDIA H100 80GB HBM3``), or None when the model has none."""
    for part, key in GPU_NAMES:
        if part in gpu_name:
            return MACHINES[key]
    return None


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
