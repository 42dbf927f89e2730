"""Learning-rate schedules of pre-training: linear warmup, then a decay to a floor.

With ``s`` the optimizer step about to run, counted from 1 (``s`` steps taken once it is done), ``w`` the warmup
steps, ``T`` the step at which the decay reaches ``min_lr`` and ``p = (s - w) / (T - w)`` the decay's progress::

    s <= w:         lr · s / w                                                 (0 → lr)
    w < s <= T:     cosine    min_lr + (lr - min_lr) · (1 + cos(π · p)) / 2
                    linear    min_lr + (lr - min_lr) · (1 - p)
                    constant  lr
                    wsd       lr until T - D, then linear to min_lr over the last D steps (warmup-stable-decay)
    s > T:          min_lr (constant: lr)

So step 1 already trains (at ``lr / w``), step ``w`` runs at the peak ``lr`` and step ``T`` at ``min_lr``;
``lr_at(0) == 0`` when there is a warmup. Without warmup the decay starts at ``lr`` (``lr_at(0)``). ``T`` need not
be the run's length: a run can stop before its schedule ends, or keep training at ``min_lr`` after it.
"""

from __future__ import annotations

import math

from megakernels.validation import finite_number, positive_int

STYLES = ("cosine", "linear", "constant", "wsd")


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"LRSchedule: {name} must be a number, got {type(value).__name__}")
    return finite_number(value, name, where="LRSchedule")


def _count(name: str, value) -> int:
    return positive_int(value, name, where="LRSchedule", minimum=0)


class LRSchedule:
    """Linear warmup from 0 to ``lr`` over ``warmup_steps``, then the decay ``style`` to ``min_lr`` at
    ``total_steps`` (see the module docstring for the formulas).

    Args:
        lr: the peak learning rate.
        min_lr: the floor, ``0 <= min_lr <= lr``.
        warmup_steps: steps of linear warmup (0 for none), ``<= total_steps``.
        total_steps: the step at which the decay reaches ``min_lr`` (>= 1).
        style: ``"cosine"``, ``"linear"``, ``"constant"`` or ``"wsd"``.
        wsd_decay_steps: with ``"wsd"``, the length of the final decay (default: a tenth of the steps after
            warmup); ``<= total_steps - warmup_steps``.

    Raises:
        TypeError: a non-number. ValueError naming the argument and the rule: a negative or non-finite rate,
        ``min_lr > lr``, a negative step count, ``total_steps < 1``, ``warmup_steps > total_steps``, an unknown
        style, or a WSD decay longer than the steps after warmup.
    """

    def __init__(
        self,
        lr: float,
        min_lr: float = 0.0,
        warmup_steps: int = 0,
        total_steps: int = 1,
        style: str = "cosine",
        wsd_decay_steps: int | None = None,
    ) -> None:
        self.lr, self.min_lr = _number("lr", lr), _number("min_lr", min_lr)
        if self.min_lr > self.lr:
            raise ValueError(f"LRSchedule: min_lr must be <= lr, got min_lr={self.min_lr:g} > lr={self.lr:g}")
        self.warmup_steps, self.total_steps = _count("warmup_steps", warmup_steps), _count("total_steps", total_steps)
        if self.total_steps < 1:
            raise ValueError(f"LRSchedule: total_steps must be >= 1, got {total_steps}")
        if self.warmup_steps > self.total_steps:
            raise ValueError(
                f"LRSchedule: warmup_steps must be <= total_steps, got warmup_steps="
                f"{self.warmup_steps} > total_steps={self.total_steps}"
            )
        if style not in STYLES:
            raise ValueError(f"LRSchedule: style must be one of {', '.join(STYLES)}, got {style!r}")
        self.style = style
        span = self.total_steps - self.warmup_steps
        self.wsd_decay_steps = (
            max(1, span // 10) if wsd_decay_steps is None else _count("wsd_decay_steps", wsd_decay_steps)
        )
        if style == "wsd" and self.wsd_decay_steps > span:
            raise ValueError(
                f"LRSchedule: wsd_decay_steps={self.wsd_decay_steps} is more than the {span} steps after warmup"
            )

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (1-based: the first step is 1).

        Raises:
            ValueError: ``step`` is not an int >= 0.
        """
        step = _count("step", step)
        if step <= self.warmup_steps and self.warmup_steps > 0:
            return self.lr * step / self.warmup_steps
        if self.style == "constant":
            return self.lr
        if step >= self.total_steps:
            return self.min_lr
        span = self.lr - self.min_lr
        if self.style == "wsd":
            start = self.total_steps - self.wsd_decay_steps
            return self.lr if step <= start else self.min_lr + span * (self.total_steps - step) / self.wsd_decay_steps
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        if self.style == "linear":
            return self.min_lr + span * (1.0 - progress)
        return self.min_lr + span * 0.5 * (1.0 + math.cos(math.pi * progress))

    def apply(self, optimizer, step: int) -> float:
        """Set ``lr_at(step)`` on every param group of ``optimizer`` (anything with ``param_groups``, e.g. a torch
        optimizer or ``ParallelOptimizer``); returns it."""
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        return {
            "lr": self.lr,
            "min_lr": self.min_lr,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "style": self.style,
            "wsd_decay_steps": self.wsd_decay_steps,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(lr={self.lr:g}, min_lr={self.min_lr:g}, warmup_steps={self.warmup_steps}, "
            f"total_steps={self.total_steps}, style={self.style!r})"
        )


class WarmupCosineSchedule(LRSchedule):
    """``LRSchedule`` with the cosine decay (GPT pre-training's)."""

    def __init__(self, lr: float, min_lr: float = 0.0, warmup_steps: int = 0, total_steps: int = 1) -> None:
        super().__init__(lr, min_lr, warmup_steps, total_steps, "cosine")
