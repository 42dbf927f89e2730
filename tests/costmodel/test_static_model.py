"""The static cost model's pieces on inputs whose answers are known: SASS control flow (loops, cold slow paths,
waits on wgmma), access widths, occupancy, the block scheduler, and the streaming roofline."""

from __future__ import annotations

import dataclasses
import math

import pytest

from costmodel import model, sass

NESTED = """
	Function : k
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;
        /*0020*/               @P0 EXIT ;
        /*0030*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0040*/                   LDG.E.128 R8, desc[UR4][R6.64] ;
        /*0050*/                   MUFU.EX2 R9, R8 ;
        /*0060*/              @!P1 BRA 0x90 ;
        /*0070*/                   CALL.REL.NOINC 0x200 ;
        /*0080*/                   MOV R9, R2 ;
        /*0090*/                   FADD R10, R10, R9 ;
        /*00a0*/                   STG.E.128 desc[UR4][R6.64], R8 ;
        /*00b0*/               @P2 BRA 0x40 ;
        /*00c0*/                   SHFL.BFLY PT, R3, R10, 0x10, 0x1f ;
        /*00d0*/               @P3 BRA 0x30 ;
        /*00e0*/                   EXIT ;
        /*00f0*/                   BRA 0xf0 ;
        /*0200*/                   FFMA R2, R2, R2, R2 ;
        /*0210*/                   RET.REL.NODEC R4 0x0 ;
"""

WGMMA = """
	Function : attn
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   WARPGROUP.ARRIVE ;
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;
        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0050*/                   FMUL R2, R24, R3 ;
        /*0060*/                   MUFU.EX2 R2, R2 ;
        /*0070*/                   WARPGROUP.ARRIVE ;
        /*0080*/                   HGMMA.64x128x16.F32.BF16 R88, R24, gdesc[UR12], R88, gsb0 ;
        /*0090*/                   FADD R4, R4, R2 ;
        /*00a0*/                   FADD R5, R5, R2 ;
        /*00b0*/               @P0 BRA 0x10 ;
        /*00c0*/                   EXIT ;
"""


def _fn(text: str) -> sass.Function:
    return next(iter(sass.parse_sass(text).values()))


def test_nested_loops_are_found_with_their_own_instructions():
    fn = _fn(NESTED)
    inner = fn.innermost_loops()
    assert len(fn.loops) == 2 and len(inner) == 1
    outer = fn.enclosing(inner[0])
    assert outer is not None and inner[0].addr == 0x40 and outer.addr == 0x30
    assert outer.counts.instructions == 3 and outer.counts.shuffles == 1  # LDG, SHFL, BRA: the inner loop excluded


def test_a_block_calling_a_slow_path_is_cold_and_not_counted():
    inner = _fn(NESTED).innermost_loops()[0]
    # LDG, MUFU, BRA | FADD, STG, BRA: the MOV / CALL / MOV slow path is left out
    assert inner.counts.instructions == 6
    assert inner.counts.mufu == 1 and inner.counts.branches == 1


# ptxas leaves a loop through a CALL.REL.NOINC to the code after it (which never returns), and an ignored row
# leaves the kernel early: the two paths are alternatives
EARLY_EXIT = """
	Function : ce
        /*0000*/                   ISETP.NE.AND P0, PT, R0, 0x10, PT ;
        /*0010*/               @P0 BRA 0x60 ;
        /*0020*/                   STG.E.128 desc[UR4][R2.64], RZ ;
        /*0030*/                   STG.E.128 desc[UR4][R6.64], RZ ;
        /*0040*/                   STG.E.128 desc[UR4][R8.64], RZ ;
        /*0050*/                   EXIT ;
        /*0060*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0070*/                   FADD R10, R10, R4 ;
        /*0080*/               @P1 CALL.REL.NOINC 0xa0 ;
        /*0090*/                   BRA 0x60 ;
        /*00a0*/                   STG.E desc[UR4][R6.64], R10 ;
        /*00b0*/                   EXIT ;
        /*00c0*/                   BRA 0xc0 ;
"""


