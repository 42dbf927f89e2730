"""The schedules beside the Triton launchers (``flash_attention.SCHEDULES``, ``grouped_gemm.rows_schedule`` /
``wgrad_schedule``: what the static cost model prices) are the loops the kernels run. The kernels compute their
loop bounds on the device, so each schedule is a mirror; here the real kernels run under Triton's interpreter with
the builtin ``range`` of their modules replaced by one that records, per program, every tile loop
(``range(start, stop, BLOCK)``) they enter, and the record must equal the schedule: the same ranges, in the same
order, for every program of the launch. Shapes cross every edge of the bounds: partial blocks, sq != sk both
ways with the causal diagonal, GQA groups, query and key blocks of different sizes, empty groups."""

from __future__ import annotations

import builtins
import math

import pytest
import torch

from megakernels.triton import interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs Triton's interpreter (TRITON_INTERPRET=1)")


class LoopRecorder:
    """Replaces ``range`` in the kernels' modules while a launch runs: every three-argument range (a tile loop;
    the loop over a GQA group's heads is ``range(0, GROUP)``) is recorded under the program that entered it."""

    def __init__(self, monkeypatch, modules):
        from triton.runtime.interpreter import interpreter_builder

        self.builder = interpreter_builder
        self.monkeypatch = monkeypatch
        self.modules = modules

    def run(self, launch) -> list[list[range]]:
        ids = {pid: i for i, pid in enumerate(launch.program_ids())}
        seen: list[list[range]] = [[] for _ in ids]

        def recording_range(*args):
            r = builtins.range(*args)
            if len(args) == 3:
                seen[ids[tuple(self.builder.grid_idx[: len(launch.grid)])]].append(r)
            return r

        with self.monkeypatch.context() as m:
            for mod in self.modules:
                m.setattr(mod, "range", recording_range, raising=False)
            launch()
        return seen


def _assert_schedule(launch, schedule, seen):
    want = [[r for _, r in runs] for runs in schedule.programs]
    assert len(want) == len(seen) == launch.num_ctas
    bad = [(pid, w, s) for pid, w, s in zip(launch.program_ids(), want, seen, strict=True) if w != s]
    assert not bad, f"{launch.name} grid {launch.grid}: {len(bad)} programs differ (id, schedule, kernel): {bad[:3]}"
    assert all(loop in schedule.loops for runs in schedule.programs for loop, _ in runs)


# (sq, sk): equal, partial blocks, more keys than queries and fewer (the causal diagonal off the corner)
FA_SHAPES = [(64, 64), (40, 40), (33, 70), (70, 33), (17, 100)]
FA_CONFIGS = [(32, 32, 4, 1), (16, 64, 4, 1), (64, 16, 4, 1)]  # BLOCK_M, BLOCK_N, warps, stages


@pytest.fixture
def fa_recorder(monkeypatch):
    from megakernels.triton import _fa_bwd, _fa_fwd

    return LoopRecorder(monkeypatch, [_fa_fwd, _fa_bwd])


def _fa_tensors(sq, sk, h, hk, d=32, b=1):
    """One batch element unless the batch elements differ (documents): a schedule does not depend on the batch
    index, and each program of the interpreter's launch costs the same."""
    g = torch.Generator().manual_seed(sq * 1000 + sk)
    q = torch.randn(b, sq, h, d, generator=g)
    k, v = torch.randn(b, sk, hk, d, generator=g), torch.randn(b, sk, hk, d, generator=g)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", FA_SHAPES)
def test_forward_schedule_is_the_kernels(fa_recorder, sq, sk, causal):
    from megakernels.triton import flash_attention as fa

    q, k, v = _fa_tensors(sq, sk, 2, 1)
    out, lse = torch.empty_like(q), torch.empty(q.shape[0], 2, sq)
    for cfg in FA_CONFIGS:
        launch = fa.forward_launch(q, k, v, out, lse, lse, causal, 1 / math.sqrt(32), 0.0, cfg)
        _assert_schedule(launch, fa.SCHEDULES[launch.name](launch), fa_recorder.run(launch))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", FA_SHAPES)
def test_backward_schedules_are_the_kernels(fa_recorder, sq, sk, causal, deterministic):
    from megakernels.triton import flash_attention as fa

    h, hk = 2, 1  # a GQA group of two query heads per k/v head
    q, k, v = _fa_tensors(sq, sk, h, hk)
    b = q.shape[0]
    lse = torch.zeros(b, h, sq)
    delta = torch.empty(2, b, h, sq)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    scheduled = set()
    for cfg in FA_CONFIGS:
        dq = torch.empty_like(q) if deterministic else torch.zeros(q.shape)
        launches = fa.backward_launches(
            q, q, k, v, q, lse, delta, dq, dk, dv, lse, causal, 0.1, 0.0, cfg, deterministic, arch=0
        )
        for launch in launches:
            seen = fa_recorder.run(launch)
            if launch.name not in fa.SCHEDULES:  # the delta kernel: no tile loops
                assert seen == [[]] * launch.num_ctas, launch.name
                continue
            _assert_schedule(launch, fa.SCHEDULES[launch.name](launch), seen)
            scheduled.add(launch.name)
    assert scheduled == {"fa_bwd_kernel"} | ({"fa_bwd_dq_kernel"} if deterministic else set())


