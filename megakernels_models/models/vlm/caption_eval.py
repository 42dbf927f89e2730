"""``megakernels eval --task caption``: how well a vision-language checkpoint captions held-out images, beside
what a model that cannot see the image can do.

    megakernels eval --load CKPT_DIR --task caption [--data PREFIX] [--samples 256]

Held-out images: the test split of ``--data`` (an image–text prefix), or by default the embedded shapes drawn with
the test split's seed (``--seed + 2000``; training draws ``--seed``), images the model never saw.

Scores, over the caption tokens (teacher forcing: the model reads the true caption up to each token):
- ``token_accuracy``: the share of caption tokens (and the closing EOD) that are the argmax;
- ``exact_match``: the share of captions whose every token is the argmax — exactly the captions greedy decoding
  reproduces;
- ``image_token_accuracy``: the token accuracy over the image-dependent tokens only — those the text before them
  does not determine (the training captions sharing that prefix go on differently, or none shares it). With a
  byte tokenizer most of a caption's tokens are spelling (``"a red c"`` determines ``"ircle"``), which puts a
  model that cannot see near 0.9 token accuracy; this score is the one about seeing.

Beside them, two text-only baselines:
- ``text_only``: the best any model that never sees the image can do, estimated from the training captions: at
  each position it predicts the training captions' most frequent next token after the same prefix (a prefix-tree
  majority vote over ``--baseline-captions`` training captions; an unseen prefix counts as wrong);
- ``mismatched_image``: the same model shown another sample's image (the images rolled by one within the batch),
  i.e. the checkpoint's own language model without the right visual evidence.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import torch


def _scores(correct: np.ndarray, mask: np.ndarray, image_dependent: np.ndarray) -> dict:
    """Token accuracy and exact match of boolean ``[n, s]`` predictions over the ``mask``ed positions, and the
    token accuracy over the ``image_dependent`` ones."""
    return {
        "token_accuracy": float((correct & mask).sum() / max(int(mask.sum()), 1)),
        "exact_match": float(((correct | ~mask).all(axis=1)).mean()) if len(mask) else 0.0,
        "image_token_accuracy": float((correct & image_dependent).sum() / max(int(image_dependent.sum()), 1)),
    }


@torch.no_grad()
def model_predictions(model, cfg, samples: list[dict], batch_size: int = 32, roll_images: bool = False) -> np.ndarray:
    """Argmax next-token ids ``[n, seq_length]`` of a ``VLMModel`` (tp = pp = 1) on captioning samples
    (``data.images.CaptionDataset`` items); ``roll_images`` shows each sample the next one's image."""
    from megakernels_models.data.datasets import collate

    device = next(model.parameters()).device
    out = []
    for i in range(0, len(samples), batch_size):
        batch = collate(samples[i : i + batch_size], device)
        images = batch["images"].roll(1, 0) if roll_images else batch["images"]
        logits = model(images=images, ids=batch["ids"])  # [s, b, V_pad]
        out.append(logits[..., : cfg.vocab_size].argmax(-1).t().cpu().numpy())
    return np.concatenate(out)


def text_only_predictions(train_samples: list[dict], samples: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """The prefix-majority text-only predictor (see the module docstring): ``[n, seq_length]`` ids (-1 where the
    prefix never occurs in ``train_samples``), and the bool ``[n, seq_length]`` mask of the image-dependent
    labelled positions (the prefix is unseen, or the training captions sharing it go on with different tokens)."""
    votes: dict[tuple, Counter] = defaultdict(Counter)
    for s in train_samples:
        ids, labels = s["ids"], s["labels"]
        for j in np.flatnonzero(labels != -100):
            votes[tuple(ids[: j + 1])][int(labels[j])] += 1
    shape = (len(samples), len(samples[0]["ids"])) if samples else (0, 0)
    out, open_ = np.full(shape, -1, dtype=np.int64), np.zeros(shape, dtype=bool)
    for n, s in enumerate(samples):
        for j in np.flatnonzero(s["labels"] != -100):
            c = votes.get(tuple(s["ids"][: j + 1]))
            open_[n, j] = not c or len(c) > 1
            if c:
                out[n, j] = c.most_common(1)[0][0]
    return out, open_


def caption_report(model, cfg, samples: list[dict], train_samples: list[dict]) -> dict:
    """``{"model": scores, "mismatched_image": scores, "text_only": scores, "samples": n, "image_tokens": k}``
    (scores: ``token_accuracy``, ``exact_match``, ``image_token_accuracy``; k: the image-dependent tokens scored)."""
    labels = np.stack([s["labels"] for s in samples])
    mask = labels != -100
    text_only, image_dependent = text_only_predictions(train_samples, samples)
    image_dependent &= mask
    return {
        "samples": len(samples),
        "image_tokens": int(image_dependent.sum()),
        "model": _scores(model_predictions(model, cfg, samples) == labels, mask, image_dependent),
        "mismatched_image": _scores(
            model_predictions(model, cfg, samples, roll_images=True) == labels, mask, image_dependent
        ),
        "text_only": _scores(text_only == labels, mask, image_dependent),
    }
