"""Pipeline schedules as data: per-rank orders, the timeline simulator against the papers' bubble fractions and
activation memory, the exchanges between stages replayed with blocking messages, the printout and the errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megakernels.parallel.pipeline.schedules import (
    SCHEDULES,
    Exchange,
    bubble_fraction,
    communication_plan,
    format_schedule,
    main,
    schedule_order,
    simulate,
)


def _cases(schedules=SCHEDULES, pps=(2, 4), vpps=(1, 2)):
    """(name, p, m, v) for p in pps, m in {p, 2p, 4p+1} where the schedule allows it, v in vpps."""
    for name in schedules:
        for p in pps:
            for v in vpps:
                if v > 1 and name in ("gpipe", "1f1b"):
                    continue
                for m in (p, 2 * p, 4 * p + 1):
                    if not (name == "interleaved" and v > 1 and m % p):
                        yield name, p, m, v


def F(c, j):
    return ("F", c, j)


def B(c, j):
    return ("B", c, j)


# ---- orders ----------------------------------------------------------------------------------------------------


def test_gpipe_runs_every_forward_then_every_backward():
    assert schedule_order("gpipe", 4, 2, 3) == [F(0, 0), F(0, 1), F(0, 2), B(0, 0), B(0, 1), B(0, 2)]


def test_1f1b_warms_up_with_pp_minus_rank_minus_one_forwards():
    assert schedule_order("1f1b", 4, 1, 6) == [
        F(0, 0),
        F(0, 1),
        F(0, 2),
        B(0, 0),
        F(0, 3),
        B(0, 1),
        F(0, 4),
        B(0, 2),
        F(0, 5),
        B(0, 3),
        B(0, 4),
        B(0, 5),
    ]
    assert schedule_order("1f1b", 4, 3, 2) == [F(0, 0), B(0, 0), F(0, 1), B(0, 1)]
    # Fewer micro-batches than the warm-up wants: all forwards first.
    assert schedule_order("1f1b", 4, 0, 2) == [F(0, 0), F(0, 1), B(0, 0), B(0, 1)]


@pytest.mark.parametrize("p, m", [(2, 1), (4, 4), (4, 9), (8, 3)])
def test_1f1b_keeps_pp_minus_rank_microbatches_in_flight(p, m):
    for r in range(p):
        order = schedule_order("1f1b", p, r, m)
        assert order[: min(p - r, m)] == [F(0, j) for j in range(min(p - r, m))]  # warm-up + first steady F
        assert simulate("1f1b", p, m)["peak_in_flight"][r] == min(p - r, m)


def test_interleaved_takes_microbatches_in_groups_of_pp_through_the_chunks():
    assert schedule_order("interleaved", 2, 0, 4, vpp=2) == [
        F(0, 0),
        F(0, 1),
        F(1, 0),
        F(1, 1),  # warm-up: 2·(p-r-1) + (v-1)·p
        F(0, 2),
        B(1, 0),
        F(0, 3),
        B(1, 1),
        F(1, 2),
        B(0, 0),
        F(1, 3),
        B(0, 1),  # steady 1F1B
        B(1, 2),
        B(1, 3),
        B(0, 2),
        B(0, 3),
    ]  # cool-down
    assert schedule_order("interleaved", 2, 1, 4, vpp=2)[:4] == [F(0, 0), F(0, 1), F(1, 0), B(1, 0)]


def test_interleaved_with_one_chunk_is_1f1b():
    assert schedule_order("interleaved", 4, 1, 7, vpp=1) == schedule_order("1f1b", 4, 1, 7)


def test_forward_only_runs_forwards_in_the_interleaved_grouping_for_any_microbatch_count():
    assert schedule_order("forward_only", 4, 0, 3) == [F(0, 0), F(0, 1), F(0, 2)]
    assert schedule_order("forward_only", 2, 1, 3, vpp=2) == [F(0, 0), F(0, 1), F(1, 0), F(1, 1), F(0, 2), F(1, 2)]


@pytest.mark.parametrize("name, p, m, v", list(_cases(pps=(2, 3, 4), vpps=(1, 2, 3))))
def test_every_op_runs_once_and_backward_after_its_forward(name, p, m, v):
    for r in range(p):
        order = schedule_order(name, p, r, m, v)
        forwards = [op for op in order if op[0] == "F"]
        assert sorted(forwards) == [F(c, j) for c in range(v) for j in range(m)]
        backwards = [op for op in order if op[0] == "B"]
        assert sorted(backwards) == ([] if name == "forward_only" else [B(c, j) for c in range(v) for j in range(m)])
        assert all(order.index(F(*op[1:])) < i for i, op in enumerate(order) if op[0] == "B")


# ---- simulator -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, p, m, v", list(_cases()))
def test_simulated_bubble_fraction_is_the_closed_form(name, p, m, v):
    sim = simulate(name, p, m, v)
    assert sim["bubble_fraction"] == pytest.approx(bubble_fraction(name, p, m, v), abs=1e-12)
    assert sim["idle_time"] == pytest.approx([sim["total_time"] - sim["useful_time"]] * p)


@pytest.mark.parametrize(
    "p, m, v, expected", [(4, 8, 1, 3 / 8), (4, 8, 2, 3 / 16), (2, 4, 2, 1 / 8), (4, 17, 1, 3 / 17)]
)
def test_bubble_fraction_values_from_the_paper(p, m, v, expected):
    assert bubble_fraction("interleaved" if v > 1 else "1f1b", p, m, v) == pytest.approx(expected)


def test_total_time_is_microbatches_plus_pp_minus_one_stage_times():
    assert simulate("1f1b", 4, 8)["total_time"] == pytest.approx((8 + 3) * 3.0)
    assert simulate("gpipe", 4, 8, t_forward=1.0, t_backward=1.0)["total_time"] == pytest.approx((8 + 3) * 2.0)
    assert simulate("interleaved", 4, 8, 2)["total_time"] == pytest.approx(8 * 3.0 + 3 * 3.0 / 2)


@pytest.mark.parametrize("p, m", [(2, 5), (4, 9)])
def test_gpipe_holds_every_microbatch_and_1f1b_at_most_pp(p, m):
    assert simulate("gpipe", p, m)["peak_in_flight"] == [m] * p
    assert max(simulate("1f1b", p, m)["peak_in_flight"]) == p


def test_interleaved_holds_chunks_of_the_warm_up_plus_one():
    p, v = 4, 2
    sim = simulate("interleaved", p, 4 * p, v)
    assert sim["peak_in_flight"] == [2 * (p - r - 1) + (v - 1) * p + 1 for r in range(p)]
    assert sim["peak_activations"] == [x / v for x in sim["peak_in_flight"]]


# ---- exchanges between stages ----------------------------------------------------------------------------------


def _messages(p: int, r: int, ex: Exchange):
    """(send | recv, peer, message) of one exchange; a message is (act | grad, producing virtual stage, mb)."""
    out = []
    for field, op in zip(Exchange._fields, ex):
        if op is not None:
            kind, c, j = op
            k = c * p + r
            out.append(
                {
                    "send_next": ("send", (r + 1) % p, ("act", k, j)),
                    "send_prev": ("send", (r - 1) % p, ("grad", k, j)),
                    "recv_prev": ("recv", (r - 1) % p, ("act", k - 1, j)),
                    "recv_next": ("recv", (r + 1) % p, ("grad", k + 1, j)),
                }[field]
            )
    return out


def replay_blocking(plans: list[list]) -> None:
    """Run every rank's exchanges with NCCL's worst case: a rank waits for all of an exchange before its next one,
    and an operation completes only once the peer has posted its match (no buffering); the k-th message from a to
    b matches b's k-th receive from a, and must be the same tensor. Raises AssertionError on a deadlock or a
    mismatch."""
    p = len(plans)
    exchanges = [[s for s in plan if isinstance(s, Exchange)] for plan in plans]
    sent, received = {}, {}
    for r in range(p):
        for e, ex in enumerate(exchanges[r]):
            for direction, peer, msg in _messages(p, r, ex):
                pair = (r, peer) if direction == "send" else (peer, r)
                (sent if direction == "send" else received).setdefault(pair, []).append((r, e, msg))
    assert sent.keys() == received.keys()
    waits: dict[tuple[int, int], list] = {}  # (rank, exchange) -> (peer, exchange) its operations need posted
    for pair, sends in sent.items():
        recvs = received[pair]
        assert [m for *_, m in sends] == [m for *_, m in recvs], f"messages {pair} out of order"
        for (a, ea, _), (b, eb, _) in zip(sends, recvs):
            waits.setdefault((a, ea), []).append((b, eb))
            waits.setdefault((b, eb), []).append((a, ea))
    pos = [0] * p
    while any(pos[r] < len(exchanges[r]) for r in range(p)):
        ready = [
            r
            for r in range(p)
            if pos[r] < len(exchanges[r]) and all(pos[b] >= eb for b, eb in waits.get((r, pos[r]), []))
        ]
        assert ready, f"deadlock with ranks at exchanges {pos}"
        for r in ready:
            pos[r] += 1


@pytest.mark.parametrize("name, p, m, v", list(_cases(pps=(2, 3, 4), vpps=(1, 2, 3))))
def test_exchanges_cannot_deadlock_even_with_unbuffered_blocking_messages(name, p, m, v):
    plans = [communication_plan(name, p, r, m, v) for r in range(p)]
    replay_blocking(plans)
    for r, plan in enumerate(plans):
        assert [s for s in plan if not isinstance(s, Exchange)] == schedule_order(name, p, r, m, v)
        received = set()
        for step in plan:
            if isinstance(step, Exchange):
                assert sum(x is not None for x in step[:2]) <= 1  # one op's output per exchange
                received |= {op for op in step[2:] if op is not None}
                continue
            kind, c, _ = step
            k = c * p + r
            assert (step in received) == (k > 0 if kind == "F" else k < p * v - 1), step


def test_replay_finds_the_send_then_receive_deadlock():
    plans = [
        [F(0, 0), Exchange(send_next=F(0, 0)), Exchange(recv_next=B(0, 0)), B(0, 0)],
        [Exchange(recv_prev=F(0, 0)), F(0, 0), B(0, 0), Exchange(send_prev=B(0, 0))],
    ]
    replay_blocking(plans)
    # Both neighbours send first and receive in a second call: NCCL hangs; the replay must say so.
    plans = [
        [F(0, 0), Exchange(send_next=F(0, 0)), Exchange(recv_next=B(0, 0)), B(0, 0)],
        [Exchange(send_prev=B(0, 0)), Exchange(recv_prev=F(0, 0)), F(0, 0), B(0, 0)],
    ]
    with pytest.raises(AssertionError, match="deadlock"):
        replay_blocking(plans)


def test_single_stage_has_no_exchanges():
    assert communication_plan("1f1b", 1, 0, 3) == schedule_order("1f1b", 1, 0, 3)


# ---- printout --------------------------------------------------------------------------------------------------


def test_format_schedule_prints_a_row_per_rank_and_the_bubble():
    text = format_schedule("1f1b", 2, 3)
    assert text.splitlines()[1:] == [
        "rank 0 | F0 F1 .. .. B0 B0 F2 B1 B1 .. B2 B2",
        "rank 1 | .. F0 B0 B0 F1 B1 B1 F2 B2 B2 .. ..",
        "bubble fraction 0.3333 (closed form 0.3333); total time 12, useful 9 per rank",
        "peak in-flight micro-batches per rank: 2 1",
    ]
    assert "F3b" in format_schedule("interleaved", 2, 4, 2) and "b = chunk 1" in format_schedule("interleaved", 2, 4, 2)


def test_command_line_defaults_to_interleaved_with_vpp(capsys):
    assert main(["--pp", "4", "--microbatches", "8", "--vpp", "2"]) == 0
    assert "schedule interleaved" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--pp", "4", "--microbatches", "6", "--vpp", "2"])
    assert "divisible by pp_size" in capsys.readouterr().err


def test_runs_as_a_module_without_warnings():
    out = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            "-m",
            "megakernels.parallel.pipeline.schedules",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "--schedule",
            "gpipe",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.splitlines()[1] == "rank 0 | F0 F1 .. .. .. B0 B0 B1 B1"


# ---- errors ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: schedule_order("zb", 2, 0, 4), "name must be one of gpipe, 1f1b, interleaved, forward_only"),
        (lambda: schedule_order("1f1b", 0, 0, 4), "pp_size must be a positive int, got 0"),
        (lambda: schedule_order("1f1b", 2, 2, 4), r"pp_rank must be in 0..1, got 2"),
        (lambda: schedule_order("1f1b", 2, 0, 0), "num_microbatches must be a positive int, got 0"),
        (lambda: schedule_order("gpipe", 2, 0, 4, vpp=0), "vpp must be a positive int, got 0"),
        (lambda: schedule_order("1f1b", 2, 0, 4, vpp=2), "schedule '1f1b' runs one model chunk per rank, got vpp=2"),
        (
            lambda: schedule_order("interleaved", 4, 0, 6, vpp=2),
            "interleaved schedule needs num_microbatches divisible by pp_size .* num_microbatches=6, pp_size=4",
        ),
        (lambda: communication_plan("interleaved", 1, 0, 2, vpp=2), r"vpp=2 needs pipeline parallelism"),
        (lambda: simulate("1f1b", 2, 4, t_backward=0), "t_backward must be positive, got 0"),
        (lambda: bubble_fraction("interleaved", 4, 5, 2), "divisible by pp_size"),
    ],
)
def test_errors_name_the_argument_and_the_rule(call, message):
    with pytest.raises(ValueError, match=message):
        call()
