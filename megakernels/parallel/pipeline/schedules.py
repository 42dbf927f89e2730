"""Pipeline schedules as data: the order of work on each rank, a timeline simulator and a text printout.

A model of ``S = pp · vpp`` virtual stages runs on ``pp`` ranks. Where each stage sits is the schedule's
*placement*:

- ``interleaved`` (every schedule but zb-v): virtual stage ``k = chunk · pp + rank`` (Megatron's assignment: rank r
  holds chunks r, r+pp, r+2pp, ... of the layer stack; with one chunk, stage k on rank k);
- ``v`` (zb-v): two chunks per rank in a V, rank r holding stage r (chunk 0) and stage ``2·pp − 1 − r`` (chunk 1).
  The first and the last stage are both on rank 0; activations go down the ranks through chunk 0 and come back up
  through chunk 1, turning on rank pp−1 without a message (its chunk 0 feeds its chunk 1).

Each rank's work is a list of ``(kind, chunk, microbatch)`` with kind ``"F"`` (forward), ``"B"`` (backward) and,
for the zero-bubble schedules, ``"W"``: their backward is split into B, the input gradient (what the previous stage
waits for), and W, the weight gradient (which nothing waits for), run later where the rank would otherwise idle.
The dependencies (``S`` stages, k the virtual stage):

    F(k, j) after F(k-1, j)        B(k, j) after F(k, j) and B(k+1, j)        W(k, j) after B(k, j), same rank

(the first stage's F and the last stage's B have no neighbour to wait for). In the schedules without W, B is the
whole backward.

Schedules (``m`` micro-batches, ``p`` ranks, ``v`` chunks per rank, ``t_f``/``t_b`` a full stage's forward/backward,
``t_w`` the weight-gradient part of ``t_b``):

- ``gpipe``        every forward, then every backward. Bubble ``(p-1)/m``; holds the activations of all ``m``
                   micro-batches at once.
- ``1f1b``         PipeDream-flush (Narayanan et al. 2021): rank r warms up with ``p-r-1`` forwards, then alternates
                   one forward and one backward, then drains the backwards. Same bubble as gpipe, but at most
                   ``p - r`` micro-batches in flight on rank r.
- ``interleaved``  1F1B over ``v`` chunks per rank, micro-batches taken in groups of ``p`` (so ``m % p == 0``);
                   a chunk costs ``1/v`` of a stage, so the bubble shrinks to ``(p-1)/(v·m)`` at the price of
                   ``v`` times as many point-to-point messages. With ``v == 1`` it is ``1f1b``.
- ``zb-h1``        Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", ICLR 2024), their handcrafted ZB-H1: 1F1B's
                   forwards and input-gradient passes, each rank's W passes delayed so that every rank keeps ``p``
                   micro-batches in flight (1F1B's peak, that of its rank 0); the W passes fill the cool-down. For
                   ``m >= p`` the bubble is ``(p-1)(t_f + T_B - t_w)`` of time, ``T_B = t_b - t_w`` (the paper's
                   ``(p-1)(T_F+T_B-T_W)``): a third of 1F1B's at ``T_F = T_B = T_W``.
- ``zb-v``         the paper's ZB-V on the V placement: two chunks per rank, each rank's order built by a list
                   scheduler that plays the step out with the F, B and W times it is given (``durations``; equal by
                   default): a free rank runs a ready B, else a ready F unless it holds ``2p`` chunk activations
                   (1F1B's peak of ``p`` micro-batches through a rank's layers), else a ready W (``_v_orders``). At
                   ``T_F = T_B = T_W`` and ``m >= p`` its step is the lower bound: the last rank waits ``p-1``
                   chunk forwards for its first input and then never idles, a bubble of ``(p-1)/(6m)``
                   (``(p-1)(t_f/2)`` of time), half of zb-h1's; twice the point-to-point messages of 1F1B.
- ``forward_only`` evaluation: the forwards alone (in the interleaved grouping when ``v > 1``; any ``m``; with
                   ``placement="v"`` in the V, each rank running whichever forward is ready, chunk 1 first).

The bubble counted here is that of one synchronous step: the time from the first op of the step to its last, less
the useful time, over the useful time (every rank's). The zero-bubble paper reports ZB-V (and ZB-H2) as having no
bubble at ``T_F = T_B = T_W``: that counts each rank from its own first op, as when consecutive steps overlap (its
optimizer "post-validation" removes the step's synchronisation); a step that ends with a synchronous optimizer step
(the global gradient norm) cannot hide the last rank's wait for its first input, which no schedule avoids.

The executor lives in ``executor.py``; this module needs no process group.
``python -m megakernels.parallel.pipeline.schedules --pp 4 --microbatches 8 [--vpp 2] [--schedule zb-v]`` prints one.
"""

