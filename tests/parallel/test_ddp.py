"""Data parallelism and the parallel optimizer against plain single-process PyTorch: DistributedDataParallel's
all-reduce and reduce-scatter give the mean gradient over dp, gradient accumulation with sync on the last
micro-batch equals one big batch, bucket collectives overlap backward; ZeRO-1 and the non-distributed step equal
torch.optim.AdamW on the averaged grads (fp32), bf16 keeps fp32 masters, an fp16 overflow on one rank skips the
step on every rank, the global grad norm counts every param once under tp / pp (tied embedding) / ZeRO-1 and clips
like torch.nn.utils.clip_grad_norm_ (also with the optimizer offloaded), the offloaded step copies each reduced
bucket to the host and equals the device step bit for bit, and the memory held per param follows Megatron's
accounting.
One world of 4 gloo processes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import megakernels.parallel as mp
from megakernels.optim import DynamicLossScaler
from megakernels.parallel import params
from megakernels.parallel.ddp import DistributedDataParallel, finalize_model_grads
from megakernels.parallel.optimizer import ParallelOptimizer, memory_bytes_per_param
from tests.parallel.checks import Checks, assert_close, block, randn

CHECKS = Checks()
IN, H, OUT, B = 6, 10, 3, 4
ADAM = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, H), nn.Tanh(), nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H), nn.Tanh(), nn.Linear(H, OUT)
    )


def _batch(dp_rank: int, micro: int = 0, n: int = B):
    return randn(n, IN, seed=100 + 10 * dp_rank + micro), randn(n, OUT, seed=200 + 10 * dp_rank + micro)


def _reference_grads(model: nn.Module, step: int = 0) -> dict[str, torch.Tensor]:
    """fp64 gradients of the mean over dp ranks of each rank's loss, in one process."""
    ref = copy.deepcopy(model).double()
    dp = mp.dp_size()
    loss = sum(F.mse_loss(ref(x.double()), y.double()) for x, y in (_batch(r, step) for r in range(dp))) / dp
    loss.backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _torch_adamw(params: list[torch.Tensor]) -> torch.optim.AdamW:
    decay = [p for p in params if p.dim() > 1]
    return torch.optim.AdamW(
        [{"params": decay}, {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}], foreach=False, **ADAM
    )


@CHECKS.add("all_reduce_and_reduce_scatter_give_the_mean_gradient_over_dp")
def _(rank, world):
    mp.initialize(1, 1, 4)
    for reduce_scatter in (False, True):
        model = _mlp()
        expected = _reference_grads(model)
        ddp = DistributedDataParallel(model, bucket_size=50, reduce_scatter=reduce_scatter)
        assert len(ddp.buckets) > 2 and all(b.numel % 4 == 0 for b in ddp.buckets)
        x, y = _batch(mp.dp_rank())
        F.mse_loss(ddp(x), y).backward()
        ddp.finish_grad_sync()
        names = {p: n for n, p in model.named_parameters()}
        assert all(p.grad is None for p in model.parameters())
        for b in ddp.buckets:
            ref = torch.zeros(b.numel, dtype=torch.float64)
            for p, at in zip(b.params, b.offsets):
                ref[at : at + p.numel()] = expected[names[p]].flatten()
            part = (
                slice(mp.dp_rank() * b.shard_size, (mp.dp_rank() + 1) * b.shard_size) if reduce_scatter else slice(None)
            )
            assert_close(b.grad_data[part], ref[part], f"reduce_scatter={reduce_scatter} bucket")


@CHECKS.add("grad_accumulation_with_sync_on_the_last_micro_batch_equals_one_big_batch")
def _(rank, world):
    mp.initialize(1, 1, 4)
    micro = 3
    model = _mlp()
    ref = copy.deepcopy(model).double()
    xs, ys = zip(*[_batch(r, m) for r in range(4) for m in range(micro)])
    F.mse_loss(ref(torch.cat(xs).double()), torch.cat(ys).double()).backward()
    ddp = DistributedDataParallel(model, bucket_size=64)
    for m in range(micro):
        x, y = _batch(mp.dp_rank(), m)
        with mp.record_events() as events:
            if m < micro - 1:
                with ddp.no_sync():
                    (F.mse_loss(ddp(x), y) / micro).backward()
            else:
                (F.mse_loss(ddp(x), y) / micro).backward()
        launches = [e for e in events if e[0] == "launch"]
        assert launches == ([] if m < micro - 1 else [("launch", "all_reduce")] * len(ddp.buckets)), events
    ddp.finish_grad_sync()
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close(p.main_grad, r.grad, name)