def test_a_call_to_code_that_never_returns_is_a_loop_exit():
    fn = _fn(EARLY_EXIT)
    assert len(fn.loops) == 1
    lp = fn.loops[0]
    assert lp.addr == 0x60 and not any(fn.blocks[b].cold for b in lp.blocks)
    assert lp.counts.global_loads == {16: 1} and lp.counts.instructions == 4  # LDG, FADD, CALL, BRA


def test_path_counts_take_one_branch_of_an_early_exit():
    fn = _fn(EARLY_EXIT)
    # 10 trips: the loop path moves 10 x 16 + 4 bytes; the early exit 48: the loop path is the costlier one
    c, runs = fn.path_counts([10])
    assert c.load_bytes() == 160 and c.store_bytes() == 4
    assert runs[id(fn.loops[0])] == 10
    # 2 trips: 36 bytes on the loop path, 48 on the early exit, which alone is counted (not both)
    c, _ = fn.path_counts([2])
    assert c.store_bytes() == 48 and c.load_bytes() == 0
    # a subroutine reached only by a call counts nothing
    nested = _fn(NESTED)
    c, _ = nested.path_counts([1, 1])
    assert c.instructions == nested.totals.instructions - 5  # not the cold CALL/MOV, FFMA/RET or the BRA pad


def test_global_accesses_are_counted_by_width():
    c = _fn(NESTED).innermost_loops()[0].counts
    assert c.global_loads == {16: 1} and c.global_stores == {16: 1}
    assert c.load_bytes() == 16 and c.vector_loads() == 1
    assert [sass.access_width(op) for op in ("LDG.E.128", "LDG.E.64", "STG.E.U16", "LDG.E")] == [16, 8, 2, 4]


def test_wgmma_flops_and_the_instructions_overlapping_each_wgmma():
    fn = _fn(WGMMA)
    (loop,) = fn.innermost_loops()
    assert loop.counts.wgmma == 3
    assert loop.counts.mma_flops == (2 * 2 * 64 * 64 * 16 + 2 * 64 * 128 * 16) / 4
    # QK^T is waited on at once; P V overlaps the two FADDs and the branch before the next iteration's wait
    assert sorted(fn.waits_after_mma(loop)) == [0, 3]


def test_mma_sync_in_a_wgmma_loop_is_priced_at_the_mma_sync_rate():
    fn = _fn(
        WGMMA.replace(
            "HGMMA.64x128x16.F32.BF16 R88, R24, gdesc[UR12], R88, gsb0", "HMMA.16816.F32.BF16 R88, R24, R40, R88"
        )
    )
    (loop,) = fn.innermost_loops()
    assert loop.counts.mma_sync_flops == 2 * 16 * 8 * 16
    m = model.H200
    rate = 4096 * m.mma_sustained
    it = model.TileIteration(
        warps=4, instructions=0, mufu=0, mma_flops=3e6, wgmma=True, overlap_instr=0, l2_bytes=0, mma_sync_flops=1e6
    )
    assert it.cycles(m)["mma"] == pytest.approx(2e6 / rate + 1e6 / (rate * m.mma_sync_rate))
    only_sync = model.TileIteration(
        warps=4, instructions=0, mufu=0, mma_flops=3e6, wgmma=False, overlap_instr=0, l2_bytes=0
    )
    assert only_sync.cycles(m)["mma"] == pytest.approx(3e6 / (rate * m.mma_sync_rate))
    # Ampere: mma.sync is its tensor-core instruction, at 2048 dense bf16 FLOP per SM-clock (312 TFLOP/s on 108
    # SMs at 1.41 GHz), at the A100's own measured sustained fraction
    a100 = model.MACHINES["A100-SXM4-80GB"]
    assert a100.mma_sustained == pytest.approx(267.9 / 312, abs=1e-3)
    assert only_sync.cycles(a100)["mma"] == pytest.approx(3e6 / (2048 * a100.mma_sustained))


