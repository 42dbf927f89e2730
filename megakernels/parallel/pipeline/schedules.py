"""Pipeline schedules as data: the order of work on each rank, a timeline simulator and a text printout.

A model of ``S = pp · vpp`` virtual stages runs on ``pp`` ranks; virtual stage ``k = chunk · pp + rank`` (Megatron's
assignment: rank r holds chunks r, r+pp, r+2pp, ... of the layer stack). Each rank's work is a list of
``("F" | "B", chunk, microbatch)``; the cross-stage dependencies are

    F(k, j) after F(k-1, j)            B(k, j) after B(k+1, j) and F(k, j)      (the last stage's B only after its F)

Schedules (``m`` micro-batches, ``p`` ranks, ``v`` chunks per rank, ``t_f``/``t_b`` a full stage's forward/backward):

- ``gpipe``        every forward, then every backward. Bubble ``(p-1)/m``; holds the activations of all ``m``
                   micro-batches at once.
- ``1f1b``         PipeDream-flush (Narayanan et al. 2021): rank r warms up with ``p-r-1`` forwards, then alternates
                   one forward and one backward, then drains the backwards. Same bubble as gpipe, but at most
                   ``p - r`` micro-batches in flight on rank r.
- ``interleaved``  1F1B over ``v`` chunks per rank, micro-batches taken in groups of ``p`` (so ``m % p == 0``);
                   a chunk costs ``1/v`` of a stage, so the bubble shrinks to ``(p-1)/(v·m)`` at the price of
                   ``v`` times as many point-to-point messages. With ``v == 1`` it is ``1f1b``.
- ``forward_only`` evaluation: the forwards alone (in the interleaved grouping when ``v > 1``; any ``m``).

The executor lives in ``executor.py``; this module needs no process group.
``python -m megakernels.parallel.pipeline.schedules --pp 4 --microbatches 8 [--vpp 2]`` prints one.
"""

from __future__ import annotations

import argparse
import fractions
import itertools
import math
from typing import NamedTuple

from megakernels.validation import positive_int

SCHEDULES = ("gpipe", "1f1b", "interleaved", "forward_only")

Op = tuple[str, int, int]  # ("F" | "B", chunk, microbatch)


def _positive(fn: str, name: str, value) -> int:
    return positive_int(value, name, where=fn)


def _check(fn: str, name: str, pp_size: int, num_microbatches: int, vpp: int, vpp_arg: str = "vpp") -> None:
    if name not in SCHEDULES:
        raise ValueError(f"{fn}: name must be one of {', '.join(SCHEDULES)}, got {name!r}")
    _positive(fn, "pp_size", pp_size)
    _positive(fn, "num_microbatches", num_microbatches)
    _positive(fn, vpp_arg, vpp)
    if vpp > 1 and name in ("gpipe", "1f1b"):
        raise ValueError(
            f"{fn}: schedule {name!r} runs one model chunk per rank, got {vpp_arg}={vpp}; use "
            "'interleaved' for virtual pipeline stages"
        )
    if vpp > 1 and name == "interleaved" and num_microbatches % pp_size:
        raise ValueError(
            f"{fn}: the interleaved schedule needs num_microbatches divisible by pp_size (micro-batches "
            f"go through the chunks in groups of pp_size), got num_microbatches={num_microbatches}, "
            f"pp_size={pp_size}"
        )


def _interleaved_op(kind: str, k: int, pp: int, m: int, vpp: int) -> Op:
    """The k-th forward (or backward) of a rank in the interleaved order: groups of ``pp`` micro-batches go through
    chunk 0, 1, ..., vpp-1 (backwards: vpp-1, ..., 0); the last group may be smaller (forward_only only)."""
    group, within = divmod(k, pp * vpp)
    chunk, offset = divmod(within, min(pp, m - group * pp))
    if kind == "B":
        chunk = vpp - 1 - chunk
    return kind, chunk, group * pp + offset