@CHECKS.add("first_touch_grads_over_dp_equal_the_mean_and_params_unused_in_a_step_read_zero_after_the_sync")
def _(rank, world):
    # The buffer is not zero-filled between steps: each param's first gradient is copied in, the params without one
    # are zeroed when their bucket is launched. Step 1 leaves the last Linear unused, step 2 uses every layer again
    # and step 0's values must not leak into either; bucket_size 30 gives the unused params a bucket of their own
    # (never completed by a hook: launched by finish_grad_sync), 40 shares one with a used bias.
    mp.initialize(1, 1, 4)
    for reduce_scatter in (False, True):
        for bucket_size in (30, 40):
            model = _mlp()
            ref = copy.deepcopy(model).double()
            ddp = DistributedDataParallel(model, bucket_size=bucket_size, reduce_scatter=reduce_scatter)
            head = {id(p) for p in model[6].parameters()}
            shared = [b for b in ddp.buckets if any(id(p) in head for p in b.params)]
            assert len(shared) == 1 and (len(shared[0].params) == 2) == (bucket_size == 30)
            names = {p: n for n, p in model.named_parameters()}
            for step, (use_head, micro) in enumerate([(True, 2), (False, 2), (True, 1)]):
                net = (lambda m: m) if use_head else (lambda m: m[:5])
                ddp.zero_grad_buffer()
                for m in range(micro):  # the mean over ranks and micro-batches of each one's loss
                    x, y = _batch(mp.dp_rank(), 10 * step + m)
                    loss = net(ddp.module)(x).sum(1).sub(y[:, 0]).square().mean() / micro
                    if m < micro - 1:
                        with ddp.no_sync():
                            loss.backward()
                    else:
                        loss.backward()
                ddp.finish_grad_sync()
                for p in ref.parameters():
                    p.grad = None
                batches = [_batch(r, 10 * step + m) for r in range(4) for m in range(micro)]
                sum(net(ref)(x.double()).sum(1).sub(y[:, 0].double()).square().mean() for x, y in batches).div(
                    4 * micro
                ).backward()
                expected = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in ref.named_parameters()}
                assert all((expected[names[p]].abs().sum() == 0) == (not use_head) for p in model[6].parameters())
                for b in ddp.buckets:  # the whole bucket, padding included (zero), as in the first check
                    want = torch.zeros(b.numel, dtype=torch.float64)
                    for p, at in zip(b.params, b.offsets):
                        want[at : at + p.numel()] = expected[names[p]].flatten()
                    n = b.shard_size
                    part = slice(mp.dp_rank() * n, (mp.dp_rank() + 1) * n) if reduce_scatter else slice(None)
                    what = f"reduce_scatter={reduce_scatter} bucket_size={bucket_size} step {step}"
                    assert_close(b.grad_data[part], want[part], what)


@CHECKS.add("bucket_collectives_are_launched_while_backward_still_runs_the_earlier_layers")
def _(rank, world):
    mp.initialize(1, 1, 4)
    for overlap, reduce_scatter in ((True, False), (True, True), (False, False)):
        kind = "reduce_scatter" if reduce_scatter else "all_reduce"
        model = _mlp()
        # bucket_size=1: every param is a bucket; a hook on the first layer's output marks where its backward starts.
        ddp = DistributedDataParallel(model, bucket_size=1, overlap=overlap, reduce_scatter=reduce_scatter)

        def mark(module, inputs, out):
            out.register_hook(lambda g: mp.comm.record("start", "first_layer_backward"))

        model[0].register_forward_hook(mark)
        x, y = _batch(mp.dp_rank())
        with mp.record_events() as events:
            F.mse_loss(ddp(x), y).backward()
            mp.comm.record("end", "backward")
            ddp.finish_grad_sync()
        start, end = events.index(("start", "first_layer_backward")), events.index(("end", "backward"))
        if overlap:  # the 3 later layers' weights and biases before, the first layer's 2 params after
            assert events[:start] == [("launch", kind)] * 6, events
            assert events[start + 1 : end] == [("launch", kind)] * 2, events
        else:
            assert events[:end] == [("start", "first_layer_backward")], events
            assert events[end + 1 : end + 9] == [("launch", kind)] * 8, events
        assert events[-8:] == [("wait", kind)] * 8, events