from __future__ import annotations

import argparse
import fractions
import functools
import heapq
import itertools
import math
from typing import NamedTuple

from megakernels.validation import positive_int

# The schedules whose backward is one pass, on the interleaved placement.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "forward_only")
# The zero-bubble schedules: backward split into B (input gradient) and W (weight gradient).
ZERO_BUBBLE = ("zb-h1", "zb-v")
ALL_SCHEDULES = SCHEDULES + ZERO_BUBBLE
PLACEMENTS = ("interleaved", "v")
ONE_CHUNK = ("gpipe", "1f1b", "zb-h1")  # schedules that run one model chunk per rank
# What ``megakernels train --schedule`` takes (interleaving follows from --vpp; forward_only is evaluation's).
TRAINER_SCHEDULES = ("1f1b", "gpipe", *ZERO_BUBBLE)

Op = tuple[str, int, int]  # ("F" | "B" | "W", chunk, microbatch)


def placement_of(name: str) -> str:
    """The placement schedule ``name`` runs on: ``"v"`` for zb-v, else ``"interleaved"``."""
    return "v" if name == "zb-v" else "interleaved"


def splits_backward(name: str) -> bool:
    """Whether schedule ``name`` splits backward into B (input gradient) and W (weight gradient)."""
    return name in ZERO_BUBBLE


def default_vpp(name: str) -> int:
    """Model chunks per rank when none is given: 2 for zb-v (its V), else 1."""
    return 2 if name == "zb-v" else 1


def virtual_stage(placement: str, pp: int, rank: int, chunk: int, vpp: int) -> int:
    """The virtual stage of ``chunk`` on ``rank`` under ``placement`` (module docstring)."""
    if placement == "v":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def stage_owner(placement: str, pp: int, stage: int, vpp: int) -> tuple[int, int]:
    """``(rank, chunk)`` holding virtual stage ``stage`` under ``placement``."""
    if placement == "v":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


def neighbour_direction(placement: str, pp: int, stage: int) -> int:
    """Which neighbour stage ``stage + 1`` is on, seen from stage ``stage``'s rank: +1 the next rank (wrapping), -1
    the previous one, 0 the same rank (the V's turn)."""
    if placement == "v":
        return 1 if stage < pp - 1 else (0 if stage == pp - 1 else -1)
    return 1


def _positive(fn: str, name: str, value) -> int:
    return positive_int(value, name, where=fn)


