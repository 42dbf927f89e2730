"""The embedded image–caption data: coloured shapes at positions, drawn procedurally (nothing downloaded).

Sample ``i`` of seed ``k`` is a dark ``S×S`` RGB image cut into a 2×2 grid of cells, two neighbouring cells of
which hold a shape each — a circle, a square or a triangle, in red, green, blue or yellow (two different colours),
filling 75–90 % of its cell — one above the other (the same column) or side by side (the same row), and its caption,
e.g. ``"a red circle above a blue square"`` (the upper, or left, shape is named first, and the two shapes are never
diagonal, so the caption is a function of the image). Everything is drawn from ``(k, i)`` alone, so any layout
reads the same samples; the held-out images of ``megakernels eval --task caption`` come from another seed. No
text-only model can guess a caption: its five attributes are uniform and independent (4·3·2·3·3 = 216 captions),
so image-conditioned accuracy far above a text-only baseline means the model sees.

Why a grid of large shapes: the default run (``megakernels train --model vlm --preset vlm-tiny``, 300 steps of 16
samples on a CPU) must learn to read the image. With small shapes at free positions (the first version of this
data) a tiny ViT did not get past the captions' text statistics in that budget (the results in
``benchmarks/results/``); shapes aligned with the cells are what a 16-pixel patch sees whole.
"""

from __future__ import annotations

import numpy as np

from megakernels_models.data.sample_index import rng

COLOURS = {"red": (220, 50, 50), "green": (50, 200, 70), "blue": (60, 90, 235), "yellow": (235, 215, 50)}
SHAPES = ("circle", "square", "triangle")
RELATIONS = ("above", "left of")


def _mask(shape: str, size: int, cy: float, cx: float, r: float) -> np.ndarray:
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    dy, dx = y - cy, x - cx
    if shape == "circle":
        return dy * dy + dx * dx <= r * r
    if shape == "square":
        return (np.abs(dy) <= 0.8 * r) & (np.abs(dx) <= 0.8 * r)
    return (dy <= 0.8 * r) & (dy >= -r) & (np.abs(dx) <= (dy + r) * 0.6)  # apex up


def shapes_sample(seed: int, i: int, image_size: int = 32) -> tuple[np.ndarray, str]:
    """Sample ``i`` of ``seed``: ``(uint8 [S, S, 3] image, caption)``.

    Raises:
        ValueError: ``image_size`` < 16 (the shapes would not be told apart).
    """
    if image_size < 16:
        raise ValueError(f"shapes_sample: image_size must be >= 16, got {image_size}")
    g = rng(seed, 0x5A9E, i)
    S = image_size
    cell = S / 2.0
    ca, cb = g.choice(len(COLOURS), 2, replace=False)
    sa, sb = g.integers(0, len(SHAPES), 2)
    rel = int(g.integers(0, len(RELATIONS)))
    k = int(g.integers(0, 2))  # the column (above) or the row (left of) the two shapes share
    cells = ((0, k), (1, k)) if rel == 0 else ((k, 0), (k, 1))  # (row, col), the first shape's first
    img = np.full((S, S, 3), 20, dtype=np.uint8)
    names = list(COLOURS)
    for (row, col), shape, colour in zip(cells, (SHAPES[sa], SHAPES[sb]), (names[ca], names[cb])):
        r = 0.45 * cell * g.uniform(0.85, 1.0)
        img[_mask(shape, S, (row + 0.5) * cell, (col + 0.5) * cell, r)] = COLOURS[colour]
    caption = f"a {names[ca]} {SHAPES[sa]} {RELATIONS[rel]} a {names[cb]} {SHAPES[sb]}"
    return img, caption


class ShapesSource:
    """An endless image–caption source over ``shapes_sample`` (the reading interface of
    ``images.ImageTextIndexed``: ``image(i)``, ``caption(i)`` as token ids, ``len`` None = endless)."""

    prefix = None

    def __init__(self, seed: int, image_size: int, tokenizer):
        self.seed, self.image_size, self.tokenizer = int(seed), int(image_size), tokenizer

    def __len__(self) -> int:
        return 1 << 40

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        img, caption = shapes_sample(self.seed, i, self.image_size)
        return img, np.asarray(self.tokenizer.encode(caption), dtype=np.int64)