def test_fp8_wgmma_counts_as_wgmma_at_the_fp8_rate():
    fn = _fn(
        WGMMA.replace(
            "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0",
            "QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24, gsb0",
        )
    )
    (loop,) = fn.innermost_loops()
    assert loop.counts.wgmma == 3 and loop.counts.mma == 3
    qflops = 2 * 64 * 64 * 32
    assert loop.counts.mma_fp8_flops == qflops / 4
    assert loop.counts.fp8_shapes == {(qflops, (64 * 32 + 32 * 64) * 1): 1}  # SS form, one byte an element
    assert sorted(fn.waits_after_mma(loop)) == [0, 3]  # the QGMMA commits the group as an HGMMA would
    m = model.H200
    rate = 4096 * m.mma_sustained
    it = model.TileIteration(
        warps=4, instructions=0, mufu=0, mma_flops=3e6, wgmma=True, overlap_instr=0, l2_bytes=0, mma_fp8_flops=2e6
    )
    assert it.cycles(m)["mma"] == pytest.approx(1e6 / rate + 2e6 / (rate * m.mma_dense_fp8 / m.mma_dense_bf16))


SHARED = """
	Function : fill
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDGSTS.E.BYPASS.128 [R19+0x10000], desc[UR56][R22.64], P5 ;
        /*0020*/                   LDS.128 R152, [R14+UR6+0x18000] ;
        /*0030*/                   STSM.16.M88.4 [R200], R176 ;
        /*0040*/                   LDSM.16.MT88.2 R4, [R200] ;
        /*0050*/                   STS [R3], R4 ;
        /*0060*/              @!PT LDS RZ, [RZ] ;
        /*0070*/               @P0 BRA 0x10 ;
        /*0080*/                   EXIT ;
"""


def test_wgmma_operands_read_from_shared_memory_depend_on_the_form():
    (loop,) = _fn(WGMMA).innermost_loops()
    ss = (64 * 16 + 16 * 64) * 2  # SS 64x64x16 (A from a descriptor): A and B
    rs = 16 * 128 * 2  # RS 64x128x16 (A in registers): B only
    assert loop.counts.wgmma_shapes == {(2 * 64 * 64 * 16, ss): 2, (2 * 64 * 128 * 16, rs): 1}
    assert loop.counts.shared_bytes == (2 * ss + rs) / 4  # per warp: a quarter of each warpgroup instruction
    tf32 = sass.Instr(0, "", "HGMMA.64x32x8.F32.TF32", "R24, gdesc[UR4], R24")
    assert sass.wgmma_shared_bytes(tf32, 64, 32, 8) == (64 * 8 + 8 * 32) * 4


def test_shared_accesses_count_every_lane_and_skip_placeholders():
    (loop,) = _fn(SHARED).innermost_loops()
    # cp.async 16 B, LDS.128 16 B, STSM of four 8x8 16-bit matrices 512 B a warp, LDSM of two 256 B, STS 4 B;
    # the @!PT LDS never runs
    assert loop.counts.shared_bytes == 32 * 16 + 32 * 16 + 512 + 256 + 32 * 4


def test_shared_memory_bounds_an_iteration_and_slows_a_starved_wgmma():
    m = model.H200
    rate = 4096 * m.mma_sustained
    base = dict(warps=8, instructions=0, mufu=0, mma_flops=2 * 2**20, wgmma=True, overlap_instr=0, l2_bytes=0)
    mma, smem_fed, smem_starved = 2 * 2**20 / rate, 40 * 1024 / m.smem_bytes_per_clk, 120 * 1024 / m.smem_bytes_per_clk
    fed = model.TileIteration(**base, shared_bytes=40 * 1024)
    # the units overlap as a p-norm: shared memory at half the MMA time adds a little to it
    assert model.per_iteration_cycles(fed, 2, m) == pytest.approx(
        ((mma**m.overlap_p + smem_fed**m.overlap_p) ** (1 / m.overlap_p), "mma")
    )
    assert mma < model.per_iteration_cycles(fed, 2, m)[0] < 1.1 * mma
    starved = model.TileIteration(**base, shared_bytes=120 * 1024)
    assert model.per_iteration_cycles(starved, 2, m) == pytest.approx(
        ((mma**m.overlap_p + smem_starved**m.overlap_p) ** (1 / m.overlap_p), "smem")
    )
    # two units at the same time cost 2^(1/p) of either, not their max
    both = model.TileIteration(**base, shared_bytes=mma * m.smem_bytes_per_clk)
    assert model.per_iteration_cycles(both, 2, m)[0] == pytest.approx(mma * 2 ** (1 / m.overlap_p))
    # 32 SS 64x32x16 wgmmas (3 KiB for 64 KFLOP each) wait on their operands: the CTA's own path grows by the
    # operand time beyond the MMA time of each
    ops = model.TileIteration(**base, wgmma_ops=((65536, 3072, 32),)).cycles(m)
    assert ops["mma"] == pytest.approx(2 * 2**20 / rate)
    assert ops["critical"] == pytest.approx(ops["mma"] + 32 * (3072 / m.smem_bytes_per_clk - 65536 / rate))
    rs = model.TileIteration(**base, wgmma_ops=((262144, 4096, 8),)).cycles(m)
    assert rs["critical"] == pytest.approx(rs["mma"])  # fed fast enough: no change


