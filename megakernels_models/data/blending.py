"""Blending datasets in fixed proportions: ``--data 0.7,PREFIX_A,0.3,PREFIX_B``.

Sample ``i`` of the blend goes to the component whose realised count is furthest below its target share
``weight·(i + 1)`` (ties to the first), and takes that component's next sample (each component is indexed by its
own running count). No randomness: the assignment is a fixed function of the weights, each component's count after
``n`` samples stays within one sample of ``weight·n``, and the samples inside each component keep that dataset's
own seeded order.
"""

from __future__ import annotations

import numpy as np


def parse_blend(spec: str) -> list[tuple[float, str]]:
    """``"PREFIX"`` -> ``[(1.0, PREFIX)]``; ``"W1,P1,W2,P2,..."`` -> ``[(w1/Σw, P1), ...]`` (weights normalised).

    Raises:
        ValueError: empty spec, an odd number of fields, a weight that is not a positive finite number, an empty
            prefix (the message names ``--data`` and the rule). Prefixes may not contain commas.
    """
    fields = [f.strip() for f in str(spec).split(",")]
    if fields == [""] or any(not f for f in fields):
        raise ValueError(f"--data {spec!r}: empty field; expected PREFIX or WEIGHT,PREFIX[,WEIGHT,PREFIX...]")
    if len(fields) == 1:
        return [(1.0, fields[0])]
    if len(fields) % 2:
        raise ValueError(
            f"--data {spec!r}: {len(fields)} fields; expected WEIGHT,PREFIX pairs (e.g. 0.7,data/a,0.3,data/b)"
        )
    pairs = []
    for w, prefix in zip(fields[::2], fields[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise ValueError(f"--data {spec!r}: weight {w!r} is not a number (expected WEIGHT,PREFIX pairs)") from None
        if not (weight > 0 and np.isfinite(weight)):
            raise ValueError(f"--data {spec!r}: weight {w} of {prefix} must be a positive finite number")
        pairs.append((weight, prefix))
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def blend_assignment(weights, n: int, counts=None) -> tuple[np.ndarray, np.ndarray]:
    """The component of samples ``c .. c+n-1`` and the index within it, continuing from the realised ``counts``
    (per component, after ``c = sum(counts)`` samples; updated in place).

    Returns:
        ``(component int64 [n], index_in_component int64 [n])``.
    """
    w = [float(x) for x in weights]
    counts = [0] * len(w) if counts is None else counts
    done = sum(counts)
    comp = np.empty(n, dtype=np.int64)
    local = np.empty(n, dtype=np.int64)
    for i in range(n):
        target = done + i + 1
        k = max(range(len(w)), key=lambda c: w[c] * target - counts[c])  # max() keeps the first on ties
        comp[i], local[i] = k, counts[k]
        counts[k] += 1
    return comp, local


class BlendedDataset:
    """Samples of ``datasets`` in the proportions ``weights`` (normalised), see the module docstring.

    ``len`` is the sum of the components' lengths (one nominal epoch); any non-negative sample number works. The
    assignment is computed in blocks as far as the largest sample number asked for.

    Raises:
        ValueError: no datasets, a length mismatch with ``weights``, or a weight that is not positive.
        IndexError: a negative sample number.
    """

    BLOCK = 4096

    def __init__(self, datasets: list, weights: list[float]):
        if not datasets or len(datasets) != len(weights):
            raise ValueError(f"BlendedDataset: {len(datasets)} datasets for {len(weights)} weights")
        if any(not (w > 0) for w in weights):
            raise ValueError(f"BlendedDataset: weights must be positive, got {list(weights)}")
        total = float(sum(weights))
        self.datasets, self.weights = list(datasets), [w / total for w in weights]
        self._counts = [0] * len(datasets)
        self._comp = np.zeros(0, dtype=np.int64)
        self._local = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def locate(self, i: int) -> tuple[int, int]:
        """(component, sample number within it) of blended sample ``i``."""
        if i < 0:
            raise IndexError(f"sample index must be >= 0, got {i}")
        if i >= len(self._comp):
            n = (i // self.BLOCK + 1) * self.BLOCK - len(self._comp)
            comp, local = blend_assignment(self.weights, n, self._counts)
            self._comp = np.concatenate([self._comp, comp])
            self._local = np.concatenate([self._local, local])
        return int(self._comp[i]), int(self._local[i])

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        k, j = self.locate(i)
        return self.datasets[k][j]
