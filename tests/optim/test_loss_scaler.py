"""DynamicLossScaler: backs off on overflow (not below min_scale), grows after growth_interval clean steps in a row
(not above max_scale), optional hysteresis, state_dict round trip, argument validation."""

from __future__ import annotations

import pytest

from megakernels.optim import DynamicLossScaler


def test_defaults_are_megatrons():
    s = DynamicLossScaler()
    assert s.scale == 2.0**16 and s.inv_scale == 2.0**-16
    assert (s.growth_factor, s.backoff_factor, s.growth_interval, s.min_scale) == (2.0, 0.5, 1000, 1.0)


def test_overflow_halves_the_scale_and_restarts_the_growth_count():
    s = DynamicLossScaler(initial_scale=1024.0, growth_interval=3)
    s.update(False)
    s.update(False)
    s.update(True)
    assert s.scale == 512.0
    s.update(False)
    s.update(False)
    assert s.scale == 512.0  # only 2 clean steps since the overflow
    s.update(False)
    assert s.scale == 1024.0


def test_grows_after_each_growth_interval_of_clean_steps_up_to_max_scale():
    s = DynamicLossScaler(initial_scale=4.0, growth_interval=2, max_scale=16.0)
    scales = []
    for _ in range(8):
        s.update(False)
        scales.append(s.scale)
    assert scales == [4.0, 8.0, 8.0, 16.0, 16.0, 16.0, 16.0, 16.0]


def test_backoff_stops_at_min_scale():
    s = DynamicLossScaler(initial_scale=8.0, min_scale=2.0)
    for _ in range(5):
        s.update(True)
    assert s.scale == 2.0


def test_hysteresis_tolerates_overflows_before_backing_off():
    s = DynamicLossScaler(initial_scale=64.0, hysteresis=2, growth_interval=100)
    s.update(True)
    assert s.scale == 64.0
    s.update(True)
    assert s.scale == 32.0
    s.update(True)
    assert s.scale == 32.0


def test_state_dict_round_trip_resumes_the_same_sequence():
    a = DynamicLossScaler(initial_scale=256.0, growth_interval=3, hysteresis=2)
    for found in (False, True, False):
        a.update(found)
    b = DynamicLossScaler(growth_interval=3, hysteresis=2)
    b.load_state_dict(a.state_dict())
    for found in (False, False, True, True, False):
        a.update(found)
        b.update(found)
        assert a.scale == b.scale
    assert a.state_dict() == b.state_dict()


def test_load_state_dict_rejects_missing_keys_and_bad_scales():
    s = DynamicLossScaler()
    with pytest.raises(KeyError, match="missing"):
        s.load_state_dict({"scale": 2.0})
    with pytest.raises(ValueError, match="scale'\\] must be a finite number > 0"):
        s.load_state_dict({"scale": float("inf"), "clean_steps": 0, "overflows_left": 1})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(initial_scale=0.0), "initial_scale must be a finite number > 0"),
        (dict(growth_factor=1.0), "growth_factor must be > 1"),
        (dict(backoff_factor=1.0), "backoff_factor must be < 1"),
        (dict(growth_interval=0), "growth_interval must be a positive int"),
        (dict(hysteresis=0), "hysteresis must be a positive int"),
        (dict(initial_scale=0.5, min_scale=1.0), "initial_scale must be in \\[min_scale, max_scale\\]"),
    ],
)
def test_invalid_arguments_name_the_rule(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**kwargs)
