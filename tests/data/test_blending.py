"""Blending: ``--data`` syntax, exact proportions (each component's count within one sample of its share at every
prefix), determinism, and each component read in its own order by its own running count."""

from __future__ import annotations

import numpy as np
import pytest

from megakernels_models.data.blending import BlendedDataset, blend_assignment, parse_blend


class Numbers:
    """A component dataset whose sample ``i`` is ``(name, i)``."""

    def __init__(self, name, n=10):
        self.name, self.n = name, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"ids": np.array([self.name, i])}


def test_parse_single_prefix_and_pairs():
    assert parse_blend("data/a") == [(1.0, "data/a")]
    assert parse_blend("0.7,data/a, 0.3,data/b") == [(pytest.approx(0.7), "data/a"), (pytest.approx(0.3), "data/b")]
    assert parse_blend("2,a,6,b") == [(0.25, "a"), (0.75, "b")]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("", "empty field"),
        ("0.7,a,", "empty field"),
        ("0.7,a,0.3", "3 fields; expected WEIGHT,PREFIX pairs"),
        ("a,b", "weight 'a' is not a number"),
        ("0.5,a,-1,b", "weight -1 of b must be a positive finite number"),
        ("0,a,1,b", "weight 0 of a must be a positive"),
        ("nan,a,1,b", "must be a positive finite number"),
    ],
)
def test_bad_blend_syntax_names_data(spec, message):
    with pytest.raises(ValueError, match="--data") as e:
        parse_blend(spec)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "weights", [[0.7, 0.3], [0.5, 0.25, 0.125, 0.125], [0.2, 0.3, 0.5], [1 / 3, 1 / 3, 1 / 3], [0.01, 0.99]]
)
def test_counts_stay_within_one_sample_of_the_share(weights):
    comp, _ = blend_assignment(weights, 5000)
    counts = np.zeros((5000, len(weights)))
    counts[np.arange(5000), comp] = 1
    realised = counts.cumsum(0)
    target = np.outer(np.arange(1, 5001), weights)
    assert np.abs(realised - target).max() < 1.0


def test_blended_dataset_is_deterministic_and_exact():
    blend = BlendedDataset([Numbers(0), Numbers(1)], [0.7, 0.3])
    got = [blend[i]["ids"].tolist() for i in range(1000)]
    other = BlendedDataset([Numbers(0), Numbers(1)], [7, 3])
    assert got == [other[i]["ids"].tolist() for i in range(1000)]
    first = [g[0] for g in got]
    assert abs(first.count(0) - 700) <= 1
    # each component is read by its own running count: 0, 1, 2, ... in its own order, past its length
    for name in (0, 1):
        assert [g[1] for g in got if g[0] == name] == list(range(first.count(name)))
    assert len(blend) == 20


def test_random_access_matches_sequential_access():
    seq = BlendedDataset([Numbers(0), Numbers(1), Numbers(2)], [0.5, 0.3, 0.2])
    ref = [seq.locate(i) for i in range(10000)]
    rnd = BlendedDataset([Numbers(0), Numbers(1), Numbers(2)], [0.5, 0.3, 0.2])
    for i in (9999, 17, 5000, 0, 8191, 8192):
        assert rnd.locate(i) == ref[i]


def test_bad_weights():
    with pytest.raises(ValueError, match="2 datasets for 1 weights"):
        BlendedDataset([Numbers(0), Numbers(1)], [1.0])
    with pytest.raises(ValueError, match="weights must be positive"):
        BlendedDataset([Numbers(0)], [0.0])