def _train(model, distributed: bool, steps: int, offload: bool = False, after_sync=None):
    ddp = DistributedDataParallel(model, bucket_size=64, reduce_scatter=distributed)
    opt = ParallelOptimizer(ddp, distributed=distributed, offload=offload, **ADAM)
    for s in range(steps):
        opt.zero_grad()
        x, y = _batch(mp.dp_rank(), s)
        with mp.record_events() as events:
            F.mse_loss(ddp(x), y).backward()
            finalize_model_grads([ddp])
        if after_sync is not None:
            after_sync(ddp, opt, events)
        assert opt.step()[0]
    return ddp, opt


@CHECKS.add("offloaded_steps_copy_each_reduced_bucket_to_the_host_and_equal_the_device_steps_under_dp_and_zero1")
def _(rank, world):
    mp.initialize(1, 1, 4)

    def copied_per_bucket(ddp, opt, events):
        kind = "reduce_scatter" if ddp.reduce_scatter else "all_reduce"
        # each bucket's copy right after its collective completed, before the step; the host holds the reduced grads
        synced = [e for e in events if e[0] != "launch" and e[1] != "params_to_device"]  # not the forward's waits
        assert synced == [("wait", kind), ("copy", "grads_to_host")] * len(ddp.buckets), events
        for piece in opt.pieces:
            assert torch.equal(piece.main.grad, piece.grad)

    for distributed in (False, True):
        ref, _ = _train(_mlp(), distributed, 3)
        got, opt = _train(_mlp(), distributed, 3, offload=True, after_sync=copied_per_bucket)
        assert len(got.buckets) > 2 and all(piece.main.device.type == "cpu" for piece in opt.pieces)
        for (name, p), r in zip(got.module.named_parameters(), ref.module.parameters()):
            assert torch.equal(p, r), (distributed, name)


@CHECKS.add("zero1_and_non_distributed_steps_equal_torch_adamw_on_the_averaged_grads")
def _(rank, world):
    mp.initialize(1, 1, 4)
    steps = 3
    ref = _mlp().double()
    ref_opt = _torch_adamw(list(ref.parameters()))
    for s in range(steps):
        ref_opt.zero_grad()
        sum(F.mse_loss(ref(x.double()), y.double()) for x, y in (_batch(r, s) for r in range(4))).div(4).backward()
        ref_opt.step()
    for distributed in (False, True):
        ddp, _ = _train(_mlp(), distributed, steps)
        for (name, p), r in zip(ddp.module.named_parameters(), ref.parameters()):
            assert_close(p, r, f"distributed={distributed} {name}", rtol=1e-6)