# (window, shift): a band inside one block, one wider than a block, and bands moved by a context-parallel offset
# (keys behind the queries, keys ahead of them)
WINDOWS = [(5, 0), (40, 0), (20, 37), (30, -45)]
# In the slow set: the band inside one block without a shift (the shifted bands fall inside one 64-wide block and
# span several 16-wide ones under FA_CONFIGS; (40, 0) keeps the unshifted window) and the whole-block shape (64, 64)
# (every other shape has whole blocks before its partial one: (40, 40) keeps sq == sk).
WINDOWED_SLOW = {(5, 0), (64, 64)}


def _windowed_cases():
    return [
        pytest.param(
            sq,
            sk,
            causal,
            window,
            shift,
            id=f"{sq}-{sk}-{'causal' if causal else 'full'}-{window}-{shift}",
            marks=[pytest.mark.slow] if {(sq, sk), (window, shift)} & WINDOWED_SLOW else [],
        )
        for sq, sk in FA_SHAPES
        for causal in (False, True)
        for window, shift in WINDOWS
    ]


@pytest.mark.parametrize("sq,sk,causal,window,shift", _windowed_cases())
def test_windowed_schedules_are_the_kernels(fa_recorder, sq, sk, causal, window, shift):
    """Sliding-window launches: the forward, the one-pass backward and the dQ kernel visit only the blocks that
    meet the band, and the schedules say so."""
    from megakernels.triton import flash_attention as fa

    h, hk = 2, 1
    q, k, v = _fa_tensors(sq, sk, h, hk)
    b = q.shape[0]
    out, lse = torch.empty_like(q), torch.zeros(b, h, sq)
    delta = torch.empty(2, b, h, sq)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for cfg in FA_CONFIGS:
        launches = [fa.forward_launch(q, k, v, out, lse, lse, causal, 0.1, 0.0, cfg, window=window, shift=shift)]
        for det in (False, True):
            dq = torch.empty_like(q) if det else torch.zeros(q.shape)
            launches += fa.backward_launches(
                q,
                q,
                k,
                v,
                q,
                lse,
                delta,
                dq,
                dk,
                dv,
                lse,
                causal,
                0.1,
                0.0,
                cfg,
                det,
                arch=0,
                window=window,
                shift=shift,
            )
        for launch in launches:
            if launch.name in fa.SCHEDULES:
                _assert_schedule(launch, fa.SCHEDULES[launch.name](launch), fa_recorder.run(launch))


# Document ids per batch element (run lengths; ids non-decreasing): documents shorter and longer than a block, one
# of one token, a query id without keys (the pair's k side lacks it), and batch elements with different documents
DOCUMENTS = [([[10, 1, 29], [40]], [[30, 7, 33], [70]]), ([[3, 30, 7], [1, 39]], [[20, 0, 50], [2, 68]])]


def _doc_ids(runs, s):
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)) * 2, torch.tensor(r)) for r in runs])
    return ids[:, :s]


