"""Specification of megakernels.optim.FusedAdamW on every backend: trajectories against torch.optim.AdamW,
master weights, state_dict interchange both ways, loss-scale unscaling, the skip-on-inf path, lr schedulers."""

from __future__ import annotations

import copy

import pytest
import torch

from megakernels.optim import FusedAdamW
from tests.optim.cases import SHAPES, SMALL_CHUNK, clone_params, grads_for, make_params, max_rel_error, set_grads


def steps_for(backend, n):
    # The emulator runs every CUDA thread as a host thread: fewer steps there (the kernels are the same each step).
    return n if not backend.emulated else max(3, n // 10)


def run_lockstep(ours, ours_params, ref, ref_params, steps, start=0):
    for s in range(start, start + steps):
        grads = grads_for(ours_params, s)
        set_grads(ours_params, grads)
        set_grads(ref_params, [g.to(r.dtype) for g, r in zip(grads, ref_params)])
        ours.step()
        ref.step()


GROUP_CONFIGS = {
    "one_group": lambda ps: [{"params": ps}],
    "three_groups": lambda ps: [
        {"params": ps[:2]},
        {"params": ps[2:4], "lr": 3e-3, "weight_decay": 0.0},
        {"params": ps[4:], "lr": 2e-2, "weight_decay": 0.3, "betas": (0.8, 0.99), "eps": 1e-6},
    ],
}


@pytest.mark.parametrize("groups", list(GROUP_CONFIGS))
@pytest.mark.parametrize("chunk_size", [0, SMALL_CHUNK], ids=["default_chunk", "small_chunk"])
def test_fp32_trajectory_matches_torch_adamw(backend, groups, chunk_size):
    params = make_params(SHAPES, backend.device)
    ref_params = clone_params(params)
    ours = FusedAdamW(GROUP_CONFIGS[groups](params), lr=1e-2, weight_decay=0.05, chunk_size=chunk_size)
    ref = torch.optim.AdamW(GROUP_CONFIGS[groups](ref_params), lr=1e-2, weight_decay=0.05, foreach=False)
    run_lockstep(ours, params, ref, ref_params, steps_for(backend, 100))
    for i, (p, r) in enumerate(zip(params, ref_params)):
        assert max_rel_error(p, r) <= 1e-6, f"param {i} {tuple(p.shape)}"
        for key in ("exp_avg", "exp_avg_sq"):
            assert max_rel_error(ours.state[p][key], ref.state[r][key]) <= 1e-6, f"{key} of param {i}"
        assert ours.state[p]["step"].item() == ref.state[r]["step"].item()


def test_params_without_grad_are_left_alone(backend):
    params = make_params([(4,), (5,)], backend.device)
    before = params[1].detach().clone()
    opt = FusedAdamW(params, lr=0.1)
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert torch.equal(params[1].detach(), before)
    assert params[1] not in opt.state or len(opt.state[params[1]]) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_master_weights_follow_an_fp32_adamw_on_fp32_copies(backend, dtype):
    params = make_params(SHAPES, backend.device, dtype)
    ref_params = clone_params(params, torch.float32)
    ours = FusedAdamW(params, lr=1e-2, weight_decay=0.1, master_weights=True, chunk_size=SMALL_CHUNK)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, foreach=False)
    run_lockstep(ours, params, ref, ref_params, steps_for(backend, 50))
    for p, r in zip(params, ref_params):
        st = ours.state[p]
        assert st["master_param"].dtype == st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
        assert max_rel_error(st["master_param"], r) <= 1e-6
        assert max_rel_error(st["exp_avg_sq"], ref.state[r]["exp_avg_sq"]) <= 1e-6
        # The 16-bit param is the master rounded, written in the same pass.
        assert torch.equal(p.detach(), st["master_param"].to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rounded_copies_are_the_fp32_params_rounded_written_in_the_update_pass(backend, dtype):
    # fp32 params (a trainer's masters) with fp32 grads, most of them with a 16-bit copy: the params follow exactly
    # the trajectory of the same optimizer without copies (and torch's AdamW to rounding), the copies equal the
    # params rounded by torch after every step, and a skipped step (found_inf) leaves everything as it was.
    params = make_params(SHAPES, backend.device)
    plain_params, ref_params = clone_params(params), clone_params(params)
    copies = {p: p.detach().to(dtype) for i, p in enumerate(params) if i != 2}  # one param without a copy
    groups = lambda ps: [{"params": ps[:4]}, {"params": ps[4:], "lr": 3e-3, "weight_decay": 0.0}]  # noqa: E731
    ours = FusedAdamW(groups(params), lr=1e-2, weight_decay=0.1, chunk_size=SMALL_CHUNK)
    ours.set_rounded_copies(copies)
    plain = FusedAdamW(groups(plain_params), lr=1e-2, weight_decay=0.1, chunk_size=SMALL_CHUNK)
    ref = torch.optim.AdamW(groups(ref_params), lr=1e-2, weight_decay=0.1, foreach=False)
    for s in range(steps_for(backend, 20)):
        grads = grads_for(params, s)  # fp32 values that bf16/fp16 grads could not hold
        for ps in (params, plain_params, ref_params):
            set_grads(ps, grads)
        scale = torch.tensor(4.0 if s % 2 else 1.0, device=backend.device)
        for ps in (params, plain_params):  # the scaled path: the kernels divide by the scale again
            set_grads(ps, [g * scale for g in grads])
        ours.step(grad_scale=scale)
        plain.step(grad_scale=scale)
        ref.step()
        for i, (p, q, r) in enumerate(zip(params, plain_params, ref_params)):
            assert torch.equal(p, q), f"step {s} param {i}"
            assert max_rel_error(p, r) <= 1e-6, f"step {s} param {i}"
            if p in copies:
                assert torch.equal(copies[p], p.detach().to(dtype)), f"step {s} copy of param {i}"
    kept = [c.clone() for c in copies.values()]
    before = [p.detach().clone() for p in params]
    set_grads(params, grads_for(params, 99))
    ours.step(found_inf=torch.ones((), device=backend.device))
    assert all(torch.equal(c, k) for c, k in zip(copies.values(), kept))
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    ours.set_rounded_copies({})  # none any more: the copies stay behind
    set_grads(params, grads_for(params, 100))
    ours.step()
    assert all(torch.equal(c, k) for c, k in zip(copies.values(), kept))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_grads_of_rounded_copies_step_as_their_fp32_values(backend, dtype):
    # fp32 params with 16-bit copies whose gradients come as 16-bit tensors (``grads``, e.g. views of a 16-bit
    # gradient buffer; none of them in .grad): the same steps, bit for bit, as with those values widened to fp32
    # .grad; and the kernel reads the 16-bit tensors where they are (a changed buffer is the next step's gradient).
    params = make_params(SHAPES, backend.device)
    wide = clone_params(params)
    buffers = [torch.zeros(p.shape, dtype=dtype, device=backend.device) for p in params]
    ours = FusedAdamW(params, lr=1e-2, weight_decay=0.1, chunk_size=SMALL_CHUNK)
    ours.set_rounded_copies({p: p.detach().to(dtype) for p in params}, dict(zip(params, buffers)))
    ref = FusedAdamW(wide, lr=1e-2, weight_decay=0.1, chunk_size=SMALL_CHUNK)
    ref.set_rounded_copies({p: p.detach().to(dtype) for p in wide})
    for s in range(steps_for(backend, 5)):
        for b, g in zip(buffers, grads_for(params, s)):
            b.copy_(g)
        set_grads(wide, [b.float() for b in buffers])
        scale = torch.tensor(2.0 if s % 2 else 1.0, device=backend.device)
        ours.step(grad_scale=scale)
        ref.step(grad_scale=scale)
        assert all(p.grad is None for p in params)
        for i, (p, q) in enumerate(zip(params, wide)):
            assert torch.equal(p, q), f"step {s} param {i}"
    with pytest.raises(ValueError, match="grads entry 0: the param has no rounded copy"):
        ours.set_rounded_copies({}, {params[0]: buffers[0]})
    with pytest.raises(TypeError, match="grads entry 0: the grad must be a tensor of the copy's dtype"):
        ours.set_rounded_copies({params[0]: buffers[0].clone()}, {params[0]: buffers[0].float()})
    with pytest.raises(ValueError, match="grads entry 0: the grad must have the param's shape"):
        ours.set_rounded_copies({params[0]: buffers[0].clone()}, {params[0]: buffers[0].reshape(-1)})


def test_check_false_obeys_found_inf_without_checking_the_grads(backend):
    params = make_params([(3, 4), (5,)], backend.device)
    opt = FusedAdamW(params, lr=1e-2)
    before = [p.detach().clone() for p in params]
    grads = grads_for(params, 0)
    grads[1][2] = float("inf")
    set_grads(params, grads)
    flag = torch.ones((), device=backend.device)
    opt.step(grad_scale=2.0, found_inf=flag, check=False)  # a set flag skips, read only
    assert flag.item() == 1.0 and all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(st["step"].item() == 0 for st in opt.state.values())
    flag.zero_()
    opt.step(grad_scale=2.0, found_inf=flag, check=False)  # no check: the inf is not seen and reaches the param
    assert flag.item() == 0.0 and not torch.isfinite(params[1]).all() and torch.isfinite(params[0]).all()
    assert all(st["step"].item() == 1 for st in opt.state.values())


def test_rounded_copies_are_checked(backend):
    p, q = make_params([(3, 4), (5,)], backend.device)
    opt = FusedAdamW([p], lr=1e-2)
    half = lambda t: t.detach().to(torch.bfloat16)  # noqa: E731
    with pytest.raises(ValueError, match="entry 0: the param is not in this optimizer's param groups"):
        opt.set_rounded_copies({q: half(q)})
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        opt.set_rounded_copies({p: p.detach().double()})
    with pytest.raises(ValueError, match=r"shape \(3, 4\)"):
        opt.set_rounded_copies({p: half(p).reshape(4, 3)})
    with pytest.raises(ValueError, match="not contiguous"):
        opt.set_rounded_copies({p: half(p).t().contiguous().t()})
    b = make_params([(2,)], backend.device, torch.bfloat16)[0]
    opt16 = FusedAdamW([b], lr=1e-2, master_weights=True)
    with pytest.raises(TypeError, match="rounded copies are of float32 params"):
        opt16.set_rounded_copies({b: half(b)})


def test_without_master_weights_16bit_state_stays_16bit(backend):
    params = make_params([(3, 7)], backend.device, torch.bfloat16)
    ref_params = clone_params(params)
    ours = FusedAdamW(params, lr=1e-2)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, foreach=False)
    run_lockstep(ours, params, ref, ref_params, 3)
    st = ours.state[params[0]]
    assert "master_param" not in st and st["exp_avg"].dtype == torch.bfloat16
    assert max_rel_error(params[0], ref_params[0]) <= 1e-2


