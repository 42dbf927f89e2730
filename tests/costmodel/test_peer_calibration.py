"""``megakernels bench --static --peer-csv``: the CSV reader, row selection, the error summary, and the command end
to end on three rows of Liger-Kernel's published data (needs liger-kernel 0.2.1 installed where
``MEGAKERNELS_PEER_PATH`` or the default peer directory points; skipped, not passed, without it)."""

from __future__ import annotations

import json
import math
import os

import pytest

from costmodel.peers import command, drivers, install, pricing, recorder, table, torch_price, triton_price

HERE = os.path.dirname(__file__)
TINY = os.path.join(HERE, "data", "liger_tiny.csv")


def test_reader_keeps_the_published_columns():
    rows = table.read_csv(TINY)
    assert len(rows) == 3
    assert {r["kernel_provider"] for r in rows} == {"liger", "huggingface"}
    assert all(set(table.FIELDS) <= set(r) for r in rows)
    assert rows[0]["gpu_name"] == "NVIDIA A100-SXM4-80GB" and rows[0]["liger_version"] == "0.2.1"


def test_reader_rejects_another_format(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="kernel_name"):
        table.read_csv(str(p))


def test_select_by_kernel_gpu_provider_and_metric():
    rows = [
        {
            "kernel_name": "rms_norm",
            "metric_name": "speed",
            "gpu_name": "NVIDIA H100 80GB HBM3",
            "kernel_provider": "liger",
        },
        {
            "kernel_name": "rms_norm",
            "metric_name": "memory",
            "gpu_name": "NVIDIA H100 80GB HBM3",
            "kernel_provider": "liger",
        },
        {
            "kernel_name": "rope",
            "metric_name": "speed",
            "gpu_name": "NVIDIA A100-SXM4-80GB",
            "kernel_provider": "huggingface",
        },
    ]
    assert table.select(rows) == [rows[0], rows[2]]
    assert table.select(rows, kernels=["rope"]) == [rows[2]]
    assert table.select(rows, gpus=["H100"]) == [rows[0]]
    assert table.select(rows, providers=["liger"]) == [rows[0]]


def test_summary_against_a_hand_computation():
    errs = [0.1, -0.2, 0.05, -0.4, 0.3]
    rows = [{"gpu_name": "A" if i < 3 else "B", "rel_error": e} for i, e in enumerate(errs)]
    rows.append({"gpu_name": "B", "rel_error": None, "reason": "x"})
    s = table.summarise(rows)
    # |e| sorted: 0.05 0.1 0.2 0.3 0.4 -> median 0.2; p90 at position 0.9 * 4 = 3.6: 0.3 + 0.6 * 0.1 = 0.36
    assert s["overall"]["rows"] == 5
    assert s["overall"]["median_abs_rel_error"] == pytest.approx(0.2)
    assert s["overall"]["p90_abs_rel_error"] == pytest.approx(0.36)
    # GPU A: 0.05 0.1 0.2 -> median 0.1, p90 at 1.8: 0.1 + 0.8 * 0.1 = 0.18; GPU B: 0.3 0.4 -> 0.35, 0.39
    assert s["per_gpu"]["A"]["median_abs_rel_error"] == pytest.approx(0.1)
    assert s["per_gpu"]["A"]["p90_abs_rel_error"] == pytest.approx(0.18)
    assert s["per_gpu"]["B"]["median_abs_rel_error"] == pytest.approx(0.35)
    assert s["per_gpu"]["B"]["p90_abs_rel_error"] == pytest.approx(0.39)
    assert s["not_modelled"] == 1


def test_a_missing_version_is_a_reason_with_the_install_command(tmp_path):
    row = dict(table.read_csv(TINY)[0], liger_version="0.0.0")
    p = command.predict_row(row, str(tmp_path), {})
    assert p["predicted_ms"] is None
    assert "pip install --no-deps --target" in p["reason"] and "liger-kernel==0.0.0" in p["reason"]


def _peer_path() -> str:
    path = os.environ.get("MEGAKERNELS_PEER_PATH")
    if install.peer_dir("0.2.1", path) is None:
        pytest.skip(install.install_hint("0.2.1", path) + " (or set MEGAKERNELS_PEER_PATH)")
    import triton  # noqa: F401  (the cost model compiles with it)

    return path


def test_the_command_end_to_end(tmp_path):
    path = _peer_path()
    from megakernels.bench.__main__ import main

    args = ["--static", "--peer-csv", TINY, "--out", str(tmp_path)] + (["--peer-path", path] if path else [])
    assert main(args) == 0
    payload = json.loads((tmp_path / "calibration.json").read_text())
    rows = payload["rows"]
    assert len(rows) == 3
    hf = [r for r in rows if r["kernel_provider"] == "huggingface"]
    assert hf[0]["predicted_ms"] is None and "provider" in hf[0]["reason"]
    done = [r for r in rows if r["rel_error"] is not None]
    assert len(done) == 2
    for r in done:
        assert r["predicted_ms"] > 0
        assert r["rel_error"] == pytest.approx((r["predicted_ms"] - r["published_ms"]) / r["published_ms"])
        assert {
            "kernel_name",
            "kernel_provider",
            "kernel_operation_mode",
            "gpu_name",
            "x_value",
            "extra_benchmark_config_str",
            "liger_version",
            "published_ms",
        } <= set(r)
    swiglu = next(r for r in done if r["kernel_name"] == "swiglu")
    kinds = [q["kernel"] for q in swiglu["launches"]]
    assert "_swiglu_forward_kernel" in kinds and kinds.count("aten.mm") == 3  # the MLP's three projections
    assert payload["summary"]["overall"]["rows"] == 2


# ---- side by side: our kernels at the peer's shapes ------------------------------------------------------------

SIDE = os.path.join(HERE, "data", "liger_side.csv")


def test_substitute_puts_our_launches_where_the_peer_function_ran():
    Op = recorder.Op
    ops = [
        Op("torch", func="mm"),
        Op("call", func="forward"),
        Op("triton", launch="peer fwd"),
        Op("torch", func="sum"),
        Op("return"),
        Op("torch", func="mm"),
        Op("call", func="backward"),
        Op("triton", launch="peer bwd"),
        Op("return"),
    ]
    out = pricing.substitute(ops, {"fwd": ["a"], "bwd": ["b", "c"]})
    assert [(o.kind, o.launch if o.kind == "ours" else o.func) for o in out] == [
        ("torch", "mm"),
        ("call", "forward"),
        ("ours", "a"),
        ("torch", "mm"),
        ("call", "backward"),
        ("ours", "b"),
        ("ours", "c"),
    ]
    with pytest.raises(ValueError, match="bwd"):
        pricing.substitute(ops, {"fwd": ["a"]})


