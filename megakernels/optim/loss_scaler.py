"""Dynamic loss scaling for fp16 training (Micikevicius et al., "Mixed Precision Training").

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by a large scale ``S`` before
backward shifts every gradient up by ``S`` (backward is linear in the loss), into fp16's range; the optimizer divides
by ``S`` again before using them. Too large an ``S`` overflows to inf/NaN, which the optimizer detects; then the step
is skipped and ``S`` backs off. After ``growth_interval`` clean steps in a row ``S`` grows again, so the scale settles
just below the overflow threshold.

The scale lives on the host (a Python float): the decision to skip a step needs the overflow flag on the host
anyway (every rank must agree), so keeping it there costs nothing extra and the loss can be multiplied by a plain
number.
"""

from __future__ import annotations

import math

from megakernels.validation import positive_int


def _positive_float(name: str, value, *, above_one: bool = False, below_one: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"DynamicLossScaler: {name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(f"DynamicLossScaler: {name} must be a finite number > 0, got {value}")
    if above_one and value <= 1.0:
        raise ValueError(f"DynamicLossScaler: {name} must be > 1, got {value}")
    if below_one and value >= 1.0:
        raise ValueError(f"DynamicLossScaler: {name} must be < 1, got {value}")
    return value


def _positive_int(name: str, value) -> int:
    return positive_int(value, name, where="DynamicLossScaler")


class DynamicLossScaler:
    """The loss scale of fp16 training, grown while steps are clean and backed off on overflow.

    Args:
        initial_scale: the first scale (default ``2**16``).
        growth_factor: the scale is multiplied by this (> 1) after ``growth_interval`` clean steps in a row.
        backoff_factor: the scale is multiplied by this (in (0, 1)) on overflow.
        growth_interval: clean steps in a row before growing (default 1000).
        min_scale: the scale never backs off below this (default 1.0).
        max_scale: the scale never grows above this (default ``2**24``; fp16's max is 65504, so larger scales only
            overflow).
        hysteresis: overflows tolerated before backing off (default 1: back off on every overflow); reset whenever
            the scale grows.

    Raises:
        TypeError / ValueError naming the argument: non-numbers, non-positive or non-finite values, growth_factor
        <= 1, backoff_factor outside (0, 1), min_scale > initial_scale or initial_scale > max_scale.

    Usage (the optimizer calls ``update``)::

        (loss * scaler.scale).backward()
        overflow = ...                      # any grad / scale is inf or NaN, agreed by every rank
        scaler.update(overflow)             # skip the step when overflow
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
    ) -> None:
        self.growth_factor = _positive_float("growth_factor", growth_factor, above_one=True)
        self.backoff_factor = _positive_float("backoff_factor", backoff_factor, below_one=True)
        self.growth_interval = _positive_int("growth_interval", growth_interval)
        self.hysteresis = _positive_int("hysteresis", hysteresis)
        self.min_scale = _positive_float("min_scale", min_scale)
        self.max_scale = _positive_float("max_scale", max_scale)
        initial_scale = _positive_float("initial_scale", initial_scale)
        if not self.min_scale <= initial_scale <= self.max_scale:
            raise ValueError(
                f"DynamicLossScaler: initial_scale must be in [min_scale, max_scale] = "
                f"[{self.min_scale:g}, {self.max_scale:g}], got {initial_scale:g}"
            )
        self._scale = initial_scale
        self._clean_steps = 0
        self._overflows_left = self.hysteresis

    @property
    def scale(self) -> float:
        """The current loss scale: multiply the loss by it before backward."""
        return self._scale

    @property
    def inv_scale(self) -> float:
        """``1 / scale``: multiply the gradients by it before using them."""
        return 1.0 / self._scale

    def update(self, found_inf: bool) -> None:
        """Record one step: back off on overflow (once ``hysteresis`` overflows have been seen), else count a clean
        step and grow after ``growth_interval`` of them in a row."""
        if found_inf:
            self._clean_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
                self._overflows_left = self.hysteresis
            return
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self._scale = min(self._scale * self.growth_factor, self.max_scale)
            self._clean_steps = 0
            self._overflows_left = self.hysteresis

    def state_dict(self) -> dict:
        """The scale and the counters (plain Python numbers)."""
        return {"scale": self._scale, "clean_steps": self._clean_steps, "overflows_left": self._overflows_left}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned.

        Raises:
            KeyError: a missing key. ValueError: a scale that is not a finite number > 0, or negative counters.
        """
        missing = {"scale", "clean_steps", "overflows_left"} - set(state)
        if missing:
            raise KeyError(f"DynamicLossScaler.load_state_dict: missing {sorted(missing)}")
        scale = _positive_float("state['scale']", state["scale"])
        clean, left = int(state["clean_steps"]), int(state["overflows_left"])
        if clean < 0 or left < 0:
            raise ValueError(
                f"DynamicLossScaler.load_state_dict: counters must be >= 0, got clean_steps={clean}, "
                f"overflows_left={left}"
            )
        self._scale, self._clean_steps, self._overflows_left = scale, clean, left or self.hysteresis

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self._scale:g}, growth_factor={self.growth_factor:g}, "
            f"backoff_factor={self.backoff_factor:g}, growth_interval={self.growth_interval}, "
            f"min_scale={self.min_scale:g}, max_scale={self.max_scale:g}, hysteresis={self.hysteresis})"
        )