def saved(opt):
    """A state_dict as torch.save + torch.load give it back: no tensor shared with the live optimizer."""
    return copy.deepcopy(opt.state_dict())


def assert_same_state_layout(ours, ref, ours_params, ref_params):
    for p, r in zip(ours_params, ref_params):
        a, b = ours.state[p], ref.state[r]
        assert {"step", "exp_avg", "exp_avg_sq"} <= set(a) and set(b) <= set(a)
        assert isinstance(a["step"], torch.Tensor) and a["step"].dtype == b["step"].dtype == torch.float32
        assert a["step"].shape == b["step"].shape == ()


@pytest.mark.parametrize("direction", ["torch_to_fused", "fused_to_torch"])
def test_state_dict_interchange_with_torch_adamw(backend, direction):
    shapes = [(3, 5), (130,), (7,)]
    params = make_params(shapes, backend.device)
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 5e-3}]  # noqa: E731
    first_cls, second_cls = (
        (torch.optim.AdamW, FusedAdamW) if direction == "torch_to_fused" else (FusedAdamW, torch.optim.AdamW)
    )
    first = first_cls(groups(params), lr=1e-2, weight_decay=0.1)
    # Warm up `first` alone, save, and load into a fresh `second` over copies of the same params.
    for s in range(5):
        set_grads(params, grads_for(params, s))
        first.step()
    second_params = clone_params(params)
    second = second_cls(groups(second_params), lr=1.0, weight_decay=0.0)  # hypers come from the state dict
    second.load_state_dict(saved(first))
    fused, fused_params, torch_opt, torch_params = (
        (second, second_params, first, params)
        if direction == "torch_to_fused"
        else (first, params, second, second_params)
    )
    assert_same_state_layout(fused, torch_opt, fused_params, torch_params)
    assert all(s["step"].device.type == "cpu" for s in torch_opt.state.values()) or backend.name == "cuda"
    # Both continue in lock step and stay together.
    for s in range(5, 5 + steps_for(backend, 20)):
        grads = grads_for(params, s)
        set_grads(params, grads)
        set_grads(second_params, grads)
        first.step()
        second.step()
    for p, q in zip(params, second_params):
        assert max_rel_error(q, p) <= 1e-6
    assert second.param_groups[1]["lr"] == 5e-3


