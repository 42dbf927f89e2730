"""Mixture-of-experts microbenchmarks, run by ``megakernels bench --ops moe``:

- ``grouped_gemm``: ``megakernels.ops.grouped_gemm`` against a loop of per-expert matmuls (``torch.split`` by the
  group sizes, one ``@`` per expert, ``torch.cat``: what a user writes) and against ``torch._grouped_mm`` where the
  installed torch has it and it runs on this device and dtype (else a note). Forward and forward+backward, at
  Mixtral-like shapes scaled to the device: 8 experts, a few thousand tokens routed top-2 by a skewed random router
  (so the groups differ in size, one may be empty), the experts' fc1 (``h -> f``) and fc2 (``f -> h``). Work is the
  FLOPs that must happen: ``2·rows·n·k`` forward, three times that with the backward.
- ``moe_router``: ``megakernels.ops.moe_router`` (the router after its gate GEMM, one pass) against the same routing
  composed from PyTorch ops as the MoE layer ran it before (softmax or sigmoid, ``topk``, gather, normalisation,
  ``bincount``, the column sum and ``logsumexp`` for the losses), forward and forward+backward, at Mixtral's (64
  experts, top 2: E scaled up), gpt-oss's (128, top 4, softmax over the chosen) and DeepSeek-V3's (256, top 8 of 4
  of 8 groups, sigmoid, a bias) routing over 8192 tokens. Work is the logits' bytes read once.
- ``moe_permute``: ``ops.moe_permute`` then ``ops.moe_unpermute`` (a counting pass, one gather, the weighted
  sum in one pass) against the PyTorch path the MoE layer ran before (a stable ``argsort`` of the assignments,
  ``index_select``, ``index_copy`` into ``[T·k, h]``, a multiply and a sum), forward and forward+backward, 8192
  tokens routed top-2 over 8 experts and top-8 over 64, hidden 1024. Work is the bytes of the rows moved there and
  back.
- ``moe_dispatch``: the all-to-all of ``ExpertExchange`` (megakernels/parallel/moe/dispatch.py) on gloo over 2 and 4
  spawned ranks: one dispatch (counts, rows, re-sort by local expert) and its way back, against the bare
  ``all_to_all_single`` of the same bytes in equal splits; time per exchange against the bytes a rank sends.

Never asserts on time; the pytest-benchmark suite (benchmarks/test_bench_moe.py) times the same callables.
"""

from __future__ import annotations

import torch

from megakernels.bench import ceilings as ceil
from megakernels.bench.common import DTYPES, OURS, Request, TablePrinter, median_seconds, result_row
from megakernels.ops.grouped_gemm import grouped_gemm

FAMILY = "moe"
EXPERTS, TOP_K = 8, 2
# (tokens, k, n): fc1 and fc2 of an expert with h = 1024, f = 2048 (Mixtral's 4096/14336, scaled to the CPU).
SHAPES = [(2048, 1024, 2048), (2048, 2048, 1024)]
GPU_SHAPES = [(8192, 4096, 14336), (8192, 14336, 4096)]
QUICK_SHAPES = [(64, 64, 96)]
DEFAULT_DTYPES = ("float32", "bfloat16")
DISPATCH_WORLDS = (2, 4)
DISPATCH_ROWS = (256, 1024, 4096)  # rows each rank sends, hidden 1024 fp32: 1, 4, 16 MiB
QUICK_DISPATCH_ROWS = (64,)
DISPATCH_HIDDEN = 1024


