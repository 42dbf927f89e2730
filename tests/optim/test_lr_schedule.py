"""WarmupCosineSchedule: linear warmup from 0 to lr, cosine decay to min_lr at total_steps, constant after; applied
to an optimizer's param groups; arguments validated with the rule in the message."""

from __future__ import annotations

import math

import pytest
import torch

from megakernels.optim import FusedAdamW, WarmupCosineSchedule


def test_warmup_rises_linearly_from_zero_to_the_peak():
    s = WarmupCosineSchedule(lr=1e-3, min_lr=1e-5, warmup_steps=4, total_steps=20)
    assert [s.lr_at(i) for i in range(5)] == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3], rel=1e-12)


def test_cosine_decay_reaches_min_lr_at_total_steps_and_stays():
    s = WarmupCosineSchedule(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert s.lr_at(60) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-12)  # half-way: cos(pi/2) = 0
    assert s.lr_at(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), rel=1e-12)
    assert s.lr_at(110) == pytest.approx(0.1, rel=1e-12)
    assert s.lr_at(111) == s.lr_at(10**6) == 0.1


def test_schedule_is_continuous_and_never_increases_after_warmup():
    s = WarmupCosineSchedule(lr=3e-4, min_lr=3e-5, warmup_steps=7, total_steps=50)
    lrs = [s.lr_at(i) for i in range(7, 60)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert lrs[0] == pytest.approx(3e-4) and lrs[-1] == pytest.approx(3e-5)


def test_without_warmup_the_decay_starts_at_the_peak():
    s = WarmupCosineSchedule(lr=2.0, min_lr=0.0, warmup_steps=0, total_steps=4)
    assert [s.lr_at(i) for i in range(5)] == pytest.approx(
        [2.0, 1 + math.cos(math.pi / 4), 1.0, 1 + math.cos(3 * math.pi / 4), 0.0], abs=1e-12
    )


def test_warmup_equal_to_total_steps_ends_at_min_lr_after_the_peak():
    s = WarmupCosineSchedule(lr=1.0, min_lr=0.5, warmup_steps=3, total_steps=3)
    assert [s.lr_at(i) for i in range(5)] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 0.5])


def test_apply_sets_every_param_group_of_an_optimizer():
    p, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    opt = FusedAdamW([{"params": [p]}, {"params": [b], "weight_decay": 0.0}], lr=123.0)
    s = WarmupCosineSchedule(lr=1e-3, warmup_steps=2, total_steps=10)
    assert s.apply(opt, 1) == pytest.approx(5e-4)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4, 5e-4])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=-1.0), "lr must be a finite number >= 0"),
        (dict(lr=float("nan")), "lr must be a finite number >= 0"),
        (dict(lr=1.0, min_lr=2.0), "min_lr must be <= lr"),
        (dict(lr=1.0, warmup_steps=-1), "warmup_steps must be an int >= 0"),
        (dict(lr=1.0, warmup_steps=1.5), "warmup_steps must be an int >= 0"),
        (dict(lr=1.0, total_steps=0), "total_steps must be >= 1"),
        (dict(lr=1.0, warmup_steps=5, total_steps=4), "warmup_steps must be <= total_steps"),
    ],
)
def test_invalid_arguments_name_the_rule(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WarmupCosineSchedule(**kwargs)


def test_non_number_lr_and_negative_step_are_rejected():
    with pytest.raises(TypeError, match="lr must be a number"):
        WarmupCosineSchedule(lr="1e-3")
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        WarmupCosineSchedule(lr=1.0, total_steps=3).lr_at(-1)


def test_decay_styles_follow_their_formulas():
    from megakernels.optim.lr_schedule import LRSchedule

    lin = LRSchedule(1.0, 0.1, warmup_steps=2, total_steps=12, style="linear")
    assert [lin.lr_at(s) for s in (1, 2, 7, 12, 20)] == pytest.approx([0.5, 1.0, 0.55, 0.1, 0.1])
    const = LRSchedule(1.0, 0.1, warmup_steps=2, total_steps=12, style="constant")
    assert [const.lr_at(s) for s in (1, 2, 12, 50)] == pytest.approx([0.5, 1.0, 1.0, 1.0])
    wsd = LRSchedule(1.0, 0.1, warmup_steps=2, total_steps=12, style="wsd", wsd_decay_steps=4)
    # warmup, stable until step 8, then linear to min_lr at 12
    assert [wsd.lr_at(s) for s in (2, 5, 8, 10, 12, 13)] == pytest.approx([1.0, 1.0, 1.0, 0.55, 0.1, 0.1])
    cos = LRSchedule(1.0, 0.0, warmup_steps=0, total_steps=10, style="cosine")
    assert cos.lr_at(5) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(style="step"), "style must be one of cosine, linear, constant, wsd"),
        (dict(style="wsd", wsd_decay_steps=11), "wsd_decay_steps=11 is more than"),
    ],
)
def test_bad_styles_are_named(kwargs, match):
    from megakernels.optim.lr_schedule import LRSchedule

    with pytest.raises(ValueError, match=match):
        LRSchedule(1.0, 0.1, warmup_steps=0, total_steps=10, **kwargs)
