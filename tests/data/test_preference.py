"""Preference pairs -> chosen and rejected sequences with completion masks: conversational pairs tokenise and split
exactly as TRL's DPOTrainer does for the same template (transformers' ``apply_chat_template`` and TRL's
``common_prefix_length``), text pairs likewise with the end token appended; the packed samples hold each pair's two
sequences as separate documents whose labels are those of the sequence alone; bad input names the file and line."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from trl.data_utils import common_prefix_length

from megakernels_models.cli import main
from megakernels_models.data import chat, preference
from megakernels_models.data.sft import packed_sample

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "data", "chat_small.jsonl")


def conversational_pairs() -> list[dict]:
    """Pairs from the example conversations: the prompt is all but the last assistant reply, chosen that reply,
    rejected the last reply of the next conversation."""
    convs = [m for _, m in chat.read_conversations(EXAMPLE)]
    pairs = []
    for k, c in enumerate(convs):
        other = convs[(k + 1) % len(convs)]
        pairs.append({"prompt": c[:-1], "chosen": c[-1:], "rejected": other[-1:]})
    return pairs


TEXT_PAIRS = [
    {"prompt": "Q: 2 + 3 =", "chosen": " 5", "rejected": " 6"},
    {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Rome."},
    {"prompt": "Say hi:", "chosen": " hi", "rejected": " no thanks, not today"},
]


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="session")
def header_dir(tmp_path_factory) -> str:
    return chat.write_small_tokenizer(str(tmp_path_factory.mktemp("header")), chat.conversation_texts([EXAMPLE]), 400)


def trl_split(tok, prompt, completion):
    """TRL's DPOTrainer split of one sequence: its token ids and the index where the completion starts."""
    if isinstance(prompt, str):
        ids = tok(prompt + completion + tok.eos_token, add_special_tokens=False)["input_ids"]
        alone = tok(prompt, add_special_tokens=False)["input_ids"]
    else:
        ids = tok.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"]
        alone = tok.apply_chat_template(prompt, tokenize=True, return_dict=True, add_generation_prompt=True)[
            "input_ids"
        ]
    return list(ids), common_prefix_length(list(alone), list(ids))


@pytest.mark.parametrize("form", ["conversational", "text"])
def test_sequences_and_masks_are_trls(tmp_path, header_dir, form):
    import transformers

    pairs = conversational_pairs() if form == "conversational" else TEXT_PAIRS
    path = write_jsonl(tmp_path / "p.jsonl", pairs)
    prefix = str(tmp_path / "pref")
    stats = preference.preprocess_preference([path], prefix, header_dir, seq_length=256)
    tok = transformers.AutoTokenizer.from_pretrained(header_dir)
    ds = preference.PreferenceIndexed(prefix)
    assert preference.is_preference(prefix) and not chat.is_chat(prefix)
    assert ds.pairs == stats["pairs"] == len(pairs) and ds.meta["rule"] == ("prefix" if form != "text" else "text")
    tokens = targets = 0
    for k, p in enumerate(pairs):
        for doc, completion in ((2 * k, p["chosen"]), (2 * k + 1, p["rejected"])):
            ids, start = trl_split(tok, p["prompt"], completion)
            assert ds.get(doc).tolist() == ids
            assert ds.get_mask(doc).tolist() == [0] * start + [1] * (len(ids) - start)
            tokens, targets = tokens + len(ids), targets + len(ids) - max(start, 1)
        assert ds.pair_sizes[k].tolist() == [len(ds.get(2 * k)), len(ds.get(2 * k + 1))]
    assert (stats["tokens"], stats["completion_tokens"]) == (tokens, targets)
    assert 0 < stats["packing"]["efficiency"] <= 1


def test_text_pairs_with_the_byte_tokenizer(tmp_path):
    prefix = str(tmp_path / "b")
    preference.preprocess_preference([write_jsonl(tmp_path / "p.jsonl", TEXT_PAIRS)], prefix, "byte")
    ds = preference.PreferenceIndexed(prefix)
    p = TEXT_PAIRS[0]
    ids = list((p["prompt"] + p["rejected"]).encode()) + [256]  # the byte tokenizer's end of document
    assert ds.get(1).tolist() == ids
    assert ds.get_mask(1).tolist() == [0] * len(p["prompt"]) + [1] * (len(ids) - len(p["prompt"]))