def routed_sizes(tokens: int, experts: int = EXPERTS, k: int = TOP_K, seed: int = 0) -> torch.Tensor:
    """Rows per expert (int64 ``[experts]``, summing to ``tokens * k``) of a top-k router over random logits with a
    per-expert bias, so popular and unpopular experts differ as in a trained router."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g) + torch.linspace(1.0, -1.0, experts)
    return torch.bincount(logits.topk(k, dim=1).indices.flatten(), minlength=experts)


def make_inputs(shape, dtype, grad=False, device="cpu"):
    """(x ``[rows, k]``, weight ``[E, n, k]``, group sizes ``[E]`` on ``device``, dy ``[rows, n]``) for ``shape``
    ``(tokens, k, n)``."""
    tokens, k, n = shape
    sizes = routed_sizes(tokens)
    rows = int(sizes.sum())
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((rows, k), generator=g, device=device).to(dtype).requires_grad_(grad)
    w = (torch.randn((EXPERTS, n, k), generator=g, device=device) * k**-0.5).to(dtype).requires_grad_(grad)
    dy = torch.randn((rows, n), generator=g, device=device).to(dtype)
    return x, w, sizes.to(device), dy


def loop_of_matmuls(x, w, sizes):
    """The baseline: split by expert, one matmul each, concatenate."""
    return torch.cat([xe @ w[e].t() for e, xe in enumerate(torch.split(x, sizes.tolist()))])


def torch_grouped_mm(x, w, sizes):
    """``torch._grouped_mm`` (weight as ``[E, k, n]``, offsets the int32 cumulative sizes)."""
    return torch._grouped_mm(x, w.transpose(1, 2), offs=torch.cumsum(sizes, 0).to(torch.int32))


IMPLEMENTATIONS = {OURS: grouped_gemm, "loop": loop_of_matmuls, "grouped_mm": torch_grouped_mm}


def available(impl: str, dtype: torch.dtype, device: str) -> str | None:
    """None when ``impl`` runs here, else why not (a note for the table)."""
    if impl != "grouped_mm":
        return None
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    x, w, sizes, dy = make_inputs(QUICK_SHAPES[0], dtype, grad=True, device=device)
    try:
        torch_grouped_mm(x, w, sizes).backward(dy)
    except (RuntimeError, NotImplementedError) as e:
        return f"torch._grouped_mm does not run {dtype} on {device}: {str(e).splitlines()[0]}"
    return None


def step_fn(fn, x, w, sizes, dy, backward: bool):
    """A zero-argument callable running ``fn(x, w, sizes)`` forward (and backward, grads dropped each call)."""
    if not backward:

        def fwd():
            with torch.no_grad():
                fn(x, w, sizes)

        return fwd

    def fwd_bwd():
        torch.autograd.backward(fn(x, w, sizes), dy, inputs=[x, w])
        x.grad = w.grad = None

    return fwd_bwd


def flops(shape, backward: bool) -> int:
    tokens, k, n = shape
    return 2 * tokens * TOP_K * n * k * (3 if backward else 1)


def default_shapes(device: str, quick: bool):
    return QUICK_SHAPES if quick else (GPU_SHAPES if device == "cuda" else SHAPES)


def run_grouped_gemm(
    dtypes, shapes, *, device="cpu", min_run_time=0.5, ceilings=None, notes=None, log=print
) -> list[dict]:
    """Every (dtype, shape, fwd / fwd+bwd) of grouped_gemm against the baselines that run here."""
    rows, table = [], TablePrinter(log)
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        impls = {}
        for name, fn in IMPLEMENTATIONS.items():
            why = available(name, dtype, device)
            if why is None:
                impls[name] = fn
            elif notes is not None and why not in notes:
                notes.append(why)
        for shape in shapes:
            for backward in (False, True):
                x, w, sizes, dy = make_inputs(shape, dtype, grad=backward, device=device)
                times = {
                    name: median_seconds(step_fn(fn, x, w, sizes, dy, backward), min_run_time)
                    for name, fn in impls.items()
                }
                value, cname = ceil.for_unit(ceilings, "TFLOP/s", dtype_name)
                tokens, k, n = shape
                row = result_row(
                    "grouped_gemm",
                    FAMILY,
                    dtype=dtype_name,
                    shape=f"{tokens}x{k}->{n}",
                    pass_="fwd+bwd" if backward else "fwd",
                    size=tokens * TOP_K * n * k,
                    size_label="rows x n x k",
                    unit="TFLOP/s",
                    work=flops(shape, backward),
                    times=times,
                    ceiling=value,
                    ceiling_name=cname,
                    experts=EXPERTS,
                    top_k=TOP_K,
                    group_sizes=sizes.tolist(),
                )
                rows.append(row)
                table(row)
    return rows


# ---- the all-to-all of expert parallelism ------------------------------------------------------------------------


def _dispatch_rank(rank: int, world: int, row_counts, hidden: int, reps: int) -> list[dict]:
    import torch.distributed as dist

    from megakernels.bench.common import timed_over_ranks
    from megakernels.parallel.moe.dispatch import ExpertExchange

    group = dist.group.WORLD
    out = []
    for count in row_counts:
        sizes = routed_sizes(count, seed=rank)  # each rank routes its own tokens
        rows = torch.randn(int(sizes.sum()), hidden)
        flat = torch.randn(int(sizes.sum()) // world * world, hidden)
        back = torch.empty_like(flat)
        exchange = ExpertExchange(group, EXPERTS)

        def ours():
            received, _ = exchange.forward(rows, sizes)
            exchange.backward(received)

        def bare():
            dist.all_to_all_single(back, flat, group=group)
            dist.all_to_all_single(flat, back, group=group)

        t = timed_over_ranks({OURS: ours, "all_to_all": bare}, reps)
        sent = torch.tensor([rows.numel() * rows.element_size() * 2], dtype=torch.float64)
        dist.all_reduce(sent, op=dist.ReduceOp.MAX)
        out.append({"rows": int(sizes.sum()), "bytes": float(sent), "times": t})
    return out


def run_dispatch(worlds, row_counts, *, hidden=DISPATCH_HIDDEN, reps=20, log=print) -> list[dict]:
    """ExpertExchange's dispatch and return on ``world`` gloo ranks (one thread each) for each rows-per-rank count;
    a row per (world, rows): time per exchange (the slowest rank's median) and bytes per second a rank sends."""
    from megakernels.parallel.launch import run_world

    rows, table = [], TablePrinter(log)
    for world in worlds:
        for m in run_world(world, _dispatch_rank, list(row_counts), hidden, reps, timeout=600)[0]:
            row = result_row(
                "moe_dispatch",
                FAMILY,
                dtype="float32",
                shape=f"{m['rows']}x{hidden}",
                pass_="fwd+bwd",
                variant=f"gloo x{world}",
                size=m["bytes"],
                size_label="bytes a rank sends",
                unit="GB/s",
                work=m["bytes"],
                times=m["times"],
                ceiling=None,
                ceiling_name="",
                world=world,
            )
            rows.append(row)
            table(row)
    return rows


# ---- the router ----------------------------------------------------------------------------------------------------

# name -> ops.moe_router's arguments
ROUTINGS = {
    "mixtral-like": dict(experts=64, top_k=2),
    "gpt-oss": dict(experts=128, top_k=4, topk_softmax=True),
    "deepseek-v3": dict(experts=256, top_k=8, score="sigmoid", n_group=8, topk_group=4, scale=2.5, bias=True),
}
ROUTER_TOKENS, QUICK_ROUTER_TOKENS = 8192, 64


def torch_route(logits, top_k, *, score="softmax", normalize=True, topk_softmax=False, bias=None, scale=1.0,
                n_group=1, topk_group=None):  # fmt: skip
    """The routing from PyTorch ops (``topk``, not a stable sort: what a user writes); the same outputs as
    ``ops.moe_router`` up to ties."""
    x = logits.float()
    p = torch.softmax(x, -1)
    lse = torch.logsumexp(x, -1)
    s = torch.sigmoid(x) if score == "sigmoid" else p
    key = (x if topk_softmax else s).detach()
    if bias is not None:
        key = key + bias
    t, e = x.shape
    if n_group > 1:
        best = key.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)
        groups = best.topk(topk_group or n_group, dim=-1).indices
        allowed = torch.zeros(t, n_group, dtype=torch.bool, device=x.device).scatter_(1, groups, True)
        key = key.masked_fill(~allowed.repeat_interleave(e // n_group, dim=1), float("-inf"))
    experts = key.topk(top_k, dim=-1).indices
    if topk_softmax:
        weights = torch.softmax(x.gather(1, experts), -1) * scale
    else:
        chosen = s.gather(1, experts)
        weights = scale * (chosen / (chosen.sum(-1, keepdim=True) + 1e-20) if normalize else chosen)
    counts = torch.bincount(experts.flatten(), minlength=e)
    aux = (s / s.sum(-1, keepdim=True) if score == "sigmoid" else p).sum(0)
    return weights, experts, counts, aux, lse


def _router_step(fn, logits, kwargs, backward):
    def step():
        x = logits.detach().requires_grad_(backward)
        weights, _, _, aux, lse = fn(x, **kwargs)
        if backward:
            (weights.sum() + aux.sum() + lse.square().mean()).backward()

    return step


def run_router(dtypes, tokens: int, *, device="cpu", min_run_time=0.5, log=print) -> list[dict]:
    """Every (dtype, routing, fwd / fwd+bwd) of ops.moe_router against ``torch_route``."""
    from megakernels.ops import moe_router

    rows, table = [], TablePrinter(log)
    for dtype_name in dtypes:
        for name, spec in ROUTINGS.items():
            spec = dict(spec)
            e = spec.pop("experts")
            g = torch.Generator().manual_seed(0)
            logits = torch.randn(tokens, e, generator=g).to(device=device, dtype=DTYPES[dtype_name])
            if spec.pop("bias", False):
                spec["bias"] = (torch.randn(e, generator=g) * 0.01).to(device)
            for backward in (False, True):
                times = {
                    OURS: median_seconds(_router_step(moe_router, logits, spec, backward), min_run_time),
                    "torch": median_seconds(_router_step(torch_route, logits, spec, backward), min_run_time),
                }
                work = logits.numel() * logits.element_size() * (2 if backward else 1)
                row = result_row(
                    "moe_router",
                    FAMILY,
                    dtype=dtype_name,
                    shape=f"{tokens}x{e}",
                    pass_="fwd+bwd" if backward else "fwd",
                    size=logits.numel(),
                    size_label="tokens x experts",
                    unit="GB/s",
                    work=work,
                    times=times,
                    ceiling=None,
                    ceiling_name="",
                    variant=name,
                    top_k=spec["top_k"],
                )
                rows.append(row)
                table(row)
    return rows


# ---- the permutation ---------------------------------------------------------------------------------------------

PERMUTES = {"top2-of-8": (8, 2), "top8-of-64": (64, 8)}
PERMUTE_TOKENS, QUICK_PERMUTE_TOKENS, PERMUTE_HIDDEN = 8192, 64, 1024


def torch_permute_unpermute(x, experts, weights, num_experts):
    """The argsort path: the rows in expert order, then back, weighted and summed."""
    t, k = experts.shape
    order = torch.argsort(experts.reshape(-1), stable=True)
    rows = x.index_select(0, order // k)
    full = rows.new_zeros((t * k, x.shape[1])).index_copy(0, order, rows)
    return (full.view(t, k, -1).float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def ours_permute_unpermute(x, experts, weights, num_experts):
    from megakernels.ops.moe_permute import moe_permute, moe_unpermute

    p = moe_permute(x, experts, num_experts)
    return moe_unpermute(p.rows, p.dest, weights)


def run_permute(dtypes, tokens: int, *, device="cpu", min_run_time=0.5, log=print) -> list[dict]:
    rows, table = [], TablePrinter(log)
    for dtype_name in dtypes:
        for name, (e, k) in PERMUTES.items():
            g = torch.Generator().manual_seed(0)
            x = torch.randn(tokens, PERMUTE_HIDDEN, generator=g).to(device=device, dtype=DTYPES[dtype_name])
            experts = torch.rand(tokens, e, generator=g).topk(k, dim=-1).indices.to(device)
            weights = torch.rand(tokens, k, generator=g).to(device)
            for backward in (False, True):

                def step(fn, x=x, experts=experts, weights=weights, e=e, backward=backward):
                    def go():
                        xs = x.detach().requires_grad_(backward)
                        out = fn(xs, experts, weights, e)
                        if backward:
                            out.sum().backward()

                    return go

                times = {
                    OURS: median_seconds(step(ours_permute_unpermute), min_run_time),
                    "torch": median_seconds(step(torch_permute_unpermute), min_run_time),
                }
                moved = 2 * tokens * k * PERMUTE_HIDDEN * x.element_size() * (2 if backward else 1)
                row = result_row(
                    "moe_permute",
                    FAMILY,
                    dtype=dtype_name,
                    shape=f"{tokens}x{PERMUTE_HIDDEN}",
                    pass_="fwd+bwd" if backward else "fwd",
                    size=tokens * k,
                    size_label="assignments",
                    unit="GB/s",
                    work=moved,
                    times=times,
                    ceiling=None,
                    ceiling_name="",
                    variant=name,
                    top_k=k,
                )
                rows.append(row)
                table(row)
    return rows


def run(request: Request) -> list[dict]:
    """The rows of the request's ops (``grouped_gemm``, ``moe_dispatch``; ``common.Request``); the dispatch runs on
    CPU ranks only."""
    rows = []
    if "grouped_gemm" in request.ops:
        rows += run_grouped_gemm(
            request.dtypes_or(DEFAULT_DTYPES),
            default_shapes(request.device, request.quick),
            device=request.device,
            min_run_time=request.min_run_time,
            ceilings=request.ceilings,
            notes=request.notes,
            log=request.log,
        )
    if "moe_router" in request.ops:
        rows += run_router(
            request.dtypes_or(("float32", "bfloat16")),
            QUICK_ROUTER_TOKENS if request.quick else ROUTER_TOKENS,
            device=request.device,
            min_run_time=request.min_run_time,
            log=request.log,
        )
    if "moe_permute" in request.ops:
        rows += run_permute(
            request.dtypes_or(("float32", "bfloat16")),
            QUICK_PERMUTE_TOKENS if request.quick else PERMUTE_TOKENS,
            device=request.device,
            min_run_time=request.min_run_time,
            log=request.log,
        )
    if "moe_dispatch" in request.ops:
        if request.device == "cpu":
            rows += run_dispatch(
                DISPATCH_WORLDS,
                QUICK_DISPATCH_ROWS if request.quick else DISPATCH_ROWS,
                reps=5 if request.quick else 20,
                log=request.log,
            )
        else:
            request.notes.append("moe_dispatch runs on gloo CPU ranks only (skipped with --device cuda)")
    return rows
