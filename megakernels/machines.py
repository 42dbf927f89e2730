"""The GPUs megakernels knows, written once, each figure with its source.

Everything that reasons about a GPU it is not running on reads this table: the kernels' launch code (an SM count
for a grid planned on the meta device), the trainer's MFU (the dense peak a step is divided by), the planner (peaks,
memory, bandwidths) and the tools beside the package (the static cost model builds its machines from these rows).
Standard library only, imports nothing of the package: a leaf.

Rates are per second for the whole GPU (``bf16_dense`` in FLOP/s, ``hbm`` in bytes/s); "dense" is the data-sheet
figure without structured sparsity (the sparse figure / 2). ``ARCHS`` holds what an architecture fixes for every
part built on it (registers, warps, shared memory per SM and per block).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Arch:
    """What one compute capability fixes: per-SM registers, resident warps and blocks, shared memory per SM and the
    opt-in shared memory per block (bytes), the shared memory the runtime reserves per block, and dense 16-bit
    tensor-core FLOPs per SM per clock."""

    arch: int
    regs: int
    max_warps: int
    max_blocks: int
    smem_per_sm: int
    smem_per_block: int
    smem_reserved: int
    mma_per_clk: float
    source: str


ARCHS: dict[int, Arch] = {
    90: Arch(
        90,
        regs=65536,
        max_warps=64,
        max_blocks=32,
        smem_per_sm=233472,  # 228 KiB
        smem_per_block=232448,  # 227 KiB opt-in
        smem_reserved=1024,
        mma_per_clk=4096.0,  # wgmma
        source="CUDA C Programming Guide, compute capability 9.0 table; NVIDIA H100 architecture whitepaper",
    ),
    80: Arch(
        80,
        regs=65536,
        max_warps=64,
        max_blocks=32,
        smem_per_sm=167936,  # 164 KiB
        smem_per_block=166912,  # 163 KiB opt-in
        smem_reserved=1024,
        mma_per_clk=2048.0,  # mma.sync
        source="CUDA C Programming Guide, compute capability 8.0 table; NVIDIA A100 architecture whitepaper",
    ),
}


@dataclasses.dataclass(frozen=True)
class GPU:
    """One GPU part. ``clock_hz`` is the clock its dense tensor-core rating assumes (``bf16_dense`` / (SMs x the
    architecture's FLOPs per SM per clock)); ``mma_sustained`` the fraction of that rating the best large bf16 GEMM
    sustains as measured; ``copy`` a device-to-device copy's bytes/s (read + written); ``torch_names`` substrings of
    ``torch.cuda.get_device_name`` that name the part exactly (the first match in ``GPUS`` order wins); ``family``
    the die's name, shared by parts with the same tensor-core peaks (``gpu_named(exact=False)``); ``sources``:
    (fields, where they come from) pairs."""

    key: str
    name: str
    arch: int
    sms: int
    clock_hz: float
    boost_clock_hz: float
    bf16_dense: float
    fp8_dense: float
    tf32_dense: float
    fp32: float
    mma_sustained: float
    hbm: float
    copy: float
    l2_bw: float
    l2_bytes: int
    l1_bytes: int
    memory_bytes: int
    torch_names: tuple[str, ...] = ()
    family: str = ""
    sources: tuple[tuple[str, str], ...] = ()

    @property
    def limits(self) -> Arch:
        """The architecture's per-SM limits."""
        return ARCHS[self.arch]

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s in a training precision: ``"bf16"``/``"fp16"`` the 16-bit tensor-core rate, ``"fp8"``
        the FP8 one (the 16-bit one on a part without FP8 tensor cores), ``"fp32"`` the CUDA cores' (no TF32).

        Raises:
            ValueError: an unknown precision.
        """
        if precision in ("bf16", "fp16"):
            return self.bf16_dense
        if precision == "fp8":
            return self.fp8_dense or self.bf16_dense
        if precision == "fp32":
            return self.fp32
        raise ValueError(f"peak_flops: precision must be fp32, bf16, fp16 or fp8, got {precision!r}")


# A device-to-device copy over the HBM peak, measured on the H200 (4.3 of 4.8 TB/s); assumed for the parts whose copy
# rate has not been measured.
COPY_FRACTION = 4.3 / 4.8

_HOPPER = (
    (
        "sms, l2_bytes, l1_bytes",
        "NVIDIA H100 Tensor Core GPU Architecture whitepaper (256 KB of combined L1 and shared memory per SM)",
    ),
    (
        "bf16_dense, fp8_dense, tf32_dense, fp32, hbm, memory_bytes, boost_clock_hz",
        "NVIDIA H100 / H200 datasheets (dense = the sparse figure / 2; FP32: SXM and H200 67, NVL 60, PCIe 51 TFLOP/s)",
    ),
    ("clock_hz", "bf16_dense / (sms x 4096 FLOP/clk/SM): the clock the dense rating assumes"),
    ("copy", "H200: a measured device-to-device copy; the other parts hbm x COPY_FRACTION (assumption)"),
    (
        "mma_sustained",
        "the maximum achievable matmul FLOPS (MAMF) table of github.com/stas00/ml-engineering, "
        "compute/accelerator/README.md: H100 SXM 792.1 of 989 TFLOP/s bf16 (80.1 %), GH200 83.0 %; 0.80 for every "
        "sm_90 part (the NVL and PCIe parts' power limits are in their clocks)",
    ),
)
# ``l2_bw``: the sustained read bandwidth of L2-resident data from all SMs, from D. Ernst's gpu-benches
# ``gpu-l2-cache`` (github.com/te42kyfo/gpu-benches, gpu-l2-cache/<gpu>.txt): the median over its 8-32 MB data sets.
_L2 = "D. Ernst, gpu-benches gpu-l2-cache (github.com/te42kyfo/gpu-benches), "

H200 = GPU(
    "H200",
    "H200 SXM (sm_90)",
    90,
    sms=132,
    clock_hz=1.83e9,
    boost_clock_hz=1.98e9,
    bf16_dense=989e12,
    fp8_dense=1979e12,
    tf32_dense=494.7e12,
    fp32=67e12,
    mma_sustained=0.80,
    hbm=4.8e12,
    copy=4.3e12,
    l2_bw=9.8e12,
    l2_bytes=50 << 20,
    l1_bytes=256 << 10,
    memory_bytes=141 * 10**9,
    torch_names=("H200",),
    family="H200",
    sources=(*_HOPPER, ("l2_bw", _L2 + "gpu-l2-cache/h200.txt: 9.68-10.25 TB/s over 8-32 MB, median 9.84")),
)

GPUS: dict[str, GPU] = {
    "H200": H200,
    "H100-SXM": dataclasses.replace(
        H200,
        key="H100-SXM",
        name="H100 SXM5 80GB (sm_90)",
        hbm=3.35e12,
        copy=3.35e12 * COPY_FRACTION,
        memory_bytes=80 * 10**9,
        torch_names=("H100 80GB HBM3", "H100 SXM"),
        family="H100",
        sources=(
            *_HOPPER,
            (
                "l2_bw",
                "no H100 SXM measurement: the H200's (" + _L2 + "h200.txt), the same die with the same SMs, L2 "
                "and clocks (only the HBM differs)",
            ),
        ),
    ),
    "H100-NVL": dataclasses.replace(
        H200,
        key="H100-NVL",
        name="H100 NVL 94GB (sm_90)",
        clock_hz=835e12 / (132 * 4096),  # power-limited: 835 of the SXM's 989 TFLOP/s at the same SM count
        boost_clock_hz=1.785e9,
        bf16_dense=835e12,
        fp8_dense=1670e12,
        tf32_dense=417.5e12,
        fp32=60e12,
        hbm=3.9e12,
        copy=3.9e12 * COPY_FRACTION,
        l2_bw=8.0e12,
        memory_bytes=94 * 10**9,
        torch_names=("H100 NVL",),
        family="H100 NVL",
        sources=(
            *_HOPPER,
            (
                "l2_bw",
                "no H100 NVL measurement: the H100 PCIe's measured 6.95 TB/s per SM x 132 SMs, the same die under a "
                "similar power limit and boost clock (assumption)",
            ),
        ),
    ),
    "H100-PCIe": dataclasses.replace(
        H200,
        key="H100-PCIe",
        name="H100 PCIe 80GB (sm_90)",
        sms=114,
        clock_hz=756e12 / (114 * 4096),  # 1.62 GHz: the 350 W limit
        boost_clock_hz=1.755e9,
        bf16_dense=756e12,
        fp8_dense=1513e12,
        tf32_dense=378e12,
        fp32=51e12,
        hbm=2.0e12,
        copy=2.0e12 * COPY_FRACTION,
        l2_bw=6.95e12,
        memory_bytes=80 * 10**9,
        torch_names=("H100 PCIe",),
        family="H100 PCIe",
        sources=(*_HOPPER, ("l2_bw", _L2 + "gpu-l2-cache/h100_pcie.txt: 6.87-7.03 TB/s over 8-32 MB, median 6.95")),
    ),
    "A100-SXM4-80GB": GPU(
        "A100-SXM4-80GB",
        "A100 SXM4 80GB (sm_80)",
        80,
        sms=108,
        clock_hz=1.41e9,  # 312e12 / (108 x 2048 FLOP/clk/SM): the boost clock
        boost_clock_hz=1.41e9,
        bf16_dense=312e12,
        fp8_dense=0.0,
        tf32_dense=156e12,
        fp32=19.5e12,
        mma_sustained=0.859,
        hbm=2.039e12,
        copy=2.039e12 * COPY_FRACTION,
        l2_bw=5.4e12,
        l2_bytes=40 << 20,
        l1_bytes=192 << 10,
        memory_bytes=80 * 10**9,
        torch_names=("A100-SXM4-80GB",),
        family="A100",
        sources=(
            (
                "sms, l2_bytes, l1_bytes",
                "NVIDIA A100 Tensor Core GPU Architecture whitepaper (192 KB of combined L1 and shared memory per SM)",
            ),
            (
                "bf16_dense, fp8_dense, tf32_dense, fp32, hbm, memory_bytes, clock_hz, boost_clock_hz",
                "NVIDIA A100 datasheet (80GB SXM: 312 TFLOP/s bf16 dense, 19.5 FP32, 2039 GB/s, 1410 MHz; no FP8)",
            ),
            ("copy", "hbm x COPY_FRACTION (assumption)"),
            ("l2_bw", _L2 + "gpu-l2-cache/a100_80.txt: 5.17-5.45 TB/s over 8-28 MB, median 5.40"),
            (
                "mma_sustained",
                "the MAMF table of github.com/stas00/ml-engineering, compute/accelerator/README.md: A100 SXM 267.9 of "
                "312 TFLOP/s bf16 (85.9 %)",
            ),
        ),
    ),
    "V100-SXM2-32GB": GPU(
        "V100-SXM2-32GB",
        "V100 SXM2 32GB (sm_70)",
        70,
        sms=80,
        clock_hz=1.53e9,
        boost_clock_hz=1.53e9,
        bf16_dense=125e12,  # fp16 tensor cores (no bf16 on Volta)
        fp8_dense=0.0,
        tf32_dense=0.0,
        fp32=15.7e12,
        mma_sustained=0.0,  # not measured
        hbm=0.9e12,
        copy=0.9e12 * COPY_FRACTION,
        l2_bw=0.0,  # not measured
        l2_bytes=6 << 20,
        l1_bytes=128 << 10,
        memory_bytes=32 * 10**9,
        torch_names=("V100-SXM2-32GB",),
        family="V100",
        sources=(
            (
                "bf16_dense, fp32, hbm, memory_bytes, sms, clock_hz, boost_clock_hz",
                "NVIDIA V100 SXM2 datasheet (125 TFLOP/s fp16 tensor, 15.7 FP32, 900 GB/s, 1530 MHz boost)",
            ),
            ("l2_bytes, l1_bytes", "NVIDIA Tesla V100 architecture whitepaper (6 MB L2, 128 KB L1/shared per SM)"),
            ("fp8_dense, tf32_dense", "none on Volta"),
            ("mma_sustained, l2_bw", "not measured (0)"),
            ("copy", "hbm x COPY_FRACTION (assumption)"),
        ),
    ),
}


def gpu_named(torch_name: str, exact: bool = True) -> GPU | None:
    """The part a device name as torch prints it (``NVIDIA H100 80GB HBM3``) names, or None when none is known.
    ``exact=False`` also accepts another part of a known die (an A100 40GB: the A100 80GB's row), for what depends on
    the die alone (the tensor-core peaks)."""
    for gpu in GPUS.values():
        if any(part in torch_name for part in gpu.torch_names):
            return gpu
    if not exact:  # the longest family name that matches: "H100 NVL" before "H100"
        for gpu in sorted(GPUS.values(), key=lambda g: -len(g.family)):
            if gpu.family and gpu.family in torch_name:
                return gpu
    return None