def test_side_by_side_ratios_and_summary():
    shape = {"kernel_operation_mode": "forward", "gpu_name": "NVIDIA A100-SXM4-80GB", "x_value": "1024"}
    shape["extra_benchmark_config_str"] = "{}"
    rows = [
        {**shape, "kernel_name": "rms_norm", "kernel_provider": "liger", "published_ms": 0.02, "predicted_ms": 0.02}
        | {"ours_predicted_ms": 0.01, "ours_over_peer": 0.5},
        {**shape, "kernel_name": "rms_norm", "kernel_provider": "huggingface", "published_ms": 0.08},
        {**shape, "kernel_name": "rope", "kernel_provider": "liger", "published_ms": 0.1, "predicted_ms": 0.1}
        | {"ours_predicted_ms": 0.15, "ours_over_peer": 1.5, "ours_bound": "host"},
        {**shape, "kernel_name": "geglu", "kernel_provider": "liger", "published_ms": 9.0, "predicted_ms": 9.0}
        | {"ours_predicted_ms": None, "ours_reason": "megakernels has no GeGLU kernel"},
    ]
    side = command.side_by_side(rows)
    by = {s["kernel_name"]: s for s in side["shapes"]}
    assert len(by) == 3  # the peer's shapes, not the HuggingFace row
    assert by["rms_norm"]["huggingface_ms"] == 0.08
    assert by["rms_norm"]["ours_over_hf"] == pytest.approx(0.01 / 0.08)
    assert by["rms_norm"]["torch_compile_ms"] is None and "ours_bound" not in by["rms_norm"]
    assert by["rope"]["ours_bound"] == "host" and by["rope"]["ours_over_hf"] is None
    assert by["geglu"]["ours_over_peer"] is None and "GeGLU" in by["geglu"]["reason"]
    sm = side["summary"]
    assert (sm["compared"], sm["ahead"], sm["behind"]) == (2, 1, 1)
    assert sm["worst"]["kernel_name"] == "rope" and sm["behind_by_bound"] == {"host": 1}
    lines = command.side_by_side_table(side)
    assert any(line.startswith("rope") and "host" in line for line in lines)
    assert any("not compared" in line and "GeGLU" in line for line in lines)


def test_side_by_side_end_to_end(tmp_path):
    path = _peer_path()
    from megakernels.bench.__main__ import main

    args = ["--static", "--peer-csv", SIDE, "--out", str(tmp_path)] + (["--peer-path", path] if path else [])
    assert main(args) == 0
    payload = json.loads((tmp_path / "calibration.json").read_text())
    rows = {(r["kernel_name"], r["kernel_provider"]): r for r in payload["rows"]}
    rms = rows[("rms_norm", "liger")]
    assert rms["ours_predicted_ms"] > 0 and rms["predicted_ms"] > 0
    assert rms["ours_over_peer"] == pytest.approx(rms["ours_predicted_ms"] / rms["predicted_ms"])
    ours = [q["kernel"] for q in rms["ours_launches"] if q.get("ours")]
    assert any("norm_fwd_rows_kernel" in k for k in ours) and any("norm_bwd_rows_kernel" in k for k in ours)
    assert (rms["ours_over_peer"] > 1) == ("ours_bound" in rms)
    geglu = rows[("geglu", "liger")]
    assert geglu["predicted_ms"] > 0  # the peer is still modelled
    assert geglu["ours_predicted_ms"] is None and "no GeGLU kernel" in geglu["ours_reason"]
    side = {s["kernel_name"]: s for s in payload["side_by_side"]["shapes"]}
    assert side["rms_norm"]["ours_over_hf"] == pytest.approx(
        rms["ours_predicted_ms"] / rows[("rms_norm", "huggingface")]["published_ms"]
    )


def test_our_launch_plans_take_the_machine():
    from costmodel import elementwise, model, streaming

    a100, h200 = model.MACHINES["A100-SXM4-80GB"], model.H200
    # a grid capped at resident blocks per SM scales with the SM count
    assert (
        streaming.rows_plan(1 << 20, 1024, 8, 4, 0, a100.sms, a100.smem)[2]
        < streaming.rows_plan(1 << 20, 1024, 8, 4, 0)[2]
    )
    assert elementwise._rope_parts("bf16", 16384, 32, 8, 128, a100)[0].grid == a100.sms * 8
    assert elementwise._rope_parts("bf16", 16384, 32, 8, 128, h200)[0].grid == h200.sms * 8


TTIR = """
module {
  tt.func public @k(%X_ptr: !tt.ptr<f32>, %L_ptr: !tt.ptr<f32>, %n_cols: i32) {
    %c0_i32 = arith.constant 0 : i32
    %c1024_i32 = arith.constant 1024 : i32
    %y = tt.load %L_ptr : !tt.ptr<f32>
    scf.for %i = %c0_i32 to %n_cols step %c1024_i32  : i32 {
      %a = tt.load %p, %m : tensor<1024x!tt.ptr<f32>>
      scf.for %j = %c0_i32 to %n_cols step %c1024_i32  : i32 {
        %b = tt.load %q : tensor<8x128x!tt.ptr<bf16>>
      }
      tt.store %p, %a, %m : tensor<1024x!tt.ptr<f32>>
    }
    tt.store %L_ptr, %y : !tt.ptr<f32>
    tt.return
  }
}
"""


def test_ir_loops_know_the_bytes_of_their_own_tiles():
    ir = triton_price.IR(TTIR, {"X_ptr": None, "L_ptr": None, "n_cols": 4096})
    assert ir.trips() == [(4, 2), (4, 3)]
    # the outer loop loads and stores a 1024-float tile (its inner loop's 8x128 bf16 tile is the inner loop's);
    # the scalar load and store outside the loops belong to no loop
    assert ir.loop_bytes == [2 * 1024 * 4, 8 * 128 * 2]
    assert triton_price._access_bytes("tt.store %L_ptr, %y : !tt.ptr<f32>") == 4


def test_a_row_naming_a_release_older_than_its_kernel_is_modelled_with_the_first_release_that_has_it():
    # Liger's CSV labels rows with the benchmark machine's installed release; a kernel newer than that release was
    # measured from the source between it and the next one
    assert command.resolve_version("layer_norm", "0.2.1") == "0.3.0"
    assert command.resolve_version("jsd", "0.3.1") == "0.4.0"
    assert command.resolve_version("megatron_swiglu", "0.8.1") == "0.8.2"
    assert command.resolve_version("layer_norm", "0.6.0") == "0.6.0"  # a release that has it: itself
    assert command.resolve_version("rms_norm", "0.2.1") == "0.2.1"
    assert command.resolve_version("unknown_kernel", "0.1.0") == "0.1.0"
    # rows written by the same commit as a rewrite of their kernel ran the rewrite (its first release)
    assert command.resolve_version("tvd", "0.7.0") == "0.8.0"
    assert command.resolve_version("fused_add_rms_norm", "0.7.0") == "0.8.0"
    assert command.resolve_version("tvd", "0.8.1") == "0.8.1"
    # the row's own label is kept; the release used is reported beside it
    row = dict(table.read_csv(TINY)[0], kernel_name="layer_norm", liger_version="0.2.1")
    p = command.predict_row(row, None, {command._key(row): "recorded elsewhere"})
    assert p["liger_version"] == "0.2.1" and p["liger_version_used"] == "0.3.0" and p["reason"] == "recorded elsewhere"
    row = dict(row, kernel_name="rms_norm")
    assert "liger_version_used" not in command.predict_row(row, None, {command._key(row): "recorded elsewhere"})


