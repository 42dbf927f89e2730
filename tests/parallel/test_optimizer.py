"""DistributedDataParallel and ParallelOptimizer in one process (no process group: one data-parallel rank): the
grad buffer layout, accumulation into main_grad, weight decay only on params with more than one dimension, fp32
masters that keep updates smaller than a bf16 ulp, the fp16 skip, state_dict round trips, the memory accounting
table and argument errors. The multi-rank behaviour is in test_ddp.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from megakernels.optim import DynamicLossScaler, WarmupCosineSchedule
from megakernels.parallel.ddp import DistributedDataParallel, finalize_model_grads
from megakernels.parallel.optimizer import ParallelOptimizer, memory_bytes_per_param
from megakernels.parallel.params import mark_shared_embedding


def _model(dtype=torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2)).to(dtype)


def _backward(ddp, dtype=torch.float32, scale=1.0):
    x = torch.linspace(-1, 1, 12).reshape(3, 4).to(dtype)
    (ddp(x).float().square().sum() * scale).backward()


def test_main_grads_are_views_of_one_fp32_buffer_in_reverse_registration_order():
    model = _model(torch.bfloat16)
    ddp = DistributedDataParallel(model, bucket_size=20)
    params = list(model.parameters())
    assert [p for b in ddp.buckets for p in b.params] == params[::-1]
    assert len(ddp.grad_buffers) == 1 and ddp.grad_buffers[0].dtype == torch.float32
    for p in params:
        assert p.main_grad.dtype == torch.float32 and p.main_grad.shape == p.shape
        assert p.main_grad.untyped_storage().data_ptr() == ddp.grad_buffers[0].untyped_storage().data_ptr()
    assert all(sum(p.numel() for p in b.params) >= 20 for b in ddp.buckets[:-1])


def test_backward_accumulates_into_main_grad_and_drops_grad():
    model = _model()
    ref = _model()
    ddp = DistributedDataParallel(model)
    for _ in range(2):
        with ddp.no_sync():
            _backward(ddp)
        _backward(ref)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.grad is None
        torch.testing.assert_close(p.main_grad, r.grad)
    ddp.zero_grad_buffer()  # a new step: the buffer counts as zero (it is not filled; see the next tests)
    ddp.finish_grad_sync()
    assert all(torch.equal(p.main_grad, torch.zeros_like(p)) for p in model.parameters())


def _partly_used_step(ddp, model, ref, use_head: bool, micro: int) -> None:
    """``micro`` backward passes through ``model`` (the last with grad sync) and through ``ref`` (plain autograd);
    without ``use_head`` the loss skips the last Linear, whose params get no gradient."""
    for m in range(micro):
        x = torch.linspace(-1, 1, 12).reshape(3, 4) * (m + 1)
        for net, wrapped in ((model, True), (ref, False)):
            out = net(x) if use_head else net[1](net[0](x))
            loss = out.square().sum()
            if wrapped and m < micro - 1:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()


@pytest.mark.parametrize("bucket_size", [3, 12, 10**6])  # one bucket per param; mixed buckets; one bucket
def test_first_touch_grads_equal_zero_fill_and_accumulate_and_unused_params_read_zero(bucket_size):
    model, ref = _model(), _model()
    ddp = DistributedDataParallel(model, bucket_size=bucket_size)
    used = {id(p) for p in list(model[0].parameters()) + list(model[1].parameters())}
    for step, (use_head, micro) in enumerate([(True, 2), (False, 1), (False, 3), (True, 1)]):
        ddp.zero_grad_buffer()
        for p in ref.parameters():
            p.grad = None
        _partly_used_step(ddp, model, ref, use_head, micro)
        if step == 1:  # before the sync: only the params that received a gradient hold this step's values
            for p, r in zip(model.parameters(), ref.parameters()):
                if id(p) in used:
                    torch.testing.assert_close(p.main_grad, r.grad)
        ddp.finish_grad_sync()
        for i, (p, r) in enumerate(zip(model.parameters(), ref.parameters())):
            expected = r.grad if r.grad is not None else torch.zeros_like(p)
            assert (r.grad is None) == (not use_head and id(p) not in used)
            torch.testing.assert_close(p.main_grad, expected, msg=f"step {step} param {i}")
        for b in ddp.buckets:  # the padding is never written
            at = b.offsets[-1] + b.params[-1].numel()
            assert torch.equal(b.grad_data[at:], torch.zeros(b.numel - at))


def test_zero_missing_grads_before_the_sync_and_a_step_without_finalize():
    model, ref = _model(), _model()
    ddp = DistributedDataParallel(model, bucket_size=3)
    opt = ParallelOptimizer(ddp, lr=0.1, weight_decay=0.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.0)
    for use_head in (True, False, False):
        opt.zero_grad()
        ref_opt.zero_grad(set_to_none=True)
        with ddp.no_sync():  # nothing launched: the step itself must not read the stale values of the head
            _partly_used_step(ddp, model, ref, use_head, 1)
        for r in ref.parameters():
            if r.grad is None:
                r.grad = torch.zeros_like(r)
        opt.step()
        ref_opt.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r)
    ddp.zero_grad_buffer()
    ddp.zero_missing_grads()
    assert all(torch.equal(p.main_grad, torch.zeros_like(p)) for p in model.parameters())


def test_separate_params_get_a_bucket_of_their_own():
    model = _model()
    mark_shared_embedding(model[1].weight)
    ddp = DistributedDataParallel(model, bucket_size=10**6)
    assert [len(b.params) for b in ddp.buckets] == [3, 1, 2]  # reverse order: head, LN bias | LN weight | first
    assert ddp.buckets[1].params == [model[1].weight]


def test_a_grad_after_its_bucket_was_synced_is_an_error():
    ddp = DistributedDataParallel(_model())
    _backward(ddp)
    with pytest.raises(RuntimeError, match="after its bucket's gradient sync was launched"):
        _backward(ddp)


def test_no_sync_restores_the_previous_setting():
    ddp = DistributedDataParallel(_model())
    ddp.set_grad_sync(False)
    with ddp.no_sync():
        pass
    assert ddp._sync_enabled is False


def test_weight_decay_only_on_params_with_more_than_one_dimension():
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ddp = DistributedDataParallel(model)
    opt = ParallelOptimizer(ddp, lr=0.1, weight_decay=0.5)
    assert opt.step()[0]  # all grads zero: only the decay moves params
    for n, p in model.named_parameters():
        factor = 1 - 0.1 * 0.5 if p.dim() > 1 else 1.0
        torch.testing.assert_close(p.detach(), before[n] * factor, msg=n)


def test_bf16_masters_keep_updates_smaller_than_half_an_ulp():
    p = nn.Parameter(torch.ones(16, 16, dtype=torch.bfloat16))
    holder = nn.Module()
    holder.p = p
    ddp = DistributedDataParallel(holder)
    opt = ParallelOptimizer(ddp, lr=1e-3, weight_decay=0.0, precision="bf16")
    for _ in range(10):  # each Adam update is ~lr = 1e-3, below bf16's half ulp at 1.0 (2^-8)
        opt.zero_grad()
        p.sum().backward()
        opt.step()
    assert opt.pieces[0].main.dtype == torch.float32
    torch.testing.assert_close(opt.pieces[0].main, torch.full((256,), 0.99), rtol=0, atol=1e-6)
    assert torch.equal(p.detach(), torch.full((16, 16), 0.99).bfloat16())


def test_fp16_overflow_skips_the_step_and_backs_off():
    model = _model(torch.float16)
    ddp = DistributedDataParallel(model)
    opt = ParallelOptimizer(ddp, precision="fp16", loss_scaler=DynamicLossScaler(2.0**4, growth_interval=2))
    before = [p.detach().clone() for p in model.parameters()]
    _backward(ddp, torch.float16, opt.loss_scale)
    model[0].weight.main_grad[0, 0] = float("nan")
    assert opt.step() == (False, None) and opt.loss_scale == 8.0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    for _ in range(2):
        opt.zero_grad()
        _backward(ddp, torch.float16, opt.loss_scale)
        stepped, norm = opt.step()
        assert stepped and norm > 0
    assert opt.loss_scale == 16.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_non_finite_grad_skips_the_step_without_a_loss_scaler(precision, bad):
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = _model(dtype)
    ddp = DistributedDataParallel(model)
    opt = ParallelOptimizer(ddp, precision=precision, clip_grad=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    masters = [piece.main.clone() for piece in opt.pieces]
    _backward(ddp, dtype)
    model[2].bias.main_grad[1] = bad
    stepped, norm = opt.step()
    assert not stepped and not math.isfinite(norm)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(torch.equal(m, piece.main) for m, piece in zip(masters, opt.pieces))
    assert all(st["step"].item() == 0 for st in opt._adam.state.values())
    opt.zero_grad()
    _backward(ddp, dtype)
    stepped, norm = opt.step()
    assert stepped and math.isfinite(norm) and norm > 0
    assert all(not torch.equal(m, piece.main) for m, piece in zip(masters, opt.pieces))
    assert all(st["step"].item() == 1 for st in opt._adam.state.values())


def test_16_bit_grad_buffers_are_widened_for_the_fp32_step():
    model, ref = _model(), _model()
    ddp = DistributedDataParallel(model, grad_dtype=torch.bfloat16)
    assert model[0].weight.main_grad.dtype == torch.bfloat16
    opt, ref_opt = ParallelOptimizer(ddp, clip_grad=1.0), ParallelOptimizer(DistributedDataParallel(ref), clip_grad=1.0)
    _backward(ddp)
    _backward(ref_opt.models[0])
    (s1, n1), (s2, n2) = opt.step(), ref_opt.step()
    assert s1 and s2 and n1 == pytest.approx(n2, rel=1e-2)


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_16_bit_grad_buffers_of_16_bit_params_step_as_fp32_buffers_do(clip):
    """grad_dtype=None (the trainer's choice where nothing is summed into the buffers): the bf16 buffers hold each
    param's bf16 gradient exactly as the fp32 buffers hold it widened; the norm and the AdamW kernel read them in 16
    bits, and every step is the fp32 buffers' step, bit for bit (norm, params, masters)."""
    runs = []
    for grad_dtype in (torch.float32, None):
        model = _model(torch.bfloat16)
        ddp = DistributedDataParallel(model, grad_dtype=grad_dtype)
        opt = ParallelOptimizer(ddp, precision="bf16", clip_grad=clip)
        norms = []
        for _ in range(4):
            opt.zero_grad()
            _backward(ddp, torch.bfloat16)
            finalize_model_grads([ddp])
            norms.append(opt.step()[1])
        assert (model[0].weight.main_grad.dtype == torch.bfloat16) == (grad_dtype is None)
        assert all(piece.main.grad is None for piece in opt.pieces) == (grad_dtype is None)  # no fp32 copy
        runs.append((norms, [p.detach().clone() for p in model.parameters()] + [m.main for m in opt._masters]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_state_dict_round_trip_continues_identically():
    runs = []
    for reload in (False, True):
        model = _model(torch.bfloat16)
        ddp = DistributedDataParallel(model)
        opt = ParallelOptimizer(ddp, precision="bf16", clip_grad=0.5)
        for step in range(3):
            if step == 2 and reload:
                saved = opt.state_dict()
                opt = ParallelOptimizer(ddp, precision="bf16", clip_grad=0.5)
                opt.load_state_dict(saved)
            opt.zero_grad()
            _backward(ddp, torch.bfloat16)
            finalize_model_grads([ddp])
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()] + [m.main for m in opt._masters])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_lr_schedule_sets_every_group_and_lr_reports_it():
    opt = ParallelOptimizer(DistributedDataParallel(_model()), lr=1.0)
    WarmupCosineSchedule(lr=2e-3, warmup_steps=4, total_steps=10).apply(opt, 2)
    assert opt.lr == 1e-3 and [g["lr"] for g in opt.param_groups] == [1e-3, 1e-3]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert opt.loss_scale == 1.0


def test_memory_table_is_megatrons():
    assert memory_bytes_per_param("bf16", False) == (2, 4, 12)
    assert memory_bytes_per_param("fp16", True, 8) == (2, 4, 1.5)
    assert memory_bytes_per_param("fp32", True, 4) == (4, 4, 2)
    with pytest.raises(ValueError, match="precision must be one of"):
        memory_bytes_per_param("fp8", False)
    with pytest.raises(ValueError, match="dp must be a positive int"):
        memory_bytes_per_param("bf16", True, 0)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(precision="fp8"), ValueError, "precision must be one of"),
        (dict(clip_grad=-1.0), ValueError, "clip_grad must be a finite number >= 0"),
        (dict(loss_scaler=DynamicLossScaler()), ValueError, "loss_scaler is only used with precision='fp16'"),
        (dict(distributed=True), ValueError, "reduce_scatter=False, distributed=True needs reduce_scatter=True"),
        (dict(precision="fp16"), None, None),
        (dict(lr=-1.0), ValueError, "lr must be a finite number >= 0"),
    ],
)
def test_optimizer_arguments_are_checked(kwargs, error, message):
    ddp = DistributedDataParallel(_model())
    if error is None:
        ParallelOptimizer(ddp, **kwargs)
        return
    with pytest.raises(error, match=message):
        ParallelOptimizer(ddp, **kwargs)


def test_optimizer_rejects_params_it_cannot_step():
    with pytest.raises(TypeError, match="wrap it in DistributedDataParallel"):
        ParallelOptimizer(_model())
    with pytest.raises(ValueError, match="has no main_grad"):
        ParallelOptimizer(list(_model().parameters()))
    with pytest.raises(ValueError, match="precision='fp32' allows params of dtype"):
        ParallelOptimizer(DistributedDataParallel(_model(torch.bfloat16)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(bucket_size=0), "bucket_size must be a positive int"),
        (dict(grad_dtype=torch.float64), "grad_dtype must be float32, bfloat16, float16 or None"),
    ],
)
def test_ddp_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedDataParallel(_model(), **kwargs)


def test_ddp_needs_trainable_params():
    with pytest.raises(ValueError, match="no parameters with requires_grad=True"):
        DistributedDataParallel(_model().requires_grad_(False))