def test_master_state_dict_roundtrip_keeps_fp32_moments_and_masters(backend):
    params = make_params([(5, 3), (17,)], backend.device, torch.bfloat16)
    opt = FusedAdamW(params, lr=1e-2, master_weights=True)
    for s in range(3):
        set_grads(params, grads_for(params, s))
        opt.step()
    sd = saved(opt)
    copies = clone_params(params)
    opt2 = FusedAdamW(copies, lr=1e-2, master_weights=True)
    opt2.load_state_dict(sd)
    for p, q in zip(params, copies):
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            assert opt2.state[q][key].dtype == torch.float32
            assert torch.equal(opt2.state[q][key], opt.state[p][key])
    # And a torch AdamW (bf16, no masters) state loads too: the masters start from the params.
    ref = torch.optim.AdamW(clone_params(params), lr=1e-2)
    set_grads(ref.param_groups[0]["params"], grads_for(params, 0))
    ref.step()
    opt2.load_state_dict(saved(ref))
    for q in copies:
        assert torch.equal(opt2.state[q]["master_param"], q.detach().float())
        assert opt2.state[q]["exp_avg"].dtype == torch.float32


def snapshot(opt, params):
    return [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params]


def assert_unchanged(opt, params, snap):
    for p, (p0, st0) in zip(params, snap):
        assert torch.equal(p.detach(), p0)
        for k, v in st0.items():
            assert torch.equal(opt.state[p][k], v), f"state {k} changed"


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("master", [False, True], ids=["fp32", "bf16_master"])
def test_nonfinite_grad_skips_the_whole_step_and_sets_found_inf(backend, bad, master):
    dtype = torch.bfloat16 if master else torch.float32
    params = make_params([(3, 5), (130,), (7,)], backend.device, dtype)
    opt = FusedAdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, master_weights=master, chunk_size=64)
    set_grads(params, grads_for(params, 0))
    opt.step()
    snap = snapshot(opt, params)
    grads = grads_for(params, 1)
    grads[2].view(-1)[3] = bad  # in the last group: the first group must not have been updated either
    set_grads(params, grads)
    found_inf = torch.zeros(1, device=backend.device)
    opt.step(grad_scale=torch.tensor(2.0, device=backend.device), found_inf=found_inf)
    assert found_inf.item() == 1.0
    assert_unchanged(opt, params, snap)
    # A clean step afterwards proceeds from the unchanged state.
    set_grads(params, grads_for(params, 2))
    found_inf.zero_()
    opt.step(found_inf=found_inf)
    assert found_inf.item() == 0.0
    assert all(opt.state[p]["step"].item() == 2.0 for p in params)


