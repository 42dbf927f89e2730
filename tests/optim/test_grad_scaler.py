"""FusedAdamW under torch.amp.GradScaler: the scaler hands over the scale and the inf flag (the contract of torch's
fused optimizers), the kernel unscales, and the result equals torch.optim.AdamW stepped through the same scaler."""

from __future__ import annotations

import torch

from megakernels.optim import FusedAdamW
from tests.optim.cases import clone_params, grads_for, make_params, max_rel_error


def scaled_step(scaler, opt, params, grads, bad=False):
    # The "loss" is sum(p * g): its grad is g, and scaling the loss scales the grad.
    loss = sum((p * g).sum() for p, g in zip(params, grads))
    if bad:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def test_grad_scaler_steps_match_torch_adamw_including_a_skipped_step(backend):
    params = make_params([(3, 5), (130,)], backend.device)
    ref_params = clone_params(params)
    ours, ref = FusedAdamW(params, lr=1e-2), torch.optim.AdamW(ref_params, lr=1e-2, foreach=False)
    scalers = [torch.amp.GradScaler(backend.device, init_scale=2.0**10, growth_interval=2) for _ in range(2)]
    for s in range(6):
        grads = grads_for(params, s)
        bad = s == 3  # one overflowing step: both skip it and halve the scale
        scaled_step(scalers[0], ours, params, grads, bad)
        scaled_step(scalers[1], ref, ref_params, grads, bad)
        assert scalers[0].get_scale() == scalers[1].get_scale()
    for p, r in zip(params, ref_params):
        assert max_rel_error(p, r) <= 1e-6
        assert ours.state[p]["step"].item() == ref.state[r]["step"].item() == 5
