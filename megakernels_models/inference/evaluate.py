"""``megakernels eval``: perplexity of a text file and LAMBADA-style last-word accuracy, for a GPT checkpoint.

    megakernels eval --load CKPT_DIR --task ppl --data wiki.test.txt [--stride 512]
    megakernels eval --load CKPT_DIR --task lambada --data lambada_test.jsonl

The checkpoint may have been saved at any layout; evaluation runs in one process (tp = pp = 1).

- ``ppl`` (WikiText style): the whole file is one token stream, scored by windows of ``seq_length`` tokens that
  advance by ``stride``; every token is scored exactly once, with as much left context as the window gives it
  (a stride below seq_length means more context per token). Reported: the mean loss per token, the token-level
  perplexity ``exp(loss_sum / tokens)``, and, as the Megatron-LM paper reports WikiText-103, the perplexity
  normalised by the number of whitespace-separated words of the text, ``exp(loss_sum / words)`` (comparable
  across tokenizers).
- ``lambada``: a JSONL file of passages (``{"text": ...}``); the target is the passage's last word (after its last
  space), the context everything before. A passage counts as correct when, feeding the target's tokens with
  teacher forcing, the model's argmax is the right token at every position of the target — so a word of several
  tokens must be predicted whole. Context and target are tokenised separately (the target with its leading
  space), as the word boundary would otherwise depend on the tokenizer's merges.
"""

from __future__ import annotations

import json
import math
import sys

import torch
import torch.nn.functional as F


