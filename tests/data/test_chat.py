"""Chat conversations -> tokens + assistant mask: the rendering is transformers' own (``apply_chat_template``) for
the same template, the assistant mask is exactly each assistant message's content and end-of-turn (checked against
transformers' ``return_assistant_tokens_mask`` of the same template marked with generation blocks, and by decoding),
bad input and missing templates are errors naming the file and line or the directory, and the written dataset
reads back with its mask."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megakernels_models.cli import main
from megakernels_models.data import chat
from megakernels_models.data.indexed import DataError, IndexedDataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "data", "chat_small.jsonl")

# The header template again, with each assistant turn inside a generation block (transformers' assistant mask)
MARKED_HEADER = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")


def conversations() -> list[list[dict]]:
    return [m for _, m in chat.read_conversations(EXAMPLE)]


def texts():
    return chat.conversation_texts([EXAMPLE])


@pytest.fixture(scope="session")
def header_dir(tmp_path_factory) -> str:
    return chat.write_small_tokenizer(str(tmp_path_factory.mktemp("header")), texts(), 400)


@pytest.fixture(scope="session")
def marked_dir(tmp_path_factory) -> str:
    return chat.write_small_tokenizer(str(tmp_path_factory.mktemp("marked")), texts(), 400, MARKED_HEADER)


@pytest.fixture(scope="session")
def chatml_dir(tmp_path_factory) -> str:
    return chat.write_small_tokenizer(
        str(tmp_path_factory.mktemp("chatml")),
        texts(),
        400,
        CHATML,
        CHATML_SPECIALS,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
    )


def hf(directory):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(directory)


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The maximal runs of ones of ``mask`` as (start, stop)."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def test_example_file_is_varied():
    convs = conversations()
    assert 35 <= len(convs) <= 50
    assert sum(c[0]["role"] == "system" for c in convs) >= 5
    assert sum(sum(m["role"] == "assistant" for m in c) >= 2 for c in convs) >= 5


@pytest.mark.parametrize("which", ["header_dir", "marked_dir", "chatml_dir"])
def test_rendering_is_transformers_rendering(request, which):
    directory = request.getfixturevalue(which)
    ref, tpl = hf(directory), chat.ChatTemplate(directory)
    for messages in conversations():
        assert tpl.render(messages) == ref.apply_chat_template(messages, tokenize=False)
        text, _, _ = tpl.spans(messages)
        assert text == ref.apply_chat_template(messages, tokenize=False)
        head = messages[:1]
        assert tpl.render(head, True) == ref.apply_chat_template(head, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("which", ["header_dir", "marked_dir", "chatml_dir"])
def test_token_ids_are_transformers_tokens(request, which):
    directory = request.getfixturevalue(which)
    ref, tpl = hf(directory), chat.ChatTemplate(directory)
    for messages in conversations()[:15]:
        ids, mask, _ = tpl.encode(messages)
        want = ref.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert ids.tolist() == list(want) and len(mask) == len(ids)


def test_prefix_rule_mask_is_transformers_assistant_mask(header_dir, marked_dir):
    """The plain header template, spans found by prefixes, marks exactly the tokens that transformers marks for the
    same template with its assistant turns in generation blocks (the same text and tokenizer)."""
    ref = hf(marked_dir)
    plain, marked = chat.ChatTemplate(header_dir), chat.ChatTemplate(marked_dir)
    for messages in conversations():
        ids, mask, rule = plain.encode(messages)
        ids2, mask2, rule2 = marked.encode(messages)
        assert (rule, rule2) == ("prefix", "generation")
        out = ref.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist() == list(out["input_ids"]) == ids2.tolist()
        assert mask.tolist() == list(out["assistant_masks"]) == mask2.tolist()


def test_mask_is_the_assistant_contents_and_end_of_turn(header_dir):
    tpl = chat.ChatTemplate(header_dir)
    dec = tpl.tokenizer.decode
    for messages in conversations():
        ids, mask, _ = tpl.encode(messages)
        replies = [m["content"].strip() + "<|eot_id|>" for m in messages if m["role"] == "assistant"]
        assert [dec(ids[a:b]) for a, b in runs(mask)] == replies
        assert dec(ids) == tpl.render(messages)  # nothing lost: the whole conversation is there


def test_chatml_mask_includes_the_end_of_turn_and_its_newline(chatml_dir):
    tpl = chat.ChatTemplate(chatml_dir)
    for messages in conversations():
        ids, mask, rule = tpl.encode(messages)
        replies = [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
        assert rule == "prefix" and [tpl.tokenizer.decode(ids[a:b]) for a, b in runs(mask)] == replies


def test_template_without_generation_prompt_locates_the_content(tmp_path):
    no_prompt = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|eot_id|>' }}{% endfor %}"
    d = chat.write_small_tokenizer(str(tmp_path / "t"), texts(), 300, no_prompt)
    tpl = chat.ChatTemplate(d)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    ids, mask, _ = tpl.encode(messages)
    assert [tpl.tokenizer.decode(ids[a:b]) for a, b in runs(mask)] == ["Hello there<|eot_id|>"]


def test_template_in_chat_template_jinja_and_named_lists(tmp_path, header_dir):
    d = chat.write_small_tokenizer(str(tmp_path / "j"), texts(), 300, "ignored {{ messages }}")
    with open(os.path.join(d, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(chat.HEADER_TEMPLATE)
    messages = conversations()[0]
    assert chat.ChatTemplate(d).render(messages) == chat.ChatTemplate(header_dir).render(messages)
    cfg_path = os.path.join(d, "tokenizer_config.json")
    os.remove(os.path.join(d, "chat_template.jinja"))
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    assert chat.ChatTemplate(d).render(messages).startswith("<|im_start|>system\nYou are helpful.")


# ---- errors ------------------------------------------------------------------------------------------------------


def write_lines(path, lines) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"messages": [', "not a JSON object"),
        ("[1, 2]", "expected a JSON object"),
        ('{"text": "x"}', 'no "messages" list'),
        ('{"messages": []}', 'no "messages" list'),
        ('{"messages": [{"content": "x"}]}', "message 0 has role None"),
        ('{"messages": [{"role": "tool", "content": "x"}]}', "message 0 has role 'tool'"),
        ('{"messages": [{"role": "user"}]}', 'message 0 (user) has no string "content"'),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}', "only the first"),
        ('{"messages": [{"role": "user", "content": "a"}]}', "no assistant message"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]}', "empty content"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, header_dir, line, message):
    path = write_lines(tmp_path / "c.jsonl", [GOOD, "", line, GOOD])
    with pytest.raises(ValueError) as e:
        chat.preprocess_chat([path], str(tmp_path / "out"), header_dir)
    assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value)
    assert not os.path.exists(str(tmp_path / "out.bin")) and not chat.is_chat(str(tmp_path / "out"))


def test_missing_template_names_the_directory(tmp_path):
    d = chat.write_small_tokenizer(str(tmp_path / "t"), texts(), 300)
    cfg_path = os.path.join(d, "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    del cfg["chat_template"]
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=f"--tokenizer {d}: no chat template"):
        chat.ChatTemplate(d)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        chat.ChatTemplate(str(tmp_path / "nope"))
    os.remove(os.path.join(d, "tokenizer.json"))
    cfg["chat_template"] = "{{ messages }}"
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        chat.ChatTemplate(d)


def _with_template(tmp_path, template) -> str:
    return chat.write_small_tokenizer(str(tmp_path / "t"), texts(), 300, template)


def test_template_that_does_not_compile(tmp_path):
    with pytest.raises(ValueError, match="does not compile \\(line 1"):
        chat.ChatTemplate(_with_template(tmp_path, "{% for m in messages %}"))


def test_template_that_is_not_prefix_stable_is_refused(tmp_path):
    unstable = "{{ messages | length }}{% for m in messages %}{{ m['role'] + m['content'] }}{% endfor %}"
    path = write_lines(tmp_path / "c.jsonl", [GOOD])
    with pytest.raises(ValueError, match=f"{path}:1: .*not prefix-stable.*generation"):
        chat.preprocess_chat([path], str(tmp_path / "o"), _with_template(tmp_path, unstable))


def test_template_raise_exception_names_the_line(tmp_path):
    strict = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('needs a system message') }}{% endif %}"
    path = write_lines(tmp_path / "c.jsonl", [GOOD])
    with pytest.raises(ValueError, match=f"{path}:1: the chat template .* failed: .*needs a system message"):
        chat.preprocess_chat([path], str(tmp_path / "o"), _with_template(tmp_path, strict))


# ---- the dataset on disk and the command -------------------------------------------------------------------------


def test_preprocess_writes_tokens_mask_and_metadata(tmp_path, header_dir):
    prefix = str(tmp_path / "sft")
    stats = chat.preprocess_chat([EXAMPLE], prefix, header_dir, seq_length=256)
    tpl = chat.ChatTemplate(header_dir)
    convs = conversations()
    ds = chat.ChatIndexed(prefix)
    assert chat.is_chat(prefix) and stats["conversations"] == len(ds) == len(convs)
    assert ds.meta["target_tokens"] == stats["target_tokens"] and ds.meta["rule"] == "prefix"
    assert ds.vocab_size == 400 and ds.mask.vocab_size == 2 and ds.mask.dtype == np.uint8
    total = targets = 0
    for c, messages in enumerate(convs):
        ids, mask, _ = tpl.encode(messages)
        assert ds.get(c).tolist() == ids.tolist() and ds.get_mask(c).tolist() == mask.tolist()
        total, targets = total + len(ids), targets + int(mask.sum())
    assert (stats["tokens"], stats["target_tokens"]) == (total, targets)
    assert stats["packing"]["samples"] < len(convs) and 0 < stats["packing"]["efficiency"] <= 1


def test_mask_from_another_run_is_refused(tmp_path, header_dir):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    chat.preprocess_chat([EXAMPLE], a, header_dir)
    chat.preprocess_chat([write_lines(tmp_path / "c.jsonl", [GOOD])], b, header_dir)
    for ext in (".bin", ".idx"):
        os.replace(b + ".mask" + ext, a + ".mask" + ext)
    with pytest.raises(DataError, match="do not match"):
        chat.ChatIndexed(a)


def test_text_written_over_chat_data_is_not_chat_data(tmp_path, header_dir):
    from megakernels_models.data.preprocess import preprocess

    prefix = str(tmp_path / "d")
    chat.preprocess_chat([EXAMPLE], prefix, header_dir)
    write_lines(tmp_path / "t.txt", ["some text"])
    preprocess([str(tmp_path / "t.txt")], prefix)
    assert not chat.is_chat(prefix) and len(IndexedDataset(prefix)) == 1


def test_cli(tmp_path, header_dir, capsys):
    prefix = str(tmp_path / "out")
    rc = main(["preprocess", "--chat", EXAMPLE, "--tokenizer", header_dir, "--output", prefix, "--seq-length", "128"])
    out = capsys.readouterr().out
    assert rc == 0 and "42 conversations" in out and "assistant target tokens" in out and "efficiency" in out
    assert len(chat.ChatIndexed(prefix)) == 42
    bad = write_lines(tmp_path / "bad.jsonl", [GOOD, "{oops"])
    rc = main(["preprocess", "--chat", bad, "--tokenizer", f"hf:{header_dir}", "--output", str(tmp_path / "x")])
    assert rc == 2 and f"{bad}:2: not a JSON object" in capsys.readouterr().err
    rc = main(["preprocess", "--chat", EXAMPLE, "--output", str(tmp_path / "y")])
    assert rc == 2 and "--chat needs --tokenizer DIR" in capsys.readouterr().err
    rc = main(["preprocess", "--chat", str(tmp_path / "none.jsonl"), "--tokenizer", header_dir, "--output", prefix])
    assert rc == 2 and "none.jsonl: no such file" in capsys.readouterr().err
