"""Token ids are checked against the vocabulary when a dataset is opened: an id past it is a DataError naming the
file, the id, its token offset and document (it trained silently or ended in an IndexError traceback before); the
scan is cached beside the data, keyed by the .bin's size and modification time; every dataset kind built by the
trainer (GPT, BERT, blends, image-text captions) is refused in one line."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megakernels_models.cli import main
from megakernels_models.data import indexed
from megakernels_models.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter

VOCAB = 261  # the byte tokenizer's


def write(prefix, n_docs=20, length=100, vocab=VOCAB) -> str:
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(str(prefix), vocab) as w:
        for _ in range(n_docs):
            w.add_document([rng.integers(0, min(vocab, 256), length)])
        w.finish()
    return str(prefix)


def poke(prefix: str, offset: int, token: int, keep_mtime: bool = False) -> None:
    """Write ``token`` at token ``offset`` of ``PREFIX.bin`` (uint16), optionally keeping the file's mtime."""
    path = prefix + ".bin"
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(2 * offset)
        f.write(np.uint16(token).tobytes())
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:  # a later mtime however coarse the file system's clock
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))


def test_an_id_past_the_vocabulary_is_refused_naming_the_file_id_offset_and_document(tmp_path):
    prefix = write(tmp_path / "d")
    poke(prefix, 1234, 9000)
    with pytest.raises(DataError) as e:
        IndexedDataset(prefix)
    assert str(e.value) == (
        f"{prefix}.bin: token id 9000 at token 1234 (document 12) is outside the vocabulary "
        f"0..260 that {prefix}.idx records (corrupt, or written with another tokenizer)"
    )


def test_the_scan_is_cached_beside_the_data_keyed_by_size_and_mtime(tmp_path):
    prefix = write(tmp_path / "d")
    ds = IndexedDataset(prefix)
    cache = json.loads((tmp_path / "d.maxid.json").read_text())
    st = os.stat(prefix + ".bin")
    top = int(np.asarray(ds.tokens(0, ds.num_tokens)).max())
    assert cache == {
        "format": 1,
        "bin_size": st.st_size,
        "bin_mtime_ns": st.st_mtime_ns,
        "bin_inode": st.st_ino,
        "max_id": top,
        "offset": int(np.argmax(np.asarray(ds.tokens(0, ds.num_tokens)))),
    }
    poke(prefix, 5, 300, keep_mtime=True)
    IndexedDataset(prefix)  # same size and mtime: the cached scan is trusted
    poke(prefix, 5, 300)
    with pytest.raises(DataError, match=r"token id 300 at token 5 \(document 0\)"):
        IndexedDataset(prefix)


def test_an_unwritable_folder_or_a_garbage_cache_only_means_another_scan(tmp_path, monkeypatch):
    prefix = write(tmp_path / "d")
    (tmp_path / "d.maxid.json").write_text("{not json")
    IndexedDataset(prefix)
    assert json.loads((tmp_path / "d.maxid.json").read_text())["max_id"] < VOCAB

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", dst)

    os.remove(tmp_path / "d.maxid.json")
    monkeypatch.setattr(indexed.os, "replace", refuse)
    IndexedDataset(prefix)
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]  # nothing cached, no temporary file left


def test_a_dtype_that_cannot_hold_a_bad_id_needs_no_scan(tmp_path):
    IndexedDataset(write(tmp_path / "d", vocab=256))
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]


def test_an_index_with_an_empty_document_reads_it_as_empty(tmp_path):
    prefix = write(tmp_path / "d", n_docs=1, length=5)
    with open(prefix + ".idx", "r+b") as f:  # one more document, of no sequences, at the end
        head = bytearray(f.read(indexed._HEADER.size))
        body = f.read()
    magic, version, code, vocab, n_seq, n_doc = indexed._HEADER.unpack(bytes(head))
    with open(prefix + ".idx", "wb") as f:
        f.write(indexed._HEADER.pack(magic, version, code, vocab, n_seq, n_doc + 1) + body + np.int64(n_seq).tobytes())
    ds = IndexedDataset(prefix)
    assert len(ds) == 2 and len(ds[0]) == 5 and len(ds[1]) == 0


TRAIN = ["--no-progress", "--eval-interval", "0", "--steps", "1"]


def _refused(argv, capsys) -> str:
    assert main(["train", *argv, *TRAIN]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("model", ["gpt", "bert", "llama"])
def test_training_on_ids_past_the_vocabulary_is_refused_in_one_line(tmp_path, capsys, model):
    prefix = write(tmp_path / "d")
    poke(prefix, 7, 4000)
    err = _refused(["--model", model, "--data", prefix], capsys)
    assert f"--data {prefix}: {prefix}.bin: token id 4000 at token 7 (document 0) is outside the vocabulary" in err


def test_a_blend_names_its_bad_component(tmp_path, capsys):
    good, bad = write(tmp_path / "good"), write(tmp_path / "bad")
    poke(bad, 1999, 261)
    err = _refused(["--data", f"1,{good},1,{bad}"], capsys)
    assert f"{bad}.bin: token id 261 at token 1999 (document 19)" in err and f"{good}.bin" not in err


def test_an_image_text_caption_past_the_vocabulary_is_refused(tmp_path):
    from megakernels_models.data.images import ImageTextIndexed, write_image_text

    prefix = str(tmp_path / "d")
    write_image_text(prefix, [(np.zeros((4, 4, 3), np.uint8), np.arange(3))] * 2, VOCAB)
    with open(prefix + ".idx", "r+b") as f:  # the captions are the index's last 6 uint16 tokens
        f.seek(-2, os.SEEK_END)
        f.write(np.uint16(5000).tobytes())
    with pytest.raises(
        DataError,
        match=rf"{prefix}\.idx: token id 5000 at caption token 5 \(sample 1's caption\) is "
        r"outside the vocabulary 0\.\.260",
    ):
        ImageTextIndexed(prefix)
