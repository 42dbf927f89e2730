"""``--schedule zb-h1 | zb-v`` in the trainer's settings, the dry run, the configuration files and ``megakernels plan``:
the bad combinations are refused naming the flags, the V places its chunks and layers as the docs say, and the plan
ranks the zero-bubble layouts with commands that ``megakernels train`` accepts. (That they train to the single
process's losses, and that their checkpoints load at other layouts: tests/models/test_layouts.py.)"""

from __future__ import annotations

import json
import shlex

import pytest

from megakernels_models.arguments import ArgumentError, validate
from megakernels_models.cli import main, parse_train_args
from megakernels_models.models.config import preset, stage_layers, stage_times
from megakernels_models.planning import costs, plan


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--schedule", "zb-v"], r"--schedule zb-v needs pipeline parallelism \(--pp > 1\)"),
        (
            ["--schedule", "zb-v", "--pp", "2", "--vpp", "4", "--nproc", "2"],
            r"--schedule zb-v places two model chunks on every pipeline rank .* --vpp 4 asks for 4: leave --vpp out",
        ),
        (
            ["--schedule", "zb-v", "--pp", "4", "--nproc", "4"],
            r"--schedule zb-v's two chunks per rank × --pp = 2 × 4 = 8 does not divide num_layers=4",
        ),
        (
            ["--schedule", "zb-h1", "--pp", "2", "--vpp", "2", "--nproc", "2"],
            r"--schedule zb-h1 runs one model chunk per pipeline rank; --vpp 2 interleaves",
        ),
        (
            ["--schedule", "zb-h1", "--pp", "2", "--nproc", "4", "--fsdp"],
            r"--schedule zb-h1 computes weight gradients in later passes .* --fsdp \(FSDP\)",
        ),
        (
            ["--schedule", "zb-v", "--pp", "2", "--nproc", "4", "--zero", "2", "--num-layers", "8"],
            r"--schedule zb-v .* --zero 2 \(FSDP\)",
        ),
        (["--schedule", "zb-x"], r"--schedule must be one of 1f1b, gpipe, zb-h1, zb-v"),
    ],
)
def test_bad_zero_bubble_settings_name_the_flags(flags, message):
    with pytest.raises((ArgumentError, SystemExit)) as e:
        validate(parse_train_args(flags))
    if e.type is ArgumentError:
        assert __import__("re").search(message, str(e.value)), str(e.value)


def test_zb_v_takes_any_number_of_microbatches_and_recomputation():
    # interleaving needs the micro-batches in groups of pp; the V does not
    args = parse_train_args(
        ["--schedule", "zb-v", "--pp", "2", "--nproc", "2", "--global-batch-size", "6", "--micro-batch-size", "2"]
    )
    validate(args)
    assert (args.pipeline_chunks(), args.pipeline_placement(), args.num_microbatches()) == (2, "v", 3)
    validate(parse_train_args(["--schedule", "zb-h1", "--pp", "2", "--nproc", "2", "--recompute", "full"]))


def test_the_v_places_chunk_r_and_2p_minus_1_minus_r_with_global_layer_numbers():
    assert stage_layers(8, 4, 2, "v") == [
        [range(0, 1), range(7, 8)],
        [range(1, 2), range(6, 7)],
        [range(2, 3), range(5, 6)],
        [range(3, 4), range(4, 5)],
    ]
    assert stage_layers(8, 2, 2) == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]  # interleaved: as before


def test_stage_times_split_the_backward():
    t_f, t_b, t_w = stage_times(preset("gpt-1.3b"))
    assert t_f == 1.0 and t_b == 2.0 and 0.7 < t_w < 0.9  # the blocks' linears: most of a GPT's FLOPs
    assert stage_times(preset("gpt-1.3b"), "full")[1] > 2.9  # recomputation adds a forward to backward


def _dry(flags):
    from megakernels_models.planning.dryrun import report

    lines = []
    rep = report(parse_train_args([*flags, "--dry-run"]), out=lines.append)
    return rep, "\n".join(lines)