def test_a_missing_release_is_never_installed_at_run_time(tmp_path, monkeypatch):
    """The model runs no installer: a row naming a release that is not installed is a reason naming the command."""
    import subprocess

    def no_run(*args, **kwargs):
        raise AssertionError(f"ran {args}")

    monkeypatch.setattr(subprocess, "run", no_run)
    monkeypatch.setattr(subprocess, "Popen", no_run)
    row = dict(table.read_csv(TINY)[0], liger_version="9.9.9")
    p = command.predict_row(row, str(tmp_path), {})
    assert p["predicted_ms"] is None and "liger-kernel==9.9.9" in p["reason"]


def test_the_releases_set_up_cover_every_published_row():
    """scripts/setup.sh installs ``RELEASES_USED``: every row of the repository's peer CSVs resolves to one of them."""
    root = os.path.join(HERE, "..", "..", "benchmarks", "peer")
    needed = {
        command.resolve_version(r["kernel_name"], r["liger_version"])
        for name in os.listdir(root)
        if name.endswith(".csv")
        for r in table.read_csv(os.path.join(root, name))
        if r["kernel_provider"] == "liger"
    }
    assert needed and needed <= set(install.RELEASES_USED), sorted(needed - set(install.RELEASES_USED))


def test_megatron_cross_entropy_rows_say_why_they_are_not_modelled():
    row = dict(table.read_csv(TINY)[0], kernel_name="megatron_cross_entropy")
    p = command.predict_row(row, None, {})
    assert p["predicted_ms"] is None and "torch.distributed" in p["reason"]


# The drivers of the kernels beyond the development set record what each benchmark's timed region runs (the peer's
# Triton kernels and the PyTorch ops around them), without compiling anything. (kernel, release, x, config, mode,
# kernels expected in order)
DRIVEN = [
    (
        "kl_div",
        "0.3.0",
        4096,
        {"B": 2, "T": 64},
        "backward",
        ["_kldiv_kernel_backward", "_log_softmax_backward_data", "add"],
    ),
    ("jsd", "0.4.0", 4096, {"B": 2, "T": 64}, "full", ["_jsd_kernel", "_log_softmax_backward_data", "add"]),
    ("tvd", "0.7.0", 4096, {"B": 2, "T": 64}, "forward", ["_tv_distance_kernel"]),
    (
        "relu_squared",
        "0.8.0",
        128,
        {"M": 256, "dtype": "torch.bfloat16"},
        "full",
        ["_relu_squared_forward_kernel", "_relu_squared_backward_kernel"],
    ),
    (
        "llama4_rope",
        "0.6.2",
        512,
        {"dtype": "torch.bfloat16", "seq_len": 64, "num_q_heads": 8, "num_kv_heads": 2},
        "backward",
        ["_llama4_rope_kernel"],
    ),
    (
        "megatron_rms_norm",
        "0.8.1",
        1024,
        {"S": 64, "B": 1},
        "full",
        ["_rms_norm_forward_kernel", "sum", "ones_like", "_rms_norm_backward_kernel", "sum", "add", "add"],
    ),
    (
        "megatron_swiglu",
        "0.8.2",
        1024,
        {"S": 64, "B": 1},
        "backward",
        ["_swiglu_fused_gate_up_forward_kernel", "sum", "ones_like", "_swiglu_fused_gate_up_backward_kernel"],
    ),
]


DRIVEN.append(
    (
        "fused_add_rms_norm",
        "0.7.0",
        1024,
        {"M": 64, "dtype": "torch.float32", "eps": 1e-6},
        "full",
        ["_fused_add_rms_norm_forward_kernel", "_fused_add_rms_norm_backward_kernel", "sum", "add"],
    )
)


DRIVEN.append(
    (
        "fused_neighborhood_attention",
        "0.6.0",
        64,
        {
            "batch_size": 1,
            "hidden_size": 128,
            "num_heads": 4,
            "kernel_size": 7,
            "dilation": 1,
            "bias": True,
            "dtype": "torch.float32",
        },
        "full",
        [
            "_fused_neighborhood_attention_qk_kernel",
            "_fused_neighborhood_attention_av_kernel",
            "_fused_neighborhood_attention_grad_qk_kernel",
        ],
    )
)


@pytest.mark.parametrize("kernel,version,x,cfg,mode,expected", DRIVEN, ids=[d[0] for d in DRIVEN])
def test_drivers_record_the_benchmarks_timed_region(kernel, version, x, cfg, mode, expected):
    rec = _record(version, kernel, mode, x, cfg)
    names = []
    for op in rec.ops:
        if op.kind == "triton":
            names.append(op.launch.kernel.__name__)
        elif op.kind == "torch":
            names.append(str(op.func).split(".")[-2])
    kernels = [n for n in names if n in expected]
    assert kernels == expected
    assert "device" not in names  # the fake tensors' own device queries are not a program's ops
    calls = [op.func for op in rec.ops if op.kind == "call"]
    assert calls == (
        ["forward"]
        if mode == "forward"
        else ["backward"]
        if mode == "backward" and kernel not in ("megatron_rms_norm", "megatron_swiglu")
        else ["forward", "backward"]
    )


def test_spilled_registers_cost_what_misses_l1_and_l2():
    from costmodel import model

    m = model.MACHINES["H100-SXM"]  # 256 KiB of L1 + shared memory per SM, 50 MiB of L2, 132 SMs
    # frames that fit in L1 (64 KiB a program, 2 programs, 16 KiB of shared memory each): no traffic beyond L1
    assert triton_price.spill_traffic(1e9, 64 << 10, 16 << 10, 2, 264, m) == (0.0, 0.0)
    # a 600 KiB frame, one program per SM, no shared memory: 256/600 of it hits L1; the 132 frames (79 MB) are more
    # than the L2 holds, so 50 MiB / 79 MB of the misses hit L2 and the rest go on to DRAM
    frame = 600 << 10
    l1_miss = 1 - (256 << 10) / frame
    l2_miss = 1 - (50 << 20) / (132 * frame)
    to_l2, to_dram = triton_price.spill_traffic(1e9, frame, 0, 1, 132, m)
    assert to_l2 == pytest.approx(1e9 * l1_miss) and to_dram == pytest.approx(1e9 * l1_miss * l2_miss)
    # a grid of 8 such programs keeps its frames in L2: nothing reaches DRAM
    assert triton_price.spill_traffic(1e9, frame, 0, 1, 8, m)[1] == 0.0
    assert triton_price.spill_traffic(0.0, frame, 0, 1, 132, m) == (0.0, 0.0)