def test_blocks_per_sm_obeys_each_hardware_limit():
    m = model.H200
    assert model.blocks_per_sm(m, 128, 32, 0) == 16  # 64 warps
    assert model.blocks_per_sm(m, 128, 255, 0) == 2  # registers
    assert model.blocks_per_sm(m, 128, 32, 100 * 1024) == 2  # shared memory (+1 KiB reserved each)
    assert model.blocks_per_sm(m, 128, 32, 0, grid_cap=3) == 3  # the launch's own grid


def test_heaviest_first_scheduling_shortens_a_skewed_grid():
    jobs = [1, 2, 3, 4, 5, 6]
    assert model.schedule(jobs, 3) == 9
    assert model.schedule(sorted(jobs, reverse=True), 3) == 7
    assert model.schedule([1.0] * 4, 2) == 2


def test_streaming_kernel_within_budget_is_dram_bound():
    c = model.StreamCost(
        instructions=16, mufu=1, l2_bytes=4, dram_bytes=4, min_bytes=4, in_flight_per_sm=64 << 10, warps_per_sm=64
    )
    p = model.predict_stream(c, 1 << 26)
    assert p["bound"] == "dram"
    m = model.H200
    ts = p["times_s"]
    t = model.combine([max(ts["dram"], ts["l2"]), ts["issue"], ts["mufu"]], m.overlap_p)
    assert ts["dram"] <= t < 1.5 * ts["dram"]  # issue below the DRAM time adds some
    assert p["predicted_fraction"] == pytest.approx((1 << 28) / m.dram_copy / (t + m.launch_s))


def test_too_few_bytes_in_flight_limit_the_bandwidth():
    m = model.H200
    c = model.StreamCost(
        instructions=8, mufu=0, l2_bytes=4, dram_bytes=4, min_bytes=4, in_flight_per_sm=8 << 10, warps_per_sm=8
    )
    p = model.predict_stream(c, 1 << 26)
    assert p["latency_limited_bw_Bps"] == pytest.approx((8 << 10) * m.sms / m.dram_latency_s)
    assert p["predicted_fraction"] < 0.35


def test_too_many_instructions_per_element_make_a_kernel_issue_bound():
    m = model.H200
    budget = m.issue_per_s / (m.dram_copy / 4)  # instructions per 4-byte element the copy rate allows
    c = model.StreamCost(
        instructions=2 * budget,
        mufu=0,
        l2_bytes=4,
        dram_bytes=4,
        min_bytes=4,
        in_flight_per_sm=64 << 10,
        warps_per_sm=64,
    )
    p = model.predict_stream(c, 1 << 26)
    assert p["bound"] == "issue" and p["predicted_fraction"] < 0.5 * m.issue_efficiency


def test_dram_and_l2_of_one_stream_overlap_fully():
    # every byte crosses DRAM and L2 once, issue is negligible: the time is the DRAM time (plus the launch)
    m = model.H200
    c = model.StreamCost(
        instructions=1e-3, mufu=0, l2_bytes=4, dram_bytes=4, min_bytes=4, in_flight_per_sm=64 << 10, warps_per_sm=64
    )
    p = model.predict_stream(c, 1 << 26, m=m)
    assert p["time_s"] == pytest.approx(p["times_s"]["dram"] + m.launch_s, rel=1e-6)
    # re-read data (L2 bytes twice the DRAM bytes) is priced by the slower of the two, not their sum
    c2 = dataclasses.replace(c, l2_bytes=8)
    p2 = model.predict_stream(c2, 1 << 26, m=m)
    slower = max(p2["times_s"]["dram"], p2["times_s"]["l2"])
    assert p2["time_s"] == pytest.approx(slower + m.launch_s, rel=1e-6)


