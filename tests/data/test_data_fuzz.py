"""Fuzz of the dataset readers: random, truncated, spliced and garbage ``.idx``/``.bin`` pairs (text and image-text)
are either opened — and then every document reads back inside the vocabulary — or refused with a DataError naming
one of the two files; never another exception type. Derandomized: the same cases every run."""

from __future__ import annotations

import itertools
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megakernels_models.data.images import ImageTextIndexed, write_image_text
from megakernels_models.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter

FUZZ = settings(
    derandomize=True,
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
_count = itertools.count()


@st.composite
def text_pairs(draw) -> tuple[int, list[list[list[int]]]]:
    """A valid pair's content: its vocabulary and documents (lists of sequences of ids)."""
    vocab = draw(st.sampled_from([200, 261, 300, 65536, 70000]))
    docs = draw(
        st.lists(
            st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6), min_size=1, max_size=3),
            min_size=1,
            max_size=4,
        )
    )
    return vocab, docs


@st.composite
def damage(draw, idx: bytes, bin_: bytes, text: bool = True) -> tuple[bytes, bytes]:
    """``(idx, bin)`` left whole, cut, overwritten in places, given a forged header or (``text``) forged document
    boundaries, or replaced by noise; the likelier damages first."""
    how = draw(
        st.sampled_from(
            ["poke", "poke", "poke", "cut", "cut", "header", "header", "docs", "docs", "none", "noise", "append"]
        )
    )
    which = draw(st.sampled_from([0, 1, 1]))
    files = [idx, bin_]
    data = files[which]
    if how == "docs" and text:  # any rising boundaries over the same sequences (empty documents included)
        n_seq = struct.unpack_from("<Q", idx, 24)[0]
        inner = sorted(draw(st.lists(st.integers(0, n_seq), max_size=5)))
        bounds = np.asarray([0, *inner, n_seq], "<i8")
        files[0] = (
            struct.pack("<8sIIQQQ", *struct.unpack_from("<8sIIQQ", idx), len(bounds) - 1)
            + idx[40 : 40 + 12 * n_seq]
            + bounds.tobytes()
        )
    elif how == "cut":
        files[which] = data[: draw(st.integers(0, len(data)))]
    elif how == "poke" and data:
        buf = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            buf[draw(st.integers(0, len(buf) - 1))] = draw(st.integers(0, 255))
        files[which] = bytes(buf)
    elif how == "header" and len(idx) >= 40:
        magic = draw(st.sampled_from([idx[:8], b"MKIDX\x00\x00\x02", b"\x00" * 8]))
        fields = [
            draw(st.sampled_from([v, 0, 1, 2, 3, 4, 2**31, 2**64 - 1])) for v in struct.unpack("<IIQQQ", idx[8:40])
        ]
        fields[:2] = [min(v, 2**32 - 1) for v in fields[:2]]
        files[0] = struct.pack("<8sIIQQQ", magic, *fields) + idx[40:]
    elif how == "noise":
        files[which] = draw(st.binary(max_size=80))
    elif how == "append":
        files[which] = data + draw(st.binary(min_size=1, max_size=16))
    return files[0], files[1]


def _write(tmp_path, idx: bytes, bin_: bytes) -> str:
    prefix = str(tmp_path / f"d{next(_count)}")
    with open(prefix + ".idx", "wb") as f:
        f.write(idx)
    with open(prefix + ".bin", "wb") as f:
        f.write(bin_)
    return prefix


def _refused_naming_a_file(e: DataError, prefix: str) -> None:
    assert f"{prefix}.idx" in str(e) or f"{prefix}.bin" in str(e), str(e)
    assert "\n" not in str(e), str(e)


@FUZZ
@given(pair=text_pairs(), data=st.data())
def test_text_pairs_are_read_whole_or_refused_naming_the_file(tmp_path, pair, data):
    vocab, docs = pair
    good = str(tmp_path / f"good{next(_count)}")
    with IndexedDatasetWriter(good, vocab) as w:
        for d in docs:
            w.add_document([np.asarray(s) for s in d])
        w.finish()
    idx, bin_ = (open(good + ext, "rb").read() for ext in (".idx", ".bin"))
    prefix = _write(tmp_path, *data.draw(damage(idx, bin_)))
    try:
        ds = IndexedDataset(prefix)
    except DataError as e:
        _refused_naming_a_file(e, prefix)
        return
    for d in range(len(ds)):
        tokens = np.asarray(ds[d])
        assert len(tokens) == ds.sizes[d] and (tokens < ds.vocab_size).all()
        assert sum(len(s) for s in ds.sentences(d)) == len(tokens)


@st.composite
def image_pairs(draw):
    """A valid image-text pair's content: vocabulary and (image, caption) samples."""
    vocab = draw(st.sampled_from([200, 261, 70000]))
    samples = draw(
        st.lists(
            st.tuples(
                st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.lists(st.integers(0, vocab - 1), max_size=5)
            ),
            max_size=3,
        )
    )
    return vocab, [(np.full((h, w, c), 7, np.uint8), np.asarray(cap, np.int64)) for h, w, c, cap in samples]


@FUZZ
@given(pair=image_pairs(), data=st.data())
def test_image_text_pairs_are_read_whole_or_refused_naming_the_file(tmp_path, pair, data):
    vocab, samples = pair
    good = str(tmp_path / f"good{next(_count)}")
    write_image_text(good, samples, vocab)
    idx, bin_ = (open(good + ext, "rb").read() for ext in (".idx", ".bin"))
    prefix = _write(tmp_path, *data.draw(damage(idx, bin_, text=False)))
    try:
        ds = ImageTextIndexed(prefix)
    except DataError as e:
        _refused_naming_a_file(e, prefix)
        return
    for i in range(len(ds)):
        image, caption = ds.sample(i)
        assert image.shape == tuple(ds.shapes[i]) and (caption < ds.vocab_size).all()
