"""The indexed dataset: what is written reads back; the smallest dtype is used; a corrupt, truncated or mismatched
pair of files is a ValueError naming the file and the rule, never garbage tokens."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from megakernels_models.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype

DOCS = [[[1, 2, 3]], [[4], [5, 6]], [[7, 8, 9, 10]]]  # documents as lists of sequences


def write(prefix, docs=DOCS, vocab_size=300):
    with IndexedDatasetWriter(str(prefix), vocab_size) as w:
        for d in docs:
            w.add_document([np.asarray(s) for s in d])
        w.finish()
    return str(prefix)


def test_round_trip(tmp_path):
    ds = IndexedDataset(write(tmp_path / "d"))
    assert len(ds) == ds.doc_count == 3
    assert [ds[i].tolist() for i in range(3)] == [[1, 2, 3], [4, 5, 6], [7, 8, 9, 10]]
    np.testing.assert_array_equal(ds.sizes, [3, 3, 4])
    assert ds.get(2, 1, 2).tolist() == [8, 9]
    assert [s.tolist() for s in ds.sentences(1)] == [[4], [5, 6]]
    assert ds.vocab_size == 300 and ds.dtype == np.uint16
    with pytest.raises(IndexError):
        ds.get(0, 2, 5)


@pytest.mark.parametrize(
    "vocab,dtype", [(100, np.uint8), (256, np.uint8), (257, np.uint16), (65536, np.uint16), (65537, np.uint32)]
)
def test_smallest_dtype(tmp_path, vocab, dtype):
    assert best_dtype(vocab) == dtype
    ds = IndexedDataset(write(tmp_path / "d", [[[0, vocab - 1]]], vocab))
    assert ds.dtype == dtype and ds[0].tolist() == [0, vocab - 1]
    assert os.path.getsize(tmp_path / "d.bin") == 2 * np.dtype(dtype).itemsize


def test_token_outside_the_vocabulary_is_refused(tmp_path):
    with IndexedDatasetWriter(str(tmp_path / "d"), 10) as w, pytest.raises(ValueError, match="outside the vocab"):
        w.add_document([np.array([3, 12], dtype=np.int64)])
    assert os.listdir(tmp_path) == []  # nothing published, temporary files removed


def test_unfinished_writer_leaves_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetWriter(str(tmp_path / "d"), 300) as w:
            w.add_document([np.arange(5)])
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_wrong_magic(tmp_path):
    p = write(tmp_path / "d")
    _patch(p + ".idx", 0, b"NOTMAGIC")
    with pytest.raises(ValueError, match=r"d\.idx: wrong magic"):
        IndexedDataset(p)


def test_bad_version(tmp_path):
    p = write(tmp_path / "d")
    _patch(p + ".idx", 8, struct.pack("<I", 7))
    with pytest.raises(ValueError, match=r"d\.idx: format version 7 is not supported"):
        IndexedDataset(p)


def test_bad_dtype_code(tmp_path):
    p = write(tmp_path / "d")
    _patch(p + ".idx", 12, struct.pack("<I", 3))
    with pytest.raises(ValueError, match="dtype code 3 is unknown"):
        IndexedDataset(p)


def test_truncated_bin(tmp_path):
    p = write(tmp_path / "d")
    os.truncate(p + ".bin", os.path.getsize(p + ".bin") - 2)
    with pytest.raises(ValueError, match=r"d\.bin: holds 18 bytes but .* describes 10 uint16 tokens"):
        IndexedDataset(p)


def test_truncated_idx(tmp_path):
    p = write(tmp_path / "d")
    os.truncate(p + ".idx", os.path.getsize(p + ".idx") - 8)
    with pytest.raises(ValueError, match=r"d\.idx: .* needs exactly .* \(truncated or corrupt\)"):
        IndexedDataset(p)
    os.truncate(p + ".idx", 10)
    with pytest.raises(ValueError, match="shorter than the 40-byte header"):
        IndexedDataset(p)


def test_corrupt_offsets(tmp_path):
    p = write(tmp_path / "d")
    _patch(p + ".idx", 40 + 4 * 4 + 8, struct.pack("<q", 99))  # the second sequence's offset
    with pytest.raises(ValueError, match="offsets are not the running sum"):
        IndexedDataset(p)


def test_bin_from_another_run(tmp_path):
    p = write(tmp_path / "d")
    write(tmp_path / "e", [[[1, 2]]])
    os.replace(tmp_path / "e.bin", p + ".bin")
    with pytest.raises(ValueError, match="truncated or from another run"):
        IndexedDataset(p)


def test_missing_file_names_it(tmp_path):
    p = write(tmp_path / "d")
    os.remove(p + ".bin")
    with pytest.raises(FileNotFoundError, match=r"d\.bin"):
        IndexedDataset(p)