def test_the_dry_run_reports_the_schedule_its_bubble_and_memory():
    base = ["--preset", "gpt-8.3b", "--pp", "4", "--nproc", "4", "--global-batch-size", "16", "--micro-batch-size", "1"]
    one, _ = _dry(base)
    h1, text = _dry([*base, "--schedule", "zb-h1"])
    v, vtext = _dry([*base, "--schedule", "zb-v", "--num-layers", "80"])
    assert one["bubble_fraction"] == pytest.approx(3 / 16)
    times = stage_times(preset("gpt-8.3b"))
    assert h1["bubble_fraction"] == pytest.approx(3 * (1 + times[1] - 2 * times[2]) / (16 * (1 + times[1])))
    assert v["bubble_fraction"] < h1["bubble_fraction"] < one["bubble_fraction"]
    assert h1["layout"]["schedule"] == "zb-h1" and "schedule zb-h1" in text
    assert v["layout"]["vpp"] == 2 and "schedule zb-v" in vtext and "W15b" in v["schedule"]
    # every rank holds 1F1B's first-stage peak of micro-batches until their W: as much as 1F1B's worst rank
    assert h1["memory_breakdown_bytes"]["activations"] >= one["memory_breakdown_bytes"]["activations"] * 0.99


def test_a_config_file_takes_the_schedule(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("preset: gpt-tiny\npp: 2\nnproc: 2\nschedule: zb-v\n")
    args = parse_train_args(["--config", str(f)])
    validate(args)
    assert args.schedule == "zb-v"
    f.write_text("preset: gpt-tiny\nschedule: zb-w\n")
    with pytest.raises(ArgumentError, match="schedule: expected one of 1f1b, gpipe, zb-h1, zb-v, got 'zb-w'"):
        parse_train_args(["--config", str(f)])


def test_plan_ranks_zero_bubble_layouts_and_its_json_carries_the_schedule(capsys, monkeypatch):
    cfg = preset("llama3-8b")
    layouts = plan.candidates(cfg, 16, 128, gpus_per_node=8)
    schedules = {(L.schedule, L.vpp) for L in layouts if L.pp > 1}
    assert {("zb-h1", 1), ("zb-v", 2), ("1f1b", 1), ("1f1b", 2)} <= schedules
    assert main(["plan", "--preset", "llama3-8b", "--gpus", "16", "--top", "40", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["ranking"]
    zb = [r for r in rows if r["layout"]["schedule"] in ("zb-h1", "zb-v")]
    assert zb, [r["layout"]["schedule"] for r in rows]
    monkeypatch.setenv("WORLD_SIZE", "16")
    for row in zb:
        words = shlex.split(row["command"])
        assert words[words.index("--schedule") + 1] == row["layout"]["schedule"]
        assert "--vpp" not in words
        validate(parse_train_args([*words[words.index("train") + 1 :], "--dry-run"]))
    assert main(["plan", "--preset", "llama3-8b", "--gpus", "16", "--top", "3"]) == 0
    assert "schedule" in capsys.readouterr().out


def test_every_zero_bubble_layout_plan_considers_is_accepted_by_train(monkeypatch):
    """As tests/models/test_plan.py does for the degrees: each (degrees, schedule) the planner enumerates for a few
    presets, as the command it prints, passes megakernels train's validation."""
    checked = 0
    for name in ("gpt-1.3b", "llama3-8b", "mixtral-8x7b", "bert-336m"):
        seen = set()
        for layout in plan.candidates(preset(name), 16, 128, gpus_per_node=8):
            key = (layout.tp, layout.pp, layout.cp, layout.ep, layout.vpp, layout.schedule)
            if layout.schedule == "1f1b" or key in seen:
                continue
            seen.add(key)
            words = shlex.split(plan.command(layout, ["--preset", name]))
            monkeypatch.setenv("WORLD_SIZE", "16")
            validate(parse_train_args([*words[words.index("train") + 1 :], "--dry-run"]))
            checked += 1
    assert checked > 8


def test_the_planners_memory_puts_the_v_ends_on_rank_0():
    meta = costs.MetaModel(preset("llama3-8b"))
    one = costs.Layout(tp=2, pp=4, vpp=1, micro_batch_size=1, global_batch_size=32)
    v = costs.Layout(tp=2, pp=4, vpp=2, schedule="zb-v", micro_batch_size=1, global_batch_size=32)
    p1 = costs.params_per_stage(meta, 2, 4, 1, 1)
    pv = costs.params_per_stage(meta, 2, 4, 2, 1, placement="v")
    assert sum(p1) == sum(pv) and pv[0] == max(pv) and pv[0] > p1[0]  # embedding and output layer on rank 0
    assert costs.memory(meta, v)["worst"] == 0
    assert (
        costs.predict(meta, v, costs.DEVICES["h200"])["bubble_fraction"]
        < costs.predict(meta, one, costs.DEVICES["h200"])["bubble_fraction"]
    )
