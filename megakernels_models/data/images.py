"""Image–text data: the indexed format (``PREFIX.bin`` images, ``PREFIX.idx`` shapes and caption tokens), the
captioning dataset the trainer reads, and the conversion of a folder of images + a JSONL of captions.

``PREFIX.bin`` is every image's uint8 pixels (``H·W·C``, row-major, channels last) back to back, nothing else.
``PREFIX.idx`` (little-endian):

=======  ===========================================================================================
bytes    field
=======  ===========================================================================================
8        magic ``b"MKIMG\\x00\\x00\\x01"``
4        format version (uint32, 1)
4        caption dtype code (uint32: 1 uint8, 2 uint16, 4 uint32, as ``indexed``)
8        vocabulary size of the tokenizer that wrote it (uint64)
8        number of samples N (uint64)
8        caption tokens T in all (uint64)
12·N     image shapes ``(H, W, C)`` (int32)
8·N      image offsets in bytes from the start of ``.bin`` (int64)
16·N     caption spans ``(offset, length)`` in tokens into the token array below (int64)
T·d      the caption tokens (the dtype above)
=======  ===========================================================================================

The reader checks it all on open (and that ``.bin`` holds exactly the pixels described, and every caption token
is inside the recorded vocabulary), raising ``indexed.DataError`` naming the file and the broken rule. A captioning
sample (``CaptionDataset``) is the image and ``[EOD] caption [EOD]`` as next-token ids and labels of
``seq_length`` (padding labelled -100, never scored).
"""

from __future__ import annotations

import json
import os
import struct
import uuid

import numpy as np

from megakernels_models.data.datasets import Epochs
from megakernels_models.data.indexed import DTYPE_CODES, DTYPES, DataError, best_dtype, paths

MAGIC = b"MKIMG\x00\x00\x01"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQQ")


def is_image_text(prefix: str) -> bool:
    """Whether ``PREFIX.idx`` is an image–text index (its magic), False when missing or another format."""
    try:
        with open(paths(prefix)[1], "rb") as f:
            return f.read(8) == MAGIC
    except OSError:
        return False


