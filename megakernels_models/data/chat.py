"""Chat conversations -> token ids with an assistant mask (``megakernels preprocess --chat``), for supervised
fine-tuning (``sft.SFTDataset``).

Input: JSONL files, one conversation a line: ``{"messages": [{"role": "system" | "user" | "assistant", "content":
"..."}, ...]}`` (other keys of the line or of a message are ignored). A conversation needs at least one assistant
message; a system message may only come first.

Rendering: with the checkpoint's own chat template, the ``chat_template`` of ``DIR/tokenizer_config.json`` (a
string, or a list of named templates of which ``default`` is taken) or the file ``DIR/chat_template.jinja`` (which
wins when both exist, as newer HuggingFace checkpoints store it there). The template runs in jinja2's immutable
sandbox the way HuggingFace ``transformers`` renders it: ``trim_blocks``, ``lstrip_blocks``, the loop controls,
``raise_exception(msg)``, ``strftime_now(fmt)``, a ``tojson`` that keeps non-ASCII text, the variables ``messages``,
``add_generation_prompt`` (False) and the special tokens of ``tokenizer_config.json`` (``bos_token``,
``eos_token``, ``pad_token``, ``unk_token``). The text is tokenised whole by ``DIR/tokenizer.json`` (no special
tokens added: the template writes them) and each token's character offsets map the assistant spans onto tokens.

The assistant span of a message (the characters whose tokens are training targets):

- when the template marks turns with ``{% generation %} ... {% endgeneration %}`` blocks, the blocks' text;
- otherwise, by prefixes: with ``P`` the rendering of the messages before it, ``G`` the same with
  ``add_generation_prompt=True`` (``P`` + the assistant header) and ``Q`` the rendering up to and including it, the
  span is ``Q[len(G):]``: the message's content and whatever the template writes after it for that turn (its
  end-of-turn token, e.g. Llama 3's ``<|eot_id|>``; ChatML's ``<|im_end|>`` and the newline after it). Where the
  template has no generation prompt (``G == P``), the span starts where the content (stripped) first appears in
  ``Q[len(P):]``. The template must be prefix-stable (each ``Q`` a prefix of the whole rendering), else the
  conversation is refused naming its line: a template that rewrites earlier turns needs generation blocks.

A token is a target when its first character is inside a span. Storage: ``PREFIX.bin``/``.idx`` hold the token
ids (one document a conversation, the tokenizer's vocabulary), ``PREFIX.mask.bin``/``.idx`` the mask (0/1, the
same lengths) in the same indexed format, and ``PREFIX.chat.json`` what was written (``format``, ``kind: "chat"``,
the counts, the tokenizer and template): its presence marks a chat dataset (written last, so a complete one).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
from collections.abc import Iterable, Iterator

import numpy as np

from megakernels_models.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter

ROLES = ("system", "user", "assistant")
META_FORMAT = 1
# Unicode noncharacters: never in interchange text, so they can bracket generation blocks in a rendering.
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"


def meta_path(prefix: str, kind: str = "chat") -> str:
    """``PREFIX.<kind>.json``: the description of a masked dataset of ``kind`` (chat; preference in
    ``data.preference``)."""
    return f"{prefix}.{kind}.json"


def mask_prefix(prefix: str) -> str:
    return prefix + ".mask"


def is_chat(prefix: str) -> bool:
    """Whether ``prefix`` is a chat dataset (its ``PREFIX.chat.json`` exists; see the module docstring)."""
    return os.path.isfile(meta_path(prefix))


# ---- the template ---------------------------------------------------------------------------------------------


def _token_text(value) -> str | None:
    """A special token of tokenizer_config.json: a string or a serialised AddedToken (``{"content": ...}``)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A checkpoint's chat template and the tokenizer of ``directory`` (see the module docstring).

    ``render(messages, add_generation_prompt=False)`` -> the text; ``encode(messages)`` -> ``(ids uint32, mask
    uint8)``; ``vocab_size``; ``source`` (the template text); ``origin`` (where it was read).

    Raises:
        FileNotFoundError: ``directory`` or its ``tokenizer.json`` is missing (named).
        ValueError: no chat template in the directory, an unreadable ``tokenizer_config.json``, a template jinja2
            cannot compile (each naming the directory or file).
    """

    def __init__(self, directory: str):
        from megakernels_models.data.tokenizer import HFTokenizer

        directory = directory[3:] if directory.startswith("hf:") else directory
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                f"--tokenizer {directory}: not a directory (give a HuggingFace tokenizer directory holding "
                "tokenizer.json and tokenizer_config.json with a chat_template)"
            )
        self.directory = directory
        config_path = os.path.join(directory, "tokenizer_config.json")
        config = {}
        if os.path.isfile(config_path):
            try:
                with open(config_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(f"{config_path}: not readable JSON ({e})") from None
            if not isinstance(config, dict):
                raise ValueError(f"{config_path}: not a JSON object")
        source, origin = None, None
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                source, origin = f.read(), jinja_path
        elif config.get("chat_template") is not None:
            source, origin = config["chat_template"], f"{config_path} chat_template"
            if isinstance(source, list):
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source, origin = named.get("default"), origin + " (the one named default)"
        if not isinstance(source, str) or not source.strip():
            raise ValueError(
                f"--tokenizer {directory}: no chat template (looked for chat_template in tokenizer_config.json "
                "and for chat_template.jinja); give the checkpoint's tokenizer directory, or add a template"
            )
        self.source, self.origin = source, origin
        self.variables = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = _token_text(config.get(name))
            if text is not None:
                self.variables[name] = text
        self._template = _compile(source, origin)
        self.tokenizer = HFTokenizer(directory)
        self.vocab_size = self.tokenizer.vocab_size
        self.digest = hashlib.sha1(source.encode()).hexdigest()[:16]

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (generation blocks unmarked)."""
        return self._render(messages, add_generation_prompt).replace(_OPEN, "").replace(_CLOSE, "")

    def _render(self, messages, add_generation_prompt):
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.variables)

    def spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]], str]:
        """``(text, assistant character spans, rule)`` of a conversation (module docstring); ``rule`` is
        ``"generation"`` or ``"prefix"``.

        Raises:
            ValueError: the template raised, is not prefix-stable, or an assistant message cannot be located.
        """
        text, spans, rule = self.message_spans(messages)
        return text, [(a, b) for _, a, b in spans], rule

    def message_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int | None, int, int]], str]:
        """``spans``, each span with the index of its assistant message in ``messages``: by prefixes, the message
        it was located for; with generation blocks, the k-th assistant message for the k-th block when there are
        as many blocks as assistant messages, else None (a block the template writes for something else).

        Raises:
            ValueError: as ``spans``.
        """
        marked = self._render(messages, False)
        if _OPEN in marked:
            text, blocks = _strip_marks(marked)
            owners = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            if len(owners) != len(blocks):
                owners = [None] * len(blocks)
            return text, [(i, a, b) for i, (a, b) in zip(owners, blocks)], "generation"
        text, spans = marked, []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render_prefix(messages[:i], False)
            prompt = self._render_prefix(messages[:i], True)
            upto = self.render(messages[: i + 1])
            for part, what in ((before, f"the first {i} messages"), (upto, f"the first {i + 1} messages")):
                if not text.startswith(part):
                    raise ValueError(
                        f"the chat template ({self.origin}) renders {what} as text that does not start the whole "
                        "conversation's rendering (not prefix-stable), so assistant turns cannot be located by "
                        "prefixes; mark them with {% generation %} blocks"
                    )
            if len(prompt) > len(before) and upto.startswith(prompt):
                start = len(prompt)
            else:
                at = upto.find(m["content"].strip(), len(before))
                if at < 0:
                    raise ValueError(
                        f"message {i} (assistant): its content does not appear in the chat template's rendering "
                        f"of it ({self.origin})"
                    )
                start = at
            if len(upto) > start:
                spans.append((i, start, len(upto)))
        return text, spans, "prefix"

    def _render_prefix(self, messages, add_generation_prompt):
        if not messages:
            try:
                return self.render([], add_generation_prompt)
            except Exception:  # a template that reads messages[0] cannot render no messages: nothing precedes
                return ""
        return self.render(messages, add_generation_prompt)

    def encode(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray, str]:
        """``(ids, mask, rule)``: the conversation's token ids, 1 on assistant targets (uint8), the span rule."""
        text, spans, rule = self.spans(messages)
        return (*self.tokens(text, spans), rule)

    def tokens(self, text: str, spans) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, mask)`` of ``text`` tokenised whole: a token is 1 in the mask when its first character is inside
        one of the character ``spans`` ``(start, end)``."""
        ids, offsets = self.tokenizer.encode_offsets(text)
        starts = offsets[:, 0] if len(offsets) else np.zeros(0, dtype=np.int64)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for a, b in spans:
            mask[(starts >= a) & (starts < b)] = 1
        return ids, mask


def _strip_marks(marked: str) -> tuple[str, list[tuple[int, int]]]:
    out, spans, at, depth, start = [], [], 0, 0, 0
    for ch in marked:
        if ch == _OPEN:
            if depth == 0:
                start = at
            depth += 1
        elif ch == _CLOSE:
            depth -= 1
            if depth == 0 and at > start:
                spans.append((start, at))
        else:
            out.append(ch)
            at += 1
    return "".join(out), spans


def _compile(source: str, origin: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: the block's text, bracketed by the marks ``spans`` reads."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark", []), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return _OPEN + caller() + _CLOSE

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"{origin}: the chat template does not compile (line {e.lineno}: {e.message})") from None


# ---- reading conversations -------------------------------------------------------------------------------------


def read_conversations(path: str) -> Iterator[tuple[int, list[dict]]]:
    """``(line number, messages)`` of each non-blank line of the JSONL file ``path`` (module docstring).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not a JSON object with a valid ``messages`` list (``path:line: rule``).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--chat {path}: no such file")
    with open(path, encoding="utf-8") as f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, 1):  # noqa: B007 (read in the except)
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not a JSON object ({e.msg} at column {e.colno})") from None
                yield lineno, check_messages(obj, f"{path}:{lineno}")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{lineno + 1}: not UTF-8 text ({e.reason})") from None