def test_combine_is_between_the_max_and_the_sum():
    assert model.combine([3.0, 4.0], 2) == pytest.approx(5.0)
    assert model.combine([3.0, 4.0], math.inf) == 4.0
    assert model.combine([3.0, 4.0], 1) == pytest.approx(7.0)


def test_machine_table_names_the_csv_gpus():
    assert model.machine_for("NVIDIA A100-SXM4-80GB").arch == 80
    assert model.machine_for("NVIDIA H100 80GB HBM3").name.startswith("H100 SXM")
    assert model.machine_for("NVIDIA H100 PCIe").sms == 114
    assert model.machine_for("NVIDIA H100 NVL").mma_dense_bf16 == 835e12
    assert model.machine_for("NVIDIA H200").dram_copy == 4.3e12
    assert model.machine_for("NVIDIA GeForce RTX 4090") is None
    for m in model.MACHINES.values():
        assert m.sources
        # every constant of the table has its source named (a constant may share an entry: "a, b, c")
        named = {f.strip().rstrip("*") for fields, _ in m.sources for f in fields.split(",")}
        for field in ("sms", "l2_bytes", "l2_bw", "hbm", "copy", "clock_hz", "mma_sustained", "launch_s", "overlap_p"):
            assert field in named, (m.name, field)
        per_clk = m.mma_dense_bf16 / (m.sms * m.clock_hz)  # dense bf16 FLOP/clk/SM: 2048 on Ampere, 4096 on Hopper
        assert per_clk == pytest.approx(2048 if m.arch == 80 else 4096, rel=0.01)


def test_local_memory_accesses_are_counted_in_bytes_per_thread():
    text = NESTED.replace("MUFU.EX2 R9, R8 ;", "STL.64 [R1+0x8], R8 ;").replace(
        "FADD R10, R10, R9 ;", "LDL R10, [R1+0x10] ;"
    )
    fn = _fn(text)
    inner = fn.innermost_loops()[0]
    assert inner.counts.local_bytes == 8 + 4  # one 64-bit spill store and one 32-bit reload an iteration
    total, _ = fn.path_counts([3, 2])  # the costliest path: both loops' iterations (2 x 3 inner ones)
    assert total.local_bytes == (8 + 4) * 3 * 2


def test_a_streaming_kernels_tensor_core_work_is_a_term_of_its_time():
    m = model.H200
    base = dict(
        instructions=0.0,
        mufu=0.0,
        l2_bytes=0.0,
        dram_bytes=1.0,
        min_bytes=1.0,
        in_flight_per_sm=1e6,
        warps_per_sm=8,
    )
    # 1e6 programs of 4096 tensor-core clocks each on 132 SMs: the MMA term alone
    cost = model.StreamCost(**base, mma_cycles=4096.0)
    got = model.predict_stream(cost, 1e6, 0, m)
    assert got["times_s"]["mma"] == pytest.approx(1e6 * 4096 / (m.sms * m.clock_hz))
    assert got["bound"] == "mma" and got["time_s"] >= got["times_s"]["mma"]
    assert model.predict_stream(model.StreamCost(**base), 1e6, 0, m)["times_s"]["mma"] == 0.0
    # a kernel that only stores waits on no load: the copy rate, not a division by zero
    stores = model.StreamCost(**{**base, "in_flight_per_sm": 0.0})
    assert model.predict_stream(stores, 1e6, 0, m)["times_s"]["dram"] == pytest.approx(1e6 / m.dram_copy)


def test_tf32_tensor_core_flops_are_counted_apart():
    text = WGMMA.replace(
        "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0", "HGMMA.64x64x8.F32.TF32 R24, gdesc[UR8], R24, gsb0"
    )
    (loop,) = _fn(text).innermost_loops()
    assert loop.counts.mma_tf32_flops == 2 * 64 * 64 * 8 / 4  # per warp, a quarter of the warpgroup's
    assert loop.counts.mma_flops > loop.counts.mma_tf32_flops
