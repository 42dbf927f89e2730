"""``megakernels preprocess``: text, JSONL and gzipped inputs through byte, HuggingFace and SentencePiece
tokenizers on one or two workers give exactly the ids of tokenising each document directly with the library."""

from __future__ import annotations

import gzip
import json
import os
import re

import numpy as np
import pytest

from megakernels_models.cli import main
from megakernels_models.data.indexed import IndexedDataset
from megakernels_models.data.preprocess import preprocess
from tests.data.conftest import write_inputs


def reference_ids(kind: str, path: str | None, text: str) -> list[int]:
    """Ids of ``text`` from the tokenizer library itself (not through megakernels)."""
    if kind == "byte":
        return list(text.encode("utf-8"))
    if kind == "hf":
        from tokenizers import Tokenizer

        return Tokenizer.from_file(path).encode(text, add_special_tokens=False).ids
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=path).encode(text)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("fmt", ["txt", "jsonl", "gz"])
@pytest.mark.parametrize("kind", ["byte", "hf", "spm"])
def test_round_trip_equals_direct_tokenisation(tmp_path, documents, hf_path, spm_path, kind, fmt, workers):
    path = {"byte": None, "hf": hf_path, "spm": spm_path}[kind]
    spec = "byte" if kind == "byte" else f"{kind}:{path}"
    write_inputs(tmp_path / "in", documents, fmt)
    stats = preprocess([str(tmp_path / "in")], str(tmp_path / "out" / "d"), spec, workers=workers)
    ds = IndexedDataset(str(tmp_path / "out" / "d"))
    assert len(ds) == stats["documents"] == len(documents)
    for i, text in enumerate(documents):
        assert ds[i].tolist() == reference_ids(kind, path, text), (kind, fmt, i)
    assert ds.dtype == {"byte": np.uint16, "hf": np.uint16, "spm": np.uint8}[kind]  # spm: 120 ids fit a byte


def test_append_eod_and_split_sentences(tmp_path, documents, hf_path):
    write_inputs(tmp_path / "in", documents[:3], "txt")
    preprocess([str(tmp_path / "in")], str(tmp_path / "d"), f"hf:{hf_path}", append_eod=True, split_sentences=True)
    ds = IndexedDataset(str(tmp_path / "d"))
    eod = reference_ids("hf", hf_path, "<|endoftext|>")[0]
    for i, text in enumerate(documents[:3]):
        lines = text.splitlines(keepends=True)
        sentences = [s.tolist() for s in ds.sentences(i)]
        assert sentences == [reference_ids("hf", hf_path, x) for x in lines[:-1]] + [
            reference_ids("hf", hf_path, lines[-1]) + [eod]
        ]


def test_folders_are_walked_in_sorted_order(tmp_path):
    for name, text in [
        ("b/2.txt", "two"),
        ("a/1.txt", "one"),
        ("b/10.txt", "ten"),
        ("c.txt", "three"),
        (".hidden.txt", "no"),
    ]:
        os.makedirs(os.path.dirname(tmp_path / "in" / name), exist_ok=True)
        (tmp_path / "in" / name).write_text(text)
    preprocess([str(tmp_path / "in")], str(tmp_path / "d"), workers=1)
    ds = IndexedDataset(str(tmp_path / "d"))
    assert [bytes(ds[i].astype(np.uint8)).decode() for i in range(len(ds))] == ["one", "ten", "two", "three"]