def _linear_loss(model: nn.Module, grads: dict[str, torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    """Σ_p Σ p·G_p·scale: every param's gradient is exactly its G (rounded to its dtype) times scale."""
    return sum((p * (grads[n] * scale).to(p.dtype)).sum() for n, p in model.named_parameters())


class _Params(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor], dtype=torch.float32, **marks: dict[str, bool]):
        super().__init__()
        for name, t in tensors.items():
            self.register_parameter(name, nn.Parameter(t.to(dtype).clone()))
        mark = {
            "tensor_parallel": params.mark_tensor_parallel,
            "sequence_parallel": params.mark_sequence_parallel,
            "shared_embedding": params.mark_shared_embedding,
            "shared_embedding_duplicate": lambda p: params.mark_shared_embedding(p, duplicate=True),
        }
        for attr, names in marks.items():
            for name in names:
                mark[attr](getattr(self, name))


@CHECKS.add("bf16_params_follow_fp32_masters_that_equal_the_fp32_reference")
def _(rank, world):
    mp.initialize(1, 1, 4)
    shapes = {"w1": (12, 8), "b1": (12,), "w2": (6, 12), "g2": (6,)}
    init = {n: randn(*s, seed=i).bfloat16().float() for i, (n, s) in enumerate(shapes.items())}
    grad = lambda d, s: {n: randn(*sh, seed=50 + 7 * d + 31 * s).bfloat16().float() for n, sh in shapes.items()}
    ref = _Params(init)
    ref_opt = _torch_adamw(list(ref.parameters()))
    for distributed in (False, True):
        model = _Params(init, torch.bfloat16)
        ddp = DistributedDataParallel(model, bucket_size=64, reduce_scatter=distributed)
        opt = ParallelOptimizer(ddp, distributed=distributed, precision="bf16", **ADAM)
        for s in range(4):
            opt.zero_grad()
            _linear_loss(model, grad(mp.dp_rank(), s)).backward()
            finalize_model_grads([ddp])
            assert opt.step()[0]
            if not distributed:
                for p in ref.parameters():
                    p.grad = None
                _linear_loss(ref, {n: sum(grad(d, s)[n] for d in range(4)) / 4 for n in shapes}).backward()
                ref_opt.step()
        names = {p: n for n, p in model.named_parameters()}
        for piece in opt.pieces:  # fp32 masters equal the fp32 reference; the bf16 params are them rounded
            assert piece.main.dtype == torch.float32 and piece.flat.dtype == torch.bfloat16
            assert torch.equal(piece.flat, piece.main.bfloat16())
            expected = getattr(ref, names[piece.param]).detach().flatten()[piece.lo : piece.hi]
            assert_close(piece.main, expected, f"distributed={distributed} master of {names[piece.param]}", rtol=1e-6)
        for name, p in model.named_parameters():  # ... and the bf16 params are them rounded (within one ulp)
            assert p.dtype == torch.bfloat16
            assert_close(p, getattr(ref, name).detach(), f"distributed={distributed} {name}", rtol=2**-8)


@CHECKS.add("fp16_overflow_on_one_rank_makes_every_rank_skip_and_back_off")
def _(rank, world):
    mp.initialize(1, 1, 4)
    shapes = {"w": (9, 7), "b": (9,)}
    model = _Params({n: randn(*s, seed=i) for i, (n, s) in enumerate(shapes.items())}, torch.float16)
    ddp = DistributedDataParallel(model, bucket_size=64, reduce_scatter=True)
    opt = ParallelOptimizer(ddp, distributed=True, precision="fp16", loss_scaler=DynamicLossScaler(2.0**8), **ADAM)
    history = []
    for s in range(3):
        opt.zero_grad()
        grads = {n: randn(*sh, seed=60 + s + 10 * mp.dp_rank(), scale=1e-2) for n, sh in shapes.items()}
        if s == 1 and mp.dp_rank() == 1:
            grads["w"][4, 2] = float("inf")  # lands in another rank's shard after the reduce-scatter
        before = [p.detach().clone() for p in model.parameters()]
        steps_before = [st["step"].item() for st in opt._adam.state.values()]
        _linear_loss(model, grads, scale=opt.loss_scale).backward()
        finalize_model_grads([ddp])
        stepped, norm = opt.step()
        changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        history.append((stepped, norm is None, changed, opt.loss_scale))
        if s == 1:
            assert [st["step"].item() for st in opt._adam.state.values()] == steps_before
    assert history == [(True, False, True, 256.0), (False, True, False, 128.0), (True, False, True, 128.0)], history


def _clip_case(layout: str, dp_rank: int, tp_rank: int, pp_rank: int, step: int):
    """Full params, this rank's params (with marks) and the per-rank grads for the clipping checks."""
    g = lambda name, *shape, d=dp_rank, t=0: randn(*shape, seed=1000 * sum(map(ord, name)) + 100 * d + 10 * t + step)
    if layout == "tp2":
        full = {"w": randn(8, 6, seed=1), "r": randn(5, seed=2), "s": randn(4, seed=3)}
        local = {"w": block(full["w"], 0, tp_rank, 2), "r": full["r"], "s": full["s"]}
        marks = {"tensor_parallel": ["w"], "sequence_parallel": ["s"]}
        grads = lambda d: {"w": g("w", 8, 6, d=d), "r": g("r", 5, d=d), "s": g("s", 4, d=d, t=tp_rank)}
        local_grads = {**grads(dp_rank), "w": block(grads(dp_rank)["w"], 0, tp_rank, 2)}
        mean = {n: sum(grads(d)[n] for d in range(2)) / 2 for n in full}
        mean["s"] = sum(g("s", 4, d=d, t=t) for d in range(2) for t in range(2)) / 2
        return full, local, marks, local_grads, mean
    full = {"e": randn(10, 4, seed=1), "w0": randn(4, 4, seed=2), "w1": randn(4, 3, seed=3), "c": randn(3, seed=4)}
    names = ["e", "w0"] if pp_rank == 0 else ["e", "w1", "c"]
    marks = {"shared_embedding": ["e"], "shared_embedding_duplicate": ["e"] if pp_rank == 1 else []}
    stage = lambda d, p: {n: g(n, *full[n].shape, d=d, t=p) for n in (["e", "w0"] if p == 0 else ["e", "w1", "c"])}
    mean = {n: sum(stage(d, p)[n] for d in range(2) for p in range(2) if n in stage(d, p)) / 2 for n in full}
    return full, {n: full[n] for n in names}, marks, stage(dp_rank, pp_rank), mean


@CHECKS.add("global_grad_norm_clipping_equals_clip_grad_norm_on_the_unsharded_model")
def _(rank, world):
    for layout, tp, pp in (("tp2", 2, 1), ("pp2_tied_embedding", 1, 2)):
        # offload: the sequence-parallel and tied-embedding grads change after the DP sync, copied at step time
        for distributed, offload in ((False, False), (True, False), (False, True), (True, True)):
            what = f"{layout} distributed={distributed} offload={offload}"
            mp.initialize(tp, pp, 2)
            full, local, marks, _, _ = _clip_case(layout, mp.dp_rank(), mp.tp_rank(), mp.pp_rank(), 0)
            model, ref = _Params(local, **marks), _Params(full)
            ddp = DistributedDataParallel(model, bucket_size=16, reduce_scatter=distributed)
            opt = ParallelOptimizer(ddp, distributed=distributed, clip_grad=0.3, offload=offload, **ADAM)
            ref_opt = _torch_adamw(list(ref.parameters()))
            for s in range(2):
                *_, grads, mean = _clip_case(layout, mp.dp_rank(), mp.tp_rank(), mp.pp_rank(), s)
                opt.zero_grad()
                _linear_loss(model, grads).backward()
                finalize_model_grads([ddp])
                stepped, norm = opt.step()
                for n, p in ref.named_parameters():
                    p.grad = mean[n].clone()
                ref_norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.3)
                ref_opt.step()
                assert stepped and abs(norm - ref_norm.item()) <= 1e-5 * ref_norm.item(), (what, norm, ref_norm)
            for n, p in model.named_parameters():
                expected = getattr(ref, n).detach()
                if n == "w":
                    expected = block(expected, 0, mp.tp_rank(), 2)
                assert_close(p, expected, f"{what} {n}", rtol=1e-6)
            mp.destroy()


