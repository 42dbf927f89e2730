"""The learning-rate schedule of GPT pre-training: linear warmup, then cosine decay to a floor.

With ``s`` the optimizer step about to run, counted from 1 (``s`` steps taken once it is done)::

    s <= warmup:            lr · s / warmup                                        (0 → lr)
    warmup < s <= total:    min_lr + (lr - min_lr) · (1 + cos(π · (s - warmup) / (total - warmup))) / 2
    s > total:              min_lr

So step 1 already trains (at ``lr / warmup``), step ``warmup`` runs at the peak ``lr`` and step ``total`` at
``min_lr``; ``lr_at(0) == 0`` when there is a warmup. Without warmup the decay starts at ``lr`` (``lr_at(0)``).
"""

from __future__ import annotations

import math

from megakernels.validation import positive_int


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"WarmupCosineSchedule: {name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not (value >= 0.0 and math.isfinite(value)):
        raise ValueError(f"WarmupCosineSchedule: {name} must be a finite number >= 0, got {value}")
    return value


def _count(name: str, value) -> int:
    return positive_int(value, name, where="WarmupCosineSchedule", minimum=0)


class WarmupCosineSchedule:
    """Linear warmup from 0 to ``lr`` over ``warmup_steps``, cosine decay to ``min_lr`` at ``total_steps``, then
    constant ``min_lr`` (see the module docstring for the formula).

    Args:
        lr: the peak learning rate.
        min_lr: the floor, ``0 <= min_lr <= lr``.
        warmup_steps: steps of linear warmup (0 for none), ``<= total_steps``.
        total_steps: the step at which the decay reaches ``min_lr`` (>= 1).

    Raises:
        TypeError: a non-number. ValueError naming the argument and the rule: a negative or non-finite rate,
        ``min_lr > lr``, a negative step count, ``total_steps < 1`` or ``warmup_steps > total_steps``.
    """

    def __init__(self, lr: float, min_lr: float = 0.0, warmup_steps: int = 0, total_steps: int = 1) -> None:
        self.lr, self.min_lr = _number("lr", lr), _number("min_lr", min_lr)
        if self.min_lr > self.lr:
            raise ValueError(f"WarmupCosineSchedule: min_lr must be <= lr, got min_lr={self.min_lr:g} > "
                             f"lr={self.lr:g}")
        self.warmup_steps, self.total_steps = _count("warmup_steps", warmup_steps), _count("total_steps", total_steps)
        if self.total_steps < 1:
            raise ValueError(f"WarmupCosineSchedule: total_steps must be >= 1, got {total_steps}")
        if self.warmup_steps > self.total_steps:
            raise ValueError(f"WarmupCosineSchedule: warmup_steps must be <= total_steps, got warmup_steps="
                             f"{self.warmup_steps} > total_steps={self.total_steps}")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (1-based: the first step is 1).

        Raises:
            ValueError: ``step`` is not an int >= 0.
        """
        step = _count("step", step)
        if step <= self.warmup_steps and self.warmup_steps > 0:
            return self.lr * step / self.warmup_steps
        if step >= self.total_steps:
            return self.min_lr
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def apply(self, optimizer, step: int) -> float:
        """Set ``lr_at(step)`` on every param group of ``optimizer`` (anything with ``param_groups``, e.g. a torch
        optimizer or ``ParallelOptimizer``); returns it."""
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        return {"lr": self.lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps}

    def __repr__(self) -> str:
        return (f"WarmupCosineSchedule(lr={self.lr:g}, min_lr={self.min_lr:g}, warmup_steps={self.warmup_steps}, "
                f"total_steps={self.total_steps})")