def test_binary_files_in_folders_are_skipped(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.py").write_text("print(1)\n")
    (tmp_path / "in" / "a.so").write_bytes(b"\x7fELF\xff\xfe")
    assert (
        main(
            [
                "preprocess",
                "--input",
                str(tmp_path / "in"),
                "--output-prefix",
                str(tmp_path / "d"),
                "--no-progress",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "1 documents" in out and "skipped 1 files that are not UTF-8 text" in out
    assert len(IndexedDataset(str(tmp_path / "d"))) == 1


def test_cli_returns_0_and_writes_the_pair(tmp_path, documents, capsys):
    write_inputs(tmp_path / "in", documents, "jsonl")
    rc = main(
        [
            "preprocess",
            "--input",
            str(tmp_path / "in"),
            "--output-prefix",
            str(tmp_path / "d"),
            "--append-eod",
            "--workers",
            "2",
            "--no-progress",
        ]
    )
    assert rc == 0
    assert "12 documents" in capsys.readouterr().out
    ds = IndexedDataset(str(tmp_path / "d"))
    assert ds[0].tolist() == list(documents[0].encode()) + [256]
    # no temporary files left; opening the pair cached its vocabulary scan beside it
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx", "d.maxid.json", "in"]


@pytest.mark.parametrize(
    "case,content,message",
    [
        ("missing", None, "--input .*nope: no such file or folder"),
        ("bad-json", "{not json}\n", r"bad\.jsonl:1: not a JSON object per line"),
        ("no-key", '{"body": "x"}\n', r"bad\.jsonl:1: no string field 'text' \(--json-key text\)"),
        ("not-utf8", b"\xff\xfe bytes", r"bad\.txt: not UTF-8 text"),
        ("empty", "", "no non-empty documents"),
        ("bad-gzip", b"not gzip", r"bad\.txt\.gz: not a valid gzip file"),
    ],
)
def test_cli_bad_input_returns_2(tmp_path, capsys, case, content, message):
    name = {"bad-json": "bad.jsonl", "no-key": "bad.jsonl", "bad-gzip": "bad.txt.gz"}.get(case, "bad.txt")
    path = tmp_path / ("nope" if case == "missing" else name)
    if content is not None:
        (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    rc = main(
        [
            "preprocess",
            "--input",
            str(path),
            "--output-prefix",
            str(tmp_path / "out" / "d"),
            "--workers",
            "1",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("megakernels preprocess: error: "), err
    assert re.search(message, err), err
    assert not (tmp_path / "out" / "d.idx").exists() and not (tmp_path / "out" / "d.bin").exists()


def test_cli_bad_tokenizer_returns_2(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("x")
    rc = main(
        [
            "preprocess",
            "--input",
            str(tmp_path / "a.txt"),
            "--output-prefix",
            str(tmp_path / "d"),
            "--tokenizer",
            "hf:/no/such.json",
        ]
    )
    assert rc == 2 and "/no/such.json" in capsys.readouterr().err


def test_a_failed_run_keeps_no_half_written_output(tmp_path, documents):
    """An error midway (a bad file after good ones) leaves the previous pair, untouched and valid."""
    write_inputs(tmp_path / "in", documents, "txt")
    preprocess([str(tmp_path / "in")], str(tmp_path / "d"))
    before = IndexedDataset(str(tmp_path / "d"))[0].tolist()
    (tmp_path / "in" / "zzz.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"zzz\.jsonl:2: no string field 'text'"):
        preprocess([str(tmp_path / "in")], str(tmp_path / "d"), workers=2)
    assert IndexedDataset(str(tmp_path / "d"))[0].tolist() == before
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx", "d.maxid.json", "in"]


def test_train_tokenizer(tmp_path, documents, capsys):
    from tokenizers import Tokenizer

    with gzip.open(tmp_path / "docs.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"content": d}) + "\n" for d in documents)
    rc = main(
        [
            "preprocess",
            "--input",
            str(tmp_path / "docs.jsonl.gz"),
            "--output-prefix",
            str(tmp_path / "d"),
            "--json-key",
            "content",
            "--train-tokenizer",
            "320",
            "--append-eod",
            "--workers",
            "2",
            "--no-progress",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    ref = Tokenizer.from_file(str(tmp_path / "d.tokenizer.json"))
    assert ref.get_vocab_size() == 320
    eod = ref.token_to_id("<|endoftext|>")
    ds = IndexedDataset(str(tmp_path / "d"))
    assert ds.vocab_size == 320
    for i, text in enumerate(documents):
        assert ds[i].tolist() == ref.encode(text, add_special_tokens=False).ids + [eod]
    assert (
        main(
            [
                "preprocess",
                "--input",
                str(tmp_path / "docs.jsonl.gz"),
                "--output-prefix",
                str(tmp_path / "e"),
                "--train-tokenizer",
                "100",
            ]
        )
        == 2
    )
    assert "needs at least 261 ids" in capsys.readouterr().err


def test_reading_stays_a_few_chunks_ahead_of_writing():
    """The input is not read ahead into memory: with 2 workers at most 2·2 chunks wait beyond the one being written
    (and the one being cut), at every document the stream hands out. Reading a document is far cheaper than
    tokenising it on a worker, so a reader without the bound runs ahead at once."""
    from megakernels_models.data import preprocess as pp

    read = []

    def docs():
        for i in range(100 * pp.CHUNK_DOCUMENTS):
            read.append(i)
            yield f"document {i}"

    written, most_ahead = 0, 0
    for seqs in pp.tokenize_documents(docs(), "byte", workers=2):
        if written == 0:
            assert bytes(seqs[0].astype(np.uint8)) == b"document 0"
        chunk = written // pp.CHUNK_DOCUMENTS  # the chunk this document came from
        most_ahead = max(most_ahead, len(read) - (chunk + 1) * pp.CHUNK_DOCUMENTS)
        written += 1
    assert written == len(read) == 100 * pp.CHUNK_DOCUMENTS
    assert 0 < most_ahead <= (2 * 2 + 1) * pp.CHUNK_DOCUMENTS