@CHECKS.add("memory_per_param_matches_megatrons_accounting_on_the_tensors_held")
def _(rank, world):
    mp.initialize(1, 1, 4)
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for distributed in (False, True):
            model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 33)).to(dtype)
            n = sum(p.numel() for p in model.parameters())
            ddp = DistributedDataParallel(model, bucket_size=2000, reduce_scatter=distributed)
            opt = ParallelOptimizer(ddp, distributed=distributed, precision=precision, **ADAM)
            opt.zero_grad()
            ddp(torch.ones(2, 64, dtype=dtype)).sum().backward()
            finalize_model_grads([ddp])
            opt.step()  # moments exist after the first step
            held = opt.memory_bytes()
            pad = sum(b.numel for b in ddp.buckets) - n
            assert 0 <= pad < 4 * len(ddp.buckets)
            per_param = memory_bytes_per_param(precision, distributed, 4)
            padded = n + pad if distributed else n  # ZeRO-1 moves params into the padded param buffer
            assert held["params"] == per_param[0] * padded, (precision, distributed, held)
            assert held["grads"] == per_param[1] * (n + pad), (precision, distributed, held)
            owned = sum(piece.hi - piece.lo for piece in opt.pieces)
            assert held["optimizer"] == (12 if precision == "bf16" else 8) * owned, (precision, distributed, held)
            assert abs(held["optimizer"] - per_param[2] * n) <= 12 * pad, (precision, distributed, held)
            expected = {
                ("bf16", True): (2, 4, 3.0),
                ("bf16", False): (2, 4, 12),
                ("fp32", True): (4, 4, 2.0),
                ("fp32", False): (4, 4, 8),
            }[precision, distributed]
            assert per_param == expected


def _world(rank, world_size):
    return CHECKS.run(rank, world_size)


world = CHECKS.fixture(4, _world)


@pytest.mark.parametrize("name", CHECKS.names())
def test_ddp(world, name):
    CHECKS.assert_passed(world, name)