def schedule_order(name: str, pp_size: int, pp_rank: int, num_microbatches: int, vpp: int = 1) -> list[Op]:
    """The work of rank ``pp_rank`` under schedule ``name``, in execution order.

    Returns:
        A list of ``("F" | "B", chunk, microbatch)`` with ``chunk`` in ``0..vpp-1`` and ``microbatch`` in
        ``0..num_microbatches-1``: every (chunk, micro-batch) forward once and, unless ``forward_only``, its
        backward once, after it.

    Raises:
        ValueError: an unknown ``name``; ``pp_size``, ``num_microbatches`` or ``vpp`` not a positive int;
            ``pp_rank`` outside ``0..pp_size-1``; ``vpp > 1`` with ``gpipe`` or ``1f1b``; ``interleaved`` with
            ``vpp > 1`` and ``num_microbatches`` not divisible by ``pp_size``.
    """
    _check("schedule_order", name, pp_size, num_microbatches, vpp)
    if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or not 0 <= pp_rank < pp_size:
        raise ValueError(f"schedule_order: pp_rank must be in 0..{pp_size - 1}, got {pp_rank!r}")
    p, r, m = pp_size, pp_rank, num_microbatches
    if name == "gpipe":
        return [("F", 0, j) for j in range(m)] + [("B", 0, j) for j in range(m)]
    if name == "forward_only":
        return [_interleaved_op("F", k, p, m, vpp) for k in range(m * vpp)]
    if name == "1f1b" or vpp == 1:
        warmup = min(p - r - 1, m)
        forwards, backwards = [("F", 0, j) for j in range(m)], [("B", 0, j) for j in range(m)]
    else:
        # Rank r runs ahead by two forwards per later rank (one for the activation to reach the last rank, one for
        # the gradient to come back), plus a full round of the first v-1 chunks.
        total = m * vpp
        warmup = min((p - r - 1) * 2 + (vpp - 1) * p, total)
        forwards = [_interleaved_op("F", k, p, m, vpp) for k in range(total)]
        backwards = [_interleaved_op("B", k, p, m, vpp) for k in range(total)]
    order = forwards[:warmup]
    for i in range(len(forwards) - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[len(forwards) - warmup :]


def _timeline(name: str, p: int, m: int, vpp: int, duration: dict) -> list[list]:
    """Every rank's ops as ``(start, end, op)``: each starts as soon as its rank is free and its inputs exist."""
    orders = [schedule_order(name, p, r, m, vpp) for r in range(p)]
    last = p * vpp - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> finish time
    clock, pos = [0] * p, [0] * p
    timeline: list[list] = [[] for _ in range(p)]
    while any(pos[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, c, j = orders[r][pos[r]]
                k = c * p + r
                deps = [("F", k - 1, j)] if kind == "F" and k > 0 else []
                if kind == "B":
                    deps = [("F", k, j)] + ([("B", k + 1, j)] if k < last else [])
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = done[(kind, k, j)] = start + duration[kind]
                timeline[r].append((start, clock[r], (kind, c, j)))
                pos[r] += 1
                progressed = True
        if not progressed:  # cannot happen for the schedules above; guards edits to them
            raise RuntimeError(f"schedule {name!r} deadlocks at positions {pos}")
    return timeline


class Exchange(NamedTuple):
    """One ``batch_isend_irecv`` call between compute steps; each field names the op whose tensor travels, or None.

    ``send_next``: the output of this rank's ``F`` to the next rank. ``send_prev``: the input gradient of its ``B``
    to the previous rank. ``recv_prev``: the input of a later ``F`` from the previous rank. ``recv_next``: the output
    gradient of a later ``B`` from the next rank.
    """

    send_next: Op | None = None
    send_prev: Op | None = None
    recv_prev: Op | None = None
    recv_next: Op | None = None


def communication_plan(
    name: str, pp_size: int, pp_rank: int, num_microbatches: int, vpp: int = 1
) -> list[Op | Exchange]:
    """``schedule_order`` with the point-to-point exchanges between its compute steps.

    The plan is lock-step: run all ranks' orders with every op taking one tick (``_timeline``); a tensor made at
    tick t is sent at t, and its receiver posts the receive at its own exchange of tick t, whenever it will use the
    tensor. Each exchange thus holds exactly the sends and receives that cross between this rank and its
    neighbours at one point of the schedule (the NCCL rule of ``p2p.py``), at most one message per direction and
    neighbour. Induction over ticks shows that even blocking, unbuffered messages cannot deadlock: the exchanges
    of tick t wait only for each other, and every rank reaches them having finished its exchanges of earlier
    ticks; the tests replay all ranks' plans that way. Empty exchanges are left out.

    Returns:
        The ops of ``schedule_order`` with ``Exchange`` entries between them (none when ``pp_size == 1``).

    Raises:
        ValueError: as ``schedule_order``, or ``vpp > 1`` with ``pp_size == 1`` (chunks would send to themselves).
    """
    order = schedule_order(name, pp_size, pp_rank, num_microbatches, vpp)
    if pp_size == 1 and vpp > 1:
        raise ValueError(f"communication_plan: vpp={vpp} needs pipeline parallelism (pp_size > 1)")
    if pp_size == 1:
        return list(order)
    p, last = pp_size, pp_size * vpp - 1
    ticks = _timeline(name, p, num_microbatches, vpp, {"F": 1, "B": 1})
    exchanges: dict[int, dict] = {}  # tick -> fields of this rank's exchange
    for q, row in enumerate(ticks):
        for _, tick, (kind, c, j) in row:
            k = c * p + q
            if kind == "F" and k < last:  # the activation goes to virtual stage k + 1
                dest, field, op = (k + 1) % p, "recv_prev", ("F", (k + 1) // p, j)
            elif kind == "B" and k > 0:  # the input gradient goes to virtual stage k - 1
                dest, field, op = (k - 1) % p, "recv_next", ("B", (k - 1) // p, j)
            else:
                continue
            if q == pp_rank:
                exchanges.setdefault(tick, {})["send_next" if kind == "F" else "send_prev"] = (kind, c, j)
            if dest == pp_rank:
                exchanges.setdefault(tick, {})[field] = op
    plan: list[Op | Exchange] = []
    for start, _, op in ticks[pp_rank] + [(max(exchanges, default=0) + 1, None, None)]:
        plan += [Exchange(**exchanges.pop(t)) for t in sorted(exchanges) if t <= start]
        if op is not None:
            plan.append(op)
    return plan


def bubble_fraction(name: str, pp: int, m: int, vpp: int = 1) -> float:
    """The paper's bubble fraction, idle time over useful time: ``(pp-1)/m`` for gpipe and 1f1b, ``(pp-1)/(vpp·m)``
    for interleaved (chunks cost ``1/vpp`` of a stage), and for forward_only unless ``m % pp != 0`` (then
    ``(pp-1)/m``). Raises ValueError as ``schedule_order``."""
    _check("bubble_fraction", name, pp, m, vpp)
    # forward_only's last, partial group of micro-batches (m % pp != 0) passes each chunk alone: no gain from vpp.
    interleaved = name == "interleaved" or (name == "forward_only" and m % pp == 0)
    return (pp - 1) / (m * (vpp if interleaved else 1))


def simulate(
    name: str, pp_size: int, num_microbatches: int, vpp: int = 1, t_forward: float = 1.0, t_backward: float = 2.0
) -> dict:
    """Run every rank's ``schedule_order`` against the cross-stage dependencies, communication taking no time.

    ``t_forward`` / ``t_backward`` are one micro-batch's forward / backward through a rank's whole share of the
    model, so one chunk takes ``1/vpp`` of them.

    Returns:
        ``{"total_time", "useful_time"`` (busy time of each rank, ``m·(t_f+t_b)``, forwards only for
        forward_only), ``"idle_time"`` (per rank: total - useful), ``"bubble_fraction"`` (mean idle / useful),
        ``"peak_in_flight"`` (per rank: most (chunk, micro-batch) forwards whose backward has not run; 1 for
        forward_only),
        ``"peak_activations"`` (the same in micro-batches through a whole rank's layers, ``/ vpp``),
        ``"timeline"`` (per rank: ``(start, end, op)``) and the arguments ``}``.

    Raises:
        ValueError: as ``schedule_order``, or a duration that is not positive.
    """
    _check("simulate", name, pp_size, num_microbatches, vpp)
    for arg, value in (("t_forward", t_forward), ("t_backward", t_backward)):
        if not value > 0:
            raise ValueError(f"simulate: {arg} must be positive, got {value!r}")
    p, m = pp_size, num_microbatches
    timeline = _timeline(name, p, m, vpp, {"F": t_forward / vpp, "B": t_backward / vpp})
    # Activations live from a forward to its backward; forward_only keeps one chunk's at a time.
    peak = [
        1
        if name == "forward_only"
        else max(itertools.accumulate(1 if kind == "F" else -1 for _, _, (kind, _, _) in row))
        for row in timeline
    ]
    total = max(row[-1][1] for row in timeline)
    useful = m * (t_forward + (0.0 if name == "forward_only" else t_backward))
    idle = [total - useful for _ in range(p)]
    return {
        "schedule": name,
        "pp": p,
        "microbatches": m,
        "vpp": vpp,
        "total_time": total,
        "useful_time": useful,
        "idle_time": idle,
        "bubble_fraction": sum(idle) / p / useful,
        "peak_in_flight": peak,
        "peak_activations": [x / vpp for x in peak],
        "timeline": timeline,
    }


def _slot(*durations: float) -> fractions.Fraction:
    parts = [fractions.Fraction(d).limit_denominator(1000) for d in durations]
    return fractions.Fraction(math.gcd(*(f.numerator for f in parts)), math.lcm(*(f.denominator for f in parts)))


def format_schedule(
    name: str, pp_size: int, num_microbatches: int, vpp: int = 1, t_forward: float = 1.0, t_backward: float = 2.0
) -> str:
    """The simulated timeline as text: one row per rank, one cell per time slot (the largest unit dividing both
    durations), ``F3`` / ``B3`` for micro-batch 3 (``F3b``: chunk 1 with ``vpp > 1``), ``.`` for idle; then the
    bubble fraction (simulated and closed form) and the peak in-flight micro-batches. Raises as ``simulate``."""
    sim = simulate(name, pp_size, num_microbatches, vpp, t_forward, t_backward)
    unit = _slot(t_forward / vpp, t_backward / vpp)

    def label(op: Op) -> str:
        kind, c, j = op
        return f"{kind}{j}" + (chr(ord("a") + c) if vpp > 1 else "")

    width = max(len(label(op)) for row in sim["timeline"] for _, _, op in row)
    slots = round(fractions.Fraction(sim["total_time"]).limit_denominator(1000) / unit)
    lines = [
        f"schedule {name}: pp={pp_size}, microbatches={num_microbatches}, vpp={vpp}, "
        f"t_forward={t_forward:g}, t_backward={t_backward:g} (one slot = {float(unit):g})"
    ]
    for r, row in enumerate(sim["timeline"]):
        cells = ["." * width] * slots
        for start, end, op in row:
            first = round(fractions.Fraction(start).limit_denominator(1000) / unit)
            last = round(fractions.Fraction(end).limit_denominator(1000) / unit)
            for s in range(first, last):
                cells[s] = label(op).ljust(width)
        lines.append(f"rank {r} | " + " ".join(cells))
    if vpp > 1:
        lines.append("chunks: " + ", ".join(f"{chr(ord('a') + c)} = chunk {c}" for c in range(vpp)))
    closed = bubble_fraction(name, pp_size, num_microbatches, vpp)
    lines.append(
        f"bubble fraction {sim['bubble_fraction']:.4f} (closed form {closed:.4f}); total time "
        f"{sim['total_time']:g}, useful {sim['useful_time']:g} per rank"
    )
    lines.append("peak in-flight micro-batches per rank: " + " ".join(f"{x:g}" for x in sim["peak_activations"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Print a pipeline schedule's timeline and bubble fraction.")
    parser.add_argument("--pp", type=int, required=True, help="pipeline-parallel size (ranks)")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per rank (interleaving)")
    parser.add_argument(
        "--schedule", choices=SCHEDULES, default=None, help="default: interleaved when --vpp > 1, else 1f1b"
    )
    parser.add_argument("--t-forward", type=float, default=1.0, help="forward time of a whole stage")
    parser.add_argument("--t-backward", type=float, default=2.0, help="backward time of a whole stage")
    args = parser.parse_args(argv)
    schedule = args.schedule or ("interleaved" if args.vpp > 1 else "1f1b")
    try:
        print(format_schedule(schedule, args.pp, args.microbatches, args.vpp, args.t_forward, args.t_backward))
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