def test_a_kernels_own_provider_name_is_the_peer_and_its_variants_are_not():
    base = dict(table.read_csv(TINY)[0], kernel_name="fused_add_rms_norm", liger_version="0.7.0")
    for provider, modelled in (("liger_fused_add_rms_norm", True), ("liger_rms_norm", False), ("huggingface", False)):
        row = dict(base, kernel_provider=provider)
        p = command.predict_row(row, None, {command._key(row): "recorded elsewhere"})
        assert (p["reason"] == "recorded elsewhere") is modelled, provider


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the tests that need Triton skip without it
    triton = tl = None


def _tuned_scale():
    """A small autotuned kernel for the autotune rule, built as a compiled (not interpreted) Triton kernel."""
    from megakernels.triton.launch import without_interpreter

    with without_interpreter():

        @triton.autotune(
            configs=[triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((64, 1), (512, 4), (4096, 8))],
            key=["n"],
        )
        @triton.jit
        def tuned_scale(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, mask=offs < n)

    return tuned_scale


def _record(version, kernel, mode, x, cfg):
    from costmodel import model

    path = install.peer_dir(version, os.environ.get("MEGAKERNELS_PEER_PATH"))
    if path is None:
        pytest.skip(install.install_hint(version, None) + " (scripts/setup.sh installs it)")
    import triton  # noqa: F401  (the cost model compiles with it)

    rec = recorder.Recorder(model.MACHINES["H100-SXM"])
    with install.imported(path), rec.patched():
        drivers.DRIVERS[kernel](rec, mode, x, cfg)
    return rec


def _count(rec, name):
    return sum(1 for op in rec.ops if op.kind == "torch" and str(op.func).split(".")[-2] == name)


def test_autotune_keeps_the_config_the_model_prices_fastest():
    import torch
    import triton  # noqa: F401  (the cost model compiles with it)

    from costmodel import model
    from megakernels.triton.launch import Launch

    m = model.MACHINES["H100-SXM"]
    n = 1 << 20
    kernel = _tuned_scale()
    rec = recorder.Recorder(m)
    with rec.patched(), rec.recording(True):
        x = torch.empty(n, device="cuda")
        y = torch.empty(n, device="cuda")
        for _ in range(2):  # the second launch of the key reuses the kept config
            kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)
    (tuning,) = rec.tunings
    launches = [op.launch for op in rec.ops if op.kind == "triton"]
    assert len(launches) == 2
    # the reference: each config launched by hand and priced one by one
    meta = torch.empty(n, device="meta")
    times = {}
    for config in kernel.configs:
        kw = config.all_kwargs()
        launch = Launch(kernel.fn, (triton.cdiv(n, kw["BLOCK"]),), (meta, meta, n), kw)
        times[config.kwargs["BLOCK"]] = triton_price.price_triton(launch, m)["time_s"]
    assert {c.kwargs["BLOCK"]: t for c, t in tuning["configs"]} == pytest.approx(times)
    best = min(times, key=times.get)
    assert tuning["chosen"].kwargs["BLOCK"] == best
    assert all(lc.kwargs["BLOCK"] == best for lc in launches)
    assert len(set(times.values())) > 1  # the configs differ in price, so the choice is a choice


