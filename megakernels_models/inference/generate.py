"""Text generation with a KV cache (``megakernels generate``, in ``pretrained.py``, calls it).

    megakernels generate --load ckpt --prompt "def fib(n):" --max-new-tokens 80 [--temperature 0.8 --top-k 40
                         --top-p 0.95 --seed 1]

The prompt runs through the model once, filling the cache (``megakernels.nn.KVCache``); then each new token costs
one token's forward. Sampling: ``temperature`` 0 is greedy (the arg-max); otherwise the logits are divided by the
temperature, cut to the ``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p``
(nucleus), and sampled with a generator seeded by ``seed``. Tokens stream to stdout as they are decoded. A model
with learned positions stops at its ``seq_length``; one with rotary embeddings can continue past it.
"""

from __future__ import annotations

import torch

from megakernels.nn.kv_cache import KVCache


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token of each row of ``logits`` ``[b, vocab]`` (see the module docstring); int64 ``[b]``."""
    if temperature == 0.0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the most likely is always kept)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    on_token=None,
) -> torch.Tensor:
    """Continue ``input_ids`` ``[b, s]`` by up to ``max_new_tokens`` tokens with ``model`` (a ``PretrainedLM``);
    returns ``[b, s + generated]``. ``on_token(ids [b])`` is called for each new token (streaming). Stops early
    when every row produced an end token (``eos_token_id``: one id or several, as Llama 3's instruction models
    have; a finished row is padded with the first), or at the model's ``seq_length`` with learned positions.

    Raises:
        ValueError: a bad ``temperature``, ``top_k``, ``top_p``, ``max_new_tokens``, or a prompt longer than a
            learned-position model's ``seq_length``.
    """
    if not temperature >= 0.0:
        raise ValueError(f"generate: temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"generate: top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"generate: top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    cfg = model.config
    limit = cfg.seq_length if cfg.position_embedding == "learned" else None
    if limit is not None and input_ids.shape[1] > limit:
        raise ValueError(
            f"generate: the prompt has {input_ids.shape[1]} tokens, more than the model's learned positions ({limit})"
        )
    generator = None if seed is None else torch.Generator(device=input_ids.device).manual_seed(seed)
    ends = None
    if eos_token_id is not None:
        ends = torch.as_tensor(
            [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=input_ids.device
        )
        if ends.numel() == 0:
            ends = None
    cache = KVCache()
    out = input_ids
    logits = model(input_ids, kv_cache=cache)[:, -1]
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        if limit is not None and out.shape[1] >= limit:
            break
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        if ends is not None:
            nxt = torch.where(done, ends[0].expand_as(nxt), nxt)
            done |= torch.isin(nxt, ends)
        out = torch.cat([out, nxt[:, None]], 1)
        if on_token is not None:
            on_token(nxt)
        if ends is not None and bool(done.all()):
            break
        logits = model(nxt[:, None], kv_cache=cache)[:, -1]
    return out