def _logits(model, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[b, s]`` ids -> ``[b, s, vocab]`` fp32 logits (padded vocabulary columns dropped)."""
    return model(ids).transpose(0, 1)[..., :vocab].float()


@torch.no_grad()
def perplexity(
    model, tokens: torch.Tensor, seq_length: int, vocab: int, stride: int | None = None, words: int | None = None
) -> dict:
    """Score every token of ``tokens`` (1-D) but the first once; see the module docstring.

    Raises:
        ValueError: fewer than 2 tokens, or a stride outside 1..seq_length.
    """
    stride = seq_length if stride is None else stride
    if not 1 <= stride <= seq_length:
        raise ValueError(f"stride must be in 1..seq_length={seq_length}, got {stride}")
    n = tokens.numel()
    if n < 2:
        raise ValueError("perplexity: the text has fewer than 2 tokens")
    loss_sum, scored, end_scored = 0.0, 0, 1  # targets [1, end_scored) are done
    start = 0
    while end_scored < n:
        window = tokens[start : start + seq_length + 1]
        logits = _logits(model, window[:-1].unsqueeze(0), vocab)[0]
        losses = F.cross_entropy(logits, window[1:], reduction="none")
        first_new = end_scored - (start + 1)  # index in `losses` of the first target not yet scored
        loss_sum += float(losses[first_new:].double().sum())
        scored += losses.numel() - first_new
        end_scored = start + window.numel()
        start += stride
    out = {"loss": loss_sum / scored, "tokens": scored, "ppl": math.exp(loss_sum / scored), "loss_sum": loss_sum}
    if words:
        out["words"] = words
        out["word_ppl"] = math.exp(loss_sum / words)
    return out


@torch.no_grad()
def lambada_accuracy(model, tokenizer, passages: list[str], seq_length: int, vocab: int) -> dict:
    """Exact last-word accuracy over ``passages`` (see the module docstring)."""
    correct = 0
    for text in passages:
        text = text.rstrip()
        cut = text.rfind(" ")
        if cut <= 0:
            raise ValueError(f"lambada: a passage without a last word after a space: {text[:60]!r}")
        context = torch.as_tensor(tokenizer.encode(text[:cut]), dtype=torch.long)
        target = torch.as_tensor(tokenizer.encode(text[cut:]), dtype=torch.long)
        ids = torch.cat([context, target])[-(seq_length + 1) :]
        logits = _logits(model, ids[:-1].unsqueeze(0), vocab)[0]
        guess = logits[-target.numel() :].argmax(-1)
        correct += bool(torch.equal(guess, ids[-target.numel() :]))
    return {"accuracy": correct / len(passages), "correct": correct, "passages": len(passages)}


def load_model(ckpt_dir: str, device: str = "cpu"):
    """(causal LM at tp = pp = 1 with the checkpoint's weights, its config); needs an initialised one-rank world."""
    from megakernels_models.inference.pretrained import load_chunk
    from megakernels_models.models.registry import titles

    return load_chunk(
        ckpt_dir,
        device,
        lambda spec: spec.causal,
        lambda cfg: (
            f"--load {ckpt_dir!r} holds a {cfg.model} model; eval scores causal language models "
            f"({titles(lambda s: s.causal)}; --task caption for those trained on captions)"
        ),
    )


def _tokenizer(spec: str):
    from megakernels_models.data.tokenizer import build_tokenizer

    return build_tokenizer(spec)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="perplexity (WikiText style) or LAMBADA accuracy of a GPT or Llama checkpoint; "
        "caption accuracy of a vision-language one",
    )
    p.add_argument("--load", required=True, metavar="DIR", help="a checkpoint (any layout)")
    p.add_argument("--task", required=True, choices=["ppl", "lambada", "caption"])
    p.add_argument(
        "--data",
        default=None,
        metavar="FILE",
        help="text file (ppl) or JSONL of passages (lambada); "
        "caption: an image-text PREFIX (default: the embedded shapes)",
    )
    p.add_argument("--samples", type=int, default=256, help="caption: held-out samples scored (default 256)")
    p.add_argument(
        "--baseline-captions",
        type=int,
        default=4096,
        help="caption: training captions the text-only baseline learns from (default 4096)",
    )
    p.add_argument(
        "--seed", type=int, default=1234, help="caption: the training run's --seed (held-out draws use another)"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="byte | hf:PATH | spm:PATH, the one the model was trained with "
        "(default: the checkpoint's tokenizer.json, else byte)",
    )
    p.add_argument("--stride", type=int, default=None, help="ppl window stride (default: seq_length)")
    p.add_argument("--json-key", default="text")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.set_defaults(_run=main)


def main(ns) -> int:
    from megakernels.parallel.launch import single_process_world
    from megakernels_models.training.checkpoint import CheckpointError

    if ns.task == "caption":
        return _caption(ns)
    if ns.data is None:
        print(f"megakernels eval: error: --task {ns.task} needs --data FILE", file=sys.stderr)
        return 2
    try:
        from megakernels_models.convert import checkpoint_tokenizer

        tok = _tokenizer(ns.tokenizer or checkpoint_tokenizer(ns.load) or "byte")
        with open(ns.data, encoding="utf-8") as f:
            raw = f.read()
    except (OSError, ValueError) as e:
        print(f"megakernels eval: error: {e}", file=sys.stderr)
        return 2
    try:
        with single_process_world(ns.device, parallel=True):
            model, cfg = load_model(ns.load, ns.device)
            if tok.vocab_size > cfg.vocab_size:
                raise ValueError(f"--tokenizer has {tok.vocab_size} ids, the model only {cfg.vocab_size}")
            if ns.task == "ppl":
                tokens = torch.as_tensor(tok.encode(raw), dtype=torch.long, device=ns.device)
                res = perplexity(model, tokens, cfg.seq_length, cfg.vocab_size, ns.stride, len(raw.split()))
                print(
                    f"ppl: {res['tokens']} tokens, loss {res['loss']:.4f}, token ppl {res['ppl']:.3f}, "
                    f"word ppl {res['word_ppl']:.3f} ({res['words']} words)"
                )
            else:
                passages = [json.loads(line)[ns.json_key] for line in raw.splitlines() if line.strip()]
                res = lambada_accuracy(model, tok, passages, cfg.seq_length, cfg.vocab_size)
                print(f"lambada: accuracy {res['accuracy']:.4f} ({res['correct']}/{res['passages']})")
    except (CheckpointError, ValueError, KeyError) as e:
        print(f"megakernels eval: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res))
    return 0


def _caption(ns) -> int:
    from megakernels.parallel.launch import single_process_world
    from megakernels_models.convert import checkpoint_tokenizer
    from megakernels_models.data.build import caption_datasets
    from megakernels_models.models.registry import family, titles
    from megakernels_models.models.vlm.caption_eval import caption_report
    from megakernels_models.training.checkpoint import CheckpointError

    try:
        if ns.samples < 1 or ns.baseline_captions < 1:
            raise ValueError("--samples and --baseline-captions must be >= 1")
        tok = _tokenizer(ns.tokenizer or checkpoint_tokenizer(ns.load) or "byte")
        with single_process_world(ns.device, parallel=True):
            model, cfg = load_model(ns.load, ns.device)
            if family(cfg).data != "captions":
                raise ValueError(
                    f"--task caption needs a checkpoint of a model trained on captions "
                    f"({titles(lambda s: s.data == 'captions')}); --load {ns.load} holds a {cfg.model} model"
                )
            train, _, test = caption_datasets(cfg, tok, ns.data, ns.seed)
            if test is None:
                raise ValueError(f"--data {ns.data}: the test split (949,50,1) is empty")
            samples = [test[i] for i in range(min(ns.samples, len(test)))]
            seen = [train[i] for i in range(min(ns.baseline_captions, len(train)))]
            res = caption_report(model, cfg, samples, seen)
    except (CheckpointError, OSError, ValueError, KeyError) as e:
        print(f"megakernels eval: error: {e}", file=sys.stderr)
        return 2
    for name in ("model", "mismatched_image", "text_only"):
        r = res[name]
        print(
            f"caption {name:>16}: token accuracy {r['token_accuracy']:.4f}, exact match {r['exact_match']:.4f}, "
            f"image-dependent token accuracy {r['image_token_accuracy']:.4f}"
        )
    print(json.dumps(res))
    return 0