def test_fused_linear_jsd_records_its_chunks():
    bt, h, v = 256, 64, 512
    cfg = {"H": h, "V": v, "dtype": "torch.bfloat16"}
    # the release's chunking: cdiv(V, H) as the memory factor, chunks of next_power_of_2(cdiv(BT, factor)) rows
    factor = -(-v // h)
    chunk = 1 << (-(-bt // factor) - 1).bit_length()
    chunks = -(-bt // chunk)
    rec = _record("0.4.0", "fused_linear_jsd", "forward", bt, cfg)
    jsd = [op.launch for op in rec.ops if op.kind == "triton"]
    assert [lc.name for lc in jsd] == ["_jsd_kernel"] * chunks
    assert all(lc.grid == (chunk,) for lc in jsd)
    # per chunk: the student's and teacher's logits, the student's input and weight gradients
    assert _count(rec, "mm") == 4 * chunks
    full = _record("0.4.0", "fused_linear_jsd", "full", bt, cfg)
    # the backward at a unit loss gradient rescales nothing (one read-back decides it); the input's and the
    # student weight's gradients accumulate
    assert [op.launch.name for op in full.ops if op.kind == "triton"] == ["_jsd_kernel"] * chunks
    assert sum(1 for op in full.ops if op.kind == "sync") == 1
    assert _count(full, "add") == 2


def test_distill_jsd_loss_runs_its_chunk_function_per_1024_rows():
    bt, h, v = 2048, 64, 256
    cfg = {"H": h, "V": v, "dtype": "torch.bfloat16", "bias": False, "weight_hard_loss": 0.5}
    rec = _record("0.5.5", "distill_jsd_loss", "forward", bt, cfg)
    # per chunk of 1024 rows: the student's and teacher's logits, then the student's input and weight gradients
    mms = [op for op in rec.ops if op.kind == "torch" and str(op.func).split(".")[-2] == "mm"]
    assert len(mms) == 4 * (bt // 1024)
    assert {op.outputs[0][0] for op in mms} == {(1024, v), (1024, h // 2), (v, h // 2)}


def test_kto_loss_runs_its_chunk_function_per_sequence():
    b, t, h, v = 3, 16, 32, 128
    cfg = {"T": t, "H": h, "V": v, "dtype": "torch.bfloat16", "bias": True, "beta": 0.1, "ignore_index": 42}
    rec = _record("0.5.5", "kto_loss", "full", b, cfg)
    mms = [op for op in rec.ops if op.kind == "torch" and str(op.func).split(".")[-2] in ("mm", "addmm")]
    assert len(mms) == 4 * b  # policy and reference logits, the policy's input and weight gradients
    assert [op.func for op in rec.ops if op.kind == "call"] == ["forward", "backward"]


def test_moe_routing_counts_every_token_choice():
    t, e, k = 1000, 16, 4
    starts, tiles = drivers._moe_routing(t, e, k, 64)
    counts = [b - a for a, b in zip(starts, starts[1:])]
    assert starts[0] == 0 and starts[-1] == t * k and min(counts) >= 0
    assert tiles == sum(-(-c // 64) for c in counts)
    assert drivers._moe_routing(t, 1, 1, 64) == ([0, t], -(-t // 64))  # one expert takes every token


def test_fused_moe_records_its_launches_on_the_routed_tiles(monkeypatch):
    # pricing stubbed (every config's price its BLOCK_N): the test is what the driver launches, not what it costs
    for module in (recorder, pricing, torch_price):
        monkeypatch.setattr(
            module, "price_triton", lambda launch, m: {"time_s": float(launch.kwargs.get("BLOCK_N", 1))}
        )
    t, e, k, h, i = 256, 8, 2, 128, 64
    cfg = {"sweep_dim": "T", "T": None, "E": e, "H": h, "intermediate_dim": i, "K": k, "dtype": "torch.bfloat16"}
    rec = _record("0.8.0", "fused_moe", "full", t, cfg)
    launches = {op.launch.name: op.launch for op in rec.ops if op.kind == "triton"}
    assert len([op for op in rec.ops if op.kind == "triton"]) == 11  # 3 routing, 2 GEMMs, gather; 5 backward
    tiles = drivers._moe_routing(t, e, k, 64)[1]
    up = launches["_fused_up_proj_swiglu_kernel"]
    assert up.grid[0] == tiles  # the M-tile count the forward reads back
    assert up.kwargs["BLOCK_N"] == 64  # the stubbed price keeps the smallest BLOCK_N
    assert launches["_moe_bwd_dW2_kernel"].contents["expert_start_ptr"] == drivers._moe_routing(t, e, k, 64)[0]
    # the warm-up tuned every autotuned kernel before the timed region, which tunes nothing more
    assert {tn["kernel"] for tn in rec.tunings} >= {"_fused_up_proj_swiglu_kernel", "_moe_bwd_dW1_kernel"}
    assert all(tn["key"][:2] == (h, i) for tn in rec.tunings if tn["kernel"] != "_token_gather_weighted_sum_kernel")


def test_in_place_ops_cost_their_bytes_and_views_nothing():
    import torch

    from costmodel import model

    m = model.MACHINES["H100-SXM"]
    t = ((1024, 1024), torch.float32)
    add_ = recorder.Op("torch", func=torch.ops.aten.add_.Tensor, inputs=(t, t), outputs=(t,))
    assert torch_price.price_torch(add_, m)["time_s"] == pytest.approx(3 * 4 * 1024 * 1024 / m.dram_copy + m.launch_s)
    view = recorder.Op("torch", func=torch.ops.aten.slice.Tensor, inputs=(t,), outputs=(t,))
    assert torch_price.price_torch(view, m) is None


def test_ops_that_only_write_cost_their_outputs():
    """A factory taking a tensor for its shape (zeros_like) and an in-place fill read nothing: one write pass."""
    import torch

    from costmodel import model

    m = model.MACHINES["H100-SXM"]
    t = ((2048, 512), torch.bfloat16)
    one_pass = 2 * 2048 * 512 / m.dram_copy + m.launch_s
    for func in (torch.ops.aten.zeros_like.default, torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default):
        assert torch_price.price_torch(recorder.Op("torch", func=func, inputs=(t,), outputs=(t,)), m)[
            "time_s"
        ] == pytest.approx(one_pass), func
    neg = recorder.Op("torch", func=torch.ops.aten.neg.default, inputs=(t,), outputs=(t,))  # reads and writes
    assert torch_price.price_torch(neg, m)["time_s"] == pytest.approx(2 * one_pass - m.launch_s)


def _compiled_region(m):
    """A small function run through the recorder's ``torch.compile``: two GEMMs, the pointwise work and reductions
    between and after them, an in-place update of a tensor made before the call; (ops, the tensors' sizes)."""
    import torch

    rec = recorder.Recorder(m)
    with rec.patched(), rec.recording(True):
        x = torch.empty(64, 32, device="cuda")
        w = torch.empty(32, 16, device="cuda")
        b = torch.empty(64, 16, device="cuda")
        g = torch.empty(64, 32, device="cuda")

        def step(x, w, b, g):
            y = x @ w  # extern
            z = torch.exp(y) * b  # fused kernel 1: reads y and b
            s = (z + b).sum()  # fused kernel 1: b again (read once), z made there
            u = z @ w.t()  # extern: needs z written
            g.add_(u)  # fused kernel 2: reads u and g, writes g (made before the call)
            return s

        torch.compile(step)(x, w, b, g)
    return rec.ops


def test_a_compiled_region_fuses_the_ops_between_its_gemms():
    from costmodel import model

    m = model.MACHINES["H100-SXM"]
    ops = _compiled_region(m)
    ops = ops[[op.kind for op in ops].index("compiled") :]  # after the inputs' allocations
    kinds = [op.kind for op in ops]
    assert kinds[-1] == "compiled_end" and kinds.count("compiled") == 1
    kernels = torch_price.fuse_compiled(ops[1:])
    assert [k for k, _ in kernels] == ["extern", "fused", "extern", "fused"]
    # counted by hand (fp32): kernel 1 reads y [64, 16] and b [64, 16] once each, writes z [64, 16] (the second
    # GEMM reads it) and the returned sum; kernel 2 reads u [64, 32] and g [64, 32], writes g back
    first, second = kernels[1][1], kernels[3][1]
    assert (first["read_bytes"], first["write_bytes"]) == (2 * 64 * 16 * 4, 64 * 16 * 4 + 4)
    assert (second["read_bytes"], second["write_bytes"]) == (2 * 64 * 32 * 4, 64 * 32 * 4)
    assert first["ops"] == 4 and second["ops"] == 1  # exp, mul, add, sum; add_
    # priced: the GEMMs as eager ones, each fused kernel its bytes at the copy rate and one launch; the host pays
    # one compiled call and one launch per kernel, not an op's dispatch per op
    gemms = [torch_price.price_torch(k, m)["time_s"] for kind, k in kernels if kind == "extern"]
    fused = [(k["read_bytes"] + k["write_bytes"]) / m.dram_copy + m.launch_s for kind, k in kernels if kind == "fused"]
    host = pricing.Host(flush_bytes=0.0)
    res = pricing.price(ops, m, host)
    assert res["gpu_s"] == pytest.approx(sum(gemms) + sum(fused))
    assert res["host_exposed_s"] == pytest.approx(host.function_s + 4 * host.torch_op_s)
    eager = pricing.price([op for op in ops if op.kind not in ("compiled", "compiled_end")], m, host)
    assert res["gpu_s"] < eager["gpu_s"]  # every eager op was its own pass over its tensors


def _softmax_region(m, v):
    """A compiled log-softmax loss and its gradient over rows of ``v``, as Inductor runs it (probed with its CUDA
    code generation, torch 2.14): a pass for the row's max and sum, one that uses them for the loss's row sums
    and the gradient's, and one that writes the gradient; (ops inside the markers, logits' bytes)."""
    import torch

    rec = recorder.Recorder(m)
    with rec.patched(), rec.recording(True):
        x = torch.empty(64, 32, device="cuda")
        w = torch.empty(32, v, device="cuda")

        def step(x, w):
            logits = x @ w  # extern
            logp = torch.log_softmax(logits, dim=-1)  # pass 1 reduces the row, pass 2 uses it
            loss = (logp.exp() * logp).sum()  # pass 2: a row sum that needs pass 1's statistics
            g = torch.ops.aten._log_softmax_backward_data(logp * 0.5, logp, -1, torch.float32)  # pass 2 sums
            return loss, g * 2  # pass 3: the gradient needs pass 2's sum

        torch.compile(step)(x, w)
    ops = rec.ops
    return ops[[op.kind for op in ops].index("compiled") + 1 :], 64 * v * 4


def test_a_compiled_reduction_kernel_rereads_its_rows_once_a_pass():
    from costmodel import model

    m = model.MACHINES["H100-SXM"]
    # rows longer than a persistent reduction holds (torch/_inductor/choices.py: 1024 for an inner reduction): the
    # logits cross DRAM in each of the three loops of the kernel, the gradient is written once
    ops, logits = _softmax_region(m, 4096)
    kernels = torch_price.fuse_compiled(ops)
    assert [k for k, _ in kernels] == ["extern", "fused"]
    fused = kernels[1][1]
    assert fused["passes"] == 3
    assert fused["read_bytes"] == 3 * logits
    assert fused["write_bytes"] == logits + 4  # the gradient, the returned loss
    # rows a persistent reduction holds stay in registers: one read of the logits, whatever the passes
    ops, logits = _softmax_region(m, 1024)
    fused = torch_price.fuse_compiled(ops)[1][1]
    assert (fused["passes"], fused["read_bytes"], fused["write_bytes"]) == (1, logits, logits + 4)


def test_a_compiled_scatter_is_stored_and_a_column_sum_has_its_own_loop():
    import torch

    from costmodel import model

    m = model.MACHINES["H100-SXM"]
    n, v = 16, 4096
    rec = recorder.Recorder(m)
    with rec.patched(), rec.recording(True):
        logits = torch.empty(n, v, device="cuda")
        idx = torch.empty(n, 1, device="cuda", dtype=torch.int64)

        def step(logits, idx):
            logp = torch.log_softmax(logits, dim=-1)
            picked = logp.gather(-1, idx)  # one element a row: no pass over the row
            g = torch.zeros_like(logp).scatter_add(-1, idx, picked)  # stored: a kernel of its own
            dx = torch.ops.aten._log_softmax_backward_data(g, logp, -1, torch.float32)
            return dx, dx.sum(0)  # a column sum: its own loop over what it reads

        torch.compile(step)(logits, idx)
    ops = rec.ops[[op.kind for op in rec.ops].index("compiled") + 1 :]
    ((kind, fused),) = torch_price.fuse_compiled(ops)
    row = n * v * 4
    # passes: the softmax statistics (logits); the gradient's row sum (the scattered g, and the indices: the
    # gather's and the scatter's own loads); the returned gradient (g, logits); the column sum (the stored gradient)
    assert fused["passes"] == 4
    assert fused["read_bytes"] == 5 * row + n * 8
    assert fused["write_bytes"] == 2 * row + v * 4  # g stored, the returned gradient, the bias gradient


def test_a_compiled_region_needs_its_end_and_no_read_back():
    with pytest.raises(ValueError, match="compiled_end"):
        torch_price.fuse_compiled([recorder.Op("torch")])
    with pytest.raises(ValueError, match="read-back"):
        torch_price.fuse_compiled([recorder.Op("sync"), recorder.Op("compiled_end", access=((),))])


def test_distill_jsd_loss_prices_its_compiled_chunk_as_one_fused_kernel_between_its_gemms():
    bt, h, v = 2048, 64, 256
    cfg = {"H": h, "V": v, "dtype": "torch.bfloat16", "bias": False, "weight_hard_loss": 0.5}
    rec = _record("0.5.5", "distill_jsd_loss", "forward", bt, cfg)
    starts = [i for i, op in enumerate(rec.ops) if op.kind == "compiled"]
    ends = [i for i, op in enumerate(rec.ops) if op.kind == "compiled_end"]
    assert len(starts) == len(ends) == bt // 1024  # one compiled call a chunk
    kernels = torch_price.fuse_compiled(rec.ops[starts[0] + 1 : ends[0] + 1])
    assert [torch_price._op_name(k) for kind, k in kernels if kind == "extern"] == ["mm"] * 4
    fused = [k for kind, k in kernels if kind == "fused"]
    # the loss and its gradient, one kernel: both chunks' bf16 logits [1024, V] and the int64 labels read once, the
    # logits' gradient written for the gradient GEMMs, the loss accumulator (fp32) read and written; then the
    # weight gradient's accumulation after its GEMM, [V, H/2] bf16 read twice and written once
    assert (fused[0]["read_bytes"], fused[0]["write_bytes"]) == (2 * 1024 * v * 2 + 1024 * 8 + 4, 1024 * v * 2 + 4)
    assert (fused[1]["read_bytes"], fused[1]["write_bytes"]) == (2 * v * (h // 2) * 2, v * (h // 2) * 2)


def _counted_loop():
    """A kernel whose programs each run as many loop iterations as a count tensor holds at their index (the MoE's
    per-expert bounds), built as a compiled (not interpreted) Triton kernel."""
    from megakernels.triton.launch import without_interpreter

    with without_interpreter():

        @triton.jit
        def counted_loop(counts_ptr, out_ptr, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            n = tl.load(counts_ptr + pid)
            acc = tl.arange(0, BLOCK).to(tl.float32)
            for _ in range(0, n):
                acc = acc * acc * 0.5 + acc
            tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)

    return counted_loop


def test_unequal_programs_cost_their_sum_and_the_busiest_bounds_the_launch(monkeypatch):
    import torch
    import triton  # noqa: F401  (the cost model compiles with it)

    from costmodel import model
    from megakernels.triton.launch import Launch

    m = model.MACHINES["H100-SXM"]
    kernel = _counted_loop()
    block, programs = 256, 4 * m.sms

    def priced(counts):
        p = len(counts)
        args = (torch.empty(p, dtype=torch.int32, device="meta"), torch.empty(p * block, device="meta"))
        launch = Launch(kernel, (p,), args, {"BLOCK": block})
        launch.contents = {"counts_ptr": counts}
        return triton_price.price_triton(launch, m)

    # equal work: the per-program rule gives what pricing program 0 for every program gives
    equal = priced([400] * programs)
    with monkeypatch.context() as mp:
        mp.setattr(triton_price, "_program_shares", lambda ir, grid: None)
        assert priced([400] * programs)["time_s"] == pytest.approx(equal["time_s"], rel=1e-12)
    assert equal["bound"] != "tail"
    # half the programs at 200 iterations, half at 600: the work is the sum, 400 a program on average
    mixed = priced([200, 600] * (programs // 2))
    assert mixed["instructions_per_program"] == pytest.approx(equal["instructions_per_program"], rel=1e-9)
    assert mixed["time_s"] == pytest.approx(equal["time_s"], rel=1e-9)
    assert priced([200] * programs)["time_s"] < 0.8 * mixed["time_s"]  # program 0's count alone would say 200
    # one program with all the work: the launch lasts as long as that program would as a launch of its own
    lone = priced([4000] + [0] * (programs - 1))
    alone = priced([4000])
    assert lone["bound"] == "tail" and set(lone["busiest_loop_trips"]) == {4000}
    assert lone["time_s"] == pytest.approx(alone["time_s"], rel=0.01)
    assert lone["time_s"] > 5 * priced([4000 // programs] * programs)["time_s"]  # the same work spread evenly


def _engine_after_moe_backward(t, e, k, h, i, calls=3):
    """The reference for the fused MoE's timed backward past the autograd function: the benchmark's inputs
    (``randn(..., requires_grad=True)`` weights times 0.02, a leaf ``x``, routing weights made a leaf by
    ``requires_grad_``) and its timed ``y.backward(do, retain_graph=True)`` with ``grad_to_none`` clearing ``x``,
    the two weight products and the routing weights before each call, run by PyTorch's own autograd engine on the
    CPU through a stand-in of the function (the release's arguments; gradients of the shapes its backward returns).
    Returns the ATen ops (``recorder.Op``s: func, input and output shapes) the engine dispatched after the stand-in's
    backward returned, in the last call (every call after the first: the first finds no ``.grad`` to add to)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    bf16 = torch.bfloat16
    seen, end = [], []

    class StandIn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, gate_up_proj, down_proj, top_k_index, top_k_weights):
            return torch.empty(t, h, dtype=bf16)

        @staticmethod
        def backward(ctx, dO):
            grads = (
                torch.empty(t, h, dtype=bf16),
                torch.empty(e, 2 * i, h, dtype=bf16),
                torch.empty(e, h, i, dtype=bf16),
                None,
                torch.empty(t * k, dtype=bf16).view(t, k),
            )
            end.append(len(seen))
            return grads

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # shapes only: a reference held to a gradient would keep the engine from taking it as the leaf's .grad
            seen.append(
                recorder.Op("torch", func=func, inputs=recorder._tensors(list(args)), outputs=recorder._tensors(out))
            )
            return out

    x = torch.randn(t, h, dtype=bf16, requires_grad=True)
    gup = torch.randn(e, 2 * i, h, dtype=bf16, requires_grad=True) * 0.02
    dn = torch.randn(e, h, i, dtype=bf16, requires_grad=True) * 0.02
    idx = torch.zeros(t, k, dtype=torch.int32)
    wts = torch.softmax(torch.randn(t, k), dim=-1).to(bf16).requires_grad_(True)
    y = StandIn.apply(x, gup, dn, idx, wts)
    do = torch.randn_like(y)
    for _ in range(calls):
        for g in (x, gup, dn, wts):  # do_bench's grad_to_none (a non-leaf product keeps no .grad anyway)
            g.grad = None
        seen.clear()
        end.clear()
        with Seen():
            y.backward(do, retain_graph=True)
    return seen[end[-1] :]


def test_fused_moe_backward_prices_the_engines_pass_over_the_weight_gradients(monkeypatch):
    # pricing stubbed for the Triton launches: the test is what the driver records after the peer's backward
    for module in (recorder, pricing, torch_price):
        monkeypatch.setattr(
            module, "price_triton", lambda launch, m: {"time_s": float(launch.kwargs.get("BLOCK_N", 1))}
        )
    from costmodel import model

    m = model.MACHINES["H100-SXM"]
    t, e, k, h, i = 256, 8, 2, 128, 64
    cfg = {"sweep_dim": "T", "T": None, "E": e, "H": h, "intermediate_dim": i, "K": k, "dtype": "torch.bfloat16"}
    # views and detaches launch nothing
    reference = [op for op in _engine_after_moe_backward(t, e, k, h, i) if torch_price.price_torch(op, m) is not None]
    # the engine's own work: each weight gradient scaled by the product's MulBackward0, then added in place into
    # the leaf's .grad by AccumulateGrad; nothing for x and the routing weights (their .grad cleared)
    assert [(torch_price._op_name(op), op.outputs[0][0]) for op in reference] == [
        ("mul", (e, h, i)),
        ("add_", (e, h, i)),
        ("mul", (e, 2 * i, h)),
        ("add_", (e, 2 * i, h)),
    ]
    for mode in ("backward", "full"):
        rec = _record("0.8.0", "fused_moe", mode, t, cfg)
        kinds = [op.kind for op in rec.ops]
        after = rec.ops[max(j for j, kind in enumerate(kinds) if kind == "return") + 1 :]
        assert [op.outputs[0][0] for op in after] == [op.outputs[0][0] for op in reference]
        assert sum(torch_price.price_torch(op, m)["time_s"] for op in after) == pytest.approx(
            sum(torch_price.price_torch(op, m)["time_s"] for op in reference), rel=1e-6
        )
        # the full pass draws its dO inside the timed call; the backward pass before it
        assert _count(rec, "randn_like") == (mode == "full")


GEMM_TTIR = """
module {
  tt.func public @g(%A_ptr: !tt.ptr<bf16>, %B_ptr: !tt.ptr<bf16>, %C_ptr: !tt.ptr<bf16>) {
    %pid_m = tt.get_program_id x : i32
    %pid_n = tt.get_program_id y : i32
    %c0_i32 = arith.constant 0 : i32
    %c1_i32 = arith.constant 1 : i32
    %c8_i32 = arith.constant 8 : i32
    %a0 = tt.splat %A_ptr : !tt.ptr<bf16> -> tensor<64x64x!tt.ptr<bf16>>
    %a1 = tt.addptr %a0, %pid_m : tensor<64x64x!tt.ptr<bf16>>, i32
    %b0 = tt.splat %B_ptr : !tt.ptr<bf16> -> tensor<64x64x!tt.ptr<bf16>>
    %b1 = tt.addptr %b0, %pid_n : tensor<64x64x!tt.ptr<bf16>>, i32
    %c0 = tt.splat %C_ptr : !tt.ptr<bf16> -> tensor<64x64x!tt.ptr<bf16>>
    %mn = arith.addi %pid_m, %pid_n : i32
    %c1 = tt.addptr %c0, %mn : tensor<64x64x!tt.ptr<bf16>>, i32
    scf.for %k = %c0_i32 to %c8_i32 step %c1_i32  : i32 {
      %a = tt.load %a1 : tensor<64x64x!tt.ptr<bf16>>
      %b = tt.load %b1 : tensor<64x64x!tt.ptr<bf16>>
    }
    tt.store %c1, %acc : tensor<64x64x!tt.ptr<bf16>>
    tt.return
  }
}
"""


def test_rereads_a_grid_sweep_apart_miss_the_l2_by_the_share_of_the_sweep_it_cannot_hold():
    ir = triton_price.IR(GEMM_TTIR, {"A_ptr": None, "B_ptr": None, "C_ptr": None})
    assert ir.base("%a1") == "A_ptr" and ir.program_axes(["%a1"]) == {0} and ir.program_axes(["%c1"]) == {0, 1}
    tile = 64 * 64 * 2  # one load: 8 per program
    l2 = 50 << 20

    def extra(gx, gy):
        nbytes = {"A_ptr": gx * 8 * tile, "B_ptr": gy * 8 * tile, "C_ptr": gx * gy * tile}
        return triton_price.sweep_rereads(ir, nbytes, (gx, gy), l2), nbytes

    # A (indexed by x only) is read again one sweep of x later, by each of the gy columns; B (indexed by y only)
    # by the adjacent programs (L2 hits). A sweep touches all of A, one B tile set and one column of C.
    (b, why), nbytes = extra(1024, 16)
    sweep = nbytes["A_ptr"] + 8 * tile + nbytes["C_ptr"] / 16
    assert why == [("A_ptr", "y", 16, sweep, round(l2 / sweep, 3))]
    assert b == pytest.approx(nbytes["A_ptr"] * 15 * (1 - l2 / sweep))
    # a sweep that fits in the L2 leaves every re-read a hit
    assert extra(256, 16)[0] == (0.0, [])
    # one column: nothing is read twice
    assert extra(4096, 1)[0] == (0.0, [])


def test_extern_gemm_tiles_waves_split_k_and_fp32():
    """An extern GEMM's time (``cublas.gemm_time``): the fastest of cuBLAS's large tiles in waves over the SMs at
    ``mma_sustained`` of peak. A shape that fills whole waves costs the flat rate; one whose tiles leave a wave part
    empty costs the whole wave; a few output tiles over a long K split K; fp32 runs at the CUDA cores' rate."""
    import torch

    from costmodel import cublas, model

    m = model.MACHINES["H100-SXM"]
    rate = m.mma_dense_bf16 * m.mma_sustained
    # 132 SMs x 128x256 tiles = 11 x 12 tiles of 128 x 256 -> exactly one wave: the flat rate
    g = cublas.gemm_time(m, 1, 11 * 128, 12 * 256, 4096, torch.bfloat16)
    assert g["time_s"] == pytest.approx(2 * 11 * 128 * 12 * 256 * 4096 / rate)
    assert (g["waves"], g["splits"]) == (1, 1)
    # one more row of 128 -> 144 tiles of 128x256, a second wave for 12 of them; 288 tiles of 128x128 take 3
    # waves of half a 128x256 tile's work: the faster, 1.5 big waves (wave quantization: 1.5 / (144 / 132))
    g = cublas.gemm_time(m, 1, 12 * 128, 12 * 256, 4096, torch.bfloat16)
    assert (g["tile"], g["waves"]) == ("128x128", 3)
    assert g["time_s"] == pytest.approx(3 * 2 * 128 * 128 * 4096 / (rate / m.sms))
    # tile quantization: 129 rows cost as 256 (enough tiles that K is not split)
    assert cublas.gemm_time(m, 1, 129, 32768, 1024, torch.bfloat16)["time_s"] == pytest.approx(
        cublas.gemm_time(m, 1, 256, 32768, 1024, torch.bfloat16)["time_s"]
    )
    # 1024 x 1024 output over K = 65536: 64 tiles of 128x128 -> split K in 2 (128 units, one wave), the fp32
    # partials (2 x 2 x 1024 x 1024 x 4 B, L2-resident) read back
    g = cublas.gemm_time(m, 1, 1024, 1024, 65536, torch.bfloat16)
    assert (g["tile"], g["splits"], g["waves"]) == ("128x128", 2, 1)
    assert g["time_s"] == pytest.approx(2 * 128 * 128 * 32768 / (rate / m.sms) + 16 * 1024 * 1024 / m.l2_bw)
    # never faster than the flat rate; fp32 at the CUDA cores' rate (PyTorch's default: no TF32)
    for shape in ((1024, 128256, 4096), (128256, 2048, 1024), (1024, 2048, 128256), (32, 4096, 128256)):
        t = cublas.gemm_time(m, 1, *shape, torch.bfloat16)["time_s"]
        assert t >= 2 * math.prod(shape) / rate * (1 - 1e-9)
    g32 = cublas.gemm_time(m, 1, 11 * 128, 12 * 256, 4096, torch.float32)
    assert g32["time_s"] == pytest.approx(2 * 11 * 128 * 12 * 256 * 4096 / (m.fp32_simt * m.mma_sustained))
    # price_torch prices an mm by it; dims folds a 2-D right operand's batch into M
    a, b = ((11 * 128, 4096), torch.bfloat16), ((4096, 12 * 256), torch.bfloat16)
    op = recorder.Op(
        "torch", func=torch.ops.aten.mm.default, inputs=(a, b), outputs=(((11 * 128, 12 * 256), torch.bfloat16),)
    )
    p = torch_price.price_torch(op, m)
    assert p["bound"] == "mma" and p["time_s"] == pytest.approx(2 * 11 * 128 * 12 * 256 * 4096 / rate + m.launch_s)
    assert cublas.dims((4, 8, 16), (4, 16, 32)) == (4, 8, 32, 16)
    assert cublas.dims((4, 8, 16), (16, 32)) == (1, 32, 32, 16)


def test_the_softmax_backward_is_priced_as_the_two_kernels_pytorch_runs():
    """PyTorch's CUDA softmax backward multiplies grad by output in one kernel and runs the row kernel on the product
    and the output in a second: twice the bytes and two launches; the log-softmax backward is one kernel."""
    import torch

    from costmodel import model

    m = model.MACHINES["H100-SXM"]
    t = ((4096, 4096), torch.float32)
    one = 3 * 4 * 4096 * 4096 / m.dram_copy
    soft = recorder.Op("torch", func=torch.ops.aten._softmax_backward_data.default, inputs=(t, t), outputs=(t,))
    log = recorder.Op("torch", func=torch.ops.aten._log_softmax_backward_data.default, inputs=(t, t), outputs=(t,))
    assert torch_price.price_torch(soft, m)["time_s"] == pytest.approx(2 * one + 2 * m.launch_s)
    assert torch_price.price_torch(log, m)["time_s"] == pytest.approx(one + m.launch_s)