def test_found_inf_already_set_skips_the_step(backend):
    params = make_params([(9,)], backend.device)
    opt = FusedAdamW(params, lr=1e-2)
    set_grads(params, grads_for(params, 0))
    opt.step()
    snap = snapshot(opt, params)
    set_grads(params, grads_for(params, 1))
    opt.step(found_inf=torch.ones(1, device=backend.device))
    assert_unchanged(opt, params, snap)


def test_overflow_only_after_unscaling_is_caught(backend):
    # 1e38 is finite, 1e38 / 0.01 is not: the check looks at the unscaled grad the update would use.
    params = make_params([(4,)], backend.device)
    opt = FusedAdamW(params, lr=1e-2)
    params[0].grad = torch.full((4,), 1e38, device=backend.device)
    found_inf = torch.zeros((), device=backend.device)
    before = params[0].detach().clone()
    opt.step(grad_scale=torch.tensor(0.01, device=backend.device), found_inf=found_inf)
    assert found_inf.item() == 1.0 and torch.equal(params[0].detach(), before)


@pytest.mark.parametrize("scale", [1024.0, 3.0])
def test_grad_scale_unscaling_matches_dividing_grads_by_hand(backend, scale):
    params = make_params(SHAPES, backend.device)
    by_hand = clone_params(params)
    ours = FusedAdamW(params, lr=1e-2, chunk_size=SMALL_CHUNK)
    ref = FusedAdamW(by_hand, lr=1e-2, chunk_size=SMALL_CHUNK)
    for s in range(steps_for(backend, 10)):
        grads = grads_for(params, s, scale=scale)
        set_grads(params, grads)
        # Divide by a tensor on the grads' device: an IEEE division on every backend (torch turns a division
        # of a CUDA tensor by a Python scalar into a multiplication by its reciprocal).
        set_grads(by_hand, [g / torch.tensor(scale, device=g.device) for g in grads])
        found_inf = torch.zeros(1, device=backend.device)
        ours.step(grad_scale=torch.tensor(scale, device=backend.device), found_inf=found_inf)
        ref.step()
        assert found_inf.item() == 0.0
    for p, q in zip(params, by_hand):
        assert torch.equal(p.detach(), q.detach())