def check_messages(obj, where: str) -> list[dict]:
    """The ``messages`` of one conversation object, checked (``where`` prefixes the error)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with a messages list, got {type(obj).__name__}")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'{where}: no "messages" list (expected {{"messages": [{{"role": ..., "content": ...}}]}})')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: message {i} is not an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}: message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f'{where}: message {i} ({role}) has no string "content"')
        if _OPEN in content or _CLOSE in content:
            raise ValueError(f"{where}: message {i} holds the Unicode noncharacter U+FDD0 or U+FDD1")
        if role == "system" and i:
            raise ValueError(f"{where}: message {i} is a system message; only the first message may be one")
        if role == "assistant" and not content.strip():
            raise ValueError(f"{where}: message {i} (assistant) has empty content")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"{where}: no assistant message (nothing to train on)")
    return out


# ---- writing -----------------------------------------------------------------------------------------------------


def preprocess_chat(
    files: Iterable[str], output_prefix: str, tokenizer_dir: str, seq_length: int | None = None
) -> dict:
    """Write the chat dataset ``output_prefix`` (module docstring) from the JSONL ``files``.

    Returns ``conversations, tokens, target_tokens, rule, vocab_size, longest`` and, with ``seq_length``,
    ``packing`` (``sft.packing_stats`` of the conversations at that sequence length).

    Raises:
        FileNotFoundError: a missing input or tokenizer.
        ValueError: bad input (naming the file and line), no conversations, no template, a template error.
    """
    if os.path.isdir(output_prefix) or output_prefix.endswith(os.sep):
        raise ValueError(f"--output-prefix {output_prefix} is a folder; give a prefix (files PREFIX.bin/.idx)")
    files = list(files)
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--chat {path}: no such file")
    template = ChatTemplate(tokenizer_dir)
    rules, sizes, targets = set(), [], 0
    with masked_writer(output_prefix, template.vocab_size) as add:
        for path in files:
            for lineno, messages in read_conversations(path):
                try:
                    ids, mask, rule = template.encode(messages)
                except ValueError as e:
                    raise ValueError(f"{path}:{lineno}: {e}") from None
                except Exception as e:  # jinja2's errors, raise_exception in the template
                    raise ValueError(
                        f"{path}:{lineno}: the chat template ({template.origin}) failed: {type(e).__name__}: {e}"
                    ) from None
                if not mask.any():
                    raise ValueError(f"{path}:{lineno}: no token of an assistant message after tokenisation")
                add(ids, mask)
                rules.add(rule)
                sizes.append(len(ids))
                targets += int(mask.sum())
        if not sizes:
            raise ValueError(f"--chat {' '.join(files)}: no conversations")
    stats = {
        "conversations": len(sizes),
        "tokens": int(sum(sizes)),
        "target_tokens": targets,
        "longest": int(max(sizes)),
        "rule": "+".join(sorted(rules)),
        "vocab_size": template.vocab_size,
        "tokenizer": os.path.abspath(template.directory),
        "template": template.origin,
        "template_sha1": template.digest,
        "inputs": [os.path.abspath(p) for p in files],
    }
    stats = write_meta(output_prefix, "chat", stats)
    if seq_length is not None:
        from megakernels_models.data.sft import packing_stats

        stats["packing"] = packing_stats(np.asarray(sizes), seq_length)
    return stats


MASKED_KINDS = ("chat", "preference")


def forget_masked(prefix: str) -> None:
    """Remove ``prefix``'s masked-dataset descriptions (every kind): the data written there next is not that kind
    any more (removed before either pair of files changes, so a half-written prefix is never taken for one)."""
    for kind in MASKED_KINDS:
        if os.path.exists(meta_path(prefix, kind)):
            os.remove(meta_path(prefix, kind))


@contextlib.contextmanager
def masked_writer(output_prefix: str, vocab_size: int):
    """Write token sequences and their 0/1 masks as ``PREFIX.bin``/``.idx`` and ``PREFIX.mask.bin``/``.idx``:
    yields ``add(ids, mask)``; both pairs are committed when the block ends without an error (``write_meta``
    then marks the kind). The prefix stops being a masked dataset of any kind first (``forget_masked``).

    Raises:
        ValueError: ``output_prefix`` is a folder.
    """
    if os.path.isdir(output_prefix) or output_prefix.endswith(os.sep):
        raise ValueError(f"--output-prefix {output_prefix} is a folder; give a prefix (files PREFIX.bin/.idx)")
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    forget_masked(output_prefix)
    with (
        IndexedDatasetWriter(output_prefix, vocab_size) as tokens,
        IndexedDatasetWriter(mask_prefix(output_prefix), 2) as masks,
    ):

        def add(ids, mask) -> None:
            tokens.add_document([ids])
            masks.add_document([mask])

        yield add
        tokens.finish()
        masks.finish()


def write_meta(prefix: str, kind: str, stats: dict) -> dict:
    """Write ``PREFIX.<kind>.json`` (atomically: its presence marks a complete dataset of ``kind``) holding
    ``stats`` after ``format`` and ``kind``; returns what was written."""
    meta = {"format": META_FORMAT, "kind": kind, **stats}
    tmp = meta_path(prefix, kind) + f".tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, meta_path(prefix, kind))
    return meta


# ---- reading -----------------------------------------------------------------------------------------------------


class ChatIndexed:
    """A chat dataset (module docstring): ``tokens`` and ``mask`` (``IndexedDataset``s of equal document sizes),
    ``meta`` (``PREFIX.chat.json``), and the reading interface of ``IndexedDataset`` over the tokens (``len``,
    ``sizes``, ``get``, ``doc_count``, ``vocab_size``, ``prefix``) plus ``get_mask(doc)``. A subclass reads
    another masked kind by its ``KIND`` (the description ``PREFIX.<KIND>.json``) and ``MADE_BY`` (the command
    that writes it, for messages).

    Raises:
        FileNotFoundError: a file of the dataset missing (named).
        DataError: the metadata unreadable, or the mask not matching the tokens (named).
    """

    KIND, MADE_BY = "chat", "megakernels preprocess --chat"

    def __init__(self, prefix: str):
        self.prefix = prefix
        path = meta_path(prefix, self.KIND)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: not found, so {prefix} is not {self.KIND} data ({self.MADE_BY})")
        try:
            with open(path, encoding="utf-8") as f:
                self.meta = json.load(f)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: unreadable ({e})") from None
        if not isinstance(self.meta, dict) or self.meta.get("kind") != self.KIND:
            raise DataError(f"{path}: not a {self.KIND} dataset description")
        if self.meta.get("format") != META_FORMAT:
            raise DataError(f"{path}: format {self.meta.get('format')} (this reader reads {META_FORMAT})")
        self.tokens = IndexedDataset(prefix)
        self.mask = IndexedDataset(mask_prefix(prefix))
        if self.mask.doc_count != self.tokens.doc_count or not np.array_equal(self.mask.sizes, self.tokens.sizes):
            raise DataError(
                f"{self.mask.idx_path}: its {self.mask.doc_count} masks do not match the "
                f"{self.tokens.doc_count} sequences of {self.tokens.idx_path} in number or lengths "
                "(written by different runs)"
            )
        self.sizes, self.doc_offsets = self.tokens.sizes, self.tokens.doc_offsets
        self.doc_count, self.vocab_size = self.tokens.doc_count, self.tokens.vocab_size

    def __len__(self) -> int:
        return self.doc_count

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        return self.tokens.get(doc, offset, length)

    def get_mask(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        return self.mask.get(doc, offset, length)


# ---- a small tokenizer with a chat template (examples and tests) ------------------------------------------------

# A Llama 3-style template (a header per message, the content, <|eot_id|>), written for this project.
HEADER_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
HEADER_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                   "<|pad|>")  # fmt: skip


def write_small_tokenizer(
    directory: str,
    texts: Iterable[str],
    vocab_size: int = 512,
    template: str = HEADER_TEMPLATE,
    specials: tuple[str, ...] = HEADER_SPECIALS,
    bos_token: str | None = "<|begin_of_text|>",
    eos_token: str | None = "<|eot_id|>",
    pad_token: str | None = "<|pad|>",
) -> str:
    """Train a byte-level BPE of ``vocab_size`` ids (with ``specials``) on ``texts`` and write a HuggingFace
    tokenizer directory: ``tokenizer.json`` and ``tokenizer_config.json`` holding ``template`` as its
    ``chat_template`` and the bos/eos/pad tokens (None: left out). Returns ``directory``. Nothing is downloaded.

    Raises:
        ValueError: ``vocab_size`` too small for the byte alphabet and ``specials``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size {vocab_size} is less than 256 bytes + {len(specials)} special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
    for name, value in (("bos_token", bos_token), ("eos_token", eos_token), ("pad_token", pad_token)):
        if value is not None:
            config[name] = value
    config["chat_template"] = template
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    return directory


def conversation_texts(files: Iterable[str]) -> Iterator[str]:
    """Every message's content of the chat JSONL ``files`` (text to train a tokenizer on)."""
    for path in files:
        for _, messages in read_conversations(path):
            for m in messages:
                yield m["content"]