def write_image_text(prefix: str, samples, vocab_size: int) -> int:
    """Write ``(uint8 [H, W, C] image, caption token ids)`` pairs as ``PREFIX.bin``/``.idx`` (temporary files,
    renamed when complete). Returns the number of samples.

    Raises:
        ValueError: an image that is not uint8 ``[H, W, C]``, or a token id outside ``0..vocab_size-1``.
    """
    dtype = best_dtype(vocab_size)
    tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = tuple(p + tag for p in paths(prefix))
    shapes, offsets, spans, tokens, at, n_tok = [], [], [], [], 0, 0
    try:
        with open(tmp[0], "wb") as binf:
            for img, caption in samples:
                img, caption = np.asarray(img), np.asarray(caption, dtype=np.int64).reshape(-1)
                if img.dtype != np.uint8 or img.ndim != 3:
                    raise ValueError(
                        f"write_image_text: sample {len(shapes)}: images must be uint8 [H, W, C], got "
                        f"{img.dtype} {img.shape}"
                    )
                if caption.size and (caption.min() < 0 or caption.max() >= vocab_size):
                    raise ValueError(f"write_image_text: sample {len(shapes)}: token ids outside 0..{vocab_size - 1}")
                binf.write(np.ascontiguousarray(img).tobytes())
                shapes.append(img.shape)
                offsets.append(at)
                spans.append((n_tok, caption.size))
                tokens.append(caption.astype(dtype))
                at, n_tok = at + img.size, n_tok + caption.size
        n = len(shapes)
        with open(tmp[1], "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, DTYPE_CODES[dtype], vocab_size, n, n_tok))
            f.write(np.asarray(shapes, dtype="<i4").reshape(n, 3).tobytes())
            f.write(np.asarray(offsets, dtype="<i8").tobytes())
            f.write(np.asarray(spans, dtype="<i8").reshape(n, 2).tobytes())
            f.write(
                (np.concatenate(tokens) if tokens else np.zeros(0, dtype)).astype(dtype.newbyteorder("<")).tobytes()
            )
        for t, final in zip(tmp, paths(prefix)):
            os.replace(t, final)
        return n
    finally:
        for t in tmp:
            if os.path.exists(t):
                os.remove(t)


class ImageTextIndexed:
    """Reads ``PREFIX.bin``/``.idx`` (see the module docstring): ``len``, ``sample(i) -> (uint8 [H, W, C],
    int64 caption ids)``, ``shapes`` ``[N, 3]``, ``vocab_size``.

    Raises:
        DataError: a file that is missing, truncated, of another format or inconsistent, or a caption token outside
            the vocabulary (naming it).
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        bin_path, idx_path = paths(prefix)
        for p in (bin_path, idx_path):
            if not os.path.isfile(p):
                raise DataError(f"{p}: no such file (make it with megakernels preprocess --images ...)")
        with open(idx_path, "rb") as f:
            raw = f.read()
        if len(raw) < _HEADER.size:
            raise DataError(f"{idx_path}: truncated header")
        magic, version, code, self.vocab_size, n, t = _HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise DataError(f"{idx_path}: not an image-text index (magic {magic!r})")
        if version != VERSION or code not in DTYPES:
            raise DataError(f"{idx_path}: unsupported version {version} or dtype code {code}")
        dtype = DTYPES[code].newbyteorder("<")
        want = _HEADER.size + 12 * n + 8 * n + 16 * n + t * dtype.itemsize
        if len(raw) != want:
            raise DataError(f"{idx_path}: {len(raw)} bytes, expected {want} for {n} samples and {t} tokens")
        at = _HEADER.size
        self.shapes = np.frombuffer(raw, "<i4", 3 * n, at).reshape(n, 3).astype(np.int64)
        self.offsets = np.frombuffer(raw, "<i8", n, at + 12 * n)
        self.spans = np.frombuffer(raw, "<i8", 2 * n, at + 20 * n).reshape(n, 2)
        self.tokens = np.frombuffer(raw, dtype, t, at + 36 * n)
        sizes = self.shapes.prod(axis=1)
        if n and (
            (self.shapes <= 0).any()
            or (self.offsets != np.concatenate([[0], np.cumsum(sizes)[:-1]])).any()
            or (self.spans < 0).any()
            or (self.spans[:, 1] > t - self.spans[:, 0]).any()
        ):
            raise DataError(f"{idx_path}: inconsistent shapes, offsets or caption spans")
        if os.path.getsize(bin_path) != int(sizes.sum()):
            raise DataError(
                f"{bin_path}: {os.path.getsize(bin_path)} bytes, but {idx_path} describes "
                f"{int(sizes.sum())} bytes of pixels"
            )
        self._bin = np.memmap(bin_path, np.uint8, "r") if sizes.sum() else np.zeros(0, np.uint8)
        if t and self.vocab_size < 1 << (8 * dtype.itemsize) and int(self.tokens.max()) >= self.vocab_size:
            at = int(np.argmax(self.tokens >= self.vocab_size))
            owner = np.flatnonzero((self.spans[:, 0] <= at) & (at < self.spans.sum(axis=1)))
            where = f"sample {owner[0]}'s caption" if len(owner) else "no caption"
            raise DataError(
                f"{idx_path}: token id {int(self.tokens[at])} at caption token {at} ({where}) is outside "
                f"the vocabulary 0..{self.vocab_size - 1} it records (corrupt, or written with another "
                "tokenizer)"
            )

    def __len__(self) -> int:
        return len(self.shapes)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        h, w, c = (int(x) for x in self.shapes[i])
        o = int(self.offsets[i])
        img = np.asarray(self._bin[o : o + h * w * c]).reshape(h, w, c)
        off, length = (int(x) for x in self.spans[i])
        return img, self.tokens[off : off + length].astype(np.int64)


class CaptionDataset:
    """Captioning samples over an image–text source (``ImageTextIndexed`` or ``shapes.ShapesSource``).

    Args:
        source: the samples; documents: the range of them to read (a split; default all).
        seq_length: text tokens per sample; the caption is cut to fit ``[EOD] caption [EOD]`` in ``seq_length + 1``.
        seed: the order (a permutation per epoch; an endless source is read in order, it is random already).
        eod, pad: the tokenizer's ids (``pad`` fills the ids after the caption; those labels are -100).

    ``dataset[i]`` -> ``{"images": uint8 [H, W, C], "ids": int64 [seq_length], "labels": int64 [seq_length]}``.
    """

    def __init__(self, source, seq_length: int, seed: int, eod: int, pad: int, *, documents: range | None = None):
        self.source, self.seq_length, self.eod, self.pad = source, int(seq_length), int(eod), int(pad)
        self.documents = range(len(source)) if documents is None else documents
        if not len(self.documents):
            raise ValueError("CaptionDataset: no samples in the split")
        self._order = None if source.prefix is None else Epochs(len(self.documents), seed)

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        j = self.documents[i % len(self.documents)] if self._order is None else self.documents[self._order(i)]
        img, caption = self.source.sample(j)
        s = self.seq_length
        window = np.full(s + 1, self.pad, dtype=np.int64)
        text = np.concatenate([[self.eod], caption[: s - 1], [self.eod]])
        window[: len(text)] = text
        labels = window[1:].copy()
        labels[len(text) - 1 :] = -100
        return {"images": img, "ids": window[:-1], "labels": labels}


def read_captioned_folder(
    images_dir: str,
    captions: str,
    tokenizer,
    image_size: int | None = None,
    image_key: str = "image",
    caption_key: str = "caption",
):
    """Yield ``(uint8 [H, W, 3] image, caption ids)`` for each line of the JSONL ``captions``
    (``{"image": "relative/path.png", "caption": "..."}``), the image decoded by Pillow (PNG, JPEG, ...), converted
    to RGB and, with ``image_size``, resized to ``image_size × image_size`` (bicubic).

    Raises:
        ValueError: a bad JSONL line, a missing key, a missing image or one Pillow cannot decode (naming the file).
        ImportError: Pillow is not installed (the ``train`` extra).
    """
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as e:
        raise ImportError("decoding images needs Pillow: pip install 'megakernels[train]'") from e
    with open(captions, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                name, caption = rec[image_key], rec[caption_key]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{captions}:{n}: expected a JSON object with {image_key!r} and {caption_key!r} ({e})"
                ) from None
            path = os.path.join(images_dir, name)
            if not os.path.isfile(path):
                raise ValueError(f"{captions}:{n}: image {path} does not exist")
            try:
                with Image.open(path) as im:
                    im = im.convert("RGB")
                    if image_size is not None and im.size != (image_size, image_size):
                        im = im.resize((image_size, image_size), Image.BICUBIC)
                    pixels = np.asarray(im, dtype=np.uint8)
            except (UnidentifiedImageError, OSError, SyntaxError) as e:
                raise ValueError(f"{captions}:{n}: image {path} cannot be decoded ({type(e).__name__}: {e})") from None
            yield pixels, np.asarray(tokenizer.encode(caption), dtype=np.int64)