# a window without a shift is the shifted window's special case: in the slow set
@pytest.mark.parametrize(
    "window,shift", [(0, 0), pytest.param(20, 0, marks=pytest.mark.slow), (30, -5)], ids=lambda x: str(x)
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("docs", range(len(DOCUMENTS)))
def test_document_schedules_are_the_kernels(fa_recorder, docs, causal, window, shift):
    """Launches with documents (``DOCS``): the forward, the one-pass backward and the dQ kernel visit only the
    blocks of the other side inside their documents' spans (with and without a window), and the schedules say so."""
    from megakernels.ops.attention import document_ranges
    from megakernels.triton import flash_attention as fa

    sq, sk, h, hk = 40, 70, 2, 1
    q, k, v = _fa_tensors(sq, sk, h, hk, b=len(DOCUMENTS[docs][0]))
    q_runs, k_runs = DOCUMENTS[docs]
    ranges = document_ranges(_doc_ids(q_runs, sq), _doc_ids(k_runs, sk))
    b = q.shape[0]
    out, lse = torch.empty_like(q), torch.zeros(b, h, sq)
    delta = torch.empty(2, b, h, sq)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    kw = dict(window=window, shift=shift, ranges=ranges)
    for cfg in FA_CONFIGS:
        launches = [fa.forward_launch(q, k, v, out, lse, lse, causal, 0.1, 0.0, cfg, **kw)]
        for det in (False, True):
            dq = torch.empty_like(q) if det else torch.zeros(q.shape)
            launches += fa.backward_launches(
                q, q, k, v, q, lse, delta, dq, dk, dv, lse, causal, 0.1, 0.0, cfg, det, arch=0, **kw
            )
        for launch in launches:
            if launch.name in fa.SCHEDULES:
                _assert_schedule(launch, fa.SCHEDULES[launch.name](launch), fa_recorder.run(launch))


def test_a_window_skips_the_key_blocks_outside_it():
    """The work of a windowed launch grows with the window, not the sequence: each program runs exactly the blocks
    of the other side that hold a (query, key) pair of the band (from the mask, block by block), at s = 1024 with
    64 x 64 blocks and a window of 200: at most 200 / 64 + 2 of 16 per program (causal; twice that without)."""
    from megakernels.triton import flash_attention as fa

    s, d, bs, cfg = 1024, 64, 64, (64, 64, 4, 1)
    n = s // bs
    q = torch.empty(1, s, 1, d, device="meta")
    lse, delta = torch.empty(1, 1, s, device="meta"), torch.empty(2, 1, 1, s, device="meta")
    pos = torch.arange(s)
    for causal in (True, False):
        totals = {}
        for window in (0, 200):
            rel = pos[:, None] - pos[None, :]  # query i, key j
            seen = (rel >= 0) if causal else torch.ones(s, s, dtype=torch.bool)
            if window:
                seen &= (rel < window) & (rel > -window)
            pairs = seen.view(n, bs, n, bs).any(3).any(1)  # [query block, key block]: meets the band
            fwd = fa.forward_launch(q, q, q, q, lse, lse, causal, 0.1, 0.0, cfg, tma=False, window=window)
            bwd, dq = fa.backward_launches(
                q, q, q, q, q, lse, delta, q, q, q, lse, causal, 0.1, 0.0, cfg, True, window=window
            )[1:]
            for launch, per_block in ((fwd, pairs.sum(1)), (dq, pairs.sum(1)), (bwd, pairs.sum(0))):
                runs = [sum(it.values()) for it in fa.SCHEDULES[launch.name](launch).iterations()]
                block = [p[1] if launch is fwd and causal else p[0] for p in launch.program_ids()]
                if launch is fwd and causal:  # the heaviest query block first
                    block = [n - 1 - y for y in block]
                assert runs == [int(per_block[m]) for m in block], (launch.name, causal, window)
                if window:
                    assert max(runs) <= (200 // bs + 2) * (1 if causal else 2)
            totals[window] = int(pairs.sum())
        assert totals[200] < totals[0]


def test_every_attention_kernel_with_tile_loops_has_a_schedule_and_no_other(fa_recorder):
    """``SCHEDULES`` holds exactly the kernels the launchers launch that enter tile loops."""
    from megakernels.triton import flash_attention as fa

    q, k, v = _fa_tensors(40, 40, 2, 1)
    lse, delta = torch.zeros(2, 2, 40), torch.empty(2, 2, 2, 40)
    cfg = FA_CONFIGS[0]
    launches = [fa.forward_launch(q, k, v, torch.empty_like(q), lse, lse, True, 0.1, 0.0, cfg)]
    for det in (False, True):
        dq = torch.empty_like(q) if det else torch.zeros(q.shape)
        launches += fa.backward_launches(
            q, q, k, v, q, lse, delta, dq, torch.empty_like(k), torch.empty_like(v), lse, True, 0.1, 0.0, cfg, det
        )
    looping = {ln.name for ln in launches if any(fa_recorder.run(ln))}
    assert looping == set(fa.SCHEDULES)


# group sizes (their sum is T): uneven, an empty group, a group of one partial tile, one group
GROUPS = [[5, 0, 33, 17], [16, 16, 16, 16], [1, 40, 0, 0, 9], [50]]


@pytest.fixture
def gemm_recorder(monkeypatch):
    from megakernels.triton import grouped_gemm

    return LoopRecorder(monkeypatch, [grouped_gemm])


@pytest.mark.parametrize("sizes", GROUPS, ids=["uneven", "even", "empty", "one"])
def test_grouped_gemm_schedules_are_the_kernels(gemm_recorder, sizes):
    from megakernels.triton import grouped_gemm as gg

    t, e, n, k = sum(sizes), len(sizes), 24, 40  # k not a multiple of BLOCK_K: the masked k path
    g = torch.Generator().manual_seed(t)
    x, dout = torch.randn(t, k, generator=g), torch.randn(t, n, generator=g)
    w = torch.randn(e, n, k, generator=g)
    dev_sizes = torch.tensor(sizes)
    for cfg in [(16, 16, 16, 4, 1), (32, 16, 32, 4, 1)]:
        fwd = gg.rows_launch(x, w, dev_sizes, torch.empty(t, n), True, cfg)
        _assert_schedule(fwd, gg.rows_schedule(fwd, sizes), gemm_recorder.run(fwd))
        dx = gg.rows_launch(dout, w, dev_sizes, torch.empty(t, k), False, cfg)
        _assert_schedule(dx, gg.rows_schedule(dx, sizes), gemm_recorder.run(dx))
        dw = gg.wgrad_launch(dout, x, dev_sizes, torch.empty(e, n, k), cfg)
        _assert_schedule(dw, gg.wgrad_schedule(dw, sizes), gemm_recorder.run(dw))