def _resolve(fn: str, name: str, vpp, placement) -> tuple[int, str]:
    """``(vpp, placement)`` with the defaults filled in and the placement checked against the schedule."""
    if name not in ALL_SCHEDULES:
        raise ValueError(f"{fn}: name must be one of {', '.join(ALL_SCHEDULES)}, got {name!r}")
    vpp = default_vpp(name) if vpp is None else vpp
    if placement is None:
        placement = placement_of(name)
    elif placement not in PLACEMENTS:
        raise ValueError(f"{fn}: placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    elif name != "forward_only" and placement != placement_of(name):
        raise ValueError(
            f"{fn}: schedule {name!r} runs on the {placement_of(name)!r} placement, got placement={placement!r} "
            "(only forward_only takes either)"
        )
    return vpp, placement


def check_arguments(
    fn: str,
    name: str,
    pp_size: int,
    num_microbatches: int,
    vpp,
    vpp_arg: str = "vpp",
    placement: str | None = None,
) -> tuple[int, str]:
    """Check the arguments of a schedule; returns ``(vpp, placement)`` with their defaults filled in."""
    vpp, placement = _resolve(fn, name, vpp, placement)
    _positive(fn, "pp_size", pp_size)
    _positive(fn, "num_microbatches", num_microbatches)
    _positive(fn, vpp_arg, vpp)
    if vpp > 1 and name in ONE_CHUNK:
        raise ValueError(
            f"{fn}: schedule {name!r} runs one model chunk per rank, got {vpp_arg}={vpp}; use "
            "'interleaved' for virtual pipeline stages"
        )
    if placement == "v":
        what = "schedule 'zb-v'" if name == "zb-v" else "the 'v' placement"
        if vpp != 2:
            raise ValueError(f"{fn}: {what} runs two model chunks per rank (the V), got {vpp_arg}={vpp}")
        if pp_size < 2:
            raise ValueError(
                f"{fn}: {what} needs pipeline parallelism (pp_size > 1: its two chunks per rank form a V across "
                f"the ranks), got pp_size={pp_size}"
            )
    if vpp > 1 and name == "interleaved" and num_microbatches % pp_size:
        raise ValueError(
            f"{fn}: the interleaved schedule needs num_microbatches divisible by pp_size (micro-batches "
            f"go through the chunks in groups of pp_size), got num_microbatches={num_microbatches}, "
            f"pp_size={pp_size}"
        )
    return vpp, placement


def _interleaved_op(kind: str, k: int, pp: int, m: int, vpp: int) -> Op:
    """The k-th forward (or backward) of a rank in the interleaved order: groups of ``pp`` micro-batches go through
    chunk 0, 1, ..., vpp-1 (backwards: vpp-1, ..., 0); the last group may be smaller (forward_only only)."""
    group, within = divmod(k, pp * vpp)
    chunk, offset = divmod(within, min(pp, m - group * pp))
    if kind == "B":
        chunk = vpp - 1 - chunk
    return kind, chunk, group * pp + offset


def _zb_h1_order(p: int, r: int, m: int) -> list[Op]:
    """ZB-H1 on rank r: 1F1B's warm-up of ``p-r-1`` forwards and its steady F, B pairs, the i-th pair followed by
    W(i - r) once ``i >= r``, so that before every forward the rank holds at most ``p`` micro-batches whose W has
    not run (1F1B's peak, reached on every rank); in the cool-down each B is followed by one pending W, and the
    W passes left run last. Rank r thus delays its W passes by r pairs: the later ranks, which 1F1B leaves idle
    the longest in the cool-down, keep the most W passes for it."""
    warmup = min(p - r - 1, m)
    order = [("F", 0, j) for j in range(warmup)]
    done = 0  # W passes issued
    for i in range(m - warmup):
        order += [("F", 0, warmup + i), ("B", 0, i)]
        if i >= r:
            order.append(("W", 0, done))
            done += 1
    for j in range(m - warmup, m):
        order.append(("B", 0, j))
        if done <= j:
            order.append(("W", 0, done))
            done += 1
    return order + [("W", 0, j) for j in range(done, m)]


@functools.lru_cache(maxsize=64)
def _v_orders(p: int, m: int, forward_only: bool, durations: tuple = (1, 1, 1)) -> tuple[tuple[Op, ...], ...]:
    """Every rank's order on the V placement: the best of a few list-scheduler policies (``_v_plan``) for the
    chunks' F, B and W ``durations`` (relative; equal by default, the paper's ``T_F = T_B = T_W``), the one whose
    step ends first (ties: the earlier in the list). All keep at most ``2p`` chunk activations on a rank (forwards
    whose W has not run: ``p`` micro-batches through its layers, 1F1B's peak). The plain policy — B, else F, else W
    — reaches the lower bound at equal times for ``p <= 8``; when the memory bound binds (unequal times, longer
    pipelines) holding fewer chunk-0 activations, or running W before F near the bound, leaves room for the
    forwards that lead to the next B. Deterministic: every rank computes every rank's order alike."""
    S = 2 * p
    if forward_only:
        return _v_plan(p, m, True, durations, S, S)[0]
    best = None
    for c0_cap in dict.fromkeys((S, S - 1, S - 2, (3 * S) // 4, p)):
        for w_first in dict.fromkeys((S, S - 1, S - 2)):
            orders, end = _v_plan(p, m, False, durations, c0_cap, w_first)
            if orders is not None and (best is None or end < best[1]):
                best = orders, end
    return best[0]


def _v_plan(p: int, m: int, forward_only: bool, durations: tuple, c0_cap: int, w_first: int):
    """One list-scheduler policy on the V: ``(orders, end)``, or ``(None, None)`` if it stalls. The step is played
    out with the chunks' ``durations``; whenever a rank is free it takes, among the ops whose inputs exist: a B (the
    oldest micro-batch first, chunk 1 before chunk 0: B is what the other ranks wait for); else, below ``w_first``
    held chunk activations, an F (chunk 1 first, which leads to the loss, then the oldest micro-batch) and then a
    W; at or above it, a W and then an F. F is never taken with ``2p`` activations held, nor a chunk-0 F with
    ``c0_cap`` chunk-0 ones. Ops of one kind and chunk become ready in micro-batch order, so only the next of each is
    looked at. Exact arithmetic (the durations as fractions over a common denominator) and a fixed tie order make it
    deterministic."""
    S = 2 * p
    parts = [fractions.Fraction(d).limit_denominator(10**6) for d in durations]
    scale = math.lcm(*(f.denominator for f in parts))
    cost = {kind: int(f * scale) for kind, f in zip("FBW", parts)}
    kinds = "F" if forward_only else "FBW"
    nxt = [{(kind, c): 0 for kind in kinds for c in (0, 1)} for _ in range(p)]  # next micro-batch of each
    done: dict[tuple[str, int, int], int] = {}  # (kind, virtual stage, micro-batch) -> finish
    orders: list[list[Op]] = [[] for _ in range(p)]
    held, held0, free = [0] * p, [0] * p, [0] * p
    events: list[tuple[int, int, tuple[str, int, int]]] = []  # (finish, rank, key) of the ops running
    now, left, trying = 0, p * len(kinds) * 2 * m, set(range(p))
    stage = [(virtual_stage("v", p, r, 0, 2), virtual_stage("v", p, r, 1, 2)) for r in range(p)]

    def ready(kind: str, k: int, j: int) -> bool:
        if kind == "F":
            return k == 0 or done.get(("F", k - 1, j), now + 1) <= now
        if kind == "B":
            return done.get(("F", k, j), now + 1) <= now and (k == S - 1 or done.get(("B", k + 1, j), now + 1) <= now)
        return done.get(("B", k, j), now + 1) <= now

    while left:
        # Only a rank that became free, or whose neighbour finished what it may wait for, can start something.
        for r in sorted(trying):
            best = {}  # kind -> (priority, op)
            for (kind, c), j in nxt[r].items():
                if j >= m or not ready(kind, stage[r][c], j):
                    continue
                if kind == "F" and not forward_only and (held[r] >= S or (c == 0 and held0[r] >= c0_cap)):
                    continue
                rank = (-c, j) if kind == "F" else (j, -c)
                if kind not in best or rank < best[kind][0]:
                    best[kind] = (rank, (kind, c, j))
            order = "BWF" if held[r] >= w_first else "BFW"
            pick = next((best[kind][1] for kind in order if kind in best), None)
            if pick is None:
                continue
            nxt[r][pick[:2]] += 1
            orders[r].append(pick)
            key = (pick[0], stage[r][pick[1]], pick[2])
            free[r] = done[key] = now + cost[pick[0]]
            heapq.heappush(events, (free[r], r, key))
            step = {"F": 1, "W": -1}.get(pick[0], 0)
            held[r] += step
            held0[r] += step if pick[1] == 0 else 0
            left -= 1
        if not events:
            if left:
                return None, None  # every rank waits on a forward the memory bound holds back
            break
        now, trying = events[0][0], set()
        while events and events[0][0] == now:
            _, r, (kind, k, _) = heapq.heappop(events)
            trying.add(r)
            if kind == "F" and k < S - 1:  # the next stage's forward may start
                trying.add(stage_owner("v", p, k + 1, 2)[0])
            elif kind == "B" and k > 0:  # the previous stage's B may start
                trying.add(stage_owner("v", p, k - 1, 2)[0])
        trying = {r for r in trying if free[r] <= now}
    return tuple(tuple(o) for o in orders), fractions.Fraction(max(free), scale)


def _key(p: int, r: int, op: Op) -> tuple[str, int, int]:
    kind, c, j = op
    return kind, virtual_stage("v", p, r, c, 2), j


def _deps(p: int, r: int, op: Op, stages: int, placement: str = "v", vpp: int = 2) -> list[tuple[str, int, int]]:
    """The ``(kind, virtual stage, micro-batch)`` an op waits for (module docstring)."""
    kind, c, j = op
    k = virtual_stage(placement, p, r, c, vpp)
    if kind == "F":
        return [("F", k - 1, j)] if k > 0 else []
    if kind == "B":
        return [("F", k, j)] + ([("B", k + 1, j)] if k < stages - 1 else [])
    return [("B", k, j)]


def schedule_order(
    name: str,
    pp_size: int,
    pp_rank: int,
    num_microbatches: int,
    vpp: int | None = None,
    *,
    placement: str | None = None,
    durations: tuple[float, float, float] | None = None,
) -> list[Op]:
    """The work of rank ``pp_rank`` under schedule ``name``, in execution order.

    Args:
        vpp: model chunks per rank; default 2 for zb-v, else 1.
        placement: only for ``forward_only`` (``"interleaved"`` by default, ``"v"`` to evaluate a zb-v model);
            every other schedule has its own (``placement_of``).
        durations: ``(t_forward, t_backward, t_weight)`` of a stage as ``simulate`` takes them (relative; default
            ``(1, 2, 1)``, the paper's equal F, B and W): what zb-v's list scheduler plans for (every rank must
            pass the same); the other schedules' orders do not depend on them.

    Returns:
        A list of ``("F" | "B" | "W", chunk, microbatch)`` with ``chunk`` in ``0..vpp-1`` and ``microbatch`` in
        ``0..num_microbatches-1``: every (chunk, micro-batch) forward once and, unless ``forward_only``, its
        backward once, after it; for the zero-bubble schedules also its W once, after its B.

    Raises:
        ValueError: an unknown ``name`` or ``placement``; ``pp_size``, ``num_microbatches`` or ``vpp`` not a positive
            int; ``pp_rank`` outside ``0..pp_size-1``; ``vpp > 1`` with ``gpipe``, ``1f1b`` or ``zb-h1``; zb-v (or
            the V placement) with ``vpp != 2`` or ``pp_size == 1``; ``interleaved`` with ``vpp > 1`` and
            ``num_microbatches`` not divisible by ``pp_size``.
    """
    vpp, placement = check_arguments("schedule_order", name, pp_size, num_microbatches, vpp, placement=placement)
    t_f, t_b, t_w = _times("schedule_order", "zb-v", *(durations or (1.0, 2.0, None)))
    if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or not 0 <= pp_rank < pp_size:
        raise ValueError(f"schedule_order: pp_rank must be in 0..{pp_size - 1}, got {pp_rank!r}")
    p, r, m = pp_size, pp_rank, num_microbatches
    if placement == "v":
        return list(_v_orders(p, m, name == "forward_only", (t_f, t_b, t_w))[r])
    if name == "zb-h1":
        return _zb_h1_order(p, r, m)
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


def _timeline(
    name: str, p: int, m: int, vpp: int, duration: dict, placement: str | None = None, durations=None
) -> list[list]:
    """Every rank's ops as ``(start, end, op)``: each starts as soon as its rank is free and its inputs exist
    (``durations``: what the orders are planned for, ``schedule_order``'s)."""
    placement = placement or placement_of(name)
    orders = [schedule_order(name, p, r, m, vpp, placement=placement, durations=durations) for r in range(p)]
    stages = p * vpp
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> finish time
    clock, pos = [0] * p, [0] * p
    timeline: list[list] = [[] for _ in range(p)]
    while any(pos[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                kind, c, j = op
                k = virtual_stage(placement, p, r, c, vpp)
                deps = _deps(p, r, op, stages, placement, vpp)
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = done[(kind, k, j)] = start + duration[kind]
                timeline[r].append((start, clock[r], op))
                pos[r] += 1
                progressed = True
        if not progressed:  # cannot happen for the schedules above; guards edits to them
            raise RuntimeError(f"schedule {name!r} deadlocks at positions {pos}")
    return timeline


class Exchange(NamedTuple):
    """One ``batch_isend_irecv`` call between compute steps; each field names the op whose tensor travels, or None.

    The fields are directions: ``send_next`` / ``send_prev`` go to the next / previous rank, ``recv_prev`` /
    ``recv_next`` come from the previous / next rank; the op says what travels: an ``F`` op's output activation
    (or, received, the input of that later F), a ``B`` op's input gradient (received: the output gradient of that
    later B). On the interleaved placement activations always go to the next rank and gradients to the previous
    one (``send_next``: an F's output, ``send_prev``: a B's input gradient, ``recv_prev``: an activation,
    ``recv_next``: a gradient); on the V, chunk 1's activations go to the previous rank and its gradients to the
    next.
    """

    send_next: Op | None = None
    send_prev: Op | None = None
    recv_prev: Op | None = None
    recv_next: Op | None = None


def communication_plan(
    name: str,
    pp_size: int,
    pp_rank: int,
    num_microbatches: int,
    vpp: int | None = None,
    *,
    placement: str | None = None,
    durations: tuple[float, float, float] | None = None,
) -> list[Op | Exchange]:
    """``schedule_order`` with the point-to-point exchanges between its compute steps.

    The plan is lock-step: run all ranks' orders with every op taking one tick (``_timeline``); a tensor made at
    tick t is sent at t, and its receiver posts the receive at its own exchange of tick t, whenever it will use the
    tensor. Each exchange thus holds exactly the sends and receives that cross between this rank and its
    neighbours at one point of the schedule (the NCCL rule of ``p2p.py``), at most one message per direction and
    neighbour. Induction over ticks shows that even blocking, unbuffered messages cannot deadlock: the exchanges
    of tick t wait only for each other, and every rank reaches them having finished its exchanges of earlier
    ticks; the tests replay all ranks' plans that way. Empty exchanges are left out. A W op sends nothing, nor does
    a tensor that stays on its rank (the V's turn on the last rank).

    Returns:
        The ops of ``schedule_order`` with ``Exchange`` entries between them (none when ``pp_size == 1``).

    Raises:
        ValueError: as ``schedule_order``, or ``vpp > 1`` with ``pp_size == 1`` (chunks would send to themselves).
    """
    order = schedule_order(name, pp_size, pp_rank, num_microbatches, vpp, placement=placement, durations=durations)
    vpp, placement = _resolve("communication_plan", name, vpp, placement)
    if pp_size == 1 and vpp > 1:
        raise ValueError(f"communication_plan: vpp={vpp} needs pipeline parallelism (pp_size > 1)")
    if pp_size == 1:
        return list(order)
    p, last = pp_size, pp_size * vpp - 1
    ticks = _timeline(name, p, num_microbatches, vpp, {"F": 1, "B": 1, "W": 1}, placement, durations)
    exchanges: dict[int, dict] = {}  # tick -> fields of this rank's exchange
    for q, row in enumerate(ticks):
        for _, tick, (kind, c, j) in row:
            k = virtual_stage(placement, p, q, c, vpp)
            if kind == "F" and k < last:  # the activation goes to virtual stage k + 1
                dest, direction = k + 1, neighbour_direction(placement, p, k)
            elif kind == "B" and k > 0:  # the input gradient goes to virtual stage k - 1
                dest, direction = k - 1, -neighbour_direction(placement, p, k - 1)
            else:
                continue
            if direction == 0:  # the same rank: handed over without a message
                continue
            dest_rank, dest_chunk = stage_owner(placement, p, dest, vpp)
            if q == pp_rank:
                exchanges.setdefault(tick, {})["send_next" if direction > 0 else "send_prev"] = (kind, c, j)
            if dest_rank == pp_rank:
                exchanges.setdefault(tick, {})["recv_prev" if direction > 0 else "recv_next"] = (kind, dest_chunk, j)
    plan: list[Op | Exchange] = []
    for start, _, op in ticks[pp_rank] + [(max(exchanges, default=0) + 1, None, None)]:
        plan += [Exchange(**exchanges.pop(t)) for t in sorted(exchanges) if t <= start]
        if op is not None:
            plan.append(op)
    return plan


def _times(fn: str, name: str, t_forward, t_backward, t_weight) -> tuple[float, float, float]:
    """``(F, B, W)`` durations of a whole stage: B is the whole backward unless the schedule splits it."""
    for arg, value in (("t_forward", t_forward), ("t_backward", t_backward)):
        if not value > 0:
            raise ValueError(f"{fn}: {arg} must be positive, got {value!r}")
    t_weight = t_backward / 2 if t_weight is None else t_weight
    if not 0 < t_weight < t_backward:
        raise ValueError(
            f"{fn}: t_weight (the weight-gradient part of t_backward) must be in (0, t_backward={t_backward:g}), "
            f"got {t_weight!r}"
        )
    if splits_backward(name):
        return t_forward, t_backward - t_weight, t_weight
    return t_forward, t_backward, 0.0


def bubble_fraction(
    name: str,
    pp: int,
    m: int,
    vpp: int | None = None,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
    t_weight: float | None = None,
) -> float:
    """The closed-form bubble fraction, idle time over useful time: ``(pp-1)/m`` for gpipe and 1f1b,
    ``(pp-1)/(vpp·m)`` for interleaved (chunks cost ``1/vpp`` of a stage), and for forward_only unless ``m % pp !=
    0`` (then ``(pp-1)/m``); for zb-h1 the paper's ``(pp-1)(T_F + T_B - T_W) / (m (T_F + T_B + T_W))`` with
    ``T_F = t_forward``, ``T_B = t_backward - t_weight``, ``T_W = t_weight`` (``t_weight`` defaults to half of
    ``t_backward``: ``(pp-1)/(3m)``) while ``T_W <= T_B``, and ``(pp-1) T_F / (m (...))`` beyond (the last rank's
    wait for its first input, which no W can fill); for zb-v that wait on the V, ``(pp-1)(T_F/2) / (m (T_F + T_B +
    T_W))`` (``(pp-1)/(6m)`` at equal times), a lower bound for any schedule on the V placement. The schedules
    reach them for ``m >= pp`` (zb-h1 for any times, zb-v at equal ones; ``simulate`` gives the others). Raises
    ValueError as ``schedule_order`` and ``simulate``."""
    vpp, _ = check_arguments("bubble_fraction", name, pp, m, vpp)
    t_f, t_b, t_w = _times("bubble_fraction", name, t_forward, t_backward, t_weight)
    if name == "zb-h1":
        return (pp - 1) * (t_f + max(t_b - t_w, 0.0)) / (m * (t_f + t_b + t_w))
    if name == "zb-v":
        return (pp - 1) * t_f / 2 / (m * (t_f + t_b + t_w))
    # forward_only's last, partial group of micro-batches (m % pp != 0) passes each chunk alone: no gain from vpp.
    interleaved = name == "interleaved" or (name == "forward_only" and m % pp == 0)
    return (pp - 1) / (m * (vpp if interleaved else 1))


def simulate(
    name: str,
    pp_size: int,
    num_microbatches: int,
    vpp: int | None = None,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
    t_weight: float | None = None,
    *,
    placement: str | None = None,
) -> dict:
    """Run every rank's ``schedule_order`` against the cross-stage dependencies, communication taking no time.

    ``t_forward`` / ``t_backward`` are one micro-batch's forward / backward through a rank's whole share of the
    model, so one chunk takes ``1/vpp`` of them; ``t_weight`` is the weight-gradient part of ``t_backward``
    (default half of it), which the zero-bubble schedules run as W (their B takes ``t_backward - t_weight``) and the
    others inside B. zb-v's order is planned for these times (``schedule_order``'s ``durations``).

    Returns:
        ``{"total_time", "useful_time"`` (busy time of each rank, ``m·(t_f+t_b)``, forwards only for
        forward_only), ``"idle_time"`` (per rank: total - useful), ``"bubble_fraction"`` (mean idle / useful),
        ``"peak_in_flight"`` (per rank: most (chunk, micro-batch) forwards whose backward — W for the zero-bubble
        schedules — has not run; 1 for forward_only),
        ``"peak_activations"`` (the same in micro-batches through a whole rank's layers, ``/ vpp``),
        ``"peak_awaiting_weight"`` (per rank: most (chunk, micro-batch) whose B has run and W not; 0 without W),
        ``"timeline"`` (per rank: ``(start, end, op)``) and the arguments ``}``.

    Raises:
        ValueError: as ``schedule_order``, or a duration that is not positive (``t_weight`` not below
            ``t_backward``).
    """
    vpp, placement = check_arguments("simulate", name, pp_size, num_microbatches, vpp, placement=placement)
    t_f, t_b, t_w = _times("simulate", name, t_forward, t_backward, t_weight)
    p, m = pp_size, num_microbatches
    plan = (t_forward, t_backward, t_weight)  # zb-v plans its order for the times it is simulated with
    timeline = _timeline(name, p, m, vpp, {"F": t_f / vpp, "B": t_b / vpp, "W": t_w / vpp}, placement, plan)
    # Activations live from a forward to its backward (its W when split); forward_only keeps one chunk's at a time.
    freed = "W" if splits_backward(name) else "B"
    peak = [
        1
        if name == "forward_only"
        else max(itertools.accumulate({"F": 1, freed: -1}.get(kind, 0) for _, _, (kind, _, _) in row))
        for row in timeline
    ]
    awaiting = [
        max(itertools.accumulate([0] + [{"B": 1, "W": -1}.get(kind, 0) for _, _, (kind, _, _) in row]))
        if splits_backward(name)
        else 0
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
        "placement": placement,
        "total_time": total,
        "useful_time": useful,
        "idle_time": idle,
        "bubble_fraction": sum(idle) / p / useful,
        "peak_in_flight": peak,
        "peak_activations": [x / vpp for x in peak],
        "peak_awaiting_weight": awaiting,
        "timeline": timeline,
    }


def _slot(*durations: float) -> fractions.Fraction:
    parts = [fractions.Fraction(d).limit_denominator(1000) for d in durations if d]
    return fractions.Fraction(math.gcd(*(f.numerator for f in parts)), math.lcm(*(f.denominator for f in parts)))


def format_schedule(
    name: str,
    pp_size: int,
    num_microbatches: int,
    vpp: int | None = None,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
    t_weight: float | None = None,
    *,
    placement: str | None = None,
) -> str:
    """The simulated timeline as text: one row per rank, one cell per time slot (the largest unit dividing the
    durations), ``F3`` / ``B3`` / ``W3`` for micro-batch 3 (``F3b``: chunk 1 with ``vpp > 1``), ``.`` for idle; then
    the bubble fraction (simulated and closed form) and the peak in-flight micro-batches. Raises as ``simulate``."""
    sim = simulate(name, pp_size, num_microbatches, vpp, t_forward, t_backward, t_weight, placement=placement)
    vpp = sim["vpp"]
    t_f, t_b, t_w = _times("format_schedule", name, t_forward, t_backward, t_weight)
    unit = _slot(t_f / vpp, t_b / vpp, t_w / vpp)

    def label(op: Op) -> str:
        kind, c, j = op
        return f"{kind}{j}" + (chr(ord("a") + c) if vpp > 1 else "")

    width = max(len(label(op)) for row in sim["timeline"] for _, _, op in row)
    slots = round(fractions.Fraction(sim["total_time"]).limit_denominator(1000) / unit)
    times = f"t_forward={t_forward:g}, t_backward={t_backward:g}"
    if splits_backward(name):
        times += f" (t_weight={t_w:g} of it as W)"
    lines = [
        f"schedule {name}: pp={pp_size}, microbatches={num_microbatches}, vpp={vpp}, {times} "
        f"(one slot = {float(unit):g})"
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
        where = (
            f"a = chunk 0 (stage r on rank r), b = chunk 1 (stage {2 * pp_size - 1}-r on rank r)"
            if sim["placement"] == "v"
            else ", ".join(f"{chr(ord('a') + c)} = chunk {c}" for c in range(vpp))
        )
        lines.append("chunks: " + where)
    closed = bubble_fraction(name, pp_size, num_microbatches, vpp, t_forward, t_backward, t_weight)
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
    parser.add_argument(
        "--vpp", type=int, default=None, help="model chunks per rank (interleaving; zb-v: 2, its default)"
    )
    parser.add_argument(
        "--schedule", choices=ALL_SCHEDULES, default=None, help="default: interleaved when --vpp > 1, else 1f1b"
    )
    parser.add_argument("--t-forward", type=float, default=1.0, help="forward time of a whole stage")
    parser.add_argument("--t-backward", type=float, default=2.0, help="backward time of a whole stage")
    parser.add_argument(
        "--t-weight",
        type=float,
        default=None,
        help="the weight-gradient part of --t-backward (zb-h1, zb-v: their W passes; default half of it)",
    )
    args = parser.parse_args(argv)
    schedule = args.schedule or ("interleaved" if (args.vpp or 1) > 1 else "1f1b")
    try:
        print(
            format_schedule(
                schedule, args.pp, args.microbatches, args.vpp, args.t_forward, args.t_backward, args.t_weight
            )
        )
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