def test_conversational_pairs_need_a_template(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", conversational_pairs()[:2])
    with pytest.raises(ValueError, match="rendered with a chat template: give --tokenizer DIR"):
        preference.preprocess_preference([path], str(tmp_path / "o"), "byte")


# ---- samples -------------------------------------------------------------------------------------------------------


def alone(ids, mask, seq_length):
    """The sample of one sequence by itself (SFT's packing of one piece)."""
    return packed_sample([(ids, mask)], seq_length, pad=0)


def test_packed_pairs_are_their_sequences_side_by_side():
    rng = np.random.default_rng(0)
    pairs = []
    for _ in range(9):
        pc = []
        for _ in range(2):
            n, p = int(rng.integers(3, 9)), int(rng.integers(1, 3))
            pc.append((rng.integers(1, 50, n), np.r_[np.zeros(p), np.ones(n - p)].astype(np.uint8)))
        pairs.append(pc)
    ds = preference.PreferenceDataset(preference.InMemoryPreference(pairs), seq_length=24, seed=3)
    seen = []
    for k in range(len(ds)):
        s = ds.sample(k)
        at = 0
        for j, p in enumerate(ds.pairs_of(k)):
            for side in range(2):
                ids, mask = pairs[p][side]
                n, m = len(ids), min(len(ids), 24 - at)  # the sample's last token is only a label
                one = alone(ids, mask, 24)
                assert (s["documents"][at : at + m] == 2 * j + side).all()
                assert s["ids"][at : at + m].tolist() == one["ids"][:m].tolist()
                assert s["positions"][at : at + m].tolist() == list(range(m))
                # labels as alone: the next sequence's first token is never the target of this one's last
                assert s["labels"][at : at + m].tolist() == one["labels"][:m].tolist()
                at += n
            seen.append(p)
        assert (s["labels"][at:] == -100).all() and (s["documents"][at:] == 2 * len(ds.pairs_of(k))).all()
        assert s["ids"].shape == (24,) and at <= 25
    assert sorted(seen) == list(range(9)) and ds.stats["samples"] < 9


def test_long_pairs_are_truncated_and_pairs_without_targets_dropped():
    ones = np.ones
    pairs = [
        [(np.arange(1, 12), np.r_[0, 0, ones(9)]), (np.arange(1, 6), np.r_[0, 0, ones(3)])],  # 16 > 11: cut
        [(np.arange(1, 10), np.r_[np.zeros(8), 1]), (np.arange(1, 4), np.r_[0, 1, 1])],  # chosen loses its target
        [(np.arange(1, 4), np.r_[0, 1, 1]), (np.arange(1, 4), np.r_[0, 0, 1])],
    ]
    with pytest.warns(UserWarning, match="1 longer .* truncated and 1 left without a completion token"):
        ds = preference.PreferenceDataset(preference.InMemoryPreference(pairs), seq_length=10, seed=0, packed=False)
    assert ds.stats["dropped"] == 1 and ds.stats["truncated"] == 1 and ds.stats["pairs"] == 2
    s = ds.pair_sample([0])
    assert s["documents"].tolist() == [0] * 6 + [1] * 4 and s["ids"][:6].tolist() == list(range(1, 7))


def test_seq_length_and_dataset_errors(tmp_path):
    with pytest.raises(ValueError, match="seq_length must be >= 3"):
        preference.PreferenceDataset(preference.InMemoryPreference([]), seq_length=2, seed=0)
    with pytest.raises(FileNotFoundError, match="not preference data"):
        preference.PreferenceIndexed(str(tmp_path / "none"))


# ---- bad input and the command -------------------------------------------------------------------------------------

GOOD = json.dumps(TEXT_PAIRS[0])


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "a", ', "not a JSON object"),
        ('{"prompt": "a", "chosen": "b"}', 'expected {"prompt": ..., "chosen": ..., "rejected": ...}'),
        ('{"prompt": "a", "chosen": "b", "rejected": []}', "three strings or three lists of messages"),
        ('{"prompt": "a", "chosen": " ", "rejected": "c"}', "chosen is empty"),
        (
            json.dumps({"prompt": [{"role": "user", "content": "q"}], "chosen": [], "rejected": []}),
            "chosen has no assistant message",
        ),
        (
            json.dumps(
                {
                    "prompt": [{"role": "user", "content": "q"}],
                    "chosen": [{"role": "assistant", "content": "a"}],
                    "rejected": [{"role": "robot", "content": "b"}],
                }
            ),
            "rejected has no assistant message",
        ),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, header_dir, line, message):
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD, "", line, GOOD])
    with pytest.raises(ValueError) as e:
        preference.preprocess_preference([path], str(tmp_path / "out"), header_dir)
    assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value)
    assert not preference.is_preference(str(tmp_path / "out"))


def test_cli(tmp_path, header_dir, capsys):
    path = write_jsonl(tmp_path / "p.jsonl", conversational_pairs())
    prefix = str(tmp_path / "out")
    rc = main(
        ["preprocess", "--preference", path, "--tokenizer", header_dir, "--output", prefix, "--seq-length", "256"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "42 pairs" in out and "completion tokens" in out and "efficiency" in out
    assert preference.PreferenceIndexed(prefix).pairs == 42
    rc = main(["preprocess", "--preference", path, "--chat", EXAMPLE, "--tokenizer", header_dir, "--output", prefix])
    assert rc == 2 and "not both" in capsys.readouterr().err
    rc = main(["preprocess", "--preference", path, "--output", str(tmp_path / "y")])
    assert rc == 2 and "give --tokenizer DIR" in capsys.readouterr().err
    rc = main(
        ["preprocess", "--preference", str(tmp_path / "none.jsonl"), "--tokenizer", header_dir, "--output", prefix]
    )
    assert rc == 2 and "none.jsonl: no such file" in capsys.readouterr().err
    rc = main(["preprocess", "--preference", path, "--tokenizer", header_dir, "--output", prefix, "--seq-length", "2"])
    assert rc == 2 and "--seq-length must be >= 3" in capsys.readouterr().err