def test_lr_scheduler_drives_the_learning_rate(backend):
    params = make_params([(3, 5), (130,)], backend.device)
    ref_params = clone_params(params)
    ours = FusedAdamW(params, lr=1e-2)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, foreach=False)
    sched = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=5e-2, total_steps=30) for o in (ours, ref)]
    for s in range(steps_for(backend, 30)):
        run_lockstep(ours, params, ref, ref_params, 1, start=s)
        for sc in sched:
            sc.step()
        assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    for p, r in zip(params, ref_params):
        assert max_rel_error(p, r) <= 1e-6


def test_closure_is_evaluated_with_grad_and_its_gradient_is_the_step(backend):
    """``step(closure)`` returns the closure's loss, computed with grad enabled (even under ``no_grad``), and the
    update uses the gradient the closure produced — as torch.optim.AdamW does."""
    params = make_params([(3,)], backend.device)
    ref_params = clone_params(params)
    start = params[0].detach().clone()

    def closure_of(opt, p):
        def closure():
            opt.zero_grad()
            loss = (p**2).sum()
            loss.backward()
            return loss

        return closure

    ours = FusedAdamW(params, lr=1e-2)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, foreach=False)
    with torch.no_grad():
        loss = ours.step(closure_of(ours, params[0]))
    ref.step(closure_of(ref, ref_params[0]))
    assert loss.item() == pytest.approx((start.double() ** 2).sum().item(), rel=1e-6)
    torch.testing.assert_close(params[0].grad, 2 * start)
    assert max_rel_error(params[0], ref_params[0]) <= 1e-6 and not torch.equal(params[0], start)


@pytest.mark.cuda
def test_loss_scaled_step_and_grad_norm_do_not_synchronize_the_gpu():
    from megakernels.optim import multi_tensor_l2norm

    params = make_params([(1000,), (3, 5), (70001,)], "cuda")
    opt = FusedAdamW(params, lr=1e-2)
    set_grads(params, grads_for(params, 0))
    opt.step()  # state exists from here on
    set_grads(params, grads_for(params, 1, scale=1024.0))
    scale = torch.tensor(1024.0, device="cuda")
    found_inf = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation now raises
    try:
        multi_tensor_l2norm([p.grad for p in params])
        opt.step(grad_scale=scale, found_inf=found_inf)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert found_inf.item() == 0.0 and all(opt.state[p]["step"].item() == 2 for p in params)
